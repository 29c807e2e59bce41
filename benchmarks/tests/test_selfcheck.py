"""The seeded facade workload: no violation, dedup actually happens, deterministic decisions."""

from __future__ import annotations

from cpmemory_benchmarks.selfcheck import main, run


def test_small_workload_has_no_violation_and_saves_characters() -> None:
    figures = run(conversations=6, turns=5, k=10, seed=3)
    assert figures.violations == 0
    assert figures.referenced > 0 and figures.chars_sent_ratio < 1.0
    again = run(conversations=6, turns=5, k=10, seed=3)
    assert (again.referenced, again.partial, again.changed) == (
        figures.referenced,
        figures.partial,
        figures.changed,
    )


def test_cli_prints_json(capsys) -> None:
    import json

    main(["--conversations", "2", "--turns", "2", "--json"])
    assert json.loads(capsys.readouterr().out)["violations"] == 0


def test_given_history_decides_like_the_stored_transcript() -> None:
    stored = run(conversations=5, turns=5, k=10, seed=4)
    given = run(conversations=5, turns=5, k=10, seed=4, given_history=True)
    assert given.violations == 0
    assert (given.referenced, given.partial, given.changed) == (stored.referenced, stored.partial, stored.changed)
