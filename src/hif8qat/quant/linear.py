"""The 8-bit (HiF8 or FP8) quantized linear layer and model conversion (contract: docs/design.md).

This module owns :class:`QuantLinear` (an ``nn.Linear`` with quantizers A, W, G, rows of one
:class:`~hif8qat.scaling.bank.ScalerBank` per converted model; its docstring gives the arithmetic),
``QuantConv1D`` (the same for GPT-2's ``Conv1D``), the conversion that swaps a model's GEMM modules for them
(``_convert_model``, private to :mod:`hif8qat.quant`: the public way in is
:func:`~hif8qat.quant.training.convert_to_hif8_training`; :func:`coverage` says what was left out and why), and
the model-wide switches and state: quantization on/off, frozen scales, BF16 emulation, weight recompute under
FSDP, the scaler state in or out of ``model.state_dict()``, the optimizer step and the per-step telemetry. MoE
experts are in :mod:`hif8qat.quant.experts`; all share the autograd function and scaler plumbing of
:mod:`hif8qat.quant.gemm`.
"""

from __future__ import annotations

import numbers
import re
import warnings
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from hif8qat.quant.blocks import (
    DEFAULT_SCOPE,
    NOT_CONVERTED,
    QUANT_OFF,
    QUANTIZED,
    SCOPES,
    ModuleFilter,
    block_gemms,
    find_transformer_blocks,
    select_gemms,
)
from hif8qat.quant.experts import QuantExperts, check_experts_layout
from hif8qat.quant.gemm import STATE_KEY, QuantState, _join
from hif8qat.scaling.bank import ScalerBank
from hif8qat.scaling.settings import ROLES, TELEMETRY_COUNT_FIELDS, TELEMETRY_MAX_FIELDS, ScalingConfig

BANK_ATTR = "hif8qat_bank"  # the model-level bank's attribute on a converted model


