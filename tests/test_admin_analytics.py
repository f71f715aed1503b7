"""Denial analytics in the admin: the SVG charts (pure), the limits overview and one limit's
page on the database and on Redis with real flushed counts, the most denied keys linking
to their bucket pages, the notes when analytics are off or the store fails, permissions."""

from __future__ import annotations

import html
import re
from urllib.parse import parse_qs, urlsplit

import pytest
from django.conf import settings
from django.test import override_settings

from django_tokenbucket import analytics, limiter, metrics
from django_tokenbucket.admin import charts
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import BackendError, MinuteCounts
from django_tokenbucket.exceptions import BackendUnavailable
from django_tokenbucket.keys import encode_key

from .test_admin import CHANGELIST, client_for, make_user

pytestmark = pytest.mark.django_db(transaction=True)

HOSTILE = '<script>"quoted"</script>'
ATTACKER = '<img src=x onerror="alert(1)">'
LIMITS = {"tight": "3/m", HOSTILE: "2/m", "sharded": {"rate": "40/m", "shards": 4}}


def minutes(counts: list[tuple[int, int]], first: int = 29_000_000) -> list[MinuteCounts]:
    return [MinuteCounts("x", first + index, allowed, denied) for index, (allowed, denied) in enumerate(counts)]


def rects(svg: str, kind: str) -> list[dict[str, float]]:
    return [
        {name: float(value) for name, value in re.findall(r'(x|y|width|height)="([-0-9.]+)"', rect)}
        for rect in re.findall(rf'<rect class="tb-{kind}"[^>]*>', svg)
    ]


# -- the chart, pure ---------------------------------------------------------------------------


def test_a_chart_draws_allowed_and_denied_per_minute_within_its_box():
    counts = minutes([(5, 0), (0, 0), (3, 2), (0, 4)] + [(0, 0)] * 56)
    svg = str(charts.chart_svg(counts, ident="c", heading="Last hour", time_of=lambda m: f"t{m - 29_000_000}"))
    assert svg.startswith("<svg") and 'role="img"' in svg and 'aria-labelledby="c-title"' in svg
    assert 'viewBox="0 0 600 150"' in svg and 'width="100%"' in svg and 'data-bars="60"' in svg
    title = re.search(r'<title id="c-title">([^<]*)</title>', svg).group(1)
    assert title == "Last hour, t0 to t60: 8 allowed, 6 denied. Most denied at t3: 4 of 4."
    allowed, denied = rects(svg, "allowed"), rects(svg, "denied")
    assert len(allowed) == 2 and len(denied) == 2  # empty minutes draw nothing
    base = 150 - 22
    for rect in allowed + denied:
        assert 46 <= rect["x"] and rect["x"] + rect["width"] <= 600 and 8 - 0.01 <= rect["y"]
        assert rect["y"] + rect["height"] <= base + 0.01
    # Heights in proportion: the busiest minute (5) fills the plot, 3 + 2 stack to as much.
    assert allowed[0]["height"] == pytest.approx(120)
    assert allowed[1]["height"] + denied[0]["height"] == pytest.approx(120)
    assert denied[0]["y"] + denied[0]["height"] == pytest.approx(allowed[1]["y"])  # stacked
    assert ">t0<" in svg and ">t60<" in svg and ">5<" in svg and ">per minute<" in svg
    assert "<title>t2: 3 allowed, 2 denied</title>" in svg  # a tooltip per bar


def test_a_spike_keeps_a_single_denial_visible():
    counts = minutes([(1_000_000, 0), (0, 1)] + [(0, 0)] * 58)
    svg = str(charts.chart_svg(counts, ident="c", heading="h", time_of=str))
    assert rects(svg, "allowed")[0]["height"] == pytest.approx(120)
    assert rects(svg, "denied")[0]["height"] >= charts.MIN_VISIBLE
    assert 'data-max="1000000"' in svg and "1,000,000" in svg


