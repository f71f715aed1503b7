"""How the admin shows a bucket: its columns, live figures, the capped paginator.

Everything is derived *now* (the store's clock) from the two stored numbers and the
limit's current config, with the same pure functions the backends decide with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

from ..algorithms import MICRO, State
from ..backends import row_backend
from ..keys import label_as_typed
from ..live import LiveState, live_state
from ..models import RateLimit
from ..registry import KnownLimit, interpret, known_limits
from ..text import describe_rate, format_duration, format_tokens

__all__ = [
    "DIGEST",
    "HEX_PREFIX",
    "UNCONFIGURED",
    "BucketColumns",
    "CappedPaginator",
    "Context",
    "Row",
    "display_row",
    "fill_meter",
    "full_again_text",
    "key_html",
    "local_time",
    "page_context",
]


_LABEL_SHOWN = 40


#: A key's digest as a form or a URL sends it: what a bucket page and an action accept.
DIGEST = re.compile(r"[0-9a-f]{64}")
#: A search term taken as the start of a digest.
HEX_PREFIX = re.compile(r"[0-9a-f]{8,64}")
#: The "limit" filter's choice of rows whose limit is no longer configured.
UNCONFIGURED = "unconfigured"


class CappedPaginator(Paginator):  # type: ignore[type-arg]
    """A paginator that counts at most ``cap + 1`` rows.

    ``COUNT(*)`` over a million rows is the slowest query of a changelist, and the
    admin runs it on every page view (``show_full_result_count`` only avoids a second
    one). Past the cap the list says "more than 10,000" and offers that many pages.
    """

    cap = 10_000

    @cached_property
    def count(self) -> int:
        queryset = cast("QuerySet[Any]", self.object_list)
        return queryset[: self.cap + 1].count()

    @property
    def capped(self) -> bool:
        """Return whether there are more rows than were counted."""
        return self.count > self.cap


@dataclass(frozen=True)
class Context:
    """What every row of one request is interpreted with."""

    now: int
    limits: dict[str, KnownLimit]


@dataclass(frozen=True)
class Row:
    """A stored bucket as the admin shows it: its limit (None: not configured) and what it holds now."""

    known: KnownLimit | None
    live: LiveState | None


def page_context(request: HttpRequest, alias: str) -> Context:
    """Return the Context of ``request``'s rows of database ``alias``, made once per request."""
    # One clock reading per request: every row, filter and count of a page is
    # interpreted at the same instant, so they agree with each other.
    cache: dict[str, Context] = request.__dict__.setdefault("_tokenbucket_admin", {})
    if alias not in cache:
        cache[alias] = Context(now=row_backend(alias).store_now(), limits=known_limits())
    return cache[alias]


def display_row(obj: RateLimit, context: Context) -> Row:
    """Return ``obj`` interpreted at ``context``'s instant, once per row."""
    row: Row | None = getattr(obj, "_tokenbucket_row", None)
    if row is None:
        known = interpret(obj.name, context.limits)
        live = None
        if known is not None:
            live = live_state(known.config, State(obj.value, obj.ts), obj.key, context.now)
        row = Row(known, live)
        obj._tokenbucket_row = row  # type: ignore[attr-defined]
    return row


def local_time(us: int) -> str:
    """Return ``us`` (µs since the epoch) in the project's time zone, or the number when no date holds it."""
    try:
        moment = timezone.localtime(datetime.fromtimestamp(us / MICRO, tz=UTC))
    except (OverflowError, OSError, ValueError):
        return str(us)
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z")


def fill_meter(live: LiveState) -> SafeString:
    """Return a bucket's fill as a ``<meter>``."""
    # <meter> colours itself from low/high/optimum: below one token (limited) it shows
    # as bad, full as good, in between as so-so. No inline style needed.
    return format_html(
        '<meter class="tb-meter" min="0" max="{}" low="{}" high="{}" optimum="{}" value="{}" title="{} ({}%)"></meter>',
        live.capacity,
        live.threshold,
        live.capacity - 1 if live.capacity > live.threshold else live.capacity,
        live.capacity,
        max(0, live.value),
        live.state,
        round(live.fill * 100),
    )


def key_html(label: str, digest: str) -> SafeString:
    """Return a key as the lists show it: its label (shortened), else its digest's start; both on hover."""
    label = label_as_typed(label)
    title = f"{label}\ndigest: {digest}" if label else f"digest: {digest}"
    if not label:
        return format_html('<span class="tb-digest" title="{}">{}…</span>', title, digest[:12])
    shown = label if len(label) <= _LABEL_SHOWN else label[: _LABEL_SHOWN - 1] + "…"
    return format_html('<span class="tb-key" title="{}">{}</span>', title, shown)


