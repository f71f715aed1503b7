"""The configured backends, by alias: each built once from the settings, forgotten when they change."""

from __future__ import annotations

import inspect
import threading

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from ..limits import DEFAULT_BACKEND_ALIAS
from ..settings import tokenbucket_settings
from .base import BaseBackend
from .caches import is_django_redis

__all__ = [
    "after_fork_in_child",
    "backend_aliases",
    "backend_class",
    "get_backend",
    "is_django_redis",
    "redis_backend",
    "reset_backend",
    "row_backend",
]

_backends: dict[str, BaseBackend] = {}
# Re-entrant: a finalizer that runs during a collection inside the locked region may
# ask for a backend in the same thread, which a plain lock would deadlock on.
_lock = threading.RLock()


def backend_aliases() -> list[str]:
    """Return the configured aliases, "default" first."""
    return list(tokenbucket_settings.backends())


def backend_class(path: object, where: str) -> type[BaseBackend]:
    """Import a backend class from its dotted path; ImproperlyConfigured names ``where`` if it is not one."""
    if not isinstance(path, str):
        raise ImproperlyConfigured(f"{where} = {path!r} must be a dotted path (a str)")
    try:
        imported = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"{where} = {path!r} cannot be imported: {exc}") from exc
    if not (isinstance(imported, type) and issubclass(imported, BaseBackend)):
        raise ImproperlyConfigured(
            f"{where} = {path!r} is not a subclass of django_tokenbucket.backends.base.BaseBackend"
        )
    return imported


def get_backend(alias: str = DEFAULT_BACKEND_ALIAS) -> BaseBackend:
    """Return the backend of ``alias``, created once and re-created when settings change."""
    backend = _backends.get(alias)
    if backend is not None:
        return backend
    with _lock:
        if alias not in _backends:
            configured = tokenbucket_settings.backends()
            if alias not in configured:
                raise ImproperlyConfigured(
                    f"no rate-limit backend {alias!r}: TOKENBUCKET['BACKENDS'] has "
                    f"{', '.join(map(repr, configured))}"
                )
            path, options, where = configured[alias]
            found = backend_class(path, f"{where}['BACKEND']")
            # A backend written before aliases may not take ``setting``: it then names
            # TOKENBUCKET in its messages.
            named = "setting" in inspect.signature(found).parameters
            _backends[alias] = found(options, setting=where) if named else found(options)
        return _backends[alias]


def redis_backend(cache: str) -> BaseBackend:
    """Return a Redis backend on the django-redis cache ``cache``, outside the configured aliases."""
    # Imported here: it needs django-redis, which only a project with a Redis cache has.
    from .redis import RedisBackend

    return RedisBackend({"CACHE": cache}, setting=f"RATELIMIT_USE_CACHE ({cache!r})")


def row_backend(database: str | None = None) -> BaseBackend:
    """Return the backend whose buckets are the ``RateLimit`` rows of ``database``.

    Without ``database``: the first configured backend that keeps rows ("default"
    first), or, when none does (every limit on Redis), a database backend on the
    database the router picks for ``RateLimit``. A database no configured backend uses
    gets a database backend of its own, for the command's ``--database``.
    """
    for alias in backend_aliases():
        backend = get_backend(alias)
        if backend.keeps_rows and (database is None or backend.database_alias() == database):
            return backend
    # Imported here: the models (and so the database backend) load after the app registry.
    from .database import DatabaseBackend

    return DatabaseBackend({"DATABASE": database} if database else {})


def reset_backend() -> None:
    """Forget every backend, so the next use builds them from the current settings."""
    with _lock:
        _backends.clear()


def after_fork_in_child() -> None:
    """Give a forked child a lock of its own (``django_tokenbucket.lifecycle``)."""
    global _lock
    # A fork while another thread built a backend would leave the child's copy held.
    _lock = threading.RLock()
