"""``manage.py tokenbucket override|exempt|block|unblock|overrides``: runtime overrides from a shell.

The subcommands of ``tokenbucket`` that change one key's limit (or every key's) while
the site runs, through ``limiter.override``/``exempt``/``block``/``clear_override``,
so that the checks, the key normalisation and the version stamp are the API's own. A
key is given as ``show`` and ``reset`` take it (KEY, ``--int``, ``--json``, ``--key
SPEC=VALUE``); none means every key of the limit. ``created_by`` is
``manage.py tokenbucket (user@host)`` unless ``--created-by`` says otherwise.
"""

from __future__ import annotations

from argparse import ArgumentParser, ArgumentTypeError, _SubParsersAction
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, OutputWrapper
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from .. import overrides
from ..api import limiter
from ..keys import as_typed
from ..models import LimitOverride
from ..override_operations import (
    DURATION_HINT,
    author,
    describe_expiry,
    describe_numbers,
    ends,
    now,
    override_spec_key,
    parse_duration,
    reached,
    refused_views,
    replaced,
    shown_key,
)
from ..rates import shown
from ..registry import KnownLimit, known_limits
from ..text import printable

__all__ = ["SUBCOMMANDS", "OverrideCommands", "add_override_parsers"]

#: The subcommands this module handles, as ``tokenbucket``'s usage lists them.
SUBCOMMANDS = ("override", "exempt", "block", "unblock", "overrides")

_MAKES = {
    "override": "Replace some of a limit's numbers for one key (or every key) while the site runs.",
    "exempt": "Let every call of one key (or every key) through, counting nothing.",
    "block": "Refuse every call of one key (or every key), spending nothing.",
}
_PAST = {overrides.LIMIT: "Overrode", overrides.EXEMPT: "Exempted", overrides.BLOCK: "Blocked"}


def _add_key_forms(command: ArgumentParser) -> None:
    command.add_argument("name", help="The limit's name.")
    command.add_argument("key", nargs="?", help="The key, a string unless --int or --json; none: every key.")
    forms = command.add_mutually_exclusive_group()
    forms.add_argument("--int", action="store_true", dest="int_key", help="KEY is an integer (its digits' bucket).")
    forms.add_argument("--json", action="store_true", dest="json_key", help="KEY is JSON (null, 42, \"a\", [...]).")
    forms.add_argument(
        "--key",
        dest="request_key",
        metavar="SPEC=VALUE",
        help="The key as @ratelimit(key=SPEC) and the DRF throttles build it, normalised as they do: "
        "post:username=alice, username=alice, header:X-Api-Key=..., ip=203.0.113.7, user=42.",
    )


def add_override_parsers(sub: _SubParsersAction[ArgumentParser], parent: ArgumentParser) -> None:
    """Add the override subcommands to ``tokenbucket``'s subparsers (``parent``: Django's options)."""
    for name, text in _MAKES.items():
        command = sub.add_parser(name, parents=[parent], help=text, description=text)
        _add_key_forms(command)
        if name == "override":
            command.add_argument(
                "--rate", help="A rate string, e.g. 100/m or 5000/d (its period replaces the limit's)."
            )
            command.add_argument("--capacity", type=_amount, help="The burst: tokens a full bucket holds.")
            command.add_argument("--max-reserved", type=_amount, help="Tokens that may be reserved ahead.")
        until = command.add_mutually_exclusive_group()
        until.add_argument("--for", dest="duration", metavar="DURATION", help=f"How long ({DURATION_HINT}).")
        until.add_argument(
            "--until", dest="until", metavar="DATETIME", help="When it ends, e.g. 2026-12-01T09:00 (local time)."
        )
        command.add_argument("--reason", default="", help="Why: shown in the admin and by 'tokenbucket overrides'.")
        command.add_argument(
            "--created-by", default="", help="Who asked for it (default: manage.py tokenbucket (user@host))."
        )
    unblock = sub.add_parser(
        "unblock",
        parents=[parent],
        help="Remove the override of one key (or the one of every key), whatever its action.",
    )
    _add_key_forms(unblock)
    listing = sub.add_parser("overrides", parents=[parent], help="The overrides in force, of one limit or all.")
    listing.add_argument("name", nargs="?", help="Only this limit.")
    listing.add_argument("--all", action="store_true", dest="expired_too", help="Expired ones too.")


