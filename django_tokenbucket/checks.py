"""System checks: a broken rate-limit setup fails ``manage.py check``, not a request."""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, router
from django.urls import get_resolver
from django.utils.module_loading import import_string

from . import catalogue
from .backends import backend_class
from .collation import column_comparison
from .decorators import declared_limits, declared_stacks
from .ip import ip_settings_problems
from .limits import DEFAULT_BACKEND_ALIAS, parse_limit
from .metrics import metrics_problem
from .request_keys import address_keyed_views, key_folding, normalize_identity
from .settings import DEFAULT_BACKEND, DEFAULTS, OptionsNotADict, parse_backends, tokenbucket_settings

__all__ = ["check_backends", "check_key_folding", "check_settings"]


@checks.register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    user = getattr(settings, "TOKENBUCKET", {})
    if not isinstance(user, dict):
        return [catalogue.E001(type=type(user).__name__)]
    unknown = sorted(set(user) - set(DEFAULTS))
    if unknown:
        errors.append(catalogue.W002(names=", ".join(map(repr, unknown)), known=", ".join(sorted(DEFAULTS))))

    limits = user.get("LIMITS", {})
    if not isinstance(limits, dict):
        errors.append(catalogue.E002(type=type(limits).__name__))
        limits = {}
    folded: dict[str, str] = {}
    for name, spec in limits.items():
        try:
            parse_limit(name, spec)
        except ImproperlyConfigured as exc:
            errors.append(catalogue.E003(obj=f"TOKENBUCKET['LIMITS'][{name!r}]", error=exc))
        if isinstance(name, str):
            other = folded.setdefault(name.casefold(), name)
            if other != name:
                errors.append(catalogue.E004(first=other, second=name))

    if not isinstance(user.get("FAIL_OPEN", False), bool):
        errors.append(catalogue.E006(value=user["FAIL_OPEN"]))
    if user.get("CLOCK", "store") not in ("store", "app"):
        errors.append(catalogue.E007(value=user["CLOCK"]))
    for problem in ip_settings_problems(
        user.get("TRUSTED_PROXIES", DEFAULTS["TRUSTED_PROXIES"]),
        user.get("IP_HEADER", DEFAULTS["IP_HEADER"]),
        user.get("IPV6_PREFIX", DEFAULTS["IPV6_PREFIX"]),
    ):
        errors.append(catalogue.E012(problem=problem))
    ip_header, trusted = user.get("IP_HEADER"), user.get("TRUSTED_PROXIES")
    if ip_header and not isinstance(trusted, (list, tuple)):
        errors.append(catalogue.W003(header=ip_header, trusted=trusted))
    for setting in ("FOLD_KEY_CASE", "COUNT_OPTIONS", "HEADERS"):
        if not isinstance(user.get(setting, DEFAULTS[setting]), bool):
            errors.append(catalogue.E016(setting=setting, value=user[setting]))
    if user.get("FOLD_KEY_ACCENTS") not in (None, True, False):
        errors.append(catalogue.E054(value=user["FOLD_KEY_ACCENTS"]))
    errors += _check_operations(user)
    secret = user.get("KEY_SECRET")
    if secret is not None and not (isinstance(secret, (str, bytes)) and len(secret) >= 16):
        errors.append(catalogue.E017())
    for setting in ("RETRY_ATTEMPTS", "RETRY_BASE_DELAY", "RETRY_MAX_DELAY"):
        value = user.get(setting, DEFAULTS[setting])
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value < 0
            or (setting == "RETRY_ATTEMPTS" and (not isinstance(value, int) or value < 1))
        ):
            errors.append(catalogue.E008(setting=setting, value=value))
    return errors