def full_again_text(live: LiveState) -> SafeString | str:
    """Return when a bucket is full again ("full", "in 3 min"), and when its next token comes."""
    if live.full_after == 0:
        return format_html('<span class="tb-full">{}</span>', _("full"))
    if live.next_token_after:
        return format_html(
            '{}<br><span class="tb-next">{}</span>',
            _("in %(duration)s") % {"duration": format_duration(live.full_after)},
            _("next token in %(duration)s") % {"duration": format_duration(live.next_token_after)},
        )
    return _("in %(duration)s") % {"duration": format_duration(live.full_after)}


class BucketColumns:
    """The columns and detail fields of a stored bucket, for ``RateLimitAdmin``."""

    _rows_cache: Any

    def _row(self, obj: RateLimit) -> Row:
        row: Row | None = getattr(obj, "_tokenbucket_row", None)
        if row is not None:
            return row
        # The detail page: interpreted on its own, at a fresh clock reading.
        alias = obj._state.db or "default"
        return display_row(obj, Context(now=row_backend(alias).store_now(), limits=known_limits()))

    @admin.display(description=_("limit"))
    def limit_name(self, obj: RateLimit) -> SafeString:
        if self._row(obj).known is None:
            return format_html(
                '{} <span class="tb-unknown" title="{}">{}</span>',
                obj.name,
                _(
                    "No limit of this name is configured here: its rows cannot be interpreted. It may be decided "
                    "with config= at call sites elsewhere (a service or worker), or no longer used."
                ),
                _("not configured"),
            )
        return format_html("{}", obj.name)

    @admin.display(description=_("key"))
    def key_label(self, obj: RateLimit) -> SafeString:
        return key_html(obj.label, obj.key)

    @admin.display(description=_("key digest"))
    def key_digest(self, obj: RateLimit) -> str:
        return obj.key

    @admin.display(description=_("tokens now"))
    def tokens_now(self, obj: RateLimit) -> SafeString | str:
        live = self._row(obj).live
        if live is None:
            return "—"
        text = format_tokens(live.value, places=2)
        if live.value < 0:
            return format_html('<span class="tb-debt" title="{}">{}</span>', _("reserved ahead"), text)
        return format_html('<span title="{}">{}</span>', format_tokens(live.value), text)

    @admin.display(description=_("tokens now"))
    def tokens(self, obj: RateLimit) -> SafeString | str:
        """The fill meter over "tokens of capacity · percent", for the list."""
        known, live = self._row(obj).known, self._row(obj).live
        if live is None or known is None:
            return "—"
        return format_html(
            '{}<br><span class="tb-tokens">{} {} {}</span>',
            fill_meter(live),
            self.tokens_now(obj),
            _("of"),
            format_tokens(known.config.capacity),
        )

    @admin.display(description=_("capacity"))
    def capacity(self, obj: RateLimit) -> str:
        known = self._row(obj).known
        return "—" if known is None else format_tokens(known.config.capacity)

    @admin.display(description=_("fill"))
    def fill_level(self, obj: RateLimit) -> SafeString | str:
        live = self._row(obj).live
        if live is None:
            return "—"
        return format_html('{} <span class="tb-percent">{}%</span>', fill_meter(live), round(live.fill * 100))

    @admin.display(description=_("full again"))
    def full_again(self, obj: RateLimit) -> SafeString | str:
        live = self._row(obj).live
        return "—" if live is None else full_again_text(live)

    @admin.display(description=_("next token"))
    def next_token(self, obj: RateLimit) -> str:
        live = self._row(obj).live
        if live is None:
            return "—"
        if live.next_token_after == 0:
            return str(_("available now"))
        return _("in %(duration)s") % {"duration": format_duration(live.next_token_after)}

    @admin.display(description=_("last update"))
    def last_update(self, obj: RateLimit) -> SafeString:
        return format_html(
            '<span title="{}">{}</span>',
            _("Time of the stored value (for fixed windows: the start of its window)"),
            local_time(obj.ts),
        )

    @admin.display(description=_("stored value (µ-tokens)"))
    def stored_value(self, obj: RateLimit) -> str:
        return f"{obj.value} ({format_tokens(obj.value)} tokens)"

    @admin.display(description=_("stored ts (µs since the epoch)"))
    def stored_ts(self, obj: RateLimit) -> str:
        return str(obj.ts)

    @admin.display(description=_("config"))
    def config_text(self, obj: RateLimit) -> str:
        known = self._row(obj).known
        if known is None:
            return str(_("not configured: no limit of this name is known to this process"))
        return f"{describe_rate(known.config)} ({known.source})"
