"""Per-plan rates: ``@ratelimit(rate=callable)``, and limits decided with ``config=``
as the admin, the command and cleanup see them (issue 30, item 5).

A request's plan comes from its ``X-Plan`` header here; a project reads it from the user
or the tenant. Every decorator case runs on the database and on Redis.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import warnings
from io import StringIO
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connection
from django.http import JsonResponse
from django.test import RequestFactory, override_settings
from django.views import View
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from django_tokenbucket import limiter, registry
from django_tokenbucket.algorithms import MICRO
from django_tokenbucket.cleanup import cleanup
from django_tokenbucket.decorators import ratelimit
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import RateLimit
from django_tokenbucket.plans import plan_config, plan_limit
from django_tokenbucket.testing import frozen_clock
from django_tokenbucket.throttling import SimpleRateThrottle, UserRateThrottle

from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_700_000_000.0
ADDRESS = ("ip", "127.0.0.1")

PLANS = {
    "free": "2/m",
    "pro": {"rate": 5, "period": 60},
    "pro-spelled-otherwise": "5/min",
    "partner": None,  # exempt
    "number": 42,
    "nonsense": "two per minute",
}


def plan_rate(request):
    return PLANS[request.headers.get("X-Plan", "free")]


async def async_plan_rate(request):
    return PLANS[request.headers.get("X-Plan", "free")]


def _body(request):
    status = request.ratelimit
    return JsonResponse({"limited": request.limited, "value": None if status is None else status.value})


@ratelimit(key="ip", rate=plan_rate)
def sync_view(request):
    return _body(request)


@ratelimit(key="ip", rate=async_plan_rate)
async def async_view(request):
    return _body(request)


@ratelimit(key="ip", rate=plan_rate)
async def async_view_sync_rate(request):
    return _body(request)


@ratelimit(key="ip", rate=plan_rate)
class ClassView(View):
    def get(self, request):
        return _body(request)


@ratelimit("search", key="ip", rate=plan_rate, block=False)
def named_view(request):
    return _body(request)


VIEWS = {
    "sync": sync_view,
    "async": async_view,
    "async, sync rate": async_view_sync_rate,
    "class": ClassView.as_view(),
}
BASES = {
    "sync": "tests.test_plans.sync_view",
    "async": "tests.test_plans.async_view",
    "async, sync rate": "tests.test_plans.async_view_sync_rate",
    "class": "tests.test_plans.ClassView",
}


def call(view, plan=None, method="get"):
    request = getattr(RequestFactory(), method)("/", **({"HTTP_X_PLAN": plan} if plan else {}))
    if iscoroutinefunction(view):
        return async_to_sync(view)(request)
    return view(request)


def codes(view, plan, n):
    return [call(view, plan).status_code for _ in range(n)]


@pytest.fixture
def redis_store():
    from .redis_servers import delete_keys

    delete_keys()
    yield {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis"}}
    delete_keys()


@pytest.fixture(params=["database", "redis"])
def backend(request):
    """The store of the decisions: the database (the test run's) or Redis."""
    overrides = {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"}
    if request.param == "redis":
        overrides = request.getfixturevalue("redis_store")
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **overrides}):
        yield request.param


@pytest.fixture
def clock():
    with frozen_clock(T0) as frozen:
        yield frozen


def plan_value(base: str, rate: str) -> float:
    """The tokens the bucket of ``base``'s plan ``rate`` holds now, for the test client's address."""
    limit = plan_limit(f"{base}[plan {rate}]")
    assert limit is not None
    return limiter.get_value(limit.name, ADDRESS, config=limit)


# -- the decorator -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(VIEWS))
def test_a_rate_string_a_config_dict_and_none(kind, backend, clock):
    view, base = VIEWS[kind], BASES[kind]
    assert codes(view, "free", 3) == [200, 200, 429]
    assert codes(view, "pro", 6) == [200] * 5 + [429]
    # None exempts: every request passes, nothing is counted, the view is told so.
    responses = [call(view, "partner") for _ in range(10)]
    assert {r.status_code for r in responses} == {200}
    assert json.loads(responses[0].content) == {"limited": False, "value": None}
    assert plan_value(base, "2/60s") == 0 and plan_value(base, "5/60s") == 0
    if backend == "database":
        assert set(RateLimit.objects.values_list("name", flat=True)) == {f"{base}[plan 2/60s]", f"{base}[plan 5/60s]"}


