"""HiF8 quantized linear layer and model conversion (contract: docs/design.md).

``HiF8Linear`` is an ``nn.Linear`` (same parameters ``weight`` / ``bias``, so ``state_dict()`` keys and
``save_pretrained`` folders are those of the plain model) with three :class:`~hif8qat.scaling.DelayedScaler`
submodules ``scaler_a``, ``scaler_w``, ``scaler_g`` whose state is kept out of the model's state dict.

With quantization on, a custom autograd function computes::

    forward   y  = Q_A(x) Q_W(W)^T + b            (bias added in high precision, not quantized)
    backward  dX = Q_G(g) Q_W(W)
              dW = Q_G(g)^T Q_A(x)                 (the forward's quantized A and W are saved and reused)
              db = sum Q_G(g)                      (as the authors' HiF8GemmFunction does)

Q_A / Q_W use round-half-away (``ta``) and ``target_fwd``; Q_G uses ``grad_rounding`` and
``target_bwd``. With quantization off the forward is exactly ``F.linear`` (identical outputs and
gradients to ``nn.Linear``).

Autocast: under ``torch.autocast`` the quantizers see the incoming tensors as they are (the HiF8
arithmetic is done in fp32 inside ``formats`` and the result is returned in the input's dtype), then
the quantized A and W (and the bias) are cast to the autocast dtype and the matmul runs in that dtype
with autocast disabled, i.e. exactly what autocast's own ``linear`` would do with the quantized
operands. The backward runs its matmuls in the dtype of the saved operands (the autocast dtype) and
returns gradients in the dtypes of x, W and b. Without autocast everything runs in the input dtype.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hif8qat.scaling import _TEL_CNT, _TEL_MAX, ROLES, DelayedScaler, ScalingConfig

SCOPES = ("mlp", "attn_mlp")
QUANT_JSON = "hif8qat_quant.json"
SCALERS_FILE = "hif8qat_scalers.safetensors"

# Linear layers converted per scope: container segment + leaf name (Llama / SmolLM2 / Qwen / openPangu
# use mlp.{gate,up,down}_proj and self_attn.{q,k,v,o}_proj; a few other common spellings are accepted).
_MLP_CONTAINERS = {"mlp", "feed_forward", "ffn"}
_MLP_LEAVES = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2", "w1", "w2", "w3"}
_ATTN_CONTAINERS = {"self_attn", "attention", "attn", "self_attention"}
_ATTN_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "out_proj", "query", "key", "value",
                "query_key_value", "dense"}


# --------------------------------------------------------------------------------------------------
# autograd function and module
# --------------------------------------------------------------------------------------------------
class _HiF8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module):
        qa = module.scaler_a.quantize(x)
        qw = module.scaler_w.quantize(weight)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            cdt = torch.get_autocast_dtype(dev)
            qa, qw = qa.to(cdt), qw.to(cdt)
            b = bias.to(cdt) if bias is not None else None
            with torch.autocast(dev, enabled=False):
                out = F.linear(qa, qw, b)
        else:
            out = F.linear(qa, qw, bias)
        ctx.save_for_backward(qa, qw)
        ctx.module = module
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        qa, qw = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        qg = ctx.module.scaler_g.quantize(grad_out)
        if qg.dtype != qw.dtype:
            qg = qg.to(qw.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = qg.matmul(qw).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = qg.reshape(-1, qg.shape[-1]).t().matmul(qa.reshape(-1, qa.shape[-1])).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = qg.reshape(-1, qg.shape[-1]).sum(0).to(b_dtype)
        return dx, dw, db, None


@torch.compiler.disable
def _quantized_linear(x, weight, bias, module):
    # The scalers keep Python-side bookkeeping (call counters, schedules) that a traced graph would bake
    # in as constants: under torch.compile the quantized linear is a graph break and runs eagerly (the
    # HiF8 kernel inside formats is compiled on its own).
    return _HiF8LinearFn.apply(x, weight, bias, module)


class HiF8Linear(nn.Linear):
    """Drop-in ``nn.Linear`` with HiF8 fake quantization of A, W (forward) and G (backward)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 config: ScalingConfig | None = None, name: str = "", enabled: bool = True):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config if config is not None else ScalingConfig()
        self.config.validate()
        self.quant_name = name
        self.quant_enabled = bool(enabled)
        self._build_scalers(device)

    def _build_scalers(self, device) -> None:
        self.scaler_a = DelayedScaler("A", self.config, device=device)
        self.scaler_w = DelayedScaler("W", self.config, device=device)
        self.scaler_g = DelayedScaler("G", self.config, device=device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: ScalingConfig | None = None, name: str = "",
                    enabled: bool = True) -> HiF8Linear:
        """Wrap an existing ``nn.Linear``, sharing its Parameter objects (optimizer state stays valid)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  config=config, name=name, enabled=enabled)
        new.weight = linear.weight
        new.bias = linear.bias
        new._build_scalers(linear.weight.device)
        new.train(linear.training)
        return new

    def scalers(self) -> Iterator[tuple[str, DelayedScaler]]:
        yield "A", self.scaler_a
        yield "W", self.scaler_w
        yield "G", self.scaler_g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quant_enabled:
            return F.linear(x, self.weight, self.bias)
        return _quantized_linear(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, hif8={'on' if self.quant_enabled else 'off'}"


# --------------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------------
def find_transformer_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of decoder layers: the longest ModuleList whose entries have an mlp or attention."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if all(any(hasattr(b, c) for c in _MLP_CONTAINERS | _ATTN_CONTAINERS) for b in mod):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError(f"{type(model).__name__}: no ModuleList of decoder layers (blocks with an 'mlp' or "
                         "'self_attn' submodule) found; is this a Llama-style causal LM?")
    return best


def parse_high_precision_blocks(spec: Any, num_blocks: int) -> list[int]:
    """Resolve a high-precision block spec: list of indices, "none", "0,1,2", or "first{k}_last{m}"."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "none")):
        return []
    if isinstance(spec, str):
        s = spec.strip().lower()
        m = re.fullmatch(r"(?:first(\d+))?_?(?:last(\d+))?", s)
        if m and (m.group(1) or m.group(2)):
            k, l_ = int(m.group(1) or 0), int(m.group(2) or 0)
            if k + l_ > num_blocks:
                raise ValueError(f"high_precision_blocks={spec!r}: first {k} + last {l_} exceeds the model's "
                                 f"{num_blocks} blocks")
            return sorted(set(range(k)) | set(range(num_blocks - l_, num_blocks)))
        if re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", s):
            spec = [int(v) for v in s.split(",")]
        else:
            raise ValueError(f"high_precision_blocks={spec!r} is invalid; allowed: none, a list of block "
                             "indices, '0,1,2', or 'first<k>_last<m>'")
    if not isinstance(spec, Iterable):
        raise ValueError(f"high_precision_blocks={spec!r} is invalid; allowed: none, a list of block indices, "
                         "or 'first<k>_last<m>'")
    out = set()
    for v in spec:
        if isinstance(v, bool) or not isinstance(v, (int, str)) or (isinstance(v, str) and not v.isdigit()):
            raise ValueError(f"high_precision_blocks: {v!r} is not a block index")
        i = int(v)
        if not 0 <= i < num_blocks:
            raise ValueError(f"high_precision_blocks: block index {i} out of range 0..{num_blocks - 1} "
                             f"(the model has {num_blocks} blocks)")
        out.add(i)
    return sorted(out)


