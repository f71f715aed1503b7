"""RateLimitedTask (issue 32): one global rate for a Celery task, however many workers run it.

In this process (eager runs, direct calls, the checks) and with real workers on a real
broker: 4 prefork workers hold 100 tasks to 20 a second at every instant, each run once,
without blocking a plain task queued behind them; a pool process that dies between
deferring a task and acknowledging its message neither loses nor duplicates it; the same
on RabbitMQ with the tokens in Redis. A deferred run is a delivery of the task itself
(its name in logs and signals), a retry is a delivery of its own, deferred in turn (issue
47 item 8, issue 49 item 6), and a refusal is retried within max_retries, never forever.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery.exceptions import Ignore, Retry
from django.db import connection
from django.test import override_settings

pytest.importorskip("celery")

from django_tokenbucket import RateLimited, limiter
from django_tokenbucket.celery import RateLimitedTask, current_reservation, refund, run_reservation_work
from django_tokenbucket.celery.checks import check_rate_limited_tasks
from django_tokenbucket.celery.signatures import load_signature
from django_tokenbucket.celery.task import deferral_id
from django_tokenbucket.models import RateLimit, Reservation
from django_tokenbucket.tasks import run_reservation
from django_tokenbucket.testing import frozen_clock

from .celery_app import QUEUE, app
from .celery_tasks import RUNS, SIGNALS, TASKS_LIMIT, limited_effect, limited_retry, plain_effect
from .celery_workers import CeleryProcess, publish_elsewhere, purge_broker, stop_all
from .settings import TOKENBUCKET as BASE_SETTINGS
from .test_celery import (  # noqa: F401  (fixtures)
    clean_records,
    percentile,
    rabbitmq,
    record_figures,
    redis_tokens,
    tables,
    wait_for,
    workdir,
)

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = BASE_SETTINGS["LIMITS"][TASKS_LIMIT]
CAPACITY, RATE = LIMIT["capacity"], LIMIT["rate"]


def runs(held: str | None = None) -> list[tuple[str, str | None, float, int, str]]:
    sql = f"SELECT tag, task_id, started, pid, held FROM {RUNS}"
    params = []
    if held:
        sql += " WHERE held = %s"
        params.append(held)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


def tokens(key: str | None = "global") -> float:
    return limiter.get_value(TASKS_LIMIT, key)


# -- in this process ----------------------------------------------------------------------


def test_an_eager_run_takes_its_tokens_and_refunds_them_once(tables):
    with frozen_clock():
        assert limited_effect.apply(("a",), {"count": 2}).get() == "a"
        assert tokens() == CAPACITY - 2
        limited_effect.apply(("b",), {"count": 2, "refund": 1.5}).get()
        assert tokens() == CAPACITY - 4 + 1.5
    assert [row[4] for row in runs()] == ["HeldTokens", "HeldTokens"]


def test_a_held_refund_happens_once_and_never_above_what_was_taken(tables):
    with frozen_clock():
        limited_effect.apply(("c",)).get()
        held: list[Any] = []

        @app.task(base=RateLimitedTask, name="tests.refund_twice", tokenbucket_limit=TASKS_LIMIT)
        def refund_twice() -> None:
            reservation = current_reservation()
            held.append(reservation)
            with pytest.raises(ValueError, match=r"rate limit 'celery_tasks': cannot refund 2 tokens of the 1"):
                reservation.refund(2)
            assert refund(reservation, 1) is True  # the same as the method
            assert reservation.refund(1) is False

        try:
            refund_twice.apply().get()
        finally:
            app.tasks.unregister("tests.refund_twice")
        assert tokens() == CAPACITY - 1
        assert held[0].name == TASKS_LIMIT and held[0].tokens == 1


def test_a_failing_run_gives_its_tokens_back_when_told():
    @app.task(base=RateLimitedTask, name="tests.fails", tokenbucket_limit=TASKS_LIMIT, tokenbucket_count=2)
    def fails() -> None:
        raise RuntimeError("failing as told")

    try:
        with frozen_clock():
            with pytest.raises(RuntimeError):
                fails.apply().get()
            assert tokens(None) == CAPACITY - 2  # the limit's one bucket: no key
            type(fails).tokenbucket_refund_on_failure = True
            with pytest.raises(RuntimeError):
                fails.apply().get()
            assert tokens(None) == CAPACITY - 2
    finally:
        app.tasks.unregister("tests.fails")


def test_an_eager_run_waits_for_its_tokens(tables):
    limited_effect.apply(("drain",), {"count": CAPACITY}).get()
    started = time.monotonic()
    limited_effect.apply(("waited",), {"count": 2}).get()
    # 2 tokens at 20 a second: 0.1 s, less what refilled since the drain.
    assert time.monotonic() - started >= 0.05
    assert [row[0] for row in runs()] == ["drain", "waited"]


def test_a_key_of_none_runs_unlimited_and_a_direct_call_too(tables):
    with frozen_clock():
        limited_effect.apply(("free",), {"tenant": None}).get()
        limited_effect("direct")
        assert tokens() == CAPACITY
    assert sorted(row[4] for row in runs()) == ["NoneType", "NoneType"]


def test_a_count_that_can_never_be_covered_fails_the_task_clearly(tables):
    result = limited_effect.apply(("huge",), {"count": CAPACITY + LIMIT["max_reserved"] + 1})
    with pytest.raises(ValueError, match=r"task 'tests.limited_effect': rate limit 'celery_tasks': count 1006 exceeds"):
        result.get()
    assert runs() == [] and tokens() == CAPACITY


def test_the_key_callable_failing_names_the_task(tables):
    @app.task(base=RateLimitedTask, name="tests.bad_key", tokenbucket_limit=TASKS_LIMIT, tokenbucket_key=lambda: 1)
    def bad_key(tenant: str) -> None:
        raise AssertionError("must not run")

    try:
        with pytest.raises(ValueError, match=r"task 'tests.bad_key': tokenbucket_key raised TypeError"):
            bad_key.apply(("x",)).get()
    finally:
        app.tasks.unregister("tests.bad_key")


def test_the_checks_find_an_unknown_limit_and_an_impossible_count():
    assert check_rate_limited_tasks() == []

    @app.task(base=RateLimitedTask, name="tests.unknown_limit", tokenbucket_limit="no_such_limit")
    def unknown_limit() -> None: ...

    @app.task(base=RateLimitedTask, name="tests.no_limit")
    def no_limit() -> None: ...

    @app.task(base=RateLimitedTask, name="tests.too_many", tokenbucket_limit=TASKS_LIMIT, tokenbucket_count=5000)
    def too_many() -> None: ...

    try:
        errors = {e.msg.split(":")[0]: e for e in check_rate_limited_tasks()}
    finally:
        for name in ("tests.unknown_limit", "tests.no_limit", "tests.too_many"):
            app.tasks.unregister(name)
    assert set(errors) == {
        "Celery task 'tests.unknown_limit'",
        "Celery task 'tests.no_limit'",
        "Celery task 'tests.too_many'",
    }
    assert {e.id for e in errors.values()} == {"django_tokenbucket.E028"}
    assert "unknown rate limit 'no_such_limit'" in errors["Celery task 'tests.unknown_limit'"].msg
    assert "needs tokenbucket_limit" in errors["Celery task 'tests.no_limit'"].msg
    assert "count 5000 exceeds capacity + max_reserved" in errors["Celery task 'tests.too_many'"].msg
    assert check_rate_limited_tasks() == []


def test_a_deferral_is_keyed_by_the_task_id_and_its_retries():
    task_id = str(uuid.uuid4())
    assert deferral_id(task_id) == deferral_id(task_id, 0) == uuid.UUID(task_id)
    assert deferral_id("my-own-id") == deferral_id("my-own-id") != deferral_id("my-own-id2")
    # A retry is a delivery of its own (issue 47, item 8): each one has its own deferral.
    retried = [deferral_id(task_id, n) for n in range(1, 4)]
    assert len({uuid.UUID(task_id), *retried}) == 4
    assert deferral_id(task_id, 2) == retried[1]


# -- real workers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers(tables, workdir, django_db_blocker):
    """4 prefork workers of 2 pool processes each, started side by side."""
    purge_broker()
    with django_db_blocker.unblock():
        started = [CeleryProcess(workdir, concurrency=2, wait=False) for _ in range(4)]
        try:
            for process in started:
                process.wait_until_ready()
        except BaseException:
            stop_all(started)
            raise
    yield started
    stop_all(started)
    purge_broker()


def admissions_over_time(starts: list[float], since: float) -> tuple[float, float]:
    """Return the largest excess of runs started over capacity + rate x elapsed (≤ 0 holds), and when."""
    worst, when = -float(CAPACITY), 0.0
    for i, started in enumerate(sorted(starts), 1):
        excess = i - (CAPACITY + RATE * (started - since))
        if excess > worst:
            worst, when = excess, started - since
    return worst, when


@pytest.mark.redis
def test_workers_share_one_global_rate_and_never_block_a_plain_task(workers):
    n = 100
    published_at = time.time()
    ids = [limited_effect.delay(f"g{i}").id for i in range(n)]
    queued_at = time.time()
    plain_effect.delay("plain")
    wait_for(lambda: len(runs()) >= n + 1, timeout=n / RATE + 30, what=f"{n} rate-limited runs and a plain one")
    time.sleep(0.5)  # room for a duplicate to show up
    rows = runs()
    limited = [row for row in rows if row[4] != "plain"]
    assert sorted(row[0] for row in limited) == sorted(f"g{i}" for i in range(n)), "lost or duplicated"
    # Each run carries the id .delay() returned, deferred or not.
    assert sorted(row[1] for row in limited) == sorted(ids)
    starts = [row[2] for row in limited]
    excess, at = admissions_over_time(starts, published_at)
    assert excess <= 0, f"{excess:.2f} runs over capacity + rate x elapsed at {at:.3f} s"
    ideal = (n - CAPACITY) / RATE
    span = max(starts) - published_at
    plain_started = next(row[2] for row in rows if row[4] == "plain")
    plain_wait = plain_started - queued_at
    # The plain task waits for the messages ahead of it to be handled (a deferral costs
    # a worker a few ms), never for their tokens: it starts as soon as they are deferred.
    last_deferral = max(r.created_at for r in Reservation.objects.all()).timestamp()
    deferred = sum(1 for row in limited if row[4] == "Reservation")
    figures = record_figures(
        "T1 RateLimitedTask, 4 workers x 2",
        tasks=n,
        limit=f"{RATE}/s, capacity {CAPACITY}",
        deferred=deferred,
        ideal_s=ideal,
        span_s=round(span, 3),
        span_over_ideal=round(span / ideal, 3),
        plain_task_wait_s=round(plain_wait, 3),
        plain_task_after_last_deferral_s=round(plain_started - last_deferral, 3),
        deferrals_per_s=round(deferred / (last_deferral - published_at), 1),
        pids=len({row[3] for row in limited}),
    )
    assert set(Reservation.objects.values_list("status", flat=True)) == {"done"}
    assert plain_started - last_deferral <= 1.0, figures
    assert plain_wait <= 0.5 * ideal, figures
    assert span <= ideal * 1.05 + 0.5, figures


@pytest.mark.redis
def test_a_worker_dying_between_deferring_and_acknowledging_runs_the_task_once(workers):
    limited_effect.apply(("drain",), {"count": CAPACITY})  # nothing left: the next one defers
    result = limited_effect.delay("die-after-defer", count=2)
    wait_for(lambda: runs("Reservation"), timeout=30, what="the task's deferred run")
    # The worker notices its lost process and puts the message back, seconds later, often
    # after the deferred run: that delivery must find the deferral and do nothing.
    wait_for(lambda: len(runs("delivered")) >= 2, timeout=60, what="the message's redelivery")
    time.sleep(1.0)  # room for a duplicate to show up
    died = runs("died")
    ran = [row for row in runs() if row[0] == "die-after-defer" and row[4] not in ("died", "delivered")]
    assert len(died) == 1, "the pool process did not die in the window"
    assert len(runs("delivered")) == 2
    assert [(row[1], row[4]) for row in ran] == [(result.id, "Reservation")]
    deferral = Reservation.objects.get()
    assert (deferral.pk, deferral.status, deferral.tokens) == (uuid.UUID(result.id), "done", 2)
    assert ran[0][2] >= deferral.eta.timestamp()


_DELAY_ON_RABBITMQ = """
import json, time
from tests.celery_tasks import limited_effect
started = time.time()
ids = [limited_effect.delay(f"amqp{i}", tenant="amqp").id for i in range(16)]
print(json.dumps([started, ids]))
"""


@pytest.mark.redis
def test_on_rabbitmq_with_the_tokens_in_redis(tables, workdir, rabbitmq, redis_store):
    queue = f"{QUEUE}-amqp-tasks"
    amqp_worker = CeleryProcess(workdir, broker=rabbitmq, queues=queue, tokenbucket=redis_store)
    try:
        published_at, ids = publish_elsewhere(_DELAY_ON_RABBITMQ, rabbitmq, queue)
        wait_for(lambda: len(runs()) >= len(ids), timeout=30, what="the RabbitMQ tasks")
        time.sleep(0.5)
        # The tokens were taken in Redis (the bound below shows that they were taken):
        # the database has no bucket of the limit.
        assert not RateLimit.objects.filter(name=TASKS_LIMIT).exists()
    finally:
        amqp_worker.stop()
        from kombu import Connection

        with Connection(rabbitmq) as broker:  # RabbitMQ keeps queues: remove this run's
            broker.default_channel.queue_delete(queue)
    rows = runs()
    assert sorted(row[1] for row in rows) == sorted(ids), "lost or duplicated"
    excess, at = admissions_over_time([row[2] for row in rows], published_at)
    assert excess <= 0, f"{excess:.2f} runs over capacity + rate x elapsed at {at:.3f} s"
    assert {row[4] for row in rows} == {"HeldTokens", "Reservation"}


def _defer_in_this_process(key: str, task_id: str, tag: Any = "x") -> None:
    """Deliver limited_effect(tag, tenant=key) as a worker would, here: it must defer."""
    limit = limited_effect.tokenbucket_config()
    limited_effect.push_request(
        id=task_id, called_directly=False, is_eager=False, delivery_info={"exchange": "", "routing_key": QUEUE}
    )
    try:
        with pytest.raises(Ignore):
            limited_effect._take_or_defer(limit, key, 1, 1_000_000, (tag,), {"tenant": key})
    finally:
        limited_effect.pop_request()


def test_a_deferral_stores_arguments_postgresql_json_refuses():
    # A NUL character (a submitted username may hold one): PostgreSQL's JSON refuses
    # \u0000, and the deferred run must get the argument back as it was given.
    tag = "nul\x00in the middle\x00"
    with frozen_clock():
        limiter.limit(TASKS_LIMIT, "nul", count=CAPACITY)
        _defer_in_this_process("nul", str(uuid.uuid4()), tag)
    assert load_signature(Reservation.objects.get().signature)["args"] == [tag]
    purge_broker()


def test_a_deferral_whose_arguments_cannot_be_stored_gives_its_tokens_back():
    with frozen_clock():
        limiter.limit(TASKS_LIMIT, "unstorable", count=CAPACITY)
        before = tokens("unstorable")
        with pytest.raises(TypeError, match=r"tests\.limited_effect.*JSON-serializable"):
            _defer_in_this_process("unstorable", str(uuid.uuid4()), object())
        assert tokens("unstorable") == before
    assert not Reservation.objects.exists()


def test_a_deferral_racing_its_twin_gives_its_tokens_back(monkeypatch):
    # The same message delivered twice at once: the second, not flagged as delivered
    # before, reserves without looking and then meets the first one's row. Its tokens
    # must come back, and the deferred run is sent again (a claim makes that harmless).
    task_id = str(uuid.uuid4())
    with frozen_clock():
        limiter.limit(TASKS_LIMIT, "twin", count=CAPACITY)
        _defer_in_this_process("twin", task_id)
        after_first = tokens("twin")
        monkeypatch.setattr(RateLimitedTask, "_maybe_delivered_before", lambda self: False)
        _defer_in_this_process("twin", task_id)
        assert tokens("twin") == after_first == -1
    assert Reservation.objects.count() == 1
    purge_broker()


# -- retries, blocks and the deferred run's name (issues 47 item 8, 49 item 6) -------------


def signals(task_id: str) -> list[tuple[str, str, int, str | None]]:
    """What Celery's signals said about ``task_id``, in order: (task, event, retries, mark)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT task, event, retries, reservation FROM {SIGNALS} WHERE task_id = %s ORDER BY at", [task_id]
        )
        return list(cursor.fetchall())