def test_one_config_spelled_two_ways_is_one_bucket(backend, clock):
    assert codes(sync_view, "pro", 3) == [200] * 3
    assert codes(sync_view, "pro-spelled-otherwise", 3) == [200, 200, 429]


def test_a_plan_has_its_own_bucket_and_keeps_it_across_a_switch(backend, clock):
    """Upgrading starts the new plan's bucket (full); the old one keeps its state, read by time."""
    assert codes(sync_view, "free", 3) == [200, 200, 429]
    assert codes(sync_view, "pro", 5) == [200] * 5  # the upgrade: pro's bucket, full
    assert codes(sync_view, "free", 1) == [429]  # back on free: its bucket as it was left
    clock.advance(30)  # free refills a token every 30 s, pro one every 12 s
    assert codes(sync_view, "free", 2) == [200, 429]
    assert codes(sync_view, "pro", 3) == [200, 200, 429]


def test_the_name_given_is_the_prefix_and_block_false_still_applies(backend, clock):
    bodies = [json.loads(call(named_view, "free").content) for _ in range(3)]
    assert [b["limited"] for b in bodies] == [False, False, True]
    assert plan_value("search", "2/60s") == 0


def test_a_block_or_an_exemption_of_the_views_name_reaches_every_plan(backend, clock):
    base = BASES["sync"]
    assert codes(sync_view, "free", 3) == [200, 200, 429]  # denied: remembered in memory
    limiter.exempt(base, ADDRESS)
    assert codes(sync_view, "free", 3) == [200] * 3  # the remembered denial was forgotten
    limiter.block(base, ADDRESS)
    assert codes(sync_view, "pro", 2) == [429, 429]  # a new plan is no way out
    assert plan_value(base, "5/60s") == 5  # a block spends nothing
    # A plan bucket's own override wins over the view's.
    limiter.exempt(f"{base}[plan 5/60s]", ADDRESS)
    assert codes(sync_view, "pro", 2) == [200, 200] and codes(sync_view, "free", 1) == [429]
    assert limiter.clear_override(base, ADDRESS) == 1
    assert codes(sync_view, "free", 1) == [429]  # free's bucket is as the exemption left it
    clock.advance(30)
    assert codes(sync_view, "free", 2) == [200, 429]


def test_other_numbers_for_a_views_name_need_a_plans_bucket(clock):
    with pytest.raises(ImproperlyConfigured, match=re.escape("unknown rate limit 'tests.test_plans.sync_view'")):
        limiter.override(BASES["sync"], ADDRESS, rate="100/m")
    with pytest.raises(ImproperlyConfigured, match=re.escape("unknown rate limit 'tests.test_plans.nope'")):
        limiter.block("tests.test_plans.nope", ADDRESS)


def test_key_none_exempts_before_the_plan_is_asked(backend, clock):
    asked = []

    def rate(request):
        asked.append(request)
        return "1/m"

    view = ratelimit(key=lambda request: None, rate=rate)(lambda request: JsonResponse({}))
    assert codes(view, None, 3) == [200] * 3 and asked == []


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ("number", r"@ratelimit 'tests.test_plans.sync_view': the rate callable tests.test_plans.plan_rate returned 42; "
         r"expected a rate string such as '100/m', a config dict .* or None to exempt the request"),
        ("nonsense", r"@ratelimit 'tests.test_plans.sync_view': the rate callable tests.test_plans.plan_rate returned "
         r"'two per minute': .*invalid rate 'two per minute'"),
    ],
)
def test_a_bad_return_names_the_limit_and_what_came_back(plan, message, clock):
    with pytest.raises(ImproperlyConfigured, match=message):
        call(sync_view, plan)
    assert not RateLimit.objects.exists()


def test_a_bad_config_dict_is_refused(clock):
    view = ratelimit(rate=lambda request: {"rate": "1/m", "capacity": -1})(lambda request: JsonResponse({}))
    with pytest.raises(ImproperlyConfigured, match=r"returned \{'rate': '1/m', 'capacity': -1\}: .*capacity must be"):
        call(view)


