"""Views and URLs of ``benchmarks/suite/http_stack.py`` (its ROOT_URLCONF).

Pairs that differ only in their rate limiting, each next to a view without any:

    /drf/...  an APIView: no throttle, our drop-in UserRateThrottle, DRF's own
    /fn/...   a function view: no decorator, our @ratelimit, django-ratelimit's

The timed views use 100 per second (burst 100) as peers.py does; the ``sanity`` views
allow 5 requests per hour, to check that each one really answers 429 after its limit.
Which of our backends a view of ours uses is chosen by the benchmark, not here.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django_ratelimit.decorators import ratelimit as peer_ratelimit
from rest_framework import throttling as drf_throttling
from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_tokenbucket import throttling as our_throttling
from django_tokenbucket.decorators import ratelimit as our_ratelimit

#: The header naming the requesting user (the benchmark sends the client's key).
USER_HEADER = "HTTP_X_BENCH_USER"
_users: dict[str, User] = {}


class HeaderUserAuthentication(BaseAuthentication):
    """Authenticate as the user the ``X-Bench-User`` header names, without a query.

    Users are unsaved ``User`` instances with a primary key, made on first sight and kept:
    what DRF's ``force_authenticate`` would give, from a class both throttles share, so
    that neither comparison is about sessions or a users table.
    """

    def authenticate(self, request: Request) -> tuple[User, None] | None:
        name = request.META.get(USER_HEADER)
        if name is None:
            return None
        user = _users.get(name)
        if user is None:
            user = _users[name] = User(pk=len(_users) + 1, username=name)
        return user, None


def ratelimited(request: HttpRequest, exception: Exception) -> HttpResponse:
    """django-ratelimit's RATELIMIT_VIEW: its denials as 429, as ours and DRF's answer."""
    return HttpResponse(b"rate limited", status=429)


# --------------------------------------------------------------------------- DRF


class PlainAPIView(APIView):
    """Baseline: the same view without a throttle."""

    authentication_classes = [HeaderUserAuthentication]
    throttle_classes: list[type[drf_throttling.BaseThrottle]] = []

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class OurThrottledView(PlainAPIView):
    """Our drop-in UserRateThrottle (scope ``user``)."""

    throttle_classes = [our_throttling.UserRateThrottle]


class DRFThrottledView(PlainAPIView):
    """DRF's own UserRateThrottle (scope ``user``), on the default cache."""

    throttle_classes = [drf_throttling.UserRateThrottle]


class OurSanityThrottle(our_throttling.UserRateThrottle):
    scope = "http_sanity"


class DRFSanityThrottle(drf_throttling.UserRateThrottle):
    scope = "http_sanity"


class OurSanityView(PlainAPIView):
    throttle_classes = [OurSanityThrottle]


class DRFSanityView(PlainAPIView):
    throttle_classes = [DRFSanityThrottle]


# --------------------------------------------------------------------------- function views


def plain(request: HttpRequest) -> HttpResponse:
    """Baseline: the same view without a decorator."""
    return HttpResponse(b'{"ok": true}', content_type="application/json")


@our_ratelimit(key="ip", rate="100/s")
def ours_decorated(request: HttpRequest) -> HttpResponse:
    """Our decorator, per client address."""
    return plain(request)


@peer_ratelimit(key="ip", rate="100/s", block=True)
def peer_decorated(request: HttpRequest) -> HttpResponse:
    """django-ratelimit's decorator, per client address, on the default cache."""
    return plain(request)


@our_ratelimit(key="ip", rate="5/h")
def ours_decorated_sanity(request: HttpRequest) -> HttpResponse:
    """Our decorator, 5 per hour."""
    return plain(request)


@peer_ratelimit(key="ip", rate="5/h", block=True)
def peer_decorated_sanity(request: HttpRequest) -> HttpResponse:
    """django-ratelimit's decorator, 5 per hour."""
    return plain(request)


urlpatterns: list[Any] = [
    path("drf/plain/", PlainAPIView.as_view()),
    path("drf/ours/", OurThrottledView.as_view()),
    path("drf/drf/", DRFThrottledView.as_view()),
    path("drf/ours-sanity/", OurSanityView.as_view()),
    path("drf/drf-sanity/", DRFSanityView.as_view()),
    path("fn/plain/", plain),
    path("fn/ours/", ours_decorated),
    path("fn/peer/", peer_decorated),
    path("fn/ours-sanity/", ours_decorated_sanity),
    path("fn/peer-sanity/", peer_decorated_sanity),
]
