"""The decision pipeline, written once: rule → recall → store → learn → status → report.

Every decision goes through it, one limit or several, sharded or not, from either
driver:

- ``begin`` (``begin_one`` for a single limit) resolves each limit and applies its key's
  override (**rule**: ``rules.in_force``), settles what an override decides without
  the store, and asks the deny cache (**recall**);
- ``store`` is the plan of store steps a driver answers (``steps.drive``, ``adrive``):
  the shards' probe, then the enforced limits, then the shadowed ones, each group one
  backend call, all-or-nothing; a call of one unsharded limit asks its one step
  (``one_step``, answered by ``steps.answer``) and takes the answer (``answered``)
  without a plan;
- ``finish`` tells the deny cache what the store said (**learn**), makes the statuses
  (**status**) and, for a call that applies, counts, logs and signals them (**report**).

A call settled before the store (an override, a recalled denial) builds no plan: the
generator and its driver would cost as much as the rest of a recalled denial.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from django.core.exceptions import ImproperlyConfigured

from .. import clock, deny_cache
from ..algorithms import MICRO, Decision
from ..backends.base import Outcome, Request
from ..keys import encode_key
from ..limits import LimitConfig
from ..overrides import Override
from ..status import Status
from . import report, statuses
from .names import ConfigSpec, encode_for, resolve
from .rules import LOOK_UP, Outsized, count_in_force, in_force, settles
from .sharding import plan_shards, sharded_decision
from .steps import Decide, Steps
from .stores import Stores

__all__ = ["Asked", "Call", "answered", "begin", "begin_one", "finish", "one_backend", "one_step", "store"]


class Asked(Protocol):
    """One limit asked of a call (``LimitRequest``)."""

    @property
    def name(self) -> str: ...

    @property
    def key(self) -> object: ...

    @property
    def count(self) -> int | float: ...

    @property
    def reserve(self) -> bool: ...

    @property
    def config(self) -> ConfigSpec | LimitConfig | None: ...


class Item:
    """One limit of a call, as it goes through the pipeline."""

    __slots__ = (
        "count",
        "decision",
        "key",
        "limit",
        "now",
        "override",
        "parts",
        "request",
        "rule",
        "status",
        "untouched",
    )

    def __init__(
        self,
        key: object,
        count: int | float,
        request: Request,
        rule: Override | Outsized | None,
        override: str | None = None,
    ) -> None:
        self.key = key
        #: As asked: what a failed-open Status reports.
        self.count = count
        #: The limit as the key's override changes it (``request.config``).
        self.limit: LimitConfig = request.config
        self.request = request
        self.rule = rule
        #: The ``override`` its Status reports: the action of the override decided under.
        self.override = override
        #: Set once known: settled by an override, recalled, undecided, failed open, or
        #: (``finish``) made from the store's decision.
        self.status: Status | None = None
        self.decision: Decision | None = None
        self.now = 0
        #: On a sharded limit: the shards' requests it is decided as (``store``), and
        #: the value of the shard read but not taken from.
        self.parts: list[Request] | None = None
        self.untouched = 0


class Call:
    """One decision of one or several limits, all-or-nothing."""

    __slots__ = ("apply", "before", "items", "overridden", "pending", "stores")

    def __init__(self, stores: Stores, apply: bool) -> None:
        self.stores = stores
        self.apply = apply
        self.items: list[Item] = []
        #: Whether an override decides one of its limits without the store (``settles``).
        self.overridden = False
        #: Whether the store is to be asked (``store``).
        self.pending = True
        #: ``deny_cache.now()`` read before the enforced limits' store call, for ``learn``;
        #: None with the cache off (nothing to learn: turning it on again clears it).
        self.before: tuple[bool, int, int] | None = None


# -- rule, recall ----------------------------------------------------------------------


def begin(stores: Stores, asked: Sequence[Asked], *, apply: bool, rules: Sequence[Override | None] | None) -> Call:
    """Start deciding ``asked`` all-or-nothing (``rules``: their overrides, when the
    caller applied them already)."""
    if not asked:
        raise ValueError("no rate limits given")
    call = Call(stores, apply)
    for n, item in enumerate(asked):
        if item.reserve is not True and item.reserve is not False:
            _check_reserve(item.name, item.reserve)
        rule = LOOK_UP if rules is None else rules[n]
        _ask(call, resolve(item.name, item.config), item.key, item.count, item.reserve, rule)
    if stores.own is None and len(call.items) > 1:
        one_backend([item.limit for item in call.items])
    if call.overridden:
        _settle(call)
    if call.pending:
        _recall(call)
    return call


def begin_one(
    stores: Stores,
    name: str,
    key: object,
    count: int | float,
    reserve: bool,
    config: ConfigSpec | LimitConfig | None,
    *,
    apply: bool,
    rule: Override | None,
) -> Call:
    """``begin`` for one limit, without the sequence of several: every request's call."""
    if reserve is not True and reserve is not False:
        _check_reserve(name, reserve)
    call = Call(stores, apply)
    _ask(call, resolve(name, config), key, count, reserve, rule)
    if call.overridden:
        _settle(call)
    if call.pending:
        _recall(call)
    return call


