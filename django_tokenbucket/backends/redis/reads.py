"""The Redis backend's reads first: a denial or a check without the script.

A key this process saw denied lately is likely denied again: its decision reads
the bucket and the clock (GET, then TIME, sent together: one round trip) and
decides in Python with the same algorithm as the script (tests/test_redis.py holds
the two equal). A denial, or a check, ends there, having written nothing; what
writes (an admission) still goes to the script, which decides it again. The clock
is read after the bucket: buckets only fill as time passes, so a state denied at
the later time was denied when it was read, whatever other clients did between
the two (a reset in between is ordered after the denial). Only on a client that
talks to one server (Sentinel included); a cluster's decisions all run the script.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ... import clock
from ..base import Outcome, Request
from .bounded import aread, single_execute
from .connections import packed_read
from .script import fast_decision, fast_outcome, parse_state, time_microseconds
from .spares import give_back, lease

__all__ = ["ReadsFirst"]


class ReadsFirst:
    """Decide a key denied lately, or a check, from one read (``GET`` and ``TIME``).

    Mixed into ``RedisBackend``, whose keys, limits, deadline, figures and error mapping it uses.
    """

    # Provided by RedisBackend.
    _failed: Any
    _key: Any
    _learned: Any
    _limit: Any
    cache_alias: str
    reads: Any
    recent_denials: Any
    timeout: float | None

    def _reads_first(self, requests: Sequence[Request], apply: bool) -> bool:
        return len(requests) == 1 and (not apply or self.recent_denials.likely(self.cache_alias, requests[0]))

    def _read_plan(self, connection: Any, request: Request) -> tuple[Any, list[tuple[str, ...]], int | None]:
        """Return the pool to read on (None: the script decides), the read's commands and,
        when the script would be sent one, the time."""
        pool = connection.read_pool
        if pool is None:
            return None, [], None
        self.reads["sent"] += 1
        key = self._key(connection, self._limit(request.config), request.key)
        now = clock.override()
        if now is None and connection.app_clock:
            now = clock.app_now()
        return pool, ([("GET", key)] if now is not None else [("GET", key), ("TIME",)]), now

    def _read_outcome(self, request: Request, raw: Any, now: int, *, apply: bool) -> Outcome | None:
        """Decide ``request`` from the stored ``raw`` at ``now``; None when the script must."""
        state = None if raw is None else parse_state(raw)
        if raw is not None and state is None:
            return None  # unreadable: the script says so
        config = request.config
        decision = config.decide(state, now, request.count, request.key.digest, request.reserve)
        if apply and (decision.allowed or decision.state is not None):
            # It writes (an admission, or a denial that re-dates a bucket whose clock
            # went back): the script decides it again, atomically.
            return None
        self.reads["decided"] += 1
        if decision.state is not None:  # a check's: the script's decisions carry none
            decision = fast_decision(decision.allowed, decision.value, decision.retry_after, decision.full_after)
        outcome: Outcome = self._learned(fast_outcome([decision], now), [request], apply)
        return outcome

    def _read(self, connection: Any, request: Request, *, apply: bool, deadline: float | None = None) -> Outcome | None:
        """Decide ``request`` from one read of its bucket and the clock; None: run the script."""
        pool, commands, now = self._read_plan(connection, request)
        if pool is None:
            return None
        if deadline is not None:
            try:
                replies = single_execute(pool, commands, deadline, self.timeout or 0.0, packed=packed_read(commands))
            except ResponseError:
                return None
            except (RedisError, OSError) as exc:
                raise self._failed(exc) from exc  # a read changed nothing: not ambiguous
            now = time_microseconds(replies[1]) if now is None else now
            return self._read_outcome(request, replies[0], now, apply=apply)
        try:
            link = lease(pool)
        except (RedisError, OSError) as exc:
            raise self._failed(exc) from exc  # nothing was sent
        try:
            link.send_packed_command(packed_read(commands) or link.pack_commands(commands))
            raw = link.read_response()
            if now is None:
                now = time_microseconds(link.read_response())
        except ResponseError:
            link.disconnect()  # the other reply may be unread
            return None
        except (RedisError, OSError) as exc:
            link.disconnect()
            raise self._failed(exc) from exc  # a read changed nothing: not ambiguous
        except BaseException:
            link.disconnect()
            raise
        finally:
            give_back(pool, link)
        return self._read_outcome(request, raw, now, apply=apply)

    async def _aread(
        self, connection: Any, request: Request, *, apply: bool, deadline: float | None = None
    ) -> Outcome | None:
        """``_read`` on the asyncio client (behind the node's breaker under ``TIMEOUT``)."""
        pool, commands, now = self._read_plan(connection, request)
        if pool is None:
            return None
        try:
            replies = await aread(pool, commands, guard=deadline is not None)
        except (RedisError, OSError) as exc:
            raise self._failed(exc) from exc  # a read changed nothing: not ambiguous
        if replies is None:
            return None
        now = time_microseconds(replies[1]) if now is None else now
        return self._read_outcome(request, replies[0], now, apply=apply)