def _deliver_in_this_process(key: str, retries: int) -> None:
    """Deliver limited_effect("x", tenant=key) here as a worker would, as its ``retries``-th retry."""
    limit = limited_effect.tokenbucket_config()
    limited_effect.push_request(
        id=str(uuid.uuid4()),
        retries=retries,
        args=("x",),
        kwargs={"tenant": key},
        called_directly=False,
        is_eager=False,
        delivery_info={"exchange": "", "routing_key": QUEUE},
    )
    try:
        limited_effect._take_or_defer(limit, key, 1, 1_000_000, ("x",), {"tenant": key})
    finally:
        limited_effect.pop_request()


def test_a_key_blocked_without_end_fails_the_task_instead_of_retrying_forever():
    # Was: retried every 180 s (Celery's default_retry_delay), without end.
    limiter.block(TASKS_LIMIT, "blocked")
    with pytest.raises(RateLimited) as refused:
        _deliver_in_this_process("blocked", retries=0)
    assert refused.value.retry_after is None and refused.value.name == TASKS_LIMIT
    assert not Reservation.objects.exists()
    purge_broker()


def test_a_refusal_with_an_end_is_retried_then_and_within_max_retries():
    limiter.block(TASKS_LIMIT, "for-a-while", until=timedelta(seconds=30))
    # Retried when the block ends...
    with pytest.raises(Retry) as retried:
        _deliver_in_this_process("for-a-while", retries=0)
    assert retried.value.when == pytest.approx(30, abs=2)
    # ...but not beyond the task's max_retries (3): then it fails (was: sys.maxsize).
    assert limited_effect.max_retries == 3
    with pytest.raises(RateLimited) as refused:
        _deliver_in_this_process("for-a-while", retries=3)
    assert refused.value.retry_after == pytest.approx(30, abs=2)
    assert not Reservation.objects.exists()
    purge_broker()


