"""The pages of the example project, each showing one integration of django_tokenbucket."""

from __future__ import annotations

import asyncio
from decimal import Decimal, InvalidOperation
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login as auth_login
from django.contrib.auth.forms import AuthenticationForm
from django.db import connection, transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.debug import sensitive_post_parameters
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from django_tokenbucket import Status, limiter
from django_tokenbucket.algorithms import MICRO
from django_tokenbucket.celery import schedule
from django_tokenbucket.decorators import ratelimit
from django_tokenbucket.http import default_response
from django_tokenbucket.request_keys import request_key
from django_tokenbucket.settings import tokenbucket_settings

from . import llm, tasks
from .models import SummaryJob


def _wants_json(request: HttpRequest) -> bool:
    return "application/json" in request.headers.get("Accept", "")


def _owner(key: Any) -> str:
    """Return a readable label of a ``user_or_ip`` key: ``user 3`` or ``address 127.0.0.1``."""
    kind, value = key
    return f"user {value}" if kind == "user" else f"address {value}"


def too_many_requests(request: HttpRequest, status: Status | None) -> HttpResponse:
    """The 429 of every @ratelimit and RateLimited (``TOKENBUCKET["RESPONSE"]``): a page for browsers."""
    retry_after = status.retry_after_header if status is not None else None
    if request.path.startswith(_JSON_ENDPOINTS):
        # A JSON endpoint answers JSON whatever the client accepts (curl sends */*).
        return JsonResponse({"detail": "Too many requests.", "retry_after": retry_after}, status=429)
    if _wants_json(request):
        return default_response(request, status)
    return render(request, "demo/429.html", {"status": status, "retry_after": retry_after}, status=429)


#: Views that answer JSON (the API and the async converter): their 429s are JSON too.
_JSON_ENDPOINTS = ("/api/", "/convert/")


# -- home ------------------------------------------------------------------------------


def home(request: HttpRequest) -> HttpResponse:
    backend = tokenbucket_settings.BACKEND.rsplit(".", 1)[-1]
    context = {
        "backend": "Redis" if backend == "RedisBackend" else f"the database ({connection.vendor})",
        "broker": settings.CELERY_BROKER_URL.split("://", 1)[0],
    }
    return render(request, "demo/home.html", context)


# -- login: login protection, no decorator ---------------------------------------------


@sensitive_post_parameters("password")
@never_cache
def login_view(request: HttpRequest) -> HttpResponse:
    """Log in with Django's AuthenticationForm: nothing here limits anything.

    ``LoginBackend`` (first in AUTHENTICATION_BACKENDS) counts the failures of every
    ``authenticate()``, this form's and the admin's, per username and per address; a
    locked-out username is refused before its password is checked, and
    ``LOGIN["RESPONSE"]`` (``locked_out``) answers with the lockout page.
    """
    form = AuthenticationForm(request, data=request.POST or None)
    if request.method == "POST" and form.is_valid():
        auth_login(request, form.get_user())
        messages.success(request, f"Welcome, {form.get_user().get_username()}.")
        next_url = request.GET.get("next", "")
        if not url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()}):
            next_url = reverse("home")
        return redirect(next_url)
    return render(request, "demo/login.html", {"form": form})


#: The lockouts of a key within LOCKOUT_MEMORY (an hour here): 30 s, 2 min, then 10 min.
LOCKOUTS = (30, 120, 600)


def lockout_seconds(lockouts: int) -> int:
    """``LOGIN["COOLOFF"]``: how long lockout number ``lockouts`` of a key lasts."""
    return LOCKOUTS[min(lockouts, len(LOCKOUTS)) - 1]


def locked_out(request: HttpRequest, status: Status) -> HttpResponse:
    """``LOGIN["RESPONSE"]``: the page of a login refused because its key is locked out."""
    retry_after = status.retry_after_header
    return render(request, "demo/429.html", {"status": status, "retry_after": retry_after, "login": True}, status=429)


# -- an async view: @ratelimit on async def -----------------------------------------------

