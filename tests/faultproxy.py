"""A TCP proxy that breaks the network between the limiter and its store, for real.

``FaultProxy(host, port)`` listens on 127.0.0.1 on an ephemeral port and forwards every
connection to ``host:port`` (PostgreSQL, MariaDB, Redis). A test points a database
alias or a cache at ``proxy.port`` and then switches faults while traffic flows:

- ``latency = s``: every reply (server to client) is delivered ``s`` seconds late, as
  from a slow server; requests still reach the server at once.
- ``refuse()``: stop listening, so new connections are refused (RST); with
  ``drop=True`` (the default) the open ones are cut as well: the store is unreachable.
- ``drop()``: cut every open connection, both sides, mid-conversation: the client sees a
  reset, the server sees its client gone (and rolls back an open transaction).
- ``blackhole()``: accept connections but never answer: nothing is forwarded in either
  direction until ``resume()``, as when a route or a server stalls.
- ``resume()``: listen again on the same port, forward again, no latency.

Every connection runs in threads of the process that made the proxy. The tests fork
worker processes while the proxy runs, and a forked child would keep copies of its
sockets open (a listener still accepting after ``refuse()``, a connection the server
never sees close); so children close their copies right after the fork.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import struct
import threading
import time
import weakref

__all__ = ["FaultProxy"]

_POLL = 0.02  # how often idle threads look at the switches; shorter costs CPU on 2 cores

_live: weakref.WeakSet[FaultProxy] = weakref.WeakSet()


def _close_copies_in_child() -> None:
    for proxy in list(_live):
        proxy._close_copies()


os.register_at_fork(after_in_child=_close_copies_in_child)


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with an RST, whatever other file descriptors refer to it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Pair:
    """One client connection and its upstream connection, pumped by three threads."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server: socket.socket | None = None
        self.closed = threading.Event()
        self.replies: queue.Queue[tuple[float, bytes] | None] = queue.Queue()

    def run(self) -> None:
        proxy = self.proxy
        # A black-holed connection is accepted but not yet connected upstream: the
        # client's handshake waits, as on a stalled route.
        while not proxy._flowing.wait(_POLL):
            if self.closed.is_set():
                return
        try:
            server = socket.create_connection(proxy.upstream, timeout=10)
        except OSError:
            self.close()
            return
        self.server = server
        if self.closed.is_set():  # dropped while connecting: close() never saw this socket
            _reset(server)
            return
        threading.Thread(target=self._pump, args=(self.client, self.server, False), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.server, self.client, True), daemon=True).start()
        self._deliver()

    def _pump(self, source: socket.socket, target: socket.socket, replies: bool) -> None:
        proxy = self.proxy
        try:
            while not self.closed.is_set():
                if not proxy._flowing.is_set():
                    # Black-holed: leave the bytes in the kernel's buffers, unread.
                    proxy._flowing.wait(_POLL)
                    continue
                readable, _, _ = select.select([source], [], [], _POLL)
                if not readable:
                    continue
                data = source.recv(65536)
                if not data:
                    break
                if replies:
                    self.replies.put((time.monotonic() + proxy.latency, data))
                    continue
                # Bytes read while a black hole began (select() was already waiting)
                # are held too, or a statement sent after blackhole() would still pass.
                while not proxy._flowing.wait(_POLL):
                    if self.closed.is_set():
                        return
                target.sendall(data)
        except (OSError, ValueError):
            pass
        self.close()

    def _deliver(self) -> None:
        """Send the server's replies to the client, each once its latency has passed."""
        proxy = self.proxy
        try:
            while not self.closed.is_set():
                try:
                    item = self.replies.get(timeout=_POLL)
                except queue.Empty:
                    continue
                if item is None:
                    break
                due, data = item
                while not self.closed.is_set() and (time.monotonic() < due or not proxy._flowing.is_set()):
                    time.sleep(min(_POLL, max(0.0, due - time.monotonic())) or _POLL)
                if self.closed.is_set():
                    break
                self.client.sendall(data)
        except (OSError, ValueError):
            pass
        self.close()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self.replies.put(None)
        for sock in (self.client, self.server):
            if sock is not None:
                _reset(sock)
        self.proxy._forget(self)


class FaultProxy:
    """A TCP proxy on 127.0.0.1:<ephemeral> in front of ``host:port``, with switchable faults."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, int(port))
        self.port: int | None = None
        #: Seconds added to every reply; may be changed at any time.
        self.latency = 0.0
        #: Connections accepted, and connections cut by ``drop()``: figures for the tests.
        self.accepted = 0
        self.dropped = 0
        self._listener: socket.socket | None = None
        self._pairs: set[_Pair] = set()
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._acceptor: threading.Thread | None = None
        self._owner = os.getpid()

    # -- switches ---------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._listen(0)
        _live.add(self)
        return self

    def refuse(self, drop: bool = True) -> None:
        """Stop listening: new connections are refused. ``drop``: cut the open ones too."""
        listener, self._listener = self._listener, None
        if listener is not None:
            # A thread blocked on the socket keeps it listening after close(); shutdown()
            # takes it out of LISTEN at once, and the join makes sure nothing accepts.
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
            if self._acceptor is not None:
                self._acceptor.join(5)
        if drop:
            self.drop()

    def drop(self) -> int:
        """Cut every open connection (an RST to both sides); return how many."""
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            pair.close()
        self.dropped += len(pairs)
        return len(pairs)

    def blackhole(self) -> None:
        """Accept connections, answer nothing, forward nothing, until ``resume()``."""
        self._flowing.clear()
        if self._listener is None:
            self._listen(self.port or 0)

    def resume(self) -> None:
        """Undo every fault: listen on the same port, forward, no latency."""
        self.latency = 0.0
        if self._listener is None:
            self._listen(self.port or 0)
        self._flowing.set()

    def close(self) -> None:
        self.refuse(drop=True)
        self._flowing.set()
        _live.discard(self)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------

    def _listen(self, port: int) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Resuming binds the port it had: the client's settings name it.
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        listener.settimeout(_POLL)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._acceptor.start()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.setblocking(True)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(self, client)
            with self._lock:
                self._pairs.add(pair)
                self.accepted += 1
            threading.Thread(target=pair.run, daemon=True).start()

    def _forget(self, pair: _Pair) -> None:
        with self._lock:
            self._pairs.discard(pair)

    def _close_copies(self) -> None:
        """In a forked child: close this process's copies of the sockets, nothing else.

        ``close()`` on a copy leaves the parent's socket open (no shutdown, no RST), and
        no lock is taken: the threads that might hold one do not exist in the child.
        """
        if self._owner == os.getpid():
            return
        sockets = [self._listener] + [s for pair in list(self._pairs) for s in (pair.client, pair.server)]
        for sock in sockets:
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        self._listener = None
        self._pairs = set()
