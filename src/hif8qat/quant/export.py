"""The deployable 8-bit export of a converted model, in one call: :func:`export_8bit`.

The quantized linears are stored as real 8-bit codes with their per-tensor scales, every other tensor in
``rest_dtype`` (BF16 for deployment), in one ``model.safetensors`` beside the model's ``config.json`` (with a
``quantization_config``), the tokenizer when one is given, and the quantizers' state. This module owns the
layout (:func:`export_8bit` lists it; docs/8bit_export.md is the reference a loader is written from), the
encoding and decoding of the weights, and the conversion record: :func:`convert_as_recorded` converts a plain
model exactly as a record names (a ``module_filter_fn`` included).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hif8qat.formats import HIF8_MAX, format_spec, hif8_decode, hif8_encode
from hif8qat.formats.qdq import element_format
from hif8qat.quant.linear import (
    _convert_model,
    freeze_scales,
    is_scaler_key,
    load_quant_state_dict,
    quant_modules,
    quant_state_dict,
    scaler_banks,
)
from hif8qat.scaling.settings import ROLES, ScalingConfig

QUANT_JSON = "hif8qat_quant.json"
SCALERS_FILE = "hif8qat_scalers.safetensors"
EIGHT_BIT_JSON = "hif8qat_8bit.json"
WEIGHTS_FILE = "model.safetensors"
# Element formats a weight can be stored in: HiF8 as its byte codes, E4M3 as torch's float8 (compressed-tensors'
# float-quantized format has no E5M2 weights).
STORABLE = {"hif8": torch.uint8, "e4m3": torch.float8_e4m3fn}


class UnstorableFormat(ValueError):
    """A model whose weights are in an element format with no 8-bit layout here (E5M2)."""


# --------------------------------------------------------------------------------------------------
# the conversion record
# --------------------------------------------------------------------------------------------------
def conversion_record(model: nn.Module) -> dict[str, Any]:
    """What the conversion of ``model`` did: scope, high-precision blocks, scaling config, converted layer names.

    Args:
        model: a converted model.

    Returns:
        The record.
    """
    record = getattr(model, "_hif8qat_conversion", None)
    if record is None:
        raise ValueError(f"{type(model).__name__} is not converted; convert it first with "
                         "hif8qat.convert_to_hif8_training(model, config=...)")
    return record


def element_formats(config: ScalingConfig) -> dict[str, str]:
    """Element format per role under ``config`` (what an export records and an evaluation quantizes to).

    Args:
        config: the scaling settings.

    Returns:
        Role -> element format.
    """
    return {r: element_format(config.format, r) for r in ROLES}


def quant_document(model: nn.Module, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``hif8qat_quant.json`` of a converted model: its conversion record, element formats and targets.

    Args:
        model: a converted model.
        meta: recorded under ``meta``.

    Returns:
        The document.
    """
    record = conversion_record(model)
    config = ScalingConfig.from_dict(record["config"])
    return {"format": "hif8qat-quant", "version": 1, **record, "meta": dict(meta or {}),
            "element_formats": element_formats(config), "targets": config.targets()}


def complete_quant_document(doc: dict[str, Any]) -> dict[str, Any]:
    """A read ``hif8qat_quant.json`` with its scaling config completed: an export written before FP8 (no
    ``format``) is HiF8; ``element_formats`` and ``targets`` are filled in when absent.

    Args:
        doc: the document as read.

    Returns:
        The completed document.
    """
    config = ScalingConfig.from_dict(doc["config"])
    doc["config"] = config.to_dict()
    doc.setdefault("element_formats", element_formats(config))
    doc.setdefault("targets", config.targets())
    return doc


