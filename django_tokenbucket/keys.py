"""Turn the keys users pass into what the store holds.

The stored key is the HMAC-SHA-256 hex digest of an injective, type-tagged encoding, so
any key (a 1 MB string, bytes, a lone surrogate, NUL) fits one 64-character ASCII
column, collations that fold case or accents cannot merge two keys, and ``("a:b", "c")``
never meets ``("a", "b:c")``. An int and a UUID are encoded as the text they print as, so
``("user", 42)`` and ``("user", "42")`` are one bucket, and so are a user's UUID and its
string: code that passes ``user.pk`` and code that passes ``str(user.pk)`` meet, whatever
type the project's primary keys have. The HMAC's secret (``TOKENBUCKET["KEY_SECRET"]``, by
default derived from ``SECRET_KEY``) means a digest in a row, a log line or a backup
cannot be turned back into the key by trying guesses (an IPv4 address, a username).

Beside the digest a short readable label is kept for the admin, except for keys taken
from what a request sends (a header, a query or form field): those may be secrets (an
API key, a password typed in the username box), so their label names only the field.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from typing import Any, Union
from uuid import UUID

from django.conf import settings

__all__ = [
    "LABEL_LENGTH",
    "SECRET_KINDS",
    "EncodedKey",
    "Key",
    "Redacted",
    "after_fork_in_child",
    "as_typed",
    "encode_key",
    "is_request_data_key",
    "key_from_json",
    "label_as_typed",
    "settings_changed",
    "unredacted",
]

Key = Union[None, str, bytes, int, UUID, tuple["Key", ...]]


class Redacted(str):
    """A str that a request sent (a header, a form field), kept out of messages and logs.

    It equals, hashes and encodes as the plain str, so it keys the same bucket; only its
    ``repr()`` and ``str()`` hide it, so an exception message, a log line or a debug page
    that shows a key shows ``<redacted>`` instead of an API key or a typed password. The
    keys the library builds from request data hold their values this way; wrap a key of
    your own in it when it is a secret.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "<redacted>"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format("<redacted>", spec)

    def __reduce__(self) -> tuple[type[Redacted], tuple[str]]:
        # Pickled with its value (a Celery reservation carries its key to the worker).
        return (Redacted, (str.__str__(self),))

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
        # As its digits: the same bucket as the str a project may pass instead.
        data = str(key).encode()
        tag = b"s"
    elif isinstance(key, UUID):
        data = str(key).encode()
        tag = b"s"
    elif isinstance(key, (tuple, list)):
        out += b"t%d:" % len(key)
        for part in key:
            _encode(part, out)
        return
    else:
        raise TypeError(
            f"a key must be None, str, bytes, int, UUID or a tuple of these, not {type(key).__name__}"
        )
    out += tag + b"%d:" % len(data) + data


#: The first element of the keys ``django_tokenbucket.request_keys.request_key`` builds from
#: request data: ``("post:username", "alice")``, ``("username", "alice")``.
SECRET_KINDS = ("header:", "get:", "post:", "username")


def is_request_data_key(key: object) -> bool:
    """Whether ``key`` holds a value a request sent (a header, a query or form field)."""
    return (
        isinstance(key, tuple) and len(key) > 1 and isinstance(key[0], str) and key[0].startswith(SECRET_KINDS)
    )


def key_from_json(value: object) -> object:
    """Return the key a parsed JSON value stands for: arrays become tuples, as keys are.

    ValueError for what no key is (a float, a bool, an object).
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise ValueError("a JSON key must be null, an integer, a string or an array of these")
    if isinstance(value, list):
        return tuple(key_from_json(part) for part in value)
    return value


def unredacted(key: object) -> object:
    """Return ``key`` with every Redacted part as a plain str: for showing a key to whoever typed it."""
    if isinstance(key, Redacted):
        return str.__str__(key)
    if isinstance(key, tuple):
        return tuple(unredacted(part) for part in key)
    return key


def _shown(key: object) -> str:
    """Return ``key`` as the admin and logs show it: a UUID as its text, a Redacted value hidden."""
    if isinstance(key, tuple):
        return "(" + ", ".join(_shown(part) for part in key) + ("," if len(key) == 1 else "") + ")"
    if isinstance(key, UUID):
        return repr(str(key))
    return repr(key)


#: The request keys whose value is kept in clear: labelled ``ip=192.0.2.1``, ``user=42``.
_CLEAR_KINDS = ("ip", "user")


def _spec_and_value(key: object) -> tuple[str, object] | None:
    """``(spec, value)`` of a key ``@ratelimit`` builds for one spec, else None."""
    if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)):
        return None
    spec, value = key
    if (spec in _CLEAR_KINDS or spec.startswith(SECRET_KINDS)) and isinstance(value, (str, int, UUID)):
        return spec, value
    return None


def as_typed(key: object) -> str:
    """Return ``key`` as an operator types it for ``manage.py tokenbucket --key`` and the
    admin's search (``ip=192.0.2.1``, ``post:username=alice``), else its repr: for showing a
    key to whoever typed it (a request's value is shown, unredacted)."""
    pair = _spec_and_value(key)
    if pair is None:
        return repr(unredacted(key))
    spec, value = pair
    return f"{spec}={unredacted(value)}"


#: A label stored before labels took the ``--key`` form: ``('ip', '192.0.2.1')``, ``('user', 42)``.
_REPR_LABEL = re.compile(r"\('(ip|user)', (?:'([^'\\]*)'|(\d+))\)")


def label_as_typed(label: str) -> str:
    """Return a stored label as ``_label`` writes it today: rows labelled by an earlier
    version show ``ip=192.0.2.1`` too, the form an operator pastes into ``--key``."""
    legacy = _REPR_LABEL.fullmatch(label)
    if legacy is None:
        return label
    return f"{legacy[1]}={legacy[2] if legacy[2] is not None else legacy[3]}"


def _label(key: object) -> str:
    pair = _spec_and_value(key)
    if is_request_data_key(key) and key[1] is not None:  # type: ignore[index]
        # Without a value, ("post:username", None, "ip", address) is keyed by the address.
        text = f"{key[0]}=… (value not stored)"  # type: ignore[index]
    elif pair is not None:
        # As the command's --key and the admin's search take it, so it can be pasted there.
        text = as_typed(key)
    elif isinstance(key, Redacted):
        text = "<redacted>"
    elif isinstance(key, str):
        text = key
    else:
        text = "" if key is None else _shown(key)
    head = text[:LABEL_LENGTH]
    if head.isprintable():
        # Nothing to escape, as for most keys: skip the per-character pass below.
        return head
    # Stored labels must survive every database's text type: escaping what is not
    # printable removes NUL and lone surrogates (category Cs) alike.
    safe = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:LABEL_LENGTH])
    return safe[:LABEL_LENGTH]


