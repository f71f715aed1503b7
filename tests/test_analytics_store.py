"""Denial analytics' storage (``BaseBackend.write_analytics`` and its reads), on both backends.

One behavioural suite for the database and Redis (``analytics_store``), then what is
particular to each: the database's single transaction and trimming, Redis' single
round trip and TTLs, concurrent flushes on PostgreSQL and MariaDB, and PgBouncer.
Nothing is mocked: round trips and statements are counted on the real connections.
"""

from __future__ import annotations

import hashlib
import threading

import pytest
import redis.connection
from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django_redis import get_redis_connection

from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.analytics_store import MAX_SPAN_MINUTES
from django_tokenbucket.backends.base import (
    KEY_MINUTES_KEPT,
    MINUTES_KEPT,
    BackendError,
    BaseBackend,
    DeniedKeyCount,
    MinuteCounts,
)
from django_tokenbucket.backends.database import DatabaseBackend
from django_tokenbucket.backends.redis import RedisBackend
from django_tokenbucket.backends.redis.analytics import EXPIRY_MARGIN, analytics_key
from django_tokenbucket.models import AnalyticsMinute, DeniedKeyMinute

from .settings import TOKENBUCKET as BASE_SETTINGS
from .test_pgbouncer import pgbouncer  # noqa: F401  (the fixture: a PgBouncer in transaction pooling mode)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

#: A minute that starts an hour (1_700_006_400 s since the epoch), so that spans can cross hours on purpose.
M0 = 28_333_440
assert M0 % 60 == 0


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def minute(name: str, at: int, allowed: int, denied: int) -> MinuteCounts:
    return MinuteCounts(name, at, allowed, denied)


def denied_key(name: str, key: str, at: int, denied: int, label: str | None = None) -> DeniedKeyCount:
    return DeniedKeyCount(name, digest(key), key if label is None else label, denied, at)


@pytest.fixture
def analytics_store(ops_store) -> BaseBackend:
    """The default backend on the database or Redis (conftest's ``ops_store``)."""
    backend = get_backend()
    assert backend.keeps_analytics
    return backend


@pytest.fixture
def database_backend() -> DatabaseBackend:
    return DatabaseBackend({})


@pytest.fixture
def redis_backend(redis_store) -> RedisBackend:
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **redis_store}):
        backend = get_backend()
        assert isinstance(backend, RedisBackend)
        yield backend


# -- on both backends -----------------------------------------------------------------


def test_writes_add_up_as_the_flushes_of_two_processes_would(analytics_store):
    store = analytics_store
    store.write_analytics(
        [minute("login", M0, 3, 1)],
        [denied_key("login", "alice", M0, 1)],
    )
    store.write_analytics(
        # The same minute twice in one write adds up too.
        [minute("login", M0, 2, 4), minute("login", M0, 1, 0), minute("login", M0 + 1, 1, 0)],
        [denied_key("login", "alice", M0, 2), denied_key("login", "bob", M0, 5)],
    )
    assert store.read_minutes(["login"], M0, M0 + 2) == [minute("login", M0, 6, 5), minute("login", M0 + 1, 1, 0)]
    top = store.read_denied_keys("login", M0, M0 + 1, 10)
    assert [(key.digest, key.denied, key.minute) for key in top] == [(digest("bob"), 5, 0), (digest("alice"), 3, 0)]
    # Nothing to write writes nothing, and fails nothing.
    store.write_analytics([], [])
    assert store.read_minutes(["login"], M0, M0 + 2) == [minute("login", M0, 6, 5), minute("login", M0 + 1, 1, 0)]


def test_reads_are_ordered_and_leave_out_other_names_and_minutes_out_of_the_span(analytics_store):
    store = analytics_store
    store.write_analytics(
        [
            minute("b", M0 + 60, 1, 1),  # the next hour (another hash on Redis)
            minute("b", M0, 2, 0),
            minute("a", M0 + 59, 0, 3),
            minute("a", M0 - 1, 9, 9),  # before the span (the previous hour)
            minute("a", M0 + 120, 9, 9),  # at ``until``: left out
            minute("c", M0, 9, 9),  # a name not asked for
            minute("odd name/ü {x}", M0 + 1, 4, 0),
        ],
        [],
    )
    assert store.read_minutes(["odd name/ü {x}", "b", "a", "b"], M0, M0 + 120) == [
        minute("a", M0 + 59, 0, 3),
        minute("b", M0, 2, 0),
        minute("b", M0 + 60, 1, 1),
        minute("odd name/ü {x}", M0 + 1, 4, 0),
    ]
    assert store.read_minutes(["a"], M0 - 1, M0) == [minute("a", M0 - 1, 9, 9)]
    assert store.read_minutes(["a"], M0, M0) == []
    assert store.read_minutes([], M0, M0 + 120) == []
    assert store.read_minutes(["nobody"], M0 - 60, M0 + 180) == []


