"""Warnings, in ``DEBUG``, about keys a view most likely got wrong.

``limiter.limit("send_message", key=request.user.pk)`` reads as a per-user limit, and
is one for signed-in users; for everyone else ``request.user.pk`` is ``None``, the key of
the one bucket everybody shares, and every anonymous visitor is limited together. The
library cannot tell that from a global limit by one call, but a limit decided during
requests with keys *and* with ``None`` is almost always that mistake: this says so, once
per limit, on the ``django_tokenbucket`` logger. Only with ``DEBUG`` on (the receivers
do nothing otherwise), and only for the limiter's public calls; the decorator and the
throttles build their keys themselves.
"""

from __future__ import annotations

import logging
import threading
from contextvars import ContextVar
from typing import Any

from django.conf import settings
from django.core.signals import request_finished, request_started
from django.dispatch import receiver

__all__ = [
    "after_fork_in_child",
    "note_key",
]

logger = logging.getLogger("django_tokenbucket")

#: Whether this context is handling a request (set from ``request_started`` in DEBUG).
_in_request: ContextVar[bool] = ContextVar("django_tokenbucket_in_request", default=False)
#: Limit names seen keyed and seen with None during requests; bounded, as names may be
#: built at run time.
_keyed: set[str] = set()
_unkeyed: set[str] = set()
_warned: set[str] = set()
_MAX_NAMES = 1024
_lock = threading.Lock()


def after_fork_in_child() -> None:
    """Give a forked child a lock of its own (``django_tokenbucket.lifecycle``)."""
    global _lock
    # A fork while another thread held the lock would leave the child's copy held.
    _lock = threading.Lock()


@receiver(request_started)
def _request_started(**kwargs: Any) -> None:
    if settings.DEBUG:
        _in_request.set(True)


@receiver(request_finished)
def _request_finished(**kwargs: Any) -> None:
    if _in_request.get():
        _in_request.set(False)


def note_key(name: str, key: object) -> None:
    """Note that limit ``name`` was decided with ``key``; warn once when, during requests,
    it has been decided both with keys and with ``None``."""
    if not _in_request.get() or not isinstance(name, str):
        return
    seen, other = (_unkeyed, _keyed) if key is None else (_keyed, _unkeyed)
    if name in seen and name not in other:
        return
    with _lock:
        if name not in seen and len(seen) < _MAX_NAMES:
            seen.add(name)
        if name not in other or name in _warned:
            return
        _warned.add(name)
    logger.warning(
        "rate limit %r was decided during requests both with a key and with key=None: None is one "
        "bucket shared by every such request. If the key is request.user.pk, every visitor who is not "
        "signed in shares it; key=request_key(request, 'user_or_ip') (django_tokenbucket.request_keys) "
        "keys them by address instead. (Shown once per limit, in DEBUG.)",
        name,
    )
