"""The admin's overview of every known limit (``limits/``) and one limit's page, with counts of
its buckets by state where the store can count them cheaply.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.translation import gettext_lazy as _

from ..backends import backend_aliases, get_backend, row_backend
from ..backends.base import BackendError
from ..live import FULL, LIMITED, PARTIAL
from ..registry import KnownLimit, known_limits
from ..text import describe_rate, format_tokens
from .actions import BucketActions
from .bucket_overrides import BucketOverrides
from .denials import analytics_status, limit_denials, overview_charts
from .display import Context, local_time, page_context

__all__ = ["LimitsOverview"]


class LimitsOverview(BucketOverrides, BucketActions):
    """The limits overview views of ``RateLimitAdmin``, and its extra URLs."""

    def get_urls(self) -> list[URLPattern]:
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        wrap = self.admin_site.admin_view
        return [
            # Before the model's own patterns: "<path:object_id>/reset/" would match these.
            path("buckets/<str:alias>/", wrap(self.buckets_view), name=f"{prefix}_buckets"),
            path("buckets/<str:alias>/key/", wrap(self.bucket_view), name=f"{prefix}_bucket"),
            path("buckets/<str:alias>/reset/", wrap(self.bucket_reset_view), name=f"{prefix}_bucket_reset"),
            path(
                "buckets/<str:alias>/override/", wrap(self.bucket_override_view), name=f"{prefix}_bucket_override"
            ),
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
    ) -> tuple[Context, dict[str, dict[str, int]]]:
        database = self.get_queryset(request).db
        context = page_context(request, database)
        configs = [known.config for known in context.limits.values()]
        counts = row_backend(database).count_by_state(configs, context.now, only=names, partial=names is not None)
        return context, counts

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

    def _denied_key_url(self, known: KnownLimit) -> Callable[[str, str], str]:
        """The page of a denied key's bucket: its own page (reset, block, exempt), or for a
        sharded limit the list of its shards (their digests share the key's first 16 digits)."""

        whole = known_limits(as_rows=False).get(known.name)  # a row's config has no shards

        def url(alias: str, digest: str) -> str:
            if whole is not None and whole.config.shards > 1:
                return self._url("buckets", alias, name=known.name, q=digest[:16])
            return self._url("bucket", alias, name=known.name, digest=digest)

        return url

    def limits_view(self, request: HttpRequest) -> HttpResponse:
        """Every limit: its config and backend, the keys stored and how many are limited right
        now, and (with analytics on) its allowed and denied calls of the last hour."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        context, counts = self._counts(request)
        elsewhere = self._elsewhere_counts(request, context.limits)
        changelist = reverse(f"{self.admin_site.name}:django_tokenbucket_ratelimit_changelist")
        status = analytics_status()
        charts, notes = overview_charts(context.limits) if status["analytics_on"] else ({}, {})
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
                "chart": charts.get(name),
                "chart_note": notes.get(name),
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
                "now": local_time(context.now),
                **status,
                "media": self.media,
            },
        )

    def limit_view(self, request: HttpRequest, name: str) -> HttpResponse:
        """One limit: its config, its keys by state now and (with analytics on) its allowed
        and denied calls of the last hour and day, and its most denied keys."""
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
        status = analytics_status()
        denials = (
            limit_denials(known, self._denied_key_url(known))
            if status["analytics_on"] and known is not None
            else None
        )
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
                    None
                    if known is None or known.config.max_reserved is None
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
                "now": local_time(context.now),
                **status,
                "denials": denials,
                "media": self.media,
            },
        )
