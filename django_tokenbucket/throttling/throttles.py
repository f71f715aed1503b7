"""The throttle classes: DRF's ``SimpleRateThrottle`` shape, decided by exact token buckets.

Every throttle of this module on one view is decided together, all-or-nothing (see
``django_tokenbucket.throttling``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from functools import cache, lru_cache
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext_lazy as _
from rest_framework.exceptions import APIException
from rest_framework.request import Request as DRFRequest
from rest_framework.settings import api_settings
from rest_framework.throttling import BaseThrottle

from .. import clock, registry
from ..algorithms import MICRO
from ..api import LimitRequest, limiter
from ..exceptions import BackendUnavailable
from ..ip import client_address, ip_key
from ..limits import LimitConfig
from ..logs import current_request, throttled_logger
from ..rates import parse_rate
from ..settings import tokenbucket_settings
from ..status import Status

__all__ = [
    "AnonRateThrottle",
    "BaseThrottle",
    "ScopedRateThrottle",
    "ServiceUnavailable",
    "SimpleRateThrottle",
    "TokenBucketThrottle",
    "UserRateThrottle",
    "declared_throttle_rates",
    "no_store",
]

logger = logging.getLogger("django_tokenbucket")

Signature = tuple[type, tuple[str, ...]]


class ServiceUnavailable(APIException):
    """The rate-limit store failed and FAIL_OPEN is off: 503, the service failed, not the client."""

    status_code = 503
    default_detail = _("Rate limiting is temporarily unavailable.")
    default_code = "rate_limit_unavailable"


class LimitRate(str):
    """The rate of a scope defined in ``TOKENBUCKET["LIMITS"]``: reads as ``"N/Ms"``.

    ``get_rate()`` returns a str, as DRF's does; this one also remembers which limit it
    stands for, so that the decision uses the whole limit (capacity, kind...).
    """

    limit_name: str

    def __new__(cls, limit_name: str) -> LimitRate:
        config = limiter.resolve(limit_name)
        text = f"{_number(config.rate, MICRO)}/{_number(config.period, MICRO)}s"
        rate = super().__new__(cls, text)
        rate.limit_name = limit_name
        return rate


@lru_cache(maxsize=256)
def _rate_numbers(rate: str) -> tuple[int | float, int | float]:
    # Each throttle parses its rate when it is made, and DRF makes them per request.
    tokens, seconds = parse_rate(rate)
    return (_number(int(tokens * MICRO), MICRO), _number(int(seconds * MICRO), MICRO))


def _number(micro: int, unit: int) -> int | float:
    value = Fraction(micro, unit)
    return int(value) if value.denominator == 1 else float(value)


class SimpleRateThrottle(BaseThrottle):
    """A throttle on one ``scope``, subclassable exactly as DRF's ``SimpleRateThrottle``.

    Subclasses implement ``get_cache_key(request, view)``, returning the bucket key or
    None to leave the request unthrottled. The rate is ``rate`` if the class sets it,
    else ``THROTTLE_RATES[scope]`` (default: ``DEFAULT_THROTTLE_RATES``, read now),
    else the ``TOKENBUCKET["LIMITS"]`` entry named ``scope``. ``scopes`` (a list)
    takes from several limits at once, all-or-nothing, e.g. a burst and a sustained
    rate. ``get_count`` weighs a request (default: the view's ``throttle_cost``, or 1).

    ``timer`` is honoured: a subclass (or a test) that replaces it decides at the time
    it returns, in seconds since the epoch.
    """

    timer: Callable[..., float] = time.time
    cache_format = "throttle_%(scope)s_%(ident)s"
    scope: str | None = None
    scopes: Sequence[str] = ()
    rate: str | None = None
    #: Rates by scope; None reads ``DEFAULT_THROTTLE_RATES`` each time a throttle is made.
    THROTTLE_RATES: Mapping[str, str | None] | None = None

    statuses: list[Status]
    # Class defaults: DRF makes every throttle anew per request, and __init__ then
    # assigns only the list of its own.
    key: object = None
    now: float | None = None
    num_requests: int | float | None = None
    duration: int | float | None = None
    _rate_error: ImproperlyConfigured | None = None

    def __init__(self) -> None:
        self.statuses = []
        if self.scopes:
            return
        if not getattr(self, "rate", None):
            self.rate = self.get_rate()
        try:
            self.num_requests, self.duration = self.parse_rate(self.rate)
        except ImproperlyConfigured as exc:
            # Reported by `manage.py check`; at request time it answers as a failed
            # store would (503, or allowed with FAIL_OPEN) instead of a 500.
            self._rate_error = exc

    # -- DRF's API --------------------------------------------------------------------

    def get_rate(self) -> str | None:
        """Return the rate of ``scope``; raise ImproperlyConfigured when there is none."""
        if not getattr(self, "scope", None):
            raise ImproperlyConfigured(f"You must set either `.scope` or `.rate` for '{type(self).__name__}' throttle")
        assert self.scope is not None
        return self._rate_of(self.scope)

    def parse_rate(self, rate: str | None) -> tuple[int | float | None, int | float | None]:
        """Return ``(num_requests, duration)`` of a rate string, ``(None, None)`` for None."""
        if rate is None:
            return (None, None)
        try:
            return _rate_numbers(rate)
        except ValueError as exc:
            raise ImproperlyConfigured(f"throttle {self._name()!r}: {exc}") from None

    def get_cache_key(self, request: DRFRequest, view: Any) -> object:
        """Return the key of ``request``'s bucket, or None to leave it unthrottled."""
        raise NotImplementedError(".get_cache_key() must be overridden")

    def get_ident(self, request: DRFRequest) -> str | None:  # type: ignore[override]
        """Return the client's address key (see ``django_tokenbucket.ip``), None if unknown.

        Unless ``TOKENBUCKET["TRUSTED_PROXIES"]`` is set, DRF's ``NUM_PROXIES`` is honoured
        as a count of trusted proxies; DRF's own fallback of trusting any
        ``X-Forwarded-For`` is not reproduced, since any client could forge it.
        """
        trusted = tokenbucket_settings.TRUSTED_PROXIES
        if trusted is None and api_settings.NUM_PROXIES:
            trusted = int(api_settings.NUM_PROXIES)
        # Every throttle of a view asks, some twice: the answer is the request's.
        memo: dict[object, str | None] = getattr(request, "_request", request).__dict__.setdefault(
            "_tokenbucket_ident", {}
        )
        memo_key = tuple(trusted) if isinstance(trusted, list) else trusted
        if memo_key not in memo:
            address = client_address(request, trusted_proxies=trusted)
            memo[memo_key] = None if address is None else ip_key(address)
        return memo[memo_key]

    def allow_request(self, request: DRFRequest, view: Any) -> bool:
        # The Django request's method: DRF's Request finds it only after a failed lookup.
        method = getattr(getattr(request, "_request", request), "method", None)
        if method == "OPTIONS" and not tokenbucket_settings.COUNT_OPTIONS:
            return True  # a CORS preflight is the browser's, not the user's, request
        try:
            scopes = self.get_scopes(request, view)
            signature: Signature = (type(self), tuple(scopes))
            decided = _decided(request, signature)
            if decided is not None:
                # A sibling asked first and decided this throttle with itself.
                self.key, self.statuses = decided
                self.now = self.timer()
                return all(status.ok for status in self.statuses) or no_store(view)
            plan = self.limit_requests(request, view, scopes)
            if not plan:
                return True
            self.now = self.timer()
            self.statuses = _decide_for_view(request, view, self, signature, plan)
        except BackendUnavailable as exc:
            no_store(view)
            raise ServiceUnavailable() from exc
        except ImproperlyConfigured as exc:
            return self._misconfigured(exc, view)
        for status in self.statuses:
            if not status.ok:
                return no_store(view)
        return True

    def wait(self) -> float | None:
        """Return the exact time until this throttle would let the request through.

        None when nothing this throttle denied can ever succeed. A subclass that keeps
        DRF's request ``history`` itself gets DRF's estimate from it.
        """
        if self.statuses:
            waits = [status.retry_after for status in self.statuses if not status.ok]
            if not waits or None in waits:
                return None
            return max(waits)  # type: ignore[type-var]
        return self._history_wait()

    # -- what subclasses may customise beyond DRF's API ---------------------------------

    def get_scopes(self, request: DRFRequest, view: Any) -> list[str]:
        """Return the scopes this throttle takes from for ``request``."""
        if self.scopes:
            return list(self.scopes)
        return [self.scope] if self.scope else []

    def get_key(self, request: DRFRequest, view: Any) -> object:
        """Return the bucket key (default: ``get_cache_key``); None leaves the request alone."""
        return self.get_cache_key(request, view)

    def get_count(self, request: DRFRequest, view: Any) -> float:
        """Return how many tokens ``request`` costs: the view's ``throttle_cost``, or 1."""
        return getattr(view, "throttle_cost", 1)

    # -- how a request becomes limits ---------------------------------------------------

    def limit_requests(self, request: DRFRequest, view: Any, scopes: Sequence[str] | None = None) -> list[LimitRequest]:
        """Return the limits this throttle takes from for ``request`` (empty: not throttled).

        ``scopes`` are ``get_scopes()``'s answer when the caller has it already.
        """
        if scopes is None:
            scopes = self.get_scopes(request, view)
        if len(scopes) > 1 or self.scopes:
            given = [(scope, rate) for scope in scopes if (rate := self._rate_of(scope)) is not None]
            if not given:
                return []
        else:
            if self._rate_error is not None:
                raise self._rate_error
            rate = self.rate
            if rate is None or not (scopes or rate):
                return []
            given = [(self._name(), rate)]
        self.key = key = self.get_key(request, view)
        if key is None:
            return []
        count = self.get_count(request, view)
        return [_limit_request(name, rate, key, count) for name, rate in given]

    def signature(self, request: DRFRequest, view: Any) -> Signature:
        return (type(self), tuple(self.get_scopes(request, view)))

    def _name(self) -> str:
        return self.scope or f"{type(self).__module__}.{type(self).__qualname__}"

    def _rate_of(self, scope: str) -> str | None:
        if scope in tokenbucket_settings.limits():
            return LimitRate(scope)
        rates = self.THROTTLE_RATES if self.THROTTLE_RATES is not None else api_settings.DEFAULT_THROTTLE_RATES
        try:
            rate = rates[scope]
        except KeyError:
            raise ImproperlyConfigured(
                f"No default throttle rate set for {scope!r} scope: add it to "
                f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] or TOKENBUCKET['LIMITS']"
            ) from None
        return None if rate is None else str(rate)

    def _misconfigured(self, exc: ImproperlyConfigured, view: Any) -> bool:
        # A misconfigured limit cannot decide, like a store that is down: the fail mode
        # applies, and the error is logged where an operator will see it.
        name = self._name()
        throttled_logger.log(logging.ERROR, name, "throttle %r cannot decide: %s", name, exc)
        if tokenbucket_settings.FAIL_OPEN:
            return True
        no_store(view)
        raise ServiceUnavailable() from exc

    def _history_wait(self) -> float | None:
        history = getattr(self, "history", None)
        if history is None or not self.num_requests or not self.duration:
            return None
        if history:
            remaining = self.duration - ((self.now or self.timer()) - history[-1])
        else:
            remaining = self.duration
        available = self.num_requests - len(history) + 1
        if available <= 0:
            return None
        return float(remaining) / float(available)


