"""What operators type, against an attacker (docs/security.md, "Third round", issue 47):
the command's and the admin forms' text, ends, factors and numbers, escaped and bounded
before use. Items 3, 4 and 11, what a second look at the command, the admin forms and
the parsers found (O1-O7), and 49.9.

Each test failed on 4c6264d, the code before the fixes, but the two that hold a bound's
other side (a hundred years and a factor in range still accepted): 3 a reason holding
terminal controls, written by staff with only *add limit override*, printed raw by
``tokenbucket overrides`` and ``unblock`` (and stored names, labels and authors by
``list``, ``show``, ``reset`` and ``cleanup``); 4 an override's end past what a datetime
holds, an ``OverflowError`` from the API, a traceback from the command and a 500 from
both admin forms; 11 the exact Fraction of ``10**3000000`` built from a bucket page's
factor before its range check. Then: O1 ``--json`` and ``--int`` keys the command
cannot read, O2 cleanup's ``--pause``, ``--unknown-idle`` and ``--max-seconds``, O3 a
limit option quoted whole, O4 what an operator typed quoted whole in an error, O5 an
end stored before the bound, which no page could show east of UTC, O6 a period too
long called a number of tokens, O7 the command's amounts read as floats. Run on the
database (SQLite, PostgreSQL or MariaDB, whichever the run uses); the bucket page on
Redis too.
"""

from __future__ import annotations

import tracemalloc
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError

from django_tokenbucket import limiter, overrides
from django_tokenbucket.algorithms import MICRO
from django_tokenbucket.cleanup import cleanup
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import LimitOverride, RateLimit
from django_tokenbucket.override_operations import factor_of, numbers_from_text, parse_duration
from django_tokenbucket.testing import frozen_clock

from .test_admin import client_for, make_user
from .test_overrides_admin import add_form, errors
from .test_overrides_command import run

pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_700_000_000.0
ADMIN = "/admin/django_tokenbucket/limitoverride/"
CHANGELIST = "/admin/django_tokenbucket/ratelimit/"
BUCKETS = f"{CHANGELIST}buckets/default/"
#: A window title (OSC ... BEL), a cleared screen (CSI 2J), the 8-bit CSI (0x9B) and a
#: right-to-left override: what a terminal obeys rather than shows.
HOSTILE = "ok\x1b]0;owned\x07\x1b[2J\x9b31m\u202egnp.exe\u2028"


@pytest.fixture(autouse=True)
def clock():
    # A flushed table must not meet a snapshot read before it (docs/api.md).
    overrides.invalidate()
    with frozen_clock(T0) as frozen:
        yield frozen
    overrides.invalidate()




def assert_inert(output: str) -> None:
    """Nothing in ``output`` that a terminal would obey: every character printable, or a newline."""
    controls = sorted({c for c in output if not c.isprintable() and c != "\n"})
    assert not controls, f"printed raw: {controls!r} in {output!r}"


def allocated(call) -> int:
    """The most memory ``call()`` held at once, in bytes: what it built, whatever the CPU's noise."""
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# -- 3. operator text drives the terminal ---------------------------------------------------


def test_3_a_reason_from_staff_with_add_only_reaches_the_terminal_escaped():
    adder = client_for(make_user("adder", "add_limitoverride"))
    response = adder.post(f"{ADMIN}add/", add_form(key_text="username=eve", reason=HOSTILE))
    assert response.status_code == 302, errors(response)
    assert LimitOverride.objects.get().reason == HOSTILE.strip()  # as written (the form strips): HTML escapes it
    for args in (("overrides",), ("overrides", "login"), ("overrides", "--all")):
        listing = run(*args)
        assert_inert(listing)  # was: ESC, BEL, 0x9B and U+202E written to the terminal
        assert "ok\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\u202egnp.exe" in listing  # the operator still reads it
    removed = run("unblock", "login", "--key", "username=eve")
    assert_inert(removed)
    assert "Removed the block override of login key username=eve, made by adder" in removed
    assert "\\x1b]0;owned" in removed


