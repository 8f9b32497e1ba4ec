"""The claims' variance model: one model per paired metric's design. Seeds and items (or held-out windows) are
crossed random effects (:func:`crossed_mean`); a quantity with no shared units has the seeds alone
(:func:`seeds_t`); one seed borrows the seed variance of other claims (:func:`with_seed_variance`);
:func:`hierarchical_bootstrap` gives a second interval where there are seeds enough."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hif8qat.stats.paired import _quantile

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
    """A :class:`Contrast` from a mean, the variance of that mean and its df (intervals, p-value).

    Args:
        k: seeds.
        n: units per seed.
        mean: the mean difference.
        var: variance of the mean.
        df: its degrees of freedom.
        comps: the (seed, unit, residual) variance components.
        method: how the variance was found, for the report.

    Returns:
        The contrast; interval, p and se are NaN when var is not finite or df not positive."""
    from scipy import stats as st
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
    degrees of freedom.

    Args:
        diffs: per-seed differences (non-finite ones dropped).

    Returns:
        A :class:`Contrast`; no interval from one seed."""
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
    combination of mean squares. One seed: the units' variance alone, n - 1 df (the seed's own effect cannot be
    seen).

    Args:
        y: the seeds x units table (a 1-d array is one seed).
        unit: what the columns are, for the method text.

    Returns:
        A :class:`Contrast`; no interval with fewer than two units or a non-finite value."""
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
    resamples seeds alone.

    Args:
        y: the seeds x units table (a 1-d array is seeds alone).
        n_boot: bootstrap draws.
        seed: random seed of the draws.
        conf: confidence level.

    Returns:
        ``(lo, hi)``; NaN when the counts do not allow it (fewer than BOOT_MIN_SEEDS seeds, or than BOOT_MIN_UNITS units
        where there are units)."""
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
    conservative otherwise.

    Args:
        seed_vars: the claims' seed variance components.
        dfs: their degrees of freedom.

    Returns:
        ``(pooled variance, df)``; (nan, nan) with no finite donor."""
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
    with Satterthwaite's df).

    Args:
        one_seed: the seed's own contrast.
        seed_var: the borrowed seed variance.
        seed_df: its degrees of freedom.
        replaces_own: ``seed_var`` already holds the whole per-seed variance (a quantity with no units, the training
            loss), so it replaces the seed's own variance instead of adding to it.
        source: where the variance came from, for the method text.

    Returns:
        The widened contrast, or ``one_seed`` unchanged when the borrowed variance is unusable."""
    own = 0.0 if replaces_own else one_seed.se**2
    if not (np.isfinite(seed_var) and seed_var >= 0 and np.isfinite(own) and seed_df > 0):
        return one_seed
    return make_contrast(one_seed.k, one_seed.n, one_seed.mean, seed_var + own, float(seed_df),
                         (seed_var, one_seed.unit_var, one_seed.resid_var),
                         f"one seed + seed variance {source}: {seed_df:g} df")
