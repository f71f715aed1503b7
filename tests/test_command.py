"""``manage.py tokenbucket list|show|reset|cleanup`` and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from django_tokenbucket import limiter
from django_tokenbucket.algorithms import MICRO
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock

pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_700_000_000.0


def run(*args: str) -> str:
    out = StringIO()
    call_command("tokenbucket", *args, stdout=out, stderr=out)
    return out.getvalue()


def store(name: str, key: object, value_tokens: float, ts: float = T0) -> RateLimit:
    encoded = encode_key(key)
    return RateLimit.objects.create(
        name=name, key=encoded.digest, label=encoded.label, value=round(value_tokens * MICRO), ts=round(ts * MICRO)
    )


def labels() -> set[str]:
    return set(RateLimit.objects.values_list("label", flat=True))


# -- list --------------------------------------------------------------------------------


def test_list_shows_every_limit_with_its_config_and_stored_keys():
    with frozen_clock(T0):
        limiter.limit("login", "a")
        limiter.limit("login", "b")
    store("retired", "x", 1)
    output = run("list")
    lines = {line.split()[0]: line for line in output.splitlines()}
    assert "token bucket: 5 per minute, capacity 5 [settings]  2 stored key(s)" in lines["login"]
    assert "fixed window: 5 per minute, capacity 5, start 0 s [settings]  0 stored key(s)" in lines["window"]
    assert "max_reserved 20" in lines["reservable"]
    assert "[DRF throttle rates]" in lines["anon"]
    # Perhaps the live rows of code that passes config= at its call sites (issue 30).
    assert "decided with config= at call sites (not in LIMITS); not readable here  1 stored key(s)" in lines["retired"]
    assert "stored key" not in run("list", "--no-counts")
    with pytest.raises(CommandError, match="does not exist"):
        run("list", "--database", "nowhere")


# -- show --------------------------------------------------------------------------------


def test_show_one_key_now():
    with frozen_clock(T0) as clock:
        limiter.limit("ten_per_minute", "alice", count=10)
        clock.advance(3)
        output = run("show", "ten_per_minute", "alice")
    assert "ten_per_minute: token bucket: 10 per minute, capacity 10 [settings]" in output
    assert f"digest {encode_key('alice').digest}" in output
    assert "tokens now:   0.5 of 10" in output
    assert "state:        limited" in output
    assert "full again:   in 57 s" in output
    assert "next token:   in 3 s" in output
    assert "stored row:   yes" in output
    with frozen_clock(T0):
        fresh = run("show", "ten_per_minute", "nobody")
    assert "tokens now:   10 of 10" in fresh and "stored row:   no (a fresh key)" in fresh


def test_keys_of_other_types_have_their_own_forms():
    with frozen_clock(T0):
        limiter.limit("login", 42, count=1)
        limiter.limit("login", "42", count=1)  # the same bucket as the int 42
        limiter.limit("login", ("ip", "203.0.113.7"), count=3)
        limiter.limit("login", None, count=4)
        assert "tokens now:   3 of 5" in run("show", "login", "42")
        assert "tokens now:   3 of 5" in run("show", "login", "42", "--int")
        assert "tokens now:   2 of 5" in run("show", "login", '["ip", "203.0.113.7"]', "--json")
        assert "tokens now:   1 of 5" in run("show", "login", "null", "--json")
        digest = encode_key(("ip", "203.0.113.7")).digest
        assert "tokens now:   2 of 5" in run("show", "login", digest[:10], "--digest")


def test_show_a_limit_summarises_its_keys_by_state():
    store("ten_per_minute", "empty", 0)
    store("ten_per_minute", "partial", 4)
    store("ten_per_minute", "full", 10, T0 - 600)
    with frozen_clock(T0):
        output = run("show", "ten_per_minute")
    assert "stored keys:     3" in output
    assert "limited now:     1" in output
    assert "partially used:  1" in output
    assert "full (idle):     1" in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("show", "nope"), "unknown rate limit 'nope'"),
        (("reset", "nope", "k"), "unknown rate limit 'nope'"),
        (("show", "login", "x", "--int"), "--int: 'x' is not an integer"),
        (("show", "login", "{", "--json"), "--json: '{' is not JSON"),
        (("show", "login", "1.5", "--json"), "a JSON key must be null, an integer, a string or an array"),
        (("show", "login", "true", "--json"), "a JSON key must be null"),
        (("show", "login", "--int"), "need a KEY"),
        (("show", "login", "abc", "--digest"), "is not a digest or a prefix of 8+ hex digits"),
        (("show", "login", "0" * 64, "--digest"), "no key of 'login' has a digest starting with"),
        (("cleanup", "--name", "nope"), "unknown rate limit(s) 'nope'"),
        (("cleanup", "--batch-size", "5000"), "batch_size must be between 1 and 1000"),
    ],
)
def test_errors_are_clear(args, message):
    with pytest.raises(CommandError) as excinfo:
        run(*args)
    assert message in str(excinfo.value)


def test_unknown_name_with_stored_rows_is_reported_never_offered_for_deletion():
    """Issue 30: the rows may be live buckets of code that passes config= elsewhere."""
    store("retired", "x", 1)
    output = run("show", "retired")
    assert "retired: decided with config= at call sites (not in LIMITS)" in output and "stored keys:     1" in output
    with pytest.raises(CommandError, match=r"1 row\(s\) are stored under 'retired'.*define the limit in") as excinfo:
        run("reset", "retired", "x")
    assert "remove-unknown" not in output + str(excinfo.value)


def test_an_ambiguous_digest_prefix_is_refused():
    # Two keys whose digests share their first 8 hex digits (birthday bound: ~10^5 tries).
    seen: dict[str, str] = {}
    for i in range(2_000_000):
        key = f"k{i}"
        prefix = encode_key(key).digest[:8]
        if prefix in seen:
            break
        seen[prefix] = key
    store("login", seen[prefix], 1)
    store("login", key, 1)
    with pytest.raises(CommandError, match="matches several keys"):
        run("show", "login", prefix, "--digest")
    assert "tokens now" in run("show", "login", encode_key(key).digest, "--digest")  # the whole digest is unique


# -- reset -------------------------------------------------------------------------------


def test_reset_one_key():
    with frozen_clock(T0):
        limiter.limit("login", "alice", count=5)
        limiter.limit("login", "bob", count=5)
        assert "Reset login key 'alice': it starts full again." in run("reset", "login", "alice")
        assert limiter.get_value("login", "alice") == 5
        assert limiter.get_value("login", "bob") == 0
        # Nothing to reset: an error, not a "done" for a bucket nobody uses.
        with pytest.raises(CommandError, match=r"'alice' has no state to reset .*nothing matched.*--key SPEC=VALUE"):
            run("reset", "login", "alice")
        limiter.limit("login", 7, count=5)
        run("reset", "login", "7", "--int")
        assert limiter.get_value("login", 7) == 5
    assert labels() == {"bob"}


def test_reset_unlocks_a_user_locked_by_a_post_username_limit(client):
    """The docs' unlock: alice is locked out by @ratelimit("login", key="post:username")."""
    with frozen_clock(T0):
        codes = [client.post("/login/", {"username": spelling}).status_code for spelling in ["alice", " Alice"] * 3]
        assert codes == [200] * 5 + [429]
        with pytest.raises(CommandError, match="nothing matched"):
            run("reset", "login", "alice")  # a plain string is another key
        assert client.post("/login/", {"username": "alice"}).status_code == 429
        assert "Reset login key post:username=alice:" in run("reset", "login", "--key", "post:username=ALICE ")
        assert client.post("/login/", {"username": "alice"}).status_code == 200
        assert "tokens now" in run("show", "login", "--key", "post:username=alice")
    with pytest.raises(CommandError, match="is not SPEC=VALUE"):
        run("show", "login", "--key", "alice")


