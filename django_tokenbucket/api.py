"""The public API: ``limiter.limit``, ``check``, ``reset``, ``get_value`` and friends."""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from fractions import Fraction
from typing import TYPE_CHECKING, Any, TypeVar, Union

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from . import analytics, clock, deny_cache, hints, metrics, overrides, registry, signals, waits
from .algorithms import MICRO, Decision
from .backends import get_backend
from .backends.base import BackendError, BaseBackend, Outcome, Request, made_request
from .exceptions import BackendUnavailable, RateLimited
from .keys import EncodedKey, encode_key
from .limits import LimitConfig, count_to_micro, freeze, parse_limit
from .logs import denial_log, throttled_logger
from .overrides import Override
from .rates import to_fraction
from .settings import tokenbucket_settings
from .shards import key_buckets, pick_two, shard_configs, shard_key, split
from .status import MultiStatus, Status

if TYPE_CHECKING:
    from .models import LimitOverride

__all__ = ["LimitRequest", "Limiter", "limiter"]

logger = logging.getLogger("django_tokenbucket")

ConfigSpec = Union[str, Mapping[str, Any]]


@dataclass(frozen=True)
class LimitRequest:
    """One limit in a ``limit_many`` / ``check_many`` call."""

    name: str
    key: object = None
    count: int | float = 1
    reserve: bool = False
    config: ConfigSpec | LimitConfig | None = None


def limit_request(name: str, key: object, count: int | float, config: LimitConfig) -> LimitRequest:
    """``LimitRequest(name, key, count, config=config)``, for a caller that makes one per
    request (a DRF throttle): the ``__init__`` of a frozen dataclass sets each field
    through ``object.__setattr__``, three times the cost. tests/test_fast_path.py keeps
    the two equal."""
    made: LimitRequest = object.__new__(LimitRequest)
    made.__dict__.update(name=name, key=key, count=count, reserve=False, config=config)
    return made


@dataclass(frozen=True)
class _Decide:
    """A step of a plan: decide ``requests`` on the backend of ``limit``."""

    limit: LimitConfig
    requests: list[Request]
    apply: bool
    #: None: ``FAIL_OPEN`` says what a failed store means; False: it is an error.
    fail_open: bool | None = None


@dataclass(frozen=True)
class _Reset:
    """A step of a plan: forget ``bucket`` (the limit, or one of its shards) for ``key``."""

    limit: LimitConfig
    bucket: LimitConfig
    key: EncodedKey


@dataclass(frozen=True)
class _Refund:
    """A step of a plan: give ``amount`` micro-tokens back to ``bucket`` for ``key``."""

    limit: LimitConfig
    bucket: LimitConfig
    key: EncodedKey
    amount: int


_Step = Union[_Decide, _Reset, _Refund]
T = TypeVar("T")
#: A plan: yields steps, receives each one's answer (an Outcome, or None when the store
#: failed and the call goes through), returns the result.
Steps = Generator[_Step, Any, T]


#: Passed as a decision's ``rule`` for "look the key's override up" (the default), as
#: opposed to one the caller already applied (``acquire``) or None.
_LOOK_UP = Override("", "", "")

_inline_cache: dict[Any, LimitConfig] = {}
_INLINE_CACHE_SIZE = 1024


def _parse_inline(name: str, config: ConfigSpec) -> LimitConfig:
    """Parse an inline config, remembering the result: decorators pass the same one on every call."""
    try:
        cache_key = (name, freeze(config))
        hash(cache_key)
    except TypeError:
        return parse_limit(name, config)
    limit = _inline_cache.get(cache_key)
    if limit is None:
        if len(_inline_cache) >= _INLINE_CACHE_SIZE:
            _inline_cache.clear()
        limit = _inline_cache[cache_key] = parse_limit(name, config)
        # Remembered so that the admin, the command and cleanup can interpret its rows.
        registry.record_inline(limit)
    return limit


