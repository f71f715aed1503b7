"""Signals sent for every decision taken by ``limit()`` (not by ``check()``), and for store failures.

The decision signals' receivers get ``name``, ``key``, ``count`` and ``status``. They run synchronously on the
request path: keep them cheap (increment a counter, don't do I/O).
"""

from django.dispatch import Signal

__all__ = ["login_locked_out", "rate_limit_allowed", "rate_limit_backend_error", "rate_limit_denied"]

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

#: Login protection (``django_tokenbucket.auth``) locked a key out: sent once per lockout,
#: when the failed login that empties the key's bucket is known to have failed, never
#: for the attempts refused afterwards. Arguments: ``name`` (the limit), ``key`` (the
#: bucket's key; a username in it is ``Redacted``), ``label`` (the key as the admin
#: shows it: never a username in clear), ``digest`` (the stored key digest), ``request``
#: (the login's request, or None), ``until`` (a datetime: when the lockout ends; None
#: when the bucket alone decides and ``retry_after`` says when it admits a login again),
#: ``retry_after`` (seconds) and ``lockouts`` (how many lockouts this key had within
#: ``LOGIN["LOCKOUT_MEMORY"]``, this one included; None unless ``COOLOFF`` is a callable).
login_locked_out = Signal()
