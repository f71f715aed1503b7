"""DRF throttles backed by exact token buckets: drop-in for ``rest_framework.throttling``.

::

    REST_FRAMEWORK = {
        "DEFAULT_THROTTLE_CLASSES": [
            "django_tokenbucket.throttling.AnonRateThrottle",
            "django_tokenbucket.throttling.UserRateThrottle",
        ],
        "DEFAULT_THROTTLE_RATES": {"anon": "100/day", "user": "5/10m"},
    }

The classes keep DRF's shape — ``SimpleRateThrottle`` with ``scope``, ``rate``,
``THROTTLE_RATES``, ``get_rate()``, ``parse_rate()``, ``get_cache_key()``, ``timer``
and ``wait()`` — so custom throttles written for DRF keep working with the import
changed. What changes is the decision: an exact token bucket stored by the limiter's
backend, and every throttle of this module on one view decided together,
all-or-nothing (a request denied by one spends no token of the others).

Rates are read from ``DEFAULT_THROTTLE_RATES`` when a throttle is made, as DRF does
per request, so ``override_settings`` works. A ``TOKENBUCKET["LIMITS"]`` entry named
like a scope replaces that scope's rate with a full limit (capacity, kind, shadow...),
unless the throttle class sets ``rate`` itself.
"""

from __future__ import annotations

# isort: off
# The classes first: importing rest_framework.views (the handler does) reads
# DEFAULT_THROTTLE_CLASSES, which name this package's classes.
from .throttles import (
    AnonRateThrottle,
    BaseThrottle,
    ScopedRateThrottle,
    ServiceUnavailable,
    SimpleRateThrottle,
    TokenBucketThrottle,
    UserRateThrottle,
    declared_throttle_rates,
)
from .handler import exception_handler
# isort: on

__all__ = [
    "AnonRateThrottle",
    "BaseThrottle",
    "ScopedRateThrottle",
    "ServiceUnavailable",
    "SimpleRateThrottle",
    "TokenBucketThrottle",
    "UserRateThrottle",
    "declared_throttle_rates",
    "exception_handler",
]
