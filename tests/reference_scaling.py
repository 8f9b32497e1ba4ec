"""Reference delayed scaler for tests: one quantizer, plain Python numbers, written from the contract.

The contract is docs/design.md, section 2 (delayed tensor scaling). This file restates it as directly as
possible, so that the fast implementation (``hif8qat.scaling.bank`` with ``hif8qat.scaling.rules`` and
``hif8qat.scaling.forecast``) can be checked against it, as Transformer Engine and torchao keep their reference scalers
with their tests. It imports none of the scaling code it checks: only ``ScalingConfig`` (the settings and their step
schedules) and ``hif8qat.formats.qdq`` (the element formats: the qdq kernel, targets, the clipped-value count).

State is Python lists and floats (the history is the list of the last ``history_len`` finite amaxes, each a
float32 value; estimates are float64; a scale is ``float32(target / (estimate + 1e-12))``); tensors are made
only at the interface (``scale``, ``state_dict``, ...), in the per-quantizer saved-state format the bank
writes. Slow and host-synchronising on purpose; single process (no ``amax_reduce`` collective).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch
from torch import nn

from hif8qat.formats import qdq as formats
from hif8qat.scaling.settings import ScalingConfig

ALGOS = ("max", "most_recent", "mean", "exp_smooth", "current")  # index = saved ``block_algo``
CANDIDATES = ("most_recent", "damped_holt", "trend_following", "ar1")  # saved ``es_scores`` order


def f32(v: float) -> float:
    """Round a Python float to the nearest float32 value (ties to even)."""
    return float(np.float32(v))


def scale_for(target: float, estimate: float) -> float:
    return f32(target / (estimate + 1e-12))


def cold(amax: float) -> float:
    """Cold-start estimate: the call's own amax, or 1.0 when it is NaN, inf or <= 0 (the authors' fallback)."""
    return amax if 0 < amax < math.inf else 1.0


def _at(schedule, step: int):
    """Value of ``{step: value}`` (or a plain value) at ``step``: that of the largest key <= step."""
    if not isinstance(schedule, dict):
        return schedule
    return schedule[max(k for k in schedule if k <= step)]


# ---------------------------------------------------------------------------------------------- exp_smooth
class Forecaster:
    """exp_smooth: log-space forecast of the next ``horizon`` amaxes, restated from the contract."""

    MIN_OBS, LONG, CV_EVERY, CV_WINDOW, DAMP = 20, 200, 5, 40, 0.9

    def __init__(self, role: str):
        g = role == "G"  # the gradients use the authors' "D" parameter set
        self.alpha, self.temp, self.clip_sigma = (0.6, 10.0, 2.5) if g else (0.5, 5.0, 3.0)
        self.beta = 0.08
        self.obs: list[float] = []  # log amax of the finite, positive amaxes seen, the last 200
        self.n_forecasts, self.last_cv_at = 0, -1
        self.scores: dict[str, float] = {}

    def observe(self, amaxes) -> None:
        self.obs += [math.log(a) for a in amaxes if 0 < a < math.inf]
        self.obs = self.obs[-self.LONG:]

    # -- the four candidates: forecasts for horizons 1..h from the log series z
    def _damped(self, h: int) -> list[float]:
        """Cumulative damping 0.9 + 0.9^2 + ... + 0.9^i for i = 1..h."""
        out, acc = [], 0.0
        for i in range(1, h + 1):
            acc += self.DAMP ** i
            out.append(acc)
        return out

    def most_recent(self, z, h):
        return [z[-1]] * h

    def damped_holt(self, z, h):
        if len(z) < 5:
            return self.most_recent(z, h)
        alpha, beta = self.alpha, self.beta
        if len(z) >= 30:  # smoothing from the volatility of the last 30 log differences
            diffs = [b - a for a, b in zip(z[-30:], z[-29:])]
            v = min(max(statistics.pstdev(diffs) / 0.3, 0.0), 1.0)
            alpha, beta = 0.4 + 0.5 * v, 0.05 + 0.15 * v
        seg = z[-50:]
        level, trend = seg[0], 0.0
        for y in seg[1:]:
            pred = level + self.DAMP * trend
            a = 0.9 if abs(y - pred) > 0.3 else alpha  # a spike: follow it fast
            new_level = a * y + (1 - a) * pred
            trend = beta * (new_level - level) + (1 - beta) * self.DAMP * trend
            level = new_level
        return [level + c * trend for c in self._damped(h)]

    def trend_following(self, z, h):
        if len(z) < 30:
            return self.most_recent(z, h)
        y = z[-30:]
        ym = sum(y) / 30
        xs = [i - 14.5 for i in range(30)]  # centred 0..29
        slope = sum(x * (v - ym) for x, v in zip(xs, y)) / sum(x * x for x in xs)
        return [z[-1] + slope * c for c in self._damped(h)]

    def ar1(self, z, h):
        fit = z[-50:]
        if len(fit) < 10:
            return self.most_recent(z, h)
        x, y = fit[:-1], fit[1:]
        xm, ym = sum(x) / len(x), sum(y) / len(y)
        phi = sum((a - xm) * (b - ym) for a, b in zip(x, y)) / (sum((a - xm) ** 2 for a in x) + 1e-15)
        phi = min(max(phi, -0.999), 0.999)
        mu = (ym - phi * xm) / (1 - phi) if abs(1 - phi) > 1e-6 else ym
        return [mu + phi ** i * (z[-1] - mu) for i in range(1, h + 1)]

    def _cross_validate(self, z, h) -> dict[str, float]:
        """Mean absolute log error of each candidate over the last 40 origins (>= 20 training points)."""
        errs = {c: [] for c in CANDIDATES}
        for t in range(max(self.MIN_OBS, len(z) - self.CV_WINDOW), len(z)):
            hh = min(h, len(z) - t)
            for c in CANDIDATES:
                pred = getattr(self, c)(z[:t], hh)
                errs[c].append(sum(abs(f - p) for f, p in zip(z[t:t + hh], pred)) / hh)
        return {c: sum(e) / len(e) for c, e in errs.items() if len(e) >= 3}

    def _combine(self, z, h) -> list[float]:
        names = [c for c in CANDIDATES if c in self.scores and math.isfinite(self.scores[c])]
        if len(names) < 2:
            return self.most_recent(z, h)
        base = self.scores.get("most_recent", math.inf)
        keep = [c for c in names if self.scores[c] <= base * 1.01]  # no worse than most recent (+1 %)
        if len(keep) < 2:
            keep = sorted(names, key=lambda c: self.scores[c])[:2]
        err = [self.scores[c] for c in keep]
        logits = [-e * self.temp / (sum(err) / len(err) + 1e-15) for e in err]
        w = [math.exp(v - max(logits)) for v in logits]
        w = [v / sum(w) for v in w]
        preds = [getattr(self, c)(z, h) for c in keep]
        return [sum(wi * p[i] for wi, p in zip(w, preds)) for i in range(h)]

    def forecast(self, window: list[float], h: int) -> list[float]:
        last = window[-1]
        if len(self.obs) < self.MIN_OBS:
            return [last] * h
        z = list(self.obs)
        if not self.scores or self.n_forecasts - self.last_cv_at >= self.CV_EVERY:
            self.scores, self.last_cv_at = self._cross_validate(z, h), self.n_forecasts
        preds = self._combine(z, h)
        recent = z[-60:]
        med = statistics.median(recent)
        spread = self.clip_sigma * 1.4826 * statistics.median([abs(v - med) for v in recent])
        preds = [min(max(p, med - spread), med + spread) for p in preds]
        self.n_forecasts += 1
        wmed = statistics.median(window)
        if wmed > 0:  # pull a forecast far above the history's median 10 % back toward it
            lm = math.log(wmed)
            preds = [lm + 0.9 * (p - lm) if p > lm + 0.1 else p for p in preds]
        lo_f, hi_f = (0.2, 3.0) if h <= 5 else (0.3, 2.5)
        lo, hi = max(lo_f * min(window), 1e-12), hi_f * max(window)
        # exp of a huge forecast overflows to inf and lands on hi either way; a NaN forecast -> the last amax
        return [last if math.isnan(p) else min(max(math.exp(min(p, 700.0)), lo), hi) for p in preds]

    def state(self) -> dict[str, torch.Tensor]:
        return {"es_obs": torch.tensor(self.obs, dtype=torch.float64),
                "es_meta": torch.tensor([self.n_forecasts, self.last_cv_at], dtype=torch.int64),
                "es_scores": torch.tensor([self.scores.get(c, math.nan) for c in CANDIDATES], dtype=torch.float64)}

    def load(self, sd) -> None:
        self.obs = sd["es_obs"].tolist()
        self.n_forecasts, self.last_cv_at = sd["es_meta"].tolist()
        self.scores = {c: v for c, v in zip(CANDIDATES, sd["es_scores"].tolist()) if not math.isnan(v)}


# ---------------------------------------------------------------------------------------------- the scaler
class DelayedScaler(nn.Module):
    """One quantizer's delayed scaling (an ``nn.Module`` only so that test layers can hold it)."""

    def __init__(self, role: str, config: ScalingConfig | None = None, target: float | None = None, *,
                 device=None):
        super().__init__()
        self.config = (config if config is not None else ScalingConfig()).validate()
        self.role = role
        self.fmt = formats.element_format(self.config.format, role)
        self.target = float(target) if target is not None else formats.target_for(self.config, role)
        self.rounding = self.config.grad_rounding if role == "G" else "ta"
        del device  # accepted for the common constructor signature; the state is Python numbers on the host
        self.step, self.frozen = 0, False
        self.reset()

    # -- controls
    def reset(self) -> None:
        """Forget the history: the next call is a cold start. Keeps step and frozen."""
        self.hist: list[float] = []
        self.n_appended = 0
        self.pending, self.pending_valid, self.pending_step = 0.0, False, -1
        self.initialized = False
        self.block_algo, self.block_len, self.block_j = "", 1, 0
        self.block_est, self.block_scale = [1.0], [self.target]
        self.forecaster: Forecaster | None = None
        self.seen = 0  # history entries already fed to the forecaster
        self.calls = 0
        self.reset_telemetry()
        self._last = dict.fromkeys(("amax", "estimate", "ratio", "scale", "exceed_frac", "clipped"), math.nan)

    def reset_telemetry(self) -> None:
        self.t_ratio_max = self.t_exceed_max = self.t_amax_max = 0.0
        self.n_ratio_gt1 = self.n_clipped = self.n_nonfinite = 0
        self.tel_calls = self.tel_stat_calls = 0

    def set_step(self, step: int) -> None:
        self.step = int(step)

    def freeze(self, frozen: bool = True) -> None:
        self.frozen = bool(frozen)

    # -- the rules
    def _current_estimate(self) -> float:
        return self.block_est[min(self.block_j, len(self.block_est) - 1)]

    def _current_scale(self) -> float:
        return self.block_scale[min(self.block_j, len(self.block_scale) - 1)]

    def _open_block(self, algo: str, k: int, ests: list[float], scales: list[float]) -> None:
        self.block_algo, self.block_len, self.block_j = algo, k, 0
        self.block_est, self.block_scale = ests, scales

    def _append(self, amax: float) -> None:
        self.hist = (self.hist + [amax])[-self.config.history_len:]
        self.n_appended += 1

    def _refresh(self, algo: str, k: int) -> None:
        """A new block: the estimate from the history before this call's amax."""
        if algo == "exp_smooth":
            self._refresh_exp_smooth(k)
            return
        h = self.hist
        est = {"max": max(h, default=0.0), "most_recent": h[-1] if h else 0.0,
               "mean": sum(h) / len(h) if h else 0.0}[algo]
        if est <= 0:  # nothing usable yet (empty or all-zero history): keep the previous estimate
            est = self._current_estimate()
        self._open_block(algo, k, [est], [scale_for(self.target, est)])

    def _refresh_exp_smooth(self, k: int) -> None:
        if self.forecaster is None:
            self.forecaster = Forecaster(self.role)
        new = min(self.n_appended - self.seen, len(self.hist))
        if new > 0:
            self.forecaster.observe(self.hist[-new:])
        self.seen = self.n_appended
        window = self.hist
        if not window or max(window) <= 0:
            ests = [self._current_estimate()] * k
            self._open_block("exp_smooth", k, ests, [scale_for(self.target, e) for e in ests])
            return
        ests = self.forecaster.forecast(window, k)
        med = statistics.median(window)
        med = med if med > 0 else max(window)
        s_med = self.target / (med + 1e-12)  # scales stay within [0.01, 100] x the median's (and <= 1e8)
        ests = [e if math.isfinite(e) and e > 0 else med for e in ests]
        scales = [f32(min(max(self.target / (e + 1e-12), 0.01 * s_med), min(100 * s_med, 1e8))) for e in ests]
        self._open_block("exp_smooth", k, ests, scales)

    def _begin(self, own_amax) -> tuple[float, float]:
        """(scale, estimate) of this call, chosen before its amax is recorded."""
        algo = _at(self.config.algo, self.step)
        if self.frozen:
            if not self.initialized or algo == "current":
                est = cold(own_amax())
                return scale_for(self.target, est), est
            return self._current_scale(), self._current_estimate()
        k = _at(self.config.interval, self.step)
        new_unit = True
        if self.config.history_unit == "step":
            new_unit = self.pending_step != self.step
            if new_unit and self.initialized and self.pending_valid:  # commit the previous step's maximum
                self._append(self.pending)
            if new_unit:
                self.pending, self.pending_valid = 0.0, False
            self.pending_step = self.step
        if algo == "current" or not self.initialized:
            est = cold(own_amax())
            self._open_block(algo, k, [est], [scale_for(self.target, est)])
            self.initialized = True
        elif new_unit:
            if algo != self.block_algo or k != self.block_len or self.block_j + 1 >= self.block_len:
                self._refresh(algo, k)
            else:
                self.block_j += 1
        return self._current_scale(), self._current_estimate()

    def _end(self, amax: float, est: float, scale: float, x: torch.Tensor | None) -> None:
        """Record this call's amax: history (finite only) and telemetry. Frozen scalers record nothing."""
        if self.frozen:
            return
        finite = amax < math.inf  # False for NaN too
        if finite and self.config.history_unit == "step":
            self.pending, self.pending_valid = max(self.pending, amax), True
        elif finite:
            self._append(amax)
        c = self.config
        stats = x is not None and ((c.telemetry_stats_every > 0 and self.calls % c.telemetry_stats_every == 0)
                                   or (c.telemetry_dump_every > 0 and self.step % c.telemetry_dump_every == 0))
        ratio = amax / est
        if not math.isnan(ratio):
            self.t_ratio_max = max(self.t_ratio_max, ratio)
            self.t_amax_max = max(self.t_amax_max, amax)
        self.n_ratio_gt1 += ratio > 1
        self.n_nonfinite += not finite
        self._last.update(amax=amax, estimate=est, ratio=ratio, scale=scale)
        if stats:
            ax = x.detach().abs().to(torch.float32) * scale
            exceed = float((ax > self.target).to(torch.float32).mean())
            clipped = int(formats.clipped_count(x, torch.tensor(scale, dtype=torch.float32), self.fmt))
            self.t_exceed_max = max(self.t_exceed_max, exceed)
            self.n_clipped += clipped
            self._last.update(exceed_frac=exceed, clipped=float(clipped))
            self.tel_stat_calls += 1
        self.calls += 1
        self.tel_calls += 1

    # -- calls
    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        amax = f32(x.detach().abs().max().item()) if x.numel() else 0.0
        scale, est = self._begin(lambda: amax)
        y, _ = formats.qdq_scaled_amax(x, torch.tensor(scale, dtype=torch.float32, device=x.device), self.fmt,
                                       self.rounding, saturate=self.config.saturate)
        self._end(amax, est, scale, x)
        return y

    def observe_amax(self, amax) -> torch.Tensor:
        """A call with a known amax and no tensor (replay); returns the scale it used."""
        if self.frozen:
            raise RuntimeError("observe_amax on a frozen scaler")
        a = f32(float(amax))
        scale, est = self._begin(lambda: a)
        self._end(a, est, scale, None)
        return torch.tensor(scale, dtype=torch.float32)

    # -- views
    @property
    def scale(self) -> torch.Tensor:
        return torch.tensor(self._current_scale(), dtype=torch.float32)

    @property
    def estimate(self) -> torch.Tensor:
        return torch.tensor(self._current_estimate(), dtype=torch.float64)

    @property
    def last(self) -> dict[str, torch.Tensor]:
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in self._last.items()}

    @property
    def _forecaster(self) -> Forecaster | None:
        return self.forecaster

    @property
    def tel_cnt(self) -> torch.Tensor:
        return torch.tensor([self.n_ratio_gt1, self.n_clipped, self.n_nonfinite], dtype=torch.int64)

    def history_values(self) -> list[float]:
        return list(self.hist)

    def telemetry_calls(self) -> tuple[int, int]:
        return self.tel_calls, self.tel_stat_calls

    def telemetry_record(self) -> dict:
        rec = {k: None if math.isnan(v) else v for k, v in self._last.items()}
        rec.update(amax_ratio_max=self.t_ratio_max, exceed_frac_max=self.t_exceed_max, amax_max=self.t_amax_max,
                   amax_ratio_gt1=self.n_ratio_gt1, clipped_count=self.n_clipped, nonfinite_count=self.n_nonfinite,
                   calls=self.tel_calls, stats_calls=self.tel_stat_calls, history_count=len(self.hist),
                   algo=self.block_algo, interval=self.block_len, format=self.fmt)
        return rec

    # -- saved state, in the per-quantizer format (keys and layout of hif8qat.scaling.settings.STATE_KEYS / META_FIELDS)
    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        if args or kwargs.get("destination") is not None:
            return kwargs.get("destination")  # called by an enclosing module: not part of the model's weights
        L = self.config.history_len
        meta = [int(self.initialized), self.block_j, self.block_len,
                ALGOS.index(self.block_algo) if self.block_algo else -1, self.step, self.pending_step,
                int(self.frozen), self.calls, self.seen]
        sd = {"history": torch.tensor([0.0] * (L - len(self.hist)) + self.hist, dtype=torch.float32),
              "total": torch.tensor(self.n_appended, dtype=torch.int64),
              "pending": torch.tensor(self.pending, dtype=torch.float32),
              "pending_valid": torch.tensor(self.pending_valid),
              "scale_block": torch.tensor(self.block_scale, dtype=torch.float32),
              "est_block": torch.tensor(self.block_est, dtype=torch.float64),
              "meta": torch.tensor(meta, dtype=torch.int64)}
        if self.forecaster is not None:
            sd.update(self.forecaster.state())
        return sd

    def load_state_dict(self, sd, strict: bool = True) -> None:
        m = sd["meta"].tolist()
        self.initialized, self.block_j, self.block_len = bool(m[0]), m[1], m[2]
        self.block_algo = ALGOS[m[3]] if m[3] >= 0 else ""
        self.step, self.pending_step, self.frozen, self.calls, self.seen = m[4], m[5], bool(m[6]), m[7], m[8]
        self.n_appended = int(sd["total"])
        self.hist = sd["history"].tolist()[len(sd["history"]) - min(self.n_appended, len(sd["history"])):]
        self.pending, self.pending_valid = float(sd["pending"]), bool(sd["pending_valid"])
        self.block_scale, self.block_est = sd["scale_block"].tolist(), sd["est_block"].tolist()
        self.forecaster = None
        if "es_obs" in sd:
            self.forecaster = Forecaster(self.role)
            self.forecaster.load(sd)


def replay(amax_sequence, config: ScalingConfig | None = None, *, steps=None, role: str = "A",
           target: float | None = None) -> torch.Tensor:
    """The scales of one reference scaler over an amax trace (``steps[i]``: the step of call i)."""
    seq = amax_sequence.tolist() if isinstance(amax_sequence, torch.Tensor) else list(amax_sequence)
    sc = DelayedScaler(role, config, target)
    out = []
    for i, a in enumerate(seq):
        if steps is not None:
            sc.set_step(steps[i])
        out.append(sc.observe_amax(a))
    return torch.stack(out) if out else torch.zeros(0)
