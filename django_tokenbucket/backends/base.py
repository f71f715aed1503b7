"""The interface every backend implements, and the all-or-nothing step they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from asgiref.sync import sync_to_async
from django.core import checks

from ..algorithms import Decision, State
from ..keys import EncodedKey
from ..limits import LimitConfig

__all__ = ["BackendError", "BaseBackend", "Outcome", "Request", "decide_all", "row_id"]

RowId = tuple[str, str]


@dataclass(frozen=True)
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


class BackendError(Exception):
    """The store failed; the limiter applies the configured fail mode.

    ``ambiguous`` is true when a write may have been applied all the same: the request
    reached the store (or may have) and its answer was lost, as when a connection dies
    during a COMMIT or while one autocommit statement runs, or a Redis reply comes
    after the socket timeout. Such a call is never run again (it could spend twice);
    its tokens count as spent.
    """

    def __init__(self, message: str, *, ambiguous: bool = False) -> None:
        super().__init__(message)
        self.ambiguous = ambiguous


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
    ``store_now()`` (its clock), ``refund()``.
    """

    #: The OPTIONS this backend takes; others are an error (``check_options``). None
    #: leaves them unchecked, for a backend that does not say.
    option_names: ClassVar[frozenset[str] | None] = None
    #: The system-check id of an unknown option.
    unknown_option_id: ClassVar[str] = "django_tokenbucket.E013"
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
        return [
            checks.Error(
                f"{setting}['OPTIONS'] has unknown option(s) for {cls.__name__}: {', '.join(unknown)}.",
                hint=f"{cls.__name__} takes {', '.join(map(repr, sorted(cls.option_names)))}.",
                id=cls.unknown_option_id,
            )
        ]

    def database_alias(self) -> str | None:
        """Return the database whose ``RateLimit`` rows hold this backend's buckets, if any.

        Such a backend's decisions join that database's transactions; the admin, the
        command's listings and cleanup read its rows.
        """
        return None

    def store_now(self) -> int:
        """Return the store's clock, in microseconds since the epoch."""
        raise NotImplementedError(f"{type(self).__name__} does not say what time its store has")

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
