"""What the limiter does, as metrics for Prometheus or OpenTelemetry (``TOKENBUCKET["METRICS"]``).

Off (``None``) by default. ``"prometheus"`` registers in ``prometheus_client``'s default
registry, which django-prometheus' ``/metrics`` view and ``prometheus_client``'s own
exporters serve; ``"opentelemetry"`` makes the same instruments with the application's
meter provider (``opentelemetry.metrics``):

========================================  ===================================  ==========================
Prometheus                                OpenTelemetry                        labels / attributes
========================================  ===================================  ==========================
``tokenbucket_decisions_total``           ``tokenbucket.decisions``            limit, backend, outcome
``tokenbucket_store_errors_total``        ``tokenbucket.store_errors``         backend, error
``tokenbucket_decision_seconds``          ``tokenbucket.decision.duration``    backend
``tokenbucket_reservations_total``        ``tokenbucket.reservations``         event
========================================  ===================================  ==========================

A decision's ``outcome`` is one of ``OUTCOMES``; a reservation's ``event`` one of
``RESERVATION_EVENTS``. Labels hold limit names, backend aliases and exception class
names, never a key: a key is what an attacker chooses, and each new label value is a
new time series kept for the life of the process. Limit names come from code, but an
inline name built at run time could be many, so past ``MAX_LIMIT_LABELS`` distinct
names the rest are counted as ``"other"``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from django.core.exceptions import ImproperlyConfigured

from .prometheus_tallies import Tallies, TalliesCollector
from .settings import tokenbucket_settings

logger = logging.getLogger("django_tokenbucket")

# Optional: each is needed only by the recorder of its name (``manage.py check``: E050).
try:
    import prometheus_client
except ImportError:  # pragma: no cover - depends on the installation
    prometheus_client = None  # type: ignore[assignment]
try:
    from opentelemetry import metrics as opentelemetry_metrics
except ImportError:  # pragma: no cover - depends on the installation
    opentelemetry_metrics = None  # type: ignore[assignment]

__all__ = [
    "KINDS",
    "MAX_LIMIT_LABELS",
    "OUTCOMES",
    "RESERVATION_EVENTS",
    "PrometheusRecorder",
    "Recorder",
    "StoreFailures",
    "TalliedPrometheusRecorder",
    "active",
    "after_fork_in_child",
    "count_reservations",
    "error_label",
    "metrics_problem",
    "settings_changed",
    "store_failures",
]

#: The values ``TOKENBUCKET["METRICS"]`` takes, and the package each one needs.
KINDS = {"prometheus": "prometheus_client", "opentelemetry": "opentelemetry"}

ALLOWED = "allowed"
DENIED = "denied"
DENIED_CACHED = "denied_cached"
SHADOW_DENIED = "shadow_denied"
FAILED_OPEN = "failed_open"
FAILED_CLOSED = "failed_closed"
EXEMPT = "exempt"
BLOCKED = "blocked"
#: Every ``outcome`` of a decision that was applied: allowed (every limit of the call
#: let it through), denied (this limit refused it), shadow_denied (a shadow limit would
#: have), failed_open and failed_closed (the store failed, and ``FAIL_OPEN`` said so),
#: denied_cached (this limit refused it from this process' memory, the store unasked:
#: ``django_tokenbucket.deny_cache``), exempt and blocked (a runtime override let it
#: through or refused it, the store unasked: ``django_tokenbucket.overrides``). A limit
#: of an all-or-nothing call that another limit refused took nothing and is not counted.
OUTCOMES = (ALLOWED, DENIED, DENIED_CACHED, SHADOW_DENIED, FAILED_OPEN, FAILED_CLOSED, EXEMPT, BLOCKED)
#: Every ``event`` of a scheduled reservation (``django_tokenbucket.celery``): made
#: (counted when its transaction commits), its work started, tokens given back (by
#: ``refund()`` or ``refund_on_failure``), cancelled before it ran, given up by the sweeper.
RESERVATION_EVENTS = ("scheduled", "ran", "refunded", "cancelled", "expired")

#: Distinct limit names given a label of their own; the rest are ``"other"``.
MAX_LIMIT_LABELS = 1000
OTHER = "other"

#: Seconds: from a fast Redis decision (~0.1 ms) to a store at its TIMEOUT.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

DECISIONS_HELP = "Rate-limit decisions applied, by outcome."
DECISION_LABELS = ["limit", "backend", "outcome"]
SECONDS_HELP = "Time spent in the rate-limit store per decision."
ERRORS_HELP = "Rate-limit store failures."
RESERVATIONS_HELP = "Scheduled reservations, by event."


class Recorder(Protocol):
    """Where the limiter's figures go; ``active()`` returns the configured one."""

    def decision(self, limit: str, backend: str, outcome: str) -> None: ...

    def store_error(self, backend: str, error: str) -> None: ...

    def store_seconds(self, backend: str, seconds: float) -> None: ...

    def reservation(self, event: str, count: int = 1) -> None: ...


