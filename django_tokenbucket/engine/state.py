"""What is stored for a key, read and changed: a limit's state now, a reset, a refund.

Plans (``steps.Steps``) that both drivers run. A reset and a refund make a remembered
denial wrong, so both forget the key in the deny cache, before and after.
"""

from __future__ import annotations

from dataclasses import replace

from django.db import transaction

from .. import clock, deny_cache, overrides
from ..algorithms import Decision
from ..backends.base import Request
from ..keys import EncodedKey
from ..limits import LimitConfig
from ..shards import key_buckets, shard_configs, shard_key
from ..status import Status
from .rules import in_force
from .sharding import read_shards
from .statuses import decided
from .steps import Decide, Refund, Reset, Steps
from .stores import Stores

__all__ = ["read", "refunded", "reset"]


def read(limit: LimitConfig, encoded: EncodedKey, key: object) -> Steps[Status]:
    """The state of ``limit`` for ``key`` now, as the Status of a zero-token call."""
    # The bucket is read under the numbers in force; an exemption or a block says what a
    # call would get, beside what the bucket holds.
    limit, rule = in_force(limit, encoded.digest)
    if limit.shards > 1:
        status = yield from _shards_status(limit, encoded, key, 0)
    else:
        # Reading has nothing to allow, so a failed store is an error even with FAIL_OPEN.
        outcome = yield Decide(limit, [Request(limit, encoded, 0)], apply=False, fail_open=False)
        assert outcome is not None
        status = decided(limit, key, 0, outcome.decisions[0], outcome.now)
    if rule is None:
        return status
    if rule.action == overrides.BLOCK:
        shadow = limit.shadow
        wait = rule.wait(clock.app_now())
        return replace(status, ok=shadow, would_deny=shadow, retry_after=wait, override=rule.action)
    return replace(status, override=rule.action)


def reset(stores: Stores, limit: LimitConfig, encoded: EncodedKey) -> Steps[None]:
    """Forget the state of ``limit`` (each of its shards) for ``encoded``."""
    # Before, so that no call of this process answers from memory meanwhile; after, so
    # that a denial decided while the reset was under way is not kept.
    deny_cache.forget(limit.name, encoded.digest)
    try:
        for bucket, part in key_buckets(limit, encoded):
            yield Reset(limit, bucket, part)
    finally:
        _forget(stores, limit, encoded)


def refunded(stores: Stores, limit: LimitConfig, encoded: EncodedKey, amount: int, key: object) -> Steps[Status]:
    """Refund ``amount`` micro-tokens; a sharded limit's go to its shards with the most room first.

    Each shard gets at most its capacity back, as a refund to one bucket is capped.
    """
    # Capped at the capacity in force.
    limit, _rule = in_force(limit, encoded.digest)
    # As ``reset`` does: tokens given back make a remembered denial wrong.
    deny_cache.forget(limit.name, encoded.digest)
    try:
        return (yield from _refunded_now(limit, encoded, amount, key))
    finally:
        _forget(stores, limit, encoded)


def _forget(stores: Stores, limit: LimitConfig, encoded: EncodedKey) -> None:
    """Forget a key given tokens back, now and, inside a transaction, when it commits:
    until then other connections read the bucket as it was, and a denial this process
    learns from them meanwhile would outlive the commit."""
    deny_cache.forget(limit.name, encoded.digest)
    alias = stores.backend(limit).database_alias()
    if alias is not None and transaction.get_connection(alias).in_atomic_block:
        transaction.on_commit(lambda: deny_cache.forget(limit.name, encoded.digest), using=alias)


def _refunded_now(limit: LimitConfig, encoded: EncodedKey, amount: int, key: object) -> Steps[Status]:
    if limit.shards == 1:
        outcome = yield Refund(limit, limit, encoded, amount)
        return decided(limit, key, amount, outcome.decisions[0], outcome.now)
    shards = shard_configs(limit)
    read_now = (yield from read_shards(limit, encoded)).decisions
    left = amount
    rooms = sorted(((shards[i].capacity - read_now[i].value, i) for i in range(limit.shards)), reverse=True)
    for room, index in rooms:
        if left <= 0 or room <= 0:
            break
        given = min(room, left)
        yield Refund(limit, shards[index], shard_key(encoded, index, limit.shards), given)
        left -= given
    return (yield from _shards_status(limit, encoded, key, amount))


def _shards_status(limit: LimitConfig, encoded: EncodedKey, key: object, count: int) -> Steps[Status]:
    """Return a sharded limit's state from all of its shards: its value is their sum."""
    outcome = yield from read_shards(limit, encoded)
    decisions = outcome.decisions
    total = Decision(True, sum(d.value for d in decisions), None, max(d.full_after for d in decisions), None)
    return decided(limit, key, count, total, outcome.now)
