"""System checks of login protection (``E060``-``E063``, ``W060``-``W062``)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from .. import catalogue
from ..backends import get_backend
from ..settings import seconds, tokenbucket_settings
from .backend import LoginBackend

__all__ = ["check_login"]


def _listed_before() -> list[str] | None:
    """The backends listed before LoginBackend; None when it is not listed."""
    before = []
    for path in getattr(settings, "AUTHENTICATION_BACKENDS", ()):
        try:
            backend = import_string(path)
        except ImportError:
            before.append(path)
            continue
        if isinstance(backend, type) and issubclass(backend, LoginBackend):
            return before
        before.append(path)
    return None


@checks.register()
def check_login(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    user = getattr(settings, "TOKENBUCKET", {})
    if not isinstance(user, dict):
        return []  # E001
    try:
        login = tokenbucket_settings.login
    except ImproperlyConfigured as exc:
        return [catalogue.E060(error=str(exc).rstrip("."))]
    before = _listed_before()
    if login is None:
        return []
    errors: list[checks.CheckMessage] = []
    if before is None:
        if "LOGIN" in user:
            errors.append(catalogue.W061())
        return errors
    if before:
        errors.append(catalogue.W060(before=", ".join(before)))
    try:
        limits = tokenbucket_settings.limits()
    except ImproperlyConfigured:
        return errors  # E003 says what
    limit = limits.get(login.limit)
    if limit is None:
        errors.append(catalogue.E061(name=login.limit))
        return errors
    if login.cooloff is not None and _overrides_off():
        errors.append(catalogue.E062())
    if callable(login.cooloff):
        problem = _first_lockout_problem(login.cooloff)
        if problem is not None:
            errors.append(catalogue.E063(problem=problem))
    try:
        alias = get_backend(limit.backend).database_alias()
    except ImproperlyConfigured:
        return errors  # the backends' checks say what
    database: Any = settings.DATABASES.get(alias) if alias is not None else None
    if isinstance(database, dict) and database.get("ATOMIC_REQUESTS"):
        errors.append(catalogue.W062(name=login.limit, alias=alias))
    return errors


def _overrides_off() -> bool:
    try:
        return tokenbucket_settings.overrides is None
    except ImproperlyConfigured:
        return False  # E052 says what; LOGIN's cooloff is then not the problem


def _first_lockout_problem(cooloff: Any) -> str | None:
    try:
        value = cooloff(1)
    except Exception as exc:  # a callable of the project's: whatever it raises is the problem
        return f"raised {type(exc).__name__}: {exc}"
    try:
        seconds(value)
    except ValueError as exc:
        return f"returned {value!r}: {exc}"
    return None