class _LimitLabels:
    """Limit names as labels: each name itself, up to a bound, then ``"other"``."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str) -> str:
        if name in self._seen:
            return name
        with self._lock:
            if len(self._seen) >= MAX_LIMIT_LABELS:
                return OTHER
            self._seen.add(name)
        return name


class _Labelled:
    """A Prometheus metric's labelled children, kept: ``labels()`` costs more than the increment."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> Any:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self._metric.labels(*labels)
        return child


class _PrometheusFigures:
    """What both Prometheus recorders count the same way: store errors and reservations,
    rare, through ``prometheus_client``'s own labelled children."""

    def __init__(self, registry: Any = None) -> None:
        self.registry = registry or prometheus_client.REGISTRY
        Counter = partial(prometheus_client.Counter, registry=self.registry)
        self._errors = _Labelled(Counter("tokenbucket_store_errors", ERRORS_HELP, ["backend", "error"]))
        self._reservations = _Labelled(Counter("tokenbucket_reservations", RESERVATIONS_HELP, ["event"]))
        self._limit_label = _LimitLabels()

    def _decision_labels(self, decision: tuple[str, ...]) -> tuple[str, ...]:
        """The labels of a decision's ``(limit, backend, outcome)``: the limit's name
        bounded (``_LimitLabels``). Asked only for a combination not seen before, or
        for a name past the bound."""
        limit, backend, outcome = decision
        return (self._limit_label(limit), backend, outcome)

    def store_error(self, backend: str, error: str) -> None:
        self._errors(backend, error).inc()

    def reservation(self, event: str, count: int = 1) -> None:
        self._reservations(event).inc(count)


class PrometheusRecorder(_PrometheusFigures):
    """Counters and a histogram in ``prometheus_client``'s default registry, every figure
    through its own labelled children: what its multiprocess mode needs, since there every
    value lives in the process' file, not in memory.

    Made once per process (the registry refuses a second metric of the same name). In
    a multiprocess server (Gunicorn, uWSGI), set ``PROMETHEUS_MULTIPROC_DIR`` before the
    workers start: each then writes its own file, and
    ``prometheus_client.multiprocess.MultiProcessCollector`` sums them (docs/operations.md).
    """

    def __init__(self, registry: Any = None) -> None:
        super().__init__(registry)
        Counter = partial(prometheus_client.Counter, registry=self.registry)
        Histogram = partial(prometheus_client.Histogram, registry=self.registry, buckets=BUCKETS)
        self._decisions = _Labelled(Counter("tokenbucket_decisions", DECISIONS_HELP, DECISION_LABELS))
        self._seconds = _Labelled(Histogram("tokenbucket_decision_seconds", SECONDS_HELP, ["backend"]))
        # Each figure's child kept, by what it is asked with: a child's lookup (the
        # metric's lock, then its dict) costs as much as its increment.
        self._count_decision: dict[tuple[str, str, str], Callable[[], None]] = {}
        self._observe_seconds: dict[str, Callable[[float], None]] = {}

    def decision(self, limit: str, backend: str, outcome: str) -> None:
        count = self._count_decision.get((limit, backend, outcome))
        if count is None:
            labels = self._decision_labels((limit, backend, outcome))
            count = self._decisions(*labels).inc
            if labels[0] == limit:  # names past the bound are not kept, however many come
                self._count_decision[(limit, backend, outcome)] = count
        count()

    def store_seconds(self, backend: str, seconds: float) -> None:
        observe = self._observe_seconds.get(backend)
        if observe is None:
            observe = self._observe_seconds[backend] = self._seconds(backend).observe
        observe(seconds)