@pytest.fixture(params=["database", "redis"])
def retry_queue(request, workers, workdir):
    """The queue to publish on: the 4 workers' (tokens in the database), or that of a
    worker of its own whose tokens are in Redis (as this process' are then)."""
    if request.param == "database":
        yield QUEUE
        return
    store = request.getfixturevalue("redis_store")
    queue = f"{QUEUE}-redis-tokens"
    worker = CeleryProcess(workdir, queues=queue, tokenbucket=store)
    try:
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, **store}):
            yield queue
    finally:
        worker.stop()


@pytest.mark.redis
def test_a_deferred_task_that_retries_runs_again(retry_queue):
    # A second of debt: the first delivery is deferred. Its run puts the bucket in debt
    # again and retries at once: the retry is short of tokens, deferred in turn, and runs.
    # Was: the retry's deferral met the first one's record and was dropped ("delivered
    # again after it was deferred (failed); nothing more to do"): 1 run of 2.
    limiter.limit(TASKS_LIMIT, "retrying", count=CAPACITY + RATE, reserve=True)
    kwargs = {"tenant": "retrying", "retries": 1, "debt": RATE}
    task_id = limited_retry.apply_async(("retry",), kwargs, queue=retry_queue).id
    wait_for(
        lambda: ("success", 1) in [s[1:3] for s in signals(task_id)], timeout=30, what="the retried run to succeed"
    )
    time.sleep(0.5)  # room for a duplicate to show up
    assert [(row[1], row[4]) for row in sorted(runs(), key=lambda row: row[2]) if row[0] == "retry"] == [
        (task_id, "Reservation 0"),
        (task_id, "Reservation 1"),
    ]
    first, retry = uuid.UUID(task_id), deferral_id(task_id, 1)
    deferrals = {r.pk: r for r in Reservation.objects.all()}
    assert set(deferrals) == {first, retry}
    # The first run ended in a retry (its tokens were used); the retry's ran.
    assert deferrals[first].status == "failed" and deferrals[first].error.startswith("Retry")
    assert deferrals[retry].status == "done"
    # Each delivery under the task's own name: the message, then its deferred run (marked
    # with its reservation), which retries; the retry, then its own deferred run, which
    # succeeds. (The retry's delivery may start before the first run's retry is signalled.)
    events = [(event, retries, mark) for _, event, retries, mark in signals(task_id)]
    assert sorted(events, key=str) == sorted(
        [
            ("prerun", 0, None),
            ("prerun", 0, str(first)),
            ("retry", 0, str(first)),
            ("prerun", 1, None),
            ("prerun", 1, str(retry)),
            ("success", 1, str(retry)),
        ],
        key=str,
    )
    assert events[:2] == [("prerun", 0, None), ("prerun", 0, str(first))]
    assert events[-1] == ("success", 1, str(retry))
    assert {task for task, *_ in signals(task_id)} == {"tests.limited_retry"}


