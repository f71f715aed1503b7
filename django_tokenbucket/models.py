"""The stored state of every rate limit: two numbers per (name, key)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from .algorithms import MICRO
from .keys import LABEL_LENGTH, label_as_typed
from .limits import MAX_NAME_LENGTH

__all__ = [
    "AnalyticsMinute",
    "DeniedKeyMinute",
    "LimitOverride",
    "OverrideTombstone",
    "OverridesVersion",
    "RateLimit",
    "Reservation",
]


class RateLimit(models.Model):
    """The state of one limit for one key.

    ``key`` is the HMAC-SHA-256 digest of the user's key (see ``keys.encode_key``), so any key
    fits and collations cannot merge two of them; ``label`` keeps a readable prefix.
    ``value`` is in micro-tokens and ``ts`` in microseconds since the Unix epoch: exact
    integers on every database.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(_("limit name"), max_length=MAX_NAME_LENGTH)
    key = models.CharField(_("key digest"), max_length=64)
    label = models.CharField(_("key"), max_length=LABEL_LENGTH, blank=True, default="")
    value = models.BigIntegerField(_("value (micro-tokens)"))
    ts = models.BigIntegerField(_("timestamp (µs since the epoch)"))

    class Meta:
        verbose_name = _("rate limit")
        verbose_name_plural = _("rate limits")
        constraints = [
            models.UniqueConstraint(fields=["name", "key"], name="django_tokenbucket_name_key"),
        ]
        indexes = [
            # Serves the admin's default order (name, most recently written first) and
            # its filter by name without sorting, and cleanup's range "rows of this
            # limit older than T". The id makes the order total, so that pages and
            # cleanup's keyset batches are stable.
            models.Index(fields=["name", "-ts", "-id"], name="django_tokenbucket_name_ts"),
        ]
        permissions = [("reset_ratelimit", _("Can reset rate limits"))]

    def __str__(self) -> str:
        return f"{self.name} [{label_as_typed(self.label) or self.key[:12]}]"

    @property
    def tokens(self) -> float:
        """Return the stored value in tokens (as of ``updated_at``, not now)."""
        return self.value / MICRO

    @property
    def updated_at(self) -> datetime:
        return datetime.fromtimestamp(self.ts / MICRO, tz=UTC)


