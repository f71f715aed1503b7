"""What the package declares it supports is what the suite runs on (issue 33: the
classifiers stopped at Django 6.0 while ``pip install`` brought 6.1, which tox tests)."""

from __future__ import annotations

import configparser
import sys
from pathlib import Path

import django

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
