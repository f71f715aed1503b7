"""Attacks on keys and on caches (docs/security.md, "Third round", issue 47, items 10, 9
and 6), each as an attacker would try it: spellings the database takes for one account,
address headers that clients write, and 429s and 503s a cache could keep.

The tests of each item failed on 4c6264d, the code before the fixes (but for two kept as
controls, which pass on both: the safe spelling W005 points to, and the paths whose 429
and 503 were uncacheable already): 10 a username respelled
with accents (``víctim``) logging in as ``victim`` on MariaDB's default collation under a
bucket of its own, through a block on ``victim`` too; 9 a limit keyed on a header that
clients write (``X-Forwarded-For``) without a word, and the compat layer's
``RATELIMIT_IP_META_KEY = "HTTP_X_FORWARDED_FOR"`` taking the client's word for its
address; 6 the DRF exception handler's 503 without ``Cache-Control: no-store``. Run on
the database (SQLite, PostgreSQL or MariaDB, whichever the run uses) and on Redis; the
cases about MariaDB's collations only in the MariaDB envs.
"""

from __future__ import annotations

import collections
import random
import re
import unicodedata

import pytest
from django.conf import settings
from django.contrib.auth import authenticate, get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.http import HttpResponse
from django.test import RequestFactory, override_settings
from django.views.generic import View
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from django_tokenbucket import limiter, request_keys
from django_tokenbucket.checks import SPELLING_PROBES, check_declared_limits, check_key_folding
from django_tokenbucket.collation import column_comparison
from django_tokenbucket.compat.ratelimit.checks import check_ratelimit_compat
from django_tokenbucket.compat.ratelimit.decorators import ratelimit as compat_ratelimit
from django_tokenbucket.decorators import ratelimit
from django_tokenbucket.request_keys import key_folding, normalize_identity
from django_tokenbucket.testing import frozen_clock
from django_tokenbucket.throttling import AnonRateThrottle

from .settings import TOKENBUCKET as BASE_SETTINGS

rf = RequestFactory()
api = APIRequestFactory()
T0 = 1_700_000_000.0
BACKENDS = {
    "database": {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"},
    "redis": {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend"},
}
LIMITS = BASE_SETTINGS["LIMITS"]
ONCE = {"rate": "1/m"}
FAST_HASHER = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, transactional_db):
    overrides = dict(BACKENDS[request.param])
    if request.param == "redis":
        overrides.update(request.getfixturevalue("redis_store"))
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **overrides, "LIMITS": LIMITS}):
        with frozen_clock(T0):
            yield request.param


@pytest.fixture
def victim(transactional_db):
    with override_settings(PASSWORD_HASHERS=FAST_HASHER):
        yield get_user_model().objects.create_user("victim", password="the right one")


# -- 10. one account, one bucket, however the database lets its name be spelled ----------

#: Each letter of "victim" and what a Latin keyboard's dead keys make of it.
ACCENTED = {"v": "vṽṿ", "i": "iíìîïĩīĭįǐȉȋịỉ", "c": "cçćĉċč", "t": "tţťṫṭț", "m": "mḿṁṃ"}


def accent_spellings(count=400, seed=47):
    """``count`` spellings of ``victim`` with accents (and some capitals), never ``victim`` itself."""
    pick = random.Random(seed)
    found: dict[str, None] = {}
    while len(found) < count:
        letters = [pick.choice(ACCENTED[letter]) for letter in "victim"]
        spelling = "".join(letter.upper() if pick.random() < 0.2 else letter for letter in letters)
        if spelling.lower() != "victim":
            found[spelling] = None
    return list(found)


SPELLINGS = accent_spellings()


def login_view():
    @ratelimit("login_guesses", key="post:username", rate="2/m", method="POST")
    def login(request):
        user = authenticate(request, username=request.POST["username"], password=request.POST["password"])
        return HttpResponse("welcome" if user else "wrong password", status=200 if user else 401)

    return login


