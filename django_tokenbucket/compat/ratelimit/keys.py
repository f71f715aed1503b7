"""The keys of django-ratelimit's ``key=``, and the address its ``ip`` key masks.

A module of its own, below the rest of this layer: what a request's key is here, and
what an operator's ``ip=203.0.113.9`` typed into the admin or the command is on one of
this layer's limits (``key_from_text``), must be one function, or an override would miss
the bucket the requests fill; ``override_operations`` imports it without the decorator,
the limiter or the stores above it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any, NamedTuple

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.utils.module_loading import import_string

from ...ip import client_address, parse_ip
from ...keys import Redacted
from ...request_keys import canonical_spec, header_name, normalize_identity, posted_field, user_pk_from_text
from ...settings import tokenbucket_settings

__all__ = [
    "MetaKeyProblem",
    "client_ip",
    "get_header",
    "ip_meta_key_problem",
    "key_from_text",
    "key_value",
    "user_or_ip",
]


def _mask(setting: str, default: int, bits: int) -> int:
    mask = getattr(settings, setting, default)
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask <= bits:
        raise ImproperlyConfigured(f"{setting} must be a prefix length from 0 to {bits}, not {mask!r}")
    return mask


class MetaKeyProblem(NamedTuple):
    """Why ``RATELIMIT_IP_META_KEY`` cannot be trusted as it is, and what to set instead."""

    header: str
    missing: str
    fix: str


def ip_meta_key_problem(source: object) -> MetaKeyProblem | None:
    """Return why ``RATELIMIT_IP_META_KEY`` = ``source`` would let clients choose their
    address, or None (not a request header, or one ``TOKENBUCKET`` says how to trust).

    A META key ``HTTP_*`` is a request header, which any client writes. django-ratelimit
    took its value as the address; here it is mapped to the client-address settings
    instead (``X-Forwarded-For`` to ``TRUSTED_PROXIES``, another header to ``IP_HEADER``
    honoured from ``TRUSTED_PROXIES`` networks), and refused when they are not set.
    """
    if not isinstance(source, str) or not source.startswith("HTTP_"):
        return None
    header = "-".join(part.capitalize() for part in source[5:].split("_"))
    trusted = tokenbucket_settings.TRUSTED_PROXIES
    if header_name(header) == "x-forwarded-for":
        if trusted:
            return None
        return MetaKeyProblem(
            header,
            "TOKENBUCKET['TRUSTED_PROXIES'] is not set",
            "Remove RATELIMIT_IP_META_KEY and set TOKENBUCKET['TRUSTED_PROXIES'] to the number of proxies in front "
            "of Django, or their CIDRs:",
        )
    ip_header = tokenbucket_settings.IP_HEADER
    if isinstance(ip_header, str) and header_name(ip_header) == header_name(header):
        if isinstance(trusted, (list, tuple)) and trusted:
            return None
    return MetaKeyProblem(
        header,
        f"TOKENBUCKET['IP_HEADER'] is not {header!r} with TRUSTED_PROXIES as the CIDRs of the proxies that set it",
        f"Set TOKENBUCKET['IP_HEADER'] = {header!r} and TOKENBUCKET['TRUSTED_PROXIES'] to the CIDRs of the "
        "proxies that set it (and remove RATELIMIT_IP_META_KEY):",
    )


def client_ip(request: HttpRequest) -> str:
    """Return the client's address, masked by ``RATELIMIT_IPV4_MASK``/``RATELIMIT_IPV6_MASK``.

    Without ``RATELIMIT_IP_META_KEY`` the address is the one ``django_tokenbucket.ip``
    trusts: ``REMOTE_ADDR``, or the hop ``TOKENBUCKET["TRUSTED_PROXIES"]`` points to. A
    META key naming a request header is mapped to those settings, or refused when they
    do not say which proxies set it (``ip_meta_key_problem``; check E043).
    """
    source = getattr(settings, "RATELIMIT_IP_META_KEY", None)
    problem = ip_meta_key_problem(source)
    if problem is not None:
        raise ImproperlyConfigured(
            f"RATELIMIT_IP_META_KEY = {source!r} reads the {problem.header} header, which clients write "
            f"themselves, and {problem.missing}. {problem.fix} the address is then read from what your proxies wrote"
        )
    if isinstance(source, str) and source.startswith("HTTP_"):
        source = None  # mapped: TRUSTED_PROXIES and IP_HEADER say which hop to believe
    if not source:
        address = client_address(request)
        if address is None:
            raise ImproperlyConfigured(
                "the client's address is unknown: REMOTE_ADDR is empty or not an address (as behind a "
                "proxy that connects over a Unix socket); set RATELIMIT_IP_META_KEY, or "
                "TOKENBUCKET['TRUSTED_PROXIES'] and 'IP_HEADER'"
            )
    else:
        if callable(source):
            text = source(request)
        elif isinstance(source, str) and "." in source:
            text = import_string(source)(request)
        elif isinstance(source, str) and source in request.META:
            text = request.META[source]
        else:
            raise ImproperlyConfigured(f"RATELIMIT_IP_META_KEY = {source!r}: the request has no such META key")
        address = parse_ip(str(text))
        if address is None:
            raise ImproperlyConfigured(f"RATELIMIT_IP_META_KEY = {source!r} gave {text!r}, which is not an address")
    return _masked(address)


def _masked(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """Return the ``ip`` key of ``address``: its network under ``RATELIMIT_IPV4_MASK``/``RATELIMIT_IPV6_MASK``."""
    if isinstance(address, ipaddress.IPv6Address):
        mask = _mask("RATELIMIT_IPV6_MASK", 64, 128)
    else:
        mask = _mask("RATELIMIT_IPV4_MASK", 32, 32)
    return str(ipaddress.ip_network((address, mask), strict=False).network_address)


def key_from_text(text: str) -> object | None:
    """Return the key this layer's ``key=`` builds, written as ``<spec>=<value>``; None if not one.

    Not in ``__all__``, which is django-ratelimit's: for the admin and the command.

    As ``django_tokenbucket.request_keys.key_from_text`` does for the native decorator,
    with django-ratelimit's keys: ``ip=`` its masked address, ``user=`` the user's id as
    text; ``header:``, ``get:`` and ``post:`` values normalised alike. For an override
    typed by an operator on one of this layer's limits.
    """
    spec, separator, value = text.partition("=")
    spec = canonical_spec(spec.strip())
    if not separator or not value:
        return None
    if spec == "ip":
        address = parse_ip(value)
        return None if address is None else _masked(address)
    if spec == "user":
        return str(user_pk_from_text(value.strip()))
    accessor, _, field = spec.partition(":")
    if accessor in _ACCESSOR_KEYS and field:
        return (spec, Redacted(normalize_identity(value)))
    return None


def user_or_ip(request: HttpRequest) -> str:
    """The user's primary key when authenticated, else the client's address."""
    if request.user.is_authenticated:
        return str(request.user.pk)
    return client_ip(request)


_SIMPLE_KEYS: dict[str, Callable[[HttpRequest], str]] = {
    "ip": client_ip,
    "user": lambda request: str(request.user.pk),
    "user_or_ip": user_or_ip,
}


def get_header(request: HttpRequest, header: str) -> str:
    """Return the request's ``header`` (``"X-Api-Key"``), ``""`` when absent: the ``header:`` key."""
    return str(request.META.get("HTTP_" + header.replace("-", "_").upper(), ""))


