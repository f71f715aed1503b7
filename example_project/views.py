"""Views of the example project: the limiter API used directly."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from django_tokenbucket import limiter
from django_tokenbucket.conf import tokenbucket_settings


def _client_key(request: HttpRequest) -> str:
    # The example trusts REMOTE_ADDR only; behind a proxy see the decorator docs.
    return request.META.get("REMOTE_ADDR", "")


def home(request: HttpRequest) -> HttpResponse:
    key = _client_key(request)
    statuses = [limiter.get_status(name, key) for name in tokenbucket_settings.limits()]
    return render(request, "home.html", {"statuses": statuses, "key": key})


@require_POST
def hit(request: HttpRequest, name: str) -> JsonResponse:
    """Take one token (or ``?count=N``) from limit ``name`` for this client."""
    try:
        count = float(request.GET.get("count", "1"))
        status = limiter.limit(name, _client_key(request), count=count, reserve="reserve" in request.GET)
    except ValueError as exc:
        return JsonResponse({"detail": str(exc)}, status=400)
    body = {
        "ok": status.ok,
        "value": status.value,
        "retry_after": status.retry_after,
        "reset_after": status.reset_after,
        "capacity": status.capacity,
    }
    response = JsonResponse(body, status=200 if status.ok else 429)
    if not status.ok and status.retry_after_header is not None:
        response["Retry-After"] = str(status.retry_after_header)
        response["Cache-Control"] = "no-store"
    return response
