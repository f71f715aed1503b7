"""``TOKENBUCKET["METRICS"]`` (issue 31): Prometheus and OpenTelemetry counters of what
the limiter decides, never a key in a label, and the sums of several OS processes in
``prometheus_client``'s multiprocess mode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import prometheus_client
import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.test import override_settings
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from django_tokenbucket import BackendUnavailable, LimitRequest, limiter, metrics, prometheus_tallies
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
    errors_before = (
        REGISTRY.get_sample_value("tokenbucket_store_errors_total", {"backend": "default", "error": "OperationalError"})
        or 0.0
    )
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
    assert "203.0.113.9" not in exposed and hostile not in exposed and 'x"}' not in exposed


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
            [sys.executable, "-c", WORKER, "20", key, settings.REDIS_KEY_PREFIX],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
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


# -- the recorder: prometheus_client's own children, across threads and forks -------------------

#: Store times around and on the buckets' bounds ("le": a value on a bound is in its bucket).
SECONDS = [0.0, 0.00005, 0.0001, 0.00010001, 0.0003, 0.001, 0.0049, 0.1, 2.5, 2.6, 40.0]


#: Both Prometheus recorders: prometheus_client's children (its multiprocess mode) and
#: the tallies kept per thread (every other process).
RECORDERS = pytest.mark.parametrize("make_recorder", [metrics.PrometheusRecorder, metrics.TalliedPrometheusRecorder])


@RECORDERS
def test_the_exposition_has_every_family_its_labels_buckets_and_created_samples(make_recorder):
    registry = CollectorRegistry()
    record_everything(make_recorder(registry))
    value = registry.get_sample_value
    assert [value("tokenbucket_decisions_total", {**LOGIN_ALLOWED, "outcome": o}) for o in metrics.OUTCOMES] == [
        2,
        2,
        2,
        1,
        1,
        1,
        1,
        1,
    ]
    assert value("tokenbucket_decisions_total", {"limit": "search", "backend": "redis", "outcome": "allowed"}) == 1
    # 0.00005 and 0.0001 on "default" (every third value is "redis's"): the bound is in its bucket.
    assert value("tokenbucket_decision_seconds_bucket", {"backend": "default", "le": "0.0001"}) == 2
    assert value("tokenbucket_decision_seconds_bucket", {"backend": "default", "le": "2.5"}) == 6
    assert value("tokenbucket_decision_seconds_bucket", {"backend": "default", "le": "+Inf"}) == 7
    assert value("tokenbucket_decision_seconds_count", {"backend": "redis"}) == 4
    assert value("tokenbucket_decision_seconds_sum", {"backend": "redis"}) == pytest.approx(2.60500001)
    assert value("tokenbucket_store_errors_total", {"backend": "redis", "error": "ConnectionError"}) == 1
    assert value("tokenbucket_reservations_total", {"event": "scheduled"}) == 3
    created = {s.name for f in registry.collect() for s in f.samples if s.name.endswith("_created")}
    assert created == {
        "tokenbucket_decisions_created",
        "tokenbucket_decision_seconds_created",
        "tokenbucket_store_errors_created",
        "tokenbucket_reservations_created",
    }


@RECORDERS
def test_no_count_is_lost_between_threads_or_scrapes(make_recorder):
    registry = CollectorRegistry()
    recorder = make_recorder(registry)
    threads_, per_thread = 8, 5000
    reads: list[float] = []
    start = threading.Barrier(threads_ + 1)

    def decide() -> None:
        start.wait()
        for _ in range(per_thread):
            recorder.decision("login", "default", metrics.ALLOWED)
            recorder.store_seconds("default", 0.0002)

    workers = [threading.Thread(target=decide) for _ in range(threads_)]
    for worker in workers:
        worker.start()
    start.wait()
    while any(worker.is_alive() for worker in workers):
        # Scrapes while the threads count: each sees every count made before it, or fewer.
        reads.append(registry.get_sample_value("tokenbucket_decisions_total", LOGIN_ALLOWED) or 0.0)
    for worker in workers:
        worker.join()
    assert reads == sorted(reads)  # a scrape never sees fewer than the one before it
    assert registry.get_sample_value("tokenbucket_decisions_total", LOGIN_ALLOWED) == threads_ * per_thread
    assert (
        registry.get_sample_value("tokenbucket_decision_seconds_count", {"backend": "default"}) == threads_ * per_thread
    )


@RECORDERS
def test_a_forked_child_counts_on_from_its_parents_figures_and_the_parent_keeps_its_own(make_recorder):
    registry = CollectorRegistry()
    recorder = make_recorder(registry)
    # A thread that counted and ended, as a request thread before a server forks.
    counter = threading.Thread(target=recorder.decision, args=("login", "default", metrics.ALLOWED))
    counter.start()
    counter.join()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's outcome is its exit status
        recorder.decision("login", "default", metrics.ALLOWED)
        os._exit(0 if registry.get_sample_value("tokenbucket_decisions_total", LOGIN_ALLOWED) == 2 else 1)
    assert exit_code_of(child, "the forked child hung counting a decision") == 0
    assert registry.get_sample_value("tokenbucket_decisions_total", LOGIN_ALLOWED) == 1


def exit_code_of(child: int, hung: str) -> int:
    """The exit code of the forked ``child``; the test fails with ``hung`` past 30 s."""
    deadline = time.monotonic() + 30
    while (ended := os.waitpid(child, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    if ended == (0, 0):
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail(hung)
    return os.waitstatus_to_exitcode(ended[1])


LOGIN_ALLOWED = {"limit": "login", "backend": "default", "outcome": "allowed"}


# -- the tallied recorder: what prometheus_client's children would show, without their locks ----


def exposition(registry: CollectorRegistry) -> list[tuple[str, str, float]]:
    # The _created samples hold when each series began, which differs between two recorders.
    return sorted(
        (sample.name, json.dumps(sample.labels, sort_keys=True), sample.value)
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    )


def record_everything(recorder: metrics.Recorder) -> None:
    for i, seconds in enumerate(SECONDS):
        recorder.store_seconds("default" if i % 3 else "redis", seconds)
        recorder.decision("login", "default", metrics.OUTCOMES[i % len(metrics.OUTCOMES)])
    recorder.decision("search", "redis", metrics.ALLOWED)
    recorder.store_error("redis", "ConnectionError")
    recorder.reservation("scheduled", 3)


def test_the_tallies_read_as_prometheus_clients_own_children_would():
    tallied, children = CollectorRegistry(), CollectorRegistry()
    record_everything(metrics.TalliedPrometheusRecorder(tallied))
    record_everything(metrics.PrometheusRecorder(children))
    assert exposition(tallied) == exposition(children)

    def created(registry: CollectorRegistry) -> list[tuple[str, str]]:
        return sorted(
            (s.name, json.dumps(s.labels, sort_keys=True))
            for f in registry.collect()
            for s in f.samples
            if s.name.endswith("_created")
        )

    assert created(tallied) == created(children) != []

    # The text a scrape gets, _created values aside, line for line.
    def text(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert text(tallied) == text(children)


def test_the_tallies_drop_created_series_when_prometheus_client_is_told_to(monkeypatch):
    """``prometheus_client.disable_created_metrics()`` (or PROMETHEUS_DISABLE_CREATED_SERIES)
    is read on every scrape, through prometheus_client's public behaviour."""
    registry = CollectorRegistry()
    record_everything(metrics.TalliedPrometheusRecorder(registry))
    prometheus_client.disable_created_metrics()
    try:
        names = {s.name for f in registry.collect() for s in f.samples}
        assert not {name for name in names if name.endswith("_created")}
        assert "tokenbucket_decisions_total" in names and "tokenbucket_decision_seconds_bucket" in names
    finally:
        prometheus_client.enable_created_metrics()
    assert "tokenbucket_decisions_created" in {s.name for f in registry.collect() for s in f.samples}


