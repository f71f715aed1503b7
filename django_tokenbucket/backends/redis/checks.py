"""What ``manage.py check`` reads from a Redis server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django_redis import get_redis_connection

from ... import catalogue
from .. import is_django_redis

__all__ = ["check_cache"]


def check_cache(options: Mapping[str, Any], setting: str) -> list[Any]:
    """Check the cache behind a Redis backend: it exists, is django-redis, and never evicts."""
    alias = options.get("CACHE", "default")
    cache_settings: dict[str, Any] = getattr(settings, "CACHES", {})
    if not isinstance(alias, str) or alias not in cache_settings:
        return [catalogue.E020(setting=setting, alias=alias)]
    cache_backend = cache_settings[alias].get("BACKEND")
    if not is_django_redis(cache_backend):
        return [catalogue.E027(setting=setting, alias=alias, backend=cache_backend)]
    policy = _eviction_policy(alias)
    if policy is not None and policy != "noeviction":
        return [catalogue.W021(alias=alias, policy=policy)]
    return []


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