class Reservation(models.Model):
    """Work scheduled with reserved tokens (``django_tokenbucket.celery.schedule``).

    Written in the transaction that reserves the tokens, so that the work and the
    tokens commit or roll back together; the Celery task claims it once, and the
    sweeper publishes it again if its message never made it to a worker.
    """

    class Status(models.TextChoices):
        #: Not handed to the broker: its ETA is too far away, or publishing failed.
        SCHEDULED = "scheduled", _("scheduled")
        #: Handed to the broker (or about to be, right after the commit).
        SENT = "sent", _("sent")
        #: Claimed by a worker; visible only with ``atomic=False``.
        RUNNING = "running", _("running")
        DONE = "done", _("done")
        FAILED = "failed", _("failed")
        CANCELLED = "cancelled", _("cancelled")
        #: Never ran: still not done ``EXPIRE_AFTER`` after its ETA.
        EXPIRED = "expired", _("expired")

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(_("limit name"), max_length=MAX_NAME_LENGTH)
    key = models.CharField(_("key digest"), max_length=64)
    label = models.CharField(_("key"), max_length=LABEL_LENGTH, blank=True, default="")
    #: The limit's config when the tokens were reserved (micro-units), so that tokens
    #: can be returned to an inline limit, or to one since removed from LIMITS.
    limit = models.JSONField(_("limit config"))
    count = models.BigIntegerField(_("reserved (micro-tokens)"))
    eta = models.DateTimeField(_("runs at"))
    status = models.CharField(_("status"), max_length=16, choices=Status.choices, default=Status.SCHEDULED)
    task = models.CharField(_("task"), max_length=255)
    #: The Celery signature as a dict: task, args, kwargs, options.
    signature = models.JSONField(_("signature"))
    #: Run the task inside the claim's transaction (its database writes happen once).
    atomic = models.BooleanField(_("atomic"), default=True)
    refund_on_failure = models.BooleanField(_("refund on failure"), default=False)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    sent_at = models.DateTimeField(_("last sent"), null=True, blank=True)
    publish_count = models.PositiveIntegerField(_("times sent"), default=0)
    started_at = models.DateTimeField(_("started"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished"), null=True, blank=True)
    refunded = models.BigIntegerField(_("refunded (micro-tokens)"), default=0)
    refunded_at = models.DateTimeField(_("refunded at"), null=True, blank=True)
    error = models.TextField(_("error"), blank=True, default="")

    class Meta:
        verbose_name = _("reservation")
        verbose_name_plural = _("reservations")
        indexes = [
            # The sweeper's queries: due reservations of one status, oldest first.
            models.Index(fields=["status", "eta"], name="django_tokenbucket_res_due"),
        ]

    def __str__(self) -> str:
        return f"{self.task} on {self.name} [{self.label or self.key[:12]}] {self.status}"

    @property
    def tokens(self) -> float:
        """Return the tokens reserved."""
        return self.count / MICRO

    @property
    def refunded_tokens(self) -> float:
        """Return the tokens given back (by ``refund`` or ``cancel``)."""
        return self.refunded / MICRO


class LimitOverride(models.Model):
    """A change to one limit made while the site runs: for one key, or every key of the limit.

    ``key`` is the key's digest, as ``RateLimit.key`` holds it (empty: every key), so an
    override reaches exactly the bucket its key's decisions use. ``action`` says what
    applies: ``limit`` replaces the numbers that are not null (micro-tokens and
    microseconds, as ``LimitConfig`` holds them), ``exempt`` lets every call through
    and counts nothing, ``block`` refuses every call until ``expires_at`` (never, when
    null). Written through ``limiter.override``/``exempt``/``block`` (and the admin and
    the command), which bump ``OverridesVersion`` in the same transaction and give the
    row its new ``revision``; read by ``django_tokenbucket.overrides``, which after a
    change reads only the rows of a revision above the one it holds.
    """

    class Action(models.TextChoices):
        LIMIT = "limit", _("limit")
        EXEMPT = "exempt", _("exempt")
        BLOCK = "block", _("block")

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(_("limit name"), max_length=MAX_NAME_LENGTH)
    key = models.CharField(_("key digest"), max_length=64, blank=True, default="")
    label = models.CharField(_("key"), max_length=LABEL_LENGTH, blank=True, default="")
    action = models.CharField(_("action"), max_length=8, choices=Action.choices)
    rate = models.BigIntegerField(_("rate (micro-tokens)"), null=True, blank=True)
    period = models.BigIntegerField(_("period (µs)"), null=True, blank=True)
    capacity = models.BigIntegerField(_("capacity (micro-tokens)"), null=True, blank=True)
    max_reserved = models.BigIntegerField(_("max reserved (micro-tokens)"), null=True, blank=True)
    expires_at = models.DateTimeField(_("expires"), null=True, blank=True)
    reason = models.TextField(_("reason"), blank=True, default="")
    created_by = models.CharField(_("created by"), max_length=150, blank=True, default="")
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    updated_at = models.DateTimeField(_("updated"), auto_now=True)
    #: ``OverridesVersion.revision`` when this row was last written. A default in the
    #: database too: a process still on a version without it can write rows during a
    #: rolling deploy (its change is seen by a full read, see ``OverridesVersion``).
    revision = models.BigIntegerField(_("revision"), default=0, db_default=0, editable=False)

    class Meta:
        verbose_name = _("limit override")
        verbose_name_plural = _("limit overrides")
        constraints = [
            models.UniqueConstraint(fields=["name", "key"], name="django_tokenbucket_override_name_key"),
        ]
        indexes = [
            # What every process reads after a change: the rows changed since its snapshot.
            models.Index(fields=["revision"], name="django_tokenbucket_lo_rev"),
        ]

    def __str__(self) -> str:
        whom = label_as_typed(self.label) or self.key[:12] or _("every key")
        return f"{self.action} {self.name} [{whom}]"

    @property
    def every_key(self) -> bool:
        """Whether this override applies to every key of its limit."""
        return not self.key


class OverridesVersion(models.Model):
    """One row that says which changes of LimitOverride each process has yet to read.

    Every change increments ``revision`` in the writer's transaction (whose row lock
    serializes writers, so revisions commit in order) and gives its row (or, for a
    deletion, its ``OverrideTombstone``) that revision. Each process reads this row at
    most once per ``OVERRIDES["MAX_AGE"]`` and, when ``revision`` moved on, only the rows
    and tombstones of a revision above the one it holds. ``epoch`` is random, new
    whenever the row is made (a flushed table starts another count, which must never
    be taken for the continuation of one a process holds); ``floor`` is the revision
    below which cleanup deleted rows or tombstones, which a process that held less must
    read whole. ``stamp`` changes with every change as well: ``-revision``, which tells
    a writer that the previous change came from a version of this app that wrote a
    random stamp and no revision (during a rolling deploy, or before this migration),
    so that it starts a new epoch and every process reads the whole table again.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    stamp = models.BigIntegerField(_("stamp"))
    epoch = models.BigIntegerField(_("epoch"), default=0, db_default=0)
    revision = models.BigIntegerField(_("revision"), default=0, db_default=0)
    floor = models.BigIntegerField(_("floor"), default=0, db_default=0)

    class Meta:
        verbose_name = _("overrides version")
        verbose_name_plural = _("overrides versions")

    def __str__(self) -> str:
        return f"overrides revision {self.revision} (epoch {self.epoch})"


class OverrideTombstone(models.Model):
    """A LimitOverride deleted (``clear_override``, the admin, ``tokenbucket unblock``), at a revision.

    What lets every other process forget it by reading what changed since its snapshot
    rather than every override. One row per limit and key (the latest deletion); cleanup
    deletes them a day after (``overrides.TOMBSTONES_KEPT``), raising
    ``OverridesVersion.floor`` past their revisions.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(_("limit name"), max_length=MAX_NAME_LENGTH)
    key = models.CharField(_("key digest"), max_length=64, blank=True, default="")
    revision = models.BigIntegerField(_("revision"))
    deleted_at = models.DateTimeField(_("deleted"), default=timezone.now)

    class Meta:
        verbose_name = _("override tombstone")
        verbose_name_plural = _("override tombstones")
        constraints = [
            models.UniqueConstraint(fields=["name", "key"], name="django_tokenbucket_tombstone_name_key"),
        ]
        indexes = [models.Index(fields=["revision"], name="django_tokenbucket_ot_rev")]

    def __str__(self) -> str:
        return f"{self.name} [{self.key[:12] or 'every key'}] deleted at revision {self.revision}"


class AnalyticsMinute(models.Model):
    """How many calls of one limit were let through and refused in one minute (denial analytics).

    Each process counts in memory and adds its counts here at most once per flush
    interval, so one row per (name, minute) however busy the limit: the charts read
    a day of a limit in at most ``MINUTES_KEPT`` rows. ``cleanup`` trims rows past
    that retention. Not in the admin: the analytics pages read it through the backend.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(_("limit name"), max_length=MAX_NAME_LENGTH)
    #: Whole minutes since the epoch (UTC).
    minute = models.BigIntegerField(_("minute"))
    allowed = models.BigIntegerField(_("allowed"), default=0)
    denied = models.BigIntegerField(_("denied"), default=0)

    class Meta:
        verbose_name = _("analytics minute")
        verbose_name_plural = _("analytics minutes")
        constraints = [
            # The target of the flushes' upsert, and the index of every read (a name's minutes).
            models.UniqueConstraint(fields=["name", "minute"], name="django_tokenbucket_analytics_name_minute"),
        ]
        indexes = [
            # Trimming deletes by age across every name, which the unique index (name first) cannot serve.
            models.Index(fields=["minute"], name="django_tokenbucket_am_minute"),
        ]

    def __str__(self) -> str:
        return f"{self.name} @{self.minute}: {self.allowed} allowed, {self.denied} denied"


class DeniedKeyMinute(models.Model):
    """How many calls of one key a limit refused in one minute: the "top denied keys" of the analytics.

    Flushed like ``AnalyticsMinute``, only for keys that were refused (an allowed call
    writes nothing here), and kept ``KEY_MINUTES_KEPT`` minutes: keys are many, so
    ``cleanup`` trims them much sooner than the per-limit counts.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(_("limit name"), max_length=MAX_NAME_LENGTH)
    minute = models.BigIntegerField(_("minute"))
    digest = models.CharField(_("key digest"), max_length=64)
    label = models.CharField(_("key"), max_length=LABEL_LENGTH, blank=True, default="")
    denied = models.BigIntegerField(_("denied"), default=0)

    class Meta:
        verbose_name = _("denied key minute")
        verbose_name_plural = _("denied key minutes")
        constraints = [
            models.UniqueConstraint(
                fields=["name", "minute", "digest"], name="django_tokenbucket_denied_name_minute_digest"
            ),
        ]
        indexes = [
            # As AnalyticsMinute's: trimming deletes by age across every name.
            models.Index(fields=["minute"], name="django_tokenbucket_dk_minute"),
        ]

    def __str__(self) -> str:
        return f"{self.name} @{self.minute} [{label_as_typed(self.label) or self.digest[:12]}]: {self.denied} denied"