class Limiter:
    """Decide rate limits against the configured backend.

    Every method takes the limit's ``name`` (an entry of ``TOKENBUCKET["LIMITS"]``, or
    any name with an inline ``config``) and a ``key`` (None for one global bucket; a
    str, bytes, int, or a tuple of these).

    ``limiter`` decides each limit on its backend (the alias in its ``"backend"``,
    ``"default"`` unless it says otherwise); ``Limiter(backend)`` decides every limit on
    that one (the django-ratelimit compatibility layer uses one per
    ``RATELIMIT_USE_CACHE``).
    """

    def __init__(self, backend: BaseBackend | None = None) -> None:
        self._own_backend = backend
        #: The ``backend`` label of every figure when this limiter has a backend of its own.
        self._own_label = None if backend is None else type(backend).__name__

    def backend(self, limit: LimitConfig | None = None) -> BaseBackend:
        """Return the backend that decides ``limit`` (by default, the default alias's)."""
        if self._own_backend is not None:
            return self._own_backend
        return get_backend() if limit is None else get_backend(limit.backend)

    def resolve(self, name: str, config: ConfigSpec | LimitConfig | None = None) -> LimitConfig:
        """Return the parsed config of ``name``; raise ImproperlyConfigured if unknown or invalid.

        Without ``config``, ``name`` is looked up in ``LIMITS``, then among the limits the
        command and the admin know (``registry.known_limits``: DRF throttle scopes, inline
        limits). ``config`` may be one this method returned before, for a caller (a DRF
        throttle) that decides the same inline limit on every request.
        """
        if isinstance(config, LimitConfig):
            return config
        if config is not None:
            return _parse_inline(name, config)
        limits = tokenbucket_settings.limits()
        try:
            return limits[name]
        except (KeyError, TypeError):
            pass
        # A DRF throttle scope, or a limit a view declares inline: the command and the
        # admin know these, so a reset or a read from Python must know them too.
        others = registry.known_limits(as_rows=False) if isinstance(name, str) else {}
        if name in others:
            return others[name].config
        known = ", ".join(sorted(map(repr, {**others, **limits}))) or "none"
        raise ImproperlyConfigured(
            f"unknown rate limit {name!r}: not in TOKENBUCKET['LIMITS'], not declared inline by a view, and not a "
            f"DRF throttle scope (known: {known}); define it in LIMITS or pass config=..."
        )

    # -- deciding ------------------------------------------------------------------------
    #
    # Every method has an async twin (``alimit`` for ``limit``...) with the same result.
    # Both run one plan, written once as a generator that yields what it needs from a
    # backend (``_Decide``, ``_Reset``, ``_Refund``) and receives the answer: ``_drive``
    # answers with the backend's blocking methods, ``_adrive`` with its asyncio ones.

    def limit(
        self,
        name: str,
        key: object = None,
        count: int | float = 1,
        reserve: bool = False,
        throws: bool = False,
        config: ConfigSpec | None = None,
    ) -> Status:
        """Take ``count`` tokens from limit ``name`` for ``key`` if they are there.

        Returns a Status; a denied call changes nothing. With ``reserve=True`` the
        tokens may be taken ahead of time (up to ``max_reserved``), and
        ``status.retry_after`` says when they exist. With ``throws=True`` a denial
        raises RateLimited instead of returning ``ok=False``.
        """
        if settings.DEBUG:
            hints.note_key(name, key)
        return self._decide_one(name, key, count, reserve, config, apply=True, throws=throws)

    async def alimit(
        self,
        name: str,
        key: object = None,
        count: int | float = 1,
        reserve: bool = False,
        throws: bool = False,
        config: ConfigSpec | None = None,
    ) -> Status:
        """``limit()`` for async code."""
        if settings.DEBUG:
            hints.note_key(name, key)
        return await self._adrive(self._one(name, key, count, reserve, config, apply=True, throws=throws))

    def check(
        self,
        name: str,
        key: object = None,
        count: int | float = 1,
        reserve: bool = False,
        throws: bool = False,
        config: ConfigSpec | None = None,
    ) -> Status:
        """Return what ``limit()`` would return with the same arguments, changing nothing."""
        return self._decide_one(name, key, count, reserve, config, apply=False, throws=throws)

    async def acheck(
        self,
        name: str,
        key: object = None,
        count: int | float = 1,
        reserve: bool = False,
        throws: bool = False,
        config: ConfigSpec | None = None,
    ) -> Status:
        """``check()`` for async code."""
        return await self._adrive(self._one(name, key, count, reserve, config, apply=False, throws=throws))

    def limit_many(
        self, requests: Iterable[LimitRequest | Sequence[Any]], *, throws: bool = False
    ) -> MultiStatus:
        """Take tokens from several limits all-or-nothing: one denial consumes none.

        ``requests`` are LimitRequest objects or ``(name, key[, count])`` tuples.
        """
        return self._decide_many([self._as_request(r) for r in requests], apply=True, throws=throws)

    async def alimit_many(
        self, requests: Iterable[LimitRequest | Sequence[Any]], *, throws: bool = False
    ) -> MultiStatus:
        """``limit_many()`` for async code."""
        return await self._adrive(self._many([self._as_request(r) for r in requests], apply=True, throws=throws))

    def check_many(
        self, requests: Iterable[LimitRequest | Sequence[Any]], *, throws: bool = False
    ) -> MultiStatus:
        """Return what ``limit_many()`` would, changing nothing."""
        return self._decide_many([self._as_request(r) for r in requests], apply=False, throws=throws)

    async def acheck_many(
        self, requests: Iterable[LimitRequest | Sequence[Any]], *, throws: bool = False
    ) -> MultiStatus:
        """``check_many()`` for async code."""
        return await self._adrive(self._many([self._as_request(r) for r in requests], apply=False, throws=throws))

    def get_value(self, name: str, key: object = None, config: ConfigSpec | None = None) -> float:
        """Return the tokens available now (negative while reserved ahead)."""
        return self.get_status(name, key, config=config).value  # type: ignore[return-value]

    async def aget_value(self, name: str, key: object = None, config: ConfigSpec | None = None) -> float:
        """``get_value()`` for async code."""
        return (await self.aget_status(name, key, config=config)).value  # type: ignore[return-value]

    def get_status(self, name: str, key: object = None, config: ConfigSpec | None = None) -> Status:
        """Return the state of a limit now, as a Status of a zero-token call."""
        return self._drive(self._state_now(name, key, config))

    async def aget_status(self, name: str, key: object = None, config: ConfigSpec | None = None) -> Status:
        """``get_status()`` for async code."""
        return await self._adrive(self._state_now(name, key, config))

    def reset(self, name: str, key: object = None, config: ConfigSpec | None = None) -> None:
        """Forget the state of ``name`` for ``key``: it starts full again."""
        self._drive(self._reset(name, key, config))

    async def areset(self, name: str, key: object = None, config: ConfigSpec | None = None) -> None:
        """``reset()`` for async code."""
        await self._adrive(self._reset(name, key, config))

    def refund(
        self, name: str, key: object = None, count: int | float = 1, config: ConfigSpec | None = None
    ) -> Status:
        """Give ``count`` unused tokens back to limit ``name`` for ``key``, up to its capacity.

        For work that reserved more than it used (an LLM call that reserved 4,000 tokens
        and used 1,200 returns 2,800). The limit refills up to now first, so a refund
        restores exactly the state it would have had without the returned tokens.
        Inside a transaction on the database backend the refund joins it, as
        consumption does. Returns the state after the refund, as ``get_status`` would.
        Nothing prevents refunding twice: ``django_tokenbucket.celery`` keeps that
        bookkeeping for reservations. A backend that cannot return tokens raises
        NotImplementedError; a failed store raises BackendUnavailable, whatever
        ``FAIL_OPEN`` says, since there is nothing to allow.
        """
        limit, amount = self._refund_amount(name, count, config)
        return self._drive(self._refunded(limit, self.encode_for(limit, key), amount, key))

    async def arefund(
        self, name: str, key: object = None, count: int | float = 1, config: ConfigSpec | None = None
    ) -> Status:
        """``refund()`` for async code."""
        limit, amount = self._refund_amount(name, count, config)
        return await self._adrive(self._refunded(limit, self.encode_for(limit, key), amount, key))

    def acquire(
        self,
        name: str,
        key: object = None,
        count: int | float = 1,
        timeout: float | None = None,
        config: ConfigSpec | None = None,
    ) -> Status:
        """Reserve ``count`` tokens and sleep until they exist; return the reservation's Status.

        For code that must wait rather than be refused: a script, a thread, a worker
        calling a paid API. Reservations are served in the order they are made: each
        waits for the tokens reserved before it, then for its own. The sleep releases
        the GIL. With ``timeout`` (seconds), a call whose wait would pass it takes
        nothing and raises RateLimited, whose ``retry_after`` says when the same call
        would wait no longer; ``max_reserved`` bounds the wait too. A count that no wait
        within ``timeout`` could cover raises ValueError. A shadow limit never waits.
        A sleep that an exception interrupts (a signal handler: Celery's soft time
        limit) gives the reserved tokens back.
        """
        overrides.refresh_if_due()
        limit, rule = self._acquiring(name, key, count, timeout, config)
        if limit.shards > 1:
            status = self._drive(self._one(name, key, count, True, limit, apply=True, throws=True, rule=rule))
        else:
            status = self._decide_unsharded(limit, key, count, True, apply=True, throws=True, rule=rule)
        wait = _wait_for(limit, status)
        if wait:
            # Interrupted (a signal handler raising), the reservation is given back.
            waits.slept(wait, status, lambda _: self.refund(name, key, count, config))
        return status

    async def aacquire(
        self,
        name: str,
        key: object = None,
        count: int | float = 1,
        timeout: float | None = None,
        config: ConfigSpec | None = None,
    ) -> Status:
        """``acquire()`` for async code: it awaits, never blocking the event loop.

        Cancelled at any point (a client gone from an async view), it gives back what it
        reserved, once (``django_tokenbucket.waits``).
        """
        await overrides.arefresh_if_due()
        limit, rule = self._acquiring(name, key, count, timeout, config)
        decide = self._adrive(self._one(name, key, count, True, limit, apply=True, throws=True, rule=rule))
        # Cancelled anywhere (a client gone from an async view), what it reserved goes back.
        return await waits.aacquired(
            decide, lambda status: _wait_for(limit, status), lambda _: self.arefund(name, key, count, config)
        )

    def _acquiring(
        self, name: str, key: object, count: int | float, timeout: float | None, config: ConfigSpec | None
    ) -> tuple[LimitConfig, Override | None]:
        """Return the limit to reserve from, the key's override applied and its
        ``max_reserved`` lowered to what ``timeout`` repays, and the override.

        The override is applied here, before the bound: applied after it, an override's
        own ``max_reserved`` would replace the bound.
        """
        base = self.resolve(name, config)
        limit, rule = _ruled(base, overrides.lookup(base.name, self.encode_for(base, key).digest))
        micro, fits = _count_in_force(base, limit, count, True)
        if not fits:
            assert rule is not None
            refused = _overridden(limit, key, micro, rule, clock.app_now(), refused=True)
            raise RateLimited(refused.name, refused.key, refused.retry_after, refused)
        if timeout is None or (rule is not None and rule.action != overrides.LIMIT):
            return limit, rule
        try:
            wait = to_fraction(timeout, "timeout")
        except ValueError as exc:
            raise ValueError(f"rate limit {limit.name!r}: {exc}") from None
        if wait < 0:
            raise ValueError(f"rate limit {limit.name!r}: timeout must not be negative, not {timeout!r}")
        bounded = limit.reserving_within(int(wait * MICRO))
        micro = count_to_micro(count)
        if bounded.max_count is not None and micro > bounded.max_count:
            raise ValueError(
                f"rate limit {limit.name!r}: count {count!r} cannot be acquired within timeout {timeout!r}: "
                f"even a full bucket ({limit.capacity_tokens:g}) would leave a wait longer than that"
            )
        return bounded, rule

    # -- overrides -------------------------------------------------------------------
    #
    # Changes to a limit made while the site runs, stored as LimitOverride rows and seen
    # by every process within OVERRIDES["MAX_AGE"] (this one at once): see
    # django_tokenbucket.overrides. ``key`` None means every key of the limit.

    def override(
        self,
        name: str,
        key: object = None,
        *,
        rate: str | int | float | Fraction | None = None,
        period: int | float | timedelta | None = None,
        capacity: int | float | None = None,
        max_reserved: int | float | None = None,
        until: datetime | timedelta | None = None,
        reason: str = "",
        created_by: str = "",
    ) -> LimitOverride:
        """Replace some of limit ``name``'s numbers for ``key`` (None: every key) until ``until``.

        ``rate`` is a rate string (``"100/m"``) or tokens per ``period`` (by default the
        limit's); numbers not given keep the limit's, except a capacity equal to the
        rate, which follows a new rate. The bucket's state is reinterpreted, as when
        LIMITS changes. ``until`` is a datetime or a timedelta from now (None: until
        cleared). Replaces any override of the same key; returns the LimitOverride.
        ValueError names the limit when the numbers are not a limit that can admit a
        call, ImproperlyConfigured when the limit is unknown.
        """
        limit = self.resolve(name)
        numbers = overrides.numbers(limit, rate, period, capacity, max_reserved)
        return overrides.make(
            limit.name, key, overrides.LIMIT, numbers, until=until, reason=reason, created_by=created_by
        )

    def exempt(
        self,
        name: str,
        key: object = None,
        *,
        until: datetime | timedelta | None = None,
        reason: str = "",
        created_by: str = "",
    ) -> LimitOverride:
        """Let every call of limit ``name`` for ``key`` (None: every key) through until ``until``.

        An exempt call takes no tokens and its status says ``override="exempt"``.
        """
        return overrides.make(
            self._override_name(name), key, overrides.EXEMPT, until=until, reason=reason, created_by=created_by
        )

    def block(
        self,
        name: str,
        key: object = None,
        *,
        until: datetime | timedelta | None = None,
        reason: str = "",
        created_by: str = "",
    ) -> LimitOverride:
        """Refuse every call of limit ``name`` for ``key`` (None: every key) until ``until``.

        A blocked call takes no tokens; its ``retry_after`` is the time until the block
        ends (None when it never does).
        """
        return overrides.make(
            self._override_name(name), key, overrides.BLOCK, until=until, reason=reason, created_by=created_by
        )

    def clear_override(self, name: str, key: object = None) -> int:
        """Remove the override of limit ``name`` for ``key`` (None: the one of every key).

        Returns how many were removed (0 or 1). The limit need not be configured any more.
        """
        if not isinstance(name, str):
            raise ValueError(f"a rate limit name must be a str, not {name!r}")
        return overrides.delete(name, overrides.key_digest(name, key).digest)

    def overrides(self, name: str | None = None) -> list[LimitOverride]:
        """Return the overrides in force (not expired), of limit ``name`` or of all, by limit and key."""
        return overrides.in_force(name)

    async def aoverride(
        self,
        name: str,
        key: object = None,
        *,
        rate: str | int | float | Fraction | None = None,
        period: int | float | timedelta | None = None,
        capacity: int | float | None = None,
        max_reserved: int | float | None = None,
        until: datetime | timedelta | None = None,
        reason: str = "",
        created_by: str = "",
    ) -> LimitOverride:
        """``override()`` for async code."""
        return await sync_to_async(self.override)(
            name,
            key,
            rate=rate,
            period=period,
            capacity=capacity,
            max_reserved=max_reserved,
            until=until,
            reason=reason,
            created_by=created_by,
        )

    async def aexempt(
        self,
        name: str,
        key: object = None,
        *,
        until: datetime | timedelta | None = None,
        reason: str = "",
        created_by: str = "",
    ) -> LimitOverride:
        """``exempt()`` for async code."""
        return await sync_to_async(self.exempt)(name, key, until=until, reason=reason, created_by=created_by)

    async def ablock(
        self,
        name: str,
        key: object = None,
        *,
        until: datetime | timedelta | None = None,
        reason: str = "",
        created_by: str = "",
    ) -> LimitOverride:
        """``block()`` for async code."""
        return await sync_to_async(self.block)(name, key, until=until, reason=reason, created_by=created_by)

    async def aclear_override(self, name: str, key: object = None) -> int:
        """``clear_override()`` for async code."""
        return await sync_to_async(self.clear_override)(name, key)

    async def aoverrides(self, name: str | None = None) -> list[LimitOverride]:
        """``overrides()`` for async code."""
        return await sync_to_async(self.overrides)(name)

    def _override_name(self, name: str) -> str:
        """The name an exemption or a block is saved under: a limit's, or that of a view's
        ``@ratelimit(rate=callable)``, whose override reaches the bucket of every plan.

        ImproperlyConfigured when it is neither.
        """
        try:
            return self.resolve(name).name
        except ImproperlyConfigured:
            if isinstance(name, str) and name in registry.plan_bases():
                return name
            raise

    # -- internals -------------------------------------------------------------------

    def refund_encoded(self, limit: LimitConfig, encoded: EncodedKey, amount: int, key: object) -> Status:
        """Refund ``amount`` micro-tokens of a parsed limit to a key already encoded.

        For code that keeps only a key's stored form, as reservations do (their rows hold
        the digest, not the key): ``key`` is what the returned Status reports.
        """
        return self._drive(self._refunded(limit, encoded, amount, key))

    def _refund_amount(self, name: str, count: int | float, config: ConfigSpec | None) -> tuple[LimitConfig, int]:
        limit = self.resolve(name, config)
        try:
            return limit, count_to_micro(count)
        except ValueError as exc:
            raise ValueError(f"rate limit {limit.name!r}: {exc}") from None

    def _state_now(self, name: str, key: object, config: ConfigSpec | None) -> Steps[Status]:
        limit = self.resolve(name, config)
        encoded = self.encode_for(limit, key)
        # The bucket is read under the numbers in force; an exemption or a block says
        # what a call would get, beside what the bucket holds.
        limit, rule = _ruled(limit, overrides.lookup(limit.name, encoded.digest))
        if limit.shards > 1:
            status = yield from self._shards_status(limit, encoded, key, 0)
        else:
            # Reading has nothing to allow, so a failed store is an error even with FAIL_OPEN.
            outcome = yield _Decide(limit, [Request(limit, encoded, 0)], apply=False, fail_open=False)
            assert outcome is not None
            status = self._status(limit, key, 0, outcome.decisions[0], outcome.now)
        if rule is None:
            return status
        if rule.action == overrides.BLOCK:
            shadow = limit.shadow
            wait = rule.wait(clock.app_now())
            return replace(status, ok=shadow, would_deny=shadow, retry_after=wait, override=rule.action)
        return replace(status, override=rule.action)

    def _shards_status(self, limit: LimitConfig, encoded: EncodedKey, key: object, count: int) -> Steps[Status]:
        """Return a sharded limit's state from all of its shards: its value is their sum."""
        outcome = yield from self._read_shards(limit, encoded)
        decisions = outcome.decisions
        total = Decision(True, sum(d.value for d in decisions), None, max(d.full_after for d in decisions), None)
        return self._status(limit, key, count, total, outcome.now)

    def _read_shards(self, limit: LimitConfig, encoded: EncodedKey) -> Steps[Outcome]:
        request = Request(limit, encoded, 0)
        reads = [_shard_request(request, index, 0) for index in range(limit.shards)]
        outcome = yield _Decide(limit, reads, apply=False, fail_open=False)
        assert outcome is not None
        return outcome  # type: ignore[no-any-return]

    def _reset(self, name: str, key: object, config: ConfigSpec | None) -> Steps[None]:
        limit = self.resolve(name, config)
        encoded = self.encode_for(limit, key)
        # Before, so that no call of this process answers from memory meanwhile; after,
        # so that a denial decided while the reset was under way is not kept.
        deny_cache.forget(limit.name, encoded.digest)
        try:
            for bucket, part in key_buckets(limit, encoded):
                yield _Reset(limit, bucket, part)
        finally:
            self._forget(limit, encoded)

    def _refunded(self, limit: LimitConfig, encoded: EncodedKey, amount: int, key: object) -> Steps[Status]:
        """Refund ``amount`` micro-tokens; a sharded limit's go to its shards with the most room first.

        Each shard gets at most its capacity back, as a refund to one bucket is capped.
        """
        # Capped at the capacity in force.
        limit, _rule = _ruled(limit, overrides.lookup(limit.name, encoded.digest))
        # As ``_reset`` does: tokens given back make a remembered denial wrong.
        deny_cache.forget(limit.name, encoded.digest)
        try:
            return (yield from self._refunded_now(limit, encoded, amount, key))
        finally:
            self._forget(limit, encoded)

    def _forget(self, limit: LimitConfig, encoded: EncodedKey) -> None:
        """Forget a key given tokens back, now and, inside a transaction, when it commits:
        until then other connections read the bucket as it was, and a denial this process
        learns from them meanwhile would outlive the commit."""
        deny_cache.forget(limit.name, encoded.digest)
        alias = self.backend(limit).database_alias()
        if alias is not None and transaction.get_connection(alias).in_atomic_block:
            transaction.on_commit(lambda: deny_cache.forget(limit.name, encoded.digest), using=alias)

    def _refunded_now(self, limit: LimitConfig, encoded: EncodedKey, amount: int, key: object) -> Steps[Status]:
        if limit.shards == 1:
            outcome = yield _Refund(limit, limit, encoded, amount)
            return self._status(limit, key, amount, outcome.decisions[0], outcome.now)
        shards = shard_configs(limit)
        read = (yield from self._read_shards(limit, encoded)).decisions
        left = amount
        rooms = sorted(((shards[i].capacity - read[i].value, i) for i in range(limit.shards)), reverse=True)
        for room, index in rooms:
            if left <= 0 or room <= 0:
                break
            given = min(room, left)
            yield _Refund(limit, shards[index], shard_key(encoded, index, limit.shards), given)
            left -= given
        return (yield from self._shards_status(limit, encoded, key, amount))

    @staticmethod
    def _as_request(item: LimitRequest | Sequence[Any]) -> LimitRequest:
        if isinstance(item, LimitRequest):
            return item
        if isinstance(item, str):
            return LimitRequest(item)
        return LimitRequest(*item)

    @staticmethod
    def encode_for(limit: LimitConfig, key: object) -> EncodedKey:
        """Return ``key``'s stored form (digest and label) for ``limit``.

        ValueError names the limit when ``key`` cannot be a key.
        """
        try:
            return encode_key(key)
        except TypeError as exc:
            raise ValueError(f"rate limit {limit.name!r}: {exc}") from None

    def _one(
        self,
        name: str,
        key: object,
        count: int | float,
        reserve: bool,
        config: ConfigSpec | LimitConfig | None,
        *,
        apply: bool,
        throws: bool,
        rule: Override | None = _LOOK_UP,
    ) -> Steps[Status]:
        """What ``_many`` does for one limit, without the lists and groups of several.

        One limit is one group (enforced or shadowed alike), applied as asked, and its
        MultiStatus would say what its only Status says. ``rule`` is the key's override
        when the caller applied it to ``config`` already (``acquire``).
        """
        limit = self._resolve_one(name, reserve, config)
        if limit.shards > 1:
            item = LimitRequest(name, key, count, reserve, limit)
            rules = None if rule is _LOOK_UP else [rule]
            statuses = yield from self._many([item], apply=apply, throws=throws, rules=rules)
            return statuses[0]
        request, ruling = self._one_request(limit, key, count, reserve, rule)
        if _settles(ruling):
            return self._one_status(request.config, key, count, request.count, ruling, apply=apply, throws=throws)
        assert not isinstance(ruling, _Outsized)
        rule = ruling
        limit = request.config
        memory = _memory_for(limit, reserve)
        if memory is not None:
            store = self.backend(limit)
            recalled = deny_cache.lookup(limit, store, request.key.digest, request.count)
            if recalled is not None:
                return self._one_status(
                    limit, key, count, request.count, recalled, apply=apply, throws=throws, rule=rule
                )
            before = deny_cache.now()
        outcome = yield _Decide(limit, [request], apply=apply)
        if memory is not None and outcome is not None:
            deny_cache.remember(memory, limit, store, request.key.digest, request.count, outcome, before)
        elif outcome is not None and apply and outcome.decisions[0].allowed:
            deny_cache.admitted(limit.name, request.key.digest)
        return self._one_status(limit, key, count, request.count, outcome, apply=apply, throws=throws, rule=rule)

    def _decide_one(
        self,
        name: str,
        key: object,
        count: int | float,
        reserve: bool,
        config: ConfigSpec | LimitConfig | None,
        *,
        apply: bool,
        throws: bool,
    ) -> Status:
        """``_drive(_one(...))``, with the backend called directly for an unsharded limit.

        That is the call on every request of most sites, and its one decision needs no
        plan: a generator, its step and their driver cost as much as the rest of this
        layer (issue 19).
        """
        limit = self._resolve_one(name, reserve, config)
        if limit.shards > 1:
            return self._drive(self._one(name, key, count, reserve, limit, apply=apply, throws=throws))
        return self._decide_unsharded(limit, key, count, reserve, apply=apply, throws=throws)

    def _decide_many(self, items: list[LimitRequest], *, apply: bool, throws: bool) -> MultiStatus:
        """``_drive(_many(...))``; one unsharded limit, what a throttle or a decorator
        usually asks for, goes as ``_decide_one`` does (``_many`` would decide it alike)."""
        if len(items) == 1:
            (item,) = items
            limit = self._resolve_one(item.name, item.reserve, item.config)
            if limit.shards == 1:
                status = self._decide_unsharded(
                    limit, item.key, item.count, item.reserve, apply=apply, throws=throws
                )
                return MultiStatus((status,))
        return self._drive(self._many(items, apply=apply, throws=throws))

    def _decide_unsharded(
        self,
        limit: LimitConfig,
        key: object,
        count: int | float,
        reserve: bool,
        *,
        apply: bool,
        throws: bool,
        rule: Override | None = _LOOK_UP,
    ) -> Status:
        """Decide one call on an unsharded limit, refreshing the overrides if due."""
        try:
            encoded = encode_key(key)
        except TypeError:
            encoded = self.encode_for(limit, key)  # raises what names the limit
        if rule is _LOOK_UP:
            # Refreshed and looked up in one call: this is every request's path.
            rule = overrides.current(limit.name, encoded.digest)
            if rule is not None:
                base = limit
                limit, rule = _ruled(limit, rule)
                micro, fits = _count_in_force(base, limit, count, reserve)
                if not fits and rule is not None:
                    return self._one_status(limit, key, count, micro, _Outsized(rule), apply=apply, throws=throws)
        request = made_request(limit, encoded, limit.validate_count(count, reserve), reserve)
        if rule is not None and rule.action != overrides.LIMIT:
            return self._one_status(limit, key, count, request.count, rule, apply=apply, throws=throws)
        limit = request.config
        store = self.backend(limit)
        memory = _memory_for(limit, reserve)
        if memory is not None:
            recalled = deny_cache.lookup(limit, store, request.key.digest, request.count)
            if recalled is not None:
                return self._one_status(
                    limit, key, count, request.count, recalled, apply=apply, throws=throws, rule=rule
                )
            before = deny_cache.now()
        recorder = metrics.active()
        started = time.perf_counter() if recorder is not None else 0.0
        try:
            outcome: Outcome | None = store.decide([request], apply=apply)
        except BackendError as exc:
            self._store_failed(_Decide(limit, [request], apply=apply), exc)
            outcome = None
        finally:
            if recorder is not None:
                # On every decision: the label as _store_label gives it, without the call.
                recorder.store_seconds(self._own_label or limit.backend, time.perf_counter() - started)
        if memory is not None and outcome is not None:
            deny_cache.remember(memory, limit, store, request.key.digest, request.count, outcome, before)
        elif outcome is not None and apply and outcome.decisions[0].allowed:
            deny_cache.admitted(limit.name, request.key.digest)
        return self._one_status(limit, key, count, request.count, outcome, apply=apply, throws=throws, rule=rule)

    def _resolve_one(self, name: str, reserve: bool, config: ConfigSpec | LimitConfig | None) -> LimitConfig:
        if not isinstance(reserve, bool):
            raise ValueError(f"rate limit {name!r}: reserve must be a bool, not {reserve!r}")
        return self.resolve(name, config)

    def _one_request(
        self, limit: LimitConfig, key: object, count: int | float, reserve: bool, rule: Override | None
    ) -> tuple[Request, Override | _Outsized | None]:
        """Return the request of one call, on ``limit`` as the key's override changes it,
        and that override (``rule``: one the caller applied already, or ``_LOOK_UP``);
        ``_Outsized`` when the count is more than the override can ever admit.

        The count is checked against the numbers in force (``_count_in_force``).
        """
        encoded = self.encode_for(limit, key)
        base = limit
        if rule is _LOOK_UP:
            found = overrides.lookup(limit.name, encoded.digest)
            # The common case, no override of this limit, costs the lookup only.
            if found is not None:
                limit, rule = _ruled(limit, found)
            else:
                rule = None
        if rule is None:
            return Request(limit, encoded, limit.validate_count(count, reserve), reserve), None
        micro, fits = _count_in_force(base, limit, count, reserve)
        return Request(limit, encoded, micro, reserve), rule if fits else _Outsized(rule)

    def _one_status(
        self,
        limit: LimitConfig,
        key: object,
        count: int | float,
        micro: int,
        outcome: Outcome | deny_cache.Recalled | Override | _Outsized | None,
        *,
        apply: bool,
        throws: bool,
        rule: Override | None = None,
    ) -> Status:
        """Return the Status of one limit's decision (None: failed open; a ``Recalled``
        denial: from memory; an Override: an exemption or a block, the store unasked;
        ``_Outsized``: refused by an override too small for it), reported and raised as
        asked. ``rule`` is the ``limit`` override decided under."""
        action = None if rule is None else rule.action
        if outcome is None:
            status = self._failed_open(limit, key, count)
        elif isinstance(outcome, Override):
            status = _overridden(limit, key, micro, outcome, clock.app_now())
        elif isinstance(outcome, _Outsized):
            status = _overridden(limit, key, micro, outcome.rule, clock.app_now(), refused=True)
        elif isinstance(outcome, deny_cache.Recalled):
            status = self._status(limit, key, micro, outcome.decision, outcome.now, cached=True, override=action)
        else:
            status = self._status(limit, key, micro, outcome.decisions[0], outcome.now, override=action)
        if apply:
            self._report_one(status, status.ok, limit)
        if throws and not status.ok:
            raise RateLimited(status.name, status.key, status.retry_after, status)
        return status

    def _many(
        self,
        items: list[LimitRequest],
        *,
        apply: bool,
        throws: bool,
        rules: Sequence[Override | None] | None = None,
    ) -> Steps[MultiStatus]:
        """Decide ``items`` all-or-nothing (``rules``: their overrides, when the caller
        applied them already)."""
        if not items:
            raise ValueError("no rate limits given")
        limits = []
        requests = []
        ruled: list[Override | _Outsized | None] = []
        for n, item in enumerate(items):
            if not isinstance(item.reserve, bool):
                raise ValueError(f"rate limit {item.name!r}: reserve must be a bool, not {item.reserve!r}")
            request, rule = self._one_request(
                self.resolve(item.name, item.config),
                item.key,
                item.count,
                item.reserve,
                _LOOK_UP if rules is None else rules[n],
            )
            limits.append(request.config)
            requests.append(request)
            ruled.append(rule)
        if self._own_backend is None:
            one_backend(limits)
        settled = [i for i, rule in enumerate(ruled) if _settles(rule)]
        if not settled:
            statuses = yield from self._many_statuses(items, limits, requests, ruled, apply=apply)  # type: ignore[arg-type]
            return self._many_result(statuses, limits, apply=apply, throws=throws)
        # Exempt limits take no part in the decision; a blocked one (or one whose override
        # is too small for its count) refuses the whole call, all-or-nothing, and the
        # others are not asked (they took nothing).
        now = clock.app_now()
        result: list[Status | None] = [None] * len(items)
        for i in settled:
            rule = ruled[i]
            if isinstance(rule, _Outsized):
                result[i] = _overridden(limits[i], items[i].key, requests[i].count, rule.rule, now, refused=True)
            else:
                result[i] = _overridden(limits[i], items[i].key, requests[i].count, rule, now)  # type: ignore[arg-type]
        rest = [i for i in range(len(items)) if result[i] is None]
        if any(not status.ok for status in result if status is not None):
            for i in rest:
                result[i] = _undecided(limits[i], items[i].key, requests[i].count / MICRO)
        elif rest:
            decided = yield from self._many_statuses(
                [items[i] for i in rest],
                [limits[i] for i in rest],
                [requests[i] for i in rest],
                [ruled[i] for i in rest],  # type: ignore[misc]
                apply=apply,
            )
            for i, status in zip(rest, decided):
                result[i] = status
        return self._many_result(result, limits, apply=apply, throws=throws)

    def _many_statuses(
        self,
        items: list[LimitRequest],
        limits: list[LimitConfig],
        requests: list[Request],
        rules: list[Override | None],
        *,
        apply: bool,
    ) -> Steps[list[Status | None]]:
        """Decide ``requests`` on the store (or from memory), all-or-nothing; return their statuses."""
        recalled = self._recall_many(limits, requests, items, rules)
        if recalled is not None:
            return recalled  # type: ignore[return-value]

        statuses: list[Status | None] = [None] * len(items)
        planned = yield from self._plan_shards(requests)
        if planned is None:  # the store failed reading the shards, and FAIL_OPEN allows
            statuses = [self._failed_open(limit, item.key, item.count) for limit, item in zip(limits, items)]
            planned = ([], [])
        parts, untouched = planned
        # Limits in shadow mode never block, so they are decided apart from the enforced
        # ones; they consume only when the enforced ones let the call through, as they
        # would if they were enforced.
        enforced = [i for i, limit in enumerate(limits) if not limit.shadow and parts]
        shadowed = [i for i, limit in enumerate(limits) if limit.shadow and parts]
        for group in (enforced, shadowed):
            if not group:
                continue
            group_apply = apply and (group is enforced or all(statuses[i].ok for i in enforced))  # type: ignore[union-attr]
            group_requests = [part for i in group for part in parts[i]]
            before = deny_cache.now()
            outcome = yield _Decide(limits[group[0]], group_requests, apply=group_apply)
            if outcome is not None and group is enforced:
                self._remember_many(limits, requests, group, outcome, before)
            position = 0
            for i in group:
                if outcome is None:
                    statuses[i] = self._failed_open(limits[i], items[i].key, items[i].count)
                    continue
                decisions = outcome.decisions[position : position + len(parts[i])]
                position += len(parts[i])
                decision = (
                    decisions[0] if limits[i].shards == 1 else _sharded_decision(limits[i], decisions, untouched[i])
                )
                statuses[i] = self._status(
                    limits[i], items[i].key, requests[i].count, decision, outcome.now, override=_action(rules[i])
                )
        return statuses

    def _many_result(
        self, statuses: Sequence[Status | None], limits: Sequence[LimitConfig], *, apply: bool, throws: bool
    ) -> MultiStatus:
        result = MultiStatus([status for status in statuses if status is not None])
        if apply:
            self._report(result, limits)
        if throws and not result.ok:
            denied = result.denied[0]
            raise RateLimited(denied.name, denied.key, result.retry_after, denied)
        return result

    def _recall_many(
        self,
        limits: list[LimitConfig],
        requests: list[Request],
        items: list[LimitRequest],
        rules: list[Override | None],
    ) -> list[Status] | None:
        """Return the statuses of a call that memory knows one of its limits denies; None
        when none is known denied (the call goes to the store).

        All-or-nothing, the whole call is denied and spends nothing; its other limits
        were not asked, so their statuses say nothing of them (``_undecided``).
        """
        memory = deny_cache.active()
        if memory is None:
            return None
        statuses: list[Status] = []
        denied = False
        for limit, request, item, rule in zip(limits, requests, items, rules):
            recalled = None
            if deny_cache.cacheable(limit, request.reserve):
                recalled = deny_cache.lookup(limit, self.backend(limit), request.key.digest, request.count)
            if recalled is None:
                statuses.append(_undecided(limit, item.key, request.count / MICRO))
            else:
                denied = True
                decision, now = recalled.decision, recalled.now
                statuses.append(
                    self._status(limit, item.key, request.count, decision, now, cached=True, override=_action(rule))
                )
        return statuses if denied else None

    def _remember_many(
        self,
        limits: list[LimitConfig],
        requests: list[Request],
        group: list[int],
        outcome: Outcome | None,
        before: tuple[bool, int, int],
    ) -> None:
        """Remember the denials of an all-or-nothing call's enforced limits, and forget
        the keys it admitted on."""
        memory = deny_cache.active()
        if memory is None or outcome is None:
            return
        if all(decision.allowed for decision in outcome.decisions):
            for i in group:
                deny_cache.admitted(requests[i].config.name, requests[i].key.digest)
            return
        if any(limits[i].shards > 1 for i in group):
            return  # its parts' decisions are not one per limit (and a sharded limit is never remembered)
        # A key asked twice in one call is decided after the call's own first take, which
        # the store never applied when the call was denied: only a key asked once says
        # what its bucket holds.
        rows = [(requests[i].config.name, requests[i].key.digest) for i in group]
        for position, i in enumerate(group):
            if rows.count(rows[position]) == 1 and deny_cache.cacheable(limits[i], requests[i].reserve):
                deny_cache.remember(
                    memory,
                    limits[i],
                    self.backend(limits[i]),
                    requests[i].key.digest,
                    requests[i].count,
                    Outcome([outcome.decisions[position]], outcome.now),
                    before,
                )

    def _plan_shards(self, requests: list[Request]) -> Steps[tuple[list[list[Request]], list[int]] | None]:
        """Return the requests to run for each one given, and what its other shard read.

        A request on an unsharded limit runs as it is. One on a sharded limit reads two
        random shards (one backend call for all of them, changing nothing) and becomes
        the parts that ``shards.split`` plans; ``untouched`` is then the value of the
        shard read but not taken from (0 when both are), for the status's estimate.
        None when that read failed and FAIL_OPEN allows.
        """
        parts = [[request] for request in requests]
        untouched = [0] * len(requests)
        sharded = [i for i, request in enumerate(requests) if request.config.shards > 1]
        if not sharded:
            return parts, untouched
        picks = {i: pick_two(requests[i].config.shards) for i in sharded}
        probes = [_shard_request(requests[i], index, 0) for i in sharded for index in picks[i]]
        outcome = yield _Decide(requests[sharded[0]].config, probes, apply=False)
        if outcome is None:
            return None
        for n, i in enumerate(sharded):
            first, second = picks[i]
            values = {first: outcome.decisions[2 * n].value, second: outcome.decisions[2 * n + 1].value}
            plan = split(requests[i].count, requests[i].reserve, (first, values[first]), (second, values[second]))
            parts[i] = [_shard_request(requests[i], index, amount) for index, amount in plan]
            untouched[i] = sum(value for index, value in values.items() if index not in dict(plan))
        return parts, untouched

    def _report(self, result: MultiStatus, limits: Sequence[LimitConfig]) -> None:
        all_ok = result.ok
        for status, limit in zip(result, limits):
            self._report_one(status, all_ok, limit)

    def _report_one(self, status: Status, all_ok: bool, limit: LimitConfig) -> None:
        """Count, log and signal one status of a call whose statuses are all ok when ``all_ok``."""
        recorder = metrics.active()
        counting = analytics.active()
        if recorder is not None or counting is not None:
            outcome = _outcome(status, all_ok)
            if outcome is not None:
                if recorder is not None:
                    recorder.decision(status.name, self._own_label or limit.backend, outcome)
                if counting is not None:
                    self._count(counting, limit, status, outcome)
        if not status.ok and denial_log.enabled():
            encoded = self.encode_for(limit, status.key)
            denial_log.denied(status.name, encoded.digest, encoded.label, status.retry_after)
        if status.ok and not status.would_deny:
            # A call denied by another of its limits consumed nothing here either:
            # there is no allowance to report (all-or-nothing).
            # ``receivers`` first, as Signal.send does: has_listeners() costs more than
            # the rest of this method, and most sites connect nothing.
            if all_ok and signals.rate_limit_allowed.receivers and signals.rate_limit_allowed.has_listeners():
                signals.rate_limit_allowed.send(
                    sender=Limiter, name=status.name, key=status.key, count=status.count, status=status
                )
            return
        if status.would_deny:
            logger.info(
                "rate limit %r (shadow mode) would have denied key %s: retry after %s s",
                status.name,
                encode_key(status.key).digest[:12],
                status.retry_after,
            )
        if signals.rate_limit_denied.receivers and signals.rate_limit_denied.has_listeners():
            signals.rate_limit_denied.send(
                sender=Limiter,
                name=status.name,
                key=status.key,
                count=status.count,
                status=status,
                shadow=status.would_deny,
            )

    def _count(self, counting: analytics.Settings, limit: LimitConfig, status: Status, outcome: str) -> None:
        """Count one applied decision for the analytics of ``limit``."""
        backend = self.backend(limit)
        if not backend.keeps_analytics:
            return
        if outcome not in _REFUSED:
            analytics.record_allowed(counting, backend, status.name)
            return
        encoded = self.encode_for(limit, status.key)
        label = encoded.label if backend.keeps_labels else ""
        analytics.record_denied(counting, backend, status.name, encoded.digest, label)

    def _drive(self, steps: Steps[T]) -> T:
        """Run a plan, answering its steps with the backends' blocking methods."""
        overrides.refresh_if_due()
        try:
            step = next(steps)
            while True:
                backend = self.backend(step.limit)
                recorder = metrics.active()
                started = time.perf_counter() if recorder is not None else 0.0
                try:
                    if isinstance(step, _Decide):
                        answer: Any = backend.decide(step.requests, apply=step.apply)
                    elif isinstance(step, _Reset):
                        backend.reset(step.bucket, step.key)
                        answer = None
                    else:
                        answer = backend.refund(step.bucket, step.key, step.amount)
                except BackendError as exc:
                    self._store_failed(step, exc)
                    answer = None
                finally:
                    if recorder is not None and isinstance(step, _Decide):
                        recorder.store_seconds(self._store_label(step.limit), time.perf_counter() - started)
                step = steps.send(answer)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            # A plan left at a step that raised (a failed reset) runs its ``finally``
            # now, here: left to the garbage collector it would run wherever a
            # collection happens to start, inside get_backend's lock included (a
            # deadlock seen in CI).
            steps.close()

    async def _adrive(self, steps: Steps[T]) -> T:
        """Run a plan, answering its steps with the backends' asyncio methods."""
        await overrides.arefresh_if_due()
        try:
            step = next(steps)
            while True:
                backend = self.backend(step.limit)
                recorder = metrics.active()
                started = time.perf_counter() if recorder is not None else 0.0
                try:
                    if isinstance(step, _Decide):
                        answer: Any = await backend.adecide(step.requests, apply=step.apply)
                    elif isinstance(step, _Reset):
                        await backend.areset(step.bucket, step.key)
                        answer = None
                    else:
                        answer = await backend.arefund(step.bucket, step.key, step.amount)
                except BackendError as exc:
                    self._store_failed(step, exc)
                    answer = None
                finally:
                    if recorder is not None and isinstance(step, _Decide):
                        recorder.store_seconds(self._store_label(step.limit), time.perf_counter() - started)
                step = steps.send(answer)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            # A plan left at a step that raised (a failed reset) runs its ``finally``
            # now, here: left to the garbage collector it would run wherever a
            # collection happens to start, inside get_backend's lock included (a
            # deadlock seen in CI).
            steps.close()

    def _store_failed(self, step: _Step, exc: BackendError) -> None:
        """Apply the fail mode to a failed step: return to let it through, or raise BackendUnavailable."""
        limit = step.limit
        metrics.store_failures.note(self._store_label(limit), metrics.error_label(exc))
        recorder = metrics.active()
        if recorder is not None:
            recorder.store_error(self._store_label(limit), metrics.error_label(exc))
        if not isinstance(step, _Decide):
            what = "reset" if isinstance(step, _Reset) else "refund"
            throttled_logger.warning(limit.name, "rate limit %r: %s failed: %s", limit.name, what, exc)
            raise BackendUnavailable(limit.name, f"the store failed: {exc}") from exc
        requests = step.requests
        fail_open = step.fail_open
        if fail_open is None:
            # A busy store is up: letting its timeouts through would let a flood past the
            # limit it created (issue 35, item 7). FAIL_OPEN is for a store that is down.
            fail_open = bool(tokenbucket_settings.FAIL_OPEN) and not exc.busy
        names = ", ".join(repr(r.config.name) for r in requests)
        if signals.rate_limit_backend_error.has_listeners():
            signals.rate_limit_backend_error.send(
                sender=Limiter,
                names=[r.config.name for r in requests],
                exception=exc,
                fail_open=fail_open,
                ambiguous=exc.ambiguous,
            )
        # At most one warning per limit per LOG_INTERVAL: a store outage fails every
        # request at once, and the signal above is there for counting them all.
        if fail_open:
            throttled_logger.warning(
                names,
                "rate limit %s (key %s): the store failed, allowing (FAIL_OPEN): %s",
                names,
                requests[0].key.digest[:12],
                exc,
            )
            return
        throttled_logger.warning(
            names,
            "rate limit %s (key %s): the store %s, refusing (fail closed): %s",
            names,
            requests[0].key.digest[:12],
            "is busy" if exc.busy else "failed",
            exc,
        )
        if recorder is not None and step.apply:
            for name in dict.fromkeys(r.config.name for r in requests):
                recorder.decision(name, self._store_label(limit), metrics.FAILED_CLOSED)
        what = "is busy (it answers, but not in time)" if exc.busy else "failed"
        raise BackendUnavailable(limit.name, f"the store {what}: {exc}") from exc

    def _store_label(self, limit: LimitConfig) -> str:
        """The ``backend`` label of ``limit``'s figures: its alias, or the class of this limiter's own backend."""
        return self._own_label or limit.backend

    @staticmethod
    def _status(
        limit: LimitConfig,
        key: object,
        count: int,
        decision: Decision,
        now: int,
        cached: bool = False,
        override: str | None = None,
    ) -> Status:
        shadow = limit.shadow
        return Status._decided(
            ok=decision.allowed or shadow,
            name=limit.name,
            key=key,
            count=count / MICRO,
            value=decision.value / MICRO,
            retry_after=None if decision.retry_after is None else decision.retry_after / MICRO,
            reset_after=decision.full_after / MICRO,
            capacity=limit.capacity / MICRO,
            rate=limit.rate / MICRO,
            period=limit.period / MICRO,
            timestamp=now / MICRO,
            shadow=shadow,
            would_deny=shadow and not decision.allowed,
            cached=cached,
            override=override,
        )

    @staticmethod
    def _failed_open(limit: LimitConfig, key: object, count: int | float) -> Status:
        return _undecided(limit, key, float(count), failed_open=True)


