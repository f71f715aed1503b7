"""What a call names: its limit's parsed config (``resolve``) and its key's stored form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

from django.core.exceptions import ImproperlyConfigured

from .. import registry
from ..keys import EncodedKey, encode_key
from ..limits import LimitConfig, freeze, parse_limit
from ..settings import tokenbucket_settings

__all__ = ["ConfigSpec", "encode_for", "resolve"]

ConfigSpec = Union[str, Mapping[str, Any]]

_inline_cache: dict[Any, LimitConfig] = {}
_INLINE_CACHE_SIZE = 1024


def _parse_inline(name: str, config: ConfigSpec) -> LimitConfig:
    """Parse an inline config, remembering the result: decorators pass the same one on every call."""
    try:
        cache_key = (name, freeze(config))
        hash(cache_key)
    except TypeError:
        return parse_limit(name, config)
    limit = _inline_cache.get(cache_key)
    if limit is None:
        if len(_inline_cache) >= _INLINE_CACHE_SIZE:
            _inline_cache.clear()
        limit = _inline_cache[cache_key] = parse_limit(name, config)
        # Remembered so that the admin, the command and cleanup can interpret its rows.
        registry.record_inline(limit)
    return limit


def resolve(name: str, config: ConfigSpec | LimitConfig | None = None) -> LimitConfig:
    """Return the parsed config of ``name``; raise ImproperlyConfigured if unknown or invalid.

    Without ``config``, ``name`` is looked up in ``LIMITS``, then among the limits the
    command and the admin know (``registry.known_limits``: DRF throttle scopes, inline
    limits). ``config`` may be one this function returned before, for a caller (a DRF
    throttle) that decides the same inline limit on every request.
    """
    if isinstance(config, LimitConfig):
        return config
    if config is not None:
        return _parse_inline(name, config)
    limits = tokenbucket_settings.limits()
    try:
        return limits[name]
    except (KeyError, TypeError):
        pass
    # A DRF throttle scope, or a limit a view declares inline: the command and the
    # admin know these, so a reset or a read from Python must know them too.
    others = registry.known_limits(as_rows=False) if isinstance(name, str) else {}
    if name in others:
        return others[name].config
    known = ", ".join(sorted(map(repr, {**others, **limits}))) or "none"
    raise ImproperlyConfigured(
        f"unknown rate limit {name!r}: not in TOKENBUCKET['LIMITS'], not declared inline by a view, and not a "
        f"DRF throttle scope (known: {known}); define it in LIMITS or pass config=..."
    )


def encode_for(limit: LimitConfig, key: object) -> EncodedKey:
    """Return ``key``'s stored form (digest and label) for ``limit``.

    ValueError names the limit when ``key`` cannot be a key.
    """
    try:
        return encode_key(key)
    except TypeError as exc:
        raise ValueError(f"rate limit {limit.name!r}: {exc}") from None
