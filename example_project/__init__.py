"""The example project of django_tokenbucket; run it with ``./scripts/demo``."""

# Loaded with Django, so that @shared_task and schedule() use this project's Celery app.
from .celery import app as celery_app

__all__ = ["celery_app"]