@pytest.mark.only_on("mariadb")
def test_10_mariadb_gives_the_user_table_its_default_collation_and_it_ignores_accents(transactional_db):
    """What the other cases rely on: the test database Django made has the server's default
    (accent-insensitive) collation on auth_user.username, as a project's would."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT DEFAULT_COLLATION_NAME FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = DATABASE()")
        (database_default,) = cursor.fetchone()
    column = column_comparison("default", "auth_user", "username")
    assert column is not None and column.collation == database_default
    assert column.equal([("víctim", "victim"), ("VICTIM", "victim")]) == [True, True]
    get_user_model().objects.create_user("victim")
    assert get_user_model().objects.filter(username="vïctim").exists()


@pytest.mark.only_on("mariadb")
@pytest.mark.every_database  # the fold follows the user table's database, on either store
def test_10_every_accent_spelling_that_logs_in_as_the_victim_meets_its_bucket(backend, victim):
    users = get_user_model().objects
    # Each of the 400 names the victim's account to the database: it is the same login.
    assert all(users.filter(username=spelling).get() == victim for spelling in SPELLINGS)
    with override_settings(PASSWORD_HASHERS=FAST_HASHER):
        assert authenticate(username="vïctim", password="the right one") == victim
        login = login_view()
        statuses = [
            login(rf.post("/", {"username": spelling, "password": f"guess {n}"})).status_code
            for n, spelling in enumerate(SPELLINGS)
        ]
    guesses = sum(status != 429 for status in statuses)
    assert guesses == 2, guesses  # was 400 of 400: a bucket per spelling up to case


@pytest.mark.only_on("mariadb")
@pytest.mark.every_database  # the fold follows the user table's database, on either store
def test_10_a_block_on_the_victim_holds_for_every_spelling(backend, victim):
    login = login_view()
    limiter.block("login_guesses", ("post:username", "victim"), reason="under attack")
    with override_settings(PASSWORD_HASHERS=FAST_HASHER):
        statuses = [
            login(rf.post("/", {"username": spelling, "password": "the right one"})).status_code
            for spelling in ["víctim", "vìctim", "vîctim", "vïctim", "VÍCTIM", "vic\u200btim"]
        ]
    assert statuses == [429] * 6  # was [200, 200, 200, 200, 200, 401]


def test_10_normalize_identity_is_the_one_fold_of_every_key_path(transactional_db):
    """The decorator, the compat layer, the admin's search (key_from_text) and the overrides an
    operator types all meet one key; on MariaDB that key has no accents."""
    accents = connection.vendor == "mysql"
    assert key_folding().accents is accents
    typed = request_keys.key_from_text("post:username=VÍCTIM")
    assert typed == ("post:username", "victim" if accents else "víctim")


#: MariaDB's accent-insensitive utf8mb4 collations (and MySQL's), those the server has.
AI_COLLATIONS = (
    "utf8mb4_general_ci",
    "utf8mb4_unicode_ci",
    "utf8mb4_unicode_520_ci",
    "utf8mb4_uca1400_ai_ci",
    "utf8mb4_0900_ai_ci",
)


def server_collations():
    with connection.cursor() as cursor:
        cursor.execute("SHOW COLLATION WHERE Charset = 'utf8mb4'")
        available = {row[0] for row in cursor.fetchall()}
    return [name for name in AI_COLLATIONS if name in available]


#: Spellings of a few names that one or another collation takes for the same name.
NAMES = dict.fromkeys(
    [
        *SPELLINGS[:40],
        *[text for pair in SPELLING_PROBES for text in pair],
        "VICTIM",
        "Victim",
        "vic\u00adtim",
        "vic\u200dtim",
        "vic\ufefftim",
        "victim\u0301",
        "v\u0131ctim",
        "Straße",
        "STRASSE",
        "strase",
        "ØRSTED",
        "Ørsted",
        "ÆON",
        "đana",
        "Đana",
        "ðana",
        "ŁUKASZ",
        "user١",
        "user۱",
        "user१",
        "ユーザー",
        "ゆーざー",
    ]
)


@pytest.mark.only_on("mariadb")
def test_10_every_pair_the_server_calls_equal_lands_in_one_bucket(db):
    for collation in server_collations():
        names = list(NAMES)
        pairs = [(first, second) for n, first in enumerate(names) for second in names[n + 1 :]]
        with connection.cursor() as cursor:
            equal = []
            for start in range(0, len(pairs), 500):
                batch = pairs[start : start + 500]
                cursor.execute(
                    "SELECT "
                    + ", ".join(
                        [f"(CONVERT(%s USING utf8mb4) COLLATE {collation} = CONVERT(%s USING utf8mb4))"] * len(batch)
                    ),
                    [text for pair in batch for text in pair],
                )
                equal += cursor.fetchone()
        apart = [
            (first, second)
            for (first, second), same in zip(pairs, equal)
            if same and normalize_identity(first) != normalize_identity(second)
        ]
        assert sum(equal) > 100 and apart == [], (collation, apart[:10])


#: Where each collation and the fold part, knowingly: a lone U+0345 (GREEK YPOGEGRAMMENI)
#: is ι to general_ci but a mark inside ᾳ; U+1DD2 (COMBINING US ABOVE) is ꝯ to UCA 5.2+;
#: the Bengali currency numerators are digits to UCA 4.0 only. Beyond the BMP, general_ci
#: and unicode_ci weigh every character alike (U+FFFD), the UCA 5.2+ collations tell the
#: circled letters and other scripts' digits from each other: the fold follows the latter
#: for letters and digits, and folds every other character beyond the BMP to U+FFFD.
KNOWN_GAPS = frozenset({0x0345, 0x1DD2, 0x09F4, 0x09F5, 0x09F6, 0x09F7})
#: The scripts whose every letter is held to its collation's classes here; for others (Runic,
#: Bopomofo, Syriac...) the fold is NFKD, marks and case, and docs/security.md says so.
SCRIPTS = ("LATIN", "GREEK", "CYRILLIC", "DIGIT", "HIRAGANA", "KATAKANA")


def in_scripts(code):
    char = chr(code)
    return code < 0x80 or unicodedata.name(char, "").startswith(SCRIPTS) or unicodedata.category(char) == "Nd"


@pytest.mark.only_on("mariadb")
def test_10_the_fold_is_as_coarse_as_each_collation_character_by_character(db):
    """Every NFKC-stable character up to U+2FFFF, weighed by the server under each
    accent-insensitive collation it has: characters of one weight fold alike, characters
    it ignores fold to nothing, and one weighed as several letters (ß as ss, æ as ae) folds
    to those letters, so that whole names the server calls equal meet one key."""
    codes = [
        code
        for code in range(1, 0x30000)
        if not 0xD800 <= code <= 0xDFFF and unicodedata.normalize("NFKC", chr(code)) == chr(code)
    ]
    folded = {code: normalize_identity(f"x{chr(code)}x")[1:-1] for code in codes}
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMPORARY TABLE tb_characters (code INT PRIMARY KEY, text VARCHAR(2) "
            "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin)"
        )
        for start in range(0, len(codes), 5000):
            cursor.executemany(
                "INSERT INTO tb_characters VALUES (%s, %s)", [(code, chr(code)) for code in codes[start : start + 5000]]
            )
        problems = {}
        for collation in server_collations():
            cursor.execute(f"SELECT code, HEX(WEIGHT_STRING(text COLLATE {collation})) FROM tb_characters")
            weights = {code: [hexed[i : i + 4] for i in range(0, len(hexed), 4)] for code, hexed in cursor.fetchall()}
            problems[collation] = fold_problems(collation, weights, folded)
        cursor.execute("DROP TEMPORARY TABLE tb_characters")
    assert problems == {collation: [] for collation in problems}


def fold_problems(collation, weights, folded):
    classes = collections.defaultdict(lambda: collections.defaultdict(list))
    for code, units in weights.items():
        if len(units) == 1 and code not in KNOWN_GAPS:
            classes[units[0]][folded[code]].append(code)
    one_weight_alike = collation in ("utf8mb4_general_ci", "utf8mb4_unicode_ci")
    problems = [
        (
            f"U+{min(min(codes) for codes in by_fold.values()):04X}",
            {fold: len(codes) for fold, codes in by_fold.items()},
        )
        for unit, by_fold in classes.items()
        if len(by_fold) > 1
        and not (unit == "FFFD" and one_weight_alike)
        and any(in_scripts(code) for codes in by_fold.values() for code in codes)
    ]
    letter = {unit: max(by_fold, key=lambda fold: len(by_fold[fold])) for unit, by_fold in classes.items()}
    for code, units in weights.items():
        if not units and folded[code] != "":
            problems.append((f"U+{code:04X} is ignored by the collation", folded[code]))
        elif len(units) > 1 and in_scripts(code) and all(unit in letter for unit in units):
            expected = re.sub("s+", "s", "".join(letter[unit] for unit in units))
            if folded[code] != expected:
                problems.append((f"U+{code:04X} weighs as {expected!r}", folded[code]))
    return problems


def test_10_the_database_check_says_which_folding_is_in_force(transactional_db):
    if connection.vendor == "mysql":
        [message] = check_key_folding(databases=["default"])
        assert message.id == "django_tokenbucket.I001"
        assert "NFKC, case and accents" in message.msg and "MySQL/MariaDB database 'default'" in message.msg
        assert "auth_user.username" in message.msg and "collation utf8mb4_" in message.msg
    else:
        # The default elsewhere (case folded, accents kept) is not a line on every migrate...
        assert check_key_folding(databases=["default"]) == []
        # ...but folding accents by the setting is said.
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, "FOLD_KEY_ACCENTS": True}):
            [message] = check_key_folding(databases=["default"])
        assert message.id == "django_tokenbucket.I001" and "NFKC, case and accents" in message.msg
    assert check_key_folding(databases=[]) == []  # plain `manage.py check` asks no database


@pytest.mark.only_on("mariadb")
def test_10_keys_that_fold_less_than_the_column_are_warned(transactional_db):
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "FOLD_KEY_ACCENTS": False}):
        [message] = check_key_folding(databases=["default"])
    assert message.id == "django_tokenbucket.W004"
    assert "'víctim'" in message.msg and "FOLD_KEY_ACCENTS" in message.hint


@pytest.mark.only_on("postgres")
@pytest.mark.every_database  # the fold follows the user table's database, on either store
def test_10_a_postgresql_column_with_an_accent_insensitive_collation_is_warned_then_folded(backend, victim):
    """PostgreSQL compares exactly unless a column says otherwise: a project may give its
    usernames an ICU collation that ignores case and accents (nondeterministic)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE COLLATION IF NOT EXISTS tb_ci_ai (provider = icu, locale = 'und-u-ks-level1', deterministic = false)"
        )
        # The LIKE index's operator class cannot use a nondeterministic collation.
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'auth_user' AND indexdef LIKE %s",
            ["%pattern_ops%"],
        )
        like_indexes = cursor.fetchall()
        for index, _ in like_indexes:
            cursor.execute(f'DROP INDEX "{index}"')
        cursor.execute('ALTER TABLE auth_user ALTER COLUMN username TYPE varchar(150) COLLATE "tb_ci_ai"')
    try:
        assert get_user_model().objects.filter(username="VÍCTIM").get() == victim
        [warned] = check_key_folding(databases=["default"])
        assert warned.id == "django_tokenbucket.W004" and "tb_ci_ai" in warned.msg
        with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "FOLD_KEY_ACCENTS": True}):
            [told] = check_key_folding(databases=["default"])
            assert told.id == "django_tokenbucket.I001" and "FOLD_KEY_ACCENTS = True" in told.msg
            login = login_view()
            with override_settings(PASSWORD_HASHERS=FAST_HASHER):
                statuses = [
                    login(rf.post("/", {"username": spelling, "password": "guess"})).status_code
                    for spelling in SPELLINGS[:20]
                ]
        assert sum(status != 429 for status in statuses) == 2
    finally:
        with connection.cursor() as cursor:
            cursor.execute('ALTER TABLE auth_user ALTER COLUMN username TYPE varchar(150) COLLATE "default"')
            for _, definition in like_indexes:
                cursor.execute(definition)


