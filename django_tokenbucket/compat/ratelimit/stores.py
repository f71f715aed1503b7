"""Where the compatibility layer keeps a limit's state: decided from the cache django-ratelimit would use.

django-ratelimit counts in ``caches[RATELIMIT_USE_CACHE]``, the ``default`` cache when
the setting is unset. Here that cache decides where the fixed windows live:

- a ``DummyCache``: nowhere, and nothing is limited (django-ratelimit's ``add`` on it
  always "succeeds" with a count of 1, so it never limited either);
- a django-redis cache: that Redis, through a Redis backend of its own;
- any other cache (locmem, file, database, memcached, Django's own ``RedisCache``):
  ``TOKENBUCKET``'s backend, the database by default, because the limiter needs a store
  that decides a window atomically and our Redis backend speaks only through django-redis.
  ``manage.py check`` says so (W040).

``core`` decides with it and the checks report with it, so the two cannot disagree.
"""

from __future__ import annotations

from typing import Literal

from django.conf import settings
from django.core.cache.backends.base import BaseCache
from django.core.cache.backends.dummy import DummyCache

from ...backends.caches import is_django_redis

__all__ = ["Home", "cache_alias", "home", "use_cache_is_set"]

#: ``"nowhere"``: nothing is limited; ``"cache"``: in the named cache's Redis;
#: ``"tokenbucket"``: in TOKENBUCKET's default backend.
Home = Literal["nowhere", "cache", "tokenbucket"]


def use_cache_is_set() -> bool:
    """Whether the project sets ``RATELIMIT_USE_CACHE`` (None counts as unset)."""
    return getattr(settings, "RATELIMIT_USE_CACHE", None) is not None


def cache_alias() -> str:
    """Return the cache django-ratelimit would count in: ``RATELIMIT_USE_CACHE``, else ``"default"``."""
    alias = getattr(settings, "RATELIMIT_USE_CACHE", None)
    return "default" if alias is None else alias


def home(cache: BaseCache) -> Home:
    """Return where the layer keeps its limits when django-ratelimit would have used ``cache``."""
    if isinstance(cache, DummyCache):
        return "nowhere"
    if is_django_redis(f"{type(cache).__module__}.{type(cache).__qualname__}"):
        return "cache"
    return "tokenbucket"
