"""The per-node circuit breaker of the Redis backend (``backends/redis/breaker.py``) as a
state machine, on a clock the test moves. Its use against real servers is in
test_redis_deadline.py and test_redis_crash.py."""

from __future__ import annotations

import os

import pytest

from django_tokenbucket.backends.redis.breaker import BREAKERS, FIRST_BACKOFF, MAX_BACKOFF, Breaker, Breakers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_closed_breaker_lets_every_call_through(clock):
    breaker = Breaker(clock)
    assert all(breaker.allow() for _ in range(100))
    assert breaker.state == "closed" and breaker.rejected == 0


def test_a_failure_opens_it_for_the_first_backoff_then_one_probe_goes_through(clock):
    breaker = Breaker(clock)
    breaker.failed()
    assert breaker.state == "open" and breaker.remaining() == pytest.approx(FIRST_BACKOFF)
    assert not breaker.allow() and not breaker.allow()
    clock.now += FIRST_BACKOFF
    assert breaker.allow()  # the probe
    assert breaker.state == "probing"
    assert not breaker.allow() and not breaker.allow()  # one probe at a time
    assert breaker.rejected == 4
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.allow() and breaker.failures == 0


def test_each_failed_probe_doubles_the_backoff_up_to_the_cap(clock):
    breaker = Breaker(clock)
    backoffs = []
    for _ in range(10):
        breaker.failed()
        backoffs.append(breaker.remaining())
        assert not breaker.allow()
        clock.now += breaker.remaining()
        assert breaker.allow()  # the probe, which fails again
    expected = [min(MAX_BACKOFF, FIRST_BACKOFF * 2**n) for n in range(10)]
    assert backoffs == pytest.approx(expected)
    assert backoffs[-1] == MAX_BACKOFF


def test_a_probe_that_never_reports_is_given_up_after_the_backoff(clock):
    breaker = Breaker(clock)
    breaker.failed()
    breaker.failed()  # back-off: 2 x FIRST_BACKOFF
    clock.now += breaker.remaining()
    assert breaker.allow()  # its caller is cancelled and never reports
    clock.now += 2 * FIRST_BACKOFF - 0.001
    assert not breaker.allow()
    clock.now += 0.002
    assert breaker.allow()  # another call probes


def test_a_success_resets_the_backoff(clock):
    breaker = Breaker(clock)
    for _ in range(5):
        breaker.failed()
    breaker.succeeded()
    breaker.failed()
    assert breaker.remaining() == pytest.approx(FIRST_BACKOFF)


def test_breakers_are_per_node_and_counted(clock):
    breakers = Breakers(clock)
    breakers.failed("10.0.0.1:7000")
    assert not breakers.allow("10.0.0.1:7000")
    assert breakers.allow("10.0.0.2:7000")  # healthy nodes never wait behind a failing one
    assert breakers.rejected() == 1
    breakers.succeeded("10.0.0.2:7000")  # a node never seen: nothing to do
    assert breakers.get("10.0.0.2:7000").state == "closed"


def test_a_forked_child_starts_with_fresh_breakers():
    BREAKERS.failed("10.9.9.9:1")
    try:
        read, write = os.pipe()
        pid = os.fork()
        # Failures, not allow(): on a loaded machine the fork can outlast the 50 ms back-off,
        # after which an open breaker allows a probe too.
        if pid == 0:  # the child: report whether it inherited the open breaker
            os.write(write, b"1" if BREAKERS.get("10.9.9.9:1").failures == 0 else b"0")
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"1"
        assert BREAKERS.get("10.9.9.9:1").failures == 1  # the parent keeps its own
    finally:
        BREAKERS.clear()
