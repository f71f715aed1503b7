"""``manage.py tokenbucket list|show|reset|cleanup``: inspect and maintain rate limits;
``override|exempt|block|unblock|overrides``: runtime overrides (``management/overrides.py``);
``top|stats``: who is being limited, from the analytics (``management/analytics.py``);
``unlock``: end a login lockout (``management/login.py``).

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

Rows of a name this process cannot read are reported as decided with ``config=`` at call
sites (the limit of a service or worker that passes its config in code, or one no
longer used), never as garbage to delete: ``cleanup`` keeps them unless told otherwise
(``--remove-unknown``). The buckets of ``@ratelimit(rate=callable)`` spell their plan's
config in their name (``django_tokenbucket.plans``), so every process reads them.

Every subcommand works on every backend a limit may be stored on (its ``"backend"``):
on the database backend through its rows, on Redis through ``SCAN`` pages (counting and
resetting a whole limit walk its keys). ``--database`` reads the ``RateLimit`` rows of
that database instead of asking the limit's backend.
"""

from __future__ import annotations

import json
import re
import sys
from argparse import SUPPRESS, ArgumentParser
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from ... import operations
from ...backends import backend_aliases, get_backend, row_backend
from ...backends.base import BackendError, BaseBackend, CleanupReport, StoredBucket
from ...cleanup import MAX_BATCH_SIZE, cleanup, database_alias
from ...keys import as_typed, encode_key, key_from_json
from ...limits import LimitConfig
from ...live import FULL, LIMITED, PARTIAL, LiveState, live_state
from ...override_operations import key_from_spec
from ...rates import shown
from ...registry import CALL_SITES, KnownLimit, interpret, known_limits, plan_bases
from ...text import describe_rate, format_duration, format_tokens, printable
from ..analytics import SUBCOMMANDS as ANALYTICS_SUBCOMMANDS
from ..analytics import AnalyticsCommands, add_analytics_parsers
from ..login import SUBCOMMANDS as LOGIN_SUBCOMMANDS
from ..login import LoginCommands, add_login_parsers
from ..overrides import SUBCOMMANDS, OverrideCommands, add_override_parsers

_JSON_HINT = "e.g. null, 42, \"alice\" or [\"ip\", \"203.0.113.7\"]"
_REQUEST_KEY_HINT = "e.g. --key post:username=alice, --key ip=203.0.113.7, --key user=42"
_DIGITS = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)


def _from_json(value: Any) -> Any:
    """Return the key a JSON value stands for: arrays become tuples, as keys are."""
    try:
        return key_from_json(value)
    except ValueError as exc:
        raise CommandError(f"--json: {exc} ({_JSON_HINT})") from None