#: Exchange rates against the euro, as the (simulated) partner API would return them.
EXCHANGE_RATES = {"EUR": Decimal("1"), "USD": Decimal("1.08"), "GBP": Decimal("0.85"), "CHF": Decimal("0.95")}


@require_GET
@ratelimit("partner_api", key="ip")
async def convert(request: HttpRequest) -> JsonResponse:
    """Convert an amount between currencies through a partner API that bills per call.

    An ``async def`` view: the limit is decided off the event loop, then the view
    awaits the partner. 10 calls per client per minute (fixed windows).
    """
    source = request.GET.get("from", "EUR").upper()
    target = request.GET.get("to", "USD").upper()
    try:
        amount = Decimal(request.GET.get("amount", "100"))
    except InvalidOperation:
        return JsonResponse({"detail": "amount must be a number"}, status=400)
    if source not in EXCHANGE_RATES or target not in EXCHANGE_RATES:
        return JsonResponse({"detail": f"currencies: {', '.join(EXCHANGE_RATES)}"}, status=400)
    await asyncio.sleep(0.05)  # the partner's round trip
    result = amount / EXCHANGE_RATES[source] * EXCHANGE_RATES[target]
    status: Status = request.ratelimit  # type: ignore[attr-defined]
    return JsonResponse(
        {
            "amount": str(amount),
            "from": source,
            "to": target,
            "result": str(result.quantize(Decimal("0.01"))),
            "partner_calls_left": status.remaining,
        }
    )


# -- expensive work: reserve LLM tokens and run the job with Celery when they exist ----


def _job_json(job: SummaryJob) -> dict[str, Any]:
    def iso(moment: Any) -> str | None:
        return moment.isoformat() if moment else None

    return {
        "id": job.pk,
        "status": job.status,
        "tokens_reserved": job.tokens_reserved,
        "tokens_used": job.tokens_used,
        "created_at": iso(job.created_at),
        "scheduled_for": iso(job.scheduled_for),
        "ran_at": iso(job.ran_at),
        "finished_at": iso(job.finished_at),
        "lateness": job.lateness,
        "summary": job.summary,
    }


def _budget(key: Any) -> dict[str, Any]:
    status = limiter.get_status("llm_tokens", key)
    return {"tokens_now": round(status.value or 0), "capacity": round(status.capacity)}


@require_http_methods(["GET", "POST"])
def summaries(request: HttpRequest) -> HttpResponse:
    """List this caller's summary jobs; POST a text to summarise.

    A job reserves its worst case in LLM tokens (``schedule(..., reserve=True)``) and
    runs on the Celery worker at the moment those tokens exist; when more than 30,000
    tokens are already reserved ahead, it is refused with 429 and Retry-After.
    """
    key = request_key(request, "user_or_ip")
    if request.method == "POST":
        return _create_summary(request, key)
    jobs = SummaryJob.objects.filter(owner=_owner(key))[:25]
    context = {
        "jobs": jobs,
        "budget": _budget(key),
        "max_length": llm.MAX_TEXT_LENGTH,
        "max_length_display": f"{llm.MAX_TEXT_LENGTH:,}",
    }
    return render(request, "demo/summaries.html", context)


def _create_summary(request: HttpRequest, key: Any) -> HttpResponse:
    text = request.POST.get("text", "").strip()
    if not text or len(text) > llm.MAX_TEXT_LENGTH:
        detail = f"give a text of 1 to {llm.MAX_TEXT_LENGTH:,} characters"
        if _wants_json(request):
            return JsonResponse({"detail": detail}, status=400)
        messages.error(request, detail)
        return redirect("summaries")
    cost = llm.worst_case_tokens(text)
    with transaction.atomic():
        job = SummaryJob.objects.create(owner=_owner(key), text=text, tokens_reserved=cost)
        # Published only if this transaction commits. Beyond max_reserved it raises
        # RateLimited, which rolls the job back and which RateLimitMiddleware turns
        # into a 429. atomic=False: the LLM call takes seconds, and holding a
        # transaction that long would stall every other writer (on SQLite, all of them).
        scheduled = schedule(tasks.summarise.s(job.pk), "llm_tokens", key=key, count=cost, atomic=False, throws=True)
        job.reservation, job.scheduled_for = scheduled.reservation, scheduled.eta
        job.save(update_fields=["reservation", "scheduled_for"])
    if _wants_json(request):
        return JsonResponse({"job": _job_json(job), "budget": _budget(key)}, status=202)
    wait = (scheduled.eta - timezone.now()).total_seconds() if scheduled.eta else 0
    when = f"in {wait:.1f} s, when they exist" if wait > 0.5 else "now"
    messages.success(request, f"Job {job.pk} reserved {cost:,} tokens and runs {when}.")
    return redirect("summaries")


