"""The rate-limit key of a request: what ``key=`` of the decorator (and the compat layer)
names — the client's address, the user, a header, a query or form field, a callable —
and the same keys written as text (``post:username=alice``) for the admin and the
command. Identities the request sends are normalised, so that every spelling of one
account is one bucket. The keys themselves are encoded in ``keys``."""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import connections, router
from django.http import HttpRequest
from django.utils.module_loading import import_string

from .collation import fold_accents
from .ip import client_ip, ip_key, parse_ip
from .keys import Redacted
from .settings import tokenbucket_settings

__all__ = [
    "ACCENT_INSENSITIVE_VENDORS",
    "ADDRESS_HEADERS",
    "MAX_IDENTITY_LENGTH",
    "Folding",
    "KeySpec",
    "address_header",
    "address_keyed_views",
    "canonical_spec",
    "header_name",
    "ip_key_from_text",
    "key_folding",
    "key_from_text",
    "normalize_identity",
    "note_view_key",
    "posted_field",
    "request_key",
    "settings_changed",
    "user_pk_from_text",
    "validate_key_spec",
]

#: What a ``key=`` may be: a spec string ("ip", "user", "user_or_ip", "header:<name>",
#: "get:<param>", "post:<field>", a dotted path) or a callable ``(request) -> key``.
KeySpec = str | Callable[[HttpRequest], Any]

_SIMPLE_KEYS = ("ip", "user", "user_or_ip", "username")
_FIELD_KEYS = ("header", "get", "post")


#: How much of an identity a request sends is read: the first 1,024 characters once
#: surrounding whitespace is removed. Four times the longest address Django's EmailField
#: takes (254), so an account name in any canonical spelling (a character decomposes into
#: at most four) is read whole; longer values name no account, and cutting them bounds
#: the Unicode normalisation, which is quadratic in a run of combining marks (160 KB of
#: them cost seconds of CPU per request). Values that differ only past this point share a
#: bucket: a limit can only get stricter for them, never looser.
MAX_IDENTITY_LENGTH = 1024


#: Database vendors whose collations compare accents equal by default: every default
#: utf8mb4 collation of MySQL and MariaDB (``general_ci``, ``unicode_ci``, ``0900_ai_ci``,
#: ``uca1400_ai_ci``) is accent-insensitive.
ACCENT_INSENSITIVE_VENDORS = frozenset({"mysql"})


@dataclass(frozen=True)
class Folding:
    """How keys taken from request data are folded: ``case``, ``accents`` (which implies
    case), and why (for the system check and the docs)."""

    case: bool
    accents: bool
    reason: str

    def __str__(self) -> str:
        if self.accents:
            return "NFKC, case and accents"
        return "NFKC and case" if self.case else "NFKC only"


_folding: Folding | None = None


def key_folding() -> Folding:
    """Return the folding in force: ``FOLD_KEY_CASE`` and ``FOLD_KEY_ACCENTS``, the latter
    decided, when None, by the database that holds the user model's table.

    Decided from the connection's vendor, without a query (this runs on the event loop
    too): MySQL and MariaDB compare accents equal under all their default collations. A
    column with another collation (a PostgreSQL nondeterministic one, a ``_bin`` one) is
    what the database check (``I001``/``W004``) reads and reports.
    """
    global _folding
    folding = _folding
    if folding is None:
        case = bool(tokenbucket_settings.FOLD_KEY_CASE)
        accents = tokenbucket_settings.FOLD_KEY_ACCENTS
        if accents is not None:
            reason = f"FOLD_KEY_ACCENTS = {accents!r}"
        elif not case:
            accents, reason = False, "FOLD_KEY_CASE = False"
        else:
            alias = router.db_for_read(get_user_model())
            vendor = connections[alias].vendor
            accents = vendor in ACCENT_INSENSITIVE_VENDORS
            shown = {"mysql": "MySQL/MariaDB", "postgresql": "PostgreSQL", "sqlite": "SQLite"}.get(vendor, vendor)
            reason = f"the user table is on {shown} database {alias!r}"
        folding = _folding = Folding(case=case or bool(accents), accents=bool(accents), reason=reason)
    return folding


