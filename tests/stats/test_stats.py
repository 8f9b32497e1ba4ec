"""stats/paired.py against hand-worked values and scipy computations written out here, never the module's helpers."""

import math

import numpy as np
import pytest
from scipy import stats as st

from hif8qat.stats import paired as stats


def test_exact_mcnemar_needs_six_one_way_flips():
    # two-sided: 2 * 0.5**5 = 0.0625 is not below 0.05, 2 * 0.5**6 = 0.03125 is
    assert stats.min_one_way_flips(0.05) == 6
    assert stats.exact_mcnemar_p(4, 0) == pytest.approx(0.125)  # "CI excludes 0" on 4 flips is not significant
    assert stats.exact_mcnemar_p(6, 0) == pytest.approx(0.03125)
    assert stats.exact_mcnemar_p(0, 0) == 1.0


@pytest.mark.parametrize("lost,gained", [(7, 3), (3, 7), (1, 12), (20, 35), (10, 10), (0, 1), (5, 6)])
def test_exact_mcnemar_uses_both_counts(lost, gained):
    # two-sided exact binomial test of the discordant items at 1/2: twice the smaller tail, written out here,
    # and scipy's binomtest; symmetric in which way the flips went
    m, k = lost + gained, min(lost, gained)
    by_hand = min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2**m)
    got = stats.exact_mcnemar_p(lost, gained)
    assert got == pytest.approx(by_hand, rel=1e-9)
    assert got == pytest.approx(st.binomtest(lost, m, 0.5).pvalue, rel=1e-9)
    assert got == stats.exact_mcnemar_p(gained, lost)


def test_mde_under_the_exact_test():
    # 6 discordant items of 100: only 0 or 6 one way reject (5 of 6: p = 2 * 7/64 = 0.22), so the power at a
    # one-way share theta is theta**6; 80 % power at theta = 0.8**(1/6), a difference of (2 theta - 1) * 6/100
    theta = 0.8 ** (1 / 6)
    assert stats.mde_exact_mcnemar(100, 6) == pytest.approx((2 * theta - 1) * 6 / 100, rel=1e-6)
    assert math.isnan(stats.mde_exact_mcnemar(100, 5))  # five flips can never be significant
    # more discordant items at the same item count: a larger difference is needed (more noise)
    assert stats.mde_exact_mcnemar(100, 40) > stats.mde_exact_mcnemar(100, 20)
    # 40 discordant of 1000: rejection region from scipy's exact test, power summed from the binomial
    n, m = 1000, 40
    reject = [c for c in range(m + 1) if st.binomtest(c, m, 0.5).pvalue < 0.05 and c > m / 2]
    d = stats.mde_exact_mcnemar(n, m)
    theta = (1 + d * n / m) / 2
    assert sum(st.binom.pmf(c, m, theta) for c in reject) == pytest.approx(0.8, abs=1e-6)


def test_exact_difference_interval():
    # 4 of 4 discordant items gained, 100 items: Clopper-Pearson lower bound 0.025**(1/4), upper 1
    lo, hi = stats.exact_difference_ci(0, 4, 100)
    assert lo == pytest.approx((2 * 0.025 ** 0.25 - 1) * 4 / 100) and hi == pytest.approx(4 / 100)
    # 4 flips one way: the exact interval contains 0, as the exact test does not reject (p = 0.125)
    assert lo < 0 < hi
    assert stats.exact_difference_ci(0, 0, 50) == (0.0, 0.0)


@pytest.mark.parametrize("lost,gained,n,conf", [(3, 7, 200, 0.95), (7, 3, 200, 0.95), (12, 30, 500, 0.95),
                                                (5, 0, 50, 0.90), (1, 1, 10, 0.99)])
