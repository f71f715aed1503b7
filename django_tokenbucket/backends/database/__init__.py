"""The database backend: limits in the ``RateLimit`` table of the application's database.

``backend`` holds ``DatabaseBackend`` and its portable path (row locks, any database);
``postgresql`` the PostgreSQL fast path and its SQL (``sql/``); ``deadline`` the
``TIMEOUT`` watchdog; ``retry`` the retry policy and how a driver's error reads;
``filters`` the ORM filters that classify rows by what they hold now.
"""

from .backend import DatabaseBackend, database_now, timeout_option
from .retry import RETRYABLE_ERRORS, error_code, lost_answer, retrying

__all__ = [
    "RETRYABLE_ERRORS",
    "DatabaseBackend",
    "database_now",
    "error_code",
    "lost_answer",
    "retrying",
    "timeout_option",
]
