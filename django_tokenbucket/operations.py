"""What the admin and the command do with stored buckets, on any backend.

Each operation goes through the capabilities a backend declares (``BaseBackend``:
``lists_buckets``, ``counts_cheaply``, ``keeps_rows``, ``needs_cleanup``), so neither
the admin nor the command knows how a store keeps its buckets. A key typed by an
operator is found in each of its limit's shards (``shards.key_buckets``); a digest
prefix in pages of the limit's listing. Store failures are raised as
``BackendError``; an operation a backend does not offer as NotImplementedError, whose
message names the backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from . import deny_cache
from .api import limiter
from .backends import backend_aliases, get_backend, row_backend
from .backends.base import BaseBackend, BucketPage, Request, StoredBucket
from .keys import EncodedKey
from .limits import LimitConfig
from .live import FULL, LIMITED, PARTIAL, LiveState, live_state, one_token
from .registry import KnownLimit
from .shards import key_buckets

__all__ = [
    "DIGEST_PREFIX_LENGTH",
    "count_stored",
    "counts_by_state",
    "find_by_digest",
    "is_stored",
    "key_state",
    "pages",
    "reset_all",
    "reset_buckets",
    "reset_key",
    "set_tokens",
    "store_of",
    "uncounted_reason",
]

#: The shortest digest prefix an operator may give for one key.
DIGEST_PREFIX_LENGTH = 8


# Every write an operator makes goes through these, so that this process' deny cache
# forgets the keys at once (other processes forget within DENY_CACHE's MAX_AGE).


def reset_buckets(backend: BaseBackend, name: str, digests: list[str]) -> int:
    """Forget the stored buckets of ``name`` with these digests (``BaseBackend.reset_buckets``)."""
    try:
        return backend.reset_buckets(name, digests)
    finally:
        for digest in digests:
            deny_cache.forget(name, digest)


def reset_all(backend: BaseBackend, limit: LimitConfig, **options: Any) -> int:
    """Forget every stored bucket of ``limit`` (``BaseBackend.reset_all``)."""
    try:
        return backend.reset_all(limit, **options)
    finally:
        deny_cache.forget_limit(limit.name)


def reset_key(backend: BaseBackend, limit: LimitConfig, key: EncodedKey) -> None:
    """Forget ``key``'s buckets of ``limit``, in each of its shards (``BaseBackend.reset``)."""
    try:
        for config, part in key_buckets(limit, key):
            backend.reset(config, part)
    finally:
        deny_cache.forget(limit.name, key.digest)


def set_tokens(backend: BaseBackend, limit: LimitConfig, digest: str, value: int) -> tuple[int, int] | None:
    """Make the stored bucket ``digest`` hold ``value`` micro-tokens (``BaseBackend.set_tokens``)."""
    try:
        return backend.set_tokens(limit, digest, value)
    finally:
        deny_cache.forget(limit.name, digest)


def store_of(limit: LimitConfig, database: str | None = None) -> BaseBackend:
    """Return the backend holding ``limit``'s buckets: its own, or the rows of ``database``."""
    return limiter.backend(limit) if database is None else row_backend(database)


def pages(backend: BaseBackend, limit: LimitConfig, **listing: Any) -> Iterator[BucketPage]:
    """Every page of ``limit``'s stored buckets (``list_buckets`` arguments in ``listing``)."""
    cursor = None
    while True:
        page = backend.list_buckets(limit, cursor=cursor, **listing)
        yield page
        if page.cursor is None:
            return
        cursor = page.cursor


def find_by_digest(
    backend: BaseBackend, limit: LimitConfig, prefix: str, *, at_most: int = 2
) -> tuple[list[StoredBucket], int]:
    """Return up to ``at_most`` stored buckets of ``limit`` whose digest starts with
    ``prefix`` (lowercase hex), and the store's time."""
    found: list[StoredBucket] = []
    now = 0
    for page in pages(backend, limit, digest_prefix=prefix, page_size=at_most):
        found += page.buckets
        now = page.now
        if len(found) >= at_most:
            break
    return found[:at_most], now


def is_stored(backend: BaseBackend, limit: LimitConfig, key: EncodedKey) -> bool | None:
    """Whether ``key`` has a stored bucket (in any shard); None when the backend cannot say."""
    if not backend.lists_buckets:
        return None
    parts = key_buckets(limit, key)
    return any(backend.list_buckets(config, digest_prefix=part.digest).buckets for config, part in parts)


def key_state(backend: BaseBackend, limit: LimitConfig, key: EncodedKey) -> LiveState:
    """Read ``key``'s state now, deciding nothing: a sharded limit's is the sum of its shards'."""
    buckets = key_buckets(limit, key)
    probe = backend.decide([Request(config, part, 0, reserve=True) for config, part in buckets], apply=False)
    value = sum(decision.value for decision in probe.decisions)
    wait = 0
    if value < one_token(limit):
        # The next token of the limit is the first one any of its buckets gets back.
        nexts = backend.decide([Request(config, part, one_token(config)) for config, part in buckets], apply=False)
        wait = min((d.retry_after for d in nexts.decisions if d.retry_after is not None), default=0)
    return LiveState(
        value=value,
        capacity=limit.capacity,
        full_after=max(decision.full_after for decision in probe.decisions),
        next_token_after=wait,
        now=probe.now,
        threshold=one_token(limit),
    )


def counts_by_state(backend: BaseBackend, limit: LimitConfig) -> dict[str, int]:
    """Return ``limit``'s buckets ``stored`` and how many are limited, partially used and
    full now: from an index where the store keeps one, else read page by page."""
    if backend.counts_cheaply:
        return backend.count_by_state([limit], backend.store_now(), only=[limit.name]).get(limit.name, {})
    counts = {"stored": 0, LIMITED: 0, PARTIAL: 0, FULL: 0}
    for page in pages(backend, limit):
        for bucket in page.buckets:
            counts["stored"] += 1
            counts[live_state(limit, bucket.state, bucket.digest, page.now).state] += 1
    return counts


def uncounted_reason(backend: BaseBackend) -> str:
    """Why ``backend``'s buckets are not counted in listings."""
    return f"stored keys not counted ({type(backend).__name__} cannot list them)"


def count_stored(limits: dict[str, KnownLimit], database: str | None = None) -> dict[str, int | str]:
    """Return the stored buckets by limit name, every backend counting its own limits,
    and the rows of names no limit here knows; a backend that cannot list its buckets
    gets ``uncounted_reason`` instead of a number. With ``database``, the rows stored
    there, by name."""
    if database is not None:
        return dict(row_backend(database).stored_names())
    counts: dict[str, int | str] = {}
    for alias in backend_aliases():
        configs = [known.config for known in limits.values() if known.config.backend == alias]
        backend = get_backend(alias)
        if not configs:
            continue
        if backend.lists_buckets:
            counts.update(backend.count_buckets(configs))
        else:
            counts.update((config.name, uncounted_reason(backend)) for config in configs)
    counts.update((name, rows) for name, rows in row_backend().stored_names().items() if name not in limits)
    return counts