def scaler_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The quantizers' state as ``hif8qat_scalers.safetensors`` stores it (CPU, contiguous).

    Args:
        model: a converted model.

    Returns:
        Name -> tensor.
    """
    return {k: v.detach().to("cpu").contiguous() for k, v in quant_state_dict(model).items()}


def convert_as_recorded(model: nn.Module, doc: Mapping[str, Any]) -> list[str]:
    """Convert a plain model exactly as ``doc`` (a conversion record) says: its scope, its high-precision blocks
    and its converted layers by name, so that a ``module_filter_fn`` of the original conversion is honoured.

    Args:
        model: a plain model.
        doc: the conversion record.

    Returns:
        The converted layers' names.
    """
    wanted = set(doc["converted"])
    config = ScalingConfig.from_dict(doc["config"])
    converted = _convert_model(model, doc["scope"], doc["high_precision_blocks"], config,
                               module_filter_fn=lambda _mod, fqn: fqn in wanted, role_map=doc.get("role_map"))
    if set(converted) != wanted:
        missing = sorted(wanted - set(converted))
        raise ValueError(f"the model has no linear {missing[:4]} that the export converted ({len(converted)} of "
                         f"{len(wanted)} found): load it into the model it was exported from")
    return converted


# --------------------------------------------------------------------------------------------------
# codes and scales
# --------------------------------------------------------------------------------------------------
def encode_weight(weight: torch.Tensor, scale: torch.Tensor, fmt: str, *, saturate: bool = False) -> torch.Tensor:
    """8-bit codes of ``weight * scale`` (the product in float32, as the quantizer forms it): HiF8 byte codes
    (round half away, saturating at +-HIF8_MAX when ``saturate``) or saturating E4M3.

    Args:
        weight: the weight.
        scale: its quantization scale ``s``.
        fmt: "hif8" or "e4m3".
        saturate: HiF8 saturates instead of overflowing to inf.

    Returns:
        uint8 codes (HiF8) or a ``float8_e4m3fn`` tensor.
    """
    x = weight.detach().float() * scale.to(torch.float32)
    if fmt == "hif8":
        return hif8_encode(x.clamp(-HIF8_MAX, HIF8_MAX) if saturate else x)
    if fmt == "e4m3":
        fmax = format_spec(fmt).max
        return x.clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    raise UnstorableFormat(f"weights in {fmt!r} have no 8-bit layout here; allowed {tuple(STORABLE)}")


def decode_weight(codes: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight that codes stored with quantization scale ``s`` stand for: ``value(code) / s`` in float32.

    Args:
        codes: the stored codes.
        scale: the quantization scale ``s``.
        dtype: the result's dtype.

    Returns:
        The weight.
    """
    s = torch.as_tensor(scale, dtype=torch.float32)
    values = hif8_decode(codes) if codes.dtype == torch.uint8 else codes.to(torch.float32)
    return (values / s).to(dtype)


def _dequant_multiplier(s: torch.Tensor) -> torch.Tensor:
    """``1 / s`` rounded once to float32, shape [1] (the compressed-tensors / vLLM scale convention)."""
    return (1.0 / s.detach().to(torch.float64).reshape(1)).to(torch.float32)


def _exact(value: torch.Tensor) -> float:
    """A float32 scalar as a JSON number that reads back to the same float32."""
    return float(value.detach().to(torch.float32).reshape(()).item())


