"""A textbook Django ORM token bucket, the reference the benchmark compares against (benchmarks/suite/peers.py)."""
