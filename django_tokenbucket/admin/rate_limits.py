"""``RateLimitAdmin``: the ``RateLimit`` changelist with its columns, actions and extra views."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import F, QuerySet, Value
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.translation import gettext_lazy as _

from .. import deny_cache
from ..keys import encode_key
from ..live import LIMITED, PARTIAL
from ..models import RateLimit
from ..registry import known_limits
from ..request_keys import key_from_text
from .buckets import stored_elsewhere
from .changelist import LimitNameFilter, RateLimitChangeList, StateFilter
from .display import DIGEST, BucketColumns, CappedPaginator
from .limits import LimitsOverview

__all__ = ["RateLimitAdmin"]


@admin.register(RateLimit)
class RateLimitAdmin(BucketColumns, LimitsOverview):
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
        if DIGEST.fullmatch(term.lower()):
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
            "overrides_url": (
                reverse(f"{self.admin_site.name}:django_tokenbucket_limitoverride_changelist")
                if request.user.has_perm("django_tokenbucket.view_limitoverride")
                or request.user.has_perm("django_tokenbucket.change_limitoverride")
                else None
            ),
            "stored_elsewhere": stored_elsewhere(self.admin_site.name, self.get_queryset(request).db),
            # This process' only: each process remembers the denials it saw (deny_cache).
            "deny_cache_keys": deny_cache.size() if deny_cache.active() is not None else None,
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
            known = known_limits(as_rows=False).get(obj.name)
            if known is not None:
                extra.update(
                    self.override_panel(request, known.config.backend, obj.name, obj.key, request.get_full_path())
                )
        return super().change_view(request, object_id, form_url, extra)
