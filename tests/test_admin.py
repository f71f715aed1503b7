"""The admin: live state, permissions (RELIABILITY-PLAN S7), resets, filters, escaping."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connections
from django.test import Client
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from django_tokenbucket import admin as tb_admin
from django_tokenbucket import limiter
from django_tokenbucket.algorithms import MICRO, State
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.database.filters import count_by_state, state_q
from django_tokenbucket.backends.redis import RedisBackend
from django_tokenbucket.keys import encode_key
from django_tokenbucket.limits import FIXED_WINDOW, TOKEN_BUCKET, LimitConfig
from django_tokenbucket.live import FULL, LIMITED, PARTIAL, STATES, cleanup_span, live_state, one_token
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock

from .redis_servers import other_keys

pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_700_000_000.0
CHANGELIST = "/admin/django_tokenbucket/ratelimit/"
XSS = "<script>alert(1)</script>"


def make_user(username: str, *codenames: str, staff: bool = True, superuser: bool = False) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=staff, is_superuser=superuser)
    if codenames:
        user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user


def client_for(user: User | None, **kwargs) -> Client:
    client = Client(**kwargs)
    if user is not None:
        client.force_login(user)
    return client


def store(name: str, key: object, value_tokens: float, ts: float) -> RateLimit:
    encoded = encode_key(key)
    return RateLimit.objects.create(
        name=name, key=encoded.digest, label=encoded.label, value=round(value_tokens * MICRO), ts=round(ts * MICRO)
    )


@pytest.fixture
def rows():
    """Rows of ten_per_minute (10 per 60 s) at T0: empty, partly used, full; one unknown; one hostile label."""
    return {
        "empty": store("ten_per_minute", "alice", 0, T0),
        "partial": store("ten_per_minute", "bob", 4, T0),
        "full": store("ten_per_minute", "carol", 10, T0 - 600),
        "unknown": store("removed_limit", "dave", 1, T0),
        "xss": store("login", XSS, 2, T0),
    }


def reset_post(ids, action="reset_selected", **extra):
    return {"action": action, "_selected_action": [str(i) for i in ids], "index": "0", **extra}


# -- permissions ---------------------------------------------------------------------------


def test_anonymous_is_sent_to_the_login_page(rows):
    response = Client().get(CHANGELIST)
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    response = Client().post(CHANGELIST, reset_post([rows["empty"].pk]))
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    assert RateLimit.objects.filter(pk=rows["empty"].pk).exists()


def test_staff_without_permissions_is_refused(rows):
    client = client_for(make_user("staff"))
    assert client.get(CHANGELIST).status_code == 403
    assert client.get(f"{CHANGELIST}{rows['empty'].pk}/change/").status_code == 403
    assert client.get(f"{CHANGELIST}limits/").status_code == 403


def test_view_permission_lists_but_cannot_reset(rows):
    client = client_for(make_user("viewer", "view_ratelimit"))
    with frozen_clock(T0):
        response = client.get(CHANGELIST)
    assert response.status_code == 200
    content = response.content.decode()
    assert "alice" in content and "bob" in content
    assert "reset_selected" not in content and "set_tokens" not in content  # no actions offered
    with frozen_clock(T0):
        detail = client.get(f"{CHANGELIST}{rows['empty'].pk}/change/")
    assert detail.status_code == 200 and "Reset this key" not in detail.content.decode()

    assert client.post(CHANGELIST, reset_post([rows["empty"].pk])).status_code == 403
    assert client.post(f"{CHANGELIST}{rows['empty'].pk}/reset/").status_code == 403
    assert RateLimit.objects.filter(pk=rows["empty"].pk).exists()
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize("codename", ["change_ratelimit", "reset_ratelimit"])
def test_change_or_reset_permission_resets_by_post_and_logs_each_key(rows, codename):
    user = make_user("operator", codename)  # either one implies viewing
    client = client_for(user)
    with frozen_clock(T0):
        listing = client.get(CHANGELIST)
        assert "reset_selected" in listing.content.decode()
        response = client.post(CHANGELIST, reset_post([rows["empty"].pk, rows["partial"].pk]))
    assert response.status_code == 302
    assert set(RateLimit.objects.values_list("label", flat=True)) == {"carol", "dave", XSS}
    # object_id is text: "100" sorts before "99", and a database's ids pass 99 in a long run.
    entries = sorted(LogEntry.objects.all(), key=lambda entry: int(entry.object_id))
    assert [(e.user_id, e.action_flag, e.object_id) for e in entries] == [
        (user.pk, DELETION, str(rows["empty"].pk)),
        (user.pk, DELETION, str(rows["partial"].pk)),
    ]
    assert "held 0 of 10 tokens" in entries[0].change_message
    assert "held 4 of 10 tokens" in entries[1].change_message
    with frozen_clock(T0):
        assert limiter.get_value("ten_per_minute", "alice") == 10  # full again


def test_reset_from_the_detail_page_is_post_only(rows):
    client = client_for(make_user("root", staff=True, superuser=True))
    url = f"{CHANGELIST}{rows['empty'].pk}/reset/"
    assert client.get(url).status_code == 405
    assert RateLimit.objects.filter(pk=rows["empty"].pk).exists()
    with frozen_clock(T0):
        detail = client.get(f"{CHANGELIST}{rows['empty'].pk}/change/").content.decode()
    assert f'action="{url}"' in detail
    response = client.post(url)
    assert response.status_code == 302 and response["Location"] == CHANGELIST
    assert not RateLimit.objects.filter(pk=rows["empty"].pk).exists()
    assert LogEntry.objects.get().action_flag == DELETION


def test_an_action_in_a_get_request_changes_nothing(rows):
    client = client_for(make_user("root", superuser=True))
    query = f"?action=reset_selected&_selected_action={rows['empty'].pk}&index=0"
    response = client.get(CHANGELIST + query)
    assert response.status_code in (200, 302)
    assert RateLimit.objects.count() == 5 and not LogEntry.objects.exists()


def test_csrf_token_is_required(rows):
    client = client_for(make_user("root", superuser=True), enforce_csrf_checks=True)
    refused = client.post(CHANGELIST, reset_post([rows["empty"].pk]))
    assert refused.status_code == 403
    assert client.post(f"{CHANGELIST}{rows['empty'].pk}/reset/").status_code == 403
    assert RateLimit.objects.filter(pk=rows["empty"].pk).exists()

    with frozen_clock(T0):
        page = client.get(CHANGELIST)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode()).group(1)
    accepted = client.post(CHANGELIST, reset_post([rows["empty"].pk], csrfmiddlewaretoken=token))
    assert accepted.status_code == 302
    assert not RateLimit.objects.filter(pk=rows["empty"].pk).exists()


def test_hostile_key_labels_are_escaped(rows):
    client = client_for(make_user("root", superuser=True))
    for url in (CHANGELIST, f"{CHANGELIST}{rows['xss'].pk}/change/", f"{CHANGELIST}?q=script"):
        with frozen_clock(T0):
            content = client.get(url).content.decode()
        assert XSS not in content
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in content


# -- what a row shows ----------------------------------------------------------------------


def row_html(content: str, label: str) -> str:
    [row] = [r for r in re.findall(r"<tr>.*?</tr>", content, re.S) if f">{label}<" in r]
    return row


def test_rows_show_the_value_derived_now_not_the_stored_one(rows):
    client = client_for(make_user("root", superuser=True))
    with frozen_clock(T0 + 30):  # 10 per 60 s: 30 s later alice has 5, bob 9
        content = client.get(CHANGELIST).content.decode()
    alice = row_html(content, "alice")
    assert ">5.00<" in alice and 'value="5000000"' in alice and "50%" in alice
    assert "in 30 s" in alice  # full again
    bob = row_html(content, "bob")
    assert ">9.00<" in bob and "in 6 s" in bob
    carol = row_html(content, "carol")
    assert ">10.00<" in carol and "full" in carol and "100%" in carol
    dave = row_html(content, "dave")
    assert "not configured" in dave and "removed_limit" in dave

    with frozen_clock(T0 + 3):  # alice has 0.5: limited, the next token comes at T0 + 6
        alice = row_html(client.get(CHANGELIST).content.decode(), "alice")
    assert ">0.50<" in alice and "next token in 3 s" in alice and "in 57 s" in alice


def test_last_update_is_shown_in_the_projects_time_zone(rows, settings):
    settings.TIME_ZONE = "Asia/Tokyo"
    client = client_for(make_user("root", superuser=True))
    with frozen_clock(T0):
        detail = client.get(f"{CHANGELIST}{rows['empty'].pk}/change/").content.decode()
    assert "2023-11-15 07:13:20 JST" in detail  # T0 is 2023-11-14 22:13:20 UTC


def test_long_labels_are_shortened_with_the_whole_label_on_hover():
    long_key = "x" * 30 + "y" * 30
    store("login", long_key, 1, T0)
    client = client_for(make_user("root", superuser=True))
    with frozen_clock(T0):
        content = client.get(CHANGELIST).content.decode()
    assert "x" * 30 + "y" * 9 + "…" in content
    assert f'title="{long_key}' in content


def test_the_list_never_counts_the_whole_table(rows):
    client = client_for(make_user("root", superuser=True))
    with frozen_clock(T0), CaptureQueriesContext(connections["default"]) as queries:
        assert client.get(CHANGELIST).status_code == 200
    counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT" in sql.upper() for sql in counts), counts
    # Rows are interpreted in Python at one clock reading: no query per row.
    for i in range(20):
        store("login", f"more-{i}", 1, T0)
    with frozen_clock(T0), CaptureQueriesContext(connections["default"]) as more:
        client.get(CHANGELIST)
    assert len(more.captured_queries) == len(queries.captured_queries)


def test_past_the_count_cap_the_list_says_more_than(rows, monkeypatch):
    monkeypatch.setattr(tb_admin.CappedPaginator, "cap", 3)
    client = client_for(make_user("root", superuser=True))
    with frozen_clock(T0):
        content = client.get(CHANGELIST).content.decode()
    assert "more than 3 rate limits" in content
    with frozen_clock(T0):
        content = client.get(CHANGELIST + "?name=ten_per_minute&state=full").content.decode()
    assert "1 rate limit" in content and "more than" not in content


# -- filters and search --------------------------------------------------------------------


def listed(client: Client, query: str, at: float = T0) -> set[str]:
    with frozen_clock(at):
        response = client.get(CHANGELIST + query)
    assert response.status_code == 200
    return {label for label in ("alice", "bob", "carol", "dave") if f">{label}<" in response.content.decode()} | (
        {"xss"} if "&lt;script&gt;" in response.content.decode() else set()
    )


def test_request_keys_show_as_the_command_and_the_search_take_them():
    # ('ip', '127.0.0.1') could not be pasted into --key or the search (issue 33).
    store("login", ("ip", "203.0.113.7"), 1, T0)
    store("login", ("user", 42), 1, T0)
    # A row labelled before labels took this form.
    RateLimit.objects.create(
        name="login", key=encode_key(("ip", "198.51.100.4")).digest, label="('ip', '198.51.100.4')", value=0, ts=0
    )
    client = client_for(make_user("root", superuser=True))
    with frozen_clock(T0):
        content = client.get(CHANGELIST).content.decode()
        for shown in ("ip=203.0.113.7", "user=42", "ip=198.51.100.4"):
            assert f">{shown}<" in content
            # What is shown finds the row in the search, as it does with the command's --key.
            found = client.get(CHANGELIST + "?q=" + shown).content.decode()
            assert f">{shown}<" in found and found.count('class="tb-key"') == 1
    assert "(&#x27;ip&#x27;" not in content


def test_filter_by_state_now(rows):
    client = client_for(make_user("root", superuser=True))
    assert listed(client, "?state=limited") == {"alice"}
    assert listed(client, "?state=partial") == {"bob", "xss"}
    assert listed(client, "?state=full") == {"carol"}
    assert listed(client, "?state=unconfigured") == {"dave"}
    # 60 s later everything configured has refilled.
    assert listed(client, "?state=full", at=T0 + 60) == {"alice", "bob", "carol", "xss"}


def test_filter_by_name_and_search_by_key(rows):
    client = client_for(make_user("root", superuser=True))
    assert listed(client, "?name=ten_per_minute") == {"alice", "bob", "carol"}
    assert listed(client, "?name=removed_limit") == {"dave"}
    assert listed(client, "?q=ALI") == {"alice"}
    assert listed(client, f"?q={rows['partial'].key}") == {"bob"}  # a digest finds its key


# -- set tokens ----------------------------------------------------------------------------


def test_set_tokens_asks_then_sets_the_value_now(rows):
    user = make_user("operator", "view_ratelimit", "reset_ratelimit")
    client = client_for(user)
    ids = [rows["full"].pk, rows["unknown"].pk]
    with frozen_clock(T0):
        form = client.post(CHANGELIST, reset_post(ids, action="set_tokens"))
    assert form.status_code == 200 and 'name="tokens"' in form.content.decode()
    assert RateLimit.objects.get(pk=rows["full"].pk).value == 10 * MICRO  # nothing yet
    data = {"action": "set_tokens", "_selected_action": [str(i) for i in ids], "apply": "yes", "tokens": "2.5"}
    with frozen_clock(T0):
        assert client.post(CHANGELIST, data).status_code == 302
        assert limiter.get_value("ten_per_minute", "carol") == 2.5
    with frozen_clock(T0 + 6):
        assert limiter.get_value("ten_per_minute", "carol") == 3.5  # refills from then on
    entry = LogEntry.objects.get()
    assert entry.action_flag == CHANGE and "Set tokens to 2.5 (was 10)" in entry.change_message
    assert RateLimit.objects.get(pk=rows["unknown"].pk).value == 1 * MICRO  # not configured: skipped


def test_set_tokens_is_capped_at_the_capacity(rows):
    client = client_for(make_user("root", superuser=True))
    data = {"action": "set_tokens", "_selected_action": [str(rows["empty"].pk)], "apply": "yes", "tokens": "99"}
    with frozen_clock(T0):
        client.post(CHANGELIST, data)
        assert limiter.get_value("ten_per_minute", "alice") == 10


def test_actions_on_too_many_rows_are_refused(rows, monkeypatch):
    monkeypatch.setattr(tb_admin.buckets, "MAX_ACTION_ROWS", 2)
    client = client_for(make_user("root", superuser=True))
    response = client.post(CHANGELIST, reset_post([r.pk for r in rows.values()], select_across="1"), follow=True)
    assert "More than 2 keys selected" in response.content.decode()
    assert RateLimit.objects.count() == 5 and not LogEntry.objects.exists()


# -- the per-limit pages -------------------------------------------------------------------


def test_limits_overview_and_one_limit(rows):
    client = client_for(make_user("viewer", "view_ratelimit"))
    with frozen_clock(T0):
        overview = client.get(f"{CHANGELIST}limits/").content.decode()
    assert "token bucket: 10 per minute, capacity 10" in overview
    assert "removed_limit" in overview and "not configured" in overview
    with frozen_clock(T0):
        page = client.get(f"{CHANGELIST}limits/ten_per_minute/")
    content = page.content.decode()
    assert page.status_code == 200
    counts = dict(re.findall(r'<th scope="row">([^<]+)</th><td>(?:<a [^>]*>)?(\d+)', content))
    assert counts == {"Stored keys": "3", "limited (less than one token)": "1", "partially used": "1", "full": "1"}
    assert client.get(f"{CHANGELIST}limits/no_such_limit/").status_code == 404


# -- the state filter is exact on every database -------------------------------------------

amounts = st.integers(min_value=1, max_value=10**7).map(lambda n: n * 1000)


def boundary(limit: LimitConfig, value: int, target: int) -> int:
    """Return the elapsed time after which a row holding ``value`` holds ``target``."""
    missing = max(0, target - value)
    if limit.kind == FIXED_WINDOW:
        return -(-missing // limit.rate) * limit.period
    return -(-missing * limit.period // limit.rate)


@st.composite
def configs(draw, name):
    kind = draw(st.sampled_from([TOKEN_BUCKET, FIXED_WINDOW]))
    rate = draw(amounts)
    capacity = draw(st.one_of(st.just(rate), amounts))
    period = draw(st.sampled_from([1, 7, 60, 3600, 86_400])) * MICRO + draw(st.sampled_from([0, 1, 999]))
    start = draw(st.integers(0, 10**9)) if kind == FIXED_WINDOW else None
    return LimitConfig(name=name, kind=kind, rate=rate, period=period, capacity=capacity, start=start)


def test_state_filter_is_exact_where_products_pass_2_to_the_53():
    """A window of an hour and a µs refilling 31.925 tokens: rate × period is ~1.1e17.

    SQLite's MOD() answers a float, and a float product rounds; the filter must not.
    """
    now = round(T0 * MICRO)
    limit = LimitConfig(
        name="limit1", kind=FIXED_WINDOW, rate=31_925_000, period=3_600_000_001, capacity=31_925_000, start=0
    )
    ts = now - 4_399_527_779  # one window start (and 799.5 s) ago, on the phase
    assert ts % limit.period == 0  # start=0: windows start on multiples of the period
    row = RateLimit.objects.create(name=limit.name, key=encode_key("k").digest, label="k", value=0, ts=ts)
    assert live_state(limit, State(0, ts), row.key, now).state == FULL
    assert list(RateLimit.objects.filter(state_q([limit], FULL, now)).values_list("pk", flat=True)) == [row.pk]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_state_filter_agrees_with_the_value_derived_now(data):
    RateLimit.objects.all().delete()
    now = round(T0 * MICRO)
    limits = [data.draw(configs(f"limit{i}"), f"config {i}") for i in range(2)]
    expected = {}
    for i in range(6):
        limit = data.draw(st.sampled_from(limits))
        value = data.draw(st.one_of(st.integers(-limit.capacity, limit.capacity + 5), st.just(0)))
        # Elapsed times anywhere up to twice the refill time, and right at the
        # boundaries where the row becomes non-limited or full (off by one either way).
        boundaries = [boundary(limit, value, target) for target in (one_token(limit), limit.capacity)]
        elapsed = data.draw(
            st.one_of(
                st.integers(-limit.period, 2 * cleanup_span(limit)),
                st.sampled_from(boundaries).flatmap(lambda b: st.sampled_from([b - 1, b, b + 1])),
            )
        )
        ts = now - elapsed
        digest = encode_key(f"k{i}").digest
        if limit.kind == FIXED_WINDOW:
            # Rows written under the current config start on the key's window phase (see
            # at_least_q for rows left over from another period or start).
            ts -= (ts - limit.window_offset(digest)) % limit.period
        row = RateLimit.objects.create(name=limit.name, key=digest, label=f"k{i}", value=value, ts=ts)
        expected[row.pk] = live_state(limit, State(value, ts), digest, now).state
        event(f"{limit.kind}: {expected[row.pk]}")
    for state in STATES:
        found = set(RateLimit.objects.filter(state_q(limits, state, now)).values_list("pk", flat=True))
        assert found == {pk for pk, s in expected.items() if s == state}, state
    names = dict(RateLimit.objects.values_list("pk", "name"))
    counted = count_by_state(RateLimit.objects.all(), limits, now)
    for name, counts in counted.items():
        mine = [state for pk, state in expected.items() if names[pk] == name]
        assert counts == {"stored": len(mine), **{state: mine.count(state) for state in (LIMITED, PARTIAL, FULL)}}


# -- every backend: the buckets views (run on Redis Cluster too, by test_redis_cluster.py) ---

BUCKETS = f"{CHANGELIST}buckets/default/"


def digests_listed(content: str) -> list[str]:
    return re.findall(r"digest=([0-9a-f]{64})", content)


def all_pages(client: Client, name: str, **search: str) -> tuple[list[str], int]:
    """Every digest listed for ``name``, following the "Next page" links; and the pages read."""
    url, query, found, pages = BUCKETS, {"name": name, **search}, [], 0
    while True:
        response = client.get(url, query)
        assert response.status_code == 200
        content = response.content.decode()
        found += digests_listed(content)
        pages += 1
        following = re.search(r'href="([^"]+)" class="tb-next-page"', content)
        if following is None:
            return found, pages
        url, query = following.group(1).replace("&amp;", "&"), {}


def test_buckets_of_every_backend_page_by_page(ops, monkeypatch):
    monkeypatch.setattr(tb_admin.RateLimitAdmin, "bucket_page_size", 10)
    keys = [f"user{i}" for i in range(35)]
    for key in keys:
        limiter.limit("ten_per_minute", key, count=4)
    client = client_for(make_user("viewer", "view_ratelimit"))
    found, pages = all_pages(client, "ten_per_minute")
    # More keys than a page holds: several pages, every key listed once.
    assert sorted(set(found)) == sorted(encode_key(key).digest for key in keys)
    assert pages >= 2
    # A digest prefix is searched page by page too (on Redis a SCAN with its own MATCH).
    wanted = encode_key("user7").digest
    assert set(all_pages(client, "ten_per_minute", q=wanted[:9])[0]) == {wanted}
    first = client.get(BUCKETS, {"name": "ten_per_minute"}).content.decode()
    assert "6.00 of 10" in first and "in 24 s" in first  # the value now and when full again
    assert 'name="_selected_action"' not in first  # a viewer gets no reset controls


def test_the_banner_says_what_a_backend_cannot_show(ops, ops_store):
    limiter.limit("ten_per_minute", "alice")
    content = client_for(make_user("root", superuser=True)).get(BUCKETS, {"name": "ten_per_minute"}).content.decode()
    if ops_store == "database":
        # Rows keep labels and are counted by index: nothing to warn about.
        assert 'class="tb-elsewhere"' not in content and ">alice<" in content
    else:
        assert "RedisBackend keeps no readable key labels: keys show as their digest" in content
        assert "Keys are not counted or filtered by state here" in content
        assert ">alice<" not in content and encode_key("alice").digest[:12] in content


def test_search_inspect_and_reset_one_key(ops):
    limiter.limit("odd name/ü", "alice", count=5)
    limiter.limit("odd name/ü", "bob", count=2)
    root = make_user("operator", "reset_ratelimit")
    client = client_for(root)
    digest = encode_key("alice").digest
    for term in ("alice", digest, digest[:10]):
        found = client.get(BUCKETS, {"name": "odd name/ü", "q": term}).content.decode()
        assert set(digests_listed(found)) == {digest}, term
    detail = client.get(f"{BUCKETS}key/", {"name": "odd name/ü", "digest": digest}).content.decode()
    assert "Tokens now</th><td>0</td>" in detail and "Full again</th><td>in 1 min<br>" in detail
    assert "Next token</th><td>in 12 s</td>" in detail and "Stored ts (µs since the epoch)</th><td>1700000000000000<" in detail
    assert digest in detail and "Reset this key" in detail
    assert client.get(f"{BUCKETS}reset/").status_code == 405
    response = client.post(f"{BUCKETS}reset/", {"name": "odd name/ü", "_selected_action": [digest]})
    assert response.status_code == 302
    assert limiter.get_value("odd name/ü", "alice") == 5 and limiter.get_value("odd name/ü", "bob") == 3
    entry = LogEntry.objects.get()
    assert (entry.user_id, entry.action_flag, entry.object_id) == (root.pk, DELETION, f"default:odd name/ü:{digest}")


def test_reset_every_key_of_a_sharded_limit_after_a_confirmation(ops):
    for key in ("alice", "bob", "carol"):
        limiter.limit("hot", key, count=15)
        limiter.limit("ten_per_minute", key)
    client = client_for(make_user("operator", "reset_ratelimit"))
    # A sharded key is found by the key as callers give it: its shards are listed.
    shards = digests_listed(client.get(BUCKETS, {"name": "hot", "q": "alice"}).content.decode())
    assert 1 <= len(set(shards)) <= 2
    asked = client.post(f"{BUCKETS}reset/", {"name": "hot", "all": "1"})
    assert asked.status_code == 200 and "Reset every stored key of “hot”" in asked.content.decode()
    assert limiter.get_value("hot", "alice") < 40  # nothing reset before the confirmation
    done = client.post(f"{BUCKETS}reset/", {"name": "hot", "all": "1", "confirm": "yes"})
    assert done.status_code == 302
    assert all(limiter.get_value("hot", key) == 40 for key in ("alice", "bob", "carol"))
    assert limiter.get_value("ten_per_minute", "alice") == 9  # another limit: untouched
    assert digests_listed(client.get(BUCKETS, {"name": "hot"}).content.decode()) == []
    assert "Reset all" in LogEntry.objects.get().change_message


def test_resets_need_the_permission_post_and_csrf(ops):
    limiter.limit("ten_per_minute", "alice", count=10)
    digest = encode_key("alice").digest
    form = {"name": "ten_per_minute", "_selected_action": [digest]}
    assert Client().get(BUCKETS).status_code == 302  # to the login page
    assert client_for(make_user("staff")).get(BUCKETS).status_code == 403
    viewer = client_for(make_user("viewer", "view_ratelimit"))
    assert viewer.post(f"{BUCKETS}reset/", form).status_code == 403
    assert viewer.post(f"{BUCKETS}reset/", {"name": "ten_per_minute", "all": "1", "confirm": "yes"}).status_code == 403
    strict = client_for(make_user("root", superuser=True), enforce_csrf_checks=True)
    assert strict.post(f"{BUCKETS}reset/", form).status_code == 403
    assert limiter.get_value("ten_per_minute", "alice") == 0 and not LogEntry.objects.exists()
    page = strict.get(BUCKETS, {"name": "ten_per_minute"}).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    assert strict.post(f"{BUCKETS}reset/", {**form, "csrfmiddlewaretoken": token}).status_code == 302
    assert limiter.get_value("ten_per_minute", "alice") == 10


def test_unknown_backends_limits_and_cursors_are_not_found(ops):
    client = client_for(make_user("root", superuser=True))
    assert client.get(f"{CHANGELIST}buckets/nowhere/").status_code == 404
    assert client.get(BUCKETS, {"name": "no_such_limit"}).status_code == 404
    assert client.get(BUCKETS, {"name": "login", "cursor": "not a cursor"}).status_code in (200, 404)


# -- Redis: pages of a keyspace that holds more than the buckets ----------------------------

#: What a page of Redis keys says of how far its SCAN has gone through the store.
SCANNED = re.compile(
    r'class="tb-scanned">(?:Looked through about (?P<some>\d+|&lt;1)% of the store’s keys so far'
    r"|Nothing found in the ~(?P<none>\d+|&lt;1)% of the store’s keys looked through so far"
    r"|Looked through all of the store’s keys)"
)


@pytest.mark.parametrize("ops_store", ["redis"], indirect=True)
def test_the_first_page_of_redis_keys_shows_buckets_among_a_caches_keys(ops):
    # The usual database: a cache's 10^5 keys beside five buckets. At the defaults the first
    # page shows the buckets its SCAN found (it was 10 calls of COUNT 100, ~1% of the keys:
    # an empty page with a Next link, 19 runs in 20).
    keys = [f"user{i}" for i in range(5)]
    for key in keys:
        limiter.limit("ten_per_minute", key, count=10)  # empty: stored for a minute
    viewer = client_for(make_user("viewer", "view_ratelimit"))
    with other_keys(get_backend().client()):
        first = viewer.get(BUCKETS, {"name": "ten_per_minute"}).content.decode()
        assert digests_listed(first), "the first page shows none of the limit's keys"
        assert SCANNED.search(first) is not None
        found, _pages = all_pages(viewer, "ten_per_minute")
    assert sorted(set(found)) == sorted(encode_key(key).digest for key in keys)


@pytest.mark.parametrize("ops_store", ["redis"], indirect=True)
def test_a_page_that_finds_nothing_yet_says_how_far_it_looked(ops, monkeypatch):
    # A page's SCAN stops at its time budget, found or not: here one call a page.
    monkeypatch.setattr(RedisBackend, "scan_budget", 0.0)
    limiter.limit("ten_per_minute", "alice")
    viewer = client_for(make_user("viewer", "view_ratelimit"))
    with other_keys(get_backend().client()):
        first = viewer.get(BUCKETS, {"name": "ten_per_minute"}).content.decode()
    assert digests_listed(first) == [] and 'class="tb-next-page"' in first
    assert SCANNED.search(first).group("none") is not None


@pytest.mark.parametrize("ops_store", ["redis"], indirect=True)
def test_a_forged_redis_cursor_is_not_found(ops):
    # The cursor of a page link is "<primary> <SCAN cursor>": decimal ASCII digits, a
    # primary of the store, a cursor below 2^64 (Redis refuses larger ones: a store failure).
    limiter.limit("ten_per_minute", "alice")
    viewer = client_for(make_user("viewer", "view_ratelimit"))
    forged = ["0 -1", "0 +5", "0 \uff15", "0 1_0", " 0 5", "0 5 ", "0  5", "0 5\n", "1 0", "0x1 0", "0 0 0"]
    forged += [f"0 {2**64}", "0 " + "9" * 5000, "9" * 5000 + " 0", "0", " "]
    for cursor in forged:
        response = viewer.get(BUCKETS, {"name": "ten_per_minute", "cursor": cursor})
        assert response.status_code == 404, cursor
    # Any cursor Redis could have made is a page from there, within the page's budget.
    for cursor in ("0 0", "0 12345", f"0 {2**64 - 1}"):
        response = viewer.get(BUCKETS, {"name": "ten_per_minute", "cursor": cursor})
        assert response.status_code == 200 and "The store failed" not in response.content.decode(), cursor