def test_top_denied_keys_ordered_by_count_then_digest_and_limited(analytics_store):
    store = analytics_store
    x, y, z, w = "x-key", "y-key", "z-key", "w-key"
    store.write_analytics(
        [],
        [
            denied_key("api", x, M0, 2),
            denied_key("api", x, M0 + 30, 3),  # summed over the span: 5
            denied_key("api", y, M0 + 1, 3),
            denied_key("api", z, M0 + 2, 3),  # y and z tie
            denied_key("api", w, M0 + 3, 1),
            denied_key("api", w, M0 + 31, 50),  # out of the span
            denied_key("api", w, M0 - 1, 50),  # out of the span
            denied_key("other", w, M0, 99),  # another limit
        ],
    )
    tied = sorted([digest(y), digest(z)])
    found = store.read_denied_keys("api", M0, M0 + 31, 10)
    assert [(key.name, key.digest, key.denied) for key in found] == [
        ("api", digest(x), 5),
        ("api", tied[0], 3),
        ("api", tied[1], 3),
        ("api", digest(w), 1),
    ]
    assert [key.digest for key in store.read_denied_keys("api", M0, M0 + 31, 2)] == [digest(x), tied[0]]
    assert [key.denied for key in store.read_denied_keys("api", M0 + 30, M0 + 32, 1)] == [50]
    assert store.read_denied_keys("api", M0 + 100, M0 + 110, 5) == []
    assert store.read_denied_keys("api", M0, M0, 5) == []


def test_labels_are_kept_cut_to_the_column_on_the_database_and_empty_on_redis(analytics_store):
    store = analytics_store
    long_label = "user-" + "é" * 100
    store.write_analytics(
        [], [denied_key("login", "long", M0, 2, long_label), denied_key("login", "short", M0, 1, "short")]
    )
    labels = [key.label for key in store.read_denied_keys("login", M0, M0 + 1, 5)]
    if isinstance(store, DatabaseBackend):
        assert labels == [long_label[:64], "short"]
    else:
        assert labels == ["", ""]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.read_denied_keys("api", M0, M0 + 5, 0), "rate limit 'api': limit must be a whole number >= 1"),
        (lambda s: s.read_denied_keys("api", M0, M0 + 5, True), "rate limit 'api': limit must be"),
        (lambda s: s.read_denied_keys("api", M0 + 5, M0, 3), r"rate limit 'api': since \(28333445\) is after until"),
        (lambda s: s.read_minutes(["b", "a"], M0 + 1, M0), r"rate limit\(s\) 'a', 'b': since \(28333441\) is after"),
        (lambda s: s.read_minutes(["a"], M0, M0 + MAX_SPAN_MINUTES + 1), "'a': a span of 2881 minutes is longer"),
        (lambda s: s.read_minutes(["a"], -1, M0), "'a': since must be >= 0"),
        (lambda s: s.read_minutes(["a"], 1.5, M0), "'a': since and until are whole minutes"),
        (lambda s: s.write_analytics([minute("a", M0, -1, 0)], []), "rate limit 'a': allowed must be a whole number"),
        (lambda s: s.write_analytics([minute("a", -5, 1, 0)], []), "rate limit 'a': -5 is not a minute"),
        (lambda s: s.write_analytics([], [DeniedKeyCount("a", "ABC", "", 1, M0)]), "'a': 'ABC' is not a key digest"),
        (lambda s: s.write_analytics([], [denied_key("a", "k", M0, 1.0)]), "'a': denied must be a whole number"),
        (lambda s: s.trim_analytics(-1), "now_minute must be whole minutes"),
    ],
)
def test_bad_input_is_refused_naming_the_limit_and_the_problem(analytics_store, call, message):
    with pytest.raises(ValueError, match=message):
        call(analytics_store)


