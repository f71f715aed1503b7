"""Measurements of django-tokenbucket, none of them a test: they assert nothing about speed.

- ``suite/``: what ``make bench`` runs (peers.py, http_stack.py, then report.py, which
  writes the tables of docs/benchmarks.md), with its worker harness, settings and stores.
- ``probes/``: one question each (the ASGI overhead, the Redis and PostgreSQL decision
  paths against their floors, cleanup, the admin's changelist), run by hand and quoted
  in the docs; they time through one shared module, ``probes/timing.py``.

The admin screenshot of docs/operations.md is taken by scripts/admin_screenshot.py.
"""