def no_store(view: Any) -> bool:
    """Make the view's 429 or 503 uncacheable, with or without RateLimitMiddleware; return False.

    DRF builds that response in its exception handler, which adds no header of ours;
    an APIView copies its ``headers`` (set per request) onto every response it returns.
    """
    headers = getattr(view, "headers", None)
    if isinstance(headers, dict):
        headers["Cache-Control"] = "no-store"
    return False


#: The name this library used before it had DRF's ``SimpleRateThrottle``.
TokenBucketThrottle = SimpleRateThrottle


def _limit_request(name: str, rate: str, key: object, count: float) -> LimitRequest:
    if isinstance(rate, LimitRate):
        return LimitRequest(rate.limit_name, key, count)
    return LimitRequest(name, key, count, config=_scope_limit(name, rate))


@lru_cache(maxsize=256)
def _scope_limit(name: str, rate: str) -> LimitConfig:
    # Parsed once per scope and rate, not per request (a changed rate is another entry).
    return limiter.resolve(name, {"rate": rate})


def _decide_for_view(
    request: DRFRequest, view: Any, throttle: SimpleRateThrottle, own: Signature, plan: list[LimitRequest]
) -> list[Status]:
    """Decide every throttle of this module on ``view`` at once, the first time one is asked.

    DRF asks each throttle in turn and would let the first ones spend tokens even when a
    later one denies; deciding them together with ``limit_many`` makes it all-or-nothing.
    ``own`` is ``throttle``'s signature for this request.
    """
    siblings = _siblings(view, throttle, own, request)
    if siblings is None:
        # Asked outside the view's own throttles (or the view has none): this one alone.
        return _limit_all(request, throttle, plan)
    cache: dict[Signature, tuple[object, list[Status]]] = request.__dict__.setdefault("_tokenbucket_throttles", {})
    if siblings:
        plans = [(own, throttle.key, plan)]
        for sibling, signature in siblings:
            plans.append((signature, sibling.key, sibling.limit_requests(request, view, signature[1])))
        results = _limit_all(request, throttle, [limit for _, _, limits in plans for limit in limits])
        position = 0
        for signature, key, limits in plans:
            cache[signature] = (key, results[position : position + len(limits)])
            position += len(limits)
    else:
        # The view's only throttle of this module, as most are: nothing to share.
        results = _limit_all(request, throttle, plan)
        cache[own] = (throttle.key, results)
    # For RateLimit headers added by RateLimitMiddleware.
    django_request = getattr(request, "_request", request)
    setattr(django_request, "_tokenbucket_throttle_statuses", results)  # noqa: B010
    return cache[own][1]


