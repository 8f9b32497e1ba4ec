"""Paired statistics for run-vs-baseline claims: one model per paired metric, exact tests for few discordant
items, equivalence (two one-sided tests) against a stated margin, and detectable effects.

The unit of comparison is a seed: a run and its same-seed baseline share data order and initial weights, so each
seed gives one paired difference. Every seed scores the same evaluation items and held-out windows, so an item's
(window's) effect on the difference recurs in every seed: seeds and items are crossed random effects, and the
variance of the mean comes from both (:func:`crossed_mean`); a quantity with no shared units (the training
loss) has the seeds alone (:func:`seeds_t`). Which model applies is fixed by the metric, never by which variance
turns out larger. Accuracy adds an exact permutation test over items of their net flips summed over seeds
(:func:`hif8qat.stats.item_flips.item_permutation_test`) and its minimum detectable effect under a stated flip model
(:func:`hif8qat.stats.item_flips.mde_item_flips`); :func:`hierarchical_bootstrap` gives a second interval where there
are seeds enough.

Also the report's per-seed measures: the relative drop with its paired bootstrap interval, the training-loss
APE, Holm's adjustment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats as st

EQUIVALENT = "equivalent within {m}"
NOT_EQUIVALENT = "not equivalent"
INCONCLUSIVE = "inconclusive at this size"


@dataclass
class Pooled:
    """The mean over seeds of a per-seed paired difference, with its uncertainty."""

    k: int
    mean: float
    se: float
    df: float  # inf: normal quantile (within-seed variance used)
    lo: float  # 95 % interval
    hi: float
    lo90: float  # 90 % interval: the two one-sided tests at 5 % each
    hi90: float
    p: float  # two-sided test of mean 0 on the same variance
    between_sd: float
    within_se: float
    variance_from: str


def _quantile(q: float, df: float) -> float:
    return float(st.norm.ppf(q)) if not np.isfinite(df) else float(st.t.ppf(q, df))


def pool_seeds(diffs: Sequence[float], within_vars: Sequence[float], within_df: float = math.inf) -> Pooled:
    """The earlier pooling rule, ``max(var(d_s), mean(v_s)) / k`` with the df of whichever is larger. The claims
    no longer use it (it picks the variance after seeing the data and counts shared items as fresh per seed);
    the tests keep it to show what the crossed model corrects.

    ``within_df``: degrees of freedom of the within-seed variance (infinite for hundreds of items; the number
    of blocks minus one, summed over seeds, for a variance from a few blocks of training steps)."""
    d = np.asarray(diffs, float)
    v = np.asarray(within_vars, float)
    ok = np.isfinite(d)
    d, v = d[ok], v[ok]
    k = len(d)
    nan = float("nan")
    if k == 0:
        return Pooled(0, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, "none")
    within = float(np.mean(v)) if np.isfinite(v).all() and len(v) else nan
    between = float(np.var(d, ddof=1)) if k > 1 else nan
    if np.isfinite(between) and not (np.isfinite(within) and within >= between):
        var, df, source = between / k, float(k - 1), "between seeds"
    elif np.isfinite(within):
        var, df, source = within / k, float(within_df), "within seeds"
    else:
        return Pooled(k, float(d.mean()), nan, nan, nan, nan, nan, nan, nan, nan, nan, "none")
    se = math.sqrt(var)
    mean = float(d.mean())
    q95, q90 = _quantile(0.975, df), _quantile(0.95, df)
    if se > 0:
        tstat = abs(mean) / se
        p = float(2 * (st.norm.sf(tstat) if not np.isfinite(df) else st.t.sf(tstat, df)))
    else:
        p = 1.0 if mean == 0 else 0.0
    return Pooled(k, mean, se, df, mean - q95 * se, mean + q95 * se, mean - q90 * se, mean + q90 * se, p,
                  math.sqrt(between) if np.isfinite(between) else nan,
                  math.sqrt(within / k) if np.isfinite(within) else nan, source)


def equivalence_verdict(lo90: float, hi90: float, margin: float, unit: str = "") -> str:
    """Two one-sided tests at 5 % each against ``[-margin, margin]`` from the 90 % interval of the difference.

    "equivalent within M": the interval lies inside the margin; "not equivalent": it lies wholly outside it
    (the difference is beyond M at the same level); otherwise "inconclusive at this size". Never "no effect".
    """
    if not (np.isfinite(lo90) and np.isfinite(hi90) and np.isfinite(margin)):
        return INCONCLUSIVE
    if -margin < lo90 and hi90 < margin:
        return EQUIVALENT.format(m=f"{margin:g}{unit}")
    if lo90 > margin or hi90 < -margin:
        return NOT_EQUIVALENT
    return INCONCLUSIVE


# ------------------------------------------------------------------------------------ paired 0/1 items
@dataclass
class ItemPair:
    n: int
    lost: int  # right in the baseline, wrong in the run
    gained: int  # wrong in the baseline, right in the run
    diff: float  # mean(run) - mean(base), a proportion
    var: float  # variance of diff from the items

    @property
    def discordant(self) -> int:
        return self.lost + self.gained


def item_pair(base: Sequence[float], run: Sequence[float]) -> ItemPair:
    """Paired 0/1 outcomes of one seed. The variance is that of a mean of per-item differences; with no
    discordant item it would be 0, an interval of zero width from a finite sample, so one is assumed."""
    b = np.asarray(base) > 0.5
    r = np.asarray(run) > 0.5
    n = int(len(b))
    lost, gained = int((b & ~r).sum()), int((~b & r).sum())
    if n < 2:
        return ItemPair(n, lost, gained, float("nan"), float("nan"))
    diff = (gained - lost) / n
    m = max(lost + gained, 1)
    var = max(m / n - diff**2, 0.0) * n / (n - 1) / n
    return ItemPair(n, lost, gained, diff, var)


def exact_mcnemar_p(lost: int, gained: int) -> float:
    """Exact two-sided McNemar p-value: a binomial test of the discordant items; 1.0 without any."""
    m = lost + gained
    return 1.0 if m == 0 else float(st.binomtest(int(lost), int(m), 0.5).pvalue)


def exact_difference_ci(lost: int, gained: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """Interval of the paired difference ``(gained - lost) / n`` conditional on the discordant items: the
    Clopper-Pearson interval of gained / (lost + gained), mapped to the difference. Exact for any count, where a
    percentile bootstrap of a handful of discordant items is anti-conservative."""
    m = lost + gained
    if n <= 0:
        return float("nan"), float("nan")
    if m == 0:
        return 0.0, 0.0
    ci = st.binomtest(int(gained), int(m), 0.5).proportion_ci(confidence_level=conf, method="exact")
    return (2 * ci.low - 1) * m / n, (2 * ci.high - 1) * m / n


def min_one_way_flips(alpha: float = 0.05) -> int:
    """Fewest discordant items, all the same way, that the exact two-sided McNemar test finds at ``alpha``."""
    m = 1
    while 2 * 0.5**m >= alpha:
        m += 1
    return m


def _rejection_region(m: int, alpha: float) -> np.ndarray:
    c = np.arange(m + 1)
    p = np.minimum(1.0, 2 * np.minimum(st.binom.cdf(c, m, 0.5), st.binom.sf(c - 1, m, 0.5)))
    return c[p < alpha]


def mde_exact_mcnemar(n: int, discordant: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest paired accuracy difference (a proportion) the exact McNemar test detects with ``power``, given
    ``n`` items of which ``discordant`` are scored differently (the measured discordance, held fixed).

    A true difference delta sends a share ``theta = (1 + delta * n / m) / 2`` of the m discordant items one way;
    the test rejects when their count falls in its exact rejection region. NaN when even all m one way would not
    be significant (m below :func:`min_one_way_flips`).
    """
    m = int(discordant)
    if n <= 0 or m <= 0:
        return float("nan")
    region = _rejection_region(m, alpha)
    upper = region[region > m / 2]
    if len(upper) == 0:
        return float("nan")

    def pw(theta):
        return float(st.binom.pmf(upper, m, theta).sum())

    if pw(1.0) < power:
        return float("nan")
    lo, hi = 0.5, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pw(mid) < power else (lo, mid)
    return (2 * hi - 1) * m / n


