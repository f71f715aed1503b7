"""Runtime overrides at scale (issue 47, "also measured"): after a change each process
reads the rows changed since its snapshot, not every override, and the snapshot is read
whole whenever it cannot be brought up to date (a flushed table counted again, cleanup
past it, a change by a version that counted nothing), never left wrong.

What a refresh reads is counted in rows the database returned, on real databases
(every one of TOKENBUCKET_TEST_DB); the changes come from other OS processes, as in
production. How long reads take is benchmarks/probes/overrides_refresh.py's business.
"""

from __future__ import annotations

import logging
import multiprocessing
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.db.backends.utils import CursorWrapper
from django.test import override_settings
from django.utils import timezone

from django_tokenbucket import limiter, overrides
from django_tokenbucket.cleanup import cleanup
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import LimitOverride, OverridesVersion, OverrideTombstone
from django_tokenbucket.override_operations import expire
from django_tokenbucket.overrides import rows as override_rows
from django_tokenbucket.overrides import snapshot as override_snapshot
from django_tokenbucket.testing import frozen_clock

from .concurrency import in_another_thread, run_processes
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.every_database

LIMITS = {"login": {"rate": 3, "period": 60}, "other": {"rate": 3, "period": 60}}
#: Long enough that nothing here refreshes unless a case asks (``overrides.invalidate``:
#: what MAX_AGE's passing does).
MAX_AGE = 600


@pytest.fixture
def overridable(transactional_db):
    tokenbucket = {**BASE_SETTINGS, "LIMITS": LIMITS, "OVERRIDES": {"MAX_AGE": MAX_AGE, "KEEP_EXPIRED": 0}}
    with override_settings(TOKENBUCKET=tokenbucket):
        yield


class Rollback(Exception):
    pass


def load(count: int) -> None:
    """Block ``count`` addresses for an hour, as one change (a penalty box's rows, written in bulk)."""
    until = timezone.now() + timedelta(hours=1)
    with transaction.atomic():
        revision = override_rows.bump(overrides.database_alias())
        LimitOverride.objects.bulk_create(
            [
                LimitOverride(
                    name="login", key=encode_key(("ip", i)).digest, action="block", expires_at=until, revision=revision
                )
                for i in range(count)
            ],
            batch_size=2000,
        )


@contextmanager
def rows_read() -> Iterator[dict[str, int]]:
    """Count the rows the database returns to the overrides' refreshes inside the block."""
    counted = {"rows": 0, "reads": 0}
    reading = {"now": False}
    real_read = override_snapshot._read

    def read() -> None:
        reading["now"] = True
        counted["reads"] += 1
        try:
            real_read()
        finally:
            reading["now"] = False

    def counting(method: str) -> Callable[..., object]:
        def fetch(self: CursorWrapper, *args: object) -> object:
            with self.db.wrap_database_errors:
                rows = getattr(self.cursor, method)(*args)
            if reading["now"]:
                counted["rows"] += (rows is not None) if method == "fetchone" else len(rows)
            return rows

        return fetch

    # Django's cursor hands these to the driver's through __getattr__: as attributes of
    # its class they see every row a query returns (the driver's own, unchanged).
    patched = ("fetchone", "fetchmany", "fetchall")
    for method in patched:
        setattr(CursorWrapper, method, counting(method))
    override_snapshot._read = read
    try:
        yield counted
    finally:
        override_snapshot._read = real_read
        for method in patched:
            delattr(CursorWrapper, method)


def in_another_process(change: Callable[[], object]) -> None:
    """Run ``change`` in a forked process of its own (its own connections), and wait for it."""
    connections.close_all()
    context = multiprocessing.get_context("fork")
    process = context.Process(target=_run, args=(change,))
    process.start()
    process.join(120)
    assert process.exitcode == 0, "the other process failed (its traceback is above)"


def _run(change: Callable[[], object]) -> None:
    try:
        change()
    finally:
        connections.close_all()


def decide(key: object, name: str = "login") -> str | None:
    """What this process applies to ``key`` now that MAX_AGE has passed."""
    overrides.invalidate()
    return limiter.check(name, key).override


# -- what a refresh reads ------------------------------------------------------------


