"""Every limit this process can interpret: ``LIMITS``, inline limits, DRF throttle rates.

Stored rows hold only ``(value, ts)``; what they mean depends on their limit's config.
The admin, the management command and cleanup need that config for rows of inline
limits too (``@ratelimit(rate=...)``, DRF scopes from ``DEFAULT_THROTTLE_RATES``), or
they would take live state for a leftover of a deleted limit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.urls import get_resolver

try:
    from rest_framework.settings import api_settings as drf_settings
except ImportError:  # DRF is not installed: no throttles
    drf_settings = None  # type: ignore[assignment]

from .limits import LimitConfig, parse_limit
from .settings import tokenbucket_settings
from .shards import row_config

__all__ = [
    "INLINE",
    "SETTINGS",
    "THROTTLE_RATES",
    "KnownLimit",
    "add_throttle_rates_source",
    "known_limits",
    "record_inline",
]

logger = logging.getLogger("django_tokenbucket")

SETTINGS = "settings"
INLINE = "inline"
THROTTLE_RATES = "DRF throttle rates"

#: Inline limits seen by this process, by name. Bounded, because a caller could build
#: names from request data; past the bound, new names are interpreted as unknown
#: (reported, never deleted without ``--remove-unknown``), which is the safe side.
_inline: dict[str, LimitConfig] = {}
_INLINE_MAX = 4096
_lock = threading.Lock()

#: Where the rates that throttle classes declare themselves come from (scope ->
#: (where, rate)): django_tokenbucket.throttling adds its own when it is imported,
#: which is when there can be such classes at all.
_throttle_rates_sources: list[Callable[[], Mapping[str, tuple[str, str | None]]]] = []


def add_throttle_rates_source(source: Callable[[], Mapping[str, tuple[str, str | None]]]) -> None:
    """Register a function that returns the rates throttle classes declare, by scope."""
    if source not in _throttle_rates_sources:
        _throttle_rates_sources.append(source)


@dataclass(frozen=True)
class KnownLimit:
    """A limit's parsed config and where it was defined (``source``)."""

    config: LimitConfig
    source: str

    @property
    def name(self) -> str:
        return self.config.name


#: ``method_decorator`` applies a decorator once to a throwaway function of its own to
#: copy its attributes: an inline limit named after that function never sees a request.
_PHANTOM = "django.utils.decorators."


def record_inline(limit: LimitConfig) -> None:
    """Remember an inline limit (called when the limiter first parses its config)."""
    if limit.name.startswith(_PHANTOM):
        return
    with _lock:
        if limit.name in _inline or len(_inline) < _INLINE_MAX:
            _inline[limit.name] = limit


def _load_views() -> None:
    # Inline limits are declared by decorators, which run when their views are
    # imported: importing the URLconf imports the views (as the system checks do).
    if not getattr(settings, "ROOT_URLCONF", None):
        return
    try:
        get_resolver().url_patterns  # noqa: B018
    except Exception as exc:  # a broken URLconf must not stop cleanup or the admin
        logger.warning("could not import the URLconf to find inline rate limits: %s", exc)


def _throttle_rates() -> dict[str, LimitConfig]:
    """Return the DRF scopes' limits: ``DEFAULT_THROTTLE_RATES`` and the throttle classes' own.

    Read whether ``rest_framework`` is in ``INSTALLED_APPS`` or not: DRF's settings and
    our throttles work without it, and a scope missing here would read as unknown
    (and its live rows as removable) in the admin, the command and cleanup.
    """
    if drf_settings is None:
        return {}
    rates: dict[str, object] = {}
    for source in _throttle_rates_sources:
        rates.update((scope, rate) for scope, (_, rate) in source().items())
    rates.update(drf_settings.DEFAULT_THROTTLE_RATES or {})
    limits = {}
    for scope, rate in rates.items():
        if rate is None:  # DRF's way to switch a scope off
            continue
        try:
            limits[scope] = parse_limit(scope, {"rate": rate})
        except ImproperlyConfigured:
            continue  # reported by the system checks
    return limits


def known_limits(*, load_views: bool = True, as_rows: bool = True) -> dict[str, KnownLimit]:
    """Return every limit this process can interpret, by name.

    Precedence follows the limiter's: a scope in ``LIMITS`` wins over the same scope in
    ``DEFAULT_THROTTLE_RATES``, and an inline config passed at a call site wins over
    ``LIMITS``. With ``load_views`` the URLconf is imported first, so that limits
    declared inline by ``@ratelimit`` on its views are known even in a process (a
    management command, a Celery worker) that has served no request. With ``as_rows``
    a sharded limit's config is that of one of its rows (a shard); without, the whole
    limit's, as a caller of the limiter sees it.
    """
    if load_views:
        _load_views()
    throttles = _throttle_rates()
    known = {name: KnownLimit(config, THROTTLE_RATES) for name, config in throttles.items()}
    known.update((name, KnownLimit(config, SETTINGS)) for name, config in tokenbucket_settings.limits().items())
    with _lock:
        inline = list(_inline.values())
    # A throttle decides its scope with an inline config, remembered as it was then: the
    # scope's rate as configured now is what its rows mean.
    known.update((config.name, KnownLimit(config, INLINE)) for config in inline if config.name not in throttles)
    if not as_rows:
        return known
    # A sharded limit's rows are its shards: they read (in the admin, for cleanup) under
    # a shard's config.
    return {name: replace(limit, config=row_config(limit.config)) for name, limit in known.items()}
