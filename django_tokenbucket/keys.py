"""Turn the keys users pass into what the store holds.

The stored key is the SHA-256 hex digest of an injective, type-tagged encoding, so any
key (a 1 MB string, bytes, a lone surrogate, NUL) fits one 64-character ASCII column,
collations that fold case or accents cannot merge two keys, and ``("a:b", "c")`` never
meets ``("a", "b:c")``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Union

__all__ = ["LABEL_LENGTH", "EncodedKey", "Key", "encode_key"]

Key = Union[None, str, bytes, int, tuple["Key", ...]]

#: How much of a key is kept, readable, beside its digest (for the admin and logs).
LABEL_LENGTH = 64


@dataclass(frozen=True)
class EncodedKey:
    digest: str
    label: str


def _encode(key: object, out: bytearray) -> None:
    if key is None:
        out += b"N"
        return
    if isinstance(key, bool):
        raise TypeError("a key must not be a bool (True and 1 would share a bucket)")
    if isinstance(key, str):
        # surrogatepass keeps a lone surrogate distinct instead of failing on it.
        data = key.encode("utf-8", "surrogatepass")
        tag = b"s"
    elif isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
        tag = b"b"
    elif isinstance(key, int):
        data = str(key).encode()
        tag = b"i"
    elif isinstance(key, (tuple, list)):
        out += b"t%d:" % len(key)
        for part in key:
            _encode(part, out)
        return
    else:
        raise TypeError(f"a key must be None, str, bytes, int or a tuple of these, not {type(key).__name__}")
    out += tag + b"%d:" % len(data) + data


def _label(key: object) -> str:
    text = key if isinstance(key, str) else ("" if key is None else repr(key))
    head = text[:LABEL_LENGTH]
    if head.isprintable():
        # Nothing to escape, as for most keys: skip the per-character pass below.
        return head
    # Stored labels must survive every database's text type: escaping what is not
    # printable removes NUL and lone surrogates (category Cs) alike.
    safe = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:LABEL_LENGTH])
    return safe[:LABEL_LENGTH]


def encode_key(key: object) -> EncodedKey:
    """Return the digest stored for ``key`` and a short printable label of it."""
    if type(key) is str:
        # The usual key, encoded exactly as _encode does, without its type dispatch.
        data = key.encode("utf-8", "surrogatepass")
        return EncodedKey(hashlib.sha256(b"s%d:%s" % (len(data), data)).hexdigest(), _label(key))
    out = bytearray()
    _encode(key, out)
    return EncodedKey(hashlib.sha256(out).hexdigest(), _label(key))
