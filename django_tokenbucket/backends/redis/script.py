"""The decision script: its source, the arguments it is sent and the replies it gives.

``lua/decide.lua`` is the Redis port of ``algorithms``; its numbers
travel as MessagePack, packed here once per limit and per call, and its replies are
read back into the ``Decision`` and ``Outcome`` the reference returns. So are the
values it stores (``parse_state``) and Redis' ``TIME``, which the backend's reads first
decide from without the script.
"""

from __future__ import annotations

import hashlib
import struct
from importlib import resources
from typing import Any

from ...algorithms import CLOCK_SKEW_TOLERANCE, Decision, State
from ..base import BackendError, Outcome

__all__ = [
    "BIGNUM_MARKER",
    "HEADERS",
    "INDEX_AND_COUNT",
    "MAX_TTL_MS",
    "MIN_TTL_MS",
    "PINNED_HEADERS",
    "SCRIPT",
    "SCRIPT_SHA",
    "as_msgpack",
    "as_text",
    "fast_decision",
    "fast_outcome",
    "parse_state",
    "reply_outcome",
    "time_microseconds",
]

#: The line of decide.lua that bignum.lua replaces.
BIGNUM_MARKER = "--[[ bignum.lua ]]"


def _joined_script() -> str:
    """Return decide.lua with bignum.lua in its place: one script, sent and cached as one."""
    lua = resources.files("django_tokenbucket.backends.redis").joinpath("lua")
    head, marker, tail = lua.joinpath("decide.lua").read_text(encoding="utf-8").partition(BIGNUM_MARKER)
    if not marker:  # pragma: no cover - a broken installation
        raise RuntimeError(f"django_tokenbucket/backends/redis/lua/decide.lua has no {BIGNUM_MARKER!r} line")
    return head + lua.joinpath("bignum.lua").read_text(encoding="utf-8") + tail


#: The decision script, from the package data.
SCRIPT = _joined_script()


#: Its SHA-1, the name EVALSHA runs it by.
SCRIPT_SHA = hashlib.sha1(SCRIPT.encode("utf-8")).hexdigest()


#: Bounds of a key's TTL in milliseconds. The upper one only keeps Redis' expiry
#: arithmetic in range: no bucket of a valid limit takes 285,000 years to refill.
MIN_TTL_MS = 1


MAX_TTL_MS = 2**53


#: With a pinned test clock, pinned time and Redis' time disagree: a key must not
#: expire (and read as full) while a test's pinned clock stands still.
PINNED_CLOCK_MIN_TTL_MS = 3_600_000


_FIELDS = 4


#: MessagePack: an int64 (all the script's numbers but ``now`` and stored states fit one),
#: and nil.
_INT64 = struct.Struct(">Bq")


_NIL = b"\xc0"


#: A request's key index and count, the part of its argument that varies per call.
INDEX_AND_COUNT = struct.Struct(">BqBq")


def as_msgpack(*numbers: int | str | None) -> bytes:
    """Return ``numbers`` as a MessagePack stream, which the script reads with cmsgpack.unpack.

    Each number is an int64, a short ASCII string (a kind's code) or None (nil).
    """
    return b"".join(_NIL if n is None else _packed(n) for n in numbers)


def _packed(value: int | str) -> bytes:
    if isinstance(value, str):  # a kind's code: a short ASCII string (fixstr)
        data = value.encode("ascii")
        assert len(data) < 32
        return bytes([0xA0 | len(data)]) + data
    return _INT64.pack(0xD3, value)


def _header(apply: bool, min_ttl_ms: int) -> bytes:
    return as_msgpack(int(apply), min_ttl_ms, MAX_TTL_MS, CLOCK_SKEW_TOLERANCE)


#: The script's second argument (apply, TTL bounds, clock-skew tolerance), indexed by
#: ``apply``: with the real clock...
HEADERS = (_header(False, MIN_TTL_MS), _header(True, MIN_TTL_MS))


#: ...and with a pinned test clock.
PINNED_HEADERS = (_header(False, PINNED_CLOCK_MIN_TTL_MS), _header(True, PINNED_CLOCK_MIN_TTL_MS))


def fast_decision(allowed: bool, value: int, retry_after: int | None, full_after: int) -> Decision:
    """Return ``Decision(allowed, value, retry_after, full_after, None)``, only faster.

    A frozen dataclass's __init__ sets each field through ``object.__setattr__``; every
    decision makes one, and filling ``__dict__`` at once costs a third as much (as
    ``Status._decided`` does). tests/test_redis.py keeps the two equal.
    """
    decision: Decision = object.__new__(Decision)
    decision.__dict__.update(allowed=allowed, value=value, retry_after=retry_after, full_after=full_after, state=None)
    return decision


def fast_outcome(decisions: list[Decision], now: int) -> Outcome:
    """Return ``Outcome(decisions, now)``, as ``fast_decision`` makes a Decision."""
    outcome: Outcome = object.__new__(Outcome)
    outcome.__dict__.update(decisions=decisions, now=now)
    return outcome


def parse_state(raw: Any) -> State | None:
    """Read a stored value, ``"<value> <ts>"`` (bytes or str); None when it is not one."""
    parts = as_text(raw).split(" ")
    if len(parts) != 2:
        return None
    try:
        return State(int(parts[0]), int(parts[1]))
    except ValueError:
        return None


def as_text(value: Any) -> str:
    """Return a reply (bytes, or str from a client made with decode_responses) as str.

    Bytes that are not UTF-8 are kept as lone surrogates (``surrogateescape``), not refused.
    """
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def time_microseconds(time_reply: Any) -> int:
    """Return Redis' ``TIME`` reply (seconds, microseconds) in microseconds."""
    seconds, micros = time_reply
    return int(seconds) * 1_000_000 + int(micros)


def reply_outcome(reply: Any, count: int) -> Outcome:
    """Read the script's reply to a call of ``count`` requests (``BackendError`` if it is
    not one). Its decisions carry no state to store: the script stored it."""
    if type(reply) is list and len(reply) == 5 and count == 1:
        # The common path's integers: now, allowed, value, retry_after (0 for None:
        # there is one only when denied or in debt), full_after.
        now, allowed, value, retry_after, full_after = reply
        retry = retry_after if allowed == 0 or value < 0 else None
        return fast_outcome([fast_decision(allowed == 1, value, retry, full_after)], now)
    if isinstance(reply, bytes):
        fields: list[Any] = reply.split(b" ")
        yes: Any = b"1"
        dash: Any = b"-"
    elif isinstance(reply, str):  # a client made with decode_responses
        fields, yes, dash = reply.split(" "), "1", "-"
    else:
        fields = []
    if len(fields) != 1 + _FIELDS * count:
        raise BackendError(f"unexpected reply from the decision script: {reply!r}")
    # int() reads bytes as well as str: no decoding.
    decisions = [
        fast_decision(
            fields[i] == yes,
            int(fields[i + 1]),
            None if fields[i + 2] == dash else int(fields[i + 2]),
            int(fields[i + 3]),
        )
        for i in range(1, len(fields), _FIELDS)
    ]
    return fast_outcome(decisions, int(fields[0]))
