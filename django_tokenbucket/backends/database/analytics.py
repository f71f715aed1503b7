"""The database backend's denial-analytics storage: ``AnalyticsMinute`` and ``DeniedKeyMinute`` rows.

Every process flushes its counts as increments, so several processes add to the same
row at once. Each flush is one transaction of atomic upserts ("insert, or add to the
row that is there"): ``INSERT ... ON CONFLICT ... DO UPDATE`` on PostgreSQL and SQLite,
``INSERT ... ON DUPLICATE KEY UPDATE`` on MySQL/MariaDB. The database adds under the row
lock, so no increment is lost and a concurrent first insert never surfaces as an
IntegrityError. The statements are plain and parameterised, with nothing set on the
session, so they run through PgBouncer in transaction pooling mode.

The backend's ``TIMEOUT`` watchdog bounds decisions only: these calls come from the
flush thread, the admin and cleanup, not from a request waiting on its limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from django.db import DatabaseError, connections, transaction
from django.db.models import Max, Model, Sum

from ...models import AnalyticsMinute, DeniedKeyMinute
from ..analytics_store import checked_limit, checked_span, merged_keys, merged_minutes
from ..base import KEY_MINUTES_KEPT, MAX_BATCH_SIZE, MINUTES_KEPT, BackendError, DeniedKeyCount, MinuteCounts
from .retry import retrying

__all__ = ["ROWS_PER_STATEMENT", "AnalyticsRows", "trim"]

_T = TypeVar("_T")

#: Rows per upsert statement. A flush of fewer rows is one statement per table; more are
#: split, so that no statement passes the drivers' limits on parameters (SQLite's 999).
ROWS_PER_STATEMENT = 500

_NAME_LENGTH = AnalyticsMinute._meta.get_field("name").max_length
_LABEL_LENGTH = DeniedKeyMinute._meta.get_field("label").max_length


def _columns(model: type[Model], fields: Sequence[str]) -> list[str]:
    return [str(model._meta.get_field(field).column) for field in fields]  # type: ignore[union-attr]


#: The fields of each table's upsert: its unique key, those kept as first stored, those added to.
_MINUTE_COLUMNS = (("name", "minute"), (), ("allowed", "denied"))
_KEY_COLUMNS = (("name", "minute", "digest"), ("label",), ("denied",))


def _upsert(
    connection: Any,
    cursor: Any,
    model: type[Model],
    fields: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]],
    rows: Sequence[tuple[Any, ...]],
) -> None:
    """Insert ``rows`` (values of ``unique + kept + added``, ``fields``), adding ``added``
    to the row already stored under the same ``unique`` values (``kept`` stay as stored)."""
    unique, kept, added = fields
    vendor, max_params = connection.vendor, connection.features.max_query_params
    quote = connection.ops.quote_name
    table = quote(model._meta.db_table)
    unique_columns = [quote(column) for column in _columns(model, unique)]
    added_columns = [quote(column) for column in _columns(model, added)]
    columns = [*unique_columns, *(quote(column) for column in _columns(model, kept)), *added_columns]
    if vendor == "mysql":
        # MariaDB has no row alias (``AS new``); VALUES(col) is the value the insert carried.
        conflict = "ON DUPLICATE KEY UPDATE " + ", ".join(f"{c} = {c} + VALUES({c})" for c in added_columns)
    elif vendor in ("postgresql", "sqlite"):
        # The table name qualifies the stored value: a bare column would be ambiguous.
        conflict = f"ON CONFLICT ({', '.join(unique_columns)}) DO UPDATE SET " + ", ".join(
            f"{c} = {table}.{c} + EXCLUDED.{c}" for c in added_columns
        )
    else:
        raise DatabaseError(f"denial analytics have no upsert for the {vendor!r} database")
    per_statement = ROWS_PER_STATEMENT
    if max_params:
        per_statement = max(1, min(per_statement, max_params // len(columns)))
    row_placeholder = "(" + ", ".join(["%s"] * len(columns)) + ")"
    for start in range(0, len(rows), per_statement):
        chunk = rows[start : start + per_statement]
        sql = (
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES {', '.join([row_placeholder] * len(chunk))} {conflict}"
        )
        cursor.execute(sql, [value for row in chunk for value in row])


def trim(alias: str, now_minute: int, *, batch_size: int = MAX_BATCH_SIZE) -> int:
    """Delete the analytics rows of database ``alias`` past their retention at ``now_minute``;
    return how many. Database errors are raised as they are (cleanup reports them).

    In batches of primary keys, each its own short statement: a day of denied keys under
    attack can be millions of rows, and one DELETE of them all would hold its locks (on
    SQLite, the whole database) for as long as it runs.
    """
    deleted = 0
    for model, kept in ((AnalyticsMinute, MINUTES_KEPT), (DeniedKeyMinute, KEY_MINUTES_KEPT)):
        manager = model._default_manager.using(alias)
        expired = manager.filter(minute__lt=now_minute - kept)
        while True:
            batch = list(expired.order_by().values_list("pk", flat=True)[:batch_size])
            if not batch:
                break
            deleted += retrying(alias, _deleting(manager, batch))
            if len(batch) < batch_size:
                break
    return deleted


def _deleting(manager: Any, pks: list[int]) -> Callable[[], int]:
    return lambda: int(manager.filter(pk__in=pks).delete()[0])


class AnalyticsRows:
    """Write, read and trim denial analytics in the backend's database.

    Mixed into ``DatabaseBackend``, whose database alias (``alias``) it uses.
    """

    # Provided by DatabaseBackend.
    alias: Callable[[], str]
    retried: Any
    gave_up: Any

    def _analytics(self, what: str, work: Callable[[str], _T]) -> _T:
        alias = self.alias()
        try:
            return work(alias)
        except DatabaseError as exc:
            raise BackendError(f"database {alias!r}: {what} failed: {type(exc).__name__}: {exc}") from exc

    def write_analytics(self, minutes: Sequence[MinuteCounts], keys: Sequence[DeniedKeyCount]) -> None:
        """One transaction of at most two upsert statements (more only past
        ``ROWS_PER_STATEMENT`` rows a table), whatever the number of keys.

        Outside a transaction of the caller's, a deadlock or serialization failure runs
        the transaction again, as decisions do (``retry.retrying``). Inside one, it
        joins it through a savepoint and such a failure propagates: only the caller can
        run its transaction again.
        """
        minute_rows = merged_minutes(minutes, max_name=_NAME_LENGTH)
        key_rows = merged_keys(keys, max_name=_NAME_LENGTH, label_length=_LABEL_LENGTH)
        if not minute_rows and not key_rows:
            return

        def write(alias: str) -> None:
            connection = connections[alias]

            def upserts() -> None:
                with connection.cursor() as cursor:
                    if minute_rows:
                        _upsert(connection, cursor, AnalyticsMinute, _MINUTE_COLUMNS, minute_rows)
                    if key_rows:
                        _upsert(connection, cursor, DeniedKeyMinute, _KEY_COLUMNS, key_rows)

            if connection.in_atomic_block:
                with transaction.atomic(using=alias):
                    upserts()
                return
            try:
                retrying(alias, upserts, retried=self.retried, gave_up=self.gave_up)
            except DatabaseError:
                # A connection the server dropped would fail every later flush of this
                # thread; Django reconnects once it is closed. (Never inside the caller's
                # transaction, which closing would lose.)
                connection.close_if_unusable_or_obsolete()
                raise

        self._analytics("writing denial analytics", write)

    def read_minutes(self, names: Sequence[str], since: int, until: int) -> list[MinuteCounts]:
        """A range of the (name, minute) unique index per name; ordered in Python, by code
        point, as the Redis backend orders them (a database collation may not be)."""
        wanted = sorted(set(names))
        since, until = checked_span(f"rate limit(s) {', '.join(map(repr, wanted))}", since, until)
        if not wanted or since == until:
            return []

        def read(alias: str) -> list[MinuteCounts]:
            rows = AnalyticsMinute.objects.using(alias).filter(name__in=wanted, minute__gte=since, minute__lt=until)
            found = rows.values_list("name", "minute", "allowed", "denied")
            return [
                MinuteCounts(name, int(minute), int(allowed), int(denied))
                for name, minute, allowed, denied in sorted(found, key=lambda row: (row[0], row[1]))
            ]

        return self._analytics("reading denial analytics", read)

    def read_denied_keys(self, name: str, since: int, until: int, limit: int) -> list[DeniedKeyCount]:
        """``GROUP BY digest`` over the span, most denied first (ties by digest), ``LIMIT``
        in the database: a minute under attack may hold many keys."""
        since, until = checked_span(f"rate limit {name!r}", since, until)
        limit = checked_limit(name, limit)
        if since == until:
            return []

        def read(alias: str) -> list[DeniedKeyCount]:
            rows = (
                DeniedKeyMinute.objects.using(alias)
                .filter(name=name, minute__gte=since, minute__lt=until)
                .values("digest")
                # Labels of one digest are alike (the key's readable prefix); MAX picks
                # a stored one over "" where some flush had none.
                .annotate(total=Sum("denied"), stored_label=Max("label"))
                .order_by("-total", "digest")
                .values_list("digest", "stored_label", "total")[:limit]
            )
            # int(): MySQL's SUM of a BIGINT is a DECIMAL.
            return [DeniedKeyCount(name, digest, label or "", int(total)) for digest, label, total in rows]

        return self._analytics("reading denial analytics", read)

    def trim_analytics(self, now_minute: int) -> int:
        """Delete the rows past their retention (``trim``); ``cleanup`` calls it too."""
        if isinstance(now_minute, bool) or not isinstance(now_minute, int) or now_minute < 0:
            raise ValueError(f"analytics: now_minute must be whole minutes since the epoch, not {now_minute!r}")
        return self._analytics("trimming denial analytics", lambda alias: trim(alias, now_minute))