def _matches(name: str, scope: str) -> bool:
    parts = name.split(".")
    leaf, containers = parts[-1], set(parts[:-1])
    if containers & _MLP_CONTAINERS and leaf in _MLP_LEAVES:
        return True
    return scope == "attn_mlp" and bool(containers & _ATTN_CONTAINERS) and leaf in _ATTN_LEAVES


def convert_model(model: nn.Module, scope: str = "mlp", high_precision_blocks: Any = None,
                  config: ScalingConfig | None = None, *, enabled: bool = True) -> list[str]:
    """Replace the scope's ``nn.Linear``s of every non-high-precision block by :class:`HiF8Linear`.

    scope ``mlp``: gate/up/down projections; ``attn_mlp``: also q/k/v/o. Embeddings, lm_head, norms
    and everything outside the decoder blocks stay untouched. Returns the converted module names.
    """
    if scope not in SCOPES:
        raise ValueError(f"convert_model: scope={scope!r} is invalid; allowed: {SCOPES}")
    config = config if config is not None else ScalingConfig()
    config.validate()
    prefix, blocks = find_transformer_blocks(model)
    hp = parse_high_precision_blocks(high_precision_blocks, len(blocks))
    candidates = [(i, name, mod) for i, block in enumerate(blocks) for name, mod in block.named_modules()
                  if isinstance(mod, nn.Linear) and _matches(name, scope)]
    if not candidates:
        raise ValueError(f"convert_model: no nn.Linear matched scope={scope!r} in the {len(blocks)} blocks of "
                         f"{prefix!r} (expected names like mlp.gate_proj / self_attn.q_proj)")
    converted = []
    for i, name, mod in candidates:
        if i in hp:
            continue
        full = f"{prefix}.{i}.{name}" if prefix else f"{i}.{name}"
        if not isinstance(mod, HiF8Linear):
            parent_name, _, leaf = name.rpartition(".")
            parent = blocks[i].get_submodule(parent_name) if parent_name else blocks[i]
            setattr(parent, leaf, HiF8Linear.from_linear(mod, config, full, enabled=enabled))
        converted.append(full)
    if not converted:
        warnings.warn(f"convert_model: every block is high precision ({hp}); nothing converted", stacklevel=2)
    model._hif8qat_conversion = {"scope": scope, "high_precision_blocks": hp, "config": config.to_dict(),
                                 "converted": list(converted)}
    return converted


