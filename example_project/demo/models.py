"""The example project's own data: summary jobs run by Celery on an LLM token budget."""

from __future__ import annotations

from django.db import models


class SummaryJob(models.Model):
    """A text to summarise, with the tokens reserved for it and when it was scheduled and ran."""

    class Status(models.TextChoices):
        SCHEDULED = "scheduled", "scheduled"
        RUNNING = "running", "running"
        DONE = "done", "done"
        FAILED = "failed", "failed"

    owner = models.CharField(max_length=100, help_text="whose token budget paid: a user or an address")
    text = models.TextField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.SCHEDULED)
    tokens_reserved = models.PositiveIntegerField()
    tokens_used = models.PositiveIntegerField(null=True, blank=True)
    summary = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    #: When the reserved tokens exist, so when the task runs (the reservation's ETA).
    scheduled_for = models.DateTimeField(null=True, blank=True)
    ran_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    reservation = models.ForeignKey(
        "django_tokenbucket.Reservation", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"summary job {self.pk} ({self.status})"

    @property
    def lateness(self) -> float | None:
        """Return how long after its scheduled time the job started, in seconds."""
        if self.ran_at is None or self.scheduled_for is None:
            return None
        return (self.ran_at - self.scheduled_for).total_seconds()
