"""The limits on a view, decided for a request: what ``@ratelimit`` and the DRF view hook share.

A ``ViewLimit`` is one ``@ratelimit`` on a view: which limit, whose key, which methods,
how many tokens. The first decorator of a stack to see a request decides every limit of
the stack at once (``limit_many``, all-or-nothing), records them on the request
(``request.limited``, ``request.ratelimit``, ``request.ratelimits``) and says which
denial blocks it; the decorator turns that into a 429 (``decorators``), the DRF hook
into DRF's ``Throttled`` (``throttling.views``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Union

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.utils.functional import LazyObject, empty

from . import registry
from .api import LimitRequest, limiter
from .limits import LimitConfig, freeze
from .logs import current_request
from .plans import plan_config
from .request_keys import KeySpec, request_key
from .settings import tokenbucket_settings
from .status import Status

__all__ = [
    "PlanSpec",
    "RateCallable",
    "ViewLimit",
    "adecide_limits",
    "chain_of",
    "decide_limits",
    "decide_view_limits",
    "pending_limits",
    "plan_limit_of",
    "record_decisions",
]


#: What a rate callable returns: a rate string (``"100/m"``), a config dict (as a
#: ``LIMITS`` entry), or None to exempt the request.
PlanSpec = Union[str, Mapping[str, Any], None]
#: ``@ratelimit(rate=...)`` decided per request: a function of the request (an ``async
#: def`` on an async view).
RateCallable = Union[Callable[[HttpRequest], PlanSpec], Callable[[HttpRequest], Awaitable[PlanSpec]]]

_plans: dict[Any, LimitConfig] = {}
_PLANS_SIZE = 1024


def plan_limit_of(base: str, rate: Any, returned: object) -> LimitConfig | None:
    """Return the limit that ``rate``, a rate callable of the limit ``base``, chose by returning
    ``returned``: the bucket of that plan (``plans``), or None to exempt the request.

    Raises ImproperlyConfigured naming the limit and quoting what was returned when it
    is neither a rate string, a config dict nor None, or not a valid config.
    """
    if returned is None:
        return None
    if not isinstance(returned, (str, Mapping)):
        if inspect.iscoroutine(returned):
            returned.close()  # never awaited: say so here rather than in a RuntimeWarning
        raise ImproperlyConfigured(
            f"@ratelimit {base!r}: the rate callable {_qualname(rate)} returned {returned!r}; expected a rate "
            f"string such as '100/m', a config dict such as {{'rate': 100, 'period': 60}}, or None to exempt "
            f"the request"
        )
    try:
        cache_key = (base, freeze(returned))
        hash(cache_key)
    except TypeError:
        cache_key = None
    limit = _plans.get(cache_key) if cache_key is not None else None
    if limit is None:
        try:
            limit = plan_config(base, returned)
        except ImproperlyConfigured as exc:
            raise ImproperlyConfigured(
                f"@ratelimit {base!r}: the rate callable {_qualname(rate)} returned {returned!r}: {exc}"
            ) from None
        # Known to the admin, the command and cleanup of this process at once (other
        # processes read the plan from the bucket's name).
        registry.record_inline(limit)
        if cache_key is not None:
            if len(_plans) >= _PLANS_SIZE:
                _plans.clear()  # configs come from code: a full cache means a plan per request, misused
            _plans[cache_key] = limit
    return limit


def _qualname(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


@dataclass(frozen=True, eq=False)
class ViewLimit:
    """One ``@ratelimit`` on a view: what it takes from, for which requests."""

    name: str
    key: KeySpec
    config: dict[str, Any] | None
    methods: frozenset[str] | None
    count: float | Callable[[HttpRequest], float] | Callable[[HttpRequest], Awaitable[float]]
    block: bool
    #: Whether the view answers OPTIONS without running its own code (Django's and DRF's
    #: class-based views): only there is OPTIONS left uncounted by default.
    options_free: bool = False
    #: ``@ratelimit(rate=callable)``: the config is the plan the callable returns for each
    #: request, in a bucket of that plan's (``plans``); ``name`` is the buckets' prefix.
    rate: RateCallable | None = None

    def limit_for(self, returned: object) -> LimitConfig | None:
        """Return the limit a request takes from, given what the rate callable returned (if any)."""
        return plan_limit_of(self.name, self.rate, returned)

    @cached_property
    def inline_limit(self) -> LimitConfig | None:
        """The inline ``config`` parsed, once (it depends on nothing else); None for a named limit,
        which is looked up in the settings in force on each request."""
        return None if self.config is None else limiter.resolve(self.name, self.config)

    def request_for(self, request: HttpRequest) -> LimitRequest | None:
        """Return what ``request`` takes from this limit, or None when it does not count."""
        if not self.counts(request):
            return None
        ident = request_key(request, self.key)
        if ident is None:
            return None
        # Never an async def here: the decorator refuses one on a sync view, and plans it
        # with arequest_for on an async one.
        config = self.inline_limit
        if self.rate is not None:
            config = self.limit_for(self.rate(request))
            if config is None:
                return None  # the plan exempts this request: nothing is counted
        count: Any = self.count
        weight = count(request) if callable(count) else count
        return LimitRequest(self.name if config is None else config.name, ident, weight, config=config)

    async def arequest_for(self, request: HttpRequest) -> LimitRequest | None:
        """``request_for`` on an event loop: a key or count that is an ``async def`` is awaited."""
        if not self.counts(request):
            return None
        key: Any = self.key
        ident = await key(request) if iscoroutinefunction(key) else request_key(request, key)
        if ident is None:
            return None
        config = self.inline_limit
        rate: Any = self.rate
        if rate is not None:
            config = self.limit_for(await rate(request) if iscoroutinefunction(rate) else rate(request))
            if config is None:
                return None
        count: Any = self.count
        if iscoroutinefunction(count):
            weight = await count(request)
        else:
            weight = count(request) if callable(count) else count
        return LimitRequest(self.name if config is None else config.name, ident, weight, config=config)

    def counts(self, request: HttpRequest) -> bool:
        """Whether this limit counts requests of ``request``'s method."""
        if self.methods is None:
            # A CORS preflight is the browser's, not the user's, request, and free where
            # the framework answers it; a function view would run its work for it.
            return request.method != "OPTIONS" or not self.options_free or bool(tokenbucket_settings.COUNT_OPTIONS)
        return request.method in self.methods

    def awaits(self) -> bool:
        """Whether its key, count or rate is an ``async def`` (which only an async view can await)."""
        return iscoroutinefunction(self.key) or iscoroutinefunction(self.count) or iscoroutinefunction(self.rate)

    def native(self) -> bool:
        """Whether its store answers on the event loop; a plan's store is known per request only."""
        if self.rate is not None:
            return False
        return limiter.backend(limiter.resolve(self.name, self.config)).asyncio_native


