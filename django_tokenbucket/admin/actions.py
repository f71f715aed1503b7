"""The admin's actions on rows: reset (delete: a missing row is a full key) and set tokens
(under the row's lock), each logged with what the key held.
"""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal
from typing import Any, cast

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from .. import operations
from ..algorithms import MICRO
from ..backends import row_backend
from ..models import RateLimit
from ..registry import interpret, known_limits
from ..text import format_tokens
from . import buckets
from .buckets import BucketAdminViews
from .display import Context, display_row

__all__ = ["BucketActions", "SetTokensForm"]


class SetTokensForm(forms.Form):
    tokens = forms.DecimalField(
        label=_("Tokens"),
        min_value=Decimal(0),
        decimal_places=6,
        max_digits=24,
        help_text=_("The value each selected key holds from now on (at most its capacity)."),
    )


class BucketActions(BucketAdminViews):
    """The actions of ``RateLimitAdmin`` on the selected rows."""

    def _limited_rows(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[RateLimit] | None:
        rows = list(queryset.order_by()[: buckets.MAX_ACTION_ROWS + 1])
        if len(rows) > buckets.MAX_ACTION_ROWS:
            self.message_user(
                request,
                _(
                    "More than %(max)s keys selected: use “manage.py tokenbucket reset NAME” to reset "
                    "a whole limit. Nothing was changed."
                )
                % {"max": f"{buckets.MAX_ACTION_ROWS:,}"},
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

    def _describe_now(self, obj: RateLimit, context: Context) -> str:
        row = display_row(obj, context)
        if row.live is None:
            return "limit not configured"
        return f"{format_tokens(row.live.value)} of {format_tokens(row.live.capacity)} tokens"

    def reset_rows(self, request: HttpRequest, rows: list[RateLimit]) -> int:
        """Forget ``rows`` (each key starts full again), logging one LogEntry per row."""
        if not rows:
            return 0
        backend = row_backend(rows[0]._state.db or "default")
        context = Context(now=backend.store_now(), limits=known_limits())
        self._log(
            request,
            [
                (obj, DELETION, f"Reset: the key held {self._describe_now(obj, context)}; it starts full again.")
                for obj in rows
            ],
        )
        by_name: dict[str, list[str]] = defaultdict(list)
        for obj in rows:
            by_name[obj.name].append(obj.key)
        return sum(operations.reset_buckets(backend, name, digests) for name, digests in by_name.items())

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
        backend = row_backend(rows[0]._state.db or "default")
        limits = known_limits()
        logged: list[tuple[RateLimit, int, str]] = []
        skipped = 0
        for obj in rows:
            known = interpret(obj.name, limits)
            changed = None if known is None else operations.set_tokens(backend, known.config, obj.key, value)
            if changed is None:
                skipped += 1
                continue
            before, after = changed
            logged.append((obj, CHANGE, f"Set tokens to {format_tokens(after)} (was {format_tokens(before)})."))
        self._log(request, logged)
        return len(logged), skipped
