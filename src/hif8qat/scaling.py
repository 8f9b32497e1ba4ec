"""Delayed tensor scaling for 8-bit (HiF8, FP8) fake quantization (contract: docs/design.md).

One :class:`DelayedScaler` per quantized tensor role (activation input ``A``, weight ``W``, output
gradient ``G`` of every converted linear). Semantics follow the authors' ``pangu_hif8_pretrain/hif8.py``
(``HiF8GlobalStateManager`` + ``hif8_qdq_with_amax``); this is an independent implementation.

Per quantizer call
------------------
1. Pick the scale. ``scale = target / (estimate + 1e-12)`` (computed in float64, stored as float32),
   ``target`` = ``target_fwd`` for A/W and ``target_bwd`` for G; no margin, no clamp at the target.

   * **cold start**: the first call (or the first after :meth:`DelayedScaler.reset`) uses its own
     amax; that amax then enters the history once (as in the authors' code).
   * **interval k**: the scale is refreshed every k calls (a "block"); calls inside a block reuse it,
     while the history still grows on every call. The block restarts at the cold start and whenever
     the scheduled interval *or algorithm* changes (the authors refresh only on an interval change;
     with interval 1 the two agree).
   * **refresh**: the estimate comes from the history **before** the current amax is appended:
     ``max`` / ``most_recent`` / ``mean`` over the last ``history_len`` entries, or ``exp_smooth``
     (below). A non-finite or non-positive cold-start amax falls back to 1.0 (authors' rule), i.e.
     ``scale = target``; a history estimate that is 0 (history still empty because every amax so far
     was non-finite, or only zero amaxes) keeps the previous estimate (the authors use 1.0 there too;
     the two agree when that previous estimate is the cold-start fallback).
   * ``algo`` and ``interval`` may be step schedules ``{0: "most_recent", 1000: "exp_smooth"}``: the
     value for a call is the one of the largest key <= the step given by :meth:`set_step`.
   * ``current`` (also as a phase of a schedule): just-in-time scaling, every call a cold start from
     its own amax (``formats.current_scale``), local (no all-reduce before the cast); the amax still
     enters the history, so telemetry and a switch to a history estimator work. The block bookkeeping
     restarts on every call (interval has no effect). A frozen scaler under ``current`` keeps scaling
     each tensor from its own amax.
2. Quantize with the fused ``formats.qdq_scaled_amax`` (one pass: qdq + amax of the unscaled tensor) in
   the role's element format (``formats.element_format``: ``hybrid`` is E4M3 for A/W, E5M2 for G) with
   its target (``formats.target_for``: HiF8 ``target_fwd`` / ``target_bwd``, FP8 max / 2^margin).
   Rounding: ``ta`` for A and W, ``grad_rounding`` for G. ``saturate`` clamps at HIF8_MAX (HiF8; FP8
   casts always saturate).
3. ``amax_reduce="max"``: all-reduce (MAX) of the amax over the default process group when
   ``torch.distributed`` is initialised (NaN is mapped to +inf first so that every rank sees the same
   non-finite value and skips it). One tiny collective per call: all ranks must call their
   quantizers in the same order (true for data parallelism on identical graphs).
4. Append the amax to the history unless it is non-finite (the authors append everything).

``history_unit="step"``: one history entry per optimizer step, the max over that step's (finite)
call amaxes. The entry of step t is committed at the first call of the next step (steps come from
:meth:`set_step`); the scale is refreshed only at step boundaries (interval then counts steps), the
first call after a reset is a cold start and the rest of that first step reuses its scale.

No host synchronisation for ``max`` / ``most_recent`` / ``mean``: the history is a fixed-size
float32 buffer on the tensor's device (newest entry last, shifted by one per append; unused leading
slots hold 0, neutral for max and sum) with a device counter ``total`` of entries ever appended; the
estimate and the non-finite / empty-history / cold-start cases use tensor ops and ``torch.where``;
interval and schedule bookkeeping uses Python ints. ``exp_smooth`` copies the history to the host at
each refresh (one sync per refresh). The scaler follows device moves of its model but not dtype casts
(``model.to(torch.bfloat16)`` leaves the history in float32 and the estimates in float64).

``exp_smooth`` (own version of the authors' ``ExpSmoothPredictor``)
--------------------------------------------------------------------
Host-side forecaster of the next ``k`` amaxes (k = current interval; call j of a block uses the
horizon-(j+1) forecast, as the authors do) in log space, with its own long history (last 200 finite,
positive amaxes seen by the scaler). Rules:

* fewer than 20 observations: forecast = most recent amax.
* four candidates on the log series: most recent; damped Holt (level + trend, damping 0.9,
  fitted over the last 50 points, smoothing alpha/beta from the volatility of the last 30 log
  differences, ``alpha = 0.4 + 0.5 v``, ``beta = 0.05 + 0.15 v``, ``v = clip(std/0.3, 0, 1)``, and a
  fast alpha 0.9 for a point whose one-step error exceeds 0.3 (spike)); trend following (least-squares
  slope over the last 30, damped 0.9 per step); AR(1) fitted on the last 50 (``|phi| <= 0.999``).
* rolling-origin cross validation over the last 40 origins (>= 20 points of training prefix), rerun
  every 5 forecasts; candidates kept if their error <= 1.01 x most recent's (at least the best two);
  softmax weights ``exp(-temp * err / mean(err))`` (temp 5 for A/W, 10 for G).
* robust clipping: forecast within median +- clip_sigma x 1.4826 x MAD of the last 60 log amaxes
  (clip_sigma 3 for A/W, 2.5 for G); a forecast more than 0.1 above log(median of the scaler history)
  is pulled 10 % toward it; then bounds in amax space [0.2 min, 3 max] of the scaler history (horizon
  <= 5) or [0.3 min, 2.5 max] (longer); non-finite -> most recent amax; finally the scale is clipped to
  [0.01, 100] x the scale at the history median (upper bound also <= 1e8).
  The G role uses the authors' "D" parameter set (alpha 0.6, temp 10, clip 2.5), A and W the default.

Differences from the authors' predictor (deliberate):

* Their incremental Holt state with the spike-adaptive (``alpha_fast``) and volatility-adaptive
  smoothing is updated but never used by their forecast (their Holt candidate refits with fixed
  alpha 0.6 / beta 0.10 and an undamped trend recursion). Here the spike- and volatility-adaptive
  smoothing is part of the damped-Holt candidate, so it affects the forecast.
* They assume exactly ``k`` new history entries per refresh (wrong after the cold start, after an
  interval change, or when non-finite amaxes were dropped); here the new entries are counted exactly
  from the device counter. On its first activation (e.g. a schedule switch at step 1000) the
  forecaster is seeded with the whole current history instead of only the last ``k`` entries, so it
  forecasts immediately when >= 20 entries exist.
* Cross-validation error is the mean absolute error of the log forecast (~relative error of the
  amax) instead of the absolute error divided by ``|log amax|`` (which explodes near amax = 1).
* Zero amaxes are kept in the scaler history (max/mean/bounds) but not in the forecaster's log series.

Telemetry
---------
Per call (always, cheap, on device): amax, estimate, ``ratio = amax / estimate`` (> 1: the tensor
outgrew its delayed estimate), non-finite flag. Every ``telemetry_stats_every`` calls (0 = never) and
on every call of a dump step (``step % telemetry_dump_every == 0``): the fraction of elements with
``|x * scale| > target`` (for HiF8 above the 3-bit-mantissa tier) and the clipped-value count
(``formats.clipped_count``'s rule: HiF8 overflow ``|x * scale| >= 40960``, values that become inf or are
clamped when ``saturate``; FP8 ``|x * scale| > max``, values the saturating cast clips). Accumulated on
device in two sets: since the last :func:`step_telemetry` (``hif8qat.qlinear.step_telemetry``) and since
the last dump.
Telemetry is not part of the scaler state dict.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

ESTIMATORS = ("max", "most_recent", "mean", "exp_smooth")
# Allowed ``algo`` values: the history estimators, and "current", the just-in-time scale from the tensor's
# own amax (Transformer Engine's current scaling; formats.current_scale), the bound no estimator can beat.
ALGOS = (*ESTIMATORS, "current")
HISTORY_UNITS = ("call", "step")
AMAX_REDUCES = ("none", "max")
GRAD_ROUNDINGS = ("ta", "stochastic")
ROLES = ("A", "W", "G")
EPS = 1e-12
_FALLBACK_ESTIMATE = 1.0  # authors: a non-finite or non-positive estimate is replaced by 1.0


# --------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"ScalingConfig.{name}={value!r} is invalid; allowed: {allowed}")


def _normalize_schedule(name: str, value: Any) -> Any:
    """Mapping -> {int: value} sorted by key (string keys from YAML/JSON are accepted)."""
    if not isinstance(value, Mapping):
        return value
    out = {}
    for k, v in value.items():
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k.strip())
        if not _is_int(k):
            _fail(name, value, "a value or a step schedule {step: value} with integer steps >= 0 and key 0")
        out[int(k)] = v
    return dict(sorted(out.items()))


@dataclass
class ScalingConfig:
    """Delayed-scaling settings shared by every scaler of a model (see module docstring)."""

    algo: str | dict[int, str] = "max"
    history_len: int = 64
    interval: int | dict[int, int] = 1
    target_fwd: float = 15.0
    target_bwd: float = 15.0
    history_unit: str = "call"
    amax_reduce: str = "none"
    saturate: bool = False
    grad_rounding: str = "ta"
    telemetry_dump_every: int = 0
    # Extension of the CONTRACT: exceed-fraction / overflow statistics every N calls (0 = only on dump
    # steps). They cost two extra reductions over the tensor, so they are not computed on every call.
    telemetry_stats_every: int = 0
    # Element format (formats.FORMAT_SETTINGS): hif8, e4m3, e5m2, or hybrid (E4M3 for A/W, E5M2 for G).
    format: str = "hif8"
    # FP8 only: amax maps to format max / 2^margin (Transformer Engine DelayedScaling, default 0).
    margin: int = 0

    def __post_init__(self) -> None:
        self.algo = _normalize_schedule("algo", self.algo)
        self.interval = _normalize_schedule("interval", self.interval)

    # -- validation ------------------------------------------------------------------------------
    def validate(self) -> ScalingConfig:
        self._validate_schedule("algo", self.algo, lambda v: isinstance(v, str) and v in ALGOS,
                                f"one of {ALGOS}")
        self._validate_schedule("interval", self.interval, lambda v: _is_int(v) and v >= 1,
                                "an integer >= 1")
        if not _is_int(self.history_len) or self.history_len < 1:
            _fail("history_len", self.history_len, "an integer >= 1")
        for name in ("target_fwd", "target_bwd"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                _fail(name, v, "a finite number > 0")
        for name, choices in (("history_unit", HISTORY_UNITS), ("amax_reduce", AMAX_REDUCES),
                              ("grad_rounding", GRAD_ROUNDINGS)):
            if getattr(self, name) not in choices:
                _fail(name, getattr(self, name), f"one of {choices}")
        if not isinstance(self.saturate, bool):
            _fail("saturate", self.saturate, "true or false")
        for name in ("telemetry_dump_every", "telemetry_stats_every"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                _fail(name, v, "an integer >= 0")
        self._validate_format()
        return self

    def _validate_format(self) -> None:
        """format / margin, and the settings that mean something for one kind of format only."""
        from .formats import FORMAT_SETTINGS

        if self.format not in FORMAT_SETTINGS:
            _fail("format", self.format, f"one of {FORMAT_SETTINGS}")
        if not _is_int(self.margin) or self.margin < 0:
            _fail("margin", self.margin, "an integer >= 0")
        if self.format == "hif8":
            if self.margin:
                _fail("margin", self.margin, "0 with format=hif8 (HiF8's target is target_fwd / target_bwd); "
                      "an integer >= 0 with e4m3, e5m2 or hybrid")
            return
        # FP8 targets come from the format (max / 2^margin); a changed HiF8 target would be silently unused.
        for name in ("target_fwd", "target_bwd"):
            default = next(f.default for f in dataclasses.fields(ScalingConfig) if f.name == name)
            if getattr(self, name) != default:
                _fail(name, getattr(self, name), f"{default} (unused) with format={self.format}: FP8 targets are "
                      "the format max / 2^margin, set margin instead")
        if self.grad_rounding != "ta":
            _fail("grad_rounding", self.grad_rounding, f"ta with format={self.format} (FP8 casts round to "
                  "nearest even; stochastic rounding is HiF8-only)")

    @staticmethod
    def _validate_schedule(name: str, value: Any, ok: Callable[[Any], bool], allowed: str) -> None:
        if isinstance(value, Mapping):
            sched_allowed = f"{allowed}, or a step schedule {{0: ..., step: ...}} with integer steps >= 0"
            if not value:
                _fail(name, value, sched_allowed + " (empty schedule)")
            for k, v in value.items():
                if not _is_int(k) or k < 0:
                    _fail(name, value, sched_allowed + f" (bad step key {k!r})")
                if not ok(v):
                    _fail(name, value, sched_allowed + f" (bad value {v!r} at step {k})")
            if 0 not in value:
                _fail(name, value, sched_allowed + " (key 0 is required)")
        elif not ok(value):
            _fail(name, value, f"{allowed}, or a step schedule {{0: ..., step: ...}}")

    # -- schedules -------------------------------------------------------------------------------
    def algo_schedule(self) -> list[tuple[int, str]]:
        return sorted(self.algo.items()) if isinstance(self.algo, Mapping) else [(0, self.algo)]

    def interval_schedule(self) -> list[tuple[int, int]]:
        if isinstance(self.interval, Mapping):
            return [(k, int(v)) for k, v in sorted(self.interval.items())]
        return [(0, int(self.interval))]

    def algo_at(self, step: int) -> str:
        return _lookup(self.algo_schedule(), step)

    def interval_at(self, step: int) -> int:
        return _lookup(self.interval_schedule(), step)

    def uses(self, algo: str) -> bool:
        return any(a == algo for _, a in self.algo_schedule())

    # -- (de)serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("algo", "interval"):
            if isinstance(d[k], Mapping):
                d[k] = {int(s): v for s, v in d[k].items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ScalingConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ScalingConfig: unknown field(s) {unknown}; allowed: {sorted(known)}")
        kw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in d.items()}
        return cls(**kw).validate()


def _lookup(schedule: Sequence[tuple[int, Any]], step: int) -> Any:
    if len(schedule) == 1:
        return schedule[0][1]
    i = bisect.bisect_right(schedule, (int(step), math.inf), key=lambda kv: (kv[0], math.inf)) - 1
    return schedule[max(i, 0)][1]


# --------------------------------------------------------------------------------------------------
# exp_smooth forecaster (host side)
# --------------------------------------------------------------------------------------------------
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
    """Forecast the next ``horizon`` amaxes from the amaxes observed so far (see module docstring)."""

    def __init__(self, params: ExpSmoothParams | None = None):
        self.p = params or ExpSmoothParams()
        self.obs: list[float] = []  # log amax, finite and > 0 only, at most p.long_len
        self.n_forecasts = 0
        self.last_cv_at = -1
        self.scores: dict[str, float] = {}

    def observe(self, amaxes: Sequence[float]) -> None:
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
        """Amax forecasts for horizons 1..horizon. ``window``: the scaler's history (non-empty)."""
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
        return {
            "es_obs": torch.tensor(self.obs, dtype=torch.float64),
            "es_meta": torch.tensor([self.n_forecasts, self.last_cv_at], dtype=torch.int64),
            "es_scores": torch.tensor([self.scores.get(nm, math.nan) for nm in _CAND_NAMES],
                                      dtype=torch.float64),
        }

    def load_state_tensors(self, sd: Mapping[str, torch.Tensor]) -> None:
        self.obs = [float(v) for v in sd["es_obs"].tolist()]
        self.n_forecasts, self.last_cv_at = (int(v) for v in sd["es_meta"].tolist())
        self.scores = {nm: float(v) for nm, v in zip(_CAND_NAMES, sd["es_scores"].tolist())
                       if not math.isnan(v)}


