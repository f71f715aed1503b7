"""System checks: a broken rate-limit setup fails ``manage.py check``, not a request."""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.urls import get_resolver
from django.utils.module_loading import import_string

from .backends import backend_class, is_django_redis
from .decorators import declared_limits, declared_stacks
from .ip import ip_settings_problems
from .limits import DEFAULT_BACKEND_ALIAS, parse_limit
from .rates import parse_rate
from .reservations import CELERY_DEFAULTS
from .settings import DEFAULT_BACKEND, DEFAULTS, parse_backends

try:
    from rest_framework.settings import api_settings as drf_settings

    from . import throttling
except ImportError:  # DRF is not installed: there are no throttles to check
    throttling = None  # type: ignore[assignment]

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
    """Check RESPONSE, LOG_INTERVAL and CELERY, which are otherwise read only when needed.

    A bad RESPONSE would fail at the first 429; a bad LOG_INTERVAL would quietly become
    the default; a bad CELERY value would surface in a worker.
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
    errors += _check_celery(user.get("CELERY", {}))
    return errors


def _check_celery(given: object) -> list[checks.CheckMessage]:
    def error(message: str) -> checks.Error:
        return checks.Error(f"TOKENBUCKET['CELERY']{message}.", id="django_tokenbucket.E025")

    if not isinstance(given, dict):
        return [error(f" must be a dict, not {type(given).__name__}")]
    errors: list[checks.CheckMessage] = []
    unknown = sorted(map(repr, set(given) - set(CELERY_DEFAULTS)))
    if unknown:
        errors.append(error(f" has unknown setting(s) {', '.join(unknown)}; it takes {', '.join(CELERY_DEFAULTS)}"))
    for name, value in given.items():
        if name not in CELERY_DEFAULTS or (name == "KEEP_FINISHED" and value is None):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
        if not number or (name == "BATCH_SIZE" and not isinstance(value, int)):
            kind = "a whole number > 0" if name == "BATCH_SIZE" else "a number of seconds > 0"
            if name == "KEEP_FINISHED":
                kind += " or None"
            errors.append(error(f"[{name!r}] must be {kind}, not {value!r}"))
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


# -- DRF throttles and the django-ratelimit compatibility layer --------------------------


@checks.register(checks.Tags.urls)
def check_throttle_rates(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check every DRF throttle rate we can see, so that none fails at request time.

    ``DEFAULT_THROTTLE_RATES`` (E030), the ``rate`` and ``THROTTLE_RATES`` of the
    throttle classes imported with the URLconf (E031), and that each scope used by our
    throttles in ``DEFAULT_THROTTLE_CLASSES`` or by a view's ``throttle_scope`` has a
    rate (E032). Runs whether ``rest_framework`` is in ``INSTALLED_APPS`` or not.
    """
    if throttling is None:  # DRF is not installed: there are no throttles
        return []
    api_settings = drf_settings
    ScopedRateThrottle, SimpleRateThrottle = throttling.ScopedRateThrottle, throttling.SimpleRateThrottle
    declared_throttle_rates = throttling.declared_throttle_rates
    try:
        patterns = get_resolver().url_patterns  # importing the views imports their throttles
    except Exception:  # a broken URLconf is reported by Django's own URL checks
        patterns = []
    messages: list[checks.CheckMessage] = []
    default_rates = api_settings.DEFAULT_THROTTLE_RATES or {}
    sources: list[tuple[str, object]] = [
        (f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'][{scope!r}]", rate) for scope, rate in default_rates.items()
    ]
    sources += list(declared_throttle_rates().values())
    for where, rate in sources:
        if rate is None:
            continue
        try:
            parse_rate(rate)  # type: ignore[arg-type]  # anything a user wrote; parse_rate says what is wrong
        except ValueError as exc:
            messages.append(
                checks.Error(
                    f"{where}: {exc}",
                    hint="DRF spellings work: '100/day', '60/min', '3/sec', '1/hr'; also '5/10m'.",
                    id="django_tokenbucket.E030" if where.startswith("REST_FRAMEWORK") else "django_tokenbucket.E031",
                )
            )
    known = set(default_rates) | set(declared_throttle_rates()) | set(_limit_names())
    try:
        classes = list(api_settings.DEFAULT_THROTTLE_CLASSES)
    except ImportError as exc:
        return [
            *messages,
            checks.Error(f"REST_FRAMEWORK['DEFAULT_THROTTLE_CLASSES']: {exc}", id="django_tokenbucket.E032"),
        ]
    scoped_views = [
        (view, view.throttle_scope) for view in _api_views(patterns) if getattr(view, "throttle_scope", None)
    ]
    for view, scope in scoped_views:
        if any(
            isinstance(c, type) and issubclass(c, ScopedRateThrottle)
            for c in getattr(view, "throttle_classes", classes)
        ):
            for name in [scope] if isinstance(scope, str) else list(scope):
                if name not in known:
                    messages.append(_no_rate(name, f"{view.__module__}.{view.__qualname__}.throttle_scope"))
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, SimpleRateThrottle)) or issubclass(cls, ScopedRateThrottle):
            continue
        own_rates = cls.THROTTLE_RATES if cls.THROTTLE_RATES is not None else {}
        scopes = list(cls.scopes) or ([cls.scope] if cls.scope else [])
        for name in scopes:
            if not cls.rate and name not in known and name not in own_rates:
                messages.append(_no_rate(name, f"{cls.__module__}.{cls.__qualname__}"))
    for view in _api_views(patterns):
        messages += _throttles_on_two_backends(view, classes, ScopedRateThrottle, SimpleRateThrottle)
    return messages


