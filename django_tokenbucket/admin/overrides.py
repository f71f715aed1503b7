"""``LimitOverrideAdmin``: the runtime overrides, listed, made, edited, expired and deleted.

Every write goes through ``overrides.make``/``overrides.delete``, never a plain
``Model.save()``/``delete()``: those bump the version stamp in the same transaction,
without which other processes would apply the old override until the next change. A
new override is made by ``limiter.override``/``exempt``/``block`` (the key as
``tokenbucket --key`` takes it, normalised as decisions normalise it); an edited one is
written again by ``override_operations.resave``, with the same checks; the limit and
the key of one are fixed (delete it and make another).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import widgets
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import Q, QuerySet
from django.forms import BaseForm
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import format_lazy
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from .. import overrides
from ..algorithms import MICRO
from ..api import limiter
from ..limits import LimitConfig
from ..models import LimitOverride
from ..override_operations import (
    DURATION_HINT,
    KEY_FORMS,
    KEY_HINT,
    describe_expiry,
    describe_numbers,
    expire,
    now,
    numbers_from_text,
    operator_key,
    parse_duration,
    rate_text,
    reached,
    refused_views,
    replaced,
    resave,
    shown_key,
)
from ..registry import known_limits
from ..request_keys import key_from_text
from .display import DIGEST

__all__ = ["LimitOverrideAdmin", "OverrideAddForm", "OverrideChangeForm"]



def _tokens(label: Any, help_text: Any) -> forms.DecimalField:
    """An amount of tokens, to the micro-token; empty: the limit's own."""
    return forms.DecimalField(
        label=label, help_text=help_text, min_value=Decimal(0), decimal_places=6, max_digits=24, required=False
    )


class _NoModelValidation(forms.ModelForm):  # type: ignore[type-arg]
    """A ModelForm whose fields are what an operator types, not the model's stored units.

    The model's own validation would read "100/m" as a number of micro-tokens: the
    limiter checks these values instead (``clean``), and writes the row itself.
    """

    def _post_clean(self) -> None:
        pass

    def _expiry(self, data: dict[str, Any]) -> Any:
        """The ``until`` the fields say: a duration from now, a moment, or None (never)."""
        if data.get("duration") and data.get("expires_at"):
            self.add_error("duration", _("Give a duration or an expiry, not both."))
            return None
        if data.get("duration"):
            try:
                return parse_duration(data["duration"])
            except ValueError as exc:
                self.add_error("duration", str(exc))
        return data.get("expires_at")