def test_an_empty_chart_says_so_and_draws_no_bars():
    svg = str(charts.chart_svg(minutes([(0, 0)] * 60), ident="c", heading="Last hour", time_of=str))
    assert "no calls" in svg and "<rect" not in svg and "<line" in svg
    nothing = str(charts.chart_svg([], ident="c", heading="Last hour"))
    assert "Last hour: no data." in nothing and "<rect" not in nothing


def test_24_hours_are_drawn_in_a_bounded_number_of_bars():
    counts = minutes([(index % 7, index % 3) for index in range(24 * 60)])
    drawn = charts.bars(counts, per=10)
    assert len(drawn) == 144 and sum(bar.total for bar in drawn) == sum(r.allowed + r.denied for r in counts)
    svg = str(charts.chart_svg(counts, ident="d", heading="Last 24 hours", per=10, time_of=str))
    assert 'data-bars="144"' in svg and svg.count("<rect") <= 2 * 144 and ">per 10 min<" in svg
    # However many minutes, never more than MAX_BARS bars.
    assert len(charts.bars(counts, per=1)) <= charts.MAX_BARS
    compact = str(charts.chart_svg(counts[:60], ident="e", heading="h", compact=True, time_of=str))
    assert 'viewBox="0 0 240 44"' in compact and "<text" not in compact and "tb-chart-compact" in compact
    assert 'y1="43"' in compact  # the axis inside the box, not on its edge


def test_every_text_of_a_chart_is_escaped():
    svg = str(charts.chart_svg(minutes([(1, 1)]), ident='x"><script>', heading=HOSTILE, time_of=lambda m: "<b>"))
    assert "<script>" not in svg and "<b>" not in svg and '"quoted"' not in svg
    assert "&lt;script&gt;&quot;quoted&quot;" in svg and "&lt;b&gt;" in svg


# -- the pages, on the stores ------------------------------------------------------------------


@pytest.fixture
def counting(ops_store, monkeypatch):
    """Analytics on (written by flush() only), LIMITS above, nothing counted before."""
    monkeypatch.setattr(analytics, "_minutes", {})
    monkeypatch.setattr(analytics, "_keys", {})
    current = settings.TOKENBUCKET
    with override_settings(
        TOKENBUCKET={**current, "LIMITS": {**current["LIMITS"], **LIMITS}, "ANALYTICS": {"FLUSH": 3600}}
    ):
        yield ops_store


def traffic() -> None:
    """tight (3 a key): alice 3 allowed, the attacker's key 3 allowed and 5 denied, bob 3 and 2;
    the hostile name (2 a key): 2 allowed, 1 denied; sharded: one key denied twice."""
    for key, calls in (("alice", 3), (ATTACKER, 8), ("bob", 5)):
        for _ in range(calls):
            limiter.limit("tight", key)
    for _ in range(3):
        limiter.limit(HOSTILE, "carol")
    denied = 0
    for _ in range(30):  # shards picked at random: denied once the two picked are spent
        denied += not limiter.limit("sharded", "dave", count=10).ok
        if denied == 2:
            break
    assert denied == 2
    # A flusher thread may have written some already: flush() waits for it, then writes the rest.
    analytics.flush()


