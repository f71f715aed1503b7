"""Attacks on a login and on what responses leak (docs/security.md, "Red-team cases"),
each as an attacker would try it: through ``@ratelimit`` and the DRF throttles.

Every test here failed on the code before the fix it names (issue 18): 1 login buckets
multiplied by respelling the username, 2 stacked limits spending when another refuses,
3 secrets at rest, 4 cacheable 429/503 from DRF, 5 RateLimit headers about someone
else's bucket, 6 unbounded connects and silent settings (test_faults.py, test_checks.py),
7 CORS preflights spending tokens. Run on the database and on Redis.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from django.contrib.auth import get_user_model
from django.http import HttpResponse
from django.test import RequestFactory, override_settings
from django.views.generic import View
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from django_tokenbucket import limiter
from django_tokenbucket.decorators import ratelimit
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock
from django_tokenbucket.throttling import AnonRateThrottle

from .settings import TOKENBUCKET as BASE_SETTINGS

rf = RequestFactory()
T0 = 1_700_000_000.0
BACKENDS = {
    "database": {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"},
    "redis": {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend"},
}
LIMITS = BASE_SETTINGS["LIMITS"]  # "login" is 5/m, "login_ip" 3/m


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, transactional_db):
    overrides = dict(BACKENDS[request.param])
    if request.param == "redis":
        overrides.update(request.getfixturevalue("redis_store"))
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **overrides, "LIMITS": LIMITS, "HEADERS": True}):
        with frozen_clock(T0):
            yield request.param


def login_value(key):
    return limiter.get_value("login", key)


# -- 1. one account, one bucket, however its name is spelled ---------------------------

SPELLINGS = [
    "victim", " victim", "victim ", "  victim", "VICTIM", "Victim", "ｖｉｃｔｉｍ", "𝐯𝐢𝐜𝐭𝐢𝐦",
    "\tvictim\n", "ＶＩＣＴＩＭ", "victim\u00a0", "VicTim",
]


@pytest.mark.parametrize("key", ["post:username", "username"])
def test_1_respelled_usernames_share_the_accounts_bucket(backend, key):
    @ratelimit("login", key=key)
    def login(request):
        return HttpResponse("checked the password")

    codes = [login(rf.post("/", {"username": spelling})).status_code for spelling in SPELLINGS]
    assert codes == [200] * 5 + [429] * 7  # was twelve 200s: one fresh bucket per spelling
    assert login_value((key, "victim")) == 0


def test_1_nfd_and_nfc_spellings_are_one_account(backend):
    @ratelimit("login", key="post:username")
    def login(request):
        return HttpResponse("ok")

    codes = [login(rf.post("/", {"username": name})).status_code for name in ["jose\u0301", "jos\u00e9"] * 3]
    assert codes == [200] * 5 + [429]


def test_1_the_username_key_reads_the_user_models_field(backend):
    assert get_user_model().USERNAME_FIELD == "username"

    @ratelimit("login", key="username")
    def login(request):
        return HttpResponse("ok")

    login(rf.post("/", {"username": " Alice "}))
    assert login_value(("username", "alice")) == 4


@pytest.mark.every_database  # decides on the database backend in its Redis case too
def test_1_case_folding_can_be_turned_off(backend):
    @ratelimit("login", key="header:X-Api-Key")
    def api(request):
        return HttpResponse("ok")

    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **BACKENDS["database"], "LIMITS": LIMITS, "FOLD_KEY_CASE": False}):
        api(rf.get("/", HTTP_X_API_KEY=" Key-A "))
        # Stripped, the value's case kept (a header's name is case-insensitive, so keys carry it in lower case).
        assert limiter.get_value("login", ("header:x-api-key", "Key-A")) == 4


# -- 2. a refused request spends nothing anywhere --------------------------------------


def stacked_login():
    # The order docs/security.md showed: per-username outside, per-IP inside.
    @ratelimit("login", key="post:username")
    @ratelimit("login_ip", key="ip")
    def login(request):
        return HttpResponse("ok")

    return login


def test_2_usernames_refused_by_the_ip_limit_create_no_rows(backend):
    login = stacked_login()
    codes = [login(rf.post("/", {"username": f"user{n}"})).status_code for n in range(12)]
    assert codes == [200] * 3 + [429] * 9
    spent = [n for n in range(12) if login_value(("post:username", f"user{n}")) < 5]
    assert spent == [0, 1, 2]  # was all twelve
    if backend == "database":
        assert RateLimit.objects.filter(name="login").count() == 3  # was 12 rows


def test_2_a_blocked_address_cannot_drain_the_victims_bucket(backend):
    login = stacked_login()
    for n in range(3):
        login(rf.post("/", {"username": f"decoy{n}"}))  # the attacker's address is now spent
    codes = [login(rf.post("/", {"username": "victim"})).status_code for _ in range(6)]
    assert codes == [429] * 6
    assert login_value(("post:username", "victim")) == 5  # was 0.04: the victim locked out


def test_2_the_order_of_stacked_decorators_does_not_matter(backend):
    @ratelimit("login_ip", key="ip")
    @ratelimit("login", key="post:username")
    def login(request):
        return HttpResponse("ok")

    for _ in range(5):
        login(rf.post("/", {"username": "victim"}))
    assert login(rf.post("/", {"username": "other"})).status_code == 429  # per-IP 3/m spent
    assert login_value(("post:username", "other")) == 5
    assert login_value(("post:username", "victim")) == 2  # only the three admitted


# -- 3. no secret at rest --------------------------------------------------------------


def test_3_header_and_form_values_are_never_stored_in_clear(backend):
    @ratelimit("login", key="header:X-Api-Key")
    def api(request):
        return HttpResponse("ok")

    api(rf.get("/", HTTP_X_API_KEY="sk_live_0123456789abcdef"))
    status = limiter.get_status("login", ("header:x-api-key", "sk_live_0123456789abcdef"))
    assert status.value == 4
    if backend == "database":
        row = RateLimit.objects.get(name="login")
        assert "sk_live" not in row.label and "sk_live" not in row.key
        assert row.label == "header:x-api-key=… (value not stored)"
    # Addresses and user ids stay readable.
    assert encode_key(("ip", "192.0.2.7")).label == "ip=192.0.2.7"


def test_3_digests_cannot_be_recovered_by_guessing_without_the_secret(backend):
    address = ("ip", "192.0.2.7")
    unkeyed = hashlib.sha256(b"t2:s2:ips9:192.0.2.7").hexdigest()  # the old, guessable digest
    assert encode_key(address).digest != unkeyed
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "KEY_SECRET": "another-secret-of-32-characters!"}):
        rotated = encode_key(address).digest
    assert rotated != encode_key(address).digest


@pytest.mark.django_db(transaction=True)
def test_3_the_admin_still_finds_a_bucket_by_its_exact_key(admin_client):
    with frozen_clock(T0):
        limiter.limit("login", ("post:username", "alice"))
    for term in ("post:username=Alice", "post:username= alice"):
        page = admin_client.get("/admin/django_tokenbucket/ratelimit/", {"q": term})
        assert page.status_code == 200 and "1 rate limit" in page.content.decode(), term
    page = admin_client.get("/admin/django_tokenbucket/ratelimit/", {"q": "alice"})
    assert "0 rate limits" in page.content.decode()  # the value is in no label


# -- 4. every 429 and 503 we produce is uncacheable ------------------------------------


class Anonymous(APIView):
    throttle_classes = [AnonRateThrottle]

    def get(self, request):
        return Response("ok")


NO_MIDDLEWARE = [m for m in __import__("django.conf").conf.settings.MIDDLEWARE if "tokenbucket" not in m]


def test_4_a_drf_429_is_no_store_without_the_middleware(backend):
    with override_settings(MIDDLEWARE=NO_MIDDLEWARE):
        responses = [Anonymous.as_view()(APIRequestFactory().get("/")) for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    assert responses[-1]["Cache-Control"] == "no-store"
    assert "Cache-Control" not in responses[0]


@pytest.mark.django_db(transaction=True, databases=["default", "unreachable"])
def test_4_a_drf_503_is_no_store():
    failing = {**BASE_SETTINGS, "OPTIONS": {"DATABASE": "unreachable"}, "RETRY_ATTEMPTS": 1}
    with override_settings(MIDDLEWARE=NO_MIDDLEWARE, TOKENBUCKET=failing):
        response = Anonymous.as_view()(APIRequestFactory().get("/"))
    assert response.status_code == 503 and response["Cache-Control"] == "no-store"


# -- 5. headers describe only the requester's own buckets ------------------------------


def test_5_no_header_tells_the_state_of_someone_elses_account(backend):
    login = stacked_login()
    response = login(rf.post("/", {"username": "victim"}))
    assert response.status_code == 200
    policy = response["RateLimit-Policy"]
    assert '"login_ip"' in policy and '"login"' not in policy  # was: victim's bucket, r=4
    assert "victim" not in json.dumps(dict(response.headers))


# -- 7. CORS preflights are free -------------------------------------------------------


def test_7_options_is_not_counted_by_the_decorator_or_the_throttles(backend):
    @ratelimit("login_ip", key="ip")
    class Page(View):
        def get(self, request):
            return HttpResponse("ok")

    view = Page.as_view()
    # Django's View answers OPTIONS itself, without the view's code (issue 28 counts it
    # on a function view, which runs its code for OPTIONS: test_attacks_request_data.py).
    assert [view(rf.options("/")).status_code for _ in range(10)] == [200] * 10
    assert limiter.get_value("login_ip", ("ip", "127.0.0.1")) == 3
    preflights = [Anonymous.as_view()(APIRequestFactory().options("/")).status_code for _ in range(5)]
    assert preflights == [200] * 5
    assert [Anonymous.as_view()(APIRequestFactory().get("/")).status_code for _ in range(4)] == [200] * 3 + [429]
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **BACKENDS["database"], "LIMITS": LIMITS, "COUNT_OPTIONS": True}):
        if backend == "database":
            assert [view(rf.options("/")).status_code for _ in range(4)] == [200] * 3 + [429]  # counted again