#: The outcomes that analytics count as ``denied``: this limit refused the call.
_REFUSED = frozenset((metrics.DENIED, metrics.DENIED_CACHED, metrics.BLOCKED))


def _outcome(status: Status, all_ok: bool) -> str | None:
    """A reported status as a metric's ``outcome``; None for a limit that another
    limit of its all-or-nothing call refused (it took nothing)."""
    if status.ok and not (status.failed_open or status.override or status.would_deny):
        return metrics.ALLOWED if all_ok else None  # most decisions: the rest cannot apply
    if status.failed_open:
        return metrics.FAILED_OPEN
    if status.cached:
        return metrics.DENIED_CACHED
    if status.override == overrides.EXEMPT:
        return metrics.EXEMPT
    if status.override == overrides.BLOCK and not status.shadow:
        return metrics.BLOCKED
    if status.would_deny:
        return metrics.SHADOW_DENIED
    if not status.ok:
        return metrics.DENIED
    return metrics.ALLOWED if all_ok else None


def _ruled(limit: LimitConfig, rule: Override | None) -> tuple[LimitConfig, Override | None]:
    """Return ``limit`` as the override ``rule`` changes it (a ``limit`` override), and the rule.

    A stored override whose numbers no longer fit the limit (its shards changed in
    LIMITS since) is ignored, with a warning, rather than fail every call.
    """
    if rule is None or rule.action != overrides.LIMIT:
        return limit, rule
    try:
        return rule.config(limit), rule
    except ImproperlyConfigured as exc:
        throttled_logger.warning(
            limit.name, "rate limit %r: an override no longer fits it, ignored: %s", limit.name, exc
        )
        return limit, None


