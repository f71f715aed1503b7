"""Every copy of the algorithms (``algorithms.PORTS``) named, present and replayed.

The script and the SQL must have a branch for every kind of ``ALGORITHMS``, and the
table must be true to the files it names. Then the two ports that the parity tests of
tests/test_redis.py and tests/test_pg_fast_path.py do not replay: the ORM filter that
classifies rows (``backends.database.filters``), on every database the run uses, and the Redis refund.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import replace
from importlib import resources
from itertools import pairwise
from pathlib import Path

import pytest
from django.test import override_settings
from hypothesis import event, given, settings

from django_tokenbucket.algorithms import ALGORITHMS, MAX_AMOUNT, PORTS, TOKEN_BUCKET, Algorithm, Port, State
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import Request
from django_tokenbucket.backends.database import DatabaseBackend
from django_tokenbucket.backends.database.filters import count_by_state, state_q
from django_tokenbucket.backends.database.postgresql import FUNCTION_VERSION
from django_tokenbucket.backends.redis import RedisBackend
from django_tokenbucket.limits import FIXED_WINDOW, LimitConfig
from django_tokenbucket.live import FULL, LIMITED, PARTIAL, STATES, live_state
from django_tokenbucket.models import RateLimit

from . import parity
from .concurrency import sized
from .redis_servers import delete_keys
from .settings import TOKENBUCKET as BASE_SETTINGS

PACKAGE = resources.files("django_tokenbucket")
TESTS = Path(__file__).parent
OPERATIONS = {"decide", "refund", "classify"}

# ---------------------------------------------------------------------------------------
# The script and the SQL have a branch for every kind, and PORTS is true
# ---------------------------------------------------------------------------------------

_LUA_HEADING = re.compile(r"^-- (\S.*?) -{3,}$", re.MULTILINE)
_SQL_FUNCTION = re.compile(r"^CREATE OR REPLACE FUNCTION (\w+)\(", re.MULTILINE)
_COMMENT = re.compile(r"--[^\n]*")
#: How the script and the SQL name a kind's code where they dispatch on it.
_LUA_BRANCH = re.compile(r"\bkind\s*==\s*\"([^\"]*)\"")
_SQL_BRANCH = re.compile(r"\bkind\s*=\s*'([^']*)'")


def part_of(port: Port) -> str:
    """Return the text of ``port.part`` in ``port.path``: a section of the script (to the
    next heading), a SQL function (to the next one), or a Python class or function."""
    text = PACKAGE.joinpath(port.path).read_text(encoding="utf-8")
    if port.path.endswith((".lua", ".sql")):
        pattern = _LUA_HEADING if port.path.endswith(".lua") else _SQL_FUNCTION
        starts = [(m.group(1), m.start()) for m in pattern.finditer(text)] + [("", len(text))]
        for (name, start), (_, end) in pairwise(starts):
            if name == port.part:
                return text[start:end]
    else:
        for node in ast.parse(text).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == port.part:
                segment = ast.get_source_segment(text, node)
                assert segment is not None
                return segment
    raise AssertionError(f"{port.path} has no {port.part!r}")


def unported(algorithms: Mapping[str, Algorithm]) -> list[str]:
    """Return what the script and the SQL lack for ``algorithms``: one line per missing branch.

    The script names every code it decides (a code it does not know goes to the general
    path, which refuses it). Each SQL function names all codes but one, which its final
    ELSE decides: a second kind left unnamed would be decided as that one.
    """
    codes = {algorithm.code: name for name, algorithm in algorithms.items()}
    problems = []
    for port in PORTS:
        if port.gate or not port.path.endswith((".lua", ".sql")):
            continue
        lua = port.path.endswith(".lua")
        code = _COMMENT.sub("", part_of(port))
        named = set((_LUA_BRANCH if lua else _SQL_BRANCH).findall(code))
        where = f"{port.path} ({port.part})"
        problems += [f"{where} has a branch for {c!r}, which no kind has" for c in sorted(named - set(codes))]
        unnamed = [f"{name!r} ({c!r})" for c, name in codes.items() if c not in named]
        if lua and unnamed:
            problems.append(f"{where} has no branch for {', '.join(unnamed)}")
        elif len(unnamed) > 1:
            problems.append(f"{where} has no branch for {', '.join(unnamed)}: its ELSE can decide one kind only")
    return problems


def undeclared(algorithms: Mapping[str, Algorithm]) -> list[str]:
    """Return the ports that every kind reaches (no ``gate``) but that do not declare a kind."""
    return [
        f"{port.path} ({port.part}) does not declare {name!r}"
        for port in PORTS
        if not port.gate
        for name in algorithms
        if name not in port.kinds
    ]


def test_the_script_and_the_sql_have_a_branch_for_every_kind():
    assert len({algorithm.code for algorithm in ALGORITHMS.values()}) == len(ALGORITHMS)
    assert unported(ALGORITHMS) == []


def test_every_port_that_every_kind_reaches_declares_every_kind():
    assert undeclared(ALGORITHMS) == []


def sliding_log() -> dict[str, Algorithm]:
    """ALGORITHMS with a kind that no port implements (its arithmetic is a token bucket's)."""
    fake = replace(ALGORITHMS[TOKEN_BUCKET], name="sliding log", aliases=(), code="s")
    return {**ALGORITHMS, fake.name: fake}


def test_a_kind_without_a_branch_in_the_script_or_the_sql_is_reported():
    assert unported(sliding_log()) == [
        "backends/redis/lua/decide.lua (The common path) has no branch for 'sliding log' ('s')",
        "backends/redis/lua/decide.lua (The general path) has no branch for 'sliding log' ('s')",
        "backends/database/sql/postgresql_v3.sql (django_tokenbucket_single_v3) has no branch for 'fixed window' ('f'), "
        "'sliding log' ('s'): its ELSE can decide one kind only",
        "backends/database/sql/postgresql_v3.sql (django_tokenbucket_step_v3) has no branch for 'token bucket' ('t'), "
        "'sliding log' ('s'): its ELSE can decide one kind only",
    ]
    assert undeclared(sliding_log()) == [
        f"{port.path} ({port.part}) does not declare 'sliding log'" for port in PORTS if not port.gate
    ]


def test_a_branch_for_a_kind_that_is_gone_is_reported():
    without_windows = {name: a for name, a in ALGORITHMS.items() if a.code != "f"}
    assert unported(without_windows) == [
        "backends/redis/lua/decide.lua (The common path) has a branch for 'f', which no kind has",
        "backends/redis/lua/decide.lua (The general path) has a branch for 'f', which no kind has",
        "backends/database/sql/postgresql_v3.sql (django_tokenbucket_step_v3) has a branch for 'f', which no kind has",
    ]


@pytest.mark.parametrize("port", PORTS, ids=lambda port: port.part)
def test_the_table_of_ports_is_true(port: Port):
    """Each part exists where it is said to, implements known kinds and operations, and is
    replayed by tests that exist; a gate sends exactly the declared kinds."""
    assert part_of(port)
    assert port.kinds and set(port.kinds) <= set(ALGORITHMS)
    assert port.operations and set(port.operations) <= OPERATIONS
    for test in port.replayed_by:
        module, _, name = test.partition("::")
        assert module.startswith("tests/") and re.search(
            rf"^def {name}\(", (TESTS / module.removeprefix("tests/")).read_text(encoding="utf-8"), re.MULTILINE
        ), f"{test} does not exist"
    if port.gate:
        assert port.gate in PACKAGE.joinpath(port.path).read_text(encoding="utf-8")
        assert set(re.findall(r"\"([^\"]*)\"", port.gate)) == {ALGORITHMS[name].code for name in port.kinds}


def test_the_ports_that_every_kind_reaches_are_those_the_backends_run():
    """The script, the SQL the code calls (its version) and the filter: none left out of
    the checks above."""
    assert {port.path for port in PORTS if not port.gate} == {
        "backends/redis/lua/decide.lua",
        f"backends/database/sql/postgresql_v{FUNCTION_VERSION}.sql",
        "backends/database/filters.py",
    }


# ---------------------------------------------------------------------------------------
# The ORM filter: rows a store wrote, classified in SQL as live_state classifies them
# ---------------------------------------------------------------------------------------


def assert_classified_alike(configs: list[LimitConfig], now: int, note=lambda label: None) -> None:
    """Every row of ``configs`` is in the same state by ``state_q`` and ``count_by_state``
    (in SQL) as by ``live_state`` (Python) at ``now``."""
    by_name = {config.name: config for config in configs}
    rows = list(RateLimit.objects.values_list("pk", "name", "key", "value", "ts"))
    expected = {pk: live_state(by_name[name], State(value, ts), key, now).state for pk, name, key, value, ts in rows}
    for state in STATES:
        found = set(RateLimit.objects.filter(state_q(configs, state, now)).values_list("pk", flat=True))
        assert found == {pk for pk, s in expected.items() if s == state}, f"{state} at {now}: {rows}"
    names = {pk: name for pk, name, *_ in rows}
    counts: dict[str, dict[str, int]] = {}
    for pk, state in expected.items():
        row = counts.setdefault(names[pk], {"stored": 0, LIMITED: 0, PARTIAL: 0, FULL: 0})
        row["stored"] += 1
        row[state] += 1
        note(f"a row {state}")
    assert count_by_state(RateLimit.objects.all(), configs, now) == counts, f"at {now}: {rows}"


@pytest.fixture
def database_backend():
    with override_settings(TOKENBUCKET=BASE_SETTINGS):
        backend = get_backend()
        assert isinstance(backend, DatabaseBackend)
        yield backend


def replay_classified(backend: DatabaseBackend, start: int, trace, note=lambda label: None) -> None:
    """Replay ``trace`` through ``backend``, and classify every row after every step.

    Names must be distinct: a window stored under another period or start is read on its
    stored phase, and may be counted a window short (see ``backends.database.filters.at_least_q``).
    """
    configs = list({request.config for _, requests, _ in trace for request in requests})
    assert len({config.name for config in configs}) == len(configs)
    RateLimit.objects.all().delete()

    def decide(requests, apply):
        outcome = backend.decide(requests, apply=apply)
        assert_classified_alike(configs, outcome.now, note)
        return outcome

    def stored(request: Request) -> State | None:
        rows = RateLimit.objects.filter(name=request.config.name, key=request.key.digest).values_list("value", "ts")
        return State(*rows[0]) if rows else None

    parity.replay(decide, stored, start, trace)


@pytest.mark.django_db(transaction=True)
# Every step is a database round trip and a filtered COUNT per state: 400 traces took 22 s
# on SQLite alone, in each of the nine test envs. The nightly tier runs them all.
@settings(parent=parity.PARITY, max_examples=sized(120, 400))
@given(parity.traces(distinct_names=True))
def test_the_orm_filter_classifies_replayed_rows_as_live_state_does(database_backend, case):
    """After every step of a trace through the database backend, at its pinned time."""
    replay_classified(database_backend, *case, note=event)


def window_read_past_2_53() -> list:
    """A window stored at 0 and read, without a write, 2^53 + 1 µs later (a multiple of its
    period) and around then: full only if the filter counts every window since, which a
    remainder taken in doubles (2^53 + 1 rounds to 2^53) does not."""
    window = parity._config(FIXED_WINDOW, rate=1, period=3, capacity=MAX_AMOUNT, start=0)
    read = [Request(window, parity.ALICE, 0)]
    return [
        (0, [Request(window, parity.ALICE, (2**53 + 1) // 3)], True),
        (2**53 + 1, read, False),
        (-1, read, False),
        (3, read, False),
    ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("config, trace", parity.BEYOND_53_BITS, ids=parity.BEYOND_53_BITS_IDS)
def test_the_orm_filter_classifies_rows_beyond_53_bits(database_backend, config, trace):
    replay_classified(database_backend, parity.T0_US, parity.beyond_53_bits_trace(config, trace))


@pytest.mark.django_db(transaction=True)
def test_the_orm_filter_counts_every_window_of_a_row_read_2_53_us_later(database_backend):
    replay_classified(database_backend, 0, window_read_past_2_53())


@pytest.mark.django_db(transaction=True)
def test_the_orm_filter_classifies_rows_at_the_clock_skew_tolerance(database_backend):
    replay_classified(database_backend, parity.T0_US, parity.clock_skew_trace())


# ---------------------------------------------------------------------------------------
# The Redis refund: the script's decision of -amount is algorithms' refund
# ---------------------------------------------------------------------------------------


@pytest.fixture
def redis_backend(redis_store):
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **redis_store}):
        backend = get_backend()
        assert isinstance(backend, RedisBackend)
        yield backend


@pytest.mark.redis
@parity.PARITY
@given(parity.refund_traces())
def test_a_redis_refund_leaves_the_state_of_the_python_refund(redis_backend, case):
    """Reports and stored states of refunds (and of the decisions around them) equal
    ``token_bucket_refund`` and ``fixed_window_refund``, on both paths of the script."""
    delete_keys()
    client = redis_backend.client()

    def stored(request: Request) -> State | None:
        key = redis_backend.key(request.config, request.key)
        raw = client.get(key)
        if raw is None:
            return None
        assert client.pttl(key) > 0, f"{key} has no TTL"
        value, ts = map(int, raw.split())
        # The script keeps a refund's value above the capacity, which every read caps.
        return State(min(value, request.config.capacity), ts)

    def refund(step: parity.Refund):
        event("a refund")
        return redis_backend.refund(step.config, step.key, step.amount)

    parity.replay(lambda requests, apply: redis_backend.decide(requests, apply=apply), stored, *case, refund=refund)
