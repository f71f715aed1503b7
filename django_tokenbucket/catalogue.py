"""Every system check of django_tokenbucket: its id, level, message and hint, in one table.

The checks themselves live with what they check (the core settings in ``checks``, each
backend's options in its package, each integration's settings in its home); they
report by calling an entry here with the values its message names::

    catalogue.E011(obj=view, view=view, name=name)

so that an id is written once, a message reads the same wherever it is raised, and
``docs/settings.md``'s table of checks can be held against this one (a test does).
An id is never reused for another meaning once released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.core import checks

__all__ = ["CATALOGUE", "Check"]

_SETTINGS_HINT = "See the settings reference in the django_tokenbucket docs (docs/settings.md)."
_BACKENDS_HINT = (
    "TOKENBUCKET = {{'BACKENDS': {{'default': {{'BACKEND': ..., 'OPTIONS': {{...}}}}, 'fast': {{...}}}}}}, and "
    "'backend': 'fast' in a limit's config (docs/settings.md#backends)."
)


@dataclass(frozen=True)
class Check:
    """One system check: ``code`` (``"E011"``: E for an error, W for a warning, I for
    information), and the
    message and hint as ``str.format`` templates of the values it is raised with."""

    code: str
    message: str
    hint: str | None = None

    @property
    def id(self) -> str:
        return f"django_tokenbucket.{self.code}"

    def __call__(self, obj: Any = None, **values: Any) -> checks.CheckMessage:
        """Return this check's message for ``values``, about ``obj``."""
        level = {"E": checks.Error, "W": checks.Warning, "I": checks.Info}[self.code[0]]
        hint = None if self.hint is None else self.hint.format(**values)
        return level(self.message.format(**values), hint=hint, obj=obj, id=self.id)


# -- the core settings (checks.py) ------------------------------------------------------

