"""``manage.py tokenbucket top|stats``: who is being limited, from the stored analytics.

``top NAME`` prints the keys a limit denied most over the last ``--since`` (at most an
hour); ``stats`` the calls each limit allowed and denied, and ``stats NAME`` the same
minute by minute (or by ``--every``). They read what every process has flushed
(``TOKENBUCKET["ANALYTICS"]``, ``django_tokenbucket.analytics``): a process' counts reach
the store within ``FLUSH`` seconds.
"""

from __future__ import annotations

import json
import math
from argparse import ArgumentParser, _SubParsersAction
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from django.core.management.base import CommandError, OutputWrapper
from django.utils import timezone

from .. import analytics
from ..api import limiter
from ..backends.base import BaseBackend, MinuteCounts
from ..override_operations import DURATION_HINT, parse_duration
from ..registry import KnownLimit, known_limits
from ..text import printable

__all__ = ["SUBCOMMANDS", "AnalyticsCommands", "add_analytics_parsers"]

#: The subcommands this module handles, as ``tokenbucket``'s usage lists them.
SUBCOMMANDS = ("top", "stats")

_OFF = "analytics are off: set TOKENBUCKET['ANALYTICS'] = {'FLUSH': 10} (docs/settings.md#analytics)"


def add_analytics_parsers(sub: _SubParsersAction[ArgumentParser], parent: ArgumentParser) -> None:
    """Add ``top`` and ``stats`` to ``tokenbucket``'s subparsers (``parent``: Django's options)."""
    text = "The keys a limit denied most lately, with their counts (all processes)."
    top = sub.add_parser("top", parents=[parent], help=text, description=text)
    top.add_argument("name", help="The limit's name.")
    top.add_argument("--since", default="1h", help=f"How far back, up to 1h (default 1h; {DURATION_HINT}).")
    top.add_argument("--limit", type=int, default=20, help="How many keys (default 20).")
    top.add_argument("--json", action="store_true", dest="as_json", help="Print JSON.")
    text = "Calls allowed and denied: per limit, or minute by minute for one limit (all processes)."
    stats = sub.add_parser("stats", parents=[parent], help=text, description=text)
    stats.add_argument("name", nargs="?", help="Only this limit, minute by minute.")
    stats.add_argument("--since", default="1h", help=f"How far back, up to 24h (default 1h; {DURATION_HINT}).")
    stats.add_argument(
        "--every", default="1m", help="With NAME: one line per this span (default 1m, e.g. 10m, 1h)."
    )
    stats.add_argument("--json", action="store_true", dest="as_json", help="Print JSON.")


def _minutes(what: str, text: str, most: int) -> int:
    """``text`` (a duration) in whole minutes, 1 to ``most``; CommandError otherwise."""
    try:
        seconds = parse_duration(text).total_seconds()
    except ValueError as exc:
        raise CommandError(f"{what}: {exc}") from None
    minutes = math.ceil(seconds / 60)
    if minutes > most:
        raise CommandError(f"{what}: {text!r} is longer than the {most // 60}h analytics keep for this")
    return minutes


def _moment(minute: int) -> str:
    """The start of ``minute`` in the project's time zone, as an operator reads it."""
    return timezone.localtime(datetime.fromtimestamp(minute * 60, tz=UTC)).strftime("%Y-%m-%d %H:%M")


