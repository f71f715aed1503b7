"""``LoginBackend``: every password login that goes through ``authenticate()`` is counted.

Listed first in ``AUTHENTICATION_BACKENDS``, it sees every call of ``authenticate()``
and ``aauthenticate()`` (the admin's login, ``LoginView``, DRF's ``ObtainAuthToken``,
allauth, a project's own code) before any backend checks a password. For a call with a
``password`` it takes one token per key of ``TOKENBUCKET["LOGIN"]["KEYS"]`` from the
login limit, then checks the credentials with the backends listed after it, as
``authenticate()`` itself would: a success gives the tokens back, a failure keeps them.
A call it refuses (a key locked out or empty) raises ``PermissionDenied``, which stops
``authenticate()`` before any backend runs a password hasher: it returns None as for a
wrong password, and sends ``user_login_failed``. A failure raises it too, so that
``authenticate()`` does not run the backends after this one a second time.

Why it checks the credentials itself rather than return None and let Django go on:
``authenticate()`` tells no backend that a later one succeeded, and DRF's token view
and most API logins never call ``login()``, whose signal would. Knowing the outcome
where the tokens were taken is what lets a success cost nothing on every path. The
cost is that Django records this backend as the user's (``user.backend``); the
``user_logged_in`` receiver writes the backend that checked the password into the
session instead, and ``get_user`` asks the backends after this one, so sessions do not
depend on this backend being listed.

Calls without a ``password`` (``RemoteUserBackend``'s ``remote_user``, social logins,
tokens) pass through untouched, as do all calls while ``TOKENBUCKET["LOGIN"]`` is
None or False.
"""

from __future__ import annotations

import inspect
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import load_backend
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest

from ..settings import LoginSettings
from . import config
from .attempts import Attempt
from .keys import credential_username, login_keys

__all__ = ["LoginBackend", "active", "handled_failure"]


@dataclass
class _Handled:
    """A failure this backend counted, for the ``user_login_failed`` that follows it."""

    request: Any
    username: str | None
    consumed: bool = False


#: The failure this backend refused or counted last in this context: Django sends
#: ``user_login_failed`` for it right after, and the receiver must not count it again.
_handled: ContextVar[_Handled | None] = ContextVar("tokenbucket_login_handled", default=None)


def handled_failure(request: Any, credentials: dict[str, Any]) -> bool:
    """Whether the failure ``user_login_failed`` reports was counted by the backend
    already (then it is marked as reported, once)."""
    handled = _handled.get()
    if handled is None or handled.consumed or handled.request is not request:
        return False
    if handled.username != credential_username(credentials):
        return False
    handled.consumed = True
    return True


def _stop(request: Any, credentials: dict[str, Any]) -> PermissionDenied:
    """The PermissionDenied that ends ``authenticate()``, its failure noted as counted."""
    _handled.set(_Handled(request, credential_username(credentials)))
    return PermissionDenied("login refused by django_tokenbucket's login protection")