E001 = Check("E001", "TOKENBUCKET must be a dict, not {type}.", _SETTINGS_HINT)
E002 = Check(
    "E002",
    "TOKENBUCKET['LIMITS'] must be a dict of name -> config, not {type}.",
    "For example: {{'login': {{'kind': 'token bucket', 'rate': '5/m'}}}}.",
)
E003 = Check(
    "E003",
    "{error}",
    "A limit is a rate string ('10/m', '5/10m', '1000/day') or a dict with 'rate' (and 'period' for a "
    "numeric rate), optional 'kind', 'capacity', 'max_reserved' and, for fixed windows, 'start'.",
)
E004 = Check(
    "E004",
    "rate limits {first!r} and {second!r} differ only in case.",
    "Databases with case-insensitive collations (MySQL, MariaDB) would store them as one limit; rename one of them.",
)
E005 = Check("E005", "{error}.", "The default is {default!r}.")
E006 = Check("E006", "TOKENBUCKET['FAIL_OPEN'] must be True or False, not {value!r}.")
E007 = Check(
    "E007",
    "TOKENBUCKET['CLOCK'] must be 'store' or 'app', not {value!r}.",
    "'store' (the default) takes time from the database or Redis, so that app servers with skewed clocks agree.",
)
E008 = Check(
    "E008",
    "TOKENBUCKET[{setting!r}] must be a non-negative number (a positive integer for RETRY_ATTEMPTS), not {value!r}.",
)
E010 = Check("E010", "{error}.", _BACKENDS_HINT)
E011 = Check(
    "E011",
    "{view} uses rate limit {name!r}, which is not in TOKENBUCKET['LIMITS'].",
    "Define it in TOKENBUCKET['LIMITS'], or give @ratelimit a rate= to define it inline.",
)
E012 = Check(
    "E012",
    "TOKENBUCKET: {problem}.",
    "Client addresses decide whose bucket a request uses: see the decorator docs "
    "(docs/decorator.md, 'Client addresses').",
)
E016 = Check("E016", "TOKENBUCKET[{setting!r}] must be True or False, not {value!r}.")
E017 = Check(
    "E017",
    "TOKENBUCKET['KEY_SECRET'] must be None (derived from SECRET_KEY) or a str or bytes of at least 16 characters.",
    "A short or guessable secret lets anyone with the rows recover keys such as addresses.",
)
E018 = Check("E018", "{error}.", _BACKENDS_HINT)
E019 = Check(
    "E019",
    "Rate limit {name!r} is stored on backend {alias!r}, which is not in TOKENBUCKET['BACKENDS'] (aliases: {aliases}).",
    _BACKENDS_HINT,
)
E022 = Check(
    "E022",
    "{view} stacks @ratelimit on limits stored on different backends ({where}); a request is decided on all of "
    "them at once, all-or-nothing, which two stores cannot do.",
    "Give the limits of one view the same 'backend'.",
)
E023 = Check(
    "E023",
    "TOKENBUCKET['RESPONSE'] = {value!r} {problem}.",
    "Give a callable (request, status) -> HttpResponse, or its dotted path.",
)
E024 = Check(
    "E024",
    "TOKENBUCKET['LOG_INTERVAL'] must be a number of seconds >= 0 (0 logs every store failure), not {value!r}.",
)
E050 = Check(
    "E050",
    "TOKENBUCKET['METRICS'] {problem}.",
    "None (off), 'prometheus' (pip install 'dj-tokenbucket[prometheus]') or 'opentelemetry' "
    "(pip install 'dj-tokenbucket[opentelemetry]').",
)
E051 = Check(
    "E051",
    "{error}.",
    "For example TOKENBUCKET['DENY_CACHE'] = {{'MAX_AGE': 1.0, 'MAX_KEYS': 100_000}}, or False to turn "
    "the deny cache off (docs/settings.md#deny_cache).",
)
E052 = Check(
    "E052",
    "{error}.",
    "For example TOKENBUCKET['OVERRIDES'] = {{'MAX_AGE': 5.0}}, or False to turn runtime overrides off "
    "(docs/settings.md#overrides).",
)
E053 = Check(
    "E053",
    "{error}.",
    "For example TOKENBUCKET['ANALYTICS'] = {{'FLUSH': 10, 'TOP_KEYS': 20, 'MAX_KEYS': 1000}}, or None to turn "
    "analytics off (docs/settings.md#analytics).",
)
E054 = Check(
    "E054",
    "TOKENBUCKET['FOLD_KEY_ACCENTS'] must be None (decided by the user table's database), True or False, "
    "not {value!r}.",
)
W002 = Check("W002", "TOKENBUCKET has unknown setting(s): {names}.", "Known settings: {known}.")
W003 = Check(
    "W003",
    "TOKENBUCKET['IP_HEADER'] = {header!r} is ignored: it is honoured only on requests from a trusted proxy "
    "given by its address, and TRUSTED_PROXIES is {trusted!r}.",
    "Give TRUSTED_PROXIES as the CIDRs of the proxies that set the header, e.g. ['10.0.0.0/8'].",
)
W005 = Check(
    "W005",
    "{view} is rate-limited by key={key!r}, a header that clients write themselves: each request can name "
    "a new address and get a fresh bucket.",
    "Key it on the client's address, key='ip', and say which proxies are yours with "
    "TOKENBUCKET['TRUSTED_PROXIES'] (and 'IP_HEADER' for an edge header such as 'CF-Connecting-IP'): "
    "then the address is read only from what your proxies wrote (docs/security.md#forged-x-forwarded-for).",
)

# -- the keys of request data and the user table (a database check: check --database) ------

I001 = Check(
    "I001",
    "Keys taken from request data (post:, get:, header:, username) are folded: {folding} ({reason}); "
    "{column} {compares}.",
)
W004 = Check(
    "W004",
    "Keys taken from request data (post:, get:, header:, username) are folded: {folding} ({reason}), but "
    "{column} has collation {collation}, which takes {first!r} and {second!r} for one name: they get two "
    "buckets, so an attacker gets a per-account limit per spelling of the account's name.",
    "Set TOKENBUCKET['FOLD_KEY_ACCENTS'] = True (it folds case too), or leave FOLD_KEY_CASE at True "
    "(docs/settings.md#fold_key_accents).",
)

