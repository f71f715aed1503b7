"""What each process holds, and the moments it must let go: a setting changed, a fork,
the tables emptied.

Several modules keep state per process: the parsed settings, the backends built from
them, the deny cache, the overrides snapshot, the metrics recorder, the analytics
counts and their flusher thread, the Redis circuit breakers, and the locks that guard
them. Two events make that state wrong. A setting it was built from changes (Django's
``setting_changed``, sent by ``override_settings`` in tests): it must be rebuilt from
the new value. The process forks (Gunicorn's and Celery's prefork workers, the test
suite's concurrency tests): the child has only the forking thread, so a lock another
thread held is held for ever, a thread is gone, and what the parent counted is the
parent's to write.

A third makes memory wrong: the tables are emptied (``post_migrate``, which follows
``manage.py flush`` and TransactionTestCase's flush after each test as well as a
migrate), and a remembered denial or a snapshot of overrides must not contradict them.

This module holds the one receiver of each, and the tables of what they reset, in the
order they run: the settings object first, so that a reset reads the new settings.
Each entry names a module and its public reset function. A module that was never
imported holds nothing to reset, so the tables name modules rather than import them:
this module imports none of the package, which every module may then import, and an
optional backend (Redis) is reset only where it is installed and in use.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from django.core.signals import setting_changed

__all__ = [
    "AFTER_FORK",
    "ON_SETTING_CHANGED",
    "ON_TABLES_EMPTIED",
    "after_fork_in_child",
    "setting_changed_receiver",
    "tables_emptied",
]

TOKENBUCKET = frozenset({"TOKENBUCKET"})

#: (module, its reset function, the Django settings its state is built from).
ON_SETTING_CHANGED: tuple[tuple[str, str, frozenset[str]], ...] = (
    ("django_tokenbucket.settings", "tokenbucket_settings.reload", TOKENBUCKET),
    ("django_tokenbucket.backends.aliases", "reset_backend", TOKENBUCKET),
    # The Redis backends' clients, key prefixes and clocks.
    ("django_tokenbucket.backends.redis.backend", "settings_changed", frozenset({"CACHES", "TOKENBUCKET"})),
    ("django_tokenbucket.deny_cache", "clear", TOKENBUCKET),
    ("django_tokenbucket.overrides.snapshot", "settings_changed", TOKENBUCKET),
    ("django_tokenbucket.analytics", "settings_changed", TOKENBUCKET),
    ("django_tokenbucket.metrics", "settings_changed", TOKENBUCKET),
    ("django_tokenbucket.auth.config", "settings_changed", frozenset({"AUTHENTICATION_BACKENDS"})),
    ("django_tokenbucket.keys", "settings_changed", frozenset({"TOKENBUCKET", "SECRET_KEY"})),
    (
        "django_tokenbucket.request_keys",
        "settings_changed",
        frozenset({"TOKENBUCKET", "DATABASES", "DATABASE_ROUTERS", "AUTH_USER_MODEL"}),
    ),
    ("django_tokenbucket.logs", "settings_changed", TOKENBUCKET),
    (
        "django_tokenbucket.compat.ratelimit.core",
        "settings_changed",
        frozenset({"CACHES", "RATELIMIT_USE_CACHE", "TOKENBUCKET"}),
    ),
)

#: (module, its function that makes what a fork left behind usable in the child).
#: Lowest layer first, so that a module's reset finds the modules below it usable.
AFTER_FORK: tuple[tuple[str, str], ...] = (
    ("django_tokenbucket.keys", "after_fork_in_child"),
    ("django_tokenbucket.registry", "after_fork_in_child"),
    ("django_tokenbucket.hints", "after_fork_in_child"),
    ("django_tokenbucket.prometheus_tallies", "after_fork_in_child"),
    ("django_tokenbucket.metrics", "after_fork_in_child"),
    ("django_tokenbucket.backends.base", "after_fork_in_child"),
    ("django_tokenbucket.backends.aliases", "after_fork_in_child"),
    ("django_tokenbucket.backends.database.deadline", "after_fork_in_child"),
    ("django_tokenbucket.backends.redis.breaker", "after_fork_in_child"),
    ("django_tokenbucket.backends.redis.clients", "after_fork_in_child"),
    ("django_tokenbucket.backends.redis.spares", "after_fork_in_child"),
    ("django_tokenbucket.backends.redis.connections", "after_fork_in_child"),
    ("django_tokenbucket.analytics", "after_fork_in_child"),
    ("django_tokenbucket.deny_cache", "after_fork_in_child"),
    ("django_tokenbucket.overrides.snapshot", "after_fork_in_child"),
    ("django_tokenbucket.compat.ratelimit.core", "after_fork_in_child"),
)

#: (module, its function that forgets what it holds of the package's tables).
ON_TABLES_EMPTIED: tuple[tuple[str, str], ...] = (
    ("django_tokenbucket.deny_cache", "clear"),
    ("django_tokenbucket.overrides.snapshot", "invalidate"),
)


def _call(module: str, function: str) -> None:
    found: Any = sys.modules.get(module)
    if found is None:
        return  # never imported: nothing held
    for name in function.split("."):
        found = getattr(found, name)
    found()


def setting_changed_receiver(*, setting: str, **kwargs: Any) -> None:
    """Reset what was built from ``setting``, in ``ON_SETTING_CHANGED`` order."""
    for module, function, settings in ON_SETTING_CHANGED:
        if setting in settings:
            _call(module, function)


def after_fork_in_child() -> None:
    """Make this process' state usable in a forked child, in ``AFTER_FORK`` order."""
    for module, function in AFTER_FORK:
        _call(module, function)


def tables_emptied(**kwargs: Any) -> None:
    """Forget what this process holds of the tables, in ``ON_TABLES_EMPTIED`` order
    (``post_migrate``: the app config connects it, for its own tables)."""
    for module, function in ON_TABLES_EMPTIED:
        _call(module, function)


setting_changed.connect(setting_changed_receiver, dispatch_uid="django_tokenbucket.lifecycle")
if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=after_fork_in_child)