def _limit_all(request: DRFRequest, throttle: SimpleRateThrottle, limits: list[LimitRequest]) -> list[Status]:
    """``limit_many(limits)`` as a list, at the throttle's ``timer()`` if it was replaced."""
    if not limits:
        return []
    seen = current_request.set(request)
    try:
        # limit_many's own path, without its conversion of what are LimitRequests already.
        if throttle.timer is time.time or throttle.now is None:
            return list(limiter.engine.decide_many(limits, apply=True, throws=False))
        with clock.pinned(round(throttle.now * MICRO)):
            return list(limiter.engine.decide_many(limits, apply=True, throws=False))
    finally:
        current_request.reset(seen)


@lru_cache(maxsize=1024)
def _throttles_of_this_module(throttle_classes: tuple[Any, ...]) -> tuple[type[SimpleRateThrottle], ...]:
    # Worked out once per view class (per list of throttle classes), not per request.
    return tuple(cls for cls in throttle_classes if isinstance(cls, type) and issubclass(cls, SimpleRateThrottle))


def _siblings(
    view: Any, throttle: SimpleRateThrottle, own: Signature, request: DRFRequest
) -> list[tuple[SimpleRateThrottle, Signature]] | None:
    """Return the view's other throttles of this module with their signatures, or None if
    ``throttle`` is not one of the view's own (it then decides alone).

    DRF makes a view's throttles anew for each request and asks them in turn; from the
    first one asked, the others are made here once more to decide them together. A view
    that keeps DRF's ``get_throttles`` names its classes in ``throttle_classes``, so only
    the classes other than ``throttle``'s are made; a view with its own
    ``get_throttles`` is asked for its throttles, which are then compared by signature.
    """
    get_throttles = getattr(view, "get_throttles", None)
    if get_throttles is None:
        return None
    if getattr(type(view), "get_throttles", None) is _drf_get_throttles():
        classes = _throttles_of_this_module(tuple(view.throttle_classes))
        if len(classes) == 1:
            return [] if classes[0] is type(throttle) else None
        if type(throttle) not in classes:
            return None
        if classes.count(type(throttle)) == 1:
            others = [cls() for cls in classes if cls is not type(throttle)]
            return [(other, other.signature(request, view)) for other in others]
    made = [t for t in get_throttles() if isinstance(t, SimpleRateThrottle)]
    signatures = [(sibling, sibling.signature(request, view)) for sibling in made]
    if not any(signature == own for _, signature in signatures):
        return None
    return [(sibling, signature) for sibling, signature in signatures if signature != own]


