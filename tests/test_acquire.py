"""``limiter.acquire`` and ``aacquire`` (issue 32): reserve, then sleep until the tokens
exist; a wait past ``timeout`` takes nothing. On every backend, sync and async.

The limiter's clock is pinned, so each reservation's wait is exact; the sleeps are real
(short: a hundred tokens a second), and each is checked to last its wait and not much
longer.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from django.db import connections
from django.test import override_settings

from django_tokenbucket import RateLimited, limiter
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

# The conformance suite's stores: every backend, and on PostgreSQL its portable path too.
from .test_conformance import BACKENDS, store_overrides

#: A hundred tokens a second: a token every 10 ms.
FAST = {"rate": 100, "period": 1}
#: Scheduling noise a sleep may add, generously: the point is that it ends.
SLACK = 1.0


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, transactional_db):
    overrides = store_overrides(request.param, request)
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **overrides}):
        yield request.param


@pytest.fixture(params=["sync", "async"])
def acquire(request, backend):
    """``limiter.acquire``, or its async twin run on an event loop."""
    if request.param == "sync":
        return limiter.acquire
    return async_to_sync(limiter.aacquire)


@pytest.fixture
def clock(backend):
    with frozen_clock(1_700_000_000.0) as frozen:
        yield frozen


def timed(call, *args, **kwargs):
    started = time.monotonic()
    result = call(*args, **kwargs)
    return result, time.monotonic() - started


def test_it_sleeps_until_the_reserved_tokens_exist(acquire, clock):
    limiter.limit("acquire-fast", config=FAST, count=100)
    status, slept = timed(acquire, "acquire-fast", count=2, config=FAST)
    assert status.ok and status.retry_after == pytest.approx(0.02)
    assert 0.02 <= slept < 0.02 + SLACK
    # Taken ahead of time: the bucket owes the two tokens until they are refilled.
    assert limiter.get_value("acquire-fast", config=FAST) == -2
    # Tokens that are there are taken without a wait.
    clock.advance(1)
    status, slept = timed(acquire, "acquire-fast", count=5, config=FAST)
    assert status.ok and status.retry_after is None and slept < SLACK


def test_a_wait_past_the_timeout_takes_nothing(acquire, clock):
    limiter.limit("acquire-fast", config=FAST, count=100)
    with pytest.raises(RateLimited) as denied:
        acquire("acquire-fast", count=1, timeout=0.005, config=FAST)
    # Half a token later, one token is owed for at most 5 ms.
    assert denied.value.retry_after == pytest.approx(0.005)
    assert limiter.get_value("acquire-fast", config=FAST) == 0
    status, slept = timed(acquire, "acquire-fast", count=1, timeout=0.01, config=FAST)
    assert status.ok and 0.01 <= slept < 0.01 + SLACK
    assert limiter.get_value("acquire-fast", config=FAST) == -1


def test_max_reserved_bounds_the_wait_too(acquire, clock):
    capped = {**FAST, "max_reserved": 2}
    limiter.limit("acquire-capped", config=capped, count=100)
    with pytest.raises(RateLimited):
        acquire("acquire-capped", count=3, config=capped)
    assert limiter.get_value("acquire-capped", config=capped) == 0


def test_a_fixed_window_waits_for_the_window_that_pays(acquire, clock):
    window = {"kind": "fixed window", "rate": 10, "period": 0.1, "start": 0}
    limiter.limit("acquire-window", config=window, count=10)
    clock.advance(0.04)  # 60 ms before the next window opens
    status, slept = timed(acquire, "acquire-window", count=3, timeout=0.1, config=window)
    assert status.ok and status.retry_after == pytest.approx(0.06) and 0.06 <= slept < 0.06 + SLACK
    # A wait is counted from the start of the current window: 0.1 s covers one window.
    with pytest.raises(RateLimited):
        acquire("acquire-window", count=10, timeout=0.1, config=window)


def test_a_shadow_limit_never_waits(acquire, clock):
    shadow = {**FAST, "shadow": True}
    limiter.limit("acquire-shadowed", config=shadow, count=100)
    status, slept = timed(acquire, "acquire-shadowed", count=50, config=shadow)
    assert status.ok and status.would_deny is False and slept < SLACK


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"count": 106, "timeout": 0.05}, r"rate limit 'acquire-fast': count 106 cannot be acquired within timeout 0.05"),
        ({"count": 1, "timeout": -1}, r"rate limit 'acquire-fast': timeout must not be negative"),
        ({"count": 1, "timeout": "soon"}, r"rate limit 'acquire-fast': timeout must be a number"),
        ({"count": 1, "timeout": True}, r"rate limit 'acquire-fast': timeout must be a number"),
        ({"count": 0}, r"rate limit 'acquire-fast'"),
    ],
)
def test_bad_arguments_are_errors_naming_the_limit_and_take_nothing(acquire, clock, arguments, message):
    limiter.limit("acquire-fast", config=FAST, count=10)
    with pytest.raises(ValueError, match=message):
        acquire("acquire-fast", config=FAST, **arguments)
    assert limiter.get_value("acquire-fast", config=FAST) == 90


def test_concurrent_acquirers_are_served_in_the_order_they_reserved(backend, clock):
    limiter.limit("acquire-fast", config=FAST, count=100)
    finished: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            status = limiter.acquire("acquire-fast", count=1, config=FAST)
            with lock:
                finished.append(status.retry_after)
        finally:
            connections.close_all()  # this thread's own, or the test database stays in use

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    # Each waits for the tokens reserved before it, then its own: 10, 20, 30, 40 ms.
    assert finished == pytest.approx([0.01, 0.02, 0.03, 0.04])


def test_async_acquirers_share_the_loop_and_are_served_in_order(backend, clock):
    # Ten a second: the four wait 0.1, 0.2, 0.3 and 0.4 s. Sleeping side by side on the
    # loop they are all done after 0.4 s; one blocking sleep after another would take 1 s.
    slow = {"rate": 10, "period": 1}
    limiter.limit("acquire-slow", config=slow, count=10)
    finished: list[float] = []

    async def one() -> None:
        status = await limiter.aacquire("acquire-slow", count=1, config=slow)
        finished.append(status.retry_after)

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(4)))

    _, elapsed = timed(async_to_sync(main))
    assert finished == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert 0.4 <= elapsed < 0.8