class TalliedPrometheusRecorder(_PrometheusFigures):
    """The same families, with decisions and store times tallied per thread without a
    lock and summed at scrape (``django_tokenbucket.prometheus_tallies``): ~1 µs a
    decision less than the children's two locked calls. Outside the multiprocess mode."""

    def __init__(self, registry: Any = None) -> None:
        super().__init__(registry)
        self._tallies = Tallies(BUCKETS, labels_of=self._decision_labels)
        self.registry.register(
            TalliesCollector(
                self._tallies,
                counter=("tokenbucket_decisions", DECISIONS_HELP, DECISION_LABELS),
                histogram=("tokenbucket_decision_seconds", SECONDS_HELP, ["backend"]),
            )
        )

    def decision(self, limit: str, backend: str, outcome: str) -> None:
        self._tallies.count((limit, backend, outcome))

    def store_seconds(self, backend: str, seconds: float) -> None:
        self._tallies.observe(backend, seconds)


def prometheus_recorder(registry: Any = None) -> PrometheusRecorder | TalliedPrometheusRecorder:
    """The Prometheus recorder for this process: tallied, unless ``prometheus_client`` is
    in its multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set, read as it reads it); with
    a warning when this process is a worker of a multiprocess server outside that mode."""
    multiprocess = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
    if multiprocess:
        return PrometheusRecorder(registry)
    server = multiprocess_server()
    if server is not None:
        logger.warning(
            "TOKENBUCKET['METRICS'] = 'prometheus' in %s without PROMETHEUS_MULTIPROC_DIR: each worker "
            "process counts on its own, so a scrape of /metrics sees the counts of whichever worker "
            "answers it, and the counters seem to jump back and forth; set PROMETHEUS_MULTIPROC_DIR "
            "(docs/operations.md, 'Metrics')",
            server,
        )
    return TalliedPrometheusRecorder(registry)


def multiprocess_server() -> str | None:
    """Name the server of several worker processes this process is a worker of, if any.

    What each leaves in its workers: Gunicorn its worker classes (imported by the arbiter
    before it forks them), uWSGI its ``uwsgi`` module with the number of processes.
    """
    uwsgi = sys.modules.get("uwsgi")
    if uwsgi is not None and getattr(uwsgi, "numproc", 1) > 1:
        return f"a uWSGI worker ({uwsgi.numproc} processes)"
    if "gunicorn.workers.base" in sys.modules:
        return "a Gunicorn worker"
    return None


class OpenTelemetryRecorder:
    """The same instruments from the application's meter provider (``opentelemetry-api``).

    Without a provider configured, the API's no-op meter records nothing; one set later
    is picked up by the API's proxy meter.
    """

    def __init__(self) -> None:
        meter = opentelemetry_metrics.get_meter("django_tokenbucket")
        self._decisions = meter.create_counter(
            "tokenbucket.decisions", unit="{decision}", description=DECISIONS_HELP
        )
        self._errors = meter.create_counter(
            "tokenbucket.store_errors", unit="{error}", description=ERRORS_HELP
        )
        self._seconds = meter.create_histogram(
            "tokenbucket.decision.duration", unit="s", description=SECONDS_HELP
        )
        self._reservations = meter.create_counter(
            "tokenbucket.reservations", unit="{reservation}", description=RESERVATIONS_HELP
        )
        self._limit_label = _LimitLabels()

    def decision(self, limit: str, backend: str, outcome: str) -> None:
        self._decisions.add(1, {"limit": self._limit_label(limit), "backend": backend, "outcome": outcome})

    def store_error(self, backend: str, error: str) -> None:
        self._errors.add(1, {"backend": backend, "error": error})

    def store_seconds(self, backend: str, seconds: float) -> None:
        self._seconds.record(seconds, {"backend": backend})

    def reservation(self, event: str, count: int = 1) -> None:
        self._reservations.add(count, {"event": event})


