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
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

from .settings import tokenbucket_settings

__all__ = ["ThrottledLogger", "throttled_logger"]

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

    def log(self, level: int, topic: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` under ``topic`` unless one was logged within the interval.

        Returns whether the message was emitted. An emitted message ends with the
        number of messages on the same topic held back since the previous one.
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
        self.logger.log(level, msg, *args)
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


@receiver(setting_changed)
def _forget_on_new_settings(*, setting: str, **kwargs: Any) -> None:
    # New settings may mean a new store or a new interval: start counting afresh.
    if setting == "TOKENBUCKET":
        throttled_logger.reset()
