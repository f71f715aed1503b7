"""``manage.py tokenbucket list|show|reset|cleanup``: inspect and maintain rate limits.

Keys on the command line are strings: ``tokenbucket show login alice`` is the bucket of
``limiter.limit("login", key="alice")``; an int or a UUID key is the bucket of its text
(``42`` and ``"42"`` are one bucket). Keys passed in code as other types hash
differently, so:

- ``--int KEY`` checks that KEY is an integer (``key=42``, the same bucket as ``"42"``);
- ``--json KEY`` for anything else JSON can say: ``null`` (the global bucket,
  ``key=None``), numbers, strings and arrays for tuples, e.g. ``'["ip", "203.0.113.7"]'``
  for the keys that ``@ratelimit(key="ip")`` and the DRF throttles use;
- ``--digest KEY`` for the stored HMAC-SHA-256 digest (or a unique prefix of 8+ hex digits),
  as the admin shows it: works for any key, whatever its type;
- ``--key SPEC=VALUE`` for the keys ``@ratelimit(key=SPEC)`` and the DRF throttles build:
  ``--key post:username=alice`` (normalised as the decorator does), ``--key ip=203.0.113.7``,
  ``--key user=42``.

``reset`` exits non-zero when the key has nothing to reset, rather than report a reset
of a bucket nobody uses.

Every subcommand works on every backend a limit may be stored on (its ``"backend"``):
on the database backend through its rows, on Redis through ``SCAN`` pages (counting and
resetting a whole limit walk its keys). ``--database`` reads the ``RateLimit`` rows of
that database instead of asking the limit's backend.
"""

from __future__ import annotations

import json
from argparse import SUPPRESS, ArgumentParser
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db.models import Count

from ...algorithms import State
from ...api import limiter
from ...backends import backend_aliases, get_backend
from ...backends.base import BackendError, BaseBackend, BucketPage, Request, StoredBucket
from ...backends.database import database_now as store_now
from ...backends.database.filters import count_by_state
from ...cleanup import MAX_BATCH_SIZE, CleanupReport, cleanup, database_alias, unknown_names
from ...keys import EncodedKey, encode_key, unredacted
from ...limits import LimitConfig
from ...live import FULL, LIMITED, PARTIAL, LiveState, live_state, one_token
from ...models import RateLimit
from ...registry import KnownLimit, known_limits
from ...request_keys import key_from_text
from ...shards import shard_configs, shard_key
from ...text import describe_rate, format_duration, format_tokens

_JSON_HINT = "e.g. null, 42, \"alice\" or [\"ip\", \"203.0.113.7\"]"
_REQUEST_KEY_HINT = "e.g. --key post:username=alice, --key ip=203.0.113.7, --key user=42"


