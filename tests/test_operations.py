"""The operations layer (issue 29): what each backend declares it can do for the admin and
the command, and the same answers from ``django_tokenbucket.operations`` on every backend.

A declared capability works; an undeclared one raises NotImplementedError naming the
backend, so the admin and the command can ask instead of testing for a class.
"""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import override_settings

from django_tokenbucket import operations
from django_tokenbucket.api import limiter
from django_tokenbucket.backends import get_backend, row_backend
from django_tokenbucket.backends.base import BackendError
from django_tokenbucket.keys import encode_key
from django_tokenbucket.live import FULL, LIMITED, PARTIAL
from django_tokenbucket.models import RateLimit
from django_tokenbucket.shards import key_buckets
from django_tokenbucket.testing import frozen_clock

pytestmark = pytest.mark.django_db(transaction=True)


def _capabilities(backend):
    """Each optional operation, called harmlessly, by the flag that declares it."""
    limit = limiter.resolve("ten_per_minute")
    digest = encode_key("nobody").digest
    now = backend.store_now()
    return {
        "lists_buckets": [
            lambda: backend.list_buckets(limit),
            lambda: backend.count_buckets([limit]),
            lambda: backend.reset_buckets(limit.name, [digest]),
        ],
        "counts_cheaply": [
            lambda: backend.stored_names(),
            lambda: backend.count_by_state([limit], now),
        ],
        "keeps_rows": [
            lambda: backend.set_tokens(limit, digest, 0),
            lambda: list(backend.rows_in_state(RateLimit.objects.all(), [limit], FULL, now)),
        ],
        "needs_cleanup": [lambda: backend.cleanup({limit.name: limit}, dry_run=True)],
    }


def test_each_backend_offers_what_it_declares_and_names_itself_otherwise(ops):
    backend = get_backend("default")
    for flag, calls in _capabilities(backend).items():
        for call in calls:
            if getattr(backend, flag):
                call()
            else:
                with pytest.raises(NotImplementedError, match=type(backend).__name__):
                    call()


def test_reset_buckets_forgets_exactly_the_digests_given(ops):
    backend = get_backend("default")
    for key in ("a", "b", "c"):
        limiter.limit("odd name/ü", key, count=5)
    limit = limiter.resolve("odd name/ü")
    gone = [encode_key("a").digest, encode_key("b").digest, encode_key("never used").digest]
    # Only stored buckets are counted: "never used" has none.
    assert backend.reset_buckets(limit.name, gone) == 2
    assert [limiter.get_value(limit.name, key) for key in ("a", "b", "c")] == [5, 5, 0]
    assert backend.reset_buckets(limit.name, []) == 0


@pytest.mark.parametrize(
    "bad",
    ["*", "a" * 63, "A" * 64, "a" * 64 + "*", "tokenbucket:*", None],
    ids=["glob", "short", "upper", "glob-suffix", "pattern", "none"],
)
def test_reset_buckets_refuses_what_is_not_a_digest_and_deletes_nothing(ops, bad):
    # A digest reaches a Redis key and a SQL filter: a pattern must never widen what goes.
    limiter.limit("ten_per_minute", "kept", count=3)
    with pytest.raises(ValueError, match=r"rate limit 'ten_per_minute': .* is not a key digest"):
        get_backend("default").reset_buckets("ten_per_minute", [encode_key("kept").digest, bad])
    assert limiter.get_value("ten_per_minute", "kept") == 7


def test_reset_buckets_reaches_a_limit_no_longer_configured(ops):
    # An operator removes a limit from settings and then its keys: the name is enough.
    limiter.limit("odd name/ü", "gone", count=2)
    current = settings.TOKENBUCKET
    remaining = {name: spec for name, spec in current["LIMITS"].items() if name != "odd name/ü"}
    with override_settings(TOKENBUCKET={**current, "LIMITS": remaining}):
        assert get_backend("default").reset_buckets("odd name/ü", [encode_key("gone").digest]) == 1
    assert limiter.get_value("odd name/ü", "gone") == 5


