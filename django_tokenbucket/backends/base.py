"""The interface every backend implements, and the all-or-nothing step they share."""

from __future__ import annotations

import math
import re
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from asgiref.sync import sync_to_async

from .. import catalogue
from ..algorithms import Decision, State
from ..catalogue import Check
from ..keys import EncodedKey
from ..limits import LimitConfig

__all__ = [
    "BUSY_WINDOW",
    "KEY_MINUTES_KEPT",
    "MAX_BATCH_SIZE",
    "MINUTES_KEPT",
    "UNKNOWN_IDLE",
    "Answers",
    "BackendError",
    "BaseBackend",
    "BucketPage",
    "CleanupReport",
    "DeniedKeyCount",
    "MinuteCounts",
    "Outcome",
    "Request",
    "StoredBucket",
    "after_fork_in_child",
    "checked_digests",
    "decide_all",
    "row_id",
    "timeout_option",
]

RowId = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Request:
    """One limit to decide: ``count`` micro-tokens from ``config`` for ``key``."""

    config: LimitConfig
    key: EncodedKey
    count: int
    reserve: bool = False


@dataclass(frozen=True)
class Outcome:
    """The decisions for a list of requests, in order, and the store time they used."""

    decisions: list[Decision]
    now: int


@dataclass(frozen=True)
class StoredBucket:
    """One stored bucket of a limit: its key's digest, a readable label if kept, its state."""

    digest: str
    #: The key as the admin shows it (client addresses, user ids); "" when the store
    #: keeps none (the Redis backend) or the key is a secret (request data).
    label: str
    state: State


@dataclass(frozen=True)
class BucketPage:
    """A page of a limit's stored buckets (``BaseBackend.list_buckets``)."""

    buckets: list[StoredBucket]
    #: Where the next page starts (pass it back as ``cursor``); None after the last page.
    #: A page may hold fewer buckets than asked for, even none, and still have a next one.
    cursor: str | None
    #: The store's clock when the page was read, in µs since the epoch.
    now: int
    #: How far through the store the listing has looked up to this page's end, 0 to 1
    #: (1 after the last page); an estimate where the store walks a keyspace (Redis'
    #: SCAN). None when the backend does not say.
    progress: float | None = None


#: Resets and cleanups of many buckets go in batches of at most this many: larger
#: batches hold their locks (and, on SQLite, the database) for longer.
MAX_BATCH_SIZE = 1000
#: Seconds without a write after which the buckets of a name no limit here knows may be
#: removed by a cleanup (``remove_unknown``), at the least: another service may use that
#: limit inline.
UNKNOWN_IDLE = 7 * 86400


