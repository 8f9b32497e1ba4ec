"""The claims' one model per paired metric (hif8qat.stats.paired): seeds x items (windows) as crossed random effects,
t on per-seed means for the training loss, the exact permutation test over items for accuracy and its MDE
under a stated flip model, each against an independent oracle (a REML mixed model from statsmodels, scipy's
t and permutation tests, brute-force enumeration) or a coverage simulation."""

from __future__ import annotations

import hashlib
import itertools
import json
import math

import numpy as np
import pandas as pd
import pytest
from reference_stats import textbook_crossed
from scipy import stats as st

from hif8qat.stats import crossed, item_flips
from hif8qat.stats import paired as stats


def _crossed(rng, k, n, sd_seed, sd_unit, sd_resid, mean=0.0):
    return (mean + rng.normal(0, sd_seed, (k, 1)) + rng.normal(0, sd_unit, (1, n))
            + rng.normal(0, sd_resid, (k, n)))


@pytest.mark.parametrize("k,n,sds,seed", [(5, 30, (0.5, 1.0, 0.7), 5), (3, 120, (0.2, 0.6, 0.4), 6),
                                          (4, 40, (1.0, 0.3, 0.5), 7)])
def test_crossed_mean_equals_a_reml_mixed_model_with_crossed_variance_components(k, n, sds, seed):
    sm = pytest.importorskip("statsmodels.api")
    y = _crossed(np.random.default_rng(seed), k, n, *sds, mean=0.2)
    df = pd.DataFrame({"y": y.ravel(), "seed": np.repeat(np.arange(k), n), "unit": np.tile(np.arange(n), k),
                       "g": 1})
    fit = sm.MixedLM.from_formula("y ~ 1", groups="g", re_formula="0", data=df,
                                  vc_formula={"seed": "0 + C(seed)", "unit": "0 + C(unit)"}).fit(reml=True)
    c = crossed.crossed_mean(y)
    # vc_formula components in name order: seed, unit; on balanced data REML and the moments agree when positive
    assert (c.seed_var, c.unit_var, c.resid_var) == pytest.approx((*fit.vcomp, fit.scale), rel=1e-3)
    assert c.mean == pytest.approx(float(fit.fe_params.iloc[0]))
    assert c.se == pytest.approx(float(fit.bse_fe.iloc[0]), rel=1e-3)


def test_crossed_intervals_cover_the_true_difference_at_5_seeds_x_30_windows():
    rng = np.random.default_rng(11)
    reps, true = 1500, 0.3
    hit_crossed = hit_rule_before = 0
    for _ in range(reps):
        y = _crossed(rng, 5, 30, 0.3, 1.0, 1.0, mean=true)  # seed, window and seed x window effects
        c = crossed.crossed_mean(y, "windows")
        hit_crossed += c.lo <= true <= c.hi
        # the rule the report used before: max(between-seed, mean within-seed variance) / k
        p = stats.pool_seeds(y.mean(1), y.var(1, ddof=1) / 30, 5 * 29)
        hit_rule_before += p.lo <= true <= p.hi
    assert 0.93 <= hit_crossed / reps <= 0.97
    assert hit_rule_before / reps < 0.93  # the windows' shared effect was counted as fresh per seed


def test_one_seed_has_no_seed_component_and_says_so():
    y = np.random.default_rng(2).normal(size=50)
    c = crossed.crossed_mean(y, "items")
    ref = st.ttest_1samp(y, 0.0)
    ci = ref.confidence_interval(0.95)
    assert (c.lo, c.hi, c.p, c.df) == pytest.approx((ci.low, ci.high, ref.pvalue, 49))
    assert c.method.startswith("one seed") and math.isnan(c.seed_var)