def test_3_every_string_the_command_reads_from_the_database_is_escaped():
    # Rows another process (or a hand) wrote: names, labels and authors it never checked.
    encoded = encode_key("mallory")
    RateLimit.objects.create(name="login", key=encoded.digest, label=HOSTILE, value=0, ts=round(T0 * MICRO))
    RateLimit.objects.create(name=HOSTILE, key=encoded.digest, label="x", value=0, ts=round(T0 * MICRO))
    LimitOverride.objects.create(name="login", key="ab" * 32, label=HOSTILE, action="block", created_by=HOSTILE)
    outputs = {
        "list": run("list"),
        "show": run("show", "login", encoded.digest[:12], "--digest"),
        "reset": run("reset", "login", encoded.digest[:12], "--digest"),
        "cleanup": run("cleanup", "--remove-unknown", "--unknown-idle", "0", "--dry-run"),
        "overrides": run("overrides"),
        "unblock": "",
    }
    LimitOverride.objects.filter(key="ab" * 32).update(key="")
    outputs["unblock"] = run("unblock", "login")
    for command, output in outputs.items():
        assert_inert(output)
        assert "\\x1b]0;owned" in output, command


def test_3_top_and_every_printed_string_share_one_escaping():
    from django_tokenbucket.text import printable

    assert printable("alice") == "alice"
    assert printable("") == ""
    assert printable(HOSTILE) == repr(HOSTILE)
    assert_inert(printable(HOSTILE))


# -- 4. durations out of range ----------------------------------------------------------------

TOO_FAR = [
    timedelta(days=9_999_999),
    timedelta.max,
    timedelta(days=36_525, seconds=1),  # just past a hundred years
    datetime(9999, 12, 31, 23, 59, tzinfo=UTC),
    datetime.max,  # naive: made aware in the project's time zone
]


@pytest.mark.parametrize("until", TOO_FAR, ids=repr)
@pytest.mark.parametrize("make", ["block", "exempt", "override"])
def test_4_an_end_out_of_range_is_a_value_error_from_the_api(make, until):
    extra = {"rate": "10/m"} if make == "override" else {}
    with pytest.raises(ValueError, match=r"rate limit 'login': until .* more than 100 years"):
        getattr(limiter, make)("login", "eve", until=until, **extra)  # was: OverflowError
    assert not LimitOverride.objects.exists()


@pytest.mark.parametrize("until", [timedelta(days=-999_999_999), timedelta.min, datetime.min.replace(tzinfo=UTC)])
def test_4_an_end_long_past_is_not_in_the_future(until):
    with pytest.raises(ValueError, match=r"rate limit 'login': until .* is not in the future"):
        limiter.block("login", "eve", until=until)  # was: OverflowError for the timedeltas
    assert not LimitOverride.objects.exists()


def test_4_a_hundred_years_is_the_longest():
    row = limiter.block("login", "eve", until=timedelta(days=36_525))
    assert row.expires_at.timestamp() == T0 + 36_525 * 86_400
    assert "in 36525 d" in run("overrides")


@pytest.mark.parametrize(
    "args",
    [
        ("--for", "9999999d"),
        ("--for", "999999999w"),
        ("--for", "36526d"),
        ("--until", "9999-12-31T23:59:59"),
        ("--until", "9999-12-31T23:59:59-12:00"),
    ],
)
@pytest.mark.parametrize("make", ["block", "exempt", "override"])
def test_4_an_end_out_of_range_is_a_clear_error_from_the_command(make, args):
    extra = ("--rate", "10/m") if make == "override" else ()
    with pytest.raises(CommandError, match=r"rate limit 'login': .*(longer|more) than 100 years"):
        run(make, "login", "eve", *args, *extra)  # was: a traceback
    assert not LimitOverride.objects.exists()


@pytest.mark.parametrize(
    "fields",
    [
        {"duration": "9999999d"},
        {"duration": "36526d"},
        {"expires_at_0": "9999-12-31", "expires_at_1": "23:59"},
    ],
    ids=["9999999d", "36526d", "9999-12-31"],
)
def test_4_an_end_out_of_range_is_a_form_error_on_both_override_forms(fields):
    client = client_for(make_user("root", superuser=True))
    response = client.post(f"{ADMIN}add/", add_form(key_text="username=eve", **fields))  # was: HTTP 500
    assert response.status_code == 200 and "100 years" in errors(response)
    assert not LimitOverride.objects.exists()
    row = limiter.override("login", "tenant", rate="100/m", until=timedelta(hours=1))
    change = {
        "rate": "100/m",
        "capacity": "",
        "max_reserved": "",
        "duration": "",
        "expires_at_0": "",
        "expires_at_1": "",
        "reason": "",
        **fields,
    }
    response = client.post(f"{ADMIN}{row.pk}/change/", change)  # was: HTTP 500
    assert response.status_code == 200 and "100 years" in errors(response)
    row.refresh_from_db()
    assert row.expires_at.timestamp() == T0 + 3600


