"""``TOKENBUCKET["LOGIN"]``: what login protection counts, and how lockouts end.

Read once per value of ``TOKENBUCKET`` (and ``AUTHENTICATION_BACKENDS`` once per value),
re-read when either changes, so that a login pays a dict lookup for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from ..limits import LimitConfig
from ..rates import parse_period
from ..settings import feature_options, tokenbucket_settings

__all__ = [
    "BACKEND_PATH",
    "DEFAULTS",
    "PARTS",
    "LoginSettings",
    "configured",
    "listed",
    "parse",
    "seconds",
]

#: Where ``AUTHENTICATION_BACKENDS`` names the backend.
BACKEND_PATH = "django_tokenbucket.auth.LoginBackend"

#: What a key can be made of, in the order a combination lists them.
PARTS = ("username", "ip", "user_agent")

#: Lockouts a key can have on record; more count as this many.
MOST_LOCKOUTS = 1000

DEFAULTS: dict[str, Any] = {
    "LIMIT": "login_failures",
    "KEYS": ["username", "ip"],
    "COOLOFF": None,
    "RESET_ON_SUCCESS": False,
    # How long a lockout counts toward the length of the next (COOLOFF a callable).
    "LOCKOUT_MEMORY": 24 * 3600,
    # A callable (request, status) -> response for every login refused by the limit.
    "RESPONSE": None,
}

Cooloff = Callable[[int], Any]


@dataclass(frozen=True)
class LoginSettings:
    """``TOKENBUCKET["LOGIN"]``, validated."""

    #: The limit of ``LIMITS`` whose buckets count the failures.
    limit: str
    #: Each entry of ``KEYS`` as the parts it is made of, in ``PARTS`` order.
    keys: tuple[tuple[str, ...], ...]
    #: None: the bucket alone decides; seconds: every lockout's length; a callable of
    #: the lockout count (1 for the first) returning seconds or a timedelta.
    cooloff: float | Cooloff | None
    reset_on_success: bool
    #: Seconds; each span this long without a lockout forgets one (COOLOFF a callable).
    lockout_memory: float
    response: Callable[..., Any] | None

    @property
    def counts_lockouts(self) -> bool:
        """Whether lockouts are counted: their length depends on how many there were."""
        return callable(self.cooloff)

    def config(self) -> LimitConfig:
        """Return the login limit's config; ImproperlyConfigured when LIMITS has no such limit."""
        try:
            return tokenbucket_settings.limits()[self.limit]
        except KeyError:
            raise ImproperlyConfigured(_unknown_limit(self.limit)) from None

    def lockouts_spec(self) -> dict[str, Any]:
        """The bucket that counts a key's lockouts (``name`` and inline ``config``): one
        token taken per lockout, one given back per ``lockout_memory``, so that what it
        lacks is the lockouts on record."""
        return {
            "name": f"{self.limit}.lockouts",
            "config": {
                "rate": 1,
                "period": Fraction(self.lockout_memory).limit_denominator(1_000_000),
                "capacity": MOST_LOCKOUTS,
                "backend": self.config().backend,
                # A lockout is rare and must be counted by every process: never from memory.
                "deny_cache": False,
            },
        }

    def lockout_seconds(self, lockouts: int | None) -> float | None:
        """Return how long lockout number ``lockouts`` lasts, in seconds (None: no lockout,
        the bucket decides); ValueError when a COOLOFF callable returns something else."""
        cooloff = self.cooloff
        if cooloff is None or isinstance(cooloff, float):
            return cooloff
        value = cooloff(lockouts or 1)
        try:
            return seconds(value)
        except ValueError as exc:
            raise ValueError(f"TOKENBUCKET['LOGIN']['COOLOFF']({lockouts}) returned {value!r}: {exc}") from None


def _unknown_limit(name: str) -> str:
    return (
        f"TOKENBUCKET['LOGIN']['LIMIT'] is {name!r}, which is not in TOKENBUCKET['LIMITS']: define the failures "
        f"a key may have, e.g. LIMITS = {{{name!r}: '5/15m'}}"
    )


