"""cpmemory's research benchmarks: an unshipped distribution beside the package (``benchmarks/``).

What users run (``cpmemory demo``, ``cpmemory bench serve|load|core|store|plan|conversation``) stays in
``cpmemory.bench``; the studies live here and reach the command line through :mod:`cpmemory_benchmarks.cli`.
"""
