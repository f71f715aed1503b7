"""Every limit this process can interpret: ``LIMITS``, inline limits, DRF throttle rates, plans.

Stored rows hold only ``(value, ts)``; what they mean depends on their limit's config.
The admin, the management command and cleanup need that config for rows of inline
limits too (``@ratelimit(rate=...)``, ``config=`` at a call site, DRF scopes from
``DEFAULT_THROTTLE_RATES``), or they would take live state for a leftover of a
deleted limit. The buckets of ``@ratelimit(rate=callable)`` spell their config in
their name (``plans``), so every process reads them (``interpret``).

A name decided with ``config=`` only in some other process (a service's own call
sites) cannot be read here: it is reported as such (``CALL_SITES``), never as garbage.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.urls import get_resolver

try:
    from rest_framework.settings import api_settings as drf_settings
except ImportError:  # DRF is not installed: no throttles
    drf_settings = None  # type: ignore[assignment]

from .limits import LimitConfig, parse_limit
from .plans import is_plan_name, plan_limit
from .settings import tokenbucket_settings
from .shards import row_config

__all__ = [
    "CALL_SITES",
    "INLINE",
    "INLINE_VARIED",
    "PLAN",
    "SETTINGS",
    "THROTTLE_RATES",
    "CleanupLimits",
    "KnownLimit",
    "ViewUse",
    "add_throttle_rates_source",
    "after_fork_in_child",
    "cleanup_limits",
    "interpret",
    "is_compat_limit",
    "known_limits",
    "plan_bases",
    "record_compat_group",
    "record_inline",
    "record_plan_base",
    "record_use",
    "uses",
]

logger = logging.getLogger("django_tokenbucket")

SETTINGS = "settings"
INLINE = "inline"
#: A name this process has seen decided with two or more configs (``config=PLANS[plan]``
#: under one name): its rows are shown under the latest, and cleanup leaves them alone,
#: since a row idle under one config may be in debt under another.
INLINE_VARIED = "inline, several configs seen; shown with the latest"
THROTTLE_RATES = "DRF throttle rates"
#: A bucket of ``@ratelimit(rate=callable)``, its config read from its name.
PLAN = "plan"
#: What a process says of stored rows whose limit it cannot read.
CALL_SITES = "decided with config= at call sites (not in LIMITS)"

#: Inline limits seen by this process, by name. Bounded, because a caller could build
#: names from request data; past the bound, new names are interpreted as unknown
#: (reported, never deleted without ``--remove-unknown``), which is the safe side.
_inline: dict[str, LimitConfig] = {}
_varied: set[str] = set()
_INLINE_MAX = 4096
#: The names of ``@ratelimit(rate=callable)`` decorators (the prefix of their plans'
#: buckets), by the view: come from code, bounded all the same.
_plan_bases: dict[str, str] = {}
_lock = threading.Lock()


def after_fork_in_child() -> None:
    """Give a forked child a lock of its own (``django_tokenbucket.lifecycle``)."""
    global _lock
    # A fork while another thread held the lock would leave the child's copy held.
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
        seen = _inline.get(limit.name)
        if seen is not None or len(_inline) < _INLINE_MAX:
            if seen is not None and seen != limit:
                _varied.add(limit.name)
            _inline[limit.name] = limit


def record_plan_base(base: str, view: str) -> None:
    """Remember that ``view``'s ``@ratelimit(rate=callable)`` names its plans' buckets ``base[plan ...]``."""
    if base.startswith(_PHANTOM):
        return
    with _lock:
        if base in _plan_bases or len(_plan_bases) < _INLINE_MAX:
            _plan_bases[base] = view


@dataclass(frozen=True)
class ViewUse:
    """How one view's ``@ratelimit`` uses a limit: what its key and count are."""

    view: str
    #: The ``key=`` spec (``"ip"``, ``"header:x-api-key"``...); None for a callable.
    key: str | None
    #: The fixed ``count=`` in micro-tokens; None for a callable.
    count: int | None


#: Limit name -> how the views decorated with it use it, for what an operator is told:
#: an override smaller than a view's count refuses every request of that view.
_uses: dict[str, set[ViewUse]] = {}


