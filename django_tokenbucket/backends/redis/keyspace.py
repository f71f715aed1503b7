"""Where a limit's state lives in Redis: key names, and finding them again with SCAN.

Keys are ``tokenbucket:<name>:{<key digest[:16]>}<key digest[16:]>`` before the cache's
key function: the braces are a Redis Cluster hash tag, so every limit of one key lives
in one slot. The admin and the command list a limit's buckets by ``SCAN`` with a
bounded ``COUNT`` on every primary, never ``KEYS``: a page SCANs until it is full or
its time budget is spent, and says how far through the keyspace it has looked.
"""

from __future__ import annotations

import hashlib
import re
import time
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

from django.core.exceptions import ImproperlyConfigured
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from ...keys import EncodedKey
from ...limits import LimitConfig
from ..base import BucketPage, Request, StoredBucket, checked_digests
from .script import as_text, parse_state

__all__ = [
    "MAX_RESET_BATCH",
    "SCAN_BUDGET",
    "SCAN_COUNT",
    "KeyspaceListing",
    "check_one_slot",
    "cursor_carries_slot",
    "key_head",
    "node_clients",
    "scanned_fraction",
    "state_key",
    "tagged_key",
]

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def state_key(config: LimitConfig, key: EncodedKey) -> str:
    """Return the key of one limit's state before the cache's key function is applied.

    Names made of ``[A-Za-z0-9_.-]`` (up to 64 characters) appear as they are; any
    other name is replaced by ``~`` and its SHA-256, so keys stay short, free of
    braces, and distinct for distinct names. The hash tag is the key's digest.
    """
    return tagged_key(key_head(config), key)


def key_head(config: LimitConfig) -> str:
    """Return the start of ``config``'s state keys, up to the hash tag (``tokenbucket:<name>:``)."""
    return _name_head(config.name)


def _name_head(name: str) -> str:
    if not _PLAIN_NAME.fullmatch(name):
        name = "~" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    return f"tokenbucket:{name}:"


def tagged_key(head: str, key: EncodedKey) -> str:
    """Return ``head`` followed by ``key``'s digest, its first 16 hex digits the hash tag."""
    digest = key.digest
    return f"{head}{{{digest[:16]}}}{digest[16:]}"


#: The largest COUNT of one SCAN call: about 0.5 ms of Redis' time at 10^5 keys, so that
#: a listing holds the server for no longer than that at a time.
SCAN_COUNT = 1000


#: The seconds one page of a listing goes on calling SCAN while it is not full: a page
#: of a database that a cache shares reads ~4 x 10^5 keys (10^5 in ~60 ms here), and a
#: page of a larger one stops there, says how far it has looked, and links to the next.
SCAN_BUDGET = 0.25


#: A page's cursor: "<primary index> <SCAN cursor>", ASCII digits (a cursor of Redis is
#: an unsigned 64-bit integer; it refuses a larger one).
_CURSOR = re.compile(r"([0-9]{1,4}) ([0-9]{1,20})")


_MAX_SCAN_CURSOR = 2**64 - 1


#: A cluster node that keeps a table per slot puts the slot in its cursors' low bits.
_SLOT_BITS = 14


#: Keys unlinked per command (or per pipeline on a cluster) by ``reset_all``.
MAX_RESET_BATCH = 1000


_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


_STORED_DIGEST = re.compile(r"\{([0-9a-f]{16})\}([0-9a-f]{48})")


_HEX = re.compile(r"[0-9a-f]*")


#: Stands for the variable part of a key while finding what the cache's key function
#: puts around it.
_SENTINEL = "\x00django_tokenbucket\x00"


class _KeyPattern(NamedTuple):
    """What the cache's key function puts before and after our part of a key."""

    before: str
    after: str

    def key(self, inner: str) -> str:
        return self.before + inner + self.after

    def pattern(self, inner_glob: str) -> str:
        """Return a SCAN MATCH pattern: the fixed parts escaped, ``inner_glob`` as it is."""
        return _GLOB_SPECIAL.sub(r"\\\1", self.before) + inner_glob + _GLOB_SPECIAL.sub(r"\\\1", self.after)

    def inner(self, key: str) -> str | None:
        if not (key.startswith(self.before) and key.endswith(self.after)):
            return None
        return key[len(self.before) : len(key) - len(self.after)]


def _digest_glob(prefix: str) -> str:
    """The glob of the hash-tagged digests (``{<16 hex>}<48 hex>``) that start with ``prefix``."""
    if len(prefix) < 16:
        return "{" + prefix + "*"
    return "{" + prefix[:16] + "}" + prefix[16:] + "*"


