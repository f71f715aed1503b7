"""The buckets of the other backends (Redis, or a database backend on another database).

Listed, inspected and reset by views of their own (``buckets/<alias>/``), through the
backend's ``list_buckets`` (SCAN pages on Redis), ``reset`` and ``reset_all``; a banner
says what a backend cannot show (labels, counts and filters by state, listing at all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth import get_permission_codename
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from .. import operations
from ..backends import backend_aliases, get_backend
from ..backends.base import BackendError, BaseBackend, StoredBucket
from ..keys import encode_key
from ..live import live_state
from ..models import RateLimit
from ..registry import KnownLimit, known_limits
from ..request_keys import key_from_text
from ..shards import key_buckets
from ..text import describe_rate, format_duration, format_tokens
from .display import DIGEST, HEX_PREFIX, fill_meter, full_again_text, key_html, local_time

__all__ = ["MAX_ACTION_ROWS", "BucketAdminViews", "limitations", "stored_elsewhere"]

#: Resets and adjustments from the admin act on at most this many rows at once; more
#: is a job for ``manage.py tokenbucket reset NAME`` (one LogEntry per row adds up).
MAX_ACTION_ROWS = 10_000


@dataclass(frozen=True)
class _Elsewhere:
    alias: str
    backend: str
    names: list[str]
    #: The page that lists this backend's buckets; None when it cannot list them.
    url: str | None
    limitations: list[str]


def limitations(backend: BaseBackend) -> list[str]:
    """Return what the admin cannot show of ``backend``'s buckets, as sentences for a banner."""
    if not backend.lists_buckets:
        return [
            str(
                _(
                    "%(backend)s cannot list its buckets: inspect or reset one key with "
                    "“manage.py tokenbucket show|reset NAME --key SPEC=VALUE”."
                )
                % {"backend": type(backend).__name__}
            )
        ]
    found = []
    if not backend.keeps_labels:
        found.append(
            str(
                _(
                    "%(backend)s keeps no readable key labels: keys show as their digest. Search an exact key "
                    "(alice, ip=203.0.113.7, user=42) to find its bucket."
                )
                % {"backend": type(backend).__name__}
            )
        )
    if not backend.counts_cheaply:
        found.append(
            str(
                _(
                    "Keys are not counted or filtered by state here: %(backend)s would have to read every key "
                    "of its store. “manage.py tokenbucket list” and “show NAME” count them."
                )
                % {"backend": type(backend).__name__}
            )
        )
    return found


def stored_elsewhere(admin_site: str, database: str) -> list[_Elsewhere]:
    """Return the backends whose buckets are not rows of ``database``, with the limits they hold.

    Without this, a project on Redis sees an empty list and no reason for it.
    """
    limits = known_limits(as_rows=False)
    elsewhere = []
    for alias in backend_aliases():
        backend = get_backend(alias)
        if backend.database_alias() != database:
            names = sorted(name for name, known in limits.items() if known.config.backend == alias)
            url = reverse(f"{admin_site}:django_tokenbucket_ratelimit_buckets", args=[alias])
            elsewhere.append(
                _Elsewhere(
                    alias, type(backend).__name__, names, url if backend.lists_buckets else None, limitations(backend)
                )
            )
    return elsewhere


def _limits_on(alias: str) -> dict[str, KnownLimit]:
    return {name: known for name, known in known_limits().items() if known.config.backend == alias}