def record_use(name: str, use: ViewUse) -> None:
    """Remember that a view uses limit ``name`` as ``use`` says (at decoration)."""
    if name.startswith(_PHANTOM) or use.view.startswith(_PHANTOM):
        return
    with _lock:
        if name in _uses or len(_uses) < _INLINE_MAX:
            _uses.setdefault(name, set()).add(use)


def uses(name: str, *, load_views: bool = True) -> frozenset[ViewUse]:
    """Return how the views known to this process use limit ``name``."""
    if load_views:
        _load_views()
    with _lock:
        return frozenset(_uses.get(name, ()))


#: The groups of the django-ratelimit layer's decorators (each names its limits
#: ``<group>:<limit>/<period>s[:<METHODS>]``): their keys are django-ratelimit's (a masked
#: address, a user id as text), not the native decorator's, and a key an operator types
#: for one of their limits must be built that way.
_compat_groups: set[str] = set()
_COMPAT_NAME = re.compile(r"(?P<group>.+):[0-9]+/[0-9]+s(?::[A-Z,]+)?", re.ASCII)


def record_compat_group(group: str) -> None:
    """Remember a group of the django-ratelimit layer (at decoration, and at each decision)."""
    if group in _compat_groups or group.startswith(_PHANTOM):
        return
    with _lock:
        if len(_compat_groups) < _INLINE_MAX:
            _compat_groups.add(group)


def is_compat_limit(name: str, *, load_views: bool = True) -> bool:
    """Whether ``name`` is a limit of the django-ratelimit layer's decorators."""
    match = _COMPAT_NAME.fullmatch(name)
    if match is None:
        return False
    if match["group"] not in _compat_groups and load_views:
        _load_views()
    return match["group"] in _compat_groups


def plan_bases(*, load_views: bool = True) -> dict[str, str]:
    """Return the names of ``@ratelimit(rate=callable)`` decorators, with the view of each."""
    if load_views:
        _load_views()
    with _lock:
        return dict(_plan_bases)


def interpret(name: str, limits: Mapping[str, KnownLimit] | None = None, *, as_rows: bool = True) -> KnownLimit | None:
    """Return how this process reads the rows of ``name`` (from ``limits``, default
    ``known_limits()``, else a plan's name), or None when it cannot."""
    known = (known_limits(as_rows=as_rows) if limits is None else limits).get(name)
    if known is not None:
        return known
    plan = plan_limit(name)
    if plan is None:
        return None
    return KnownLimit(row_config(plan) if as_rows else plan, PLAN)


class CleanupLimits(Mapping[str, LimitConfig]):
    """The configs cleanup may read rows with: ``known``'s (by name), and any plan's bucket.

    Iterating gives ``known``'s names only; a plan's bucket is found by its name, among
    the names stored (``name in limits``), since only the store knows which plans were used.
    """

    def __init__(self, known: Mapping[str, LimitConfig]) -> None:
        self._known = dict(known)

    def __getitem__(self, name: str) -> LimitConfig:
        config = self._known.get(name)
        if config is None:
            plan = plan_limit(name)
            if plan is None:
                raise KeyError(name)
            config = row_config(plan)
        return config

    def __iter__(self) -> Iterator[str]:
        return iter(self._known)

    def __len__(self) -> int:
        return len(self._known)


def cleanup_limits() -> CleanupLimits:
    """Return the limits whose idle rows cleanup may delete, read as ``known_limits`` reads them.

    A name seen with several configs (``INLINE_VARIED``) is left out: a row full under one
    of them may be in debt under another, and deleting it would hand out a fresh bucket.
    """
    known = known_limits()
    return CleanupLimits({name: limit.config for name, limit in known.items() if limit.source != INLINE_VARIED})


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


def _inline_source(name: str, varied: set[str]) -> str:
    # A plan's bucket reads the same here as in a process that never decided it.
    if name in varied:
        return INLINE_VARIED
    return PLAN if is_plan_name(name) else INLINE


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
        varied = set(_varied)
    # A throttle decides its scope with an inline config, remembered as it was then: the
    # scope's rate as configured now is what its rows mean.
    known.update(
        (config.name, KnownLimit(config, _inline_source(config.name, varied)))
        for config in inline
        if config.name not in throttles
    )
    if not as_rows:
        return known
    # A sharded limit's rows are its shards: they read (in the admin, for cleanup) under
    # a shard's config.
    return {name: replace(limit, config=row_config(limit.config)) for name, limit in known.items()}