def mde_from_se(se: float, df: float, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest difference a two-sided test at ``alpha`` on an estimate with standard error ``se`` detects with
    ``power`` (t with ``df`` degrees of freedom, normal when df is infinite)."""
    if not np.isfinite(se) or not df > 0:
        return float("nan")
    return (_quantile(1 - alpha / 2, df) + _quantile(power, df)) * se


def block_variance_of_mean(x: Sequence[float], block: int = 5) -> float:
    """Variance of the mean of a series with serial correlation (training steps), from means of consecutive
    blocks of ``block`` values (``len(x) // block - 1`` degrees of freedom); NaN with fewer than two blocks."""
    a = np.asarray(x, float)
    a = a[np.isfinite(a)]
    nb = len(a) // block
    if nb < 2:
        return float("nan")
    means = a[: nb * block].reshape(nb, block).mean(1)
    return float(np.var(means, ddof=1) / nb)


def mean_variance(x: Sequence[float]) -> float:
    """Variance of the mean of independent values (items)."""
    a = np.asarray(x, float)
    a = a[np.isfinite(a)]
    return float(np.var(a, ddof=1) / len(a)) if len(a) > 1 else float("nan")


# The report's per-seed measures: relative drop, loss APE, paired bootstrap, Holm.
def relative_drop(base: float, quant: float) -> float:
    """``(base - quant) / base * 100``; NaN when the baseline is 0."""
    return float("nan") if base == 0 else (base - quant) / base * 100.0


def _pointwise_ape(steps_q, loss_q, steps_b, loss_b) -> pd.Series:
    """``|Lq - Lb| / |Lb| * 100`` per step logged by both runs (the last value of a step logged twice), by step."""
    q = pd.Series(np.asarray(loss_q, float), index=np.asarray(steps_q)).groupby(level=0).last()
    b = pd.Series(np.asarray(loss_b, float), index=np.asarray(steps_b)).groupby(level=0).last()
    common = q.index.intersection(b.index).sort_values()
    return (q[common] - b[common]).abs() / b[common].abs() * 100.0


def loss_ape(steps_q: Sequence[int], loss_q: Sequence[float], steps_b: Sequence[int], loss_b: Sequence[float],
             *, last_frac: float = 0.1, last_n: int | None = None) -> dict[str, float]:
    """Training-loss APE over the steps logged by both runs (mean of ``|Lq - Lb| / |Lb| * 100``).

    ``last_n`` (or ``ceil(last_frac * n_common)``) common steps form the "last" window.
    Returns ``{n_common, ape_all, ape_last, last_n, first_step, last_step}``.
    """
    err = _pointwise_ape(steps_q, loss_q, steps_b, loss_b)
    common = err.index
    if len(common) == 0:
        return {"n_common": 0, "ape_all": float("nan"), "ape_last": float("nan"), "last_n": 0,
                "first_step": None, "last_step": None}
    n_last = int(last_n) if last_n is not None else max(1, math.ceil(last_frac * len(common)))
    n_last = min(n_last, len(common))
    return {"n_common": int(len(common)), "ape_all": float(err.mean()), "ape_last": float(err.iloc[-n_last:].mean()),
            "last_n": n_last, "first_step": int(common[0]), "last_step": int(common[-1])}


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (NaN stays NaN and does not count as a comparison)."""
    p = np.asarray(pvalues, float)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    order = ok[np.argsort(p[ok], kind="stable")]
    m, running = len(order), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def running_ape(steps_q, loss_q, steps_b, loss_b) -> pd.DataFrame:
    """Per common step: the pointwise APE and its running (cumulative) mean, for the loss figures."""
    err = _pointwise_ape(steps_q, loss_q, steps_b, loss_b)
    return pd.DataFrame({"step": err.index, "ape": err.values, "running_ape": err.expanding().mean().values})


@dataclass
class DropCI:
    base: float
    quant: float
    drop: float
    lo: float
    hi: float
    n: int
    significant: bool


def paired_bootstrap_drop(base_correct: Sequence[float], quant_correct: Sequence[float], *, n_boot: int = 10000,
                          seed: int = 0, ci: float = 0.95) -> DropCI:
    """Relative drop of mean(quant) vs mean(base) on the same documents, with a paired percentile CI.

    Both arrays are per-document 0/1 (or scores) in the same document order.
    """
    b = np.asarray(base_correct, float)
    q = np.asarray(quant_correct, float)
    if b.shape != q.shape or b.ndim != 1:
        raise ValueError(f"paired bootstrap needs equal-length 1-d arrays, got {b.shape} and {q.shape}")
    n = len(b)
    if n == 0:
        nan = float("nan")
        return DropCI(nan, nan, nan, nan, nan, 0, False)
    base, quant = float(b.mean()), float(q.mean())
    rng = np.random.default_rng(seed)
    drops = np.empty(n_boot)
    chunk = max(1, min(n_boot, 2_000_000 // max(n, 1)))
    for start in range(0, n_boot, chunk):
        m = min(chunk, n_boot - start)
        idx = rng.integers(0, n, size=(m, n))
        mb, mq = b[idx].mean(1), q[idx].mean(1)
        with np.errstate(divide="ignore", invalid="ignore"):
            drops[start:start + m] = np.where(mb > 0, (mb - mq) / mb * 100.0, np.nan)
    alpha = (1.0 - ci) / 2.0
    lo, hi = np.nanquantile(drops, [alpha, 1.0 - alpha]) if np.isfinite(drops).any() else (np.nan, np.nan)
    drop = relative_drop(base, quant)
    sig = bool(np.isfinite(lo) and np.isfinite(hi) and (lo > 0 or hi < 0))
    return DropCI(base, quant, drop, float(lo), float(hi), n, sig)


def binomial_se_pp(p_pct: float, n: int) -> float:
    p = p_pct / 100.0
    return math.sqrt(p * (1 - p) / n) * 100.0


# ------------------------------------------------------------------ one model per paired metric's design
# Every seed scores the same items (or held-out windows), so an item's effect on a paired difference recurs in
# every seed: seeds and items are crossed, not nested. The variance of a contrast's mean comes from the design's
# own units, chosen by the metric before any data are seen, never by which variance turns out larger.
BOOT_MIN_SEEDS = 5  # the hierarchical bootstrap resamples seeds; with fewer it underestimates their spread badly
BOOT_MIN_UNITS = 10
# Relative tolerance (to the largest mean square) under which a variance component counts as zero: far above
# float64 rounding of sums of squares (about 1e-15 relative) and far below any real component.
COMPONENT_RTOL = 1e-9


@dataclass
class Contrast:
    """The mean of a paired difference over a design's units with its uncertainty and where that comes from."""

    k: int  # seeds
    n: int  # items or windows per seed (1 for a seeds-only design)
    mean: float
    se: float
    df: float
    lo: float  # 95 % interval
    hi: float
    lo90: float  # 90 % interval: the two one-sided tests at 5 % each
    hi90: float
    p: float  # two-sided test of mean 0 on the same variance and df
    seed_var: float  # variance components (NaN where the design cannot estimate one)
    unit_var: float
    resid_var: float
    method: str


def make_contrast(k: int, n: int, mean: float, var: float, df: float, comps: tuple[float, float, float],
              method: str) -> Contrast:
    nan = float("nan")
    if not (np.isfinite(var) and var >= 0 and df > 0):
        return Contrast(k, n, mean, nan, nan, nan, nan, nan, nan, nan, *comps, method)
    se = math.sqrt(var)
    q95, q90 = _quantile(0.975, df), _quantile(0.95, df)
    p = float(2 * st.t.sf(abs(mean) / se, df)) if se > 0 else (1.0 if mean == 0 else 0.0)
    return Contrast(k, n, mean, se, df, mean - q95 * se, mean + q95 * se, mean - q90 * se, mean + q90 * se, p,
                    *comps, method)


def seeds_t(diffs: Sequence[float]) -> Contrast:
    """Seeds as the only unit (training loss: every seed its own curve): t on the k per-seed means with k - 1
    degrees of freedom. No interval from one seed."""
    d = np.asarray(diffs, float)
    d = d[np.isfinite(d)]
    k = len(d)
    mean = float(d.mean()) if k else float("nan")
    var = float(np.var(d, ddof=1)) if k > 1 else float("nan")
    return make_contrast(k, 1, mean, var / k if k > 1 else var, float(k - 1),
                     (var, float("nan"), float("nan")), f"t over {k} seed means, {k - 1} df")


def crossed_mean(y, unit: str = "units") -> Contrast:
    """Mean of a balanced seeds x units table of paired differences (units: items or held-out windows, the same
    in every seed), with seeds, units and their interaction as crossed random effects.

    Method of moments from the two-way analysis of variance: with k seeds, n units and the mean squares MS_s
    (seeds, k - 1 df), MS_u (units, n - 1 df) and MS_e (interaction, (k-1)(n-1) df), the components are
    sigma_s^2 = (MS_s - MS_e) / n, sigma_u^2 = (MS_u - MS_e) / k and sigma_e^2 = MS_e; an estimate not above 0
    (within COMPONENT_RTOL of the mean squares' scale) means no such component and is set to 0, as REML does
    (REML would also pool that term's sum of squares into the residual; the moments keep MS_e).
    Var(mean) = sigma_s^2/k + sigma_u^2/n + sigma_e^2/(kn), with Satterthwaite's degrees of freedom for that
    combination of mean squares. One seed: the units' variance
    alone, n - 1 df (the seed's own effect cannot be seen). ``unit``: what the columns are, for the method text."""
    y = np.asarray(y, float)
    if y.ndim == 1:
        y = y[None, :]
    k, n = y.shape
    nan = float("nan")
    if n < 2 or not np.isfinite(y).all():
        return make_contrast(k, n, float(y.mean()) if y.size else nan, nan, nan, (nan, nan, nan), "none")
    mean = float(y.mean())
    if k == 1:
        ms_u = float(np.var(y[0], ddof=1))
        return make_contrast(1, n, mean, ms_u / n, float(n - 1), (nan, ms_u, nan),
                         f"one seed: t over {n} {unit}, {n - 1} df (no seed variance)")
    r, c = y.mean(1), y.mean(0)
    df_s, df_u, df_e = k - 1, n - 1, (k - 1) * (n - 1)
    ms_s, ms_u = n * float(np.var(r, ddof=1)), k * float(np.var(c, ddof=1))
    ms_e = float(((y - r[:, None] - c[None, :] + mean) ** 2).sum() / df_e)
    # a component is kept only when its mean square exceeds MS_e by more than rounding noise: sparse 0/1 flips
    # make MS_s == MS_e exactly in exact arithmetic (one flipped cell gives equal mean squares), and a 1e-16
    # "component" would otherwise pick the df of the two-df seed term (3.4 df where 199 is right)
    tol = COMPONENT_RTOL * max(ms_s, ms_u, ms_e)
    s2_s = (ms_s - ms_e) / n if ms_s - ms_e > tol else 0.0
    s2_u = (ms_u - ms_e) / k if ms_u - ms_e > tol else 0.0
    # the same variance as a combination of mean squares, kn Var = c_s MS_s + c_u MS_u + c_e MS_e (what
    # Satterthwaite's df needs): each component kept adds its mean square and takes one MS_e away
    c_s, c_u = float(s2_s > 0), float(s2_u > 0)
    terms = [(c_s, ms_s, df_s), (c_u, ms_u, df_u), (1.0 - c_s - c_u, ms_e, df_e)]
    total = sum(w * ms for w, ms, _ in terms)
    denom = sum((w * ms) ** 2 / d for w, ms, d in terms if w)
    df = total**2 / denom if denom > 0 else float(df_e)
    return make_contrast(k, n, mean, total / (k * n), df, (s2_s, s2_u, ms_e),
                     f"seeds x {n} {unit} crossed (method of moments), Satterthwaite {df:.1f} df")


def hierarchical_bootstrap(y, *, n_boot: int = 2000, seed: int = 0, conf: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the mean of a seeds x units table, resampling seeds and units independently (both
    are random samples; a unit recurs in every seed, so its rows are not resampled per seed). A 1-column table
    resamples seeds alone. NaN when the counts do not allow it (fewer than BOOT_MIN_SEEDS seeds, or than
    BOOT_MIN_UNITS units where there are units)."""
    y = np.asarray(y, float)
    if y.ndim == 1:
        y = y[:, None]
    k, n = y.shape
    if k < BOOT_MIN_SEEDS or (1 < n < BOOT_MIN_UNITS) or not np.isfinite(y).all():
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for b in range(n_boot):
        rows = rng.integers(0, k, k)
        cols = rng.integers(0, n, n) if n > 1 else np.zeros(1, int)
        means[b] = y[np.ix_(rows, cols)].mean()
    a = (1 - conf) / 2
    lo, hi = np.quantile(means, [a, 1 - a])
    return float(lo), float(hi)


# ------------------------------------------------------------- one seed: the seed component borrowed
def pool_seed_variance(seed_vars: Sequence[float], dfs: Sequence[float]) -> tuple[float, float]:
    """The seed variance of a set of multi-seed claims pooled into one estimate: their variance components
    averaged with weights their degrees of freedom (k - 1 each), and the degrees of freedom of the largest one
    alone, not their sum: the claims often share runs (two experiments against one baseline), so their
    estimates are not independent, and counting one claim's df is right when they are fully dependent and
    conservative otherwise. (nan, nan) with no finite donor."""
    v, d = np.asarray(seed_vars, float), np.asarray(dfs, float)
    ok = np.isfinite(v) & np.isfinite(d) & (d > 0)
    if not ok.any():
        return float("nan"), float("nan")
    return float(np.sum(v[ok] * d[ok]) / np.sum(d[ok])), float(d[ok].max())


def with_seed_variance(one_seed: Contrast, seed_var: float, seed_df: float, *, replaces_own: bool = False,
                       source: str = "") -> Contrast:
    """A one-seed contrast whose variance gains a seed component measured elsewhere (:func:`pool_seed_variance`):
    one seed's mean differs from the mean over seeds by the seed's own shift, whose variance the seed cannot
    show. The variance of its mean is ``seed_var + se^2`` (the units' share, from the seed itself) on the
    borrowed variance's degrees of freedom: Satterthwaite's for the two would be larger (the seed's own share
    is known on hundreds of df), but the borrowed component dominates, comes from a few seeds of other claims,
    and the approximation undercovers there (a one-seed simulation with the seed variance 4x the items': 0.94
    with Satterthwaite's df). ``replaces_own``: ``seed_var`` already holds the whole per-seed variance (a
    quantity with no units, the training loss: the variance over seeds of the per-seed differences), so it
    replaces the seed's own variance instead of adding to it."""
    own = 0.0 if replaces_own else one_seed.se**2
    if not (np.isfinite(seed_var) and seed_var >= 0 and np.isfinite(own) and seed_df > 0):
        return one_seed
    return make_contrast(one_seed.k, one_seed.n, one_seed.mean, seed_var + own, float(seed_df),
                         (seed_var, one_seed.unit_var, one_seed.resid_var),
                         f"one seed + seed variance {source}: {seed_df:g} df")


# ---------------------------------------------------------------------- error control over many rows
def benjamini_hochberg(pvalues: Sequence[float]) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (false discovery rate; scipy's), NaN kept and not counted."""
    p = np.asarray(pvalues, float)
    out = np.full_like(p, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        out[ok] = st.false_discovery_control(p[ok], method="bh")
    return out