def _action(rule: Override | None) -> str | None:
    return None if rule is None else rule.action


def _settles(rule: Override | _Outsized | None) -> bool:
    """Whether an override decides a call without the store: an exemption, a block, or a
    ``limit`` override too small for the call's count."""
    return isinstance(rule, _Outsized) or (rule is not None and rule.action != overrides.LIMIT)


@dataclass(frozen=True)
class _Outsized:
    """A call whose count a ``limit`` override makes larger than any call it admits."""

    rule: Override


def _count_in_force(base: LimitConfig, limit: LimitConfig, count: object, reserve: bool) -> tuple[int, bool]:
    """Return ``count`` in micro-tokens, and whether ``limit`` (``base`` as an override
    changes it) can ever admit it.

    Checked against the numbers in force: an override may raise the capacity above a
    count the limit itself could never admit. A count that only an override makes too
    large is no mistake of the caller's — an operator lowered the capacity under a view's
    ``count=5`` — so the call is refused, spending nothing, until the override ends
    (False), rather than raised as an error on every request of that key. ValueError
    naming the limit for a count that the limit's own numbers refuse too.
    """
    try:
        return limit.validate_count(count, reserve), True
    except ValueError:
        if limit is base:
            raise
        return base.validate_count(count, reserve), False


def _overridden(
    limit: LimitConfig, key: object, micro: int, rule: Override, now: int, *, refused: bool = False
) -> Status:
    """The Status of a call an exemption let through or a block refused, the store unasked;
    ``refused``: a call more than a ``limit`` override can ever admit, refused until it ends.

    A block on a shadow limit refuses nothing, as the limit itself would not.
    """
    blocked = refused or rule.action == overrides.BLOCK
    return Status(
        ok=not blocked or limit.shadow,
        name=limit.name,
        key=key,
        count=micro / MICRO,
        value=None,
        retry_after=rule.wait(now) if blocked else None,
        reset_after=None,
        capacity=limit.capacity_tokens,
        rate=limit.rate_tokens,
        period=limit.period_seconds,
        timestamp=now / MICRO,
        shadow=limit.shadow,
        would_deny=blocked and limit.shadow,
        override=rule.action,
    )


