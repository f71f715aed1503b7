"""Key encoding (B7, B8, B9 and property (b)), unit-level and end to end on the database."""

from __future__ import annotations

import re
import unicodedata
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from django_tokenbucket import limiter
from django_tokenbucket.keys import LABEL_LENGTH, Redacted, as_typed, encode_key, label_as_typed
from django_tokenbucket.testing import frozen_clock

HEX64 = re.compile(r"[0-9a-f]{64}", re.ASCII)


def assert_safe_label(label: str) -> None:
    assert isinstance(label, str)
    assert len(label) <= LABEL_LENGTH == 64
    assert label.isprintable()
    assert "\x00" not in label
    assert not any(unicodedata.category(c) == "Cs" for c in label)
    label.encode("utf-8")  # strict: no lone surrogates survive


def assert_digest(digest: str) -> None:
    assert isinstance(digest, str)
    assert HEX64.fullmatch(digest), digest


# ---------------------------------------------------------------------------------------
# B7: long keys
# ---------------------------------------------------------------------------------------

LONG_KEYS = {
    "300 chars": "k" * 300,
    "10 KB": "é" * 5 * 1024,
    "1 MB str": "x" * 2**20,
    "1 MB bytes": b"\xff" * 2**20,
    "1 MB tuple": ("user", "y" * 2**20),
}


@pytest.mark.parametrize("key", LONG_KEYS.values(), ids=LONG_KEYS.keys())
def test_long_keys_give_a_64_char_digest(key):
    encoded = encode_key(key)
    assert_digest(encoded.digest)
    assert_safe_label(encoded.label)


def test_long_keys_differing_only_at_the_end_are_distinct():
    base = "a" * 2**20
    digests = {encode_key(base + tail).digest for tail in ("", "b", "c", "bb")}
    digests.add(encode_key(base[:-1]).digest)
    assert len(digests) == 5
    # The label keeps the readable prefix, which is the same: only the digest tells them apart.
    assert encode_key(base + "b").label == encode_key(base + "c").label == "a" * 64


def test_short_label_is_the_key():
    assert encode_key("alice").label == "alice"
    assert encode_key(None).label == ""
    assert encode_key("k" * 300).label == "k" * 64


# ---------------------------------------------------------------------------------------
# B8: awkward characters, bytes, normalisation and case
# ---------------------------------------------------------------------------------------

AWKWARD_KEYS = [
    "\x00",
    "a\x00b",
    "\ud800",  # lone surrogate
    "\udfff",
    "a\ud800b",
    "\ud83d\ude00",  # a surrogate *pair* as two code points, not the emoji
    "\U0001f600",  # the emoji itself
    "\n",
    "\u200b",  # zero width space
    "\u202e",  # right-to-left override
    "\x7f",
    "\x85",
    "é",
    "e\u0301",
    "Bob",
    "bob",
    "bób",
    "BOB",
    "ß",
    "ss",
    "ﬀ",  # LATIN SMALL LIGATURE FF
    "ff",
    "",
    " ",
    "i",
    "İ",
]


@pytest.mark.parametrize("key", AWKWARD_KEYS, ids=ascii)
def test_awkward_strings_encode(key):
    encoded = encode_key(key)
    assert_digest(encoded.digest)
    assert_safe_label(encoded.label)


def test_awkward_strings_are_distinct():
    digests = {encode_key(k).digest for k in AWKWARD_KEYS}
    assert len(digests) == len(AWKWARD_KEYS)


def test_bytes_and_str_of_the_same_text_are_distinct():
    for text in ("alice", "é", "", "\x00"):
        assert encode_key(text).digest != encode_key(text.encode()).digest
    assert encode_key(b"\xff").digest != encode_key("\xff").digest
    # bytearray and memoryview are the same bytes as bytes.
    assert encode_key(bytearray(b"ab")).digest == encode_key(b"ab").digest == encode_key(memoryview(b"ab")).digest


def test_nfc_and_nfd_are_distinct():
    nfc, nfd = "\u00e9", "e\u0301"
    assert unicodedata.normalize("NFC", nfd) == nfc
    assert encode_key(nfc).digest != encode_key(nfd).digest


