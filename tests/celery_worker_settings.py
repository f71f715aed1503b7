"""Settings of the Celery workers that test_celery.py starts: the tests' own, pointed at
the test database the pytest process created (its name is only known at run time).
"""

import json
import os

from .settings import *  # noqa: F403
from .settings import CACHES, DATABASES, TOKENBUCKET

for _alias, _database in DATABASES.items():
    if _alias != "unreachable":
        _database["NAME"] = os.environ["TOKENBUCKET_WORKER_DB_NAME"]
# The Redis backend's keys of the pytest process (its prefix depends on its pid).
CACHES["redis"]["KEY_PREFIX"] = os.environ["TOKENBUCKET_WORKER_REDIS_PREFIX"]
TOKENBUCKET = {**TOKENBUCKET, **json.loads(os.environ.get("TOKENBUCKET_WORKER_TOKENBUCKET", "{}"))}
