"""Lockouts for operators: ``is_locked()`` and ``unlock()`` (``manage.py tokenbucket unlock``)."""

from __future__ import annotations

from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured

from .. import overrides
from ..api import limiter
from ..keys import encode_key
from . import config
from .attempts import blocks_in_force
from .keys import key_of, typed_parts

__all__ = ["Unlocked", "ais_locked", "aunlock", "is_locked", "unlock"]


@dataclass(frozen=True)
class Unlocked:
    """One bucket of the login limit that ``unlock`` reached (one entry of ``KEYS``)."""

    #: The entry of KEYS: ``("username",)``, ``("username", "ip")``...
    entry: tuple[str, ...]
    #: The key as an operator typed it: ``username=alice, ip=203.0.113.7``.
    typed: str
    #: Whether a lockout's block (or any block) of the key was removed.
    unblocked: bool
    #: Whether its bucket was short of a token for a login (it was locked by the bucket).
    was_empty: bool


def _entries(username: str | None, ip: str | None) -> tuple[str, list[tuple[tuple[str, ...], object, str]]]:
    """The login limit's name, and each entry of KEYS made of the parts given: (entry,
    key, as typed); ValueError for a malformed part, ImproperlyConfigured when LOGIN is off."""
    login = config.configured()
    if login is None:
        raise ImproperlyConfigured("login protection is off (TOKENBUCKET['LOGIN'] is None or False)")
    parts = typed_parts(username, ip)
    if not parts:
        raise ValueError("give a username, an address, or both")
    found = []
    for entry in login.keys:
        if all(part in parts for part in entry):
            typed = ", ".join(f"{part}={_shown(parts[part])}" for part in entry)
            found.append((entry, key_of([parts[part] for part in entry]), typed))
    return login.limit, found


def is_locked(*, username: str | None = None, ip: str | None = None) -> bool:
    """Whether a login with ``username`` and/or from ``ip`` would be refused now by an entry
    of ``LOGIN["KEYS"]`` made of those parts: a block in force, or a bucket without a
    token for a login. Changes nothing. For a project's "this account is locked" badge."""
    name, entries = _entries(username, ip)
    return any(not limiter.check(name, key).ok for _entry, key, _typed in entries)


async def ais_locked(*, username: str | None = None, ip: str | None = None) -> bool:
    """``is_locked()`` for async code."""
    return await sync_to_async(is_locked)(username=username, ip=ip)


def unlock(*, username: str | None = None, ip: str | None = None) -> list[Unlocked]:
    """End the lockouts of ``username`` and/or the address ``ip``: for every entry of
    ``LOGIN["KEYS"]`` made of the parts given, remove the key's block and fill its bucket
    (and forget its lockouts on record). Entries that need a part not given are left as
    they are. ValueError for a malformed part, ImproperlyConfigured when LOGIN is off.
    """
    login = config.configured()
    name, entries = _entries(username, ip)
    assert login is not None
    done = []
    for entry, key, typed in entries:
        digest = encode_key(key).digest
        was_empty = limiter.get_value(name, key) < 1
        unblocked = False
        if blocks_in_force(name, [digest]).filter(key=digest).exists():
            unblocked = overrides.delete(name, digest) > 0
        limiter.reset(name, key)
        if login.counts_lockouts:
            spec = login.lockouts_spec()
            limiter.reset(spec["name"], key, config=spec["config"])
        done.append(Unlocked(entry, typed, unblocked, was_empty))
    return done


async def aunlock(*, username: str | None = None, ip: str | None = None) -> list[Unlocked]:
    """``unlock()`` for async code."""
    return await sync_to_async(unlock)(username=username, ip=ip)


def _shown(part: tuple[str, object]) -> str:
    return str.__str__(part[1]) if isinstance(part[1], str) else str(part[1])
