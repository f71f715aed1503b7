"""Limit definitions: validated once, held as exact integers."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from fractions import Fraction
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from .algorithms import (
    ALGORITHMS,
    FIXED_WINDOW,
    MAX_AMOUNT,
    MICRO,
    TOKEN_BUCKET,
    Algorithm,
    Decision,
    State,
    algorithm_named,
)
from .rates import parse_period, parse_rate, shown, to_fraction

__all__ = ["FIXED_WINDOW", "MAX_SHARDS", "TOKEN_BUCKET", "LimitConfig", "count_to_micro", "parse_limit", "to_micro"]

_KNOWN_KEYS = {
    "kind",
    "rate",
    "period",
    "capacity",
    "max_reserved",
    "start",
    "shadow",
    "shards",
    "backend",
    "deny_cache",
}
#: The alias of the backend a limit is stored on when it names none.
DEFAULT_BACKEND_ALIAS = "default"
#: More shards than this spread a limit thinner than any deployment needs.
MAX_SHARDS = 1024
#: Periods are whole microseconds and must fit the integer arithmetic comfortably.
_MAX_PERIOD_US = 2**53
MAX_NAME_LENGTH = 200


def to_micro(amount: Fraction, what: str, given: object) -> int:
    """Return ``amount`` tokens as micro-tokens, or raise ValueError naming ``what``.

    ``given`` is the value as the user wrote it, quoted in the message.
    """
    micro = amount * MICRO
    if micro.denominator != 1:
        raise ValueError(f"{what} must have at most 6 decimal places, not {shown(given)}")
    if abs(micro) > MAX_AMOUNT:
        raise ValueError(f"{what} must be at most {MAX_AMOUNT // MICRO:,} tokens, not {shown(given)}")
    return int(micro)


@dataclass(frozen=True)
class LimitConfig:
    """One limit, normalised: amounts in micro-tokens, times in microseconds."""

    name: str
    kind: str
    rate: int
    period: int
    capacity: int
    max_reserved: int | None = None
    start: int | None = None
    #: Evaluate and report, never block: for rolling out a new limit safely.
    shadow: bool = False
    #: Spread over this many buckets, for a hot limit (``django_tokenbucket.shards``).
    shards: int = 1
    #: The alias in ``TOKENBUCKET["BACKENDS"]`` of the store that holds this limit.
    backend: str = DEFAULT_BACKEND_ALIAS
    #: Whether this process may answer a key known to be denied from memory
    #: (``django_tokenbucket.deny_cache``); False for a limit whose resets must be seen
    #: by every process at once.
    deny_cache: bool = True

    @property
    def period_seconds(self) -> float:
        return self.period / MICRO

    @property
    def rate_tokens(self) -> float:
        return self.rate / MICRO

    @property
    def capacity_tokens(self) -> float:
        return self.capacity / MICRO

    @property
    def max_count(self) -> int | None:
        """Return the largest count (micro-tokens) that can ever succeed with a reservation.

        A sharded limit reserves from one shard.
        """
        if self.max_reserved is None:
            return None
        return (self.capacity + self.max_reserved) // self.shards

    @property
    def max_plain_count(self) -> int:
        """Return the largest count (micro-tokens) that can ever succeed without a reservation.

        A sharded limit takes from two shards at most.
        """
        return self.capacity if self.shards == 1 else 2 * self.capacity // self.shards

    def window_offset(self, key_digest: str) -> int:
        """Return where this key's windows start, in microseconds modulo the period.

        A per-key offset spreads the moments when windows reopen, so clients that were
        all denied do not come back at the same instant.
        """
        if self.start is not None:
            return self.start % self.period
        digest = hashlib.sha256(f"{self.name}\x00{key_digest}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.period

    @property
    def algorithm(self) -> Algorithm:
        """Return the arithmetic of this limit's kind."""
        return ALGORITHMS[self.kind]

    def _offset(self, algorithm: Algorithm, key_digest: str) -> int:
        # Only phased kinds need it, and it costs a SHA-256 per call.
        return self.window_offset(key_digest) if algorithm.phased else 0

    def fresh_state(self, key_digest: str) -> State:
        """Return the state of this limit for a key nobody has used."""
        algorithm = ALGORITHMS[self.kind]
        return algorithm.fresh(self.capacity, self.period, self._offset(algorithm, key_digest))

    def decide(
        self,
        state: State | None,
        now: int,
        count: int,
        key_digest: str,
        reserve: bool = False,
    ) -> Decision:
        """Run this limit's algorithm on ``state`` (None: a fresh key) at ``now``."""
        algorithm = ALGORITHMS[self.kind]
        offset = self._offset(algorithm, key_digest)
        if state is None:
            state = algorithm.fresh(self.capacity, self.period, offset)
        return algorithm.decide(
            state,
            now,
            count,
            rate=self.rate,
            period=self.period,
            capacity=self.capacity,
            offset=offset,
            reserve=reserve,
            max_reserved=self.max_reserved,
        )

    def reserving_within(self, wait: int) -> LimitConfig:
        """Return this limit with ``max_reserved`` lowered so that a reservation waits at
        most ``wait`` microseconds for its tokens (``limiter.acquire``'s ``timeout``).

        A debt is paid within the time its refill takes from zero (``refill_time``); a
        fixed window's is counted from the start of the current window, so a wait that
        would end within ``wait`` by less than one window may be refused.
        """
        refill_time = self.algorithm.refill_time
        # The largest debt repaid within ``wait``: refill_time is monotone in the amount.
        low, high = 0, max(self.rate, (wait + 1) * self.rate // self.period + self.rate)
        while low < high:
            middle = (low + high + 1) // 2
            if refill_time(middle, self.rate, self.period) <= wait:
                low = middle
            else:
                high = middle - 1
        # Each shard holds an equal share of the debt.
        bound = low - low % self.shards
        if self.max_reserved is not None and self.max_reserved <= bound:
            return self
        return replace(self, max_reserved=bound)

    def refund(self, state: State | None, now: int, amount: int, key_digest: str) -> State:
        """Return ``state`` once ``amount`` micro-tokens are given back at ``now`` (capped at capacity)."""
        algorithm = ALGORITHMS[self.kind]
        offset = self._offset(algorithm, key_digest)
        if state is None:
            state = algorithm.fresh(self.capacity, self.period, offset)
        return algorithm.refund(
            state, now, amount, rate=self.rate, period=self.period, capacity=self.capacity, offset=offset
        )

    def validate_count(self, count: object, reserve: bool) -> int:
        """Return ``count`` in micro-tokens, or raise ValueError naming this limit."""
        if type(count) is int and 0 < count <= MAX_AMOUNT // MICRO:
            # The common case (count=1 on every request) without the cost of a Fraction.
            micro = count * MICRO
        else:
            try:
                micro = count_to_micro(count)
            except ValueError as exc:
                raise ValueError(f"rate limit {self.name!r}: {exc}") from None
        if not reserve and micro > self.max_plain_count:
            if self.shards > 1:
                raise ValueError(
                    f"rate limit {self.name!r}: count {shown(count)} exceeds what two of its "
                    f"{self.shards} shards hold ({self.max_plain_count / MICRO:g}) and could never "
                    f"succeed; use fewer shards or raise the capacity"
                )
            raise ValueError(
                f"rate limit {self.name!r}: count {shown(count)} exceeds the capacity "
                f"{self.capacity_tokens:g} and could never succeed; pass reserve=True "
                f"to reserve tokens ahead, or raise the capacity"
            )
        if reserve and self.max_count is not None and micro > self.max_count:
            raise ValueError(
                f"rate limit {self.name!r}: count {shown(count)} exceeds capacity + "
                f"max_reserved ({self.max_count / MICRO:g}) and could never succeed"
            )
        return micro


def count_to_micro(count: object) -> int:
    """Return a count of tokens (taken, refunded) in micro-tokens; ValueError unless positive and exact."""
    amount = to_fraction(count, "count")
    if amount <= 0:
        raise ValueError(f"count must be positive, not {shown(count)}")
    return to_micro(amount, "count", count)


def parse_limit(name: object, spec: object) -> LimitConfig:
    """Validate one entry of ``TOKENBUCKET["LIMITS"]`` (or an inline ``config=``).

    Raises ImproperlyConfigured with a message that names the limit and quotes the
    offending value.
    """
    if not isinstance(name, str) or not name or name != name.strip() or not name.isprintable():
        raise ImproperlyConfigured(
            f"rate limit name {shown(name)} must be a non-empty printable string without "
            f"leading or trailing spaces"
        )
    if len(name) > MAX_NAME_LENGTH:
        raise ImproperlyConfigured(
            f"rate limit name {name[:40]!r}... is longer than {MAX_NAME_LENGTH} characters"
        )
    try:
        return _parse_spec(name, spec)
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(f"rate limit {name!r}: {exc}") from None


def _parse_spec(name: str, spec: object) -> LimitConfig:
    if isinstance(spec, str):
        spec = {"rate": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"expected a dict such as {{'rate': '10/m'}} or a rate string, not {shown(spec)}")
    unknown = set(spec) - _KNOWN_KEYS
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(sorted(map(shown, unknown))[:10])}; "
            f"expected some of {', '.join(sorted(_KNOWN_KEYS))}"
        )
    kind_given = spec.get("kind", TOKEN_BUCKET)
    algorithm = algorithm_named(kind_given) if isinstance(kind_given, str) else None
    if algorithm is None:
        kinds = " or ".join(map(repr, ALGORITHMS))
        raise ValueError(f"kind must be {kinds}, not {shown(kind_given)}")
    kind = algorithm.name

    if "rate" not in spec:
        raise ValueError("'rate' is required (e.g. 'rate': '10/m', or 'rate': 10 with 'period': 60)")
    rate_given = spec["rate"]
    if isinstance(rate_given, str):
        if "period" in spec:
            raise ValueError(
                f"give the period either in the rate string {shown(rate_given)} or as 'period', not both"
            )
        tokens, period_s = parse_rate(rate_given)
    else:
        tokens = to_fraction(rate_given, "rate")
        if "period" not in spec:
            raise ValueError(f"a numeric rate {shown(rate_given)} needs 'period' (seconds or a timedelta)")
        period_s = parse_period(spec["period"])
    if tokens <= 0:
        raise ValueError(f"rate must be positive, not {rate_given!r}")

    period_us = period_s * MICRO
    if period_us.denominator != 1 or period_us > _MAX_PERIOD_US:
        raise ValueError(
            f"period must be a whole number of microseconds up to {_MAX_PERIOD_US // MICRO} "
            f"seconds, not {float(period_s)!r} seconds"
        )
    rate = to_micro(tokens, "rate", rate_given)

    capacity = rate
    if spec.get("capacity") is not None:
        capacity_tokens = to_fraction(spec["capacity"], "capacity")
        if capacity_tokens <= 0:
            raise ValueError(f"capacity must be positive, not {spec['capacity']!r}")
        capacity = to_micro(capacity_tokens, "capacity", spec["capacity"])

    max_reserved = None
    if spec.get("max_reserved") is not None:
        reserved_tokens = to_fraction(spec["max_reserved"], "max_reserved")
        if reserved_tokens < 0:
            raise ValueError(f"max_reserved must not be negative, not {spec['max_reserved']!r}")
        max_reserved = to_micro(reserved_tokens, "max_reserved", spec["max_reserved"])

    start = None
    if spec.get("start") is not None:
        if not algorithm.phased:
            phased = " and ".join(repr(a.name) for a in ALGORITHMS.values() if a.phased)
            raise ValueError(f"'start' applies to kinds with windows ({phased}) only, not {kind!r}")
        start_given = spec["start"]
        if isinstance(start_given, timedelta):
            start_s = Fraction(start_given // timedelta(microseconds=1), MICRO)
        else:
            start_s = to_fraction(start_given, "start")
        start_us = start_s * MICRO
        if start_us.denominator != 1:
            raise ValueError(f"start must be a whole number of microseconds, not {start_given!r}")
        start = int(start_us)

    shadow = spec.get("shadow", False)
    if not isinstance(shadow, bool):
        raise ValueError(f"shadow must be True or False, not {shown(shadow)}")

    shards = spec.get("shards", 1)
    if type(shards) is not int or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be a whole number from 1 to {MAX_SHARDS}, not {shown(shards)}")
    # Equal shards: every row of the limit reads under one config (the admin, cleanup).
    uneven = [
        what
        for what, amount in (("rate", rate), ("capacity", capacity), ("max_reserved", max_reserved or 0))
        if amount % shards
    ]
    if uneven:
        raise ValueError(
            f"{' and '.join(uneven)} must split into {shards} equal shards to the micro-token "
            f"(a millionth of a token); choose a number of shards that divides them"
        )

    deny_cache = spec.get("deny_cache", True)
    if not isinstance(deny_cache, bool):
        raise ValueError(f"deny_cache must be True or False, not {shown(deny_cache)}")

    backend = spec.get("backend", DEFAULT_BACKEND_ALIAS)
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be an alias in TOKENBUCKET['BACKENDS'] (a str), not {shown(backend)}")

    return LimitConfig(
        name=name,
        backend=backend,
        shadow=shadow,
        kind=kind,
        rate=rate,
        period=int(period_us),
        capacity=capacity,
        max_reserved=max_reserved,
        start=start,
        shards=shards,
        deny_cache=deny_cache,
    )


def freeze(spec: Any) -> Any:
    """Return a hashable form of an inline config, for caching its parsed form."""
    if isinstance(spec, Mapping):
        return tuple(sorted((str(k), freeze(v)) for k, v in spec.items()))
    if isinstance(spec, (list, tuple)):
        return tuple(freeze(v) for v in spec)
    return (type(spec).__name__, spec)
