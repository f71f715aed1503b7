"""The summariser's Celery task, scheduled by ``views.summaries`` with ``django_tokenbucket.celery.schedule``."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from django_tokenbucket.celery import current_reservation, refund

from . import llm
from .models import SummaryJob


@shared_task(name="demo.summarise")
def summarise(job_id: int) -> None:
    """Summarise one job's text, then give back the reserved tokens the answer did not use."""
    job = SummaryJob.objects.get(pk=job_id)
    job.status, job.ran_at = SummaryJob.Status.RUNNING, timezone.now()
    job.save(update_fields=["status", "ran_at"])
    try:
        completion = llm.summarise(job.text)
    except Exception:
        SummaryJob.objects.filter(pk=job_id).update(status=SummaryJob.Status.FAILED, finished_at=timezone.now())
        raise
    job.summary, job.tokens_used = completion.text, completion.total_tokens
    job.status, job.finished_at = SummaryJob.Status.DONE, timezone.now()
    job.save(update_fields=["summary", "tokens_used", "status", "finished_at"])
    reservation = current_reservation()
    unused = job.tokens_reserved - completion.total_tokens
    if reservation is not None and unused > 0:
        # The next jobs of this user can run sooner; once only, even if redelivered.
        refund(reservation, unused)