def _memory_for(limit: LimitConfig, reserve: bool) -> deny_cache.Settings | None:
    """Return the deny cache's setting when a call on ``limit`` may use it, else None."""
    memory = deny_cache.active()
    if memory is None or not deny_cache.cacheable(limit, reserve):
        return None
    return memory


def _undecided(limit: LimitConfig, key: object, tokens: float, *, failed_open: bool = False) -> Status:
    """The Status of a limit whose store did not decide: a call denied from memory did
    not ask it (it took nothing), or it failed open; what it holds is unknown."""
    return Status(
        ok=True,
        name=limit.name,
        key=key,
        count=tokens,
        value=None,
        retry_after=None,
        reset_after=None,
        capacity=limit.capacity_tokens,
        rate=limit.rate_tokens,
        period=limit.period_seconds,
        timestamp=None,
        failed_open=failed_open,
        shadow=limit.shadow,
    )


def _wait_for(limit: LimitConfig, status: Status) -> float:
    """Seconds until the tokens of an acquired reservation exist (0 when they do, when the
    store failed open, or on a shadow limit, which never blocks)."""
    if limit.shadow or not status.ok or status.retry_after is None:
        return 0.0
    return max(0.0, status.retry_after)


def one_backend(limits: Sequence[LimitConfig]) -> None:
    """Raise ImproperlyConfigured unless every limit is stored on the same backend.

    Limits decided together are decided all-or-nothing, in one transaction or one
    script; two stores cannot share one, and deciding them one after the other would
    spend on one store what the other then refuses.
    """
    aliases: dict[str, list[str]] = {}
    for limit in limits:
        aliases.setdefault(limit.backend, []).append(limit.name)
    if len(aliases) > 1:
        stores = "; ".join(f"{alias!r}: {', '.join(map(repr, names))}" for alias, names in aliases.items())
        raise ImproperlyConfigured(
            f"rate limits decided together must be stored on one backend, and these are not ({stores}): "
            f"one decision across two stores cannot be all-or-nothing. Decide them in separate calls, "
            f"or give them the same 'backend'."
        )


def _shard_request(request: Request, index: int, count: int) -> Request:
    """Return ``request`` moved to shard ``index`` of its limit, for ``count`` micro-tokens."""
    shards = request.config.shards
    return Request(shard_configs(request.config)[index], shard_key(request.key, index, shards), count, request.reserve)


def _sharded_decision(limit: LimitConfig, parts: Sequence[Decision], untouched: int) -> Decision:
    """Return one decision for a call on a sharded limit, from those of its parts.

    The value is an estimate, the two shards read scaled to all of them; the waits are
    the longest of the parts', which must all succeed together.
    """
    allowed = all(part.allowed for part in parts)
    # Allowed: a reservation's wait, if any. Denied: the wait of the parts that were.
    waits = [part.retry_after for part in parts if part.retry_after is not None and (allowed or not part.allowed)]
    retry_after = max(waits, default=None)
    value = (sum(part.value for part in parts) + untouched) * limit.shards // 2
    return Decision(allowed, value, retry_after, max(part.full_after for part in parts), None)


limiter = Limiter()