class LoginBackend:
    """Count failed password logins per ``TOKENBUCKET["LOGIN"]["KEYS"]``; refuse locked-out keys.

    List it first: ``AUTHENTICATION_BACKENDS = ["django_tokenbucket.auth.LoginBackend",
    "django.contrib.auth.backends.ModelBackend"]``. It grants no permissions.
    """

    def authenticate(self, request: HttpRequest | None, **credentials: Any) -> Any:
        """Check ``credentials`` with the backends after this one, counting a failure."""
        _handled.set(None)
        attempt = self._attempt(request, credentials)
        if attempt is None:
            return None
        refusal = attempt.reserve()
        if refusal is not None:
            raise _stop(request, credentials)
        try:
            user, path = self._check(request, credentials)
        except PermissionDenied:
            attempt.failed()
            raise _stop(request, credentials) from None
        if user is None:
            attempt.failed()
            raise _stop(request, credentials)
        attempt.succeeded()
        return _checked_by(user, path)

    async def aauthenticate(self, request: HttpRequest | None, **credentials: Any) -> Any:
        """``authenticate()`` for ``aauthenticate()``: the backends after this one are awaited."""
        _handled.set(None)
        attempt = self._attempt(request, credentials)  # no I/O: settings and the request
        if attempt is None:
            return None
        refusal = await attempt.areserve()
        if refusal is not None:
            raise _stop(request, credentials)
        try:
            user, path = await self._acheck(request, credentials)
        except PermissionDenied:
            await attempt.afailed()
            raise _stop(request, credentials) from None
        if user is None:
            await attempt.afailed()
            raise _stop(request, credentials)
        await attempt.asucceeded()
        return _checked_by(user, path)

    def _attempt(self, request: HttpRequest | None, credentials: dict[str, Any]) -> Attempt | None:
        """The attempt to count, None when this call is not one (no password, protection
        off, no key applies); PermissionDenied when it cannot be counted (no username)."""
        login = active()
        if login is None or "password" not in credentials:
            return None
        keys = login_keys(login, request, credentials)
        if keys is None:
            # Not a refusal by the limit: the form says what it says of any bad login.
            raise _stop(request, credentials)
        if not keys:
            return None
        return Attempt.of(login, keys, request, sender=LoginBackend)

    # -- the backends after this one -------------------------------------------------

    @staticmethod
    def _later(request: HttpRequest | None, credentials: dict[str, Any]) -> list[tuple[Any, str]]:
        """The backends listed after this one that take ``credentials``, as ``authenticate()`` picks them."""
        found, seen_self = [], False
        for path in settings.AUTHENTICATION_BACKENDS:
            backend = load_backend(path)
            if not seen_self:
                seen_self = isinstance(backend, LoginBackend)
                continue
            try:
                inspect.signature(backend.authenticate).bind(request, **credentials)
            except TypeError:
                continue
            found.append((backend, path))
        return found

    def _check(self, request: HttpRequest | None, credentials: dict[str, Any]) -> tuple[Any, str | None]:
        for backend, path in self._later(request, credentials):
            user = backend.authenticate(request, **credentials)
            if user is not None:
                return user, path
        return None, None

    async def _acheck(self, request: HttpRequest | None, credentials: dict[str, Any]) -> tuple[Any, str | None]:
        for backend, path in self._later(request, credentials):
            check = getattr(backend, "aauthenticate", None)
            if check is None:
                user = await sync_to_async(backend.authenticate)(request, **credentials)
            else:
                user = await check(request, **credentials)
            if user is not None:
                return user, path
        return None, None

    # -- sessions --------------------------------------------------------------------

    def get_user(self, user_id: Any) -> Any:
        """The user of a session that names this backend: as the backends after it find it."""
        for backend in self._getters():
            user = backend.get_user(user_id)
            if user is not None:
                return user
        return None

    async def aget_user(self, user_id: Any) -> Any:
        """``get_user()`` for async code."""
        for backend in self._getters():
            getter = getattr(backend, "aget_user", None)
            user = await (getter(user_id) if getter is not None else sync_to_async(backend.get_user)(user_id))
            if user is not None:
                return user
        return None

    @staticmethod
    def _getters() -> list[Any]:
        backends = [load_backend(path) for path in settings.AUTHENTICATION_BACKENDS]
        return [b for b in backends if not isinstance(b, LoginBackend) and hasattr(b, "get_user")]


def active() -> LoginSettings | None:
    """``TOKENBUCKET["LOGIN"]`` when ``AUTHENTICATION_BACKENDS`` lists ``LoginBackend``
    (protection is on), else None; ImproperlyConfigured when LOGIN is malformed."""
    return config.configured() if config.listed(LoginBackend) else None


#: The attribute that remembers, on a user this backend returned, the backend that
#: checked the password (Django records this one as ``user.backend``).
CHECKED_BY = "_tokenbucket_checked_by"


def _checked_by(user: Any, path: str | None) -> Any:
    try:
        setattr(user, CHECKED_BY, path)
    except AttributeError:  # a user object that takes no attributes: the session keeps this backend
        pass
    return user