_ACCESSOR_KEYS: dict[str, Callable[[HttpRequest, str], str]] = {
    "get": lambda request, field: request.GET.get(field, ""),
    # As the view reads it: a JSON body too, DRF's parsed data on a DRF request.
    "post": lambda request, field: posted_field(request, field) or "",
    "header": get_header,
}


def key_value(group: str, request: HttpRequest, key: Any) -> object:
    """Return the value ``key=`` (a name, ``accessor:field``, a callable or its dotted path)
    gives for ``request`` in ``group``, as django-ratelimit builds it."""
    if not key:
        raise ImproperlyConfigured("Ratelimit key must be specified")
    if callable(key):
        return key(group, request)
    if not isinstance(key, str):
        raise ImproperlyConfigured(f"Ratelimit key must be a str or a callable, not {key!r}")
    if key in _SIMPLE_KEYS:
        return _SIMPLE_KEYS[key](request)
    if ":" in key:
        accessor, field = key.split(":", 1)
        if accessor not in _ACCESSOR_KEYS:
            raise ImproperlyConfigured(f"Unknown ratelimit key: {key}")
        # Normalised as the native decorator's keys are (every spelling of one account is
        # one bucket), and tagged as request data, which is never stored in clear.
        return (canonical_spec(key), Redacted(normalize_identity(_ACCESSOR_KEYS[accessor](request, field))))
    if "." in key:
        return import_string(key)(group, request)
    raise ImproperlyConfigured(f"Could not understand ratelimit key: {key}")