def test_reset_by_digest():
    row = store("login", ("ip", "198.51.100.1"), 0)
    assert "Reset login key" in run("reset", "login", row.key[:12], "--digest")
    assert not RateLimit.objects.exists()


def test_reset_all_keys_asks_first(monkeypatch):
    for key in ("a", "b", "c"):
        store("login", key, 0)
    store("ten_per_minute", "other", 0)
    answers = iter(["n", "yes"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    with pytest.raises(CommandError, match="reset cancelled"):
        run("reset", "login")
    assert labels() == {"a", "b", "c", "other"}
    assert "Reset 3 key(s) of login" in run("reset", "login")
    assert labels() == {"other"}


def test_reset_all_keys_with_stdin_closed_is_a_no(monkeypatch):
    # "manage.py tokenbucket reset login < /dev/null", as from cron (issue 33).
    store("login", "a", 0)
    monkeypatch.setattr("sys.stdin", StringIO(""))
    with pytest.raises(CommandError, match="reset cancelled: no answer on stdin; pass --yes to reset the 1 stored key of 'login'"):
        run("reset", "login")
    assert labels() == {"a"}


def test_reset_all_keys_without_a_prompt():
    store("login", "a", 0)
    with pytest.raises(CommandError, match="without --yes"):
        run("reset", "login", "--no-input")
    assert labels() == {"a"}
    assert "Reset 1 key(s) of login" in run("reset", "login", "--yes")
    assert labels() == set()
    assert "no keys are stored" in run("reset", "login", "--yes")


# -- cleanup -----------------------------------------------------------------------------


def test_cleanup_reports_and_keeps_unknown_limits_unless_asked():
    store("login", "idle", 5, 0)
    store("login", "busy", 0, T0)
    store("retired", "x", 1, 0)
    with frozen_clock(T0):
        dry = run("cleanup", "--dry-run")
        assert "Would delete 1 idle row(s)" in dry and labels() == {"idle", "busy", "x"}
        output = run("cleanup")
    assert "Deleted 1 idle row(s)" in output and "  login: 1" in output
    assert "Limit 'retired' cannot be read here (decided with config= at call sites (not in LIMITS), or no longer " \
        "used): 1 row(s) kept." in output
    assert "--remove-unknown" not in output  # never suggested: they may be live
    assert labels() == {"busy", "x"}
    store("retired", "recent", 1, T0 - 3600)
    with frozen_clock(T0):
        output = run("cleanup", "--remove-unknown")
    # A name this process does not know may be a limit another service uses: its rows
    # written in the last week stay.
    assert "Limit 'retired' cannot be read here (decided with config= at call sites (not in LIMITS), or no longer " \
        "used): 1 of 2 row(s) removed (the others were written too recently)." in output
    assert labels() == {"busy", "recent"}
    with frozen_clock(T0):
        run("cleanup", "--remove-unknown", "--unknown-idle", "60")
    assert labels() == {"busy"}


def test_cleanup_as_json():
    store("login", "idle", 5, 0)
    with frozen_clock(T0):
        report = json.loads(run("cleanup", "--json", "--batch-size", "10", "--name", "login", "--database", "default"))
    assert report["deleted"] == {"login": 1} and report["complete"] is True and report["batches"] == 1


def test_cleanup_says_how_many_denial_analytics_rows_it_trimmed():
    from django_tokenbucket.backends.base import MINUTES_KEPT, MinuteCounts
    from django_tokenbucket.backends.database import DatabaseBackend

    now = int(T0 // 60)
    DatabaseBackend({}).write_analytics(
        [MinuteCounts("login", now - MINUTES_KEPT - 1, 1, 0), MinuteCounts("api", now - MINUTES_KEPT - 9, 0, 1)], []
    )
    with frozen_clock(T0):
        assert "analytics" not in run("cleanup", "--dry-run")
        assert "Trimmed 2 denial-analytics row(s) past their retention." in run("cleanup")
        assert "analytics" not in run("cleanup")
        assert json.loads(run("cleanup", "--json"))["analytics_trimmed"] == 0


def test_djangos_options_work_after_the_subcommand():
    """Issue 21: `tokenbucket list --settings X` failed ("unrecognized arguments")."""
    command = [sys.executable, "-m", "django", "tokenbucket", "list", "--no-counts", "--settings", "tests.settings", "-v", "0"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr
    assert "login" in result.stdout


# -- every backend (run on Redis Cluster too, by test_redis_cluster.py) -------------------

def test_list_counts_the_keys_of_each_limit_on_its_backend(ops):
    for i in range(25):
        limiter.limit("odd name/ü", f"k{i}")
    for key in ("a", "b"):
        limiter.limit("hot", key, count=15)
    lines = {line.split("  ")[0].strip(): line for line in run("list").splitlines()}
    assert lines["odd name/ü"].endswith("  25 stored key(s) on 'default'")
    # 15 tokens of a shard holding 10: each call took from two shards, two buckets a key.
    assert lines["hot"].endswith("  4 stored key(s) on 'default'")
    assert lines["login"].endswith("  0 stored key(s) on 'default'")


def test_show_summarises_and_shows_one_key_on_every_backend(ops):
    limiter.limit("ten_per_minute", "empty", count=10)
    limiter.limit("ten_per_minute", "partial", count=4)
    limiter.limit("hot", "alice", count=15)
    summary = run("show", "ten_per_minute")
    assert "stored keys:     2" in summary and "limited now:     1" in summary and "partially used:  1" in summary
    one = run("show", "ten_per_minute", "partial")
    assert "tokens now:   6 of 10" in one and "stored row:   yes" in one
    digest = encode_key("empty").digest
    by_digest = run("show", "ten_per_minute", digest[:10], "--digest")
    assert f"(digest {digest})" in by_digest and "tokens now:   0 of 10" in by_digest
    # A sharded limit: the key as callers give it reads the sum of its shards.
    sharded = run("show", "hot", "alice")
    assert "tokens now:   25 of 40" in sharded and "stored row:   yes" in sharded
    assert "stored row:   no (a fresh key)" in run("show", "hot", "nobody")


def test_reset_one_key_and_every_key_on_every_backend(ops):
    for key in ("a", "b", "c"):
        limiter.limit("odd name/ü", key, count=5)
        limiter.limit("hot", key, count=15)
    limiter.limit("ten_per_minute", "other")
    assert "Reset odd name/ü key 'a'" in run("reset", "odd name/ü", "a")
    assert limiter.get_value("odd name/ü", "a") == 5 and limiter.get_value("odd name/ü", "b") == 0
    digest = encode_key("b").digest
    # Shown by its label where the store keeps one (the database), else by its digest.
    reset = run("reset", "odd name/ü", digest[:12], "--digest")
    assert reset in ("Reset odd name/ü key b: it starts full again.\n", f"Reset odd name/ü key {digest}: it starts full again.\n")
    assert limiter.get_value("odd name/ü", "b") == 5
    assert "Reset hot key 'a'" in run("reset", "hot", "a")
    assert limiter.get_value("hot", "a") == 40
    # 15 tokens of a shard holding 10: each call took from two shards, two buckets a key.
    with pytest.raises(CommandError, match="refusing to reset all 4 stored keys of 'hot' without --yes"):
        run("reset", "hot", "--no-input")
    assert "Reset 4 key(s) of hot" in run("reset", "hot", "--yes")
    assert limiter.get_value("hot", "b") == 40 and limiter.get_value("hot", "c") == 40
    assert "Reset 1 key(s) of odd name/ü" in run("reset", "odd name/ü", "--yes")
    assert limiter.get_value("odd name/ü", "c") == 5
    assert limiter.get_value("ten_per_minute", "other") == 9  # another limit: untouched
    assert "no keys are stored" in run("reset", "hot", "--yes")


def test_cleanup_runs_where_buckets_are_rows(ops, ops_store):
    output = run("cleanup")
    if ops_store == "database":
        assert "Deleted 0 idle row(s)" in output
    else:
        assert "Backend 'default' (RedisBackend): its keys expire when their bucket is full again" in output
