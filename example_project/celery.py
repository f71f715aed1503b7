"""The example project's Celery app: ``celery -A example_project worker --beat``."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds example_project/demo/tasks.py; django_tokenbucket's own tasks register themselves.
app.autodiscover_tasks()
