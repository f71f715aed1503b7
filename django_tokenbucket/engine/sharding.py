"""A call on a sharded limit: which shards it reads and takes from, and its one decision."""

from __future__ import annotations

from collections.abc import Sequence

from ..algorithms import Decision
from ..backends.base import Outcome, Request
from ..keys import EncodedKey
from ..limits import LimitConfig
from ..shards import pick_two, shard_configs, shard_key, split
from .steps import Decide, Steps

__all__ = ["plan_shards", "read_shards", "shard_request", "sharded_decision"]


def shard_request(request: Request, index: int, count: int) -> Request:
    """Return ``request`` moved to shard ``index`` of its limit, for ``count`` micro-tokens."""
    shards = request.config.shards
    return Request(shard_configs(request.config)[index], shard_key(request.key, index, shards), count, request.reserve)


def sharded_decision(limit: LimitConfig, parts: Sequence[Decision], untouched: int) -> Decision:
    """Return one decision for a call on a sharded limit, from those of its parts.

    The value is an estimate, the two shards read scaled to all of them; the waits are
    the longest of the parts', which must all succeed together.
    """
    allowed = all(part.allowed for part in parts)
    # Allowed: a reservation's wait, if any. Denied: the wait of the parts that were.
    waits = [part.retry_after for part in parts if part.retry_after is not None and (allowed or not part.allowed)]
    retry_after = max(waits, default=None)
    value = (sum(part.value for part in parts) + untouched) * limit.shards // 2
    return Decision(allowed, value, retry_after, max(part.full_after for part in parts), None)


def read_shards(limit: LimitConfig, encoded: EncodedKey) -> Steps[Outcome]:
    """Read every shard of ``limit`` for ``encoded``, changing nothing; a failed store is an error."""
    request = Request(limit, encoded, 0)
    reads = [shard_request(request, index, 0) for index in range(limit.shards)]
    outcome = yield Decide(limit, reads, apply=False, fail_open=False)
    assert outcome is not None
    return outcome  # type: ignore[no-any-return]


def plan_shards(requests: list[Request]) -> Steps[list[tuple[list[Request], int]] | None]:
    """Return the parts to run for each request on a sharded limit, and what its other
    shard read; None when that read failed and FAIL_OPEN allows.

    Each request reads two random shards (one backend call for all of them, changing
    nothing) and becomes the parts that ``shards.split`` plans; ``untouched`` is then
    the value of the shard read but not taken from (0 when both are), for the status's
    estimate.
    """
    picks = [pick_two(request.config.shards) for request in requests]
    probes = [shard_request(request, index, 0) for request, pick in zip(requests, picks) for index in pick]
    outcome = yield Decide(requests[0].config, probes, apply=False)
    if outcome is None:
        return None
    planned = []
    for n, (request, (first, second)) in enumerate(zip(requests, picks)):
        values = {first: outcome.decisions[2 * n].value, second: outcome.decisions[2 * n + 1].value}
        plan = split(request.count, request.reserve, (first, values[first]), (second, values[second]))
        untouched = sum(value for index, value in values.items() if index not in dict(plan))
        planned.append(([shard_request(request, index, amount) for index, amount in plan], untouched))
    return planned
