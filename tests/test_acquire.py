"""``limiter.acquire`` and ``aacquire`` (issue 32): reserve, then sleep until the tokens
exist; a wait past ``timeout`` takes nothing. On every backend, sync and async.

The limiter's clock is pinned, so each reservation's wait is exact; the sleeps are real
(short: a hundred tokens a second), and each is checked to last its wait and not much
longer.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from django.db import connections, transaction
from django.test import override_settings

from django_tokenbucket import RateLimited, limiter
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

# The conformance suite's stores: every backend, and on PostgreSQL its portable path too.
from .test_conformance import BACKENDS, store_overrides
from .test_faults import redis_behind_proxy, stored_state

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
        (
            {"count": 106, "timeout": 0.05},
            r"rate limit 'acquire-fast': count 106 cannot be acquired within timeout 0.05",
        ),
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


# -- a wait given up takes nothing (issue 47, item 7) ---------------------------------------
#
# Django cancels an async view whose client disconnects; asyncio.timeout cancels what it
# wraps; a Celery soft time limit raises inside a sleeping worker. The tokens reserved for
# that wait are never used: they must go back, whether the cancellation lands in the sleep
# or while the store call that reserved them is under way (its reply unseen).

#: A token a minute, none to spare: a reservation waits 60 s, and the clock is pinned, so
#: the bucket's value says exactly what was taken and given back.
SLOW = {"rate": 1, "period": 60, "capacity": 1}


async def _reserved(expected: float, deadline: float = 10.0) -> None:
    """Return once the bucket shows the reservation (the waiter is asleep)."""
    give_up = time.monotonic() + deadline
    while await limiter.aget_value("acquire-cancelled", config=SLOW) != expected:
        assert time.monotonic() < give_up, "the reservation never showed"
        await asyncio.sleep(0.01)


async def _cancelled(task: asyncio.Task, deadline: float = 10.0) -> None:
    """Wait for ``task`` to end and check that it ended cancelled."""
    await asyncio.wait({task}, timeout=deadline)
    if not task.done():
        task.cancel()  # what the old code did: it slept on, cancellation swallowed
        pytest.fail("the cancelled aacquire did not end")
    assert task.cancelled()


def test_a_wait_cancelled_in_its_sleep_takes_nothing(backend, clock):
    limiter.limit("acquire-cancelled", config=SLOW)  # drained: each acquire waits 60 s

    async def main() -> list[float]:
        values = []
        for _ in range(3):  # the attack's figure: 3 cancellations left -2.91 tokens
            before = await limiter.aget_value("acquire-cancelled", config=SLOW)
            task = asyncio.create_task(limiter.aacquire("acquire-cancelled", timeout=600, config=SLOW))
            await _reserved(before - 1)
            task.cancel()
            await _cancelled(task)
            values.append(await limiter.aget_value("acquire-cancelled", config=SLOW))
        return values

    assert async_to_sync(main)() == [0, 0, 0]


def test_a_wait_cut_by_asyncio_timeout_takes_nothing(backend, clock):
    limiter.limit("acquire-cancelled", config=SLOW)

    async def main() -> float:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await limiter.aacquire("acquire-cancelled", timeout=120, config=SLOW)
        return await limiter.aget_value("acquire-cancelled", config=SLOW)

    assert async_to_sync(main)() == 0


class Interrupted(Exception):
    """Raised by a signal handler inside a sleeping acquire, as Celery's soft time limit is."""


def test_a_sync_wait_interrupted_by_a_signal_takes_nothing(backend, clock):
    limiter.limit("acquire-cancelled", config=SLOW)

    def interrupt(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            limiter.acquire("acquire-cancelled", timeout=120, config=SLOW)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert limiter.get_value("acquire-cancelled", config=SLOW) == 0


@pytest.fixture(params=sorted(name for name in BACKENDS if name.startswith("database")))
def database_backend(request, transactional_db):
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **BACKENDS[request.param]}):
        yield request.param


@pytest.mark.parametrize("cancellations", [1, 2])
def test_a_wait_cancelled_mid_call_on_the_database_takes_nothing(database_backend, cancellations):
    # Another transaction holds the bucket's row (on SQLite, the database's write lock):
    # the store call that reserves waits for it, and is cancelled meanwhile. Released,
    # the call reserves and commits; the cancelled waiter never saw its reply. A second
    # cancellation while the first is being handled must not give the tokens back twice.
    with frozen_clock(1_700_000_000.0):
        limiter.limit("acquire-cancelled", config=SLOW)
    holding, release = threading.Event(), threading.Event()

    def hold_the_row() -> None:
        try:
            with transaction.atomic():
                list(RateLimit.objects.select_for_update().filter(name="acquire-cancelled"))
                holding.set()
                release.wait(20)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    assert holding.wait(10)

    async def main() -> float:
        task = asyncio.create_task(limiter.aacquire("acquire-cancelled", timeout=120, config=SLOW))
        await asyncio.sleep(0.3)  # the decision waits for the row
        for _ in range(cancellations):
            task.cancel()
            await asyncio.sleep(0.05)
        release.set()
        await _cancelled(task)
        # After a second cancellation the give-back may still be under way: wait for it,
        # then long enough for a second one to show.
        give_up = time.monotonic() + 10
        while await limiter.aget_value("acquire-cancelled", config=SLOW) < 0 and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        return await limiter.aget_value("acquire-cancelled", config=SLOW)

    try:
        with frozen_clock(1_700_000_000.0):
            assert async_to_sync(main)() == 0
    finally:
        release.set()
        holder.join(20)


@pytest.mark.redis
@pytest.mark.parametrize("timeout", [None, 5.0], ids=["redis", "redis-timeout"])
@pytest.mark.parametrize("cancellations", [1, 2])
def test_a_wait_cancelled_mid_call_on_redis_takes_nothing(transactional_db, timeout, cancellations):
    # Every reply comes 0.5 s late through the proxy: once Redis holds the reservation
    # (read directly), the waiter is cancelled before it reads that it was made.
    options = {"OPTIONS": {"CACHE": "proxied", **({"TIMEOUT": timeout} if timeout else {})}}
    socket_timeouts = {"SOCKET_CONNECT_TIMEOUT": 5, "SOCKET_TIMEOUT": 5}
    with redis_behind_proxy(cache_options=socket_timeouts, **options) as proxy, frozen_clock(1_700_000_000.0):

        async def main() -> float:
            await limiter.alimit("acquire-cancelled", config=SLOW)
            proxy.latency = 0.5
            task = asyncio.create_task(limiter.aacquire("acquire-cancelled", timeout=120, config=SLOW))
            drained = stored_state("redis")
            give_up = time.monotonic() + 10
            while stored_state("redis") == drained:  # the script has not run yet
                assert time.monotonic() < give_up, "the script never ran"
                await asyncio.sleep(0.005)
            assert not task.done()  # its reply is on its way
            for _ in range(cancellations):
                task.cancel()
                await asyncio.sleep(0.05)
            await _cancelled(task)
            proxy.latency = 0.0
            give_up = time.monotonic() + 10
            while await limiter.aget_value("acquire-cancelled", config=SLOW) < 0 and time.monotonic() < give_up:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            return await limiter.aget_value("acquire-cancelled", config=SLOW)

        assert async_to_sync(main)() == 0