def chain_of(view: Any) -> tuple[ViewLimit, ...]:
    return getattr(view, "_tokenbucket_chain", ())


def pending_limits(request: HttpRequest, chain: tuple[ViewLimit, ...], this: ViewLimit) -> list[ViewLimit]:
    """Return the limits of ``chain`` to decide now: none if ``this`` was decided above."""
    decided = request.__dict__.setdefault("_tokenbucket_decided", set())
    if this in decided:
        return []
    pending = [limit for limit in chain if limit not in decided]
    decided.update(pending)
    return pending


def _plan(request: HttpRequest, limits: list[ViewLimit]) -> list[tuple[ViewLimit, LimitRequest]]:
    """Return what ``request`` takes from each of ``limits`` that counts it."""
    planned = [(limit, limit.request_for(request)) for limit in limits]
    return [(limit, limit_request) for limit, limit_request in planned if limit_request is not None]


def decide_limits(request: HttpRequest, limits: list[ViewLimit]) -> list[tuple[ViewLimit, Status]]:
    """Decide every limit that counts ``request``, all-or-nothing."""
    asked = _plan(request, limits)
    if not asked:
        return []
    seen = current_request.set(request)
    try:
        statuses = limiter.limit_many([limit_request for _, limit_request in asked])
    finally:
        current_request.reset(seen)
    return [(limit, status) for (limit, _), status in zip(asked, statuses)]


