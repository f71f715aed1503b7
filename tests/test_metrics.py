"""``TOKENBUCKET["METRICS"]`` (issue 31): Prometheus and OpenTelemetry counters of what
the limiter decides, never a key in a label, and the sums of several OS processes in
``prometheus_client``'s multiprocess mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.test import override_settings
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from django_tokenbucket import BackendUnavailable, LimitRequest, limiter, metrics
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "unreachable"])

PROMETHEUS = {**BASE_SETTINGS, "METRICS": "prometheus"}
SHADOW = {"rate": 1, "period": 60, "shadow": True}


def decisions(limit: str, outcome: str, backend: str = "default") -> float:
    value = REGISTRY.get_sample_value(
        "tokenbucket_decisions_total", {"limit": limit, "backend": backend, "outcome": outcome}
    )
    return value or 0.0


def counted(limit: str, backend: str = "default") -> dict[str, float]:
    return {outcome: decisions(limit, outcome, backend) for outcome in metrics.OUTCOMES}


@pytest.fixture
def prometheus():
    with override_settings(TOKENBUCKET=PROMETHEUS), frozen_clock():
        yield


@pytest.fixture(params=["database", "redis"])
def store(request, prometheus):
    if request.param == "database":
        yield
        return
    redis = request.getfixturevalue("redis_store")
    with override_settings(TOKENBUCKET={**PROMETHEUS, **redis}):
        yield


def test_each_applied_decision_is_counted_once_by_its_outcome(store):
    before = counted("login")
    for _ in range(5):
        assert limiter.limit("login", "alice").ok
    assert not limiter.limit("login", "alice").ok
    # Reads are not decisions.
    limiter.check("login", "alice")
    limiter.get_value("login", "alice")
    after = counted("login")
    assert after["allowed"] - before["allowed"] == 5
    assert after["denied"] - before["denied"] == 1
    assert after["failed_open"] == before["failed_open"] and after["failed_closed"] == before["failed_closed"]


def test_a_limit_refused_by_another_of_its_call_is_not_counted(store):
    limiter.limit("login", "bob", count=5)
    before, other = counted("login"), counted("ten_per_minute")
    result = limiter.limit_many([LimitRequest("ten_per_minute", "bob"), LimitRequest("login", "bob")])
    assert not result.ok
    assert counted("login")["denied"] - before["denied"] == 1
    assert counted("ten_per_minute") == other  # it took nothing


def test_a_shadow_limit_that_would_deny_is_counted_apart(store):
    before = counted("metrics-shadowed")
    limiter.limit("metrics-shadowed", "carol", config=SHADOW)
    status = limiter.limit("metrics-shadowed", "carol", config=SHADOW)
    assert status.ok and status.would_deny
    after = counted("metrics-shadowed")
    assert (after["allowed"] - before["allowed"], after["shadow_denied"] - before["shadow_denied"]) == (1, 1)


def test_store_failures_are_counted_open_or_closed_with_the_error(prometheus):
    failing = {**PROMETHEUS, "OPTIONS": {"DATABASE": "unreachable"}, "RETRY_ATTEMPTS": 1}
    errors_before = REGISTRY.get_sample_value(
        "tokenbucket_store_errors_total", {"backend": "default", "error": "OperationalError"}
    ) or 0.0
    before = counted("login")
    with override_settings(TOKENBUCKET=failing):
        with pytest.raises(BackendUnavailable):
            limiter.limit("login", "dave")
    with override_settings(TOKENBUCKET={**failing, "FAIL_OPEN": True}):
        assert limiter.limit("login", "dave").failed_open
    after = counted("login")
    assert (after["failed_closed"] - before["failed_closed"], after["failed_open"] - before["failed_open"]) == (1, 1)
    assert after["allowed"] == before["allowed"]
    errors = REGISTRY.get_sample_value(
        "tokenbucket_store_errors_total", {"backend": "default", "error": "OperationalError"}
    )
    assert errors == errors_before + 2


def test_store_time_is_observed_per_decision(store):
    before = REGISTRY.get_sample_value("tokenbucket_decision_seconds_count", {"backend": "default"}) or 0.0
    for _ in range(3):
        limiter.limit("ten_per_minute", "erin")
    limiter.limit_many([("ten_per_minute", "erin"), ("login", "erin")])
    after = REGISTRY.get_sample_value("tokenbucket_decision_seconds_count", {"backend": "default"})
    assert after == before + 4
    assert REGISTRY.get_sample_value("tokenbucket_decision_seconds_sum", {"backend": "default"}) > 0


def test_no_key_ever_reaches_a_label(store):
    # An attacker picks keys; each label value would be a time series kept forever.
    hostile = 'x"} 1\ntokenbucket_decisions_total{limit="login'
    limiter.limit("login", hostile)
    limiter.limit("login", ("ip", "203.0.113.9"))
    exposed = "\n".join(
        f"{sample.name} {sample.labels}"
        for family in REGISTRY.collect()
        if family.name.startswith("tokenbucket")
        for sample in family.samples
    )
    assert "203.0.113.9" not in exposed and hostile not in exposed and "x\"}" not in exposed


def test_limit_names_past_the_bound_share_one_label(prometheus, monkeypatch):
    recorder = metrics.active()
    assert recorder is not None
    monkeypatch.setattr(metrics, "MAX_LIMIT_LABELS", len(recorder._limit_label._seen) + 1)
    before = counted("other")["allowed"]
    limiter.limit("first-of-many", config="5/m")
    for i in range(3):
        limiter.limit(f"many-{i}", config="5/m")
    assert counted("first-of-many")["allowed"] == 1
    assert counted("other")["allowed"] - before == 3
    assert counted("many-0")["allowed"] == 0


def test_metrics_are_off_by_default_and_a_bad_value_is_a_check_error():
    assert metrics.active() is None
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "METRICS": "statsd"}):
        [error] = [m for m in run_checks() if m.id == "django_tokenbucket.E050"]
        assert "'statsd'" in error.msg and "prometheus" in error.hint
        with pytest.raises(Exception, match=r"TOKENBUCKET\['METRICS'\] must be None"):
            limiter.limit("login", "frank")


def test_opentelemetry_gets_the_same_instruments():
    from opentelemetry import metrics as otel
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    otel.set_meter_provider(MeterProvider(metric_readers=[reader]))
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "METRICS": "opentelemetry"}), frozen_clock():
        for _ in range(6):
            limiter.limit("login", "grace")
    points: dict[tuple[str, frozenset], float] = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    # A counter's point has a value; a histogram's, a count.
                    value = getattr(point, "value", None)
                    points[(metric.name, frozenset(point.attributes.items()))] = point.count if value is None else value

    def decided(outcome: str) -> float:
        attributes = frozenset({"limit": "login", "backend": "default", "outcome": outcome}.items())
        return points.get(("tokenbucket.decisions", attributes), 0)

    assert (decided("allowed"), decided("denied")) == (5, 1)
    assert points[("tokenbucket.decision.duration", frozenset({"backend": "default"}.items()))] == 6


# -- several OS processes, as Gunicorn's workers ----------------------------------------------

WORKER = """
import json, os, sys
import django
django.setup()
from django.test.utils import override_settings
from django_tokenbucket import limiter
from tests.settings import TOKENBUCKET, CACHES
settings = {**TOKENBUCKET, "METRICS": "prometheus", "BACKEND": "django_tokenbucket.backends.redis.RedisBackend",
            "OPTIONS": {"CACHE": "redis"}}
