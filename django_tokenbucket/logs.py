"""Warnings that cannot flood the logs.

When the store goes down, every request on every limit fails the same way. Logging
each failure would bury everything else (and cost I/O on the request path exactly
when the service is already struggling), so warnings about one limit are emitted at
most once per ``TOKENBUCKET["LOG_INTERVAL"]`` seconds, and the next one says how many
were held back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from .settings import tokenbucket_settings

__all__ = ["DenialLog", "ThrottledLogger", "current_request", "denial_log", "settings_changed", "throttled_logger"]

#: Monotonic, so that a wall-clock jump can neither silence nor unleash the warnings.
#: A module attribute so tests can move it.
_clock = time.monotonic

#: More topics than this (limit names) and the oldest are forgotten: inline limits may
#: have generated names, and this must not grow without bound.
_MAX_TOPICS = 10_000


class ThrottledLogger:
    """Log at most one message per topic (a limit name) per ``LOG_INTERVAL`` seconds."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._lock = threading.Lock()
        #: topic -> (time of the last message emitted, messages held back since)
        self._topics: dict[str, tuple[float, int]] = {}

    @staticmethod
    def interval() -> float:
        """Return ``TOKENBUCKET["LOG_INTERVAL"]`` in seconds (0 logs everything)."""
        try:
            return max(0.0, float(tokenbucket_settings.LOG_INTERVAL))
        except (TypeError, ValueError):
            return 10.0

    def log(self, level: int, topic: str, msg: str, *args: Any, extra: Mapping[str, object] | None = None) -> bool:
        """Log ``msg % args`` under ``topic`` unless one was logged within the interval.

        Returns whether the message was emitted. An emitted message ends with the
        number of messages on the same topic held back since the previous one;
        ``extra`` becomes attributes of its record, for structured (JSON) handlers.
        """
        if not self.logger.isEnabledFor(level):
            return False
        now = _clock()
        interval = self.interval()
        with self._lock:
            last, suppressed = self._topics.get(topic, (None, 0))
            if last is not None and now - last < interval:
                self._topics[topic] = (last, suppressed + 1)
                return False
            if topic not in self._topics and len(self._topics) >= _MAX_TOPICS:
                self._topics.clear()
            self._topics[topic] = (now, 0)
        if suppressed:
            msg += " (%d similar message%s suppressed in the last %.0f s)"
            args = (*args, suppressed, "" if suppressed == 1 else "s", now - last if last is not None else 0)
        self.logger.log(level, msg, *args, extra=extra)
        return True

    def warning(self, topic: str, msg: str, *args: Any) -> bool:
        """Log a WARNING under ``topic``, at most once per interval (see ``log``)."""
        return self.log(logging.WARNING, topic, msg, *args)

    def reset(self) -> None:
        """Forget every topic (for tests, and when the settings change)."""
        with self._lock:
            self._topics.clear()


#: The limiter's warnings about failing stores.
throttled_logger = ThrottledLogger(logging.getLogger("django_tokenbucket"))


#: The request being rate limited, set by ``@ratelimit``, the DRF throttles and the
#: django-ratelimit layer around their decisions, so that a log line can name its path.
current_request: ContextVar[Any] = ContextVar("django_tokenbucket_request", default=None)

#: Seconds without a denial after which a key's next denial starts a new spell (and a new line).
SPELL_GAP = 60.0
#: Keys in a spell remembered at most; the least recently denied are forgotten first.
_MAX_SPELLS = 10_000


class DenialLog:
    """One INFO line when a key starts being denied, not one per denial.

    A key is "being denied" from its first denial until ``SPELL_GAP`` seconds have passed
    since its last one (an attacker who keeps hammering stays in one spell, admitted now
    and then as tokens come back). The lines of one limit are rate-limited like the
    store-failure warnings: a rotation of keys gives at most one per ``LOG_INTERVAL``, saying
    how many were held back. Nothing is tracked while the logger does not emit INFO.
    """

    def __init__(self, throttled: ThrottledLogger) -> None:
        self.throttled = throttled
        self._lock = threading.Lock()
        #: (limit name, key digest) -> end of the key's spell on the monotonic clock
        self._spells: OrderedDict[tuple[str, str], float] = OrderedDict()

    def enabled(self) -> bool:
        """Whether denials are tracked: the logger emits INFO."""
        return self.throttled.logger.isEnabledFor(logging.INFO)

    def denied(self, name: str, digest: str, label: str, retry_after: float | None) -> bool:
        """Note a denial of key ``digest`` by limit ``name``; log it if it starts a spell. Returns whether it did."""
        if not self.enabled():
            return False
        now = _clock()
        row = (name, digest)
        with self._lock:
            ends = self._spells.get(row)
            self._spells[row] = now + SPELL_GAP
            self._spells.move_to_end(row)
            if len(self._spells) > _MAX_SPELLS:
                self._spells.popitem(last=False)
        if ends is not None and now < ends:
            return False
        request = current_request.get()
        path = getattr(request, "path", None)
        shown = label or digest[:12]
        # %r for what the client chose (its key, the path): a newline or an escape sequence
        # in them is printed escaped, so it cannot forge a line of its own.
        return self.throttled.log(
            logging.INFO,
            f"denying {name}",
            "rate limit %r started denying key %r%s%s",
            name,
            shown,
            "" if path is None else f" on {path!r}",
            "" if retry_after is None else f" (retry after {retry_after:.3g} s)",
            extra={
                "tokenbucket_limit": name,
                "tokenbucket_key": shown,
                "tokenbucket_digest": digest[:12],
                "tokenbucket_path": path,
                "tokenbucket_retry_after": retry_after,
            },
        )

    def reset(self) -> None:
        """Forget every spell (for tests, and when the settings change)."""
        with self._lock:
            self._spells.clear()


#: The limiter's line per key that starts being denied.
denial_log = DenialLog(throttled_logger)


def settings_changed() -> None:
    """Start counting afresh (``django_tokenbucket.lifecycle``): new settings may mean a new store or a new interval."""
    throttled_logger.reset()
    denial_log.reset()
