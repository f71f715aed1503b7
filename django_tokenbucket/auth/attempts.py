"""A login attempt's tokens: taken before the password is checked, kept for a failure,
given back for a success; and the lockouts that failures end in.

Taking first is what makes the count exact: concurrent guesses each hold their token
while their password hash runs, so no more of them are checked than the bucket holds,
in any number of processes (a limiter that counts failures once they are known reads,
hashes, then writes, and every guess in flight passes its read). A success gives its
tokens back, so that only failures stay spent.

Lockouts (``COOLOFF`` not None) are ``block`` overrides of the key, written when the
failure that emptied its bucket is known, so that they show in the admin and in
``manage.py tokenbucket overrides``, and every process refuses the key without asking
the store once it has read them (within ``OVERRIDES["MAX_AGE"]``). The bucket is reset
once the block is committed: the key starts afresh, full, when the lockout ends. Until a
process has read the block, its decisions may find that full bucket; so an attempt the
bucket admits looks for a block of its keys in the database before any password is
checked (one indexed query, made only while COOLOFF is set and only for attempts the
store admitted: a flood on a locked key stays answered from memory).

Every call joins the caller's transaction when the login limit is stored on its
database, as every decision of the limiter does (check W062 says what a rollback does).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import Q

from .. import clock, overrides, signals
from ..api import LimitRequest, limiter
from ..exceptions import BackendUnavailable
from ..keys import encode_key
from ..limits import LimitConfig
from ..settings import MOST_LOCKOUTS, LoginSettings
from ..status import MultiStatus, Status
from .keys import http_request

__all__ = ["LOCKOUT_AUTHOR", "Attempt", "Refusal", "blocks_in_force", "lock_out", "mark_refused", "refusal_of"]

logger = logging.getLogger("django_tokenbucket")

#: ``created_by`` of the blocks that lockouts write.
LOCKOUT_AUTHOR = "login protection"
#: The attribute of an HttpRequest that says why its login was refused, for the
#: middleware's answer (``responses``).
REFUSAL_ATTRIBUTE = "_tokenbucket_login_refusal"


@dataclass(frozen=True)
class Refusal:
    """Why a login was refused before its password was checked: ``status`` is the
    binding Status (its ``retry_after`` is the Retry-After); ``unavailable`` when the
    store failed and the limiter fails closed."""

    status: Status | None
    unavailable: bool = False


@dataclass
class Attempt:
    """One login attempt's keys, and what the store answered for them."""

    login: LoginSettings
    limit: LimitConfig
    keys: list[object]
    request: Any
    #: The sender of ``login_locked_out``: ``LoginBackend``.
    sender: object = None
    statuses: MultiStatus | None = None
    #: The keys whose token this attempt holds (an exempt or undecided key holds none).
    held: list[tuple[object, Status]] = field(default_factory=list)

    @classmethod
    def of(cls, login: LoginSettings, keys: list[object], request: Any, *, sender: object) -> Attempt:
        return cls(login, login.config(), keys, request, sender)

    # -- taking --------------------------------------------------------------------

    def _requests(self) -> list[LimitRequest]:
        return [LimitRequest(self.limit.name, key) for key in self.keys]

    def reserve(self) -> Refusal | None:
        """Take a token for each key, all-or-nothing; a Refusal when the login must not be checked."""
        try:
            statuses = limiter.limit_many(self._requests())
        except BackendUnavailable:
            return self._refused(Refusal(None, unavailable=True))
        refusal = self._taken(statuses)
        if refusal is None and self.login.cooloff is not None:
            refusal = self._locked(_blocked(self.limit, self.keys))
        return refusal

    async def areserve(self) -> Refusal | None:
        """``reserve()`` for async code."""
        try:
            statuses = await limiter.alimit_many(self._requests())
        except BackendUnavailable:
            return self._refused(Refusal(None, unavailable=True))
        refusal = self._taken(statuses)
        if refusal is None and self.login.cooloff is not None:
            refusal = await self._alocked(await sync_to_async(_blocked)(self.limit, self.keys))
        return refusal

    def _taken(self, statuses: MultiStatus) -> Refusal | None:
        self.statuses = statuses
        if not statuses.ok:
            return self._refused(Refusal(_binding(statuses)))
        self.held = [(key, status) for key, status in zip(self.keys, statuses) if _holds(status)]
        return None

    def _locked(self, block: Status | None) -> Refusal | None:
        if block is None:
            return None
        # Locked out meanwhile (a block this process has not read yet): the token goes back.
        self.refund()
        return self._refused(Refusal(block))

    async def _alocked(self, block: Status | None) -> Refusal | None:
        if block is None:
            return None
        await self.arefund()
        return self._refused(Refusal(block))

    def _refused(self, refusal: Refusal) -> Refusal:
        self.held = []
        mark_refused(self.request, refusal)
        return refusal

    # -- settling ------------------------------------------------------------------

    def refund(self) -> None:
        """Give back the tokens this attempt holds (a success, or a lockout found late)."""
        for key, _status in self.held:
            try:
                limiter.refund(self.limit.name, key)
            except BackendUnavailable as exc:  # the store said why already; the token refills on its own
                logger.warning("login protection: could not give back a token of %r: %s", self.limit.name, exc)
        self.held = []

    async def arefund(self) -> None:
        """``refund()`` for async code."""
        for key, _status in self.held:
            try:
                await limiter.arefund(self.limit.name, key)
            except BackendUnavailable as exc:
                logger.warning("login protection: could not give back a token of %r: %s", self.limit.name, exc)
        self.held = []

    def succeeded(self) -> None:
        """The password was right: nothing stays spent (and, with RESET_ON_SUCCESS, the
        username's buckets are full again)."""
        self.refund()
        if self.login.reset_on_success:
            for key in self.keys:
                if _has_username(key):
                    limiter.reset(self.limit.name, key)

    async def asucceeded(self) -> None:
        """``succeeded()`` for async code."""
        await self.arefund()
        if self.login.reset_on_success:
            for key in self.keys:
                if _has_username(key):
                    await limiter.areset(self.limit.name, key)

    def failed(self) -> None:
        """The password was wrong: the tokens stay spent, and a key whose bucket this
        failure emptied is locked out."""
        emptied = [(key, status) for key, status in self.held if _emptied(status)]
        self.held = []
        for key, status in emptied:
            lock_out(self.login, self.limit, key, status, self.request, self.sender)

    async def afailed(self) -> None:
        """``failed()`` for async code."""
        await sync_to_async(self.failed)()


