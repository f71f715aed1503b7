"""``manage.py tokenbucket override|exempt|block|unblock|overrides`` (issue 30), and the key
normalisation of an override made from a shell, end to end through ``@ratelimit``."""

from __future__ import annotations

import getpass
import socket
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from django_tokenbucket import limiter, overrides
from django_tokenbucket.models import LimitOverride
from django_tokenbucket.signals import rate_limit_denied
from django_tokenbucket.testing import frozen_clock

pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def clock():
    # A flushed table must not meet a snapshot read before it (see docs/api.md).
    overrides.invalidate()
    with frozen_clock(T0) as frozen:
        yield frozen
    overrides.invalidate()


def run(*args: str) -> str:
    out = StringIO()
    call_command("tokenbucket", *args, stdout=out, stderr=out)
    return out.getvalue()


def test_a_block_made_with_key_reaches_the_bucket_of_a_normalised_login():
    output = run("block", "login", "--key", "post:username= Alice@Example.com ", "--for", "1h", "--reason", "stuffing")
    assert "Blocked login key post:username=alice@example.com: always refused, ends in 1 h" in output
    row = LimitOverride.objects.get()
    assert (row.action, row.reason, row.label) == ("block", "stuffing", "post:username=… (value not stored)")
    denied = []

    def record(sender, status, **kwargs):
        denied.append(status)

    rate_limit_denied.connect(record)
    try:
        response = Client().post("/login/", {"username": "alice@example.com"})
    finally:
        rate_limit_denied.disconnect(record)
    assert response.status_code == 429
    assert response["Retry-After"] == "3600"
    assert [status.override for status in denied] == ["block"]
    # Another user is not blocked.
    assert Client().post("/login/", {"username": "bob@example.com"}).status_code == 200
    assert "Removed the block override of login key post:username=alice@example.com" in run(
        "unblock", "login", "--key", "post:username=ALICE@example.com"
    )
    assert Client().post("/login/", {"username": "alice@example.com"}).status_code == 200


def test_override_takes_a_rate_capacity_and_a_duration():
    output = run(
        "override", "login", "tenant-42", "--rate", "100/m", "--capacity", "150", "--for", "7d", "--reason", "launch"
    )
    assert "Overrode login key 'tenant-42': 100 per minute, capacity 150, ends in 7 d" in output
    row = LimitOverride.objects.get()
    assert row.expires_at is not None and row.expires_at.timestamp() == T0 + 7 * 86400
    status = limiter.limit("login", "tenant-42")
    assert status.ok and status.capacity == 150 and status.rate == 100
    assert limiter.limit("login", "someone-else").capacity == 5


def test_until_takes_a_date_and_time():
    run("exempt", "login", "acme", "--until", "2023-11-15T00:00:00+00:00")
    assert LimitOverride.objects.get().expires_at.timestamp() == 1_700_006_400


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["alice"], "alice"),
        (["42", "--int"], 42),
        (['["ip", "203.0.113.7"]', "--json"], ("ip", "203.0.113.7")),
        (["--key", "ip=203.0.113.7"], ("ip", "203.0.113.7")),
        (["--key", "user=42"], ("user", 42)),
    ],
)
def test_every_key_form_of_show_and_reset(args, key):
    assert "Exempted login key" in run("exempt", "login", *args)
    assert limiter.limit("login", key).override == "exempt"
    assert limiter.limit("login", "nobody").override is None
    run("unblock", "login", *args)
    assert limiter.limit("login", key).override is None


def test_no_key_is_every_key_of_the_limit():
    assert "Blocked login every key: always refused, until cleared." in run("block", "login")
    assert limiter.limit("login", "a").override == "block" and limiter.limit("login", "b").override == "block"
    assert limiter.limit("ten_per_minute", "a").override is None
    assert "Removed the block override of login every key" in run("unblock", "login")


def test_created_by_says_who_ran_it_unless_given():
    run("block", "login", "x")
    assert LimitOverride.objects.get().created_by == f"manage.py tokenbucket ({getpass.getuser()}@{socket.gethostname()})"
    run("block", "login", "x", "--created-by", "alice (ticket 123)")
    assert LimitOverride.objects.get().created_by == "alice (ticket 123)"