def _check_operations(user: dict[str, Any]) -> list[checks.CheckMessage]:
    """Check RESPONSE, LOG_INTERVAL, METRICS, DENY_CACHE and OVERRIDES, which are otherwise read only when needed.

    A bad RESPONSE would fail at the first 429, a bad METRICS at the first decision; a
    bad LOG_INTERVAL would quietly become the default. (``CELERY`` is the Celery integration's: ``celery.checks``.)
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
        errors.append(catalogue.E023(value=user["RESPONSE"], problem=problem))
    interval = user.get("LOG_INTERVAL", DEFAULTS["LOG_INTERVAL"])
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval < math.inf:
        errors.append(catalogue.E024(value=interval))
    metrics = metrics_problem(user.get("METRICS", DEFAULTS["METRICS"]))
    if metrics is not None:
        errors.append(catalogue.E050(problem=metrics))
    # Each feature's options as the feature reads them: the same object, the same message.
    features = (("deny_cache", catalogue.E051), ("overrides", catalogue.E052), ("analytics", catalogue.E053))
    for feature, check in features:
        try:
            attrgetter(feature)(tokenbucket_settings)
        except ImproperlyConfigured as exc:
            errors.append(check(error=exc))
    return errors


@checks.register(checks.Tags.caches)  # tagged so that ``check --tag caches`` includes the Redis ones
def check_backends(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check every backend alias (each backend checks its own OPTIONS) and the limits' aliases."""
    user = getattr(settings, "TOKENBUCKET", {})
    if not isinstance(user, dict):
        return []  # reported by check_settings (E001)
    try:
        configured = parse_backends(user)
    except OptionsNotADict as exc:
        return [catalogue.E010(error=exc)]
    except ImproperlyConfigured as exc:
        return [catalogue.E018(error=exc)]
    messages: list[checks.CheckMessage] = []
    for path, options, where in configured.values():
        try:
            found = backend_class(path, f"{where}['BACKEND']")
        except ImproperlyConfigured as exc:
            messages.append(catalogue.E005(error=exc, default=DEFAULT_BACKEND))
            continue
        messages += found.check_options(options, where)
    limits = user.get("LIMITS", {})
    for name, spec in limits.items() if isinstance(limits, dict) else ():
        alias = spec.get("backend", DEFAULT_BACKEND_ALIAS) if isinstance(spec, dict) else DEFAULT_BACKEND_ALIAS
        if isinstance(alias, str) and alias not in configured:
            messages.append(catalogue.E019(name=name, alias=alias, aliases=", ".join(map(repr, configured))))
    return messages


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
        catalogue.E011(obj=view, view=view, name=name)
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
            messages.append(catalogue.E022(obj=view, view=view, where=where))
    for view, specs in sorted(address_keyed_views().items()):
        messages += [catalogue.W005(obj=view, view=view, key=spec) for spec in specs]
    return messages


#: Spellings of one name that some database collation takes for one (case, accents,
#: letters with a stroke, ligatures, characters it ignores, other scripts' digits):
#: what the database check asks the user table's column about.
SPELLING_PROBES = (
    ("victim", "VICTIM"),
    ("victim", "víctim"),
    ("victim", "vìctim"),
    ("victim", "vîctim"),
    ("victim", "vïctim"),
    ("victim", "VÍCTIM"),
    ("victim", "vıctim"),
    ("victim", "vic\u200btim"),
    ("victim", "vic\u00adtim"),
    ("strasse", "straße"),
    ("rose", "roße"),
    ("orsted", "ørsted"),
    ("lukasz", "łukasz"),
    ("dana", "đana"),
    ("aeon", "æon"),
    ("oeuvre", "œuvre"),
    ("user1", "user\u0661"),
)


@checks.register(checks.Tags.database)
def check_key_folding(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Say how keys of request data are folded, and warn when the user table's username
    column takes two spellings for one name that the keys keep apart (``check --database``).

    The folding in force is decided without a query (``request_keys.key_folding``); this
    asks the database itself, about the column a login looks names up in.
    """
    user_model = get_user_model()
    alias = router.db_for_read(user_model)
    if not databases or alias not in databases:
        return []
    folding = key_folding()
    field_column = getattr(user_model._meta.get_field(user_model.USERNAME_FIELD), "column", None)
    column = f"{user_model._meta.db_table}.{field_column} on database {alias!r}"
    comparison = column_comparison(alias, user_model._meta.db_table, field_column) if field_column else None
    try:
        equal = comparison.equal(SPELLING_PROBES) if comparison is not None else None
    except DatabaseError:
        equal = None
    if comparison is None or equal is None:
        compares = "could not be read (no table yet, or a database this check cannot ask)"
        return _folding_info(folding, column, compares)
    for (first, second), same in zip(SPELLING_PROBES, equal):
        if same and normalize_identity(first) != normalize_identity(second):
            return [
                catalogue.W004(
                    folding=folding,
                    reason=folding.reason,
                    column=column,
                    collation=comparison.collation,
                    first=first,
                    second=second,
                )
            ]
    compares = (
        f"has collation {comparison.collation}: each pair of {len(SPELLING_PROBES)} spellings it was asked about "
        f"({sum(equal)} of them one name to it) has one key"
    )
    return _folding_info(folding, column, compares)


def _folding_info(folding: Any, column: str, compares: str) -> list[checks.CheckMessage]:
    """I001, where there is something to say: accents are folded (MySQL/MariaDB, or the
    setting). The default elsewhere (case folded, accents kept) would be a line on every
    ``migrate`` of every project, saying nothing it needs to act on."""
    if not folding.accents:
        return []
    return [catalogue.I001(folding=folding, reason=folding.reason, column=column, compares=compares)]