def mark_refused(request: Any, refusal: Refusal) -> None:
    """Note on the login's HttpRequest why it was refused, for the middleware's answer."""
    target = http_request(request)
    if target is not None:
        target.__dict__[REFUSAL_ATTRIBUTE] = refusal


def refusal_of(request: Any) -> Refusal | None:
    """Why ``request``'s login was refused before its password was checked, if it was."""
    target = http_request(request)
    return None if target is None else target.__dict__.get(REFUSAL_ATTRIBUTE)


def _binding(statuses: MultiStatus) -> Status:
    """The status that refused: the longest wait among the denied (the one a retry needs)."""
    denied = statuses.denied
    never = [status for status in denied if status.retry_after is None]
    if never:
        return never[0]
    return max(denied, key=lambda status: status.retry_after or 0.0)


def _holds(status: Status) -> bool:
    """Whether a status of an admitted attempt took its token: not an exemption, not a
    store that failed open, not a shadow limit that would have refused."""
    return not (status.failed_open or status.would_deny or status.override == overrides.EXEMPT)


def _emptied(status: Status) -> bool:
    """Whether the token taken was the last one: the bucket admits no further attempt now."""
    return status.value is not None and status.value < 1 and not status.shadow


def _has_username(key: object) -> bool:
    return isinstance(key, tuple) and "username" in key[0::2]


# -- lockouts --------------------------------------------------------------------------


def blocks_in_force(name: str, digests: Iterable[str]) -> Any:
    """The block overrides of ``name`` in force for any of ``digests`` (or for every key)."""
    now = _now()
    # Looked up, not imported: the package is imported before the app registry is ready.
    return (
        apps.get_model("django_tokenbucket", "LimitOverride")
        .objects.using(overrides.database_alias())
        .filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=now),
            name=name,
            key__in=[*digests, ""],
            action=overrides.BLOCK,
        )
    )


def _now() -> datetime:
    return overrides.as_datetime(clock.app_now())


