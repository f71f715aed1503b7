"""The override tables: the models, the database that holds them, the version row's counter.

The rows live in the application's database (the alias the routers give the model for
writes) whatever store decides the limits, a Redis-only project included: the admin
and the command edit them as models, and one query per process per ``MAX_AGE`` costs a
database nothing. Every write counts one more change in the one-row version stamp
(``OverridesVersion``) in its own transaction (``bump``) and gives its row (a deletion,
its ``OverrideTombstone``) that revision; ``snapshot`` reads what changed since the
revision it holds, ``store`` writes.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from django.apps import apps
from django.db import connections, router
from django.db.models import Case, F, Value, When

from ..algorithms import MICRO
from .rules import NUMBERS, Override

if TYPE_CHECKING:
    from ..models import LimitOverride, OverridesVersion, OverrideTombstone

__all__ = ["EPOCH", "FIELDS", "MICROSECOND", "as_datetime", "as_micro", "bump", "database_alias", "from_row", "models"]

#: The columns ``from_row`` takes, in its order.
FIELDS = ("name", "key", "action", *NUMBERS, "expires_at")


def from_row(
    name: str,
    digest: str,
    action: str,
    rate: int | None,
    period: int | None,
    capacity: int | None,
    max_reserved: int | None,
    expires_at: datetime | None,
) -> Override:
    """The Override a row's values (``values_list(*FIELDS)``) say, in the units decisions use."""
    expires = None if expires_at is None else as_micro(expires_at)
    return Override(name, digest, action, rate, period, capacity, max_reserved, expires)


def models() -> tuple[type[LimitOverride], type[OverridesVersion], type[OverrideTombstone]]:
    # Looked up, not imported: this module is imported (by ``api``) before the app
    # registry is ready, when settings files import ``django_tokenbucket``.
    return (
        apps.get_model("django_tokenbucket", "LimitOverride"),
        apps.get_model("django_tokenbucket", "OverridesVersion"),
        apps.get_model("django_tokenbucket", "OverrideTombstone"),
    )


def database_alias() -> str:
    """Return the database alias that holds the overrides (the routers' choice for writes).

    Reads go there too: a replica that lags would hide a change this process just made.
    """
    return router.db_for_write(models()[0]) or "default"


def bump(alias: str) -> int:
    """Count one more change in the version row, in the caller's transaction; return its revision.

    The row stays locked until that transaction ends, so changes take their revisions
    in the order they commit: a process that read revision N has read every change up
    to N. A row whose stamp is not ``-revision`` was last changed by a version of this
    app that did not count (see ``OverridesVersion``): a new epoch makes every process
    read the whole table once.
    """
    _, version, _ = models()
    rows = version.objects.using(alias).filter(pk=1)

    def count() -> int:
        # The assignments in this order: MySQL and MariaDB evaluate them left to right,
        # each seeing the ones before; the others all see the row as it was. Here both
        # read the stamp and the revision as they were.
        return rows.update(
            epoch=Case(When(stamp=-F("revision"), then=F("epoch")), default=Value(_new_epoch())),
            stamp=-(F("revision") + 1),
            revision=F("revision") + 1,
        )

    if not count():  # no row yet (a new or flushed table): made, or found made meanwhile
        _make_version_row(alias, version)
        count()
    return int(rows.values_list("revision", flat=True).get())


def _make_version_row(alias: str, version: type[OverridesVersion]) -> None:
    """Insert the version row at revision 0 unless another writer just did, without an error."""
    writer = connections[alias]
    if writer.vendor != "mysql":
        # ON CONFLICT DO NOTHING (PostgreSQL waits for the other writer's commit first).
        version.objects.using(alias).bulk_create(
            [version(pk=1, epoch=_new_epoch(), revision=0, stamp=0, floor=0)], ignore_conflicts=True
        )
        return
    # Not INSERT IGNORE (Django's ignore_conflicts here): on a duplicate it takes a shared
    # lock, and two writers that both hold one deadlock when the UPDATE wants it
    # exclusive. ON DUPLICATE KEY UPDATE takes the exclusive lock at once.
    quote = writer.ops.quote_name
    columns = ", ".join(quote(column) for column in ("id", "epoch", "revision", "stamp", "floor"))
    with writer.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote(version._meta.db_table)} ({columns}) VALUES (1, %s, 0, 0, 0) "
            f"ON DUPLICATE KEY UPDATE {quote('id')} = {quote('id')}",
            [_new_epoch()],
        )


def _new_epoch() -> int:
    return secrets.randbits(62) + 1  # never 0, what a missing row reads as


def as_datetime(micro: int) -> datetime:
    """Return ``micro`` (µs since the epoch, as ``clock.app_now``) as an aware datetime."""
    return datetime.fromtimestamp(micro / MICRO, tz=UTC)


#: For ``as_micro``, and for the one read that converts every row (``snapshot``).
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)


def as_micro(moment: datetime) -> int:
    """Return an aware ``moment`` in µs since the epoch."""
    return (moment - EPOCH) // MICROSECOND