def hif8_linears(model: nn.Module) -> Iterator[tuple[str, HiF8Linear]]:
    for name, mod in model.named_modules():
        if isinstance(mod, HiF8Linear):
            yield name, mod


def _scalers(model: nn.Module) -> Iterator[tuple[str, str, DelayedScaler]]:
    for name, mod in hif8_linears(model):
        for role, sc in mod.scalers():
            yield name, role, sc


def set_quantization(model: nn.Module, enabled: bool) -> None:
    """Switch HiF8 on/off; a layer switched from off to on resets its scalers (cold start)."""
    for _, mod in hif8_linears(model):
        if enabled and not mod.quant_enabled:
            for _, sc in mod.scalers():
                sc.reset()
        mod.quant_enabled = bool(enabled)


def set_step(model: nn.Module, step: int) -> None:
    """Current optimizer step (drives schedules, history_unit=step and telemetry dump steps)."""
    for _, _, sc in _scalers(model):
        sc.set_step(step)


def freeze_scales(model: nn.Module, frozen: bool = True) -> None:
    """Frozen: quantize with the current scales, no history update (hif8-mode evaluation)."""
    for _, _, sc in _scalers(model):
        sc.freeze(frozen)


# --------------------------------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------------------------------
def quant_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything needed to resume the quantizers exactly: ``{layer}.{A|W|G}.{key}`` and ``{layer}.enabled``."""
    sd: dict[str, torch.Tensor] = {}
    for name, mod in hif8_linears(model):
        sd[f"{name}.enabled"] = torch.tensor(int(mod.quant_enabled), dtype=torch.int64)
        for role, sc in mod.scalers():
            for k, v in sc.state_dict().items():
                sd[f"{name}.{role}.{k}"] = v
    return sd


def load_quant_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    layers = dict(hif8_linears(model))
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
    for (name, role), state in grouped.items():
        dict(layers[name].scalers())[role].load_state_dict(state)
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
    overflow_count (elements with |x*s| >= 40960, on statistics calls), nonfinite_count (calls with a
    non-finite amax), amax_max, calls, stats_calls.
    """
    by_role: dict[str, list[DelayedScaler]] = {}
    for _, role, sc in _scalers(model):
        by_role.setdefault(role, []).append(sc)
    if not by_role:
        return {}
    roles = sorted(by_role)
    maxes = torch.stack([torch.stack([sc.tel_max for sc in by_role[r]]).amax(0) for r in roles])
    cnts = torch.stack([torch.stack([sc.tel_cnt for sc in by_role[r]]).sum(0) for r in roles])
    maxes_l, cnts_l = maxes.tolist(), cnts.tolist()
    out: dict[str, float] = {}
    for ri, r in enumerate(roles):
        for k, v in zip(_TEL_MAX, maxes_l[ri]):
            out[f"tel/{r}/{k}"] = float(v)
        for k, v in zip(_TEL_CNT, cnts_l[ri]):
            out[f"tel/{r}/{k}"] = float(v)
        calls = [sc.telemetry_calls() for sc in by_role[r]]
        out[f"tel/{r}/calls"] = float(sum(c for c, _ in calls))
        out[f"tel/{r}/stats_calls"] = float(sum(s for _, s in calls))
    if reset:
        for scs in by_role.values():
            for sc in scs:
                sc.reset_telemetry()
    return out


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def dump_telemetry(model: nn.Module, path: str | os.PathLike, *, step: int | None = None) -> int:
    """Append one JSON line per scaler (last call values + accumulators since the last step_telemetry).

    Call it before :func:`step_telemetry` in a step to get that step's per-layer aggregates.
    Returns the number of lines written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, role, sc in _scalers(model):
        rec = {"step": sc._step if step is None else int(step), "layer": name, "role": role}
        rec.update(sc.telemetry_record())
        lines.append(json.dumps({k: _json_value(v) for k, v in rec.items()}))
    with open(path, "a", encoding="utf-8") as fh:
        for line in lines:
            fh.write(line + "\n")
    return len(lines)


# --------------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------------
def save_quant_export(model: nn.Module, directory: str | os.PathLike, meta: Mapping[str, Any] | None = None) -> None:
    """Write hif8qat_quant.json and hif8qat_scalers.safetensors into ``directory`` (beside save_pretrained)."""
    from safetensors.torch import save_file

    record = getattr(model, "_hif8qat_conversion", None)
    if record is None:
        raise ValueError("save_quant_export: the model was not converted with convert_model")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    doc = {"format": "hif8qat-quant", "version": 1, **record, "meta": dict(meta or {})}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in quant_state_dict(model).items()}
    tmp = directory / (SCALERS_FILE + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / SCALERS_FILE)
    tmpj = directory / (QUANT_JSON + ".tmp")
    tmpj.write_text(json.dumps(doc, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmpj, directory / QUANT_JSON)


def load_quant_export(model: nn.Module, directory: str | os.PathLike) -> dict[str, Any]:
    """Convert a plain HF model as recorded in ``directory`` (if not yet converted), restore the scalers.

    Returns the ``meta`` dict given to :func:`save_quant_export`.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    doc = json.loads((directory / QUANT_JSON).read_text(encoding="utf-8"))
    config = ScalingConfig.from_dict(doc["config"])
    if not any(True for _ in hif8_linears(model)):
        converted = convert_model(model, doc["scope"], doc["high_precision_blocks"], config)
        if sorted(converted) != sorted(doc["converted"]):
            raise ValueError(f"load_quant_export: converted layers differ from the export "
                             f"({len(converted)} vs {len(doc['converted'])})")
    load_quant_state_dict(model, load_file(str(directory / SCALERS_FILE)))
    return doc.get("meta", {})


__all__ = [
    "SCOPES", "HiF8Linear", "convert_model", "dump_telemetry", "find_transformer_blocks", "freeze_scales",
    "hif8_linears", "load_quant_export", "load_quant_state_dict", "parse_high_precision_blocks",
    "quant_state_dict", "save_quant_export", "set_quantization", "set_step", "step_telemetry",
]
