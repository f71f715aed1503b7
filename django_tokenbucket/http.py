"""HTTP plumbing shared by the decorator, the middleware and the DRF throttles: the 429
and 503 responses and the RateLimit headers (a request's key: ``request_keys``)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import TypeVar

from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.utils.module_loading import import_string

from .exceptions import BackendUnavailable, RateLimited
from .keys import is_request_data_key
from .settings import tokenbucket_settings
from .status import Status

__all__ = [
    "add_ratelimit_headers",
    "default_response",
    "rate_limited_response",
    "unavailable_response",
    "wants_json",
]

ResponseT = TypeVar("ResponseT", bound=HttpResponseBase)


# -- responses -------------------------------------------------------------------------


def wants_json(request: HttpRequest) -> bool:
    """Return whether ``request`` asks for (or sends) JSON: its answer is JSON then."""
    # META, not request.headers: building that mapping of every header costs a denied
    # request more than the rest of its answer (a flood is made of denied requests).
    accept = request.META.get("HTTP_ACCEPT", "")
    return "json" in accept or "json" in (request.content_type or "")


def default_response(request: HttpRequest, status: Status | None) -> HttpResponse:
    """Answer 429 Too Many Requests: JSON for JSON clients, plain text for others."""
    retry_after = status.retry_after_header if status is not None else None
    detail = "Too many requests."
    if retry_after is not None:
        detail += f" Retry in {retry_after} second{'s' if retry_after != 1 else ''}."
    if wants_json(request):
        return JsonResponse({"detail": detail, "retry_after": retry_after}, status=429)
    # The charset given, not left for Django to find in the content type per response.
    return HttpResponse(detail, status=429, content_type="text/plain; charset=utf-8", charset="utf-8")


def rate_limited_response(request: HttpRequest, status: Status | None) -> HttpResponse:
    """Build the 429 response (``TOKENBUCKET["RESPONSE"]``) and add the headers it must carry."""
    factory = _response_factory(tokenbucket_settings.RESPONSE)
    response: HttpResponse = factory(request, status)
    retry_after = None if status is None else status.retry_after_header
    # A factory of the project's may have set its own; ours never does.
    if retry_after is not None and (factory is default_response or not response.has_header("Retry-After")):
        response["Retry-After"] = str(retry_after)
    # RFC 6585: a 429 must not be stored by a cache.
    response["Cache-Control"] = "no-store"
    if not tokenbucket_settings.LOG_DENIED_REQUESTS:
        # Django's log_response skips a response marked so. One WARNING per refusal would
        # let a flood write as many log lines as it sends requests, and it cost 13 of a
        # cached denial's 91 µs through a view; logs.DenialLog writes a line per key instead.
        response._has_been_logged = True  # type: ignore[attr-defined]
    return response


_imported_factory: tuple[str, Callable[[HttpRequest, Status | None], HttpResponse]] | None = None


def _response_factory(
    setting: str | Callable[[HttpRequest, Status | None], HttpResponse],
) -> Callable[[HttpRequest, Status | None], HttpResponse]:
    """Return ``RESPONSE`` as a callable: a dotted path is imported once while it stays the setting.

    Django's ``import_string`` caches the module, not the lookup: it splits the path and
    finds the module and the attribute again on every call, about 1 µs of each denial.
    """
    global _imported_factory
    if not isinstance(setting, str):
        return setting
    imported = _imported_factory
    if imported is None or imported[0] != setting:
        imported = _imported_factory = (setting, import_string(setting))
    return imported[1]


def unavailable_response(request: HttpRequest, exc: BackendUnavailable) -> HttpResponse:
    """Answer 503: the rate-limit store failed (fail closed), not the client."""
    detail = "Rate limiting is temporarily unavailable."
    if wants_json(request):
        response: HttpResponse = JsonResponse({"detail": detail}, status=503)
    else:
        response = HttpResponse(detail, status=503, content_type="text/plain; charset=utf-8")
    response["Cache-Control"] = "no-store"
    return response


def response_for_exception(request: HttpRequest, exc: Exception) -> HttpResponse | None:
    """Return the response for a RateLimited or BackendUnavailable, None for anything else."""
    if isinstance(exc, RateLimited):
        return rate_limited_response(request, exc.status)
    if isinstance(exc, BackendUnavailable):
        return unavailable_response(request, exc)
    return None


# -- RateLimit headers (draft-ietf-httpapi-ratelimit-headers) ---------------------------


def _sf_string(value: str) -> str:
    # A structured-field string holds printable ASCII only; escape quotes and backslashes.
    printable = re.sub(r"[^\x20-\x7e]", "?", value)
    return '"' + printable.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ratelimit_headers(statuses: Iterable[Status]) -> dict[str, str]:
    """Return ``RateLimit-Policy`` and ``RateLimit`` for the per-client limits in ``statuses``.

    Limits on a global key (None) are left out: their capacity describes the service,
    not the client, and the draft asks not to disclose operational capacity. So are
    limits keyed by what the request sent (``post:username``...): that bucket may be
    someone else's, and its state would tell whether their account is under attack.

    A refused request names only the limits that refused it: the others of its
    all-or-nothing call were not asked when memory refused it (the deny cache), and
    naming them on the store's refusals alone would change the set from one identical
    refusal to the next.
    """
    statuses = list(statuses)
    refused = [status for status in statuses if not status.ok]
    policies = []
    limits = []
    for status in refused or statuses:
        if status.key is None or status.value is None or status.shadow or is_request_data_key(status.key):
            continue
        name = _sf_string(status.name)
        policies.append(f"{name};q={math.floor(status.capacity)};w={max(1, math.ceil(status.period))}")
        if status.ok:
            reset = math.ceil(status.reset_after or 0)
        else:
            # Never later than Retry-After: a client waiting t seconds may then retry.
            reset = status.retry_after_header or 0
        limits.append(f"{name};r={status.remaining};t={max(0, reset)}")
    if not policies:
        return {}
    return {"RateLimit-Policy": ", ".join(policies), "RateLimit": ", ".join(limits)}


def add_ratelimit_headers(response: ResponseT, statuses: Iterable[Status]) -> ResponseT:
    """Add the RateLimit headers to ``response`` when ``TOKENBUCKET["HEADERS"]`` is on."""
    if tokenbucket_settings.HEADERS:
        for header, value in ratelimit_headers(statuses).items():
            response[header] = value
    return response
