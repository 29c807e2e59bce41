"""``bench serve --rate R1 --rate R2``: one run per arrival rate against real engine processes (mock replicas)."""
from __future__ import annotations

import json
import subprocess
import sys


def test_a_rate_sweep_runs_every_rate_and_reports_each(processes, tmp_path):
    engines = [processes.engine().start(), processes.engine().start()]
    plot, per_request = tmp_path / "sweep.png", tmp_path / "requests.jsonl"
    args = [sys.executable, "-m", "cpmemory.cli", "bench", "serve", "--workload", "synthetic", "--requests", "6",
            "--rate", "40", "--rate", "20", "--timeout", "20", "--engine-timeout", "5", "--json", "--plot", str(plot),
            "--per-request", str(per_request)]
    for engine in engines:
        args += ["--engine", engine.url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    rows = report["sweep"]
    assert [row["rate"] for row in rows] == [20.0, 40.0]  # ascending, each rate once
    for row in rows:
        for figures in row["strategies"].values():
            assert figures["errors"] == 0 and figures["lost_blocks"] == 0 and figures["prompt_tokens"] > 0
    assert report["settings"]["rate"] == 40.0 and report["strategies"] == rows[-1]["strategies"]
    assert plot.stat().st_size > 0
    assert "TTFT by arrival rate" in done.stderr
    # every request of every run, tagged with its strategy and rate, as the engines' usage reported it
    records = [json.loads(line) for line in per_request.read_text().splitlines()]
    by_run: dict = {}
    for record in records:
        by_run.setdefault((record["strategy"], record["rate"]), []).append(record)
    assert sorted(by_run) == [(name, rate) for name in ("cpmemory", "original") for rate in (20.0, 40.0)]
    for (name, rate), rows in by_run.items():
        figures = next(row for row in report["sweep"] if row["rate"] == rate)["strategies"][name]
        assert len(rows) == 6 and all(row["error"] is None and row["replica"] in (0, 1) for row in rows)
        assert sum(row["prompt_tokens"] for row in rows) == figures["prompt_tokens"]
        assert sum(row["cached_tokens"] for row in rows) == figures["cached_tokens"]


def test_a_repeated_rate_is_an_error(processes):
    engine = processes.engine().start()
    done = subprocess.run([sys.executable, "-m", "cpmemory.cli", "bench", "serve", "--workload", "synthetic",
                           "--engine", engine.url, "--rate", "2", "--rate", "2"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "each --rate once" in done.stderr


def test_a_load_sweep_measures_the_original_capacity_first_and_runs_at_fractions_of_it(processes):
    engines = [processes.engine().start(), processes.engine().start()]
    args = [sys.executable, "-m", "cpmemory.cli", "bench", "serve", "--workload", "synthetic", "--requests", "6",
            "--concurrency", "3", "--calibrate-requests", "4", "--load", "0.5", "--load", "0.25", "--timeout", "20",
            "--engine-timeout", "5", "--json"]
    for engine in engines:
        args += ["--engine", engine.url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    capacity = report["capacity"]
    assert capacity["requests"] == 4 and capacity["concurrency"] == 3 and capacity["errors"] == 0
    assert capacity["throughput_rps"] > 0
    rows = report["sweep"]
    assert [row["load"] for row in rows] == [0.25, 0.5]  # ascending
    assert [row["rate"] for row in rows] == [round(f * capacity["throughput_rps"], 3) for f in (0.25, 0.5)]
    for row in rows:
        for figures in row["strategies"].values():
            assert figures["errors"] == 0 and figures["lost_blocks"] == 0
    assert report["load"] == 0.5 and report["settings"]["rate"] == rows[-1]["rate"]
    assert "capacity (original, 3 clients, 4 requests)" in done.stderr


def test_rate_and_load_together_are_an_error(processes):
    engine = processes.engine().start()
    done = subprocess.run([sys.executable, "-m", "cpmemory.cli", "bench", "serve", "--workload", "synthetic",
                           "--engine", engine.url, "--rate", "2", "--load", "0.5"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--rate or --load, not both" in done.stderr


def test_the_in_process_proxy_holds_and_plans_when_asked(processes, tmp_path):
    """``--hold window`` and a ``--config`` file's hold bounds reach the in-process proxy: with more clients than
    slots requests are held and released in windows, and nothing is lost; ``cpmemory-nohold`` holds nothing."""
    engines = [processes.engine().start(), processes.engine().start()]
    settings = tmp_path / "proxy.toml"
    settings.write_text("[hold]\nmax_in_flight = 1\ntimeout_ms = 200\n")
    args = [sys.executable, "-m", "cpmemory.cli", "bench", "serve", "--workload", "synthetic", "--requests", "24",
            "--concurrency", "12", "--hold", "window", "--config", str(settings), "--strategies",
            "cpmemory,cpmemory-nohold", "--timeout", "30", "--engine-timeout", "10", "--json"]
    for engine in engines:
        args += ["--engine", engine.url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    figures, proxy = report["strategies"]["cpmemory"], report["details"]["cpmemory"]["proxy"]
    assert figures["errors"] == 0 and figures["lost_blocks"] == 0
    assert report["settings"]["hold"] == "window"
    assert report["settings"]["proxy_config"]["hold"] == {"max_in_flight": 1, "timeout_ms": 200}
    assert proxy["hold_held"] > 0 and sum(proxy["hold_windows"].values()) > 0, proxy
    unheld = report["details"]["cpmemory-nohold"]["proxy"]
    assert report["strategies"]["cpmemory-nohold"]["errors"] == 0 and not unheld.get("hold_held"), unheld
