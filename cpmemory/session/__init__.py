"""The per-conversation turn lifecycle (prepare -> commit / abort) shared by the sync and async facades."""
