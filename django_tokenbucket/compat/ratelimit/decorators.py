"""``@ratelimit``, as django-ratelimit 4.1's: count the request, set ``request.limited``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.http import HttpRequest
from django.utils.module_loading import import_string

from ...exceptions import RateLimited
from . import ALL, UNSAFE
from .core import _decide
from .exceptions import Ratelimited

__all__ = ["ratelimit"]

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
        def limited(request: HttpRequest) -> bool:
            decided = _decide(request, group, fn, key, rate, method, increment=True)
            over = decided is not None and decided[0]["should_limit"]
            request.limited = over or getattr(request, "limited", False)  # type: ignore[attr-defined]
            if over and block:
                assert decided is not None
                raise _exception(decided[1])
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

        return functools.wraps(fn)(wrapped)  # type: ignore[return-value]

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
