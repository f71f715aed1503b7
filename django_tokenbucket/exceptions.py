"""Exceptions raised by django_tokenbucket."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.exceptions import PermissionDenied

if TYPE_CHECKING:
    from .status import Status

__all__ = ["BackendUnavailable", "RateLimited"]


class RateLimited(PermissionDenied):
    """A call was denied by a rate limit (raised with ``throws=True``).

    A PermissionDenied, so code that does not handle it answers 403 rather than 500;
    the HTTP integrations turn it into 429 with ``Retry-After``.
    """

    def __init__(
        self,
        name: str,
        key: object,
        retry_after: float | None,
        status: Status | None = None,
    ) -> None:
        self.name = name
        self.key = key
        self.retry_after = retry_after
        self.status = status
        when = "never" if retry_after is None else f"retry after {retry_after:.3f}s"
        super().__init__(f"rate limit {name!r} exceeded for key {key!r}: {when}")

    @property
    def wait(self) -> float | None:
        """Alias of ``retry_after``, as DRF's ``Throttled`` names it."""
        return self.retry_after


class BackendUnavailable(Exception):
    """The rate-limit store failed and ``FAIL_OPEN`` is off, so nothing was decided.

    Also raised with ``FAIL_OPEN`` on when the store is busy rather than down: it
    reported a lock or time limit it gave up on, or ran out of ``TIMEOUT`` while it was
    answering this process' other calls. The HTTP integrations answer 503: the service
    failed, not the client.
    """

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__(f"rate limit {name!r}: {message}")