def page(client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, response.status_code
    return response.content.decode()


def test_the_overview_draws_the_last_hour_of_each_limit(counting):
    traffic()
    content = page(client_for(make_user("viewer", "view_ratelimit")), f"{CHANGELIST}limits/")
    assert "Last hour: allowed, denied" in content
    # Every configured limit has one (the throttles' scopes too), each with its own ids.
    assert content.count('class="tb-chart tb-chart-compact"') >= len(settings.TOKENBUCKET["LIMITS"])
    ids = re.findall(r'<title id="([^"]+)"', content)
    assert len(ids) == len(set(ids))
    tight = re.search(r"“tight”, last hour, per minute, [^<]*", content).group(0)
    assert "9 allowed, 7 denied" in tight
    assert "<script>" not in content and "&lt;script&gt;&quot;quoted&quot;&lt;/script&gt;" in content
    assert "keys known to be denied from memory" in content or "key known to be denied" in content


def test_one_limit_shows_the_hour_the_day_and_the_most_denied_keys(counting):
    traffic()
    client = client_for(make_user("viewer", "view_ratelimit"))
    content = page(client, f"{CHANGELIST}limits/tight/")
    assert 'aria-labelledby="tb-chart-hour-title"' in content and 'aria-labelledby="tb-chart-day-title"' in content
    # The day's ends have the same clock time: its chart names their days of the week.
    day_title = re.search(r'<title id="tb-chart-day-title">([^<]*)</title>', content).group(1)
    assert re.match(r"Last 24 hours, per 10 minutes, \w{3} \d\d:\d\d to \w{3} \d\d:\d\d: 9 allowed", day_title)
    totals = re.findall(r'<th scope="row">Last (?:hour|24 hours)</th><td>(\d+)</td><td>(\d+)</td><td>([^<]+)</td>', content)
    assert totals == [("9", "7", "43.8 %"), ("9", "7", "43.8 %")]
    keys = re.findall(r'<td class="tb-top-key"><a href="([^"]+)">(.*?)</a>(?: <span class="tb-digest"[^>]*>[0-9a-f]{12}…</span>)?</td><td>(\d+)</td>', content, re.S)
    assert [count for _, _, count in keys] == ["5", "2"]
    for (url, shown, _count), key in zip(keys, (ATTACKER, "bob"), strict=True):
        digest = encode_key(key).digest
        link = urlsplit(html.unescape(url))
        assert link.path == f"{CHANGELIST}buckets/default/key/"
        assert parse_qs(link.query) == {"name": ["tight"], "digest": [digest]}
        if counting == "database":  # labels kept: the key as given, escaped (the digest on hover)
            assert shown.endswith(f">{html.escape(key)}</span>") and f"digest: {digest}" in shown
        else:  # Redis keeps no labels: the digest's start
            assert digest[:12] in shown
    assert "<img" not in content and (counting != "database" or "&lt;img src=x onerror=" in content)
    # The link leads to the key's bucket page, with its reset and override forms.
    root = client_for(make_user("root", superuser=True))
    bucket = page(root, html.unescape(keys[0][0]))
    assert "Reset this key" in bucket and 'value="block"' in bucket


def test_a_hostile_limit_name_is_escaped_on_its_page(counting):
    traffic()
    client = client_for(make_user("viewer", "view_ratelimit"))
    overview = page(client, f"{CHANGELIST}limits/")
    url = html.unescape(re.search(r'<a href="([^"]+)">&lt;script&gt;', overview).group(1))
    content = page(client, url)
    assert "<script>" not in content and '"quoted"' not in content.replace('&quot;quoted&quot;', "")
    assert re.search(r'<th scope="row">Last hour</th><td>2</td><td>1</td>', content)


def test_a_sharded_limits_keys_link_to_the_list_of_their_shards(counting):
    traffic()
    content = page(client_for(make_user("viewer", "view_ratelimit")), f"{CHANGELIST}limits/sharded/")
    keys = re.findall(r'<td class="tb-top-key"><a href="([^"]+)">', content)
    assert len(keys) == 1
    link = urlsplit(html.unescape(keys[0]))
    assert link.path == f"{CHANGELIST}buckets/default/"
    assert parse_qs(link.query) == {"name": ["sharded"], "q": [encode_key("dave").digest[:16]]}


def test_with_analytics_off_the_pages_say_how_to_turn_them_on(ops_store):
    client = client_for(make_user("viewer", "view_ratelimit"))
    for url in (f"{CHANGELIST}limits/", f"{CHANGELIST}limits/ten_per_minute/"):
        content = page(client, url)
        assert "Analytics are off" in content and 'TOKENBUCKET["ANALYTICS"]' in content
        assert "docs/settings.md#analytics" in content and "tb-chart" not in content


def test_a_failing_store_is_a_note_not_an_error(counting, monkeypatch):
    backend = get_backend("default")

    def fail(*args, **kwargs):
        raise BackendError("the store is down <b>")

    monkeypatch.setattr(backend, "read_minutes", fail)
    monkeypatch.setattr(backend, "read_denied_keys", fail)
    client = client_for(make_user("viewer", "view_ratelimit"))
    overview = page(client, f"{CHANGELIST}limits/")
    assert "Analytics could not be read from the store" in overview and "the store is down &lt;b&gt;" in overview
    content = page(client, f"{CHANGELIST}limits/tight/")
    assert 'class="errornote">Analytics could not be read' in content and "tb-chart" not in content
    assert "Stored keys" in content  # the rest of the page is there


def test_a_store_without_analytics_says_so(counting, monkeypatch):
    backend = get_backend("default")
    monkeypatch.setattr(type(backend), "keeps_analytics", False)
    content = page(client_for(make_user("viewer", "view_ratelimit")), f"{CHANGELIST}limits/tight/")
    assert f"{type(backend).__name__} keeps no analytics." in content


def test_pending_counts_of_this_process_are_shown(counting):
    limiter.limit("tight", "alice")
    content = page(client_for(make_user("viewer", "view_ratelimit")), f"{CHANGELIST}limits/tight/")
    assert "This process has 1 allowed and 0 denied calls not written yet." in content


def test_staff_without_the_view_permission_is_refused(counting):
    client = client_for(make_user("staff"))
    assert client.get(f"{CHANGELIST}limits/").status_code == 403
    assert client.get(f"{CHANGELIST}limits/tight/").status_code == 403


@pytest.mark.parametrize("ops_store", ["database"], indirect=True)  # a database backend's read
def test_a_failed_read_leaves_the_requests_transaction_usable(counting, monkeypatch):
    """Under ATOMIC_REQUESTS the page runs in a transaction: a read that fails in the
    database (PostgreSQL then refuses every later query of the transaction) is rolled
    back to a savepoint, and the page goes on."""
    from django.db import DatabaseError, connection, transaction

    from django_tokenbucket.admin.denials import limit_denials
    from django_tokenbucket.models import RateLimit
    from django_tokenbucket.registry import known_limits

    backend = get_backend("default")

    def broken(*args, **kwargs):
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT no_such_column FROM django_tokenbucket_ratelimit")
        except DatabaseError as exc:
            raise BackendError(f"read failed: {exc}") from exc

    monkeypatch.setattr(backend, "read_minutes", broken)
    with transaction.atomic():
        denials = limit_denials(known_limits()["tight"], lambda alias, digest: "")
        assert denials.error is not None and "read failed" in denials.error
        assert RateLimit.objects.count() >= 0  # the transaction still answers


def test_this_processes_store_failures_are_shown(db, monkeypatch):
    """A store that refuses connections: the failures this process saw are on the overview."""
    monkeypatch.setattr(metrics, "store_failures", metrics.StoreFailures())
    nowhere = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": "redis://127.0.0.1:1/0",  # nothing listens on port 1: refused at once
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1},
    }
    store = {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "nowhere"}}
    client = client_for(make_user("viewer", "view_ratelimit"))
    with override_settings(
        CACHES={**settings.CACHES, "nowhere": nowhere},
        TOKENBUCKET={**settings.TOKENBUCKET, **store, "ANALYTICS": {"FLUSH": 3600}},
    ):
        for _ in range(2):
            with pytest.raises(BackendUnavailable):
                limiter.limit("ten_per_minute", "alice")
        content = page(client, f"{CHANGELIST}limits/")
    assert "This server process saw 2 failures of the store “default” since it started" in content
    assert "ConnectionError" in content
