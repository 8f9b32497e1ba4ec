"""Scaler bank: the delayed-scaling state of every 8-bit quantizer of a model in one table.

The project's one implementation of delayed scaling (contract: docs/design.md, section 2): the rules of
:mod:`hif8qat.scaling.rules` and :mod:`hif8qat.scaling.forecast` applied to all rows at once, for speed and
for ``torch.compile``. It owns the table (:class:`ScalerBank`, a row per layer and role A / W / G), the custom
op that quantizes one call with its row's scale and records its amax (:func:`bank_qdq`), the update once per
micro-batch. Saved states: :mod:`hif8qat.scaling.bank_state`; one row as a scaler: :mod:`.bank_row`.
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
from torch import nn

from hif8qat.errors import RunError
from hif8qat.formats import qdq as formats
from hif8qat.scaling import bank_state, bank_telemetry, current, forecast, rules
from hif8qat.scaling.autograd_engine import in_backward, queue_at_backward_end, tensor_version
from hif8qat.scaling.bank_extras import BankExtras
from hif8qat.scaling.forecast import ExpSmoothForecaster
from hif8qat.scaling.settings import ALGOS, ROLES, ScalingConfig, lookup

# op modes
RECORD = 0  # a training call (a backward pass is expected to end the micro-batch)
RECORD_NO_GRAD = 1  # a forward-only call (no backward will come: the next call ends the micro-batch)
REPLAY = 2  # the backward's re-quantization of the weight with the forward's scale: reads, records nothing


# Quantize kernels by element format (formats.scaled_qdq_kernel): the bank validated its config once and
# makes its scales itself, so its calls skip the public functions' per-call checks. "bank" is their compile
# site: the op's body runs in another dispatch context than eager callers.
QDQ_KERNELS = {f: formats.scaled_qdq_kernel(f, site="bank") for f in formats.FORMATS}


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host decision (mask, index, forecast) on the bank's device without a host sync. A copy from pageable
    memory blocks until the GPU has caught up, every micro-batch; a page-locked one runs asynchronously, and
    torch's pinned allocator keeps its block until the copy has run. On CPU the array's memory is shared.

    Args:
        array: the host array.
        device: the bank's device.

    Returns:
        The tensor on ``device``.
    """
    host = torch.from_numpy(array)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


class QuantizerCalledTwice(RunError):
    """A quantizer ran twice in one micro-batch outside an activation-checkpointing recompute."""


_BANKS: weakref.WeakValueDictionary[int, ScalerBank] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


# --------------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("hif8qat::bank_qdq", mutates_args=())
def bank_qdq(x: torch.Tensor, bank_id: int, row: int, mode: int, out_dtype: torch.dtype | None = None,
             keep: bool = False) -> torch.Tensor:
    """Fake-quantize ``x`` with one row of a bank (:class:`ScalerBank` says how a call runs).

    Declared pure: its only side effect is on the bank's tables, which nothing inside a compiled graph reads
    (they are read by this op at call time and by the bank between micro-batches).

    Args:
        x: the tensor to quantize.
        bank_id: the bank's registry id.
        row: the quantizer's row.
        mode: ``RECORD`` (training), ``RECORD_NO_GRAD`` (forward-only) or ``REPLAY`` (the backward's weight
            re-quantization).
        out_dtype: the result's dtype (default x's: the kernel writes it, no separate cast pass).
        keep: keep the result for an activation-checkpointing recompute; only for eager callers (a compiled
            graph may reuse the memory of a result it deems dead).

    Returns:
        The fake-quantized tensor.
    """
    return _BANKS[bank_id].quantize(x, row, mode, out_dtype, keep)


@bank_qdq.register_fake
def _(x, bank_id, row, mode, out_dtype=None, keep=False):
    return torch.empty_like(x, dtype=out_dtype or x.dtype)


def release_kept(bank_id: int, row: int) -> None:
    """Drop a weight result kept for a checkpoint recompute: its layer's backward has run, so no recompute
    can ask for it again this micro-batch (kept longer, every layer's Q(W) would outlive its backward).

    Args:
        bank_id: the bank's registry id.
        row: the weight quantizer's row.
    """
    bank = _BANKS.get(bank_id)
    if bank is not None:
        bank._kept.pop(row, None)


