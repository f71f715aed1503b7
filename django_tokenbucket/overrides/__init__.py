"""Overrides made while the site runs: a limit's numbers changed, a key exempted or blocked.

An operator who gives a tenant ten times its quota, exempts a partner or blocks an
account writes a ``LimitOverride`` row, and every process applies it to its next
decisions within ``OVERRIDES["MAX_AGE"]`` seconds, without a deploy and without a query
per decision. Four modules, each importing only those before it:

- ``rules``: what an override is (``Override``, the actions), how it changes a limit
  (``derive``), the one parser of its numbers (``numbers``) and its key (``key_digest``);
  pure, no I/O.
- ``rows``: the tables (the models, the database alias that holds them) and the version
  row's counter that every write bumps.
- ``snapshot``: this process' snapshot of the overrides in force, refreshed from the
  rows changed since it (``refresh_if_due``), and looked up by decisions (``lookup``).
- ``store``: the writes: ``make`` (the one way an override is written, by the API, the
  admin, the command and login protection), ``delete``, ``remove_expired``.

This package re-exports what the rest of ``django_tokenbucket`` uses.
"""

from __future__ import annotations

from .rows import as_datetime, database_alias
from .rules import (
    ACTIONS,
    BLOCK,
    EXEMPT,
    LIMIT,
    LONGEST,
    LONGEST_TEXT,
    NUMBERS,
    Digest,
    Override,
    Settings,
    check_admits,
    derive,
    key_digest,
    numbers,
)
from .snapshot import WARN_IN_FORCE, active, arefresh_if_due, current, invalidate, lookup, refresh_if_due
from .store import TOMBSTONES_KEPT, delete, expiry, in_force, make, remove_expired, require_on

__all__ = [
    "ACTIONS",
    "BLOCK",
    "EXEMPT",
    "LIMIT",
    "LONGEST",
    "LONGEST_TEXT",
    "NUMBERS",
    "TOMBSTONES_KEPT",
    "WARN_IN_FORCE",
    "Digest",
    "Override",
    "Settings",
    "active",
    "arefresh_if_due",
    "as_datetime",
    "check_admits",
    "current",
    "database_alias",
    "delete",
    "derive",
    "expiry",
    "in_force",
    "invalidate",
    "key_digest",
    "lookup",
    "make",
    "numbers",
    "refresh_if_due",
    "remove_expired",
    "require_on",
]
