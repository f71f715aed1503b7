"""What the package declares it supports is what the suite runs on (issue 33: the
classifiers stopped at Django 6.0 while ``pip install`` brought 6.1, which tox tests)."""

from __future__ import annotations

import configparser
import sys
from pathlib import Path

import django
import pytest

SETUP_CFG = Path(__file__).resolve().parent.parent / "setup.cfg"


def classifiers() -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(SETUP_CFG, encoding="utf-8")
    return {line.strip() for line in parser["metadata"]["classifiers"].splitlines() if line.strip()}


def test_the_django_series_under_test_is_declared():
    series = "{}.{}".format(*django.VERSION[:2])
    assert f"Framework :: Django :: {series}" in classifiers()


def test_the_python_under_test_is_declared():
    version = "{}.{}".format(*sys.version_info[:2])
    assert f"Programming Language :: Python :: {version}" in classifiers()


@pytest.mark.parametrize(
    ("envs", "installs"),
    [
        ("py313-dj52-sqlite", set()),
        ("py311-dj52-sqlite,lint", set()),
        ("py311-dj52-mariadb", {"libmariadb-dev"}),
        ("example", {"chromium"}),
        ("py312-dj6x-postgres", {"pgbouncer"}),
    ],
)
def test_the_test_command_installs_only_what_the_envs_asked_for_need(tmp_path, envs, installs):
    """Issue 49: ``./scripts/test -e py313-dj52-sqlite`` apt-installed Chromium, its
    driver and the MariaDB headers (~33 s) for an env that uses none of them. Run here
    with none of those tools on the PATH and ``apt-get`` recording what it is asked
    (the script stops before tox: TOKENBUCKET_TEST_PLAN), as root, as CI runs it."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 0\n')
    (bin_dir / "pkg-config").write_text("#!/bin/sh\nexit 1\n")  # no MariaDB headers
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")  # as root, as CI runs it: it may install
    for stub in ("apt-get", "pkg-config", "id"):
        (bin_dir / stub).chmod(0o755)
    environment = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "TOKENBUCKET_TEST_PLAN": "1",
    }
    script = Path(__file__).resolve().parent.parent / "scripts" / "test"
    done = subprocess.run([str(script), "-e", envs], env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    asked = log.read_text() if log.exists() else ""
    for package in ("chromium", "libmariadb-dev", "pgbouncer"):
        if package not in installs or (package == "pgbouncer" and Path("/usr/sbin/pgbouncer").exists()):
            assert package not in asked, (envs, asked)
        else:
            assert package in asked, (envs, asked)
