"""What tests/test_login*.py log in through: a password hasher that counts what it
checks, and a URLconf of the login paths with no decorator on any of them (the admin's,
Django's LoginView, DRF's obtain_auth_token, a JSON API login of a project's own)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from django.contrib import admin
from django.contrib.auth import authenticate
from django.contrib.auth.hashers import MD5PasswordHasher
from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from rest_framework.authtoken.views import obtain_auth_token

#: Passwords this process has checked (``verify``) and hashed (``encode``: what Django
#: runs for an unknown username, to answer in the same time).
CHECKED = {"verify": 0, "encode": 0}
#: Seconds each check sleeps: a password hash that takes time, as PBKDF2's does, is the
#: window concurrent guesses race through.
DELAY_ENV = "TOKENBUCKET_TEST_HASH_DELAY"


class CountingHasher(MD5PasswordHasher):
    """MD5 (fast, for tests only) that counts its work."""

    algorithm = "counting_md5"

    def verify(self, password: str, encoded: str) -> bool:
        CHECKED["verify"] += 1
        delay = float(os.environ.get(DELAY_ENV) or 0)
        if delay:
            time.sleep(delay)
        # MD5's verify encodes the password again: that is not a second hash run.
        return super().encode(password, encoded.split("$", 2)[1]) == encoded

    def encode(self, password: str, salt: str) -> str:
        CHECKED["encode"] += 1
        return super().encode(password, salt)


HASHERS = ["tests.login_support.CountingHasher"]


def checked() -> int:
    """Every password hasher run of this process so far."""
    return CHECKED["verify"] + CHECKED["encode"]


def reset_counts() -> None:
    CHECKED.update(verify=0, encode=0)


class PlainLoginView(LoginView):
    """Django's LoginView (AuthenticationForm, ``login()`` on success) answering without a template."""

    def form_invalid(self, form: Any) -> HttpResponse:
        return HttpResponse(" ".join(form.non_field_errors()) or "invalid", content_type="text/plain")

    def get(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return HttpResponse("the form")


def api_login(request: HttpRequest) -> JsonResponse:
    """A project's own JSON login: ``authenticate()``, 401 on failure."""
    data = json.loads(request.body or b"{}")
    user = authenticate(request, username=data.get("username"), password=data.get("password"))
    if user is None:
        return JsonResponse({"detail": "Invalid credentials."}, status=401)
    return JsonResponse({"user": user.get_username()})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/login/", PlainLoginView.as_view()),
    path("api/token/", obtain_auth_token),
    path("api/login/", api_login),
]


class CheckThenCountBackend:
    """The way a limiter that counts failures once they are known works (django-axes'):
    refuse a key whose failures ran out, else let the password be checked, and count a
    failure afterwards (``count_failure``, a ``user_login_failed`` receiver). The negative
    control of tests/test_login_concurrency.py."""

    def authenticate(self, request: Any, username: str | None = None, **credentials: Any) -> None:
        from django.core.exceptions import PermissionDenied

        from django_tokenbucket import limiter

        if not limiter.check("login_failures", ("username", username)).ok:
            raise PermissionDenied
        return None


def count_failure(sender: Any, credentials: dict[str, Any], **kwargs: Any) -> None:
    from django_tokenbucket import limiter

    limiter.limit("login_failures", ("username", credentials.get("username")))