def _layer_scales(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per quantized GEMM site (a linear, or one expert's slice of a 3-D expert parameter): its weight, the
    weight's scale and the activations' fixed scale (None: just in time), as the frozen evaluation mode uses them;
    ``tensor``: the parameter holding the weight, ``expert``: the slice's index in it (None: the whole)."""
    out = {}
    for name, mod in quant_modules(model):
        if not mod.quant_enabled:
            continue
        for i, site in enumerate(mod.site_names()):
            param, _, expert = site.partition(".")  # "" for a linear; "gate_up_proj", "3" for an expert
            weight = (mod.weight if not site else getattr(mod, param)[int(expert)]).detach()
            a_row, w_row = mod._rows[3 * i], mod._rows[3 * i + 1]
            out[f"{name}.{site}" if site else name] = {
                "weight": weight, "tensor": f"{name}.{param or 'weight'}", "expert": int(expert) if site else None,
                "W": mod.bank.frozen_scale(weight, w_row), "A": mod.bank.static_scale(a_row)}
    return out


def _checkpoint_weights(model: nn.Module, scales: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[str, str]]:
    """``{checkpoint key: (its layer's name, its GEMM site)}`` for every quantized weight. A linear's key is its own
    ``.weight``; an expert's slice is saved as transformers writes MoE checkpoints (per-expert 2-D weights,
    e.g. ``experts.3.gate_proj.weight`` and ``experts.3.up_proj.weight`` for ``gate_up_proj[3]``), found by
    reverting a marker state dict whose slices hold their site's number through transformers' own mapping."""
    out = {f"{site}.weight": (site, site) for site, e in scales.items() if e["expert"] is None}
    experts = [site for site, e in scales.items() if e["expert"] is not None]
    if not experts:
        return out
    from transformers.core_model_loading import revert_weight_conversion

    marker: dict[str, torch.Tensor] = {}
    for number, site in enumerate(experts):
        entry = scales[site]
        shape = (entry["expert"] + 1, *entry["weight"].shape)
        t = marker.setdefault(entry["tensor"], torch.full(shape, -1.0))
        if t.shape[0] < shape[0]:
            t = marker[entry["tensor"]] = torch.cat([t, torch.full((shape[0] - t.shape[0], *shape[1:]), -1.0)])
        t[entry["expert"]] = float(number)
    for key, t in revert_weight_conversion(model, marker).items():
        numbers = t.unique()
        if numbers.numel() != 1 or numbers.item() < 0 or not key.endswith(".weight"):
            raise ValueError(f"{key}: a checkpoint tensor that mixes experts; the 8-bit export stores per-expert "
                             "2-D weights only")
        out[key] = (key[: -len(".weight")], experts[int(numbers.item())])
    return out


def _checkpoint_state(model: nn.Module, scales: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The model's weights in the layout its checkpoints have: MoE experts as per-expert 2-D tensors, as
    ``save_pretrained`` reverts them (the in-memory 3-D expert parameters are not what a loader reads)."""
    state = plain_state_dict(model)
    if any(e["expert"] is not None for e in scales.values()):
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    return state


def quantization_config(fmt: str, act_fmt: str, quantized: list[str], ignored: list[str], dynamic_inputs: bool,
                        ) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``: compressed-tensors' float-quantized scheme (FP8), or the same
    fields naming HiF8 (``quant_method`` ``hif8``).

    Args:
        fmt: the weights' element format.
        act_fmt: the activations' element format.
        quantized: the quantized layers' names.
        ignored: the layers left in high precision.
        dynamic_inputs: the activations are scaled just in time (no stored input scale).

    Returns:
        The ``quantization_config`` dict.
    """
    def args(kind: str, dynamic: bool) -> dict[str, Any]:
        return {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "tensor", "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": None,
                "observer_kwargs": {}}

    if fmt == "e4m3":
        group = {"targets": ["Linear"], "weights": args("float", False),
                 "input_activations": args("float", dynamic_inputs), "output_activations": None,
                 "format": "float-quantized"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": ignored,
                "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}}
    group = {"targets": quantized, "weights": {"element_format": fmt, "strategy": "tensor"},
             "input_activations": {"element_format": act_fmt, "strategy": "tensor", "dynamic": dynamic_inputs}}
    return {"quant_method": "hif8", "format": "hif8-codes", "config_groups": {"group_0": group}, "ignore": ignored}


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as ``save_pretrained`` writes them: no scaler entries, and a tensor shared by several
    names (a tied head) once, under its first name.

    Args:
        model: the model.

    Returns:
        Name -> tensor.
    """
    seen, out = set(), {}
    for key, t in model.state_dict().items():
        if is_scaler_key(key):
            continue
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.device.type != "meta" and ident in seen:
            continue
        seen.add(ident)
        out[key] = t
    return out


def _json_text(payload: Any, **kwargs: Any) -> str:
    return json.dumps(payload, **kwargs) + "\n"


# --------------------------------------------------------------------------------------------------
# the export and its loader
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def export_8bit(model: nn.Module, out_dir: str | os.PathLike, *, rest_dtype: torch.dtype = torch.bfloat16,
                tokenizer: Any = None, meta: Mapping[str, Any] | None = None,
                source_dir: str | os.PathLike | None = None, record_extra: Mapping[str, Any] | None = None,
                finish: Callable[[Path], None] | None = None, skip_files: tuple[str, ...] = ()) -> dict[str, Any]:
    """Write the deployable 8-bit export of ``model`` (converted by ``convert_to_hif8_training``) into
    ``out_dir``; :func:`hif8qat.load_8bit_export` reads it back. The model is left as it was (its scalers are
    read, not frozen).

    Layout: each quantized linear ``L`` has ``L.weight`` (uint8 HiF8 byte codes, or ``float8_e4m3fn``),
    ``L.weight_scale`` (float32, shape [1]: the dequantization multiplier ``1 / s`` for the quantization scale
    ``s`` with which training quantized ``W * s``), and ``L.input_scale`` (likewise for the activations) where
    the activations have a fixed scale at inference (just-in-time scaling has none: scale each input from its
    amax). ``hif8qat_8bit.json`` holds the format, each role's element format, each layer's exact scales ``s``
    (float32 values) and the conversion record; ``hif8qat_quant.json`` and ``hif8qat_scalers.safetensors`` the
    quantizers' state. The codes are those of the model's evaluation mode (its scalers frozen as they stand),
    with the scale that mode's weight quantizer uses, so that ``decode(code) / s`` in float32 is bit for bit
    the fake-quantized weight. A transformers model's ``config`` is written with a ``quantization_config``.

    Args:
        model: the converted model.
        out_dir: the export folder (replaced as a whole, atomically).
        rest_dtype: every tensor that is not a quantized weight (BF16 to deploy; ``torch.float32`` keeps them
            exactly, and the reloaded model then computes bit for bit as this one with its scales frozen).
        tokenizer: saved beside it when given.
        meta: recorded in the export.
        source_dir: the pipeline's export folder the model was loaded from: its other files (config,
            tokenizer, modeling code, the scalers' files) are copied instead of written from the model.
        record_extra: goes into ``hif8qat_8bit.json``.
        finish: ``finish(folder)`` runs last on the finished folder before it replaces ``out_dir`` (the
            pipeline writes its manifest there).
        skip_files: names in ``source_dir`` not copied.

    Returns:
        ``bytes`` (the weights file), ``bf16_bytes`` (the same tensors all in BF16), ``source_bytes``,
        ``layers``, ``format``.
    """
    from safetensors.torch import save_file  # a core dependency, imported where the export needs it

    out_dir = Path(out_dir)
    if source_dir is not None:
        doc = complete_quant_document(json.loads((Path(source_dir) / QUANT_JSON).read_text(encoding="utf-8")))
    else:
        doc = quant_document(model, meta)
    fmt, act_fmt = doc["element_formats"]["W"], doc["element_formats"]["A"]
    if fmt not in STORABLE:
        raise UnstorableFormat(f"export_8bit: weights in {fmt!r} (format={doc['config']['format']!r}) have no 8-bit "
                               f"layout; allowed weight formats {tuple(STORABLE)} (format hif8, e4m3 or hybrid)")
    if source_dir is None and not hasattr(getattr(model, "config", None), "save_pretrained"):
        raise TypeError(f"export_8bit: {type(model).__name__} has no transformers config (model.config."
                        "save_pretrained); the export is a transformers model folder")
    for bank in scaler_banks(model):  # the last micro-batch counts, as a state dict's would
        bank.update()
    scales = _layer_scales(model)
    saturate = bool(doc["config"].get("saturate", False))
    by_weight = _checkpoint_weights(model, scales)

    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, Any]] = {}
    bf16_bytes = source_bytes = 0
    for key, t in _checkpoint_state(model, scales).items():
        t = t.detach().cpu()
        source_bytes += t.numel() * t.element_size()
        bf16_bytes += t.numel() * 2 if t.is_floating_point() else t.numel() * t.element_size()
        hit = by_weight.get(key)
        if hit is None:
            tensors[key] = t.to(rest_dtype).contiguous() if t.is_floating_point() else t.contiguous()
            continue
        name, site = hit
        entry = scales[site]
        # an expert's piece as the checkpoint holds it; a linear's weight as the quantizer sees it
        tensors[key] = encode_weight(t if entry["expert"] is not None else entry["weight"], entry["W"], fmt,
                                     saturate=saturate)
        tensors[f"{name}.weight_scale"] = _dequant_multiplier(entry["W"])
        if entry["A"] is not None:
            tensors[f"{name}.input_scale"] = _dequant_multiplier(entry["A"])
        layers[name] = {"weight_quant_scale": _exact(entry["W"]),
                        "input_quant_scale": None if entry["A"] is None else _exact(entry["A"])}
        if name != site:  # a piece of an expert's weight: the GEMM site whose scales it carries
            layers[name]["site"] = site
    missing = sorted(set(scales) - {rec.get("site", name) for name, rec in layers.items()})
    if missing:
        raise ValueError(f"export_8bit: quantized layers without a weight in the model's state dict: {missing[:4]}")
    ignored = sorted(name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and name not in layers)
    dynamic = any(v["input_quant_scale"] is None for v in layers.values())

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if source_dir is not None:
            source_dir = Path(source_dir)
            weights = set(source_dir.glob("model*.safetensors"))
            source_bytes = sum(p.stat().st_size for p in weights)
            for path in sorted(source_dir.iterdir()):  # config, tokenizer, modeling code, the scalers' own files
                if path.is_file() and path not in weights and path.name not in skip_files \
                        and path.name != "model.safetensors.index.json":
                    shutil.copy2(path, tmp / path.name)
        else:
            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            save_file(scaler_tensors(model), str(tmp / SCALERS_FILE))
            (tmp / QUANT_JSON).write_text(json.dumps(doc, indent=2, sort_keys=True), encoding="utf-8")
        config = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
        config["quantization_config"] = quantization_config(fmt, act_fmt, sorted(layers), ignored, dynamic)
        (tmp / "config.json").write_text(_json_text(config, indent=2, sort_keys=True), encoding="utf-8")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        size = (tmp / WEIGHTS_FILE).stat().st_size
        stored = sum(t.numel() * t.element_size() for t in tensors.values())
        scale_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith("_scale"))
        bf16_file = size - stored + scale_bytes + bf16_bytes  # the same header, every weight in BF16, no scales
        record = {
            "format": "hif8qat-8bit", "version": 1,
            "weight_format": fmt, "weight_dtype": str(STORABLE[fmt]).replace("torch.", ""),
            "element_formats": doc["element_formats"], "rest_dtype": str(rest_dtype).replace("torch.", ""),
            "scale_convention": "value = code_value / quant_scale (float32); "
                                "weight_scale = input_scale = 1 / quant_scale",
            "activations": "dynamic" if dynamic else "static",
            "layers": layers, "ignored_linears": ignored, "quant": doc,
            "bytes": size, "bf16_bytes": bf16_file, "source_bytes": source_bytes,
            "meta": dict(meta or {}), **dict(record_extra or {}),
        }
        (tmp / EIGHT_BIT_JSON).write_text(_json_text(record, indent=1, sort_keys=True), encoding="utf-8")
        if finish is not None:
            finish(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return {"bytes": size, "bf16_bytes": bf16_file, "source_bytes": source_bytes, "layers": len(layers),
            "format": fmt}


def decoded_state_dict(directory: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of an 8-bit export in ``dtype``: the quantized weights decoded with their exact scales
    (``value(code) / s``), the scale tensors left out.

    Args:
        directory: the 8-bit export.
        dtype: the tensors' dtype.

    Returns:
        Name -> tensor.
    """
    from safetensors import safe_open  # a core dependency, imported where the loader needs it

    directory = Path(directory)
    layers = json.loads((directory / EIGHT_BIT_JSON).read_text(encoding="utf-8"))["layers"]
    out = {}
    with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            name, _, leaf = key.rpartition(".")
            if name in layers and leaf in ("weight_scale", "input_scale"):
                continue
            t = f.get_tensor(key)
            if name in layers and leaf == "weight":
                out[key] = decode_weight(t, layers[name]["weight_quant_scale"], dtype)
            else:
                out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


def restore_quantizers(model: nn.Module, directory: str | os.PathLike) -> dict[str, Any]:
    """Convert a plain model as the export in ``directory`` records (unless converted), restore its scalers;
    returns the export's ``meta``.

    Args:
        model: a plain or converted model.
        directory: the export folder.

    Returns:
        The ``meta`` dict.
    """
    from safetensors.torch import load_file  # a core dependency, imported where the loader needs it

    directory = Path(directory)
    doc = complete_quant_document(json.loads((directory / QUANT_JSON).read_text(encoding="utf-8")))
    if not any(True for _ in quant_modules(model)):
        convert_as_recorded(model, doc)
    load_quant_state_dict(model, load_file(str(directory / SCALERS_FILE)))
    return doc.get("meta", {})


def load_8bit_export(directory: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                     trust_remote_code: bool | None = None, quantize: bool = True):
    """``(model, tokenizer)`` from an 8-bit export (``tokenizer`` None where none was saved): the decoded weights in
    ``dtype`` and, with ``quantize``, the converted layers as recorded, their final scales frozen (the weights
    are already on the 8-bit grid, which the weight quantizer maps to themselves). Needs ``transformers``.

    Args:
        directory: the 8-bit export.
        dtype: the decoded weights' dtype.
        trust_remote_code: allow the model's own code.
        quantize: convert the layers as recorded, scales frozen.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ValueError: the tensors do not match the model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    state = decoded_state_dict(directory, dtype)
    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=bool(trust_remote_code))
    if hasattr(config, "quantization_config"):  # the codes are decoded here, not by a transformers quantizer
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=bool(trust_remote_code))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if _is_tied(model, k, state)}
    if unexpected or set(missing) - tied:
        raise ValueError(f"{directory}: the tensors do not match the model: missing {sorted(set(missing) - tied)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    tok = None
    if any((directory / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tok = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=bool(trust_remote_code))
        if tok.pad_token is None and tok.eos_token is not None:
            tok.pad_token = tok.eos_token
    if quantize:
        restore_quantizers(model, directory)
        freeze_scales(model, True)
    model.eval()
    return model, tok


def _is_tied(model: nn.Module, key: str, state: Mapping[str, torch.Tensor]) -> bool:
    """A parameter missing from the file because it shares its storage with one that is there (a tied head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(key)
    return p is not None and any(params.get(k) is p for k in state if k != key)


__all__ = ["EIGHT_BIT_JSON", "QUANT_JSON", "SCALERS_FILE", "STORABLE", "UnstorableFormat", "WEIGHTS_FILE",
           "complete_quant_document", "conversion_record", "convert_as_recorded", "decode_weight",
           "decoded_state_dict", "element_formats", "encode_weight", "export_8bit", "load_8bit_export",
           "plain_state_dict", "quant_document", "quantization_config", "restore_quantizers", "scaler_tensors"]