# --------------------------------------------------------------------------------------------------
# the bank
# --------------------------------------------------------------------------------------------------
class ScalerBank(BankExtras, nn.Module):
    """Delayed-scaling state of ``len(roles)`` quantizers sharing one :class:`ScalingConfig`.

    Tables are plain tensor attributes, not buffers: they follow the model's device moves (``_apply``)
    but never its dtype casts, stay out of ``state_dict()`` and are never broadcast by DDP. Per-row
    bookkeeping is in numpy arrays. ``row_state_dict`` / ``load_row_state_dicts`` use the per-quantizer
    format of :mod:`hif8qat.scaling.bank_state`, so exports and checkpoints written before the bank load unchanged.

    Public attributes, read and written by the helpers :mod:`~hif8qat.scaling.bank_state` and
    :mod:`~hif8qat.scaling.bank_telemetry` (which sit below this module and get the bank as an argument):

    * per row: ``roles``, ``formats`` (element format), ``specs`` (its :class:`~hif8qat.formats.qdq.FormatSpec`),
      ``targets`` (Python floats; ``target`` is the same as a tensor), ``forecasters`` (exp_smooth forecaster
      or None);
    * ``max_block``: the largest exp_smooth block (the width of ``blk_scale`` / ``blk_est``);
    * the tables (``history``, ``total``, ``pending``, ``pending_valid``, ``scale``, ``est``, ``blk_scale``,
      ``blk_est``; telemetry: ``tel_max``, ``tel_cnt``, ``last_vals``, ``last_stats``), the per-row bookkeeping
      (numpy: ``initialized``, ``block_j``, ``block_len``, ``block_algo``, ``blk_size``, ``pending_step``,
      ``calls``, ``seen_total``, ``tel_calls``, ``tel_stat_calls``), ``step`` and ``frozen``. The meta of a
      saved row and the telemetry columns are named in :mod:`hif8qat.scaling.settings`.

    One quantize kernel per call, the custom op ``hif8qat::bank_qdq``: it reads its row's scale, runs the
    fused qdq + amax kernel of :mod:`hif8qat.formats.qdq` and writes the amax into the table; opaque to
    ``torch.compile`` (a fake implementation gives shapes), so quantized linears cause no graph break; its
    Python body holds the per-row bookkeeping (Python ints, no tensor ops). One bank update per micro-batch,
    queued by the first gradient-quantizer call to run when the backward ends (forward-only passes are flushed
    by the next call, :meth:`update` or a state dict): one optional all-reduce of all amaxes
    (``amax_reduce=max``), then one vectorised append to the histories and the telemetry. The next
    micro-batch's scales come in one vectorised pass at its first call (the step is known then); exp_smooth
    copies the table to the host once per refresh round.

    Each quantizer is called once per micro-batch, so a call's scale comes from the history before its own
    amax is appended. A second forward-quantizer (A / W) call during the backward is an
    activation-checkpointing recompute: it reuses the forward's scale and records nothing (a ``keep=True``
    eager weight call leaves its result with the bank until the micro-batch ends, so the recompute gets a
    copy); any other second call raises :class:`QuantizerCalledTwice`. Under FSDP the backward re-quantizes
    the weight with the forward's scale (``REPLAY``) instead of keeping it. Frozen (evaluation) banks read
    their scales, record nothing, never communicate. A row quantizes in its role's element format with that
    format's target. Under ``algo="current"`` a call's scale comes from its own amax
    (:mod:`hif8qat.scaling.current`); the history still receives the amaxes at the end of the micro-batch.
    """

    def __init__(self, config: ScalingConfig | None = None, roles: Sequence[str] = ROLES, *,
                 device: torch.device | str | None = None):
        super().__init__()
        config = config if config is not None else ScalingConfig()  # validated when it was made
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise ValueError(f"ScalerBank: roles {bad} are invalid; allowed: {ROLES}")
        self.config = config
        self.roles = list(roles)
        n = len(self.roles)
        self.n = n
        self._algo_sched = config.algo_schedule()
        self._interval_sched = config.interval_schedule()
        self._step_mode = config.history_unit == "step"
        self.max_block = max(k for _, k in self._interval_sched) if config.uses("exp_smooth") else 1
        self._uses_current = config.uses("current")
        self.formats = [formats.element_format(config.format, r) for r in self.roles]  # element format per row
        self._kernels = [QDQ_KERNELS[f] for f in self.formats]
        self.specs = [formats.format_spec(f) for f in self.formats]
        self.targets = [formats.target_for(config, r) for r in self.roles]
        self._rounding = [config.grad_rounding if r == "G" else "ta" for r in self.roles]
        self._init_extras()  # the stochastic-rounding generator and the step watch (bank_extras)
        self._is_g = np.array([r == "G" for r in self.roles])
        self._fresh_tables(torch.device(device) if device is not None else torch.device("cpu"))
        self.step = 0
        self.frozen = False
        self.forecasters: list[ExpSmoothForecaster | None] = [None] * n
        self._reset_rows(np.ones(n, dtype=bool))
        self._mb_reset()
        self.bank_id = next(_IDS)
        _BANKS[self.bank_id] = self

    def _fresh_tables(self, dev: torch.device) -> None:
        """The tables of a bank that has not run yet (every row cold), on ``dev``."""
        n, L = self.n, int(self.config.history_len)
        f32, f64, i64 = torch.float32, torch.float64, torch.int64
        self.target = torch.tensor(self.targets, dtype=f64, device=dev)
        self.history = torch.zeros(n, L, dtype=f32, device=dev)
        self.total = torch.zeros(n, dtype=i64, device=dev)
        self.pending = torch.zeros(n, dtype=f32, device=dev)
        self.pending_valid = torch.zeros(n, dtype=torch.bool, device=dev)
        self.scale = self.target.to(f32)  # scale of the current (or last) call per row
        self.est = torch.ones(n, dtype=f64, device=dev)  # the estimate behind it
        self.blk_scale = torch.zeros(n, self.max_block, dtype=f32, device=dev)  # exp_smooth blocks
        self.blk_est = torch.zeros(n, self.max_block, dtype=f64, device=dev)
        self.amax = torch.zeros(n, dtype=f32, device=dev)  # this micro-batch's amax per row
        # telemetry since the last reset_telemetry, last call values (columns: settings.TELEMETRY_*_FIELDS)
        self.tel_max = torch.zeros(n, 3, dtype=f64, device=dev)
        self.tel_cnt = torch.zeros(n, 3, dtype=i64, device=dev)
        self.last_vals = torch.full((n, 4), math.nan, dtype=f64, device=dev)  # amax, estimate, ratio, scale
        self.last_stats = torch.full((n, 2), math.nan, dtype=f64, device=dev)  # exceed_frac, clipped
        self._views()

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
        if self.device.type == "meta" and dev.type != "meta":
            # to_empty() of a model built on the meta device: a bank there never ran and its tables hold no
            # data to copy, so they start cold on the new device (a checkpoint's scalers load afterwards)
            self._fresh_tables(dev)
        elif dev != self.device:
            for name in self._TABLES:
                setattr(self, name, getattr(self, name).to(dev))
            self._views()
        return self

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = None if k == "_rng" else copy.deepcopy(v, memo)
        new._views()
        self._copy_rng_into(new)
        new.bank_id = next(_IDS)  # a copy is a different bank for the op
        _BANKS[new.bank_id] = new
        return new

    def __getstate__(self):
        raise TypeError("ScalerBank is not picklable; save its state with hif8qat.quant.linear.quant_state_dict")

    # Per-row Python bookkeeping and the value of a fresh (cold) row. blk_size 1: scale / est hold the block;
    # > 1: an exp_smooth block of that many scales in blk_scale / blk_est. initialized is bool, the rest int64.
    _ROW_STATE = (("initialized", False), ("block_j", 0), ("block_len", 1), ("block_algo", -1), ("blk_size", 1),
                  ("pending_step", -1), ("calls", 0), ("seen_total", 0), ("tel_calls", 0), ("tel_stat_calls", 0))

    def _reset_rows(self, rows: np.ndarray) -> None:
        """Python state of a fresh (cold) row."""
        for name, fresh in self._ROW_STATE:
            if not hasattr(self, name):
                setattr(self, name, np.zeros(self.n, dtype=bool if name == "initialized" else np.int64))
            getattr(self, name)[rows] = fresh
        for r in np.flatnonzero(rows):
            self.forecasters[r] = None

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
        """Set the optimizer step the next calls belong to (the interval and schedules count it).

        Args:
            step: the step.
        """
        self.step = int(step)
        self._seen_version = None

    def freeze(self, frozen: bool = True) -> None:
        """Frozen: quantize with the current scales, record nothing, communicate nothing.

        Args:
            frozen: True to freeze, False to resume recording.
        """
        if frozen:
            self.update()
        self.frozen = bool(frozen)

    @torch.no_grad()
    def reset(self, rows: Sequence[int] | np.ndarray | None = None) -> None:
        """Forget the history of ``rows`` (default all): the next call is a cold start. Keeps step, frozen.

        Args:
            rows: the rows to reset (default all).
        """
        self.update()
        mask = np.zeros(self.n, dtype=bool)
        mask[np.arange(self.n) if rows is None else np.asarray(rows, dtype=np.int64)] = True
        m = host_to_device(mask, self.device)
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
        """One quantizer call (the body of ``hif8qat::bank_qdq``).

        Args:
            x: the tensor to quantize.
            row: the quantizer's row.
            mode: ``RECORD``, ``RECORD_NO_GRAD`` or ``REPLAY``.
            out_dtype: the result's dtype (default x's).
            keep: keep the result for a checkpoint recompute (eager callers only).

        Returns:
            The fake-quantized tensor.
        """
        if mode == REPLAY or self.frozen:
            return self._qdq(x, row, self.frozen_scale(x, row) if self.frozen else self._scale_rows[row], out_dtype)
        if self._mb_calls[row]:
            if in_backward() and not self._is_g[row]:  # checkpoint recompute: the forward's scale
                kept = self._kept.pop(row, None)
                if kept is not None and kept[1] == (x.data_ptr(), tensor_version(x), x.shape, out_dtype):
                    # the forward's tensor, unchanged: a copy of its result (an op returns a fresh tensor)
                    # instead of a second quantization
                    return kept[0].clone()
                return self._qdq(x, row, self._scale_rows[row], out_dtype)
            if self._mb_grad:
                raise QuantizerCalledTwice(
                    f"{self.formats[row]} quantizer {self.row_name(row)} was called twice in one micro-batch; "
                    "its amax history would be updated twice. Each quantized layer may run once per "
                    "forward/backward (a module reused inside one forward cannot be quantized), activation "
                    "checkpointing recomputes during the backward only; a forward whose backward never ran must "
                    "be followed by hif8qat.quant.linear.update_scales(model) (or use freeze_scales(model) for "
                    "evaluation)")
            self.update()  # forward-only micro-batches end at the next call
        return self._record_call(x, row, mode, out_dtype, keep)

    def observe(self, row: int, amax: torch.Tensor) -> torch.Tensor:
        """A call with a known amax and no tensor (replay); returns the scale it used.

        Args:
            row: the quantizer's row.
            amax: the call's amax.

        Returns:
            The scale the call used (0-d float32).
        """
        a = amax.to(device=self.device, dtype=torch.float32).reshape(())
        self._begin(row, RECORD_NO_GRAD, lambda: a, self._current_now())
        scale = self._scale_rows[row].clone()
        self._amax_rows[row].copy_(a)
        self._mb_calls[row] += 1
        return scale

    def _record_call(self, x: torch.Tensor, row: int, mode: int, out_dtype: torch.dtype | None = None,
                     keep: bool = False) -> torch.Tensor:
        if mode == RECORD:
            self._watch_step(row, x)
        own = None
        if self._current_now():  # just in time: the amax pass first, then the cast with the scale from it
            own = current.tensor_amax(x)
            self._begin(row, mode, lambda: own, True)
        else:
            self._begin(row, mode, lambda: x.detach().abs().amax().to(torch.float32))
        c = self.config
        stats = ((c.telemetry_stats_every > 0 and self.calls[row] % c.telemetry_stats_every == 0)
                 or (c.telemetry_dump_every > 0 and self.step % c.telemetry_dump_every == 0))
        scale = self._scale_rows[row]
        y, amax = self._kernels[row](x, scale, self._rounding[row], c.saturate, own is None, out_dtype,
                                     self._rng_for(row))
        self._amax_rows[row].copy_(amax if own is None else own)
        self._mb_calls[row] += 1
        if keep and mode == RECORD:  # for a checkpoint recompute (see quantize)
            self._kept[row] = (y, (x.data_ptr(), tensor_version(x), x.shape, out_dtype))
        if stats:
            bank_telemetry.record_stats(self, x, row, scale, self._amax_rows[row])
        if self._is_g[row] and not self._callback_queued and in_backward():
            queue_at_backward_end(self.update)
            self._callback_queued = True
        return y

    def _qdq(self, x, row, scale, out_dtype=None):
        return self._kernels[row](x, scale, self._rounding[row], self.config.saturate, False, out_dtype,
                                  self._rng_for(row))[0]

    def _current_now(self) -> bool:
        """Whether the algorithm at the current step is just-in-time scaling."""
        return self._uses_current and lookup(self._algo_sched, self.step) == "current"

    just_in_time = property(_current_now, doc="Whether calls at the current step scale from their own amax.")

    def frozen_scale(self, x: torch.Tensor, row: int) -> torch.Tensor:
        """The scale a frozen (evaluation) call of ``row`` on ``x`` quantizes with: the row's scale; a row that
        never ran, or any row under ``current``, takes the scale from this tensor's own amax (local).

        Args:
            x: the tensor the call quantizes.
            row: the quantizer's row.

        Returns:
            The scale (0-d float32 on the bank's device).
        """
        static = self.static_scale(row)
        if static is not None:
            return static
        return rules.scale_of(self.targets[row], rules.cold_estimate(current.tensor_amax(x)))

    def static_scale(self, row: int) -> torch.Tensor | None:
        """The scale every frozen call of ``row`` uses whatever its tensor (an 8-bit export stores it), or None
        where a frozen call scales from the tensor's own amax (a row that never ran, or just-in-time scaling).

        Args:
            row: the quantizer's row.

        Returns:
            The row's scale, or None.
        """
        if self.initialized[row] and not self._current_now():
            return self._scale_rows[row]
        return None


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
            est = rules.cold_estimate(
                a if current else rules.reduce_amax(a.reshape(1), self.config.amax_reduce).reshape(()))
            self.est[row] = est
            self._scale_rows[row].copy_(rules.scale_of(self.targets[row], est))
            if current and self.initialized[row]:
                return
            self.initialized[row] = True
            self.block_algo[row] = ALGOS.index(lookup(self._algo_sched, self.step))
            self.block_len[row] = lookup(self._interval_sched, self.step)
            self.block_j[row] = 0
            self.blk_size[row] = 1

    # -- per micro-batch -------------------------------------------------------------------------------
    def _prepare(self, row: int, both: bool) -> None:
        """Scales of this micro-batch in one pass: for every row (``both``), or the row's group (forward
        rows A / W, or gradient rows G) when no backward is expected.

        Decisions are numpy; tensor work is a handful of whole-table ops. Rows prepared but not called by
        the end of the micro-batch are rolled back in :meth:`update`."""
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
        algo = lookup(self._algo_sched, step)
        ai, k = ALGOS.index(algo), lookup(self._interval_sched, step)
        init = group & self.initialized
        new_unit = np.ones(self.n, dtype=bool)
        if self._step_mode:
            new_unit = self.pending_step != step
            commit = new_unit & init
            if commit.any():
                m = host_to_device(commit, self.device)
                self.history, self.total = rules.append(self.history, self.total, self.pending,
                                                        self.pending_valid & m)
                self.pending = self.pending.masked_fill(m, 0.0)
                self.pending_valid = self.pending_valid & ~m
            self.pending_step[group] = step
        live = init & new_unit
        # under current every unit opens a block (the call then sets the scale from its own amax)
        refresh = live & rules.refresh_due(self.block_algo, self.block_len, self.block_j, ai, k, algo == "current")
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
                est = rules.history_estimate(self.history, self.total, algo, self.est)
                self._set_rows(refresh, est, rules.scale_of(self.target, est))
        if es_adv.any():
            j = host_to_device(np.minimum(self.block_j, self.blk_size - 1), self.device).view(-1, 1)
            self._set_rows(es_adv, self.blk_est.gather(1, j).view(-1), self.blk_scale.gather(1, j).view(-1))

    def _mask(self, rows: np.ndarray) -> torch.Tensor | bool:
        return True if rows.all() else host_to_device(rows, self.device)

    def _set_rows(self, rows: np.ndarray, est: torch.Tensor, scale: torch.Tensor) -> None:
        if rows.all():
            self.est = est.clone()
            self.scale.copy_(scale)
        else:
            m = self._mask(rows)
            self.est = torch.where(m, est, self.est)
            self.scale.copy_(torch.where(m, scale, self.scale))

    def _refresh_exp_smooth(self, rows: np.ndarray, k: int) -> None:
        """Host forecasts for ``rows``: one device-to-host copy for the whole bank, one copy back."""
        L = self.history.shape[1]
        host = torch.cat((self.history.double().flatten(), self.total.double(), self.est)).cpu().numpy()
        hist, total, cur = host[: self.n * L].reshape(self.n, L), host[self.n * L: self.n * (L + 1)], host[-self.n:]
        if self._snap["fc"] is None:
            self._snap["fc"] = copy.deepcopy(self.forecasters)
        idx = np.flatnonzero(rows)
        ests, scales = forecast.exp_smooth_rows(self.forecasters, self.roles, self.targets, idx, hist, total,
                                                self.seen_total, cur, k, self.max_block)
        ix = host_to_device(idx, self.device)
        self.blk_est = self.blk_est.index_copy(0, ix, host_to_device(ests, self.device))
        self.blk_scale = self.blk_scale.index_copy(
            0, ix, host_to_device(scales.astype(np.float32), self.device))
        self.blk_size[rows] = k
        self._set_rows(rows, self.blk_est[:, 0], self.blk_scale[:, 0])

    @torch.no_grad()
    def update(self) -> None:
        """End the micro-batch: record the amaxes of the rows that ran (see the class docstring)."""
        called = self._mb_calls > 0
        if self._snap is not None and (self._prepared & ~called).any():
            self._rollback(self._prepared & ~called)
        if not called.any():
            self._mb_reset()
            return
        cm = self._mask(called)
        amax = rules.reduce_amax(self.amax, self.config.amax_reduce)
        finite = amax < math.inf  # false for NaN and inf
        ok = finite & cm
        if self._step_mode:
            self.pending = torch.where(ok, torch.maximum(self.pending, amax), self.pending)
            self.pending_valid = self.pending_valid | ok
        else:
            self.history, self.total = rules.append(self.history, self.total, amax, ok)
        bank_telemetry.record_calls(self, amax, finite, cm)
        self.calls += called
        self.tel_calls += called
        self._mb_reset()

    def _rollback(self, rows: np.ndarray) -> None:
        snap = self._snap
        for k, v in snap["py"].items():
            getattr(self, k)[rows] = v[rows]
        m = host_to_device(rows, self.device)
        for k, v in snap["t"].items():
            cur = getattr(self, k)
            new = torch.where(m.view(-1, *([1] * (cur.dim() - 1))), v, cur)
            if k == "scale":
                self.scale.copy_(new)
            else:
                setattr(self, k, new)
        if snap["fc"] is not None:
            for r in np.flatnonzero(rows):
                self.forecasters[r] = snap["fc"][r]

    # -- telemetry -----------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_telemetry(self) -> None:
        self.tel_max.zero_()
        self.tel_cnt.zero_()
        self.tel_calls[:] = 0
        self.tel_stat_calls[:] = 0

    def row_name(self, row: int) -> str:
        """The name of a row in messages: the quantizer's module path once set, else its role and index.

        Args:
            row: the row.

        Returns:
            The name.
        """
        names = getattr(self, "_row_names", None)
        return names[row] if names else f"{self.roles[row]} (row {row})"

    def set_row_names(self, names: Sequence[str]) -> None:
        """Name the rows (the quantizers' module paths) for messages and telemetry.

        Args:
            names: one name per row.
        """
        self._row_names = list(names)

    def telemetry_records(self) -> list[dict[str, Any]]:
        """Per-row telemetry (one host copy): last call values and the accumulators.

        Returns:
            One dict per row.
        """
        return bank_telemetry.records(self)

    # -- state (per row, in the per-quantizer format of hif8qat.scaling.bank_state) ---------------------------------
    def _host(self) -> dict[str, torch.Tensor]:
        return bank_state.host_tables(self)

    def row_state_dict(self, row: int, host: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Row ``row``'s saved state (CPU tensors; keys ``settings.STATE_KEYS``).

        Args:
            row: the row.
            host: the tables already copied to the host (one copy for many rows), or None.

        Returns:
            The row's state.
        """
        self.update()
        return bank_state.row_state(self, row, host if host is not None else self._host())

    @torch.no_grad()
    def load_row_state_dicts(self, states: Mapping[int, Mapping[str, torch.Tensor]], strict: bool = True) -> None:
        """Restore rows from saved per-quantizer states (this bank's, or the per-layer scalers' of older runs).

        Args:
            states: row -> saved state.
            strict: refuse missing or unexpected keys.

        Raises:
            ValueError: a state's history length or exp_smooth block does not fit this bank.
        """
        self.update()
        bank_state.load_rows(self, states, strict)

    def extra_repr(self) -> str:
        """The bank's size and settings, for ``repr``.

        Returns:
            The text.
        """
        c = self.config
        return (f"quantizers={self.n}, format={c.format}, algo={c.algo}, history_len={c.history_len}, "
                f"interval={c.interval}, unit={c.history_unit}, amax_reduce={c.amax_reduce}")
