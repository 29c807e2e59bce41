#!/usr/bin/env bash
# Regenerate the replay results (docs/results/replay.md): every workload at tight (20%) and roomy (200%) cache capacity.
# Writes docs/img/bench-<workload>-<tight|roomy>.{json,png} and docs/img/bench-results.md (the markdown table).
# Usage (from the repository root): benchmarks/bench_results.sh [DATA_DIR]   (default ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_DIR="${1:-../shared/data}"
CPM="${CPM:-.venv/bin/cpmemory}"
PY="${PY:-.venv/bin/python}"
OUT=docs/img
mkdir -p "$OUT"
for workload in multihop mt_rag locomo synthetic; do
  for pair in tight:20% roomy:200%; do
    label="${pair%%:*}"; capacity="${pair#*:}"
    echo "== $workload $label ($capacity)" >&2
    "$CPM" bench replay --workload "$workload" --data-dir "$DATA_DIR" --capacity "$capacity" \
      --plot "$OUT/bench-$workload-$label.png" --json > "$OUT/bench-$workload-$label.json"
  done
done
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from cpmemory_benchmarks.replay_report import markdown_row
out = Path(sys.argv[1])
lines = ["| workload | cache | original | original+lpm | popularity | reorder | reorder+schedule | contextpilot"
         " | cpmemory | MST bound | position-free bound |", "|---" * 11 + "|"]
for workload in ("multihop", "mt_rag", "locomo", "synthetic"):
    for label, capacity in (("tight", "20%"), ("roomy", "200%")):
        path = out / f"bench-{workload}-{label}.json"
        if path.exists():
            lines.append(markdown_row(json.loads(path.read_text().strip().splitlines()[-1]), capacity))
(out / "bench-results.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