def test_nothing_of_a_refused_write_is_stored(analytics_store):
    with pytest.raises(ValueError):
        analytics_store.write_analytics([minute("a", M0, 1, 0), minute("a", M0 + 1, -1, 0)], [])
    assert analytics_store.read_minutes(["a"], M0, M0 + 2) == []


# -- the database: one transaction, trimming, failures --------------------------------------


def test_a_write_is_one_transaction_of_two_statements_whatever_the_number_of_keys(database_backend):
    connection = connections[database_backend.alias()]

    def statements(keys: int) -> list[str]:
        minutes = [minute(f"limit-{i}", M0 + keys, i, 1) for i in range(keys)]
        denied = [denied_key("limit-0", f"key-{i}", M0 + keys, 1) for i in range(keys)]
        with CaptureQueriesContext(connection) as queries:
            database_backend.write_analytics(minutes, denied)
        return [query["sql"] for query in queries]

    one, many = statements(1), statements(150)
    assert len(one) == len(many), many
    # Two upserts, and the transaction's own statements where the vendor's log shows them.
    assert len([sql for sql in many if sql.startswith("INSERT INTO")]) == 2
    assert all(sql.startswith(("INSERT INTO", "BEGIN", "COMMIT")) for sql in many), many
    assert many[-1] == "COMMIT" or connection.vendor not in ("postgresql", "mysql")
    assert AnalyticsMinute.objects.filter(minute=M0 + 150).count() == 150
    assert DeniedKeyMinute.objects.filter(minute=M0 + 150).count() == 150


def test_a_write_that_fails_halfway_stores_nothing(database_backend):
    """Both upserts are one transaction: when the second fails, the first is rolled back."""
    connection = connections[database_backend.alias()]
    database_backend.write_analytics([minute("login", M0, 1, 1)], [denied_key("login", "k", M0, 1)])
    seen: list[str] = []

    def fail_on_denied_keys(execute, sql, params, many, context):
        seen.append(sql)
        if DeniedKeyMinute._meta.db_table in sql:
            raise DatabaseError("the second statement failed")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(fail_on_denied_keys):
        with pytest.raises(BackendError, match=r"database 'default': writing denial analytics failed: .*second"):
            database_backend.write_analytics([minute("login", M0, 10, 10)], [denied_key("login", "k", M0, 10)])
    assert len([sql for sql in seen if sql.startswith("INSERT")]) == 2
    assert database_backend.read_minutes(["login"], M0, M0 + 1) == [minute("login", M0, 1, 1)]
    assert [k.denied for k in database_backend.read_denied_keys("login", M0, M0 + 1, 5)] == [1]


def test_a_write_inside_the_callers_transaction_joins_it(database_backend):
    """A savepoint of the caller's transaction, not a commit of its own: a rollback takes it back."""
    with pytest.raises(RuntimeError), transaction.atomic():
        database_backend.write_analytics([minute("login", M0, 1, 1)], [denied_key("login", "k", M0, 1)])
        assert database_backend.read_minutes(["login"], M0, M0 + 1) == [minute("login", M0, 1, 1)]
        raise RuntimeError("the caller's work failed")
    assert database_backend.read_minutes(["login"], M0, M0 + 1) == []
    assert database_backend.read_denied_keys("login", M0, M0 + 1, 1) == []


def test_trimming_deletes_exactly_the_rows_past_their_retention(database_backend):
    now = M0 + 10_000
    database_backend.write_analytics(
        [
            minute("login", now - MINUTES_KEPT - 1, 1, 1),  # one minute too old
            minute("login", now - MINUTES_KEPT, 1, 1),  # the oldest kept
            minute("other", now - MINUTES_KEPT - 500, 1, 0),
            minute("login", now, 1, 0),
        ],
        [
            denied_key("login", "gone", now - KEY_MINUTES_KEPT - 1, 1),
            denied_key("login", "gone-too", now - MINUTES_KEPT, 1),  # keys go sooner than counts
            denied_key("login", "kept", now - KEY_MINUTES_KEPT, 1),
            denied_key("login", "kept", now, 1),
        ],
    )
    assert database_backend.trim_analytics(now) == 4
    assert sorted(AnalyticsMinute.objects.values_list("name", "minute")) == [
        ("login", now - MINUTES_KEPT),
        ("login", now),
    ]
    assert sorted(DeniedKeyMinute.objects.values_list("label", "minute")) == [
        ("kept", now - KEY_MINUTES_KEPT),
        ("kept", now),
    ]
    assert database_backend.trim_analytics(now) == 0