def test_10_fold_key_accents_is_checked():
    from django_tokenbucket.checks import check_settings

    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "FOLD_KEY_ACCENTS": "yes"}):
        assert [m.id for m in check_settings()] == ["django_tokenbucket.E054"]
    for value in (None, True, False):
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, "FOLD_KEY_ACCENTS": value}):
            assert check_settings() == []


# -- 9. a limit keyed on an address the client writes itself ----------------------------


@pytest.fixture
def registered_keys():
    """The views the decorators have recorded as keyed on an address header, as before the test."""
    saved = {view: set(specs) for view, specs in request_keys._address_keyed_views.items()}
    yield
    request_keys._address_keyed_views.clear()
    request_keys._address_keyed_views.update(saved)


def w005(view_name):
    return [m for m in check_declared_limits() if m.id == "django_tokenbucket.W005" and view_name in m.obj]


@pytest.mark.parametrize(
    "header", ["X-Forwarded-For", "x_forwarded_for", "X-Real-IP", "Forwarded", "CF-Connecting-IP", "True-Client-IP"]
)
def test_9_a_limit_keyed_on_an_address_header_is_named_with_the_safe_spelling(registered_keys, header):
    @ratelimit(key=f"header:{header}", rate="5/m")
    def search(request):
        return HttpResponse("ok")

    @compat_ratelimit(key=f"header:{header}", rate="5/m")
    def compat_search(request):
        return HttpResponse("ok")

    for view in ("search", "compat_search"):
        [message] = w005(f".{view}")
        assert message.level == 30 and header in message.msg  # a warning: the site still starts
        assert "key='ip'" in message.hint and "TRUSTED_PROXIES" in message.hint