def test_a_coroutine_from_a_sync_callable_is_an_error_not_a_warning(clock):
    view = ratelimit(rate=lambda request: async_plan_rate(request))(lambda request: JsonResponse({}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ImproperlyConfigured, match=r"returned <coroutine object async_plan_rate"):
            call(view)


def test_an_async_rate_callable_on_a_sync_view_fails_at_decoration():
    def sync(request):
        return JsonResponse({})

    with pytest.raises(ImproperlyConfigured, match=r"an async def key=, count= or rate= can only be awaited on an async"):
        ratelimit(rate=async_plan_rate)(sync)

    class Api(APIView):
        pass

    with pytest.raises(ImproperlyConfigured, match=r"DRF authenticates synchronously; an async def key=, count= or rate="):
        ratelimit(rate=async_plan_rate)(Api)


def test_the_callable_returns_the_whole_config():
    with pytest.raises(ImproperlyConfigured, match=r"rate=callable.*give none of them to @ratelimit"):
        ratelimit(rate=plan_rate, capacity=10)


def test_a_plan_name_too_long_for_the_store_is_refused(clock):
    view = ratelimit("x" * 190, rate=plan_rate)(lambda request: JsonResponse({}))
    with pytest.raises(ImproperlyConfigured, match=r"longer than 200 characters; give @ratelimit a shorter name="):
        call(view)


def test_stacked_with_a_plain_limit_all_or_nothing(backend, clock):
    view = ratelimit(key="ip", rate="3/m")(ratelimit(key="ip", rate=plan_rate)(lambda request: JsonResponse({})))
    assert codes(view, "free", 3) == [200, 200, 429]
    # The plan refused the third: the outer limit spent nothing on it.
    assert codes(view, "pro", 2) == [200, 429]


# -- plan names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "100/m",
        {"rate": 0.5, "period": 1},
        {"rate": "5/h", "capacity": 2.5, "kind": "fixed window", "start": 0, "max_reserved": 3},
        {"rate": "1000/d", "shards": 4, "backend": "default", "shadow": True, "deny_cache": False},
    ],
)
def test_a_plans_name_reads_back_as_its_config(spec):
    limit = plan_config("app.views.search", spec)
    assert limit.name.startswith("app.views.search[plan ")
    assert plan_limit(limit.name) == limit


@pytest.mark.parametrize(
    "name",
    ["search", "search[plan ]", "search[plan 1e2/60s]", "search[plan 100/60s; capacity=100]",
     "search[plan 100/60s; colour=red]", "search[plan 100/60]", "search[plan 100/60s; shards=4; shards=4]"],
)
def test_only_the_canonical_spelling_is_a_plan(name):
    assert plan_limit(name) is None


# -- the command, the admin's reading and cleanup -------------------------------------------


def run(*args: str) -> str:
    out = StringIO()
    call_command("tokenbucket", *args, stdout=out, stderr=out)
    return out.getvalue()


@pytest.fixture
def elsewhere(monkeypatch):
    """This process as one that never ran the call sites (the command from a shell, cron's
    cleanup, a worker): it has seen no config= and no plan."""
    monkeypatch.setattr(registry, "_inline", {})
    monkeypatch.setattr(registry, "_varied", set())
    monkeypatch.setattr(registry, "_plan_bases", {})
    monkeypatch.setattr(registry, "_load_views", lambda: None)


def store(name: str, key: object, value_tokens: float, ts: float = T0) -> None:
    encoded = encode_key(key)
    RateLimit.objects.create(
        name=name, key=encoded.digest, label=encoded.label, value=round(value_tokens * MICRO), ts=round(ts * MICRO)
    )


def labels() -> set[str]:
    return set(RateLimit.objects.values_list("label", flat=True))


def test_config_at_a_call_site_is_known_in_its_process(clock):
    limiter.limit("partner_quota", "acme", config={"rate": "3/m"}, count=3)
    listing = {line.split()[0]: line for line in run("list").splitlines()}
    assert "token bucket: 3 per minute, capacity 3 [inline]  1 stored key(s)" in listing["partner_quota"]
    assert "tokens now:   0 of 3" in run("show", "partner_quota", "acme")
    assert "stored keys:     1" in run("show", "partner_quota")


