"""The watchdog behind the database backend's ``TIMEOUT``, on real sockets.

The end-to-end case (a PostgreSQL or MariaDB connection whose route stalls) is
tests/test_faults.py::test_f2_timeout_bounds_a_connection_that_stalls.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from django_tokenbucket.backends.database.deadline import watching

#: Scheduling on a busy 2-core machine, added to every deadline.
SLACK_S = 0.5


@pytest.fixture
def socket_pair():
    """Make connected pairs of sockets; every one is closed after the test."""
    made: list[socket.socket] = []

    def make() -> tuple[socket.socket, socket.socket]:
        pair = socket.socketpair()
        made.extend(pair)
        return pair

    yield make
    for sock in made:
        sock.close()


def test_a_read_with_nothing_to_read_ends_at_the_deadline(socket_pair):
    waiting, _peer = socket_pair()
    waiting.settimeout(5)  # a watchdog that never fires fails the test instead of hanging it
    started = time.monotonic()
    with watching(waiting.fileno(), 0.2) as watch:
        assert waiting.recv(1) == b""  # shut down: end of stream instead of waiting for ever
    elapsed = time.monotonic() - started
    assert watch.fired
    assert 0.2 <= elapsed <= 0.2 + SLACK_S


def test_a_block_that_ends_in_time_leaves_the_socket_alone(socket_pair):
    mine, peer = socket_pair()
    # Far enough that a busy machine does not reach it before the block ends.
    with watching(mine.fileno(), 2.0) as watch:
        mine.sendall(b"ping")
    time.sleep(2.3)  # past the deadline
    assert not watch.fired
    assert peer.recv(4) == b"ping"
    peer.sendall(b"pong")
    assert mine.recv(4) == b"pong"


def test_the_earliest_of_several_deadlines_fires_first(socket_pair):
    late, _late_peer = socket_pair()
    early, _early_peer = socket_pair()
    late.settimeout(5)
    early.settimeout(5)
    with watching(late.fileno(), 2.0) as late_watch, watching(early.fileno(), 0.1) as early_watch:
        assert early.recv(1) == b""
        assert early_watch.fired and not late_watch.fired
        assert late.recv(1) == b""
        assert late_watch.fired


def test_a_socket_closed_inside_the_block_cannot_take_another_socket_down(socket_pair):
    # Had the watch kept only the number, a socket opened after the close would get
    # it, and the deadline would shut that one down.
    first, _first_peer = socket_pair()
    number = first.fileno()
    with watching(number, 0.1) as watch:
        first.close()
        newcomer, newcomer_peer = socket_pair()
        assert number in (newcomer.fileno(), newcomer_peer.fileno())  # the number was reused
        give_up = time.monotonic() + 5
        while not watch.fired and time.monotonic() < give_up:
            time.sleep(0.05)
    assert watch.fired
    newcomer.sendall(b"still here")
    assert newcomer_peer.recv(10) == b"still here"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_has_a_watchdog_of_its_own(socket_pair):
    warm, _warm_peer = socket_pair()
    with watching(warm.fileno(), 10):  # the parent's watchdog thread is running
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            status = 1
            try:
                waiting, _peer = socket_pair()
                waiting.settimeout(5)
                with watching(waiting.fileno(), 0.1) as watch:
                    ended = waiting.recv(1) == b""
                status = 0 if ended and watch.fired else 1
            finally:
                os._exit(status)  # never back into the parent's pytest session
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