def _blocked(limit: LimitConfig, keys: list[object]) -> Status | None:
    """A block of one of ``keys`` in force in the database (read there, not from this
    process' snapshot of the overrides): the Status of the call it refuses, else None."""
    digests = {encode_key(key).digest: key for key in keys}
    row = blocks_in_force(limit.name, digests).order_by("key").first()
    if row is None:
        return None
    now = _now()
    return Status(
        ok=False,
        name=limit.name,
        key=digests.get(row.key),
        count=1.0,
        value=None,
        retry_after=None if row.expires_at is None else max(0.0, (row.expires_at - now).total_seconds()),
        reset_after=None,
        capacity=limit.capacity_tokens,
        rate=limit.rate_tokens,
        period=limit.period_seconds,
        timestamp=now.timestamp(),
        override=overrides.BLOCK,
    )


def _lockouts(login: LoginSettings, key: object) -> int:
    """Count one more lockout of ``key``; return how many it has on record, this one included."""
    spec = login.lockouts_spec()
    status = limiter.limit(spec["name"], key, config=spec["config"])
    if not status.ok or status.value is None:
        return MOST_LOCKOUTS
    return max(1, math.ceil(MOST_LOCKOUTS - status.value - 1e-6))


def lock_out(
    login: LoginSettings, limit: LimitConfig, key: object, status: Status, request: Any, sender: object
) -> None:
    """Lock ``key`` out: its failures have emptied its bucket. One log line and one
    ``login_locked_out`` signal; with COOLOFF, a block until the lockout ends."""
    if limit.shadow:
        return  # a limit in shadow mode refuses nothing: its denials are reported as it decides
    encoded = encode_key(key)
    if login.cooloff is not None and blocks_in_force(limit.name, [encoded.digest]).filter(key=encoded.digest).exists():
        return  # locked out already: a failure held its token across the lockout
    lockouts = _lockouts(login, key) if login.counts_lockouts else None
    try:
        seconds = login.lockout_seconds(lockouts)
    except ValueError as exc:
        # The bucket still refuses the key until it refills: the safe side of a broken callable.
        logger.error("login protection: %s; the bucket alone decides this lockout", exc)
        seconds = None
    until = None if seconds is None else _block(limit, key, encoded.digest, encoded.label, seconds, lockouts)
    retry_after = seconds if until is not None else limiter.check(limit.name, key).retry_after
    logger.warning(
        "login protection: %r key %s (digest %s) locked out: its failed logins emptied its bucket; %s",
        limit.name,
        encoded.label,
        encoded.digest[:12],
        _how_long(until, retry_after, lockouts),
    )
    if signals.login_locked_out.receivers:
        signals.login_locked_out.send(
            sender=sender,
            name=limit.name,
            key=key,
            label=encoded.label,
            digest=encoded.digest,
            request=request,
            until=until,
            retry_after=retry_after,
            lockouts=lockouts,
        )


def _how_long(until: datetime | None, retry_after: float | None, lockouts: int | None) -> str:
    which = "" if lockouts is None else f" (lockout {lockouts} on record)"
    if until is not None:
        return f"blocked until {until.isoformat(timespec='seconds')}{which}"
    if retry_after is None:
        return "its bucket admits no login again"
    return f"its bucket admits a login again in {retry_after:.0f} s{which}"


def _block(
    limit: LimitConfig, key: object, digest: str, label: str, seconds: float, lockouts: int | None
) -> datetime | None:
    """Write the block of a lockout, then (once it is committed) fill the key's bucket for
    when it ends; return when it ends, or None when it could not be written."""
    which = "" if lockouts is None else f" (lockout {lockouts} within LOCKOUT_MEMORY)"
    try:
        row = overrides.make(
            limit.name,
            overrides.Digest(digest, label),
            overrides.BLOCK,
            until=timedelta(seconds=seconds),
            reason=f"Locked out by login protection: its failed logins emptied the bucket{which}.",
            created_by=LOCKOUT_AUTHOR,
        )
    except (ImproperlyConfigured, ValueError) as exc:
        logger.error("login protection: %s; the bucket alone decides this lockout", exc)
        return None
    name = limit.name
    # After the commit, never before: a process that finds the bucket full looks for the
    # block, and must find it.
    transaction.on_commit(lambda: _fill(name, key), using=overrides.database_alias())
    return row.expires_at


def _fill(name: str, key: object) -> None:
    try:
        limiter.reset(name, key)
    except BackendUnavailable as exc:
        logger.warning("login protection: the bucket of a lockout could not be filled for its end: %s", exc)