class OverrideAddForm(_NoModelValidation):
    """A new override, made through ``limiter.override``/``exempt``/``block`` by ``clean``.

    The limiter both checks and writes, so the row is written while the form is
    cleaned, inside the admin's transaction (a later failure rolls it back): its
    errors then show on the form, naming the problem, as the limiter words them.
    """

    name = forms.ChoiceField(label=_("limit"))
    key_text = forms.CharField(
        label=_("key"),
        required=False,
        help_text=format_lazy(
            _(
                "As a view's key= builds it ({}), or a key your code passes to the limiter (42, alice); "
                "empty: every key of the limit."
            ),
            KEY_HINT,
        ),
    )
    key_form = forms.ChoiceField(
        label=_("written as"), choices=list(KEY_FORMS.items()), initial="auto", required=False
    )
    action = forms.ChoiceField(label=_("action"), choices=LimitOverride.Action.choices)
    rate = forms.CharField(
        label=_("rate"), required=False, help_text=_("Action “limit”: a rate string, e.g. 100/m (empty: the limit's).")
    )
    capacity = _tokens(_("capacity"), _("Action “limit”: the burst."))
    max_reserved = _tokens(_("max reserved"), _("Action “limit”."))
    duration = forms.CharField(
        label=_("for"),
        required=False,
        help_text=format_lazy(_("{}; empty: until the expiry below, or never."), DURATION_HINT),
    )
    expires_at = forms.SplitDateTimeField(label=_("expires"), required=False, widget=widgets.AdminSplitDateTime)
    reason = forms.CharField(label=_("reason"), required=False, widget=forms.Textarea(attrs={"rows": 3}))

    #: Set by ``LimitOverrideAdmin.get_form``: who is making it, and whether they may
    #: replace an override of the same key (the change permission).
    created_by = ""
    may_replace = False
    #: Set by ``clean``: what the operator is told of the key typed (``operator_key``).
    key_warning: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["name"]
        assert isinstance(field, forms.ChoiceField)
        field.choices = [("", "---------")] + [(name, name) for name in sorted(known_limits(as_rows=False))]
        #: The override this one replaced, for the admin's message.
        self.replaced: LimitOverride | None = None

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        name, action = data["name"], data["action"]
        try:
            key, self.key_warning = operator_key(name, data["key_text"], data.get("key_form") or "auto")
        except ValueError as exc:
            self.add_error("key_text", str(exc))
            return data
        until = self._expiry(data)
        # 0 is a number (max_reserved 0: no reservations); only an empty field is "the limit's".
        numbers = {n: None if data.get(n) in (None, "") else data[n] for n in ("rate", "capacity", "max_reserved")}
        if action != overrides.LIMIT and any(value is not None for value in numbers.values()):
            self.add_error("action", _("Rate, capacity and max reserved apply to the action “limit” only."))
        if self.errors:
            return data
        #: The key the override was made for, for the admin's message of which bucket it reaches.
        self.key = key
        try:
            existing = replaced(name, overrides.key_digest(name, key).digest)
            if existing is not None and not self.may_replace:
                self.add_error(
                    None,
                    _("“%(override)s” exists: replacing it needs the permission to change limit overrides.")
                    % {"override": existing},
                )
                return data
            common = {"until": until, "reason": data["reason"], "created_by": self.created_by}
            if action == overrides.LIMIT:
                self.instance = limiter.override(
                    name,
                    key,
                    rate=numbers["rate"],
                    capacity=numbers["capacity"],
                    max_reserved=numbers["max_reserved"],
                    **common,
                )
            elif action == overrides.EXEMPT:
                self.instance = limiter.exempt(name, key, **common)
            else:
                self.instance = limiter.block(name, key, **common)
        except (ValueError, ImproperlyConfigured) as exc:
            self.add_error(None, str(exc))
            return data
        self.replaced = existing
        return data

    class Meta:
        model = LimitOverride
        fields: list[str] = []


class OverrideChangeForm(_NoModelValidation):
    """Reason, expiry and (action "limit") numbers of an override; checked here, written by the admin."""

    rate = forms.CharField(
        label=_("rate"),
        required=False,
        help_text=_("A rate string, e.g. 100/m (its period replaces the limit's); empty: the limit's."),
    )
    capacity = _tokens(_("capacity"), _("Empty: the limit's."))
    max_reserved = _tokens(_("max reserved"), _("Empty: the limit's."))
    duration = forms.CharField(
        label=_("for"), required=False, help_text=format_lazy(_("From now: {}."), DURATION_HINT)
    )
    expires_at = forms.SplitDateTimeField(
        label=_("expires"), required=False, widget=widgets.AdminSplitDateTime, help_text=_("Empty: never.")
    )
    reason = forms.CharField(label=_("reason"), required=False, widget=forms.Textarea(attrs={"rows": 3}))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        row: LimitOverride = self.instance
        known = known_limits(as_rows=False).get(row.name)
        self.limit: LimitConfig | None = known.config if known else None
        if row.action != overrides.LIMIT:
            for number in ("rate", "capacity", "max_reserved"):
                del self.fields[number]
        else:
            self.initial["rate"] = rate_text(row, self.limit)
            for number in ("capacity", "max_reserved"):
                value = getattr(row, number)
                self.initial[number] = None if value is None else Decimal(value) / MICRO
        try:
            self.initial["expires_at"] = None if row.expires_at is None else timezone.localtime(row.expires_at)
        except OverflowError:
            # An end past year 9999 on this zone's clock, stored before overrides.LONGEST
            # bounded it: "expires now" shows it, and the field left empty leaves it as it is.
            self.initial["expires_at"] = None
        #: What ``LimitOverrideAdmin.save_model`` writes.
        self.changes: dict[str, Any] = {}

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        row: LimitOverride = self.instance
        try:
            overrides.require_on(row.name)
        except ImproperlyConfigured as exc:
            self.add_error(None, str(exc))
            return data
        changes: dict[str, Any] = {"reason": data["reason"]}
        until = self._expiry(data)
        if data.get("duration") or "expires_at" in self.changed_data:
            # An expiry left as it was stays, even if it passed: saving a reason must not fail.
            try:
                changes["expires_at"] = overrides.expiry(row.name, until)
            except ValueError as exc:
                self.add_error("expires_at", str(exc))
        numbers = ("rate", "capacity", "max_reserved")
        if row.action == overrides.LIMIT and any(number in self.changed_data for number in numbers):
            if self.limit is None:
                self.add_error(None, _("Limit “%(name)s” is not configured: its numbers cannot be checked.") % {
                    "name": row.name
                })
                return data
            try:
                changes.update(
                    numbers_from_text(
                        self.limit,
                        # A rate shown as it was and left alone is kept, even one no rate string can say.
                        data["rate"] if "rate" in self.changed_data else None,
                        data.get("capacity"),
                        data.get("max_reserved"),
                    )
                )
            except ValueError as exc:
                self.add_error(None, str(exc))
            if "rate" not in self.changed_data:
                changes.update(rate=row.rate, period=row.period)
        if not self.errors:
            self.changes = changes
        return data

    class Meta:
        model = LimitOverride
        fields: list[str] = []


