"""``@ratelimit``: rate limits on Django views, sync, async and class-based."""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable, Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.views.generic import View as DjangoView

from . import registry
from .api import limiter
from .exceptions import BackendUnavailable
from .http import add_ratelimit_headers, rate_limited_response, unavailable_response
from .limits import count_to_micro
from .request_keys import KeySpec, note_view_key, validate_key_spec
from .status import Status
from .view_limits import (
    RateCallable,
    ViewLimit,
    adecide_limits,
    chain_of,
    decide_limits,
    pending_limits,
    record_decisions,
)

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
    """Return the methods counted, HEAD with GET: Django runs a view's GET code for HEAD."""
    if method is None:
        return None
    methods = frozenset({method.upper()} if isinstance(method, str) else (m.upper() for m in method))
    return methods | {"HEAD"} if "GET" in methods else methods


def _answers_options_itself(view_class: type) -> bool:
    """Whether a view class answers OPTIONS without its own code: Django's or DRF's ``options()``.

    Only there is an uncounted OPTIONS free of the view's work. A function view runs its
    own code for OPTIONS, so there OPTIONS is counted like any other method.
    """
    answers = {DjangoView.options}
    drf_views = sys.modules.get("rest_framework.views")
    if drf_views is not None:
        answers.add(drf_views.APIView.options)
    return getattr(view_class, "options", None) in answers


def _view_class_of_dispatch(view: Any) -> type | None:
    """Return the class of a view whose ``dispatch`` ``view`` is, as
    ``method_decorator(..., name="dispatch")`` hands it to a decorator (a partial of the
    bound method, made per request), else None.

    Decorating ``dispatch`` limits every request of the class, as decorating the class
    does, and so leaves a preflight that Django's ``options()`` answers as free.
    """
    bound = getattr(view, "func", None)
    instance = getattr(bound, "__self__", None)
    if isinstance(instance, DjangoView) and getattr(bound, "__name__", None) == "dispatch":
        return type(instance)
    return None


def _fixed_count(count: object) -> int | None:
    """Return a decorator's fixed ``count=`` in micro-tokens (None for a callable or a bad one,
    which the first request reports)."""
    if callable(count):
        return None
    try:
        return count_to_micro(count)
    except ValueError:
        return None


def _drf_view_class(view: Any) -> type | None:
    """Return the DRF view class of ``view`` (an APIView subclass, or its ``as_view()``), else None."""
    drf_views = sys.modules.get("rest_framework.views")  # no DRF loaded: no DRF view either
    if drf_views is None:
        return None
    view_class = view if isinstance(view, type) else getattr(view, "cls", None)
    return view_class if isinstance(view_class, type) and issubclass(view_class, drf_views.APIView) else None


def ratelimit(
    name: str | None = None,
    *,
    key: KeySpec = "ip",
    rate: str | float | RateCallable | None = None,
    period: float | timedelta | None = None,
    capacity: float | None = None,
    kind: str | None = None,
    shadow: bool = False,
    backend: str | None = None,
    count: float | Callable[[HttpRequest], float] | Callable[[HttpRequest], Awaitable[float]] = 1,
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
    request; on an ``async def`` view the callable may be an ``async def`` too, and is
    awaited). ``count`` (or a callable of the request) weighs a request; ``method``
    restricts which HTTP methods count (``ALL``, ``UNSAFE``, a name or a list).

    ``rate`` may be a callable of the request (an ``async def`` on an ``async def``
    view) that returns the request's plan: a rate string (``"1000/h"``), a config dict
    (as a ``LIMITS`` entry: rate, period, capacity, kind, max_reserved, backend...), or
    None to exempt the request (nothing is counted). Each plan has its own bucket per
    key, named ``<name>[plan <its config>]`` after this limit's name, so that every
    process (the admin, ``manage.py tokenbucket``, cleanup) reads its rows exactly;
    docs/plans.md says why and what a change of plan does.

    A denied request gets 429 with ``Retry-After`` when ``block`` is true; otherwise the
    view runs and sees ``request.limited`` (bool) and ``request.ratelimit`` (the Status).
    If the store fails and ``FAIL_OPEN`` is off, the answer is 503.

    Works on function views, ``async def`` views, class-based views (decorate the
    class, or use ``method_decorator``).
    """
    validate_key_spec(key)
    methods = _methods(method)
    config: dict[str, Any] | None = None
    plans: RateCallable | None = None
    if callable(rate):
        if period is not None or capacity is not None or kind is not None or shadow or backend is not None:
            raise ImproperlyConfigured(
                "@ratelimit(rate=callable): the callable returns each request's whole config (a rate string, "
                "or a dict with period, capacity, kind, shadow, backend...); give none of them to @ratelimit"
            )
        plans = rate
    elif rate is not None:
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

    def limit_of(view: Any, below: tuple[ViewLimit, ...], options_free: bool) -> ViewLimit:
        """Return this decorator's limit on ``view``, registered for the system checks."""
        note_view_key(_view_path(view), key)  # for W005: a key no client should choose
        shown_rate = rate if plans is None else getattr(plans, "__name__", "rate")
        limit_name = name or _default_name(view, below, shown_rate, period, methods, key)  # type: ignore[arg-type]
        if plans is not None:
            # Named per plan at request time; the command lists the callable here.
            registry.record_plan_base(limit_name, _view_path(view))
        elif config is None:
            _declared.setdefault(limit_name, _view_path(view))
        else:
            limiter.resolve(limit_name, config)  # a bad inline limit fails at import, not per request
        registry.record_use(
            limit_name,
            registry.ViewUse(_view_path(view), key if isinstance(key, str) else None, _fixed_count(count)),
        )
        return ViewLimit(limit_name, key, config, methods, count, block, options_free, rate=plans)

    def decorator(view: View) -> View:
        drf_class = _drf_view_class(view)
        if drf_class is not None:
            return _limit_drf_view(view, drf_class, limit_of)  # type: ignore[no-any-return]
        if isinstance(view, type):
            # A class-based view: limit every request its dispatch() handles.
            original = view.dispatch  # type: ignore[attr-defined]
            below = chain_of(original)
            this = limit_of(view, below, _answers_options_itself(view))
            view.dispatch = _limit_function(original, this, below)  # type: ignore[attr-defined]
            return view
        below = chain_of(view)
        dispatching = _view_class_of_dispatch(view)
        options_free = dispatching is not None and _answers_options_itself(dispatching)
        return _limit_function(view, limit_of(view, below, options_free), below)  # type: ignore[return-value]

    return decorator


