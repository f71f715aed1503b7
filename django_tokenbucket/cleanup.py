"""Delete the buckets that no longer matter: limits that read as a fresh key would.

A full token bucket is the same state as a fresh one (and a full fixed window on a
fresh key's phase as a fresh window), so its stored state can go: the next call
recreates it and decides exactly as it would have. Without cleanup, every key ever seen
(an attacker's 10^6 usernames, say) keeps a ``RateLimit`` row forever. Redis keys expire
by themselves when their bucket is full again; the database backend deletes idle rows
in short batches that stay out of live traffic's way
(``backends/database/cleanup.py`` says how).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from . import overrides
from .backends import row_backend
from .backends.base import MAX_BATCH_SIZE, UNKNOWN_IDLE, CleanupReport
from .limits import LimitConfig
from .registry import cleanup_limits

__all__ = ["MAX_BATCH_SIZE", "UNKNOWN_IDLE", "CleanupReport", "cleanup", "database_alias", "unknown_names"]


def database_alias(database: str | None = None) -> str:
    """Return the database whose rows cleanup reads: ``database``, or that of ``row_backend()``."""
    alias = database or row_backend().database_alias()
    assert alias is not None
    return alias


def unknown_names(known: Iterable[str], database: str | None = None) -> dict[str, int]:
    """Return the number of stored rows per limit name that is not in ``known``."""
    known = set(known)
    return {name: rows for name, rows in row_backend(database).stored_names().items() if name not in known}


def cleanup(
    *,
    limits: Mapping[str, LimitConfig] | None = None,
    names: Iterable[str] | None = None,
    batch_size: int = MAX_BATCH_SIZE,
    remove_unknown: bool = False,
    unknown_idle: float | None = None,
    dry_run: bool = False,
    max_seconds: float | None = None,
    pause: float | None = None,
    database: str | None = None,
) -> CleanupReport:
    """Delete idle rows of ``database`` (default: see ``row_backend``) in batches; return what was done.

    ``limits`` maps names to configs (default: every limit this process knows, see
    ``registry.cleanup_limits``, and the buckets of ``@ratelimit(rate=callable)``'s
    plans, read from their names); ``names`` restricts the run to some of them. Rows of
    a name not in ``limits`` are kept and reported (``report.unknown``): such a name may
    be decided with ``config=`` at call sites this process never ran (another service,
    a worker), whose live rows must survive. ``remove_unknown`` is the explicit choice
    to delete them all the same once nothing has written them for ``unknown_idle``
    seconds (default: ``UNKNOWN_IDLE``, a week), which is safe for every limit that
    refills within that time. ``dry_run`` deletes nothing and reports what would go. ``max_seconds``
    bounds the run (``report.complete`` says whether it finished); ``pause`` sleeps
    between batches to leave the database to live traffic (default: none, except 0.1 s
    on SQLite, whose waiting writers poll for the lock). Unless ``dry_run``, the
    database's denial analytics past their retention are trimmed too
    (``report.analytics_trimmed``). Overrides that expired more than
    ``OVERRIDES["KEEP_EXPIRED"]`` ago (of ``names``, if given) are deleted from the
    database that holds them (``report.overrides_removed``; counted on a dry run).
    """
    if limits is None:
        limits = cleanup_limits()
    if names is not None:
        names = list(names)  # read twice
    report = row_backend(database).cleanup(
        limits,
        names=names,
        batch_size=batch_size,
        remove_unknown=remove_unknown,
        unknown_idle=unknown_idle,
        dry_run=dry_run,
        max_seconds=max_seconds,
        pause=pause,
    )
    report.overrides_removed = overrides.remove_expired(names=names, dry_run=dry_run)
    return report
