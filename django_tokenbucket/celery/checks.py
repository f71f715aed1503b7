"""System checks of the Celery integration: ``TOKENBUCKET["CELERY"]``, which is otherwise read
only in a worker. Registered by ``apps.ready()`` when Celery is installed.
"""

from __future__ import annotations

import math
from typing import Any

from celery import current_app
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from .. import catalogue
from ..settings import tokenbucket_settings
from .reservations import CELERY_DEFAULTS
from .task import RateLimitedTask

__all__ = ["check_celery_settings", "check_rate_limited_tasks"]


@checks.register()
def check_celery_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check ``TOKENBUCKET["CELERY"]``: a bad value would otherwise surface in a worker."""
    user = getattr(settings, "TOKENBUCKET", {})
    if not isinstance(user, dict) or "CELERY" not in user:
        return []
    return _check_celery(user["CELERY"])


def _check_celery(given: object) -> list[checks.CheckMessage]:
    def error(problem: str) -> checks.CheckMessage:
        return catalogue.E025(problem=problem)

    if not isinstance(given, dict):
        return [error(f" must be a dict, not {type(given).__name__}")]
    errors: list[checks.CheckMessage] = []
    unknown = sorted(map(repr, set(given) - set(CELERY_DEFAULTS)))
    if unknown:
        errors.append(error(f" has unknown setting(s) {', '.join(unknown)}; it takes {', '.join(CELERY_DEFAULTS)}"))
    for name, value in given.items():
        if name not in CELERY_DEFAULTS or (name == "KEEP_FINISHED" and value is None):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
        if not number or (name == "BATCH_SIZE" and not isinstance(value, int)):
            kind = "a whole number > 0" if name == "BATCH_SIZE" else "a number of seconds > 0"
            if name == "KEEP_FINISHED":
                kind += " or None"
            errors.append(error(f"[{name!r}] must be {kind}, not {value!r}"))
    return errors


@checks.register()
def check_rate_limited_tasks(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check every ``RateLimitedTask`` the Celery app knows: its limit exists, and a fixed
    count could ever be covered (otherwise each run would fail in a worker)."""
    try:
        tokenbucket_settings.limits()
    except (ImproperlyConfigured, TypeError, ValueError):
        return []  # the settings' own checks say what is wrong with them
    errors: list[checks.CheckMessage] = []
    for task in list(current_app.tasks.values()):
        if not isinstance(task, RateLimitedTask):
            continue
        try:
            limit = task.tokenbucket_config()
            count = task.tokenbucket_count
            if not callable(count):
                limit.validate_count(count, True)
        except (ImproperlyConfigured, ValueError) as exc:
            problem = str(exc).removeprefix(f"task {task.name!r}: ")
            errors.append(catalogue.E028(task=task.name, problem=problem))
    return errors
