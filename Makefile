# Benchmarks (issues 8 and 19). `make bench` creates .venv-bench with the package, its Redis,
# DRF and PostgreSQL extras and the peers it is compared with (the `bench` extra), then
# runs benchmarks/suite/peers.py against PostgreSQL and Redis on 127.0.0.1 (PGHOST/PGPORT/
# PGUSER, REDIS_HOST/REDIS_PORT), then benchmarks/suite/http_stack.py (our DRF throttle and
# @ratelimit through Django's request handler, next to DRF's throttle and django-ratelimit's
# decorator), each writing its figures as JSON under benchmarks/results/ (git-ignored),
# and then benchmarks/suite/report.py, which prints issue 19's targets, met or missed, and
# rewrites the tables of docs/benchmarks.md from the JSON of this run (one run id for the
# three). About 6 minutes on 2 cores.
# `make bench-quick` (about 2 minutes) and `make bench-http` (the HTTP stack alone) print
# their figures and leave the docs alone.
# `make bench-tasks` (about 2 minutes) runs benchmarks/suite/tasks.py: RateLimitedTask and
# Celery's own rate_limit on 4 real workers, Redis broker, PostgreSQL; it rewrites its own
# section of docs/benchmarks.md.
# `make bench-flood` (issue 35, about 3 minutes) runs benchmarks/suite/flood.py: 8 processes
# flooding one exhausted key, then 100,000 rotating exhausted keys, with the deny cache on
# and off, on the database backend (PostgreSQL) and on a private redis-server; store
# operations counted on the servers, a ninth process's SELECT p99, denied requests through
# views, item 7's fail-open figure, and issue 48's login phase (a locked-out account's wrong
# passwords next to unprotected logins: µs, PBKDF2 hashes, store operations per login).
# It prints issue 35's targets and rewrites its own section
# of docs/benchmarks.md. PYTHON: a Python with the [redis,drf,postgres] extras, redis-server.
# Knobs: BENCH_ARGS for peers.py, BENCH_HTTP_ARGS for http_stack.py, BENCH_FLOOD_ARGS for flood.py. See docs/benchmarks.md.
# The probes of benchmarks/probes/ are no part of it: each runs by hand (see its --help).
# `make bench-failover` (issues 34 and 46, about two minutes a run) runs tests/test_redis_crash.py
# FAILOVER_RUNS times (3), which kills a Redis Cluster primary and a Sentinel master under
# load from 4 processes (sync, then asyncio; at the defaults, with docs/redis.md's socket
# timeouts and with none), and writes the figures to its own section of
# docs/benchmarks.md: failure window, failed calls' latency, healthy keys' p50/p99 before,
# during and after. It needs the test extras and redis-server (PYTHON: a Python that has them).

PYTHON ?= python3
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed
BENCH_ARGS ?=
BENCH_HTTP_ARGS ?=
BENCH_FLOOD_ARGS ?=
BENCH_SUITE := benchmarks/suite
BENCH_RESULTS := benchmarks/results
# Expanded once: every step of one `make bench` records the same run id.
BENCH_RUN := $(shell date -u +%Y%m%dT%H%M%SZ)-$(shell echo $$$$)

.PHONY: bench bench-failover bench-flood bench-http bench-quick bench-tasks bench-venv

bench-venv: $(BENCH_STAMP)

$(BENCH_STAMP): setup.cfg pyproject.toml Makefile
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "Python 3.11+ is needed: make bench PYTHON=python3.11")'
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install --quiet -e '.[redis,drf,postgres,celery,bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(BENCH_PY) $(BENCH_SUITE)/peers.py --run-id $(BENCH_RUN) --json $(BENCH_RESULTS)/peers.json $(BENCH_ARGS)
	$(BENCH_PY) $(BENCH_SUITE)/http_stack.py --run-id $(BENCH_RUN) --json $(BENCH_RESULTS)/http.json $(BENCH_HTTP_ARGS)
	$(BENCH_PY) $(BENCH_SUITE)/report.py $(BENCH_RESULTS)/peers.json $(BENCH_RESULTS)/http.json \
		--run-id $(BENCH_RUN) --docs docs/benchmarks.md

bench-tasks: $(BENCH_STAMP)
	$(BENCH_PY) $(BENCH_SUITE)/tasks.py --json $(BENCH_RESULTS)/tasks.json --docs docs/benchmarks.md

bench-flood:
	$(PYTHON) $(BENCH_SUITE)/flood.py --json $(BENCH_RESULTS)/flood.json --docs docs/benchmarks.md $(BENCH_FLOOD_ARGS)

bench-http: $(BENCH_STAMP)
	$(BENCH_PY) $(BENCH_SUITE)/http_stack.py --json $(BENCH_RESULTS)/http-only.json $(BENCH_HTTP_ARGS)

bench-quick: $(BENCH_STAMP)
	$(BENCH_PY) $(BENCH_SUITE)/peers.py --quick --run-id $(BENCH_RUN) --json $(BENCH_RESULTS)/quick-peers.json $(BENCH_ARGS)
	$(BENCH_PY) $(BENCH_SUITE)/http_stack.py --quick --run-id $(BENCH_RUN) --json $(BENCH_RESULTS)/quick-http.json \
		$(BENCH_HTTP_ARGS)
	$(BENCH_PY) $(BENCH_SUITE)/report.py $(BENCH_RESULTS)/quick-peers.json $(BENCH_RESULTS)/quick-http.json \
		--run-id $(BENCH_RUN)

FAILOVER_RUNS ?= 3

bench-failover:
	$(PYTHON) $(BENCH_SUITE)/failover.py --runs $(FAILOVER_RUNS) --json $(BENCH_RESULTS)/failover.json --docs docs/benchmarks.md
