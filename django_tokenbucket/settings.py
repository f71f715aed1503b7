"""The ``TOKENBUCKET`` setting, read with defaults and re-read when it changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

from .limits import DEFAULT_BACKEND_ALIAS, LimitConfig, parse_limit

__all__ = ["DEFAULTS", "BackendSettings", "OptionsNotADict", "tokenbucket_settings"]

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
    "DENY_CACHE": {"MAX_AGE": 1.0, "MAX_KEYS": 100_000},
    # Overrides made while the site runs (limiter.override, exempt, block) are seen by
    # every process within MAX_AGE seconds (see django_tokenbucket.overrides); False
    # turns them off, and with them the query each process makes per MAX_AGE.
    "OVERRIDES": {"MAX_AGE": 5.0, "KEEP_EXPIRED": 30 * 24 * 3600},
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

    Limits are parsed lazily and cached until the setting changes, so a broken entry
    is reported by the system checks or on first use, never at import.
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

    def reload(self) -> None:
        for attr in DEFAULTS:
            self.__dict__.pop(attr, None)
        self._limits = None
        self._backends = None


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


@receiver(setting_changed)
def _reload_settings(*, setting: str, **kwargs: Any) -> None:
    if setting == "TOKENBUCKET":
        # The backends, built from these settings, are forgotten by django_tokenbucket.backends.
        tokenbucket_settings.reload()
