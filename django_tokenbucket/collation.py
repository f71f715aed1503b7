"""What a database treats as one spelling of a name, and a fold at least as coarse.

A username key must be one bucket for every spelling that logs in as one account, and
which spellings those are is the user table's collation's to say: MySQL's and MariaDB's
defaults (``utf8mb4_general_ci``, ``utf8mb4_unicode_ci``, ``utf8mb4_unicode_520_ci``,
``utf8mb4_uca1400_ai_ci``, ``utf8mb4_0900_ai_ci``) compare ``víctim`` equal to
``victim``, and ``vic<ZERO WIDTH SPACE>tim`` too under the UCA ones. ``fold_accents``
maps every such spelling to one, for all of them at once; where they disagree (``ß`` is
``s`` under ``general_ci`` and ``ss`` under the UCA collations) it takes the coarser
side, since a fold coarser than the collation only merges buckets (a stricter limit),
while a finer one hands an attacker a bucket per spelling.

``column_comparison`` asks a database how a column compares (for the system check
that says which folding is in force and whether it is coarse enough).
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from django.db import DatabaseError, connections

__all__ = ["ColumnComparison", "column_comparison", "fold_accents"]

# -- the fold ---------------------------------------------------------------------------

# Letters the UCA collations equate with a base letter but Unicode does not decompose:
# "LATIN SMALL LETTER D WITH STROKE" (đ) is d, "LATIN SMALL LETTER O WITH STROKE" (ø) is
# o, "LATIN SMALL LETTER INSULAR D" is d. Read from the character's name: a table of
# them would be the collations' own, which a library should not copy.
_LATIN_LETTER = re.compile(
    r"LATIN (?:SMALL |CAPITAL )?(?:LETTER|LIGATURE) "
    r"(?:(?:SMALL CAPITAL|INSULAR|DOTLESS|SCRIPT|OPEN|CLOSED|FLATTENED|SIGMOID|ANGLICANA|BROKEN|LONG|TAILLESS"
    r"|SIDEWAYS|BARRED|STRETCHED|LOW|DOUBLE|MIDDLE-WELSH) )*"
    r"(AA|AE|AO|AU|AV|AY|DB|DZ|IJ|LJ|LL|LS|LZ|NJ|OE|OO|QP|TC|TH|TS|TZ|VY|[A-Z])"
    r"(?: (?:WITH|DIGRAPH|ABOVE|BELOW|ROTUNDA|CEDILLA|BAR|STROKE|HOOK|TAIL|LOOP|CURL|BELT|SWASH|FLOURISH)\b.*)?"
)
_LATIN_WORDS = {
    "DEZH DIGRAPH": "dʒ",
    "TESH DIGRAPH": "tʃ",
    "FENG DIGRAPH": "fŋ",
    "TURNED DELTA": "zw",
    "ETH": "d",
    "SHARP S": "s",
    "SCHWA": "ə",
    "VOLAPUK AE": "a",
    "VOLAPUK OE": "o",
    "VOLAPUK UE": "u",
    "OLD POLISH O": "a",
}
# A letter drawn in a circle or a square, or written above another (a combining Latin
# or Cyrillic letter), is that letter to the UCA collations.
_DECORATED = re.compile(
    r"(?:COMBINING (?=(?:LATIN|CYRILLIC) (?:SMALL )?LETTER )"
    r"|(?:CROSSED )?(?:NEGATIVE )?(?:CIRCLED|SQUARED|PARENTHESIZED) )(.*)"
)
# Cyrillic letters drawn with eyes or crossed are the plain letter to UCA 5.2 and later.
_CYRILLIC_VARIANT = re.compile(r" (?:MONOCULAR|BINOCULAR|DOUBLE MONOCULAR|MULTIOCULAR|CROSSED|DOUBLE) ")
_SPELLED_OUT = {
    "GREEK KAI SYMBOL": "και",
    "GREEK CAPITAL KAI SYMBOL": "και",
    "LATIN LETTER INVERTED GLOTTAL STOP WITH STROKE": "ts",
}
# Characters with no weight at all (ignored wherever they stand) that are not marks,
# format or control characters: a name can carry any number of them and still log in.
_IGNORED = frozenset("\u0640\u07fa\u0824\u0828\u180a\u06de\u1cd3\u1cf2\u1cf3\ufe73")
_NO_WEIGHT_CATEGORIES = frozenset({"Mn", "Me", "Mc", "Cf", "Cc"})
_REPEATED_S = re.compile("s+")
_ASCII_CONTROLS = dict.fromkeys([*range(0x20), 0x7F])


def _named(name: str) -> str | None:
    try:
        return unicodedata.lookup(name)
    except KeyError:
        return None


def _fold_char(char: str, depth: int = 0) -> str:
    """Return what one character (of an NFKD text) folds to: a base letter, a digit, "" for
    a character the collations ignore, U+FFFD for one beyond the BMP, else itself (lower case)."""
    number = unicodedata.numeric(char, None)
    if number is not None and number in range(10):
        return str(int(number))  # every script's digits are the same digit to UCA
    name = unicodedata.name(char, "")
    category = unicodedata.category(char)
    if name in _SPELLED_OUT:
        return _SPELLED_OUT[name]
    decorated = _DECORATED.fullmatch(name)
    base = decorated.group(1) if decorated else name
    candidates = []
    if decorated:
        candidates += [base, base.replace(" LETTER ", " SMALL LETTER ", 1)]
        if base.endswith((" ABOVE", " BELOW")):  # a combining letter placed above or below
            candidates.append(base.rsplit(" ", 1)[0])
    if base.startswith("CYRILLIC ") and _CYRILLIC_VARIANT.search(base):
        plain = _CYRILLIC_VARIANT.sub(" ", base)
        candidates += [plain, plain.replace(" LETTER ", " SMALL LETTER ", 1)]
    if name.startswith(("MODIFIER LETTER SMALL ", "MODIFIER LETTER CAPITAL ")):
        letter = name[9:].replace("LETTER SMALL", "SMALL LETTER").replace("LETTER CAPITAL", "CAPITAL LETTER")
        candidates.append("LATIN " + letter)
    if " DIGIT HALF " in name:
        candidates.append("DIGIT " + name.split(" DIGIT HALF ")[1])
    if " WITH " in base:
        candidates.append(base.split(" WITH ")[0])
    if " FINAL " in base:  # Hebrew's final forms are the letter
        candidates.append(base.replace(" FINAL ", " "))
    if base.startswith("GEORGIAN ") and (" SMALL " in base or " CAPITAL " in base):
        candidates.append(base.replace(" SMALL ", " ").replace(" CAPITAL ", " "))
    if base.startswith(("HIRAGANA LETTER SMALL ", "KATAKANA LETTER SMALL ")):
        candidates.append(base.replace(" SMALL ", " "))
    for candidate in candidates:
        found = _named(candidate)
        if found is not None and found != char and depth < 4:
            return _fold_char(found, depth + 1)
    if base.startswith("LATIN "):
        for word, letter in _LATIN_WORDS.items():
            if base.endswith(" " + word):
                return letter
        latin = _LATIN_LETTER.fullmatch(base)
        if latin:
            return latin.group(1).lower()
    code = ord(char)
    if 0x30A1 <= code <= 0x30F6 or code in (0x30FD, 0x30FE):
        return _fold_char(chr(code - 0x60), depth + 1)  # katakana is hiragana to UCA
    if category in _NO_WEIGHT_CATEGORIES or char in _IGNORED:
        # A spacing vowel sign (Devanagari's ा) is a letter of the word to the collations.
        if category != "Mc" or "VOWEL SIGN" not in name:
            return ""
    if category == "Zs":
        return " "
    if code > 0xFFFF:
        # general_ci and unicode_ci give every character beyond the BMP one weight.
        return "\ufffd"
    return char.lower()


class _FoldTable(dict[int, str]):
    """``str.translate``'s table for the fold.

    The BMP is filled a Unicode block (256 code points) at a time on first use, about
    1 ms a block: a process does that work at most once per block (256 blocks, 7 MB at
    most), so no request pays a name lookup per character twice. Beyond the BMP the
    collations give almost everything one weight, and a cheap rule answers without
    storing anything (an attacker touching every code point grows nothing).
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def __missing__(self, code: int) -> str:
        if code > 0xFFFF:
            return _fold_astral(chr(code))
        with self._lock:
            if code not in self:
                block = code & ~0xFF
                self.update({point: _fold_char(chr(point)) for point in range(block, block + 0x100)})
        return self[code]


