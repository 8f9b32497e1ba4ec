"""The claims' statistics at their edges, each against an oracle written here and sharing nothing with the code:
the crossed model's degrees of freedom and interval against the textbook two-way ANOVA with Satterthwaite's
formula in exact rational arithmetic (so tied mean squares tie exactly, as sparse 0/1 flips make them) and
against a restricted maximum likelihood fit with its own Satterthwaite df; the accuracy interval that inverts the
item test against Clopper-Pearson and brute-force enumeration; the gain-share homogeneity test against scipy's
chi-square and an enumerated conditional p; the items the item test needs against a simulation of that test."""

from __future__ import annotations

import itertools
from math import comb

import numpy as np
import pytest
from reference_stats import textbook_crossed
from scipy import stats as st

from hif8qat.stats import crossed, item_flips


def _flips(k, n, cells, value=100.0, unit_effect=None):
    """A seeds x items table of accuracy changes (points): 0 except the given (seed, item) cells."""
    y = np.zeros((k, n))
    for (i, j), v in cells.items():
        y[i, j] = v * value
    if unit_effect is not None:
        y += unit_effect[None, :]
    return y


def _random(seed, k, n, sds):
    rng = np.random.default_rng(seed)
    return (0.3 + rng.normal(0, sds[0], (k, 1)) + rng.normal(0, sds[1], (1, n)) + rng.normal(0, sds[2], (k, n)))


DESIGNS = {
    "both components": _random(1, 4, 12, (0.8, 0.9, 0.5)),
    "seed component negative": _random(2, 5, 10, (0.0, 0.9, 0.6)),
    "unit component negative": _random(3, 3, 15, (0.9, 0.0, 0.6)),
    "both negative": _random(4, 3, 9, (0.0, 0.0, 1.0)),
    # one flipped cell: the three mean squares are equal in exact arithmetic, not in floating point
    "one flip, all mean squares tied": _flips(3, 200, {(1, 7): 1}),
    "one flip on a unit effect: seed tied, unit positive": _flips(
        3, 200, {(0, 3): -1}, unit_effect=np.random.default_rng(5).normal(0, 30, 200)),
    "sparse flips, several seeds": _flips(5, 130, {(0, 1): 1, (2, 1): 1, (3, 40): -1, (4, 77): 1, (1, 77): 1}),
    "exp10 vs exp2 ARC pattern": _flips(3, 200, {(0, 2): 1, (0, 9): 1, (1, 9): 1, (2, 11): 1, (1, 20): 1,
                                                 (2, 33): 1, (0, 50): 1, (1, 61): 1, (2, 99): -1}),
}


@pytest.mark.parametrize("name", list(DESIGNS))
def test_crossed_df_and_interval_equal_the_textbook_satterthwaite_formula(name):
    y = DESIGNS[name]
    want = textbook_crossed(y)
    c = crossed.crossed_mean(y)
    assert c.df == pytest.approx(want["df"], rel=1e-9), name
    assert (c.mean, c.se, c.lo, c.hi) == pytest.approx((want["mean"], want["se"], want["lo"], want["hi"]),
                                                        rel=1e-9, abs=1e-12)
    assert (c.seed_var, c.unit_var, c.resid_var) == pytest.approx(
        (want["seed_var"], want["unit_var"], want["resid_var"]), rel=1e-9, abs=1e-12)
    # the 90 % interval too (the equivalence test's)
    w90 = textbook_crossed(y, 0.90)
    assert (c.lo90, c.hi90) == pytest.approx((w90["lo"], w90["hi"]), rel=1e-9, abs=1e-12)


def test_a_rounding_noise_component_does_not_decide_the_df():
    # MS_seed equals MS_error in exact arithmetic; in floating point one exceeds the other by about 1e-16 of
    # their size, which before counted as a seed component and gave the df of the two-df seed term
    y = DESIGNS["one flip on a unit effect: seed tied, unit positive"]
    c = crossed.crossed_mean(y)
    assert c.seed_var == 0 and c.df == pytest.approx(199)