async def adecide_limits(request: HttpRequest, limits: list[ViewLimit]) -> list[tuple[ViewLimit, Status]]:
    """``_decide`` for an async view: on the event loop where nothing blocks, else in a thread.

    Limits on a backend without an asyncio path (the database's) are planned and decided in
    one worker thread, as a sync view would (but for keys and counts that are ``async
    def``, awaited first). On an asyncio backend (Redis) the decision is awaited; planning
    stays on the loop too unless a key or count may block: a plain function of the
    project's, or the user when it is not loaded yet (the session and user lookups query
    the database).
    """
    native = all(limit.native() for limit in limits)
    if not native and not any(limit.awaits() for limit in limits):
        return await sync_to_async(decide_limits)(request, limits)
    asked = await _aplan(request, limits)
    if not asked:
        return []
    seen = current_request.set(request)
    try:
        statuses = await limiter.alimit_many([limit_request for _, limit_request in asked])
    finally:
        current_request.reset(seen)
    return [(limit, status) for (limit, _), status in zip(asked, statuses)]


async def _aplan(request: HttpRequest, limits: list[ViewLimit]) -> list[tuple[ViewLimit, LimitRequest]]:
    """``_plan`` on the event loop, but for the limits whose planning may block: one thread for those."""
    on_loop = [_plans_on_the_loop(request, limit) for limit in limits]
    blocking = [limit for limit, here in zip(limits, on_loop) if not here]
    planned = dict(await sync_to_async(_plan)(request, blocking)) if blocking else {}
    asked = []
    for limit, here in zip(limits, on_loop):
        limit_request = await limit.arequest_for(request) if here else planned.get(limit)
        if limit_request is not None:
            asked.append((limit, limit_request))
    return asked


def _plans_on_the_loop(request: HttpRequest, limit: ViewLimit) -> bool:
    """Whether planning ``limit`` for ``request`` does no blocking I/O."""
    for function in (limit.count, limit.rate):
        if callable(function) and not iscoroutinefunction(function):
            return False  # the project's code: it may query anything
    spec = limit.key
    if callable(spec):
        return iscoroutinefunction(spec)  # an async def is awaited; a plain function may block
    if spec in ("user", "user_or_ip"):
        return _user_loaded(request)
    # "ip", "username", "header:", "get:", "post:" read the request (whose body an ASGI
    # server has read already); a dotted path is a function of the project's.
    return not ("." in spec and ":" not in spec)


def _user_loaded(request: HttpRequest) -> bool:
    """Whether ``request.user`` is there without a query: set, absent, or a lazy user already loaded."""
    user = request.__dict__.get("user")
    if not isinstance(user, LazyObject):
        return True  # no authentication middleware, or a user object set by the project
    # AuthenticationMiddleware's lazy user caches what it loaded in request._cached_user.
    return user._wrapped is not empty or hasattr(request, "_cached_user")


def decide_view_limits(request: HttpRequest, chain: tuple[ViewLimit, ...]) -> Status | None:
    """Decide the limits of ``chain`` not yet decided for ``request``, all-or-nothing; record
    them on the request and return the denial that blocks it, None when nothing does."""
    pending = pending_limits(request, chain, chain[0])
    return record_decisions(request, decide_limits(request, pending) if pending else [])


def record_decisions(request: HttpRequest, decided: list[tuple[ViewLimit, Status]]) -> Status | None:
    """Set ``request.limited``, ``request.ratelimit`` and ``request.ratelimits``; return the
    denial that blocks the request (the longest wait), None when nothing blocks it."""
    statuses = [status for _, status in decided]
    request.ratelimits = [*getattr(request, "ratelimits", []), *statuses]  # type: ignore[attr-defined]
    denied = [status for status in statuses if not status.ok]
    request.limited = getattr(request, "limited", False) or bool(denied)  # type: ignore[attr-defined]
    if statuses:
        request.ratelimit = denied[0] if denied else statuses[0]  # type: ignore[attr-defined]
    elif not hasattr(request, "ratelimit"):
        request.ratelimit = None  # type: ignore[attr-defined]
    blocking = [status for limit, status in decided if limit.block and not status.ok]
    if not blocking:
        return None
    # The longest wait: the request succeeds only when every limit has room (None: never).
    return max(blocking, key=lambda status: math.inf if status.retry_after is None else status.retry_after)