def test_9_a_class_view_is_named_and_an_ordinary_header_is_not(registered_keys):
    @ratelimit(key="header:X-Forwarded-For", rate="5/m")
    class Search(View):
        def get(self, request):
            return HttpResponse("ok")

    @ratelimit(key="header:X-Api-Key", rate="5/m")
    def keyed(request):
        return HttpResponse("ok")

    assert len(w005("Search")) == 1
    assert w005(".keyed") == []


def test_9_the_safe_spelling_holds_against_a_rotated_header(backend):
    """What W005 points to: behind one proxy, key="ip" reads the hop the proxy wrote."""

    @ratelimit(key="ip", rate="5/m")
    def search(request):
        return HttpResponse("ok")

    with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "TRUSTED_PROXIES": 1}):
        statuses = [
            search(rf.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}, 203.0.113.9")).status_code
            for n in range(10)
        ]
    assert statuses.count(200) == 5


def compat_search_view():
    @compat_ratelimit(key="ip", rate="5/m", block=False)
    def search(request):
        return HttpResponse("limited" if request.limited else "ok")

    return search


def rotated(n, proxy="10.0.0.2", **headers):
    """A request from one client behind ``proxy``, its X-Forwarded-For claiming a new address each time."""
    return rf.get("/", REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR=f"198.51.100.{n}, 203.0.113.9", **headers)


