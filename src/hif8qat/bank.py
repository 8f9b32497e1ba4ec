"""Scaler bank: the delayed-scaling state of every 8-bit quantizer of a model in one table.

Same semantics as :class:`hif8qat.scaling.DelayedScaler` (the reference kept for tests; see its module
docstring for the rules), organised for speed and for ``torch.compile``:

* **One state table** for all quantizers (rows; one per layer and role A / W / G): history ``[n, L]``,
  entry counts, pending step maxima, current scales and estimates, exp_smooth blocks, telemetry.
* **One quantize kernel per call.** A quantizer call is the custom op ``hif8qat::bank_qdq``: it reads its
  row's scale, runs the fused qdq + amax kernel of :mod:`hif8qat.formats` and writes the amax into the
  table. The op is opaque to ``torch.compile`` (a fake implementation gives shapes), so a whole-model
  compile has no graph break from quantized linears; its Python body runs at call time, which is where
  the per-row bookkeeping lives (Python ints, no tensor ops).
* **One bank update per micro-batch**, queued by the first gradient-quantizer call to run when the
  backward pass ends (forward-only passes are flushed by the next call, :meth:`ScalerBank.update` or a
  state dict): one optional all-reduce of all amaxes (``amax_reduce=max``), then one vectorised append
  to the histories and the telemetry. The scales for the next micro-batch are computed in one vectorised
  pass at its first quantizer call (the step is known then); exp_smooth copies the table to the host
  once per refresh round for the whole model.

Micro-batch rules. Each quantizer is called once per micro-batch, so "the scale of a call comes from the
history before its own amax is appended" holds exactly as in the per-call reference. A second call of a
forward quantizer (A / W) during the backward pass is an activation-checkpointing recompute: it reuses
the forward's scale and records nothing. Any other second call in one micro-batch raises
:class:`QuantizerCalledTwice`. The quantized linear keeps its forward's quantized weight for the backward;
under FSDP the backward re-quantizes it with the forward's scale (``REPLAY``) instead. A call with
``keep=True`` (eager weight calls) leaves its result with the bank until the micro-batch ends, so that an
activation-checkpointing recompute of the same, unchanged tensor gets a copy of it instead of a second
quantization.

Frozen (evaluation) banks read their scales and record nothing, so they never communicate.

Formats. Each row quantizes to the element format of its role under ``config.format``
(:func:`hif8qat.formats.element_format`: ``hybrid`` is E4M3 for A and W, E5M2 for G) with that format's
target (:func:`hif8qat.formats.target_for`: HiF8 15, FP8 max / 2^margin) and clipped-value count (HiF8:
``|x*s| >= 40960``, FP8: ``|x*s| > max``).

Just-in-time scaling (``algo="current"``, also as a phase of a schedule): every call is a cold start, the
scale comes from the tensor's own amax (one amax pass, then the cast), computed locally (no collective per
call; the history still receives the amaxes, all-reduced by ``amax_reduce`` at the end of the micro-batch, so
telemetry and a later switch to a delayed estimator work). Frozen banks keep doing so: an evaluation of a
``current`` run scales every tensor from its own amax.
"""

from __future__ import annotations

import copy
import itertools
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hif8qat import formats
from hif8qat.errors import RunError
from hif8qat.scaling import (
    _FALLBACK_ESTIMATE,
    _META,
    _TEL_CNT,
    _TEL_MAX,
    ALGOS,
    EPS,
    EXP_SMOOTH_PARAMS,
    ROLES,
    ExpSmoothForecaster,
    ExpSmoothParams,
    ScalingConfig,
    _exp_smooth_block,
    _lookup,
    check_state_keys,
)

# op modes
RECORD = 0  # a training call (a backward pass is expected to end the micro-batch)
RECORD_NO_GRAD = 1  # a forward-only call (no backward will come: the next call ends the micro-batch)
REPLAY = 2  # the backward's re-quantization of the weight with the forward's scale: reads, records nothing


def _hif8_kernel(x: torch.Tensor, scale: torch.Tensor, rounding: str, saturate: bool, want_amax: bool,
                 out_dtype: torch.dtype | None = None):
    """Fused HiF8 ``qdq(x * scale) / scale`` (+ ``max|x|``): one kernel, arguments trusted (no checks)."""
    return formats._dispatch(x, scale, rounding, None, None, scaled=True, saturate=saturate, want_amax=want_amax,
                             site="bank", out_dtype=out_dtype)


def _fp8_kernel(fmt: str):
    def kernel(x: torch.Tensor, scale: torch.Tensor, rounding: str, saturate: bool, want_amax: bool,
               out_dtype: torch.dtype | None = None):
        """Fused saturating FP8 ``qdq(x * scale) / scale`` (+ ``max|x|``); rounding is always nearest-even
        (the config refuses another one for FP8) and the cast always saturates."""
        return formats._fp8_dispatch(x, scale, fmt, None, scaled=True, want_amax=want_amax, site="bank",
                                     out_dtype=out_dtype)
    return kernel


