"""The item-level flip model of the accuracy claims: an exact sign-flip test over items of their net flips summed
over seeds, the interval inverted from it, its power and minimum detectable effect, and the homogeneity check of
its assumption (items' net flips independent: no training-noise shift shared by one seed's items).

Split from :mod:`hif8qat.stats.paired` (the crossed and per-seed models) by job: everything here works on integer
item counts by exact enumeration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def _sign_flip_dist(mags: Sequence[int]) -> np.ndarray:
    """P(the +-signed sum of integer ``mags`` = 2s - sum(mags)) for s = 0..sum(mags), every sign equally likely."""
    total = int(np.sum(mags))
    dist = np.zeros(total + 1)
    dist[0] = 1.0
    for m in mags:
        m = int(m)
        shifted = np.zeros_like(dist)
        shifted[m:] = dist[: total + 1 - m]
        dist = 0.5 * (dist + shifted)
    return dist


def item_permutation_test(net: Sequence[float]) -> tuple[int, int, float]:
    """Exact permutation (sign-flip) test over items of their net change summed over seeds, in answers: under no
    effect each item's net change is as likely negative as positive, so the statistic sum(net) is referred to all
    2^m sign assignments of the m items that changed (their exact distribution, built by convolution). An item
    that flips the same way in every seed counts once, with its weight; at one seed this is the exact McNemar
    test.

    Args:
        net: per item, its net change over the seeds (gains minus losses).

    Returns:
        ``(items net lost, items net gained, two-sided p)``; p = 1.0 when no item changed."""
    a = np.rint(np.asarray(net, float)).astype(np.int64)
    a = a[a != 0]
    lost, gained = int((a < 0).sum()), int((a > 0).sum())
    if not len(a):
        return lost, gained, 1.0
    dist = _sign_flip_dist(np.abs(a))
    total = len(dist) - 1
    stat = 2 * np.arange(total + 1) - total
    return lost, gained, min(1.0, float(dist[np.abs(stat) >= abs(int(a.sum()))].sum()))


def mde_item_flips(n_items: int, net: Sequence[float], k: int, *, alpha: float = 0.05, power: float = 0.8
                   ) -> float:
    """Smallest accuracy difference (a proportion of the items) the item permutation test detects with ``power``
    under a stated flip model: an effect of a items makes a further a items lose in every one of the k seeds
    (net change -k each), on top of the items whose net change here is not zero, which keep their sizes and
    take either sign with probability 1/2. Exact: the test's rejection region for those m + a items, and the
    probability that the null items' signed sum plus the effect's -a k falls in it.

    Args:
        n_items: items per seed.
        net: per item, its net change over the seeds.
        k: seeds.
        alpha: the test's two-sided level.
        power: the power to reach.

    Returns:
        a / n_items for the smallest a that reaches ``power``; NaN when none up to n_items - m does."""
    a0 = np.rint(np.asarray(net, float)).astype(np.int64)
    null = np.abs(a0[a0 != 0])
    if n_items <= 0 or k <= 0:
        return float("nan")
    null_dist = _sign_flip_dist(null)
    t_null = 2 * np.arange(len(null_dist)) - int(null.sum())
    for a in range(1, int(n_items) - len(null) + 1):
        dist = _sign_flip_dist(np.concatenate([null, np.full(a, int(k))]))
        total = len(dist) - 1
        stat = 2 * np.arange(total + 1) - total
        absstat = np.abs(stat)
        # P(|T| >= |t|) for each t, from the distribution sorted by |T|
        sorted_abs = np.sort(absstat)
        cum = np.cumsum(dist[np.argsort(absstat, kind="stable")][::-1])[::-1]
        p_of = {int(v): float(cum[np.searchsorted(sorted_abs, v, side="left")]) for v in np.unique(absstat)}
        t = np.abs(t_null - a * int(k))
        hit = np.array([p_of.get(int(v), 1.0) < alpha for v in t])
        if float(null_dist[hit].sum()) >= power:
            return a / n_items
    return float("nan")


# ------------------------------------------------- the item test's interval, its assumption, its reach
def _binom_pmf(c: int, theta: float) -> np.ndarray:
    """Binomial(c, theta) probabilities of 0..c (the ufuncs directly: scipy.stats' pmf costs far more per call
    and the interval's bisection calls it thousands of times)."""
    from scipy.special import gammaln
    j = np.arange(c + 1)
    if theta <= 0.0 or theta >= 1.0:
        return (j == (c if theta >= 1.0 else 0)).astype(float)
    return np.exp(gammaln(c + 1) - gammaln(j + 1) - gammaln(c - j + 1) + j * math.log(theta)
                  + (c - j) * math.log1p(-theta))


def _signed_sum_dist(mags: Sequence[int], theta: float = 0.5) -> np.ndarray:
    """P(S = s) for s = 0..sum(mags), S the summed magnitude of the items signed +, each item + with probability
    ``theta`` independently (the signed sum is T = 2S - sum(mags)). Items of one magnitude w form a binomial on
    a lattice of step w, so the work grows with the distinct magnitudes (at most the seeds), not the items."""
    from scipy.signal import fftconvolve
    a = np.asarray(mags, np.int64)
    a = a[a > 0]
    dist = np.ones(1)
    for w, c in zip(*np.unique(a, return_counts=True), strict=True):
        kernel = np.zeros(int(c) * int(w) + 1)
        kernel[:: int(w)] = _binom_pmf(int(c), theta)
        if len(dist) * len(kernel) > 4_000_000:  # large samples (items needed): FFT, rounding far below alpha
            dist = np.clip(fftconvolve(dist, kernel), 0.0, None)
        else:
            dist = np.convolve(dist, kernel)
    return dist


def item_test_interval(net: Sequence[float], n_items: int, k: int, conf: float = 0.95) -> tuple[float, float]:
    """Interval of the accuracy difference (a proportion, per item and seed) that inverts the exact item test
    (:func:`item_permutation_test`), so that the two cannot disagree: it excludes 0 exactly when that test's p is
    below ``1 - conf``.

    Conditional on the items that changed and the size of each one's net change over the seeds (as the test
    is), an effect is a share ``theta`` of them changing for the better, each independently; the interval holds
    every theta that the two one-sided tests of the signed sum do not reject at ``(1 - conf) / 2`` each (at
    theta = 1/2 their doubled smaller tail is the test's two-sided p, the null being symmetric), mapped to
    ``(2 theta - 1) * sum(|net|) / (k * n_items)``. At one seed this is the Clopper-Pearson interval of the
    exact McNemar test.

    Args:
        net: per item, its net change over the seeds.
        n_items: items per seed.
        k: seeds.
        conf: confidence level.

    Returns:
        ``(lo, hi)``; (0, 0) when no item changed, NaN when n_items or k is not positive. Its bounds cannot pass the
        changed items' total."""
    a = np.rint(np.asarray(net, float)).astype(np.int64)
    a = a[a != 0]
    if n_items <= 0 or k <= 0:
        return float("nan"), float("nan")
    if not len(a):
        return 0.0, 0.0
    mags = np.abs(a)
    total = int(mags.sum())
    s_obs = (int(a.sum()) + total) // 2  # the observed summed magnitude of the items that gained
    half = (1 - conf) / 2

    def upper_tail(theta):  # P(S >= s_obs), increasing in theta
        return float(_signed_sum_dist(mags, theta)[s_obs:].sum())

    def lower_tail(theta):  # P(S <= s_obs), decreasing in theta
        return float(_signed_sum_dist(mags, theta)[: s_obs + 1].sum())

    def bisect(f, want_above):  # the theta in [0, 1] where the monotone f crosses ``half``
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            if (f(mid) >= half) == want_above:
                hi = mid
            else:
                lo = mid
        return lo, hi

    theta_lo = 0.0 if s_obs == 0 else bisect(upper_tail, True)[1]
    theta_hi = 1.0 if s_obs == total else bisect(lower_tail, False)[0]
    scale = total / (k * n_items)
    return (2 * theta_lo - 1) * scale, (2 * theta_hi - 1) * scale


def gain_share_homogeneity(lost: Sequence[int], gained: Sequence[int], *, n_sim: int = 9999, seed: int = 0
                           ) -> tuple[float, int, float]:
    """Whether the seeds share one share of gains among their flips: the chi-square statistic of the seeds x
    (lost, gained) table, its df and a p-value conditional on the table's margins (Monte Carlo over the
    multivariate hypergeometric law, as the counts are small for the chi-square law).

    The item test is exact only if the items' net flips are independent; a training-noise shift shared by the
    items of one seed would tilt that seed's flips one way and another seed's the other, which this detects.

    Args:
        lost: per seed, items lost.
        gained: per seed, items gained.
        n_sim: Monte Carlo draws.
        seed: random seed of the draws.

    Returns:
        ``(chi-square, df, p)``; (nan, 0, nan) when there is nothing to compare (fewer than two seeds with a flip, or
        flips all one way)."""
    L, G = np.asarray(lost, np.int64), np.asarray(gained, np.int64)
    keep = (L + G) > 0
    L, G = L[keep], G[keep]
    if len(L) < 2 or L.sum() == 0 or G.sum() == 0:
        return float("nan"), 0, float("nan")
    m = L + G
    M, g_tot = int(m.sum()), int(G.sum())
    e = m * g_tot / M  # expected gains per seed

    def chi2(g):
        return ((g - e) ** 2 * (1 / e + 1 / (m - e))).sum(-1)

    obs = float(chi2(G))
    sims = np.random.default_rng(seed).multivariate_hypergeometric(m, g_tot, size=n_sim)
    p = (1 + int((chi2(sims) >= obs - 1e-9 * max(obs, 1.0)).sum())) / (n_sim + 1)
    return obs, len(L) - 1, float(p)


def item_test_power(null_mags: Sequence[int], effect_items: int, k: int, alpha: float = 0.05) -> float:
    """Power of the item test under the flip model of :func:`mde_item_flips`: ``effect_items`` items lose in
    every one of the k seeds (net -k each) besides the null items, whose signs are fair coins. The test refers the
    signed sum to all sign assignments of every changed item.

    Args:
        null_mags: net sizes of the null items (zeros are ignored).
        effect_items: items the effect moves.
        k: seeds.
        alpha: the test's two-sided level.

    Returns:
        The probability that the test rejects."""
    null = np.asarray(null_mags, np.int64)
    null = null[null > 0]
    a = int(effect_items)
    test = _signed_sum_dist(np.concatenate([null, np.full(a, int(k), np.int64)]))
    w_test = len(test) - 1
    absstat = np.abs(2 * np.arange(w_test + 1) - w_test)
    # the smallest |T| the test rejects: p(|t|) = P(|T| >= |t|) falls as |t| grows
    order = np.argsort(-absstat, kind="stable")
    tail = np.cumsum(test[order])
    vals = absstat[order]
    p_at = {}
    for v, pv in zip(vals, tail, strict=True):
        p_at[int(v)] = float(pv)  # the last write per value holds the tail up to and including it
    rejected = [v for v, pv in p_at.items() if pv < alpha]
    if not rejected:
        return 0.0
    crit = min(rejected)
    dist = _signed_sum_dist(null)
    t_null = 2 * np.arange(len(dist)) - (len(dist) - 1) - a * int(k)
    return float(dist[np.abs(t_null) >= crit].sum())


def items_needed_flip_model(effect: float, n_items: int, sizes: Mapping[int, int], k: int, *, alpha: float = 0.05,
                            power: float = 0.8, max_items: int = 10_000_000) -> float:
    """Items the item test needs to detect an accuracy difference ``effect`` with ``power``, under the flip
    model of :func:`mde_item_flips`: at N items, ``effect * N`` items lose in every one of the k seeds, and the items
    that change by chance keep the rate and sizes seen here, scaled to N.

    Args:
        effect: the difference to detect, a proportion of the items per seed.
        n_items: items measured here.
        sizes: |net change over the seeds| -> count among ``n_items``.
        k: seeds.
        alpha: the test's two-sided level.
        power: the power to reach.
        max_items: the search's upper bound.

    Returns:
        The number of items (a float); NaN when even ``max_items`` do not reach the power or the effect is 0."""
    if not effect or n_items <= 0 or k <= 0:
        return float("nan")

    def pw(n):
        null = np.concatenate([np.full(int(round(c * n / n_items)), int(w), np.int64) for w, c in sizes.items()]
                              + [np.zeros(0, np.int64)])
        return item_test_power(null, int(round(abs(effect) * n)), k, alpha)

    hi = 8
    while pw(hi) < power:
        if hi >= max_items:
            return float("nan")
        hi = min(hi * 2, max_items)
    lo = hi // 2  # the power grows with the items, up to the steps of the test's discreteness
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pw(mid) < power else (lo, mid)
    return float(hi)


def joint_gain_share_homogeneity(tables: Sequence[tuple[Sequence[int], Sequence[int]]], *, n_sim: int = 9999,
                                 seed: int = 0) -> tuple[float, int, float, int]:
    """The homogeneity check of :func:`gain_share_homogeneity` summed over several rows (the accuracy rows of one
    claim), with the sum referred to its own null: each replicate draws every row's table from that row's
    conditional law (fixed margins) and sums the rows' chi-squares, so the p-value is valid however sparse the
    tables are (the chi-square law of the sum is not: a sparse table's statistic has a mean above its df and a
    variance below twice it).

    Args:
        tables: per row, the seeds' (lost, gained) counts.
        n_sim: Monte Carlo draws.
        seed: random seed of the draws.

    Returns:
        ``(summed chi-square, summed df, Monte Carlo p, rows that could show it)``; (nan, 0, nan, 0) when no row can."""
    rng = np.random.default_rng(seed)
    obs, dof, used = 0.0, 0, 0
    null = np.zeros(n_sim)
    for lost, gained in tables:
        L, G = np.asarray(lost, np.int64), np.asarray(gained, np.int64)
        keep = (L + G) > 0
        L, G = L[keep], G[keep]
        if len(L) < 2 or L.sum() == 0 or G.sum() == 0:
            continue
        m = L + G
        g_tot = int(G.sum())
        e = m * g_tot / int(m.sum())
        w = 1 / e + 1 / (m - e)
        obs += float(((G - e) ** 2 * w).sum())
        null += (((rng.multivariate_hypergeometric(m, g_tot, size=n_sim) - e) ** 2) * w).sum(-1)
        dof += len(L) - 1
        used += 1
    if not used:
        return float("nan"), 0, float("nan"), 0
    p = (1 + int((null >= obs - 1e-9 * max(obs, 1.0)).sum())) / (n_sim + 1)
    return obs, dof, float(p), used
