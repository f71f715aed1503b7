"""The keys of a login attempt: one per entry of ``LOGIN["KEYS"]``.

Each is the key ``@ratelimit`` builds for the same part of a request, so that a login's
bucket is the one ``manage.py tokenbucket ... --key username=alice`` (or ``--key
ip=...``) names, and an override made for that key reaches it: ``("username",
Redacted("alice"))`` normalised as the decorator normalises what a request sends,
``("ip", <the client's address as key="ip" reads it>)``, and the user agent as
``key="header:User-Agent"`` keys it. A combination is those pairs one after the other,
in ``LOGIN_PARTS`` order: ``("username", Redacted("alice"), "ip", "203.0.113.7")``; its label
names its first part only when that is the username, as every label of request data
does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.contrib.auth import get_user_model
from django.http import HttpRequest

from ..ip import client_ip
from ..keys import Redacted
from ..request_keys import ip_key_from_text, normalize_identity
from ..settings import LoginSettings

__all__ = ["USER_AGENT_SPEC", "credential_username", "http_request", "key_of", "login_keys", "typed_parts"]

#: The user agent's part of a key: the one ``key="header:User-Agent"`` gives a request.
USER_AGENT_SPEC = "header:user-agent"
_SPEC = {"username": "username", "ip": "ip", "user_agent": USER_AGENT_SPEC}


def http_request(request: Any) -> HttpRequest | None:
    """The HttpRequest of ``request``: DRF's Request wraps one, which is where the
    middleware looks for what the backend learnt."""
    if request is None:
        return None
    return getattr(request, "_request", request)  # type: ignore[no-any-return]


_ABSENT = object()


def _identity(credentials: Mapping[str, Any]) -> object:
    """The credential that names the account: ``username`` (as ``ModelBackend`` reads it),
    else the user model's ``USERNAME_FIELD``, else ``email`` (allauth's login by email,
    and most email backends); ``_ABSENT`` when the credentials have none of them."""
    for name in ("username", get_user_model().USERNAME_FIELD, "email"):
        value = credentials.get(name, _ABSENT)
        if value is not None and value is not _ABSENT:
            return value
    present = any(name in credentials for name in ("username", get_user_model().USERNAME_FIELD, "email"))
    return None if present else _ABSENT


def credential_username(credentials: Mapping[str, Any]) -> str | None:
    """The account the credentials name, normalised; None when there is none, or only an
    empty one (or one that is no text: a list, a bool...)."""
    value = _identity(credentials)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # as a form or serializer field reads a number
    if not isinstance(value, str):
        return None
    return normalize_identity(value) or None


def _part(part: str, username: str | None, request: HttpRequest | None) -> tuple[str, object] | None:
    if part == "username":
        return None if username is None else ("username", Redacted(username))
    assert request is not None
    if part == "ip":
        return ("ip", client_ip(request))
    # Clients that send none share the bucket of the empty value, as a header key does.
    return (USER_AGENT_SPEC, Redacted(normalize_identity(request.META.get("HTTP_USER_AGENT", ""))))


def key_of(parts: Sequence[tuple[str, object]]) -> object:
    """The key of an entry made of ``parts`` (``(spec, value)`` pairs in ``LOGIN_PARTS`` order)."""
    if len(parts) == 1:
        return parts[0]
    return tuple(item for pair in parts for item in pair)


def login_keys(login: LoginSettings, request: Any, credentials: Mapping[str, Any]) -> list[object] | None:
    """Return the keys of a login attempt, one per entry of ``KEYS`` that applies.

    The username is the credential that names the account (``username``, the user
    model's ``USERNAME_FIELD`` or ``email``). Without a request (``authenticate(username=...,
    password=...)`` from code) only the entries made of the username apply; without any
    of those credentials, only the entries made without it. None when one of them is
    given empty (or is no text): a login that cannot be counted is refused.
    """
    username = credential_username(credentials)
    # Credentials that name the account some other way (a phone number a custom backend
    # takes): the entries made with the username cannot apply, the others still count.
    named = _identity(credentials) is not _ABSENT
    request = http_request(request)
    keys = []
    for entry in login.keys:
        if (request is None and entry != ("username",)) or (not named and "username" in entry):
            continue
        parts = [_part(part, username, request) for part in entry]
        if any(part is None for part in parts):
            return None
        keys.append(key_of(parts))  # type: ignore[arg-type]
    return keys


def typed_parts(username: str | None = None, ip: str | None = None) -> dict[str, tuple[str, object]]:
    """The parts an operator typed (``unlock --username U --ip A``), as a login's keys
    hold them; ValueError for an empty username or an address that is not one."""
    parts: dict[str, tuple[str, object]] = {}
    if username is not None:
        name = normalize_identity(username)
        if not name:
            raise ValueError("--username: an empty username is no account")
        parts["username"] = ("username", Redacted(name))
    if ip is not None:
        key = ip_key_from_text(ip)
        if key is None:
            raise ValueError(f"--ip: {ip!r} is not an IP address")
        parts["ip"] = key
    return parts