def _exp_smooth_block(forecaster: ExpSmoothForecaster, window: list[float], new: int, cur_est: float,
                      target: float, k: int) -> tuple[list[float], list[float]]:
    """Estimates and scales (python floats) of one exp_smooth refresh of horizon ``k``.

    ``window``: the scaler's history (oldest first); ``new``: entries appended since the last refresh
    (fed to the forecaster); ``cur_est``: the current estimate, kept while the history has nothing usable.
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


# --------------------------------------------------------------------------------------------------
# the scaler
# --------------------------------------------------------------------------------------------------
def _formats():
    from hif8qat import formats  # lazily: formats is heavy and scaling is imported by the config

    return formats


_qdq_amax_fn = None  # formats.qdq_scaled_amax, bound on first use (a seam tests wrap)


def _qdq_amax(x, scale, fmt, rounding, saturate):
    global _qdq_amax_fn
    if _qdq_amax_fn is None:
        _qdq_amax_fn = _formats().qdq_scaled_amax
    return _qdq_amax_fn(x, scale, fmt, rounding, saturate=saturate)


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


# meta vector layout (Python state saved in the state dict)
_META = ("initialized", "block_j", "block_len", "block_algo", "step", "pending_step", "frozen", "calls",
         "seen_total")
_TEL_MAX = ("amax_ratio_max", "exceed_frac_max", "amax_max")
_TEL_CNT = ("amax_ratio_gt1", "clipped_count", "nonfinite_count")


# One scaler's saved state: the same keys for the reference scaler and each row of the bank (checkpoints and
# exports load in either).
STATE_KEYS = ("history", "total", "pending", "pending_valid", "scale_block", "est_block", "meta")
OPTIONAL_STATE_KEYS = ("es_obs", "es_meta", "es_scores")


def check_state_keys(state: Mapping, strict: bool, who: str) -> None:
    """KeyError naming ``who`` when a saved scaler state lacks a key, or (strict) has an unknown one."""
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise KeyError(f"{who}: state is missing {missing}")
    extra = set(state) - set(STATE_KEYS) - set(OPTIONAL_STATE_KEYS)
    if strict and extra:
        raise KeyError(f"{who}: unexpected state keys {sorted(extra)}")


class DelayedScaler(nn.Module):
    """Delayed per-tensor scaling for one tensor role (see the module docstring).

    State lives in non-persistent buffers (so an enclosing model's ``state_dict()`` is unchanged) and
    in Python ints. ``scaler.state_dict()`` called directly returns the full scaler state (tensors),
    ``load_state_dict`` restores it exactly; called by an enclosing module it contributes nothing.

    The history buffer holds the last ``history_len`` finite amaxes, oldest first, newest at index
    -1 (a fixed-size device buffer shifted by one on each append; unused leading slots are 0, which
    is neutral for max and sum); ``total`` counts the entries ever appended.
    """

    def __init__(self, role: str, config: ScalingConfig | None = None, target: float | None = None, *,
                 device: torch.device | str | None = None):
        super().__init__()
        config = config if config is not None else ScalingConfig()
        config.validate()
        fm = _formats()
        self.role = role
        self.config = config
        self.fmt = fm.element_format(config.format, role)
        spec = fm.format_spec(self.fmt)
        self._clip = (spec.clip_threshold, spec.clip_inclusive)
        if target is None:
            target = fm.target_for(config, role)
        if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
            raise ValueError(f"DelayedScaler target={target!r} is invalid; allowed: a finite number > 0")
        self.target = float(target)
        self.rounding = config.grad_rounding if role == "G" else "ta"
        self._algo_sched = config.algo_schedule()
        self._interval_sched = config.interval_schedule()
        self._step_mode = config.history_unit == "step"
        self._uses_current = config.uses("current")
        self._es_params = EXP_SMOOTH_PARAMS.get(role, ExpSmoothParams())
        L = int(config.history_len)
        self.register_buffer("history", torch.zeros(L, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("total", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("pending", torch.zeros((), dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("pending_valid", torch.zeros((), dtype=torch.bool, device=device),
                             persistent=False)
        self.register_buffer("scale_block", torch.full((1,), self.target, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("est_block", torch.ones(1, dtype=torch.float64, device=device), persistent=False)
        # telemetry accumulators since the last step_telemetry: see _TEL_MAX / _TEL_CNT
        self.register_buffer("tel_max", torch.zeros(3, dtype=torch.float64, device=device), persistent=False)
        self.register_buffer("tel_cnt", torch.zeros(3, dtype=torch.int64, device=device), persistent=False)
        self._step = 0
        self._frozen = False
        self._reset_python_state()

    def _apply(self, fn, recurse=True):
        # Follow device moves of the enclosing model (.to(device), .cuda(), ...) but never its dtype
        # casts: model.to(torch.bfloat16) must not round the amax history or the scales.
        dev = fn(torch.zeros(1, dtype=torch.float32, device=self.history.device)).device
        for name, buf in self._buffers.items():
            if buf is not None and buf.device != dev:
                self._buffers[name] = buf.to(dev)
        self._select_block(self._block_j)
        return self

    # -- python state ----------------------------------------------------------------------------
    def _reset_python_state(self) -> None:
        self._initialized = False
        self._block_j = 0
        self._block_len = 1
        self._block_algo = ""
        self._pending_step: int | None = None
        self._calls = 0
        self._seen_total = 0  # history entries already fed to the exp_smooth forecaster
        self._forecaster: ExpSmoothForecaster | None = None
        self._tel_calls = 0
        self._tel_stat_calls = 0
        self.last: dict[str, torch.Tensor | None] = {
            "amax": None, "estimate": None, "ratio": None, "scale": None, "exceed_frac": None,
            "clipped": None}
        self._select_block(0)

    def _select_block(self, j: int) -> None:
        self._block_j = j
        self._cur_scale = self.scale_block[min(j, self.scale_block.numel() - 1)]
        self._cur_est = self.est_block[min(j, self.est_block.numel() - 1)]

    def _set_block(self, est64: torch.Tensor, scale: torch.Tensor) -> None:
        self.est_block = est64.reshape(-1)
        self.scale_block = scale.reshape(-1)
        self._select_block(0)

    def reset(self) -> None:
        """Forget the history and restart with a cold start (QAT switched on). Keeps step and frozen."""
        dev = self.history.device
        with torch.no_grad():
            self.history.zero_()
            self.total.zero_()
            self.pending.zero_()
            self.pending_valid.zero_()
            self.scale_block = torch.full((1,), self.target, dtype=torch.float32, device=dev)
            self.est_block = torch.ones(1, dtype=torch.float64, device=dev)
            self.tel_max.zero_()
            self.tel_cnt.zero_()
        self._reset_python_state()

    def set_step(self, step: int) -> None:
        self._step = int(step)

    def freeze(self, frozen: bool = True) -> None:
        """Frozen: keep using the current scale, no history update (eval in hif8 mode)."""
        self._frozen = bool(frozen)

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def scale(self) -> torch.Tensor:
        """The scale of the current call in the block (0-d float32 device tensor)."""
        return self._cur_scale

    @property
    def estimate(self) -> torch.Tensor:
        """The amax estimate behind :attr:`scale` (0-d float64 device tensor)."""
        return self._cur_est

    def history_values(self) -> list[float]:
        """Chronological history (oldest first); host sync, for analysis and exp_smooth."""
        n = min(int(self.total.item()), self.history.numel())
        return self.history.tolist()[self.history.numel() - n:] if n else []

    # -- estimate ----------------------------------------------------------------------------------
    def _scale_of(self, est64: torch.Tensor) -> torch.Tensor:
        return torch.div(self.target, est64 + EPS).to(torch.float32)

    def _cold_estimate(self, amax: torch.Tensor) -> torch.Tensor:
        est = amax.to(torch.float64)
        ok = (est > 0) & (est < math.inf)
        return torch.where(ok, est, torch.full_like(est, _FALLBACK_ESTIMATE))

    def _history_estimate(self, algo: str) -> torch.Tensor:
        """Tensor estimate (float64, 0-d) of max / most_recent / mean; no host sync.

        The history holds only finite values, so the estimate is finite; an empty (or all-zero)
        history gives 0, in which case the previous estimate is kept.
        """
        if algo == "max":
            est = self.history.amax().to(torch.float64)
        elif algo == "most_recent":
            est = self.history[-1].to(torch.float64)
        elif algo == "mean":
            n = self.total.clamp(1, self.history.numel())
            est = self.history.sum(dtype=torch.float64) / n
        else:  # pragma: no cover - validated
            raise ValueError(algo)
        return torch.where(est > 0, est, self._cur_est)

    def _refresh(self, algo: str, k: int) -> None:
        self._block_algo = algo
        self._block_len = k
        if algo != "exp_smooth":
            est = self._history_estimate(algo)
            self._set_block(est, self._scale_of(est))
        else:
            self._refresh_exp_smooth(k)

    def _refresh_exp_smooth(self, k: int) -> None:
        dev = self.history.device
        window = self.history_values()  # host sync
        total = int(self.total.item())
        if self._forecaster is None:
            self._forecaster = ExpSmoothForecaster(self._es_params)
        est, scales = _exp_smooth_block(self._forecaster, window, total - self._seen_total,
                                        float(self._cur_est.item()), self.target, k)
        self._seen_total = total
        self._set_block(torch.tensor(est, dtype=torch.float64, device=dev),
                        torch.tensor(scales, dtype=torch.float32, device=dev))

    # -- the call -----------------------------------------------------------------------------------
    def _reduce(self, amax: torch.Tensor) -> torch.Tensor:
        if amax.dtype != torch.float32:
            amax = amax.to(torch.float32)
        if self.config.amax_reduce == "max" and _dist_active():
            buf = torch.where(torch.isnan(amax), torch.full_like(amax, math.inf), amax).reshape(1).clone()
            dist.all_reduce(buf, op=dist.ReduceOp.MAX)
            amax = buf.reshape(())
        return amax

    def _append(self, value: torch.Tensor, ok: torch.Tensor) -> None:
        shifted = torch.cat((self.history[1:], value.reshape(1)))
        torch.where(ok, shifted, self.history, out=self.history)
        self.total.add_(ok)

    def _begin_call(self, cold_amax: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick (scale, estimate) for this call, before its amax is known."""
        step = self._step
        algo = _lookup(self._algo_sched, step) if self._uses_current or not self._frozen else ""
        if self._frozen:
            # never ran, or just-in-time: scale from this tensor (local: frozen never communicates)
            if not self._initialized or algo == "current":
                est = self._cold_estimate(cold_amax().to(torch.float32))
                return self._scale_of(est), est
            return self._cur_scale, self._cur_est
        k = _lookup(self._interval_sched, step)
        new_unit = True
        if self._step_mode:
            new_unit = self._pending_step != step
            if new_unit and self._initialized:
                self._append(self.pending, self.pending_valid)
                self.pending.zero_()
                self.pending_valid.zero_()
            self._pending_step = step
        if algo == "current":  # a cold start on every call, from the local amax
            est = self._cold_estimate(cold_amax().to(torch.float32))
            self._set_block(est, self._scale_of(est))
            self._block_len, self._block_algo = k, algo
            self._initialized = True
        elif not self._initialized:
            est = self._cold_estimate(self._reduce(cold_amax()))
            self._set_block(est, self._scale_of(est))
            self._block_len, self._block_algo = k, algo
            self._initialized = True
        elif new_unit:
            if algo != self._block_algo or k != self._block_len or self._block_j + 1 >= self._block_len:
                self._refresh(algo, k)
            else:
                self._select_block(self._block_j + 1)
        return self._cur_scale, self._cur_est

    def _want_stats(self) -> bool:
        c = self.config
        if c.telemetry_stats_every > 0 and self._calls % c.telemetry_stats_every == 0:
            return True
        return c.telemetry_dump_every > 0 and self._step % c.telemetry_dump_every == 0

    def _end_call(self, amax: torch.Tensor, est: torch.Tensor, scale: torch.Tensor,
                  x: torch.Tensor | None) -> None:
        """Record this call's amax (history + telemetry). Frozen scalers do not all-reduce: evaluation may run
        on one rank only."""
        amax = amax.to(torch.float32) if self._frozen else self._reduce(amax)
        finite = amax < math.inf  # amax >= 0 or NaN: false for NaN and inf
        if not self._frozen:
            if self._step_mode:
                torch.where(finite, torch.maximum(self.pending, amax), self.pending, out=self.pending)
                self.pending_valid.logical_or_(finite)
            else:
                self._append(amax, finite)
        # telemetry (fmax ignores NaN; an inf amax shows as an inf ratio)
        ratio = amax / est
        torch.fmax(self.tel_max, torch.stack((ratio, self.tel_max[1], amax.to(torch.float64))),
                   out=self.tel_max)
        self.tel_cnt[::2].add_(torch.stack((ratio > 1, ~finite)))
        self.last.update(amax=amax, estimate=est, ratio=ratio, scale=scale)
        if x is not None and self._want_stats():
            ax = x.detach().abs().to(torch.float32).mul_(scale)
            exceed = (ax > self.target).to(torch.float32).mean()
            clipped = _formats().clipped_count(x, scale, self.fmt)
            self.tel_max[1:2].copy_(torch.fmax(self.tel_max[1:2], exceed.reshape(1)))
            self.tel_cnt[1:2].add_(clipped.reshape(1))
            self.last["exceed_frac"], self.last["clipped"] = exceed, clipped
            self._tel_stat_calls += 1
        self._calls += 1
        self._tel_calls += 1

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize ``x`` with the delayed (or just-in-time) scale; record its amax."""
        scale, est = self._begin_call(lambda: x.abs().amax().to(torch.float32))
        y, amax = _qdq_amax(x, scale, self.fmt, self.rounding, self.config.saturate)
        self._end_call(amax, est, scale, x)
        return y

    @torch.no_grad()
    def observe_amax(self, amax: float | torch.Tensor) -> torch.Tensor:
        """Run one call with a known amax and no tensor (replay); returns the scale it used."""
        a = torch.as_tensor(amax, dtype=torch.float32, device=self.history.device).reshape(())
        scale, est = self._begin_call(lambda: a)
        scale = scale.clone()
        self._end_call(a, est, scale, None)
        return scale

    # -- telemetry ---------------------------------------------------------------------------------
    def telemetry_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tel_max [3] float64, tel_cnt [3] int64) since the last reset_telemetry; see _TEL_MAX/_TEL_CNT."""
        return self.tel_max, self.tel_cnt

    def telemetry_calls(self) -> tuple[int, int]:
        """(calls, calls with exceed/clipped statistics) since the last reset_telemetry."""
        return self._tel_calls, self._tel_stat_calls

    @torch.no_grad()
    def reset_telemetry(self) -> None:
        self.tel_max.zero_()
        self.tel_cnt.zero_()
        self._tel_calls = 0
        self._tel_stat_calls = 0

    def telemetry_record(self) -> dict[str, Any]:
        """Per-scaler telemetry (host sync): last call values and the accumulators."""
        def f(t):
            return None if t is None else float(t.item())

        rec: dict[str, Any] = {k: f(v) for k, v in self.last.items()}
        rec.update({k: float(v) for k, v in zip(_TEL_MAX, self.tel_max.tolist())})
        rec.update({k: int(v) for k, v in zip(_TEL_CNT, self.tel_cnt.tolist())})
        rec.update(calls=self._tel_calls, stats_calls=self._tel_stat_calls,
                   history_count=min(int(self.total.item()), self.history.numel()),
                   algo=self._block_algo, interval=self._block_len)
        return rec

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if destination is not None or args:
            # called by an enclosing module: scaler state is not part of the model's weights
            return destination
        meta = [int(self._initialized), self._block_j, self._block_len,
                ALGOS.index(self._block_algo) if self._block_algo else -1, self._step,
                -1 if self._pending_step is None else self._pending_step, int(self._frozen), self._calls,
                self._seen_total]
        sd = {
            "history": self.history.detach().clone(),
            "total": self.total.detach().clone(),
            "pending": self.pending.detach().clone(),
            "pending_valid": self.pending_valid.detach().clone(),
            "scale_block": self.scale_block.detach().clone(),
            "est_block": self.est_block.detach().clone(),
            "meta": torch.tensor(meta, dtype=torch.int64),
        }
        if self._forecaster is not None:
            sd.update(self._forecaster.state_tensors())
        return sd

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        check_state_keys(state_dict, strict, f"DelayedScaler({self.role}).load_state_dict")
        if state_dict["history"].shape != self.history.shape:
            raise ValueError(f"DelayedScaler({self.role}): history_len mismatch: checkpoint "
                             f"{tuple(state_dict['history'].shape)} vs {tuple(self.history.shape)}")
        dev = self.history.device
        with torch.no_grad():
            for name in ("history", "total", "pending", "pending_valid"):
                getattr(self, name).copy_(state_dict[name].to(dev))
            self.scale_block = state_dict["scale_block"].to(device=dev, dtype=torch.float32).clone()
            self.est_block = state_dict["est_block"].to(device=dev, dtype=torch.float64).clone()
        m = dict(zip(_META, (int(v) for v in state_dict["meta"].tolist())))
        self._initialized = bool(m["initialized"])
        self._block_len = m["block_len"]
        self._block_algo = ALGOS[m["block_algo"]] if m["block_algo"] >= 0 else ""
        self._step = m["step"]
        self._pending_step = None if m["pending_step"] < 0 else m["pending_step"]
        self._frozen = bool(m["frozen"])
        self._calls, self._seen_total = m["calls"], m["seen_total"]
        self._select_block(m["block_j"])
        if "es_obs" in state_dict:
            self._forecaster = ExpSmoothForecaster(self._es_params)
            self._forecaster.load_state_tensors(state_dict)
        else:
            self._forecaster = None

    def extra_repr(self) -> str:
        c = self.config
        return (f"role={self.role}, format={self.fmt}, target={self.target}, algo={c.algo}, history_len={c.history_len}, "
                f"interval={c.interval}, unit={c.history_unit}")


def replay(amax_sequence: Sequence[float] | torch.Tensor, config: ScalingConfig | None = None, *,
           steps: Sequence[int] | None = None, role: str = "A",
           target: float | None = None) -> torch.Tensor:
    """Scales a :class:`DelayedScaler` would use for a recorded or synthetic amax trace.

    ``steps[i]`` (optional) is the optimizer step of call i (drives schedules and ``history_unit=step``).
    Runs the scaler's own call path (``_begin_call`` / ``_end_call``) without any tensor to quantize.
    Returns a float32 tensor with one scale per call.
    """
    seq = amax_sequence.tolist() if isinstance(amax_sequence, torch.Tensor) else list(amax_sequence)
    if steps is not None and len(steps) != len(seq):
        raise ValueError(f"replay: steps has {len(steps)} entries for {len(seq)} amaxes")
    scaler = DelayedScaler(role, config, target)
    out = []
    for i, a in enumerate(seq):
        if steps is not None:
            scaler.set_step(int(steps[i]))
        out.append(scaler.observe_amax(float(a)))
    return torch.stack(out) if out else torch.zeros(0)


__all__ = [
    "ALGOS", "AMAX_REDUCES", "ESTIMATORS", "GRAD_ROUNDINGS", "HISTORY_UNITS", "ROLES", "DelayedScaler",
    "ExpSmoothForecaster", "ExpSmoothParams", "ScalingConfig", "replay",
]
