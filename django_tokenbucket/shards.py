"""Hot limits spread over shards: ``"shards": N`` in a limit's config. Pure, no I/O.

A global limit that every request hits is one row (or key) that every decision locks
in turn. With ``shards=N`` the limit is N independent buckets of the same kind, each
with ``1/N`` of the rate, of the capacity and of ``max_reserved`` (which must divide
evenly, to the micro-token, so that every row reads under one config). A call reads
two shards picked at random and takes from the fuller one (the power of two choices
keeps the shards level); when neither holds the count alone but both together do, it
takes from both at once, all or nothing.

The bound stays exact: N buckets admit at most the sum of their bounds, which is the
limit's own ``C + r·Δ``. The price is at most some denials while other shards still
hold tokens, one more round trip per decision (the read of the two shards), and
statuses whose ``value`` is an estimate (the two shards read, times N / 2).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace
from functools import lru_cache

from .keys import LABEL_LENGTH, EncodedKey
from .limits import LimitConfig

__all__ = ["key_buckets", "pick_two", "row_config", "shard_configs", "shard_key", "split"]


@lru_cache(maxsize=1024)
def shard_configs(config: LimitConfig) -> tuple[LimitConfig, ...]:
    """Return the configs of ``config``'s shards, all alike: an equal share of everything."""
    shards = config.shards
    shard = replace(
        config,
        rate=config.rate // shards,
        capacity=config.capacity // shards,
        max_reserved=None if config.max_reserved is None else config.max_reserved // shards,
        shards=1,
    )
    return (shard,) * shards


def row_config(config: LimitConfig) -> LimitConfig:
    """Return the config that each stored row (or key) of ``config`` reads under."""
    return config if config.shards == 1 else shard_configs(config)[0]


def shard_key(key: EncodedKey, index: int, shards: int) -> EncodedKey:
    """Return the key under which shard ``index`` of ``key`` is stored.

    The digest keeps the key's first 16 hex digits, which the Redis backend uses as the
    hash tag: a call that takes from two shards stays in one Redis Cluster slot.
    """
    suffix = hashlib.sha256(f"{key.digest}/{index}".encode()).hexdigest()
    return EncodedKey(key.digest[:16] + suffix[16:], f"[shard {index + 1}/{shards}] {key.label}"[:LABEL_LENGTH])


def key_buckets(config: LimitConfig, key: EncodedKey) -> list[tuple[LimitConfig, EncodedKey]]:
    """Return the buckets that hold ``key`` of ``config``: itself, or each of its shards."""
    if config.shards == 1:
        return [(config, key)]
    return [(shard, shard_key(key, index, config.shards)) for index, shard in enumerate(shard_configs(config))]


def pick_two(shards: int, rng: random.Random | None = None) -> tuple[int, int]:
    """Return two distinct shard indexes, uniformly at random."""
    first, second = (rng or random).sample(range(shards), 2)
    return first, second


def split(count: int, reserve: bool, first: tuple[int, int], second: tuple[int, int]) -> list[tuple[int, int]]:
    """Plan a call of ``count`` micro-tokens on two shards, each given as (index, value now).

    Returns the (shard index, micro-tokens) parts to take, all or nothing: the whole
    count from the fuller shard when it holds it (or when even both could not, so that
    the denial's wait is the fuller shard's); otherwise all that the fuller holds and
    the rest from the other. Reservations go to the fuller shard whole.
    """
    (fuller, fuller_value), (other, other_value) = sorted((first, second), key=lambda shard: -shard[1])
    if reserve or fuller_value >= count or fuller_value + other_value < count:
        return [(fuller, count)]
    # Here 0 < fuller_value < count and the other shard holds the rest.
    return [(fuller, fuller_value), (other, count - fuller_value)]