@lru_cache(maxsize=1024)
def _fold_named_astral(char: str) -> str:
    return _fold_char(char)


def _fold_astral(char: str) -> str:
    """``_fold_char`` beyond the BMP, without a name lookup for most characters."""
    category = unicodedata.category(char)
    if category in _NO_WEIGHT_CATEGORIES and (category != "Mc" or "VOWEL SIGN" not in unicodedata.name(char, "")):
        return ""
    number = unicodedata.numeric(char, None)
    if number is not None and number in range(10):
        return str(int(number))
    name = unicodedata.name(char, "")
    if any(script in name for script in ("LATIN", "CYRILLIC", "HIRAGANA", "KATAKANA")):
        # circled and squared letters, Latin Extended-F and G, small kana
        return _fold_named_astral(char)
    return "\ufffd"


_TABLE = _FoldTable()


def fold_accents(text: str) -> str:
    """Return the one spelling of ``text`` under every accent-insensitive collation above.

    Case and accents are folded, characters the collations ignore removed, letters they
    equate with a base letter replaced by it, digits made ASCII, runs of ``s`` made one
    (``ß`` is ``s`` to one collation and ``ss`` to the others). ``text`` is NFKC already
    (as Django's login makes a username); the result is for keys, never for display.
    """
    if text.isascii():
        folded = text.translate(_ASCII_CONTROLS).lower()
    else:
        # Twice: case folding makes marks of its own (İ -> i + U+0307).
        folded = unicodedata.normalize("NFKD", text).translate(_TABLE).casefold()
        folded = unicodedata.normalize("NFKD", folded).translate(_TABLE)
    return _REPEATED_S.sub("s", folded)


