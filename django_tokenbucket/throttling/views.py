"""``@ratelimit`` on DRF views: decided right after DRF authenticates the request.

``decorators`` hands a DRF view's limits here (see ``decorators._limit_drf_view``), so
that ``key="user"`` is DRF's user (a token's, a JWT's) and ``post:`` fields come from
DRF's parsed ``request.data``.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import APIException, Throttled
from rest_framework.request import Request as DRFRequest

from ..exceptions import BackendUnavailable
from ..http import ratelimit_headers
from ..settings import tokenbucket_settings
from ..view_limits import decide_view_limits
from .throttles import ServiceUnavailable, no_store

__all__ = ["limit_after_authentication"]


def limit_after_authentication(view_class: type, limits: tuple[Any, ...] | None = None) -> None:
    """Decide ``@ratelimit``'s limits on a DRF view right after DRF authenticates, in place.

    ``limits`` are the class's own (``@ratelimit`` on the class); a decorated function of
    the class (``as_view()``, ``@api_view``) hands its limits over on the request instead,
    so the class's other routes are untouched. ``perform_authentication`` is where DRF's
    request first knows its user (a token's, a JWT's, the session's) and can parse its
    body. The limits are decided there whether authentication succeeded or failed, and
    before permissions and throttles, so that a request DRF then refuses (401, 403) has
    spent its token, as a guessed credential must: a request whose credentials fail is
    keyed as anonymous (``"user"`` falls back to its address). A refused request gets
    DRF's 429 with ``Retry-After``; a failed store, 503.
    """
    if limits is not None:
        view_class._tokenbucket_chain = limits  # type: ignore[attr-defined]
    original = view_class.perform_authentication  # type: ignore[attr-defined]
    if getattr(original, "decides_view_limits", False):
        return  # hooked already, here or on a base class: the hook reads the chain per request

    def perform_authentication(self: Any, request: DRFRequest) -> None:
        try:
            original(self, request)
        except APIException:
            _decide_view_limits(self, request)  # a failed credential counts, as anonymous
            raise
        _decide_view_limits(self, request)

    perform_authentication.decides_view_limits = True  # type: ignore[attr-defined]
    view_class.perform_authentication = perform_authentication  # type: ignore[attr-defined]


def _decide_view_limits(view: Any, request: DRFRequest) -> None:
    # The limits a decorated function handed over, then the class's own (the most derived
    # class's: a decorated subclass of a decorated view adds its own), all-or-nothing.
    handed_over = getattr(request, "_request", request).__dict__.get("_tokenbucket_drf_chain", ())
    chain = (*handed_over, *getattr(type(view), "_tokenbucket_chain", ()))
    if not chain:
        return
    try:
        blocking = decide_view_limits(request, chain)
    except BackendUnavailable as exc:
        no_store(view)
        raise ServiceUnavailable() from exc
    headers = getattr(view, "headers", None)
    if tokenbucket_settings.HEADERS and isinstance(headers, dict):
        headers.update(ratelimit_headers(request.ratelimits))  # type: ignore[attr-defined]
    if blocking is not None:
        no_store(view)
        raise Throttled(wait=blocking.retry_after)
