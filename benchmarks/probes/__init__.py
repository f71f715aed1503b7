"""Probes: one question each, run by hand, their figures quoted in the docs.

Each is a script (``python benchmarks/probes/NAME.py --help``) that compares what it
measures with a floor or a baseline of the same run, timed through timing.py, so that
every probe warms up, interleaves, summarises and compares in one way. _setup.py gives
the probes on tests/settings.py a throwaway database.
"""