def test_overrides_lists_what_is_in_force(clock):
    assert run("overrides") == "No overrides in force.\n"
    run("override", "burst", "--rate", "40/m", "--reason", "launch  week", "--created-by", "ops")
    run("block", "login", "--key", "post:username=eve", "--for", "1h", "--created-by", "sec")
    limiter.exempt("login", "partner", until=timedelta(seconds=30), created_by="api")
    lines = run("overrides").splitlines()
    assert lines[0].split() == ["limit", "key", "action", "numbers", "expires", "reason", "created", "by"]
    assert len(lines) == 4
    burst = next(line for line in lines if line.startswith("burst"))
    assert "every key" in burst and "40 per minute, capacity 20" in burst and "never" in burst
    assert "launch week" in burst and burst.endswith("ops")
    login = [line for line in lines if line.startswith("login")]
    assert any("post:username=… (value not stored)" in line and "always refused" in line for line in login)
    assert any("'partner'" not in line and "partner" in line and "in 30 s" in line for line in login)
    assert run("overrides", "burst").count("\n") == 2
    clock.advance(60)
    assert "partner" not in run("overrides")
    expired = run("overrides", "login", "--all")
    assert "partner" in expired and "expired 2023-11-14" in expired
    assert "Removed the expired exempt override of login key 'partner', made by api." in run(
        "unblock", "login", "partner"
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["block", "no_such_limit", "k"], "unknown rate limit 'no_such_limit'"),
        (["override", "login", "k", "--rate", "10/fortnight"], "rate limit 'login': override: invalid rate"),
        (["override", "login", "k"], "rate limit 'login': override: give at least one of rate"),
        (["override", "login", "k", "--capacity", "0"], "rate limit 'login'"),
        (["block", "login", "k", "--for", "soon"], "rate limit 'login': --for: 'soon' is not a duration"),
        (["block", "login", "k", "--until", "yesterday"], "rate limit 'login': --until: 'yesterday' is not a date"),
        (["block", "login", "k", "--until", "2020-01-01T00:00Z"], "rate limit 'login': until"),
        (["block", "login", "--key", "nonsense"], "key 'nonsense' is not SPEC=VALUE"),
        (["block", "login", "--int"], "'login': --int and --json need a KEY"),
        (["block", "login", "x", "--int"], "--int: 'x' is not an integer"),
        (["block", "login", "x", "--created-by", "x" * 151], "rate limit 'login': created_by must be at most 150"),
        (["unblock", "login", "nobody"], "rate limit 'login' has no override for key 'nobody': nothing removed"),
    ],
)
def test_bad_input_is_a_clear_error_naming_the_limit(args, words):
    with pytest.raises(CommandError) as raised:
        run(*args)
    assert words in str(raised.value)
    assert not LimitOverride.objects.exists()


def test_a_limit_no_longer_configured_can_still_be_unblocked():
    LimitOverride.objects.create(name="retired", key="", action="block", created_by="ops")
    assert "Removed the block override of retired every key, made by ops." in run("unblock", "retired")
    assert not LimitOverride.objects.exists()


def test_the_usage_names_the_new_subcommands():
    with pytest.raises(CommandError) as raised:
        call_command("tokenbucket", "nothing")
    assert "override,exempt,block,unblock,overrides" in str(raised.value)


def test_the_command_overrides_limits_on_every_backend(ops_store):
    # Overrides live in the database whatever store decides: a Redis limit obeys them too.
    limiter.limit("ten_per_minute", "alice", count=10)
    run("override", "ten_per_minute", "alice", "--rate", "100/m", "--for", "1h")
    run("block", "ten_per_minute", "--key", "ip=203.0.113.7")
    assert limiter.get_status("ten_per_minute", "alice").capacity == 100
    assert limiter.limit("ten_per_minute", ("ip", "203.0.113.7")).override == "block"
    assert "Removed the limit override of ten_per_minute key 'alice'" in run("unblock", "ten_per_minute", "alice")
    assert limiter.get_status("ten_per_minute", "alice").capacity == 10


def test_with_overrides_off_the_command_says_how_to_turn_them_on(settings):
    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "OVERRIDES": False}
    with pytest.raises(CommandError, match="rate limit 'login': overrides are off"):
        run("block", "login", "eve")
    assert not LimitOverride.objects.exists()
