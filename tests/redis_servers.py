"""Real Redis servers for the tests: private redis-server processes and a local Redis Cluster.

Fault tests start a server on a port of their own, so that stopping, pausing or
restarting it cannot disturb anything else. The cluster is made of redis-server
processes on loopback ports in a temporary directory, joined by ``redis-cli --cluster
create``. Nothing here is mocked.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import redis
import redis.asyncio.connection
import redis.asyncio.sentinel
import redis.connection
import redis.sentinel

#: Socket connections attempted by this process, by port (CountingConnection, AsyncCountingConnection).
CONNECTS: Counter[int] = Counter()


class CountingConnection(redis.connection.Connection):
    """redis-py's connection, counting each socket it tries to open in ``CONNECTS`` (by port)."""

    def _connect(self):
        CONNECTS[int(self.port)] += 1
        return super()._connect()


class AsyncCountingConnection(redis.asyncio.connection.Connection):
    """The asyncio twin of ``CountingConnection``."""

    async def _connect(self):
        CONNECTS[int(self.port)] += 1
        return await super()._connect()


class CountingSentinelConnection(redis.sentinel.SentinelManagedConnection):
    """Sentinel's managed connection, counting in ``CONNECTS`` (by the master's port it tries)."""

    def _connect(self):
        CONNECTS[int(self.port)] += 1
        return super()._connect()


class AsyncCountingSentinelConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    """The asyncio twin of ``CountingSentinelConnection``."""

    async def _connect(self):
        CONNECTS[int(self.port)] += 1
        return await super()._connect()


def delete_keys(alias: str = "redis") -> int:
    """Delete this test process's keys (those under its KEY_PREFIX) from the cache ``alias``."""
    from django.core.cache import caches
    from django_redis import get_redis_connection

    prefix = caches[alias].key_prefix
    client = get_redis_connection(alias)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    for start in range(0, len(keys), 500):
        client.unlink(*keys[start : start + 500])
    return len(keys)


#: Keys another user of the Redis database holds (django-redis' ``default`` cache: page
#: caches, sessions) beside the buckets, for the listings' tests.
OTHER_KEYS = 100_000


@contextmanager
def other_keys(client, count: int = OTHER_KEYS):
    """Write ``count`` keys that no limit owns (a cache's, under a prefix of this process),
    pipelined; delete them after. They expire in an hour should the deletion not run."""
    names = [f"tbtest-other-{os.getpid()}:1:views.decorators.cache.cache_page.{i:06d}" for i in range(count)]
    try:
        for start in range(0, count, 5000):
            pipe = client.pipeline(transaction=False)
            for name in names[start : start + 5000]:
                pipe.set(name, b"<html>cached</html>", ex=3600)
            pipe.execute()
        yield names
    finally:
        for start in range(0, count, 5000):
            # One key a command: a cluster refuses an UNLINK over several slots.
            pipe = client.pipeline(transaction=False)
            for name in names[start : start + 5000]:
                pipe.unlink(name)
            pipe.execute()


def keys_without_ttl(client, pattern: str) -> tuple[int, int]:
    """Return (keys matching ``pattern``, those of them without a TTL), by SCAN and PTTL."""
    total = immortal = 0
    for key in client.scan_iter(match=pattern, count=1000):
        ttl = client.pttl(key)
        if ttl == -2:  # expired between SCAN and PTTL
            continue
        total += 1
        immortal += ttl == -1
    return total, immortal


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """Return a loopback port that is free, and whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(21000, 29999)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


class RedisServer:
    """One redis-server process that this test owns: start, stop, pause, restart."""

    def __init__(self, *args: str, port: int | None = None, directory: str | None = None) -> None:
        self.port = port or free_port()
        self.args = list(args)
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="tb-redis-")
        self.directory = directory or self._tmp.name
        self.process: subprocess.Popen | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)

    def start(self) -> RedisServer:
        command = [
            "redis-server",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.directory,
            "--logfile", str(Path(self.directory) / f"redis-{self.port}.log"),
            *self.args,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not self._answers():
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode() if self.process.stderr else ""
                self.process = None
                raise RuntimeError(f"redis-server on port {self.port} did not start: {error}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer within 10 s")
            time.sleep(0.02)
        return self

    def _answers(self) -> bool:
        """Whether the server answers PING at all (-NOAUTH and -LOADING count: it is up)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith((b"+PONG", b"-NOAUTH", b"-LOADING"))
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        if self.paused:
            self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections are accepted by the kernel, nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)
        self.paused = False

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()


