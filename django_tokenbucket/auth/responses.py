"""What a client refused by login protection is answered (``RateLimitMiddleware``).

``authenticate()`` returns None for a refused login as for a wrong password, so the
view answers as it answers any failed login: a form shows its usual error (nothing that
tells a locked account from a wrong password, or whether the account exists). A JSON
client (``Accept`` or ``Content-Type`` naming JSON) whose login view answered with a
4xx gets ``TOKENBUCKET["RESPONSE"]``'s 429 instead, with ``Retry-After`` and
``Cache-Control: no-store`` (503 when the store failed and the limiter fails closed).
``LOGIN["RESPONSE"]``, a callable ``(request, status) -> response``, answers every
refused login instead, forms included (a lockout page, a redirect); a 429 of its gets
``Retry-After`` unless it set one.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponseBase

from ..exceptions import BackendUnavailable
from ..http import rate_limited_response, unavailable_response, wants_json
from .attempts import refusal_of
from .backend import active

__all__ = ["login_response"]


def login_response(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    """Return the answer to ``request``: ``response``, unless its login was refused by the limit."""
    refusal = refusal_of(request)
    code = response.status_code
    if refusal is None or (200 < code < 400):
        return response  # no refused login, or the view went on to something else (a redirect)
    login = active()
    if refusal.status is not None and login is not None and login.response is not None:
        hooked: HttpResponseBase = login.response(request, refusal.status)
        retry_after = refusal.status.retry_after_header
        if hooked.status_code == 429 and retry_after is not None and not hooked.has_header("Retry-After"):
            hooked["Retry-After"] = str(retry_after)
        return hooked
    if not wants_json(request) or not 400 <= code < 500:
        return response
    if refusal.unavailable:
        name = login.limit if login is not None else "login"
        return unavailable_response(request, BackendUnavailable(name, "the store failed"))
    if refusal.status is None:
        return response
    return rate_limited_response(request, refusal.status)
