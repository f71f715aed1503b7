"""System checks: a broken rate-limit setup fails ``manage.py check``, not a request."""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.urls import get_resolver
from django.utils.module_loading import import_string

from .backends import backend_class
from .decorators import declared_limits, declared_stacks
from .ip import ip_settings_problems
from .limits import DEFAULT_BACKEND_ALIAS, parse_limit
from .settings import DEFAULT_BACKEND, DEFAULTS, parse_backends

__all__ = ["check_backends", "check_settings"]

_SETTINGS_HINT = "See the settings reference in the django_tokenbucket docs (docs/settings.md)."


@checks.register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    user = getattr(settings, "TOKENBUCKET", {})
    if not isinstance(user, dict):
        return [
            checks.Error(
                f"TOKENBUCKET must be a dict, not {type(user).__name__}.",
                hint=_SETTINGS_HINT,
                id="django_tokenbucket.E001",
            )
        ]
    unknown = sorted(set(user) - set(DEFAULTS))
    if unknown:
        errors.append(
            checks.Warning(
                f"TOKENBUCKET has unknown setting(s): {', '.join(map(repr, unknown))}.",
                hint=f"Known settings: {', '.join(sorted(DEFAULTS))}.",
                id="django_tokenbucket.W002",
            )
        )

    limits = user.get("LIMITS", {})
    if not isinstance(limits, dict):
        errors.append(
            checks.Error(
                f"TOKENBUCKET['LIMITS'] must be a dict of name -> config, not {type(limits).__name__}.",
                hint="For example: {'login': {'kind': 'token bucket', 'rate': '5/m'}}.",
                id="django_tokenbucket.E002",
            )
        )
        limits = {}
    folded: dict[str, str] = {}
    for name, spec in limits.items():
        try:
            parse_limit(name, spec)
        except ImproperlyConfigured as exc:
            errors.append(
                checks.Error(
                    str(exc),
                    hint="A limit is a rate string ('10/m', '5/10m', '1000/day') or a dict with "
                    "'rate' (and 'period' for a numeric rate), optional 'kind', 'capacity', "
                    "'max_reserved' and, for fixed windows, 'start'.",
                    obj=f"TOKENBUCKET['LIMITS'][{name!r}]",
                    id="django_tokenbucket.E003",
                )
            )
        if isinstance(name, str):
            other = folded.setdefault(name.casefold(), name)
            if other != name:
                errors.append(
                    checks.Error(
                        f"rate limits {other!r} and {name!r} differ only in case.",
                        hint="Databases with case-insensitive collations (MySQL, MariaDB) would "
                        "store them as one limit; rename one of them.",
                        id="django_tokenbucket.E004",
                    )
                )


    if not isinstance(user.get("FAIL_OPEN", False), bool):
        errors.append(
            checks.Error(
                f"TOKENBUCKET['FAIL_OPEN'] must be True or False, not {user['FAIL_OPEN']!r}.",
                id="django_tokenbucket.E006",
            )
        )
    if user.get("CLOCK", "store") not in ("store", "app"):
        errors.append(
            checks.Error(
                f"TOKENBUCKET['CLOCK'] must be 'store' or 'app', not {user['CLOCK']!r}.",
                hint="'store' (the default) takes time from the database or Redis, so that "
                "app servers with skewed clocks agree.",
                id="django_tokenbucket.E007",
            )
        )
    for problem in ip_settings_problems(
        user.get("TRUSTED_PROXIES", DEFAULTS["TRUSTED_PROXIES"]),
        user.get("IP_HEADER", DEFAULTS["IP_HEADER"]),
        user.get("IPV6_PREFIX", DEFAULTS["IPV6_PREFIX"]),
    ):
        errors.append(
            checks.Error(
                f"TOKENBUCKET: {problem}.",
                hint="Client addresses decide whose bucket a request uses: see the decorator docs "
                "(docs/decorator.md, 'Client addresses').",
                id="django_tokenbucket.E012",
            )
        )
    ip_header, trusted = user.get("IP_HEADER"), user.get("TRUSTED_PROXIES")
    if ip_header and not isinstance(trusted, (list, tuple)):
        errors.append(
            checks.Warning(
                f"TOKENBUCKET['IP_HEADER'] = {ip_header!r} is ignored: it is honoured only on requests "
                f"from a trusted proxy given by its address, and TRUSTED_PROXIES is {trusted!r}.",
                hint="Give TRUSTED_PROXIES as the CIDRs of the proxies that set the header, e.g. ['10.0.0.0/8'].",
                id="django_tokenbucket.W003",
            )
        )
    for setting in ("FOLD_KEY_CASE", "COUNT_OPTIONS", "HEADERS"):
        if not isinstance(user.get(setting, DEFAULTS[setting]), bool):
            errors.append(
                checks.Error(
                    f"TOKENBUCKET[{setting!r}] must be True or False, not {user[setting]!r}.",
                    id="django_tokenbucket.E016",
                )
            )
    errors += _check_operations(user)
    secret = user.get("KEY_SECRET")
    if secret is not None and not (isinstance(secret, (str, bytes)) and len(secret) >= 16):
        errors.append(
            checks.Error(
                "TOKENBUCKET['KEY_SECRET'] must be None (derived from SECRET_KEY) or a str or bytes of "
                "at least 16 characters.",
                hint="A short or guessable secret lets anyone with the rows recover keys such as addresses.",
                id="django_tokenbucket.E017",
            )
        )
    for setting in ("RETRY_ATTEMPTS", "RETRY_BASE_DELAY", "RETRY_MAX_DELAY"):
        value = user.get(setting, DEFAULTS[setting])
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value < 0
            or (setting == "RETRY_ATTEMPTS" and (not isinstance(value, int) or value < 1))
        ):
            errors.append(
                checks.Error(
                    f"TOKENBUCKET[{setting!r}] must be a non-negative number "
                    f"(a positive integer for RETRY_ATTEMPTS), not {value!r}.",
                    id="django_tokenbucket.E008",
                )
            )
    return errors