#: HMAC-SHA-256's inner and outer hashes with the secret's pads already absorbed, copied
#: for each key: hashlib's copies cost half of what copying an ``hmac.HMAC`` does.
_prepared: tuple[Any, Any] | None = None
_prepared_lock = threading.Lock()
#: Recent short keys (a str, or a pair of a str and a str or int) and their encodings:
#: most calls repeat a key (a user, an address), and a dict lookup costs a tenth of the HMAC.
_recent: dict[object, EncodedKey] = {}
_RECENT_SIZE = 4096
_RECENT_KEY_LENGTH = 256


def _secret() -> bytes:
    user = getattr(settings, "TOKENBUCKET", {})
    secret = user.get("KEY_SECRET") if isinstance(user, dict) else None
    if secret:
        return secret.encode() if isinstance(secret, str) else bytes(secret)
    # Derived, so that the digests say nothing about SECRET_KEY itself.
    return hashlib.sha256(b"django_tokenbucket.keys\x00" + settings.SECRET_KEY.encode()).digest()


_INNER_PAD = bytes(b ^ 0x36 for b in range(256))
_OUTER_PAD = bytes(b ^ 0x5C for b in range(256))


def _prepare(secret: bytes) -> tuple[Any, Any]:
    """Return the inner and outer hashes of HMAC-SHA-256 (RFC 2104) keyed with ``secret``."""
    if len(secret) > 64:  # SHA-256's block size
        secret = hashlib.sha256(secret).digest()
    secret = secret.ljust(64, b"\0")
    return hashlib.sha256(secret.translate(_INNER_PAD)), hashlib.sha256(secret.translate(_OUTER_PAD))


def _digest(data: bytes) -> str:
    global _prepared
    prepared = _prepared
    if prepared is None:
        with _prepared_lock:
            prepared = _prepared = _prepare(_secret())
    inner = prepared[0].copy()
    inner.update(data)
    outer = prepared[1].copy()
    outer.update(inner.digest())
    return str(outer.hexdigest())


def settings_changed() -> None:
    """Forget the secret (``KEY_SECRET``, ``SECRET_KEY``) and the keys encoded with it
    (``django_tokenbucket.lifecycle``)."""
    global _prepared
    _prepared = None
    _recent.clear()


def after_fork_in_child() -> None:
    """Give a forked child a lock of its own (``django_tokenbucket.lifecycle``)."""
    global _prepared_lock
    # A fork while another thread prepared the secret would leave the child's copy held.
    _prepared_lock = threading.Lock()


def _cacheable_pair(key: tuple[object, ...]) -> bool:
    """Whether ``key`` is a short (str, str or int) pair, by exact types."""
    if len(key) != 2:
        return False
    kind, value = key
    if type(kind) is not str or len(kind) > _RECENT_KEY_LENGTH:
        return False
    if type(value) is Redacted:
        # Only where the label hides the value whatever its type: the str's entry is
        # found for the Redacted value, and its label must not show what Redacted hides.
        return len(value) <= _RECENT_KEY_LENGTH and kind.startswith(SECRET_KINDS)
    return type(value) is int or (type(value) is str and len(value) <= _RECENT_KEY_LENGTH)


def encode_key(key: object) -> EncodedKey:
    """Return the digest stored for ``key`` and a short printable label of it."""
    kind = type(key)
    # The usual keys, a str or a pair such as ("user", 42) or ("ip", "192.0.2.1"), are
    # remembered. Types are compared exactly: ("user", True) equals ("user", 1) but must
    # be refused, and is never stored here to be found for it.
    if isinstance(key, str):
        cacheable = kind is str and len(key) <= _RECENT_KEY_LENGTH
    else:
        cacheable = isinstance(key, tuple) and kind is tuple and _cacheable_pair(key)
    if cacheable:
        encoded = _recent.get(key)
        if encoded is not None:
            return encoded
    if isinstance(key, str):
        # Encoded exactly as _encode does, without its type dispatch.
        data = key.encode("utf-8", "surrogatepass")
        encoded = EncodedKey(_digest(b"s%d:%s" % (len(data), data)), _label(key))
    else:
        out = bytearray()
        _encode(key, out)
        encoded = EncodedKey(_digest(bytes(out)), _label(key))
    if cacheable:
        if len(_recent) >= _RECENT_SIZE:
            _recent.clear()  # cheaper than tracking the least recent, and as bounded
        _recent[key] = encoded
    return encoded