def test_config_at_call_sites_elsewhere_is_reported_never_offered_for_deletion(elsewhere, clock):
    store("partner_quota", "acme", 0, T0)
    store("partner_quota", "idle", 3, T0 - 30 * 86400)
    listing = {line.split()[0]: line for line in run("list").splitlines()}
    assert "decided with config= at call sites (not in LIMITS); not readable here  2 stored key(s)" in (
        listing["partner_quota"]
    )
    shown = run("show", "partner_quota")
    assert "partner_quota: decided with config= at call sites (not in LIMITS)" in shown
    assert "stored keys:     2" in shown and "define the limit in TOKENBUCKET['LIMITS']" in shown
    with pytest.raises(CommandError) as excinfo:
        run("show", "partner_quota", "acme")
    for message in (shown, str(excinfo.value)):
        assert "remove-unknown" not in message and "deletes" not in message
    cleaned = run("cleanup")
    assert "Limit 'partner_quota' cannot be read here (decided with config= at call sites (not in LIMITS), or no " \
        "longer used): 2 row(s) kept." in cleaned
    assert "remove-unknown" not in cleaned and labels() == {"acme", "idle"}
    assert "unknown rate limit" not in run("cleanup", "--name", "partner_quota", "--dry-run")
    # The explicit choice (documented in docs/operations.md): rows nothing wrote for a week.
    run("cleanup", "--remove-unknown")
    assert labels() == {"acme"}


def test_a_name_never_used_is_still_unknown(elsewhere):
    with pytest.raises(CommandError, match=r"unknown rate limit 'nope': .*nothing is stored under it"):
        run("show", "nope")


def test_plan_buckets_are_read_in_any_process(elsewhere, clock):
    base = "tests.test_plans.sync_view"
    store(f"{base}[plan 2/60s]", ADDRESS, 0, T0)
    store(f"{base}[plan 2/60s]", ("ip", "10.0.0.9"), 1, T0 - 120)  # full again since
    store(f"{base}[plan 5/60s]", ADDRESS, 4, T0 - 6)
    listing = {line.split("]")[0] + "]": line for line in run("list").splitlines()}
    assert "token bucket: 2 per minute, capacity 2 [plan]  2 stored key(s)" in listing[f"{base}[plan 2/60s]"]
    assert "token bucket: 5 per minute, capacity 5 [plan]  1 stored key(s)" in listing[f"{base}[plan 5/60s]"]
    assert not any("not readable" in line for line in listing.values())
    shown = run("show", f"{base}[plan 5/60s]", "--key", "ip=127.0.0.1")
    assert "tokens now:   4.5 of 5" in shown
    assert "limited now:     1" in run("show", f"{base}[plan 2/60s]")
    report = cleanup()
    assert report.deleted == {f"{base}[plan 2/60s]": 1} and report.unknown == {}
    assert labels() == {"ip=127.0.0.1"}
    only = cleanup(names=[f"{base}[plan 5/60s]"])
    assert only.unknown == {} and not only.deleted and labels() == {"ip=127.0.0.1"}


def test_the_command_lists_the_rate_callables(clock):
    assert re.search(
        r"^tests\.test_plans\.sync_view\[plan \.\.\.\] +a bucket per plan: the rate callable of "
        r"tests\.test_plans\.sync_view$",
        run("list"),
        re.MULTILINE,
    )


def test_plan_rows_in_the_admin_read_as_their_plan(elsewhere, clock, admin_client):
    base = "tests.test_plans.sync_view"
    store(f"{base}[plan 2/60s]", ADDRESS, 1, T0)
    page = admin_client.get("/admin/django_tokenbucket/ratelimit/").content.decode()
    assert ">1.00<" in page and "50%" in page
    assert 'class="tb-unknown"' not in page


def test_one_name_with_several_configs_is_shown_but_not_cleaned(clock):
    limiter.limit("tenant_quota", "a", config={"rate": "10/m"}, count=10)
    limiter.limit("tenant_quota", "b", config={"rate": "1000/d"}, count=1000)
    assert "[inline, several configs seen; shown with the latest]" in run("show", "tenant_quota")
    clock.advance(3600)  # "a" is full again under 10/m; "b" is in debt under 1000/d
    report = cleanup()
    assert report.deleted.get("tenant_quota", 0) == 0 and report.unknown == {"tenant_quota": 2}
    assert labels() == {"a", "b"}


def test_the_registry_is_bounded(monkeypatch):
    monkeypatch.setattr(registry, "_inline", {})
    monkeypatch.setattr(registry, "_INLINE_MAX", 3)
    for i in range(10):
        limiter.resolve(f"bounded_{i}", {"rate": f"{i + 1}/m"})
    assert sorted(registry._inline) == ["bounded_0", "bounded_1", "bounded_2"]


# -- DRF: the recipe of docs/plans.md --------------------------------------------------------


class PlanRateThrottle(UserRateThrottle):
    """docs/plans.md's throttle, the plan read from the X-Plan header."""

    THROTTLE_RATES = {"plan.free": "2/m", "plan.pro": "5/m"}
    scope = "plan.free"

    def get_scopes(self, request, view):
        self.scope = f"plan.{request.headers.get('X-Plan', 'free')}"
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return [self.scope]

    def get_rate(self):
        return self.THROTTLE_RATES[self.scope]