# ------------------------------------------------------------------------ restricted maximum likelihood
def reml_fit(y):
    """REML for y = mu + seed_i + unit_j + e_ij, fitted by Fisher scoring on the dense covariance (no closed
    form used), and Satterthwaite's df for the mean from the REML expected information (as lmerTest computes it):
    df = 2 Var(mu)^2 / (grad' I^-1 grad). Components fitted at 0 are left out of the information."""
    k, n = y.shape
    yv = y.ravel()
    X = np.ones((k * n, 1))
    Zs = np.kron(np.eye(k), np.ones((n, 1)))
    Zu = np.kron(np.ones((k, 1)), np.eye(n))
    G = [Zs @ Zs.T, Zu @ Zu.T, np.eye(k * n)]

    def parts(theta):
        V = sum(t * g for t, g in zip(theta, G, strict=True))
        Vi = np.linalg.inv(V)
        XtViX = X.T @ Vi @ X
        P = Vi - Vi @ X @ np.linalg.inv(XtViX) @ X.T @ Vi
        return V, Vi, XtViX, P

    def nll(theta):
        V, _, XtViX, P = parts(theta)
        return 0.5 * (np.linalg.slogdet(V)[1] + np.linalg.slogdet(XtViX)[1] + yv @ P @ yv)

    def score_info(theta, idx):
        _, _, _, P = parts(theta)
        Py = P @ yv
        score = np.array([-0.5 * np.trace(P @ G[a]) + 0.5 * Py @ G[a] @ Py for a in idx])
        info = np.array([[0.5 * np.trace(P @ G[a] @ P @ G[b]) for b in idx] for a in idx])
        return score, info

    # Fisher scoring (the textbook REML iteration) with an active set: a component stepping below 0 is fixed at
    # 0, where the restricted likelihood must then fall as it grows (its score not positive)
    theta = np.full(3, np.var(yv) / 3)
    free = [0, 1, 2]
    for _ in range(200):
        score, info = score_info(theta, free)
        step = np.linalg.solve(info, score)
        new = theta.copy()
        new[free] += step
        if (new[free] <= 0).any():
            worst = free[int(np.argmin(new[free] / np.maximum(theta[free], 1e-300)))]
            theta[worst] = 0.0
            free = [i for i in free if i != worst]
            continue
        theta = new
        if np.max(np.abs(step) / theta[free]) < 1e-13:
            break
    fixed = [i for i in range(3) if i not in free]
    if fixed:
        assert (score_info(theta, fixed)[0] <= 1e-9 * np.abs(yv).max() ** 2).all()
    assert -nll(theta) >= -nll(np.where(theta > 0, theta * 1.001, 0.0)) - 1e-12
    _, Vi, XtViX, P = parts(theta)
    var_mu = float(np.linalg.inv(XtViX)[0, 0])
    mu = float(var_mu * (X.T @ Vi @ yv)[0])
    idx = free
    info = np.array([[0.5 * np.trace(P @ G[a] @ P @ G[b]) for b in idx] for a in idx])
    grad = np.array([var_mu ** 2 * float((X.T @ Vi @ G[a] @ Vi @ X)[0, 0]) for a in idx])
    df = 2 * var_mu ** 2 / float(grad @ np.linalg.solve(info, grad))
    return {"mean": mu, "se": var_mu ** 0.5, "df": df, "theta": theta, "reml": -nll(theta)}


@pytest.mark.parametrize("name", ["both components", "one flip on a unit effect: seed tied, unit positive"])
def test_crossed_model_equals_exact_reml_and_its_satterthwaite_df_in_balanced_designs(name):
    # balanced and in the interior (or with a component at 0 whose sum of squares pools to the same residual):
    # REML and the moments agree exactly, and so do the two ways to Satterthwaite's df
    y = DESIGNS[name]
    y = y[:, :20]  # the dense fit stays small; one flip on unit effects keeps MS_seed = MS_error at any width
    c = crossed.crossed_mean(y)
    r = reml_fit(y)
    assert (c.seed_var, c.unit_var, c.resid_var) == pytest.approx(tuple(r["theta"]), rel=1e-7, abs=1e-9)
    assert c.mean == pytest.approx(r["mean"], rel=1e-9, abs=1e-12)
    assert c.se == pytest.approx(r["se"], rel=1e-7)
    assert c.df == pytest.approx(r["df"], rel=1e-6)


