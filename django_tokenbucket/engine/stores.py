"""Where a limiter's limits are stored, and who sends its signals."""

from __future__ import annotations

from ..backends import get_backend
from ..backends.base import BaseBackend
from ..limits import LimitConfig

__all__ = ["Stores"]


class Stores:
    """Where a limiter's limits are stored: each limit's backend alias, or one backend of its own.

    ``sender`` is the ``sender`` of the signals its decisions send.
    """

    def __init__(self, backend: BaseBackend | None, sender: object) -> None:
        self.own = backend
        #: The ``backend`` label of every figure when this limiter has a backend of its own.
        self.own_label = None if backend is None else type(backend).__name__
        self.sender = sender

    def backend(self, limit: LimitConfig | None = None) -> BaseBackend:
        """Return the backend that decides ``limit`` (by default, the default alias's)."""
        if self.own is not None:
            return self.own
        return get_backend() if limit is None else get_backend(limit.backend)

    def label(self, limit: LimitConfig) -> str:
        """The ``backend`` label of ``limit``'s figures: its alias, or the class of this limiter's own backend."""
        return self.own_label or limit.backend
