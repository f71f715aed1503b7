"""The receivers of Django's authentication signals.

``user_login_failed``: a failure that ``LoginBackend`` did not count is counted here, so
that a project's own login code that sends the signal (or a backend listed before
``LoginBackend`` that refuses) spends its keys' tokens too; it cannot be refused
before its password is checked, only counted. A failure the backend counted (or
refused) is skipped: Django sends the signal for those too.

``user_logged_in``: a user that ``LoginBackend`` returned carries Django's record of
that backend; the session is given the backend that checked the password instead, so
that it never depends on ``LoginBackend`` being listed.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, load_backend
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.exceptions import ImproperlyConfigured
from django.dispatch import receiver
from django.utils.module_loading import import_string

from ..api import limiter
from . import config
from .attempts import Attempt
from .backend import CHECKED_BY, LoginBackend, active, handled_failure
from .keys import login_keys

__all__ = ["know_the_lockouts_limit"]


@receiver(user_login_failed, dispatch_uid="django_tokenbucket.auth.login_failed")
def _login_failed(sender: Any, credentials: dict[str, Any], request: Any = None, **kwargs: Any) -> None:
    login = active()
    if login is None or handled_failure(request, credentials) or "password" not in credentials:
        return
    keys = login_keys(login, request, credentials)
    if not keys:
        return
    attempt = Attempt.of(login, keys, request, sender=LoginBackend)
    if attempt.reserve() is None:
        attempt.failed()


@receiver(user_logged_in, dispatch_uid="django_tokenbucket.auth.logged_in")
def _logged_in(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    backend_path = getattr(user, "backend", None)
    if not isinstance(backend_path, str) or not config.listed(LoginBackend):
        return
    path = getattr(user, CHECKED_BY, None)
    if path is None:
        try:
            if not issubclass(import_string(backend_path), LoginBackend):
                return
        except ImportError:
            return
        path = _first_getter()
    elif backend_path == path:
        return
    if path is None:
        return
    user.backend = path
    session = getattr(request, "session", None)
    if session is not None and session.get(BACKEND_SESSION_KEY) == backend_path:
        session[BACKEND_SESSION_KEY] = path


def _first_getter() -> str | None:
    """The first backend after ``LoginBackend`` that can find a session's user (``force_login``
    picks ``LoginBackend``, the first listed with ``get_user``)."""
    for path in settings.AUTHENTICATION_BACKENDS:
        backend = load_backend(path)
        if not isinstance(backend, LoginBackend) and hasattr(backend, "get_user"):
            return str(path)
    return None


def know_the_lockouts_limit() -> None:
    """Make the bucket that counts lockouts (``<LIMIT>.lockouts``, COOLOFF a callable) known
    to this process' admin, command and cleanup, as a limit of LIMITS is: it is decided
    with an inline config, which a process learns when it first decides it."""
    try:
        login = config.configured()
        if login is not None and login.counts_lockouts:
            spec = login.lockouts_spec()
            limiter.resolve(spec["name"], spec["config"])
    except ImproperlyConfigured:
        pass  # the system checks say what


know_the_lockouts_limit()
