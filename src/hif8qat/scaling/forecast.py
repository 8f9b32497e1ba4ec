"""The ``exp_smooth`` estimator: a host-side forecaster of the next ``k`` amaxes in log space.

Own version of the authors' ``ExpSmoothPredictor`` (``pangu_hif8_pretrain/hif8.py``); the rules and the
deliberate differences are listed in docs/design.md (section 2). This module owns the forecaster
(:class:`ExpSmoothForecaster`, whose docstring lists its rules) and the turn of forecasts into a block of
scales (:func:`exp_smooth_block`, :func:`exp_smooth_rows`), used by :mod:`hif8qat.scaling.bank` at each
exp_smooth refresh (one host copy of the bank's table per refresh round).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hif8qat.scaling.rules import EPS


@dataclass(frozen=True)
class ExpSmoothParams:
    alpha: float = 0.5
    beta: float = 0.08
    alpha_fast: float = 0.9
    spike_thresh: float = 0.3
    damp: float = 0.9
    adaptive: bool = True
    ensemble_temp: float = 5.0
    ensemble_filter: float = 1.01
    clip_sigma: float = 3.0
    cv_every: int = 5
    cv_window: int = 40
    min_obs: int = 20
    long_len: int = 200


EXP_SMOOTH_PARAMS = {
    "A": ExpSmoothParams(),
    "W": ExpSmoothParams(),
    "G": ExpSmoothParams(alpha=0.6, ensemble_temp=10.0, clip_sigma=2.5),  # authors' "D" set
}


def _damp_cum(damp: float, horizon: int) -> np.ndarray:
    return np.cumsum(damp ** np.arange(1, horizon + 1, dtype=np.float64))


def _cand_most_recent(z: np.ndarray, horizon: int, p: ExpSmoothParams) -> np.ndarray:
    return np.full(horizon, z[-1])


def _cand_damped_holt(z: np.ndarray, horizon: int, p: ExpSmoothParams) -> np.ndarray:
    if len(z) < 5:
        return np.full(horizon, z[-1])
    alpha, beta = p.alpha, p.beta
    if p.adaptive and len(z) >= 30:
        v = min(max(float(np.std(np.diff(z[-30:]))) / 0.3, 0.0), 1.0)
        alpha, beta = 0.4 + 0.5 * v, 0.05 + 0.15 * v
    seg = z[-50:].tolist()
    level, trend = seg[0], 0.0
    for y in seg[1:]:
        pred = level + p.damp * trend
        a = p.alpha_fast if abs(y - pred) > p.spike_thresh else alpha
        new_level = a * y + (1.0 - a) * pred
        trend = beta * (new_level - level) + (1.0 - beta) * p.damp * trend
        level = new_level
    return level + _damp_cum(p.damp, horizon) * trend


def _cand_trend_following(z: np.ndarray, horizon: int, p: ExpSmoothParams) -> np.ndarray:
    if len(z) < 30:
        return np.full(horizon, z[-1])
    y = z[-30:]
    x = np.arange(30, dtype=np.float64) - 14.5
    slope = float((x * (y - y.mean())).sum() / (x * x).sum())
    return z[-1] + slope * _damp_cum(p.damp, horizon)


def _cand_ar1(z: np.ndarray, horizon: int, p: ExpSmoothParams) -> np.ndarray:
    fit = z[-50:]
    if len(fit) < 10:
        return np.full(horizon, z[-1])
    x, y = fit[:-1], fit[1:]
    xm, ym = float(x.mean()), float(y.mean())
    phi = float(((x - xm) * (y - ym)).sum() / (((x - xm) ** 2).sum() + 1e-15))
    phi = min(max(phi, -0.999), 0.999)
    mu = (ym - phi * xm) / (1.0 - phi) if abs(1.0 - phi) > 1e-6 else ym
    h = np.arange(1, horizon + 1, dtype=np.float64)
    return mu + phi**h * (z[-1] - mu)


_CANDIDATES: dict[str, Callable[[np.ndarray, int, ExpSmoothParams], np.ndarray]] = {
    "most_recent": _cand_most_recent,
    "damped_holt": _cand_damped_holt,
    "trend_following": _cand_trend_following,
    "ar1": _cand_ar1,
}
_CAND_NAMES = tuple(_CANDIDATES)


class ExpSmoothForecaster:
    """Forecast the next ``horizon`` amaxes from the amaxes observed so far.

    * fewer than ``min_obs`` (20) observations: forecast = most recent amax.
    * four candidates on the log series: most recent; damped Holt (level + trend, damping 0.9, fitted over the
      last 50 points, alpha/beta from the volatility of the last 30 log differences, ``alpha = 0.4 + 0.5 v``,
      ``beta = 0.05 + 0.15 v``, ``v = clip(std/0.3, 0, 1)``, fast alpha 0.9 for a point whose one-step error
      exceeds 0.3); trend following (least-squares slope over the last 30, damped 0.9 per step); AR(1) fitted
      on the last 50 (``|phi| <= 0.999``).
    * rolling-origin cross validation over the last 40 origins (>= 20 points of training prefix), rerun every
      5 forecasts; candidates kept if their error <= 1.01 x most recent's (at least the best two); softmax
      weights ``exp(-temp * err / mean(err))`` (temp 5 for A/W, 10 for G).
    * robust clipping: within median +- clip_sigma x 1.4826 x MAD of the last 60 log amaxes; a forecast more
      than 0.1 above log(median of the scaler history) is pulled 10 % toward it; then bounds in amax space
      [0.2 min, 3 max] of the scaler history (horizon <= 5) or [0.3 min, 2.5 max]; non-finite -> most recent.
    * :func:`exp_smooth_block` turns the forecasts into one block of scales, clipped to [0.01, 100] x the
      scale at the history median (upper bound also <= 1e8).
    """

    def __init__(self, params: ExpSmoothParams | None = None):
        self.p = params or ExpSmoothParams()
        self.obs: list[float] = []  # log amax, finite and > 0 only, at most p.long_len
        self.n_forecasts = 0
        self.last_cv_at = -1
        self.scores: dict[str, float] = {}

    def __deepcopy__(self, memo) -> ExpSmoothForecaster:
        # The bank snapshots every forecaster at each refresh round (a skipped step rolls them back): its
        # containers hold only floats and strings, so copying the containers is a deep copy, at a fraction of
        # copy.deepcopy's cost per element.
        new = ExpSmoothForecaster(self.p)  # the parameters are frozen: shared
        new.obs, new.scores = list(self.obs), dict(self.scores)
        new.n_forecasts, new.last_cv_at = self.n_forecasts, self.last_cv_at
        return new

    def observe(self, amaxes: Sequence[float]) -> None:
        """Add amaxes to the observed series (their logs; non-finite and non-positive ones are dropped, and
        only the last ``long_len`` are kept).

        Args:
            amaxes: the new amaxes, oldest first.
        """
        for a in amaxes:
            a = float(a)
            if math.isfinite(a) and a > 0:
                self.obs.append(math.log(a))
        if len(self.obs) > self.p.long_len:
            del self.obs[: len(self.obs) - self.p.long_len]

    def _cross_validate(self, z: np.ndarray, horizon: int) -> dict[str, float]:
        n = len(z)
        errs: dict[str, list[float]] = {name: [] for name in _CAND_NAMES}
        for t in range(max(self.p.min_obs, n - self.p.cv_window), n):
            h = min(horizon, n - t)
            future, train = z[t:t + h], z[:t]
            for name, fn in _CANDIDATES.items():
                errs[name].append(float(np.abs(future - fn(train, h, self.p)[:h]).mean()))
        return {name: float(np.mean(e)) for name, e in errs.items() if len(e) >= 3}

    def _combine(self, z: np.ndarray, horizon: int) -> np.ndarray:
        scores = self.scores
        names = [nm for nm in _CAND_NAMES if nm in scores and math.isfinite(scores[nm])]
        if len(names) < 2:
            return _cand_most_recent(z, horizon, self.p)
        base = scores.get("most_recent", math.inf)
        keep = [nm for nm in names if scores[nm] <= base * self.p.ensemble_filter]
        if len(keep) < 2:
            keep = sorted(names, key=lambda nm: scores[nm])[:2]
        s = np.array([scores[nm] for nm in keep])
        logits = -s * self.p.ensemble_temp / (s.mean() + 1e-15)
        w = np.exp(logits - logits.max())
        w /= w.sum()
        out = np.zeros(horizon)
        for wi, nm in zip(w, keep):
            out += wi * _CANDIDATES[nm](z, horizon, self.p)
        return out

    def forecast(self, window: Sequence[float], horizon: int) -> list[float]:
        """Amax forecasts for horizons 1..horizon.

        Args:
            window: the scaler's history (non-empty).
            horizon: how many steps ahead.

        Returns:
            ``horizon`` amaxes.
        """
        p = self.p
        last = float(window[-1])
        if len(self.obs) < p.min_obs:
            return [last] * horizon
        z = np.asarray(self.obs, dtype=np.float64)
        if not self.scores or self.n_forecasts - self.last_cv_at >= p.cv_every:
            self.scores = self._cross_validate(z, horizon)
            self.last_cv_at = self.n_forecasts
        preds = self._combine(z, horizon)
        recent = z[-60:]
        med = float(np.median(recent))
        spread = p.clip_sigma * 1.4826 * float(np.median(np.abs(recent - med)))
        preds = np.clip(preds, med - spread, med + spread)
        self.n_forecasts += 1

        w = np.asarray(window, dtype=np.float64)
        wmin, wmax, wmed = float(w.min()), float(w.max()), float(np.median(w))
        if wmed > 0:
            lm = math.log(wmed)
            preds = np.where(preds > lm + 0.1, lm + 0.9 * (preds - lm), preds)
        lo_f, hi_f = (0.2, 3.0) if horizon <= 5 else (0.3, 2.5)
        with np.errstate(over="ignore", invalid="ignore"):
            est = np.clip(np.exp(preds), max(lo_f * wmin, 1e-12), hi_f * wmax)
        est = np.where(np.isfinite(est), est, last)
        return [float(e) for e in est]

    # -- state -----------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The forecaster's state as tensors (observations, counters, cross-validation scores), for a saved
        row.

        Returns:
            ``{"es_obs", "es_meta", "es_scores"}``.
        """
        return {
            "es_obs": torch.tensor(self.obs, dtype=torch.float64),
            "es_meta": torch.tensor([self.n_forecasts, self.last_cv_at], dtype=torch.int64),
            "es_scores": torch.tensor([self.scores.get(nm, math.nan) for nm in _CAND_NAMES],
                                      dtype=torch.float64),
        }

    def load_state_tensors(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_tensors` saved.

        Args:
            sd: the saved tensors.
        """
        self.obs = [float(v) for v in sd["es_obs"].tolist()]
        self.n_forecasts, self.last_cv_at = (int(v) for v in sd["es_meta"].tolist())
        self.scores = {nm: float(v) for nm, v in zip(_CAND_NAMES, sd["es_scores"].tolist())
                       if not math.isnan(v)}


def new_forecaster(role: str) -> ExpSmoothForecaster:
    """A fresh forecaster with the role's parameters (the authors' "D" set for gradients).

    Args:
        role: "A", "W" or "G".

    Returns:
        The forecaster.
    """
    return ExpSmoothForecaster(EXP_SMOOTH_PARAMS.get(role, ExpSmoothParams()))


def exp_smooth_block(forecaster: ExpSmoothForecaster, window: list[float], new: int, cur_est: float,
                      target: float, k: int) -> tuple[list[float], list[float]]:
    """Estimates and scales of one exp_smooth refresh of horizon ``k``.

    Args:
        forecaster: the row's forecaster.
        window: the scaler's history (oldest first).
        new: entries appended since the last refresh (fed to the forecaster).
        cur_est: the current estimate, kept while the history has nothing usable.
        target: the row's scale target.
        k: the horizon.

    Returns:
        ``(estimates, scales)``: ``k`` python floats each.
    """
    new = min(new, len(window))
    if new > 0:
        forecaster.observe(window[len(window) - new:])
    if not window or max(window) <= 0:  # nothing usable yet: keep the previous estimate
        est = [cur_est] * k
        return est, [target / (e + EPS) for e in est]
    est = forecaster.forecast(window, k)
    med = float(np.median(np.asarray(window)))
    if med <= 0:
        med = max(window)
    s_med = target / (med + EPS)
    lo, hi = 0.01 * s_med, min(100.0 * s_med, 1e8)
    scales = []
    for i, e in enumerate(est):
        if not math.isfinite(e) or e <= 0:
            est[i] = e = med
        scales.append(min(max(target / (e + EPS), lo), hi))
    return est, scales




def exp_smooth_rows(forecasters: list[ExpSmoothForecaster | None], roles: Sequence[str], targets: Sequence[float],
                    rows: np.ndarray, hist: np.ndarray, total: np.ndarray, seen_total: np.ndarray, cur: np.ndarray,
                    k: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """One exp_smooth refresh of horizon ``k`` for some of the bank's rows, on host copies of its tables.

    Args:
        forecasters: one per bank row, created on first use (updated in place).
        roles: each row's role.
        targets: each row's scale target.
        rows: the rows to refresh.
        hist: ``[n, L]`` histories, newest last.
        total: ``[n]`` entries ever appended.
        seen_total: ``[n]`` entries already fed to the forecasters (updated in place).
        cur: ``[n]`` current estimates.
        k: the horizon.
        width: the width of the returned blocks.

    Returns:
        Estimates and scales, each ``[len(rows), width]`` with the first ``k`` columns filled.
    """
    L = hist.shape[1]
    ests = np.zeros((len(rows), width))
    scales = np.zeros((len(rows), width))
    for i, r in enumerate(rows):
        t = int(total[r])
        n_hist = min(t, L)
        window = hist[r, L - n_hist:].tolist() if n_hist else []
        if forecasters[r] is None:
            forecasters[r] = new_forecaster(roles[r])
        e, s = exp_smooth_block(forecasters[r], window, t - int(seen_total[r]), float(cur[r]), targets[r], k)
        seen_total[r] = t
        ests[i, :k], scales[i, :k] = e, s
    return ests, scales


__all__ = ["EXP_SMOOTH_PARAMS", "ExpSmoothForecaster", "ExpSmoothParams", "exp_smooth_block", "exp_smooth_rows",
           "new_forecaster"]
