"""The client's address, as a rate-limit key that a client cannot forge.

``X-Forwarded-For`` is written by whoever sends the request, so by default it is
ignored and ``REMOTE_ADDR`` is the client. Behind proxies, configure which hops are
yours (``TRUSTED_PROXIES``: a count, or a list of CIDRs) and the address just before
them is taken; an edge header such as ``CF-Connecting-IP`` (``IP_HEADER``) is honoured
only when the request comes from a trusted proxy. IPv6 clients get a whole /64 (one
subscriber's allocation) per bucket, and IPv4 addresses wrapped in IPv6 forms are
unwrapped, so neither rotation nor notation yields fresh buckets.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Union

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest

from .settings import tokenbucket_settings

__all__ = [
    "FALLBACKS",
    "client_address",
    "client_ip",
    "ip_key",
    "ip_settings_problems",
    "normalize_ip",
    "parse_ip",
]

logger = logging.getLogger("django_tokenbucket")

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")

#: How often a forwarded address was malformed and REMOTE_ADDR used instead, by reason.
FALLBACKS: Counter[str] = Counter()


#: Values no longer than this are parsed once per process and remembered: every limited
#: request parses its REMOTE_ADDR, and ``ipaddress`` costs more than the rest of the key.
#: Longer ones (no address is) are parsed each time, so the memory stays bounded.
_REMEMBERED_LENGTH = 80


def parse_ip(value: str) -> IPAddress | None:
    """Parse one address as proxies write it: brackets, ports and zone ids allowed."""
    if len(value) <= _REMEMBERED_LENGTH:
        return _parse_remembered(value)
    return _parse(value)


def _parse(value: str) -> IPAddress | None:
    text = value.strip()
    if not text or len(text) > 64:
        return None
    if text.startswith("["):  # [2001:db8::1]:443
        end = text.find("]")
        if end < 0:
            return None
        text = text[1:end]
    elif text.count(":") == 1:  # 1.2.3.4:5678
        text = text.split(":", 1)[0]
    text = text.split("%", 1)[0]  # fe80::1%eth0: the zone only names an interface
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


# Addresses are immutable and the parse depends on nothing else; a client rotating
# values costs at most maxsize entries of at most _REMEMBERED_LENGTH characters.
_parse_remembered = lru_cache(maxsize=4096)(_parse)


def _is_int_in(value: object, low: int, high: float) -> bool:
    # bool is an int subclass, and True would pass for a count of 1.
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_network(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return False
    return True


def _trusted_proxies_problem(value: object) -> str | None:
    if value is None or _is_int_in(value, 0, float("inf")):
        return None
    if isinstance(value, (list, tuple)):
        for cidr in value:
            if not _is_network(cidr):
                return f"TRUSTED_PROXIES lists {cidr!r}, which is not an address or a CIDR such as '10.0.0.0/8'"
        return None
    # Anything else would silently trust the wrong hop: a negative count takes the
    # address the client wrote itself, a string or a float trusts nothing at all.
    return (
        "TRUSTED_PROXIES must be None, the number of proxies in front of Django (an int >= 0) "
        f"or a list of their CIDRs, not {value!r}"
    )


def _ipv6_prefix_problem(value: object) -> str | None:
    if _is_int_in(value, 1, 128):
        return None
    return f"IPV6_PREFIX must be a prefix length from 1 to 128 (64: one subscriber's network), not {value!r}"


def ip_settings_problems(trusted_proxies: object, ip_header: object, ipv6_prefix: object) -> list[str]:
    """Return what is wrong with the client-address settings (for the system check)."""
    problems = [_trusted_proxies_problem(trusted_proxies), _ipv6_prefix_problem(ipv6_prefix)]
    if ip_header is not None and (not isinstance(ip_header, str) or not ip_header.strip()):
        problems.append(f"IP_HEADER must be None or a header name such as 'CF-Connecting-IP', not {ip_header!r}")
    return [problem for problem in problems if problem is not None]


def ip_key(address: IPAddress, ipv6_prefix: int | None = None) -> str:
    """Return the bucket key of an address: the IPv4 address, or its IPv6 network."""
    if isinstance(address, ipaddress.IPv4Address):
        return str(address)
    prefix = tokenbucket_settings.IPV6_PREFIX if ipv6_prefix is None else ipv6_prefix
    problem = _ipv6_prefix_problem(prefix)
    if problem is not None:
        raise ImproperlyConfigured(f"TOKENBUCKET: {problem}")
    return str(ipaddress.IPv6Network((address, prefix), strict=False))


def normalize_ip(value: str, ipv6_prefix: int | None = None) -> str | None:
    """Return the bucket key of an address written as proxies write it, or None if malformed."""
    address = parse_ip(value)
    return None if address is None else ip_key(address, ipv6_prefix)


@lru_cache(maxsize=16)
def _trusted_networks(cidrs: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    try:
        return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)
    except ValueError as exc:
        raise ImproperlyConfigured(f"TOKENBUCKET['TRUSTED_PROXIES']: {exc}") from None


def _is_trusted(address: IPAddress | None, networks: Sequence[Any]) -> bool:
    return address is not None and any(address in network for network in networks)


def _fallback(reason: str, request: HttpRequest) -> IPAddress | None:
    FALLBACKS[reason] += 1
    logger.debug("client address: %s; using REMOTE_ADDR", reason)
    return parse_ip(request.META.get("REMOTE_ADDR", ""))


_FROM_SETTINGS: Any = object()


def client_address(request: HttpRequest, trusted_proxies: Any = _FROM_SETTINGS) -> IPAddress | None:
    """Return the client's address per the trusted-proxy settings, or None if unknown.

    ``trusted_proxies`` overrides ``TOKENBUCKET["TRUSTED_PROXIES"]``: None, a count of
    proxies in front of this server, or a list of their CIDRs.
    """
    remote = parse_ip(request.META.get("REMOTE_ADDR", ""))
    trusted = tokenbucket_settings.TRUSTED_PROXIES if trusted_proxies is _FROM_SETTINGS else trusted_proxies
    if trusted is not None and not isinstance(trusted, (list, tuple)):
        problem = _trusted_proxies_problem(trusted)
        if problem is not None:
            raise ImproperlyConfigured(f"TOKENBUCKET: {problem}")
    networks = _trusted_networks(tuple(trusted)) if isinstance(trusted, (list, tuple)) else ()

    header = tokenbucket_settings.IP_HEADER
    if header and _is_trusted(remote, networks):
        edge = request.headers.get(header)
        if edge is not None:
            address = parse_ip(edge)
            return address if address is not None else _fallback(f"malformed {header}", request)

    if not trusted:
        return remote
    forwarded = request.headers.get("X-Forwarded-For")
    if not forwarded:
        return remote
    # The chain as the last proxy saw it: what the client claimed, each proxy's view,
    # and finally the peer that connected to us.
    chain = [hop.strip() for hop in forwarded.split(",")] + [request.META.get("REMOTE_ADDR", "")]
    if isinstance(trusted, int):
        if len(chain) <= trusted:
            return _fallback("fewer hops than TRUSTED_PROXIES", request)
        address = parse_ip(chain[-(trusted + 1)])
        return address if address is not None else _fallback("malformed X-Forwarded-For", request)
    for hop in reversed(chain):
        address = parse_ip(hop)
        if address is None:
            return _fallback("malformed X-Forwarded-For", request)
        if not _is_trusted(address, networks):
            return address
    return _fallback("every hop is a trusted proxy", request)


def client_ip(request: HttpRequest, trusted_proxies: Any = _FROM_SETTINGS) -> str:
    """Return the rate-limit key for the client's address (IPv6 grouped by ``IPV6_PREFIX``)."""
    address = client_address(request, trusted_proxies)
    # No usable address at all (a misconfigured server): one shared, visible bucket.
    return "unknown" if address is None else ip_key(address)
