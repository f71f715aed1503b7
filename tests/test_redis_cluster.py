"""The Redis backend on a real Redis Cluster: 3 masters with a replica each, on loopback ports.

The cluster is started for the session from redis-server processes (tests/redis_servers.py)
and torn down at the end. The whole conformance suite runs on it unchanged (imported
below, with a ``backend`` fixture that points the limiter at the cluster), then what is
particular to a cluster: hash tags and slots, NOSCRIPT on nodes that never saw the
script, a failover, and exactness with several processes.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from redis.cluster import RedisCluster

from django_tokenbucket import LimitRequest, limiter
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.redis import RedisBackend
from django_tokenbucket.keys import encode_key
from django_tokenbucket.testing import frozen_clock

from .concurrency import hammer, run_processes, sized, summarise
from .redis_servers import LocalCluster, keys_without_ttl, other_keys
from .settings import TOKENBUCKET as BASE_SETTINGS
from .test_admin import (  # noqa: F401  (the admin's cases on every backend, run here on the cluster)
    test_buckets_of_every_backend_page_by_page,
    test_reset_every_key_of_a_sharded_limit_after_a_confirmation,
    test_resets_need_the_permission_post_and_csrf,
    test_search_inspect_and_reset_one_key,
    test_the_banner_says_what_a_backend_cannot_show,
    test_the_first_page_of_redis_keys_shows_buckets_among_a_caches_keys,
)
from .test_command import (  # noqa: F401  (the command's cases on every backend)
    test_cleanup_runs_where_buckets_are_rows,
    test_list_counts_the_keys_of_each_limit_on_its_backend,
    test_reset_one_key_and_every_key_on_every_backend,
    test_show_summarises_and_shows_one_key_on_every_backend,
)
from .test_conformance import *  # noqa: F403  (the conformance suite, run here on the cluster)

pytestmark = [pytest.mark.redis_processes, pytest.mark.redis_cluster]

T0 = 1_700_000_000.0
FACTORY = "django_tokenbucket.backends.redis.ClusterConnectionFactory"


@pytest.fixture(autouse=True)
def api():
    """The sync API only (this overrides the conformance suite's fixture, which runs both):
    test_conformance runs the async twins on every backend, and a failover is not undone
    between the parameters of one test."""
    return "sync"


@pytest.fixture(scope="session")
def cluster():
    local = LocalCluster(masters=3, replicas=1).start()
    yield local
    local.close()


@pytest.fixture(params=[None, 5.0, "defaults"], ids=["redis-py's retries", "TIMEOUT", "defaults"])
def backend(request, cluster):
    """The limiter on the cluster (this overrides the conformance suite's fixture of the same name):
    through redis-py's cluster client (``TIMEOUT: None``), through the backend's own bounded
    calls (a ``TIMEOUT`` no test comes near), and at the defaults: no ``TIMEOUT`` (the
    default deadline's path, at a value no test comes near: conftest.py) and no socket
    timeouts, so through a cluster client of the backend's own."""
    timeouts = {} if request.param == "defaults" else {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 10}
    cache = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": cluster.url,
        "KEY_PREFIX": settings.REDIS_KEY_PREFIX,
        "OPTIONS": {"CONNECTION_FACTORY": FACTORY, **timeouts},
    }
    tokenbucket = {**BASE_SETTINGS, "BACKEND": "django_tokenbucket.backends.redis.RedisBackend"}
    tokenbucket["OPTIONS"] = {"CACHE": "cluster"}
    if request.param != "defaults":
        tokenbucket["OPTIONS"]["TIMEOUT"] = request.param
    with override_settings(CACHES={**settings.CACHES, "cluster": cache}, TOKENBUCKET=tokenbucket):
        client = get_backend().client()
        assert isinstance(client, RedisCluster)
        # The topology as it is now: the failover test of the other parameter moved a primary.
        client.nodes_manager.initialize()
        client.flushall(target_nodes=RedisCluster.PRIMARIES)
        yield "redis-cluster"


@pytest.fixture
def redis_backend(backend) -> RedisBackend:
    return get_backend()


@pytest.fixture
def ops_store(backend, transactional_db):
    """The store of the admin's and the command's shared cases (conftest.py): the cluster."""
    return "redis"


def test_listing_pages_through_every_primary_and_resets_them_all(cluster, redis_backend):
    config = limiter.resolve("ten_per_minute")
    with frozen_clock(T0):
        for user in range(300):
            limiter.limit("ten_per_minute", user)
        limiter.limit("login", "other")
    per_node = [server.client().dbsize() for server in masters(cluster)]
    assert len(per_node) == 3 and all(n > 0 for n in per_node)
    digests, cursor, pages, largest, progress = [], None, 0, 0, []
    while True:
        page = redis_backend.list_buckets(config, cursor=cursor, page_size=20)
        digests += [bucket.digest for bucket in page.buckets]
        pages += 1
        largest = max(largest, len(page.buckets))
        progress.append(page.progress)
        if page.cursor is None:
            break
        cursor = page.cursor
    # Every key, although they lie on three primaries; in pages of about 20 (COUNT is a hint to SCAN).
    assert sorted(set(digests)) == sorted(encode_key(user).digest for user in range(300))
    assert pages >= 300 // 60 and largest <= 60
    # How far the listing has looked goes up over the primaries, each a third, to the end.
    assert progress == sorted(progress) and progress[-1] == 1.0 and progress[0] < 1 / 3
    assert redis_backend.count_buckets([config, limiter.resolve("login")]) == {"ten_per_minute": 300, "login": 1}
    assert redis_backend.reset_all(config, batch_size=50) == 300
    assert redis_backend.count_buckets([config, limiter.resolve("login")]) == {"ten_per_minute": 0, "login": 1}


def test_a_page_of_the_cluster_stops_at_its_time_budget_and_says_how_far_it_looked(cluster, redis_backend, monkeypatch):
    config = limiter.resolve("ten_per_minute")
    monkeypatch.setattr(redis_backend, "scan_budget", 0.0)  # one SCAN call a page
    with frozen_clock(T0):
        for user in range(3):
            limiter.limit("ten_per_minute", user, count=10)  # empty: stored for a minute
    with other_keys(redis_backend.client(), 30_000):
        digests, cursor, progress = [], None, []
        while True:
            page = redis_backend.list_buckets(config, cursor=cursor, page_size=1000)
            digests += [bucket.digest for bucket in page.buckets]
            progress.append(page.progress)
            if page.cursor is None:
                break
            cursor = page.cursor
    assert sorted(digests) == sorted(encode_key(user).digest for user in range(3))
    # About 10^4 keys a primary, 10 calls of COUNT 1000 on each: every page bounded, the
    # estimate going up through each primary's third.
    assert 20 <= len(progress) <= 60 and progress == sorted(progress) and progress[-1] == 1.0
    for third in range(3):
        assert any(third / 3 < share < (third + 1) / 3 for share in progress), third


def masters(cluster: LocalCluster):
    return [server for server in cluster.servers if server.client().info("replication")["role"] == "master"]


def test_the_limits_of_one_key_share_a_slot_and_keys_spread_over_the_nodes(cluster, redis_backend):
    client = redis_backend.client()
    names = ["ten_per_minute", "burst", "window", "login"]
    for user in range(60):
        slots = {client.keyslot(redis_backend.key(limiter.resolve(n), encode_key(user))) for n in names}
        assert len(slots) == 1
        with frozen_clock(T0):
            assert limiter.limit_many([(name, user) for name in names]).ok
    per_node = [server.client().dbsize() for server in masters(cluster)]
    assert len(per_node) == 3 and all(n > 0 for n in per_node) and sum(per_node) == 240


def test_limits_of_different_keys_cannot_be_decided_together(redis_backend):
    with pytest.raises(ImproperlyConfigured, match="share one key"):
        limiter.limit_many([("login", "user-1"), ("burst", None)])
    # One at a time they work, and on a single key together too.
    assert limiter.limit("login", "user-1").ok and limiter.limit("burst", None).ok


def test_nodes_that_never_saw_the_script_load_it_once(cluster, redis_backend):
    client = redis_backend.client()
    client.script_flush()  # on every master
    reloads = redis_backend.script_reloads
    with frozen_clock(T0):
        for user in range(60):  # keys on every master
            assert limiter.limit("login", user).ok
        assert redis_backend.script_reloads == reloads + 3  # once per master
        for user in range(60):
            assert limiter.limit("login", user).value == 3
    assert redis_backend.script_reloads == reloads + 3


def test_no_key_is_left_without_a_ttl(cluster, redis_backend):
    with frozen_clock(T0) as clock:
        for i in range(40):
            limiter.limit("ten_per_minute", i)
            limiter.limit("window", i % 9, count=2)
            limiter.limit("reservable", i % 5, count=7, reserve=True)
            clock.advance(1 if i % 3 else -600)
    counts = [keys_without_ttl(server.client(), f"{settings.REDIS_KEY_PREFIX}:*") for server in masters(cluster)]
    assert sum(total for total, _ in counts) >= 40
    assert sum(immortal for _, immortal in counts) == 0


PROCESSES = sized(6, 32)


@pytest.mark.concurrency
def test_h1_exact_on_the_cluster(cluster, redis_backend):
    config = {"rate": 100, "period": 3600}
    call = partial(limiter.limit, "h1", "hot", config=config)
    with frozen_clock(T0):
        results = run_processes(hammer, PROCESSES, call, 50, None)
        assert limiter.get_value("h1", "hot", config=config) == 0
    figures = summarise(results, case="H1", backend="redis-cluster (3 masters + 3 replicas)", C=100)
    assert figures["surfaced_errors"] == 0, figures["error_samples"]
    assert figures["admitted"] == 100


@pytest.mark.concurrency
def test_h2_bound_on_the_cluster(cluster, redis_backend):
    capacity, rate, duration = sized(20, 100), 10, sized(3.0, 20.0)
    config = {"rate": rate, "period": 1, "capacity": capacity}
    call = partial(limiter.limit, "h2", "hot", config=config)
    results = run_processes(hammer, PROCESSES, call, None, duration)
    figures = summarise(results, case="H2", backend="redis-cluster (3 masters + 3 replicas)", C=capacity, r=rate)
    bound = capacity + rate * figures["store_clock_span_s"]
    figures.update(bound=round(bound, 3), excess=round(figures["admitted"] - bound, 3))
    figures["utilisation"] = round(figures["admitted"] / bound, 4)
    counts = [keys_without_ttl(server.client(), f"{settings.REDIS_KEY_PREFIX}:*") for server in masters(cluster)]
    figures.update(keys=sum(c[0] for c in counts), keys_without_ttl=sum(c[1] for c in counts))
    assert figures["surfaced_errors"] == 0, figures["error_samples"]
    assert figures["admitted"] <= bound + 1e-6
    assert figures["admitted"] >= 0.9 * bound, figures
    assert figures["keys_without_ttl"] == 0


@pytest.mark.concurrency
def test_h5_all_or_nothing_on_the_cluster(cluster, redis_backend):
    loose = {"rate": 1000, "period": 3600}
    tight = {"rate": 10, "period": 3600}
    requests = [LimitRequest("h5-loose", "k", config=loose), LimitRequest("h5-tight", "k", config=tight)]
    with frozen_clock(T0):
        results = run_processes(hammer, PROCESSES, partial(limiter.limit_many, requests), 30, None)
        figures = summarise(results, case="H5", backend="redis-cluster (3 masters + 3 replicas)")
        assert figures["surfaced_errors"] == 0, figures["error_samples"]
        assert figures["admitted"] == 10
        assert limiter.get_value("h5-loose", "k", config=loose) == 990


def test_async_decisions_run_on_the_asyncio_cluster_client(cluster, redis_backend):
    """The async API on the cluster: redis-py's asyncio RedisCluster, the same keys, slots and results."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    users = [f"async-user-{i}" for i in range(12)]

    async def decide() -> object:
        for user in users:
            assert (await limiter.alimit_many([("login", user, 2), ("burst", user, 3)])).ok
        assert not (await limiter.alimit_many([("login", users[0], 4), ("burst", users[0])])).ok
        with pytest.raises(ImproperlyConfigured, match="share one key"):
            await limiter.alimit_many([("login", "user-1"), ("burst", None)])
        await limiter.areset("burst", users[1])
        from django_tokenbucket.backends.redis import backend as redis_module

        return await redis_backend.asyncio_clients.client(redis_module._settings_generation)

    with frozen_clock(T0):
        client = asyncio.run(decide())
        assert isinstance(client, AsyncRedisCluster)
        # What the async path wrote, the sync path reads: the same keys on the same nodes.
        assert [limiter.get_value("login", user) for user in users] == [3] * len(users)
        assert limiter.get_value("burst", users[0]) == 17 and limiter.get_value("burst", users[1]) == 20
    assert redis_backend.async_calls["thread"] == 0 and redis_backend.async_calls["asyncio"] == len(users) + 3
    login = limiter.resolve("login")
    nodes = {redis_backend.client().get_node_from_key(redis_backend.key(login, encode_key(u))).port for u in users}
    assert len(nodes) > 1  # the keys were spread over several masters


# Not with the defaults' client: a third failover in a row on the session's cluster found
# the nodes' views of the slot still apart now and then; that client goes through a real
# failover in tests/test_redis_crash.py (a primary SIGKILLed, no socket timeouts).
@pytest.mark.parametrize("backend", [None, 5.0], ids=["redis-py's retries", "TIMEOUT"], indirect=True)
def test_a_failover_keeps_the_state_and_surfaces_no_error(cluster, redis_backend):
    """A replica takes over the slot (CLUSTER FAILOVER): MOVED and NOSCRIPT are both handled."""
    cluster.wait_until_ok()  # every replica linked: the other parameter's failover left one syncing
    client = redis_backend.client()
    config = limiter.resolve("login")
    key = redis_backend.key(config, encode_key("failover"))
    slot = client.keyslot(key)
    with frozen_clock(T0):
        assert limiter.limit("login", "failover", count=2).value == 3
        old_master = cluster.node_for_slot(slot)
        replica = cluster.node_for_slot(slot, role="replica")
        if replica.client().info("replication")["role"] == "master":
            # The view of the node asked lags the other parameter's failover: the other way round.
            old_master, replica = replica, old_master
        replica_client = replica.client()
        deadline = time.monotonic() + 30
        while replica_client.info("replication")["master_repl_offset"] < old_master.client().info("replication")[
            "master_repl_offset"
        ]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        replica_client.script_flush()  # it may have been a master (the other parameter's failover)
        asked = 0.0
        while replica_client.info("replication")["role"] != "master":
            assert time.monotonic() < deadline, "the failover did not happen"
            if time.monotonic() - asked > 5:
                # A manual failover the master does not take part in times out: ask again.
                replica_client.execute_command("CLUSTER FAILOVER")
                asked = time.monotonic()
            time.sleep(0.05)
        cluster.wait_until_ok()
        reloads = redis_backend.script_reloads
        assert limiter.limit("login", "failover").value == 2  # the replicated state, decided on the new master
        views_agree = time.monotonic() + 10  # the promoted node's own view may lag by a gossip round
        while cluster.node_for_slot(slot, via=replica).port != replica.port:
            assert time.monotonic() < views_agree
            time.sleep(0.05)
        assert redis_backend.script_reloads == reloads + 1  # the new master had never run the script
        replica_client.close()


def test_a_slot_being_migrated_is_followed_through_ask_and_then_moved(cluster, redis_backend):
    """A slot moved to another master as ``redis-cli --cluster reshard`` moves it: while the
    key is already on the target and the slot still the source's, the source answers ASK
    (the target serves the key after ASKING); once the slot is the target's, MOVED. The
    bucket's state goes along, sync and asyncio, on both the redis-py path and TIMEOUT's."""
    cluster.wait_until_ok()
    client = redis_backend.client()
    config = limiter.resolve("login")
    key = redis_backend.key(config, encode_key("migrating"))
    slot = client.keyslot(key)
    source = cluster.node_for_slot(slot)
    target = next(s for s in cluster.servers if s is not source and s.client().info("replication")["role"] == "master")
    source_id, target_id = (s.client().execute_command("CLUSTER MYID").decode() for s in (source, target))
    with frozen_clock(T0):
        assert limiter.limit("login", "migrating", count=2).value == 3
        target.client().execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        source.client().execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", key)
        assert [s.client().execute_command("CLUSTER COUNTKEYSINSLOT", slot) for s in (source, target)] == [0, 1]
        # Mid-migration: the source answers ASK for the key it no longer holds.
        assert limiter.limit("login", "migrating").value == 2
        assert asyncio.run(limiter.alimit("login", "migrating")).value == 1
        for server in cluster.servers:
            if server.client().info("replication")["role"] == "master":
                server.client().execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        cluster.wait_until_ok()
        # Migrated: the slot is the target's, and a client that still sends it to the source is MOVED.
        assert limiter.limit("login", "migrating").value == 0
        assert not limiter.limit("login", "migrating").ok
        assert not asyncio.run(limiter.alimit("login", "migrating")).ok
    assert cluster.node_for_slot(slot).port == target.port


def test_denial_analytics_of_two_limits_on_the_cluster(cluster, redis_backend):
    """Each limit's analytics keys share one slot (ZUNION over its minutes runs on one
    node); the two limits' lie on different nodes, which one pipeline writes and reads."""
    from django.core.cache import caches

    from django_tokenbucket.backends.base import DeniedKeyCount, MinuteCounts
    from django_tokenbucket.backends.redis.analytics import analytics_key

    client = redis_backend.client()
    minute = 28_333_440
    names = ["login", "api {v2}"]

    def node(name: str, kind: str, number: int) -> int:
        return client.get_node_from_key(str(caches["cluster"].make_key(analytics_key(name, kind, number)))).port

    # Each limit on one node whatever the hour or minute; the two on different nodes.
    assert {node(names[0], "h", 1), node(names[0], "k", minute), node(names[0], "k", minute + 59)} == {
        node(names[0], "h", 2)
    }
    assert node(names[0], "h", 1) != node(names[1], "h", 1)
    first, second, third = (encode_key(k).digest for k in ("a", "b", "c"))
    for _ in range(2):  # two flushes add up
        redis_backend.write_analytics(
            [MinuteCounts(name, minute + offset, 2, 1) for name in names for offset in (0, 61)],
            [
                *(DeniedKeyCount(name, first, "a", 2, minute) for name in names),
                *(DeniedKeyCount(name, second, "b", 1, minute + 61) for name in names),
                DeniedKeyCount(names[1], third, "c", 5, minute + 1),
            ],
        )
    assert redis_backend.read_minutes(names, minute, minute + 62) == [
        MinuteCounts(name, minute + offset, 4, 2) for name in sorted(names) for offset in (0, 61)
    ]
    assert [(k.digest, k.denied) for k in redis_backend.read_denied_keys(names[0], minute, minute + 62, 5)] == [
        (first, 4),
        (second, 2),
    ]
    assert [(k.digest, k.denied) for k in redis_backend.read_denied_keys(names[1], minute, minute + 62, 2)] == [
        (third, 10),
        (first, 4),
    ]
