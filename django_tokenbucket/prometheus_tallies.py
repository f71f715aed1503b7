"""A counter and a histogram that each thread adds to without a lock, read by Prometheus.

``TOKENBUCKET["METRICS"] = "prometheus"`` counts every decision and observes its store
time. Through ``prometheus_client``'s labelled children, that is two calls that each take
a lock and check their arguments. Here a thread adds to dicts only it writes, and the
registry sums them when it is read (a scrape); docs/benchmarks.md ("Where the time
goes") gives what each costs a decision, in instructions and in µs.

Walled off: this module reads no private name of ``prometheus_client``. What a scrape
shows is built with its documented custom-collector API (``CounterMetricFamily``,
``HistogramMetricFamily``) and formatted by its own exposition; the histogram's ``le``
labels and whether ``_created`` series are on are asked of a ``Histogram`` of its own,
made for the purpose, so a scrape reads as the children's would (tests/test_metrics.py
compares the two). Not for ``prometheus_client``'s multiprocess mode, where values live
in each process' file and another process reads them: ``metrics`` keeps the children
there.
"""

from __future__ import annotations

import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
except ImportError:  # pragma: no cover - metrics_problem() says so before anything is made here
    prometheus_client = None  # type: ignore[assignment]

__all__ = ["SWEEP_AT", "Tallies", "TalliesCollector", "after_fork_in_child"]

#: Threads' tallies kept before the first sweep for ended ones (then twice those left running).
SWEEP_AT = 64

Labels = tuple[str, ...]


def _themselves(key: Labels) -> Labels:
    return key


class _ThreadTally:
    """What one thread added: counts by labels, and per series of the histogram the
    bucket counts (one per bound, then +Inf) followed by the sum of the values."""

    __slots__ = ("counts", "histograms", "thread")

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.counts: dict[Labels, int] = {}
        self.histograms: dict[str, list[float]] = {}


#: Every Tallies of this process, for the fork reset.
_every: weakref.WeakSet[Tallies] = weakref.WeakSet()


class Tallies:
    """Counts and histogram observations, kept per thread and summed on ``read()``.

    Only its own thread writes a tally; a reader copies each dict and list whole (one C
    call, atomic under the GIL), so it sees each count made before it, never half of an
    increment. A histogram's bucket and its sum are two additions, so a read may see one
    observation's bucket without its value in the sum, as ``prometheus_client``'s
    children (a lock for each) may too; the next read has both. A thread's tally is
    folded into the ended threads' sum once the thread has ended, on a read or when
    tallies pile up (a server making a thread per request, and nobody reading): it is
    kept as long as a live thread may still write it.

    A count is asked by a key, and kept under ``labels_of(key)``, which is asked at a
    thread's first count of the key: a key whose labels are itself is then counted
    with one addition; any other (a name past a bound on labels) asks each time, so that
    no key outside the bound is kept.
    """

    def __init__(self, bounds: Sequence[float], labels_of: Callable[[Labels], Labels] = _themselves) -> None:
        self.bounds = tuple(bounds)
        self._labels_of = labels_of
        #: labels -> when this process first counted them (the ``_created`` samples).
        self.counts_created: dict[Labels, float] = {}
        self.histograms_created: dict[str, float] = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._threads: list[_ThreadTally] = []
        self._ended = _ThreadTally(threading.current_thread())
        self._sweep_at = SWEEP_AT
        _every.add(self)

    def count(self, key: Labels) -> None:
        """Add one to the count of ``key``'s labels (``labels_of(key)``)."""
        try:
            counts = self._local.counts
        except AttributeError:
            counts = self._join().counts
        try:
            counts[key] += 1
        except KeyError:  # this thread's first count of the key, or a key not counted as itself
            labels = self._labels_of(key)
            if labels != key:
                # Not kept by its own key (the label rule may bound what it keeps), so
                # every count of it comes here.
                key = labels
                if key in counts:
                    counts[key] += 1
                    return
            self.counts_created.setdefault(key, time.time())
            counts[key] = 1

    def observe(self, label: str, value: float) -> None:
        """Put ``value`` in the histogram of ``label`` (the histogram has one label)."""
        try:
            histograms = self._local.histograms
        except AttributeError:
            histograms = self._join().histograms
        histogram = histograms.get(label)
        if histogram is None:
            self.histograms_created.setdefault(label, time.time())
            histogram = histograms[label] = self._empty_histogram()
        # The first bound at or above the value: Prometheus' buckets hold "le" (<=).
        histogram[bisect_left(self.bounds, value)] += 1
        histogram[-1] += value

    def read(self) -> tuple[dict[Labels, int], dict[str, list[float]]]:
        """Return the counts, and the histograms' bucket counts and sums, of every thread so far."""
        with self._lock:
            self._fold_ended()
            counts = dict(self._ended.counts)
            histograms = {label: list(h) for label, h in self._ended.histograms.items()}
            for tally in self._threads:
                self._add(counts, histograms, tally)
        return counts, histograms

    def threads_kept(self) -> int:
        """How many threads' tallies are kept apart from the ended threads' sum."""
        return len(self._threads)

    def after_fork_in_child(self) -> None:
        # The parent's threads did not come along (their tallies fold into the sum at the
        # next read), and its lock may have been held by one of them.
        self._lock = threading.Lock()

    def _join(self) -> _ThreadTally:
        """Return the calling thread's tally, made now (the thread's first addition)."""
        tally = _ThreadTally(threading.current_thread())
        with self._lock:
            self._threads.append(tally)
            if len(self._threads) >= self._sweep_at:
                self._fold_ended()
                self._sweep_at = max(SWEEP_AT, 2 * len(self._threads))
        self._local.counts, self._local.histograms = tally.counts, tally.histograms
        return tally

    def _fold_ended(self) -> None:
        running = []
        for tally in self._threads:
            # Whether the thread ended is asked before its tally is read: read after, it
            # could miss what the thread wrote between the two.
            if tally.thread.is_alive():
                running.append(tally)
            else:
                self._add(self._ended.counts, self._ended.histograms, tally)
        self._threads = running

    def _add(self, counts: dict[Labels, int], histograms: dict[str, list[float]], tally: _ThreadTally) -> None:
        for labels, count in tally.counts.copy().items():
            counts[labels] = counts.get(labels, 0) + count
        for label, histogram in tally.histograms.copy().items():
            total = histograms.setdefault(label, self._empty_histogram())
            for i, value in enumerate(list(histogram)):
                total[i] += value

    def _empty_histogram(self) -> list[float]:
        return [0.0] * (len(self.bounds) + 2)  # a count per bound and +Inf, then the sum