def test_case_and_accents_are_distinct():
    digests = [encode_key(k).digest for k in ("Bob", "bob", "bób", "BOB", "Bób")]
    assert len(set(digests)) == 5
    # A digest is lowercase hex: collations that fold case see the same string only
    # when the keys were the same.
    assert all(d == d.lower() for d in digests)


@pytest.mark.parametrize("key", ["\x00", "\ud800", "a\ud800b", b"\x00\xff", ("\x00", b"\x00", "\udfff")], ids=ascii)
def test_labels_escape_what_databases_cannot_store(key):
    label = encode_key(key).label
    assert_safe_label(label)
    assert label  # something readable is kept


# ---------------------------------------------------------------------------------------
# B9: key parts cannot be spliced
# ---------------------------------------------------------------------------------------

DISTINCT_GROUPS = [
    [("user", "a:b"), ("user:a", "b"), ("user", "a", "b"), "user:a:b", ("user:a:b",)],
    [("a", "b:c"), ("a:b", "c")],
    [("a", "bc"), ("ab", "c"), ("abc",), "abc", ("a", "b", "c")],
    ["a", ("a",), (("a",),), ("a", "b"), (("a", "b"),)],
    [1, b"1", (1,), 10, -1],
    [None, "", b"", (), (None,), ("",), 0, "N"],
    [("s1:a",), ("s", "a"), "s1:a"],
    [(1, 23), (12, 3), (123,)],
    [("", ""), ("",), ()],
]


@pytest.mark.parametrize("group", DISTINCT_GROUPS, ids=repr)
def test_spliced_keys_are_distinct(group):
    digests = [encode_key(k).digest for k in group]
    assert len(set(digests)) == len(group)


#: Keys that name one bucket: an int and its digits, a UUID and its text (a user's id
#: passed as ``user.pk`` or ``str(user.pk)``, whatever type the primary key has).
SAME_GROUPS = [
    [1, "1"],
    [-1, "-1"],
    [(1, 23), ("1", "23"), ["1", 23]],
    [("user", 42), ("user", "42"), ("user", Redacted("42"))],
    [("user", 2**80), ("user", str(2**80))],
    [
        ("user", uuid.UUID("6f9619ff-8b86-d011-b42d-00cf4fc964ff")),
        ("user", "6f9619ff-8b86-d011-b42d-00cf4fc964ff"),
    ],
]


@pytest.mark.parametrize("group", SAME_GROUPS, ids=repr)
def test_one_id_however_it_is_passed_is_one_bucket(group):
    assert len({encode_key(k).digest for k in group}) == 1
    assert len({encode_key(k).digest for k in group}) == 1  # and again, from the recent keys


def test_a_uuid_key_is_labelled_as_its_text():
    key = ("user", uuid.UUID("6f9619ff-8b86-d011-b42d-00cf4fc964ff"))
    assert encode_key(key).label == "user=6f9619ff-8b86-d011-b42d-00cf4fc964ff"


@pytest.mark.parametrize(
    ("key", "label"),
    [
        (("ip", "2001:db8::1"), "ip=2001:db8::1"),
        (("user", 42), "user=42"),
        (("user", "42"), "user=42"),
        (("post:username", Redacted("alice")), "post:username=… (value not stored)"),
        (("ip", "192.0.2.1", "user", 7), "('ip', '192.0.2.1', 'user', 7)"),
        (("tenant", "acme"), "('tenant', 'acme')"),
        (("ip", None), "('ip', None)"),
    ],
    ids=repr,
)
def test_request_keys_are_labelled_as_the_command_takes_them(key, label):
    assert encode_key(key).label == label


def test_as_typed_shows_a_typed_request_value_in_the_form_it_was_typed():
    assert as_typed(("post:username", Redacted("alice"))) == "post:username=alice"
    assert as_typed(("ip", "192.0.2.1")) == "ip=192.0.2.1"
    assert as_typed("alice") == "'alice'"
    assert as_typed(("tenant", 3)) == "('tenant', 3)"


@pytest.mark.parametrize("key", [True, False, ("user", True), (1, (False,))], ids=repr)
def test_bools_are_rejected(key):
    with pytest.raises(TypeError):
        encode_key(key)


