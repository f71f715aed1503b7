"""System checks of the DRF integration: every throttle rate and scope, checked before a request.

Registered by ``apps.ready()`` when DRF is installed, whether or not ``rest_framework``
is in ``INSTALLED_APPS``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.urls import get_resolver
from rest_framework.settings import api_settings

from .. import catalogue
from ..limits import DEFAULT_BACKEND_ALIAS
from ..rates import parse_rate
from .throttles import ScopedRateThrottle, SimpleRateThrottle, declared_throttle_rates

__all__ = ["check_throttle_rates"]


@checks.register(checks.Tags.urls)
def check_throttle_rates(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check every DRF throttle rate we can see, so that none fails at request time.

    ``DEFAULT_THROTTLE_RATES`` (E030), the ``rate`` and ``THROTTLE_RATES`` of the
    throttle classes imported with the URLconf (E031), and that each scope used by our
    throttles in ``DEFAULT_THROTTLE_CLASSES`` or by a view's ``throttle_scope`` has a
    rate (E032). Runs whether ``rest_framework`` is in ``INSTALLED_APPS`` or not.
    """
    try:
        patterns = get_resolver().url_patterns  # importing the views imports their throttles
    except Exception:  # a broken URLconf is reported by Django's own URL checks
        patterns = []
    messages: list[checks.CheckMessage] = []
    default_rates = api_settings.DEFAULT_THROTTLE_RATES or {}
    settings_rates = [
        (f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'][{scope!r}]", rate) for scope, rate in default_rates.items()
    ]
    for check, sources in ((catalogue.E030, settings_rates), (catalogue.E031, declared_throttle_rates().values())):
        for where, rate in sources:
            if rate is None:
                continue
            try:
                parse_rate(rate)  # type: ignore[arg-type]  # anything a user wrote; parse_rate says what is wrong
            except ValueError as exc:
                messages.append(check(where=where, error=exc))
    known = set(default_rates) | set(declared_throttle_rates()) | set(_limit_names())
    try:
        classes = list(api_settings.DEFAULT_THROTTLE_CLASSES)
    except ImportError as exc:
        return [*messages, catalogue.E033(error=exc)]
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
    return [catalogue.E026(obj=view, view=name, where=where)]


def _no_rate(scope: str, where: str) -> checks.CheckMessage:
    return catalogue.E032(scope=scope, where=where)


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