class TalliesCollector:
    """Shows ``tallies`` in a ``prometheus_client`` registry as the labelled children of a
    ``Counter`` named ``counter`` and of a ``Histogram`` named ``histogram`` would be."""

    def __init__(
        self,
        tallies: Tallies,
        counter: tuple[str, str, Sequence[str]],
        histogram: tuple[str, str, Sequence[str]],
    ) -> None:
        self._tallies = tallies
        self._counter = counter
        self._histogram = histogram
        self._bound_labels = [labels["le"] for labels, _created in _histogram_probe(tallies.bounds)]

    def describe(self) -> list[Any]:
        # The names the registry checks for clashes, without reading the tallies.
        return self._families()

    def collect(self) -> Iterable[Any]:
        counter, histogram = self._families()
        counts, histograms = self._tallies.read()
        with_created = _created_series_on()
        # In the order each series was first counted, as the children are shown.
        for labels, created_at in list(self._tallies.counts_created.items()):
            if labels in counts:
                counter.add_metric(labels, float(counts[labels]), created=created_at if with_created else None)
        histogram_name, _help, (label_name,) = self._histogram
        for label, created_at in list(self._tallies.histograms_created.items()):
            values = histograms.get(label)
            if values is None:
                continue
            buckets, running = [], 0.0
            for bound_label, in_bucket in zip(self._bound_labels, values):
                running += in_bucket
                buckets.append((bound_label, running))
            histogram.add_metric([label], buckets, values[-1])
            if with_created:
                histogram.add_sample(f"{histogram_name}_created", {label_name: label}, created_at)
        return [counter, histogram]

    def _families(self) -> list[Any]:
        name, documentation, labels = self._counter
        counter = CounterMetricFamily(name, documentation, labels=labels)
        name, documentation, labels = self._histogram
        return [counter, HistogramMetricFamily(name, documentation, labels=labels)]


def _histogram_probe(bounds: Sequence[float]) -> list[tuple[dict[str, str], bool]]:
    """The ``_bucket`` samples' labels of a ``prometheus_client`` histogram with these
    bounds, in order, each with whether the histogram had a ``_created`` sample."""
    probe = prometheus_client.Histogram("tokenbucket_probe", "", buckets=bounds, registry=None)
    samples = [sample for family in probe.collect() for sample in family.samples]
    created = any(sample.name.endswith("_created") for sample in samples)
    return [(sample.labels, created) for sample in samples if sample.name.endswith("_bucket")]


def _created_series_on() -> bool:
    """Whether ``prometheus_client`` writes ``_created`` series now: its
    ``PROMETHEUS_DISABLE_CREATED_SERIES`` and ``disable_created_metrics()`` say, and a
    histogram of its own shows which, on every scrape (it may change at run time)."""
    return _histogram_probe((1.0,))[0][1]


def after_fork_in_child() -> None:
    """Give each ``Tallies`` of a forked child a lock of its own (``django_tokenbucket.lifecycle``)."""
    for tallies in list(_every):
        tallies.after_fork_in_child()