#: One recorder of each kind per process: their instruments are registered once.
_made: dict[str, Recorder] = {}
_made_lock = threading.Lock()
_active: Recorder | None = None
_loaded = False


def active() -> Recorder | None:
    """Return the recorder ``TOKENBUCKET["METRICS"]`` asks for, or None when metrics are off.

    Read once and again after the setting changes. An unknown value or a missing
    package is reported by ``manage.py check`` (E050) and raises here.
    """
    if _loaded:
        return _active
    return _load()


def _load() -> Recorder | None:
    global _active, _loaded
    kind = tokenbucket_settings.METRICS
    recorder: Recorder | None = None
    if kind is not None:
        problem = metrics_problem(kind)
        if problem is not None:
            raise ImproperlyConfigured(f"TOKENBUCKET['METRICS'] {problem}")
        with _made_lock:
            if kind not in _made:
                _made[kind] = prometheus_recorder() if kind == "prometheus" else OpenTelemetryRecorder()
            recorder = _made[kind]
    _active, _loaded = recorder, True
    return recorder


def count_reservations(event: str, count: int = 1) -> None:
    """Count ``count`` reservations reaching ``event`` (one of ``RESERVATION_EVENTS``), when metrics are on."""
    recorder = active()
    if recorder is not None and count:
        recorder.reservation(event, count)


def metrics_problem(kind: object) -> str | None:
    """What is wrong with ``TOKENBUCKET["METRICS"] = kind``, or None (for the checks too)."""
    if kind is None:
        return None
    if kind not in KINDS:
        return f"must be None, 'prometheus' or 'opentelemetry', not {kind!r}"
    installed = prometheus_client if kind == "prometheus" else opentelemetry_metrics
    if installed is None:
        return f"= {kind!r} needs {KINDS[kind]}: pip install 'dj-tokenbucket[{kind}]'"
    return None


class StoreFailures:
    """The store failures this process has seen, by backend, kept whether ``METRICS`` is
    on or not: the admin shows them (a process' own, as its deny cache)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: backend label -> (failures, the last one's error label, when: time.time())
        self._seen: dict[str, tuple[int, str, float]] = {}

    def note(self, backend: str, error: str) -> None:
        """Count one failure of ``backend`` (an alias, or a limiter's own backend class)."""
        with self._lock:
            count = self._seen.get(backend, (0, "", 0.0))[0]
            self._seen[backend] = (count + 1, error, time.time())

    def seen(self) -> dict[str, tuple[int, str, float]]:
        """Return backend -> (failures since this process started, the last error, when)."""
        with self._lock:
            return dict(self._seen)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()


#: This process' store failures (``engine.failure`` notes each one).
store_failures = StoreFailures()


def error_label(exc: BaseException) -> str:
    """The ``error`` label of a store failure: the class of what the store raised."""
    cause = exc.__cause__ or exc
    return type(cause).__name__


def settings_changed() -> None:
    """Read ``METRICS`` again at the next figure (``django_tokenbucket.lifecycle``)."""
    global _loaded
    _loaded = False


def after_fork_in_child() -> None:
    """Give a forked child the recorder's lock of its own (``django_tokenbucket.lifecycle``)."""
    global _made_lock
    # The parent's lock may have been held by another thread at the fork.
    _made_lock = threading.Lock()
