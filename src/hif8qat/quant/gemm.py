"""The quantized GEMM shared by every quantized module: the autograd function (A, W, G quantized, straight-through)
and :class:`QuantState`, the scaler plumbing of a module with one or more GEMM sites (rows of a scaler bank, the
scalers in the module's ``state_dict``). :mod:`hif8qat.quant.linear` builds its layers on them, and
:mod:`hif8qat.quant.experts` the MoE experts."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F

from hif8qat.compute_dtype import emulated_linear, emulated_matmul
from hif8qat.scaling.autograd_engine import in_backward, tensor_version
from hif8qat.scaling.bank import RECORD, RECORD_NO_GRAD, REPLAY, ScalerBank, bank_qdq, release_kept
from hif8qat.scaling.bank_row import BankedScaler
from hif8qat.scaling.settings import ROLES, ScalingConfig

STATE_KEY = "hif8_scaler"  # a module's scaler entries in model.state_dict(): {module}.hif8_scaler.[{site}.]{role}.{key}
# In model.state_dict() beside a module's scalers: the settings they were recorded under (JSON bytes), so that a
# state from another format or algorithm is refused instead of loaded as if it were this model's.
SETTINGS_KEY = "settings"
RECORDED_SETTINGS = ("format", "algo")


class _QuantLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, bank_id, rows, mode, keep_w, emulate_bf16):
        dev = x.device.type
        cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        qa = bank_qdq(x, bank_id, rows[0], mode, cdt)  # written in the matmul's dtype by the kernel
        # eager: the bank keeps Q(W) for a checkpoint recompute (compiled graphs may reuse an op result's memory)
        qw = _quantized_weight(weight, bank_id, rows[1], mode, cdt, keep_w and not torch.compiler.is_compiling())
        b = bias.to(cdt) if bias is not None and cdt is not None else bias
        # BF16 emulation is the layer's setting, decided here and kept for the backward
        emulate = qa.dtype == torch.bfloat16 and emulate_bf16
        if emulate:
            out = emulated_linear(qa, qw, b)
        else:
            with torch.autocast(dev, enabled=False):
                out = F.linear(qa, qw, b)
        ctx.save_for_backward(qa, qw if keep_w else weight)
        ctx.quant = (bank_id, rows, cdt, keep_w, emulate)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        qa, w = ctx.saved_tensors
        bank_id, rows, cdt, keep_w, emulate = ctx.quant
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        mm_dtype = cdt or w_dtype  # the dtype of Q(W) as the forward's matmul used it
        qg = bank_qdq(grad_out, bank_id, rows[2], RECORD, mm_dtype)
        # sharded (FSDP): the forward's Q(W) recomputed from the re-gathered W with the forward's scale
        qw = w if keep_w else bank_qdq(w, bank_id, rows[1], REPLAY, cdt)
        if keep_w and not torch.compiler.is_compiling():
            release_kept(bank_id, rows[1])
        dx = dw = db = None
        flat_g = qg.reshape(-1, qg.shape[-1])
        if emulate:  # FP32 GEMMs on the BF16 values, BF16 results: never torch's slow BF16 path
            if ctx.needs_input_grad[0]:
                dx = emulated_matmul(qg, qw, x_dtype)
            if ctx.needs_input_grad[1]:
                dw = emulated_matmul(flat_g.t(), qa.reshape(-1, qa.shape[-1]), w_dtype)
        else:
            if ctx.needs_input_grad[0]:
                dx = qg.matmul(qw).to(x_dtype)
            if ctx.needs_input_grad[1]:
                dw = flat_g.t().matmul(qa.reshape(-1, qa.shape[-1])).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = qg.reshape(-1, qg.shape[-1]).sum(0).to(b_dtype)
        return dx, dw, db, None, None, None, None, None


# bank id -> (the bank, weight row -> (what its Q(W) was computed from, the tensors keeping those addresses
# alive, Q(W))): filled only inside reusing_frozen_weights
_FROZEN_WEIGHTS: dict[int, tuple[ScalerBank, dict[int, tuple[tuple, tuple, torch.Tensor]]]] = {}


@contextlib.contextmanager
def reusing_frozen_weights(banks: Iterable[ScalerBank]) -> Iterator[None]:
    """Within it, a frozen bank's weight quantizer computes each Q(W) once and returns that tensor again while the
    weight and its scale are unchanged (evaluation: thousands of forwards of the same weights).

    A reused Q(W) is the one a new call would compute, bit for bit: a frozen call quantizes with the row's stored
    scale, or with one from the weight's own amax (just-in-time scaling, a row that never ran), and rounds to
    nearest, so it depends only on the weight, that scale and the output dtype. Each is checked at every call
    (data pointer, in-place version counter, shape, strides, dtype; the weight and scale tensors are held, so their
    addresses cannot be reused): a weight or scale written in place, a parameter replaced or a bank unfrozen
    quantizes afresh. Training calls (with gradients, or on an unfrozen bank) and compiled graphs never reuse.
    The reused tensors (one low-precision copy of the quantized weights) are released on leaving; not reentrant
    for the same bank.

    Args:
        banks: the model's scaler banks (:func:`hif8qat.quant.linear.scaler_banks`).

    Yields:
        Nothing.
    """
    mine = [bank for bank in banks if bank.bank_id not in _FROZEN_WEIGHTS]
    for bank in mine:
        _FROZEN_WEIGHTS[bank.bank_id] = (bank, {})
    try:
        yield
    finally:
        for bank in mine:
            _FROZEN_WEIGHTS.pop(bank.bank_id, None)


def _quantized_weight(weight: torch.Tensor, bank_id: int, row: int, mode: int, cdt: torch.dtype | None,
                      keep: bool) -> torch.Tensor:
    """Q(W) of a forward: reused inside :func:`reusing_frozen_weights` where it is the same, else computed."""
    held = _FROZEN_WEIGHTS.get(bank_id)
    if held is None or mode == RECORD or torch.compiler.is_compiling():
        return bank_qdq(weight, bank_id, row, mode, cdt, keep)
    bank, reused = held
    scale = bank.static_scale(row) if bank.frozen else None
    if not bank.frozen or weight.is_inference() or (scale is not None and scale.is_inference()):
        return bank_qdq(weight, bank_id, row, mode, cdt, keep)  # no version counter to trust
    source = (weight.data_ptr(), tensor_version(weight), tuple(weight.shape), weight.stride(), weight.dtype,
              weight.device, cdt, None if scale is None else (scale.data_ptr(), tensor_version(scale)))
    hit = reused.get(row)
    if hit is not None and hit[0] == source:
        return hit[2]
    qw = bank_qdq(weight, bank_id, row, mode, cdt, keep)
    reused[row] = (source, (weight, scale), qw)
    return qw


class QuantState:
    """The scaler plumbing of a quantized module: for each of its GEMM sites (one for a linear, one per expert
    weight for an MoE experts module) three rows A, W, G of a :class:`~hif8qat.scaling.bank.ScalerBank`."""

    def _init_quant(self, config: ScalingConfig | None, name: str, enabled: bool, emulate_bf16: bool) -> None:
        self.config = config if config is not None else ScalingConfig()  # validated when it was made
        self.quant_name = name
        self.quant_enabled = bool(enabled)
        self.emulate_bf16 = bool(emulate_bf16)
        self.recompute_weight = False  # True under FSDP: see set_weight_recompute
        self.state_in_state_dict = False  # see set_state_in_state_dict
        object.__setattr__(self, "_bank", None)
        self._rows = tuple(range(3 * len(self.site_names())))

    def site_names(self) -> list[str]:
        """The GEMM sites' names relative to the module ("" for the module itself).

        Returns:
            The names.
        """
        return [""]

    def _own_bank(self, device) -> None:
        bank = ScalerBank(self.config, [r for _ in self.site_names() for r in ROLES], device=device)
        base = self.quant_name or type(self).__name__
        bank.set_row_names([f"{_join(base, s)}.{r}" for s in self.site_names() for r in ROLES])
        self.hif8_bank = bank  # registered: follows the layer's device moves
        self._attach(bank, self._rows)

    def _attach(self, bank: ScalerBank, rows: tuple[int, ...]) -> None:
        object.__setattr__(self, "_bank", bank)  # not a submodule: the model's bank is registered once
        self._rows = tuple(rows)
        if getattr(self, "hif8_bank", bank) is not bank:  # a bank registered before: the shared one replaces it
            delattr(self, "hif8_bank")

    @property
    def bank(self) -> ScalerBank:
        return self._bank

    def scalers(self) -> Iterator[tuple[str, BankedScaler]]:
        """Each role's scaler of this module's (first) GEMM site, as a one-row view of the bank.

        Yields:
            ``(role, scaler)`` for A, W and G.
        """
        for role, row in zip(ROLES, self._rows):
            yield role, BankedScaler(self._bank, row)

    # One int, not a tuple: a module's rows are always the contiguous range A, W, G of each site from its first
    # row. A compiled block can then take that int as a graph input (see train.compiled_blocks) instead of
    # guarding on a tuple of constants, so blocks that differ only in their rows share one graph.
    @property
    def _rows(self) -> tuple[int, ...]:
        return tuple(range(self._row0, self._row0 + 3 * len(self.site_names())))

    @_rows.setter
    def _rows(self, rows: tuple[int, ...]) -> None:
        rows = tuple(int(r) for r in rows)
        if rows != tuple(range(rows[0], rows[0] + len(rows))):
            raise ValueError(f"{type(self).__name__}: scaler rows {rows} are not one contiguous range")
        self._row0 = rows[0]

    scaler_a = property(lambda self: BankedScaler(self._bank, self._rows[0]))
    scaler_w = property(lambda self: BankedScaler(self._bank, self._rows[1]))
    scaler_g = property(lambda self: BankedScaler(self._bank, self._rows[2]))

    # -- the scalers in the module's own state dict (opt-in: set_state_in_state_dict) -------------------------
    def scaler_state(self, host: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This module's scalers: ``[{site}.]{A|W|G}.{key}`` (CPU tensors of :mod:`hif8qat.scaling.bank_state`)
        and ``enabled``.

        Args:
            host: the bank's tables already copied to the host (one copy for many modules), or None.

        Returns:
            Key -> CPU tensor.
        """
        bank = self._bank
        bank.update()
        host = host if host is not None else bank._host()
        sd = {"enabled": torch.tensor(int(self.quant_enabled), dtype=torch.int64)}
        for si, site in enumerate(self.site_names()):
            for ri, role in enumerate(ROLES):
                row = self._rows[3 * si + ri]
                sd.update({f"{_join(site, role)}.{k}": v for k, v in bank.row_state_dict(row, host).items()})
        return sd

    def load_scaler_state(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Restore what :meth:`scaler_state` saved.

        Args:
            sd: the saved state.
            strict: every site and role must be there.

        Raises:
            KeyError: an unexpected key, or (strict) a missing row.
        """
        sites = {s: i for i, s in enumerate(self.site_names())}
        states: dict[int, dict[str, torch.Tensor]] = {}
        for key, v in sd.items():
            if key == "enabled":
                continue
            site_role, _, k = key.rpartition(".")
            site, _, role = site_role.rpartition(".")
            if role not in ROLES or site not in sites:
                raise KeyError(f"{self.quant_name or type(self).__name__}: unexpected scaler state key {key!r}")
            states.setdefault(self._rows[3 * sites[site] + ROLES.index(role)], {})[k] = v
        if strict and len(states) != len(self._rows):
            raise KeyError(f"{self.quant_name or type(self).__name__}: scaler state for {sorted(states)} rows only")
        self._bank.load_row_state_dicts(states, strict)
        if "enabled" in sd:
            self.quant_enabled = bool(int(sd["enabled"]))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.state_in_state_dict and self._bank is not None:
            for k, v in self.scaler_state().items():
                destination[f"{prefix}{STATE_KEY}.{k}"] = v
            destination[f"{prefix}{STATE_KEY}.{SETTINGS_KEY}"] = _settings_tensor(self.config)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        head = f"{prefix}{STATE_KEY}."
        mine = {k[len(head):]: v for k, v in state_dict.items() if k.startswith(head)}
        rest = {k: v for k, v in state_dict.items() if not k.startswith(head)} if mine else state_dict
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if not self.state_in_state_dict:
            unexpected_keys.extend(head + k for k in mine)
        elif mine:
            recorded = mine.pop(SETTINGS_KEY, None)
            if recorded is not None and _settings_of(recorded) != _settings(self.config):
                saved, ours = _settings_of(recorded), _settings(self.config)
                error_msgs.append(
                    f"{head}*: scaler state recorded under {_describe(saved)}, but this model quantizes with "
                    f"{_describe(ours)}; load it into a model converted with the same settings, or leave the "
                    "scaler keys out to start the scalers cold")
                return
            try:
                self.load_scaler_state(mine, strict)
            except (KeyError, ValueError) as err:
                error_msgs.append(f"{head}*: {err}")
        elif strict:
            missing_keys.append(f"{head}*")

    def _quant_gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    site: int = 0) -> torch.Tensor:
        """``x W^T + b`` with A, W, G quantized by the rows of GEMM site ``site`` (W laid out ``[out, in]``)."""
        # a pass without gradients ends its micro-batch at the next call (no backward will)
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                            or (bias is not None and bias.requires_grad))
        first = self._row0 + 3 * site
        return _QuantLinearFn.apply(x, weight, bias, self._bank.bank_id, (first, first + 1, first + 2),
                                    RECORD if grad else RECORD_NO_GRAD, not self.recompute_weight, self.emulate_bf16)


@contextlib.contextmanager
def keep_weights_under_fake_tensors() -> Iterator[None]:
    """Within it, a quantized GEMM run on fake tensors keeps its quantized weight as the real one does.

    Under torch's ``FakeTensorMode`` the bank op runs its shape-only implementation, which keeps nothing; the real
    op (eager, ``keep``) keeps each quantized weight from its forward call until the layer's backward, so that an
    activation-checkpointing recompute gets it back instead of quantizing again. Here that keeping is done around
    the op, so a fake-tensor simulation of a step (the memory estimate) holds those weights exactly as long as the
    real step does (it matters only with checkpointing: without it the forward saves the same tensor for backward
    anyway). Not reentrant; not for real tensors, whose op keeps them itself."""
    global bank_qdq, release_kept
    op, release = bank_qdq, release_kept
    kept: dict[tuple[int, int], torch.Tensor] = {}

    def keeping_qdq(x, bank_id, row, mode, out_dtype=None, keep=False):
        if mode == RECORD and in_backward() and (bank_id, row) in kept:  # the recompute: a copy of the kept one
            return kept.pop((bank_id, row)).clone()
        y = op(x, bank_id, row, mode, out_dtype, keep)
        if keep and mode == RECORD and not in_backward():
            kept[(bank_id, row)] = y
        return y

    def keeping_release(bank_id, row):
        kept.pop((bank_id, row), None)
        release(bank_id, row)

    bank_qdq, release_kept = keeping_qdq, keeping_release
    try:
        yield
    finally:
        bank_qdq, release_kept = op, release


def _settings(config: ScalingConfig) -> dict:
    d = ScalingConfig.to_dict(config)
    return json.loads(json.dumps({k: d[k] for k in RECORDED_SETTINGS}))  # schedule keys as JSON gives them back


def _settings_tensor(config: ScalingConfig) -> torch.Tensor:
    return torch.tensor(list(json.dumps(_settings(config), sort_keys=True).encode()), dtype=torch.uint8)


def _settings_of(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.to(torch.uint8).tolist()).decode())


def _describe(settings: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in settings.items())


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


__all__ = ["SETTINGS_KEY", "STATE_KEY", "QuantState", "keep_weights_under_fake_tensors", "reusing_frozen_weights"]
