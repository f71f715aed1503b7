"""What ``manage.py check`` reads from a Redis server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django_redis import get_redis_connection

from ... import catalogue
from ..caches import is_django_redis
from .bounded import deadline_option
from .clients import cache_primary, rebuildable

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
    messages = _check_timeout(options, setting, alias, cache_settings[alias].get("OPTIONS") or {})
    policy = _eviction_policy(alias)
    if policy is not None and policy != "noeviction":
        messages.append(catalogue.W021(alias=alias, policy=policy))
    return messages


def _check_timeout(options: Mapping[str, Any], setting: str, alias: str, cache_options: Mapping[str, Any]) -> list[Any]:
    """TIMEOUT is valid, and the socket timeouts (what bounds a connect or a topology read) are within it.

    Where the cache sets no SOCKET_TIMEOUT, the backend's own connections get the
    deadline's (``clients``): only what the cache sets, or a cache the backend cannot
    build a client of its own for, can outlast it.
    """
    try:
        timeout = deadline_option(options, setting)
    except ValueError as exc:
        return [catalogue.E029(error=exc)]
    if timeout is None:
        return []
    read = cache_options.get("SOCKET_TIMEOUT") or None
    connect = cache_options.get("SOCKET_CONNECT_TIMEOUT") or None
    filled = read is None and _rebuildable(alias, setting)
    problems = []
    # redis-py connects within SOCKET_TIMEOUT when no connect timeout is given.
    if connect is not None and (not isinstance(connect, (int, float)) or connect > timeout):
        problems.append(f"SOCKET_CONNECT_TIMEOUT = {connect!r}")
    if read is None:
        if not filled:
            problems.append("no SOCKET_TIMEOUT" + ("" if connect else " nor SOCKET_CONNECT_TIMEOUT"))
    elif not isinstance(read, (int, float)) or read > timeout:
        problems.append(f"SOCKET_TIMEOUT = {read!r}")
    if not problems:
        return []
    given = f"{timeout:g} s" + ("" if "TIMEOUT" in options else " (the default)")
    return [catalogue.W022(timeout=given, alias=alias, problem=" and ".join(problems))]


def _rebuildable(alias: str, setting: str) -> bool:
    try:
        return rebuildable(cache_primary(alias, setting))
    except Exception:  # no LOCATION, a factory that cannot be imported: what uses it says so
        return False


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
