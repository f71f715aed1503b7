"""Whether login protection is on: ``TOKENBUCKET["LOGIN"]`` (parsed by
``django_tokenbucket.settings``) and the backend listed in ``AUTHENTICATION_BACKENDS``.

Each read once per value, and again when it changes (``django_tokenbucket.lifecycle``),
so that a login pays a dict lookup for them.
"""

from __future__ import annotations

from django.conf import settings
from django.utils.module_loading import import_string

from ..settings import LoginSettings, tokenbucket_settings

__all__ = ["BACKEND_PATH", "configured", "listed", "settings_changed"]

#: Where ``AUTHENTICATION_BACKENDS`` names the backend.
BACKEND_PATH = "django_tokenbucket.auth.LoginBackend"


def configured() -> LoginSettings | None:
    """Return ``TOKENBUCKET["LOGIN"]`` validated, whether or not the backend is listed (None:
    LOGIN is None or False); ImproperlyConfigured when it is malformed."""
    return tokenbucket_settings.login


def listed(backend: type) -> bool:
    """Whether ``AUTHENTICATION_BACKENDS`` lists ``backend`` (or a subclass of it)."""
    found = _listed.get(backend)
    if found is None:
        found = False
        for path in getattr(settings, "AUTHENTICATION_BACKENDS", ()):
            try:
                candidate = import_string(path)
            except ImportError:
                continue  # Django's own checks and authenticate() report it
            if isinstance(candidate, type) and issubclass(candidate, backend):
                found = True
                break
        _listed[backend] = found
    return found


_listed: dict[type, bool] = {}


def settings_changed() -> None:
    """Read ``AUTHENTICATION_BACKENDS`` again (``django_tokenbucket.lifecycle``)."""
    _listed.clear()