def settings_changed() -> None:
    """Decide the key folding again, by the new settings and user table (``django_tokenbucket.lifecycle``)."""
    global _folding
    _folding = None


def normalize_identity(value: str) -> str:
    """Return the one spelling of an identity a request sent: the key of every spelling
    that the user table's database takes for the same account.

    NFKC and stripped, as Django's login makes a username; case-folded, as MySQL/MariaDB
    collations ignore case, so ``" ＶＩＣＴＩＭ"`` logs in as ``victim``; and, where
    the user table compares accents equal (MySQL, MariaDB, or ``FOLD_KEY_ACCENTS =
    True``), accents and characters the collation ignores folded too, so that ``víctim``
    is ``victim`` (``collation.fold_accents``). Otherwise an attacker multiplies an
    account's limit by rewriting its name. ``key_folding()`` says which folding is in
    force. Only the first ``MAX_IDENTITY_LENGTH`` characters (after stripping) are read.

    The one function that makes these keys: the decorator, the compat layer, the admin's
    search and the overrides typed by operators all call it.
    """
    # Stripped before it is cut, so that padding cannot push a real name past the cut.
    text = unicodedata.normalize("NFKC", value.strip()[:MAX_IDENTITY_LENGTH]).strip()
    folding = _folding or key_folding()
    if folding.accents:
        return fold_accents(text)
    return text.casefold() if folding.case else text


#: Request headers that carry a client's address, and that any client can write: a
#: limit keyed on one of them directly gives each request the bucket it names.
ADDRESS_HEADERS = frozenset(
    {
        "x-forwarded-for",
        "x-real-ip",
        "forwarded",
        "forwarded-for",
        "x-forwarded",
        "cf-connecting-ip",
        "true-client-ip",
        "x-client-ip",
        "x-cluster-client-ip",
        "fastly-client-ip",
        "x-originating-ip",
        "x-remote-ip",
        "x-remote-addr",
        "x-envoy-external-address",
        "x-azure-clientip",
        "x-azure-socketip",
        "x-appengine-user-ip",
        "cloudfront-viewer-address",
        "client-ip",
    }
)
# Other spellings of the same: X-Original-Forwarded-For, X-My-Client-IP, X-Peer-Addr.
_ADDRESS_LIKE = re.compile(r"(?:^|-)(?:ip|addr|address|forwarded|forwarded-for)$|client-?ip|real-?ip")


def header_name(name: str) -> str:
    """Return a header's name as compared here: lower case, ``_`` as ``-`` (``X_Real_IP`` -> ``x-real-ip``)."""
    return name.strip().lower().replace("_", "-")


def address_header(spec: object) -> str | None:
    """Return the header a key spec reads when it is one that carries a client's address
    (``"header:X-Forwarded-For"`` -> ``"x-forwarded-for"``), else None."""
    if not isinstance(spec, str):
        return None
    kind, _, field = spec.partition(":")
    if kind != "header" or not field:
        return None
    name = header_name(field)
    return name if name in ADDRESS_HEADERS or _ADDRESS_LIKE.search(name) else None


#: The views rate-limited by a key spec naming an address header (view -> specs), as the
#: decorators saw them, for the system check W005. Bounded by the code's decorators.
_address_keyed_views: dict[str, set[str]] = {}


def note_view_key(view: str, spec: object) -> None:
    """Record that ``view`` is rate-limited by ``spec`` (when it reads an address header)."""
    if address_header(spec) is not None:
        _address_keyed_views.setdefault(view, set()).add(str(spec))


def address_keyed_views() -> dict[str, tuple[str, ...]]:
    """Return the views rate-limited by a client-written address header, with the specs."""
    return {view: tuple(sorted(specs)) for view, specs in _address_keyed_views.items()}