@cache
def _drf_get_throttles() -> Any:
    # Imported on first use: importing rest_framework.views reads DEFAULT_THROTTLE_CLASSES,
    # which name this package's classes, so they must exist first.
    from rest_framework import views as drf_views

    return drf_views.APIView.get_throttles


def _decided(request: DRFRequest, signature: Signature) -> tuple[object, list[Status]] | None:
    """Return the key and statuses another throttle of the view decided for ``signature``."""
    # DRF's own tests ask with request={}: nothing was decided for that.
    decided = getattr(request, "__dict__", {}).get("_tokenbucket_throttles")
    return decided.get(signature) if decided else None


class AnonRateThrottle(SimpleRateThrottle):
    """Limits anonymous users by address, under scope ``anon`` (as DRF's)."""

    scope: str | None = "anon"

    def get_cache_key(self, request: DRFRequest, view: Any) -> object:
        if _authenticated(request):
            return None
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}

    def get_key(self, request: DRFRequest, view: Any) -> object:
        if type(self).get_cache_key is not AnonRateThrottle.get_cache_key:  # a subclass's own
            return self.get_cache_key(request, view)
        if _authenticated(request):
            return None
        return ("ip", self.get_ident(request) or "unknown")


class UserRateThrottle(SimpleRateThrottle):
    """Limits each user, and anonymous users by address, under scope ``user`` (as DRF's)."""

    scope: str | None = "user"

    def get_cache_key(self, request: DRFRequest, view: Any) -> object:
        ident = request.user.pk if _authenticated(request) else self.get_ident(request)
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def get_key(self, request: DRFRequest, view: Any) -> object:
        # Keys that carry their kind read as such in the admin (a user id, an address);
        # a subclass's own get_cache_key is used as it is.
        if type(self).get_cache_key is not UserRateThrottle.get_cache_key:
            return self.get_cache_key(request, view)
        user = _authenticated_user(request)
        if user is not None:
            return ("user", user.pk)
        return ("ip", self.get_ident(request) or "unknown")


