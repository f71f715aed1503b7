"""``RatelimitMiddleware``: answers ``Ratelimited`` with ``settings.RATELIMIT_VIEW``."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.utils.module_loading import import_string

from .exceptions import Ratelimited

__all__ = ["RatelimitMiddleware"]


class RatelimitMiddleware:
    """Turn a raised ``Ratelimited`` into the response of the view ``RATELIMIT_VIEW``.

    ``RATELIMIT_VIEW`` is a dotted path to a view ``(request, exception)``. Without it,
    use ``django_tokenbucket.middleware.RateLimitMiddleware``, which answers 429 with
    ``Retry-After``.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponseBase | None:
        if not isinstance(exception, Ratelimited):
            return None
        path = getattr(settings, "RATELIMIT_VIEW", None)
        if not path:
            raise ImproperlyConfigured(
                "RatelimitMiddleware needs settings.RATELIMIT_VIEW, the dotted path of a view "
                "(request, exception); or use django_tokenbucket.middleware.RateLimitMiddleware"
            )
        view: Callable[[HttpRequest, Exception], HttpResponseBase] = import_string(path)
        return view(request, exception)
