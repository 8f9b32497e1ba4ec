"""The 8-bit (HiF8 or FP8) quantized linear layer and model conversion (contract: docs/design.md).

``QuantLinear`` is an ``nn.Linear`` (same parameters ``weight`` / ``bias``, so ``state_dict()`` keys and
``save_pretrained`` folders are those of the plain model) with three quantizers A, W, G, which are rows of a
:class:`~hif8qat.scaling.bank.ScalerBank`: one bank per converted model, built once after the swap (a layer
built on its own has a private one). The scaler state is kept out of the model's state dict (see
:func:`quant_state_dict`) unless :func:`set_state_in_state_dict` puts it there, as the public
``convert_to_hif8_training`` does: then ``{layer}.hif8_scaler.{A|W|G}.{key}`` entries travel with any trainer's
checkpoint of ``model.state_dict()``.

With quantization on, a custom autograd function computes::

    forward   y  = Q_A(x) Q_W(W)^T + b            (bias added in high precision, not quantized)
    backward  dX = Q_G(g) Q_W(W)
              dW = Q_G(g)^T Q_A(x)                 (the forward's quantized A and W are saved: W is quantized
              db = sum Q_G(g)                       once per micro-batch; eager activation checkpointing
                                                     included, see :mod:`hif8qat.scaling.bank`: under torch.compile
                                                     its recompute quantizes W again)

Under FSDP (:func:`set_weight_recompute`, called by ``distributed.apply_fsdp``) the backward recomputes Q_W(W)
from the re-gathered W with the forward's scale instead, as the authors' HiF8GemmFunction does: bit-identical,
and no full quantized weight lives from forward to backward.

Each Q is one call of the custom op ``hif8qat::bank_qdq`` (traceable: a whole-model ``torch.compile`` has
no graph break from these layers). Q_A / Q_W use round-half-away (``ta``), Q_G uses ``grad_rounding``;
each maps the amax estimate to its role's target (``ScalingConfig.targets``: ``target`` per role, else
``target_fwd`` for A and W, ``target_bwd`` for G). With ``ScalingConfig.format`` an FP8 format (``e4m3``, ``e5m2``, or
``hybrid``: E4M3 for A and W, E5M2 for G) the same layer quantizes with saturating FP8 casts and the FP8
targets instead (see :mod:`hif8qat.scaling.bank`). With quantization off the forward is exactly ``F.linear`` (identical
outputs and gradients to ``nn.Linear``).

Micro-batches: every quantizer runs once per forward/backward; the bank records the amaxes when the
backward ends (or at the next call of a forward-only pass, or :func:`update_scales`). Activation
checkpointing is safe: the recomputed forward reuses the forward's scales and records nothing; any other
second call of a layer in one micro-batch raises :class:`~hif8qat.scaling.bank.QuantizerCalledTwice`.

BF16 emulation is a value of the layer (``emulate_bf16``, set at conversion or by :func:`set_bf16_emulation`):
a BF16 GEMM of the layer then runs as FP32 on BF16 values (:mod:`hif8qat.compute_dtype`), in forward and backward.

Autocast: under ``torch.autocast`` the quantizers see the incoming tensors as they are (the HiF8
arithmetic is done in fp32 inside ``formats``) and write the quantized A and W in the autocast dtype
(bit for bit the cast of the result in the input's dtype, without a separate cast pass); the bias is cast
and the matmul runs in that dtype with autocast disabled, i.e. exactly what autocast's own ``linear``
would do with the quantized operands. The backward quantizes G into the dtype of the saved Q_W(W), runs
its matmuls in that dtype and returns gradients in the dtypes of x, W and b.
Without autocast everything runs in the input dtype.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Collection, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from hif8qat import compute_dtype as numerics
from hif8qat.quant.blocks import SCOPES, ModuleFilter, find_transformer_blocks, select_linears
from hif8qat.scaling.bank import RECORD, RECORD_NO_GRAD, REPLAY, ScalerBank, bank_qdq, release_kept
from hif8qat.scaling.bank_row import BankedScaler
from hif8qat.scaling.settings import ROLES, TELEMETRY_COUNT_FIELDS, TELEMETRY_MAX_FIELDS, ScalingConfig

BANK_ATTR = "hif8qat_bank"  # the model-level bank's attribute on a converted model
STATE_KEY = "hif8_scaler"  # a layer's scaler entries in model.state_dict(): {layer}.hif8_scaler.{role}.{key}


# --------------------------------------------------------------------------------------------------
# autograd function and module
# --------------------------------------------------------------------------------------------------
class _QuantLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, bank_id, rows, mode, keep_w, emulate_bf16):
        dev = x.device.type
        cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        qa = bank_qdq(x, bank_id, rows[0], mode, cdt)  # written in the matmul's dtype by the kernel
        # eager: the bank keeps Q(W) for a checkpoint recompute (compiled graphs may reuse an op result's memory)
        qw = bank_qdq(weight, bank_id, rows[1], mode, cdt, keep_w and not torch.compiler.is_compiling())
        b = bias.to(cdt) if bias is not None and cdt is not None else bias
        # BF16 emulation is the layer's setting, decided here and kept for the backward
        emulate = qa.dtype == torch.bfloat16 and emulate_bf16
        if emulate:
            out = numerics.emulated_linear(qa, qw, b)
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
                dx = numerics.emulated_matmul(qg, qw, x_dtype)
            if ctx.needs_input_grad[1]:
                dw = numerics.emulated_matmul(flat_g.t(), qa.reshape(-1, qa.shape[-1]), w_dtype)
        else:
            if ctx.needs_input_grad[0]:
                dx = qg.matmul(qw).to(x_dtype)
            if ctx.needs_input_grad[1]:
                dw = flat_g.t().matmul(qa.reshape(-1, qa.shape[-1])).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = qg.reshape(-1, qg.shape[-1]).sum(0).to(b_dtype)
        return dx, dw, db, None, None, None, None, None


class QuantLinear(nn.Linear):
    """Drop-in ``nn.Linear`` with 8-bit (HiF8 or FP8) fake quantization of A, W (forward) and G (backward)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 config: ScalingConfig | None = None, name: str = "", enabled: bool = True,
                 emulate_bf16: bool = False, own_bank: bool = True):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config if config is not None else ScalingConfig()  # validated when it was made
        self.quant_name = name
        self.quant_enabled = bool(enabled)
        self.emulate_bf16 = bool(emulate_bf16)
        self.recompute_weight = False  # True under FSDP: see set_weight_recompute
        self.state_in_state_dict = False  # see set_state_in_state_dict
        object.__setattr__(self, "_bank", None)
        self._rows = (0, 1, 2)
        if own_bank:  # a conversion builds one bank for all its layers instead
            self._own_bank(device)

    def _own_bank(self, device) -> None:
        bank = ScalerBank(self.config, ROLES, device=device)
        bank.set_row_names([f"{self.quant_name or 'QuantLinear'}.{r}" for r in ROLES])
        self.hif8_bank = bank  # registered: follows the layer's device moves
        self._attach(bank, (0, 1, 2))

    def _attach(self, bank: ScalerBank, rows: tuple[int, int, int]) -> None:
        object.__setattr__(self, "_bank", bank)  # not a submodule: the model's bank is registered once
        self._rows = rows
        if "hif8_bank" in self._modules and self._modules["hif8_bank"] is not bank:
            del self._modules["hif8_bank"]

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: ScalingConfig | None = None, name: str = "",
                    enabled: bool = True, *, emulate_bf16: bool = False, own_bank: bool = True) -> QuantLinear:
        """Wrap an existing ``nn.Linear``, sharing its Parameter objects (optimizer state stays valid).
        ``own_bank=False``: no scaler bank yet (a conversion attaches the model's one)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  config=config, name=name, enabled=enabled, emulate_bf16=emulate_bf16, own_bank=False)
        new.weight = linear.weight
        new.bias = linear.bias
        if own_bank:
            new._own_bank(linear.weight.device)
        new.train(linear.training)
        return new

    @property
    def bank(self) -> ScalerBank:
        return self._bank

    def scalers(self) -> Iterator[tuple[str, BankedScaler]]:
        for role, row in zip(ROLES, self._rows):
            yield role, BankedScaler(self._bank, row)

    # Three int attributes, not one tuple: a compiled block guards on each int on its own, which torch.compile can
    # then treat as a graph input (see train.compiled_blocks), so that blocks differing only in their rows share
    # one graph.
    @property
    def _rows(self) -> tuple[int, int, int]:
        return self._row_a, self._row_w, self._row_g

    @_rows.setter
    def _rows(self, rows: tuple[int, int, int]) -> None:
        self._row_a, self._row_w, self._row_g = (int(r) for r in rows)

    scaler_a = property(lambda self: BankedScaler(self._bank, self._rows[0]))
    scaler_w = property(lambda self: BankedScaler(self._bank, self._rows[1]))
    scaler_g = property(lambda self: BankedScaler(self._bank, self._rows[2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quant_enabled:
            return F.linear(x, self.weight, self.bias)
        # a pass without gradients ends its micro-batch at the next call (no backward will)
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                            or (self.bias is not None and self.bias.requires_grad))
        return _QuantLinearFn.apply(x, self.weight, self.bias, self._bank.bank_id, self._rows,
                                   RECORD if grad else RECORD_NO_GRAD, not self.recompute_weight, self.emulate_bf16)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, hif8={'on' if self.quant_enabled else 'off'}"

    # -- the scalers in the module's own state dict (opt-in: set_state_in_state_dict) -------------------------
    def scaler_state(self, host: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This layer's scalers: ``{A|W|G}.{key}`` (CPU tensors of :mod:`hif8qat.scaling.bank_state`) and
        ``enabled``."""
        bank = self._bank
        bank.update()
        host = host if host is not None else bank._host()
        sd = {"enabled": torch.tensor(int(self.quant_enabled), dtype=torch.int64)}
        for role, row in zip(ROLES, self._rows):
            sd.update({f"{role}.{k}": v for k, v in bank.row_state_dict(row, host).items()})
        return sd

    def load_scaler_state(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        states: dict[int, dict[str, torch.Tensor]] = {}
        for key, v in sd.items():
            role, _, k = key.partition(".")
            if key != "enabled" and role not in ROLES:
                raise KeyError(f"{self.quant_name or 'QuantLinear'}: unexpected scaler state key {key!r}")
            if role in ROLES:
                states.setdefault(self._rows[ROLES.index(role)], {})[k] = v
        if strict and len(states) != len(ROLES):
            raise KeyError(f"{self.quant_name or 'QuantLinear'}: scaler state for {sorted(states)} rows only")
        self._bank.load_row_state_dicts(states, strict)
        if "enabled" in sd:
            self.quant_enabled = bool(int(sd["enabled"]))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.state_in_state_dict and self._bank is not None:
            for k, v in self.scaler_state().items():
                destination[f"{prefix}{STATE_KEY}.{k}"] = v

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
            try:
                self.load_scaler_state(mine, strict)
            except (KeyError, ValueError) as err:
                error_msgs.append(f"{head}*: {err}")
        elif strict:
            missing_keys.append(f"{head}*")


# --------------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------------
def convert_model(model: nn.Module, scope: str = "mlp", high_precision_blocks: Collection[int] | None = None,
                  config: ScalingConfig | None = None, *, enabled: bool = True,
                  module_filter_fn: ModuleFilter | None = None, emulate_bf16: bool = False) -> list[str]:
    """Replace the scope's ``nn.Linear``s of every block not listed in ``high_precision_blocks`` (block indices)
    and accepted by ``module_filter_fn(module, fqn)`` by :class:`QuantLinear`; all share one scaler bank.

    scope ``mlp``: gate/up/down projections; ``attn_mlp``: also q/k/v/o. Embeddings, lm_head, norms
    and everything outside the decoder blocks stay untouched. Returns the converted module names.
    """
    config = config if config is not None else ScalingConfig()
    try:
        chosen, _ = select_linears(model, scope, high_precision_blocks or (), module_filter_fn)
    except ValueError as err:
        raise ValueError(f"convert_model: {err}") from None
    converted = []
    for full, parent, leaf in chosen:
        mod = getattr(parent, leaf)
        if not isinstance(mod, QuantLinear):
            setattr(parent, leaf, QuantLinear.from_linear(mod, config, full, enabled=enabled,
                                                           emulate_bf16=emulate_bf16, own_bank=False))
        converted.append(full)
    if not converted:
        warnings.warn("convert_model: no linear left to convert (high-precision blocks / filter); nothing converted",
                      stacklevel=2)
    else:
        _build_bank(model, config)
    model._hif8qat_conversion = {"scope": scope, "high_precision_blocks": sorted(set(high_precision_blocks or ())),
                                 "config": ScalingConfig.to_dict(config), "converted": list(converted)}
    return converted


def _build_bank(model: nn.Module, config: ScalingConfig) -> ScalerBank:
    """One bank for every QuantLinear of the model (rows in module order: A, W, G of each layer)."""
    layers = list(quant_linears(model))
    device = layers[0][1].weight.device
    bank = ScalerBank(config, [r for _ in layers for r in ROLES], device=device)
    bank.set_row_names([f"{name}.{r}" for name, _ in layers for r in ROLES])
    for i, (_, layer) in enumerate(layers):
        layer._attach(bank, (3 * i, 3 * i + 1, 3 * i + 2))
    if not isinstance(model, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):  # their children are entries
        setattr(model, BANK_ATTR, bank)  # registered once: follows the model's device moves
    return bank


def quant_linears(model: nn.Module) -> Iterator[tuple[str, QuantLinear]]:
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            yield name, mod


def _banks(model: nn.Module) -> list[ScalerBank]:
    out: dict[int, ScalerBank] = {}
    for _, mod in quant_linears(model):
        out.setdefault(id(mod.bank), mod.bank)
    return list(out.values())


def scaler_banks(model: nn.Module) -> list[ScalerBank]:
    """The distinct scaler banks of a model's quantized layers (one after a conversion)."""
    return _banks(model)


def set_quantization(model: nn.Module, enabled: bool) -> None:
    """Switch quantization on/off; a layer switched from off to on resets its scalers (cold start)."""
    resets: dict[int, tuple[ScalerBank, list[int]]] = {}
    for _, mod in quant_linears(model):
        if enabled and not mod.quant_enabled:
            resets.setdefault(id(mod.bank), (mod.bank, []))[1].extend(mod._rows)
        mod.quant_enabled = bool(enabled)
    for bank, rows in resets.values():
        bank.reset(rows)


def set_weight_recompute(model: nn.Module, recompute: bool = True) -> None:
    """Recompute Q_W(W) in the backward instead of keeping it from the forward (FSDP: the full weight is
    re-gathered for the backward, and a kept quantized copy would hold a whole unsharded weight per layer
    from forward to backward). Bit-identical either way; off by default, on from ``distributed.apply_fsdp``."""
    for _, mod in quant_linears(model):
        mod.recompute_weight = bool(recompute)


def set_bf16_emulation(model: nn.Module, emulate: bool = True) -> None:
    """Whether the quantized layers run their BF16 GEMMs as FP32 GEMMs on BF16 values (see
    :mod:`hif8qat.compute_dtype`); the numerics of a run decide it, the layers never guess it."""
    for _, mod in quant_linears(model):
        mod.emulate_bf16 = bool(emulate)


def set_state_in_state_dict(model: nn.Module, on: bool = True) -> None:
    """Put each quantized layer's scaler state (amax histories, scales, step, counters) into
    ``model.state_dict()`` and read it back in ``load_state_dict``, so any trainer's checkpoint carries it."""
    for _, mod in quant_linears(model):
        mod.state_in_state_dict = bool(on)


def set_step(model: nn.Module, step: int) -> None:
    """Current optimizer step (drives schedules, history_unit=step and telemetry dump steps)."""
    for bank in _banks(model):
        bank.set_step(step)


def freeze_scales(model: nn.Module, frozen: bool = True) -> None:
    """Frozen: quantize with the current scales, record nothing and never communicate (evaluation)."""
    for bank in _banks(model):
        bank.freeze(frozen)


def update_scales(model: nn.Module) -> None:
    """End the current micro-batch now: record the amaxes of the quantizers that ran since the last update.

    A backward pass does this by itself when it ends; call it after a forward whose backward never runs.
    """
    for bank in _banks(model):
        bank.update()


# --------------------------------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------------------------------
def quant_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything needed to resume the quantizers exactly: ``{layer}.{A|W|G}.{key}`` and ``{layer}.enabled``.

    Per-quantizer tensors in the format of :mod:`hif8qat.scaling.bank_state` (exports written before the bank load as is).
    """
    sd: dict[str, torch.Tensor] = {}
    hosts: dict[int, dict[str, torch.Tensor]] = {}
    for name, mod in quant_linears(model):
        bank = mod.bank
        if id(bank) not in hosts:
            bank.update()
            hosts[id(bank)] = bank._host()  # one device-to-host copy per table
        sd.update({f"{name}.{k}": v for k, v in mod.scaler_state(hosts[id(bank)]).items()})
    return sd


def load_quant_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    layers = dict(quant_linears(model))
    grouped: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    enabled: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, v in sd.items():
        if key.endswith(".enabled") and key[: -len(".enabled")] in layers:
            enabled[key[: -len(".enabled")]] = v
            continue
        m = re.fullmatch(r"(.+)\.([AWG])\.([^.]+)", key)
        if m is None or m.group(1) not in layers:
            unexpected.append(key)
            continue
        grouped.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = v
    missing = [f"{n}.{r}" for n in layers for r in ROLES if (n, r) not in grouped]
    if strict and (missing or unexpected):
        raise KeyError(f"load_quant_state_dict: missing scalers {missing[:6]}{'...' if len(missing) > 6 else ''}"
                       f", unexpected keys {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}")
    per_bank: dict[int, tuple[ScalerBank, dict[int, Mapping[str, torch.Tensor]]]] = {}
    for (name, role), state in grouped.items():
        layer = layers[name]
        per_bank.setdefault(id(layer.bank), (layer.bank, {}))[1][layer._rows[ROLES.index(role)]] = state
    for bank, states in per_bank.values():
        bank.load_row_state_dicts(states)
    for name, v in enabled.items():
        layers[name].quant_enabled = bool(int(v))


# --------------------------------------------------------------------------------------------------
# telemetry
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def step_telemetry(model: nn.Module, reset: bool = True) -> dict[str, float]:
    """Aggregates per role since the last call (one host sync), then reset.

    Keys ``tel/<role>/<stat>``: amax_ratio_max (max amax/estimate), amax_ratio_gt1 (calls whose amax
    outgrew the estimate), exceed_frac_max (max fraction of |x*s| > target, on statistics calls),
    clipped_count (elements beyond the format's range, on statistics calls: for HiF8 the overflow
    |x*s| >= 40960, for FP8 |x*s| > max; logs written before FP8 call it overflow_count), nonfinite_count
    (calls with a non-finite amax), amax_max, calls, stats_calls, and target (the scale target the role's
    quantizers map the amax estimate to: the run's per-role target, FP8's format max / 2^margin).
    """
    banks = _banks(model)
    if not banks:
        return {}
    for bank in banks:
        bank.update()
    roles = sorted({r for bank in banks for r in bank.roles})
    maxes, cnts = [], []
    for r in roles:
        rows = [(bank, torch.tensor([i for i, x in enumerate(bank.roles) if x == r], device=bank.device))
                for bank in banks]
        maxes.append(torch.stack([b.tel_max.index_select(0, ix).amax(0) for b, ix in rows]).amax(0))
        cnts.append(torch.stack([b.tel_cnt.index_select(0, ix).sum(0) for b, ix in rows]).sum(0))
    maxes_l, cnts_l = torch.stack(maxes).tolist(), torch.stack(cnts).tolist()
    out: dict[str, float] = {}
    for ri, r in enumerate(roles):
        for k, v in zip(TELEMETRY_MAX_FIELDS, maxes_l[ri]):
            out[f"tel/{r}/{k}"] = float(v)
        for k, v in zip(TELEMETRY_COUNT_FIELDS, cnts_l[ri]):
            out[f"tel/{r}/{k}"] = float(v)
        out[f"tel/{r}/calls"] = float(sum(int(b.tel_calls[[x == r for x in b.roles]].sum()) for b in banks))
        out[f"tel/{r}/stats_calls"] = float(sum(int(b.tel_stat_calls[[x == r for x in b.roles]].sum())
                                                for b in banks))
        out[f"tel/{r}/target"] = max(t for b in banks for t, x in zip(b.targets, b.roles) if x == r)
    if reset:
        for bank in banks:
            bank.reset_telemetry()
    return out


__all__ = [
    "BANK_ATTR", "SCOPES", "STATE_KEY", "QuantLinear", "convert_model", "find_transformer_blocks", "freeze_scales",
    "load_quant_state_dict", "quant_linears", "quant_state_dict", "scaler_banks", "set_bf16_emulation", "set_quantization",
    "set_state_in_state_dict", "set_step", "set_weight_recompute", "step_telemetry", "update_scales",
]