def test_9_compat_ip_meta_key_on_forwarded_for_is_refused_without_trusted_proxies(backend, settings):
    settings.RATELIMIT_IP_META_KEY = "HTTP_X_FORWARDED_FOR"
    search = compat_search_view()
    for n in range(10):
        with pytest.raises(ImproperlyConfigured, match=r"X-Forwarded-For header, which clients write.*TRUSTED_PROXIES"):
            search(rf.get("/", REMOTE_ADDR="203.0.113.9", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}"))
    [message] = [m for m in check_ratelimit_compat() if m.id == "django_tokenbucket.E043"]
    assert "TRUSTED_PROXIES" in message.msg and "RATELIMIT_IP_META_KEY" in message.hint


def test_9_compat_ip_meta_key_on_forwarded_for_is_mapped_to_trusted_proxies(backend, settings):
    settings.RATELIMIT_IP_META_KEY = "HTTP_X_FORWARDED_FOR"
    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "TRUSTED_PROXIES": 1}
    search = compat_search_view()
    assert [search(rotated(n)).content for n in range(10)].count(b"ok") == 5  # keyed by 203.0.113.9
    assert [m for m in check_ratelimit_compat() if m.id == "django_tokenbucket.E043"] == []


def test_9_compat_ip_meta_key_on_an_edge_header_needs_ip_header_and_proxy_networks(backend, settings):
    settings.RATELIMIT_IP_META_KEY = "HTTP_X_REAL_IP"
    search = compat_search_view()
    with pytest.raises(ImproperlyConfigured, match="IP_HEADER"):
        search(rf.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_REAL_IP="198.51.100.1"))
    assert [m.id for m in check_ratelimit_compat()].count("django_tokenbucket.E043") == 1
    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "IP_HEADER": "X-Real-IP", "TRUSTED_PROXIES": ["10.0.0.0/8"]}
    # From the proxy, the header is the client; from anywhere else, the connection is.
    from_proxy = [search(rf.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_REAL_IP="203.0.113.9")).content for _ in range(6)]
    direct = [search(rf.get("/", REMOTE_ADDR="192.0.2.5", HTTP_X_REAL_IP=f"198.51.100.{n}")).content for n in range(6)]
    assert from_proxy.count(b"ok") == 5 and direct.count(b"ok") == 5
    assert [m for m in check_ratelimit_compat() if m.id == "django_tokenbucket.E043"] == []


# -- 6. every 429 and 503 we produce is uncacheable ------------------------------------------

