"""The Celery app of the tests: the one their workers run and the tests publish with.

A real broker (Redis by default, database 5; ``TOKENBUCKET_CELERY_BROKER`` may name
another, e.g. RabbitMQ). Every test run has a queue and, on Redis, a key prefix of its
own, so parallel runs (tox envs, two developers) never consume each other's messages.
The worker subprocesses get the same names through the environment.
"""

from __future__ import annotations

import json
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

REDIS_HOST = os.environ.get("REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("REDIS_PORT", "6379"))
REDIS_BROKER = f"redis://{REDIS_HOST}:{REDIS_PORT}/{os.environ.get('TOKENBUCKET_CELERY_REDIS_DB', '5')}"
BROKER = os.environ.get("TOKENBUCKET_CELERY_BROKER", REDIS_BROKER)
QUEUE = os.environ.setdefault("TOKENBUCKET_CELERY_QUEUE", f"tbtest-{os.getpid()}")
#: Prefix of every broker key of this run on Redis (queues, unacked messages, pidbox).
KEY_PREFIX = f"{QUEUE}:"

app = Celery("tests", include=["tests.celery_tasks"])
transport_options: dict[str, object] = {}
if BROKER.startswith("redis"):
    transport_options["global_keyprefix"] = KEY_PREFIX
# Extra options for one worker, e.g. a short visibility_timeout (see test_celery.py).
transport_options.update(json.loads(os.environ.get("TOKENBUCKET_CELERY_TRANSPORT", "{}")))
app.conf.update(
    broker_url=BROKER,
    broker_transport_options=transport_options,
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    worker_redirect_stdouts=False,
    timezone="UTC",
)
if os.environ.get("TOKENBUCKET_CELERY_DB_REUSE_MAX"):
    # Celery's Django fixup closes the database connection before and after every task
    # unless told to reuse it this many times (make bench-tasks, docs/celery.md).
    app.conf.CELERY_DB_REUSE_MAX = int(os.environ["TOKENBUCKET_CELERY_DB_REUSE_MAX"])
if os.environ.get("TOKENBUCKET_CELERY_SWEEP_EVERY"):
    # The beat entry docs/celery.md recommends, at a test's pace.
    app.conf.beat_schedule = {
        "tokenbucket-sweep": {
            "task": "django_tokenbucket.sweep_reservations",
            "schedule": float(os.environ["TOKENBUCKET_CELERY_SWEEP_EVERY"]),
        }
    }