# -- what a database says ------------------------------------------------------------------


@dataclass(frozen=True)
class ColumnComparison:
    """How a database compares a column: its collation, and a function telling whether it
    calls two texts equal (several pairs in one round trip)."""

    database: str
    table: str
    column: str
    collation: str
    equal: Callable[[Sequence[tuple[str, str]]], list[bool]]


_IDENTIFIER = re.compile(r"[A-Za-z0-9_.\-]+")


def column_comparison(alias: str, table: str, column: str) -> ColumnComparison | None:
    """Return how database ``alias`` compares ``table.column``, or None when it cannot say
    (the table is not there yet, another vendor, the server refused the query)."""
    connection = connections[alias]
    reader = _READERS.get(connection.vendor)
    if reader is None:
        return None
    # to_regclass reads a name as SQL does: quoted, so that a mixed-case table is found.
    name = connection.ops.quote_name(table) if connection.vendor == "postgresql" else table
    try:
        with connection.cursor() as cursor:
            found = reader(cursor, name, column)
    except DatabaseError:
        return None
    if found is None:
        return None
    collation, compare_sql = found

    def equal(pairs: Sequence[tuple[str, str]]) -> list[bool]:
        if not pairs:
            return []
        sql = "SELECT " + ", ".join([compare_sql] * len(pairs))
        with connections[alias].cursor() as cursor:
            cursor.execute(sql, [text for pair in pairs for text in pair])
            row = cursor.fetchone()
        return [bool(value) for value in row]

    return ColumnComparison(alias, table, column, collation, equal)


def _mysql(cursor: Any, table: str, column: str) -> tuple[str, str] | None:
    cursor.execute(
        "SELECT COLLATION_NAME, CHARACTER_SET_NAME FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND COLUMN_NAME = %s",
        [table, column],
    )
    row = cursor.fetchone()
    if row is None or row[0] is None or not all(_IDENTIFIER.fullmatch(name) for name in row):
        return None
    collation, charset = row
    # The connection's own character set may be narrower (utf8mb3): each side is
    # converted to the column's, then compared under its collation.
    return collation, f"(CONVERT(%s USING {charset}) COLLATE {collation} = CONVERT(%s USING {charset}))"


def _postgresql(cursor: Any, table: str, column: str) -> tuple[str, str] | None:
    cursor.execute(
        "SELECT format_type(a.atttypid, a.atttypmod), n.nspname, c.collname "
        "FROM pg_attribute a LEFT JOIN pg_collation c ON c.oid = a.attcollation "
        "LEFT JOIN pg_namespace n ON n.oid = c.collnamespace "
        "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s AND NOT a.attisdropped",
        [table, column],
    )
    row = cursor.fetchone()
    if row is None:
        return None
    column_type, schema, collation = row
    if not re.fullmatch(r"[A-Za-z0-9_. ()\"]+", column_type):
        return None
    cast = f"CAST(%s AS {column_type})"
    if collation is None or collation == "default":
        # citext compares without case whatever its collation; text and varchar by the
        # database's default collation, deterministic unless it says otherwise.
        return collation or "default", f"({cast} = {cast})"
    quoted = '"{}"."{}"'.format(schema.replace('"', '""'), collation.replace('"', '""'))
    return collation, f"({cast} COLLATE {quoted} = {cast})"


def _sqlite(cursor: Any, table: str, column: str) -> tuple[str, str] | None:
    cursor.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = %s", [table])
    row = cursor.fetchone()
    if row is None:
        return None
    declared = re.search(rf'["`\[]?{re.escape(column)}["`\]]?\s[^,]*?COLLATE\s+["`]?(\w+)', row[0], re.I)
    collation = declared.group(1).upper() if declared else "BINARY"
    if collation not in ("BINARY", "NOCASE", "RTRIM"):
        return None  # an application-defined collation: only the application knows it
    return collation, f"(%s = %s COLLATE {collation})"


_READERS: dict[str, Callable[[Any, str, str], tuple[str, str] | None]] = {
    "mysql": _mysql,
    "postgresql": _postgresql,
    "sqlite": _sqlite,
}
