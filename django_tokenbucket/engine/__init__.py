"""The decision engine: everything between ``limiter.limit(...)`` and a backend's ``decide``.

``calls.Engine`` holds the public entries (``django_tokenbucket.api.Limiter`` delegates
to it); ``decide`` is the decision pipeline (rule → recall → store → learn → status →
report), written once for one limit or several, sharded or not; ``steps`` the plans'
steps and their two drivers (blocking, asyncio); ``state`` the plans that read, reset
and refund a key; ``rules`` a key's override as it applies to a call; ``report`` the
metrics, analytics, log and signals of a decision; ``failure`` a failed store call's
fail mode; ``statuses``, ``sharding`` and ``names`` the pieces they share.

Layering: ``api`` → ``engine`` → backends, algorithms and the process' state modules
(``overrides``, ``deny_cache``, ``metrics``, ``analytics``); nothing here imports ``api``.
"""

from __future__ import annotations

from .calls import Engine
from .decide import Asked
from .names import ConfigSpec

__all__ = ["Asked", "ConfigSpec", "Engine"]