def test_after_one_change_among_ten_thousand_a_refresh_reads_the_rows_changed(overridable):
    load(10_000)
    with rows_read() as first:
        assert limiter.check("login", ("ip", 7)).override == "block"
    assert first["rows"] >= 10_000, "the first read of a process is whole (and counted here)"

    in_another_process(lambda: limiter.block("login", "newcomer"))
    with rows_read() as after:
        assert decide("newcomer") == "block"
    # The version row and the one row changed: not the 10,000 in force.
    assert after == {"rows": 2, "reads": 1}

    in_another_process(lambda: limiter.clear_override("login", ("ip", 7)))
    with rows_read() as after:
        assert decide(("ip", 7)) is None
    assert after == {"rows": 2, "reads": 1}, "the version row and the tombstone"

    # Made here: this process reads it as the others do.
    limiter.exempt("login", ("ip", 8))
    with rows_read() as after:
        assert limiter.check("login", ("ip", 8)).override == "exempt"
    assert after == {"rows": 2, "reads": 1}
    assert len(override_snapshot._snapshot.keyed) == 10_000


def test_nothing_changed_reads_the_version_row_alone(overridable):
    load(1_000)
    limiter.check("login", "k")
    with rows_read() as after:
        assert decide(("ip", 3)) == "block"
    assert after == {"rows": 1, "reads": 1}


def test_a_rolled_back_change_is_read_again_by_its_key_and_its_revision_may_go_to_another(overridable):
    """Rolled back, a change's revision is the next writer's: a process that had counted
    it as read would miss that one. The key is read again, not the table."""
    load(1_000)
    limiter.check("login", "k")
    with pytest.raises(Rollback), transaction.atomic():
        limiter.block("login", "mistake")
        assert limiter.check("login", "mistake").override == "block"  # at once, here
        raise Rollback
    in_another_process(lambda: limiter.block("login", "next"))  # the same revision, committed
    with rows_read() as after:
        assert decide("mistake") is None
        assert decide("next") == "block"
    # The version row twice, "next"; the key rolled back, read again, is absent.
    assert after == {"rows": 3, "reads": 2}
    assert OverridesVersion.objects.get().revision == 2


def test_changes_from_many_processes_at_once_take_distinct_revisions_in_order_and_all_are_read(overridable):
    limiter.check("login", "k")

    def block_many(barrier, index):
        barrier.wait()
        for i in range(15):
            limiter.block("login", f"p{index}-{i}")
        return {}

    run_processes(block_many, 4)
    revisions = sorted(LimitOverride.objects.values_list("revision", flat=True))
    assert revisions == list(range(1, 61))
    with rows_read() as after:
        seen = [decide(f"p{index}-{i}") for index in range(4) for i in range(15)]
    assert seen == ["block"] * 60 and after["reads"] == 60
    assert len(override_snapshot._snapshot.keyed) == 60


@pytest.mark.only_on("postgres", "mariadb")  # SQLite's IMMEDIATE transactions let no one write meanwhile
def test_a_transaction_whose_view_lags_behind_the_snapshot_neither_reads_all_nor_undoes_a_change(overridable):
    """Under REPEATABLE READ a transaction sees the version row as it was when it began:
    read whole from there, the snapshot would lose every change since, for every thread."""
    limiter.block("login", "a")
    assert decide("a") == "block"
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        assert OverridesVersion.objects.get().revision == 1  # this transaction's view begins
        in_another_thread(lambda: limiter.block("login", "b"))  # another connection, committed
        assert in_another_thread(lambda: decide("b")) == "block"  # the snapshot is at revision 2
        with rows_read() as lagging:
            assert decide("b") == "block"
        assert lagging == {"rows": 1, "reads": 1}, "the version row, as this transaction sees it"
    assert decide("b") == "block"


def test_a_refresh_forgets_the_remembered_denials_of_the_keys_changed_alone(overridable):
    load(100)
    for key in ("changed", "unchanged"):
        for _ in range(3):
            assert limiter.limit("login", key).ok
        assert not limiter.limit("login", key).ok
        assert limiter.limit("login", key).cached  # remembered
    in_another_process(lambda: limiter.override("login", "changed", rate=3, period=1))
    overrides.invalidate()
    status = limiter.limit("login", "changed")
    assert status.override == "limit" and not status.cached, "asked of the store, under the new numbers"
    assert limiter.limit("login", "unchanged").cached


