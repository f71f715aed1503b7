"""Storage backends: where limit state lives and how it is locked.

A project may use several at once, by alias (``TOKENBUCKET["BACKENDS"]``, as Django's
``CACHES``); each limit is stored on one, its ``"backend"`` (``"default"`` unless it
says otherwise).
"""

from __future__ import annotations

from .aliases import (
    after_fork_in_child,
    backend_aliases,
    backend_class,
    get_backend,
    is_django_redis,
    redis_backend,
    reset_backend,
    row_backend,
)
from .base import BaseBackend

__all__ = [
    "BaseBackend",
    "after_fork_in_child",
    "backend_aliases",
    "backend_class",
    "get_backend",
    "is_django_redis",
    "redis_backend",
    "reset_backend",
    "row_backend",
]