class LocalCluster:
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each, on loopback ports."""

    def __init__(self, masters: int = 3, replicas: int = 1) -> None:
        self.masters = masters
        self.replicas = replicas
        self._tmp = tempfile.TemporaryDirectory(prefix="tb-redis-cluster-")
        self.servers: list[RedisServer] = []

    @property
    def url(self) -> str:
        return self.servers[0].url

    def start(self) -> LocalCluster:
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                port = free_port()
                node_dir = Path(self._tmp.name) / str(port)
                node_dir.mkdir()
                server = RedisServer(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000",
                    port=port,
                    directory=str(node_dir),
                )  # fmt: skip
                self.servers.append(server.start())
            addresses = [f"127.0.0.1:{server.port}" for server in self.servers]
            replicas = ["--cluster-replicas", str(self.replicas)]
            subprocess.run(
                ["redis-cli", "--cluster", "create", *addresses, *replicas, "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=60,
            )
            self.wait_until_ok()
        except BaseException:
            self.close()
            raise
        return self

    def wait_until_ok(self, timeout: float = 60) -> None:
        """Wait until every node reports cluster_state:ok and every replica is in sync."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._node_ready(server) for server in self.servers):
                return
            time.sleep(0.1)
        raise RuntimeError("the local Redis Cluster did not become ready")

    @staticmethod
    def _node_ready(server: RedisServer) -> bool:
        client = server.client()
        try:
            if client.cluster("INFO").get("cluster_state") != "ok":
                return False
            info = client.info("replication")
            return info["role"] == "master" or info.get("master_link_status") == "up"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def node_for_slot(self, slot: int, role: str = "master", via: RedisServer | None = None) -> RedisServer:
        """Return the server that is the master (or a replica) of ``slot``, as ``via`` sees it."""
        client = (via or self.servers[0]).client()
        deadline = time.monotonic() + 10
        try:
            while True:  # polled: a node learns of a new replica by gossip, a moment later
                for start, end, master, *replicas in client.execute_command("CLUSTER SLOTS"):
                    if start <= slot <= end and (role == "master" or replicas):
                        port = int((master if role == "master" else replicas[0])[1])
                        return next(server for server in self.servers if server.port == port)
                if time.monotonic() > deadline:
                    raise LookupError(f"no {role} of slot {slot} in CLUSTER SLOTS")
                time.sleep(0.05)
        finally:
            client.close()

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []
        self._tmp.cleanup()


class LocalSentinel:
    """A redis-sentinel (``redis-server --sentinel``) on a loopback port, watching ``master`` as ``service``."""

    def __init__(self, master: RedisServer, service: str = "tbmaster", down_after_ms: int | None = None) -> None:
        self.master = master
        self.service = service
        #: Set, the sentinel fails the master over to a replica after this much silence.
        self.down_after_ms = down_after_ms
        self.port = free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="tb-sentinel-")
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def start(self) -> LocalSentinel:
        config = Path(self._tmp.name) / "sentinel.conf"  # the sentinel rewrites it: a file of its own
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self._tmp.name}\n"
            f"logfile {self._tmp.name}/sentinel.log\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
            + (
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} 10000\n"
                if self.down_after_ms
                else ""
            )
        )
        self.process = subprocess.Popen(
            ["redis-server", str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 10
        try:
            while True:  # up, and it knows the master
                try:
                    if client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service):
                        return self
                except redis.RedisError:
                    pass
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-sentinel on port {self.port} did not start")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
        self._tmp.cleanup()


class SilentHost:
    """A loopback address where a connection attempt is never answered, as with a host that
    is down or cut off (its SYNs go unanswered, the client waits out its connect timeout).

    A real listening socket whose accept queue is full: Linux then drops the SYNs of
    further connections (``tcp_abort_on_overflow`` 0, its default), so a connect hangs
    rather than being refused. Nothing is ever accepted.
    """

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        # A backlog of 0 holds one connection: this one fills it.
        self.filler = socket.create_connection(("127.0.0.1", self.port), timeout=1)
        probe = socket.socket()
        probe.settimeout(0.2)
        try:
            probe.connect(("127.0.0.1", self.port))
        except TimeoutError:
            pass  # as intended: the next connect is not answered
        else:
            self.close()
            raise RuntimeError("a connection to a full accept queue was answered: SYNs are not dropped here")
        finally:
            probe.close()

    def close(self) -> None:
        self.filler.close()
        self.listener.close()

    def __enter__(self) -> SilentHost:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def once_answered(call, within: float = 3.0):
    """``call()`` until it does not fail with a store failure, and its result.

    Calls are bounded by default and every node has a breaker: a server that was stopped
    or frozen and is back is found by the breaker's next probe, within its back-off (at
    most 1 s), and the calls before that fail at once.
    """
    from django_tokenbucket import BackendUnavailable
    from django_tokenbucket.backends.base import BackendError

    ends = time.monotonic() + within
    while True:
        try:
            return call()
        except (BackendUnavailable, BackendError):
            if time.monotonic() > ends:
                raise
            time.sleep(0.01)


async def once_answered_async(call, within: float = 3.0):
    """``once_answered`` for a coroutine function."""
    import asyncio

    from django_tokenbucket import BackendUnavailable
    from django_tokenbucket.backends.base import BackendError

    ends = time.monotonic() + within
    while True:
        try:
            return await call()
        except (BackendUnavailable, BackendError):
            if time.monotonic() > ends:
                raise
            await asyncio.sleep(0.01)
