"""``is_ratelimited`` and ``get_usage``, as django-ratelimit 4.1 documents them.

A limit is django-ratelimit's: ``rate`` requests per fixed window of the rate's period,
windows starting at an offset taken from the key (so that clients' windows do not all
reopen at once), identified by ``group``, ``rate``, ``method`` and the key's value.
Here each window is a ``"fixed window"`` limit of the limiter, named
``"<group>:<N>/<P>s[:<METHODS>]"`` and keyed by the value, so the admin and the
``tokenbucket`` command show it. A request the limit refuses is not stored (it spends
nothing), and concurrent requests cannot overshoot the rate.
"""

from __future__ import annotations

import contextvars
import functools
import ipaddress
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypedDict

from django.conf import settings
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.utils.module_loading import import_string

from ... import registry
from ...algorithms import MICRO
from ...api import Limiter, limiter
from ...backends import get_backend, redis_backend
from ...backends.base import BaseBackend
from ...exceptions import BackendUnavailable
from ...ip import client_address, parse_ip
from ...keys import Redacted, encode_key
from ...limits import LimitConfig
from ...logs import current_request
from ...request_keys import canonical_spec, header_name, normalize_identity, posted_field, user_pk_from_text
from ...settings import tokenbucket_settings
from ...status import Status
from . import stores
from .methods import ALL, UNSAFE

__all__ = ["get_usage", "is_ratelimited"]

#: django-ratelimit's margin on its cache entries' lifetime, for code that reads it; each
#: window here ends exactly, and its state expires with it.
EXPIRATION_FUDGE = 5

Rate = str | tuple[int, int] | None


class Usage(TypedDict):
    """What ``get_usage`` returns (django-ratelimit's dict)."""

    count: int
    limit: int
    should_limit: bool
    time_left: int


_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# django-ratelimit's grammar, which reads a prefix: "5/10m", "100/h", "100/10" (seconds).
_RATE = re.compile(r"(?P<count>[0-9]+)/(?P<multiplier>[0-9]*)(?P<unit>[smhd])?", re.ASCII)
#: The rate grammar under django-ratelimit's public name: ``groups()`` is (count, multiplier, unit).
rate_re = _RATE


def _split_rate(rate: str | tuple[int, int]) -> tuple[int, int]:
    """Return ``(limit, period_seconds)`` of a rate string or tuple."""
    if isinstance(rate, tuple):
        return rate
    match = _RATE.match(rate) if isinstance(rate, str) else None
    if match is None:
        raise ImproperlyConfigured(
            f"invalid ratelimit rate {rate!r}: expected 'N/unit' or 'N/Munit' with unit one of "
            "s, m, h, d (e.g. '5/m', '100/10m'), a (limit, seconds) tuple, None or a callable"
        )
    seconds = _PERIODS[match["unit"] or "s"]
    if match["multiplier"]:
        seconds *= int(match["multiplier"])
    return int(match["count"]), seconds


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


def _get_ip(request: HttpRequest) -> str:
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
    return _get_ip(request)