def test_trimming_goes_in_batches(database_backend):
    from django_tokenbucket.backends.database.analytics import trim

    database_backend.write_analytics([minute(f"n{i}", M0, 1, 0) for i in range(7)], [])
    with CaptureQueriesContext(connections["default"]) as queries:
        assert trim("default", M0 + MINUTES_KEPT + 1, batch_size=3) == 7
    deletes = [q["sql"] for q in queries if q["sql"].startswith("DELETE")]
    assert len(deletes) == 3 and AnalyticsMinute.objects.count() == 0


@pytest.mark.django_db(transaction=True, databases=["default", "unreachable"])
def test_store_failures_are_backend_errors_naming_what_failed():
    backend = DatabaseBackend({"DATABASE": "unreachable"})
    with pytest.raises(BackendError, match="database 'unreachable': writing denial analytics failed"):
        backend.write_analytics([minute("a", M0, 1, 0)], [])
    with pytest.raises(BackendError, match="database 'unreachable': reading denial analytics failed"):
        backend.read_minutes(["a"], M0, M0 + 1)
    with pytest.raises(BackendError, match="database 'unreachable': reading denial analytics failed"):
        backend.read_denied_keys("a", M0, M0 + 1, 3)
    with pytest.raises(BackendError, match="database 'unreachable': trimming denial analytics failed"):
        backend.trim_analytics(M0)
    dead = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:1/0"}
    with override_settings(CACHES={**settings.CACHES, "dead": dead}):
        redis_backend = RedisBackend({"CACHE": "dead"})
        with pytest.raises(BackendError, match=r"Redis \(cache 'dead'\): writing denial analytics failed") as raised:
            redis_backend.write_analytics([minute("a", M0, 1, 0)], [])
        assert raised.value.ambiguous is False  # never connected: nothing was sent
        with pytest.raises(BackendError, match=r"Redis \(cache 'dead'\): reading denial analytics failed"):
            redis_backend.read_minutes(["a"], M0, M0 + 1)
        with pytest.raises(BackendError, match=r"Redis \(cache 'dead'\): reading denial analytics failed"):
            redis_backend.read_denied_keys("a", M0, M0 + 1, 3)


def test_names_longer_than_the_column_are_refused_on_the_database(database_backend):
    with pytest.raises(ValueError, match="the name is longer than 200 characters"):
        database_backend.write_analytics([minute("n" * 201, M0, 1, 0)], [])


# -- Redis: one round trip, TTLs ------------------------------------------------------------


@pytest.fixture
def round_trips(monkeypatch) -> list[bytes]:
    """What each command batch sent to Redis (a pipeline is one), as it goes on the socket."""
    sent: list[bytes] = []
    original = redis.connection.Connection.send_packed_command

    def counting(self, command, check_health=True):
        sent.append(command)
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
    return sent


def test_a_write_is_one_round_trip_whatever_the_number_of_keys(redis_backend, round_trips):
    redis_backend.client().ping()  # connected before counting
    for keys in (1, 150):
        round_trips.clear()
        redis_backend.write_analytics(
            [minute(f"limit-{i}", M0 + keys, i, 1) for i in range(keys)],
            [denied_key("limit-0", f"key-{i}", M0 + keys, 1) for i in range(keys)],
        )
        assert len(round_trips) == 1
    round_trips.clear()
    assert len(redis_backend.read_minutes([f"limit-{i}" for i in range(150)], M0 + 150, M0 + 151)) == 150
    assert len(redis_backend.read_denied_keys("limit-0", M0 + 150, M0 + 151, 500)) == 150
    assert len(round_trips) == 2  # one pipeline of HGETALLs, one ZUNION


