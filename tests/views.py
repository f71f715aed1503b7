"""Views the HTTP tests drive through Django's and DRF's test clients."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.decorators import action, api_view, throttle_classes
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.viewsets import ViewSet

from django_tokenbucket import limiter
from django_tokenbucket.decorators import UNSAFE, ratelimit
from django_tokenbucket.throttling import AnonRateThrottle, ScopedRateThrottle, TokenBucketThrottle, UserRateThrottle


def _body(request: HttpRequest) -> dict:
    status = getattr(request, "ratelimit", None)
    return {
        "limited": getattr(request, "limited", None),
        "value": None if status is None else status.value,
    }


@ratelimit(key="ip", rate="2/m")
def inline_ip(request):
    return JsonResponse(_body(request))


@ratelimit("login", key="post:username", method=UNSAFE)
def login(request):
    return JsonResponse(_body(request))


@ratelimit("ten_per_minute", key="ip")
@ratelimit("login", key="post:username", method=UNSAFE)
def stacked(request):
    return JsonResponse(_body(request))


@ratelimit(key="user_or_ip", rate="2/m", block=False)
def soft(request):
    return JsonResponse(_body(request))


def key_from_header(request):
    return request.headers.get("X-Tenant")


@ratelimit(key="tests.views.key_from_header", rate="1/m")
def by_dotted_path(request):
    return JsonResponse(_body(request))


@ratelimit(key=lambda request: None if request.GET.get("staff") else ("k", "shared"), rate="1/m")
def exemptable(request):
    return JsonResponse(_body(request))


@ratelimit(key="ip", rate=10, period=60, count=lambda request: int(request.GET.get("cost", "1")))
def weighted(request):
    return JsonResponse(_body(request))


@ratelimit(key="ip", rate="2/m")
async def async_view(request):
    return JsonResponse(_body(request))


@ratelimit(key="user_or_ip", rate="2/m")
async def async_by_user(request):
    return JsonResponse(_body(request))


def _header_or_none(request: HttpRequest) -> str | None:
    return request.headers.get("X-Key")


@ratelimit(key=_header_or_none, rate="1/m")
@ratelimit(key="ip", rate="3/m")
async def async_stacked(request):
    return JsonResponse(_body(request))


@ratelimit(key="header:X-Key", rate="5/m", count=lambda request: int(request.GET.get("cost", "1")))
async def async_weighted(request):
    return JsonResponse(_body(request))


async def _signed_in_user(request: HttpRequest) -> object:
    user = await request.auser()  # the async session and user lookups
    return ("user", user.pk) if user.is_authenticated else None


async def _async_cost(request: HttpRequest) -> int:
    return int(request.GET.get("cost", "1"))


@ratelimit(key=_signed_in_user, rate="3/m", count=_async_cost)
@ratelimit(key="ip", rate="10/m")
async def async_awaited_key(request):
    return JsonResponse(_body(request))


@ratelimit(key="ip", rate="1/m", shadow=True)
def shadowed(request):
    return JsonResponse({**_body(request), "would_deny": request.ratelimit.would_deny})


def raises(request):
    limiter.limit("login", key=request.GET.get("who", "x"), count=5, throws=True)
    return HttpResponse("ok")


@ratelimit(key="ip", rate="2/m")
class ClassView(View):
    def get(self, request):
        return JsonResponse(_body(request))

    def post(self, request):
        return JsonResponse(_body(request))


class MethodDecorated(View):
    @method_decorator(ratelimit(key="ip", rate="1/m"))
    def get(self, request):
        return JsonResponse(_body(request))


@ratelimit(key="ip", rate="1/m", kind="fixed window")
def unavailable_probe(request):
    return HttpResponse("ok")


# -- DRF ----------------------------------------------------------------------------


class DefaultThrottled(APIView):
    """Uses REST_FRAMEWORK['DEFAULT_THROTTLE_CLASSES']."""

    def get(self, request):
        return Response({"ok": True})


class LimitedInside(APIView):
    """Calls the limiter itself, with throws=True, on a key clients must not see."""

    throttle_classes: list[type] = []

    def post(self, request):
        limiter.limit("login", ("secret-account", request.data.get("username")), throws=True)
        return Response({"ok": True})


class TwoThrottles(APIView):
    throttle_classes = [UserRateThrottle, ScopedRateThrottle]
    throttle_scope = "scarce"

    def get(self, request):
        return Response({"ok": True})


class BurstSustained(APIView):
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = ["api_burst", "api_sustained"]

    def get(self, request):
        return Response({"ok": True})


class TenantThrottle(TokenBucketThrottle):
    scope = "tenant"

    def get_key(self, request, view):
        return request.headers.get("X-Tenant")


class Costly(APIView):
    throttle_classes = [TenantThrottle]
    throttle_cost = 3

    def get(self, request):
        return Response({"ok": True})


@api_view(["GET"])
@throttle_classes([AnonRateThrottle])
def function_api(request):
    return Response({"ok": True})


class Things(ViewSet):
    throttle_classes: list = []

    def list(self, request):
        return Response([])

    @action(detail=False, throttle_classes=[UserRateThrottle])
    def special(self, request):
        return Response({"ok": True})


def keyed_by_pk(request):
    """The old Quick start's mistake: ``request.user.pk`` is None for anonymous visitors."""
    limiter.limit("keyed_by_pk", key=request.user.pk, config="100/m")
    return HttpResponse("ok")


def global_budget(request):
    limiter.limit("global_budget", config="100/m")
    return HttpResponse("ok")