def _check_operations(user: dict[str, Any]) -> list[checks.CheckMessage]:
    """Check RESPONSE and LOG_INTERVAL, which are otherwise read only when needed.

    A bad RESPONSE would fail at the first 429; a bad LOG_INTERVAL would quietly become
    the default. (``CELERY`` is the Celery integration's: ``celery.checks``.)
    """
    errors: list[checks.CheckMessage] = []
    response = user.get("RESPONSE", DEFAULTS["RESPONSE"])
    problem = None
    if isinstance(response, str):
        try:
            response = import_string(response)
        except ImportError as exc:
            problem = f"cannot be imported: {exc}"
    if problem is None and not callable(response):
        problem = "is not callable"
    if problem:
        errors.append(
            checks.Error(
                f"TOKENBUCKET['RESPONSE'] = {user['RESPONSE']!r} {problem}.",
                hint="Give a callable (request, status) -> HttpResponse, or its dotted path.",
                id="django_tokenbucket.E023",
            )
        )
    interval = user.get("LOG_INTERVAL", DEFAULTS["LOG_INTERVAL"])
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval < math.inf:
        errors.append(
            checks.Error(
                f"TOKENBUCKET['LOG_INTERVAL'] must be a number of seconds >= 0 (0 logs every store failure), "
                f"not {interval!r}.",
                id="django_tokenbucket.E024",
            )
        )
    return errors


@checks.register(checks.Tags.caches)  # tagged so that ``check --tag caches`` includes the Redis ones
def check_backends(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check every backend alias (each backend checks its own OPTIONS) and the limits' aliases."""
    user = getattr(settings, "TOKENBUCKET", {})
    if not isinstance(user, dict):
        return []  # reported by check_settings (E001)
    try:
        configured = parse_backends(user)
    except ImproperlyConfigured as exc:
        options_not_dict = "OPTIONS'] must be a dict" in str(exc)
        return [
            checks.Error(
                f"{exc}.",
                hint=_BACKENDS_HINT,
                id="django_tokenbucket.E010" if options_not_dict else "django_tokenbucket.E018",
            )
        ]
    messages: list[checks.CheckMessage] = []
    for path, options, where in configured.values():
        try:
            found = backend_class(path, f"{where}['BACKEND']")
        except ImproperlyConfigured as exc:
            messages.append(
                checks.Error(f"{exc}.", hint=f"The default is {DEFAULT_BACKEND!r}.", id="django_tokenbucket.E005")
            )
            continue
        messages += found.check_options(options, where)
    limits = user.get("LIMITS", {})
    for name, spec in limits.items() if isinstance(limits, dict) else ():
        alias = spec.get("backend", DEFAULT_BACKEND_ALIAS) if isinstance(spec, dict) else DEFAULT_BACKEND_ALIAS
        if isinstance(alias, str) and alias not in configured:
            messages.append(
                checks.Error(
                    f"Rate limit {name!r} is stored on backend {alias!r}, which is not in TOKENBUCKET['BACKENDS'] "
                    f"(aliases: {', '.join(map(repr, configured))}).",
                    hint=_BACKENDS_HINT,
                    id="django_tokenbucket.E019",
                )
            )
    return messages


_BACKENDS_HINT = (
    "TOKENBUCKET = {'BACKENDS': {'default': {'BACKEND': ..., 'OPTIONS': {...}}, 'fast': {...}}}, and "
    "'backend': 'fast' in a limit's config (docs/settings.md#backends)."
)


@checks.register(checks.Tags.urls)
def check_declared_limits(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Report ``@ratelimit("name")`` decorators whose name is not in LIMITS.

    The URLconf is loaded first so that every decorated view has been imported.
    """
    try:
        get_resolver().url_patterns  # noqa: B018  (importing the views registers their limits)
    except Exception:  # a broken URLconf is reported by Django's own URL checks
        return []
    user = getattr(settings, "TOKENBUCKET", {})
    limits = user.get("LIMITS", {}) if isinstance(user, dict) else None
    if not isinstance(limits, dict):
        return []  # reported by check_settings (E001/E002)
    messages: list[checks.CheckMessage] = [
        checks.Error(
            f"{view} uses rate limit {name!r}, which is not in TOKENBUCKET['LIMITS'].",
            hint="Define it in TOKENBUCKET['LIMITS'], or give @ratelimit a rate= to define it inline.",
            obj=view,
            id="django_tokenbucket.E011",
        )
        for name, view in sorted(declared_limits().items())
        if name not in limits
    ]
    # A stack of @ratelimit is decided all-or-nothing: on one backend, or not at all.
    for view, stack in sorted(declared_stacks().items()):
        stores: dict[str, list[str]] = {}
        for name, inline in stack:
            spec = inline if inline is not None else limits.get(name)
            alias = spec.get("backend", DEFAULT_BACKEND_ALIAS) if isinstance(spec, dict) else DEFAULT_BACKEND_ALIAS
            stores.setdefault(str(alias), []).append(name)
        if len(stores) > 1:
            where = "; ".join(f"{alias!r}: {', '.join(map(repr, names))}" for alias, names in stores.items())
            messages.append(
                checks.Error(
                    f"{view} stacks @ratelimit on limits stored on different backends ({where}); a request "
                    f"is decided on all of them at once, all-or-nothing, which two stores cannot do.",
                    hint="Give the limits of one view the same 'backend'.",
                    obj=view,
                    id="django_tokenbucket.E022",
                )
            )
    return messages


