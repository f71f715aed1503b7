"""``@ratelimit``: rate limits on Django views, sync, async and class-based."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase

from .api import LimitRequest, limiter
from .exceptions import BackendUnavailable
from .http import add_ratelimit_headers, rate_limited_response, unavailable_response
from .request_keys import KeySpec, request_key, validate_key_spec
from .settings import tokenbucket_settings
from .status import Status

__all__ = ["ALL", "UNSAFE", "declared_limits", "ratelimit"]

#: Count every HTTP method (the default).
ALL = None
#: Count only the methods that change something.
UNSAFE = ("DELETE", "PATCH", "POST", "PUT")

View = TypeVar("View", bound=Callable[..., Any])

#: Limit names that decorators refer to (name -> the view), for the system check that
#: each one is defined in LIMITS.
_declared: dict[str, str] = {}


#: Stacks of @ratelimit decided together (the view -> its limits' names and inline
#: configs), for the system check that each stack is stored on one backend.
_stacks: dict[str, tuple[tuple[str, dict[str, Any] | None], ...]] = {}


def declared_limits() -> dict[str, str]:
    """Return the LIMITS names used by ``@ratelimit(name)`` so far, with the view using each."""
    return dict(_declared)


def declared_stacks() -> dict[str, tuple[tuple[str, dict[str, Any] | None], ...]]:
    """Return the stacks of two or more ``@ratelimit`` seen so far, by view: (name, inline config) each."""
    return dict(_stacks)


def _methods(method: str | Iterable[str] | None) -> frozenset[str] | None:
    if method is None:
        return None
    if isinstance(method, str):
        return frozenset({method.upper()})
    return frozenset(m.upper() for m in method)


def ratelimit(
    name: str | None = None,
    *,
    key: KeySpec = "ip",
    rate: str | float | None = None,
    period: float | timedelta | None = None,
    capacity: float | None = None,
    kind: str | None = None,
    shadow: bool = False,
    backend: str | None = None,
    count: float | Callable[[HttpRequest], float] = 1,
    method: str | Iterable[str] | None = ALL,
    block: bool = True,
) -> Callable[[View], View]:
    """Rate-limit a view.

    ``name`` is a limit in ``TOKENBUCKET["LIMITS"]``; or give ``rate`` (``"5/m"``, or a
    number with ``period``) and optionally ``capacity``, ``kind`` and ``shadow`` to
    define one inline, named after the view (``module.qualname``) unless ``name`` is
    given, and stored on ``backend`` (an alias of ``TOKENBUCKET["BACKENDS"]``). ``key``
    says whose bucket a request uses: ``"ip"`` (default), ``"user"``,
    ``"user_or_ip"``, ``"header:<name>"``, ``"get:<param>"``, ``"post:<field>"``, a
    callable ``(request) -> key`` or a dotted path to one (returning None exempts the
    request). ``count`` (or a callable of the request) weighs a request; ``method``
    restricts which HTTP methods count (``ALL``, ``UNSAFE``, a name or a list).

    A denied request gets 429 with ``Retry-After`` when ``block`` is true; otherwise the
    view runs and sees ``request.limited`` (bool) and ``request.ratelimit`` (the Status).
    If the store fails and ``FAIL_OPEN`` is off, the answer is 503.

    Works on function views, ``async def`` views, class-based views (decorate the
    class, or use ``method_decorator``).
    """
    validate_key_spec(key)
    methods = _methods(method)
    config: dict[str, Any] | None = None
    if rate is not None:
        config = {"rate": rate}
        for option, value in (("period", period), ("capacity", capacity), ("kind", kind), ("backend", backend)):
            if value is not None:
                config[option] = value
        if shadow:
            config["shadow"] = True
    elif period is not None or capacity is not None or kind is not None or shadow or backend is not None:
        raise ImproperlyConfigured(
            "@ratelimit: period, capacity, kind, shadow and backend define an inline limit and need rate= "
            "(or define the limit in TOKENBUCKET['LIMITS'] and pass its name)"
        )
    elif name is None:
        raise ImproperlyConfigured("@ratelimit needs the name of a limit in TOKENBUCKET['LIMITS'], or rate=")

    def decorator(view: View) -> View:
        if isinstance(view, type):
            # A class-based view: limit every request its dispatch() handles.
            original = view.dispatch  # type: ignore[attr-defined]
            limited = ratelimit(
                name or _default_name(view, _chain_of(original), rate, period, methods, key),
                key=key,
                rate=rate,
                period=period,
                capacity=capacity,
                kind=kind,
                shadow=shadow,
                backend=backend,
                count=count,
                method=method,
                block=block,
            )(original)
            view.dispatch = limited  # type: ignore[attr-defined]
            return view

        below = _chain_of(view)
        limit_name = name or _default_name(view, below, rate, period, methods, key)
        if config is None:
            _declared.setdefault(limit_name, f"{view.__module__}.{view.__qualname__}")
        if config is not None:
            limiter.resolve(limit_name, config)  # a bad inline limit fails at import, not per request
        this = _ViewLimit(limit_name, key, config, methods, count, block)
        # This decorator and every @ratelimit below it: the first of them to see a request
        # decides them all at once, so a request refused by one spends nothing on the others.
        chain = (this, *below)
        if below:
            _stacks[f"{view.__module__}.{view.__qualname__}"] = tuple((limit.name, limit.config) for limit in chain)

        if iscoroutinefunction(view):

            async def async_wrapper(*args: Any, **kwargs: Any) -> HttpResponseBase:
                request = _request_of(args)
                pending = _pending(request, chain, this)
                if pending:
                    try:
                        # The backend does blocking database work: keep it off the event loop.
                        decided = await sync_to_async(_decide)(request, pending)
                    except BackendUnavailable as exc:
                        return unavailable_response(request, exc)
                    blocked = _apply(request, decided)
                    if blocked is not None:
                        return blocked
                return _with_headers(request, await view(*args, **kwargs))

            wrapper: Callable[..., Any] = markcoroutinefunction(async_wrapper)
        else:

            def sync_wrapper(*args: Any, **kwargs: Any) -> HttpResponseBase:
                request = _request_of(args)
                pending = _pending(request, chain, this)
                if pending:
                    try:
                        decided = _decide(request, pending)
                    except BackendUnavailable as exc:
                        return unavailable_response(request, exc)
                    blocked = _apply(request, decided)
                    if blocked is not None:
                        return blocked
                return _with_headers(request, view(*args, **kwargs))

            wrapper = sync_wrapper
        wrapped = functools.wraps(view)(wrapper)
        # functools.wraps copies __dict__: a decorator stacked above sees this chain.
        wrapped._tokenbucket_chain = chain  # type: ignore[attr-defined]
        return wrapped  # type: ignore[return-value]

    return decorator


@dataclass(frozen=True, eq=False)
class _ViewLimit:
    """One ``@ratelimit`` on a view: what it takes from, for which requests."""

    name: str
    key: KeySpec
    config: dict[str, Any] | None
    methods: frozenset[str] | None
    count: float | Callable[[HttpRequest], float]
    block: bool

    def request_for(self, request: HttpRequest) -> LimitRequest | None:
        """Return what ``request`` takes from this limit, or None when it does not count."""
        if self.methods is None:
            if request.method == "OPTIONS" and not tokenbucket_settings.COUNT_OPTIONS:
                return None  # a CORS preflight is the browser's, not the user's, request
        elif request.method not in self.methods:
            return None
        ident = request_key(request, self.key)
        if ident is None:
            return None
        weight = self.count(request) if callable(self.count) else self.count
        return LimitRequest(self.name, ident, weight, config=self.config)


def _chain_of(view: Any) -> tuple[_ViewLimit, ...]:
    return getattr(view, "_tokenbucket_chain", ())


def _pending(request: HttpRequest, chain: tuple[_ViewLimit, ...], this: _ViewLimit) -> list[_ViewLimit]:
    """Return the limits of ``chain`` to decide now: none if ``this`` was decided above."""
    decided = request.__dict__.setdefault("_tokenbucket_decided", set())
    if this in decided:
        return []
    pending = [limit for limit in chain if limit not in decided]
    decided.update(pending)
    return pending


def _decide(request: HttpRequest, limits: list[_ViewLimit]) -> list[tuple[_ViewLimit, Status]]:
    """Decide every limit that counts ``request``, all-or-nothing."""
    planned = [(limit, limit.request_for(request)) for limit in limits]
    asked = [(limit, limit_request) for limit, limit_request in planned if limit_request is not None]
    if not asked:
        return []
    statuses = limiter.limit_many([limit_request for _, limit_request in asked])
    return [(limit, status) for (limit, _), status in zip(asked, statuses)]


def _apply(request: HttpRequest, decided: list[tuple[_ViewLimit, Status]]) -> HttpResponseBase | None:
    """Record the decisions on ``request``; return the 429 when a blocking limit refused it."""
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
    longest = max(blocking, key=lambda status: math.inf if status.retry_after is None else status.retry_after)
    return add_ratelimit_headers(rate_limited_response(request, longest), request.ratelimits)  # type: ignore[attr-defined]


def _with_headers(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    statuses = getattr(request, "ratelimits", None)
    if statuses and isinstance(response, HttpResponseBase):
        # Every limit the request met, so that stacked decorators add up.
        add_ratelimit_headers(response, statuses)
    return response


def _default_name(
    view: Callable[..., Any],
    below: tuple[_ViewLimit, ...],
    rate: str | float | None,
    period: float | timedelta | None,
    methods: frozenset[str] | None,
    key: KeySpec,
) -> str:
    """Return the name of an inline limit: the view's ``module.qualname``.

    A second inline limit stacked on the same view gets its own name, told apart by what
    differs (rate, methods, key), so that it never shares the bucket of the first.
    """
    base = f"{view.__module__}.{view.__qualname__}"
    taken = {limit.name for limit in below}
    if base not in taken:
        return base
    parts = [str(rate) if period is None else f"{rate}/{period}"]
    if methods is not None:
        parts.append("+".join(sorted(methods)))
    if isinstance(key, str):
        parts.append(key)
    name = f"{base}[{','.join(parts)}]"
    suffix = 2
    while name in taken:
        name = f"{base}[{','.join(parts)}#{suffix}]"
        suffix += 1
    return name


def _request_of(args: tuple[Any, ...]) -> HttpRequest:
    # Function views get (request, ...); methods get (self, request, ...).
    for arg in args[:2]:
        if isinstance(arg, HttpRequest) or hasattr(arg, "META"):
            return arg  # type: ignore[no-any-return]
    raise TypeError("@ratelimit: the decorated view was not given a request")
