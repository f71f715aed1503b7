"""The engine's public entries: one decision or several, a limit's state, a reset, a
refund, an acquisition, each blocking or asyncio.

``Engine`` is what ``django_tokenbucket.api.Limiter`` delegates to, and what an
integration that builds its own ``LimitRequest``s (the DRF throttle) calls directly
(``limiter.engine.decide_many``). Each entry refreshes the overrides' snapshot, then
runs the decision pipeline (``decide``) or a plan of ``state`` with a driver of
``steps``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import clock, overrides, waits
from ..algorithms import MICRO
from ..exceptions import RateLimited
from ..keys import EncodedKey
from ..limits import LimitConfig, count_to_micro
from ..overrides import Override
from ..rates import to_fraction
from ..status import MultiStatus, Status
from . import decide, state
from .decide import Asked
from .names import ConfigSpec, encode_for, resolve
from .rules import LOOK_UP, count_in_force, in_force
from .statuses import overridden
from .steps import aanswer, adrive, answer, drive
from .stores import Stores

__all__ = ["Engine"]


class Engine(Stores):
    """Decide, read and change rate limits on their backends (or on ``backend``, for every limit).

    ``sender`` is the ``sender`` of the signals it sends (the ``Limiter`` class).
    """

    # -- decisions ---------------------------------------------------------------------

    def decide_one(
        self,
        name: str,
        key: object,
        count: int | float,
        reserve: bool,
        config: ConfigSpec | LimitConfig | None,
        *,
        apply: bool,
        throws: bool,
        rule: Override | None = LOOK_UP,
    ) -> Status:
        """Decide one limit (``apply``: take the tokens; ``throws``: raise RateLimited when
        denied). ``rule`` is the key's override when the caller applied it to ``config``
        already (``acquire``)."""
        overrides.refresh_if_due()
        call = decide.begin_one(self, name, key, count, reserve, config, apply=apply, rule=rule)
        if call.pending:
            self._store(call)
        (status,) = decide.finish(call)
        if throws and not status.ok:
            raise RateLimited(status.name, status.key, status.retry_after, status)
        return status

    async def adecide_one(
        self,
        name: str,
        key: object,
        count: int | float,
        reserve: bool,
        config: ConfigSpec | LimitConfig | None,
        *,
        apply: bool,
        throws: bool,
        rule: Override | None = LOOK_UP,
    ) -> Status:
        """``decide_one()`` for async code."""
        await overrides.arefresh_if_due()
        call = decide.begin_one(self, name, key, count, reserve, config, apply=apply, rule=rule)
        if call.pending:
            await self._astore(call)
        (status,) = decide.finish(call)
        if throws and not status.ok:
            raise RateLimited(status.name, status.key, status.retry_after, status)
        return status

    def decide_many(self, asked: Sequence[Asked], *, apply: bool, throws: bool) -> MultiStatus:
        """Decide the limits ``asked`` (``LimitRequest``s) all-or-nothing: one denial consumes none."""
        overrides.refresh_if_due()
        call = decide.begin(self, asked, apply=apply, rules=None)
        if call.pending:
            self._store(call)
        return _many_result(decide.finish(call), throws)

    async def adecide_many(self, asked: Sequence[Asked], *, apply: bool, throws: bool) -> MultiStatus:
        """``decide_many()`` for async code."""
        await overrides.arefresh_if_due()
        call = decide.begin(self, asked, apply=apply, rules=None)
        if call.pending:
            await self._astore(call)
        return _many_result(decide.finish(call), throws)

    def _store(self, call: decide.Call) -> None:
        """Ask the store what ``call`` leaves to it: one step when it is one unsharded
        limit, the pipeline's plan otherwise."""
        step = decide.one_step(call)
        if step is None:
            drive(self, decide.store(call))
        else:
            decide.answered(call, answer(self, step))

    async def _astore(self, call: decide.Call) -> None:
        """``_store()`` for async code."""
        step = decide.one_step(call)
        if step is None:
            await adrive(self, decide.store(call))
        else:
            decide.answered(call, await aanswer(self, step))

    # -- state -------------------------------------------------------------------------

    def status(self, name: str, key: object, config: ConfigSpec | None) -> Status:
        """Return the state of a limit now, as a Status of a zero-token call."""
        overrides.refresh_if_due()
        limit = resolve(name, config)
        return drive(self, state.read(limit, encode_for(limit, key), key))

    async def astatus(self, name: str, key: object, config: ConfigSpec | None) -> Status:
        """``status()`` for async code."""
        await overrides.arefresh_if_due()
        limit = resolve(name, config)
        return await adrive(self, state.read(limit, encode_for(limit, key), key))

    def reset(self, name: str, key: object, config: ConfigSpec | None) -> None:
        """Forget the state of ``name`` for ``key``: it starts full again."""
        overrides.refresh_if_due()
        limit = resolve(name, config)
        drive(self, state.reset(self, limit, encode_for(limit, key)))

    async def areset(self, name: str, key: object, config: ConfigSpec | None) -> None:
        """``reset()`` for async code."""
        await overrides.arefresh_if_due()
        limit = resolve(name, config)
        await adrive(self, state.reset(self, limit, encode_for(limit, key)))

    def refund(self, name: str, key: object, count: int | float, config: ConfigSpec | None) -> Status:
        """Give ``count`` unused tokens back to limit ``name`` for ``key`` (``Limiter.refund``)."""
        limit, amount = _refund_amount(name, count, config)
        return self.refund_encoded(limit, encode_for(limit, key), amount, key)

    async def arefund(self, name: str, key: object, count: int | float, config: ConfigSpec | None) -> Status:
        """``refund()`` for async code."""
        limit, amount = _refund_amount(name, count, config)
        await overrides.arefresh_if_due()
        return await adrive(self, state.refunded(self, limit, encode_for(limit, key), amount, key))

    def refund_encoded(self, limit: LimitConfig, encoded: EncodedKey, amount: int, key: object) -> Status:
        """Refund ``amount`` micro-tokens of a parsed limit to a key already encoded (``Limiter.refund_encoded``)."""
        overrides.refresh_if_due()
        return drive(self, state.refunded(self, limit, encoded, amount, key))

    # -- acquire -----------------------------------------------------------------------

    def acquire(
        self, name: str, key: object, count: int | float, timeout: float | None, config: ConfigSpec | None
    ) -> Status:
        """Reserve ``count`` tokens and sleep until they exist (``Limiter.acquire``)."""
        overrides.refresh_if_due()
        limit, rule = self._acquiring(name, key, count, timeout, config)
        status = self.decide_one(name, key, count, True, limit, apply=True, throws=True, rule=rule)
        wait = _wait_for(limit, status)
        if wait:
            # Interrupted (a signal handler raising), the reservation is given back.
            waits.slept(wait, status, lambda _: self.refund(name, key, count, config))
        return status

    async def aacquire(
        self, name: str, key: object, count: int | float, timeout: float | None, config: ConfigSpec | None
    ) -> Status:
        """``acquire()`` for async code: it awaits, never blocking the event loop."""
        await overrides.arefresh_if_due()
        limit, rule = self._acquiring(name, key, count, timeout, config)
        decision = self.adecide_one(name, key, count, True, limit, apply=True, throws=True, rule=rule)
        # Cancelled anywhere (a client gone from an async view), what it reserved goes back.
        return await waits.aacquired(
            decision, lambda status: _wait_for(limit, status), lambda _: self.arefund(name, key, count, config)
        )

    def _acquiring(
        self, name: str, key: object, count: int | float, timeout: float | None, config: ConfigSpec | None
    ) -> tuple[LimitConfig, Override | None]:
        """Return the limit to reserve from, the key's override applied and its
        ``max_reserved`` lowered to what ``timeout`` repays, and the override.

        The override is applied here, before the bound: applied after it, an override's
        own ``max_reserved`` would replace the bound.
        """
        base = resolve(name, config)
        limit, rule = in_force(base, encode_for(base, key).digest)
        micro, fits = count_in_force(base, limit, count, True)
        if not fits:
            assert rule is not None
            refused = overridden(limit, key, micro, rule, clock.app_now(), refused=True)
            raise RateLimited(refused.name, refused.key, refused.retry_after, refused)
        if timeout is None or (rule is not None and rule.action != overrides.LIMIT):
            return limit, rule
        try:
            wait = to_fraction(timeout, "timeout")
        except ValueError as exc:
            raise ValueError(f"rate limit {limit.name!r}: {exc}") from None
        if wait < 0:
            raise ValueError(f"rate limit {limit.name!r}: timeout must not be negative, not {timeout!r}")
        bounded = limit.reserving_within(int(wait * MICRO))
        micro = count_to_micro(count)
        if bounded.max_count is not None and micro > bounded.max_count:
            raise ValueError(
                f"rate limit {limit.name!r}: count {count!r} cannot be acquired within timeout {timeout!r}: "
                f"even a full bucket ({limit.capacity_tokens:g}) would leave a wait longer than that"
            )
        return bounded, rule


def _many_result(statuses: list[Status], throws: bool) -> MultiStatus:
    result = MultiStatus(statuses)
    if throws and not result.ok:
        denied = result.denied[0]
        raise RateLimited(denied.name, denied.key, result.retry_after, denied)
    return result


def _refund_amount(name: str, count: int | float, config: ConfigSpec | None) -> tuple[LimitConfig, int]:
    limit = resolve(name, config)
    try:
        return limit, count_to_micro(count)
    except ValueError as exc:
        raise ValueError(f"rate limit {limit.name!r}: {exc}") from None


def _wait_for(limit: LimitConfig, status: Status) -> float:
    """Seconds until the tokens of an acquired reservation exist (0 when they do, when the
    store failed open, or on a shadow limit, which never blocks)."""
    if limit.shadow or not status.ok or status.retry_after is None:
        return 0.0
    return max(0.0, status.retry_after)
