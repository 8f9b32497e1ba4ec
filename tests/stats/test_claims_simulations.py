"""Simulations of the claims' intervals and checks where the simple models break: a one-seed claim whose seed
variance dwarfs its items', an accuracy claim whose seeds share a training-noise shift, and the homogeneity
check summed over sparse tables. Each also measures the rule the report used before, which fails there."""

from __future__ import annotations

import numpy as np
from scipy import stats as st

from hif8qat.report.claims import accuracy_interval_and_test, seed_variance_donors
from hif8qat.stats import crossed, item_flips


def _crossed(rng, k, n, sd_seed, sd_unit, sd_resid, mean=0.0):
    return (mean + rng.normal(0, sd_seed, (k, 1)) + rng.normal(0, sd_unit, (1, n))
            + rng.normal(0, sd_resid, (k, n)))


def test_one_seed_interval_with_a_borrowed_seed_variance_covers_when_seeds_dominate():
    """One seed x 100 items, its seed variance 4x the items' share of the mean's variance; two multi-seed
    claims of the same kind (5 and 3 seeds) lend theirs. The items-only interval the report gave one seed covers
    about 62 %; the borrowed one must hold 95 % within simulation noise."""
    rng = np.random.default_rng(49)
    n, sd_unit, sd_resid, true = 100, 1.0, 1.0, 0.1
    sd_seed = np.sqrt(4 * (sd_unit**2 + sd_resid**2) / n)
    reps, hit, hit_before = 2000, 0, 0
    kind = ("baseline", "bf16", "arc_challenge", "gold_ll")
    for _ in range(reps):
        donors = {(f"exp{i}", "", kind[0], "exp1", *kind[1:]): crossed.crossed_mean(
            _crossed(rng, k, n, sd_seed, sd_unit, sd_resid), "items") for i, k in ((3, 5), (6, 3))}
        var, df, n_claims = seed_variance_donors(donors)[kind]
        one = crossed.crossed_mean(_crossed(rng, 1, n, sd_seed, sd_unit, sd_resid, true), "items")
        hit_before += one.lo <= true <= one.hi
        c = crossed.with_seed_variance(one, var, df)
        hit += c.lo <= true <= c.hi
    assert n_claims == 2 and df == 4  # the largest donor's df, not the sum: the donors may share runs
    assert hit_before / reps < 0.7
    assert hit / reps >= 0.93


def _shifted_flips(rng, reps, k, n, q, shift_sd):
    """reps x k x n paired accuracy differences in points: each item changes in a seed with probability q, for
    the better with probability 1/2 + the seed's shift (normal, sd ``shift_sd``, the same for all its items)."""
    theta = np.clip(0.5 + rng.normal(0, shift_sd, (reps, k, 1)), 0.02, 0.98)
    changed = rng.random((reps, k, n)) < q
    up = rng.random((reps, k, n)) < theta
    return np.where(changed, np.where(up, 100.0, -100.0), 0.0)


def _rule_before(c, net, n, k, p_item):
    """The report's accuracy interval before: the crossed t interval, widened to the exact item interval where
    fewer than 25 items changed, or replaced by it where the t interval contradicted the item test."""
    changed = int((net != 0).sum())
    if not (p_item < 0.05) != (c.lo > 0 or c.hi < 0) and changed >= 25:
        return c.lo, c.hi
    e = tuple(v * 100 for v in item_flips.item_test_interval(net, n, k))
    hull = (min(c.lo, e[0]), max(c.hi, e[1]))
    if (p_item < 0.05) == (hull[0] > 0 or hull[1] < 0):
        return hull
    return e


def test_accuracy_interval_covers_under_a_per_seed_shift_twice_the_noise():
    """5 seeds x 150 items, each item changing in a seed with probability 0.1; every seed's items share a shift
    of their gain share whose spread of the per-seed accuracy difference is twice the spread from the items'
    own noise, the true difference 0. The item test's independence fails; the interval must still cover."""
    rng = np.random.default_rng(7)
    reps, k, n, q = 300, 5, 150, 0.1
    noise_sd = np.sqrt(q / n)  # sd of one seed's mean difference (a proportion) from the items alone
    shift_sd = 2 * noise_sd / (2 * q)  # the shift's sd of that mean: 2 q shift_sd = twice noise_sd
    y_all = _shifted_flips(rng, reps, k, n, q, shift_sd)
    hit = hit_before = 0
    for y in y_all:
        c = crossed.crossed_mean(y, "items")
        net = y.sum(0) / 100.0
        lost, gained = (y < 0).sum(1), (y > 0).sum(1)
        homog_p = item_flips.gain_share_homogeneity(lost, gained, n_sim=999)[2]
        lo, hi, *_ = accuracy_interval_and_test(c, net, n, k, homog_p)
        hit += lo <= 0 <= hi
        lo_b, hi_b = _rule_before(c, net, n, k, item_flips.item_permutation_test(net)[2])
        hit_before += lo_b <= 0 <= hi_b
    assert hit_before / reps < 0.92
    assert hit / reps >= 0.94


def test_summed_homogeneity_p_is_valid_over_sparse_tables():
    """Thirty accuracy rows of 5 seeds with about one flip per seed and no shift: the summed chi-square's p
    from the rows' joint conditional null rejects at its level; the chi-square law the report used before
    rejects far more often (a sparse table's statistic has a mean above its df)."""
    rng = np.random.default_rng(3)
    reps, rows, k = 300, 30, 5
    rej = rej_before = 0
    for _ in range(reps):
        tables = []
        for _ in range(rows):
            m = rng.poisson(1.0, k)
            g = rng.binomial(m, 0.5)
            tables.append((m - g, g))
        chi2, dof, p, used = item_flips.joint_gain_share_homogeneity(tables, n_sim=499,
                                                                     seed=int(rng.integers(1 << 30)))
        if not used:
            continue
        rej += p < 0.05
        rej_before += st.chi2.sf(chi2, dof) < 0.05
    assert rej / reps <= 0.08  # 0.05 and two standard errors of 300 replicates
    assert rej_before / reps > 0.15
