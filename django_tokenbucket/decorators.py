"""``@ratelimit``: rate limits on Django views, sync, async and class-based."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.utils.functional import LazyObject, empty
from django.views.generic import View as DjangoView

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
    rate: str | float | None = None,
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

    def limit_of(view: Any, below: tuple[_ViewLimit, ...], options_free: bool) -> _ViewLimit:
        """Return this decorator's limit on ``view``, registered for the system checks."""
        limit_name = name or _default_name(view, below, rate, period, methods, key)
        if config is None:
            _declared.setdefault(limit_name, _view_path(view))
        else:
            limiter.resolve(limit_name, config)  # a bad inline limit fails at import, not per request
        return _ViewLimit(limit_name, key, config, methods, count, block, options_free)

    def decorator(view: View) -> View:
        drf_class = _drf_view_class(view)
        if drf_class is not None:
            return _limit_drf_view(view, drf_class, limit_of)  # type: ignore[no-any-return]
        if isinstance(view, type):
            # A class-based view: limit every request its dispatch() handles.
            original = view.dispatch  # type: ignore[attr-defined]
            below = _chain_of(original)
            this = limit_of(view, below, _answers_options_itself(view))
            view.dispatch = _limit_function(original, this, below)  # type: ignore[attr-defined]
            return view
        below = _chain_of(view)
        return _limit_function(view, limit_of(view, below, False), below)  # type: ignore[return-value]

    return decorator


def _limit_function(view: Callable[..., Any], this: _ViewLimit, below: tuple[_ViewLimit, ...]) -> Callable[..., Any]:
    """Return ``view`` deciding ``this`` limit and every ``@ratelimit`` below it before it runs."""
    # The first of a stack of decorators to see a request decides them all at once, so a
    # request refused by one spends nothing on the others.
    chain = (this, *below)
    if not iscoroutinefunction(view) and any(limit.awaits() for limit in chain):
        raise ImproperlyConfigured(
            f"@ratelimit on {_view_path(view)}: an async def key= or count= can only "
            f"be awaited on an async def view; give this sync view a plain function"
        )
    if below:
        _stacks[_view_path(view)] = tuple((limit.name, limit.config) for limit in chain)

    if iscoroutinefunction(view):

        async def async_wrapper(*args: Any, **kwargs: Any) -> HttpResponseBase:
            request = _request_of(args)
            pending = _pending(request, chain, this)
            if pending:
                try:
                    decided = await _adecide(request, pending)
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
    return wrapped


