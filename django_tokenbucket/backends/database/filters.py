"""Rows of ``RateLimit`` by what they hold now, in SQL: the admin's filters, the counts
of the command and the admin, exactly as ``state`` derives one row (the same
arithmetic, as wide decimals on PostgreSQL and MySQL/MariaDB and exact integers in a
registered function on SQLite)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db.models import BooleanField, Count, DecimalField, F, Func, Q, QuerySet, Value
from django.db.models.functions import Cast
from django.db.models.lookups import GreaterThanOrEqual

from ...limits import LimitConfig
from ...live import FULL, LIMITED, PARTIAL, STATES, one_token, refill_time

__all__ = ["ProductsAtLeast", "at_least_q", "count_by_state", "state_q"]

#: Wide enough for products of two amounts of up to 2**54 each: exact on PostgreSQL and
#: MySQL/MariaDB.
_WIDE = DecimalField(max_digits=65, decimal_places=0)
_SQLITE_FUNCTION = "django_tokenbucket_products_ge"


def _products_ge(a: int | None, b: int | None, c: int | None, d: int | None) -> int | None:
    if a is None or b is None or c is None or d is None:
        return None
    # Python's integers: SQLite would overflow 64 bits, or round past 2**53 as a double.
    return int(int(a) * int(b) >= int(c) * int(d))


class ProductsAtLeast(Func):
    """``a * b >= c * d`` for integer expressions, exactly, where the products overflow 64 bits.

    PostgreSQL and MySQL/MariaDB multiply as wide decimals. SQLite has no such type
    (an overflowing product would silently become an imprecise double), so there the
    comparison is a Python function registered on the connection.
    """

    arity = 4
    output_field = BooleanField()

    def as_sql(
        self,
        compiler: Any,
        connection: Any,
        function: str | None = None,
        template: str | None = None,
        arg_joiner: str | None = None,
        **extra_context: Any,
    ) -> Any:
        a, b, c, d = self.get_source_expressions()
        wide = GreaterThanOrEqual(Cast(a, _WIDE) * Cast(b, _WIDE), Cast(c, _WIDE) * Cast(d, _WIDE))
        return compiler.compile(wide)

    def as_sqlite(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        connection.ensure_connection()
        connection.connection.create_function(_SQLITE_FUNCTION, 4, _products_ge, deterministic=True)
        return super().as_sql(compiler, connection, function=_SQLITE_FUNCTION, **extra_context)


def at_least_q(limit: LimitConfig, threshold: int, now: int) -> Q:
    """Return a Q for the rows of ``limit`` that hold at least ``threshold`` micro-tokens at ``now``.

    ``threshold`` must not exceed the capacity. Mirrors the algorithms: a token bucket
    gains ``floor(rate * elapsed / period)``; a fixed window ``rate`` per whole window
    elapsed; a clock that went backwards gains nothing. Exact on every database.

    A fixed-window row stored under another ``period`` or ``start`` (before the config
    changed) is read on its stored phase: a window start of the new phase may already
    have credited it, so such a row can be counted one window short until its next
    decision or cleanup realigns it. The phase of a key comes from a hash SQL cannot
    compute; the values shown per row (``live_state``) are always exact.
    """
    elapsed = Value(now) - F("ts")
    if limit.algorithm.phased:
        # A phased kind credits whole periods only: elapsed minus what is left of the current one.
        # The % operator, not MOD(): SQLite's MOD() is Django's, in doubles, which lose
        # windows past 2**53 µs; the operator is exact on 64-bit integers everywhere.
        elapsed = elapsed - elapsed % Value(limit.period)
    missing = Value(threshold) - F("value")
    # value + floor(rate * elapsed / period) >= threshold  <=>  rate * elapsed >= missing * period
    refilled = Q(ts__lte=now) & Q(ProductsAtLeast(Value(limit.rate), elapsed, missing, Value(limit.period)))
    return Q(name=limit.name) & (Q(value__gte=threshold) | refilled)


def _recent_or_in_debt(limit: LimitConfig, amount: int, now: int) -> Q:
    # Implied by "holds less than amount now": a row not in debt that was last written
    # longer ago than it takes to refill from 0 holds at least that much. Redundant for
    # the result, but it lets the database use an index range on (name, ts) (and the
    # partial index of rows in debt) instead of evaluating every row of the table.
    return Q(name=limit.name) & (Q(ts__gt=now - refill_time(limit, amount)) | Q(value__lt=0))


def state_q(limits: Iterable[LimitConfig], state: str, now: int) -> Q:
    """Return a Q for the rows of ``limits`` that are in ``state`` (one of STATES) at ``now``."""
    if state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, not {state!r}")
    result = Q(pk__in=[])
    for limit in limits:
        if state == FULL:
            part = at_least_q(limit, limit.capacity, now)
        elif state == LIMITED:
            threshold = one_token(limit)
            part = _recent_or_in_debt(limit, threshold, now) & ~at_least_q(limit, threshold, now)
        else:
            part = (
                _recent_or_in_debt(limit, limit.capacity, now)
                & at_least_q(limit, one_token(limit), now)
                & ~at_least_q(limit, limit.capacity, now)
            )
        result |= part
    return result


def count_by_state(
    queryset: QuerySet[Any], limits: Iterable[LimitConfig], now: int, *, partial: bool = True
) -> dict[str, dict[str, int]]:
    """Return, per limit name in ``queryset``, the rows ``stored`` and how many are ``limited`` now.

    With ``partial``, also ``partial`` and ``full`` (for configured limits). Only rows
    written recently, or in debt, can be limited or partially used: those two counts
    come from index ranges, and ``full`` is what remains, so no query evaluates every
    row of a large table (the plain count per name reads the index only).
    """
    limits = list(limits)
    queryset = queryset.order_by()
    counts: dict[str, dict[str, int]] = {
        row["name"]: {"stored": row["n"]} for row in queryset.values("name").annotate(n=Count("pk"))
    }
    states = (LIMITED, PARTIAL) if partial else (LIMITED,)
    for state in states:
        for row in queryset.filter(state_q(limits, state, now)).values("name").annotate(n=Count("pk")):
            counts[row["name"]][state] = row["n"]
    configured = {limit.name for limit in limits}
    for name, row in counts.items():
        if name in configured:
            for state in states:
                row.setdefault(state, 0)
            if partial:
                row[FULL] = row["stored"] - row[LIMITED] - row[PARTIAL]
    return counts