@pytest.mark.parametrize("ops_store", ["database", "redis"], indirect=True)
def test_4_an_end_out_of_range_is_a_message_on_a_bucket_page(ops_store):
    limiter.limit("login", "alice")
    digest = encode_key("alice").digest
    client = client_for(make_user("root", superuser=True))
    url = f"{BUCKETS}key/?name=login&digest={digest}"
    form = {"name": "login", "digest": digest, "next": url, "for": "9999999d"}
    for action in ("block", "exempt", "multiply"):
        response = client.post(f"{BUCKETS}override/", {**form, "action": action, "factor": "2"}, follow=True)
        content = response.content.decode()  # was: HTTP 500
        assert "Nothing was changed" in content and "longer than 100 years" in content
    assert not LimitOverride.objects.exists()


# -- 11. CPU before a range check -------------------------------------------------------------

HOSTILE_NUMBERS = ["1e3000000", "1e-3000000", "9" * 100_000, "0." + "0" * 100_000 + "1", "1" + "0" * 5000]


@pytest.mark.parametrize("text", HOSTILE_NUMBERS, ids=lambda text: text[:12])
def test_11_a_hostile_factor_is_refused_before_it_is_built(text):
    def refuse():
        with pytest.raises(ValueError, match="the factor must be a number above 0 and at most 1,000,000"):
            factor_of(text)

    # 10**3000000 as an exact Fraction held 5.6 MB (1.4-2.0 s of CPU per POST); a plain
    # "2" holds under 1 KB.
    assert allocated(refuse) < 32_000


def test_11_a_factor_in_range_is_exact():
    assert factor_of(" 2.5 ") == Decimal("2.5")
    assert factor_of("1e6") == 1_000_000 and factor_of("0.000001") == Decimal("0.000001")


@pytest.mark.parametrize("ops_store", ["database", "redis"], indirect=True)
def test_11_the_bucket_page_answers_a_hostile_factor_with_a_message(ops_store):
    limiter.limit("login", "alice")
    digest = encode_key("alice").digest
    client = client_for(make_user("root", superuser=True))
    url = f"{BUCKETS}key/?name=login&digest={digest}"
    for factor in ("1e3000000", "1e10000000", "nan", "-inf", "1" * 50_000):
        form = {"name": "login", "digest": digest, "next": url, "action": "multiply", "factor": factor}
        content = client.post(f"{BUCKETS}override/", form, follow=True).content.decode()
        assert "Nothing was changed" in content and "at most 1,000,000" in content
        assert len(content) < 20_000 + len(client.get(url).content)  # the factor is not quoted whole
    assert not LimitOverride.objects.exists()


