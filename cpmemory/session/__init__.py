"""The per-conversation turn lifecycle (prepare -> commit / abort) shared by the sync and async facades.

Modules: ``config`` (CpMemoryConfig), ``turns`` (pure prepare/commit steps, PreparedTurn, BlockDecision),
``index`` (per-tenant bounded context indexes), ``segments`` (cached segment index for partial overlap),
``batch`` (offline planning), ``counters`` (facade counters). The seeded self-check workload is
``cpmemory_benchmarks.selfcheck`` (benchmarks/).
"""
