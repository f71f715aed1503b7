"""``@ratelimit``, as django-ratelimit 4.1's: count the request, set ``request.limited``."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.http import HttpRequest
from django.utils.module_loading import import_string

from ... import registry
from ...exceptions import RateLimited
from ...request_keys import note_view_key
from .core import group_of, is_ratelimited, last_status
from .exceptions import Ratelimited
from .methods import ALL, UNSAFE

__all__ = ["ratelimit"]

#: The attribute set on every view this ``ratelimit`` decorates.
MARK = "_tokenbucket_compat_ratelimit"

View = TypeVar("View", bound=Callable[..., Any])


def ratelimit(
    group: str | None = None, key: Any = None, rate: Any = None, method: Any = ALL, block: bool = True
) -> Callable[[View], View]:
    """Count each request to the view against ``rate`` (see ``core.get_usage``).

    ``request.limited`` is set on every request (True when this or a decorator above it
    found the request over its limit). With ``block`` a limited request raises
    ``RATELIMIT_EXCEPTION_CLASS`` (default ``Ratelimited``) instead of reaching the view.
    Works on function views, ``async def`` views and with ``method_decorator``.
    """

    def decorator(fn: View) -> View:
        # Known before any request is decided: the command and the admin build the keys
        # an operator types for this group's limits as django-ratelimit's. (A function
        # made by exec() has no module to name its group by; its first request does.)
        if group is not None or isinstance(getattr(fn, "__module__", None), str):
            registry.record_compat_group(group if group is not None else group_of(fn))
        note_view_key(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}", key)  # for W005

        def limited(request: HttpRequest) -> bool:
            old_limited = getattr(request, "limited", False)
            token = last_status.set(None)
            try:
                # Looked up in this module at each call, as django-ratelimit's decorator does,
                # so that mock.patch("...decorators.is_ratelimited") decides for it.
                over = is_ratelimited(
                    request=request, group=group, fn=fn, key=key, rate=rate, method=method, increment=True
                )
                status = last_status.get()
            finally:
                last_status.reset(token)
            request.limited = over or old_limited  # type: ignore[attr-defined]
            if over and block:
                raise _exception(status)
            return over

        if iscoroutinefunction(fn):

            async def async_wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                await sync_to_async(limited)(request)
                return await fn(request, *args, **kwargs)

            wrapped: Callable[..., Any] = markcoroutinefunction(async_wrapped)
        else:

            def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                limited(request)
                return fn(request, *args, **kwargs)

        decorated = wraps(fn)(wrapped)
        # Marks the view for the checks (they look for it in the URLconf). functools.wraps
        # copies it outwards, and method_decorator onto the method it makes.
        setattr(decorated, MARK, True)
        return decorated  # type: ignore[return-value]

    return decorator


def _exception(status: Any) -> Exception:
    """Return the exception to raise: ``RATELIMIT_EXCEPTION_CLASS``, with the details if ours."""
    cls = getattr(settings, "RATELIMIT_EXCEPTION_CLASS", Ratelimited)
    if isinstance(cls, str):
        cls = import_string(cls)
    if isinstance(cls, type) and issubclass(cls, RateLimited) and status is not None:
        return cls(status.name, status.key, status.retry_after, status)
    exception: Exception = cls()
    return exception


ratelimit.ALL = ALL  # type: ignore[attr-defined]
ratelimit.UNSAFE = UNSAFE  # type: ignore[attr-defined]
