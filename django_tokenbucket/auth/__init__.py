"""Login protection on Django's own authentication (docs/login.md).

::

    AUTHENTICATION_BACKENDS = [
        "django_tokenbucket.auth.LoginBackend",
        "django.contrib.auth.backends.ModelBackend",
    ]
    TOKENBUCKET = {
        "LIMITS": {"login_failures": "5/15m"},
        "LOGIN": {"LIMIT": "login_failures", "KEYS": ["username", "ip"], "COOLOFF": None},
    }

Every password login through ``authenticate()`` or ``aauthenticate()`` takes a token
per key before its password is checked and gives it back if the password was right:
only failures stay spent, and no more passwords are checked than the buckets hold, in
any number of processes. ``is_locked()`` says whether a username or an address is
locked out; ``unlock()`` (and ``manage.py tokenbucket unlock``) ends a lockout.
"""

from __future__ import annotations

from .backend import LoginBackend
from .unlock import Unlocked, ais_locked, aunlock, is_locked, unlock

__all__ = ["LoginBackend", "Unlocked", "ais_locked", "aunlock", "is_locked", "unlock"]
