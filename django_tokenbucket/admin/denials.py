"""Who is being limited, for the admin's limits pages: charts of allowed and denied calls
per minute and the most denied keys, read from each limit's store (``analytics``).

Nothing here may turn a page into an error: a store that fails or keeps no analytics
becomes a note beside the limit, and the rest of the page is drawn as usual.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from .. import analytics, deny_cache, metrics
from ..algorithms import MICRO
from ..backends import backend_aliases, get_backend
from ..backends.base import KEY_MINUTES_KEPT, BackendError, BaseBackend, MinuteCounts
from ..registry import KnownLimit
from .charts import chart_svg, minute_day_time, totals
from .display import key_html, local_time

__all__ = ["DOCS", "KeyRow", "LimitDenials", "analytics_status", "limit_denials", "overview_charts"]

#: Where the setting is explained (the admin has no address for the docs: the path in the repository).
DOCS = "docs/settings.md#analytics"
#: The overview's compact charts and the limit page's first chart: the last hour.
HOUR = 60
#: The limit page's second chart: the last 24 hours, in bars of 10 minutes.
DAY, DAY_BAR = 24 * 60, 10
#: Rows of the limit page's table of the most denied keys.
TOP_KEYS_SHOWN = 20


def analytics_status() -> dict[str, Any]:
    """What every limits page says about analytics and this process: on or off (or the
    setting's error), the deny cache's size, the counts not written yet."""
    try:
        on = analytics.active() is not None
        problem = None
    except ImproperlyConfigured as exc:  # E053 says so too; the page still renders
        on, problem = False, str(exc)
    pending = analytics.pending() if on else {}
    return {
        "analytics_on": on,
        "analytics_problem": problem,
        "analytics_docs": DOCS,
        # This process' only: each process counts, and remembers denials, in its own memory.
        "deny_cache_keys": deny_cache.size() if deny_cache.active() is not None else None,
        "pending_allowed": sum(counts["allowed"] for counts in pending.values()),
        "pending_denied": sum(counts["denied"] for counts in pending.values()),
        "store_failures": [
            {"backend": backend, "count": count, "error": error, "at": local_time(int(at * MICRO))}
            for backend, (count, error, at) in sorted(metrics.store_failures.seen().items())
        ],
    }


def _failure(backend: BaseBackend, exc: Exception) -> str:
    return _("Analytics could not be read from the store (%(backend)s): %(error)s") % {
        "backend": backend.setting,
        "error": exc,
    }


def _no_analytics(backend: BaseBackend) -> str:
    return _("%(backend)s keeps no analytics.") % {"backend": type(backend).__name__}


def _reading(backend: BaseBackend) -> AbstractContextManager[Any]:
    """A savepoint around a read of a database backend: in a request that runs in a
    transaction (ATOMIC_REQUESTS), a failed read would otherwise leave that transaction
    unusable for the rest of the page; a savepoint rolls back the read alone."""
    alias = backend.database_alias()
    return transaction.atomic(using=alias) if alias is not None else nullcontext()


def _per_minute(backend: BaseBackend, names: list[str], since: int) -> dict[str, list[MinuteCounts]]:
    """The counts of ``names`` for each of the last ``since`` minutes, zeros filled: one read
    of the store for them all (``analytics.minutes`` reads one name)."""
    until = analytics.current_minute() + 1
    stored: dict[str, dict[int, MinuteCounts]] = defaultdict(dict)
    for row in backend.read_minutes(names, until - since, until):
        stored[row.name][row.minute] = row
    return {
        name: [stored[name].get(minute, MinuteCounts(name, minute, 0, 0)) for minute in range(until - since, until)]
        for name in names
    }


def overview_charts(limits: dict[str, KnownLimit]) -> tuple[dict[str, SafeString], dict[str, str]]:
    """Return the last hour's compact chart of each limit whose store keeps analytics, and
    a note for the limits whose store failed or keeps none. One read per store."""
    charts: dict[str, SafeString] = {}
    notes: dict[str, str] = {}
    by_alias: dict[str, list[str]] = defaultdict(list)
    for name, known in limits.items():
        by_alias[known.config.backend].append(name)
    for alias, names in sorted(by_alias.items()):
        if alias not in backend_aliases():
            continue  # a limit on a backend that is not configured: check E-codes say so
        backend = get_backend(alias)
        if not backend.keeps_analytics:
            notes.update((name, _no_analytics(backend)) for name in names)
            continue
        try:
            with _reading(backend):
                counted = _per_minute(backend, sorted(names), HOUR)
        except (BackendError, NotImplementedError) as exc:
            notes.update((name, _failure(backend, exc)) for name in names)
            continue
        for name in sorted(names):
            charts[name] = chart_svg(
                counted[name],
                ident=f"tb-chart-{len(charts)}",  # ids unique on the page, whatever the names
                heading=_("“%(name)s”, last hour, per minute") % {"name": name},
                compact=True,
            )
    return charts, notes


@dataclass(frozen=True)
class KeyRow:
    """One of the most denied keys: how it shows, how often it was denied, its bucket page."""

    key: SafeString
    digest: str
    denied: int
    url: str


@dataclass
class LimitDenials:
    """The analytics of one limit's page."""

    #: A note instead of the charts: the store failed, or keeps no analytics.
    error: str | None = None
    hour_chart: SafeString | None = None
    day_chart: SafeString | None = None
    hour_allowed: int = 0
    hour_denied: int = 0
    day_allowed: int = 0
    day_denied: int = 0
    keys: list[KeyRow] = field(default_factory=list)
    #: Whether the store keeps labels: otherwise keys show as their digest only.
    labels: bool = True

    @property
    def hour_share(self) -> str:
        """Return the share of the last hour's calls that were denied, in percent."""
        return _share(self.hour_denied, self.hour_allowed + self.hour_denied)

    @property
    def day_share(self) -> str:
        """Return the share of the last 24 hours' calls that were denied, in percent."""
        return _share(self.day_denied, self.day_allowed + self.day_denied)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "—"


def limit_denials(known: KnownLimit, bucket_url: Callable[[str, str], str]) -> LimitDenials:
    """Return the charts, totals and most denied keys of one limit; ``bucket_url(alias,
    digest)`` is the page of a key's bucket."""
    alias = known.config.backend
    if alias not in backend_aliases():
        return LimitDenials(error=_("Backend “%(alias)s” is not configured.") % {"alias": alias})
    backend = get_backend(alias)
    if not backend.keeps_analytics:
        return LimitDenials(error=_no_analytics(backend))
    name = known.name
    try:
        with _reading(backend):
            day = analytics.minutes(name, since=DAY, backend=backend)
            keys = analytics.denied_keys(name, since=KEY_MINUTES_KEPT, limit=TOP_KEYS_SHOWN, backend=backend)
    except (BackendError, NotImplementedError) as exc:
        return LimitDenials(error=_failure(backend, exc))
    hour = day[-HOUR:]
    hour_allowed, hour_denied = totals(hour)
    day_allowed, day_denied = totals(day)
    return LimitDenials(
        hour_chart=chart_svg(hour, ident="tb-chart-hour", heading=_("Last hour, per minute")),
        day_chart=chart_svg(
            day,
            ident="tb-chart-day",
            heading=_("Last 24 hours, per 10 minutes"),
            per=DAY_BAR,
            time_of=minute_day_time,
        ),
        hour_allowed=hour_allowed,
        hour_denied=hour_denied,
        day_allowed=day_allowed,
        day_denied=day_denied,
        keys=list(_key_rows(keys, alias, bucket_url)),
        labels=backend.keeps_labels,
    )


def _key_rows(
    keys: Iterable[analytics.DeniedKeyCount], alias: str, bucket_url: Callable[[str, str], str]
) -> Iterable[KeyRow]:
    for row in keys:
        yield KeyRow(key_html(row.label, row.digest), row.digest, row.denied, bucket_url(alias, row.digest))

