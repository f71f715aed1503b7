"""The store steps of a plan, and the two drivers that answer them.

A plan is a generator that yields what it needs from a store (``Decide``, ``Reset``,
``Refund``) and receives the answer: an ``Outcome``, or None when the store failed and
the fail mode lets the call through. ``drive`` answers with the backends' blocking
methods, ``adrive`` with their asyncio ones, so that each operation is written once for
both; ``answer`` and ``aanswer`` answer one step, for the drivers and for a decision of
one limit, which needs no plan (``decide.one_step``). The store call is timed for the
metrics here, and its failure handed to ``failure``.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any, TypeVar, Union

from .. import metrics
from ..backends.base import BackendError, Request
from ..keys import EncodedKey
from ..limits import LimitConfig
from . import failure
from .stores import Stores

__all__ = ["Decide", "Refund", "Reset", "Step", "Steps", "aanswer", "adrive", "answer", "drive"]


class Decide:
    """A step of a plan: decide ``requests`` on the backend of ``limit``."""

    __slots__ = ("apply", "fail_open", "limit", "requests")

    def __init__(self, limit: LimitConfig, requests: list[Request], apply: bool, fail_open: bool | None = None):
        self.limit = limit
        self.requests = requests
        self.apply = apply
        #: None: ``FAIL_OPEN`` says what a failed store means; False: it is an error.
        self.fail_open = fail_open


class Reset:
    """A step of a plan: forget ``bucket`` (the limit, or one of its shards) for ``key``."""

    __slots__ = ("bucket", "key", "limit")

    def __init__(self, limit: LimitConfig, bucket: LimitConfig, key: EncodedKey) -> None:
        self.limit = limit
        self.bucket = bucket
        self.key = key


class Refund:
    """A step of a plan: give ``amount`` micro-tokens back to ``bucket`` for ``key``."""

    __slots__ = ("amount", "bucket", "key", "limit")

    def __init__(self, limit: LimitConfig, bucket: LimitConfig, key: EncodedKey, amount: int) -> None:
        self.limit = limit
        self.bucket = bucket
        self.key = key
        self.amount = amount


Step = Union[Decide, Reset, Refund]
T = TypeVar("T")
#: A plan: yields steps, receives each one's answer (an Outcome, or None when the store
#: failed and the call goes through), returns the result.
Steps = Generator[Step, Any, T]


def answer(stores: Stores, step: Step) -> Any:
    """Answer one step with the backend's blocking method: the store's answer, or None
    when it failed and the fail mode lets the call through (``failure``)."""
    backend = stores.backend(step.limit)
    recorder = metrics.active()
    started = time.perf_counter() if recorder is not None else 0.0
    try:
        if isinstance(step, Decide):
            return backend.decide(step.requests, apply=step.apply)
        if isinstance(step, Reset):
            backend.reset(step.bucket, step.key)
            return None
        return backend.refund(step.bucket, step.key, step.amount)
    except BackendError as exc:
        _failed(stores, step, exc)
        return None
    finally:
        if recorder is not None and isinstance(step, Decide):
            recorder.store_seconds(stores.label(step.limit), time.perf_counter() - started)


async def aanswer(stores: Stores, step: Step) -> Any:
    """``answer()`` with the backend's asyncio methods."""
    backend = stores.backend(step.limit)
    recorder = metrics.active()
    started = time.perf_counter() if recorder is not None else 0.0
    try:
        if isinstance(step, Decide):
            return await backend.adecide(step.requests, apply=step.apply)
        if isinstance(step, Reset):
            await backend.areset(step.bucket, step.key)
            return None
        return await backend.arefund(step.bucket, step.key, step.amount)
    except BackendError as exc:
        _failed(stores, step, exc)
        return None
    finally:
        if recorder is not None and isinstance(step, Decide):
            recorder.store_seconds(stores.label(step.limit), time.perf_counter() - started)


def drive(stores: Stores, steps: Steps[T]) -> T:
    """Run a plan, answering its steps with the backends' blocking methods."""
    try:
        step = next(steps)
        while True:
            step = steps.send(answer(stores, step))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        # A plan left at a step that raised (a failed reset) runs its ``finally`` now,
        # here: left to the garbage collector it would run wherever a collection happens
        # to start, inside get_backend's lock included (a deadlock seen in CI).
        steps.close()


async def adrive(stores: Stores, steps: Steps[T]) -> T:
    """Run a plan, answering its steps with the backends' asyncio methods."""
    try:
        step = next(steps)
        while True:
            step = steps.send(await aanswer(stores, step))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        # As in ``drive``.
        steps.close()


def _failed(stores: Stores, step: Step, exc: BackendError) -> None:
    """Apply the fail mode to a failed step: return to let it through, or raise BackendUnavailable."""
    if isinstance(step, Decide):
        label = stores.label(step.limit)
        failure.decide_failed(label, stores.sender, step.limit, step.requests, step.apply, step.fail_open, exc)
    else:
        what = "reset" if isinstance(step, Reset) else "refund"
        failure.change_failed(stores.label(step.limit), step.limit, what, exc)
