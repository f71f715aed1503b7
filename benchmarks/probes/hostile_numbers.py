"""What does a hostile number cost the admin and the parsers now? (issue 47, item 11)

A bucket page's *Give ×N* read ``factor=1e3000000`` as an exact Fraction before its
range check: 1.4–2.0 s of CPU per POST. This probe posts hostile factors and a refused
plain one (``zero``: the same path, parse, refuse, message, redirect) to a bucket page,
taking turns, and reads the CPU each costs; then the parsers alone, and, for scale, what
the code before the fix built for the same text (``Fraction(Decimal(text))``):

    TOKENBUCKET_TEST_DB=sqlite .venv/bin/python benchmarks/probes/hostile_numbers.py

Prints one JSON object: per case, the median CPU of ``--repeat`` calls, in milliseconds
(POSTs) or microseconds (parsers and the old build).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction

from _setup import DB, bench_database  # configures Django: first

# isort: split

from django.contrib.auth.models import User
from django.test import Client

from benchmarks.probes.timing import rotate
from django_tokenbucket import limiter
from django_tokenbucket.keys import encode_key
from django_tokenbucket.override_operations import factor_of, parse_duration

HOSTILE = {
    "1e3000000": "1e3000000",
    "1e10000000": "1e10000000",
    "1e-3000000": "1e-3000000",
    "9 x 100,000": "9" * 100_000,
}
OVERRIDE = "/admin/django_tokenbucket/ratelimit/buckets/default/override/"


def cpu(call: Callable[[], object]) -> float:
    """The CPU seconds of one ``call()``."""
    start = time.process_time()
    call()
    return time.process_time() - start


def refused(parse: Callable[[str], object], text: str) -> Callable[[], object]:
    def call() -> None:
        try:
            parse(text)
        except ValueError:
            return
        raise AssertionError(f"{text[:20]!r} was accepted")

    return call


def posts(repeat: int) -> dict[str, float]:
    """Median CPU (ms) of a bucket page's ×N POST per factor, the factors taking turns."""
    limiter.limit("login", "alice")
    digest = encode_key("alice").digest
    client = Client()
    client.force_login(User.objects.create_superuser("root", password="pw"))
    cases = {"zero (refused, plain)": "zero", **HOSTILE}
    forms = {
        case: {"name": "login", "digest": digest, "action": "multiply", "factor": factor, "next": "/admin/"}
        for case, factor in cases.items()
    }
    for form in forms.values():  # warm up: templates, sessions, first-call imports
        client.post(OVERRIDE, form)
    spent: dict[str, list[float]] = {case: [] for case in cases}
    for turn in range(repeat):
        for case in rotate(list(cases), turn):
            spent[case].append(cpu(lambda case=case: client.post(OVERRIDE, forms[case])))
    return {case: round(statistics.median(times) * 1e3, 2) for case, times in spent.items()}


def parsers(repeat: int) -> dict[str, float]:
    """Median CPU (µs) of each parser refusing each hostile text, and of the old build."""
    found: dict[str, float] = {}
    for case, text in HOSTILE.items():
        for what, call in (
            ("factor_of", refused(factor_of, text)),
            ("parse_duration", refused(parse_duration, text)),
        ):
            found[f"{what} {case}"] = round(statistics.median(cpu(call) for _ in range(repeat)) * 1e6, 1)
    for case in ("1e3000000", "1e10000000"):
        text = HOSTILE[case]
        built = cpu(lambda text=text: Fraction(Decimal(text)))
        found[f"before the fix: Fraction(Decimal({case}))"] = round(built * 1e6, 1)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    options = parser.parse_args()
    with bench_database():
        result = {"database": DB, "post_ms": posts(options.repeat), "parse_us": parsers(options.repeat)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