class BucketAdminViews(admin.ModelAdmin):  # type: ignore[type-arg]
    """The buckets of one backend, through its listing capabilities: list, inspect, reset.

    The base of ``RateLimitAdmin`` (Django's admin needs a model for its pages; these
    are extra views of the rate-limit model, under its permissions).
    """

    bucket_page_size = 100

    def has_reset_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Return whether the user may reset or adjust keys: change or reset permission."""
        opts = self.opts
        return any(
            request.user.has_perm(f"{opts.app_label}.{codename}")
            for codename in (get_permission_codename("change", opts), f"reset_{opts.model_name}")
        )

    def _url(self, view: str, alias: str, **query: str) -> str:
        url = reverse(f"{self.admin_site.name}:django_tokenbucket_ratelimit_{view}", args=[alias])
        return f"{url}?{urlencode(query)}" if query else url

    def _backend(self, alias: str) -> BaseBackend:
        if alias not in backend_aliases():
            raise Http404(f"No rate-limit backend {alias!r} is configured.")
        return get_backend(alias)

    def _limit_of(self, alias: str, name: str | None) -> KnownLimit:
        known = _limits_on(alias).get(name or "")
        if known is None:
            raise Http404(f"No rate limit {name!r} is stored on backend {alias!r}.")
        return known

    def _base_context(self, request: HttpRequest, alias: str, backend: BaseBackend, title: Any) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.opts,
            "alias": alias,
            "backend_name": type(backend).__name__,
            "limitations": limitations(backend),
            "buckets_url": self._url("buckets", alias),
            "can_reset": self.has_reset_permission(request),
            "media": self.media,
        }

    def _find(
        self, backend: BaseBackend, known: KnownLimit, term: str, cursor: str | None
    ) -> tuple[list[StoredBucket], int, str | None, float | None]:
        """Buckets for a search, the store's time, where the search goes on and how far it
        has looked (``BucketPage.progress``).

        The exact key typed (and its shards) is a direct read; a digest prefix is a
        listing of its own, page by page (on Redis a SCAN of the keyspace).
        """
        found: dict[str, StoredBucket] = {}
        now, next_cursor, progress = 0, None, None
        if cursor is None:
            whole = known_limits(as_rows=False)[known.name].config
            for key in dict.fromkeys(k for k in (term, key_from_text(term)) if k is not None):
                for _config, part in key_buckets(whole, encode_key(key)):
                    page = backend.list_buckets(known.config, digest_prefix=part.digest)
                    found.update((bucket.digest, bucket) for bucket in page.buckets)
                    now = page.now
        if HEX_PREFIX.fullmatch(term.lower()):
            page = backend.list_buckets(
                known.config, cursor=cursor, digest_prefix=term.lower(), page_size=self.bucket_page_size
            )
            found.update((bucket.digest, bucket) for bucket in page.buckets)
            now, next_cursor, progress = page.now, page.cursor, page.progress
        return sorted(found.values(), key=lambda bucket: bucket.digest), now, next_cursor, progress

    def buckets_view(self, request: HttpRequest, alias: str) -> HttpResponse:
        """A page of one limit's buckets on backend ``alias`` (``?name=``, ``?cursor=``, ``?q=``)."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        backend = self._backend(alias)
        limits = _limits_on(alias)
        context = self._base_context(
            request, alias, backend, _("Rate-limit keys on backend “%(alias)s”") % {"alias": alias}
        )
        name = request.GET.get("name") or (min(limits) if limits else None)
        context.update(
            {
                "limit_links": [
                    (limit, self._url("buckets", alias, name=limit), limit == name) for limit in sorted(limits)
                ],
                "name": name,
                "rows": [],
            }
        )
        if not backend.lists_buckets or name is None:
            return TemplateResponse(request, "admin/django_tokenbucket/ratelimit/buckets.html", context)
        known = self._limit_of(alias, name)
        term = request.GET.get("q", "")
        cursor = request.GET.get("cursor") or None
        progress: float | None = None
        try:
            if term.strip():
                buckets, now, next_cursor, progress = self._find(backend, known, term.strip(), cursor)
            else:
                page = backend.list_buckets(known.config, cursor=cursor, page_size=self.bucket_page_size)
                buckets, now, next_cursor, progress = page.buckets, page.now, page.cursor, page.progress
        except ValueError as exc:  # a cursor or digest this store did not make
            raise Http404(str(exc)) from None
        except BackendError as exc:
            self.message_user(request, str(_("The store failed: %(error)s") % {"error": exc}), messages.ERROR)
            buckets, now, next_cursor = [], 0, None
        context.update(
            {
                "q": term,
                "scanned": _scanned_note(progress, more=next_cursor is not None, empty=not buckets),
                "config": describe_rate(known.config),
                "now": local_time(now) if now else None,
                "rows": [self._bucket_row(alias, known, bucket, now) for bucket in buckets],
                "next_url": (
                    self._url("buckets", alias, name=name, cursor=next_cursor, **({"q": term} if term.strip() else {}))
                    if next_cursor
                    else None
                ),
                "first_url": self._url("buckets", alias, name=name) if cursor or term.strip() else None,
                "reset_url": self._url("bucket_reset", alias),
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            }
        )
        return TemplateResponse(request, "admin/django_tokenbucket/ratelimit/buckets.html", context)

    def _bucket_row(self, alias: str, known: KnownLimit, bucket: StoredBucket, now: int) -> dict[str, Any]:
        live = live_state(known.config, bucket.state, bucket.digest, now)
        return {
            "digest": bucket.digest,
            "key": key_html(bucket.label, bucket.digest),
            "tokens": format_html(
                '{}<br><span class="tb-tokens">{} {} {}</span>',
                fill_meter(live),
                format_tokens(live.value, places=2),
                _("of"),
                format_tokens(live.capacity),
            ),
            "full_again": full_again_text(live),
            "url": self._url("bucket", alias, name=known.name, digest=bucket.digest),
        }

    def bucket_view(self, request: HttpRequest, alias: str) -> HttpResponse:
        """One bucket now (``?name=&digest=``): the figures of a row's detail page."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        backend = self._backend(alias)
        known = self._limit_of(alias, request.GET.get("name"))
        digest = request.GET.get("digest", "")
        if not DIGEST.fullmatch(digest) or not backend.lists_buckets:
            raise Http404("No such key.")
        try:
            page = backend.list_buckets(known.config, digest_prefix=digest)
        except BackendError as exc:
            self.message_user(request, str(_("The store failed: %(error)s") % {"error": exc}), messages.ERROR)
            return HttpResponseRedirect(self._url("buckets", alias, name=known.name))
        # Nothing stored: the key is full (reset, or full again and, on Redis, expired).
        # Its page still stands, so that a key seen denied (the analytics' denied keys
        # link here) can be blocked or exempted once its bucket is gone.
        bucket = page.buckets[0] if page.buckets else None
        live = live_state(known.config, None if bucket is None else bucket.state, digest, page.now)
        next_token = (
            _("available now")
            if live.next_token_after == 0
            else _("in %(duration)s") % {"duration": format_duration(live.next_token_after)}
        )
        fields = [
            (_("limit"), known.name),
            (_("key"), key_html("" if bucket is None else bucket.label, digest)),
            (_("key digest"), digest),
            (_("tokens now"), format_tokens(live.value)),
            (_("capacity"), format_tokens(live.capacity)),
            (
                _("fill"),
                format_html('{} <span class="tb-percent">{}%</span>', fill_meter(live), round(live.fill * 100)),
            ),
            (_("full again"), full_again_text(live)),
            (_("next token"), next_token),
        ]
        if bucket is None:
            fields.append((_("stored state"), _("none (reset, or full again and expired): the key is full")))
        else:
            fields += [
                (_("stored value (µ-tokens)"), f"{bucket.state.value} ({format_tokens(bucket.state.value)} tokens)"),
                (_("last update"), local_time(bucket.state.ts)),
                (_("stored ts (µs since the epoch)"), str(bucket.state.ts)),
            ]
        fields.append((_("config"), f"{describe_rate(known.config)} ({known.source})"))
        context = self._base_context(request, alias, backend, _("Key of “%(name)s”") % {"name": known.name})
        context.update(
            {
                "name": known.name,
                "digest": digest,
                "stored": bucket is not None,
                "fields": fields,
                "now": local_time(page.now),
                "list_url": self._url("buckets", alias, name=known.name),
                "reset_url": self._url("bucket_reset", alias),
            }
        )
        return TemplateResponse(request, "admin/django_tokenbucket/ratelimit/bucket.html", context)

    def bucket_reset_view(self, request: HttpRequest, alias: str) -> HttpResponse:
        """Reset keys (``digest``, repeatable) or every key (``all``, after a confirmation) of a limit.

        POST only, with the CSRF token (the admin's views check it); one LogEntry per key,
        one for a whole limit.
        """
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_reset_permission(request):
            raise PermissionDenied
        backend = self._backend(alias)
        known = self._limit_of(alias, request.POST.get("name"))
        list_url = self._url("buckets", alias, name=known.name)
        if request.POST.get("all"):
            if request.POST.get("confirm") != "yes":
                context = self._base_context(request, alias, backend, _("Reset every key?"))
                context.update(
                    {"name": known.name, "reset_url": self._url("bucket_reset", alias), "list_url": list_url}
                )
                return TemplateResponse(request, "admin/django_tokenbucket/ratelimit/reset_all.html", context)
            try:
                count = operations.reset_all(backend, known.config)
            except (BackendError, NotImplementedError) as exc:
                self.message_user(request, str(_("Nothing was reset: %(error)s") % {"error": exc}), messages.ERROR)
                return HttpResponseRedirect(list_url)
            _log_reset(request, alias, known.name, "", f"Reset all {count} keys of {known.name}: they start full.")
            self.message_user(
                request,
                ngettext("Reset %(count)d key of %(name)s.", "Reset %(count)d keys of %(name)s.", count)
                % {"count": count, "name": known.name},
                messages.SUCCESS,
            )
            return HttpResponseRedirect(list_url)
        digests = [d for d in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME) if DIGEST.fullmatch(d)]
        if not digests:
            self.message_user(request, str(_("No keys were selected: nothing was reset.")), messages.WARNING)
            return HttpResponseRedirect(list_url)
        if len(digests) > MAX_ACTION_ROWS:
            raise PermissionDenied
        try:
            operations.reset_buckets(backend, known.name, digests)
        except BackendError as exc:
            self.message_user(request, str(_("The store failed: %(error)s") % {"error": exc}), messages.ERROR)
            return HttpResponseRedirect(list_url)
        for digest in digests:
            _log_reset(request, alias, known.name, digest, "Reset: it starts full again.")
        self.message_user(
            request,
            ngettext("Reset %(count)d key.", "Reset %(count)d keys.", len(digests)) % {"count": len(digests)},
            messages.SUCCESS,
        )
        return HttpResponseRedirect(list_url)


def _scanned_note(progress: float | None, *, more: bool, empty: bool) -> str | None:
    """What a page says of how far its listing has looked through the store (on Redis a
    SCAN's estimate), so that a page without keys reads as "not yet", not "none"."""
    if progress is None:
        return None
    if not more:
        return str(_("Looked through all of the store’s keys."))
    # Rounded down, and never 100% before the end: the figure must not claim more.
    percent = "<1" if progress < 0.01 else str(min(99, int(progress * 100)))
    if empty:
        return str(
            _("Nothing found in the ~%(percent)s%% of the store’s keys looked through so far: the next page goes on.")
            % {"percent": percent}
        )
    return str(
        _("Looked through about %(percent)s%% of the store’s keys so far: the next page goes on.")
        % {"percent": percent}
    )


def _log_reset(request: HttpRequest, alias: str, name: str, digest: str, message: str) -> None:
    """One LogEntry for a reset of a bucket that is no row here (object_id: backend, name and digest)."""
    what = f"{name} [{digest[:12]}…]" if digest else name
    LogEntry.objects.create(
        user_id=cast(int, request.user.pk),
        content_type_id=ContentType.objects.get_for_model(RateLimit, for_concrete_model=False).pk,
        object_id=f"{alias}:{name}:{digest}"[:255] if digest else None,
        object_repr=f"{what} on backend {alias}"[:200],
        action_flag=DELETION,
        change_message=message,
    )
