"""Which of Django's ``CACHES`` is django-redis' cache, the store of the Redis backend.

A module of its own, below both ``aliases`` (which builds the configured backends, the
Redis one among them) and the Redis backend's clients and checks (which ask it of a
cache alias): each imports it, neither the other.
"""

from __future__ import annotations

from django.utils.module_loading import import_string

try:
    from django_redis.cache import RedisCache
except ImportError:  # the Redis backend is not installed; no cache is a django-redis one
    RedisCache = None

__all__ = ["is_django_redis"]


def is_django_redis(cache_backend: object) -> bool:
    """Whether a ``CACHES`` BACKEND path names django-redis' cache (or a subclass)."""
    if RedisCache is None or not isinstance(cache_backend, str):
        return False
    try:
        cache_class = import_string(cache_backend)
    except ImportError:
        return False
    return isinstance(cache_class, type) and issubclass(cache_class, RedisCache)
