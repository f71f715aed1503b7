"""What a decision reports once it is made: metrics, analytics, the denial log, signals."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .. import analytics, metrics, overrides, signals
from ..keys import encode_key
from ..limits import LimitConfig
from ..logs import denial_log
from ..status import Status
from .names import encode_for
from .stores import Stores

__all__ = ["failed_closed", "report"]

logger = logging.getLogger("django_tokenbucket")

#: The outcomes that analytics count as ``denied``: this limit refused the call.
_REFUSED = frozenset((metrics.DENIED, metrics.DENIED_CACHED, metrics.BLOCKED))


def failed_closed(recorder: metrics.Recorder, label: str, names: Iterable[str]) -> None:
    """Count the limits of a call refused because its store failed (fail closed)."""
    for name in names:
        _count_decision(recorder, name, label, metrics.FAILED_CLOSED)


def _count_decision(recorder: metrics.Recorder, name: str, label: str, outcome: str) -> None:
    recorder.decision(name, label, outcome)


def report(stores: Stores, status: Status, all_ok: bool, limit: LimitConfig) -> None:
    """Count, log and signal one status of an applied call (all-or-nothing: its statuses
    are all ok when ``all_ok``)."""
    recorder = metrics.active()
    counting = analytics.active()
    if recorder is not None or counting is not None:
        outcome = _outcome(status, all_ok)
        if outcome is not None:
            if recorder is not None:
                _count_decision(recorder, status.name, stores.own_label or limit.backend, outcome)
            if counting is not None:
                _count(stores, counting, limit, status, outcome)
    if not status.ok and denial_log.enabled():
        encoded = encode_for(limit, status.key)
        denial_log.denied(status.name, encoded.digest, encoded.label, status.retry_after)
    if status.ok and not status.would_deny:
        # A call denied by another of its limits consumed nothing here either: there is
        # no allowance to report (all-or-nothing). ``receivers`` first, as Signal.send
        # does: has_listeners() costs more than the rest of this function, and most
        # sites connect nothing.
        if all_ok and signals.rate_limit_allowed.receivers and signals.rate_limit_allowed.has_listeners():
            signals.rate_limit_allowed.send(
                sender=stores.sender, name=status.name, key=status.key, count=status.count, status=status
            )
        return
    if status.would_deny:
        logger.info(
            "rate limit %r (shadow mode) would have denied key %s: retry after %s s",
            status.name,
            encode_key(status.key).digest[:12],
            status.retry_after,
        )
    if signals.rate_limit_denied.receivers and signals.rate_limit_denied.has_listeners():
        signals.rate_limit_denied.send(
            sender=stores.sender,
            name=status.name,
            key=status.key,
            count=status.count,
            status=status,
            shadow=status.would_deny,
        )


def _outcome(status: Status, all_ok: bool) -> str | None:
    """A reported status as a metric's ``outcome``; None for a limit that another limit
    of its all-or-nothing call refused (it took nothing)."""
    if status.ok and not (status.failed_open or status.override or status.would_deny):
        return metrics.ALLOWED if all_ok else None  # most decisions: the rest cannot apply
    if status.failed_open:
        return metrics.FAILED_OPEN
    if status.cached:
        return metrics.DENIED_CACHED
    if status.override == overrides.EXEMPT:
        return metrics.EXEMPT
    if status.override == overrides.BLOCK and not status.shadow:
        return metrics.BLOCKED
    if status.would_deny:
        return metrics.SHADOW_DENIED
    if not status.ok:
        return metrics.DENIED
    return metrics.ALLOWED if all_ok else None


def _count(stores: Stores, counting: analytics.Settings, limit: LimitConfig, status: Status, outcome: str) -> None:
    """Count one applied decision for the analytics of ``limit``."""
    backend = stores.backend(limit)
    if not backend.keeps_analytics:
        return
    if outcome not in _REFUSED:
        analytics.record_allowed(counting, backend, status.name)
        return
    encoded = encode_for(limit, status.key)
    label = encoded.label if backend.keeps_labels else ""
    analytics.record_denied(counting, backend, status.name, encoded.digest, label)