# ------------------------------------------------------------------ the interval that inverts the item test
def _enumerated_tails(mags, s_obs, theta):
    """P(S >= s_obs), P(S <= s_obs) over all 2^m sign assignments, S the magnitudes signed +."""
    up = down = 0.0
    for signs in itertools.product((0, 1), repeat=len(mags)):
        s = sum(m for m, g in zip(mags, signs, strict=True) if g)
        pr = np.prod([theta if g else 1 - theta for g in signs])
        up += pr * (s >= s_obs)
        down += pr * (s <= s_obs)
    return up, down


@pytest.mark.parametrize("lost,gained,n", [(0, 4, 130), (1, 6, 200), (3, 11, 171), (2, 2, 130), (0, 1, 200)])
def test_at_one_seed_the_item_interval_is_clopper_pearson(lost, gained, n):
    net = [-1] * lost + [1] * gained
    ci = st.binomtest(gained, lost + gained).proportion_ci(0.95, method="exact")
    lo, hi = item_flips.item_test_interval(net, n, 1)
    m = lost + gained
    assert (lo, hi) == pytest.approx(((2 * ci.low - 1) * m / n, (2 * ci.high - 1) * m / n), abs=1e-9)


@pytest.mark.parametrize("net,k", [([4, 1, -1], 5), ([2, 2], 5), ([1, 1, 1, 1], 3), ([3, -2, 1, 1, -1], 3),
                                   ([5, 5, -1], 5)])
def test_the_item_interval_inverts_the_enumerated_item_test(net, k):
    n = 130
    lo, hi = item_flips.item_test_interval(net, n, k)
    mags = [abs(x) for x in net]
    total = sum(mags)
    s_obs = sum(x for x in net if x > 0)

    def theta_of(d):
        return (d * k * n / total + 1) / 2

    # each bound is where one enumerated tail reaches 2.5 %; just inside, the tail is above; just outside, below
    for bound, tail in ((lo, 0), (hi, 1)):
        t = theta_of(bound)
        if 0 < t < 1:
            assert _enumerated_tails(mags, s_obs, t)[tail] == pytest.approx(0.025, abs=1e-6)


def test_the_item_interval_and_the_item_test_never_disagree():
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(1, 6))
        m = int(rng.integers(1, 12))
        net = rng.integers(1, k + 1, m) * rng.choice([-1, 1], m, p=[0.25, 0.75])
        lo, hi = item_flips.item_test_interval(net, 150, k)
        p = item_flips.item_permutation_test(net)[2]
        assert (p < 0.05) == (lo > 0 or hi < 0), (list(net), k, p, lo, hi)


# --------------------------------------------------------------------------------- gain share homogeneity
def test_gain_share_homogeneity_is_the_chi_square_of_seeds_by_lost_gained():
    lost, gained = [1, 4, 0, 2], [5, 1, 0, 3]
    chi2, dof, p = item_flips.gain_share_homogeneity(lost, gained, n_sim=20_000)
    table = np.array([[1, 4, 2], [5, 1, 3]])  # the seed without a flip carries no share
    ref = st.chi2_contingency(table, correction=False)
    assert chi2 == pytest.approx(ref.statistic) and dof == ref.dof == 2
    # the p conditional on the margins, enumerated: gains per seed hypergeometric given the totals
    m, G = table.sum(0), table[1].sum()
    e = m * G / m.sum()
    exact = 0.0
    for g in itertools.product(*(range(x + 1) for x in m)):
        if sum(g) != G:
            continue
        pr = np.prod([comb(int(x), int(gi)) for x, gi in zip(m, g, strict=True)]) / comb(int(m.sum()), int(G))
        stat = sum((gi - ei) ** 2 * (1 / ei + 1 / (x - ei)) for gi, ei, x in zip(g, e, m, strict=True))
        exact += pr * (stat >= chi2 - 1e-9)
    assert p == pytest.approx(exact, abs=0.01)