def canonical_spec(spec: str) -> str:
    """Return the one spelling of a key spec as keys carry it: a header's name in lower case.

    Header names are case-insensitive in HTTP (``request.headers`` finds any spelling),
    so ``header:X-Api-Key`` and ``header:x-api-key`` read the same value and must key
    the same bucket — on two views that name one limit, and for an operator who types
    either spelling. Query and form field names are case-sensitive, and stay as written.
    """
    if spec[:7].lower() == "header:":
        return "header:" + header_name(spec[7:])
    return spec


def _username(request: HttpRequest) -> str | None:
    return posted_field(request, get_user_model().USERNAME_FIELD)


def _is_json(content_type: str | None) -> bool:
    """Whether a body of ``content_type`` is JSON: ``application/json`` or ``application/*+json``."""
    return content_type is not None and (content_type == "application/json" or content_type.endswith("+json"))


def _body_fields(request: HttpRequest) -> Any:
    """Return what the view will read the body's fields from: a mapping, or None.

    On a DRF view that is DRF's parsed ``request.data`` (JSON, forms, any parser of the
    view's); a parse error is DRF's to answer (400), as it would be in the view. On a
    Django view, a JSON body is parsed (and kept on the request for the other limits),
    else the form data of ``request.POST``.
    """
    drf_request = sys.modules.get("rest_framework.request")
    if drf_request is not None and isinstance(request, drf_request.Request):
        return request.data
    if not _is_json(request.content_type):
        return request.POST
    if "_tokenbucket_json" not in request.__dict__:
        try:
            parsed = json.loads(request.body)
        except (ValueError, RecursionError):
            parsed = None  # the view cannot read it either: no field, keyed by address
        request.__dict__["_tokenbucket_json"] = parsed
    return request.__dict__["_tokenbucket_json"]


def posted_field(request: HttpRequest, field: str) -> str | None:
    """Return body field ``field`` as the view reads it (form or JSON, DRF's ``request.data``), or None.

    A number counts as its text (DRF's CharField accepts one); a list, an object, a
    bool or null is no identity, as the view's form or serializer would reject it.
    """
    data = _body_fields(request)
    if not isinstance(data, Mapping):
        return None
    value = data.get(field)
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


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
            value = posted_field(request, field)
        value = None if value is None else normalize_identity(value)
        spec = canonical_spec(spec)
        if not value:
            return (spec, None, "ip", client_ip(request))
        # Redacted: a header or a field may be a secret (an API key, a password typed in
        # the username box), and a key is shown in exception messages and signals.
        return (spec, Redacted(value))
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

    An address is read as a request's is (brackets, a port, a zone id, an IPv4 address
    wrapped in IPv6) and keys the bucket its client's requests use: an IPv6 address its
    network of ``IPV6_PREFIX`` bits, so that what an access log shows reaches the bucket
    a block must reach. A malformed address is no key (None).
    """
    spec, separator, value = text.partition("=")
    spec = canonical_spec(spec.strip())
    if not separator or not value:
        return None
    if spec == "ip":
        return ip_key_from_text(value)
    if spec == "user":
        return ("user", user_pk_from_text(value.strip()))
    kind, _, field = spec.partition(":")
    if spec == "username" or (kind in _FIELD_KEYS and field):
        return (spec, Redacted(normalize_identity(value)))
    return None


def ip_key_from_text(value: str) -> tuple[str, str] | None:
    """Return the key ``key="ip"`` gives a request from address ``value``, None if it is not one."""
    text = value.strip()
    if text == "unknown":  # what a request without a usable address is keyed by
        return ("ip", text)
    address = parse_ip(text)
    return None if address is None else ("ip", ip_key(address))


def user_pk_from_text(text: str) -> object:
    """Return a user id typed as text as the user model's primary key holds it (a UUID, an int...)."""
    try:
        return get_user_model()._meta.pk.to_python(text)
    except ValidationError:
        return text


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