@dataclass
class CleanupReport:
    """What a cleanup run did (``BaseBackend.cleanup``). Counts are stored buckets."""

    #: Buckets deleted, by limit name (idle ones; unknown names only with remove_unknown).
    deleted: Counter[str] = field(default_factory=Counter)
    #: Candidates confirmed not idle (not full again yet, such as buckets in debt): kept.
    kept: int = 0
    #: Buckets under names that are not configured, by name (before any removal).
    unknown: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    seconds: float = 0.0
    slowest_batch: float = 0.0
    #: False when ``max_seconds`` ran out before every limit was done.
    complete: bool = True
    dry_run: bool = False
    #: Denial-analytics rows deleted past their retention (``trim_analytics``); 0 on a dry run.
    analytics_trimmed: int = 0
    #: Overrides deleted (on a dry run: that would be) past ``OVERRIDES["KEEP_EXPIRED"]``.
    overrides_removed: int = 0

    @property
    def deleted_total(self) -> int:
        return sum(self.deleted.values())

    @property
    def rows_per_second(self) -> float:
        return self.deleted_total / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Return the report as plain data (for logs, JSON and Celery results)."""
        return {
            "deleted": dict(self.deleted),
            "deleted_total": self.deleted_total,
            "kept": self.kept,
            "unknown": self.unknown,
            "batches": self.batches,
            "seconds": round(self.seconds, 3),
            "slowest_batch_seconds": round(self.slowest_batch, 4),
            "rows_per_second": round(self.rows_per_second, 1),
            "complete": self.complete,
            "dry_run": self.dry_run,
            "analytics_trimmed": self.analytics_trimmed,
            "overrides_removed": self.overrides_removed,
        }


#: Denial analytics (``django_tokenbucket.analytics``) keep per-minute counts this many
#: minutes (24 hours)...
MINUTES_KEPT = 24 * 60
#: ...and the denied keys of each minute this many (the last hour).
KEY_MINUTES_KEPT = 60


@dataclass(frozen=True)
class MinuteCounts:
    """Calls of limit ``name`` in one minute: how many it let through, how many it refused.

    ``minute`` counts whole minutes since the epoch (UTC): ``int(time.time() // 60)``.
    """

    name: str
    minute: int
    allowed: int
    denied: int


@dataclass(frozen=True)
class DeniedKeyCount:
    """How many calls of one key limit ``name`` refused: in ``minute`` when written, over
    the span asked for (``minute`` then 0) when read."""

    name: str
    digest: str
    #: The key as the admin shows it, when the store keeps labels (``keeps_labels``) and
    #: the key is not a secret; "" otherwise.
    label: str
    denied: int
    minute: int = 0


_DIGEST = re.compile(r"[0-9a-f]{64}")


def checked_digests(name: str, digests: Iterable[str]) -> list[str]:
    """Return ``digests`` as a list, each checked to be a key digest (64 lowercase hex
    digits): an operator's typo is an error, never a pattern or a key of another kind."""
    found = list(digests)
    for digest in found:
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise ValueError(f"rate limit {name!r}: {digest!r} is not a key digest (64 lowercase hex digits)")
    return found


class BackendError(Exception):
    """The store failed; the limiter applies the configured fail mode.

    ``ambiguous`` is true when a write may have been applied all the same: the request
    reached the store (or may have) and its answer was lost, as when a connection dies
    during a COMMIT or while one autocommit statement runs, or a Redis reply comes
    after the socket timeout. Such a call is never run again (it could spend twice);
    its tokens count as spent.

    ``busy`` is true when the store is up but could not decide in time: it reported a
    lock it waited too long for, or the call ran out of time while the store was
    answering this process' other calls (``Answers``). ``FAIL_OPEN`` does not let such
    a call through: under a flood, that would let the flood past the limit.
    """

    def __init__(self, message: str, *, ambiguous: bool = False, busy: bool = False) -> None:
        super().__init__(message)
        self.ambiguous = ambiguous
        self.busy = busy


#: How recently the store must have answered this process for a call that then runs out
#: of time to count as a busy store rather than a dead one.
BUSY_WINDOW = 1.0


class Answers:
    """When a store last answered this process: what tells a busy store from a dead one.

    A store that misses a call's deadline after answering this process within
    ``BUSY_WINDOW`` is up and overloaded, or contended on the key: a flood's own
    doing, which ``FAIL_OPEN`` must not turn into a way past the limit (issue 35,
    item 7). One that has said nothing for longer may be down, and failing open is what
    ``FAIL_OPEN`` is for. A forked child starts with no evidence either way, and so
    takes the store for down until it answers.
    """

    __slots__ = ("__weakref__", "at")

    _every: ClassVar[weakref.WeakSet[Answers]] = weakref.WeakSet()

    def __init__(self) -> None:
        self.at = -math.inf
        Answers._every.add(self)

    def answered(self) -> None:
        self.at = time.monotonic()

    def recently(self) -> bool:
        return time.monotonic() - self.at <= BUSY_WINDOW

    @classmethod
    def forget_all(cls) -> None:
        for answers in list(cls._every):
            answers.at = -math.inf


def after_fork_in_child() -> None:
    """Start a forked child with no evidence that any store answers (``django_tokenbucket.lifecycle``)."""
    Answers.forget_all()


def row_id(request: Request) -> RowId:
    return (request.config.name, request.key.digest)


def decide_all(
    requests: Sequence[Request], states: Mapping[RowId, State | None], now: int
) -> tuple[list[Decision], dict[RowId, State]]:
    """Decide every request against locked ``states``; return decisions and what to write.

    All or nothing: either every request is allowed and the final states are written,
    or nothing is consumed. Requests on the same row see each other's consumption.
    A denied group still writes a rebased state where a clock went backwards, so that
    the lost time cannot lock anybody out.
    """
    current: dict[RowId, State | None] = dict(states)
    decisions = []
    for request in requests:
        rid = row_id(request)
        decision = request.config.decide(
            current.get(rid), now, request.count, request.key.digest, request.reserve
        )
        decisions.append(decision)
        if decision.allowed:
            current[rid] = decision.state
    if all(decision.allowed for decision in decisions):
        writes = {
            rid: state for rid, state in current.items() if state is not None and state != states.get(rid)
        }
        return decisions, writes

    # Denied: report each allowed-alone limit as it stands, untouched.
    reported = []
    writes = {}
    for request, decision in zip(requests, decisions, strict=False):
        rid = row_id(request)
        if decision.allowed:
            decision = request.config.decide(states.get(rid), now, 0, request.key.digest)
        elif decision.state is not None:
            writes[rid] = decision.state
        reported.append(decision)
    return reported, writes


class BaseBackend(ABC):
    """Stores limit state and decides under a lock (or an atomic script).

    Subclasses fetch and lock the state of every row a call touches, read the store's
    clock, run ``decide_all`` and write back what it returns, as one atomic step.
    Failures of the store are raised as ``BackendError``.

    What a backend can do beyond deciding is declared here, so that the rest of the
    package asks instead of testing for a class: ``database_alias()`` (its buckets are
    ``RateLimit`` rows there, its decisions join that database's transactions),
    ``store_now()`` (its clock), ``refund()``, and the operations that the admin and the
    command reach through ``django_tokenbucket.operations``:

    - with ``lists_buckets``: ``list_buckets()``, ``count_buckets()``, ``reset_all()``
      and ``reset_buckets()`` (by digest, whatever the limit's config is now);
    - with ``counts_cheaply``: ``stored_names()`` and ``count_by_state()``, which read
      an index rather than every bucket;
    - with ``keeps_rows``: ``rows_in_state()`` (the admin's changelist filter) and
      ``set_tokens()``;
    - with ``needs_cleanup``: ``cleanup()``, for stores whose full buckets do not
      expire by themselves;
    - with ``keeps_analytics``: ``write_analytics()``, ``read_minutes()``,
      ``read_denied_keys()`` and ``trim_analytics()`` (``django_tokenbucket.analytics``).

    Each one a backend does not offer raises NotImplementedError.
    """

    #: Its buckets can be listed page by page (``list_buckets``), counted
    #: (``count_buckets``), reset by digest (``reset_buckets``) and all reset at once
    #: (``reset_all``).
    lists_buckets: ClassVar[bool] = False
    #: It keeps a readable label beside each bucket's digest (client address, user id).
    keeps_labels: ClassVar[bool] = False
    #: Counting its buckets (``stored_names``, ``count_by_state``) reads an index;
    #: otherwise it walks the whole store, which the admin does not do on a page view.
    counts_cheaply: ClassVar[bool] = False
    #: Its buckets are ``RateLimit`` rows of ``database_alias()``: the admin's changelist
    #: lists them, filters them by state (``rows_in_state``) and sets their tokens
    #: (``set_tokens``).
    keeps_rows: ClassVar[bool] = False
    #: Full buckets stay stored until ``cleanup()`` deletes them.
    needs_cleanup: ClassVar[bool] = False
    #: It stores denial analytics (``write_analytics``, ``read_minutes``,
    #: ``read_denied_keys``, ``trim_analytics``): see ``django_tokenbucket.analytics``.
    keeps_analytics: ClassVar[bool] = False

    #: The OPTIONS this backend takes; others are an error (``check_options``). None
    #: leaves them unchecked, for a backend that does not say.
    option_names: ClassVar[frozenset[str] | None] = None
    #: The system check of an unknown option.
    unknown_option_check: ClassVar[Check] = catalogue.E013
    #: Whether ``adecide``/``areset``/``arefund`` run on the event loop (an asyncio
    #: client) rather than the blocking methods in a worker thread (the default here).
    asyncio_native: ClassVar[bool] = False

    def __init__(self, options: Mapping[str, Any], *, setting: str = "TOKENBUCKET") -> None:
        self.options = dict(options)
        #: Where this backend is configured, for messages: ``TOKENBUCKET`` (its BACKEND
        #: and OPTIONS) or ``TOKENBUCKET['BACKENDS']['<alias>']``.
        self.setting = setting

    @classmethod
    def check_options(cls, options: Mapping[str, Any], setting: str) -> list[Any]:
        """Return system-check messages about ``options`` (given at ``setting``).

        Subclasses extend it with their own checks; this one reports unknown options.
        """
        if cls.option_names is None:
            return []
        unknown = sorted(map(repr, set(options) - cls.option_names))
        if not unknown:
            return []
        known = ", ".join(map(repr, sorted(cls.option_names)))
        return [cls.unknown_option_check(setting=setting, backend=cls.__name__, names=", ".join(unknown), known=known)]

    def database_alias(self) -> str | None:
        """Return the database whose ``RateLimit`` rows hold this backend's buckets, if any.

        Such a backend's decisions join that database's transactions; the admin, the
        command's listings and cleanup read its rows.
        """
        return None

    def store_now(self) -> int:
        """Return the store's clock, in microseconds since the epoch."""
        raise NotImplementedError(f"{type(self).__name__} does not say what time its store has")

    def list_buckets(
        self, config: LimitConfig, *, cursor: str | None = None, page_size: int = 100, digest_prefix: str = ""
    ) -> BucketPage:
        """Return a page of ``config``'s stored buckets, from ``cursor`` (None: the first page).

        ``digest_prefix`` (lowercase hex) keeps the buckets whose digest starts with it.
        Each page reads a bounded part of the store; a bucket written or deleted while
        the pages are read may be missed or listed twice (never one present throughout).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list its buckets")

    def count_buckets(self, configs: Sequence[LimitConfig]) -> dict[str, int]:
        """Return how many buckets are stored, by limit name, for each of ``configs``."""
        raise NotImplementedError(f"{type(self).__name__} cannot count its buckets")

    def reset_all(self, config: LimitConfig, *, batch_size: int = 1000) -> int:
        """Forget every stored bucket of ``config`` (its shards too), in batches; return how many."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset every key of a limit")

    def reset_buckets(self, name: str, digests: Sequence[str]) -> int:
        """Forget the stored buckets of limit ``name`` with these key digests; return how many were stored.

        By name, not config: the buckets of a limit no longer configured can go too.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot reset keys by digest")

    def stored_names(self) -> dict[str, int]:
        """Return how many buckets are stored under each limit name, configured or not."""
        raise NotImplementedError(f"{type(self).__name__} cannot count its buckets by name cheaply")

    def count_by_state(
        self, configs: Iterable[LimitConfig], now: int, *, only: Sequence[str] | None = None, partial: bool = True
    ) -> dict[str, dict[str, int]]:
        """Return, per stored limit name (of ``only``, when given), the buckets ``stored``
        and how many are ``limited`` at store time ``now``; with ``partial``, also
        ``partial`` and ``full`` for the limits in ``configs`` (see ``live.STATES``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot count its buckets by state cheaply")

    def rows_in_state(self, rows: Any, configs: Iterable[LimitConfig], state: str, now: int) -> Any:
        """Return the ``RateLimit`` queryset ``rows`` narrowed to those in ``state`` at ``now``."""
        raise NotImplementedError(f"{type(self).__name__} keeps no RateLimit rows")

    def set_tokens(self, config: LimitConfig, digest: str, value: int) -> tuple[int, int] | None:
        """Make the stored bucket ``digest`` hold ``value`` micro-tokens from now on
        (at most the capacity), under its lock at store time.

        Returns its value before and after, or None when no bucket is stored there.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot set a key's tokens")

    def cleanup(self, limits: Mapping[str, LimitConfig], **options: Any) -> CleanupReport:
        """Delete stored buckets that read as fresh ones (full); see ``django_tokenbucket.cleanup``."""
        raise NotImplementedError(f"{type(self).__name__}'s keys expire by themselves; nothing to clean up")

    def write_analytics(self, minutes: Sequence[MinuteCounts], keys: Sequence[DeniedKeyCount]) -> None:
        """Add these counts to the stored ones (summing with other processes'), as one
        write to the store: one transaction, or one pipeline.

        Counts older than ``MINUTES_KEPT`` (``KEY_MINUTES_KEPT`` for keys) may be
        dropped. Raises BackendError when the store fails.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no analytics")

    def read_minutes(self, names: Sequence[str], since: int, until: int) -> list[MinuteCounts]:
        """Return the stored counts of ``names`` for the minutes ``since`` <= m < ``until``,
        summed over every process, ordered by name then minute; minutes with no call are left out."""
        raise NotImplementedError(f"{type(self).__name__} keeps no analytics")

    def read_denied_keys(self, name: str, since: int, until: int, limit: int) -> list[DeniedKeyCount]:
        """Return the ``limit`` keys of ``name`` most denied in the minutes ``since`` <= m <
        ``until``, their counts summed over those minutes and every process, most denied
        first (ties by digest)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no analytics")

    def trim_analytics(self, now_minute: int) -> int:
        """Delete counts older than ``MINUTES_KEPT`` (keys: ``KEY_MINUTES_KEPT``) minutes
        before ``now_minute``; return how many records went (0 where they expire by themselves)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no analytics")

    @abstractmethod
    def decide(self, requests: Sequence[Request], *, apply: bool) -> Outcome:
        """Decide ``requests`` all-or-nothing; consume only when ``apply`` is true."""

    @abstractmethod
    def reset(self, config: LimitConfig, key: EncodedKey) -> None:
        """Forget the state of one key, so that it reads as fresh (full)."""

    # The asyncio twins. These run the blocking method in a worker thread (Django's
    # thread-sensitive executor, where a database connection belongs); a backend with
    # an asyncio client overrides them.

    async def adecide(self, requests: Sequence[Request], *, apply: bool) -> Outcome:
        """``decide()`` for async code."""
        return await sync_to_async(self.decide)(requests, apply=apply)

    async def areset(self, config: LimitConfig, key: EncodedKey) -> None:
        """``reset()`` for async code."""
        await sync_to_async(self.reset)(config, key)

    async def arefund(self, config: LimitConfig, key: EncodedKey, amount: int) -> Outcome:
        """``refund()`` for async code."""
        return await sync_to_async(self.refund)(config, key, amount)

    def refund(self, config: LimitConfig, key: EncodedKey, amount: int) -> Outcome:
        """Give ``amount`` micro-tokens back to one key, capped at the capacity.

        Returns the state after the refund as the decision of a zero-token call. Backends
        that cannot return tokens raise NotImplementedError (the default).
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot return tokens (refund); the database backend can"
        )


class RecentDenials:
    """Which keys this process saw denied lately, to pick how their next decision goes.

    A decision on a key likely denied reads the bucket and the store's clock first, and
    decides a denial from that read alone; any other decides in the store's single
    atomic step (PostgreSQL's function, Redis' script), which admits in one round trip
    where reading first would cost two. A key is remembered from an outcome that leaves it
    short of one more call of the same count, until the time that call would be allowed
    (measured on this process' monotonic clock: a guess, not the store's time), and
    forgotten when it admits with room to spare. Bounded: past ``size`` keys, the one
    remembered first is forgotten (a key denied again keeps its place).

    Exactness never depends on it: both paths decide alike (tests/test_pg_fast_path.py,
    tests/test_redis.py), and a wrong guess costs only a round trip.
    """

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._until: dict[tuple[str, str, str], float] = {}
        self._lock = threading.Lock()

    def forget(self, alias: str, name: str, digest: str) -> None:
        """Forget one key: its next decision goes straight to the store's atomic step."""
        with self._lock:
            self._until.pop((alias, name, digest), None)

    def likely(self, alias: str, request: Request) -> bool:
        """Whether ``request`` is likely denied, as far as this process has seen."""
        until = self._until.get((alias, request.config.name, request.key.digest))
        return until is not None and until > time.monotonic()

    def learn(self, alias: str, request: Request, decision: Decision) -> None:
        """Remember, or forget, ``request``'s key from the decision just made."""
        key = (alias, request.config.name, request.key.digest)
        count = request.count
        if decision.allowed and decision.value >= count:
            if key in self._until:
                with self._lock:
                    self._until.pop(key, None)
            return
        config = request.config
        if decision.allowed or decision.retry_after is None:
            short = count - decision.value
            wait = config.algorithm.refill_time(short, config.rate, config.period) if short > 0 else 0
        else:
            wait = decision.retry_after
        if wait <= 0:
            return
        if key in self._until:
            # Denied again, as a hot key is on every call: its time moves on where it
            # stands, one store in the dict; an eviction racing it may let it stay (one
            # key over the bound for a moment, a hint either way).
            self._until[key] = time.monotonic() + min(wait, _LONGEST_MEMORY) / 1e6
            return
        with self._lock:
            self._until.pop(key, None)
            while self._until and len(self._until) >= self.size:
                del self._until[next(iter(self._until))]
            self._until[key] = time.monotonic() + min(wait, _LONGEST_MEMORY) / 1e6


#: The longest a denial is remembered (µs): a bucket emptied for hours is still picked
#: up again by a later denial.
_LONGEST_MEMORY = 3600 * 10**6


def timeout_option(value: Any, setting: str = "TOKENBUCKET") -> float | None:
    """Validate the ``TIMEOUT`` option: ``None`` or a positive, finite number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{setting}['OPTIONS']['TIMEOUT'] must be None or a positive number of seconds, not {value!r}."
        )
    return float(value)
