"""Views and URLs of ``benchmarks/suite/flood.py`` (its ROOT_URLCONF).

A function view and a DRF view, each without limiting and with ours at one request an
hour per address, so that after the first request every one is denied: what a denied
request costs through Django's request handling, next to that handling alone.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.urls import path
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


class PlainAPIView(APIView):
    """Baseline: the DRF view without a throttle."""

    throttle_classes: list[type[BaseThrottle]] = []

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class ThrottledAPIView(PlainAPIView):
    """Our AnonRateThrottle (scope ``anon``: one request an hour per address)."""

    throttle_classes = [throttling.AnonRateThrottle]


urlpatterns: list[Any] = [
    path("fn/plain/", plain),
    path("fn/limited/", limited),
    path("drf/plain/", PlainAPIView.as_view()),
    path("drf/limited/", ThrottledAPIView.as_view()),
]
