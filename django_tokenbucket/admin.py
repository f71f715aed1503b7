"""The Django admin for rate limits: live state of every stored key, and resets.

What a row shows is derived *now* (the store's clock) from its two stored numbers
and the limit's current config, with the same pure functions the backends decide
with. Nothing here ever writes a row from a form: a save would race with live
traffic and could mint tokens. Changes go through actions that lock the row
(``Set tokens``) or delete it (``Reset``: a missing row is a fresh, full key).

Built for tables of millions of rows: no full COUNT (the paginator counts at most
``CappedPaginator.cap + 1`` rows), no facets, the default order and the filter by name
served by the ``(name, -ts, -id)`` index.

Buckets of the other backends (Redis, or a database backend on another database) are
listed, inspected and reset by views of their own (``buckets/<alias>/``), through the
backend's ``list_buckets`` (SCAN pages on Redis), ``reset`` and ``reset_all``; a banner
says what a backend cannot show (labels, counts and filters by state, listing at all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, cast
from urllib.parse import urlencode

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.contrib.auth import get_permission_codename
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import F, QuerySet, Value
from django.db.models.functions import Coalesce
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from .algorithms import MICRO, State
from .backends import backend_aliases, get_backend
from .backends.base import BackendError, BaseBackend, StoredBucket
from .backends.database import database_now as store_now
from .backends.database.filters import count_by_state, state_q
from .keys import EncodedKey, encode_key
from .limits import LimitConfig
from .live import FULL, LIMITED, PARTIAL, LiveState, live_state
from .models import RateLimit
from .registry import KnownLimit, known_limits
from .request_keys import key_from_text
from .shards import shard_key
from .text import describe_rate, format_duration, format_tokens

__all__ = ["CappedPaginator", "RateLimitAdmin"]

#: Resets and adjustments from the admin act on at most this many rows at once; more
#: is a job for ``manage.py tokenbucket reset NAME`` (one LogEntry per row adds up).
MAX_ACTION_ROWS = 10_000

_LABEL_SHOWN = 40
_DIGEST = re.compile(r"[0-9a-f]{64}")
_UNCONFIGURED = "unconfigured"


class CappedPaginator(Paginator):  # type: ignore[type-arg]
    """A paginator that counts at most ``cap + 1`` rows.

    ``COUNT(*)`` over a million rows is the slowest query of a changelist, and the
    admin runs it on every page view (``show_full_result_count`` only avoids a second
    one). Past the cap the list says "more than 10,000" and offers that many pages.
    """

    cap = 10_000

    @cached_property
    def count(self) -> int:
        queryset = cast("QuerySet[Any]", self.object_list)
        return queryset[: self.cap + 1].count()

    @property
    def capped(self) -> bool:
        """Return whether there are more rows than were counted."""
        return self.count > self.cap


@dataclass(frozen=True)
class _Context:
    """What every row of one request is interpreted with."""

    now: int
    limits: dict[str, KnownLimit]


@dataclass(frozen=True)
class _Row:
    known: KnownLimit | None
    live: LiveState | None


def _context(request: HttpRequest, alias: str) -> _Context:
    # One clock reading per request: every row, filter and count of a page is
    # interpreted at the same instant, so they agree with each other.
    cache: dict[str, _Context] = request.__dict__.setdefault("_tokenbucket_admin", {})
    if alias not in cache:
        cache[alias] = _Context(now=store_now(alias), limits=known_limits())
    return cache[alias]


def _row(obj: RateLimit, context: _Context) -> _Row:
    row: _Row | None = getattr(obj, "_tokenbucket_row", None)
    if row is None:
        known = context.limits.get(obj.name)
        live = None
        if known is not None:
            live = live_state(known.config, State(obj.value, obj.ts), obj.key, context.now)
        row = _Row(known, live)
        obj._tokenbucket_row = row  # type: ignore[attr-defined]
    return row


def _local_time(us: int) -> str:
    try:
        moment = timezone.localtime(datetime.fromtimestamp(us / MICRO, tz=UTC))
    except (OverflowError, OSError, ValueError):
        return str(us)
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z")


def _meter(live: LiveState) -> SafeString:
    # <meter> colours itself from low/high/optimum: below one token (limited) it shows
    # as bad, full as good, in between as so-so. No inline style needed.
    return format_html(
        '<meter class="tb-meter" min="0" max="{}" low="{}" high="{}" optimum="{}" value="{}" title="{} ({}%)"></meter>',
        live.capacity,
        live.threshold,
        live.capacity - 1 if live.capacity > live.threshold else live.capacity,
        live.capacity,
        max(0, live.value),
        live.state,
        round(live.fill * 100),
    )


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
    ) -> tuple[list[StoredBucket], int, str | None]:
        """Buckets for a search, the store's time and where the search goes on.

        The exact key typed (and its shards) is a direct read; a digest prefix is a
        listing of its own, page by page (on Redis a SCAN of the keyspace).
        """
        found: dict[str, StoredBucket] = {}
        now, next_cursor = 0, None
        if cursor is None:
            whole = known_limits(as_rows=False)[known.name].config
            for key in dict.fromkeys(k for k in (term, key_from_text(term)) if k is not None):
                encoded = encode_key(key)
                shards = whole.shards
                parts = [encoded] if shards == 1 else [shard_key(encoded, i, shards) for i in range(shards)]
                for part in parts:
                    page = backend.list_buckets(known.config, digest_prefix=part.digest)
                    found.update((bucket.digest, bucket) for bucket in page.buckets)
                    now = page.now
        if _HEX_PREFIX.fullmatch(term.lower()):
            page = backend.list_buckets(
                known.config, cursor=cursor, digest_prefix=term.lower(), page_size=self.bucket_page_size
            )
            found.update((bucket.digest, bucket) for bucket in page.buckets)
            now, next_cursor = page.now, page.cursor
        return sorted(found.values(), key=lambda bucket: bucket.digest), now, next_cursor

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
        try:
            if term.strip():
                buckets, now, next_cursor = self._find(backend, known, term.strip(), cursor)
            else:
                page = backend.list_buckets(known.config, cursor=cursor, page_size=self.bucket_page_size)
                buckets, now, next_cursor = page.buckets, page.now, page.cursor
        except ValueError as exc:  # a cursor or digest this store did not make
            raise Http404(str(exc)) from None
        except BackendError as exc:
            self.message_user(request, str(_("The store failed: %(error)s") % {"error": exc}), messages.ERROR)
            buckets, now, next_cursor = [], 0, None
        context.update(
            {
                "q": term,
                "config": describe_rate(known.config),
                "now": _local_time(now) if now else None,
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
            "key": _key_html(bucket.label, bucket.digest),
            "tokens": format_html(
                '{}<br><span class="tb-tokens">{} {} {}</span>',
                _meter(live),
                format_tokens(live.value, places=2),
                _("of"),
                format_tokens(live.capacity),
            ),
            "full_again": _full_again(live),
            "url": self._url("bucket", alias, name=known.name, digest=bucket.digest),
        }

    def bucket_view(self, request: HttpRequest, alias: str) -> HttpResponse:
        """One bucket now (``?name=&digest=``): the figures of a row's detail page."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        backend = self._backend(alias)
        known = self._limit_of(alias, request.GET.get("name"))
        digest = request.GET.get("digest", "")
        if not _DIGEST.fullmatch(digest) or not backend.lists_buckets:
            raise Http404("No such key.")
        try:
            page = backend.list_buckets(known.config, digest_prefix=digest)
        except BackendError as exc:
            self.message_user(request, str(_("The store failed: %(error)s") % {"error": exc}), messages.ERROR)
            return HttpResponseRedirect(self._url("buckets", alias, name=known.name))
        if not page.buckets:
            self.message_user(
                request,
                str(_("That key has no stored state (reset, or full again and expired): it is full.")),
                messages.INFO,
            )
            return HttpResponseRedirect(self._url("buckets", alias, name=known.name))
        bucket = page.buckets[0]
        live = live_state(known.config, bucket.state, bucket.digest, page.now)
        next_token = (
            _("available now")
            if live.next_token_after == 0
            else _("in %(duration)s") % {"duration": format_duration(live.next_token_after)}
        )
        fields = [
            (_("limit"), known.name),
            (_("key"), _key_html(bucket.label, bucket.digest)),
            (_("key digest"), bucket.digest),
            (_("tokens now"), format_tokens(live.value)),
            (_("capacity"), format_tokens(live.capacity)),
            (_("fill"), format_html('{} <span class="tb-percent">{}%</span>', _meter(live), round(live.fill * 100))),
            (_("full again"), _full_again(live)),
            (_("next token"), next_token),
            (_("stored value (µ-tokens)"), f"{bucket.state.value} ({format_tokens(bucket.state.value)} tokens)"),
            (_("last update"), _local_time(bucket.state.ts)),
            (_("stored ts (µs since the epoch)"), str(bucket.state.ts)),
            (_("config"), f"{describe_rate(known.config)} ({known.source})"),
        ]
        context = self._base_context(request, alias, backend, _("Key of “%(name)s”") % {"name": known.name})
        context.update(
            {
                "name": known.name,
                "digest": bucket.digest,
                "fields": fields,
                "now": _local_time(page.now),
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
                count = backend.reset_all(known.config)
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
        digests = [d for d in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME) if _DIGEST.fullmatch(d)]
        if not digests:
            self.message_user(request, str(_("No keys were selected: nothing was reset.")), messages.WARNING)
            return HttpResponseRedirect(list_url)
        if len(digests) > MAX_ACTION_ROWS:
            raise PermissionDenied
        try:
            for digest in digests:
                backend.reset(known.config, EncodedKey(digest, ""))
                _log_reset(request, alias, known.name, digest, "Reset: it starts full again.")
        except BackendError as exc:
            self.message_user(request, str(_("The store failed: %(error)s") % {"error": exc}), messages.ERROR)
            return HttpResponseRedirect(list_url)
        self.message_user(
            request,
            ngettext("Reset %(count)d key.", "Reset %(count)d keys.", len(digests)) % {"count": len(digests)},
            messages.SUCCESS,
        )
        return HttpResponseRedirect(list_url)


_HEX_PREFIX = re.compile(r"[0-9a-f]{8,64}")


def _key_html(label: str, digest: str) -> SafeString:
    title = f"{label}\ndigest: {digest}" if label else f"digest: {digest}"
    if not label:
        return format_html('<span class="tb-digest" title="{}">{}…</span>', title, digest[:12])
    shown = label if len(label) <= _LABEL_SHOWN else label[: _LABEL_SHOWN - 1] + "…"
    return format_html('<span class="tb-key" title="{}">{}</span>', title, shown)


def _full_again(live: LiveState) -> SafeString | str:
    if live.full_after == 0:
        return format_html('<span class="tb-full">{}</span>', _("full"))
    if live.next_token_after:
        return format_html(
            '{}<br><span class="tb-next">{}</span>',
            _("in %(duration)s") % {"duration": format_duration(live.full_after)},
            _("next token in %(duration)s") % {"duration": format_duration(live.next_token_after)},
        )
    return _("in %(duration)s") % {"duration": format_duration(live.full_after)}


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


class RateLimitChangeList(ChangeList):
    """Interprets the page's rows once, at one clock reading."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        context = _context(request, self.queryset.db)
        rows = list(self.result_list)
        for obj in rows:
            _row(obj, context)
        self.result_list = rows


class LimitNameFilter(admin.SimpleListFilter):
    """Filter by limit name: the configured limits (and any name given in the URL)."""

    title = _("limit")
    parameter_name = "name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # Names come from the settings, not from SELECT DISTINCT over the table.
        return [(name, name) for name in sorted(known_limits())]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        return queryset.filter(name=value) if value else queryset


class StateFilter(admin.SimpleListFilter):
    """Filter by what a row holds now: limited, partially used, full, or not configured."""

    title = _("state now")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            (LIMITED, _("limited (less than one token)")),
            (PARTIAL, _("partially used")),
            (FULL, _("full")),
            (_UNCONFIGURED, _("limit not configured")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if not value:
            return queryset
        context = _context(request, queryset.db)
        if value == _UNCONFIGURED:
            return queryset.exclude(name__in=list(context.limits))
        if value not in (LIMITED, PARTIAL, FULL):
            return queryset.none()
        return queryset.filter(state_q([known.config for known in context.limits.values()], value, context.now))


class SetTokensForm(forms.Form):
    tokens = forms.DecimalField(
        label=_("Tokens"),
        min_value=Decimal(0),
        decimal_places=6,
        max_digits=24,
        help_text=_("The value each selected key holds from now on (at most its capacity)."),
    )


@admin.register(RateLimit)
class RateLimitAdmin(BucketAdminViews):
    """Rate limits: live state now, fill level, reset. Read-only except for the actions."""

    # What fits beside the admin's navigation sidebar and filters at 1280 px with long
    # names and keys; the detail page has every figure on its own line, the stored time too.
    list_display = ("limit_name", "key_label", "tokens", "full_again")
    list_display_links = ("key_label",)
    list_filter = (LimitNameFilter, StateFilter)
    search_fields = ("label",)
    search_help_text = _(
        "Search keys as shown (their first 64 characters), an exact key ('alice', 'post:username=alice'), "
        "or a whole key digest."
    )
    # The index order: a page is an index range scan, never a sort of the table.
    ordering = ("name", "-ts", "-id")
    sortable_by = ()
    list_per_page = 100
    list_max_show_all = 200
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = CappedPaginator
    actions = ("reset_selected", "set_tokens")
    fieldsets = (
        (None, {"fields": ("limit_name", "key_label", "key_digest")}),
        (
            _("Now"),
            {"fields": ("tokens_now", "capacity", "fill_level", "full_again", "next_token")},
        ),
        (_("Stored state"), {"fields": ("stored_value", "last_update", "stored_ts")}),
        (_("Limit"), {"fields": ("config_text",)}),
    )
    readonly_fields = (
        "limit_name",
        "key_label",
        "key_digest",
        "tokens_now",
        "capacity",
        "fill_level",
        "full_again",
        "next_token",
        "stored_value",
        "last_update",
        "stored_ts",
        "config_text",
    )
    change_list_template = "admin/django_tokenbucket/ratelimit/change_list.html"
    change_form_template = "admin/django_tokenbucket/ratelimit/change_form.html"

    class Media:
        css = {"all": ("django_tokenbucket/admin.css",)}

    # -- permissions ---------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # rows are made by the limiter

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Never through a form: saving a row read a moment ago would overwrite what
        # live traffic wrote since (and could hand back spent tokens).
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # "Reset" deletes, and logs what the key held

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Who may reset keys may see what they reset.
        return super().has_view_permission(request, obj) or self.has_reset_permission(request, obj)

    # -- the list ------------------------------------------------------------------------

    def get_ordering(self, request: HttpRequest) -> Any:
        if request.GET.get(StateFilter.parameter_name) in (LIMITED, PARTIAL):
            # These filters find their few rows through index ranges (rows written
            # recently, rows in debt). Given an order the index also serves, the planner
            # would rather walk the index in that order and test every row on the way;
            # the same order as expressions leaves it the index ranges and a short sort.
            return (Coalesce(F("name"), Value("")).asc(), (F("ts") + 0).desc(), "-id")
        return self.ordering

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RateLimitChangeList

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        results, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if _DIGEST.fullmatch(term.lower()):
            results = results | queryset.filter(key=term.lower())
        elif term:
            # Keys from request data are stored as digests only: found by the exact key,
            # as typed ("alice") or as the decorator builds it ("post:username=alice").
            keys = [term, key_from_text(term)]
            results = results | queryset.filter(key__in=[encode_key(key).digest for key in keys if key is not None])
        return results, may_have_duplicates

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if (
            request.method == "POST"
            and request.POST.get("action") in self.actions
            and not self.has_reset_permission(request)
        ):
            raise PermissionDenied
        extra = {
            "overview_url": reverse(f"{self.admin_site.name}:django_tokenbucket_ratelimit_limits"),
            "stored_elsewhere": stored_elsewhere(self.admin_site.name, self.get_queryset(request).db),
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = dict(extra_context or {})
        if self.has_reset_permission(request):
            extra["reset_url"] = reverse(f"{self.admin_site.name}:django_tokenbucket_ratelimit_reset", args=[object_id])
        obj = self.get_object(request, unquote(object_id))
        if obj is not None:
            extra["limit_url"] = reverse(f"{self.admin_site.name}:django_tokenbucket_ratelimit_limit", args=[obj.name])
        return super().change_view(request, object_id, form_url, extra)

    def _row(self, obj: RateLimit) -> _Row:
        row: _Row | None = getattr(obj, "_tokenbucket_row", None)
        if row is not None:
            return row
        # The detail page: interpreted on its own, at a fresh clock reading.
        alias = obj._state.db or "default"
        return _row(obj, _Context(now=store_now(alias), limits=known_limits()))

    @admin.display(description=_("limit"))
    def limit_name(self, obj: RateLimit) -> SafeString:
        if self._row(obj).known is None:
            return format_html(
                '{} <span class="tb-unknown" title="{}">{}</span>',
                obj.name,
                _("No limit of this name is configured: its rows cannot be interpreted."),
                _("not configured"),
            )
        return format_html("{}", obj.name)

    @admin.display(description=_("key"))
    def key_label(self, obj: RateLimit) -> SafeString:
        return _key_html(obj.label, obj.key)

    @admin.display(description=_("key digest"))
    def key_digest(self, obj: RateLimit) -> str:
        return obj.key

    @admin.display(description=_("tokens now"))
    def tokens_now(self, obj: RateLimit) -> SafeString | str:
        live = self._row(obj).live
        if live is None:
            return "—"
        text = format_tokens(live.value, places=2)
        if live.value < 0:
            return format_html('<span class="tb-debt" title="{}">{}</span>', _("reserved ahead"), text)
        return format_html('<span title="{}">{}</span>', format_tokens(live.value), text)

    @admin.display(description=_("tokens now"))
    def tokens(self, obj: RateLimit) -> SafeString | str:
        """The fill meter over "tokens of capacity · percent", for the list."""
        known, live = self._row(obj).known, self._row(obj).live
        if live is None or known is None:
            return "—"
        return format_html(
            '{}<br><span class="tb-tokens">{} {} {}</span>',
            _meter(live),
            self.tokens_now(obj),
            _("of"),
            format_tokens(known.config.capacity),
        )

    @admin.display(description=_("capacity"))
    def capacity(self, obj: RateLimit) -> str:
        known = self._row(obj).known
        return "—" if known is None else format_tokens(known.config.capacity)

    @admin.display(description=_("fill"))
    def fill_level(self, obj: RateLimit) -> SafeString | str:
        live = self._row(obj).live
        if live is None:
            return "—"
        return format_html('{} <span class="tb-percent">{}%</span>', _meter(live), round(live.fill * 100))

    @admin.display(description=_("full again"))
    def full_again(self, obj: RateLimit) -> SafeString | str:
        live = self._row(obj).live
        return "—" if live is None else _full_again(live)

    @admin.display(description=_("next token"))
    def next_token(self, obj: RateLimit) -> str:
        live = self._row(obj).live
        if live is None:
            return "—"
        if live.next_token_after == 0:
            return str(_("available now"))
        return _("in %(duration)s") % {"duration": format_duration(live.next_token_after)}

    @admin.display(description=_("last update"))
    def last_update(self, obj: RateLimit) -> SafeString:
        return format_html(
            '<span title="{}">{}</span>',
            _("Time of the stored value (for fixed windows: the start of its window)"),
            _local_time(obj.ts),
        )

    @admin.display(description=_("stored value (µ-tokens)"))
    def stored_value(self, obj: RateLimit) -> str:
        return f"{obj.value} ({format_tokens(obj.value)} tokens)"

    @admin.display(description=_("stored ts (µs since the epoch)"))
    def stored_ts(self, obj: RateLimit) -> str:
        return str(obj.ts)

    @admin.display(description=_("config"))
    def config_text(self, obj: RateLimit) -> str:
        known = self._row(obj).known
        if known is None:
            return str(_("not configured: no limit of this name is known to this process"))
        return f"{describe_rate(known.config)} ({known.source})"

    # -- actions -------------------------------------------------------------------------

    def _limited_rows(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[RateLimit] | None:
        rows = list(queryset.order_by()[: MAX_ACTION_ROWS + 1])
        if len(rows) > MAX_ACTION_ROWS:
            self.message_user(
                request,
                _(
                    "More than %(max)s keys selected: use “manage.py tokenbucket reset NAME” to reset "
                    "a whole limit. Nothing was changed."
                )
                % {"max": f"{MAX_ACTION_ROWS:,}"},
                messages.ERROR,
            )
            return None
        return rows

    def _log(self, request: HttpRequest, entries: list[tuple[RateLimit, int, str]]) -> None:
        content_type = ContentType.objects.get_for_model(RateLimit, for_concrete_model=False)
        LogEntry.objects.bulk_create(
            LogEntry(
                user_id=cast(int, request.user.pk),
                content_type_id=content_type.pk,
                object_id=str(obj.pk),
                object_repr=str(obj)[:200],
                action_flag=flag,
                change_message=message,
            )
            for obj, flag, message in entries
        )

    def _describe_now(self, obj: RateLimit, context: _Context) -> str:
        row = _row(obj, context)
        if row.live is None:
            return "limit not configured"
        return f"{format_tokens(row.live.value)} of {format_tokens(row.live.capacity)} tokens"

    def reset_rows(self, request: HttpRequest, rows: list[RateLimit]) -> int:
        """Delete ``rows`` (each key starts full again), logging one LogEntry per row."""
        if not rows:
            return 0
        alias = rows[0]._state.db or "default"
        context = _Context(now=store_now(alias), limits=known_limits())
        self._log(
            request,
            [
                (obj, DELETION, f"Reset: the key held {self._describe_now(obj, context)}; it starts full again.")
                for obj in rows
            ],
        )
        deleted, _counts = RateLimit.objects.using(alias).filter(pk__in=[obj.pk for obj in rows]).delete()
        return deleted

    @admin.action(description=_("Reset selected keys (full again)"), permissions=["reset"])
    def reset_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        rows = self._limited_rows(request, queryset)
        if rows is None:
            return
        count = self.reset_rows(request, rows)
        self.message_user(
            request,
            ngettext("Reset %(count)d key.", "Reset %(count)d keys.", count) % {"count": count},
            messages.SUCCESS,
        )

    @admin.action(description=_("Set tokens of selected keys…"), permissions=["reset"])
    def set_tokens(self, request: HttpRequest, queryset: QuerySet[Any]) -> TemplateResponse | None:
        rows = self._limited_rows(request, queryset)
        if not rows:  # too many, or reset meanwhile
            return None
        form = SetTokensForm(request.POST if "apply" in request.POST else None)
        if form.is_bound and form.is_valid():
            tokens = form.cleaned_data["tokens"]
            changed, skipped = self._set_tokens(request, rows, int(tokens * MICRO))
            self.message_user(
                request,
                ngettext("Set %(count)d key to %(tokens)s tokens.", "Set %(count)d keys to %(tokens)s tokens.", changed)
                % {"count": changed, "tokens": format_tokens(int(tokens * MICRO))},
                messages.SUCCESS,
            )
            if skipped:
                self.message_user(
                    request,
                    ngettext(
                        "%(count)d key was skipped: its limit is not configured, or it no longer exists.",
                        "%(count)d keys were skipped: their limit is not configured, or they no longer exist.",
                        skipped,
                    )
                    % {"count": skipped},
                    messages.WARNING,
                )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": _("Set tokens"),
            "opts": self.opts,
            "form": form,
            "rows": rows[:100],
            "more": max(0, len(rows) - 100),
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action": "set_tokens",
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        return TemplateResponse(request, "admin/django_tokenbucket/ratelimit/set_tokens.html", context)

    def _set_tokens(self, request: HttpRequest, rows: list[RateLimit], value: int) -> tuple[int, int]:
        alias = rows[0]._state.db or "default"
        limits = known_limits()
        logged: list[tuple[RateLimit, int, str]] = []
        skipped = 0
        for obj in rows:
            known = limits.get(obj.name)
            if known is None:
                skipped += 1
                continue
            with transaction.atomic(using=alias):
                # Under the row lock, at the store's time: what live traffic wrote a
                # moment ago is the state being adjusted, not a stale copy of it.
                locked = (
                    RateLimit.objects.using(alias).select_for_update().filter(pk=obj.pk).values_list("value", "ts")
                )
                current = next(iter(locked), None)
                if current is None:
                    skipped += 1
                    continue
                before, new = self._adjusted(known.config, State(*current), obj.key, value, store_now(alias))
                RateLimit.objects.using(alias).filter(pk=obj.pk).update(value=new.value, ts=new.ts)
            logged.append((obj, CHANGE, f"Set tokens to {format_tokens(new.value)} (was {format_tokens(before)})."))
        self._log(request, logged)
        return len(logged), skipped

    @staticmethod
    def _adjusted(limit: LimitConfig, state: State, key: str, value: int, now: int) -> tuple[int, State]:
        """Return the value now and the state that holds ``value`` (capped at the capacity) from now on."""
        probe = limit.decide(state, now, 0, key, reserve=True)
        base = probe.state or limit.decide(None, now, 0, key, reserve=True).state
        assert base is not None
        # Keep the state's time base: a token bucket's refill phase, a window's start.
        return probe.value, replace(base, value=min(value, limit.capacity))

    # -- extra views ---------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        wrap = self.admin_site.admin_view
        return [
            # Before the model's own patterns: "<path:object_id>/reset/" would match these.
            path("buckets/<str:alias>/", wrap(self.buckets_view), name=f"{prefix}_buckets"),
            path("buckets/<str:alias>/key/", wrap(self.bucket_view), name=f"{prefix}_bucket"),
            path("buckets/<str:alias>/reset/", wrap(self.bucket_reset_view), name=f"{prefix}_bucket_reset"),
            path("limits/", wrap(self.limits_view), name=f"{prefix}_limits"),
            path("limits/<path:name>/", wrap(self.limit_view), name=f"{prefix}_limit"),
            path("<path:object_id>/reset/", wrap(self.reset_view), name=f"{prefix}_reset"),
            *super().get_urls(),
        ]

    def reset_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Reset one key from its detail page: POST only (the admin checks the CSRF token), logged."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_reset_permission(request):
            raise PermissionDenied
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404("No such rate-limit row (reset already?).")
        self.reset_rows(request, [obj])
        self.message_user(request, _("Reset “%(key)s”: it starts full again.") % {"key": obj}, messages.SUCCESS)
        return HttpResponseRedirect(reverse(f"{self.admin_site.name}:django_tokenbucket_ratelimit_changelist"))

    def _counts(
        self, request: HttpRequest, names: list[str] | None = None
    ) -> tuple[_Context, dict[str, dict[str, int]]]:
        queryset = self.get_queryset(request)
        context = _context(request, queryset.db)
        configs = [known.config for known in context.limits.values()]
        if names is not None:
            queryset = queryset.filter(name__in=names)
            configs = [config for config in configs if config.name in names]
        return context, count_by_state(queryset, configs, context.now, partial=names is not None)

    def _elsewhere_counts(self, request: HttpRequest, limits: dict[str, KnownLimit]) -> dict[str, int | None]:
        """Stored keys of the limits on other backends than this changelist's database:
        counted where that is an index read, None (not counted) elsewhere."""
        database = self.get_queryset(request).db
        counts: dict[str, int | None] = {}
        for alias in backend_aliases():
            backend = get_backend(alias)
            if backend.database_alias() == database:
                continue
            configs = [known.config for known in limits.values() if known.config.backend == alias]
            counted: dict[str, int] = {}
            if configs and backend.lists_buckets and backend.counts_cheaply:
                try:
                    counted = backend.count_buckets(configs)
                except BackendError:
                    counted = {}
            counts.update((config.name, counted.get(config.name)) for config in configs)
        return counts

    def limits_view(self, request: HttpRequest) -> HttpResponse:
        """Every limit: its config and backend, the keys stored and how many are limited right now."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        context, counts = self._counts(request)
        elsewhere = self._elsewhere_counts(request, context.limits)
        changelist = reverse(f"{self.admin_site.name}:django_tokenbucket_ratelimit_changelist")
        entries = []
        for name in sorted(set(context.limits) | set(counts)):
            known = context.limits.get(name)
            count = counts.get(name, {})
            entry = {
                "name": name,
                "known": known,
                "backend": known.config.backend if known else None,
                "rate": describe_rate(known.config) if known else None,
                "stored": count.get("stored", 0),
                "limited": count.get(LIMITED, 0) if known else None,
                "detail_url": reverse(f"{self.admin_site.name}:django_tokenbucket_ratelimit_limit", args=[name]),
                "changelist_url": f"{changelist}?{urlencode({'name': name})}",
            }
            if name in elsewhere and known is not None:
                # Its keys are not rows of this changelist: listed by its backend's own page.
                entry.update(
                    stored=elsewhere[name],
                    limited=None,
                    changelist_url=self._url("buckets", known.config.backend, name=name),
                )
            entries.append(entry)
        return TemplateResponse(
            request,
            "admin/django_tokenbucket/ratelimit/limits.html",
            {
                **self.admin_site.each_context(request),
                "title": _("Rate limits by limit"),
                "opts": self.opts,
                "entries": entries,
                "now": _local_time(context.now),
                "media": self.media,
            },
        )

    def limit_view(self, request: HttpRequest, name: str) -> HttpResponse:
        """One limit: its config and its keys by state now."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        context, counts = self._counts(request, [name])
        known = context.limits.get(name)
        count = counts.get(name)
        if known is None and count is None:
            raise Http404(f"No rate limit named {name!r} is configured or stored.")
        count = count or {}
        stored: int | None = count.get("stored", 0)
        changelist = reverse(f"{self.admin_site.name}:django_tokenbucket_ratelimit_changelist")
        keys_url = f"{changelist}?{urlencode({'name': name})}"
        elsewhere = self._elsewhere_counts(request, context.limits) if known is not None else {}
        if name in elsewhere and known is not None:
            stored, count = elsewhere[name], {}
            keys_url = self._url("buckets", known.config.backend, name=name)
        return TemplateResponse(
            request,
            "admin/django_tokenbucket/ratelimit/limit.html",
            {
                **self.admin_site.each_context(request),
                "title": _("Rate limit “%(name)s”") % {"name": name},
                "opts": self.opts,
                "name": name,
                "known": known,
                "config": known.config if known else None,
                "rate": describe_rate(known.config) if known else None,
                "capacity": format_tokens(known.config.capacity) if known else None,
                "max_reserved": (
                    None if known is None or known.config.max_reserved is None
                    else format_tokens(known.config.max_reserved)
                ),
                "stored": stored,
                "backend": known.config.backend if known else None,
                "states": [
                    (_("limited (less than one token)"), count.get(LIMITED, 0) if known else None, LIMITED),
                    (_("partially used"), count.get(PARTIAL, 0) if known else None, PARTIAL),
                    (_("full"), count.get(FULL, 0) if known else None, FULL),
                ],
                "by_state": name not in elsewhere,
                "changelist_url": keys_url,
                "now": _local_time(context.now),
                "media": self.media,
            },
        )