def _check_reserve(name: str, reserve: object) -> None:
    if not isinstance(reserve, bool):
        raise ValueError(f"rate limit {name!r}: reserve must be a bool, not {reserve!r}")


def _ask(call: Call, limit: LimitConfig, key: object, count: int | float, reserve: bool, rule: Override | None) -> None:
    """Add one limit to ``call``: its request on the numbers in force under the key's
    override (**rule**; ``rule``: one the caller applied already, or ``LOOK_UP``), or
    ``Outsized`` when its count is more than the override can ever admit
    (``count_in_force``)."""
    try:
        encoded = encode_key(key)
    except TypeError:
        encoded = encode_for(limit, key)  # raises what names the limit
    base = limit
    if rule is LOOK_UP:
        limit, rule = in_force(limit, encoded.digest)
    if rule is None:
        # The common case, no override of this limit: the lookup only.
        call.items.append(
            Item(key, count, Request(limit, encoded, limit.validate_count(count, reserve), reserve), None)
        )
        return
    micro, fits = count_in_force(base, limit, count, reserve)
    ruling = rule if fits else Outsized(rule)
    call.overridden = call.overridden or settles(ruling)
    call.items.append(Item(key, count, Request(limit, encoded, micro, reserve), ruling, rule.action))


def _settle(call: Call) -> None:
    """Decide what overrides decide without the store.

    Exempt limits take no part in the decision; a blocked one (or one whose override is
    too small for its count) refuses the whole call, all-or-nothing, and the others are
    not asked (they took nothing).
    """
    items = call.items
    settled = [item for item in items if settles(item.rule)]
    now = clock.app_now()
    for item in settled:
        rule = item.rule
        refused = isinstance(rule, Outsized)
        ruling = rule.rule if isinstance(rule, Outsized) else rule
        assert ruling is not None
        item.status = statuses.overridden(item.limit, item.key, item.request.count, ruling, now, refused=refused)
    if any(not item.status.ok for item in settled):  # type: ignore[union-attr]
        for item in items:
            if item.status is None:
                item.status = statuses.undecided(item.limit, item.key, item.request.count / MICRO)
    call.pending = any(item.status is None for item in items)


def _recall(call: Call) -> None:
    """Answer the call from memory when it knows one of its limits denies it (**recall**).

    All-or-nothing, the whole call is denied and spends nothing; its other limits were
    not asked, so their statuses say nothing of them (``undecided``).
    """
    if deny_cache.active() is None:
        return
    stores = call.stores
    denied = False
    for item in call.items:
        request = item.request
        if item.status is None and deny_cache.cacheable(item.limit, request.reserve):
            found = deny_cache.lookup(item.limit, stores.backend(item.limit), request.key.digest, request.count)
            if found is not None:
                denied = True
                item.status = statuses.decided(
                    item.limit,
                    item.key,
                    request.count,
                    found.decision,
                    found.now,
                    cached=True,
                    override=item.override,
                )
    if not denied:
        return
    for item in call.items:
        if item.status is None:
            item.status = statuses.undecided(item.limit, item.key, item.request.count / MICRO)
    call.pending = False


# -- store -------------------------------------------------------------------------------


def store(call: Call) -> Steps[None]:
    """Ask the store for the limits nothing settled (**store**): the plan a driver runs.

    Limits in shadow mode never block, so they are decided apart from the enforced ones;
    they consume only when the enforced ones let the call through, as they would if
    they were enforced.
    """
    rest = [item for item in call.items if item.status is None]
    sharded = [item for item in rest if item.limit.shards > 1]
    if sharded:
        planned = yield from plan_shards([item.request for item in sharded])
        if planned is None:  # the store failed reading the shards, and FAIL_OPEN allows
            for item in rest:
                item.status = statuses.failed_open(item.limit, item.key, item.count)
            return
        for item, (parts, untouched) in zip(sharded, planned):
            item.parts, item.untouched = parts, untouched
    enforced = [item for item in rest if not item.limit.shadow]
    shadowed = [item for item in rest if item.limit.shadow]
    enforced_ok = True
    for group in (enforced, shadowed):
        if not group:
            continue
        if group is enforced and deny_cache.active() is not None:
            call.before = deny_cache.now()
        requests = []
        for item in group:
            if item.parts is None:
                requests.append(item.request)
            else:
                requests.extend(item.parts)
        outcome = yield Decide(group[0].limit, requests, call.apply and (group is enforced or enforced_ok))
        enforced_ok = _take(group, outcome) and enforced_ok