# --------------------------------------------------------------------------------------------------
# autograd function and module
# --------------------------------------------------------------------------------------------------
class QuantLinear(QuantState, nn.Linear):
    """Drop-in ``nn.Linear`` with 8-bit (HiF8 or FP8) fake quantization of A, W (forward) and G (backward).

    It keeps the parameters ``weight`` / ``bias``, so ``state_dict()`` keys and ``save_pretrained`` folders
    are those of the plain model. The scaler state is kept out of the model's state dict (see
    :func:`quant_state_dict`) unless :func:`set_state_in_state_dict` puts it there, as the public
    ``convert_to_hif8_training`` does: then ``{layer}.hif8_scaler.{A|W|G}.{key}`` entries travel with any
    trainer's checkpoint of ``model.state_dict()``. A layer built on its own has a private bank. With
    quantization on, a custom autograd function computes::

        forward   y  = Q_A(x) Q_W(W)^T + b     (bias added in high precision, not quantized)
        backward  dX = Q_G(g) Q_W(W)
                  dW = Q_G(g)^T Q_A(x)
                  db = sum Q_G(g)

    The forward's quantized A and W are saved, so W is quantized once per micro-batch, eager activation
    checkpointing included (see :mod:`hif8qat.scaling.bank`); under torch.compile its recompute quantizes W
    again.

    Under FSDP (:func:`set_weight_recompute`, called by ``distributed.apply_fsdp``) the backward recomputes
    Q_W(W) from the re-gathered W with the forward's scale instead, as the authors' HiF8GemmFunction does:
    bit-identical, and no full quantized weight lives from forward to backward.

    Each Q is one call of the custom op ``hif8qat::bank_qdq`` (traceable: a whole-model ``torch.compile`` has
    no graph break from these layers). Q_A / Q_W use round-half-away (``ta``), Q_G uses ``grad_rounding``;
    each maps the amax estimate to its role's target (``ScalingConfig.targets``). With
    ``ScalingConfig.format`` an FP8 format (``e4m3``, ``e5m2``, or ``hybrid``: E4M3 for A and W, E5M2 for G)
    the same layer quantizes with saturating FP8 casts and the FP8 targets instead. With quantization off the
    forward is exactly ``F.linear`` (identical outputs and gradients to ``nn.Linear``).

    Micro-batches: every quantizer runs once per forward/backward; the bank records the amaxes when the
    backward ends (or at the next call of a forward-only pass, or :func:`update_scales`). Activation
    checkpointing is safe: the recomputed forward reuses the forward's scales and records nothing; any other
    second call of a layer in one micro-batch raises :class:`~hif8qat.scaling.bank.QuantizerCalledTwice`.

    BF16 emulation is a value of the layer (``emulate_bf16``, set at conversion or by
    :func:`set_bf16_emulation`): a BF16 GEMM of the layer then runs as FP32 on BF16 values
    (:mod:`hif8qat.compute_dtype`), in forward and backward.

    Autocast: under ``torch.autocast`` the quantizers see the incoming tensors as they are (the HiF8
    arithmetic is done in fp32 inside ``formats``) and write the quantized A and W in the autocast dtype (bit
    for bit the cast of the result in the input's dtype, without a separate cast pass); the bias is cast and
    the matmul runs in that dtype with autocast disabled, i.e. exactly what autocast's own ``linear`` would do
    with the quantized operands. The backward quantizes G into the dtype of the saved Q_W(W), runs its matmuls
    in that dtype and returns gradients in the dtypes of x, W and b. Without autocast everything runs in the
    input dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 config: ScalingConfig | None = None, name: str = "", enabled: bool = True,
                 emulate_bf16: bool = False, own_bank: bool = True):
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_quant(config, name, enabled, emulate_bf16)
        if own_bank:  # a conversion builds one bank for all its layers instead
            self._own_bank(device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: ScalingConfig | None = None, name: str = "",
                    enabled: bool = True, *, emulate_bf16: bool = False, own_bank: bool = True) -> QuantLinear:
        """Wrap an existing ``nn.Linear``, sharing its Parameter objects (optimizer state stays valid).

        Args:
            linear: the layer.
            config: the scaling settings (default ``ScalingConfig()``).
            name: the layer's name in the model (for messages and telemetry).
            enabled: quantization on.
            emulate_bf16: run BF16 GEMMs as FP32 on BF16 values.
            own_bank: build a private scaler bank (False: a conversion attaches the model's one).

        Returns:
            The quantized layer.
        """
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  config=config, name=name, enabled=enabled, emulate_bf16=emulate_bf16, own_bank=False)
        new.weight = linear.weight
        new.bias = linear.bias
        if own_bank:
            new._own_bank(linear.weight.device)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear`` with quantized operands (or exactly ``F.linear`` when quantization is off).

        Args:
            x: the input.

        Returns:
            The output.
        """
        if not self.quant_enabled:
            return F.linear(x, self.weight, self.bias)
        return self._quant_gemm(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        """The linear's sizes, whether quantization is on and the format, for ``repr``.

        Returns:
            The text.
        """
        return (f"{super().extra_repr()}, quant={'on' if self.quant_enabled else 'off'}, "
                f"format={self.config.format}")


class QuantConv1D(QuantState, nn.Module):
    """GPT-2's ``Conv1D`` (``y = x W + b``, weight ``[in, out]``) quantized like :class:`QuantLinear`; the parameter
    names and shapes stay the Conv1D's, so its checkpoints load as they are."""

    hif8_kind = "conv1d"

    def __init__(self, conv, config: ScalingConfig | None = None, name: str = "", enabled: bool = True, *,
                 emulate_bf16: bool = False, own_bank: bool = True):
        super().__init__()
        self.nf, self.nx = conv.nf, conv.nx
        self.weight, self.bias = conv.weight, conv.bias  # shared: optimizer state stays valid
        self._init_quant(config, name, enabled, emulate_bf16)
        if own_bank:  # a conversion builds one bank for all its layers instead
            self._own_bank(conv.weight.device)
        self.train(conv.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W + b`` with quantized operands (or exactly Conv1D's arithmetic when quantization is off).

        Args:
            x: the input.

        Returns:
            The output.
        """
        if not self.quant_enabled:  # Conv1D's own arithmetic
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)
        # Q(W^T) = Q(W)^T: a per-tensor scale does not see the layout
        return self._quant_gemm(x, self.weight.t(), self.bias)

    def extra_repr(self) -> str:
        """The Conv1D's sizes, whether quantization is on and the format, for ``repr``.

        Returns:
            The text.
        """
        return f"nf={self.nf}, nx={self.nx}, quant={'on' if self.quant_enabled else 'off'}, format={self.config.format}"


# --------------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------------
def _convert_model(model: nn.Module, scope: str = DEFAULT_SCOPE, high_precision_blocks: Collection[int] | None = None,
                   config: ScalingConfig | None = None, *, enabled: bool = True,
                   module_filter_fn: ModuleFilter | None = None, emulate_bf16: bool = False,
                   role_map: Mapping[str, str] | None = None) -> list[str]:
    """Quantize the scope's GEMM modules (``nn.Linear``, ``Conv1D``, MoE experts) of every block not listed in
    ``high_precision_blocks``; all share one scaler bank. Routers, embeddings, lm_head, norms and everything
    outside the decoder blocks stay untouched; roles come from the block's structure
    (:mod:`hif8qat.quant.blocks`).

    Args:
        model: the model, converted in place.
        scope: ``mlp`` (the feed-forward / MoE GEMMs) or ``attn_mlp`` (also attention's).
        high_precision_blocks: block indices left in high precision.
        config: the scaling settings (default ``ScalingConfig()``).
        enabled: quantization on from the start.
        module_filter_fn: ``fn(module, fqn) -> bool``; False leaves a GEMM out.
        emulate_bf16: the layers run BF16 GEMMs as FP32 on BF16 values.
        role_map: block-relative name -> ``attn`` / ``mlp`` / ``none``, for names the structure cannot place.

    Returns:
        The converted module names (:func:`coverage` says, for every GEMM weight of the blocks, whether it is
        quantized or why not).
    """
    config = config if config is not None else ScalingConfig()
    try:
        selection = select_gemms(model, scope, high_precision_blocks or (), module_filter_fn, role_map)
        for g in selection.chosen:  # refuse an experts layout before anything is swapped
            if g.kind == "experts" and not isinstance(g.module, QuantExperts):
                check_experts_layout(g.module, g.fqn)
    except ValueError as err:
        raise ValueError(f"convert_model: {err}") from None
    converted = []
    for g in selection.chosen:
        parent_name, _, leaf = g.fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        mod, kw = g.module, {"enabled": enabled, "emulate_bf16": emulate_bf16}
        if isinstance(mod, QuantState):
            pass
        elif g.kind == "linear":
            setattr(parent, leaf, QuantLinear.from_linear(mod, config, g.fqn, own_bank=False, **kw))
        elif g.kind == "conv1d":
            setattr(parent, leaf, QuantConv1D(mod, config, g.fqn, own_bank=False, **kw))
        else:
            setattr(parent, leaf, QuantExperts(mod, config, g.fqn, own_bank=False, **kw))
        converted.append(g.fqn)
    if not converted:
        warnings.warn("convert_model: no GEMM left to convert (high-precision blocks); nothing converted",
                      stacklevel=2)
    else:
        _build_bank(model, config)
    model._hif8qat_conversion = {"scope": scope, "high_precision_blocks": sorted(set(high_precision_blocks or ())),
                                 "config": ScalingConfig.to_dict(config), "converted": list(converted)}
    if role_map:
        model._hif8qat_conversion["role_map"] = dict(role_map)
    object.__setattr__(model, "_hif8qat_coverage", dict(selection.coverage))  # not saved: rebuilt by a conversion
    return converted


def coverage(model: nn.Module) -> dict[str, str]:
    """For every GEMM weight of the model's decoder blocks (its name in the model; an expert's slice is
    ``{experts}.{param}.{index}``): ``"quantized"``, or why it is not (the scope, a high-precision block,
    ``module_filter_fn``, a router, ``role_map``, quantization switched off, or the model not converted).

    Args:
        model: the model.

    Returns:
        Weight name -> ``"quantized"`` or the reason.
    """
    recorded = getattr(model, "_hif8qat_coverage", {})
    roles = getattr(model, "_hif8qat_conversion", {}).get("role_map")
    out = {}
    for g in block_gemms(model, roles)[2]:
        on = isinstance(g.module, QuantState) and g.module.quant_enabled
        for site in g.sites:
            reason = QUANTIZED if on else recorded.get(site, NOT_CONVERTED)
            out[site] = QUANT_OFF if reason == QUANTIZED and not on else reason
    return out


def _build_bank(model: nn.Module, config: ScalingConfig) -> ScalerBank:
    """One bank for every quantized module of the model (rows in module order: A, W, G of each GEMM site)."""
    mods = list(quant_modules(model))
    device = next(mods[0][1].parameters()).device
    sites = [(_join(name, s)) for name, mod in mods for s in mod.site_names()]
    bank = ScalerBank(config, [r for _ in sites for r in ROLES], device=device)
    bank.set_row_names([f"{site}.{r}" for site in sites for r in ROLES])
    first = 0
    for _, mod in mods:
        n = 3 * len(mod.site_names())
        mod._attach(bank, tuple(range(first, first + n)))
        first += n
    if not isinstance(model, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):  # their children are entries
        setattr(model, BANK_ATTR, bank)  # registered once: follows the model's device moves
    return bank


def quant_modules(model: nn.Module) -> Iterator[tuple[str, QuantState]]:
    """Every quantized module (linears, Conv1Ds, MoE experts), in module order.

    Args:
        model: the model.

    Yields:
        ``(name, module)``.
    """
    for name, mod in model.named_modules():
        if isinstance(mod, QuantState):
            yield name, mod


def quant_linears(model: nn.Module) -> Iterator[tuple[str, QuantLinear | QuantConv1D]]:
    """The quantized modules with one GEMM site (linears and Conv1Ds).

    Args:
        model: the model.

    Yields:
        ``(name, module)``.
    """
    for name, mod in quant_modules(model):
        if isinstance(mod, (QuantLinear, QuantConv1D)):
            yield name, mod


def quant_sites(model: nn.Module) -> Iterator[tuple[str, QuantState, tuple[int, int, int]]]:
    """``(site name, module, its A/W/G rows)`` for every GEMM site (one per linear, two per expert).

    Args:
        model: the model.

    Yields:
        ``(site name, module, rows)``.
    """
    for name, mod in quant_modules(model):
        for i, site in enumerate(mod.site_names()):
            yield _join(name, site), mod, mod._rows[3 * i: 3 * i + 3]


def _banks(model: nn.Module) -> list[ScalerBank]:
    out: dict[int, ScalerBank] = {}
    for _, mod in quant_modules(model):
        out.setdefault(id(mod.bank), mod.bank)
    return list(out.values())


def scaler_banks(model: nn.Module) -> list[ScalerBank]:
    """The distinct scaler banks of a model's quantized layers (one after a conversion).

    Args:
        model: the model.

    Returns:
        The banks.
    """
    return _banks(model)


def set_quantization(model: nn.Module, enabled: bool) -> None:
    """Switch quantization on/off; a layer switched from off to on resets its scalers (cold start).

    Args:
        model: the model.
        enabled: quantization on.
    """
    resets: dict[int, tuple[ScalerBank, list[int]]] = {}
    for _, mod in quant_modules(model):
        if enabled and not mod.quant_enabled:
            resets.setdefault(id(mod.bank), (mod.bank, []))[1].extend(mod._rows)
        mod.quant_enabled = bool(enabled)
    for bank, rows in resets.values():
        bank.reset(rows)


def set_weight_recompute(model: nn.Module, recompute: bool = True) -> None:
    """Recompute Q_W(W) in the backward instead of keeping it from the forward (FSDP: the full weight is
    re-gathered for the backward, and a kept quantized copy would hold a whole unsharded weight per layer
    from forward to backward). Bit-identical either way; off by default, on from ``distributed.apply_fsdp``.

    Args:
        model: the model.
        recompute: recompute instead of keeping.
    """
    for _, mod in quant_modules(model):
        mod.recompute_weight = bool(recompute)


def set_bf16_emulation(model: nn.Module, emulate: bool = True) -> None:
    """Whether the quantized layers run their BF16 GEMMs as FP32 GEMMs on BF16 values (see
    :mod:`hif8qat.compute_dtype`); the numerics of a run decide it, the layers never guess it.

    Args:
        model: the model.
        emulate: emulate BF16 GEMMs.
    """
    for _, mod in quant_modules(model):
        mod.emulate_bf16 = bool(emulate)


def set_state_in_state_dict(model: nn.Module, on: bool = True) -> None:
    """Put each quantized layer's scaler state (amax histories, scales, step, counters) into
    ``model.state_dict()`` and read it back in ``load_state_dict``, so any trainer's checkpoint carries it.

    Args:
        model: the model.
        on: carry the scaler state in the state dict.
    """
    for _, mod in quant_modules(model):
        mod.state_in_state_dict = bool(on)
    for bank in _banks(model):
        bank.rng_in_state_dict = bool(on)


def is_scaler_key(key: str) -> bool:
    """Whether a ``model.state_dict()`` key is a scaler entry (:func:`set_state_in_state_dict`), not a weight.

    Args:
        key: a state-dict key.

    Returns:
        True for a layer's scaler entry or the bank's generator state.
    """
    return f".{STATE_KEY}." in f".{key}" or f".{BANK_ATTR}." in f".{key}"


def scaler_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The scaler entries of ``model.state_dict()`` alone: what a data-parallel rank keeps of its own (its
    scalers are its own unless ``amax_reduce`` makes them common), beside the weights every rank shares.

    Args:
        model: a model whose scalers are in its state dict (:func:`set_state_in_state_dict`).

    Returns:
        Key -> tensor, the keys as ``model.state_dict()`` has them.
    """
    return {k: v for k, v in model.state_dict().items() if is_scaler_key(k)}


def _scaler_owner(key: str) -> str | None:
    """The quantized module whose scaler entry ``key`` is (None for the bank's generator)."""
    head, sep, _ = f".{key}".partition(f".{STATE_KEY}.")
    return head[1:] if sep else None


def load_scaler_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """Restore :func:`scaler_state_dict`'s entries, every one of them.

    Args:
        model: the model, converted as the one that saved them, its scalers in its state dict.
        sd: the saved entries.

    Raises:
        KeyError: entries missing, or entries of layers the model does not have.
        RuntimeError: scalers recorded under other settings (``format``, ``algo``, ...).
    """
    expected = set(scaler_state_dict(model))
    owners = {_scaler_owner(k) for k in expected}
    missing = sorted(expected - set(sd))
    # a state may hold what a fresh one lacks (an estimator's optional entries): the layer's own load checks those
    unexpected = sorted(k for k in sd if k not in expected and _scaler_owner(k) not in owners)
    if missing or unexpected:
        raise KeyError(f"load_scaler_state_dict: missing scalers {missing[:6]}{'...' if len(missing) > 6 else ''}"
                       f", unexpected keys {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}")
    model.load_state_dict(dict(sd), strict=False)  # the weights are not in sd; every scaler key is checked above


@contextmanager
def scalers_left_out(model: nn.Module) -> Iterator[None]:
    """Inside, ``model.state_dict()`` and ``load_state_dict`` hold the weights only: for files of the weights,
    which every rank shares and plain ``transformers`` reads (the scalers travel per rank, or in an export's
    own file).

    Args:
        model: the model.

    Yields:
        Nothing; the scalers are back in the state dict as before on leaving.
    """
    modules, banks = [mod for _, mod in quant_modules(model)], _banks(model)
    kept = [mod.state_in_state_dict for mod in modules], [bank.rng_in_state_dict for bank in banks]
    set_state_in_state_dict(model, False)
    try:
        yield
    finally:
        for mod, on in zip(modules, kept[0]):
            mod.state_in_state_dict = on
        for bank, on in zip(banks, kept[1]):
            bank.rng_in_state_dict = on


def set_step(model: nn.Module, step: int) -> None:
    """Current optimizer step (drives schedules, history_unit=step and telemetry dump steps): an integer >= 0
    that never goes back (a loaded scaler state brings its own step back with it). Call it before each
    optimizer step; with ``transformers.Trainer``, :class:`hif8qat.integrations.hf.StepCallback` does.

    Args:
        model: the model.
        step: the optimizer step.
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"set_step: step={step!r} ({type(step).__name__}) is invalid; allowed: an int >= 0, the "
                        "number of optimizer steps taken (e.g. transformers' state.global_step)")
    step = int(step)
    if step < 0:
        raise ValueError(f"set_step: step={step} is invalid; allowed: an int >= 0")
    banks = _banks(model)
    if not banks:
        raise ValueError(f"set_step: {type(model).__name__} has no quantized layers; convert it first with "
                         "hif8qat.convert_to_hif8_training(model, config=...)")
    for bank in banks:
        if step < bank.step:
            raise ValueError(f"set_step: step={step} goes back from the model's step {bank.step}; steps only go "
                             "forward (loading a checkpoint's model state restores its step: continue from there)")
    for bank in banks:
        bank.set_step(step)


def freeze_scales(model: nn.Module, frozen: bool = True) -> None:
    """Frozen: quantize with the current scales, record nothing and never communicate (evaluation).

    Args:
        model: the model.
        frozen: True to freeze, False to resume recording.
    """
    for bank in _banks(model):
        bank.freeze(frozen)


def update_scales(model: nn.Module) -> None:
    """End the current micro-batch now: record the amaxes of the quantizers that ran since the last update.

    A backward pass does this by itself when it ends; call it after a forward whose backward never runs.

    Args:
        model: the model.
    """
    for bank in _banks(model):
        bank.update()


# --------------------------------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------------------------------
def quant_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything needed to resume the quantizers exactly: ``{site}.{A|W|G}.{key}`` per GEMM site and
    ``{module}.enabled``.

    Per-quantizer tensors in the format of :mod:`hif8qat.scaling.bank_state` (exports written before the bank load
    as is).

    Args:
        model: the model.

    Returns:
        Key -> CPU tensor.
    """
    sd: dict[str, torch.Tensor] = {}
    hosts: dict[int, dict[str, torch.Tensor]] = {}
    for name, mod in quant_modules(model):
        bank = mod.bank
        if id(bank) not in hosts:
            bank.update()
            hosts[id(bank)] = bank._host()  # one device-to-host copy per table
        sd.update({f"{name}.{k}": v for k, v in mod.scaler_state(hosts[id(bank)]).items()})
    bank = getattr(model, BANK_ATTR, None)
    if isinstance(bank, ScalerBank):  # the stochastic-rounding generator (nothing without stochastic rounding)
        sd.update({f"{BANK_ATTR}.{k}": v for k, v in bank.rng_state_dict().items()})
    return sd


def load_quant_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Restore what :func:`quant_state_dict` saved.

    Args:
        model: the converted model.
        sd: the saved state.
        strict: refuse missing scalers and unexpected keys.

    Raises:
        KeyError: naming the missing scalers and unexpected keys.
    """
    modules = dict(quant_modules(model))
    sites = {site: (mod, rows) for site, mod, rows in quant_sites(model)}
    grouped: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    enabled: dict[str, torch.Tensor] = {}
    unexpected = []
    rng = {k[len(BANK_ATTR) + 1:]: v for k, v in sd.items() if k.startswith(BANK_ATTR + ".")}
    sd = {k: v for k, v in sd.items() if not k.startswith(BANK_ATTR + ".")}
    for key, v in sd.items():
        if key.endswith(".enabled") and key[: -len(".enabled")] in modules:
            enabled[key[: -len(".enabled")]] = v
            continue
        m = re.fullmatch(r"(.+)\.([AWG])\.([^.]+)", key)
        if m is None or m.group(1) not in sites:
            unexpected.append(key)
            continue
        grouped.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = v
    missing = [f"{n}.{r}" for n in sites for r in ROLES if (n, r) not in grouped]
    if strict and (missing or unexpected):
        raise KeyError(f"load_quant_state_dict: missing scalers {missing[:6]}{'...' if len(missing) > 6 else ''}"
                       f", unexpected keys {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}")
    per_bank: dict[int, tuple[ScalerBank, dict[int, Mapping[str, torch.Tensor]]]] = {}
    for (site, role), state in grouped.items():
        mod, rows = sites[site]
        per_bank.setdefault(id(mod.bank), (mod.bank, {}))[1][rows[ROLES.index(role)]] = state
    for bank, states in per_bank.values():
        bank.load_row_state_dicts(states)
    for name, v in enabled.items():
        modules[name].quant_enabled = bool(int(v))
    bank = getattr(model, BANK_ATTR, None)
    if rng and isinstance(bank, ScalerBank):
        bank.load_rng_state_dict(rng)


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

    Args:
        model: the model.
        reset: start the next aggregation afresh.

    Returns:
        Key -> value.
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
    "BANK_ATTR", "SCOPES", "STATE_KEY", "QuantConv1D", "QuantExperts", "QuantLinear", "QuantState",
    "coverage", "quant_modules", "quant_sites", "find_transformer_blocks", "freeze_scales",
    "is_scaler_key", "load_quant_state_dict", "load_scaler_state_dict", "quant_linears", "quant_state_dict",
    "scaler_banks", "scaler_state_dict", "scalers_left_out", "set_bf16_emulation", "set_quantization",
    "set_state_in_state_dict", "set_step", "set_weight_recompute", "step_telemetry", "update_scales",
]
