"""The Django admin for rate limits: live state of every stored key, and resets.

What a row shows is derived *now* (the store's clock) from its two stored numbers
and the limit's current config, with the same pure functions the backends decide
with. Nothing here ever writes a row from a form: a save would race with live
traffic and could mint tokens. Changes go through actions that lock the row
(``Set tokens``) or delete it (``Reset``: a missing row is a fresh, full key).

Built for tables of millions of rows: no full COUNT (the paginator counts at most
``CappedPaginator.cap + 1`` rows), no facets, the default order and the filter by name
served by the ``(name, -ts, -id)`` index.

Buckets of the other backends (Redis, or a database backend on another database) are
listed, inspected and reset by views of their own (``buckets/<alias>/``), through the
backend's ``list_buckets`` (SCAN pages on Redis), ``reset`` and ``reset_all``; a banner
says what a backend cannot show (labels, counts and filters by state, listing at all).

Runtime overrides have an admin of their own (``LimitOverrideAdmin``), and every bucket
page offers to block, exempt or multiply the limit of its key (``bucket_overrides``).

With ``TOKENBUCKET["ANALYTICS"]`` on, the limits pages chart who is being limited:
allowed and denied calls per minute as inline SVG drawn on the server (``charts``), and
the most denied keys linking to their bucket pages (``denials``).
"""

from .buckets import MAX_ACTION_ROWS
from .display import CappedPaginator
from .overrides import LimitOverrideAdmin
from .rate_limits import RateLimitAdmin

__all__ = ["MAX_ACTION_ROWS", "CappedPaginator", "LimitOverrideAdmin", "RateLimitAdmin"]
