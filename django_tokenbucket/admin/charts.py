"""Allowed and denied calls per minute as an inline SVG chart, drawn on the server.

No JavaScript and no third-party script: the admin page carries the picture itself,
which works under a strict Content-Security-Policy and needs no CDN. The chart is a
stacked bar per period (allowed at the bottom, denied on top), ``role="img"`` with a
``<title>`` that says in words what it shows (for screen readers, and as a tooltip), and
a ``<title>`` per bar with its time and counts.

Pure: ``chart_svg`` depends only on its arguments (and the active translation and
time zone for its words and clock times), so it is tested without a store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from django.utils import timezone
from django.utils.formats import date_format, number_format
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from ..backends.base import MinuteCounts

__all__ = ["Bar", "bars", "chart_svg", "minute_day_time", "minute_time", "totals"]

#: The drawing's own units (``viewBox``): it scales to the width of its box and keeps
#: its proportions, so its words stay readable on a phone.
WIDTH = 600
HEIGHT = 150
COMPACT_WIDTH = 240
COMPACT_HEIGHT = 44
#: Room for the words around the plot (left: the scale; bottom: the clock times).
_LEFT, _RIGHT, _TOP, _BOTTOM = 46, 6, 8, 22
#: More bars than this are merged (the 24-hour chart: 144 bars of 10 minutes), so a
#: page draws a bounded number of elements whatever the span.
MAX_BARS = 150
#: The least height of a period with calls: one denial beside a spike of thousands
#: still shows.
MIN_VISIBLE = 1.0


@dataclass(frozen=True)
class Bar:
    """The calls of ``minutes`` minutes starting at ``minute`` (minutes since the epoch)."""

    minute: int
    minutes: int
    allowed: int
    denied: int

    @property
    def total(self) -> int:
        """Return the calls of this period, allowed and denied."""
        return self.allowed + self.denied


def bars(counts: Sequence[MinuteCounts], per: int = 1) -> list[Bar]:
    """Return ``counts`` summed into bars of ``per`` consecutive minutes, oldest first.

    The last bar holds what is left when ``len(counts)`` is not a multiple of ``per``;
    ``per`` grows past what was asked when more than ``MAX_BARS`` bars would result.
    """
    if per < 1:
        raise ValueError(f"a bar spans at least one minute, not {per!r}")
    ordered = sorted(counts, key=lambda row: row.minute)
    per = max(per, -(-len(ordered) // MAX_BARS))
    result = []
    for start in range(0, len(ordered), per):
        group = ordered[start : start + per]
        result.append(
            Bar(group[0].minute, per, sum(row.allowed for row in group), sum(row.denied for row in group))
        )
    return result


def totals(counts: Sequence[MinuteCounts]) -> tuple[int, int]:
    """Return the allowed and denied calls of ``counts``, summed."""
    return sum(row.allowed for row in counts), sum(row.denied for row in counts)


def minute_time(minute: int) -> str:
    """Return the start of ``minute`` (minutes since the epoch) as HH:MM in the current time zone."""
    return timezone.localtime(datetime.fromtimestamp(minute * 60, tz=UTC)).strftime("%H:%M")


def minute_day_time(minute: int) -> str:
    """Return the start of ``minute`` as the day of the week and HH:MM ("Tue 14:05"), for
    spans over a day, whose two ends have the same clock time."""
    return date_format(timezone.localtime(datetime.fromtimestamp(minute * 60, tz=UTC)), "D H:i")


def _number(value: int) -> str:
    return number_format(value, force_grouping=True)


def _summary(drawn: Sequence[Bar], heading: str, time_of: Callable[[int], str]) -> str:
    """The chart in words: its span, the totals and the busiest period."""
    allowed = sum(bar.allowed for bar in drawn)
    denied = sum(bar.denied for bar in drawn)
    span = _("%(start)s to %(end)s") % {
        "start": time_of(drawn[0].minute),
        "end": time_of(drawn[-1].minute + drawn[-1].minutes),
    }
    if allowed + denied == 0:
        return _("%(heading)s, %(span)s: no calls.") % {"heading": heading, "span": span}
    busiest = max(drawn, key=lambda bar: (bar.denied, bar.total))
    text = _("%(heading)s, %(span)s: %(allowed)s allowed, %(denied)s denied.") % {
        "heading": heading,
        "span": span,
        "allowed": _number(allowed),
        "denied": _number(denied),
    }
    if denied:
        text += " " + _("Most denied at %(time)s: %(denied)s of %(total)s.") % {
            "time": time_of(busiest.minute),
            "denied": _number(busiest.denied),
            "total": _number(busiest.total),
        }
    return text


def chart_svg(
    counts: Sequence[MinuteCounts],
    *,
    ident: str,
    heading: str,
    per: int = 1,
    compact: bool = False,
    time_of: Callable[[int], str] = minute_time,
) -> SafeString:
    """Return an ``<svg>`` of ``counts`` (one entry per minute, as ``analytics.minutes()``
    returns them): a stacked bar of allowed and denied calls per ``per`` minutes.

    ``ident`` makes the id of its title unique on the page; ``heading``
    names the chart in its title ("Last hour, per minute"). ``compact`` draws the bars
    only (the overview's small chart), the words staying in the title. Every text is
    escaped.
    """
    width, height = (COMPACT_WIDTH, COMPACT_HEIGHT) if compact else (WIDTH, HEIGHT)
    # Compact: a pixel below the axis, which on the viewBox's very edge could be lost to
    # rounding once scaled.
    left, right, top, bottom = (0, 0, 2, 1) if compact else (_LEFT, _RIGHT, _TOP, _BOTTOM)
    drawn = bars(counts, per)
    title = _summary(drawn, heading, time_of) if drawn else _("%(heading)s: no data.") % {"heading": heading}
    plot_width, plot_height = width - left - right, height - top - bottom
    base = top + plot_height
    highest = max((bar.total for bar in drawn), default=0)
    slot = plot_width / len(drawn) if drawn else plot_width
    gap = min(1.0, slot * 0.15)
    shapes = []
    for index, bar in enumerate(drawn):
        if bar.total == 0:
            continue  # nothing to draw: an empty period is the absence of a bar
        x = left + index * slot
        # Heights in proportion to the busiest period, but never below MIN_VISIBLE.
        total_height = max(MIN_VISIBLE * (1 + (bar.allowed > 0 and bar.denied > 0)), plot_height * bar.total / highest)
        denied_height = 0.0
        if bar.denied:
            denied_height = max(MIN_VISIBLE, total_height * bar.denied / bar.total)
            if bar.allowed:
                denied_height = min(denied_height, total_height - MIN_VISIBLE)
        allowed_height = total_height - denied_height
        tip = _("%(time)s: %(allowed)s allowed, %(denied)s denied") % {
            "time": time_of(bar.minute),
            "allowed": _number(bar.allowed),
            "denied": _number(bar.denied),
        }
        rects = []
        if allowed_height > 0:
            rects.append(
                format_html(
                    '<rect class="tb-allowed" fill="#417893" x="{}" y="{}" width="{}" height="{}"/>',
                    f"{x:.2f}",
                    f"{base - allowed_height:.2f}",
                    f"{slot - gap:.2f}",
                    f"{allowed_height:.2f}",
                )
            )
        if denied_height > 0:
            rects.append(
                format_html(
                    '<rect class="tb-denied" fill="#ba2121" x="{}" y="{}" width="{}" height="{}"/>',
                    f"{x:.2f}",
                    f"{base - total_height:.2f}",
                    f"{slot - gap:.2f}",
                    f"{denied_height:.2f}",
                )
            )
        # rects holds format_html's output only: joined, it is as safe as each part.
        shapes.append(format_html("<g><title>{}</title>{}</g>", tip, SafeString("".join(rects))))
    words: list[SafeString] = []
    if not compact:
        # The scale: the busiest period's calls at the top, 0 at the baseline; the
        # clock times of the first period and of the end of the last under the axis.
        span = drawn[0].minutes if drawn else per
        unit = _("per minute") if span == 1 else _("per %(minutes)s min") % {"minutes": span}
        words = [
            format_html(
                '<text class="tb-chart-text" x="{}" y="{}" text-anchor="end">{}</text>',
                left - 4,
                top + 10,
                _number(highest),
            ),
            format_html('<text class="tb-chart-text" x="{}" y="{}" text-anchor="end">0</text>', left - 4, base),
            # The unit under the middle of the axis: beside the scale it would not fit.
            format_html(
                '<text class="tb-chart-text" x="{}" y="{}" text-anchor="middle">{}</text>',
                (left + width - right) // 2,
                height - 6,
                unit,
            ),
        ]
        if drawn:
            words += [
                format_html(
                    '<text class="tb-chart-text" x="{}" y="{}">{}</text>', left, height - 6, time_of(drawn[0].minute)
                ),
                format_html(
                    '<text class="tb-chart-text" x="{}" y="{}" text-anchor="end">{}</text>',
                    width - right,
                    height - 6,
                    time_of(drawn[-1].minute + drawn[-1].minutes),
                ),
            ]
    axis = format_html(
        '<line class="tb-chart-axis" stroke="#ccc" x1="{}" y1="{}" x2="{}" y2="{}"/>', left, base, width - right, base
    )
    return format_html(
        '<svg class="tb-chart{}" role="img" aria-labelledby="{}-title" viewBox="0 0 {} {}" width="100%" '
        'preserveAspectRatio="xMidYMid meet" xmlns="http://www.w3.org/2000/svg" data-bars="{}" data-max="{}">'
        '<title id="{}-title">{}</title>{}{}{}</svg>',
        " tb-chart-compact" if compact else "",
        ident,
        width,
        height,
        len(drawn),
        highest,
        ident,
        title,
        axis,
        format_html_join("", "{}", ((shape,) for shape in shapes)),
        format_html_join("", "{}", ((word,) for word in words)),
    )