class ScopedRateThrottle(UserRateThrottle):
    """Limits by the view's ``throttle_scope`` attribute, per user or address (as DRF's).

    ``throttle_scope`` may also be a list of scopes, consumed all-or-nothing (e.g. a
    burst and a sustained rate).
    """

    scope_attr = "throttle_scope"
    scope: str | None = None

    def __init__(self) -> None:
        # The rate depends on the view, known only when a request comes (as in DRF).
        self.statuses = []

    def get_scopes(self, request: DRFRequest, view: Any) -> list[str]:
        scope = getattr(view, self.scope_attr, None)
        if not scope:
            self.scope = self.rate = None
            return []
        scopes = [scope] if isinstance(scope, str) else list(scope)
        # As DRF's: scope, rate, num_requests and duration describe the view's scope.
        self.scope = scopes[0]
        self.rate = self.get_rate()
        self._rate_error = None
        try:
            self.num_requests, self.duration = self.parse_rate(self.rate)
        except ImproperlyConfigured as exc:
            self._rate_error = exc
        return scopes


def _authenticated(request: Any) -> bool:
    return _authenticated_user(request) is not None


def _authenticated_user(request: Any) -> Any:
    """The request's user if authenticated, else None (DRF's ``request.user`` is a property)."""
    user = getattr(request, "user", None)
    return user if user is not None and user.is_authenticated else None


def _subclasses(cls: type[SimpleRateThrottle]) -> Iterator[type[SimpleRateThrottle]]:
    for subclass in cls.__subclasses__():
        yield subclass
        yield from _subclasses(subclass)


def declared_throttle_rates() -> dict[str, tuple[str, str | None]]:
    """Return the rates the throttle classes imported so far declare, by scope.

    Each value is ``(where, rate)``: a class's own ``rate`` for its ``scope``, and every
    entry of a class's ``THROTTLE_RATES``. For the system checks and the registry
    (the admin, the command and cleanup), which import the URLconf first.
    """
    rates: dict[str, tuple[str, str | None]] = {}
    for cls in _subclasses(SimpleRateThrottle):
        where = f"{cls.__module__}.{cls.__qualname__}"
        if "<locals>" in where:
            continue  # made inside a function: not one of the project's classes
        own_rates = cls.__dict__.get("THROTTLE_RATES")
        if isinstance(own_rates, Mapping):
            for scope, rate in own_rates.items():
                rates.setdefault(str(scope), (f"{where}.THROTTLE_RATES", rate))
        rate = cls.__dict__.get("rate")
        if isinstance(rate, str) and cls.scope:
            rates.setdefault(cls.scope, (f"{where}.rate", rate))
    return rates


registry.add_throttle_rates_source(declared_throttle_rates)
