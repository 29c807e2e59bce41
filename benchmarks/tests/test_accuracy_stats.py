"""The accuracy study's scoring and paired statistics, against values worked out by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cpmemory_benchmarks.accuracy_stats import (
    Score,
    bootstrap_ci,
    mcnemar_p,
    means,
    normalize,
    paired,
    score,
    wilcoxon_p,
)


def test_normalize_drops_case_punctuation_and_articles() -> None:
    assert normalize("The  Eiffel-Tower, in Paris!") == "eiffel tower in paris"
    assert normalize("An apple a day") == "apple day"


def test_score_takes_the_best_gold_and_counts_whole_tokens() -> None:
    assert score("Paris", ["paris", "Lyon"]) == Score(1.0, 1.0, 1.0)
    found = score("It was in Paris, France.", ["Paris"])
    assert found.em == 0.0 and found.contain == 1.0
    assert found.f1 == pytest.approx(2 * (1 / 5) * 1 / (1 / 5 + 1))  # 1 common token of 5 predicted, 1 gold
    assert score("Parisian food", ["Paris"]).contain == 0.0  # "paris" is not a whole token of the answer
    assert score("no idea", ["7 May 2023"]) == Score(0.0, 0.0, 0.0)


def test_score_needs_a_gold_answer() -> None:
    with pytest.raises(ValueError, match="gold"):
        score("anything", [])


def test_mcnemar_exact_p_values() -> None:
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 5) == pytest.approx(1.0)
    assert mcnemar_p(0, 10) == pytest.approx(2 * 0.5 ** 10)
    assert mcnemar_p(1, 9) == mcnemar_p(9, 1) == pytest.approx(2 * 11 * 0.5 ** 10)
    with pytest.raises(ValueError):
        mcnemar_p(-1, 3)


def test_wilcoxon_signed_rank_p_values() -> None:
    assert wilcoxon_p([0.0] * 8) == 1.0
    # ten distinct losses, no ties: the exact two-sided p is 2 / 2**10 (only one of 2**10 sign patterns is as extreme)
    assert wilcoxon_p([-0.1 * k for k in range(1, 11)]) == pytest.approx(2 * 0.5 ** 10)
    # zero differences are dropped: the same losses among many ties give the same p
    assert wilcoxon_p([0.0] * 30 + [-0.1 * k for k in range(1, 11)]) == pytest.approx(2 * 0.5 ** 10)
    assert wilcoxon_p([-0.5, 0.5, -0.25, 0.25, -0.1, 0.1]) == pytest.approx(1.0)


def test_bootstrap_interval_holds_the_mean_is_seeded_and_narrows_with_n() -> None:
    rng = np.random.default_rng(7)
    small = list(rng.normal(0.1, 0.4, size=40))
    large = list(rng.normal(0.1, 0.4, size=1600))
    low, high = bootstrap_ci(small)
    assert low < float(np.mean(small)) < high
    assert bootstrap_ci(small) == (low, high)
    large_low, large_high = bootstrap_ci(large)
    assert large_high - large_low < (high - low) / 3  # about sqrt(40) times narrower
    assert all(math.isnan(v) for v in bootstrap_ci([]))
    assert bootstrap_ci([0.25] * 10) == (0.25, 0.25)


def test_paired_counts_discordant_pairs_and_mean_differences() -> None:
    hit, miss = Score(1.0, 1.0, 1.0), Score(0.0, 0.0, 0.0)
    half = Score(0.0, 0.5, 1.0)
    baseline = [hit, hit, miss, hit]
    condition = [hit, miss, hit, half]
    result = paired(baseline, condition, [2, 2, 2, 2], [3, 2, 4, 2])
    assert result.n == 4
    assert result.f1_diff == pytest.approx((0 - 1 + 1 - 0.5) / 4)
    assert (result.contain_only_baseline, result.contain_only_condition) == (1, 1)
    assert result.mcnemar_p == pytest.approx(1.0)
    assert result.tokens_diff == pytest.approx(0.75)
    assert result.f1_p == pytest.approx(wilcoxon_p([0.0, -1.0, 1.0, -0.5]))
    shape = result.as_json()
    assert set(shape) >= {"f1_diff", "f1_ci", "contain_only_original", "contain_only_cond", "mcnemar_p",
                          "f1_wilcoxon_p"}
    with pytest.raises(ValueError):
        paired(baseline, condition[:2])


def test_means_of_no_scores_are_null() -> None:
    assert means([], []) == {"em": None, "f1": None, "contain": None, "answer_tokens": None}
    assert means([Score(1, 1, 1), Score(0, 0.5, 1)], [2, 4]) == {"em": 0.5, "f1": 0.75, "contain": 1.0,
                                                                  "answer_tokens": 3.0}