# -- when the snapshot cannot be brought up to date ------------------------------------


def test_a_flushed_table_counted_again_past_the_snapshot_is_read_whole(overridable):
    for key in ("gone-1", "gone-2", "gone-3"):
        limiter.block("login", key)
    assert limiter.check("login", "gone-1").override == "block"  # held at revision 3

    def flush_and_write_more():
        # Another process empties the tables (a flush, a TransactionTestCase's) and the
        # count starts again, past where this process stands.
        for model in (LimitOverride, OverrideTombstone, OverridesVersion):
            model.objects.all().delete()
        for i in range(5):
            limiter.block("login", f"new-{i}")

    in_another_process(flush_and_write_more)
    assert OverridesVersion.objects.get().revision == 5
    assert decide("gone-1") is None
    assert [decide(f"new-{i}") for i in range(5)] == ["block"] * 5
    assert len(override_snapshot._snapshot.keyed) == 5


def test_cleanup_past_a_snapshot_makes_it_read_whole(overridable):
    """An override ended and deleted by cleanup, or a tombstone deleted, leaves nothing
    for a process behind it to read: the floor sends it to the whole table."""
    limiter.block("login", "ended", until=timedelta(hours=1))
    limiter.block("login", "cleared")
    assert decide("ended") == decide("cleared") == "block"

    def end_clear_and_clean_up():
        expire(LimitOverride.objects.get(label="ended"))
        limiter.clear_override("login", "cleared")
        limiter.block("other", "unrelated")
        time.sleep(0.01)  # KEEP_EXPIRED is 0: an override that ended before now
        with frozen_clock(time.time() + overrides.TOMBSTONES_KEPT + 60):
            assert cleanup(names=["login"]).overrides_removed == 1
        assert not OverrideTombstone.objects.exists()

    in_another_process(end_clear_and_clean_up)
    version = OverridesVersion.objects.get()
    assert version.floor == 4 and version.revision == 5
    assert decide("ended") is None
    assert decide("cleared") is None
    assert decide("unrelated", "other") == "block"


def test_a_change_by_a_version_that_counted_nothing_is_read(overridable):
    """A rolling deploy: a process of the previous version writes a row without a
    revision (the column's database default) and a random stamp; this version's next
    change starts another epoch, and every process reads the table whole."""
    limiter.block("login", "before")
    assert decide("before") == "block"

    def as_the_previous_version():
        table, quote = LimitOverride._meta.db_table, connection.ops.quote_name
        columns = ("name", "key", "label", "action", "reason", "created_by", "created_at", "updated_at")
        now = timezone.now()
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {quote(table)} ({', '.join(map(quote, columns))}) VALUES ({', '.join(['%s'] * 8)})",
                ["login", encode_key("old-writer").digest, "old-writer", "block", "", "", now, now],
            )
            OverridesVersion.objects.filter(pk=1).update(stamp=secrets.randbits(62) + 1)
        limiter.block("login", "after")

    epoch = OverridesVersion.objects.get().epoch
    in_another_process(as_the_previous_version)
    assert LimitOverride.objects.get(label="old-writer").revision == 0
    assert decide("old-writer") == "block"
    assert decide("after") == "block"
    assert decide("before") == "block"
    assert OverridesVersion.objects.get().epoch != epoch


# -- memory and its bound ----------------------------------------------------------------


def test_an_ended_override_leaves_memory_without_any_change(overridable):
    limiter.block("login", "forever")
    limiter.block("login", "briefly", until=timedelta(seconds=0.3))
    assert decide("briefly") == "block"
    assert len(override_snapshot._snapshot.keyed) == 2
    time.sleep(0.35)
    assert decide("briefly") is None
    assert list(override_snapshot._snapshot.keyed) == [("login", encode_key("forever").digest)]
    assert len(override_snapshot._snapshot.expiring) == 0


def test_a_full_read_past_the_documented_figure_warns(overridable, monkeypatch, caplog):
    monkeypatch.setattr(override_snapshot, "WARN_IN_FORCE", 5)
    load(6)
    with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
        limiter.check("login", "k")
    assert "6 rate-limit overrides are in force, more than the 5 documented" in caplog.text
    assert "docs/settings.md#overrides" in caplog.text
