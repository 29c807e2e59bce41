"""Studies run by hand (``python -m cpmemory_benchmarks.studies.<name>``): where the ceilings of the planner and of
the online path lie, the window each online target needs, and the token estimate against real tokenizers."""
