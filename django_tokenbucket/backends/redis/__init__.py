"""The Redis backend: limits in Redis through a django-redis cache, one Lua script a decision.

``backend`` holds ``RedisBackend``; ``script`` the decision script, its arguments and
replies; ``keyspace`` key naming and SCAN (the admin's and the command's listings);
``connections`` the cluster connection factory and what a client retries on its own;
``aio`` the asyncio clients; ``checks`` what ``manage.py check`` reads from the server;
``bounded`` the calls made within ``TIMEOUT``, behind ``breaker``'s per-node breakers.
"""

from .backend import RedisBackend
from .connections import ClusterConnectionFactory
from .keyspace import state_key
from .script import BIGNUM_MARKER, SCRIPT

__all__ = ["BIGNUM_MARKER", "SCRIPT", "ClusterConnectionFactory", "RedisBackend", "state_key"]