class Plans(APIView):
    throttle_classes = [PlanRateThrottle]

    def get(self, request):
        return Response({"ok": True})


class Burst(SimpleRateThrottle):
    scope = "plans_burst"
    rate = "100/m"

    def get_cache_key(self, request, view):
        return self.get_ident(request)


class PlansAndBurst(APIView):
    """With a sibling asked first, decided together: the plan is asked there too."""

    throttle_classes = [Burst, PlanRateThrottle]

    def get(self, request):
        return Response({"ok": True})


@pytest.mark.parametrize("view", [Plans, PlansAndBurst])
def test_the_drf_recipe_gives_each_plan_its_bucket(view, backend, clock):
    def codes_of(plan, n):
        request = lambda: APIRequestFactory().get("/", headers={"X-Plan": plan})  # noqa: E731
        return [view.as_view()(request()).status_code for _ in range(n)]

    assert codes_of("free", 3) == [200, 200, 429]
    assert codes_of("pro", 6) == [200] * 5 + [429]
    assert limiter.get_value("plan.free", ADDRESS) == 0 and limiter.get_value("plan.pro", ADDRESS) == 0
    if view is PlansAndBurst:  # the refused requests spent nothing on the sibling
        assert limiter.get_value("plans_burst", "127.0.0.1", config={"rate": "100/m"}) == 93


def test_the_drf_recipes_scopes_are_known_everywhere(elsewhere):
    known = registry.known_limits()
    assert known["plan.pro"].source == registry.THROTTLE_RATES and known["plan.pro"].config.rate == 5 * MICRO


# -- a real second process -------------------------------------------------------------------


def run_elsewhere(*args: str) -> str:
    """``manage.py tokenbucket ARGS`` in another OS process, on this test's database: a
    process that has run none of this one's call sites."""
    code = (
        "import sys, django\n"
        "django.setup()\n"
        "from django.conf import settings\n"
        f"settings.DATABASES['default']['NAME'] = {connection.settings_dict['NAME']!r}\n"
        "from django.core.management import call_command\n"
        "call_command('tokenbucket', *sys.argv[1:])\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=root, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def test_another_process_reads_plans_and_keeps_call_site_rows():
    # The other process reads the store's clock, not a pinned one: times are real here.
    base, now = "tests.test_plans.sync_view", time.time()
    assert codes(sync_view, "free", 3) == [200, 200, 429]
    limiter.limit("partner_quota", "acme", config={"rate": "3/m"})
    store(f"{base}[plan 5/60s]", ("ip", "10.0.0.9"), 5, now - 3600)  # idle: full again long since
    store("partner_quota", "old", 3, now - 30 * 86400)
    listing = run_elsewhere("list")
    assert re.search(rf"^{re.escape(base)}\[plan 2/60s\] +token bucket: 2 per minute, capacity 2 \[plan\]  1 stored",
                     listing, re.MULTILINE)
    assert re.search(r"^partner_quota +decided with config= at call sites \(not in LIMITS\); not readable here  2 stored",
                     listing, re.MULTILINE)
    assert "remove-unknown" not in run_elsewhere("show", "partner_quota")
    cleaned = run_elsewhere("cleanup")
    assert f"{base}[plan 5/60s]: 1" in cleaned and "2 row(s) kept" in cleaned and "remove-unknown" not in cleaned
    assert labels() == {"ip=127.0.0.1", "acme", "old"}


def test_show_and_reset_a_plan_key_on_every_backend(backend, elsewhere, clock):
    base = "tests.test_plans.sync_view"
    assert codes(sync_view, "free", 3) == [200, 200, 429]
    assert "tokens now:   0 of 2" in run("show", f"{base}[plan 2/60s]", "--key", "ip=127.0.0.1")
    assert "it starts full again" in run("reset", f"{base}[plan 2/60s]", "--key", "ip=127.0.0.1")
    assert codes(sync_view, "free", 1) == [200]


def test_a_plan_reads_the_same_in_the_process_that_decided_it(clock):
    codes(sync_view, "free", 1)
    listing = {line.split("]")[0] + "]": line for line in run("list").splitlines()}
    assert "capacity 2 [plan]  1 stored key(s)" in listing["tests.test_plans.sync_view[plan 2/60s]"]
