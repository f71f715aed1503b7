"""The ``make bench`` suite: django-tokenbucket next to its peers and the stores' floors.

peers.py (the stores) and http_stack.py (the request stack) each write the JSON of one
run; report.py turns both into the tables of docs/benchmarks.md. harness.py runs every
configuration in a worker process of its own and interleaves their rounds; the settings
modules, stores.py and textbook/ give them their databases, keys and references.
"""