def test_a_thread_per_request_without_scrapes_keeps_a_bounded_number_of_tallies():
    # runserver makes a thread per request; metrics may be on with nobody scraping.
    registry = CollectorRegistry()
    recorder = metrics.TalliedPrometheusRecorder(registry)
    kept = []
    for _ in range(1000):
        thread = threading.Thread(target=recorder.decision, args=("login", "default", metrics.ALLOWED))
        thread.start()
        thread.join()
        kept.append(recorder._tallies.threads_kept())
    assert max(kept) <= prometheus_tallies.SWEEP_AT
    assert registry.get_sample_value("tokenbucket_decisions_total", LOGIN_ALLOWED) == 1000
    assert recorder._tallies.threads_kept() == 0  # the read folded every ended thread into the sum


def test_a_forked_child_counts_though_a_parent_thread_held_the_tallies_lock():
    registry = CollectorRegistry()
    recorder = metrics.TalliedPrometheusRecorder(registry)
    recorder.decision("login", "default", metrics.ALLOWED)
    held, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        # A scrape in progress in another thread at the moment the server forks.
        with recorder._tallies._lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    held.wait()
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's outcome is its exit status
            # A new thread's first count and a scrape both take the lock.
            counter = threading.Thread(target=recorder.decision, args=("login", "default", metrics.ALLOWED))
            counter.start()
            counter.join()
            os._exit(0 if registry.get_sample_value("tokenbucket_decisions_total", LOGIN_ALLOWED) == 2 else 1)
        assert exit_code_of(child, "the forked child hung on the lock a parent thread held") == 0
    finally:
        release.set()
        holder.join()


