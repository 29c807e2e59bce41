"""What a cached prefix is worth on a real engine: TTFT of LoCoMo-sessions prompts with their first k blocks cached.

    .venv/bin/python scripts/ttft_by_cached_share.py --engine http://127.0.0.1:18101 [--requests 8] [--model tiny]
        [--data-dir DIR]

For each of the first ``--requests`` questions of the ``locomo_sessions`` workload (4 whole dialog sessions as
blocks, about 6,000 tokens), and each k = 0..3: empty the engine's prefix cache (``POST /reset_prefix_cache``, vLLM
with ``VLLM_SERVER_DEV_MODE=1``), send a prompt of the first k blocks alone (it caches them), then the whole prompt,
streamed, one token, and time its first token. Prints, per k, the mean share of the prompt the engine reported
cached, the mean TTFT and its ratio to k = 0. Run it on an idle replica: it measures the engine's cost curve, the
bound on what any block order can buy a request (docs/bench-serve.md, "Measured 2026-12-03", "What a cached share
is worth on this engine").
A measuring aid, not part of the package.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cpmemory.bench.loaders import default_data_dir, load_locomo_sessions
from cpmemory.engines.client import EngineClient, EngineSettings

SYSTEM = "Answer the question from the dialog sessions."


def first_token(client: EngineClient, texts: list[str], question: str) -> tuple[float, int, int]:
    """Seconds to the first streamed token, prompt tokens, cached tokens of one chat request (one token)."""
    content = "\n\n".join(texts) + "\n\nQuestion: " + question
    result = client.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
                         max_tokens=1, stream=True, extra={"temperature": 0})
    if result.ttft_s is None or not result.prompt_tokens:
        raise RuntimeError("the stream ended without a token or a usage object")
    return result.ttft_s, result.prompt_tokens, result.cached_tokens or 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="http://127.0.0.1:18101")
    parser.add_argument("--model", default="tiny", help="the served model's name")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    trace = load_locomo_sessions(args.data_dir or default_data_dir())
    rows: dict[int, list[tuple[float, int, int]]] = {k: [] for k in range(4)}
    with EngineClient(EngineSettings(base_url=args.engine.rstrip("/"), model=args.model, timeout_s=300)) as client:
        for request in trace.requests[:args.requests]:
            texts = [block.text for block in request.blocks]
            for k in rows:
                if not client.reset_prefix_cache():
                    raise RuntimeError("the engine refused POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1?)")
                if k:
                    first_token(client, texts[:k], "-")
                rows[k].append(first_token(client, texts, request.query))
    base = statistics.mean(seconds for seconds, _, _ in rows[0])
    print("| first blocks cached | cached share | prompt tokens | TTFT mean ms | vs none cached |")
    print("|---|---|---|---|---|")
    for k, measured in rows.items():
        mean = statistics.mean(seconds for seconds, _, _ in measured)
        share = statistics.mean(cached / prompt for _, prompt, cached in measured)
        prompt_tokens = statistics.mean(prompt for _, prompt, _ in measured)
        print(f"| {k} | {share:.2f} | {prompt_tokens:,.0f} | {1000 * mean:,.0f} | {base / mean:.2f}x |")


if __name__ == "__main__":
    main()