def _login():
    return limiter.resolve("login")


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda text: parse_duration(text), id="duration"),
        pytest.param(lambda text: numbers_from_text(_login(), text, None, None), id="rate text"),
        pytest.param(lambda text: numbers_from_text(_login(), None, Decimal(text), None), id="capacity"),
        pytest.param(lambda text: numbers_from_text(_login(), None, None, Decimal(text)), id="max_reserved"),
        pytest.param(lambda text: limiter.override("login", "x", capacity=Decimal(text)), id="api capacity"),
        pytest.param(lambda text: limiter.override("login", "x", rate=Decimal(text), period=1), id="api rate"),
        pytest.param(lambda text: limiter.override("login", "x", rate=1, period=Decimal(text)), id="api period"),
        pytest.param(lambda text: run("override", "login", "x", "--capacity", text), id="--capacity"),
        pytest.param(lambda text: run("override", "login", "x", "--max-reserved", text), id="--max-reserved"),
        pytest.param(lambda text: run("top", "login", "--since", text), id="--since"),
        pytest.param(lambda text: run("cleanup", "--pause", text), id="--pause"),
        pytest.param(lambda text: run("cleanup", "--max-seconds", text), id="--max-seconds"),
        pytest.param(lambda text: run("cleanup", "--unknown-idle", text, "--remove-unknown"), id="--unknown-idle"),
        pytest.param(lambda text: run("show", "login", text, "--int"), id="--int"),
        pytest.param(lambda text: run("show", "login", text, "--json"), id="--json"),
    ],
)
@pytest.mark.parametrize("text", HOSTILE_NUMBERS, ids=lambda text: text[:12])
def test_11_every_number_the_forms_the_command_and_the_api_parse_is_bounded_first(call, text):
    def attempt():
        try:
            call(text)
        except (ValueError, ImproperlyConfigured, CommandError):
            pass  # what each says is for the tests above; here, what it costs

    assert allocated(attempt) < 2_000_000  # the command's own setup included; 10**3000000 alone is 1.2 MB


# -- O1. --json keys the command cannot read ----------------------------------------------------


@pytest.mark.parametrize(
    "text", ["1" * 5000, "[" * 100_000 + "]" * 100_000, "1e400", "true"], ids=["5000 digits", "nested", "1e400", "true"]
)
@pytest.mark.parametrize("command", ["show", "reset", "block", "unblock"])
def test_o1_a_json_key_the_command_cannot_read_is_a_clear_error(command, text):
    with pytest.raises(CommandError, match=r"--json: .*(not JSON|a JSON key must be)"):
        run(command, "login", text, "--json")  # was: a traceback (ValueError, RecursionError)


def test_o1_an_int_key_of_too_many_digits_is_said_so():
    with pytest.raises(CommandError, match=r"--int: '1111.*\(5,000 characters\) has more than 4,300 digits"):
        run("show", "login", "1" * 5000, "--int")


# -- O2. cleanup's numbers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--pause", "nan", "pause must be"),
        ("--pause", "inf", "pause must be"),
        ("--pause", "-1", "pause must be"),
        ("--pause", "1e10", "pause must be"),
        ("--max-seconds", "nan", "max_seconds must be"),
        ("--max-seconds", "-1", "max_seconds must be"),
        ("--unknown-idle", "inf", "unknown_idle must be"),
        ("--unknown-idle", "1e300", "unknown_idle must be"),
    ],
)
def test_o2_cleanups_numbers_are_checked_before_any_row_goes(option, value, words):
    for n in range(3):
        RateLimit.objects.create(name="retired", key=f"{n:064x}", value=0, ts=0)
    with pytest.raises(CommandError, match=words):
        # was: NaN ran without a deadline; inf, -1 and 1e10 failed after the first batch
        # (a traceback for inf and 1e10); an infinite idle time a traceback
        run("cleanup", option, value, "--batch-size", "1", "--remove-unknown")
    assert RateLimit.objects.count() == 3
    with pytest.raises(ValueError, match=words):
        cleanup(**{option[2:].replace("-", "_"): float(value)}, remove_unknown=True)


# -- O3. a limit option quoted whole ------------------------------------------------------------


@pytest.mark.parametrize("option", ["shards", "shadow", "deny_cache", "backend", "kind"])
def test_o3_a_huge_option_from_a_tenants_plan_is_quoted_short(option):
    with pytest.raises(ImproperlyConfigured, match=rf"rate limit 'plan': .*{option}.*<an integer of 16,610 bits>"):
        limiter.resolve("plan", {"rate": "5/m", option: 10**5000})  # was: "Exceeds the limit (4300 digits)"


# -- O4. what an operator typed, quoted whole in an error ------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda text: parse_duration(text), id="duration"),
        pytest.param(lambda text: factor_of(text), id="factor"),
        pytest.param(lambda text: numbers_from_text(_login(), text, None, None), id="rate text"),
        pytest.param(lambda text: run("block", "login", "x", "--until", text), id="--until"),
        pytest.param(lambda text: run("show", "login", "--key", text), id="--key"),
        pytest.param(lambda text: run("show", "login", text, "--int"), id="--int"),
        pytest.param(lambda text: run("show", "login", text, "--json"), id="--json"),
    ],
)
def test_o4_an_error_quotes_what_was_typed_cut_short(call):
    with pytest.raises((ValueError, CommandError)) as caught:
        call("x" * 100_000)
    assert len(str(caught.value)) < 1_000