def _limit_drf_view(
    view: Any, view_class: type, limit_of: Callable[[Any, tuple[_ViewLimit, ...], bool], _ViewLimit]
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
    from .throttling import limit_after_authentication  # DRF is loaded: the view is one of its views

    is_class = isinstance(view, type)
    below: tuple[_ViewLimit, ...] = getattr(view_class, "_tokenbucket_chain", ()) if is_class else _chain_of(view)
    this = limit_of(view_class, below, _answers_options_itself(view_class))
    chain = (this, *below)
    if any(limit.awaits() for limit in chain):
        raise ImproperlyConfigured(
            f"@ratelimit on {_view_path(view_class)}: DRF authenticates synchronously; "
            f"an async def key= or count= cannot be awaited there"
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


@dataclass(frozen=True, eq=False)
class _ViewLimit:
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

    def request_for(self, request: HttpRequest) -> LimitRequest | None:
        """Return what ``request`` takes from this limit, or None when it does not count."""
        if not self.counts(request):
            return None
        ident = request_key(request, self.key)
        if ident is None:
            return None
        # Never an async def here: the decorator refuses one on a sync view, and plans it
        # with arequest_for on an async one.
        count: Any = self.count
        weight = count(request) if callable(count) else count
        return LimitRequest(self.name, ident, weight, config=self.config)

    async def arequest_for(self, request: HttpRequest) -> LimitRequest | None:
        """``request_for`` on an event loop: a key or count that is an ``async def`` is awaited."""
        if not self.counts(request):
            return None
        key: Any = self.key
        ident = await key(request) if iscoroutinefunction(key) else request_key(request, key)
        if ident is None:
            return None
        count: Any = self.count
        if iscoroutinefunction(count):
            weight = await count(request)
        else:
            weight = count(request) if callable(count) else count
        return LimitRequest(self.name, ident, weight, config=self.config)

    def counts(self, request: HttpRequest) -> bool:
        """Whether this limit counts requests of ``request``'s method."""
        if self.methods is None:
            # A CORS preflight is the browser's, not the user's, request, and free where
            # the framework answers it; a function view would run its work for it.
            return request.method != "OPTIONS" or not self.options_free or bool(tokenbucket_settings.COUNT_OPTIONS)
        return request.method in self.methods

    def awaits(self) -> bool:
        """Whether its key or count is an ``async def`` (which only an async view can await)."""
        return iscoroutinefunction(self.key) or iscoroutinefunction(self.count)


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


def _plan(request: HttpRequest, limits: list[_ViewLimit]) -> list[tuple[_ViewLimit, LimitRequest]]:
    """Return what ``request`` takes from each of ``limits`` that counts it."""
    planned = [(limit, limit.request_for(request)) for limit in limits]
    return [(limit, limit_request) for limit, limit_request in planned if limit_request is not None]


def _decide(request: HttpRequest, limits: list[_ViewLimit]) -> list[tuple[_ViewLimit, Status]]:
    """Decide every limit that counts ``request``, all-or-nothing."""
    asked = _plan(request, limits)
    if not asked:
        return []
    statuses = limiter.limit_many([limit_request for _, limit_request in asked])
    return [(limit, status) for (limit, _), status in zip(asked, statuses)]


async def _adecide(request: HttpRequest, limits: list[_ViewLimit]) -> list[tuple[_ViewLimit, Status]]:
    """``_decide`` for an async view: on the event loop where nothing blocks, else in a thread.

    Limits on a backend without an asyncio path (the database's) are planned and decided in
    one worker thread, as a sync view would (but for keys and counts that are ``async
    def``, awaited first). On an asyncio backend (Redis) the decision is awaited; planning
    stays on the loop too unless a key or count may block: a plain function of the
    project's, or the user when it is not loaded yet (the session and user lookups query
    the database).
    """
    native = all(limiter.backend(limiter.resolve(limit.name, limit.config)).asyncio_native for limit in limits)
    if not native and not any(limit.awaits() for limit in limits):
        return await sync_to_async(_decide)(request, limits)
    asked = await _aplan(request, limits)
    if not asked:
        return []
    statuses = await limiter.alimit_many([limit_request for _, limit_request in asked])
    return [(limit, status) for (limit, _), status in zip(asked, statuses)]


async def _aplan(request: HttpRequest, limits: list[_ViewLimit]) -> list[tuple[_ViewLimit, LimitRequest]]:
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


def _plans_on_the_loop(request: HttpRequest, limit: _ViewLimit) -> bool:
    """Whether planning ``limit`` for ``request`` does no blocking I/O."""
    if callable(limit.count) and not iscoroutinefunction(limit.count):
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


def _apply(request: HttpRequest, decided: list[tuple[_ViewLimit, Status]]) -> HttpResponseBase | None:
    """Record the decisions on ``request``; return the 429 when a blocking limit refused it."""
    longest = record_decisions(request, decided)
    if longest is None:
        return None
    return add_ratelimit_headers(rate_limited_response(request, longest), request.ratelimits)  # type: ignore[attr-defined]


def decide_view_limits(request: HttpRequest, chain: tuple[_ViewLimit, ...]) -> Status | None:
    """Decide the limits of ``chain`` not yet decided for ``request``, all-or-nothing; record
    them on the request and return the denial that blocks it, None when nothing does."""
    pending = _pending(request, chain, chain[0])
    return record_decisions(request, _decide(request, pending) if pending else [])


def record_decisions(request: HttpRequest, decided: list[tuple[_ViewLimit, Status]]) -> Status | None:
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
