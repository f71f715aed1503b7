"""Signals sent for every decision taken by ``limit()`` (not by ``check()``), and for store failures.

The decision signals' receivers get ``name``, ``key``, ``count`` and ``status``. They run synchronously on the
request path: keep them cheap (increment a counter, don't do I/O).
"""

from django.dispatch import Signal

__all__ = ["rate_limit_allowed", "rate_limit_backend_error", "rate_limit_denied"]

#: A call was allowed.
rate_limit_allowed = Signal()

#: A call was denied, or, with ``shadow=True``, would have been denied by a limit in
#: shadow mode (and was let through).
rate_limit_denied = Signal()

#: The store failed, on any call (reads such as ``check()`` and ``get_value()`` too).
#: Extra arguments: ``names`` (the limits of the call), ``exception`` (the library's
#: ``BackendError``; the driver's exception is its ``__cause__``), ``fail_open``
#: (whether the call was allowed anyway) and ``ambiguous`` (the store may have applied
#: the call all the same: its answer was lost after the request was sent; count these
#: as spent tokens).
rate_limit_backend_error = Signal()
