"""``exception_handler``: DRF's ``EXCEPTION_HANDLER`` answering 429 for ``RateLimited``, 503 for a failed store."""

from __future__ import annotations

from typing import Any

from rest_framework import views as drf_views
from rest_framework.exceptions import Throttled
from rest_framework.response import Response

from ..exceptions import BackendUnavailable, RateLimited
from ..http import add_ratelimit_headers
from .throttles import ServiceUnavailable

__all__ = ["exception_handler"]


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
        response = drf_views.exception_handler(Throttled(wait=exc.retry_after), context)
        if response is not None and exc.status is not None:
            add_ratelimit_headers(response, [exc.status])
    elif isinstance(exc, BackendUnavailable):
        response = drf_views.exception_handler(ServiceUnavailable(), context)
    else:
        response = drf_views.exception_handler(exc, context)
    if response is not None and isinstance(exc, (RateLimited, BackendUnavailable, Throttled, ServiceUnavailable)):
        # A refusal (RFC 6585: a 429 must not be stored) or a store that failed for the
        # moment: a shared cache must serve neither to anyone else.
        response["Cache-Control"] = "no-store"
    return response