def _from_json(value: Any) -> Any:
    """Return the key a JSON value stands for: arrays become tuples, as keys are."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise CommandError(f"a JSON key must be null, an integer, a string or an array of these ({_JSON_HINT})")
    if isinstance(value, list):
        return tuple(_from_json(part) for part in value)
    return value


class Command(BaseCommand):
    help = "List, inspect, reset and clean up rate limits (see docs/operations.md)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        # Accepted after the subcommand, where people type it.
        common = ArgumentParser(add_help=False)
        common.add_argument("--database", help="Database alias of the RateLimit table (default: the backend's).")
        # Django's own options, accepted after the subcommand too ("tokenbucket list
        # --settings X"); SUPPRESS keeps the values given before it.
        for flags, kwargs in (
            (("--settings",), {}),
            (("--pythonpath",), {}),
            (("-v", "--verbosity"), {"type": int, "choices": [0, 1, 2, 3]}),
            (("--traceback",), {"action": "store_true"}),
            (("--no-color",), {"action": "store_true"}),
            (("--force-color",), {"action": "store_true"}),
        ):
            common.add_argument(*flags, default=SUPPRESS, help=SUPPRESS, **kwargs)
        sub = parser.add_subparsers(dest="subcommand", required=True, metavar="{list,show,reset,cleanup}")

        listing = sub.add_parser(
            "list", parents=[common], help="Limits with their config, and how many keys each has stored."
        )
        listing.add_argument("--no-counts", action="store_true", help="Do not count stored keys (a table scan).")

        for name, text in (("show", "Show a limit, or one key's state now."), ("reset", "Reset one key, or all.")):
            command = sub.add_parser(name, parents=[common], help=text)
            command.add_argument("name", help="The limit's name.")
            command.add_argument(
                "key", nargs="?", help="The key, a string unless --int, --json or --digest is given."
            )
            forms = command.add_mutually_exclusive_group()
            forms.add_argument(
                "--int", action="store_true", dest="int_key", help="KEY is an integer (its digits' bucket)."
            )
            forms.add_argument("--json", action="store_true", dest="json_key", help=f"KEY is JSON ({_JSON_HINT}).")
            forms.add_argument(
                "--digest", action="store_true", help="KEY is the stored key digest, or a unique prefix of it."
            )
            forms.add_argument(
                "--key",
                dest="request_key",
                metavar="SPEC=VALUE",
                help="The key as @ratelimit(key=SPEC) and the DRF throttles build it, normalised as they do: "
                "post:username=alice, username=alice, header:X-Api-Key=..., get:q=..., ip=203.0.113.7, user=42.",
            )
            if name == "reset":
                command.add_argument(
                    "--yes", action="store_true", help="Without KEY: reset every key without asking."
                )
                command.add_argument(
                    "--no-input", "--noinput", action="store_false", dest="interactive", help="Never prompt."
                )

        clean = sub.add_parser("cleanup", parents=[common], help="Delete idle rows (keys that read as fresh).")
        clean.add_argument(
            "--batch-size", type=int, default=MAX_BATCH_SIZE, help=f"Rows per batch (1 to {MAX_BATCH_SIZE})."
        )
        clean.add_argument(
            "--remove-unknown",
            action="store_true",
            help="Also delete rows of limits that are not configured, once nothing has written them for "
            "--unknown-idle seconds.",
        )
        clean.add_argument(
            "--unknown-idle",
            type=float,
            metavar="SECONDS",
            help="With --remove-unknown: how long a row must be untouched (default: a week), since another "
            "service may use that limit.",
        )
        clean.add_argument("--dry-run", action="store_true", help="Report what would be deleted; delete nothing.")
        clean.add_argument("--max-seconds", type=float, help="Stop after this long (the next run continues).")
        clean.add_argument(
            "--pause", type=float, help="Seconds to sleep between batches (default: 0; 0.1 on SQLite)."
        )
        clean.add_argument("--name", action="append", dest="names", help="Only this limit (repeatable).")
        clean.add_argument("--json", action="store_true", dest="as_json", help="Print the report as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        database = options.get("database")
        if database is not None and database not in settings.DATABASES:
            raise CommandError(f"--database: {database!r} does not exist in DATABASES")
        handler = getattr(self, f"handle_{options['subcommand']}")
        handler(**options)

    # -- helpers ---------------------------------------------------------------------

    def _known(self, name: str, database: str | None, *, as_rows: bool = True) -> KnownLimit:
        limits = known_limits(as_rows=as_rows)
        if name in limits:
            return limits[name]
        known = ", ".join(sorted(limits)) or "none"
        message = (
            f"unknown rate limit {name!r}: not in TOKENBUCKET['LIMITS'], not declared inline by a view, "
            f"and not a DRF throttle scope (known: {known})"
        )
        stored = RateLimit.objects.using(database_alias(database)).filter(name=name).count()
        if stored:
            message += (
                f". {stored} row(s) are stored under this name: "
                f"'manage.py tokenbucket cleanup --remove-unknown' deletes them"
            )
        raise CommandError(message)

    def _key(self, options: dict[str, Any]) -> object:
        raw = options["key"]
        spec = options.get("request_key")
        if spec is not None:
            if raw is not None:
                raise CommandError("give the key once: as KEY or as --key SPEC=VALUE")
            key = key_from_text(spec)
            if key is None:
                raise CommandError(f"--key: {spec!r} is not SPEC=VALUE ({_REQUEST_KEY_HINT})")
            return key
        if raw is None:
            raise CommandError("--int, --json and --digest need a KEY")
        if options["int_key"]:
            try:
                return int(raw)
            except ValueError:
                raise CommandError(f"--int: {raw!r} is not an integer") from None
        if options["json_key"]:
            try:
                return _from_json(json.loads(raw))
            except json.JSONDecodeError as exc:
                raise CommandError(f"--json: {raw!r} is not JSON ({exc}); {_JSON_HINT}") from None
        return raw

    @staticmethod
    def _require_no_key_form(options: dict[str, Any]) -> None:
        if options["int_key"] or options["json_key"] or options["digest"]:
            raise CommandError("--int, --json and --digest need a KEY")
        if options.get("request_key") is not None:
            raise CommandError("--key names one key: it cannot apply to the whole limit")

    def _bucket_by_digest(self, limit: LimitConfig, prefix: str, database: str | None) -> tuple[StoredBucket, int]:
        """Return the one stored bucket of ``limit`` whose digest starts with ``prefix``, and the store's time."""
        prefix = prefix.lower()
        if len(prefix) < 8 or any(c not in "0123456789abcdef" for c in prefix):
            raise CommandError(f"--digest: {prefix!r} is not a digest or a prefix of 8+ hex digits")
        if database is not None:
            rows = list(
                RateLimit.objects.using(database)
                .filter(name=limit.name, key__startswith=prefix)
                .order_by("key")
                .values_list("key", "label", "value", "ts")[:2]
            )
            found = [StoredBucket(key, label, State(value, ts)) for key, label, value, ts in rows]
            now = store_now(database)
        else:
            backend = self._listing_backend(limit, "find a key by its digest")
            found, now = [], 0
            for page in _pages(backend, limit, digest_prefix=prefix, page_size=2):
                found += page.buckets
                now = page.now
                if len(found) > 1:
                    break
        if not found:
            raise CommandError(f"no key of {limit.name!r} has a digest starting with {prefix!r}")
        if len(found) > 1:
            raise CommandError(f"the digest prefix {prefix!r} matches several keys of {limit.name!r}: give more digits")
        return found[0], now

    @staticmethod
    def _listing_backend(limit: LimitConfig, what: str) -> BaseBackend:
        backend = limiter.backend(limit)
        if not backend.lists_buckets:
            raise CommandError(
                f"{limit.name!r} is stored on backend {limit.backend!r} ({type(backend).__name__}), which cannot "
                f"list its keys, so this command cannot {what}; give a key (--key SPEC=VALUE)"
            )
        return backend

    def _print_live(self, live: LiveState, stored: bool | None) -> None:
        self.stdout.write(f"  tokens now:   {format_tokens(live.value)} of {format_tokens(live.capacity)}")
        self.stdout.write(f"  state:        {live.state}")
        full = "full" if live.full_after == 0 else f"in {format_duration(live.full_after)}"
        self.stdout.write(f"  full again:   {full}")
        nxt = "available now" if live.next_token_after == 0 else f"in {format_duration(live.next_token_after)}"
        self.stdout.write(f"  next token:   {nxt}")
        if stored is not None:
            self.stdout.write(f"  stored row:   {'yes' if stored else 'no (a fresh key)'}")

    def _live_from_backend(self, limit: LimitConfig, key: EncodedKey) -> LiveState:
        """Read a key's state now from the limit's backend: a sharded limit's is the sum of its shards'."""
        backend = limiter.backend(limit)
        buckets = _buckets(limit, key)
        try:
            probe = backend.decide([Request(config, part, 0, reserve=True) for config, part in buckets], apply=False)
            value = sum(decision.value for decision in probe.decisions)
            wait = 0
            if value < one_token(limit):
                # The next token of the limit is the first one any of its buckets gets back.
                nexts = backend.decide(
                    [Request(config, part, one_token(config)) for config, part in buckets], apply=False
                ).decisions
                waits = [d.retry_after for d in nexts if d.retry_after is not None]
                wait = min(waits, default=0)
        except BackendError as exc:
            raise CommandError(f"the store failed: {exc}") from exc
        return LiveState(
            value=value,
            capacity=limit.capacity,
            full_after=max(decision.full_after for decision in probe.decisions),
            next_token_after=wait,
            now=probe.now,
            threshold=one_token(limit),
        )

    @staticmethod
    def _stored(limit: LimitConfig, key: EncodedKey, database: str | None) -> bool | None:
        """Whether the key has a stored bucket (None when the backend cannot say)."""
        digests = [part.digest for _, part in _buckets(limit, key)]
        if database is not None:
            return RateLimit.objects.using(database).filter(name=limit.name, key__in=digests).exists()
        backend = limiter.backend(limit)
        if not backend.lists_buckets:
            return None
        try:
            return any(backend.list_buckets(limit, digest_prefix=digest).buckets for digest in digests)
        except BackendError as exc:
            raise CommandError(f"the store failed: {exc}") from exc

    # -- list ------------------------------------------------------------------------

    def handle_list(self, *, database: str | None, no_counts: bool, **options: Any) -> None:
        limits = known_limits()
        counts: dict[str, int | str] = {}
        if not no_counts:
            counts.update(self._counts(limits, database))
        names = sorted(set(limits) | set(counts))
        if not names:
            self.stdout.write("No rate limits are configured, and none are stored.")
            return
        width = max(len(name) for name in names)
        for name in names:
            known = limits.get(name)
            count = counts.get(name, 0)
            stored = "" if no_counts else f"  {count} stored key(s)" if isinstance(count, int) else f"  {count}"
            if known is None:
                self.stdout.write(f"{name:<{width}}  NOT CONFIGURED{stored}")
            else:
                where = "" if database is not None else f" on {known.config.backend!r}"
                self.stdout.write(f"{name:<{width}}  {describe_rate(known.config)} [{known.source}]{stored}{where}")

    @staticmethod
    def _counts(limits: dict[str, KnownLimit], database: str | None) -> dict[str, int | str]:
        """Stored keys by limit: each backend counts its own limits; rows of names no
        limit here knows are counted in the database."""
        counts: dict[str, int | str] = {}
        if database is not None:
            rows = RateLimit.objects.using(database).order_by().values("name").annotate(rows=Count("pk"))
            return {row["name"]: row["rows"] for row in rows}
        for alias in backend_aliases():
            configs = [known.config for known in limits.values() if known.config.backend == alias]
            backend = get_backend(alias)
            if not configs:
                continue
            if not backend.lists_buckets:
                uncounted = f"stored keys not counted ({type(backend).__name__} cannot list them)"
                counts.update((config.name, uncounted) for config in configs)
                continue
            try:
                counts.update(backend.count_buckets(configs))
            except BackendError as exc:
                raise CommandError(f"backend {alias!r}: the store failed: {exc}") from exc
        counts.update(unknown_names(limits))
        return counts

    # -- show ------------------------------------------------------------------------

    def handle_show(self, *, name: str, database: str | None, **options: Any) -> None:
        known = self._known(name, database, as_rows=not _one_key(options))
        limit = known.config
        self.stdout.write(f"{name}: {describe_rate(limit)} [{known.source}]")
        if options["key"] is None and options.get("request_key") is None:
            self._require_no_key_form(options)
            self._show_summary(limit, database)
            return
        if options["digest"]:
            bucket, now = self._bucket_by_digest(limit, options["key"], database)
            live = live_state(limit, bucket.state, bucket.digest, now)
            self.stdout.write(f"key {bucket.label or '(no label)'} (digest {bucket.digest})")
            self._print_live(live, stored=True)
            return
        key = self._key(options)
        encoded = encode_key(key)
        self.stdout.write(f"key {unredacted(key)!r} (digest {encoded.digest})")
        self._print_live(self._live_from_backend(limit, encoded), self._stored(limit, encoded, database))

    def _show_summary(self, limit: LimitConfig, database: str | None) -> None:
        alias = database or limiter.backend(limit).database_alias()
        if alias is not None:
            rows = RateLimit.objects.using(alias).filter(name=limit.name)
            counts = count_by_state(rows, [limit], store_now(alias)).get(limit.name, {})
        else:
            # No index to count by state: every stored bucket is read, a page at a time.
            counts = {"stored": 0, LIMITED: 0, PARTIAL: 0, FULL: 0}
            for page in _pages(self._listing_backend(limit, "summarise its keys"), limit):
                for bucket in page.buckets:
                    counts["stored"] += 1
                    counts[live_state(limit, bucket.state, bucket.digest, page.now).state] += 1
        self.stdout.write(f"  stored keys:     {counts.get('stored', 0)}")
        self.stdout.write(f"  limited now:     {counts.get(LIMITED, 0)}")
        self.stdout.write(f"  partially used:  {counts.get(PARTIAL, 0)}")
        self.stdout.write(f"  full (idle):     {counts.get(FULL, 0)}")
        self.stdout.write("Keys without a stored row are fresh (full). Show one: tokenbucket show NAME KEY")

    # -- reset -----------------------------------------------------------------------

    def handle_reset(self, *, name: str, database: str | None, **options: Any) -> None:
        known = self._known(name, database, as_rows=not _one_key(options))
        limit = known.config
        if options["key"] is None and options.get("request_key") is None:
            self._require_no_key_form(options)
            self._reset_all(limit, database, yes=options["yes"], interactive=options["interactive"])
            return
        if options["digest"]:
            bucket, _now = self._bucket_by_digest(limit, options["key"], database)
            if database is not None:
                RateLimit.objects.using(database).filter(name=limit.name, key=bucket.digest).delete()
            else:
                try:
                    limiter.backend(limit).reset(limit, EncodedKey(bucket.digest, bucket.label))
                except BackendError as exc:
                    raise CommandError(f"the store failed: {exc}") from exc
            self.stdout.write(f"Reset {name} key {bucket.label or bucket.digest}: it starts full again.")
            return
        key = self._key(options)
        encoded = encode_key(key)
        existed = self._stored(limit, encoded, database)
        if not existed and self._live_from_backend(limit, encoded).value >= limit.capacity:
            # Saying "reset" here would tell an operator that a locked-out user is free.
            raise CommandError(
                f"{name} key {unredacted(key)!r} has no state to reset (it reads full): nothing matched. Keys that "
                f"@ratelimit and the DRF throttles build are not plain strings: give them as --key SPEC=VALUE "
                f"({_REQUEST_KEY_HINT}), or find the bucket in the admin and use --digest."
            )
        try:
            for config, part in _buckets(limit, encoded):
                limiter.backend(limit).reset(config, part)
        except BackendError as exc:
            raise CommandError(f"the store failed: {exc}") from exc
        # The operator typed the key: show it, normalised, as the bucket holds it.
        self.stdout.write(f"Reset {name} key {unredacted(key)!r}: it starts full again.")

    def _reset_all(self, limit: LimitConfig, database: str | None, *, yes: bool, interactive: bool) -> None:
        if database is not None:
            rows = RateLimit.objects.using(database).filter(name=limit.name)
            total = rows.count()
        else:
            backend = self._listing_backend(limit, "reset every key of it")
            try:
                total = backend.count_buckets([limit])[limit.name]
            except BackendError as exc:
                raise CommandError(f"the store failed: {exc}") from exc
        if total == 0:
            self.stdout.write(f"{limit.name}: no keys are stored; nothing to reset.")
            return
        if not yes:
            if not interactive:
                raise CommandError(f"refusing to reset all {total} keys of {limit.name!r} without --yes")
            answer = input(f"Reset all {total} stored keys of {limit.name!r}? They start full again. [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                raise CommandError("reset cancelled")
        if database is not None:
            deleted = 0
            while True:
                # In batches, so that no statement locks a large part of a live table.
                batch = list(rows.order_by().values_list("pk", flat=True)[:MAX_BATCH_SIZE])
                if not batch:
                    break
                deleted += RateLimit.objects.using(database).filter(pk__in=batch).delete()[0]
        else:
            try:
                deleted = backend.reset_all(limit, batch_size=MAX_BATCH_SIZE)
            except BackendError as exc:
                raise CommandError(f"the store failed: {exc}") from exc
        self.stdout.write(f"Reset {deleted} key(s) of {limit.name}: they start full again.")

    # -- cleanup ---------------------------------------------------------------------

    def handle_cleanup(self, *, database: str | None, **options: Any) -> None:
        names = options["names"]
        if names:
            limits = known_limits()
            unknown = [name for name in names if name not in limits]
            if unknown:
                raise CommandError(
                    f"unknown rate limit(s) {', '.join(map(repr, unknown))}; "
                    f"known: {', '.join(sorted(limits)) or 'none'}"
                )
        # Each database that holds a backend's rows; keys on Redis expire by themselves.
        aliases = [database] if database is not None else _cleanup_databases()
        reports = {}
        for alias in aliases:
            try:
                reports[alias] = cleanup(
                    names=names,
                    batch_size=options["batch_size"],
                    remove_unknown=options["remove_unknown"],
                    unknown_idle=options["unknown_idle"],
                    dry_run=options["dry_run"],
                    max_seconds=options["max_seconds"],
                    pause=options["pause"],
                    database=alias,
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from None
        if options["as_json"]:
            if len(reports) == 1:
                self.stdout.write(json.dumps(next(iter(reports.values())).as_dict(), sort_keys=True))
            else:
                self.stdout.write(json.dumps({alias: r.as_dict() for alias, r in reports.items()}, sort_keys=True))
            return
        for alias, report in reports.items():
            if len(reports) > 1:
                self.stdout.write(f"Database {alias!r}:")
            self._print_cleanup(report, names, options)
        if database is None:
            for alias in backend_aliases():
                backend = get_backend(alias)
                if backend.database_alias() is None:
                    self.stdout.write(
                        f"Backend {alias!r} ({type(backend).__name__}): its keys expire when their bucket is full "
                        f"again; nothing to clean up."
                    )

    def _print_cleanup(self, report: CleanupReport, names: list[str] | None, options: dict[str, Any]) -> None:
        verb = "Would delete" if report.dry_run else "Deleted"
        self.stdout.write(
            f"{verb} {report.deleted_total} idle row(s) in {report.batches} batch(es), {report.seconds:.2f} s "
            f"({report.rows_per_second:.0f} rows/s; slowest batch {report.slowest_batch * 1000:.1f} ms); "
            f"kept {report.kept} candidate(s) that are not idle."
        )
        for name, deleted in sorted(report.deleted.items()):
            if deleted:
                self.stdout.write(f"  {name}: {deleted}")
        if not report.complete:
            self.stdout.write("Stopped at --max-seconds; the next run continues.")
        if report.unknown:
            removed = options["remove_unknown"] and not names
            for name, rows in report.unknown.items():
                if removed:
                    gone = report.deleted.get(name, 0)
                    verb = "would be removed" if report.dry_run else "removed"
                    self.stderr.write(
                        f"Limit {name!r} is not configured: {gone} of {rows} row(s) {verb} "
                        f"(the others were written too recently)."
                    )
                else:
                    self.stderr.write(f"Limit {name!r} is not configured: {rows} row(s) kept.")
            if not removed:
                self.stderr.write("Delete rows of limits that are not configured with --remove-unknown.")


def _cleanup_databases() -> list[str]:
    """The databases of the backends that store rows; the default backend's first."""
    aliases = [get_backend(alias).database_alias() for alias in backend_aliases()]
    found = list(dict.fromkeys(alias for alias in aliases if alias is not None))
    return found or [database_alias()]


def _pages(backend: BaseBackend, limit: LimitConfig, **kwargs: Any) -> Iterator[BucketPage]:
    """Every page of ``limit``'s stored buckets, from the first to the last."""
    cursor = None
    while True:
        try:
            page = backend.list_buckets(limit, cursor=cursor, **kwargs)
        except BackendError as exc:
            raise CommandError(f"the store failed: {exc}") from exc
        yield page
        if page.cursor is None:
            return
        cursor = page.cursor


def _buckets(limit: LimitConfig, key: EncodedKey) -> list[tuple[LimitConfig, EncodedKey]]:
    """Return the buckets that hold ``key`` of ``limit``: itself, or each of its shards."""
    if limit.shards == 1:
        return [(limit, key)]
    return [(shard, shard_key(key, index, limit.shards)) for index, shard in enumerate(shard_configs(limit))]


def _one_key(options: dict[str, Any]) -> bool:
    """Whether the command names one key as callers give it (a sharded limit's whole config
    applies), rather than the limit's rows or one row by digest (a shard's config applies)."""
    given = options["key"] is not None or options.get("request_key") is not None
    return given and not options["digest"]