def _digest_of(inner: str) -> str | None:
    match = _STORED_DIGEST.fullmatch(inner.rpartition(":")[2])
    return match.group(1) + match.group(2) if match else None


def node_clients(client: Any) -> list[Any]:
    """Return a client per primary: the client itself, or each primary of a cluster (by name)."""
    if not isinstance(client, RedisCluster):
        return [client]
    cluster: Any = client
    return [node.redis_connection or cluster.get_redis_connection(node) for node in _primaries(cluster)]


def _primaries(cluster: Any) -> list[Any]:
    return sorted(cluster.get_primaries(), key=lambda node: node.name)


def _parse_cursor(cursor: str | None, nodes: int, config: LimitConfig) -> tuple[int, int]:
    """Read a page's cursor, which comes back from a page link: anything but one this
    store's listing could have made is a ValueError, before it reaches Redis."""
    if cursor is None:
        return 0, 0
    match = _CURSOR.fullmatch(cursor)
    node_index, scan_cursor = (int(match.group(1)), int(match.group(2))) if match else (-1, -1)
    if not 0 <= node_index < nodes or not 0 <= scan_cursor <= _MAX_SCAN_CURSOR:
        shown = cursor if len(cursor) <= 50 else cursor[:50] + "…"
        raise ValueError(f"rate limit {config.name!r}: {shown!r} is not a cursor of this store's listing")
    return node_index, scan_cursor


def _next_count(count: int, wanted: int, found: int, looked: int) -> int:
    """COUNT for a page's next SCAN call: doubled while nothing matched, else enough for
    the ``wanted`` buckets still missing at the density seen so far (``found`` in about
    ``looked`` keys); 10 to ``SCAN_COUNT``."""
    estimate = 2 * count if found == 0 else wanted * looked // found
    return max(10, min(SCAN_COUNT, estimate))


def _reversed_fraction(cursor: int) -> float:
    return int(f"{cursor:064b}"[::-1], 2) / 2**64


def scanned_fraction(cursor: int, slots: Sequence[int] = ()) -> float:
    """Return how far through a node's keys SCAN has looked when it hands back ``cursor``
    (an estimate, 0 to 1; not for the final cursor 0).

    SCAN walks a hash table's buckets by incrementing the cursor's bits in reverse: bit
    ``i`` stands for 2^-(i+1) of the table whatever its size, so the cursor's bits
    reversed, read as a binary fraction, is the share of the buckets behind it, and keys
    hash evenly over buckets. A cluster node that keeps a table per slot (Redis 7.4+,
    Valkey 8+) puts the slot in the cursor's low 14 bits: given the node's ``slots``
    (sorted), the share is that of its slots behind the cursor's, plus the part of its
    slot's table.
    """
    if not slots:
        return _reversed_fraction(cursor)
    slot, within = cursor & (2**_SLOT_BITS - 1), cursor >> _SLOT_BITS
    return min(1.0, (bisect_left(slots, slot) + _reversed_fraction(within)) / len(slots))


def _version(text: object) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"[0-9]+", str(text))[:2])


def cursor_carries_slot(server_info: Mapping[str, Any]) -> bool:
    """Whether a cluster node that answers ``INFO server`` so keeps a table per slot,
    whose index its SCAN cursors carry: Redis 7.4+ (kvstore), Valkey 8+ (which reports
    ``redis_version`` 7.2.4 beside its own ``valkey_version``)."""
    valkey = server_info.get("valkey_version")
    if valkey is not None:
        return _version(valkey) >= (8, 0)
    return _version(server_info.get("redis_version", "")) >= (7, 4)


def _slots_in_cursor(cluster: Any, node_index: int, node: Any) -> list[int]:
    """Return a cluster primary's slots, sorted, if its SCAN cursors carry a slot; else []."""
    try:
        info = node.info("server")
    except ResponseError:  # INFO renamed away: the estimate goes without
        return []
    if not cursor_carries_slot(info):
        return []
    name = _primaries(cluster)[node_index].name
    slots_cache = cluster.nodes_manager.slots_cache
    return sorted(slot for slot, holders in slots_cache.items() if holders and holders[0].name == name)


def _scan_node(node: Any, pattern: str) -> Iterator[str]:
    scan_cursor = 0
    while True:
        scan_cursor, keys = node.scan(cursor=scan_cursor, match=pattern, count=SCAN_COUNT)
        yield from (as_text(key) for key in keys)
        if int(scan_cursor) == 0:
            return


