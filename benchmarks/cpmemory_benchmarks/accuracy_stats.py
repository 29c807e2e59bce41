"""Scoring and paired statistics of the accuracy study (pure functions; no IO).

Answers are scored against every gold answer of a question, taking the best:

* ``em``: the normalised answer equals a normalised gold answer;
* ``f1``: token F1 between the normalised answer and a normalised gold answer (SQuAD style: bag of tokens);
* ``contain``: a normalised gold answer occurs in the normalised answer as whole tokens.

Normalisation lowercases, drops punctuation and the articles a/an/the, and collapses white space.

Paired differences compare a condition with ``original`` over the questions both answered (no error, non-empty
answer): the mean difference of token F1 with a percentile bootstrap confidence interval, the Wilcoxon signed-rank
test on those differences, and McNemar's exact test on containment (the discordant pairs: contained only under one
condition). Where the gold answers are long-form (MT-RAG's reference answers are sentences) containment is never
met under any condition, McNemar has nothing to count, and the signed-rank test is the significance test that says
something.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans({character: " " for character in string.punctuation + "\u2018\u2019\u201c\u201d"})
BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95


def normalize(text: str) -> str:
    """Lowercase, punctuation and articles removed, white space collapsed."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1(prediction: list[str], gold: list[str]) -> float:
    if not prediction or not gold:
        return float(prediction == gold)
    common = sum((Counter(prediction) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(gold)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True, slots=True)
class Score:
    """One answer's scores (each the best over the gold answers)."""

    em: float
    f1: float
    contain: float


def score(answer: str, golds: Sequence[str]) -> Score:
    """Score ``answer`` against ``golds`` (at least one). Pure."""
    if not golds:
        raise ValueError("a question needs at least one gold answer")
    predicted = normalize(answer)
    tokens = predicted.split()
    best = Score(0.0, 0.0, 0.0)
    for gold in golds:
        wanted = normalize(gold)
        best = Score(
            max(best.em, float(predicted == wanted)),
            max(best.f1, _f1(tokens, wanted.split())),
            max(best.contain, float(bool(wanted) and f" {wanted} " in f" {predicted} ")),
        )
    return best


def bootstrap_ci(differences: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                 confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``differences`` (seeded: the same input, the same interval).

    Returns (nan, nan) for no differences.
    """
    values = np.asarray(differences, dtype=float)
    if values.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return (float(low), float(high))


def mcnemar_p(only_first: int, only_second: int) -> float:
    """McNemar's exact test (two-sided binomial on the discordant pairs); 1.0 when there are none."""
    from scipy.stats import binomtest

    if only_first < 0 or only_second < 0:
        raise ValueError("discordant counts cannot be negative")
    discordant = only_first + only_second
    if discordant == 0:
        return 1.0
    return float(binomtest(min(only_first, only_second), discordant, 0.5).pvalue)


def wilcoxon_p(differences: Sequence[float]) -> float:
    """Two-sided Wilcoxon signed-rank p of paired differences (zero differences dropped); 1.0 when all are zero."""
    from scipy.stats import wilcoxon

    values = np.asarray(differences, dtype=float)
    values = values[values != 0.0]  # dropped here, so that scipy's exact test still applies to a few pairs
    if values.size == 0:
        return 1.0
    return float(wilcoxon(values).pvalue)


@dataclass(frozen=True, slots=True)
class Paired:
    """One condition against a baseline over the same questions."""

    n: int
    f1_diff: float
    f1_ci: tuple[float, float]
    contain_only_baseline: int
    contain_only_condition: int
    mcnemar_p: float
    tokens_diff: float
    f1_p: float

    def as_json(self) -> dict[str, object]:
        """The issue's shape (``contain_only_original`` names the baseline whatever it is)."""
        return {"n": self.n, "f1_diff": _round(self.f1_diff), "f1_ci": [_round(v) for v in self.f1_ci],
                "contain_only_original": self.contain_only_baseline,
                "contain_only_cond": self.contain_only_condition, "mcnemar_p": _round(self.mcnemar_p),
                "f1_wilcoxon_p": _round(self.f1_p), "answer_tokens_diff": _round(self.tokens_diff)}


def paired(baseline: Sequence[Score], condition: Sequence[Score], baseline_tokens: Sequence[float] = (),
           condition_tokens: Sequence[float] = (), *, seed: int = 0) -> Paired:
    """Compare ``condition`` with ``baseline`` question by question (the same questions in the same order)."""
    if len(baseline) != len(condition) or len(baseline_tokens) != len(condition_tokens):
        raise ValueError("paired samples must have the same length")
    differences = [c.f1 - b.f1 for b, c in zip(baseline, condition)]
    only_baseline = sum(1 for b, c in zip(baseline, condition) if b.contain and not c.contain)
    only_condition = sum(1 for b, c in zip(baseline, condition) if c.contain and not b.contain)
    token_diffs = [c - b for b, c in zip(baseline_tokens, condition_tokens)]
    return Paired(
        n=len(differences),
        f1_diff=float(np.mean(differences)) if differences else float("nan"),
        f1_ci=bootstrap_ci(differences, seed=seed),
        contain_only_baseline=only_baseline,
        contain_only_condition=only_condition,
        mcnemar_p=mcnemar_p(only_baseline, only_condition),
        tokens_diff=float(np.mean(token_diffs)) if token_diffs else float("nan"),
        f1_p=wilcoxon_p(differences),
    )


def _round(value: float) -> float | None:
    return None if value != value else round(float(value), 4)  # NaN -> null in JSON


def means(scores: Sequence[Score], tokens: Sequence[float]) -> dict[str, float | None]:
    """A condition's mean scores and answer length (the issue's ``conditions`` entry)."""
    if not scores:
        return {"em": None, "f1": None, "contain": None, "answer_tokens": None}
    return {"em": _round(float(np.mean([s.em for s in scores]))), "f1": _round(float(np.mean([s.f1 for s in scores]))),
            "contain": _round(float(np.mean([s.contain for s in scores]))),
            "answer_tokens": _round(float(np.mean(tokens))) if tokens else None}