def _limit_function(view: Callable[..., Any], this: ViewLimit, below: tuple[ViewLimit, ...]) -> Callable[..., Any]:
    """Return ``view`` deciding ``this`` limit and every ``@ratelimit`` below it before it runs."""
    # The first of a stack of decorators to see a request decides them all at once, so a
    # request refused by one spends nothing on the others.
    chain = (this, *below)
    if not iscoroutinefunction(view) and any(limit.awaits() for limit in chain):
        raise ImproperlyConfigured(
            f"@ratelimit on {_view_path(view)}: an async def key=, count= or rate= can only "
            f"be awaited on an async def view; give this sync view a plain function"
        )
    if below:
        _stacks[_view_path(view)] = tuple((limit.name, limit.config) for limit in chain)

    if iscoroutinefunction(view):

        async def async_wrapper(*args: Any, **kwargs: Any) -> HttpResponseBase:
            request = _request_of(args)
            pending = pending_limits(request, chain, this)
            if pending:
                try:
                    decided = await adecide_limits(request, pending)
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
            pending = pending_limits(request, chain, this)
            if pending:
                try:
                    decided = decide_limits(request, pending)
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
    return wrapped


def _limit_drf_view(
    view: Any, view_class: type, limit_of: Callable[[Any, tuple[ViewLimit, ...], bool], ViewLimit]
) -> Any:
    """Limit a DRF view: decide its ``@ratelimit`` limits once DRF has authenticated the request.

    Wrapping ``dispatch`` (or the function ``as_view()`` returns) would decide before DRF
    authenticates the request and parses its body: ``key="user"`` would see the session's
    user (anonymous for a token or JWT client, so keyed by address) and ``post:`` fields
    an empty ``request.POST`` for JSON. See ``throttling.limit_after_authentication``. A
    class is changed in place (as ``dispatch`` is for a Django view). A function (from
    ``as_view()`` or ``@api_view``, or any wrapper of one) stays as it is, and hands its
    limits to the class through the request, so that the class's other routes are untouched.
    """
    from .throttling.views import limit_after_authentication  # DRF is loaded: the view is one of its views

    is_class = isinstance(view, type)
    below: tuple[ViewLimit, ...] = getattr(view_class, "_tokenbucket_chain", ()) if is_class else chain_of(view)
    this = limit_of(view_class, below, _answers_options_itself(view_class))
    chain = (this, *below)
    if any(limit.awaits() for limit in chain):
        raise ImproperlyConfigured(
            f"@ratelimit on {_view_path(view_class)}: DRF authenticates synchronously; "
            f"an async def key=, count= or rate= cannot be awaited there"
        )
    if is_class:
        limit_after_authentication(view_class, chain)
        return view
    limit_after_authentication(view_class)

    def handing_over(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        # The outermost decorator runs first and hands over the whole stack.
        request.__dict__.setdefault("_tokenbucket_drf_chain", chain)
        return view(request, *args, **kwargs)

    wrapped = functools.wraps(view)(handing_over)
    wrapped._tokenbucket_chain = chain  # type: ignore[attr-defined]
    return wrapped


def _view_path(view: Any) -> str:
    """Return ``module.qualname`` of a view (a DRF ``@api_view`` by its function's name)."""
    qualname = view.__qualname__
    if qualname.startswith("api_view.<locals>."):
        qualname = view.__name__  # DRF names the class it makes after the function
    return f"{view.__module__}.{qualname}"


def _apply(request: HttpRequest, decided: list[tuple[ViewLimit, Status]]) -> HttpResponseBase | None:
    """Record the decisions on ``request``; return the 429 when a blocking limit refused it."""
    longest = record_decisions(request, decided)
    if longest is None:
        return None
    return add_ratelimit_headers(rate_limited_response(request, longest), request.ratelimits)  # type: ignore[attr-defined]


def _with_headers(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    statuses = getattr(request, "ratelimits", None)
    if statuses and isinstance(response, HttpResponseBase):
        # Every limit the request met, so that stacked decorators add up.
        add_ratelimit_headers(response, statuses)
    return response


def _default_name(
    view: Callable[..., Any],
    below: tuple[ViewLimit, ...],
    rate: str | float | None,
    period: float | timedelta | None,
    methods: frozenset[str] | None,
    key: KeySpec,
) -> str:
    """Return the name of an inline limit: the view's ``module.qualname``.

    A second inline limit stacked on the same view gets its own name, told apart by what
    differs (rate, methods, key), so that it never shares the bucket of the first.
    """
    base = _view_path(view)
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