# -- the backends' options (each backend's check_options) --------------------------------

E013 = Check("E013", "{setting}['OPTIONS'] has unknown option(s) for {backend}: {names}.", "{backend} takes {known}.")
E009 = Check("E009", "{setting}['OPTIONS']['DATABASE'] = {alias!r} is not in DATABASES.")
E014 = Check("E014", "{setting}['OPTIONS'][{option!r}] must be {expected}, not {value!r}.")
E015 = Check("E015", "{error}")
W001 = Check(
    "W001",
    "Rate limits are stored in the SQLite database {alias!r} without IMMEDIATE transactions: concurrent "
    "requests will fail with 'database is locked'.",
    "Set DATABASES[{alias!r}]['OPTIONS'] = {{'transaction_mode': 'IMMEDIATE', 'timeout': 5}} (Django 5.1+).",
)
_CACHE_HINT = (
    "Point {setting}['OPTIONS']['CACHE'] at a cache whose BACKEND is 'django_redis.cache.RedisCache' "
    "(pip install 'dj-tokenbucket[redis]')."
)
E020 = Check("E020", "{setting}['OPTIONS']['CACHE'] = {alias!r} is not an alias in CACHES.", _CACHE_HINT)
E021 = Check("E021", E013.message, E013.hint)
# An error since W020 let such a site start with every rate-limit call failing (issue 33).
E027 = Check(
    "E027",
    "The Redis rate-limit backend uses CACHES[{alias!r}], whose BACKEND {backend!r} is not a django-redis cache: "
    "every rate-limit call would fail.",
    _CACHE_HINT,
)
W021 = Check(
    "W021",
    "The Redis behind CACHES[{alias!r}] has maxmemory-policy {policy!r}: when its memory is full it may delete "
    "rate-limit keys, and a deleted bucket reads as full again.",
    "Set maxmemory-policy to 'noeviction' (a full Redis then fails calls, and FAIL_OPEN decides), or give the "
    "limits a Redis of their own.",
)
E029 = Check(
    "E029",
    "{error}",
    "TIMEOUT is the seconds a whole rate-limit call on Redis may take: leave it out for the default (0.2), "
    "give a number such as 0.5, or None for no deadline.",
)
W022 = Check(
    "W022",
    "TOKENBUCKET's Redis TIMEOUT is {timeout}, but CACHES[{alias!r}] has {problem}: a connection being made, "
    "or a cluster's topology being read, is bounded by the socket timeouts alone, so a call can outlast TIMEOUT.",
    "Set SOCKET_CONNECT_TIMEOUT and SOCKET_TIMEOUT in CACHES[{alias!r}]['OPTIONS'] to at most TIMEOUT, or "
    "remove them: the backend's own connections then time out within TIMEOUT "
    "(docs/redis.md#one-deadline-per-call-timeout).",
)

# -- the integrations: Celery, DRF, django-ratelimit ----------------------------------------

