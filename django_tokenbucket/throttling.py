"""DRF throttles backed by exact token buckets: drop-in for ``rest_framework.throttling``.

::

    REST_FRAMEWORK = {
        "DEFAULT_THROTTLE_CLASSES": [
            "django_tokenbucket.throttling.AnonRateThrottle",
            "django_tokenbucket.throttling.UserRateThrottle",
        ],
        "DEFAULT_THROTTLE_RATES": {"anon": "100/day", "user": "5/10m"},
    }

Rates are read from ``DEFAULT_THROTTLE_RATES`` on every request, so ``override_settings``
works. A ``TOKENBUCKET["LIMITS"]`` entry named like a scope replaces that scope's rate
with a full limit (capacity, kind, shadow...). All of this module's throttles on one
view are decided together, all-or-nothing: a request denied by one spends no token of
the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext_lazy as _
from rest_framework.exceptions import APIException, Throttled
from rest_framework.request import Request as DRFRequest
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.throttling import BaseThrottle
from rest_framework.views import exception_handler as drf_exception_handler

from .api import LimitRequest, limiter
from .conf import tokenbucket_settings
from .exceptions import BackendUnavailable, RateLimited
from .http import add_ratelimit_headers
from .ip import client_ip
from .status import Status

__all__ = [
    "AnonRateThrottle",
    "ScopedRateThrottle",
    "ServiceUnavailable",
    "TokenBucketThrottle",
    "UserRateThrottle",
    "exception_handler",
]

Signature = tuple[str, tuple[str, ...]]


class ServiceUnavailable(APIException):
    """The rate-limit store failed and FAIL_OPEN is off: 503, the service failed, not the client."""

    status_code = 503
    default_detail = _("Rate limiting is temporarily unavailable.")
    default_code = "rate_limit_unavailable"


class TokenBucketThrottle(BaseThrottle):
    """Base class: a throttle on one ``scope`` (or several ``scopes``, all-or-nothing).

    Subclasses implement ``get_key(request, view)``, returning the bucket key or None
    to leave the request unthrottled. ``get_count`` weighs a request (default: the
    view's ``throttle_cost`` attribute, or 1).
    """

    scope: str | None = None
    scopes: Sequence[str] = ()

    def __init__(self) -> None:
        self.statuses: list[Status] = []

    # -- what subclasses customise --------------------------------------------------

    def get_scopes(self, request: DRFRequest, view: Any) -> list[str]:
        if self.scopes:
            return list(self.scopes)
        return [self.scope] if self.scope else []

    def get_key(self, request: DRFRequest, view: Any) -> object:
        raise NotImplementedError("TokenBucketThrottle subclasses must implement get_key()")

    def get_count(self, request: DRFRequest, view: Any) -> float:
        return getattr(view, "throttle_cost", 1)

    def get_ident(self, request: DRFRequest) -> str:
        """Return the client's address key (see ``django_tokenbucket.ip``).

        Unless ``TOKENBUCKET["TRUSTED_PROXIES"]`` is set, DRF's ``NUM_PROXIES`` is honoured
        as a count of trusted proxies; DRF's own fallback of trusting any
        ``X-Forwarded-For`` is not reproduced, since any client could forge it.
        """
        trusted = tokenbucket_settings.TRUSTED_PROXIES
        if trusted is None and api_settings.NUM_PROXIES:
            trusted = int(api_settings.NUM_PROXIES)
        return client_ip(request, trusted_proxies=trusted)

    # -- how a scope becomes a limit ------------------------------------------------

    def get_limit(self, scope: str) -> LimitRequest | None:
        """Return the limit of ``scope`` without a key: from LIMITS, else DEFAULT_THROTTLE_RATES."""
        if scope in tokenbucket_settings.limits():
            return LimitRequest(scope)
        rates = api_settings.DEFAULT_THROTTLE_RATES
        if scope not in rates:
            raise ImproperlyConfigured(
                f"No default throttle rate set for {scope!r} scope: add it to "
                f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] or TOKENBUCKET['LIMITS']"
            )
        rate = rates[scope]
        if rate is None:  # DRF's way to switch a scope off
            return None
        return LimitRequest(scope, config={"rate": rate})

    def limit_requests(self, request: DRFRequest, view: Any) -> list[LimitRequest]:
        """Return the limits this throttle takes from for ``request`` (empty: not throttled)."""
        scopes = self.get_scopes(request, view)
        if not scopes:
            return []
        key = self.get_key(request, view)
        if key is None:
            return []
        count = self.get_count(request, view)
        requests = []
        for scope in scopes:
            limit = self.get_limit(scope)
            if limit is not None:
                requests.append(LimitRequest(limit.name, key, count, config=limit.config))
        return requests

    def signature(self, request: DRFRequest, view: Any) -> Signature:
        return (f"{type(self).__module__}.{type(self).__qualname__}", tuple(self.get_scopes(request, view)))

    # -- BaseThrottle -----------------------------------------------------------------

    def allow_request(self, request: DRFRequest, view: Any) -> bool:
        try:
            self.statuses = _decide_for_view(request, view, self)
        except BackendUnavailable as exc:
            raise ServiceUnavailable() from exc
        return all(status.ok for status in self.statuses)

    def wait(self) -> float | None:
        """Return the exact time until this throttle would let the request through."""
        waits = [status.retry_after for status in self.statuses if not status.ok]
        if not waits or any(wait is None for wait in waits):
            return None
        return max(wait for wait in waits if wait is not None)


def _decide_for_view(request: DRFRequest, view: Any, throttle: TokenBucketThrottle) -> list[Status]:
    """Decide every TokenBucketThrottle of ``view`` at once, the first time one is asked.

    DRF asks each throttle in turn and would let the first ones spend tokens even when a
    later one denies; deciding them together with ``limit_many`` makes it all-or-nothing.
    """
    cache: dict[Signature, list[Status]] = request.__dict__.setdefault("_tokenbucket_throttles", {})
    own = throttle.signature(request, view)
    if own not in cache:
        ours = [t for t in view.get_throttles() if isinstance(t, TokenBucketThrottle)]
        if not any(t.signature(request, view) == own for t in ours):
            ours = [throttle]  # asked outside the view's own throttles
        plan = [(t.signature(request, view), t.limit_requests(request, view)) for t in ours]
        flat = [limit for _, limits in plan for limit in limits]
        results = list(limiter.limit_many(flat)) if flat else []
        position = 0
        for signature, limits in plan:
            cache[signature] = results[position : position + len(limits)]
            position += len(limits)
        # For RateLimit headers added by RateLimitMiddleware.
        django_request = getattr(request, "_request", request)
        setattr(django_request, "_tokenbucket_throttle_statuses", results)  # noqa: B010
    return cache[own]


class AnonRateThrottle(TokenBucketThrottle):
    """Limits anonymous users by address, under scope ``anon`` (as DRF's)."""

    scope = "anon"

    def get_key(self, request: DRFRequest, view: Any) -> object:
        if request.user and request.user.is_authenticated:
            return None
        return ("ip", self.get_ident(request))


class UserRateThrottle(TokenBucketThrottle):
    """Limits each user, and anonymous users by address, under scope ``user`` (as DRF's)."""

    scope = "user"

    def get_key(self, request: DRFRequest, view: Any) -> object:
        if request.user and request.user.is_authenticated:
            return ("user", request.user.pk)
        return ("ip", self.get_ident(request))


class ScopedRateThrottle(UserRateThrottle):
    """Limits by the view's ``throttle_scope`` attribute, per user or address (as DRF's).

    ``throttle_scope`` may also be a list of scopes, consumed all-or-nothing (e.g. a
    burst and a sustained rate).
    """

    scope_attr = "throttle_scope"

    def get_scopes(self, request: DRFRequest, view: Any) -> list[str]:
        scope = getattr(view, self.scope_attr, None)
        if not scope:
            return []
        return [scope] if isinstance(scope, str) else list(scope)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's ``EXCEPTION_HANDLER``, answering 429 for ``RateLimited`` and 503 for ``BackendUnavailable``.

    ``RateLimited`` is a ``PermissionDenied`` (so plain Django answers 403 rather than
    500), and DRF's own handler turns every ``PermissionDenied`` into a 403 whose body is
    the exception's message, key included. With this handler, ``limiter.limit(...,
    throws=True)`` in an API view answers like a throttle: 429 with ``Retry-After``.
    Everything else goes to DRF's handler::

        REST_FRAMEWORK = {"EXCEPTION_HANDLER": "django_tokenbucket.throttling.exception_handler"}
    """
    if isinstance(exc, RateLimited):
        response = drf_exception_handler(Throttled(wait=exc.retry_after), context)
        if response is not None:
            # RFC 6585: a 429 must not be stored by a cache.
            response["Cache-Control"] = "no-store"
            if exc.status is not None:
                add_ratelimit_headers(response, [exc.status])
        return response
    if isinstance(exc, BackendUnavailable):
        return drf_exception_handler(ServiceUnavailable(), context)
    return drf_exception_handler(exc, context)