def _throttles_on_two_backends(view: Any, default_classes: list[Any], scoped: Any, simple: Any) -> list[Any]:
    """Report a view whose throttles take from limits on two backends (E026).

    A view's throttles are decided together, all-or-nothing, which two stores cannot do;
    at request time such a view would answer as if the store were down.
    """
    user = getattr(settings, "TOKENBUCKET", {})
    limits = user.get("LIMITS", {}) if isinstance(user, dict) else {}
    limits = limits if isinstance(limits, dict) else {}
    scopes: list[str] = []
    for cls in getattr(view, "throttle_classes", default_classes):
        if not (isinstance(cls, type) and issubclass(cls, simple)) or getattr(cls, "rate", None):
            continue
        if issubclass(cls, scoped):
            scope = getattr(view, getattr(cls, "scope_attr", "throttle_scope"), None)
            scopes += [scope] if isinstance(scope, str) else list(scope or ())
        else:
            own = getattr(cls, "scope", None)
            scopes += list(getattr(cls, "scopes", ())) or ([own] if own else [])
    stores: dict[str, list[str]] = {}
    for scope in scopes:
        spec = limits.get(scope)
        alias = spec.get("backend", DEFAULT_BACKEND_ALIAS) if isinstance(spec, dict) else DEFAULT_BACKEND_ALIAS
        stores.setdefault(str(alias), []).append(scope)
    if len(stores) < 2:
        return []
    where = "; ".join(f"{alias!r}: {', '.join(map(repr, names))}" for alias, names in stores.items())
    name = f"{view.__module__}.{view.__qualname__}"
    return [
        checks.Error(
            f"{name}'s throttles take from limits stored on different backends ({where}); they are decided "
            f"together, all-or-nothing, which two stores cannot do.",
            hint="Give the scopes' limits in TOKENBUCKET['LIMITS'] the same 'backend'.",
            obj=view,
            id="django_tokenbucket.E026",
        )
    ]


def _no_rate(scope: str, where: str) -> checks.Error:
    return checks.Error(
        f"throttle scope {scope!r} ({where}) has no rate: every request it meets would fail.",
        hint="Add it to REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] (None switches it off) or TOKENBUCKET['LIMITS'].",
        id="django_tokenbucket.E032",
    )


def _limit_names() -> list[str]:
    user = getattr(settings, "TOKENBUCKET", {})
    limits = user.get("LIMITS", {}) if isinstance(user, dict) else {}
    return list(limits) if isinstance(limits, dict) else []


def _api_views(patterns: Any) -> list[Any]:
    """Return the view classes (``as_view()``'s ``cls``/``view_class``) of a URLconf's patterns."""
    views = []
    for pattern in patterns:
        if hasattr(pattern, "url_patterns"):
            views += _api_views(pattern.url_patterns)
            continue
        callback = getattr(pattern, "callback", None)
        view = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
        if isinstance(view, type):
            views.append(view)
    return views


@checks.register(checks.Tags.caches)
def check_ratelimit_compat(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check the ``RATELIMIT_*`` settings read by ``django_tokenbucket.compat.ratelimit``."""
    messages: list[checks.CheckMessage] = []
    alias = getattr(settings, "RATELIMIT_USE_CACHE", None)
    caches = getattr(settings, "CACHES", {})
    if alias is not None:
        if alias not in caches:
            messages.append(
                checks.Error(
                    f"RATELIMIT_USE_CACHE = {alias!r} is not an alias in CACHES.",
                    hint="Name a cache in CACHES, or remove the setting to use TOKENBUCKET's backend.",
                    id="django_tokenbucket.E040",
                )
            )
        else:
            backend = caches[alias].get("BACKEND", "")
            if not is_django_redis(backend) and backend != "django.core.cache.backends.dummy.DummyCache":
                messages.append(
                    checks.Warning(
                        f"RATELIMIT_USE_CACHE = {alias!r} is a {backend}, which cannot hold a limit atomically: "
                        "django_tokenbucket.compat.ratelimit keeps its limits in TOKENBUCKET's backend instead.",
                        hint="Nothing to do if that is what you want; a django-redis cache is used as a Redis backend.",
                        id="django_tokenbucket.W040",
                    )
                )
    for setting, bits in (("RATELIMIT_IPV4_MASK", 32), ("RATELIMIT_IPV6_MASK", 128)):
        mask = getattr(settings, setting, bits if bits == 32 else 64)
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask <= bits:
            messages.append(
                checks.Error(
                    f"{setting} must be a prefix length from 0 to {bits}, not {mask!r}.", id="django_tokenbucket.E041"
                )
            )
    exception_class = getattr(settings, "RATELIMIT_EXCEPTION_CLASS", None)
    if isinstance(exception_class, str):
        try:
            import_string(exception_class)
        except ImportError as exc:
            messages.append(
                checks.Error(f"RATELIMIT_EXCEPTION_CLASS = {exception_class!r}: {exc}", id="django_tokenbucket.E042")
            )
    return messages
