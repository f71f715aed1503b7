"""Exact token-bucket rate limiting for Django, on your database or on Redis.

Only the small public surface lives here. Nothing imported here touches models, so a
settings module may import this package.
"""

from .api import LimitRequest, limiter
from .exceptions import BackendUnavailable, RateLimited
from .status import MultiStatus, Status

__version__ = "0.1.0"
__all__ = [
    "BackendUnavailable",
    "LimitRequest",
    "MultiStatus",
    "RateLimited",
    "Status",
    "__version__",
    "limiter",
]
