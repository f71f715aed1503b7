"""Block, exempt or multiply one key's limit from its bucket page (a database row's or another backend's).

A bucket page knows its key by the digest only (Redis keeps no label; request data is
never stored in clear), so the override is made for that digest
(``override_operations.save_digest``) with the checks ``limiter.override`` makes. A
sharded limit's page is one shard's, whose digest is not the key's: no actions there
(``manage.py tokenbucket block NAME KEY`` names the key).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from django.contrib import messages
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext_lazy as _

from .. import overrides
from ..api import limiter
from ..backends.base import BackendError
from ..models import LimitOverride
from ..override_operations import (
    DURATION_HINT,
    describe_expiry,
    describe_numbers,
    factor_of,
    multiplied,
    panel,
    parse_duration,
    replaced,
    save_digest,
    shown_key,
)
from ..registry import KnownLimit, known_limits
from .buckets import BucketAdminViews
from .display import DIGEST

__all__ = ["BucketOverrides"]

BLOCK, EXEMPT, MULTIPLY = "block", "exempt", "multiply"


class BucketOverrides(BucketAdminViews):
    """The override panel of bucket pages and the view its forms post to."""

    def has_override_permission(self, request: HttpRequest) -> bool:
        """Return whether the user may make overrides from a bucket page: add limit override."""
        return bool(request.user.has_perm("django_tokenbucket.add_limitoverride"))

    def _override_url(self, row: LimitOverride | None) -> str | None:
        if row is None:
            return None
        return reverse(f"{self.admin_site.name}:django_tokenbucket_limitoverride_change", args=[row.pk])

    def override_panel(self, request: HttpRequest, alias: str, name: str, digest: str, back: str) -> dict[str, Any]:
        """The context of ``_override_panel.html``: the override in force for the key, and the forms."""
        whole = known_limits(as_rows=False).get(name)
        found = panel(name, digest)
        shown = []
        may_see = any(
            request.user.has_perm(f"django_tokenbucket.{action}_limitoverride") for action in ("view", "change")
        )
        for row, scope in ((found.own, _("this key")), (found.every_key, _("every key of this limit"))):
            if row is not None:
                config = whole.config if whole is not None else None
                shown.append(
                    {
                        "scope": scope,
                        "row": row,
                        "numbers": describe_numbers(row, config),
                        "expires": describe_expiry(row),
                        "url": self._override_url(row) if may_see else None,
                        "in_force": row is found.in_force,
                    }
                )
        cannot: Any = None
        if whole is None:
            cannot = _("This limit is not configured: it cannot be overridden.")
        elif whole.config.shards > 1:
            cannot = _(
                "This is one shard of a sharded limit: block, exempt or give more to the key itself with "
                "“manage.py tokenbucket block|exempt|override %(name)s KEY”."
            ) % {"name": name}
        return {
            "override_panel": {
                "shown": shown,
                "can_override": self.has_override_permission(request) and cannot is None,
                "cannot": cannot if self.has_override_permission(request) else None,
                "url": self._url("bucket_override", alias),
                "name": name,
                "digest": digest,
                "next": back,
                "duration_hint": DURATION_HINT,
            }
        }

    def bucket_view(self, request: HttpRequest, alias: str) -> HttpResponse:
        response = super().bucket_view(request, alias)
        if isinstance(response, TemplateResponse) and response.context_data is not None:
            data = response.context_data
            response.context_data.update(
                self.override_panel(request, alias, data["name"], data["digest"], request.get_full_path())
            )
        return response

    def bucket_override_view(self, request: HttpRequest, alias: str) -> HttpResponse:
        """Block, exempt or give ×N to one key (``name``, ``digest``): POST only (the admin checks
        the CSRF token), with the add permission (and change, to replace an override), logged."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_override_permission(request):
            raise PermissionDenied
        backend = self._backend(alias)
        known = self._limit_of(alias, request.POST.get("name"))
        digest = request.POST.get("digest", "")
        action = request.POST.get("action")
        if not DIGEST.fullmatch(digest) or action not in (BLOCK, EXEMPT, MULTIPLY):
            raise PermissionDenied
        back = request.POST.get("next", "")
        if not url_has_allowed_host_and_scheme(back, {request.get_host()}, require_https=request.is_secure()):
            back = self._url("bucket", alias, name=known.name, digest=digest)
        existing = replaced(known.name, digest)
        if existing is not None and not request.user.has_perm("django_tokenbucket.change_limitoverride"):
            raise PermissionDenied  # replacing another operator's override is changing it
        try:
            row = self._save(request, known, digest, action, backend)
        except (ValueError, ImproperlyConfigured) as exc:
            self.message_user(request, str(_("Nothing was changed: %(error)s") % {"error": exc}), messages.ERROR)
            return HttpResponseRedirect(back)
        what = f"{row.action}, {describe_numbers(row, limiter.resolve(known.name))}, {describe_expiry(row)}"
        reason = f" Reason: {row.reason}" if row.reason else ""
        LogEntry.objects.create(
            user_id=cast(int, request.user.pk),
            content_type_id=ContentType.objects.get_for_model(LimitOverride).pk,
            object_id=str(row.pk),
            object_repr=str(row)[:200],
            action_flag=CHANGE if existing is not None else ADDITION,
            change_message=f"From the bucket page ({alias}): {what}.{reason}"
            + (f" Replaced {existing.action}." if existing is not None else ""),
        )
        # Not the limit's name first: the admin capitalises a message's first letter.
        self.message_user(
            request,
            _("Override saved for %(limit)s key %(key)s: %(what)s. Every process applies it within %(seconds)s s.")
            % {"limit": known.name, "key": shown_key(row), "what": what, "seconds": _max_age()},
            messages.SUCCESS,
        )
        return HttpResponseRedirect(back)

    def _save(
        self, request: HttpRequest, known: KnownLimit, digest: str, action: str, backend: Any
    ) -> LimitOverride:
        text = request.POST.get("for", "").strip()
        until: timedelta | None = parse_duration(text) if text else None
        limit = limiter.resolve(known.name)
        if limit.shards > 1:
            raise ValueError(f"rate limit {known.name!r} is sharded: a bucket page is one shard, not the key")
        try:
            # The label the bucket holds, so that the override lists as the key does.
            found = backend.list_buckets(known.config, digest_prefix=digest).buckets
        except (BackendError, NotImplementedError):
            found = []
        label = found[0].label if found else ""
        numbers = None
        if action == MULTIPLY:
            numbers = multiplied(limit, factor_of(request.POST.get("factor", "")))
        return save_digest(
            known.name,
            digest,
            label,
            {BLOCK: overrides.BLOCK, EXEMPT: overrides.EXEMPT, MULTIPLY: overrides.LIMIT}[action],
            numbers=numbers,
            until=until,
            reason=request.POST.get("reason", "").strip(),
            created_by=request.user.get_username(),
        )


def _max_age() -> str:
    settings = overrides.active()
    return "—" if settings is None else f"{settings.max_age:g}"
