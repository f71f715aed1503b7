"""The rate-limit key of a request: what ``key=`` of the decorator (and the compat layer)
names — the client's address, the user, a header, a query or form field, a callable —
and the same keys written as text (``post:username=alice``) for the admin and the
command. Identities the request sends are normalised, so that every spelling of one
account is one bucket. The keys themselves are encoded in ``keys``."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.utils.module_loading import import_string

from .ip import client_ip
from .settings import tokenbucket_settings

__all__ = ["KeySpec", "key_from_text", "normalize_identity", "request_key", "validate_key_spec"]

#: What a ``key=`` may be: a spec string ("ip", "user", "user_or_ip", "header:<name>",
#: "get:<param>", "post:<field>", a dotted path) or a callable ``(request) -> key``.
KeySpec = str | Callable[[HttpRequest], Any]

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