class Command(LoginCommands, AnalyticsCommands, OverrideCommands, BaseCommand):
    help = "List, inspect, reset and clean up rate limits, and override them (see docs/operations.md)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        # Django's own options, accepted after the subcommand too ("tokenbucket list
        # --settings X"); SUPPRESS keeps the values given before it.
        django_options = ArgumentParser(add_help=False)
        for flags, kwargs in (
            (("--settings",), {}),
            (("--pythonpath",), {}),
            (("-v", "--verbosity"), {"type": int, "choices": [0, 1, 2, 3]}),
            (("--traceback",), {"action": "store_true"}),
            (("--no-color",), {"action": "store_true"}),
            (("--force-color",), {"action": "store_true"}),
        ):
            django_options.add_argument(*flags, default=SUPPRESS, help=SUPPRESS, **kwargs)
        # Accepted after the subcommand, where people type it.
        common = ArgumentParser(add_help=False, parents=[django_options])
        common.add_argument("--database", help="Database alias of the RateLimit table (default: the backend's).")
        names = ",".join(("list", "show", "reset", "cleanup", *SUBCOMMANDS, *ANALYTICS_SUBCOMMANDS, *LOGIN_SUBCOMMANDS))
        sub = parser.add_subparsers(dest="subcommand", required=True, metavar=f"{{{names}}}")

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
            help="Also delete rows of names this process cannot read (limits decided with config= at call "
            "sites it never ran, or no longer used), once nothing has written them for --unknown-idle seconds.",
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
        # Overrides live in the overrides' database, whatever backend decides: no --database.
        add_override_parsers(sub, django_options)
        add_analytics_parsers(sub, django_options)
        add_login_parsers(sub, django_options)

    def handle(self, *args: Any, **options: Any) -> None:
        database = options.get("database")
        if database is not None and database not in settings.DATABASES:
            raise CommandError(f"--database: {database!r} does not exist in DATABASES")
        handler = getattr(self, f"handle_{options['subcommand']}")
        try:
            handler(**options)
        except BackendError as exc:
            raise CommandError(f"the store failed: {exc}") from exc

    # -- helpers ---------------------------------------------------------------------

    def _known(self, name: str, database: str | None, *, as_rows: bool = True) -> KnownLimit:
        limits = known_limits(as_rows=as_rows)
        known = interpret(name, limits, as_rows=as_rows)
        if known is not None:
            return known
        stored = self._stored_rows(name, database)
        if stored:
            raise CommandError(_unreadable(name, stored))
        listed = ", ".join(sorted(limits)) or "none"
        raise CommandError(
            f"unknown rate limit {name!r}: not in TOKENBUCKET['LIMITS'], not declared inline by a view, "
            f"not a DRF throttle scope, and nothing is stored under it (known: {listed})"
        )

    @staticmethod
    def _stored_rows(name: str, database: str | None) -> int:
        return row_backend(database).stored_names().get(name, 0)

    def _key(self, options: dict[str, Any]) -> object:
        raw = options["key"]
        spec = options.get("request_key")
        if spec is not None:
            if raw is not None:
                raise CommandError("give the key once: as KEY or as --key SPEC=VALUE")
            if not spec.strip():
                raise CommandError(f"--key: an empty key is not SPEC=VALUE ({_REQUEST_KEY_HINT})")
            try:
                # Built as the requests of this limit build theirs (the native decorator's
                # or the django-ratelimit layer's keys).
                return key_from_spec(options["name"], spec)
            except ValueError as exc:
                raise CommandError(f"--key: {exc}") from None
        if raw is None:
            raise CommandError("--int, --json and --digest need a KEY")
        if options["int_key"]:
            try:
                return int(raw)  # Python refuses more than sys.get_int_max_str_digits() digits, unread
            except ValueError:
                most = sys.get_int_max_str_digits()
                # Say so, rather than call a number of 5,000 digits "not an integer".
                problem = f"has more than {most:,} digits" if _DIGITS.fullmatch(raw) else "is not an integer"
                raise CommandError(f"--int: {shown(raw)} {problem}") from None
        if options["json_key"]:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise CommandError(f"--json: {shown(raw)} is not JSON ({exc}); {_JSON_HINT}") from None
            except (ValueError, RecursionError):
                # A number of more digits than int() converts, or arrays nested past the
                # parser's recursion: JSON, but no key anyone passes.
                raise CommandError(
                    f"--json: {shown(raw)} is not JSON a key can be (a number of too many digits, or "
                    f"arrays nested too deep); {_JSON_HINT}"
                ) from None
            return _from_json(value)
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
        shortest = operations.DIGEST_PREFIX_LENGTH
        if len(prefix) < shortest or any(c not in "0123456789abcdef" for c in prefix):
            raise CommandError(f"--digest: {prefix!r} is not a digest or a prefix of {shortest}+ hex digits")
        backend = self._listing_backend(limit, database, "find a key by its digest")
        found, now = operations.find_by_digest(backend, limit, prefix)
        if not found:
            raise CommandError(f"no key of {limit.name!r} has a digest starting with {prefix!r}")
        if len(found) > 1:
            raise CommandError(f"the digest prefix {prefix!r} matches several keys of {limit.name!r}: give more digits")
        return found[0], now

    @staticmethod
    def _listing_backend(limit: LimitConfig, database: str | None, what: str) -> BaseBackend:
        backend = operations.store_of(limit, database)
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

    # -- list ------------------------------------------------------------------------

    def handle_list(self, *, database: str | None, no_counts: bool, **options: Any) -> None:
        limits = known_limits()
        counts: dict[str, int | str] = {}
        if not no_counts:
            counts.update(operations.count_stored(limits, database))
        bases = {f"{base}[plan ...]": view for base, view in plan_bases(load_views=False).items()}
        names = sorted(set(limits) | set(counts) | set(bases))
        if not names:
            self.stdout.write("No rate limits are configured, and none are stored.")
            return
        # A stored name is whatever a row holds, not only what LIMITS validated.
        shown = {name: printable(name) for name in names}
        width = max(len(text) for text in shown.values())
        for name in names:
            if name in bases:
                self.stdout.write(f"{shown[name]:<{width}}  a bucket per plan: the rate callable of {bases[name]}")
                continue
            known = interpret(name, limits)
            count = counts.get(name, 0)
            stored = "" if no_counts else f"  {count} stored key(s)" if isinstance(count, int) else f"  {count}"
            if known is None:
                # Live rows, perhaps: another process decides them with its own config=.
                self.stdout.write(f"{shown[name]:<{width}}  {CALL_SITES}; not readable here{stored}")
            else:
                where = "" if database is not None else f" on {known.config.backend!r}"
                line = f"{describe_rate(known.config)} [{known.source}]{stored}{where}"
                self.stdout.write(f"{shown[name]:<{width}}  {line}")

    # -- show ------------------------------------------------------------------------

    def handle_show(self, *, name: str, database: str | None, **options: Any) -> None:
        whole = options["key"] is None and options.get("request_key") is None
        if whole and interpret(name, as_rows=True) is None:
            stored = self._stored_rows(name, database)
            if stored:
                # Not an error: the rows are there and someone decides them; this process
                # only lacks their config.
                self._require_no_key_form(options)
                self.stdout.write(f"{name}: {CALL_SITES}")
                self.stdout.write(f"  stored keys:     {stored}")
                self.stdout.write(f"  {_unreadable(name, stored)}.")
                return
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
            self.stdout.write(f"key {printable(bucket.label) or '(no label)'} (digest {printable(bucket.digest)})")
            self._print_live(live, stored=True)
            return
        key = self._key({**options, "name": name})
        encoded = encode_key(key)
        self.stdout.write(f"key {as_typed(key)} (digest {encoded.digest})")
        live = operations.key_state(operations.store_of(limit), limit, encoded)
        self._print_live(live, operations.is_stored(operations.store_of(limit, database), limit, encoded))

    def _show_summary(self, limit: LimitConfig, database: str | None) -> None:
        counts = operations.counts_by_state(self._listing_backend(limit, database, "summarise its keys"), limit)
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
            operations.reset_buckets(operations.store_of(limit, database), limit.name, [bucket.digest])
            self.stdout.write(f"Reset {name} key {printable(bucket.label or bucket.digest)}: it starts full again.")
            return
        key = self._key({**options, "name": name})
        encoded = encode_key(key)
        backend = operations.store_of(limit)
        existed = operations.is_stored(operations.store_of(limit, database), limit, encoded)
        if not existed and operations.key_state(backend, limit, encoded).value >= limit.capacity:
            # Saying "reset" here would tell an operator that a locked-out user is free.
            raise CommandError(
                f"{name} key {as_typed(key)} has no state to reset (it reads full): nothing matched. Keys that "
                f"@ratelimit and the DRF throttles build are not plain strings: give them as --key SPEC=VALUE "
                f"({_REQUEST_KEY_HINT}), or find the bucket in the admin and use --digest."
            )
        operations.reset_key(backend, limit, encoded)
        # The operator typed the key: show it, normalised, as the bucket holds it.
        self.stdout.write(f"Reset {name} key {as_typed(key)}: it starts full again.")

    def _reset_all(self, limit: LimitConfig, database: str | None, *, yes: bool, interactive: bool) -> None:
        backend = self._listing_backend(limit, database, "reset every key of it")
        total = backend.count_buckets([limit])[limit.name]
        if total == 0:
            self.stdout.write(f"{limit.name}: no keys are stored; nothing to reset.")
            return
        stored = "the 1 stored key" if total == 1 else f"all {total} stored keys"
        if not yes:
            if not interactive:
                raise CommandError(f"refusing to reset {stored} of {limit.name!r} without --yes")
            try:
                answer = input(f"Reset {stored} of {limit.name!r}? They start full again. [y/N] ")
            except EOFError:
                # Run from cron or CI, stdin is closed: no answer is a no.
                raise CommandError(
                    f"reset cancelled: no answer on stdin; pass --yes to reset {stored} of {limit.name!r}"
                ) from None
            if answer.strip().lower() not in ("y", "yes"):
                raise CommandError("reset cancelled")
        deleted = operations.reset_all(backend, limit, batch_size=MAX_BATCH_SIZE)
        self.stdout.write(f"Reset {deleted} key(s) of {limit.name}: they start full again.")

    # -- cleanup ---------------------------------------------------------------------

    def handle_cleanup(self, *, database: str | None, **options: Any) -> None:
        names = options["names"]
        if names:
            limits = known_limits()
            # A name with rows is asked about on purpose: its rows are reported (and kept).
            stored = row_backend(database).stored_names()
            unknown = [name for name in names if interpret(name, limits) is None and not stored.get(name)]
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
                if not backend.needs_cleanup:
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
                self.stdout.write(f"  {printable(name)}: {deleted}")
        if report.analytics_trimmed:
            self.stdout.write(f"Trimmed {report.analytics_trimmed} denial-analytics row(s) past their retention.")
        if report.overrides_removed:
            self.stdout.write(
                f"{verb} {report.overrides_removed} override(s) expired longer ago than OVERRIDES['KEEP_EXPIRED']."
            )
        if not report.complete:
            self.stdout.write("Stopped at --max-seconds; the next run continues.")
        if report.unknown:
            removed = options["remove_unknown"] and not names
            for name, rows in report.unknown.items():
                if removed:
                    gone = report.deleted.get(name, 0)
                    verb = "would be removed" if report.dry_run else "removed"
                    self.stderr.write(
                        f"Limit {name!r} cannot be read here ({CALL_SITES}, or no longer used): {gone} of {rows} "
                        f"row(s) {verb} (the others were written too recently)."
                    )
                else:
                    self.stderr.write(
                        f"Limit {name!r} cannot be read here ({CALL_SITES}, or no longer used): {rows} row(s) kept."
                    )
            if not removed:
                # Never a hint to delete them: they may be live buckets of another process.
                self.stderr.write(
                    "Rows this process cannot read are kept. Define those limits in TOKENBUCKET['LIMITS'] (or "
                    "decide them with @ratelimit(rate=callable)) and cleanup reads and tidies them too."
                )


def _unreadable(name: str, stored: int) -> str:
    """Say why the command cannot read ``name``'s ``stored`` rows, and how to make it able to."""
    return (
        f"{stored} row(s) are stored under {name!r}, which is not in TOKENBUCKET['LIMITS'], not declared by a "
        f"view and not a DRF throttle scope: the limit of code that passes config= at its call sites (a service "
        f"or worker this process never ran), or no longer used. This process cannot read their tokens; define "
        f"the limit in TOKENBUCKET['LIMITS'] to read and tidy them here"
    )


def _cleanup_databases() -> list[str]:
    """The databases of the backends that store rows; the default backend's first."""
    backends = [get_backend(alias) for alias in backend_aliases()]
    found = [backend.database_alias() for backend in backends if backend.needs_cleanup]
    return list(dict.fromkeys(alias for alias in found if alias is not None)) or [database_alias()]


def _one_key(options: dict[str, Any]) -> bool:
    """Whether the command names one key as callers give it (a sharded limit's whole config
    applies), rather than the limit's rows or one row by digest (a shard's config applies)."""
    given = options["key"] is not None or options.get("request_key") is not None
    return given and not options["digest"]
