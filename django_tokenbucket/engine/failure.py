"""A failed store call: its fail mode (``FAIL_OPEN``), or BackendUnavailable.

The drivers (``steps``) hand every ``BackendError`` here. A decision the fail mode lets
through returns (its plan receives None and reports the limits ``failed_open``); anything
else raises BackendUnavailable naming the limit.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import metrics, signals
from ..backends.base import BackendError, Request
from ..exceptions import BackendUnavailable
from ..limits import LimitConfig
from ..logs import throttled_logger
from ..settings import tokenbucket_settings
from . import report

__all__ = ["change_failed", "decide_failed"]


def _noted(label: str, exc: BackendError) -> metrics.Recorder | None:
    """Count the failure (this process' tally, and the metrics); return the active recorder."""
    metrics.store_failures.note(label, metrics.error_label(exc))
    recorder = metrics.active()
    if recorder is not None:
        recorder.store_error(label, metrics.error_label(exc))
    return recorder


def change_failed(label: str, limit: LimitConfig, what: str, exc: BackendError) -> None:
    """A reset or a refund failed: an error whatever ``FAIL_OPEN`` says, there is nothing to allow."""
    _noted(label, exc)
    throttled_logger.warning(limit.name, "rate limit %r: %s failed: %s", limit.name, what, exc)
    raise BackendUnavailable(limit.name, f"the store failed: {exc}") from exc


def decide_failed(
    label: str,
    sender: object,
    limit: LimitConfig,
    requests: Sequence[Request],
    apply: bool,
    fail_open: bool | None,
    exc: BackendError,
) -> None:
    """A decision failed: return to let it through (``fail_open``, by default ``FAIL_OPEN``
    for a store that is down), or raise BackendUnavailable."""
    recorder = _noted(label, exc)
    if fail_open is None:
        # A busy store is up: letting its timeouts through would let a flood past the
        # limit it created (issue 35, item 7). FAIL_OPEN is for a store that is down.
        fail_open = bool(tokenbucket_settings.FAIL_OPEN) and not exc.busy
    names = ", ".join(repr(r.config.name) for r in requests)
    if signals.rate_limit_backend_error.has_listeners():
        signals.rate_limit_backend_error.send(
            sender=sender,
            names=[r.config.name for r in requests],
            exception=exc,
            fail_open=fail_open,
            ambiguous=exc.ambiguous,
        )
    # At most one warning per limit per LOG_INTERVAL: a store outage fails every request
    # at once, and the signal above is there for counting them all.
    if fail_open:
        throttled_logger.warning(
            names,
            "rate limit %s (key %s): the store failed, allowing (FAIL_OPEN): %s",
            names,
            requests[0].key.digest[:12],
            exc,
        )
        return
    throttled_logger.warning(
        names,
        "rate limit %s (key %s): the store %s, refusing (fail closed): %s",
        names,
        requests[0].key.digest[:12],
        "is busy" if exc.busy else "failed",
        exc,
    )
    if recorder is not None and apply:
        report.failed_closed(recorder, label, dict.fromkeys(r.config.name for r in requests))
    what = "is busy (it answers, but not in time)" if exc.busy else "failed"
    raise BackendUnavailable(limit.name, f"the store {what}: {exc}") from exc
