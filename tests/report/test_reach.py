"""What a profile can show of the paper's effects: the paper's side computed from the authors' logs, the
verdicts and sample sizes worked by hand."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from hif8qat.report.reach import (
    items_needed,
    paper_effects,
    paper_loss_gap,
    parse_sizes,
    reach_table,
    reach_verdict,
)


def test_the_paper_loss_gap_is_the_signed_mean_over_the_quantized_phase_only():
    q = pd.DataFrame({"step": [1, 2, 3, 4], "loss": [10.0, 10.0, 10.1, 9.9], "quant": ["OFF", "OFF", "ON", "ON"]})
    b = pd.DataFrame({"step": [1, 2, 3, 4], "loss": [9.0, 10.0, 10.0, 10.0], "quant": ["OFF"] * 4})
    gap, n = paper_loss_gap(q, b)  # steps 3 and 4: +1 % and -1 %; the warmup's +11 % is left out
    assert n == 2 and gap == pytest.approx(0.0, abs=1e-12)


def test_the_paper_effects_reproduce_the_published_headline_numbers():
    effects = paper_effects().set_index(["experiment", "counterpart", "metric", "task"])["paper_effect"]
    # the abstract: exp8 vs exp7 drops 0.43 % MMLU (0.44 from the rounded scores), 0.58 % HellaSwag, 0.22 % ARC-C
    assert effects["exp8", "exp7", "accuracy", "mmlu_continuation"] == pytest.approx(0.438, abs=1e-3)
    assert effects["exp8", "exp7", "accuracy", "hellaswag"] == pytest.approx(0.584, abs=1e-3)
    assert effects["exp8", "exp7", "accuracy", "arc_challenge"] == pytest.approx(0.218, abs=1e-3)
    # the APE is 0.1148 %; the signed gap over the QAT phase is below it and positive (a systematic cost)
    assert 0.1 < effects["exp8", "exp7", "train_loss", "loss"] < 0.1148 + 0.01


def test_items_needed_by_hand():
    # the flip model: the paper's drop of 1 % of a 50 % score is 0.5 % of the items losing in every seed; with
    # no item changing by chance, the item test needs 6 of them one way (two-sided p = 2 / 2^6 < 0.05), which
    # 0.005 x n reaches at n = 1,100 items
    n = items_needed(1.0, 50.0, 200, {}, 3)
    assert round(0.005 * n) == 6 and round(0.005 * (n - 1)) == 5
    # items changing by chance (here 10 % of them, by one answer net) make the test need more
    assert items_needed(1.0, 50.0, 200, {1: 20}, 3) > 2 * n
    assert math.isnan(items_needed(0.0, 50.0, 200, {1: 20}, 3))
    assert parse_sizes("1:3 2:1") == {1: 3, 2: 1} and parse_sizes(float("nan")) == {}


def test_verdicts_say_resolvable_or_the_sample_needed_and_whether_the_paper_is_inside_the_interval():
    assert reach_verdict(0.12, 0.07, -0.05, 0.05, 1, "seeds") == \
        "resolvable; differs from the paper (95 % CI excludes its value)"
    assert reach_verdict(0.2, 0.4, 0.1, 0.9, 12, "seeds").startswith("not resolvable: needs about 12 seeds; consistent")
    assert "too few items flip" in reach_verdict(0.4, math.nan, -1, 1, math.nan, "items")


def test_reach_rows_are_the_claims_the_paper_also_measured():
    claims = pd.DataFrame([
        {"experiment": "exp8", "counterpart": "exp7", "against": "baseline", "mode": "train", "task": "loss",
         "metric": "train_loss", "unit": "% of loss", "n_seeds": 3, "n_items": 120, "cost": 0.0, "ci_lo": -0.05,
         "ci_hi": 0.05, "margin": 0.25, "equivalence": "equivalent within 0.25 %", "mde": 0.24, "base": math.nan,
         "lost": math.nan, "gained": math.nan, "run_tag": ""},
        {"experiment": "exp8", "counterpart": "exp7", "against": "bf16_mode", "mode": "hif8", "task": "hellaswag",
         "metric": "accuracy", "unit": "% of score", "n_seeds": 1, "n_items": 130, "cost": 0.0, "ci_lo": -5,
         "ci_hi": 5, "margin": 1, "equivalence": "inconclusive at this size", "mde": math.nan, "base": 40.0,
         "lost": 1, "gained": 1, "run_tag": ""},
    ])
    effects = pd.DataFrame([{"experiment": "exp8", "counterpart": "exp7", "metric": "train_loss", "task": "loss",
                             "paper_effect": 0.12, "paper_basis": "test"}])
    reach = reach_table(claims, effects)
    assert len(reach) == 1  # the hif8-mode row has no counterpart in the paper
    # MDE 0.24 is twice the paper's 0.12: four times the seeds, 3 x 4 = 12
    assert reach.loc[0, "needed"] == 12 and reach.loc[0, "reach"].startswith("not resolvable: needs about 12 seeds")
