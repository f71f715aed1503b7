"""Views and URLs of ``benchmarks/suite/flood.py`` (its ROOT_URLCONF).

A function view and a DRF view, each without limiting and with ours at one request an
hour per address, so that after the first request every one is denied: what a denied
request costs through Django's request handling, next to that handling alone and next
to the same view refusing every request itself (the framework's own 429, with no
limiter: what a denial costs at the least).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.urls import path
from rest_framework.authtoken.views import obtain_auth_token
from rest_framework.exceptions import Throttled
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import BaseThrottle
from rest_framework.views import APIView

from django_tokenbucket import throttling
from django_tokenbucket.decorators import ratelimit


def plain(request: HttpRequest) -> HttpResponse:
    """Baseline: the function view without a decorator."""
    return HttpResponse(b'{"ok": true}', content_type="application/json")


@ratelimit(key="ip", rate="1/h")
def limited(request: HttpRequest) -> HttpResponse:
    """Our decorator, per client address, one request an hour."""
    return plain(request)


def refused(request: HttpRequest) -> HttpResponse:
    """Baseline of a denial: the function view answering 429 itself, as ours does.

    Marked as logged, as our 429s are (``LOG_DENIED_REQUESTS``): Django's WARNING per
    response is no part of what either costs.
    """
    response = HttpResponse(b"Too many requests.", status=429, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = "3600"
    response["Cache-Control"] = "no-store"
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


class PlainAPIView(APIView):
    """Baseline: the DRF view without a throttle."""

    throttle_classes: list[type[BaseThrottle]] = []

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class ThrottledAPIView(PlainAPIView):
    """Our AnonRateThrottle (scope ``anon``: one request an hour per address)."""

    throttle_classes = [throttling.AnonRateThrottle]


class RefusingAPIView(PlainAPIView):
    """Baseline of a denial: the DRF view refusing as DRF's throttles make it refuse."""

    def get(self, request: Request) -> Response:
        raise Throttled(wait=3600)


urlpatterns: list[Any] = [
    path("fn/plain/", plain),
    path("fn/limited/", limited),
    path("fn/refused/", refused),
    path("drf/plain/", PlainAPIView.as_view()),
    path("drf/limited/", ThrottledAPIView.as_view()),
    path("drf/refused/", RefusingAPIView.as_view()),
    # Issue 48's login phase (flood_login.py): DRF's token login, no decorator on it.
    path("login/token/", obtain_auth_token),
]