# The parent's key prefix: one bucket for all, deleted with the parent's keys.
caches = {**CACHES, "redis": {**CACHES["redis"], "KEY_PREFIX": sys.argv[3]}}
allowed = denied = 0
with override_settings(TOKENBUCKET=settings, CACHES=caches):
    for i in range(int(sys.argv[1])):
        if limiter.limit("multi", sys.argv[2], config="30/h").ok:
            allowed += 1
        else:
            denied += 1
print(json.dumps({"allowed": allowed, "denied": denied}))
"""


def test_counts_of_several_processes_sum_to_their_decisions(tmp_path: Path, redis_store):
    # Each process writes its own file in PROMETHEUS_MULTIPROC_DIR, as Gunicorn workers
    # do; MultiProcessCollector sums them, as the /metrics view of such a server does.
    key = f"shared-{os.getpid()}"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, "20", key, settings.REDIS_KEY_PREFIX], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    results = [json.loads(worker.communicate(timeout=120)[0]) for worker in workers]
    assert all(worker.returncode == 0 for worker in workers)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(tmp_path))

    def summed(outcome: str) -> float:
        labels = {"limit": "multi", "backend": "default", "outcome": outcome}
        return registry.get_sample_value("tokenbucket_decisions_total", labels) or 0.0

    assert summed("allowed") == sum(r["allowed"] for r in results) == 30
    # A process answers a key it saw denied from memory (the deny cache), counted apart.
    assert summed("denied") + summed("denied_cached") == sum(r["denied"] for r in results) == 50
    assert summed("denied_cached") > 0