class OverrideCommands:
    """The handlers of ``add_override_parsers``' subcommands, mixed into ``tokenbucket``'s Command.

    Uses the Command's ``_key`` (the key forms of ``show`` and ``reset``), ``_known``
    (an unknown limit's error) and ``stdout``.
    """

    stdout: OutputWrapper
    stderr: OutputWrapper

    def _override_key(self, options: dict[str, Any], *, making: bool = False) -> object:
        """The key the options name (None: every key); ``making`` an override, a --key spec
        that no view of the limit keys by is refused (it would reach no request's bucket)."""
        if options["key"] is None and options.get("request_key") is None:
            if options["int_key"] or options["json_key"]:
                raise CommandError(f"{options['name']!r}: --int and --json need a KEY")
            return None
        if making and options.get("request_key") is not None and options["key"] is None:
            try:
                key, warning = override_spec_key(options["name"], options["request_key"])
            except ValueError as exc:
                raise CommandError(f"--key: {exc}") from None
            if warning is not None:
                self.stderr.write(f"Warning: {warning}.")
            return key
        return self._key({**options, "digest": False})

    @staticmethod
    def _until(name: str, options: dict[str, Any]) -> timedelta | datetime | None:
        if options.get("duration"):
            try:
                return parse_duration(options["duration"])
            except ValueError as exc:
                raise CommandError(f"rate limit {name!r}: --for: {exc}") from None
        if options.get("until"):
            try:
                moment = parse_datetime(options["until"].strip())
            except ValueError:
                moment = None
            if moment is None:
                raise CommandError(
                    f"rate limit {name!r}: --until: {shown(options['until'])} is not a date and time "
                    f"(e.g. 2026-12-01T09:00 or 2026-12-01 09:00+01:00)"
                )
            return moment if timezone.is_aware(moment) else timezone.make_aware(moment)
        return None

    def _make(self, action: str, name: str, options: dict[str, Any]) -> None:
        known: KnownLimit = self._known(name, None, as_rows=False)
        key = self._override_key(options, making=True)
        common = {
            "until": self._until(name, options),
            "reason": options["reason"],
            "created_by": author(options["created_by"]),
        }
        try:
            if action == overrides.LIMIT:
                row = limiter.override(
                    name,
                    key,
                    rate=options["rate"],
                    capacity=options["capacity"],
                    max_reserved=options["max_reserved"],
                    **common,
                )
            elif action == overrides.EXEMPT:
                row = limiter.exempt(name, key, **common)
            else:
                row = limiter.block(name, key, **common)
        except (ValueError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc)) from None
        whom = "every key" if key is None else f"key {as_typed(key)}"
        self.stdout.write(
            f"{_PAST[action]} {name} {whom}: {describe_numbers(row, known.config)}, "
            f"{_ending(describe_expiry(row))}."
        )
        if key is not None:
            self.stdout.write(f"It reaches {printable(reached(known.config, key))}.")
        for warning in refused_views(row, known.config):
            self.stderr.write(f"Warning: {warning}.")
        self.stdout.write(
            f"Every process applies it within {_max_age()} s; 'tokenbucket unblock {name}' with the same key ends it."
        )

    def handle_override(self, *, name: str, **options: Any) -> None:
        self._make(overrides.LIMIT, name, {"name": name, **options})

    def handle_exempt(self, *, name: str, **options: Any) -> None:
        self._make(overrides.EXEMPT, name, {"name": name, **options})

    def handle_block(self, *, name: str, **options: Any) -> None:
        self._make(overrides.BLOCK, name, {"name": name, **options})

    def handle_unblock(self, *, name: str, **options: Any) -> None:
        key = self._override_key({"name": name, **options})
        whom = "every key" if key is None else f"key {as_typed(key)}"
        # The limit need not be configured any more: its overrides can still be removed.
        try:
            found = replaced(name, overrides.key_digest(name, key).digest)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if found is None:
            raise CommandError(
                f"rate limit {name!r} has no override for {whom}: nothing removed "
                f"('tokenbucket overrides {name}' lists those in force)"
            )
        limiter.clear_override(name, key)
        end = ends(found)
        state = "expired " if end is not None and end <= now() else ""
        made = f", made by {printable(found.created_by)}" if found.created_by else ""
        why = f" ({_one_line(found.reason)})" if found.reason else ""
        self.stdout.write(f"Removed the {state}{printable(found.action)} override of {name} {whom}{made}{why}.")

    def handle_overrides(self, *, name: str | None, expired_too: bool, **options: Any) -> None:
        if expired_too:
            rows = LimitOverride.objects.using(overrides.database_alias()).order_by("name", "key")
            found = list(rows if name is None else rows.filter(name=name))
        else:
            found = limiter.overrides(name)
        if not found:
            where = f" of {name!r}" if name else ""
            self.stdout.write(f"No overrides{where} {'stored' if expired_too else 'in force'}.")
            return
        limits = known_limits(as_rows=False)
        at = now()
        table = [("limit", "key", "action", "numbers", "expires", "reason", "created by")]
        for row in found:
            known = limits.get(row.name)
            # Every cell but the computed ones was written by someone with the add
            # permission (or by hand in the table): escaped, so that none drives the terminal.
            table.append(
                (
                    printable(row.name),
                    printable(shown_key(row)),
                    printable(row.action),
                    describe_numbers(row, known.config if known else None),
                    describe_expiry(row, at),
                    _one_line(row.reason),
                    printable(row.created_by),
                )
            )
        widths = [max(len(line[column]) for line in table) for column in range(len(table[0]) - 1)]
        for line in table:
            cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)] + [line[-1]]
            self.stdout.write("  ".join(cells).rstrip())

    if TYPE_CHECKING:

        def _key(self, options: dict[str, Any]) -> object: ...

        def _known(self, name: str, database: str | None, *, as_rows: bool = True) -> KnownLimit: ...


def _amount(text: str) -> Decimal:
    """``--capacity`` and ``--max-reserved`` as typed: exact, as the admin's fields read them
    (a float would drop a 17th digit rather than refuse it), and refused past 40
    characters before they are read. The limiter checks the rest."""
    if len(text) > _MAX_AMOUNT_LENGTH:
        raise ArgumentTypeError(f"{shown(text)} is longer than any amount of tokens")
    try:
        return Decimal(text.strip())
    except ArithmeticError:
        raise ArgumentTypeError(f"{shown(text)} is not a number") from None


_MAX_AMOUNT_LENGTH = 40


def _one_line(reason: str) -> str:
    """A reason (a textarea's, so perhaps several lines) on one line, escaped for a terminal."""
    return printable(" ".join(reason.split()))


def _ending(expiry: str) -> str:
    return "until cleared" if expiry == "never" else f"ends {expiry}"


def _max_age() -> str:
    settings = overrides.active()
    return "—" if settings is None else f"{settings.max_age:g}"