class AnalyticsCommands:
    """The handlers of ``add_analytics_parsers``' subcommands, mixed into ``tokenbucket``'s Command.

    Uses the Command's ``_known`` (an unknown limit's error) and ``stdout``.
    """

    stdout: OutputWrapper

    def _known(self, name: str, database: str | None, *, as_rows: bool = True) -> KnownLimit:
        raise NotImplementedError  # the Command's

    def _analytics_backend(self, name: str) -> BaseBackend:
        if analytics.active() is None:
            raise CommandError(_OFF)
        known = self._known(name, None, as_rows=False)
        backend = limiter.backend(known.config)
        if not backend.keeps_analytics:
            raise CommandError(f"rate limit {name!r}: its store ({backend.setting}) keeps no analytics")
        return backend

    def handle_top(self, *, name: str, since: str, limit: int, as_json: bool, **options: Any) -> None:
        minutes = _minutes("--since", since, analytics.KEY_MINUTES_KEPT)
        if not 1 <= limit <= 1000:
            raise CommandError(f"--limit must be from 1 to 1000, not {limit}")
        keys = analytics.denied_keys(name, since=minutes, limit=limit, backend=self._analytics_backend(name))
        if as_json:
            rows = [{"digest": key.digest, "label": key.label, "denied": key.denied} for key in keys]
            self.stdout.write(json.dumps({"name": name, "minutes": minutes, "keys": rows}, indent=2))
            return
        if not keys:
            self.stdout.write(f"{name}: no key denied in the last {minutes} min (flushed counts)")
            return
        self.stdout.write(f"{name}: the most denied keys of the last {minutes} min (all processes, flushed counts)")
        width = max(len(f"{key.denied:,}") for key in keys)
        for rank, key in enumerate(keys, 1):
            # A label is what a client sent (an address, a user id), stored with what is
            # not printable escaped; escaped again for a row that did not come from here.
            shown = printable(key.label) or "-"
            self.stdout.write(f"{rank:>3}. {key.denied:>{width},} denied  {printable(key.digest[:16])}  {shown}")

    def handle_stats(self, *, name: str | None, since: str, every: str, as_json: bool, **options: Any) -> None:
        minutes = _minutes("--since", since, analytics.MINUTES_KEPT)
        if name is not None:
            step = _minutes("--every", every, analytics.MINUTES_KEPT)
            self._stats_of(name, minutes, step, as_json)
            return
        if analytics.active() is None:
            raise CommandError(_OFF)
        until = analytics.current_minute() + 1
        by_backend: dict[BaseBackend, list[str]] = defaultdict(list)
        for known in sorted(known_limits(as_rows=False).values(), key=lambda known: known.name):
            backend = limiter.backend(known.config)
            if backend.keeps_analytics:
                by_backend[backend].append(known.name)
        totals = {name: [0, 0] for names in by_backend.values() for name in names}
        for backend, names in by_backend.items():
            for row in backend.read_minutes(names, until - minutes, until):
                totals[row.name][0] += row.allowed
                totals[row.name][1] += row.denied
        if as_json:
            rows = [{"name": n, "allowed": a, "denied": d} for n, (a, d) in sorted(totals.items())]
            self.stdout.write(json.dumps({"minutes": minutes, "limits": rows}, indent=2))
            return
        self.stdout.write(f"Calls of the last {minutes} min (all processes, flushed counts):")
        width = max([len(n) for n in totals] + [5])
        self.stdout.write(f"{'limit':<{width}}  {'allowed':>10}  {'denied':>10}  denied %")
        for limit_name, (allowed, denied) in sorted(totals.items()):
            share = f"{100 * denied / (allowed + denied):.1f}" if allowed + denied else "-"
            self.stdout.write(f"{limit_name:<{width}}  {allowed:>10,}  {denied:>10,}  {share:>8}")

    def _stats_of(self, name: str, minutes: int, step: int, as_json: bool) -> None:
        rows = analytics.minutes(name, since=minutes, backend=self._analytics_backend(name))
        spans = [_sum(rows[start : start + step]) for start in range(0, len(rows), step)]
        if as_json:
            data = [{"minute": s.minute, "allowed": s.allowed, "denied": s.denied} for s in spans]
            self.stdout.write(json.dumps({"name": name, "every_minutes": step, "rows": data}, indent=2))
            return
        allowed, denied = sum(s.allowed for s in spans), sum(s.denied for s in spans)
        self.stdout.write(
            f"{name}: {allowed:,} allowed, {denied:,} denied in the last {minutes} min "
            f"(all processes, flushed counts; {timezone.get_current_timezone_name()})"
        )
        self.stdout.write(f"{'from':<16}  {'allowed':>10}  {'denied':>10}")
        for span in spans:
            self.stdout.write(f"{_moment(span.minute):<16}  {span.allowed:>10,}  {span.denied:>10,}")


def _sum(rows: list[MinuteCounts]) -> MinuteCounts:
    """The counts of consecutive minutes as one span, starting at the first."""
    return MinuteCounts(
        rows[0].name, rows[0].minute, sum(row.allowed for row in rows), sum(row.denied for row in rows)
    )
