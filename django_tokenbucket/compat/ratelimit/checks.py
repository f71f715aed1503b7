"""System checks of the django-ratelimit compatibility layer: the ``RATELIMIT_*`` settings it reads."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.utils.module_loading import import_string

from ...backends import is_django_redis

__all__ = ["check_ratelimit_compat"]

@checks.register(checks.Tags.caches)
def check_ratelimit_compat(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check the ``RATELIMIT_*`` settings read by ``django_tokenbucket.compat.ratelimit``."""
    messages: list[checks.CheckMessage] = []
    alias = getattr(settings, "RATELIMIT_USE_CACHE", None)
    caches = getattr(settings, "CACHES", {})
    if alias is not None:
        if alias not in caches:
            messages.append(
                checks.Error(
                    f"RATELIMIT_USE_CACHE = {alias!r} is not an alias in CACHES.",
                    hint="Name a cache in CACHES, or remove the setting to use TOKENBUCKET's backend.",
                    id="django_tokenbucket.E040",
                )
            )
        else:
            backend = caches[alias].get("BACKEND", "")
            if not is_django_redis(backend) and backend != "django.core.cache.backends.dummy.DummyCache":
                messages.append(
                    checks.Warning(
                        f"RATELIMIT_USE_CACHE = {alias!r} is a {backend}, which cannot hold a limit atomically: "
                        "django_tokenbucket.compat.ratelimit keeps its limits in TOKENBUCKET's backend instead.",
                        hint="Nothing to do if that is what you want; a django-redis cache is used as a Redis backend.",
                        id="django_tokenbucket.W040",
                    )
                )
    for setting, bits in (("RATELIMIT_IPV4_MASK", 32), ("RATELIMIT_IPV6_MASK", 128)):
        mask = getattr(settings, setting, bits if bits == 32 else 64)
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask <= bits:
            messages.append(
                checks.Error(
                    f"{setting} must be a prefix length from 0 to {bits}, not {mask!r}.", id="django_tokenbucket.E041"
                )
            )
    exception_class = getattr(settings, "RATELIMIT_EXCEPTION_CLASS", None)
    if isinstance(exception_class, str):
        try:
            import_string(exception_class)
        except ImportError as exc:
            messages.append(
                checks.Error(f"RATELIMIT_EXCEPTION_CLASS = {exception_class!r}: {exc}", id="django_tokenbucket.E042")
            )
    return messages