_SIMPLE_KEYS: dict[str, Callable[[HttpRequest], str]] = {
    "ip": _get_ip,
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


def _method_match(request: HttpRequest, method: Any = ALL) -> bool:
    if method == ALL or method is None:
        return True
    methods = {m.upper() for m in ([method] if isinstance(method, str) else method)}
    if "GET" in methods:
        methods.add("HEAD")  # Django runs a view's GET code for HEAD: it is counted with GET
    return request.method in methods


def group_of(fn: Any) -> str:
    """Return django-ratelimit's default group of the view ``fn``: its module and qualified
    name (those of the function a ``functools.partial`` wraps)."""
    if isinstance(fn, functools.partial):
        fn = fn.func
    parts = []
    if hasattr(fn, "__module__"):
        parts.append(fn.__module__)
    if hasattr(fn, "__self__"):
        parts.append(type(fn.__self__).__name__)
    parts.append(fn.__qualname__)
    return ".".join(parts)


def _key_value(group: str, request: HttpRequest, key: Any) -> object:
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


def _methods_suffix(method: Any) -> str:
    if method == ALL or method is None:
        return ""
    methods = [method] if isinstance(method, str) else list(method)
    return ":" + ",".join(sorted(m.upper() for m in methods))


# -- where the state lives (RATELIMIT_USE_CACHE) -------------------------------------------

_limiters: dict[str, Limiter] = {}
_limiters_lock = threading.Lock()


def _limiter() -> Limiter | None:
    """Return the limiter for the cache django-ratelimit would use, or None when it is a DummyCache.

    That cache is ``RATELIMIT_USE_CACHE``, the ``default`` cache when unset, as in
    django-ratelimit; ``stores.home`` tells where its limits live.
    """
    alias = stores.cache_alias()
    where = stores.home(caches[alias])  # an unknown alias raises InvalidCacheBackendError, as before
    if where == "nowhere":
        return None
    if where == "tokenbucket":
        return limiter
    with _limiters_lock:
        if alias not in _limiters:
            _limiters[alias] = Limiter(_redis_backend(alias))
        return _limiters[alias]


def settings_changed() -> None:
    """Forget the limiters (``django_tokenbucket.lifecycle``): an alias may name another cache after the change."""
    with _limiters_lock:
        _limiters.clear()


def after_fork_in_child() -> None:
    """Give a forked child a lock of its own (``django_tokenbucket.lifecycle``)."""
    global _limiters_lock
    # A fork while another thread made a limiter would leave the child's copy held.
    _limiters_lock = threading.Lock()


def _redis_backend(alias: str) -> BaseBackend:
    default = get_backend()
    if getattr(default, "cache_alias", None) == alias:
        return default  # the same cache as TOKENBUCKET's own Redis backend
    return redis_backend(alias)


# -- the decision --------------------------------------------------------------------------

#: The limiter's status of the last decision in this context (set by ``get_usage``):
#: get_usage() returns django-ratelimit's dict, and the decorator, which goes through the
#: patchable is_ratelimited() as django-ratelimit's does, reads the status here to raise
#: Ratelimited with the limit's name and Retry-After.
last_status: contextvars.ContextVar[Status | None] = contextvars.ContextVar("_last_status", default=None)


def _decide(
    request: HttpRequest, group: str | None, fn: Any, key: Any, rate: Any, method: Any, increment: bool
) -> tuple[Usage, Status | None] | None:
    """Return the usage of the request's limit and the limiter's status (None: no limit applies)."""
    if group is None and fn is None:
        raise ImproperlyConfigured("get_usage must be called with either `group` or `fn` arguments")
    if not getattr(settings, "RATELIMIT_ENABLE", True):
        return None
    if not _method_match(request, method):
        return None
    if group is None:
        group = group_of(fn)
    registry.record_compat_group(group)
    if callable(rate):
        rate = rate(group, request)
    elif isinstance(rate, str) and "." in rate:
        rate = import_string(rate)(group, request)
    if rate is None:
        return None
    limit, period = _split_rate(rate)
    if period <= 0:
        raise ImproperlyConfigured("Ratelimit period must be greater than 0")
    value = _key_value(group, request, key)
    if value is None:
        return None  # a key callable's way to exempt a request
    if limit <= 0:  # "0/m": always limited, nothing to store
        return Usage(count=int(increment), limit=0, should_limit=True, time_left=period), None
    store = _limiter()
    if store is None:
        return None
    name = f"{group}:{limit}/{period}s{_methods_suffix(method)}"
    config = {"kind": "fixed window", "rate": limit, "period": period}
    fail_open = getattr(settings, "RATELIMIT_FAIL_OPEN", tokenbucket_settings.FAIL_OPEN)
    seen = current_request.set(request)
    try:
        status = (store.limit if increment else store.check)(name, value, config=config)
    except BackendUnavailable:
        status = None
    finally:
        current_request.reset(seen)
    if status is None or status.failed_open:
        if fail_open:
            return None
        return Usage(count=0, limit=0, should_limit=True, time_left=-1), status
    left = round(status.value or 0)
    if status.ok and not increment:
        left += 1  # check() tells the value after the call it would make
    used = limit - max(0, left)
    # django-ratelimit's count includes the request being counted, refused or not.
    count = used + 1 if increment and not status.ok else used
    time_left = _time_left(store.resolve(name, config), status, value)
    return Usage(count=count, limit=limit, should_limit=not status.ok, time_left=time_left), status


def _time_left(config: LimitConfig, status: Status, value: object) -> int:
    """Return the whole seconds until the key's current window ends."""
    now = round((status.timestamp or 0) * MICRO)
    offset = config.window_offset(encode_key(value).digest)
    window_end = now - (now - offset) % config.period + config.period
    return -(-(window_end - now) // MICRO)


def get_usage(
    request: HttpRequest,
    group: str | None = None,
    fn: Any = None,
    key: Any = None,
    rate: Any = None,
    method: str | Iterable[str] | tuple[None] | None = ALL,
    increment: bool = False,
) -> Usage | None:
    """Return ``{"count", "limit", "should_limit", "time_left"}`` for the request, or None.

    None when no limit applies: ``RATELIMIT_ENABLE`` is off, the method does not count,
    the rate is None, or the store failed and ``RATELIMIT_FAIL_OPEN`` allows. With
    ``increment`` the request is counted (if the limit lets it through); without,
    ``should_limit`` says whether it would be limited if it were counted.
    """
    decided = _decide(request, group, fn, key, rate, method, increment)
    last_status.set(None if decided is None else decided[1])
    return None if decided is None else decided[0]


def is_ratelimited(
    request: HttpRequest,
    group: str | None = None,
    fn: Any = None,
    key: Any = None,
    rate: Any = None,
    method: str | Iterable[str] | tuple[None] | None = ALL,
    increment: bool = False,
) -> bool:
    """Return whether the request is over its limit (see ``get_usage``)."""
    usage = get_usage(request, group, fn, key, rate, method, increment)
    return False if usage is None else usage["should_limit"]


is_ratelimited.ALL = get_usage.ALL = ALL  # type: ignore[attr-defined]
is_ratelimited.UNSAFE = get_usage.UNSAFE = UNSAFE  # type: ignore[attr-defined]
