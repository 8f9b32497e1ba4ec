"""Paired statistics for run-vs-baseline claims: exact tests for few discordant items, equivalence (two one-sided
tests) against a stated margin, detectable effects, and error control over many rows.

The unit of comparison is a seed: a run and its same-seed baseline share data order and initial weights. The
variance model of a claim (seeds crossed with items) is :mod:`hif8qat.stats.crossed`; the item test of accuracy
is :mod:`hif8qat.stats.item_flips`. Also the report's per-seed measures: the relative drop with its paired
bootstrap interval, the training-loss APE, Holm's adjustment."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

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
    from scipy import stats as st
    return float(st.norm.ppf(q)) if not np.isfinite(df) else float(st.t.ppf(q, df))


def pool_seeds(diffs: Sequence[float], within_vars: Sequence[float], within_df: float = math.inf) -> Pooled:
    """The earlier pooling rule, ``max(var(d_s), mean(v_s)) / k`` with the df of whichever is larger. The claims
    no longer use it (it picks the variance after seeing the data and counts shared items as fresh per seed);
    the tests keep it to show what the crossed model corrects.

    Args:
        diffs: per-seed paired differences.
        within_vars: per-seed variances of those differences.
        within_df: degrees of freedom of the within-seed variance (infinite for hundreds of items; the number of blocks
            minus one, summed over seeds, for a variance from a few blocks of training steps).

    Returns:
        A :class:`Pooled` (NaN fields where the seeds cannot give them)."""
    from scipy import stats as st
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

    Args:
        lo90: lower bound of the 90 % interval.
        hi90: its upper bound.
        margin: the equivalence margin.
        unit: unit printed after the margin (e.g. ``%``).

    Returns:
        One of ``EQUIVALENT`` (formatted with the margin), ``NOT_EQUIVALENT`` or ``INCONCLUSIVE``."""
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
    discordant item it would be 0, an interval of zero width from a finite sample, so one is assumed.

    Args:
        base: the baseline's per-item outcomes (above 0.5 is right).
        run: the run's, in the same item order.

    Returns:
        An :class:`ItemPair`; diff and var are NaN with fewer than two items."""
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
    """Exact two-sided McNemar p-value: a binomial test of the discordant items.

    Args:
        lost: items right in the baseline, wrong in the run.
        gained: items wrong in the baseline, right in the run.

    Returns:
        The p-value; 1.0 without a discordant item."""
    from scipy import stats as st
    m = lost + gained
    return 1.0 if m == 0 else float(st.binomtest(int(lost), int(m), 0.5).pvalue)


def exact_difference_ci(lost: int, gained: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """Interval of the paired difference ``(gained - lost) / n`` conditional on the discordant items: the
    Clopper-Pearson interval of gained / (lost + gained), mapped to the difference. Exact for any count, where a
    percentile bootstrap of a handful of discordant items is anti-conservative.

    Args:
        lost: items lost.
        gained: items gained.
        n: items scored.
        conf: confidence level.

    Returns:
        ``(lo, hi)``; (0, 0) without a discordant item, NaN when n is not positive."""
    from scipy import stats as st
    m = lost + gained
    if n <= 0:
        return float("nan"), float("nan")
    if m == 0:
        return 0.0, 0.0
    ci = st.binomtest(int(gained), int(m), 0.5).proportion_ci(confidence_level=conf, method="exact")
    return (2 * ci.low - 1) * m / n, (2 * ci.high - 1) * m / n


def min_one_way_flips(alpha: float = 0.05) -> int:
    """Fewest discordant items, all the same way, that the exact two-sided McNemar test finds at ``alpha``.

    Args:
        alpha: the test's two-sided level.

    Returns:
        That number of items."""
    m = 1
    while 2 * 0.5**m >= alpha:
        m += 1
    return m


def _rejection_region(m: int, alpha: float) -> np.ndarray:
    from scipy import stats as st
    c = np.arange(m + 1)
    p = np.minimum(1.0, 2 * np.minimum(st.binom.cdf(c, m, 0.5), st.binom.sf(c - 1, m, 0.5)))
    return c[p < alpha]


def mde_exact_mcnemar(n: int, discordant: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest paired accuracy difference (a proportion) the exact McNemar test detects with ``power``, the
    measured discordance held fixed.

    A true difference delta sends a share ``theta = (1 + delta * n / m) / 2`` of the m discordant items one way;
    the test rejects when their count falls in its exact rejection region.

    Args:
        n: items scored.
        discordant: items scored differently by the two models.
        alpha: the test's two-sided level.
        power: the power to reach.

    Returns:
        The difference; NaN when even all m one way would not be significant (m below :func:`min_one_way_flips`)."""
    from scipy import stats as st
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
    ``power``.

    Args:
        se: the estimate's standard error.
        df: its degrees of freedom (infinite: the normal law).
        alpha: the test's two-sided level.
        power: the power to reach.

    Returns:
        The difference; NaN when se is not finite or df not positive."""
    if not np.isfinite(se) or not df > 0:
        return float("nan")
    return (_quantile(1 - alpha / 2, df) + _quantile(power, df)) * se


def block_variance_of_mean(x: Sequence[float], block: int = 5) -> float:
    """Variance of the mean of a series with serial correlation (training steps), from means of consecutive
    blocks (``len(x) // block - 1`` degrees of freedom).

    Args:
        x: the series (non-finite values dropped).
        block: values per block.

    Returns:
        The variance; NaN with fewer than two blocks."""
    a = np.asarray(x, float)
    a = a[np.isfinite(a)]
    nb = len(a) // block
    if nb < 2:
        return float("nan")
    means = a[: nb * block].reshape(nb, block).mean(1)
    return float(np.var(means, ddof=1) / nb)


def mean_variance(x: Sequence[float]) -> float:
    """Variance of the mean of independent values (items).

    Args:
        x: the values (non-finite ones dropped).

    Returns:
        The variance; NaN with fewer than two values."""
    a = np.asarray(x, float)
    a = a[np.isfinite(a)]
    return float(np.var(a, ddof=1) / len(a)) if len(a) > 1 else float("nan")


# The report's per-seed measures: relative drop, loss APE, paired bootstrap, Holm.
def relative_drop(base: float, quant: float) -> float:
    """The relative drop ``(base - quant) / base * 100``.

    Args:
        base: the baseline's score.
        quant: the run's score.

    Returns:
        The drop in %; NaN when the baseline is 0."""
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

    Args:
        steps_q: the quantized run's logged steps.
        loss_q: its losses at those steps.
        steps_b: the baseline's logged steps.
        loss_b: its losses at those steps.
        last_frac: share of the common steps that form the "last" window.
        last_n: the "last" window's size in steps (overrides ``last_frac``).

    Returns:
        ``{n_common, ape_all, ape_last, last_n, first_step, last_step}``."""
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
    """Holm-Bonferroni adjusted p-values.

    Args:
        pvalues: the family's p-values (NaN stays NaN and does not count).

    Returns:
        The adjusted p-values, in the input order."""
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
    """Per common step: the pointwise APE and its running (cumulative) mean, for the loss figures.

    Args:
        steps_q: the quantized run's logged steps.
        loss_q: its losses at those steps.
        steps_b: the baseline's logged steps.
        loss_b: its losses at those steps.

    Returns:
        A frame with columns ``step``, ``ape`` and ``running_ape``."""
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

    Args:
        base_correct: the baseline's per-document 0/1 (or scores).
        quant_correct: the run's, in the same document order.
        n_boot: bootstrap draws.
        seed: random seed of the draws.
        ci: confidence level.

    Returns:
        A :class:`DropCI` (NaN fields for no document).

    Raises:
        ValueError: the arrays are not 1-d of equal length."""
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
    """Binomial standard error of an accuracy, in percentage points.

    Args:
        p_pct: the accuracy in %.
        n: items.

    Returns:
        The standard error in percentage points."""
    p = p_pct / 100.0
    return math.sqrt(p * (1 - p) / n) * 100.0


# ---------------------------------------------------------------------- error control over many rows
def benjamini_hochberg(pvalues: Sequence[float]) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (false discovery rate; scipy's).

    Args:
        pvalues: the family's p-values (NaN kept and not counted).

    Returns:
        The adjusted p-values, in the input order."""
    from scipy import stats as st
    p = np.asarray(pvalues, float)
    out = np.full_like(p, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        out[ok] = st.false_discovery_control(p[ok], method="bh")
    return out
