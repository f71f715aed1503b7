"""The Status of each way a limit's part of a call ends: decided by the store, recalled
from memory, failed open, settled by an override, or left undecided."""

from __future__ import annotations

from ..algorithms import MICRO, Decision
from ..limits import LimitConfig
from ..overrides import BLOCK, Override
from ..status import Status

__all__ = ["decided", "failed_open", "overridden", "undecided"]


def decided(
    limit: LimitConfig,
    key: object,
    count: int,
    decision: Decision,
    now: int,
    cached: bool = False,
    override: str | None = None,
) -> Status:
    """The Status of ``decision`` on ``count`` micro-tokens at store time ``now`` (``cached``: from memory)."""
    shadow = limit.shadow
    # Positional: every decision makes one, and matching 15 keywords costs more than
    # the rest of the call.
    return Status._decided(
        decision.allowed or shadow,
        limit.name,
        key,
        count / MICRO,
        decision.value / MICRO,
        None if decision.retry_after is None else decision.retry_after / MICRO,
        decision.full_after / MICRO,
        limit.capacity / MICRO,
        limit.rate / MICRO,
        limit.period / MICRO,
        now / MICRO,
        shadow,
        shadow and not decision.allowed,
        cached,
        override,
    )


def undecided(limit: LimitConfig, key: object, tokens: float, *, failed_open: bool = False) -> Status:
    """The Status of a limit whose store did not decide: a call denied from memory did
    not ask it (it took nothing), or it failed open; what it holds is unknown."""
    return Status(
        ok=True,
        name=limit.name,
        key=key,
        count=tokens,
        value=None,
        retry_after=None,
        reset_after=None,
        capacity=limit.capacity_tokens,
        rate=limit.rate_tokens,
        period=limit.period_seconds,
        timestamp=None,
        failed_open=failed_open,
        shadow=limit.shadow,
    )


def failed_open(limit: LimitConfig, key: object, count: int | float) -> Status:
    """The Status of a limit whose store failed and ``FAIL_OPEN`` let the call through."""
    return undecided(limit, key, float(count), failed_open=True)


def overridden(
    limit: LimitConfig, key: object, micro: int, rule: Override, now: int, *, refused: bool = False
) -> Status:
    """The Status of a call an exemption let through or a block refused, the store unasked;
    ``refused``: a call more than a ``limit`` override can ever admit, refused until it ends.

    A block on a shadow limit refuses nothing, as the limit itself would not.
    """
    blocked = refused or rule.action == BLOCK
    return Status(
        ok=not blocked or limit.shadow,
        name=limit.name,
        key=key,
        count=micro / MICRO,
        value=None,
        retry_after=rule.wait(now) if blocked else None,
        reset_after=None,
        capacity=limit.capacity_tokens,
        rate=limit.rate_tokens,
        period=limit.period_seconds,
        timestamp=now / MICRO,
        shadow=limit.shadow,
        would_deny=blocked and limit.shadow,
        override=rule.action,
    )