@require_GET
def summary_jobs(request: HttpRequest) -> JsonResponse:
    """This caller's jobs as JSON (the summaries page polls it)."""
    key = request_key(request, "user_or_ip")
    jobs = SummaryJob.objects.filter(owner=_owner(key))[:25]
    return JsonResponse({"jobs": [_job_json(job) for job in jobs], "budget": _budget(key)})


# -- the playground: a bucket on a chart --------------------------------------------------

#: The limits a visitor may fire at and reset (their own bucket only), with what they show.
PLAYGROUND_LIMITS = {
    "playground_bucket": "Token bucket: a burst of 5, then one token back every second.",
    "playground_slow": "Token bucket: 10 tokens, one back every 6 seconds.",
    "playground_window": "Fixed window: 5 calls per 10-second window, whatever happened in the last one.",
    "playground_reserve": "Reservations: calls may go 5 tokens into debt; retry_after says when their work may run.",
}


def _limit_json(name: str) -> dict[str, Any]:
    limit = limiter.resolve(name)
    return {
        "name": name,
        "description": PLAYGROUND_LIMITS[name],
        "kind": limit.kind,
        "capacity": limit.capacity_tokens,
        "rate": limit.rate_tokens,
        "period": limit.period_seconds,
        "max_reserved": None if limit.max_reserved is None else limit.max_reserved / MICRO,
    }


def _status_json(status: Status) -> dict[str, Any]:
    return {
        "ok": status.ok,
        "count": status.count,
        "value": status.value,
        "timestamp": status.timestamp,
        "retry_after": status.retry_after,
        "reset_after": status.reset_after,
    }


def playground(request: HttpRequest) -> HttpResponse:
    limits = [_limit_json(name) for name in PLAYGROUND_LIMITS]
    return render(request, "demo/playground.html", {"limits": limits})


def _playground_name(name: str) -> str:
    if name not in PLAYGROUND_LIMITS:
        raise Http404(f"no playground limit {name!r}")
    return name


@require_GET
def playground_status(request: HttpRequest, name: str) -> JsonResponse:
    """The bucket now (``limiter.get_status``: changes nothing), polled by the chart."""
    status = limiter.get_status(_playground_name(name), request_key(request, "ip"))
    return JsonResponse({"limit": _limit_json(name), "status": _status_json(status)})


@require_POST
def playground_hit(request: HttpRequest, name: str) -> JsonResponse:
    """Take ``count`` tokens (``limiter.limit``): 200 when allowed, 429 with Retry-After when not."""
    limit = limiter.resolve(_playground_name(name))
    try:
        count = int(request.POST.get("count", "1"))
        # The reservation limit shows debts: its calls reserve instead of being denied.
        status = limiter.limit(name, request_key(request, "ip"), count=count, reserve=limit.max_reserved is not None)
    except ValueError as exc:
        return JsonResponse({"detail": str(exc)}, status=400)
    response = JsonResponse({"status": _status_json(status)}, status=200 if status.ok else 429)
    if not status.ok and status.retry_after_header is not None:
        response["Retry-After"] = str(status.retry_after_header)
    return response


@require_POST
def playground_reset(request: HttpRequest, name: str) -> JsonResponse:
    """Forget this visitor's bucket: it is full again."""
    limiter.reset(_playground_name(name), request_key(request, "ip"))
    return JsonResponse({"status": _status_json(limiter.get_status(name, request_key(request, "ip")))})
