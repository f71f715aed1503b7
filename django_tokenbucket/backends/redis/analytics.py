"""The Redis backend's denial-analytics storage: per-minute counters that expire by themselves.

Per limit, two kinds of key (made with the cache's key function, as bucket keys are):

- ``tokenbucket:analytics:{<tag>}<name>:h:<hour>``, a hash per hour whose fields
  ``<minute>:a`` and ``<minute>:d`` count the calls allowed and denied in that minute
  (``HINCRBY``): a day of a limit is 24 keys, read with one HGETALL each;
- ``tokenbucket:analytics:{<tag>}<name>:k:<minute>``, a sorted set of the key digests
  denied in that minute, scored by how many times (``ZINCRBY``).

``<tag>`` is the first 16 hex digits of the name's SHA-256: a Redis Cluster hash tag
that puts all of one limit's analytics keys in one slot (so ``ZUNION`` over its minutes
runs on one node), and that braces in the name cannot break, since the name follows it.

Increments from every process add up in Redis, and every key carries a TTL, so there is
nothing to trim: an hour's hash lives ``MINUTES_KEPT`` minutes past its last minute,
a minute's set ``KEY_MINUTES_KEPT`` minutes past its minute (both plus
``EXPIRY_MARGIN``). The TTL is counted from the minute written rather than from a
clock, taking a flush to happen within the minute it reports: one that comes later
only keeps its keys a little longer. No readable labels are kept (see ``backend``).

The backend's deadline bounds decisions only: these calls come from the flush thread
and the admin, not from a request waiting on its limit, and are bounded by the socket
timeouts of the client (the cache's, or those the backend's own client fills in at the
deadline where the cache sets none: ``clients``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisClusterException, RedisError

from ..analytics_store import checked_limit, checked_span, merged_keys, merged_minutes
from ..base import KEY_MINUTES_KEPT, MINUTES_KEPT, BackendError, DeniedKeyCount, MinuteCounts
from .connections import may_have_run
from .script import as_text

__all__ = ["EXPIRY_MARGIN", "AnalyticsKeys", "analytics_key"]

#: Seconds every analytics key outlives its retention: a flush may come up to a flush
#: interval after its minute, and the hosts' clocks may differ by a little.
EXPIRY_MARGIN = 300

_ERRORS = (RedisError, RedisClusterException, OSError)


def analytics_key(name: str, kind: str, number: int) -> str:
    """Return the key (before the cache's key function) of limit ``name``'s hour hash
    (``kind`` "h", ``number`` the hour) or minute set ("k", the minute)."""
    tag = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"tokenbucket:analytics:{{{tag}}}{name}:{kind}:{number}"


def hour_ttl(minute: int) -> int:
    """Seconds from ``minute`` until its hour's hash may go: its hour's last minute plus the retention."""
    hour_end = (minute // 60 + 1) * 60
    return (hour_end - minute + MINUTES_KEPT) * 60 + EXPIRY_MARGIN


#: Seconds a minute's set of denied keys lives: to the end of the minute, plus the retention.
KEYS_TTL = (1 + KEY_MINUTES_KEPT) * 60 + EXPIRY_MARGIN


class AnalyticsKeys:
    """Write and read denial analytics in Redis (single server, Sentinel or Cluster).

    Mixed into ``RedisBackend``, whose connection (``_connect``) and error mapping
    (``_failed``) it uses.
    """

    # Provided by RedisBackend.
    _connect: Any
    _failed: Any
    cache_alias: str

    def _analytics_key(self, connection: Any, name: str, kind: str, number: int) -> str:
        return str(connection.make_key(analytics_key(name, kind, number)))

    def _analytics_failed(self, what: str, exc: BaseException, *, ambiguous: bool = False) -> BackendError:
        failed = self._failed(exc, ambiguous=ambiguous)
        return BackendError(
            f"Redis (cache {self.cache_alias!r}): {what} failed: {failed}", ambiguous=ambiguous, busy=failed.busy
        )

    def write_analytics(self, minutes: Sequence[MinuteCounts], keys: Sequence[DeniedKeyCount]) -> None:
        """One non-transactional pipeline (one round trip; on a cluster, one per node
        involved): HINCRBY and ZINCRBY, and an EXPIRE per key written.

        Not MULTI/EXEC: increments need no isolation, and on a cluster the keys of
        several limits lie in several slots. When it fails after sending, some
        increments may have been applied (``BackendError.ambiguous``).
        """
        minute_rows = merged_minutes(minutes)
        key_rows = merged_keys(keys)
        client = None
        try:
            connection = self._connect()
            client = connection.client
            pipe = client.pipeline(transaction=False)
            ttls: dict[str, int] = {}
            for name, minute, allowed, denied in minute_rows:
                key = self._analytics_key(connection, name, "h", minute // 60)
                for suffix, count in (("a", allowed), ("d", denied)):
                    if count:
                        pipe.hincrby(key, f"{minute}:{suffix}", count)
                        # The earliest minute written asks the longest: it must outlive the hour.
                        ttls[key] = max(ttls.get(key, 0), hour_ttl(minute))
            for name, minute, digest, _label, denied in key_rows:
                if denied:
                    key = self._analytics_key(connection, name, "k", minute)
                    pipe.zincrby(key, denied, digest)
                    ttls[key] = KEYS_TTL
            if not ttls:
                return
            for key, ttl in ttls.items():
                pipe.expire(key, ttl)
            pipe.execute()
        except _ERRORS as exc:
            ambiguous = client is not None and may_have_run(client, exc)
            raise self._analytics_failed("writing denial analytics", exc, ambiguous=ambiguous) from exc

    def read_minutes(self, names: Sequence[str], since: int, until: int) -> list[MinuteCounts]:
        """One pipeline of HGETALLs, one per name and hour spanned."""
        wanted = sorted(set(names))
        since, until = checked_span(f"rate limit(s) {', '.join(map(repr, wanted))}", since, until)
        if not wanted or since == until:
            return []
        hours = range(since // 60, (until - 1) // 60 + 1)
        try:
            connection = self._connect()
            pipe = connection.client.pipeline(transaction=False)
            for name in wanted:
                for hour in hours:
                    pipe.hgetall(self._analytics_key(connection, name, "h", hour))
            replies = pipe.execute()
        except _ERRORS as exc:
            raise self._analytics_failed("reading denial analytics", exc) from exc
        found: list[MinuteCounts] = []
        for index, name in enumerate(wanted):
            counts: dict[int, list[int]] = {}
            for reply in replies[index * len(hours) : (index + 1) * len(hours)]:
                for field, value in (reply or {}).items():
                    minute_text, _, kind = as_text(field).partition(":")
                    minute = int(minute_text)
                    if since <= minute < until and kind in ("a", "d"):
                        counts.setdefault(minute, [0, 0])[kind == "d"] += int(value)
            found += [MinuteCounts(name, minute, *counted) for minute, counted in sorted(counts.items())]
        return found

    def read_denied_keys(self, name: str, since: int, until: int, limit: int) -> list[DeniedKeyCount]:
        """``ZUNION`` of the span's minute sets (Redis >= 6.2; one slot, so one node of a
        cluster), then the top ``limit`` here, where ties are ordered by digest.

        Labels are "": the Redis backend keeps none.
        """
        since, until = checked_span(f"rate limit {name!r}", since, until)
        limit = checked_limit(name, limit)
        if since == until:
            return []
        try:
            connection = self._connect()
            keys = [self._analytics_key(connection, name, "k", minute) for minute in range(since, until)]
            pairs = connection.client.zunion(keys, withscores=True)
        except _ERRORS as exc:
            raise self._analytics_failed("reading denial analytics", exc) from exc
        # Scores are doubles: exact integers up to 2**53, far beyond any count here.
        totals = sorted(((-round(float(score)), as_text(member)) for member, score in pairs))
        return [DeniedKeyCount(name, digest, "", -negated) for negated, digest in totals[:limit]]

    def trim_analytics(self, now_minute: int) -> int:
        """Nothing to delete: every analytics key expires by itself (see the module docstring)."""
        if isinstance(now_minute, bool) or not isinstance(now_minute, int) or now_minute < 0:
            raise ValueError(f"analytics: now_minute must be whole minutes since the epoch, not {now_minute!r}")
        return 0