# Quantize kernels by element format: ``kernel(x, scale, rounding, saturate, want_amax, out_dtype=None) ->
# (y, amax or None)`` with ``scale`` a 0-d float32 tensor (x's device) and y in ``out_dtype`` (default x's,
# bit for bit the cast of the x-dtype result). Targets and clip thresholds come from formats.FORMATS.
FORMATS = {"hif8": _hif8_kernel, "e4m3": _fp8_kernel("e4m3"), "e5m2": _fp8_kernel("e5m2")}


def _amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as a 0-d float32 tensor in one pass (aminmax: |x| is never materialised); 0 for an empty x."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    mn, mx = torch.aminmax(x.detach())
    return torch.maximum(mx.float(), -mn.float())


class QuantizerCalledTwice(RunError):
    """A quantizer ran twice in one micro-batch outside an activation-checkpointing recompute."""


_BANKS: weakref.WeakValueDictionary[int, ScalerBank] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# --------------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("hif8qat::bank_qdq", mutates_args=())
def bank_qdq(x: torch.Tensor, bank_id: int, row: int, mode: int, out_dtype: torch.dtype | None = None,
             keep: bool = False) -> torch.Tensor:
    """Fake-quantize ``x`` with row ``row`` of bank ``bank_id`` (see the module docstring); the result in
    ``out_dtype`` (default x's: the kernel writes it, no separate cast pass). ``keep``: see the module
    docstring; only for eager callers (a compiled graph may reuse the memory of a result it deems dead).

    Declared pure: its only side effect is on the bank's tables, which nothing inside a compiled graph
    reads (they are read by this op at call time and by the bank between micro-batches).
    """
    return _BANKS[bank_id].quantize(x, row, mode, out_dtype, keep)


@bank_qdq.register_fake
def _(x, bank_id, row, mode, out_dtype=None, keep=False):
    return torch.empty_like(x, dtype=out_dtype or x.dtype)


