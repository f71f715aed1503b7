"""Real Celery workers (and beat) as subprocesses, for tests/test_celery.py.

Each is a ``celery`` process on this run's queue, with the tests' settings pointed at
the pytest process's test database, started in a session of its own so that stopping
it also stops its pool processes. Nothing here is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection

from .celery_app import BROKER, KEY_PREFIX, QUEUE, REDIS_BROKER

ROOT = Path(__file__).resolve().parent.parent


def broker_client() -> Any:
    """Return a redis-py client of the Redis broker's database."""
    import redis

    return redis.Redis.from_url(REDIS_BROKER)


def purge_broker() -> None:
    """Delete this run's broker keys (queue, unacked messages) from Redis."""
    if not BROKER.startswith("redis"):
        return
    client = broker_client()
    keys = list(client.scan_iter(match=f"{KEY_PREFIX}*", count=1000))
    if keys:
        client.delete(*keys)


class CeleryProcess:
    """One ``celery worker`` or ``celery beat`` subprocess."""

    counter = 0

    def __init__(
        self,
        directory: Path,
        *,
        kind: str = "worker",
        concurrency: int = 2,
        transport: dict[str, Any] | None = None,
        tokenbucket: dict[str, Any] | None = None,
        broker: str | None = None,
        sweep_every: float | None = None,
        queues: str = QUEUE,
        wait: bool = True,
    ) -> None:
        self.arguments = {
            "kind": kind,
            "concurrency": concurrency,
            "transport": transport,
            "tokenbucket": tokenbucket,
            "broker": broker,
            "sweep_every": sweep_every,
            "queues": queues,
        }
        self.directory = directory
        CeleryProcess.counter += 1
        self.name = f"{QUEUE}-{kind}{CeleryProcess.counter}"
        self.log = directory / f"{self.name}.log"
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.celery_worker_settings",
            "TOKENBUCKET_WORKER_DB_NAME": str(connection.settings_dict["NAME"]),
            "TOKENBUCKET_WORKER_REDIS_PREFIX": settings.CACHES["redis"]["KEY_PREFIX"],
            "TOKENBUCKET_CELERY_QUEUE": QUEUE,
            "TOKENBUCKET_CELERY_TRANSPORT": json.dumps(transport or {}),
            "TOKENBUCKET_WORKER_TOKENBUCKET": json.dumps(tokenbucket or {}),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        if broker:
            env["TOKENBUCKET_CELERY_BROKER"] = broker
        if sweep_every:
            env["TOKENBUCKET_CELERY_SWEEP_EVERY"] = str(sweep_every)
        command = [sys.executable, "-m", "celery", "-A", "tests.celery_app", kind, "--loglevel", "INFO"]
        command += ["--logfile", str(self.log)]
        if kind == "worker":
            command += ["--pool", "prefork", "--concurrency", str(concurrency), "--queues", queues]
            command += ["--hostname", f"{self.name}@%h", "--without-gossip", "--without-mingle"]
            command += ["--without-heartbeat"]
        else:
            command += ["--schedule", str(directory / f"{self.name}-schedule"), "--max-interval", "1"]
        self._stderr = open(directory / f"{self.name}.err", "w")
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self._stderr, start_new_session=True
        )
        if wait:
            self.wait_until_ready(kind)

    def output(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        err = self.log.with_suffix(".err")
        return text + (err.read_text(errors="replace") if err.exists() else "")

    def wait_until_ready(self, kind: str = "worker", timeout: float = 60) -> None:
        marker = " ready." if kind == "worker" else "beat: Starting"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"celery {kind} exited with {self.process.returncode}:\n{self.output()[-5000:]}")
            if marker in self.output():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"celery {kind} not ready after {timeout} s:\n{self.output()[-5000:]}")

    def pool_children(self) -> set[int]:
        """Return the pids of this worker's pool processes."""
        children = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.process.pid:
                children.add(int(entry.name))
        return children

    def kill_child(self, pid: int) -> bool:
        """SIGKILL one pool process of this worker (never anything else); True if it was one."""
        if pid not in self.pool_children():
            return False
        os.kill(pid, signal.SIGKILL)
        return True

    def restart(self) -> None:
        """Stop, then start a process like this one."""
        self.stop()
        self.__init__(self.directory, **self.arguments)  # type: ignore[misc]

    def ask_to_stop(self) -> None:
        """Start a warm shutdown (running tasks finish, unacknowledged messages go back)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Warm shutdown (running tasks finish, unacknowledged messages go back), then SIGKILL."""
        self.ask_to_stop()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)
        self._stderr.close()


def stop_all(processes: list[CeleryProcess]) -> None:
    """Stop ``processes``, their warm shutdowns side by side (each takes a second or two)."""
    for process in processes:
        process.ask_to_stop()
    for process in processes:
        process.stop()


def publish_elsewhere(code: str, broker: str, queue: str) -> Any:
    """Run ``code`` in a new process whose Celery app publishes to ``broker`` and ``queue``
    (this process' app talks to Redis), and return the JSON its last line prints."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.celery_worker_settings",
        "TOKENBUCKET_WORKER_DB_NAME": str(connection.settings_dict["NAME"]),
        "TOKENBUCKET_WORKER_REDIS_PREFIX": "unused",
        "TOKENBUCKET_CELERY_BROKER": broker,
        "TOKENBUCKET_CELERY_QUEUE": queue,
    }
    out = subprocess.run(
        [sys.executable, "-c", "import django, tests.celery_app\ndjango.setup()\n" + code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