def test_training_loss_uses_t_on_the_seed_means_with_k_minus_1_df_whatever_the_within_seed_variance():
    from hif8qat.report.claims import claims_table

    diffs = [0.01, 0.05, -0.02, 0.03, 0.00]
    rows = [{"experiment": "exp8", "run_tag": "", "against": "baseline", "counterpart": "exp7", "seed": s,
             "dirty": False, "mode": "train", "task": "loss", "metric": "train_loss", "n": 35, "recorded": True,
             "diff": d, "var": 0.5, "within_df": 6, "base": float("nan"), "lost": 0, "gained": 0, "units": None}
            for s, d in enumerate(diffs)]  # within-seed variance far above the between-seed one
    row = claims_table(pd.DataFrame(rows)).iloc[0]
    ref = st.ttest_1samp(diffs, 0.0)
    ci = ref.confidence_interval(0.95)
    assert (row["ci_lo"], row["ci_hi"], row["p"], row["df"]) == pytest.approx((ci.low, ci.high, ref.pvalue, 4))
    assert "4 df" in row["ci_method"]


def _brute_sign_flip_p(x):
    x = np.asarray(x, float)
    obs = abs(x.sum())
    sums = [abs(np.dot(s, x)) for s in itertools.product((-1, 1), repeat=len(x))]
    return float(np.mean(np.asarray(sums) >= obs - 1e-9))


def test_item_permutation_test_equals_scipys_exact_sign_flip_test():
    rng = np.random.default_rng(3)
    for _ in range(5):
        net = rng.integers(-3, 4, 40)  # net flips of 40 items over 3 seeds, most zero or small
        net[rng.random(40) < 0.6] = 0
        changed = net[net != 0].astype(float)
        ref = st.permutation_test((changed,), np.sum, permutation_type="samples", n_resamples=np.inf,
                                  alternative="two-sided")
        lost, gained, p = item_flips.item_permutation_test(net)
        assert (lost, gained) == ((net < 0).sum(), (net > 0).sum())
        assert p == pytest.approx(min(1.0, ref.pvalue)) and p == pytest.approx(_brute_sign_flip_p(changed))
    # one seed: every item weighs 1, the exact McNemar (binomial) test
    assert item_flips.item_permutation_test([-1] * 7 + [1] * 2)[2] == pytest.approx(st.binomtest(2, 9).pvalue)
    # an item lost in all 5 seeds is one item, not five independent flips
    assert item_flips.item_permutation_test([-5, -5, 1])[2] == pytest.approx(_brute_sign_flip_p([-5, -5, 1]))
    assert item_flips.item_permutation_test([-5, -5, 1])[2] > st.binomtest(1, 11).pvalue


def _power_by_enumeration(null, a, k, alpha=0.05):
    """P(the sign-flip test rejects) when a items lose in every one of k seeds and the null items take random
    signs, by enumerating every sign pattern."""
    hits = 0
    patterns = list(itertools.product((-1, 1), repeat=len(null)))
    for s in patterns:
        x = np.concatenate([np.multiply(s, null), -np.full(a, k)])
        hits += _brute_sign_flip_p(x) < alpha
    return hits / len(patterns)


@pytest.mark.parametrize("null,k", [([1, 1, 2], 3), ([1, 2], 5), ([1, 1, 1, 1], 1)])
def test_accuracy_mde_is_the_smallest_effect_the_item_test_detects_under_the_flip_model(null, k):
    n = 100
    a = round(item_flips.mde_item_flips(n, null, k) * n)
    assert _power_by_enumeration(null, a, k) >= 0.8 > _power_by_enumeration(null, a - 1, k)


def test_accuracy_mde_grows_with_the_flips_seen_not_capped_by_them():
    # the rule before held the discordant count fixed, so its MDE could never exceed m / n
    few = item_flips.mde_item_flips(130, [1, 1, 2], 5)
    many = item_flips.mde_item_flips(130, [1, -1] * 10 + [2, -2] * 5, 5)
    assert many > few > (1 + 1 + 2) / 130 / 5


def test_hierarchical_bootstrap_resamples_units_as_well_as_seeds():
    rng = np.random.default_rng(8)
    col = rng.normal(0, 1.0, 40)
    y = np.tile(col, (5, 1))  # only the units differ: a seeds-only bootstrap would give zero width
    lo, hi = crossed.hierarchical_bootstrap(y, n_boot=4000, seed=1)
    assert (hi - lo) == pytest.approx(2 * 1.96 * col.std(ddof=0) / math.sqrt(40), rel=0.15)
    assert all(map(math.isnan, crossed.hierarchical_bootstrap(y[:3])))  # 3 seeds: too few to resample


