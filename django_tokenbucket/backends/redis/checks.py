"""What ``manage.py check`` reads from a Redis server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core import checks
from django_redis import get_redis_connection

from .. import is_django_redis

__all__ = ["check_cache"]


def check_cache(options: Mapping[str, Any], setting: str) -> list[Any]:
    """Check the cache behind a Redis backend: it exists, is django-redis, and never evicts."""
    messages: list[Any] = []
    alias = options.get("CACHE", "default")
    hint = (
        f"Point {setting}['OPTIONS']['CACHE'] at a cache whose BACKEND is 'django_redis.cache.RedisCache' "
        "(pip install 'dj-tokenbucket[redis]')."
    )
    cache_settings: dict[str, Any] = getattr(settings, "CACHES", {})
    if not isinstance(alias, str) or alias not in cache_settings:
        messages.append(
            checks.Error(
                f"{setting}['OPTIONS']['CACHE'] = {alias!r} is not an alias in CACHES.",
                hint=hint,
                id="django_tokenbucket.E020",
            )
        )
        return messages
    cache_backend = cache_settings[alias].get("BACKEND")
    if not is_django_redis(cache_backend):
        messages.append(
            checks.Warning(
                f"The Redis rate-limit backend uses CACHES[{alias!r}], whose BACKEND {cache_backend!r} "
                f"is not a django-redis cache: every rate-limit call will fail.",
                hint=hint,
                id="django_tokenbucket.W020",
            )
        )
        return messages
    policy = _eviction_policy(alias)
    if policy is not None and policy != "noeviction":
        messages.append(
            checks.Warning(
                f"The Redis behind CACHES[{alias!r}] has maxmemory-policy {policy!r}: when its memory is "
                f"full it may delete rate-limit keys, and a deleted bucket reads as full again.",
                hint="Set maxmemory-policy to 'noeviction' (a full Redis then fails calls, and "
                "FAIL_OPEN decides), or give the limits a Redis of their own.",
                id="django_tokenbucket.W021",
            )
        )
    return messages


def _eviction_policy(alias: str) -> str | None:
    """Return Redis' maxmemory-policy, the first evicting one of a cluster's nodes, or None if unknown."""
    try:
        reply = get_redis_connection(alias).config_get("maxmemory-policy")
    except Exception:  # down, CONFIG denied or renamed, not a Redis: nothing to report
        return None
    policies = []
    pending: list[Any] = [reply]
    while pending:  # a cluster client answers per node: {node: {name: value}}
        item = pending.pop()
        if isinstance(item, dict):
            for name, value in item.items():
                if isinstance(value, dict):
                    pending.append(value)
                elif (name.decode() if isinstance(name, bytes) else name) == "maxmemory-policy":
                    policies.append(value.decode() if isinstance(value, bytes) else str(value))
    evicting = sorted(p for p in policies if p != "noeviction")
    return evicting[0] if evicting else (policies[0] if policies else None)
