"""Per-plan buckets: the names of limits whose config a ``@ratelimit(rate=callable)`` returns.

A stored bucket is ``(value, ts)``; what it means depends on its limit's config. A rate
decided per request (free, pro, enterprise) has no one config, and a process that
serves no request (``manage.py tokenbucket``, a cleanup from cron, a Celery worker)
never sees the configs the views returned. So each config a rate callable returns
gets its own bucket, under a name that spells the config out::

    app.views.search[plan 100/60s]
    app.views.search[plan 1000/3600s; capacity=50; kind=fixed window; backend=fast]

Every process can read such a row exactly from its name alone (``plan_limit``):
the admin shows its tokens, the command its state, and cleanup deletes it once idle,
with no registry shared between processes. The spelling is canonical (the parsed
numbers, not the returned text), so ``"100/m"`` and ``{"rate": 100, "period": 60}``
are one bucket, and parsing a name back yields it again or nothing.
"""

from __future__ import annotations

import re
from decimal import Decimal
from functools import lru_cache
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from .algorithms import MICRO, TOKEN_BUCKET
from .limits import DEFAULT_BACKEND_ALIAS, MAX_NAME_LENGTH, LimitConfig, parse_limit

__all__ = ["is_plan_name", "plan_limit", "plan_name"]

_PLAN = re.compile(r"(?P<base>.+)\[plan (?P<body>[^\[\]]+)\]", re.DOTALL)
_SEPARATOR = "; "


def _number(micro: int) -> str:
    """Return an exact decimal of ``micro`` millionths, without trailing zeros: 100, 0.5."""
    return format((Decimal(micro) / MICRO).normalize(), "f")


def _spelling(limit: LimitConfig) -> str:
    """Return the canonical spelling of ``limit``'s config, as it goes between ``[plan `` and ``]``."""
    parts = [f"{_number(limit.rate)}/{_number(limit.period)}s"]
    if limit.capacity != limit.rate:
        parts.append(f"capacity={_number(limit.capacity)}")
    if limit.max_reserved is not None:
        parts.append(f"max_reserved={_number(limit.max_reserved)}")
    if limit.kind != TOKEN_BUCKET:
        parts.append(f"kind={limit.kind}")
    if limit.start is not None:
        parts.append(f"start={_number(limit.start)}")
    if limit.shards != 1:
        parts.append(f"shards={limit.shards}")
    if limit.backend != DEFAULT_BACKEND_ALIAS:
        parts.append(f"backend={limit.backend}")
    if limit.shadow:
        parts.append("shadow")
    if not limit.deny_cache:
        parts.append("no deny cache")
    return _SEPARATOR.join(parts)


def plan_name(base: str, limit: LimitConfig) -> str:
    """Return the name of the bucket of ``base`` for the config ``limit`` (whose own name is ignored)."""
    return f"{base}[plan {_spelling(limit)}]"


def plan_config(base: str, spec: Any) -> LimitConfig:
    """Return the limit of ``base`` for ``spec`` (a rate string or a config dict), named for its plan.

    Raises ImproperlyConfigured naming ``base`` when ``spec`` is not a valid config, or
    when the plan's name would exceed the names the store holds.
    """
    parsed = parse_limit(base, spec)
    name = plan_name(base, parsed)
    if len(name) > MAX_NAME_LENGTH:
        raise ImproperlyConfigured(
            f"rate limit {base!r}: the bucket of the plan {spec!r} would be named {name!r}, longer than "
            f"{MAX_NAME_LENGTH} characters; give @ratelimit a shorter name="
        )
    return parse_limit(name, spec)


def is_plan_name(name: str) -> bool:
    """Whether ``name`` is spelled as a plan's bucket (it may still not parse)."""
    return name.endswith("]") and _PLAN.fullmatch(name) is not None


@lru_cache(maxsize=1024)
def plan_base(name: str) -> str | None:
    """Return the name of the ``@ratelimit(rate=callable)`` whose plan bucket ``name`` is, or None."""
    match = _PLAN.fullmatch(name) if name.endswith("]") else None
    return None if match is None else match["base"]


def plan_limit(name: str) -> LimitConfig | None:
    """Return the config that ``name``, a plan's bucket, spells out; None if it is not one.

    Only the canonical spelling parses: a name that merely looks like one (edited by
    hand, or from another version's spelling) is not taken for a config it might not be.
    """
    match = _PLAN.fullmatch(name)
    if match is None:
        return None
    rate, *options = match["body"].split(_SEPARATOR)
    tokens, slash, period = rate.partition("/")
    if not slash or not period.endswith("s"):
        return None
    try:
        spec: dict[str, Any] = {"rate": Decimal(tokens), "period": Decimal(period[:-1])}
        for option in options:
            if option == "shadow":
                spec["shadow"] = True
            elif option == "no deny cache":
                spec["deny_cache"] = False
            else:
                field, equals, value = option.partition("=")
                if not equals or field in spec:
                    return None
                if field in ("capacity", "max_reserved", "start"):
                    spec[field] = Decimal(value)
                elif field == "shards":
                    spec[field] = int(value)
                elif field in ("kind", "backend"):
                    spec[field] = value
                else:
                    return None
        limit = parse_limit(name, spec)
    except (ArithmeticError, ValueError, ImproperlyConfigured):
        return None
    return limit if plan_name(match["base"], limit) == name else None
