"""The system checks' catalogue: one table of ids, the same as the documented one, and no
id written anywhere else (issue 29: ids were inline across four files, one picked by
matching message text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.core import checks

from django_tokenbucket.catalogue import CATALOGUE, Check

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "django_tokenbucket"
DOCUMENTED_ROW = re.compile(r"^\| `([EWI]\d{3})` \| (error|warning|info) \|", re.M)
LEVELS = {"E": ("error", checks.Error), "W": ("warning", checks.Warning), "I": ("info", checks.Info)}


def documented_checks() -> dict[str, str]:
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    return dict(DOCUMENTED_ROW.findall(text))


def test_every_check_is_documented_and_every_documented_check_exists():
    documented = documented_checks()
    assert sorted(documented) == sorted(CATALOGUE)
    for code, level in documented.items():
        assert level == LEVELS[code[0]][0], code


def test_no_check_id_is_written_outside_the_catalogue():
    inline = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "catalogue.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        # A check's id as a keyword argument (``Error(..., id="...")``), not an HTML id.
        if re.search(r"django_tokenbucket\.[EWI]\d{3}|(?:^|[(,])\s*id=\"", line)
    ]
    assert inline == []


@pytest.mark.parametrize("code", sorted(CATALOGUE))
def test_each_entry_makes_its_message_with_its_id_and_level(code):
    check = CATALOGUE[code]
    fields = set(re.findall(r"\{(\w+)", check.message + (check.hint or "")))
    message = check(obj="where", **dict.fromkeys(fields, "VALUE"))
    assert message.id == f"django_tokenbucket.{code}" and message.obj == "where"
    assert type(message) is LEVELS[code[0]][1]
    if fields:
        assert "VALUE" in message.msg + (message.hint or "")


def test_a_check_says_which_value_is_missing():
    with pytest.raises(KeyError, match="name"):
        Check("E999", "limit {name!r}")()
