# Benchmarks (issue 8). `make bench` creates .venv-bench with the package, its Redis,
# DRF and PostgreSQL extras and the peers it is compared with (the `bench` extra), then
# runs benchmarks/peers.py against PostgreSQL and Redis on 127.0.0.1 (PGHOST/PGPORT/
# PGUSER, REDIS_HOST/REDIS_PORT), then benchmarks/http_stack.py (`make bench-http` alone:
# our DRF throttle and @ratelimit through Django's request handler, next to DRF's throttle
# and django-ratelimit's decorator). Each prints its table and writes its figures as JSON
# (benchmarks/results/latest.json, http.json). About 5 minutes on 2 cores, of which
# http_stack.py takes one; `make bench-quick` (peers.py only) takes about one.
# Knobs: BENCH_ARGS for peers.py, BENCH_HTTP_ARGS for http_stack.py. See docs/benchmarks.md.

PYTHON ?= python3
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed
BENCH_ARGS ?=
BENCH_HTTP_ARGS ?=

.PHONY: bench bench-http bench-quick bench-venv

bench-venv: $(BENCH_STAMP)

$(BENCH_STAMP): setup.cfg pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "Python 3.11+ is needed: make bench PYTHON=python3.11")'
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install --quiet -e '.[redis,drf,postgres,bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(BENCH_PY) benchmarks/peers.py --json benchmarks/results/latest.json $(BENCH_ARGS)
	$(BENCH_PY) benchmarks/http_stack.py --json benchmarks/results/http.json $(BENCH_HTTP_ARGS)

bench-http: $(BENCH_STAMP)
	$(BENCH_PY) benchmarks/http_stack.py --json benchmarks/results/http.json $(BENCH_HTTP_ARGS)

bench-quick: $(BENCH_STAMP)
	$(BENCH_PY) benchmarks/peers.py --quick --json benchmarks/results/quick.json $(BENCH_ARGS)