def _limit_of(row: LimitOverride) -> LimitConfig | None:
    """The config of ``row``'s limit (None: not configured), as the list read it for its page."""
    if hasattr(row, "_tokenbucket_limit"):
        read: LimitConfig | None = row._tokenbucket_limit
        return read
    known = known_limits(as_rows=False).get(row.name)
    return known.config if known is not None else None


class OverrideChangeList(ChangeList):
    """Reads the limits once per page: every row is described with the same ones."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        limits = known_limits(as_rows=False)
        for row in self.result_list:
            known = limits.get(row.name)
            row._tokenbucket_limit = known.config if known is not None else None


class ExpiryFilter(admin.SimpleListFilter):
    """In force now, or expired (kept until deleted, for the record)."""

    title = _("in force")
    parameter_name = "in_force"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("yes", _("in force")), ("no", _("expired"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        ending = Q(expires_at__isnull=True) | Q(expires_at__gt=now())
        if self.value() == "yes":
            return queryset.filter(ending)
        if self.value() == "no":
            return queryset.exclude(ending)
        return queryset


@admin.register(LimitOverride)
class LimitOverrideAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Runtime overrides: who gets another limit, an exemption or a block, until when and why."""

    list_display = ("name", "key_shown", "action", "numbers", "expires", "reason_shown", "created_by", "updated_at")
    list_display_links = ("key_shown",)
    list_filter = (("name", admin.AllValuesFieldListFilter), "action", ExpiryFilter)
    search_fields = ("label", "reason", "created_by")
    search_help_text = _("Search key labels, reasons and authors, an exact key (post:username=alice) or a key digest.")
    ordering = ("name", "key")
    actions = ("expire_now",)
    list_per_page = 100

    class Media:
        css = {"all": ("django_tokenbucket/admin.css",)}

    # -- the list ------------------------------------------------------------------------

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return OverrideChangeList

    @admin.display(description=_("key"), ordering="label")
    def key_shown(self, obj: LimitOverride) -> SafeString:
        text = shown_key(obj)
        if obj.every_key:
            return format_html('<span class="tb-every-key">{}</span>', _("every key"))
        return format_html('<span class="tb-key" title="digest: {}">{}</span>', obj.key, text)

    @admin.display(description=_("numbers"))
    def numbers(self, obj: LimitOverride) -> str:
        return describe_numbers(obj, _limit_of(obj))

    @admin.display(description=_("expires"), ordering="expires_at")
    def expires(self, obj: LimitOverride) -> SafeString | str:
        text = describe_expiry(obj)
        if text.startswith("expired"):
            return format_html('<span class="tb-expired">{}</span> {}', _("expired"), text.removeprefix("expired "))
        return text

    @admin.display(description=_("reason"))
    def reason_shown(self, obj: LimitOverride) -> str:
        reason = " ".join(obj.reason.split())
        return reason if len(reason) <= 80 else reason[:79] + "…"

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        results, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if DIGEST.fullmatch(term.lower()):
            results = results | queryset.filter(key=term.lower())
        elif term:
            # Request data is stored as a digest only: found by the key as typed.
            keys = [term, key_from_text(term)]
            digests = [overrides.key_digest("", key).digest for key in keys if key is not None]
            results = results | queryset.filter(key__in=digests)
        return results, may_have_duplicates

    # -- add and change ------------------------------------------------------------------

    def get_fieldsets(self, request: HttpRequest, obj: LimitOverride | None = None) -> Any:
        if obj is None:
            return (
                (None, {"fields": ("name", "key_text", "key_form", "action")}),
                (_("Numbers (action “limit”)"), {"fields": ("rate", "capacity", "max_reserved")}),
                (_("Until"), {"fields": ("duration", "expires_at")}),
                (None, {"fields": ("reason",)}),
            )
        fieldsets: list[tuple[Any, dict[str, Any]]] = [
            (None, {"fields": ("name", "key_shown", "key", "action")}),
        ]
        if obj.action == overrides.LIMIT:
            fieldsets.append((_("Numbers"), {"fields": ("numbers_now", "rate", "capacity", "max_reserved")}))
        fieldsets += [
            (_("Until"), {"fields": ("expires_now", "duration", "expires_at")}),
            (None, {"fields": ("reason",)}),
            (_("Record"), {"fields": ("created_by", "created_at", "updated_at")}),
        ]
        return fieldsets

    def get_readonly_fields(self, request: HttpRequest, obj: LimitOverride | None = None) -> Any:
        if obj is None:
            return ()
        return ("name", "key_shown", "key", "action", "numbers_now", "expires_now", "created_by", "created_at",
                "updated_at")

    @admin.display(description=_("in force now"))
    def numbers_now(self, obj: LimitOverride) -> str:
        return describe_numbers(obj, _limit_of(obj))

    @admin.display(description=_("expires now"))
    def expires_now(self, obj: LimitOverride) -> str:
        return describe_expiry(obj)

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        if obj is None:
            base: type[BaseForm] = type(
                "OverrideAddForm",
                (OverrideAddForm,),
                {
                    "created_by": request.user.get_username()[:150],
                    "may_replace": self.has_change_permission(request),
                    "__module__": __name__,
                },
            )
        else:
            base = OverrideChangeForm
        return super().get_form(request, obj, change, **{**kwargs, "form": base, "fields": None})

    def save_model(self, request: HttpRequest, obj: LimitOverride, form: Any, change: bool) -> None:
        if not change:
            limit = _limit_of(form.instance)
            if limit is not None and not form.instance.every_key:
                self.message_user(request, _("It reaches %(bucket)s.") % {"bucket": reached(limit, form.key)})
            if form.key_warning:
                self.message_user(request, form.key_warning, messages.WARNING)
            for warning in refused_views(form.instance, limit):
                self.message_user(request, warning, messages.WARNING)
            if form.replaced is not None:
                self.message_user(
                    request,
                    _("It replaced “%(override)s” (made by %(by)s).")
                    % {"override": form.replaced, "by": form.replaced.created_by or "?"},
                    messages.WARNING,
                )
            return  # the limiter wrote it, while the form was cleaned
        form.instance = resave(obj, **form.changes)

    def construct_change_message(self, request: HttpRequest, form: Any, formsets: Any, add: bool = False) -> Any:
        if add:
            row = form.instance
            return f"Made: {row.action}, {describe_numbers(row, _limit_of(row))}, {describe_expiry(row)}."
        return super().construct_change_message(request, form, formsets, add)

    # -- expire and delete ---------------------------------------------------------------

    @admin.action(description=_("Expire selected overrides now"), permissions=["change"])
    def expire_now(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        ended = 0
        try:
            with transaction.atomic(using=overrides.database_alias()):
                for row in queryset:
                    if expire(row):
                        ended += 1
                        self.log_change(request, row, "Expired now.")
        except ImproperlyConfigured as exc:  # overrides are off: every change rolled back
            self.message_user(request, str(_("Nothing was changed: %(error)s") % {"error": exc}), messages.ERROR)
            return
        self.message_user(
            request,
            ngettext("Expired %(count)d override.", "Expired %(count)d overrides.", ended) % {"count": ended},
            messages.SUCCESS,
        )

    def delete_model(self, request: HttpRequest, obj: LimitOverride) -> None:
        overrides.delete(obj.name, obj.key)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        with transaction.atomic(using=overrides.database_alias()):
            for row in queryset:
                overrides.delete(row.name, row.key)