@pytest.mark.parametrize("key", [1.0, 1.5, object(), {"a": 1}, {"a"}, ("a", 1.0)], ids=repr)
def test_other_types_are_rejected(key):
    with pytest.raises(TypeError):
        encode_key(key)


def test_lists_and_tuples_share_a_bucket():
    # A list is accepted as a tuple of parts (keys often arrive as JSON arrays).
    assert encode_key(["a", 1]).digest == encode_key(("a", 1)).digest


def test_encoding_is_deterministic():
    # Stored digests outlive processes: no per-process hash seed may enter them.
    assert encode_key("alice").digest == encode_key("alice").digest
    assert encode_key(("user", 42)).digest == encode_key(("user", 42)).digest


# ---------------------------------------------------------------------------------------
# Property (b): injective, and always a safe digest and label
# ---------------------------------------------------------------------------------------

_ANY_CHAR = st.characters(exclude_categories=())  # surrogates included
_PARTS = st.text(alphabet=_ANY_CHAR) | st.binary() | st.integers()
_KEYS = st.recursive(
    st.none() | _PARTS,
    lambda children: st.lists(children, max_size=4).map(tuple),
    max_leaves=8,
)


def _canonical(key):
    """The key with every int written as its digits: what encode_key tells apart."""
    if isinstance(key, tuple):
        return tuple(_canonical(part) for part in key)
    return str(key) if isinstance(key, int) else key


@given(st.lists(_KEYS, min_size=2, max_size=8, unique_by=_canonical))
def test_encoding_is_injective(keys):
    digests = {encode_key(k).digest for k in keys}
    assert len(digests) == len(keys)


@given(st.tuples(_PARTS, _PARTS), st.tuples(_PARTS, _PARTS))
def test_two_part_keys_injective(a, b):
    if _canonical(a) != _canonical(b):
        assert encode_key(a).digest != encode_key(b).digest


@given(st.lists(st.text(alphabet=_ANY_CHAR, max_size=3), min_size=1, max_size=4))
def test_splitting_the_same_text_differently_is_distinct(parts):
    joined = "".join(parts)
    assert encode_key(tuple(parts)).digest != encode_key(joined).digest
    if len(parts) > 1:
        assert encode_key(tuple(parts)).digest != encode_key((joined,)).digest


@given(_KEYS)
def test_digest_and_label_are_always_safe(key):
    encoded = encode_key(key)
    assert_digest(encoded.digest)
    assert_safe_label(encoded.label)


# ---------------------------------------------------------------------------------------
# End to end: the database gives these keys distinct buckets, and any key fits
# ---------------------------------------------------------------------------------------

E2E_KEYS = [
    ("user", "a:b"),
    ("user:a", "b"),
    "a",
    ("a",),
    1,
    b"1",
    "\x00",
    "a\x00b",
    "\ud800",
    "alice",
    b"alice",
    "é",
    "e\u0301",
    "Bob",
    "bob",
    "bób",
    "BOB",
    "k" * 300,
    "k" * 301,
    None,
]


@pytest.mark.django_db(transaction=True)
def test_distinct_buckets_end_to_end():
    from django_tokenbucket.models import RateLimit

    capacity = 5  # 'login' is '5/m' in tests/settings.py
    with frozen_clock():
        exhausted = []
        for key in E2E_KEYS:
            for _ in range(capacity):
                assert limiter.limit("login", key=key).ok, ascii(key)
            denied = limiter.limit("login", key=key)
            assert not denied.ok and denied.retry_after > 0
            exhausted.append(key)
            for other in E2E_KEYS:
                expected = 0 if other in exhausted else capacity
                assert limiter.get_value("login", key=other) == expected, (ascii(key), ascii(other))
    rows = list(RateLimit.objects.filter(name="login"))
    assert len(rows) == len(E2E_KEYS)
    for row in rows:
        assert_digest(row.key)
        assert_safe_label(row.label)
    assert {row.key for row in rows} == {encode_key(k).digest for k in E2E_KEYS}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("key", [LONG_KEYS["1 MB str"], LONG_KEYS["1 MB bytes"], LONG_KEYS["1 MB tuple"], LONG_KEYS["10 KB"]], ids=["1 MB str", "1 MB bytes", "1 MB tuple", "10 KB"])
