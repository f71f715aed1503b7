"""docs/architecture.md's "Where the tests live" holds every test module and only those.

The map is a table: a feature, the modules about it, the other modules that test it too.
A module that is in no row's second column has no home a reader can find (issue 50:
modules were named after the round of work that wrote them, not what they test); a name
that is no module is a row gone stale after a rename.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HEADING = "## Where the tests live"
MODULE = re.compile(r"`(test_\w+\.py)`")


def module_files() -> set[str]:
    return {path.name for path in (ROOT / "tests").glob("test_*.py")}


def map_rows() -> list[tuple[str, set[str], set[str]]]:
    """(feature, its modules, also tested in) for each row of the map's table."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    if HEADING not in text:
        pytest.fail(f'docs/architecture.md has no "{HEADING}" section')
    # The section runs to the next heading of its level or above, or to the end.
    section = re.split(r"^#{1,2} ", text.split(HEADING, 1)[1], flags=re.M)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            pytest.fail(f"a row of the map has {len(cells)} columns, not 3: {line}")
        if cells[0] == "Feature" or set(cells[0]) <= set("-: "):
            continue  # the header and the line under it
        rows.append((cells[0], set(MODULE.findall(cells[1])), set(MODULE.findall(cells[2]))))
    return rows


def test_the_map_has_one_row_per_feature():
    features = [feature for feature, _, _ in map_rows()]
    assert features, "the map's table has no rows"
    assert len(set(features)) == len(features), "a feature has two rows"


def test_every_test_module_has_a_row():
    homed = set().union(*(own for _, own, _ in map_rows()))
    missing = sorted(module_files() - homed)
    assert not missing, (
        f"{', '.join(missing)}: in no row's \"Its modules\" column of docs/architecture.md's "
        f'"{HEADING[3:]}"; add each to the row of the feature it tests (or a new row)'
    )


def test_the_map_names_only_modules_that_exist():
    named = set().union(*(own | also for _, own, also in map_rows()))
    stale = sorted(named - module_files())
    assert not stale, f'{", ".join(stale)}: named by "{HEADING[3:]}" in docs/architecture.md, but not in tests/'