def test_the_multiprocess_mode_keeps_prometheus_clients_children(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert type(metrics.prometheus_recorder(CollectorRegistry())) is metrics.PrometheusRecorder
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    assert type(metrics.prometheus_recorder(CollectorRegistry())) is metrics.TalliedPrometheusRecorder


@pytest.mark.parametrize(
    ("module", "attributes", "warned"),
    [
        ("gunicorn.workers.base", {}, "a Gunicorn worker"),
        ("uwsgi", {"numproc": 4}, "a uWSGI worker (4 processes)"),
        ("uwsgi", {"numproc": 1}, None),
    ],
)
def test_a_worker_of_a_multiprocess_server_is_told_what_a_scrape_sees(monkeypatch, caplog, module, attributes, warned):
    """Issue 46: under ``gunicorn -w 4`` without the multiprocess mode, each worker counts
    alone and a scrape sees one of them: the default must say so. (What each server
    leaves in its workers' ``sys.modules`` stands in for the server here.)"""
    import types

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**attributes))
    with caplog.at_level("WARNING", logger="django_tokenbucket"):
        metrics.prometheus_recorder(CollectorRegistry())
    lines = [r.getMessage() for r in caplog.records if "PROMETHEUS_MULTIPROC_DIR" in r.getMessage()]
    if warned is None:
        assert lines == []
    else:
        assert len(lines) == 1 and warned in lines[0] and "a scrape of /metrics sees" in lines[0]


def test_a_worker_in_the_multiprocess_mode_is_not_warned(monkeypatch, caplog, tmp_path):
    import types

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gunicorn.workers.base", types.SimpleNamespace())
    with caplog.at_level("WARNING", logger="django_tokenbucket"):
        metrics.prometheus_recorder(CollectorRegistry())
    assert not [r for r in caplog.records if "PROMETHEUS_MULTIPROC_DIR" in r.getMessage()]


# -- the /metrics view docs/operations.md gives -------------------------------------------------


def documented_metrics_view():
    """The ``# myapp/metrics.py`` block of docs/operations.md, as a user pastes it."""
    page = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
    text = page.read_text()
    start = text.index("```python\n# myapp/metrics.py\n") + len("```python\n")
    namespace: dict = {}
    exec(compile(text[start : text.index("```", start)], "myapp/metrics.py", "exec"), namespace)
    return namespace["metrics"]


def test_the_documented_view_serves_this_process_counts(store, rf):
    """Issue 49: the docs named the metric families but gave no URL to scrape them at."""
    for _ in range(4):
        limiter.limit("login", "documented-view")
    response = documented_metrics_view()(rf.get("/metrics"))
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    line = 'tokenbucket_decisions_total{backend="default",limit="login",outcome="allowed"}'
    assert any(row.startswith(line) and float(row.split()[-1]) >= 4 for row in response.content.decode().splitlines())


def test_the_documented_view_sums_every_worker_in_the_multiprocess_mode(tmp_path: Path, redis_store, rf, monkeypatch):
    key = f"view-{os.getpid()}"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, "10", key, settings.REDIS_KEY_PREFIX],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [json.loads(worker.communicate(timeout=120)[0]) for worker in workers]
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    body = documented_metrics_view()(rf.get("/metrics")).content.decode()
    allowed = [
        row
        for row in body.splitlines()
        if row.startswith("tokenbucket_decisions_total{") and 'outcome="allowed"' in row
    ]
    assert sum(float(row.split()[-1]) for row in allowed) == sum(r["allowed"] for r in results) == 30