WITH_HANDLER = {**settings.REST_FRAMEWORK, "EXCEPTION_HANDLER": "django_tokenbucket.throttling.exception_handler"}


class ThrottledView(APIView):
    throttle_classes = [AnonRateThrottle]

    def get(self, request):
        return Response("ok")


class Throwing(APIView):
    throttle_classes = []

    def get(self, request):
        limiter.limit("once", "api key", config=ONCE, throws=True)
        return Response("ok")


def django_throwing(request):
    limiter.limit("once", "page key", config=ONCE, throws=True)
    return HttpResponse("ok")


@ratelimit(key="ip", rate="1/m")
def decorated(request):
    return HttpResponse("ok")


@ratelimit(key="ip", rate="1/m")
class DecoratedClass(View):
    def get(self, request):
        return HttpResponse("ok")


@ratelimit(key="ip", rate="1/m")
class DecoratedDRF(APIView):
    throttle_classes = []

    def get(self, request):
        return Response("ok")


@compat_ratelimit(key="ip", rate="1/m")
def compat_decorated(request):
    return HttpResponse("ok")


#: Every way a request meets a limit, and what turns a refusal or a failed store into HTTP:
#: (view, request factory, through RateLimitMiddleware, REST_FRAMEWORK).
PATHS = {
    "decorator": (decorated, rf, False, None),
    "decorator on a class": (DecoratedClass.as_view(), rf, False, None),
    "decorator on a DRF view": (DecoratedDRF.as_view(), api, False, None),
    "DRF throttle": (ThrottledView.as_view(), api, False, None),
    "DRF throttle, middleware": (ThrottledView.as_view(), api, True, None),
    "throws=True, middleware": (django_throwing, rf, True, None),
    "throws=True, DRF exception handler": (Throwing.as_view(), api, False, WITH_HANDLER),
    "compat decorator, middleware": (compat_decorated, rf, True, None),
}
#: The compat layer fails closed as django-ratelimit does, with a 429 (above).
PATHS_TO_503 = sorted(set(PATHS) - {"compat decorator, middleware"})


def through_middleware(view, middleware):
    """``view`` behind RateLimitMiddleware as Django's handler runs it (process_exception, then
    process_response), when ``middleware``; else ``view`` itself."""
    if not middleware:
        return view
    from django_tokenbucket.middleware import RateLimitMiddleware

    def handler(request):
        try:
            return view(request)
        except Exception as exc:
            answered = RateLimitMiddleware(view).process_exception(request, exc)
            if answered is None:
                raise
            return answered

    return RateLimitMiddleware(handler)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_6_every_429_is_no_store(backend, path):
    view, factory, middleware, drf = PATHS[path]
    with override_settings(REST_FRAMEWORK=drf or settings.REST_FRAMEWORK):
        answer = through_middleware(view, middleware)
        responses = [answer(factory.get("/", REMOTE_ADDR="198.51.100.7")) for _ in range(4)]
    refused = [response for response in responses if response.status_code == 429]
    assert refused and all(response["Cache-Control"] == "no-store" for response in refused)


@pytest.fixture(params=sorted(BACKENDS))
def store_down(request):
    """A store that refuses every connection: a database on a closed port, or a Redis on one."""
    if request.param == "database":
        request.getfixturevalue("transactional_db")
        down = {**BACKENDS["database"], "OPTIONS": {"DATABASE": "unreachable"}, "RETRY_ATTEMPTS": 1}
        caches = settings.CACHES
    else:
        caches = {
            **settings.CACHES,
            "down": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": "redis://127.0.0.1:1/0",
                "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1},
            },
        }
        down = {**BACKENDS["redis"], "OPTIONS": {"CACHE": "down"}}
    with override_settings(CACHES=caches, TOKENBUCKET={**BASE_SETTINGS, **down, "LIMITS": LIMITS}):
        yield request.param


@pytest.mark.django_db(transaction=True, databases=["default", "unreachable"])
@pytest.mark.parametrize("path", PATHS_TO_503)
def test_6_every_503_is_no_store(store_down, path):
    view, factory, middleware, drf = PATHS[path]
    with override_settings(REST_FRAMEWORK=drf or settings.REST_FRAMEWORK):
        response = through_middleware(view, middleware)(factory.get("/", REMOTE_ADDR="198.51.100.7"))
    assert response.status_code == 503 and response["Cache-Control"] == "no-store"
