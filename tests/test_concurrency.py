"""Exactness with several OS processes on one hot key (RELIABILITY-PLAN H1, H2, H3, H5).

Each test runs on the env's database (SQLite with IMMEDIATE transactions, PostgreSQL
READ COMMITTED, MariaDB) and, on PostgreSQL, again under SERIALIZABLE, where the
limiter retries serialization failures itself. Figures are printed at the end of the run.
"""

from __future__ import annotations

from functools import partial

import pytest
from django.conf import settings
from django.db import connections, transaction
from django.test import override_settings

from django_tokenbucket import LimitRequest, limiter
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock

from .concurrency import hammer, run_processes, summarise
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True, databases="__all__")]

PROCESSES = 8
ALIASES = ["default"] + [alias for alias in ("serializable", "repeatable_read") if alias in settings.DATABASES]
ISOLATION = {
    ("postgres", "default"): "READ COMMITTED",
    ("postgres", "serializable"): "SERIALIZABLE",
    ("mariadb", "default"): "READ COMMITTED (Django's default)",
    ("mariadb", "repeatable_read"): "REPEATABLE READ (InnoDB's default)",
    ("sqlite", "default"): "IMMEDIATE, WAL",
}


_ISOLATION_SQL = {
    "postgres": "SHOW transaction_isolation",
    "mariadb": "SELECT @@SESSION.tx_isolation",
}


@pytest.fixture(params=ALIASES)
def alias(request):
    if settings.DB in _ISOLATION_SQL:
        # The figures must describe the isolation level that really ran.
        # Inside a transaction: psycopg sets the level per transaction, not per session.
        with transaction.atomic(using=request.param), connections[request.param].cursor() as cursor:
            cursor.execute(_ISOLATION_SQL[settings.DB])
            actual = cursor.fetchone()[0].replace("-", " ").upper()
        assert ISOLATION[(settings.DB, request.param)].startswith(actual), actual
    options = {"DATABASE": request.param}
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "OPTIONS": options}):
        yield request.param


def run_info(alias: str, case: str, **extra):
    return {"case": case, "backend": settings.DB, "isolation": ISOLATION[(settings.DB, alias)], **extra}


def rows(name: str, alias: str) -> int:
    return RateLimit.objects.using(alias).filter(name=name).count()


def test_h1_exact_with_a_frozen_clock(alias):
    """Refill contributes nothing, so exactly the capacity is admitted: 100 of 400."""
    config = {"rate": 100, "period": 3600}
    call = partial(limiter.limit, "h1", "hot", config=config)
    with frozen_clock(1_700_000_000):
        results = run_processes(hammer, PROCESSES, call, 50, None)
        assert limiter.get_value("h1", "hot", config=config) == 0
    figures = summarise(results, **run_info(alias, "H1", C=100))
    assert figures["surfaced_errors"] == 0, figures["error_samples"]
    assert figures["attempts"] == PROCESSES * 50
    assert figures["admitted"] == 100
    assert rows("h1", alias) == 1


def test_h2_bound_with_the_real_clock(alias):
    """admitted <= C + r·Δ, Δ measured on the store's clock, and >= 90 % of it."""
    capacity, rate = 20, 10
    config = {"rate": rate, "period": 1, "capacity": capacity}
    call = partial(limiter.limit, "h2", "hot", config=config)
    results = run_processes(hammer, PROCESSES, call, None, 3.0)
    figures = summarise(results, **run_info(alias, "H2", C=capacity, r=rate, M_s=3.0))
    bound = capacity + rate * figures["store_clock_span_s"]
    figures.update(bound=round(bound, 3), excess=round(figures["admitted"] - bound, 3))
    figures["utilisation"] = round(figures["admitted"] / bound, 4)
    assert figures["surfaced_errors"] == 0, figures["error_samples"]
    assert figures["admitted"] <= bound + 1e-6
    assert figures["admitted"] >= 0.9 * bound, figures
    assert rows("h2", alias) == 1


def test_h3_creation_race_makes_one_row(alias):
    """Every process's first call is on a key nobody used: one row, no IntegrityError."""
    config = {"rate": 3, "period": 3600}
    call = partial(limiter.limit, "h3", "new-key", config=config)
    with frozen_clock(1_700_000_000):
        results = run_processes(hammer, PROCESSES, call, 1, None)
    figures = summarise(results, **run_info(alias, "H3", C=3))
    assert figures["surfaced_errors"] == 0, figures["error_samples"]
    assert figures["admitted"] == 3
    assert rows("h3", alias) == 1


def test_h5_all_or_nothing_under_contention(alias):
    """A denial by the tight limit never consumes from the loose one."""
    loose = {"rate": 1000, "period": 3600}
    tight = {"rate": 10, "period": 3600}
    requests = [LimitRequest("h5-loose", "k", config=loose), LimitRequest("h5-tight", "k", config=tight)]
    call = partial(limiter.limit_many, requests)
    with frozen_clock(1_700_000_000):
        results = run_processes(hammer, 6, call, 30, None)
        figures = summarise(results, **run_info(alias, "H5"))
        assert figures["surfaced_errors"] == 0, figures["error_samples"]
        assert figures["admitted"] == 10
        assert limiter.get_value("h5-loose", "k", config=loose) == 990
        assert limiter.get_value("h5-tight", "k", config=tight) == 0