def seconds(value: object) -> float:
    """``value`` (seconds, or a timedelta) as positive, finite seconds; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise ValueError("expected seconds (a number) or a timedelta")
    total = float(parse_period(value))
    if not math.isfinite(total):
        raise ValueError("expected a finite number of seconds")
    return total


def _keys(value: object) -> tuple[tuple[str, ...], ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"KEYS must be a non-empty list such as ['username', 'ip'], not {value!r}")
    entries = []
    for entry in value:
        parts = (entry,) if isinstance(entry, str) else entry
        if not isinstance(parts, (list, tuple)) or not parts or any(part not in PARTS for part in parts):
            raise ValueError(
                f"KEYS: {entry!r} is not one of {', '.join(map(repr, PARTS))} or a tuple of them (a combination)"
            )
        if len(set(parts)) != len(parts):
            raise ValueError(f"KEYS: {entry!r} names a part twice")
        ordered = tuple(part for part in PARTS if part in parts)
        if ordered in entries:
            raise ValueError(f"KEYS: {entry!r} is given twice")
        entries.append(ordered)
    return tuple(entries)


def _callable(what: str, value: object) -> Callable[..., Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ValueError(f"{what}: {value!r} cannot be imported: {exc}") from None
    if not callable(value):
        raise ValueError(f"{what} must be a callable or the dotted path to one, not {value!r}")
    return value


def _cooloff(value: object) -> float | Cooloff | None:
    if value is None:
        return None
    if isinstance(value, str) or callable(value):
        return _callable("COOLOFF", value)
    try:
        return seconds(value)
    except ValueError as exc:
        raise ValueError(
            f"COOLOFF must be None, seconds, a timedelta or a callable of the lockout count, not {value!r}: {exc}"
        ) from None


def parse(value: object) -> LoginSettings | None:
    """Return ``TOKENBUCKET["LOGIN"]`` validated (None: off); ValueError says what is wrong."""
    options = feature_options("LOGIN", value, DEFAULTS, off="None, False")
    if options is None:
        return None
    merged = {**DEFAULTS, **options}
    limit = merged["LIMIT"]
    if not isinstance(limit, str) or not limit:
        raise ValueError(f"TOKENBUCKET['LOGIN']['LIMIT'] must be the name of a limit in LIMITS, not {limit!r}")
    reset = merged["RESET_ON_SUCCESS"]
    if not isinstance(reset, bool):
        raise ValueError(f"TOKENBUCKET['LOGIN']['RESET_ON_SUCCESS'] must be True or False, not {reset!r}")
    try:
        keys = _keys(merged["KEYS"])
        cooloff = _cooloff(merged["COOLOFF"])
        memory = seconds(merged["LOCKOUT_MEMORY"])
        response = _callable("RESPONSE", merged["RESPONSE"])
    except ValueError as exc:
        raise ValueError(f"TOKENBUCKET['LOGIN']: {exc}") from None
    return LoginSettings(limit, keys, cooloff, reset, memory, response)


def configured() -> LoginSettings | None:
    """Return ``TOKENBUCKET["LOGIN"]`` validated, whether or not the backend is listed (None:
    LOGIN is None or False); ImproperlyConfigured when it is malformed."""
    global _parsed
    parsed = _parsed
    if parsed is None:
        user = tokenbucket_settings.user_settings
        try:
            parsed = _parsed = (parse(user.get("LOGIN", {}) if isinstance(user, Mapping) else {}),)
        except ValueError as exc:
            raise ImproperlyConfigured(str(exc)) from None
    return parsed[0]


def listed(backend: type) -> bool:
    """Whether ``AUTHENTICATION_BACKENDS`` lists ``backend`` (or a subclass of it)."""
    found = _listed.get(backend)
    if found is None:
        found = False
        for path in getattr(settings, "AUTHENTICATION_BACKENDS", ()):
            try:
                candidate = import_string(path)
            except ImportError:
                continue  # Django's own checks and authenticate() report it
            if isinstance(candidate, type) and issubclass(candidate, backend):
                found = True
                break
        _listed[backend] = found
    return found


_parsed: tuple[LoginSettings | None] | None = None
_listed: dict[type, bool] = {}


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    global _parsed
    if setting == "TOKENBUCKET":
        _parsed = None
    if setting == "AUTHENTICATION_BACKENDS":
        _listed.clear()
