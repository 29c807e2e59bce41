"""The research commands reach ``cpmemory bench`` through the entry-point registry, tolerant of absent studies."""
from __future__ import annotations

import typer
from typer.testing import CliRunner

from cpmemory.cli import app
from cpmemory_benchmarks import cli


def test_register_adds_present_studies_and_skips_absent_ones(monkeypatch) -> None:
    monkeypatch.setattr(cli, "STUDIES", (
        cli.Study("plan", "cpmemory.bench.plan_bench", "present"),
        cli.Study("absent", "cpmemory_benchmarks.no_such_study", "absent"),
    ))
    bench = typer.Typer()
    assert cli.register(bench) == ["plan"]
    assert [c.name for c in bench.registered_commands] == ["plan"]


def test_a_study_whose_dependency_is_missing_says_which_when_run(monkeypatch, tmp_path) -> None:
    (tmp_path / "broken_study.py").write_text("import no_such_dependency_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "STUDIES", (cli.Study("broken", "broken_study", "broken"),))
    bench = typer.Typer()
    bench.command("core")(lambda: None)
    assert cli.register(bench) == ["broken"]
    result = CliRunner().invoke(bench, ["broken", "--any", "flag"])
    assert result.exit_code == 2
    assert "no_such_dependency_anywhere" in result.output


def test_the_research_commands_are_listed_under_bench() -> None:
    result = CliRunner().invoke(app, ["bench", "--help"])
    assert result.exit_code == 0
    for name in ("replay", "hold", "serve", "load", "core", "store", "plan", "conversation"):
        assert name in result.output


def test_without_the_benchmarks_the_research_commands_say_how_to_install_them(monkeypatch) -> None:
    from cpmemory import cli as cpmemory_cli

    monkeypatch.setattr(cpmemory_cli, "entry_points", lambda group: ())
    bench = typer.Typer()
    bench.command("core")(lambda: None)
    cpmemory_cli._register_research(bench)
    result = CliRunner().invoke(bench, ["replay", "--workload", "mt_rag", "--json"])
    assert result.exit_code == 2
    assert "pip install -e benchmarks" in result.output
