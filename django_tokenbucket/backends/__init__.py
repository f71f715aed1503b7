"""Storage backends: where limit state lives and how it is locked."""

from __future__ import annotations

import threading

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from .base import BaseBackend

__all__ = ["BaseBackend", "get_backend", "reset_backend"]

_backend: BaseBackend | None = None
_lock = threading.Lock()


def get_backend() -> BaseBackend:
    """Return the configured backend, created once and re-created when settings change."""
    global _backend
    backend = _backend
    if backend is None:
        from ..conf import tokenbucket_settings

        with _lock:
            if _backend is None:
                path = tokenbucket_settings.BACKEND
                try:
                    backend_class = import_string(path)
                except ImportError as exc:
                    raise ImproperlyConfigured(
                        f"TOKENBUCKET['BACKEND'] = {path!r} cannot be imported: {exc}"
                    ) from exc
                if not (isinstance(backend_class, type) and issubclass(backend_class, BaseBackend)):
                    raise ImproperlyConfigured(
                        f"TOKENBUCKET['BACKEND'] = {path!r} is not a BaseBackend subclass"
                    )
                _backend = backend_class(tokenbucket_settings.OPTIONS)
            backend = _backend
    return backend


def reset_backend() -> None:
    global _backend
    with _lock:
        _backend = None