def test_o4_the_add_forms_key_is_quoted_short():
    client = client_for(make_user("root", superuser=True))
    # (A plain text is a key as the API takes it; a spec's value is what is checked.)
    response = client.post(f"{ADMIN}add/", add_form(key_text="ip=" + "x" * 100_000))
    assert response.status_code == 200 and "is not an IP address" in errors(response)
    assert len(errors(response)) < 1_000


# -- O5. an end stored before the bound, shown east of UTC --------------------------------------


def test_o5_an_end_stored_past_the_bound_still_shows_everywhere(settings):
    # The API took until=datetime(9999, 12, 31, 23, tzinfo=UTC) before item 4: in Tokyo
    # that end is in year 10000, which no datetime holds.
    settings.TIME_ZONE = "Asia/Tokyo"
    row = LimitOverride.objects.create(
        name="login",
        key=encode_key("eve").digest,
        label="eve",
        action="block",
        expires_at=datetime(9999, 12, 31, 23, 0, tzinfo=UTC),
    )
    assert "in " in run("overrides") and "9999-12-31 23:00:00 UTC" in run("overrides")  # was: OverflowError
    client = client_for(make_user("root", superuser=True))
    assert "9999-12-31 23:00:00 UTC" in client.get(ADMIN).content.decode()  # was: HTTP 500
    assert client.get(f"{ADMIN}{row.pk}/change/").status_code == 200  # was: HTTP 500
    form = {"duration": "", "expires_at_0": "", "expires_at_1": "", "reason": "kept"}
    assert client.post(f"{ADMIN}{row.pk}/change/", form).status_code == 302  # a reason alone saves
    row.refresh_from_db()
    assert row.reason == "kept" and row.expires_at == datetime(9999, 12, 31, 23, 0, tzinfo=UTC)
    limiter.limit("login", "alice")
    page = client.get(f"{CHANGELIST}{RateLimit.objects.get().pk}/change/")
    assert page.status_code == 200
    assert not limiter.limit("login", "eve").ok


# -- O6. a period too long, from the forms, in words about tokens -----------------------------------


def test_o6_a_rate_strings_period_too_long_is_said_in_seconds():
    with pytest.raises(ValueError, match=r"rate limit 'login': period must be .* up to 9007199254 seconds") as caught:
        numbers_from_text(_login(), "1/99999999999999999999999999d", None, None)
    assert "tokens" not in str(caught.value)  # was: "period must be at most 9,007,199,254 tokens"


# -- O7. the command's amounts read as floats ------------------------------------------------------


def test_o7_the_commands_amounts_are_read_exactly_as_the_forms_read_them():
    with pytest.raises(CommandError, match=r"rate limit 'login': override: capacity must have at most 6 decimal"):
        run("override", "login", "x", "--capacity", "1.0000000000000001")  # was: a float, 1.0, accepted
    with pytest.raises(CommandError, match=r"--max-reserved: '1{40}'\.\.\. \(41 characters\) is longer than any"):
        run("override", "login", "x", "--max-reserved", "1" * 41)
    assert not LimitOverride.objects.exists()
    run("override", "login", "x", "--capacity", "2.5", "--max-reserved", "1e1")
    row = LimitOverride.objects.get()
    assert (row.capacity, row.max_reserved) == (2_500_000, 10 * MICRO)


# -- 49.9 the bucket page's message keeps the limit's name as it is written ----------------------


def test_49_9_the_bucket_pages_message_does_not_capitalise_the_limit_name():
    limiter.limit("login", "alice")
    digest = encode_key("alice").digest
    client = client_for(make_user("root", superuser=True))
    form = {"name": "login", "digest": digest, "action": "block", "for": "1h"}
    content = client.post(f"{BUCKETS}override/", form, follow=True).content.decode()
    assert "Login" not in content.split('class="messagelist"')[1].split("</ul>")[0]  # was: "Login key alice: block…"
    assert "Override saved for login key alice: block, always refused" in content
