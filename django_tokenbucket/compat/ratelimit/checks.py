"""System checks of the django-ratelimit compatibility layer: the ``RATELIMIT_*`` settings it reads."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.utils.module_loading import import_string

from ... import catalogue
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
            messages.append(catalogue.E040(alias=alias))
        else:
            backend = caches[alias].get("BACKEND", "")
            if not is_django_redis(backend) and backend != "django.core.cache.backends.dummy.DummyCache":
                messages.append(catalogue.W040(alias=alias, backend=backend))
    for setting, bits in (("RATELIMIT_IPV4_MASK", 32), ("RATELIMIT_IPV6_MASK", 128)):
        mask = getattr(settings, setting, bits if bits == 32 else 64)
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask <= bits:
            messages.append(catalogue.E041(setting=setting, bits=bits, value=mask))
    exception_class = getattr(settings, "RATELIMIT_EXCEPTION_CLASS", None)
    if isinstance(exception_class, str):
        try:
            import_string(exception_class)
        except ImportError as exc:
            messages.append(catalogue.E042(value=exception_class, error=exc))
    return messages