def test_redis_keys_expire_with_the_retention(redis_backend):
    client = get_redis_connection("redis")
    redis_backend.write_analytics(
        [minute("login", M0 + 10, 1, 1), minute("login", M0 + 70, 1, 0)],
        [denied_key("login", "k", M0 + 10, 2)],
    )
    prefix = f"{settings.REDIS_KEY_PREFIX}:1:"
    first_hour = client.pttl(prefix + analytics_key("login", "h", M0 // 60)) / 1000
    next_hour = client.pttl(prefix + analytics_key("login", "h", M0 // 60 + 1)) / 1000
    keys = client.pttl(prefix + analytics_key("login", "k", M0 + 10)) / 1000
    # Each lives the retention past its last minute (the hour's, for a hash), from the minute written.
    assert abs(first_hour - ((60 - 10 + MINUTES_KEPT) * 60 + EXPIRY_MARGIN)) < 5
    assert abs(next_hour - ((60 - 10 + MINUTES_KEPT) * 60 + EXPIRY_MARGIN)) < 5
    assert abs(keys - ((1 + KEY_MINUTES_KEPT) * 60 + EXPIRY_MARGIN)) < 5
    assert redis_backend.trim_analytics(M0 + 10_000) == 0
    # A hash's TTL is taken from its earliest minute of the write: it outlives the whole hour.
    redis_backend.write_analytics([minute("later", M0 + 59, 1, 0), minute("later", M0 + 1, 1, 0)], [])
    later = client.pttl(prefix + analytics_key("later", "h", M0 // 60)) / 1000
    assert abs(later - ((60 - 1 + MINUTES_KEPT) * 60 + EXPIRY_MARGIN)) < 5
    # Every analytics key of this test carries a TTL.
    found = list(client.scan_iter(match=f"{prefix}tokenbucket:analytics:*"))
    assert len(found) == 4 and all(client.ttl(key) > 0 for key in found)


def test_a_limit_name_with_braces_keeps_its_keys_in_one_slot():
    from redis.cluster import key_slot

    name = "weird}{name"
    keys = [analytics_key(name, "h", 1), analytics_key(name, "k", 2), analytics_key(name, "k", 999)]
    assert len({key_slot(key.encode()) for key in keys}) == 1
    assert analytics_key("a", "k", 1) != analytics_key("b", "k", 1)


# -- concurrent flushes, PostgreSQL and MariaDB --------------------------------------------


WRITERS = 4
ROUNDS = 15


@pytest.mark.only_on("postgres", "mariadb")
def test_concurrent_flushes_on_the_same_rows_add_up_exactly(database_backend):
    """Threads, each on its own connection, flush the same (name, minute) rows and keys at
    once; every round's rows are new, so their first inserts race too."""
    barrier = threading.Barrier(WRITERS)
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            for round_ in range(ROUNDS):
                barrier.wait(timeout=30)
                # Each writer lists the rows in another order: the backend must lock in one.
                names = ["a", "b", "c"][index % 3 :] + ["a", "b", "c"][: index % 3]
                database_backend.write_analytics(
                    [minute(name, M0 + round_, 1, 2) for name in names],
                    [denied_key(name, key, M0 + round_, 3) for name in names for key in ("k1", "k2")][::-1],
                )
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert not database_backend.gave_up  # no deadlock or serialization failure outlasted the retries
    expected = [minute(name, M0 + r, WRITERS, 2 * WRITERS) for name in "abc" for r in range(ROUNDS)]
    assert database_backend.read_minutes(["a", "b", "c"], M0, M0 + ROUNDS) == expected
    for name in "abc":
        top = database_backend.read_denied_keys(name, M0, M0 + ROUNDS, 5)
        assert sorted((k.digest, k.denied) for k in top) == sorted(
            (digest(key), 3 * WRITERS * ROUNDS) for key in ("k1", "k2")
        )
    assert AnalyticsMinute.objects.count() == 3 * ROUNDS and DeniedKeyMinute.objects.count() == 6 * ROUNDS


@pytest.mark.only_on("postgres")
@pytest.mark.pgbouncer
@pytest.mark.django_db(transaction=True, databases=["default", "pgbouncer"])
def test_flushes_through_pgbouncer_in_transaction_pooling_mode(pgbouncer):
    """Two clients share PgBouncer's one server connection, a transaction at a time."""
    backend = DatabaseBackend({"DATABASE": "pgbouncer"})

    def flush() -> None:
        try:
            for _ in range(5):
                backend.write_analytics([minute("bounced", M0, 1, 1)], [denied_key("bounced", "k", M0, 1)])
        finally:
            connections.close_all()

    threads = [threading.Thread(target=flush) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert backend.read_minutes(["bounced"], M0, M0 + 1) == [minute("bounced", M0, 10, 10)]
    assert [(k.label, k.denied) for k in backend.read_denied_keys("bounced", M0, M0 + 1, 1)] == [("k", 10)]
    assert backend.trim_analytics(M0 + MINUTES_KEPT + 1) == 2
