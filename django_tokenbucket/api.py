"""The public API: ``limiter.limit``, ``check``, ``reset``, ``get_value`` and friends.

``Limiter`` is the face: each method checks what only the public call has (the DEBUG
hints, tuples as ``LimitRequest``s) and hands the rest to ``django_tokenbucket.engine``,
where the decision pipeline and the plans of state live. Its override methods (``override``,
``exempt``, ``block``...) write the rows that ``overrides`` reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from . import hints, registry
from .backends.base import BaseBackend
from .engine import ConfigSpec, Engine
from .engine.names import encode_for, resolve
from .keys import EncodedKey
from .limits import LimitConfig
from .overrides import rules as override_rules
from .overrides import store as override_store
from .status import MultiStatus, Status

if TYPE_CHECKING:
    from .models import LimitOverride

__all__ = ["ConfigSpec", "LimitRequest", "Limiter", "limiter"]


@dataclass(frozen=True, slots=True)
class LimitRequest:
    """One limit in a ``limit_many`` / ``check_many`` call."""

    name: str
    key: object = None
    count: int | float = 1
    reserve: bool = False
    config: ConfigSpec | LimitConfig | None = None


class Limiter:
    """Decide rate limits against the configured backend.

    Every method takes the limit's ``name`` (an entry of ``TOKENBUCKET["LIMITS"]``, or
    any name with an inline ``config``) and a ``key`` (None for one global bucket; a
    str, bytes, int, or a tuple of these).

    ``limiter`` decides each limit on its backend (the alias in its ``"backend"``,
    ``"default"`` unless it says otherwise); ``Limiter(backend)`` decides every limit on
    that one (the django-ratelimit compatibility layer uses one per
    ``RATELIMIT_USE_CACHE``).

    Every method has an async twin (``alimit`` for ``limit``...) with the same result:
    the engine runs one pipeline with a blocking and an asyncio driver.
    """

    def __init__(self, backend: BaseBackend | None = None) -> None:
        #: The engine that decides for this limiter; an integration that builds its own
        #: ``LimitRequest``s (the DRF throttle) calls ``engine.decide_many`` directly.
        self.engine = Engine(backend, sender=Limiter)

    def backend(self, limit: LimitConfig | None = None) -> BaseBackend:
        """Return the backend that decides ``limit`` (by default, the default alias's)."""
        return self.engine.backend(limit)

    def resolve(self, name: str, config: ConfigSpec | LimitConfig | None = None) -> LimitConfig:
        """Return the parsed config of ``name``; raise ImproperlyConfigured if unknown or invalid.

        Without ``config``, ``name`` is looked up in ``LIMITS``, then among the limits the
        command and the admin know (``registry.known_limits``: DRF throttle scopes, inline
        limits). ``config`` may be one this method returned before, for a caller (a DRF
        throttle) that decides the same inline limit on every request.
        """
        return resolve(name, config)

    @staticmethod
    def encode_for(limit: LimitConfig, key: object) -> EncodedKey:
        """Return ``key``'s stored form (digest and label) for ``limit``.

        ValueError names the limit when ``key`` cannot be a key.
        """
        return encode_for(limit, key)

    # -- deciding ------------------------------------------------------------------------

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
        return self.engine.decide_one(name, key, count, reserve, config, apply=True, throws=throws)

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
        return await self.engine.adecide_one(name, key, count, reserve, config, apply=True, throws=throws)

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
        return self.engine.decide_one(name, key, count, reserve, config, apply=False, throws=throws)

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
        return await self.engine.adecide_one(name, key, count, reserve, config, apply=False, throws=throws)

    def limit_many(self, requests: Iterable[LimitRequest | Sequence[Any]], *, throws: bool = False) -> MultiStatus:
        """Take tokens from several limits all-or-nothing: one denial consumes none.

        ``requests`` are LimitRequest objects or ``(name, key[, count])`` tuples.
        """
        return self.engine.decide_many([_as_request(r) for r in requests], apply=True, throws=throws)

    async def alimit_many(
        self, requests: Iterable[LimitRequest | Sequence[Any]], *, throws: bool = False
    ) -> MultiStatus:
        """``limit_many()`` for async code."""
        return await self.engine.adecide_many([_as_request(r) for r in requests], apply=True, throws=throws)

    def check_many(self, requests: Iterable[LimitRequest | Sequence[Any]], *, throws: bool = False) -> MultiStatus:
        """Return what ``limit_many()`` would, changing nothing."""
        return self.engine.decide_many([_as_request(r) for r in requests], apply=False, throws=throws)

    async def acheck_many(
        self, requests: Iterable[LimitRequest | Sequence[Any]], *, throws: bool = False
    ) -> MultiStatus:
        """``check_many()`` for async code."""
        return await self.engine.adecide_many([_as_request(r) for r in requests], apply=False, throws=throws)

    def get_value(self, name: str, key: object = None, config: ConfigSpec | None = None) -> float:
        """Return the tokens available now (negative while reserved ahead)."""
        return self.get_status(name, key, config=config).value  # type: ignore[return-value]

    async def aget_value(self, name: str, key: object = None, config: ConfigSpec | None = None) -> float:
        """``get_value()`` for async code."""
        return (await self.aget_status(name, key, config=config)).value  # type: ignore[return-value]

    def get_status(self, name: str, key: object = None, config: ConfigSpec | None = None) -> Status:
        """Return the state of a limit now, as a Status of a zero-token call."""
        return self.engine.status(name, key, config)

    async def aget_status(self, name: str, key: object = None, config: ConfigSpec | None = None) -> Status:
        """``get_status()`` for async code."""
        return await self.engine.astatus(name, key, config)

    def reset(self, name: str, key: object = None, config: ConfigSpec | None = None) -> None:
        """Forget the state of ``name`` for ``key``: it starts full again."""
        self.engine.reset(name, key, config)

    async def areset(self, name: str, key: object = None, config: ConfigSpec | None = None) -> None:
        """``reset()`` for async code."""
        await self.engine.areset(name, key, config)

    def refund(self, name: str, key: object = None, count: int | float = 1, config: ConfigSpec | None = None) -> Status:
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
        return self.engine.refund(name, key, count, config)

    async def arefund(
        self, name: str, key: object = None, count: int | float = 1, config: ConfigSpec | None = None
    ) -> Status:
        """``refund()`` for async code."""
        return await self.engine.arefund(name, key, count, config)

    def refund_encoded(self, limit: LimitConfig, encoded: EncodedKey, amount: int, key: object) -> Status:
        """Refund ``amount`` micro-tokens of a parsed limit to a key already encoded.

        For code that keeps only a key's stored form, as reservations do (their rows hold
        the digest, not the key): ``key`` is what the returned Status reports.
        """
        return self.engine.refund_encoded(limit, encoded, amount, key)

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
        return self.engine.acquire(name, key, count, timeout, config)

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
        return await self.engine.aacquire(name, key, count, timeout, config)

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
        numbers = override_rules.numbers(limit, rate, period, capacity, max_reserved)
        return override_store.make(
            limit.name, key, override_rules.LIMIT, numbers, until=until, reason=reason, created_by=created_by
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
        return override_store.make(
            self._override_name(name), key, override_rules.EXEMPT, until=until, reason=reason, created_by=created_by
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
        return override_store.make(
            self._override_name(name), key, override_rules.BLOCK, until=until, reason=reason, created_by=created_by
        )

    def clear_override(self, name: str, key: object = None) -> int:
        """Remove the override of limit ``name`` for ``key`` (None: the one of every key).

        Returns how many were removed (0 or 1). The limit need not be configured any more.
        """
        if not isinstance(name, str):
            raise ValueError(f"a rate limit name must be a str, not {name!r}")
        return override_store.delete(name, override_rules.key_digest(name, key).digest)

    def overrides(self, name: str | None = None) -> list[LimitOverride]:
        """Return the overrides in force (not expired), of limit ``name`` or of all, by limit and key."""
        return override_store.in_force(name)

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


def _as_request(item: LimitRequest | Sequence[Any]) -> LimitRequest:
    if isinstance(item, LimitRequest):
        return item
    if isinstance(item, str):
        return LimitRequest(item)
    return LimitRequest(*item)


limiter = Limiter()
