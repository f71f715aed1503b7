"""The list of ``RateLimit`` rows: its filters (by limit, by what the rows hold now) and its
changelist, which derives every row's live state once per page.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from ..backends import row_backend
from ..live import FULL, LIMITED, PARTIAL
from ..registry import known_limits
from .display import UNCONFIGURED, display_row, page_context

__all__ = ["LimitNameFilter", "RateLimitChangeList", "StateFilter"]


class RateLimitChangeList(ChangeList):
    """Interprets the page's rows once, at one clock reading."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        context = page_context(request, self.queryset.db)
        rows = list(self.result_list)
        for obj in rows:
            display_row(obj, context)
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
            (UNCONFIGURED, _("limit not configured")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if not value:
            return queryset
        context = page_context(request, queryset.db)
        if value == UNCONFIGURED:
            return queryset.exclude(name__in=list(context.limits))
        if value not in (LIMITED, PARTIAL, FULL):
            return queryset.none()
        configs = [known.config for known in context.limits.values()]
        found: QuerySet[Any] = row_backend(queryset.db).rows_in_state(queryset, configs, value, context.now)
        return found