def one_step(call: Call) -> Decide | None:
    """The store step of a call of one unsharded limit (every request's call), which a
    driver answers without a plan (``steps.answer``): ``store`` would ask the same, at
    the cost of a generator. None for any other call, which runs ``store``."""
    if len(call.items) != 1:
        return None
    item = call.items[0]
    if item.limit.shards > 1:
        return None
    if not item.limit.shadow and deny_cache.active() is not None:
        call.before = deny_cache.now()
    return Decide(item.limit, [item.request], call.apply)


def answered(call: Call, outcome: Outcome | None) -> None:
    """Take the store's answer to ``one_step``."""
    _take(call.items, outcome)


def _take(group: list[Item], outcome: Outcome | None) -> bool:
    """Give each item of ``group`` its decision from the store's ``outcome`` (None: the
    store failed and the call goes through, failed open); return whether none of its
    enforced limits refused."""
    if outcome is None:
        for item in group:
            item.status = statuses.failed_open(item.limit, item.key, item.count)
        return True
    allowed = True
    position = 0
    for item in group:
        if item.parts is None:
            decision = outcome.decisions[position]
            position += 1
        else:
            decisions = outcome.decisions[position : position + len(item.parts)]
            position += len(item.parts)
            decision = sharded_decision(item.limit, decisions, item.untouched)
        item.decision, item.now = decision, outcome.now
        allowed = allowed and (item.limit.shadow or decision.allowed)
    return allowed


# -- learn, status, report ----------------------------------------------------------------


def finish(call: Call) -> list[Status]:
    """Learn what the store said, make the statuses and report them (a call that applies)."""
    if call.before is not None:
        _learn(call)
    made = []
    for item in call.items:
        status = item.status
        if status is None:
            assert item.decision is not None
            status = item.status = statuses.decided(
                item.limit, item.key, item.request.count, item.decision, item.now, override=item.override
            )
        made.append(status)
    if call.apply:
        all_ok = made[0].ok if len(made) == 1 else all(status.ok for status in made)
        for status, item in zip(made, call.items):
            report.report(call.stores, status, all_ok, item.limit)
    return made


def _learn(call: Call) -> None:
    """Remember the denials of the enforced limits, and forget the keys they admitted on (**learn**)."""
    enforced = [item for item in call.items if item.decision is not None and not item.limit.shadow]
    if all(item.decision.allowed for item in enforced):  # type: ignore[union-attr]
        for item in enforced:
            deny_cache.admitted(item.limit.name, item.request.key.digest)
        return
    memory = deny_cache.active()
    if memory is None:
        return
    # A key asked twice in one call is decided after the call's own first take, which
    # the store never applied when the call was denied: only a key asked once says what
    # its bucket holds.
    rows = [(item.limit.name, item.request.key.digest) for item in enforced]
    for position, item in enumerate(enforced):
        request = item.request
        if rows.count(rows[position]) == 1 and deny_cache.cacheable(item.limit, request.reserve):
            assert item.decision is not None and call.before is not None
            deny_cache.remember(
                memory,
                item.limit,
                call.stores.backend(item.limit),
                request.key.digest,
                request.count,
                Outcome([item.decision], item.now),
                call.before,
            )


def one_backend(limits: Sequence[LimitConfig]) -> None:
    """Raise ImproperlyConfigured unless every limit is stored on the same backend.

    Limits decided together are decided all-or-nothing, in one transaction or one
    script; two stores cannot share one, and deciding them one after the other would
    spend on one store what the other then refuses.
    """
    aliases: dict[str, list[str]] = {}
    for limit in limits:
        aliases.setdefault(limit.backend, []).append(limit.name)
    if len(aliases) > 1:
        stores = "; ".join(f"{alias!r}: {', '.join(map(repr, names))}" for alias, names in aliases.items())
        raise ImproperlyConfigured(
            f"rate limits decided together must be stored on one backend, and these are not ({stores}): "
            f"one decision across two stores cannot be all-or-nothing. Decide them in separate calls, "
            f"or give them the same 'backend'."
        )