def _unlink(node: Any, keys: list[str], cluster: bool) -> int:
    if not cluster:
        return int(node.unlink(*keys))
    # A cluster node refuses a command over keys of several slots (CROSSSLOT).
    pipe = node.pipeline(transaction=False)
    for key in keys:
        pipe.unlink(key)
    return sum(int(result) for result in pipe.execute())


class KeyspaceListing:
    """The admin's and the command's operations on a limit's keys: list, count, reset all.

    Mixed into ``RedisBackend``, whose connection (``_connect``), clock (``store_now``)
    and error mapping (``_failed``) they use.
    """

    # Provided by RedisBackend.
    _connect: Any
    _failed: Any
    store_now: Any
    client: Any
    cache_alias: str

    #: The seconds a page goes on calling SCAN while it is not full (``SCAN_BUDGET``).
    scan_budget: float = SCAN_BUDGET

    def list_buckets(
        self, config: LimitConfig, *, cursor: str | None = None, page_size: int = 100, digest_prefix: str = ""
    ) -> BucketPage:
        """A page of SCAN results: SCAN calls until ``page_size`` buckets are found, the
        keyspace ends or ``scan_budget`` seconds are spent (one call at least). The first
        call's COUNT is ``page_size`` (10 to ``SCAN_COUNT``), as dense matches need; then
        it grows while matches are sparse. SCAN returns about COUNT keys per call, so a
        page may hold a few more than ``page_size``; it may hold none and have a next one.

        The cursor is "<primary index> <SCAN cursor>" (a cluster's primaries in name
        order); the page's ``progress`` is the share of the primaries' keys looked
        through up to its end (``scanned_fraction``, the primaries taken as equal). A
        whole digest is one GET, no SCAN.
        """
        if not _HEX.fullmatch(digest_prefix) or len(digest_prefix) > 64:
            raise ValueError(f"rate limit {config.name!r}: a digest prefix is lowercase hex, not {digest_prefix!r}")
        try:
            connection = self._connect()
            outer = self._key_pattern(connection, key_head(config))
            nodes = node_clients(connection.client)
            if len(digest_prefix) == 64:
                key = outer.key(tagged_key("", EncodedKey(digest_prefix, "")))
                keys = [key]
                values = self._values(connection.client, keys)
                return BucketPage(self._buckets(outer, keys, values), None, self.store_now())
            node_index, scan_cursor = _parse_cursor(cursor, len(nodes), config)
            pattern = outer.pattern(_digest_glob(digest_prefix))
            found: dict[str, None] = {}
            count = min(SCAN_COUNT, max(10, page_size))
            # What this node has shown of its density so far (each primary holds its own
            # share of the limit's keys: a count fitted to one would overfill a page on another).
            looked = found_here = 0
            deadline = time.monotonic() + self.scan_budget
            while True:
                reply_cursor, keys = nodes[node_index].scan(cursor=scan_cursor, match=pattern, count=count)
                scan_cursor = int(reply_cursor)
                before = len(found)
                found.update(dict.fromkeys(as_text(key) for key in keys))
                found_here += len(found) - before
                looked += count
                if scan_cursor == 0:
                    node_index += 1
                    looked = found_here = 0
                    if node_index == len(nodes):
                        break
                if len(found) >= page_size or time.monotonic() >= deadline:
                    break
                wanted = page_size - len(found)
                if looked == 0:  # a new node: start as a page starts, for what is missing
                    count = min(SCAN_COUNT, max(10, wanted))
                else:
                    count = _next_count(count, wanted, found_here, looked)
            keys = list(found)
            buckets = self._buckets(outer, keys, self._values(connection.client, keys))
            if node_index == len(nodes):
                next_cursor, progress = None, 1.0
            else:
                next_cursor = f"{node_index} {scan_cursor}"
                slots = (
                    _slots_in_cursor(connection.client, node_index, nodes[node_index])
                    if isinstance(connection.client, RedisCluster) and scan_cursor
                    else []
                )
                progress = (node_index + scanned_fraction(scan_cursor, slots)) / len(nodes)
            now = self.store_now()
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc) from exc
        return BucketPage(buckets, next_cursor, now, progress)

    def count_buckets(self, configs: Sequence[LimitConfig]) -> dict[str, int]:
        """One SCAN of every ``tokenbucket:`` key (all of it, in pages): a walk over the
        whole keyspace, for the command rather than for a page view."""
        try:
            connection = self._connect()
            heads = {key_head(config)[len("tokenbucket:") :]: config.name for config in configs}
            outer = self._key_pattern(connection, "tokenbucket:")
            seen: dict[str, set[str]] = {name: set() for name in heads.values()}
            for key in self._scan_all(connection.client, outer.pattern("*")):
                rest = outer.inner(key)
                head, sep, digest = (rest or "").partition(":")
                name = heads.get(head + sep)
                if name is not None:
                    seen[name].add(digest)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc) from exc
        return {name: len(digests) for name, digests in seen.items()}

    def reset_buckets(self, name: str, digests: Sequence[str]) -> int:
        """UNLINK the keys of these digests: one command on a single Redis; one pipeline
        of single-key UNLINKs on a cluster, whose keys lie in many slots."""
        checked = checked_digests(name, digests)
        if not checked:
            return 0
        try:
            connection = self._connect()
            outer = self._key_pattern(connection, _name_head(name))
            keys = [outer.key(tagged_key("", EncodedKey(digest, ""))) for digest in checked]
            return _unlink(connection.client, keys, isinstance(connection.client, RedisCluster))
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc) from exc

    def reset_all(self, config: LimitConfig, *, batch_size: int = MAX_RESET_BATCH) -> int:
        """UNLINK the limit's keys as SCAN finds them, ``batch_size`` at a time (one
        command on a single Redis; one pipeline of single-key UNLINKs on a cluster node,
        whose keys lie in many slots)."""
        if not 1 <= batch_size <= MAX_RESET_BATCH:
            raise ValueError(f"batch_size must be between 1 and {MAX_RESET_BATCH}, not {batch_size!r}")
        deleted = 0
        try:
            connection = self._connect()
            pattern = self._key_pattern(connection, key_head(config)).pattern(_digest_glob(""))
            cluster = isinstance(connection.client, RedisCluster)
            for node in node_clients(connection.client):
                batch: list[str] = []
                for key in _scan_node(node, pattern):
                    batch.append(key)
                    if len(batch) >= batch_size:
                        deleted += _unlink(node, batch, cluster)
                        batch = []
                if batch:
                    deleted += _unlink(node, batch, cluster)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc) from exc
        return deleted

    def _key_pattern(self, connection: Any, head: str) -> _KeyPattern:
        """Find what the cache's key function puts around ``head`` + the variable part."""
        made = str(connection.make_key(head + _SENTINEL))
        before, found, after = made.partition(_SENTINEL)
        if not found or _SENTINEL in after:
            raise ImproperlyConfigured(
                f"CACHES[{self.cache_alias!r}]['KEY_FUNCTION'] does not keep the end of a key as it is: "
                f"the rate-limit buckets stored there cannot be listed (show and reset one key by its key)"
            )
        return _KeyPattern(before, after)

    def _scan_all(self, client: Any, pattern: str) -> Iterator[str]:
        for node in node_clients(client):
            yield from _scan_node(node, pattern)

    @staticmethod
    def _values(client: Any, keys: list[str]) -> list[Any]:
        if not keys:
            return []
        if isinstance(client, RedisCluster):
            # One pipeline of GETs, which the cluster client sends to each key's node.
            pipe = cast(Any, client).pipeline()
            for key in keys:
                pipe.get(key)
            return list(pipe.execute(raise_on_error=False))
        return list(client.mget(keys))

    @staticmethod
    def _buckets(outer: _KeyPattern, keys: list[str], values: list[Any]) -> list[StoredBucket]:
        buckets = []
        for key, raw in zip(keys, values, strict=True):
            if raw is None or isinstance(raw, Exception):  # expired (full again) since SCAN saw it
                continue
            digest = _digest_of(outer.inner(key) or "")
            state = parse_state(raw)
            if digest is not None and state is not None:
                buckets.append(StoredBucket(digest, "", state))
        return sorted(buckets, key=lambda bucket: bucket.digest)


def check_one_slot(client: Any, keys: list[str], requests: Sequence[Request]) -> None:
    """Refuse (``ImproperlyConfigured``) limits decided together on a cluster whose keys
    lie in different slots: one script cannot touch them all atomically."""
    if len(keys) < 2 or not isinstance(client, (RedisCluster, AsyncRedisCluster)):
        return
    cluster: Any = client
    if len({cluster.keyslot(key) for key in keys}) > 1:
        names = ", ".join(sorted({repr(r.config.name) for r in requests}))
        raise ImproperlyConfigured(
            f"rate limits {names}: on Redis Cluster, limits decided together (limit_many) must "
            f"share one key, so that their states live in one hash slot; these use different "
            f"keys (or a KEY_FUNCTION that moved the hash tag)"
        )
