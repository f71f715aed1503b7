"""The admin of runtime overrides (issue 30): the LimitOverride pages, and the block / exempt /
give ×N actions of every bucket page (a database row's, and each backend's: Redis too)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.http import HttpResponse
from django.test import Client

from django_tokenbucket import limiter, overrides
from django_tokenbucket.decorators import ratelimit
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import LimitOverride, OverridesVersion, RateLimit
from django_tokenbucket.testing import frozen_clock

from .test_admin import client_for, make_user

pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_700_000_000.0
ADMIN = "/admin/django_tokenbucket/limitoverride/"
CHANGELIST = "/admin/django_tokenbucket/ratelimit/"
BUCKETS = f"{CHANGELIST}buckets/default/"
ALICE = ("post:username", "alice@example.com")
XSS = "<script>alert(1)</script>"


@pytest.fixture(autouse=True)
def fresh_overrides():
    # A flushed table must not meet a snapshot read before it (docs/api.md).
    overrides.invalidate()
    yield
    overrides.invalidate()


@pytest.fixture
def clock():
    with frozen_clock(T0) as frozen:
        yield frozen


def stamp() -> int:
    return OverridesVersion.objects.get(pk=1).stamp


def add_form(**fields) -> dict:
    return {
        "name": "login",
        "key_text": "",
        "action": "block",
        "rate": "",
        "capacity": "",
        "max_reserved": "",
        "duration": "",
        "expires_at_0": "",
        "expires_at_1": "",
        "reason": "",
        **fields,
    }


def errors(response) -> str:
    content = response.content.decode()
    return " ".join(re.findall(r'<ul class="errorlist[^"]*"[^>]*>(.*?)</ul>', content, re.S))


# -- the LimitOverride pages ---------------------------------------------------------------


def test_permissions_of_the_override_pages(clock):
    limiter.block("login", "eve", reason="stuffing")
    row = LimitOverride.objects.get()
    staff = client_for(make_user("staff"))
    assert staff.get(ADMIN).status_code == 403
    assert staff.post(f"{ADMIN}add/", add_form(key_text="username=bob")).status_code == 403
    viewer = client_for(make_user("viewer", "view_limitoverride"))
    listing = viewer.get(ADMIN).content.decode()
    assert "eve" in listing and "stuffing" in listing
    assert "expire_now" not in listing and f'href="{ADMIN}add/"' not in listing
    assert viewer.post(f"{ADMIN}add/", add_form(key_text="username=bob")).status_code == 403
    assert viewer.post(ADMIN, {"action": "expire_now", "_selected_action": [row.pk]}).status_code in (200, 302)
    assert viewer.post(f"{ADMIN}{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert limiter.limit("login", "eve").override == "block"  # nothing changed
    assert LimitOverride.objects.get().expires_at is None and not LogEntry.objects.exists()


def test_the_list_says_what_each_override_does(clock):
    limiter.override("burst", rate="40/m", reason="launch", created_by="ops")
    limiter.block("login", ("post:username", "Eve@Example.com"), created_by="sec")
    limiter.exempt("login", "partner", until=timedelta(seconds=30))
    LimitOverride.objects.create(name="login", key="ab" * 32, action="exempt")
    limiter.block("login", XSS, reason=XSS)
    content = client_for(make_user("root", superuser=True)).get(ADMIN).content.decode()
    assert XSS not in content and "&lt;script&gt;" in content
    assert "every key" in content and "40 per minute, capacity 20" in content and "launch" in content
    assert "post:username=… (value not stored)" in content and "always refused" in content
    assert "partner" in content and "in 30 s" in content
    assert "abababababab…" in content  # a key known by its digest only
    clock.advance(60)
    content = client_for(make_user("root2", superuser=True)).get(ADMIN).content.decode()
    assert 'class="tb-expired"' in content


def test_filters_and_search(clock):
    limiter.block("login", ("post:username", "eve@example.com"), reason="stuffing")
    limiter.exempt("burst", "partner", reason="contract", created_by="ops")
    client = client_for(make_user("root", superuser=True))

    def listed(**query) -> set[str]:
        content = client.get(ADMIN, query).content.decode()
        return set(re.findall(r'/limitoverride/(\d+)/change/', content))

    block, exempt = (str(LimitOverride.objects.get(action=a).pk) for a in ("block", "exempt"))
    assert listed() == {block, exempt}
    assert listed(action="exempt") == {exempt}
    assert listed(name="login") == {block}
    assert listed(q="contract") == {exempt} and listed(q="ops") == {exempt}
    # Request data is stored as a digest: found by the key as typed, normalised.
    assert listed(q="post:username= EVE@example.com") == {block}
    assert listed(in_force="no") == set()


def test_add_goes_through_the_limiter_with_the_key_normalised(clock):
    user = make_user("operator", "add_limitoverride", "view_limitoverride")
    client = client_for(user)
    before = limiter.limit("login", ALICE)
    assert before.ok and before.override is None
    response = client.post(
        f"{ADMIN}add/",
        add_form(key_text="post:username= Alice@Example.com ", duration="1h", reason="stuffing"),
    )
    assert response.status_code == 302, errors(response)
    row = LimitOverride.objects.get()
    assert (row.action, row.created_by, row.reason) == ("block", "operator", "stuffing")
    assert row.expires_at.timestamp() == T0 + 3600
    status = limiter.limit("login", ALICE)
    assert not status.ok and status.override == "block" and status.retry_after == 3600
    entry = LogEntry.objects.get()
    assert (entry.action_flag, entry.object_id, entry.user_id) == (ADDITION, str(row.pk), user.pk)

    response = client.post(f"{ADMIN}add/", add_form(action="limit", rate="100/m", capacity="150"))
    assert response.status_code == 302, errors(response)
    status = limiter.limit("login", "anyone")
    assert status.override == "limit" and status.capacity == 150 and status.rate == 100


def test_an_override_added_in_the_admin_meets_a_login_posted_in_another_case(clock):
    client = client_for(make_user("root", superuser=True))
    response = client.post(f"{ADMIN}add/", add_form(key_text="post:username=ALICE@example.com ", reason="stuffing"))
    assert response.status_code == 302, errors(response)
    assert Client().post("/login/", {"username": " alice@EXAMPLE.com"}).status_code == 429
    assert Client().post("/login/", {"username": "bob@example.com"}).status_code == 200


def test_add_takes_a_max_reserved_of_zero_and_a_limit_wide_exemption(clock):
    client = client_for(make_user("root", superuser=True))
    response = client.post(f"{ADMIN}add/", add_form(name="reservable", action="limit", max_reserved="0"))
    assert response.status_code == 302, errors(response)
    assert LimitOverride.objects.get().max_reserved == 0
    assert limiter.limit("reservable", "k", count=10).ok
    assert not limiter.limit("reservable", "k", reserve=True).ok  # no debt allowed any more
    response = client.post(f"{ADMIN}add/", add_form(name="burst", action="exempt", key_text=""))
    assert response.status_code == 302, errors(response)
    assert limiter.limit("burst", "anyone").override == "exempt"


def test_a_block_keeps_its_action_and_changes_its_reason(clock):
    row = limiter.block("login", "eve", until=timedelta(hours=1))
    client = client_for(make_user("root", superuser=True))
    page = client.get(f"{ADMIN}{row.pk}/change/").content.decode()
    assert 'name="rate"' not in page and 'name="capacity"' not in page and 'name="reason"' in page
    expires = dict(re.findall(r'name="(expires_at_[01])" value="([^"]*)"', page))
    response = client.post(f"{ADMIN}{row.pk}/change/", {"duration": "", **expires, "reason": "confirmed"})
    assert response.status_code == 302, errors(response)
    row.refresh_from_db()
    assert (row.action, row.reason, row.expires_at.timestamp()) == ("block", "confirmed", T0 + 3600)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"key_text": "ip=nonsense"}, "rate limit &#x27;login&#x27;: key &#x27;ip=nonsense&#x27;: &#x27;nonsense&#x27; is not an IP address"),
        ({"key_text": "[1,", "key_form": "json"}, "key &#x27;[1,&#x27; is not a key as JSON"),
        ({"action": "limit", "rate": "10/fortnight"}, "rate limit &#x27;login&#x27;: override: invalid rate"),
        ({"action": "limit"}, "give at least one of rate"),
        ({"action": "block", "rate": "10/m"}, "apply to the action “limit” only"),
        ({"duration": "soon"}, "is not a duration"),
        ({"duration": "1h", "expires_at_0": "2030-01-01", "expires_at_1": "00:00"}, "not both"),
        ({"expires_at_0": "2020-01-01", "expires_at_1": "00:00"}, "is not in the future"),
        ({"name": "no_such_limit"}, "Select a valid choice"),
    ],
)
def test_add_shows_the_limiters_errors_on_the_form(clock, fields, words):
    response = client_for(make_user("root", superuser=True)).post(f"{ADMIN}add/", add_form(**fields))
    assert response.status_code == 200
    assert words in errors(response)
    assert not LimitOverride.objects.exists() and not LogEntry.objects.exists()


def test_replacing_an_override_from_the_add_form_needs_the_change_permission(clock):
    limiter.block("login", "eve", reason="first", created_by="sec")
    adder = client_for(make_user("adder", "add_limitoverride"))
    response = adder.post(f"{ADMIN}add/", add_form(key_text="post:username=x"))
    assert response.status_code == 302
    limiter.block("login", ("post:username", "y"))
    response = adder.post(f"{ADMIN}add/", add_form(key_text="post:username=y", action="exempt"))
    assert "replacing it needs the permission to change limit overrides" in errors(response)
    changer = client_for(make_user("changer", "add_limitoverride", "change_limitoverride"))
    response = changer.post(f"{ADMIN}add/", add_form(key_text="post:username=y", action="exempt"), follow=True)
    assert "It replaced" in response.content.decode()
    assert limiter.limit("login", ("post:username", "y")).override == "exempt"


def test_change_writes_again_and_bumps_the_version(clock):
    row = limiter.override("login", "tenant", rate="100/m", reason="launch")
    client = client_for(make_user("changer", "change_limitoverride"))
    page = client.get(f"{ADMIN}{row.pk}/change/").content.decode()
    assert 'value="100/m"' in page and "100 per minute, capacity 100" in page
    assert 'name="key_text"' not in page and 'name="name"' not in page  # the limit and key are fixed
    before = stamp()
    form = {"rate": "200/m", "capacity": "", "max_reserved": "", "duration": "2h", "expires_at_0": "",
            "expires_at_1": "", "reason": "launch, extended"}
    response = client.post(f"{ADMIN}{row.pk}/change/", form)
    assert response.status_code == 302, errors(response)
    assert stamp() != before
    row.refresh_from_db()
    assert row.reason == "launch, extended" and row.expires_at.timestamp() == T0 + 7200
    assert limiter.limit("login", "tenant").capacity == 200
    assert LogEntry.objects.get().action_flag == CHANGE
    bad = client.post(f"{ADMIN}{row.pk}/change/", {**form, "rate": "0/m"})
    assert "rate limit &#x27;login&#x27;" in errors(bad)
    # A reason alone changes nothing else, even for an override whose expiry has passed.
    clock.advance(3 * 3600)
    page = client.get(f"{ADMIN}{row.pk}/change/").content.decode()
    expires = dict(re.findall(r'name="(expires_at_[01])" value="([^"]*)"', page))
    response = client.post(
        f"{ADMIN}{row.pk}/change/", {**form, "duration": "", **expires, "rate": "200/m", "reason": "over"}
    )
    assert response.status_code == 302, errors(response)
    row.refresh_from_db()
    assert row.reason == "over" and row.expires_at.timestamp() == T0 + 7200


def test_expire_now_and_delete_bump_the_version(clock):
    limiter.block("login", "a")
    limiter.block("login", "b")
    limiter.exempt("login", "c")
    a, b, c = (LimitOverride.objects.get(label=label) for label in "abc")
    viewer_and_deleter = client_for(make_user("deleter", "view_limitoverride", "delete_limitoverride"))
    client = client_for(make_user("root", superuser=True))
    before = stamp()
    response = client.post(ADMIN, {"action": "expire_now", "_selected_action": [a.pk], "index": "0"})
    assert response.status_code == 302 and stamp() != before
    assert limiter.limit("login", "a").override is None and limiter.limit("login", "b").override == "block"
    a.refresh_from_db()
    assert a.expires_at.timestamp() == T0
    assert LogEntry.objects.get().change_message == "Expired now."

    before = stamp()
    assert viewer_and_deleter.post(f"{ADMIN}{b.pk}/delete/", {"post": "yes"}).status_code == 302
    assert stamp() != before and limiter.limit("login", "b").override is None
    before = stamp()
    response = viewer_and_deleter.post(
        ADMIN, {"action": "delete_selected", "_selected_action": [a.pk, c.pk], "post": "yes", "index": "0"}
    )
    assert response.status_code == 302
    assert stamp() != before and not LimitOverride.objects.exists()
    assert limiter.limit("login", "c").override is None
    assert LogEntry.objects.filter(action_flag=DELETION).count() == 3


# -- bucket pages: a database row's ----------------------------------------------------------


def row_page(client: Client, row: RateLimit) -> str:
    return client.get(f"{CHANGELIST}{row.pk}/change/").content.decode()


def test_a_rows_page_blocks_its_key_with_the_add_permission(clock):
    limiter.limit("login", ALICE)
    row = RateLimit.objects.get()
    viewer = client_for(make_user("viewer", "view_ratelimit"))
    assert "Block this key" not in row_page(viewer, row)
    tool = f'<li><a href="{ADMIN}">Limit overrides</a></li>'
    assert tool not in viewer.get(CHANGELIST).content.decode()
    assert tool in client_for(make_user("both", "view_ratelimit", "view_limitoverride")).get(
        CHANGELIST
    ).content.decode()  # "Limit overrides", beside "Limits overview"
    form = {"name": "login", "digest": row.key, "action": "block", "for": "1h", "reason": "stuffing"}
    assert viewer.post(f"{BUCKETS}override/", form).status_code == 403
    operator = make_user("operator", "view_ratelimit", "add_limitoverride", "view_limitoverride")
    client = client_for(operator)
    page = row_page(client, row)
    assert "No override: the limit's own numbers apply" in page
    assert "Block this key" in page and "Exempt this key" in page and "Give ×N" in page
    assert client.get(f"{BUCKETS}override/", form).status_code == 405
    response = client.post(f"{BUCKETS}override/", {**form, "next": f"{CHANGELIST}{row.pk}/change/"}, follow=True)
    assert response.redirect_chain[-1][0] == f"{CHANGELIST}{row.pk}/change/"
    content = response.content.decode()
    assert "Override saved for login key post:username=… (value not stored): block, always refused" in content
    override = LimitOverride.objects.get()
    assert (override.key, override.created_by, override.reason) == (row.key, "operator", "stuffing")
    assert override.label == row.label
    status = limiter.limit("login", ALICE)
    assert not status.ok and status.override == "block" and status.retry_after == 3600
    # The page shows it, with a link to it.
    assert f"{ADMIN}{override.pk}/change/" in content and "stuffing" in content
    entry = LogEntry.objects.get()
    assert (entry.action_flag, entry.object_id, entry.user_id) == (ADDITION, str(override.pk), operator.pk)
    # Replacing it is changing it.
    assert client.post(f"{BUCKETS}override/", {**form, "action": "exempt"}).status_code == 403
    assert limiter.limit("login", ALICE).override == "block"


def test_bucket_actions_refuse_a_get_a_bad_action_and_a_missing_csrf_token(clock):
    limiter.limit("login", "alice")
    row = RateLimit.objects.get()
    strict = client_for(make_user("root", superuser=True), enforce_csrf_checks=True)
    form = {"name": "login", "digest": row.key, "action": "exempt"}
    assert strict.post(f"{BUCKETS}override/", form).status_code == 403
    page = row_page(strict, row)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    assert strict.post(f"{BUCKETS}override/", {**form, "action": "delete", "csrfmiddlewaretoken": token}).status_code == 403
    assert not LimitOverride.objects.exists()
    assert strict.post(f"{BUCKETS}override/", {**form, "csrfmiddlewaretoken": token}).status_code == 302
    assert limiter.limit("login", "alice").override == "exempt"
    # An unsafe "next" is not followed.
    response = strict.post(
        f"{BUCKETS}override/", {**form, "next": "https://evil.example/", "csrfmiddlewaretoken": token}
    )
    assert response["Location"].startswith(f"{BUCKETS}key/")


def test_bad_input_on_a_bucket_page_is_a_message_naming_the_problem(clock):
    limiter.limit("login", "alice")
    row = RateLimit.objects.get()
    client = client_for(make_user("root", superuser=True))
    form = {"name": "login", "digest": row.key, "next": f"{CHANGELIST}{row.pk}/change/"}
    for fields, words in (
        ({"action": "block", "for": "soon"}, "is not a duration"),
        ({"action": "multiply", "factor": "zero"}, "not a number"),
        ({"action": "multiply", "factor": "0"}, "above 0"),
    ):
        content = client.post(f"{BUCKETS}override/", {**form, **fields}, follow=True).content.decode()
        assert "Nothing was changed" in content and words in content
    assert not LimitOverride.objects.exists()


# -- bucket pages: every backend ----------------------------------------------------------------


def test_give_n_times_and_exempt_from_any_backends_bucket_page(ops, ops_store):
    limiter.limit("ten_per_minute", "alice", count=10)
    digest = encode_key("alice").digest
    client = client_for(make_user("root", superuser=True))
    url = f"{BUCKETS}key/?name=ten_per_minute&digest={digest}"
    page = client.get(url).content.decode()
    assert "Give ×N" in page
    form = {"name": "ten_per_minute", "digest": digest, "next": url}
    response = client.post(f"{BUCKETS}override/", {**form, "action": "multiply", "factor": "10", "for": "7d"})
    assert response.status_code == 302 and response["Location"] == url
    row = LimitOverride.objects.get()
    assert row.label == ("alice" if ops_store == "database" else "")
    # The empty bucket is the same one, refilling ten times as fast: a token in 0.6 s.
    assert limiter.limit("ten_per_minute", "alice").retry_after == 0.6
    ops.advance(0.6)
    status = limiter.limit("ten_per_minute", "alice")
    assert status.ok and status.capacity == 100 and status.rate == 100 and status.override == "limit"
    assert limiter.limit("ten_per_minute", "bob").capacity == 10
    page = client.get(url).content.decode()
    assert "100 per minute, capacity 100" in page and f"{ADMIN}{row.pk}/change/" in page
    client.post(f"{BUCKETS}override/", {**form, "action": "exempt"})
    assert limiter.limit("ten_per_minute", "alice").override == "exempt"
    assert [e.action_flag for e in LogEntry.objects.order_by("pk")] == [ADDITION, CHANGE]


def test_a_key_with_nothing_stored_keeps_its_page_and_can_be_blocked_from_it(ops, ops_store):
    # A key seen denied whose bucket has filled again and, on Redis, expired: the
    # analytics' denied keys link to this page, which must still offer the actions.
    limiter.limit("ten_per_minute", "mallory", count=10)
    limiter.reset("ten_per_minute", "mallory")
    digest = encode_key("mallory").digest
    client = client_for(make_user("root", superuser=True))
    url = f"{BUCKETS}key/?name=ten_per_minute&digest={digest}"
    response = client.get(url)
    page = response.content.decode()
    assert response.status_code == 200
    shown = dict(re.findall(r"<tr><th[^>]*>(.*?)</th><td>(.*?)</td></tr>", page, re.S))
    assert shown["Tokens now"] == shown["Capacity"] == "10" and shown["Key digest"] == digest
    assert shown["Stored state"].startswith("none (reset, or full again and expired)")
    assert "Block this key" in page and "Reset this key" not in page  # nothing to reset
    form = {"name": "ten_per_minute", "digest": digest, "next": url, "action": "block", "for": "1h"}
    assert client.post(f"{BUCKETS}override/", form)["Location"] == url
    assert limiter.limit("ten_per_minute", "mallory").override == "block"
    assert "this key" in client.get(url).content.decode()


def test_a_limit_wide_override_shows_on_each_bucket_page_and_a_shard_offers_no_actions(ops):
    limiter.limit("ten_per_minute", "alice")
    limiter.limit("hot", "alice")
    limiter.block("ten_per_minute", reason="incident")
    client = client_for(make_user("root", superuser=True))
    page = client.get(f"{BUCKETS}key/", {"name": "ten_per_minute", "digest": encode_key("alice").digest})
    assert "every key of this limit" in page.content.decode() and "incident" in page.content.decode()
    shards = re.findall(r"digest=([0-9a-f]{64})", client.get(BUCKETS, {"name": "hot"}).content.decode())
    shard = client.get(f"{BUCKETS}key/", {"name": "hot", "digest": shards[0]}).content.decode()
    assert "one shard of a sharded limit" in shard and "Block this key" not in shard
    response = client.post(f"{BUCKETS}override/", {"name": "hot", "digest": shards[0], "action": "block"}, follow=True)
    assert "is sharded" in response.content.decode()
    assert LimitOverride.objects.count() == 1


def test_with_overrides_off_the_admin_says_so(clock, settings):
    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "OVERRIDES": False}
    limiter.limit("login", "alice")
    row = RateLimit.objects.get()
    client = client_for(make_user("root", superuser=True))
    assert "overrides are off" in errors(client.post(f"{ADMIN}add/", add_form(key_text="post:username=eve")))
    response = client.post(
        f"{BUCKETS}override/", {"name": "login", "digest": row.key, "action": "block"}, follow=True
    )
    assert "Nothing was changed" in response.content.decode() and "overrides are off" in response.content.decode()
    assert not LimitOverride.objects.exists()


def test_with_overrides_off_an_edit_or_an_expiry_says_so_and_writes_nothing(clock, settings):
    # Edits go through overrides.make as new overrides do: no row written that would never apply.
    row = limiter.block("login", "a", reason="abuse")
    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "OVERRIDES": False}
    client = client_for(make_user("root", superuser=True))
    form = {"duration": "", "expires_at_0": "", "expires_at_1": "", "reason": "changed"}
    assert "overrides are off" in errors(client.post(f"{ADMIN}{row.pk}/change/", form))
    response = client.post(ADMIN, {"action": "expire_now", "_selected_action": [row.pk], "index": "0"}, follow=True)
    assert "Nothing was changed" in response.content.decode() and "overrides are off" in response.content.decode()
    row.refresh_from_db()
    assert (row.reason, row.expires_at) == ("abuse", None)


# -- issue 49: the add form reaches the keys the docs use, and says which bucket ------------


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]] if response.context else []


@pytest.mark.parametrize(
    ("typed", "form", "key"),
    [
        ("1", "auto", 1),  # the Quick start's key=request.user.pk; 1 and "1" are one bucket
        ("tenant-7", "auto", "tenant-7"),
        ("ip=203.0.113.9", "text", "ip=203.0.113.9"),  # a key that only looks like a spec
        ('["tenant", 7]', "json", ("tenant", 7)),
    ],
)
def test_the_add_form_names_every_key_the_api_takes(clock, typed, form, key):
    client = client_for(make_user("root", superuser=True))
    response = client.post(f"{ADMIN}add/", add_form(name="ten_per_minute", key_text=typed, key_form=form), follow=True)
    assert response.status_code == 200, errors(response)
    assert limiter.limit("ten_per_minute", key).override == "block"
    assert limiter.limit("ten_per_minute", "someone else").override is None
    reached = [m for m in messages_of(response) if m.startswith("It reaches the bucket")]
    # Nothing had been decided on that key: the operator is told, so a wrong key shows.
    assert len(reached) == 1 and "not stored: no request has used it" in reached[0]


def test_the_add_form_says_when_the_bucket_is_in_use(clock):
    limiter.limit("ten_per_minute", 42)
    client = client_for(make_user("root", superuser=True))
    response = client.post(f"{ADMIN}add/", add_form(name="ten_per_minute", key_text="42"), follow=True)
    assert any("stored: requests have used it" in m for m in messages_of(response))


def test_a_spec_no_view_of_an_inline_limit_keys_by_is_refused_with_the_ones_they_do(clock, client):
    from .views import inline_ip  # noqa: F401  (its decorator declares the limit)

    client.get("/inline-ip/")
    superuser = client_for(make_user("root", superuser=True))
    response = superuser.post(f"{ADMIN}add/", add_form(name="tests.views.inline_ip", key_text="user=1"))
    assert response.status_code == 200
    assert "no view keys it by &#x27;user&#x27;" in errors(response) and "key=&#x27;ip&#x27;" in errors(response)
    assert not LimitOverride.objects.exists()


@ratelimit("signin", key="post:username")
def signin(request):
    """The one view of the ``signin`` limit: a limit's views are what every test module that
    decorates one of its own adds to the registry, so this test keeps a limit of its own."""
    return HttpResponse("ok")


def test_a_spec_no_view_of_a_named_limit_keys_by_is_saved_with_a_warning(clock):
    """``signin`` is in LIMITS: code may decide it with keys of its own, so ``username=`` is
    saved, but the operator learns that its views key by ``post:username``."""
    client = client_for(make_user("root", superuser=True))
    response = client.post(f"{ADMIN}add/", add_form(name="signin", key_text="username=eve"), follow=True)
    assert LimitOverride.objects.count() == 1
    assert any("no view keys it by 'username'" in m and "post:username" in m for m in messages_of(response))
