"""``@ratelimit``: rate limits on Django views, sync, async and class-based."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase

from .api import limiter
from .exceptions import BackendUnavailable
from .http import (
    KeySpec,
    add_ratelimit_headers,
    rate_limited_response,
    request_key,
    unavailable_response,
    validate_key_spec,
)
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


def declared_limits() -> dict[str, str]:
    """Return the LIMITS names used by ``@ratelimit(name)`` so far, with the view using each."""
    return dict(_declared)


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
    count: float | Callable[[HttpRequest], float] = 1,
    method: str | Iterable[str] | None = ALL,
    block: bool = True,
) -> Callable[[View], View]:
    """Rate-limit a view.

    ``name`` is a limit in ``TOKENBUCKET["LIMITS"]``; or give ``rate`` (``"5/m"``, or a
    number with ``period``) and optionally ``capacity``, ``kind`` and ``shadow`` to
    define one inline, named after the view (``module.qualname``) unless ``name`` is
    given. ``key`` says whose bucket a request uses: ``"ip"`` (default), ``"user"``,
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
        for option, value in (("period", period), ("capacity", capacity), ("kind", kind)):
            if value is not None:
                config[option] = value
        if shadow:
            config["shadow"] = True
    elif period is not None or capacity is not None or kind is not None or shadow:
        raise ImproperlyConfigured(
            "@ratelimit: period, capacity, kind and shadow define an inline limit and need rate= "
            "(or define the limit in TOKENBUCKET['LIMITS'] and pass its name)"
        )
    elif name is None:
        raise ImproperlyConfigured("@ratelimit needs the name of a limit in TOKENBUCKET['LIMITS'], or rate=")

    def decorator(view: View) -> View:
        if isinstance(view, type):
            # A class-based view: limit every request its dispatch() handles.
            original = view.dispatch  # type: ignore[attr-defined]
            taken = getattr(original, "_tokenbucket_limit_names", ())
            limited = ratelimit(
                name or _default_name(view, taken, rate, period, methods, key),
                key=key,
                rate=rate,
                period=period,
                capacity=capacity,
                kind=kind,
                shadow=shadow,
                count=count,
                method=method,
                block=block,
            )(original)
            view.dispatch = limited  # type: ignore[attr-defined]
            return view

        limit_name = name or _default_name(
            view, getattr(view, "_tokenbucket_limit_names", ()), rate, period, methods, key
        )
        if config is None:
            _declared.setdefault(limit_name, f"{view.__module__}.{view.__qualname__}")
        if config is not None:
            limiter.resolve(limit_name, config)  # a bad inline limit fails at import, not per request

        def decide(request: HttpRequest) -> Status | None:
            if methods is not None and request.method not in methods:
                return None
            request_ident = request_key(request, key)
            if request_ident is None:
                return None
            weight = count(request) if callable(count) else count
            return limiter.limit(limit_name, request_ident, count=weight, config=config)

        def before(request: HttpRequest, status: Status | None) -> HttpResponseBase | None:
            if status is None:
                # Not counted here (another method, an exempt key): the view still reads
                # request.limited, as set by the decorators that did count it, or False.
                request.limited = getattr(request, "limited", False)  # type: ignore[attr-defined]
                if not hasattr(request, "ratelimit"):
                    request.ratelimit = None  # type: ignore[attr-defined]
                return None
            previous = getattr(request, "ratelimits", [])
            request.ratelimits = [*previous, status]  # type: ignore[attr-defined]
            request.ratelimit = status  # type: ignore[attr-defined]
            request.limited = getattr(request, "limited", False) or not status.ok  # type: ignore[attr-defined]
            if block and not status.ok:
                return add_ratelimit_headers(rate_limited_response(request, status), request.ratelimits)  # type: ignore[attr-defined]
            return None

        def after(request: HttpRequest, response: HttpResponseBase, status: Status | None) -> HttpResponseBase:
            if status is not None and isinstance(response, HttpResponseBase):
                # Every limit the request met, so that stacked decorators add up rather
                # than the outermost one replacing the others' headers.
                add_ratelimit_headers(response, request.ratelimits)  # type: ignore[attr-defined]
            return response

        if iscoroutinefunction(view):

            async def async_wrapper(*args: Any, **kwargs: Any) -> HttpResponseBase:
                request = _request_of(args)
                try:
                    # The backend does blocking database work: keep it off the event loop.
                    status = await sync_to_async(decide)(request)
                except BackendUnavailable as exc:
                    return unavailable_response(request, exc)
                blocked = before(request, status)
                if blocked is not None:
                    return blocked
                return after(request, await view(*args, **kwargs), status)

            wrapper: Callable[..., Any] = markcoroutinefunction(async_wrapper)
        else:

            def sync_wrapper(*args: Any, **kwargs: Any) -> HttpResponseBase:
                request = _request_of(args)
                try:
                    status = decide(request)
                except BackendUnavailable as exc:
                    return unavailable_response(request, exc)
                blocked = before(request, status)
                if blocked is not None:
                    return blocked
                return after(request, view(*args, **kwargs), status)

            wrapper = sync_wrapper
        wrapped = functools.wraps(view)(wrapper)
        # functools.wraps copies __dict__, so a decorator stacked above sees every name below.
        wrapped._tokenbucket_limit_names = (*getattr(view, "_tokenbucket_limit_names", ()), limit_name)  # type: ignore[attr-defined]
        return wrapped  # type: ignore[return-value]

    return decorator


def _default_name(
    view: Callable[..., Any],
    taken_names: Iterable[str],
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
    taken = set(taken_names)
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
