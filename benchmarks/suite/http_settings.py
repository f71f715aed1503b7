"""Settings of ``benchmarks/suite/http_stack.py``: peers.py's, on stores of its own, with a request stack.

The PostgreSQL database ``tokenbucket_bench_http`` and the Redis keys under ``tbhttp`` (in
Redis database 14) belong to this benchmark alone, so that it can run while peers.py
does; both are created and cleared by the benchmark. The test suite's databases
(``test``/``test_test`` on PostgreSQL, Redis database 15) are never touched.
"""

from benchmarks.suite import peers_settings as base
from benchmarks.suite.peers_settings import *  # noqa: F403 - peers.py's settings, overridden below

PG_DATABASE = "tokenbucket_bench_http"
DATABASES = {"default": {**base.DATABASES["default"], "NAME": PG_DATABASE}}
# Not a prefix of peers.py's "tbbench" either way round: each run clears only its own keys.
REDIS_PREFIX = "tbhttp"
CACHES = {"default": {**base.CACHES["default"], "KEY_PREFIX": REDIS_PREFIX}}

ROOT_URLCONF = "benchmarks.suite.http_views"
ALLOWED_HOSTS = ["testserver"]  # what RequestFactory's environ names
# A small production-like stack, the same for every view. No sessions or auth middleware:
# the users come from an authentication class that makes no query (see http_views), so
# that the throttles, not session lookups, are what differs between the views.
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
    # django-ratelimit's documented way to answer 429 rather than its default 403.
    "django_ratelimit.middleware.RatelimitMiddleware",
]
RATELIMIT_VIEW = "benchmarks.suite.http_views.ratelimited"

REST_FRAMEWORK = {
    # The views name their authentication class: importing it from here would import
    # http_views, and so DRF's APIView, while DRF's settings are being read.
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    # The browsable API's templates would be picked by no client here; leave them out.
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_THROTTLE_CLASSES": [],
    # Our drop-in and DRF's own read the same rates: "user" is what the timed views use
    # (peers.py's limit, 100 per second with a burst of 100), "http_sanity" the sanity
    # views (5 sequential requests allowed, the 6th denied).
    "DEFAULT_THROTTLE_RATES": {"user": "100/s", "http_sanity": "5/h"},
}
