"""Run DRF's and django-ratelimit's own tests against our drop-ins (tox env ``compat``).

Downloads the published sdists (``pip download --no-binary :all: --no-deps``), takes
DRF's ``tests/test_throttling.py`` and django-ratelimit's ``django_ratelimit/tests.py``,
rewrites their import lines only — ``rest_framework.throttling`` becomes
``django_tokenbucket.throttling`` and ``django_ratelimit.*`` becomes
``django_tokenbucket.compat.ratelimit.*`` — and runs them with pytest. Assertions are
untouched: the rewritten lines are printed for anyone to check.

Prints each suite's pass/fail counts. Fails when a test outside ``EXPECTED_FAILURES``
fails, when one inside it passes (the list must stay true), or when docs/migrating.md
does not explain one of them.

    python tests/upstream/run.py [--keep]    # --keep: leave the work directory
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MIGRATING = ROOT / "docs" / "migrating.md"


@dataclass(frozen=True)
class Suite:
    label: str
    distribution: str
    version: str
    member: str  # the test file inside the sdist (below its top directory)
    target: str  # where it goes in the work directory
    imports: tuple[tuple[str, str], ...]  # (old, new) prefixes of import lines


SUITES = (
    Suite(
        label="DRF",
        distribution="djangorestframework",
        # The tests must be those of the DRF that runs them.
        version=importlib.metadata.version("djangorestframework"),
        member="tests/test_throttling.py",
        target="drf/test_throttling.py",
        imports=(("from rest_framework.throttling import", "from django_tokenbucket.throttling import"),),
    ),
    Suite(
        label="django-ratelimit",
        distribution="django-ratelimit",
        version="4.1.0",
        member="django_ratelimit/tests.py",
        # Kept at django_ratelimit/tests.py: the tests name their own helpers by dotted
        # path ("django_ratelimit.tests.mykey"). The package holds nothing else, so no
        # upstream code can run.
        target="django_ratelimit/tests.py",
        imports=(("from django_ratelimit.", "from django_tokenbucket.compat.ratelimit."),),
    ),
)

#: Upstream tests that fail on purpose, with the behaviour that differs. Each test name
#: must appear in docs/migrating.md, which says why the difference is better.
EXPECTED_FAILURES = {
    "ThrottlingTests.test_request_throttling_multiple_throttles": (
        "a request refused by the 3/sec throttle spends nothing on the 6/min one (all-or-nothing), "
        "so the 6/min throttle still has room where DRF expects 429 with Retry-After 59"
    ),
    "ThrottlingTests.test_throttle_rate_change_negative": (
        "refused requests spend nothing: after 24 requests in one second only 3 were admitted, so the "
        "binding throttle is 3/sec (Retry-After 1); DRF counted all 24 against 6/min (Retry-After 60)"
    ),
    "ThrottlingTests.test_minutes_fields": (
        "token bucket: at 3/min the next token comes in 20 s, so Retry-After is 20, not 60"
    ),
    "FunctionsTests.test_not_increment_after_increment": (
        "a refused request is not stored: after one admitted and one refused request the count is 1, not 2"
    ),
    "IpMetaTests.test_alternate_header": (
        "RATELIMIT_IP_META_KEY naming a header that clients write, without TRUSTED_PROXIES saying which proxies "
        "set it, is refused (ImproperlyConfigured): a rotated header would be a fresh window per request"
    ),
    "CacheFailTests.test_is_ratelimited_cache_connection_error_without_increment": (
        "a store that is down fails closed for reads too (unless RATELIMIT_FAIL_OPEN); "
        "django-ratelimit's memcached client returned the default and said 'not limited'"
    ),
}


def download(suite: Suite, into: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--dest",
            str(into),
            f"{suite.distribution}=={suite.version}",
        ],
        check=True,
    )
    prefix = suite.distribution.replace("-", "_").lower()
    for path in into.iterdir():
        if path.name.replace("-", "_").lower().startswith(f"{prefix}_{suite.version}") and path.name.endswith(
            ".tar.gz"
        ):
            return path
    raise SystemExit(f"pip download left no sdist of {suite.distribution} {suite.version} in {into}")


def extract(sdist: Path, member: str) -> str:
    with tarfile.open(sdist) as archive:
        for info in archive.getmembers():
            if info.name.split("/", 1)[-1] == member:
                handle = archive.extractfile(info)
                assert handle is not None
                return handle.read().decode()
    raise SystemExit(f"{sdist.name} has no {member}")


def rewrite_imports(suite: Suite, source: str) -> str:
    """Return ``source`` with its import lines pointed at our code, and print the change."""
    lines = source.splitlines(keepends=True)
    used = set()
    for index, line in enumerate(lines):
        for old, new in suite.imports:
            if line.startswith(old):
                lines[index] = new + line[len(old) :]
                used.add(old)
    missing = [old for old, _ in suite.imports if old not in used]
    if missing:
        raise SystemExit(f"{suite.label}: no import line starts with {missing}: has the upstream file changed?")
    rewritten = "".join(lines)
    diff = difflib.unified_diff(
        source.splitlines(), rewritten.splitlines(), suite.member, suite.target, lineterm="", n=0
    )
    print("\n".join(diff))
    return rewritten


def run_pytest(work: Path, targets: list[str]) -> Path:
    report = work / "report.xml"
    (work / "pytest.ini").write_text(
        "[pytest]\nDJANGO_SETTINGS_MODULE = settings\npython_files = test_*.py tests.py\npythonpath = .\n"
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(work / "pytest.ini"),
            "--rootdir",
            str(work),
            f"--junitxml={report}",
            *targets,
        ],
        cwd=work,
        check=False,  # the outcome is judged below, test by test
    )
    return report


def outcomes(report: Path) -> dict[str, dict[str, str]]:
    """Return ``{suite label: {Class.test: "passed" | "failed" | "skipped"}}``."""
    results: dict[str, dict[str, str]] = {suite.label: {} for suite in SUITES}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        label = "django-ratelimit" if module.startswith("django_ratelimit") else "DRF"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        results[label][f"{cls}.{case.get('name')}"] = outcome
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tokenbucket-upstream-"))
    try:
        for name in ("settings.py", "upstream_urls.py"):
            shutil.copy(HERE / name, work / name)
        targets = []
        for suite in SUITES:
            source = extract(download(suite, work), suite.member)
            target = work / suite.target
            target.parent.mkdir(parents=True, exist_ok=True)
            if suite.target.startswith("django_ratelimit/"):
                (target.parent / "__init__.py").write_text("# Only the rewritten tests: no upstream code.\n")
            target.write_text(rewrite_imports(suite, source))
            targets.append(suite.target)
        results = outcomes(run_pytest(work, targets))
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    problems = []
    documented = MIGRATING.read_text()
    for suite in SUITES:
        tests = results[suite.label]
        passed = sum(outcome == "passed" for outcome in tests.values())
        failed = sorted(test for test, outcome in tests.items() if outcome != "passed")
        print(
            f"\n{suite.label} {suite.version} ({suite.member}): {passed} passed, {len(failed)} failed of {len(tests)}"
        )
        for test in failed:
            reason = EXPECTED_FAILURES.get(test)
            print(f"  {'expected' if reason else 'UNEXPECTED'}: {test}" + (f" ({reason})" if reason else ""))
            if reason is None:
                problems.append(f"{suite.label}: {test} failed")
        if not tests:
            problems.append(f"{suite.label}: no test ran")
    every = {test: outcome for tests in results.values() for test, outcome in tests.items()}
    for test in EXPECTED_FAILURES:
        if every.get(test) == "passed":
            problems.append(f"{test} passed: take it off EXPECTED_FAILURES and docs/migrating.md")
        elif test not in every:
            problems.append(f"{test} did not run: is EXPECTED_FAILURES out of date?")
        if test.split(".")[-1] not in documented:
            problems.append(f"{test} fails on purpose but docs/migrating.md does not say why")
    for problem in problems:
        print(f"compat: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