def test_heldout_claims_cross_seeds_with_windows_and_list_the_token_files(tmp_path):
    from test_report import make_fake_runs

    from hif8qat import report
    from hif8qat.stats import heldout as heldout_stats

    runs = make_fake_runs(tmp_path / "runs", seeds=(0, 1, 2))
    rng = np.random.default_rng(4)
    window_effect = rng.normal(0, 0.05, 16)  # the same windows in every seed
    pct, kls = [], []  # per seed, each window's NLL difference in % of the seed's baseline NLL, and mean KL
    for sd in range(3):
        d = runs / "smoke" / "exp8" / f"seed{sd}" / "eval" / "heldout"
        d.mkdir(parents=True)
        base = rng.gamma(3, 1, 16 * 8)
        bf16 = base + np.repeat(window_effect, 8) + 0.01 * sd + rng.normal(0, 0.01, base.size)
        kl, top1 = rng.gamma(1, 0.01, base.size), (rng.random(base.size) < 0.9).astype(int)
        pd.DataFrame({"window": np.repeat(np.arange(16), 8), "pos": np.tile(np.arange(8), 16),
                      "nll_baseline": base, "nll_bf16": bf16, "kl_bf16_vs_baseline": kl,
                      "top1_bf16_vs_baseline": top1}).to_csv(d / "tokens.csv.gz", index=False)
        kls.append(kl.reshape(16, 8).mean(1))
        pct.append((bf16 - base).reshape(16, 8).mean(1) * 100 / base.mean())
        s = heldout_stats.comparison_summary(base, bf16, kl, top1, 8)
        (d / "summary.json").write_text(json.dumps({
            "baseline_run": f"exp7/seed{sd}", "tokens_file": "tokens.csv.gz",
            "tokens_sha256": hashlib.sha256((d / "tokens.csv.gz").read_bytes()).hexdigest(),
            "comparisons": {"bf16_vs_baseline": {"reference": "baseline", "other": "bf16", "summary": s}}}))
    rep = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100, figures=False)
    row = rep["tables"]["heldout_smoke"].iloc[0]
    assert row["n_seeds"] == 3 and "16 windows crossed" in row["ci_method"]
    assert row["cost"] == pytest.approx(np.mean(pct), rel=1e-5)
    # the mean KL's interval: the textbook crossed model written in the tests on each window's mean KL, read
    # from the token files (the window means here come from the generated columns, not from those files)
    kl_ref = textbook_crossed(np.array(kls))
    assert (row["kl_ci_lo"], row["kl_ci_hi"]) == pytest.approx((kl_ref["lo"], kl_ref["hi"]), rel=1e-5)
    assert row["top1_ci_lo"] < row["top1_agreement"] < row["top1_ci_hi"]
    # a shared window effect: far fewer degrees of freedom than 3 seeds x 15 windows, and wider than each
    # seed's own window interval divided by the seeds (the rule before)
    nll_ref = textbook_crossed(np.array(pct))
    assert row["df"] == pytest.approx(nll_ref["df"], rel=1e-6) and row["df"] < 3 * 15
    assert (row["ci_lo"], row["ci_hi"]) == pytest.approx((nll_ref["lo"], nll_ref["hi"]), rel=1e-5)
    assert row["ci_hi"] - row["ci_lo"] > 2 * 1.96 * np.sqrt(np.mean([np.var(p, ddof=1) / 16 for p in pct]) / 3)
    src = json.loads((tmp_path / "t" / "heldout_smoke.sources.json").read_text())
    listed = {f["path"] for f in src["files"]}
    for sd in range(3):
        for name in ("summary.json", "tokens.csv.gz"):
            assert str(runs / "smoke" / "exp8" / f"seed{sd}" / "eval" / "heldout" / name) in listed
    assert "units" not in pd.read_csv(tmp_path / "t" / "paired_smoke.csv").columns