@pytest.mark.redis
def test_a_deferred_run_is_the_task_itself_in_logs_and_signals(workers):
    # Was: logged as "tests.limited_retry[id] ignored", then run and signalled as
    # "django_tokenbucket.run_reservation[id]" (issue 49, item 6).
    limiter.limit(TASKS_LIMIT, "named", count=CAPACITY + 2, reserve=True)
    task_id = limited_retry.delay("named", tenant="named").id
    wait_for(lambda: any(s[1] == "success" for s in signals(task_id)), timeout=30, what="the deferred run")
    assert signals(task_id) == [
        ("tests.limited_retry", "prerun", 0, None),
        ("tests.limited_retry", "prerun", 0, task_id),
        ("tests.limited_retry", "success", 0, task_id),
    ]
    succeeded = f"Task tests.limited_retry[{task_id}] succeeded in "
    # The worker logs the success after the task_success signal: on a busy machine the
    # line may reach its log file a moment after the signal was seen.
    wait_for(
        lambda: succeeded in "".join(worker.output() for worker in workers), timeout=10, what="the success log line"
    )
    logs = "".join(worker.output() for worker in workers)
    assert f"django_tokenbucket.run_reservation[{task_id}]" not in logs
    assert f"Task tests.limited_retry[{task_id}] deferred by " in logs


def test_a_deferred_run_published_by_an_earlier_version_still_runs(tables):
    # Earlier versions sent a deferred run through django_tokenbucket.run_reservation;
    # such a message, still in a broker after the upgrade, runs the task once.
    task_id = str(uuid.uuid4())
    with frozen_clock():
        limiter.limit(TASKS_LIMIT, "legacy", count=CAPACITY)
        _defer_in_this_process("legacy", task_id, "legacy")
    purge_broker()  # this version's own message for it: the old one is delivered instead
    run_reservation.apply(args=(task_id,)).get()
    assert [(row[0], row[1], row[4]) for row in runs()] == [("legacy", task_id, "Reservation")]
    assert Reservation.objects.get().status == "done"
    with pytest.raises(Ignore):  # and once
        run_reservation_work(run_reservation, task_id)
