"""The ``TOKENBUCKET`` setting: read with one table of defaults, parsed once, reset once.

``tokenbucket_settings`` is the one reader, as DRF's ``api_settings``: each setting by
its name (``tokenbucket_settings.FAIL_OPEN``), the limits and the backend aliases
parsed, and each feature's options validated into a frozen dataclass
(``tokenbucket_settings.deny_cache``, ``.overrides``, ``.analytics``, ``.login``). Each is
parsed at its first use and kept on the object until ``django_tokenbucket.lifecycle``
calls ``reload()`` (the setting changed), so a broken entry is reported by the system
checks, which read the same object, or on first use, never at import. The features'
modules keep no copy: they ask this object.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction
from functools import cached_property
from typing import Any, NamedTuple, TypeVar

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

# Loaded with the settings, which every module reads: its receiver of setting_changed and
# its fork hook are then in place before anything builds state they reset.
from . import lifecycle  # noqa: F401
from .algorithms import MICRO
from .limits import DEFAULT_BACKEND_ALIAS, LimitConfig, parse_limit
from .rates import parse_period

__all__ = [
    "ANALYTICS_FLUSH",
    "ANALYTICS_MAX_KEYS",
    "ANALYTICS_TOP_KEYS",
    "DEFAULTS",
    "DENY_CACHE_MAX_AGE",
    "DENY_CACHE_MAX_KEYS",
    "LOGIN_DEFAULTS",
    "LOGIN_PARTS",
    "MOST_LOCKOUTS",
    "OVERRIDES_KEEP_EXPIRED",
    "OVERRIDES_MAX_AGE",
    "AnalyticsSettings",
    "BackendSettings",
    "DenyCacheSettings",
    "LoginSettings",
    "OptionsNotADict",
    "OverridesSettings",
    "feature_options",
    "parse_analytics",
    "parse_backends",
    "parse_deny_cache",
    "parse_login",
    "parse_overrides",
    "seconds",
    "tokenbucket_settings",
]

# The features' own defaults, named once: DEFAULTS below and the messages quote them.
DENY_CACHE_MAX_AGE = 1.0
DENY_CACHE_MAX_KEYS = 100_000
OVERRIDES_MAX_AGE = 5.0
#: Seconds an expired override is kept (the admin shows it, its reason and author) before
#: cleanup deletes it: 30 days.
OVERRIDES_KEEP_EXPIRED = 30 * 24 * 3600
ANALYTICS_FLUSH = 10.0
ANALYTICS_TOP_KEYS = 20
ANALYTICS_MAX_KEYS = 1000

DEFAULT_BACKEND = "django_tokenbucket.backends.database.DatabaseBackend"

DEFAULTS: dict[str, Any] = {
    "BACKEND": DEFAULT_BACKEND,
    "OPTIONS": {},
    # Several stores at once, by alias as CACHES does: {"default": {"BACKEND": ...,
    # "OPTIONS": {...}}, "fast": {...}}; a limit picks one with "backend": "<alias>".
    # Without it, BACKEND and OPTIONS are the "default" alias.
    "BACKENDS": None,
    "LIMITS": {},
    "FAIL_OPEN": False,
    # Serialization failures and deadlocks, when the limiter owns the transaction.
    "RETRY_ATTEMPTS": 20,
    "RETRY_BASE_DELAY": 0.001,
    "RETRY_MAX_DELAY": 0.1,
    # "store": the database's (or Redis') clock; "app": this host's clock.
    "CLOCK": "store",
    # Client addresses (see django_tokenbucket.ip).
    "TRUSTED_PROXIES": None,
    "IP_HEADER": None,
    "IPV6_PREFIX": 64,
    # HTTP integrations.
    "RESPONSE": "django_tokenbucket.http.default_response",
    "HEADERS": False,
    # Keys from request data (post:, get:, header:, username) are NFKC-normalised and
    # stripped; also case-folded unless this is False (case-sensitive identifiers).
    "FOLD_KEY_CASE": True,
    # ...and accent-folded (víctim is victim): None decides by the database of the user
    # table (MySQL/MariaDB compare accents equal), True or False says so.
    "FOLD_KEY_ACCENTS": None,
    # CORS preflights (OPTIONS) are not counted by the decorator and the throttles.
    "COUNT_OPTIONS": False,
    # The secret of the HMAC that stored key digests use; None derives one from SECRET_KEY.
    "KEY_SECRET": None,
    # Operations: at most one warning per limit per this many seconds when the store
    # fails (see django_tokenbucket.logs); 0 logs every failure.
    "LOG_INTERVAL": 10,
    # Whether Django's django.request logger writes its WARNING for every 429 the
    # decorator and the middleware answer. Off: a flood of refused requests would be a
    # flood of log lines; the limiter logs one INFO line per key that starts being denied.
    "LOG_DENIED_REQUESTS": False,
    # Scheduled reserved work (see django_tokenbucket.celery.CELERY_DEFAULTS).
    "CELERY": {},
    # None, "prometheus" or "opentelemetry" (see django_tokenbucket.metrics).
    "METRICS": None,
    # Keys known to be denied are answered from this process' memory for at most
    # MAX_AGE seconds (see django_tokenbucket.deny_cache); False turns it off.
    "DENY_CACHE": {"MAX_AGE": DENY_CACHE_MAX_AGE, "MAX_KEYS": DENY_CACHE_MAX_KEYS},
    # Overrides made while the site runs (limiter.override, exempt, block) are seen by
    # every process within MAX_AGE seconds (see django_tokenbucket.overrides); False
    # turns them off, and with them the query each process makes per MAX_AGE.
    "OVERRIDES": {"MAX_AGE": OVERRIDES_MAX_AGE, "KEEP_EXPIRED": OVERRIDES_KEEP_EXPIRED},
    # Per-minute allowed/denied counts and the most denied keys, written to each limit's
    # store once per FLUSH seconds per process (see django_tokenbucket.analytics): for
    # the admin's charts and `tokenbucket top/stats`. None (off) or {"FLUSH": 10, ...}.
    "ANALYTICS": None,
    # Login protection (django_tokenbucket.auth, docs/login.md): in force while
    # AUTHENTICATION_BACKENDS lists LoginBackend; {} is its defaults, None or False off.
    "LOGIN": {},
}


class BackendSettings(NamedTuple):
    """One alias of ``TOKENBUCKET["BACKENDS"]``, and the setting to name in its errors."""

    path: str
    options: dict[str, Any]
    #: Where it is set, for messages: ``TOKENBUCKET`` (its BACKEND and OPTIONS) or
    #: ``TOKENBUCKET['BACKENDS']['fast']``.
    where: str


class TokenBucketSettings:
    """Attribute access to ``settings.TOKENBUCKET`` merged over DEFAULTS.

    Limits, backends and each feature's options are parsed lazily and kept until the
    setting changes (``reload``), so a broken entry is reported by the system checks or
    on first use, never at import.
    """

    def __init__(self) -> None:
        self._limits: dict[str, LimitConfig] | None = None
        self._backends: dict[str, BackendSettings] | None = None

    @property
    def user_settings(self) -> dict[str, Any]:
        value = getattr(settings, "TOKENBUCKET", {})
        if not isinstance(value, dict):
            raise ImproperlyConfigured(f"TOKENBUCKET must be a dict, not {type(value).__name__}")
        return value

    def __getattr__(self, attr: str) -> Any:
        # Reached only for a setting not read since the last reload: the value is then
        # kept as an instance attribute, which later reads find without this method
        # (several a decision, on every request).
        if attr not in DEFAULTS:
            raise AttributeError(f"invalid TOKENBUCKET setting {attr!r}")
        value = self.__dict__[attr] = self.user_settings.get(attr, DEFAULTS[attr])
        return value

    def limits(self) -> dict[str, LimitConfig]:
        """Return every limit in ``LIMITS``, parsed; raise ImproperlyConfigured on the first bad one."""
        if self._limits is None:
            raw = self.LIMITS
            if not isinstance(raw, dict):
                raise ImproperlyConfigured(
                    f"TOKENBUCKET['LIMITS'] must be a dict of name -> config, not {type(raw).__name__}"
                )
            self._limits = {name: parse_limit(name, spec) for name, spec in raw.items()}
        return self._limits

    def backends(self) -> dict[str, BackendSettings]:
        """Return every backend alias with its class path and options; raise ImproperlyConfigured if malformed."""
        if self._backends is None:
            self._backends = parse_backends(self.user_settings)
        return self._backends

    # The features' options: cached_property keeps each in the instance's __dict__, where
    # the decisions that read them (deny_cache and analytics, on every call) find it as
    # a plain attribute; a malformed one raises on every read and is never kept.

    @cached_property
    def deny_cache(self) -> DenyCacheSettings | None:
        """``DENY_CACHE`` validated (None: off); ImproperlyConfigured says what is wrong."""
        return _validated(parse_deny_cache, self.DENY_CACHE)

    @cached_property
    def overrides(self) -> OverridesSettings | None:
        """``OVERRIDES`` validated (None: off); ImproperlyConfigured says what is wrong."""
        return _validated(parse_overrides, self.OVERRIDES)

    @cached_property
    def analytics(self) -> AnalyticsSettings | None:
        """``ANALYTICS`` validated (None: off); ImproperlyConfigured says what is wrong."""
        return _validated(parse_analytics, self.ANALYTICS)

    @cached_property
    def login(self) -> LoginSettings | None:
        """``LOGIN`` validated, whether or not ``AUTHENTICATION_BACKENDS`` lists the login
        backend (None: LOGIN is None or False); ImproperlyConfigured says what is wrong."""
        return _validated(parse_login, self.LOGIN)

    def reload(self) -> None:
        """Forget every value read, so that the next read takes the current settings."""
        for attr in (*DEFAULTS, *_PARSED_ON_FIRST_READ):
            self.__dict__.pop(attr, None)
        self._limits = None
        self._backends = None


#: The features' options, each kept by a cached_property once parsed.
_PARSED_ON_FIRST_READ = tuple(
    name for name, value in vars(TokenBucketSettings).items() if isinstance(value, cached_property)
)

_Parsed = TypeVar("_Parsed")


def _validated(parse: Callable[[object], _Parsed], value: object) -> _Parsed:
    try:
        return parse(value)
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None


class OptionsNotADict(ImproperlyConfigured):
    """A backend's ``OPTIONS`` is not a dict (check E010; any other malformed BACKENDS is E018)."""


