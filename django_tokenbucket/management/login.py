"""``manage.py tokenbucket unlock [--username U] [--ip A]``: end a login lockout.

Through ``django_tokenbucket.auth.unlock``: for every entry of ``TOKENBUCKET["LOGIN"]["KEYS"]``
made of the parts given, the key's block (a lockout's, or one made by hand) is removed
and its bucket filled, normalised as a login's keys are (``--username " Alice "`` is
``alice``'s bucket, ``--ip`` an address as an access log shows it).
"""

from __future__ import annotations

from argparse import ArgumentParser, _SubParsersAction
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, OutputWrapper

from .. import overrides
from ..auth import unlock
from ..auth.config import configured

__all__ = ["SUBCOMMANDS", "LoginCommands", "add_login_parsers"]

#: The subcommands this module handles, as ``tokenbucket``'s usage lists them.
SUBCOMMANDS = ("unlock",)


def add_login_parsers(sub: _SubParsersAction[ArgumentParser], parent: ArgumentParser) -> None:
    """Add ``unlock`` to ``tokenbucket``'s subparsers (``parent``: Django's options)."""
    text = "End the login lockouts of a username, an address, or both (login protection: docs/login.md)."
    command = sub.add_parser("unlock", parents=[parent], help=text, description=text)
    command.add_argument("--username", help="The username, as typed at the login (normalised as logins are).")
    command.add_argument("--ip", help="The client's address (an IPv6 address reaches its network's bucket).")


class LoginCommands:
    """The handler of ``unlock``, mixed into ``tokenbucket``'s Command."""

    stdout: OutputWrapper

    def handle_unlock(self, *, username: str | None, ip: str | None, **options: Any) -> None:
        if username is None and ip is None:
            raise CommandError("unlock: give --username, --ip, or both")
        try:
            done = unlock(username=username, ip=ip)
            login = configured()
        except (ValueError, ImproperlyConfigured) as exc:
            raise CommandError(f"unlock: {exc}") from None
        assert login is not None
        given = {part for part, value in (("username", username), ("ip", ip)) if value is not None}
        for unlocked in done:
            state = "removed its block" if unlocked.unblocked else "no block"
            bucket = "filled its bucket (it was empty)" if unlocked.was_empty else "filled its bucket"
            self.stdout.write(f"Unlocked {login.limit} key {unlocked.typed}: {state}, {bucket}.")
        reached = {unlocked.entry for unlocked in done}
        for entry in login.keys:
            if entry not in reached:
                missing = ", ".join(f"--{part.replace('_', '-')}" for part in entry if part not in given)
                self.stdout.write(f"Not reached: the KEYS entry {'+'.join(entry)} needs {missing} too.")
        if any(unlocked.unblocked for unlocked in done):
            self.stdout.write(f"Every process stops applying the removed blocks within {_max_age()} s.")
        if not done:
            raise CommandError(
                f"unlock: no entry of TOKENBUCKET['LOGIN']['KEYS'] is made of {' and '.join(sorted(given))} alone"
            )


def _max_age() -> str:
    settings = overrides.active()
    return "—" if settings is None else f"{settings.max_age:g}"
