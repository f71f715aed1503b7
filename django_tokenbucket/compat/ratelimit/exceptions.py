"""``Ratelimited``, raised by ``@ratelimit(block=True)`` (as django-ratelimit's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

# Re-exported: django-ratelimit's exceptions module has the name (Ratelimited's base there).
from django.core.exceptions import PermissionDenied  # noqa: F401

from ...exceptions import RateLimited

if TYPE_CHECKING:
    from ...status import Status

__all__ = ["Ratelimited"]


class Ratelimited(RateLimited):
    """A request was over a limit. A ``PermissionDenied``, as in django-ratelimit.

    It is also django_tokenbucket's ``RateLimited``, so ``RateLimitMiddleware`` answers
    it with 429 and ``Retry-After``. Raised by the decorator with the limit's
    ``name``, ``key``, ``retry_after`` and ``status``; code of your own may raise it
    without arguments, as before.
    """

    def __init__(
        self,
        name: str | None = None,
        key: object = None,
        retry_after: float | None = None,
        status: Status | None = None,
    ) -> None:
        if name is None:
            self.name, self.key, self.retry_after, self.status = "", key, retry_after, status
            Exception.__init__(self, "rate limited")
        else:
            super().__init__(name, key, retry_after, status)