def feature_options(
    setting: str, value: object, known: Mapping[str, object], off: str = "False"
) -> Mapping[str, Any] | None:
    """Return ``TOKENBUCKET[setting]``, a feature's dict of options, checked for its keys.

    None (the feature is off) for ``None`` or ``False``; ``True`` is the defaults (``{}``).
    ``known`` maps each option to its default, shown in the message; ValueError says what
    is wrong. Each option's value is the feature's to check.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        example = ", ".join(f"{name!r}: {default!r}" for name, default in known.items())
        raise ValueError(f"TOKENBUCKET[{setting!r}] must be {off} or a dict such as {{{example}}}, not {value!r}")
    unknown = sorted(map(repr, set(value) - set(known)))
    if unknown:
        names = sorted(known)
        takes = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        raise ValueError(f"TOKENBUCKET[{setting!r}] has unknown key(s) {', '.join(unknown)}: it takes {takes}")
    return value


@dataclass(frozen=True)
class DenyCacheSettings:
    """``TOKENBUCKET["DENY_CACHE"]``, validated: how long and how many denials to remember
    (``django_tokenbucket.deny_cache``)."""

    #: Microseconds a denial is remembered at most (the staleness bound across processes).
    max_age: int
    max_keys: int


def parse_deny_cache(value: object) -> DenyCacheSettings | None:
    """Return the ``DENY_CACHE`` setting validated (None: off); ValueError says what is wrong."""
    value = feature_options("DENY_CACHE", value, DEFAULTS["DENY_CACHE"])
    if value is None:
        return None
    max_age = value.get("MAX_AGE", DENY_CACHE_MAX_AGE)
    if isinstance(max_age, bool) or not isinstance(max_age, (int, float)) or not 0 < max_age <= 3600:
        raise ValueError(
            f"TOKENBUCKET['DENY_CACHE']['MAX_AGE'] must be a number of seconds above 0 and at most 3600, "
            f"not {max_age!r}"
        )
    max_keys = value.get("MAX_KEYS", DENY_CACHE_MAX_KEYS)
    if type(max_keys) is not int or max_keys < 1:
        raise ValueError(
            f"TOKENBUCKET['DENY_CACHE']['MAX_KEYS'] must be a whole number of at least 1, not {max_keys!r}"
        )
    return DenyCacheSettings(max(1, int(max_age * MICRO)), max_keys)


#: The longest ``OVERRIDES["KEEP_EXPIRED"]``: 100 years.
_MOST_KEPT = 100 * 365 * 24 * 3600


@dataclass(frozen=True)
class OverridesSettings:
    """``TOKENBUCKET["OVERRIDES"]``, validated (``django_tokenbucket.overrides``)."""

    #: Seconds a snapshot is used before the version stamp is read again.
    max_age: float
    #: Seconds after its expiry that cleanup deletes an override; None keeps them all.
    keep_expired: float | None = OVERRIDES_KEEP_EXPIRED


def parse_overrides(value: object) -> OverridesSettings | None:
    """Return the ``OVERRIDES`` setting validated (None: off); ValueError says what is wrong."""
    value = feature_options("OVERRIDES", value, DEFAULTS["OVERRIDES"])
    if value is None:
        return None
    max_age = value.get("MAX_AGE", OVERRIDES_MAX_AGE)
    if isinstance(max_age, bool) or not isinstance(max_age, (int, float)) or not 0 < max_age <= 3600:
        raise ValueError(
            f"TOKENBUCKET['OVERRIDES']['MAX_AGE'] must be a number of seconds above 0 and at most 3600, not {max_age!r}"
        )
    keep = value.get("KEEP_EXPIRED", OVERRIDES_KEEP_EXPIRED)
    if keep is not None and (
        isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 <= keep <= _MOST_KEPT
    ):
        raise ValueError(
            f"TOKENBUCKET['OVERRIDES']['KEEP_EXPIRED'] must be a number of seconds from 0 to {_MOST_KEPT} (100 "
            f"years), or None to keep expired overrides for good, not {keep!r}"
        )
    return OverridesSettings(float(max_age), None if keep is None else float(keep))


@dataclass(frozen=True)
class AnalyticsSettings:
    """``TOKENBUCKET["ANALYTICS"]``, validated (``django_tokenbucket.analytics``)."""

    #: Seconds between two writes of this process' counts.
    flush: float
    #: Denied keys written per limit and minute, the most denied first.
    top_keys: int
    #: Distinct denied keys counted per limit and minute in memory.
    max_keys: int


def parse_analytics(value: object) -> AnalyticsSettings | None:
    """Return the ``ANALYTICS`` setting validated (None: off); ValueError says what is wrong."""
    defaults = {"FLUSH": ANALYTICS_FLUSH, "TOP_KEYS": ANALYTICS_TOP_KEYS, "MAX_KEYS": ANALYTICS_MAX_KEYS}
    value = feature_options("ANALYTICS", value, defaults, off="None")
    if value is None:
        return None
    flush_every = value.get("FLUSH", ANALYTICS_FLUSH)
    if isinstance(flush_every, bool) or not isinstance(flush_every, (int, float)) or not 0.1 <= flush_every <= 3600:
        raise ValueError(
            f"TOKENBUCKET['ANALYTICS']['FLUSH'] must be a number of seconds from 0.1 to 3600 (one write per "
            f"process per FLUSH), not {flush_every!r}"
        )
    top_keys = value.get("TOP_KEYS", ANALYTICS_TOP_KEYS)
    if type(top_keys) is not int or not 0 <= top_keys <= 1000:
        raise ValueError(
            f"TOKENBUCKET['ANALYTICS']['TOP_KEYS'] must be a whole number from 0 to 1000, not {top_keys!r}"
        )
    max_keys = value.get("MAX_KEYS", ANALYTICS_MAX_KEYS)
    if type(max_keys) is not int or not max(1, top_keys) <= max_keys <= 1_000_000:
        raise ValueError(
            f"TOKENBUCKET['ANALYTICS']['MAX_KEYS'] must be a whole number from TOP_KEYS ({top_keys}) to "
            f"1000000, not {max_keys!r}"
        )
    return AnalyticsSettings(float(flush_every), top_keys, max_keys)


#: What a login key can be made of, in the order a combination lists them.
LOGIN_PARTS = ("username", "ip", "user_agent")

#: Lockouts a key can have on record; more count as this many.
MOST_LOCKOUTS = 1000

LOGIN_DEFAULTS: dict[str, Any] = {
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
    #: Each entry of ``KEYS`` as the parts it is made of, in ``LOGIN_PARTS`` order.
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
        if not isinstance(parts, (list, tuple)) or not parts or any(part not in LOGIN_PARTS for part in parts):
            raise ValueError(
                f"KEYS: {entry!r} is not one of {', '.join(map(repr, LOGIN_PARTS))} or a tuple of them (a combination)"
            )
        if len(set(parts)) != len(parts):
            raise ValueError(f"KEYS: {entry!r} names a part twice")
        ordered = tuple(part for part in LOGIN_PARTS if part in parts)
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


def parse_login(value: object) -> LoginSettings | None:
    """Return ``TOKENBUCKET["LOGIN"]`` validated (None: off); ValueError says what is wrong."""
    options = feature_options("LOGIN", value, LOGIN_DEFAULTS, off="None, False")
    if options is None:
        return None
    merged = {**LOGIN_DEFAULTS, **options}
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


def parse_backends(user: dict[str, Any]) -> dict[str, BackendSettings]:
    """Read ``BACKENDS`` (or the top-level ``BACKEND``/``OPTIONS`` as its "default")."""
    aliases = user.get("BACKENDS")
    if aliases is None:
        options = user.get("OPTIONS", {})
        if not isinstance(options, dict):
            raise OptionsNotADict(f"TOKENBUCKET['OPTIONS'] must be a dict, not {type(options).__name__}")
        path = user.get("BACKEND", DEFAULT_BACKEND)
        return {DEFAULT_BACKEND_ALIAS: BackendSettings(path, options, "TOKENBUCKET")}
    if "BACKEND" in user or "OPTIONS" in user:
        raise ImproperlyConfigured(
            "TOKENBUCKET has both BACKENDS and BACKEND/OPTIONS: give the default store as "
            "BACKENDS['default'] and remove the top-level BACKEND and OPTIONS"
        )
    if not isinstance(aliases, dict) or DEFAULT_BACKEND_ALIAS not in aliases:
        raise ImproperlyConfigured(
            "TOKENBUCKET['BACKENDS'] must be a dict of alias -> {'BACKEND': ..., 'OPTIONS': {...}} "
            f"with a 'default' alias, not {aliases!r}"
        )
    parsed = {}
    for alias, entry in aliases.items():
        where = f"TOKENBUCKET['BACKENDS'][{alias!r}]"
        if not isinstance(alias, str) or not isinstance(entry, dict):
            raise ImproperlyConfigured(f"{where} must be a dict such as {{'BACKEND': {DEFAULT_BACKEND!r}}}")
        unknown = sorted(map(repr, set(entry) - {"BACKEND", "OPTIONS"}))
        if unknown:
            raise ImproperlyConfigured(f"{where} has unknown key(s) {', '.join(unknown)}: it takes BACKEND and OPTIONS")
        options = entry.get("OPTIONS", {})
        if not isinstance(options, dict):
            raise OptionsNotADict(f"{where}['OPTIONS'] must be a dict, not {type(options).__name__}")
        parsed[alias] = BackendSettings(entry.get("BACKEND", DEFAULT_BACKEND), options, where)
    return parsed


tokenbucket_settings = TokenBucketSettings()