def test_huge_key_end_to_end(key):
    from django_tokenbucket.models import RateLimit

    with frozen_clock():
        status = limiter.limit("login", key=key)
        assert status.ok and status.value == 4
        assert limiter.get_value("login", key=key) == 4
        # The same key is found again: the digest is the whole identity.
        assert limiter.limit("login", key=key).value == 3
    row = RateLimit.objects.get(name="login")
    assert len(row.key) == 64
    assert_digest(row.key)
    assert row.key == encode_key(key).digest
    assert_safe_label(row.label)
    assert row.value == 3_000_000


@pytest.mark.django_db(transaction=True)
def test_bool_key_is_rejected_end_to_end():
    from django_tokenbucket.models import RateLimit

    with pytest.raises((TypeError, ValueError)):
        limiter.limit("login", key=True)
    assert not RateLimit.objects.exists()


# ---------------------------------------------------------------------------------------
# The digest is HMAC-SHA-256 of the encoding, computed from prepared hashes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", ["short", "s" * 64, "a secret longer than the 64-byte block of SHA-256 " * 3])
def test_the_digest_is_the_hmac_of_the_encoding(settings, secret):
    """Issue 19: the HMAC is assembled from hashlib copies; it must stay the standard one."""
    import hashlib
    import hmac

    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "KEY_SECRET": secret}
    for key, encoding in [("alice", b"s5:alice"), ("é", b"s2:\xc3\xa9"), (("a", 7), b"t2:s1:as1:7"), (None, b"N")]:
        expected = hmac.new(secret.encode(), encoding, hashlib.sha256).hexdigest()
        assert encode_key(key).digest == expected
        assert encode_key(key).digest == expected  # and again, from the recent keys


def test_a_new_secret_forgets_the_recent_keys(settings):
    before = encode_key("bob").digest
    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "KEY_SECRET": "another"}
    assert encode_key("bob").digest != before


@pytest.mark.parametrize(
    "remembered, asked",
    [(("user", 1), ("user", True)), (("user", 1), ("user", 1.0)), (("ip", "1"), ("ip", b"1"))],
    ids=repr,
)
def test_a_remembered_pair_is_never_given_for_an_equal_pair_of_other_types(remembered, asked):
    """Pairs such as ("user", 42) are remembered by equality, and ("user", True) equals
    ("user", 1): it must still be refused, and ("ip", b"1") must keep a bucket of its own."""
    encode_key(remembered)
    assert encode_key(remembered) == encode_key(remembered)
    if asked[1] == remembered[1]:
        with pytest.raises(TypeError):
            encode_key(asked)
    else:
        assert encode_key(asked).digest != encode_key(remembered).digest


def test_remembered_pairs_encode_as_fresh_ones(settings):
    pairs = [("user", 42), ("ip", "192.0.2.1"), ("user", "43"), ("username", "é" * 300)]
    first = [encode_key(pair) for pair in pairs]
    assert [encode_key(pair) for pair in pairs] == first  # from the recent keys
    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "KEY_SECRET": "another"}
    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "KEY_SECRET": None}
    assert [encode_key(pair) for pair in pairs] == first  # computed again
    assert len({encoded.digest for encoded in first}) == len(pairs)


@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        ("('ip', '192.0.2.1')", "ip=192.0.2.1"),
        ("('user', 42)", "user=42"),
        ("('user', '6f9619ff-8b86-d011-b42d-00cf4fc964ff')", "user=6f9619ff-8b86-d011-b42d-00cf4fc964ff"),
        ("('tenant', 'acme')", "('tenant', 'acme')"),
        ("('ip', '192.0.2.1', 'user', 7)", "('ip', '192.0.2.1', 'user', 7)"),
        ("alice", "alice"),
        ("", ""),
    ],
)
def test_a_label_stored_by_an_earlier_version_shows_as_typed(stored, shown):
    assert label_as_typed(stored) == shown