def test_key_state_and_is_stored_read_a_sharded_key_as_its_shards_sum(ops):
    backend = get_backend("default")
    limit = limiter.resolve("hot")
    key = encode_key("alice")
    assert operations.is_stored(backend, limit, key) is False
    limiter.limit("hot", "alice", count=15)
    state = operations.key_state(backend, limit, key)
    assert (state.value, state.capacity) == (25 * 1_000_000, 40 * 1_000_000)
    assert state.state == PARTIAL and state.next_token_after == 0
    assert operations.is_stored(backend, limit, key) is True
    # Reading decided nothing.
    assert operations.key_state(backend, limit, key).value == state.value


def test_counts_by_state_agree_on_every_backend(ops):
    backend = get_backend("default")
    limiter.limit("ten_per_minute", "empty", count=10)
    limiter.limit("ten_per_minute", "partial", count=4)
    limiter.limit("ten_per_minute", "again", count=1)
    ops.advance(60)  # "again" and "partial" refill; "empty" too: ten a minute
    limiter.limit("ten_per_minute", "late", count=10)
    counts = operations.counts_by_state(backend, limiter.resolve("ten_per_minute"))
    assert counts == {"stored": 4, LIMITED: 1, PARTIAL: 0, FULL: 3}


def test_find_by_digest_pages_through_a_prefix(ops):
    backend = get_backend("default")
    limit = limiter.resolve("odd name/ü")
    for i in range(30):
        limiter.limit(limit.name, f"k{i}")
    digest = encode_key("k7").digest
    [found], now = operations.find_by_digest(backend, limit, digest[:12])
    assert found.digest == digest and now == backend.store_now()
    # A one-digit prefix matches about two of thirty: at most ``at_most`` come back.
    every = sorted(encode_key(f"k{i}").digest for i in range(30))
    prefix = every[0][0]
    matching = [d for d in every if d.startswith(prefix)]
    assert [b.digest for b in operations.find_by_digest(backend, limit, prefix, at_most=50)[0]] == matching
    assert len(operations.find_by_digest(backend, limit, prefix, at_most=1)[0]) == 1


def test_set_tokens_writes_under_the_lock_and_keeps_the_refill_phase():
    backend = row_backend()
    limit = limiter.resolve("ten_per_minute")
    digest = encode_key("alice").digest
    with frozen_clock() as clock:
        assert backend.set_tokens(limit, digest, 3_000_000) is None  # nothing stored: nothing made
        limiter.limit(limit.name, "alice", count=9)
        clock.advance(3)  # half a token back
        assert backend.set_tokens(limit, digest, 2_000_000) == (1_500_000, 2_000_000)
        clock.advance(3)
        assert limiter.get_value(limit.name, "alice") == 2.5
        # Never above the capacity.
        assert backend.set_tokens(limit, digest, 99_000_000) == (2_500_000, 10_000_000)


def test_row_backend_is_the_configured_database_backend_or_one_on_the_alias(ops, ops_store):
    backend = row_backend()
    assert backend.keeps_rows and backend.database_alias() == "default"
    assert (backend is get_backend("default")) == (ops_store == "database")
    assert row_backend("default").database_alias() == "default"


def test_a_failing_database_is_a_backend_error_naming_it():
    from django.db import connection

    backend = row_backend()
    limit = limiter.resolve("ten_per_minute")
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE django_tokenbucket_ratelimit RENAME TO tb_moved")
    try:
        for operation in (
            lambda: backend.count_buckets([limit]),
            lambda: backend.reset_buckets(limit.name, [encode_key("x").digest]),
            lambda: backend.set_tokens(limit, encode_key("x").digest, 0),
            lambda: backend.stored_names(),
        ):
            with pytest.raises(BackendError, match="database 'default'"):
                operation()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE tb_moved RENAME TO django_tokenbucket_ratelimit")


def test_key_buckets_names_every_shard_once(ops):
    limit = limiter.resolve("hot")
    buckets = key_buckets(limit, encode_key("alice"))
    assert len(buckets) == limit.shards == 4
    assert len({(shard.name, part.digest) for shard, part in buckets}) == 4
    assert key_buckets(limiter.resolve("login"), encode_key("x")) == [(limiter.resolve("login"), encode_key("x"))]