# --------------------------------------------------------------------------------------------------
# the bank
# --------------------------------------------------------------------------------------------------
class ScalerBank(nn.Module):
    """Delayed-scaling state of ``len(roles)`` quantizers sharing one :class:`ScalingConfig`.

    Tables are plain tensor attributes, not buffers: they follow the model's device moves (``_apply``)
    but never its dtype casts, stay out of ``state_dict()`` and are never broadcast by DDP. Per-row
    bookkeeping is in numpy arrays. ``row_state_dict`` / ``load_row_state_dict`` use the reference
    scaler's per-quantizer format, so exports and checkpoints written before the bank load unchanged.
    """

    def __init__(self, config: ScalingConfig | None = None, roles: Sequence[str] = ROLES, *,
                 device: torch.device | str | None = None):
        super().__init__()
        config = config if config is not None else ScalingConfig()
        config.validate()
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise ValueError(f"ScalerBank: roles {bad} are invalid; allowed: {ROLES}")
        self.config = config
        self.roles = list(roles)
        n, L = len(self.roles), int(config.history_len)
        self.n = n
        self._algo_sched = config.algo_schedule()
        self._interval_sched = config.interval_schedule()
        self._step_mode = config.history_unit == "step"
        self._kmax = max(k for _, k in self._interval_sched) if config.uses("exp_smooth") else 1
        self._uses_current = config.uses("current")
        self.formats = [formats.element_format(config.format, r) for r in self.roles]  # element format per row
        self._kernels = [FORMATS[f] for f in self.formats]
        specs = [formats.format_spec(f) for f in self.formats]
        self._clip = [(s.clip_threshold, s.clip_inclusive) for s in specs]
        self._targets = [formats.target_for(config, r) for r in self.roles]
        self._rounding = [config.grad_rounding if r == "G" else "ta" for r in self.roles]
        self._is_g = np.array([r == "G" for r in self.roles])
        dev = torch.device(device) if device is not None else torch.device("cpu")
        f32, f64, i64 = torch.float32, torch.float64, torch.int64
        self.target = torch.tensor(self._targets, dtype=f64, device=dev)
        self.history = torch.zeros(n, L, dtype=f32, device=dev)
        self.total = torch.zeros(n, dtype=i64, device=dev)
        self.pending = torch.zeros(n, dtype=f32, device=dev)
        self.pending_valid = torch.zeros(n, dtype=torch.bool, device=dev)
        self.scale = self.target.to(f32)  # scale of the current (or last) call per row
        self.est = torch.ones(n, dtype=f64, device=dev)  # the estimate behind it
        self.blk_scale = torch.zeros(n, self._kmax, dtype=f32, device=dev)  # exp_smooth blocks
        self.blk_est = torch.zeros(n, self._kmax, dtype=f64, device=dev)
        self.amax = torch.zeros(n, dtype=f32, device=dev)  # this micro-batch's amax per row
        # telemetry since the last reset_telemetry (see scaling._TEL_MAX / _TEL_CNT), last call values
        self.tel_max = torch.zeros(n, 3, dtype=f64, device=dev)
        self.tel_cnt = torch.zeros(n, 3, dtype=i64, device=dev)
        self.last_vals = torch.full((n, 4), math.nan, dtype=f64, device=dev)  # amax, estimate, ratio, scale
        self.last_stats = torch.full((n, 2), math.nan, dtype=f64, device=dev)  # exceed_frac, clipped
        self._views()
        self.step = 0
        self.frozen = False
        self._forecasters: list[ExpSmoothForecaster | None] = [None] * n
        self._reset_rows(np.ones(n, dtype=bool))
        self._mb_reset()
        self.bank_id = next(_IDS)
        _BANKS[self.bank_id] = self

    # -- plumbing ------------------------------------------------------------------------------------
    def _views(self) -> None:
        # 0-d views the kernels read and write: no indexing op per call
        self._scale_rows = list(self.scale.unbind())
        self._amax_rows = list(self.amax.unbind())

    _TABLES = ("target", "history", "total", "pending", "pending_valid", "scale", "est", "blk_scale", "blk_est",
               "amax", "tel_max", "tel_cnt", "last_vals", "last_stats")

    @property
    def device(self) -> torch.device:
        return self.history.device

    def _apply(self, fn, recurse=True):
        # follow device moves of the enclosing model, never its dtype casts (scales stay fp32 / fp64)
        dev = fn(torch.zeros(1, dtype=torch.float32, device=self.device)).device
        if dev != self.device:
            for name in self._TABLES:
                setattr(self, name, getattr(self, name).to(dev))
            self._views()
        return self

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = copy.deepcopy(v, memo)
        new._views()
        new.bank_id = next(_IDS)  # a copy is a different bank for the op
        _BANKS[new.bank_id] = new
        return new

    def __getstate__(self):
        raise TypeError("ScalerBank is not picklable; save its state with hif8qat.qlinear.quant_state_dict")

    def _reset_rows(self, rows: np.ndarray) -> None:
        """Python state of a fresh (cold) row."""
        if not hasattr(self, "initialized"):
            n = self.n
            self.initialized = np.zeros(n, dtype=bool)
            self.block_j = np.zeros(n, dtype=np.int64)
            self.block_len = np.ones(n, dtype=np.int64)
            self.block_algo = np.full(n, -1, dtype=np.int64)
            self.blk_size = np.ones(n, dtype=np.int64)  # 1: scale/est hold the block; > 1: exp_smooth block
            self.pending_step = np.full(n, -1, dtype=np.int64)
            self.calls = np.zeros(n, dtype=np.int64)
            self.seen_total = np.zeros(n, dtype=np.int64)
            self.tel_calls = np.zeros(n, dtype=np.int64)
            self.tel_stat_calls = np.zeros(n, dtype=np.int64)
        self.initialized[rows] = False
        self.block_j[rows] = 0
        self.block_len[rows] = 1
        self.block_algo[rows] = -1
        self.blk_size[rows] = 1
        self.pending_step[rows] = -1
        self.calls[rows] = 0
        self.seen_total[rows] = 0
        self.tel_calls[rows] = 0
        self.tel_stat_calls[rows] = 0
        for r in np.flatnonzero(rows):
            self._forecasters[r] = None

    def _mb_reset(self) -> None:
        self._mb_calls = np.zeros(self.n, dtype=np.int64)
        self._prepared = np.zeros(self.n, dtype=bool)
        self._snap: dict[str, Any] | None = None
        self._mb_open = False
        self._mb_grad = False
        self._callback_queued = False
        self._kept: dict[int, tuple[torch.Tensor, tuple]] = {}  # results of keep=True calls (see quantize)

    # -- public controls -----------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        self.step = int(step)

    def freeze(self, frozen: bool = True) -> None:
        """Frozen: quantize with the current scales, record nothing, communicate nothing."""
        if frozen:
            self.update()
        self.frozen = bool(frozen)

    @torch.no_grad()
    def reset(self, rows: Sequence[int] | np.ndarray | None = None) -> None:
        """Forget the history of ``rows`` (default all): the next call is a cold start. Keeps step, frozen."""
        self.update()
        mask = np.zeros(self.n, dtype=bool)
        mask[np.arange(self.n) if rows is None else np.asarray(rows, dtype=np.int64)] = True
        m = torch.from_numpy(mask).to(self.device)
        for name, value in (("history", 0), ("total", 0), ("pending", 0), ("pending_valid", False),
                            ("est", 1.0), ("blk_scale", 0), ("blk_est", 0), ("tel_max", 0), ("tel_cnt", 0),
                            ("last_vals", math.nan), ("last_stats", math.nan)):
            t = getattr(self, name)
            t.masked_fill_(m.view(-1, *([1] * (t.dim() - 1))), value)
        self.scale.copy_(torch.where(m, self.target.to(torch.float32), self.scale))
        self._reset_rows(mask)

    # -- the call ------------------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, row: int, mode: int, out_dtype: torch.dtype | None = None,
                 keep: bool = False) -> torch.Tensor:
        """One quantizer call (the body of ``hif8qat::bank_qdq``)."""
        if mode == REPLAY or self.frozen:
            return self._qdq(x, row, self._call_scale(x, row) if self.frozen else self._scale_rows[row], out_dtype)
        if self._mb_calls[row]:
            if _in_backward() and not self._is_g[row]:  # checkpoint recompute: the forward's scale
                kept = self._kept.pop(row, None)
                if kept is not None and kept[1] == (x.data_ptr(), x._version, x.shape, out_dtype):
                    # the forward's tensor, unchanged: a copy of its result (an op returns a fresh tensor)
                    # instead of a second quantization
                    return kept[0].clone()
                return self._qdq(x, row, self._scale_rows[row], out_dtype)
            if self._mb_grad:
                raise QuantizerCalledTwice(
                    f"HiF8 quantizer {self.row_name(row)} was called twice in one micro-batch; its amax history "
                    "would be updated twice. Each quantized layer may run once per forward/backward (a module "
                    "reused inside one forward cannot be quantized), activation checkpointing recomputes "
                    "during the backward only; a forward whose backward never ran must be followed by "
                    "hif8qat.qlinear.update_scales(model) (or use freeze_scales(model) for evaluation)")
            self.update()  # forward-only micro-batches end at the next call
        return self._record_call(x, row, mode, out_dtype, keep)

    def observe(self, row: int, amax: torch.Tensor) -> torch.Tensor:
        """A call with a known amax and no tensor (replay); returns the scale it used."""
        a = amax.to(device=self.device, dtype=torch.float32).reshape(())
        self._begin(row, RECORD_NO_GRAD, lambda: a, self._current_now())
        scale = self._scale_rows[row].clone()
        self._amax_rows[row].copy_(a)
        self._mb_calls[row] += 1
        return scale

    def _record_call(self, x: torch.Tensor, row: int, mode: int, out_dtype: torch.dtype | None = None,
                     keep: bool = False) -> torch.Tensor:
        own = None
        if self._current_now():  # just in time: the amax pass first, then the cast with the scale from it
            own = _amax(x)
            self._begin(row, mode, lambda: own, True)
        else:
            self._begin(row, mode, lambda: x.detach().abs().amax().to(torch.float32))
        c = self.config
        stats = ((c.telemetry_stats_every > 0 and self.calls[row] % c.telemetry_stats_every == 0)
                 or (c.telemetry_dump_every > 0 and self.step % c.telemetry_dump_every == 0))
        scale = self._scale_rows[row]
        y, amax = self._kernels[row](x, scale, self._rounding[row], c.saturate, own is None, out_dtype)
        self._amax_rows[row].copy_(amax if own is None else own)
        self._mb_calls[row] += 1
        if keep and mode == RECORD:  # for a checkpoint recompute (see quantize)
            self._kept[row] = (y, (x.data_ptr(), x._version, x.shape, out_dtype))
        if stats:
            self._stats(x, row, scale)
        if self._is_g[row] and not self._callback_queued and _in_backward():
            torch.autograd.Variable._execution_engine.queue_callback(self.update)
            self._callback_queued = True
        return y

    def _qdq(self, x, row, scale, out_dtype=None):
        return self._kernels[row](x, scale, self._rounding[row], self.config.saturate, False, out_dtype)[0]

    def _current_now(self) -> bool:
        """Whether the algorithm at the current step is just-in-time scaling."""
        return self._uses_current and _lookup(self._algo_sched, self.step) == "current"

    just_in_time = property(_current_now, doc="Whether calls at the current step scale from their own amax.")

    def _call_scale(self, x, row) -> torch.Tensor:
        """Frozen: the row's scale; a row that never ran, or any row under ``current``, takes the scale from
        this tensor's own amax (local)."""
        if self.initialized[row] and not self._current_now():
            return self._scale_rows[row]
        est = self._cold_estimate(_amax(x))
        return torch.div(self._targets[row], est + EPS).to(torch.float32)

    @staticmethod
    def _cold_estimate(amax: torch.Tensor) -> torch.Tensor:
        est = amax.to(torch.float64)
        return torch.where((est > 0) & (est < math.inf), est, torch.full_like(est, _FALLBACK_ESTIMATE))

    def _reduce_(self, amax: torch.Tensor) -> torch.Tensor:
        if self.config.amax_reduce == "max" and _dist_active():
            amax = torch.where(torch.isnan(amax), torch.full_like(amax, math.inf), amax).clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        return amax

    def _begin(self, row: int, mode: int, cold_amax, current: bool = False) -> None:
        """Pick the row's scale for this call (before its amax is known; ``current``: from ``cold_amax``)."""
        if not self._mb_open:
            self._mb_open = True
            self._mb_grad = mode == RECORD
        if not self._prepared[row]:  # a training micro-batch prepares the gradient rows too (one pass)
            self._prepare(row, both=mode == RECORD)
        if current or not self.initialized[row]:
            # cold start from this call's own amax (reduced across ranks; opens a block), or just-in-time
            # scaling: a cold start on every call, from the local amax (no collective per call)
            a = cold_amax().reshape(())
            est = self._cold_estimate(a if current else self._reduce_(a.reshape(1)).reshape(()))
            self.est[row] = est
            self._scale_rows[row].copy_(torch.div(self._targets[row], est + EPS).to(torch.float32))
            if current and self.initialized[row]:
                return
            self.initialized[row] = True
            self.block_algo[row] = ALGOS.index(_lookup(self._algo_sched, self.step))
            self.block_len[row] = _lookup(self._interval_sched, self.step)
            self.block_j[row] = 0
            self.blk_size[row] = 1

    # -- per micro-batch -------------------------------------------------------------------------------
    def _prepare(self, row: int, both: bool) -> None:
        """Scales of this micro-batch in one pass: for every row (``both``), or the row's group (forward
        rows A / W, or gradient rows G) when no backward is expected.

        Decisions are numpy; tensor work is a handful of whole-table ops. Rows prepared but not called by
        the end of the micro-batch are rolled back in :meth:`update`.
        """
        group = (np.ones(self.n, dtype=bool) if both else self._is_g == self._is_g[row]) & ~self._prepared
        self._prepared |= group
        if self._snap is None:
            self._snap = {"py": {k: getattr(self, k).copy() for k in
                                 ("initialized", "block_j", "block_len", "block_algo", "blk_size", "pending_step",
                                  "seen_total")},
                          "t": {k: getattr(self, k).clone() for k in
                                ("history", "total", "pending", "pending_valid", "scale", "est", "blk_scale",
                                 "blk_est")},
                          "fc": None}
        step = self.step
        algo = _lookup(self._algo_sched, step)
        ai, k = ALGOS.index(algo), _lookup(self._interval_sched, step)
        init = group & self.initialized
        new_unit = np.ones(self.n, dtype=bool)
        if self._step_mode:
            new_unit = self.pending_step != step
            commit = new_unit & init
            if commit.any():
                m = torch.from_numpy(commit).to(self.device)
                self._append(self.pending, self.pending_valid & m)
                self.pending = self.pending.masked_fill(m, 0.0)
                self.pending_valid = self.pending_valid & ~m
            self.pending_step[group] = step
        live = init & new_unit
        refresh = live & ((self.block_algo != ai) | (self.block_len != k) | (self.block_j + 1 >= self.block_len)
                          | (algo == "current"))  # under current every unit opens a block: the call sets the scale
        advance = live & ~refresh
        self.block_j[advance] += 1
        self.block_j[refresh] = 0
        self.block_algo[refresh] = ai
        self.block_len[refresh] = k
        es_adv = advance & (self.blk_size > 1)
        if refresh.any():
            if algo == "exp_smooth":
                self._refresh_exp_smooth(refresh, k)
            elif algo == "current":
                self.blk_size[refresh] = 1
            else:
                self.blk_size[refresh] = 1
                est = self._history_estimate(algo)
                est = torch.where(est > 0, est, self.est)
                self._set_rows(refresh, est, torch.div(self.target, est + EPS).to(torch.float32))
        if es_adv.any():
            j = torch.from_numpy(np.minimum(self.block_j, self.blk_size - 1)).to(self.device).view(-1, 1)
            self._set_rows(es_adv, self.blk_est.gather(1, j).view(-1), self.blk_scale.gather(1, j).view(-1))

    def _mask(self, rows: np.ndarray) -> torch.Tensor | bool:
        return True if rows.all() else torch.from_numpy(rows).to(self.device)

    def _set_rows(self, rows: np.ndarray, est: torch.Tensor, scale: torch.Tensor) -> None:
        if rows.all():
            self.est = est.clone()
            self.scale.copy_(scale)
        else:
            m = self._mask(rows)
            self.est = torch.where(m, est, self.est)
            self.scale.copy_(torch.where(m, scale, self.scale))

    def _append(self, value: torch.Tensor, ok: torch.Tensor) -> None:
        shifted = torch.cat((self.history[:, 1:], value.view(-1, 1)), dim=1)
        self.history = torch.where(ok.view(-1, 1), shifted, self.history)
        self.total = self.total + ok

    def _history_estimate(self, algo: str) -> torch.Tensor:
        if algo == "max":
            return self.history.amax(1).to(torch.float64)
        if algo == "most_recent":
            return self.history[:, -1].to(torch.float64)
        n = self.total.clamp(1, self.history.shape[1])
        return self.history.sum(1, dtype=torch.float64) / n

    def _refresh_exp_smooth(self, rows: np.ndarray, k: int) -> None:
        """Host forecasts for ``rows``: one device-to-host copy for the whole bank, one copy back."""
        L = self.history.shape[1]
        host = torch.cat((self.history.double().flatten(), self.total.double(), self.est)).cpu().numpy()
        hist, total, cur = host[: self.n * L].reshape(self.n, L), host[self.n * L: self.n * (L + 1)], host[-self.n:]
        if self._snap["fc"] is None:
            self._snap["fc"] = copy.deepcopy(self._forecasters)
        idx = np.flatnonzero(rows)
        ests = np.zeros((len(idx), self._kmax))
        scales = np.zeros((len(idx), self._kmax))
        for i, r in enumerate(idx):
            t = int(total[r])
            n_hist = min(t, L)
            window = hist[r, L - n_hist:].tolist() if n_hist else []
            if self._forecasters[r] is None:
                self._forecasters[r] = ExpSmoothForecaster(EXP_SMOOTH_PARAMS.get(self.roles[r], ExpSmoothParams()))
            e, s = _exp_smooth_block(self._forecasters[r], window, t - int(self.seen_total[r]), float(cur[r]),
                                     self._targets[r], k)
            self.seen_total[r] = t
            ests[i, :k], scales[i, :k] = e, s
        ix = torch.from_numpy(idx).to(self.device)
        self.blk_est = self.blk_est.index_copy(0, ix, torch.from_numpy(ests).to(self.device))
        self.blk_scale = self.blk_scale.index_copy(
            0, ix, torch.from_numpy(scales).to(device=self.device, dtype=torch.float32))
        self.blk_size[rows] = k
        self._set_rows(rows, self.blk_est[:, 0], self.blk_scale[:, 0])

    @torch.no_grad()
    def update(self) -> None:
        """End the micro-batch: record the amaxes of the rows that ran (see the module docstring)."""
        called = self._mb_calls > 0
        if self._snap is not None and (self._prepared & ~called).any():
            self._rollback(self._prepared & ~called)
        if not called.any():
            self._mb_reset()
            return
        cm = self._mask(called)
        amax = self._reduce_(self.amax)
        finite = amax < math.inf  # false for NaN and inf
        ok = finite & cm
        if self._step_mode:
            self.pending = torch.where(ok, torch.maximum(self.pending, amax), self.pending)
            self.pending_valid = self.pending_valid | ok
        else:
            self._append(amax, ok)
        ratio = amax / self.est
        amax64 = amax.to(torch.float64)
        new_max = torch.fmax(self.tel_max, torch.stack((ratio, self.tel_max[:, 1], amax64), dim=1))
        cnt = torch.stack(((ratio > 1), torch.zeros_like(finite), ~finite), dim=1)
        last = torch.stack((amax64, self.est, ratio, self.scale.to(torch.float64)), dim=1)
        if cm is True:
            self.tel_max, self.last_vals = new_max, last
        else:
            self.tel_max = torch.where(cm.view(-1, 1), new_max, self.tel_max)
            self.last_vals = torch.where(cm.view(-1, 1), last, self.last_vals)
            cnt &= cm.view(-1, 1)
        self.tel_cnt += cnt
        self.calls += called
        self.tel_calls += called
        self._mb_reset()

    def _rollback(self, rows: np.ndarray) -> None:
        snap = self._snap
        for k, v in snap["py"].items():
            getattr(self, k)[rows] = v[rows]
        m = torch.from_numpy(rows).to(self.device)
        for k, v in snap["t"].items():
            cur = getattr(self, k)
            new = torch.where(m.view(-1, *([1] * (cur.dim() - 1))), v, cur)
            if k == "scale":
                self.scale.copy_(new)
            else:
                setattr(self, k, new)
        if snap["fc"] is not None:
            for r in np.flatnonzero(rows):
                self._forecasters[r] = snap["fc"][r]

    def _stats(self, x: torch.Tensor, row: int, scale: torch.Tensor) -> None:
        ax = x.detach().abs().to(torch.float32).mul_(scale)
        exceed = (ax > self._targets[row]).to(torch.float32).mean().to(torch.float64)
        threshold, inclusive = self._clip[row]  # formats.clipped_count's rule, on the |x*s| computed here
        clipped = (ax >= threshold if inclusive else ax > threshold).sum()
        self.tel_max[row, 1] = torch.fmax(self.tel_max[row, 1], exceed)
        self.tel_cnt[row, 1] += clipped
        self.last_stats[row] = torch.stack((exceed, clipped.to(torch.float64)))
        self.tel_stat_calls[row] += 1

    # -- telemetry -----------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_telemetry(self) -> None:
        self.tel_max.zero_()
        self.tel_cnt.zero_()
        self.tel_calls[:] = 0
        self.tel_stat_calls[:] = 0

    def row_name(self, row: int) -> str:
        names = getattr(self, "_row_names", None)
        return names[row] if names else f"{self.roles[row]} (row {row})"

    def set_row_names(self, names: Sequence[str]) -> None:
        self._row_names = list(names)

    def telemetry_records(self) -> list[dict[str, Any]]:
        """Per-row telemetry (one host copy): last call values and the accumulators."""
        host = torch.cat((self.last_vals, self.last_stats, self.tel_max, self.tel_cnt.double(),
                          self.total.double().view(-1, 1)), dim=1).cpu().tolist()
        L = self.history.shape[1]
        out = []
        for r, v in enumerate(host):
            rec: dict[str, Any] = {k: (None if math.isnan(x) else x) for k, x in
                                   zip(("amax", "estimate", "ratio", "scale", "exceed_frac", "clipped"), v[:6])}
            rec.update({k: float(x) for k, x in zip(_TEL_MAX, v[6:9])})
            rec.update({k: int(x) for k, x in zip(_TEL_CNT, v[9:12])})
            rec.update(calls=int(self.tel_calls[r]), stats_calls=int(self.tel_stat_calls[r]),
                       history_count=min(int(v[12]), L),
                       algo=ALGOS[self.block_algo[r]] if self.block_algo[r] >= 0 else "", format=self.formats[r],
                       interval=int(self.block_len[r]))
            out.append(rec)
        return out

    # -- state (per row, in the reference scaler's format) ---------------------------------------------
    def _host(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).detach().cpu() for k in
                ("history", "total", "pending", "pending_valid", "scale", "est", "blk_scale", "blk_est")}

    def row_state_dict(self, row: int, host: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Row ``row``'s state as :meth:`DelayedScaler.state_dict` writes it (CPU tensors)."""
        self.update()
        h = host if host is not None else self._host()
        size = int(self.blk_size[row])
        if size > 1:
            sb, eb = h["blk_scale"][row, :size].clone(), h["blk_est"][row, :size].clone()
        else:
            sb, eb = h["scale"][row:row + 1].clone(), h["est"][row:row + 1].clone()
        meta = [int(self.initialized[row]), int(self.block_j[row]), int(self.block_len[row]),
                int(self.block_algo[row]), self.step, int(self.pending_step[row]), int(self.frozen),
                int(self.calls[row]), int(self.seen_total[row])]
        sd = {"history": h["history"][row].clone(), "total": h["total"][row].clone(),
              "pending": h["pending"][row].clone(), "pending_valid": h["pending_valid"][row].clone(),
              "scale_block": sb, "est_block": eb, "meta": torch.tensor(meta, dtype=torch.int64)}
        if self._forecasters[row] is not None:
            sd.update(self._forecasters[row].state_tensors())
        return sd

    def state_dicts(self) -> list[dict[str, torch.Tensor]]:
        self.update()
        host = self._host()
        return [self.row_state_dict(r, host) for r in range(self.n)]

    @torch.no_grad()
    def load_row_state_dicts(self, states: Mapping[int, Mapping[str, torch.Tensor]], strict: bool = True) -> None:
        """Restore rows from per-quantizer state dicts (this bank's or the reference scaler's)."""
        self.update()
        host = self._host()
        L = self.history.shape[1]
        for row, sd in states.items():
            name = self.row_name(row)
            check_state_keys(sd, strict, f"scaler {name}")
            if tuple(sd["history"].shape) != (L,):
                raise ValueError(f"scaler {name}: history_len mismatch: saved {tuple(sd['history'].shape)} vs "
                                 f"({L},) configured")
            size = sd["scale_block"].numel()
            if size > self._kmax and size > 1:
                raise ValueError(f"scaler {name}: saved exp_smooth block of {size} scales exceeds the configured "
                                 f"largest interval {self._kmax}")
            m = dict(zip(_META, (int(v) for v in sd["meta"].tolist())))
            host["history"][row] = sd["history"].float()
            host["total"][row] = sd["total"].long()
            host["pending"][row] = sd["pending"].float()
            host["pending_valid"][row] = sd["pending_valid"].bool()
            j = min(m["block_j"], size - 1)
            if size > 1:
                host["blk_scale"][row, :size] = sd["scale_block"].float()
                host["blk_est"][row, :size] = sd["est_block"].double()
            host["scale"][row] = sd["scale_block"].float().reshape(-1)[j]
            host["est"][row] = sd["est_block"].double().reshape(-1)[j]
            self.initialized[row] = bool(m["initialized"])
            self.block_j[row], self.block_len[row] = m["block_j"], m["block_len"]
            self.block_algo[row] = m["block_algo"]
            self.blk_size[row] = size
            self.pending_step[row] = m["pending_step"]
            self.calls[row], self.seen_total[row] = m["calls"], m["seen_total"]
            self.step = m["step"]
            if "es_obs" in sd:
                fc = ExpSmoothForecaster(EXP_SMOOTH_PARAMS.get(self.roles[row], ExpSmoothParams()))
                fc.load_state_tensors(sd)
                self._forecasters[row] = fc
            else:
                self._forecasters[row] = None
        for k, v in host.items():
            if k == "scale":
                self.scale.copy_(v.to(self.device))
            else:
                setattr(self, k, v.to(self.device))

    def extra_repr(self) -> str:
        c = self.config
        return (f"quantizers={self.n}, format={c.format}, algo={c.algo}, history_len={c.history_len}, "
                f"interval={c.interval}, unit={c.history_unit}, amax_reduce={c.amax_reduce}")


# --------------------------------------------------------------------------------------------------
# one row with the reference scaler's interface
# --------------------------------------------------------------------------------------------------
class BankedScaler:
    """Row ``row`` of a bank seen as one scaler (the interface of :class:`~hif8qat.scaling.DelayedScaler`).

    A layer's ``scaler_a`` / ``scaler_w`` / ``scaler_g`` are such views of the model's bank. A standalone
    one (:meth:`standalone`) owns a one-row bank and ends the micro-batch after each call, which makes it
    a drop-in for the reference scaler in tests and trace replays. ``set_step`` / ``freeze`` act on the
    whole bank.
    """

    def __init__(self, bank: ScalerBank, row: int, *, own: bool = False):
        self.bank, self.row, self._own = bank, int(row), own

    @classmethod
    def standalone(cls, role: str, config: ScalingConfig | None = None, target: float | None = None, *,
                   device: torch.device | str | None = None) -> BankedScaler:
        bank = ScalerBank(config, [role], device=device)
        if target is not None:
            if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
                raise ValueError(f"BankedScaler target={target!r} is invalid; allowed: a finite number > 0")
            bank._targets[0] = float(target)
            bank.target.fill_(float(target))
            bank.scale.fill_(float(target))
        return cls(bank, 0, own=True)

    # -- interface of the reference scaler -----------------------------------------------------------
    role = property(lambda self: self.bank.roles[self.row])
    config = property(lambda self: self.bank.config)
    target = property(lambda self: self.bank._targets[self.row])
    fmt = property(lambda self: self.bank.formats[self.row])
    history = property(lambda self: self.bank.history[self.row])
    total = property(lambda self: self.bank.total[self.row])
    tel_max = property(lambda self: self.bank.tel_max[self.row])
    tel_cnt = property(lambda self: self.bank.tel_cnt[self.row])
    est_block = property(lambda self: self.bank.est[self.row:self.row + 1])
    scale = property(lambda self: self.bank.scale[self.row])
    estimate = property(lambda self: self.bank.est[self.row])
    initialized = property(lambda self: bool(self.bank.initialized[self.row]))
    frozen = property(lambda self: self.bank.frozen)
    _forecaster = property(lambda self: self.bank._forecasters[self.row])

    @property
    def last(self) -> dict[str, torch.Tensor]:
        v = torch.cat((self.bank.last_vals[self.row], self.bank.last_stats[self.row]))
        return dict(zip(("amax", "estimate", "ratio", "scale", "exceed_frac", "clipped"), v.unbind()))

    def set_step(self, step: int) -> None:
        self.bank.set_step(step)

    def freeze(self, frozen: bool = True) -> None:
        self.bank.freeze(frozen)

    def reset(self) -> None:
        self.bank.reset([self.row])

    def _end(self) -> None:
        if self._own:
            self.bank.update()

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bank.quantize(x, self.row, RECORD_NO_GRAD)
        self._end()
        return y

    @torch.no_grad()
    def observe_amax(self, amax: float | torch.Tensor) -> torch.Tensor:
        if self.bank.frozen:
            raise RuntimeError("observe_amax on a frozen scaler")
        scale = self.bank.observe(self.row, torch.as_tensor(amax, dtype=torch.float32))
        self._end()
        return scale

    def history_values(self) -> list[float]:
        self.bank.update()
        n = min(int(self.total.item()), self.history.numel())
        return self.history.tolist()[self.history.numel() - n:] if n else []

    def telemetry_record(self) -> dict[str, Any]:
        return self.bank.telemetry_records()[self.row]

    def telemetry_calls(self) -> tuple[int, int]:
        return int(self.bank.tel_calls[self.row]), int(self.bank.tel_stat_calls[self.row])

    def reset_telemetry(self) -> None:
        if not self._own:
            raise RuntimeError("reset_telemetry of one row of a shared bank: use bank.reset_telemetry()")
        self.bank.reset_telemetry()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.bank.row_state_dict(self.row)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        self.bank.load_row_state_dicts({self.row: state_dict}, strict=strict)


def bank_replay(amax_sequence: Sequence[float] | torch.Tensor, config: ScalingConfig | None = None, *,
                steps: Sequence[int] | None = None, role: str = "A", target: float | None = None) -> torch.Tensor:
    """:func:`hif8qat.scaling.replay` through a one-row bank (same arguments, same result)."""
    seq = amax_sequence.tolist() if isinstance(amax_sequence, torch.Tensor) else list(amax_sequence)
    if steps is not None and len(steps) != len(seq):
        raise ValueError(f"replay: steps has {len(steps)} entries for {len(seq)} amaxes")
    sc = BankedScaler.standalone(role, config, target)
    out = []
    for i, a in enumerate(seq):
        if steps is not None:
            sc.set_step(int(steps[i]))
        out.append(sc.observe_amax(float(a)))
    return torch.stack(out) if out else torch.zeros(0)