def test_exact_difference_interval_with_flips_both_ways(lost, gained, n, conf):
    # Clopper-Pearson from beta quantiles (x gained of m discordant), mapped to (gained - lost) / n
    m, a = lost + gained, 1 - conf
    p_lo = 0.0 if gained == 0 else st.beta.ppf(a / 2, gained, m - gained + 1)
    p_hi = 1.0 if gained == m else st.beta.ppf(1 - a / 2, gained + 1, m - gained)
    lo, hi = stats.exact_difference_ci(lost, gained, n, conf=conf)
    assert (lo, hi) == pytest.approx(((2 * p_lo - 1) * m / n, (2 * p_hi - 1) * m / n), rel=1e-7, abs=1e-12)
    assert lo <= (gained - lost) / n <= hi
    # swapping the two counts mirrors the interval around 0
    lo_s, hi_s = stats.exact_difference_ci(gained, lost, n, conf=conf)
    assert (lo_s, hi_s) == pytest.approx((-hi, -lo), rel=1e-7, abs=1e-12)


def test_item_pair_counts_and_variance():
    base = np.array([1, 1, 1, 0, 0, 1, 0, 1])
    run = np.array([1, 0, 0, 1, 0, 1, 0, 1])
    ip = stats.item_pair(base, run)
    assert (ip.n, ip.lost, ip.gained) == (8, 2, 1)
    d = run - base  # per-item differences: -1, -1, +1 and zeros
    assert ip.diff == pytest.approx(d.mean()) and ip.var == pytest.approx(d.var(ddof=1) / 8)
    # no discordant item: one is assumed, so the variance is never 0
    same = stats.item_pair(base, base)
    assert same.diff == 0 and same.var == pytest.approx((1 / 8) * 8 / 7 / 8)


def test_pool_seeds_between_and_within():
    # between-seed spread dominates: var = s^2 / k with s^2 = 1, t with 2 degrees of freedom (t_.975 = 4.302653)
    p = stats.pool_seeds([1.0, 2.0, 3.0], [0.1, 0.1, 0.1])
    assert p.mean == 2.0 and p.se == pytest.approx(math.sqrt(1 / 3)) and p.df == 2
    assert p.hi - p.mean == pytest.approx(4.302653 * math.sqrt(1 / 3), rel=1e-6)
    assert p.hi90 - p.mean == pytest.approx(2.919986 * math.sqrt(1 / 3), rel=1e-6)
    # within-seed variance dominates (seeds agree more than their items allow): var = mean(v) / k, normal
    p = stats.pool_seeds([1.0, 1.1], [1.0, 1.0])
    assert p.se == pytest.approx(math.sqrt(0.5)) and math.isinf(p.df)
    assert p.hi - p.mean == pytest.approx(1.959964 * math.sqrt(0.5), rel=1e-6)
    # one seed: its within-seed variance alone, with the given degrees of freedom
    p = stats.pool_seeds([0.5], [0.04], within_df=6)
    assert p.se == pytest.approx(0.2) and p.df == 6
    assert p.p == pytest.approx(2 * (1 - st.t.cdf(0.5 / 0.2, 6)))


def test_equivalence_verdicts_never_say_no_effect():
    assert stats.equivalence_verdict(-0.4, 0.3, 1.0, " %") == "equivalent within 1 %"
    assert stats.equivalence_verdict(1.2, 3.0, 1.0) == "not equivalent"
    assert stats.equivalence_verdict(-3.0, -1.5, 1.0) == "not equivalent"
    assert stats.equivalence_verdict(-0.5, 2.0, 1.0) == "inconclusive at this size"
    assert stats.equivalence_verdict(float("nan"), 0.1, 1.0) == "inconclusive at this size"


def test_mde_from_se_and_block_variance():
    # (z_.975 + z_.8) * se = (1.959964 + 0.841621) * 0.1
    assert stats.mde_from_se(0.1, math.inf) == pytest.approx(0.2801585, rel=1e-6)
    x = np.arange(20, dtype=float)  # blocks of 5: means 2, 7, 12, 17; var 41.667 / 4 blocks
    assert stats.block_variance_of_mean(x, 5) == pytest.approx(np.var([2, 7, 12, 17], ddof=1) / 4)
    assert math.isnan(stats.block_variance_of_mean(x[:9], 5))
