"""``RateLimitMiddleware``: turns rate-limit exceptions raised in views into responses.

Add ``"django_tokenbucket.middleware.RateLimitMiddleware"`` to MIDDLEWARE and a
``RateLimited`` raised anywhere in a view (``limiter.limit(..., throws=True)``) becomes
the same 429 the decorator sends, and ``BackendUnavailable`` a 503. It also marks every
429 ``Cache-Control: no-store`` and, with ``TOKENBUCKET["HEADERS"]``, adds the RateLimit
headers for decisions that DRF throttles recorded on the request. A login that login
protection refused (``django_tokenbucket.auth``) gets its answer here: 429 for a JSON
client, or ``LOGIN["RESPONSE"]``'s (``auth.responses``).
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.utils.deprecation import MiddlewareMixin

from .auth.responses import login_response
from .http import add_ratelimit_headers, response_for_exception

__all__ = ["RateLimitMiddleware"]


class RateLimitMiddleware(MiddlewareMixin):
    """Answer 429/503 for rate-limit exceptions; works under WSGI and ASGI."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        return response_for_exception(request, exception)

    def process_response(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        response = login_response(request, response)
        if response.status_code == 429 and not response.has_header("Cache-Control"):
            response["Cache-Control"] = "no-store"
        statuses = getattr(request, "_tokenbucket_throttle_statuses", None)
        if statuses and not response.has_header("RateLimit"):
            add_ratelimit_headers(response, statuses)
        return response
