"""HTTP plumbing shared by the decorator, the middleware and the DRF throttles:
request keys, the 429 and 503 responses, and the RateLimit headers."""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.utils.module_loading import import_string

from .conf import tokenbucket_settings
from .exceptions import BackendUnavailable, RateLimited
from .ip import client_ip
from .keys import is_request_data_key
from .status import Status

__all__ = [
    "KeySpec",
    "add_ratelimit_headers",
    "default_response",
    "rate_limited_response",
    "request_key",
    "unavailable_response",
]

#: What a ``key=`` may be: a spec string ("ip", "user", "user_or_ip", "header:<name>",
#: "get:<param>", "post:<field>", a dotted path) or a callable ``(request) -> key``.
KeySpec = str | Callable[[HttpRequest], Any]

ResponseT = TypeVar("ResponseT", bound=HttpResponseBase)

_SIMPLE_KEYS = ("ip", "user", "user_or_ip", "username")
_FIELD_KEYS = ("header", "get", "post")


def normalize_identity(value: str) -> str:
    """Return the one spelling of an identity a request sent: NFKC, stripped, case-folded.

    Django's login strips the username and NFKC-normalises it, and MySQL/MariaDB
    collations ignore case, so ``" ＶＩＣＴＩＭ"`` logs in as ``victim``: every such
    spelling must meet one bucket, or an attacker multiplies an account's limit by
    rewriting the name. ``TOKENBUCKET["FOLD_KEY_CASE"] = False`` keeps case.
    """
    text = unicodedata.normalize("NFKC", value).strip()
    return text.casefold() if tokenbucket_settings.FOLD_KEY_CASE else text


def _username(request: HttpRequest) -> str | None:
    field = get_user_model().USERNAME_FIELD
    value = request.POST.get(field)
    return None if value is None else str(value)


def _user_or_ip(request: HttpRequest) -> tuple[str, object]:
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return ("user", user.pk)
    # Anonymous requests are told apart by address: they never share one bucket.
    return ("ip", client_ip(request))


def request_key(request: HttpRequest, spec: KeySpec) -> object:
    """Return the rate-limit key of ``request`` for a key ``spec``.

    Keys carry their kind (``("ip", "203.0.113.7")``, ``("user", 42)``), so a user id
    never meets an address. A field that is missing (``get:``, ``post:``, ``header:``)
    falls back to the client's address rather than one bucket shared by everyone
    without it. A callable (or dotted path) may return None to exempt the request.
    """
    if callable(spec):
        return spec(request)
    if not isinstance(spec, str):
        raise ImproperlyConfigured(f"a rate-limit key must be a str or a callable, not {spec!r}")
    if spec == "ip":
        return ("ip", client_ip(request))
    if spec in ("user", "user_or_ip"):
        return _user_or_ip(request)
    kind, _, field = spec.partition(":")
    if spec == "username" or (kind in _FIELD_KEYS and field):
        if spec == "username":
            value = _username(request)
        elif kind == "header":
            value = request.headers.get(field)
        elif kind == "get":
            value = request.GET.get(field)
        else:
            value = request.POST.get(field)
        value = None if value is None else normalize_identity(value)
        if not value:
            return (spec, None, "ip", client_ip(request))
        return (spec, value)
    if "." in spec:
        return request_key(request, _import_key_function(spec))
    raise ImproperlyConfigured(
        f"unknown rate-limit key {spec!r}: expected one of {', '.join(_SIMPLE_KEYS)}, "
        f"'header:<name>', 'get:<param>', 'post:<field>', a callable or a dotted path to one"
    )


def key_from_text(text: str) -> object | None:
    """Return the key the decorator builds, written as ``<spec>=<value>``; None if not one.

    ``"post:username=Alice"`` is the key of ``key="post:username"`` for a request that sent
    ``Alice`` (normalised as the decorator does), ``"ip=192.0.2.1"`` and ``"user=42"`` those
    of ``key="ip"`` and ``key="user"``. For finding a bucket whose key is not stored in
    clear (the admin's search, the command).
    """
    spec, separator, value = text.partition("=")
    spec = spec.strip()
    if not separator or not value:
        return None
    if spec == "ip":
        return ("ip", value.strip())
    if spec == "user":
        value = value.strip()
        return ("user", int(value) if value.isdecimal() else value)
    kind, _, field = spec.partition(":")
    if spec == "username" or (kind in _FIELD_KEYS and field):
        return (spec, normalize_identity(value))
    return None


def _import_key_function(path: str) -> Callable[[HttpRequest], Any]:
    try:
        function = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"rate-limit key {path!r} cannot be imported: {exc}") from None
    if not callable(function):
        raise ImproperlyConfigured(f"rate-limit key {path!r} is not callable")
    return function  # type: ignore[no-any-return]


def validate_key_spec(spec: KeySpec) -> None:
    """Raise ImproperlyConfigured now for a key spec that could never work."""
    if callable(spec):
        return
    if not isinstance(spec, str):
        raise ImproperlyConfigured(f"a rate-limit key must be a str or a callable, not {spec!r}")
    kind, _, field = spec.partition(":")
    if spec in _SIMPLE_KEYS or (kind in _FIELD_KEYS and field) or ("." in spec and ":" not in spec):
        return
    raise ImproperlyConfigured(
        f"unknown rate-limit key {spec!r}: expected one of {', '.join(_SIMPLE_KEYS)}, "
        f"'header:<name>', 'get:<param>', 'post:<field>', a callable or a dotted path to one"
    )


# -- responses -------------------------------------------------------------------------


def _wants_json(request: HttpRequest) -> bool:
    accept = request.headers.get("Accept", "")
    return "json" in accept or "json" in (request.content_type or "")


def default_response(request: HttpRequest, status: Status | None) -> HttpResponse:
    """Answer 429 Too Many Requests: JSON for JSON clients, plain text for others."""
    retry_after = status.retry_after_header if status is not None else None
    detail = "Too many requests."
    if retry_after is not None:
        detail += f" Retry in {retry_after} second{'s' if retry_after != 1 else ''}."
    if _wants_json(request):
        return JsonResponse({"detail": detail, "retry_after": retry_after}, status=429)
    return HttpResponse(detail, status=429, content_type="text/plain; charset=utf-8")


def rate_limited_response(request: HttpRequest, status: Status | None) -> HttpResponse:
    """Build the 429 response (``TOKENBUCKET["RESPONSE"]``) and add the headers it must carry."""
    factory = tokenbucket_settings.RESPONSE
    if isinstance(factory, str):
        factory = import_string(factory)
    response: HttpResponse = factory(request, status)
    if status is not None and status.retry_after_header is not None and not response.has_header("Retry-After"):
        response["Retry-After"] = str(status.retry_after_header)
    # RFC 6585: a 429 must not be stored by a cache.
    response["Cache-Control"] = "no-store"
    return response


def unavailable_response(request: HttpRequest, exc: BackendUnavailable) -> HttpResponse:
    """Answer 503: the rate-limit store failed (fail closed), not the client."""
    detail = "Rate limiting is temporarily unavailable."
    if _wants_json(request):
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
    """
    policies = []
    limits = []
    for status in statuses:
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
