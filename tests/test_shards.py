"""Sharded limits, without a store: the shards' configs and keys, the plan of a call,
and the config's validation. The behaviour on every backend is in test_conformance.py
(TestShards), and under several processes in test_concurrency.py."""

from __future__ import annotations

import random

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_tokenbucket.algorithms import MICRO
from django_tokenbucket.keys import encode_key
from django_tokenbucket.limits import MAX_SHARDS, parse_limit
from django_tokenbucket.shards import pick_two, shard_configs, shard_key, split


@pytest.mark.parametrize("shards", [2, 4, 5, 8, 1000])
def test_shards_share_the_rate_capacity_and_reservations_equally(shards):
    limit = parse_limit("global", {"rate": 1000, "period": 1, "capacity": 1500.5, "max_reserved": 7, "shards": shards})
    parts = shard_configs(limit)
    assert len(parts) == shards and len(set(parts)) == 1
    assert parts[0].rate * shards == limit.rate
    assert parts[0].capacity * shards == limit.capacity
    assert parts[0].max_reserved * shards == limit.max_reserved
    assert (parts[0].name, parts[0].period, parts[0].kind, parts[0].shards) == ("global", MICRO, limit.kind, 1)


@pytest.mark.parametrize(
    "spec, uneven",
    [
        ({"rate": 10, "period": 1, "shards": 3}, "rate and capacity"),
        ({"rate": 12, "period": 1, "capacity": 10.000001, "shards": 3}, "capacity"),
        ({"rate": 12, "period": 1, "max_reserved": 1.000001, "shards": 2}, "max_reserved"),
    ],
)
def test_uneven_shards_are_refused_naming_the_limit(spec, uneven):
    with pytest.raises(
        ImproperlyConfigured, match=f"rate limit 'hot': {uneven} must split into {spec['shards']} equal"
    ):
        parse_limit("hot", spec)


def test_shard_keys_are_distinct_and_keep_the_redis_hash_tag():
    key = encode_key(("tenant", 7))
    keys = [shard_key(key, index, 16) for index in range(16)]
    assert len({k.digest for k in keys} | {key.digest}) == 17
    assert {k.digest[:16] for k in keys} == {key.digest[:16]}
    assert all(len(k.digest) == 64 for k in keys)
    assert keys[3].label.startswith("[shard 4/16] ")


def test_pick_two_is_two_distinct_shards_covering_all():
    seen = set()
    for _ in range(500):
        first, second = pick_two(5)
        assert first != second and {first, second} <= set(range(5))
        seen |= {first, second}
    assert seen == set(range(5))


@pytest.mark.parametrize(
    "count, reserve, first, second, plan",
    [
        (1, False, (0, 5), (1, 3), [(0, 1)]),  # the fuller one
        (1, False, (0, 3), (1, 5), [(1, 1)]),
        (5, False, (0, 5), (1, 3), [(0, 5)]),  # the fuller holds it all
        (6, False, (0, 5), (1, 3), [(0, 5), (1, 1)]),  # pooled: all of the fuller, the rest
        (8, False, (0, 5), (1, 3), [(0, 5), (1, 3)]),
        (9, False, (0, 5), (1, 3), [(0, 9)]),  # not even both: a denial on the fuller
        (3, False, (0, -2), (1, 2), [(1, 3)]),  # a shard in debt
        (9, True, (0, 5), (1, 3), [(0, 9)]),  # reservations go whole to the fuller
    ],
)
def test_split_plans_the_parts(count, reserve, first, second, plan):
    assert split(count, reserve, first, second) == plan


@pytest.mark.parametrize(
    "shards, message",
    [
        (0, "shards must be a whole number from 1 to 1024, not 0"),
        (MAX_SHARDS + 1, "not 1025"),
        (True, "not True"),
        ("4", "not '4'"),
        (2.0, "not 2.0"),
    ],
)
def test_bad_shards_are_refused_naming_the_limit(shards, message):
    with pytest.raises(ImproperlyConfigured, match=f"rate limit 'hot': .*{message}"):
        parse_limit("hot", {"rate": 10, "period": 1, "shards": shards})


def test_counts_are_checked_against_two_shards():
    limit = parse_limit("hot", {"rate": 10, "period": 1, "shards": 4})  # 2.5 tokens per shard
    assert limit.max_plain_count == 5 * MICRO
    assert limit.validate_count(5, False) == 5 * MICRO
    with pytest.raises(ValueError, match=r"'hot': count 5\.5 exceeds what two of its 4 shards hold"):
        limit.validate_count(5.5, False)
    reservable = parse_limit("hot", {"rate": 10, "period": 1, "shards": 4, "max_reserved": 10})
    assert reservable.max_count == 5 * MICRO  # one shard: 2.5 + 2.5 reserved


@pytest.mark.django_db
def test_cleanup_deletes_idle_shards_and_keeps_busy_ones():
    from django.test import override_settings

    from django_tokenbucket import limiter
    from django_tokenbucket.cleanup import cleanup
    from django_tokenbucket.models import RateLimit
    from django_tokenbucket.testing import frozen_clock

    from .settings import TOKENBUCKET as BASE_SETTINGS

    limits = {**BASE_SETTINGS["LIMITS"], "global": {"rate": 8, "period": 60, "shards": 4}}
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "LIMITS": limits}), frozen_clock(1_700_000_000) as clock:
        random.seed(8)
        while limiter.get_value("global", None) > 0:  # every shard drained
            limiter.limit("global", None)
        stored = RateLimit.objects.filter(name="global").count()
        assert stored == 4
        # A shard holds 2 tokens and refills one every 30 s: full (idle) after 60 s.
        clock.advance(30)
        assert cleanup(names=["global"]).deleted_total == 0
        clock.advance(30)
        assert cleanup(names=["global"]).deleted_total == stored
        assert limiter.get_value("global", None) == 8