def test_gain_share_homogeneity_has_nothing_to_compare_with_flips_one_way():
    chi2, dof, p = item_flips.gain_share_homogeneity([0, 0, 0], [2, 1, 1])
    assert dof == 0 and np.isnan(chi2) and np.isnan(p)


def test_a_shift_shared_by_one_seeds_items_shows_in_the_homogeneity_test():
    # seed 0 loses what seed 1 gains: no effect overall, and the item test's independence does not hold
    chi2, dof, p = item_flips.gain_share_homogeneity([18, 2, 10], [2, 18, 10])
    assert dof == 2 and p < 0.001


# ------------------------------------------------------------------------------- items needed, flip model
def test_items_needed_under_the_flip_model_without_chance_flips():
    # no item changes by chance: the effect's items lose in every seed, and the test needs 6 of them one way
    # (two-sided p = 2 / 2^6 < 0.05 > 2 / 2^5); an effect of 1 % of the items reaches 6 items at 550 items
    n = item_flips.items_needed_flip_model(0.01, 200, {}, 3)
    assert round(0.01 * n) == 6 and round(0.01 * (n - 1)) == 5


def test_items_needed_reaches_the_power_in_a_simulation_of_the_item_test():
    k, effect, sizes, n0 = 3, 0.02, {1: 6, 2: 2}, 200
    n = int(item_flips.items_needed_flip_model(effect, n0, sizes, k))
    rng = np.random.default_rng(1)

    def simulated_power(n_items, reps=400):
        null = np.concatenate([np.full(round(c * n_items / n0), w) for w, c in sizes.items()])
        a = round(effect * n_items)
        hits = 0
        for _ in range(reps):
            net = np.concatenate([null * rng.choice([-1, 1], len(null)), np.full(a, -k)])
            hits += item_flips.item_permutation_test(net)[2] < 0.05
        return hits / reps

    assert simulated_power(n) >= 0.8 - 0.05
    assert simulated_power(int(n * 0.6)) < 0.8


# ------------------------------------------------------------------------------------ a claims row, end to end
def _accuracy_contrasts(k, n, cells, base=0.4):
    """seed_contrasts-like accuracy rows of one claim: seeds x items flips (+1 gained, -1 lost) as given."""
    import pandas as pd

    rows = []
    for seed in range(k):
        flips = np.zeros(n)
        for (i, j), v in cells.items():
            if i == seed:
                flips[j] = v
        rows.append({"experiment": "exp13", "run_tag": "", "against": "baseline", "counterpart": "exp1",
                     "mode": "bf16", "task": "hellaswag", "metric": "accuracy", "seed": seed, "n": n,
                     "recorded": True, "diff": flips.mean() * 100, "var": np.nan, "within_df": np.inf,
                     "base": base * 100, "lost": int((flips < 0).sum()), "gained": int((flips > 0).sum()),
                     "units": pd.Series(flips * 100, index=[str(i) for i in range(n)]), "dirty": False,
                     "run": f"exp13/seed{seed}", "counterpart_run": f"exp1/seed{seed}"})
    return pd.DataFrame(rows)


def test_an_accuracy_row_with_few_flips_has_an_interval_that_agrees_with_its_test():
    from hif8qat.report.claims import claims_table

    # four items gained, each in one seed: the item test's p is 2 / 2^4 = 0.125, so the interval holds 0 (the
    # crossed t interval alone excluded it)
    c = _accuracy_contrasts(3, 130, {(0, 5): 1, (1, 9): 1, (2, 17): 1, (2, 60): 1})
    row = claims_table(c, n_boot=10).iloc[0]
    assert row["p"] == pytest.approx(0.125)
    assert row["ci_lo"] < 0 < row["ci_hi"] and "exact" in row["ci_method"]
    t = crossed.crossed_mean(np.stack([u.to_numpy() for u in c["units"]]))
    assert t.lo > 0  # what the interval was before: gains only, yet a test that finds nothing
    assert row["homog_df"] == 0  # flips one way: no share to compare
    assert row["changed_by_size"] == "1:4"