E025 = Check("E025", "TOKENBUCKET['CELERY']{problem}.")
E028 = Check(
    "E028",
    "Celery task {task!r}: {problem}",
    "Fix the task's tokenbucket_limit (a limit of TOKENBUCKET['LIMITS']) or tokenbucket_count.",
)
E026 = Check(
    "E026",
    "{view}'s throttles take from limits stored on different backends ({where}); they are decided together, "
    "all-or-nothing, which two stores cannot do.",
    "Give the scopes' limits in TOKENBUCKET['LIMITS'] the same 'backend'.",
)
_RATE_HINT = "DRF spellings work: '100/day', '60/min', '3/sec', '1/hr'; also '5/10m'."
E030 = Check("E030", "{where}: {error}", _RATE_HINT)
E031 = Check("E031", "{where}: {error}", _RATE_HINT)
E032 = Check(
    "E032",
    "throttle scope {scope!r} ({where}) has no rate: every request it meets would fail.",
    "Add it to REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] (None switches it off) or TOKENBUCKET['LIMITS'].",
)
E033 = Check("E033", "REST_FRAMEWORK['DEFAULT_THROTTLE_CLASSES']: {error}")
E040 = Check(
    "E040",
    "RATELIMIT_USE_CACHE = {alias!r} is not an alias in CACHES.",
    "Name a cache in CACHES, or remove the setting to use the default cache, as django-ratelimit does.",
)
E041 = Check("E041", "{setting} must be a prefix length from 0 to {bits}, not {value!r}.")
E042 = Check("E042", "RATELIMIT_EXCEPTION_CLASS = {value!r}: {error}")
E043 = Check(
    "E043",
    "RATELIMIT_IP_META_KEY = {value!r} reads the {header} header, which clients write themselves, and "
    "{missing}: every request could name a new address and get a fresh bucket.",
    "{fix} django_tokenbucket then reads the address from what your proxies wrote "
    "(docs/migrating.md#client-addresses).",
)
W040 = Check(
    "W040",
    "django_tokenbucket.compat.ratelimit keeps its limits in TOKENBUCKET's backend, not in the cache "
    "django-ratelimit would use: CACHES[{alias!r}] ({named}), a {backend}, cannot hold a limit atomically.",
    "Nothing to do if that is what you want. To keep them in that cache's Redis, make it a django-redis cache "
    "(BACKEND 'django_redis.cache.RedisCache'); tests that count queries: docs/migrating.md#your-tests.",
)

# -- login protection (auth/checks.py) --------------------------------------------------

_LOGIN_HINT = (
    "For example TOKENBUCKET['LOGIN'] = {{'LIMIT': 'login_failures', 'KEYS': ['username', 'ip'], 'COOLOFF': None}}, "
    "or None to turn login protection off (docs/login.md)."
)
E060 = Check("E060", "{error}.", _LOGIN_HINT)
E061 = Check(
    "E061",
    "TOKENBUCKET['LOGIN']['LIMIT'] is {name!r}, which is not in TOKENBUCKET['LIMITS']: every login would fail.",
    "Define the failed logins a key may have, e.g. TOKENBUCKET['LIMITS'] = {{{name!r}: '5/15m'}}.",
)
E062 = Check(
    "E062",
    "TOKENBUCKET['LOGIN']['COOLOFF'] is set, but overrides are off (TOKENBUCKET['OVERRIDES'] is False): a lockout "
    "is a block override, and none could be written.",
    "Turn overrides on (TOKENBUCKET['OVERRIDES'] = {{'MAX_AGE': 5.0}}), or set COOLOFF to None.",
)
E063 = Check(
    "E063",
    "TOKENBUCKET['LOGIN']['COOLOFF'] is a callable, and COOLOFF(1) {problem}.",
    "Return the first lockout's length in seconds (a number) or as a timedelta: e.g. "
    "lambda lockouts: [60, 600, 3600][min(lockouts, 3) - 1].",
)
W060 = Check(
    "W060",
    "AUTHENTICATION_BACKENDS lists {before} before django_tokenbucket.auth.LoginBackend: they check passwords "
    "before login protection counts them, and a locked-out key still reaches them.",
    "List django_tokenbucket.auth.LoginBackend first.",
)
W061 = Check(
    "W061",
    "TOKENBUCKET['LOGIN'] is set, but AUTHENTICATION_BACKENDS does not list django_tokenbucket.auth.LoginBackend: "
    "no login is counted.",
    "Add 'django_tokenbucket.auth.LoginBackend' first in AUTHENTICATION_BACKENDS, or remove TOKENBUCKET['LOGIN'].",
)
W062 = Check(
    "W062",
    "The login limit {name!r} is stored in database {alias!r}, which has ATOMIC_REQUESTS: a failed login whose "
    "request rolls back (DRF rolls back every request it answers with an error) takes its failure back with it.",
    "Store the login limit outside the requests' transactions: on Redis, or on a second alias of the same database "
    "('backend' of the limit, a BACKENDS entry with OPTIONS {{'DATABASE': '<alias>'}}); docs/login.md#transactions.",
)

#: Every check, by code.
CATALOGUE: dict[str, Check] = {value.code: value for value in list(globals().values()) if isinstance(value, Check)}
