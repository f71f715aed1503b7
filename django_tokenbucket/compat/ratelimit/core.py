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
import ipaddress as ipaddress  # django-ratelimit's core imports it: code patching core.ipaddress finds it
import re
import threading
from collections.abc import Iterable
from typing import Any, TypedDict

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
from ...keys import encode_key
from ...limits import LimitConfig
from ...logs import current_request
from ...settings import tokenbucket_settings
from ...status import Status
from . import stores
from .keys import client_ip, key_value
from .keys import get_header as get_header
from .keys import user_or_ip as user_or_ip
from .methods import ALL, UNSAFE

__all__ = ["get_usage", "is_ratelimited"]

#: django-ratelimit's core holds its keys' functions; code (and its own tests) that import
#: them from there find them here too.
_get_ip = client_ip

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
    value = key_value(group, request, key)
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
