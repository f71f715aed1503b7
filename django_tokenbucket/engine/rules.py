"""A key's override as it applies to a call: the numbers in force, or a decision without the store.

``in_force`` is the one place the engine looks an override up; the drivers' callers have
refreshed the snapshot (``overrides.refresh_if_due``).
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from .. import overrides
from ..limits import LimitConfig
from ..logs import throttled_logger
from ..overrides import Override

__all__ = ["LOOK_UP", "Outsized", "count_in_force", "in_force", "settles"]

#: Passed as a decision's ``rule`` for "look the key's override up" (the default), as
#: opposed to one the caller already applied (``acquire``) or None.
LOOK_UP = Override("", "", "")


class Outsized:
    """A call whose count a ``limit`` override makes larger than any call it admits."""

    __slots__ = ("rule",)

    def __init__(self, rule: Override) -> None:
        self.rule = rule


def in_force(limit: LimitConfig, digest: str) -> tuple[LimitConfig, Override | None]:
    """Return ``limit`` as the override of key ``digest`` changes it, and that override.

    A stored override whose numbers no longer fit the limit (its shards changed in
    LIMITS since) is ignored, with a warning, rather than fail every call.
    """
    rule = overrides.lookup(limit.name, digest)
    # The common case, no override of this limit, costs the lookup only.
    if rule is None or rule.action != overrides.LIMIT:
        return limit, rule
    try:
        return rule.config(limit), rule
    except ImproperlyConfigured as exc:
        throttled_logger.warning(
            limit.name, "rate limit %r: an override no longer fits it, ignored: %s", limit.name, exc
        )
        return limit, None


def count_in_force(base: LimitConfig, limit: LimitConfig, count: object, reserve: bool) -> tuple[int, bool]:
    """Return ``count`` in micro-tokens, and whether ``limit`` (``base`` as an override
    changes it) can ever admit it.

    Checked against the numbers in force: an override may raise the capacity above a
    count the limit itself could never admit. A count that only an override makes too
    large is no mistake of the caller's — an operator lowered the capacity under a view's
    ``count=5`` — so the call is refused, spending nothing, until the override ends
    (False), rather than raised as an error on every request of that key. ValueError
    naming the limit for a count that the limit's own numbers refuse too.
    """
    try:
        return limit.validate_count(count, reserve), True
    except ValueError:
        if limit is base:
            raise
        return base.validate_count(count, reserve), False


def settles(rule: Override | Outsized | None) -> bool:
    """Whether an override decides a call without the store: an exemption, a block, or a
    ``limit`` override too small for the call's count."""
    return isinstance(rule, Outsized) or (rule is not None and rule.action != overrides.LIMIT)
