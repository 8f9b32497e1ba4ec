"""The deployable 8-bit export: a run's quantized linears stored as real 8-bit codes with their per-tensor scales,
everything else in BF16, in one ``model.safetensors`` beside the model's config and tokenizer.

Layout (docs/8bit_export.md is the reference a loader is written from):

* each quantized linear ``L``: ``L.weight`` (uint8 HiF8 byte codes, or ``float8_e4m3fn``), ``L.weight_scale``
  (float32, shape [1]: the dequantization multiplier, ``1 / s`` for the quantization scale ``s`` with which
  training quantized ``W * s``), and ``L.input_scale`` (likewise for the activations) where the run's activations
  have a fixed scale at inference; a run with just-in-time scaling has none (scale each input from its amax);
* every other tensor in BF16;
* ``hif8qat_8bit.json``: the format, the element format of each role, each layer's exact scales ``s`` (float32
  values) and where they came from, and the provenance of the export it was made from;
* ``config.json`` with a ``quantization_config``: for FP8, compressed-tensors' ``float-quantized`` format (what
  vLLM and transformers' compressed-tensors integration read); for HiF8, the same fields with ``quant_method``
  ``hif8`` (no public loader reads HiF8 yet).

The codes are made from the model the ``hif8`` evaluation mode runs (the export reloaded, its scalers restored and
frozen), with the scale that mode's weight quantizer uses, so that ``decode(code) / s`` in float32 is bit for bit
the fake-quantized weight it multiplies. :func:`load_8bit_export` builds that model back from the codes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hif8qat.artefacts import FOLDER_MANIFEST, read_json, verify_folder_manifest, write_folder_manifest
from hif8qat.files import atomic_path, sha256_file, write_json
from hif8qat.formats import HIF8_MAX, format_spec, hif8_decode, hif8_encode
from hif8qat.models.loading import load_causal_lm
from hif8qat.models.quant_files import QUANT_JSON, load_quant_export, read_quant_export
from hif8qat.quant.linear import freeze_scales, quant_modules

EIGHT_BIT_JSON = "hif8qat_8bit.json"
WEIGHTS_FILE = "model.safetensors"
# Element formats a weight can be stored in: HiF8 as its byte codes, E4M3 as torch's float8 (compressed-tensors'
# float-quantized format has no E5M2 weights).
STORABLE = {"hif8": torch.uint8, "e4m3": torch.float8_e4m3fn}
REDO = ("Delete that folder and write it again from the run's export (python run.py ... stage=export)")
_SKIPPED = (FOLDER_MANIFEST, "model.safetensors.index.json")


class UnstorableFormat(ValueError):
    """A run whose weights are in an element format with no 8-bit layout here (E5M2)."""


def _weight_files(export_dir: Path) -> list[Path]:
    files = sorted(export_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{export_dir} has no model*.safetensors (not a save_pretrained folder)")
    return files


def _load_hif8_mode(export_dir: Path, trust_remote_code: bool | None):
    """The model the ``hif8`` evaluation mode runs: FP32 weights, the export's scalers restored and frozen."""
    verify_folder_manifest(export_dir, REDO)
    model, tok = load_causal_lm(str(export_dir), dtype=torch.float32, trust_remote_code=trust_remote_code)
    load_quant_export(model, export_dir)
    freeze_scales(model, True)
    model.eval()
    return model, tok


def encode_weight(weight: torch.Tensor, scale: torch.Tensor, fmt: str, *, saturate: bool = False) -> torch.Tensor:
    """8-bit codes of ``weight * scale`` (the product in float32, as the quantizer forms it): HiF8 byte codes
    (round half away, saturating at +-HIF8_MAX when ``saturate``) or saturating E4M3."""
    x = weight.detach().float() * scale.to(torch.float32)
    if fmt == "hif8":
        return hif8_encode(x.clamp(-HIF8_MAX, HIF8_MAX) if saturate else x)
    if fmt == "e4m3":
        fmax = format_spec(fmt).max
        return x.clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    raise UnstorableFormat(f"weights in {fmt!r} have no 8-bit layout here; allowed {tuple(STORABLE)}")


def decode_weight(codes: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight that codes stored with quantization scale ``s`` stand for: ``value(code) / s`` in float32."""
    s = torch.as_tensor(scale, dtype=torch.float32)
    values = hif8_decode(codes) if codes.dtype == torch.uint8 else codes.to(torch.float32)
    return (values / s).to(dtype)


def _dequant_multiplier(s: torch.Tensor) -> torch.Tensor:
    """``1 / s`` rounded once to float32, shape [1] (the compressed-tensors / vLLM scale convention)."""
    return (1.0 / s.detach().to(torch.float64).reshape(1)).to(torch.float32)


def _exact(value: torch.Tensor) -> float:
    """A float32 scalar as a JSON number that reads back to the same float32."""
    return float(value.detach().to(torch.float32).reshape(()).item())


def _layer_scales(model) -> dict[str, dict[str, Any]]:
    """Per quantized GEMM site (a linear, or one expert's slice of a 3-D expert parameter): its weight, the
    weight's scale and the activations' fixed scale (None: just in time), as the frozen ``hif8`` mode uses them;
    ``tensor``: the checkpoint tensor holding the weight, ``expert``: the slice's index in it (None: the whole)."""
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


def _checkpoint_weights(model, scales: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[str, str]]:
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


def quantization_config(fmt: str, act_fmt: str, quantized: list[str], ignored: list[str], dynamic_inputs: bool,
                        ) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``: compressed-tensors' float-quantized scheme (FP8), or the same
    fields naming HiF8 (``quant_method`` ``hif8``)."""
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


def write_8bit_export(export_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      rest_dtype: torch.dtype = torch.bfloat16, trust_remote_code: bool | None = None,
                      meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the 8-bit export of the save_pretrained folder ``export_dir`` (with its ``hif8qat_quant.json``) into
    ``out_dir`` (replaced as a whole, atomically). ``rest_dtype``: the dtype of every tensor that is not a
    quantized weight (BF16 for deployment; the export's own float32 keeps them exactly). Returns sizes and the
    layer count (``bytes``, ``bf16_bytes``: the same tensors all in BF16, ``source_bytes``, ``layers``)."""
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    if not (export_dir / QUANT_JSON).exists():
        raise FileNotFoundError(f"{export_dir} has no {QUANT_JSON}: only a quantized run has an 8-bit export")
    doc = read_quant_export(export_dir)
    fmt, act_fmt = doc["element_formats"]["W"], doc["element_formats"]["A"]
    if fmt not in STORABLE:
        raise UnstorableFormat(f"{export_dir}: weights in {fmt!r} (quant.format={doc['config']['format']!r}) have no "
                               f"8-bit layout here; allowed weight formats {tuple(STORABLE)} (quant.format hif8, "
                               "e4m3 or hybrid)")
    model, _ = _load_hif8_mode(export_dir, trust_remote_code)
    scales = _layer_scales(model)
    saturate = bool(doc["config"].get("saturate", False))
    by_weight = _checkpoint_weights(model, scales)

    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, Any]] = {}
    source_bytes = sum(p.stat().st_size for p in _weight_files(export_dir))
    bf16_bytes = 0
    for path in _weight_files(export_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                bf16_bytes += t.numel() * 2 if t.is_floating_point() else t.numel() * t.element_size()
                hit = by_weight.get(key)
                if hit is None:
                    tensors[key] = t.to(rest_dtype) if t.is_floating_point() else t
                    continue
                name, site = hit
                entry = scales[site]
                tensors[key] = encode_weight(t.float() if entry["expert"] is not None else entry["weight"], entry["W"],
                                             fmt, saturate=saturate)
                tensors[f"{name}.weight_scale"] = _dequant_multiplier(entry["W"])
                if entry["A"] is not None:
                    tensors[f"{name}.input_scale"] = _dequant_multiplier(entry["A"])
                layers[name] = {"weight_quant_scale": _exact(entry["W"]),
                                "input_quant_scale": None if entry["A"] is None else _exact(entry["A"])}
                if name != site:  # a piece of an expert's weight: the GEMM site whose scales it carries
                    layers[name]["site"] = site
    missing = sorted(set(scales) - {rec.get("site", name) for name, rec in layers.items()})
    if missing:
        raise ValueError(f"{export_dir}: quantized layers without a weight in the safetensors files: {missing[:4]}")
    ignored = sorted(name for name, mod in model.named_modules()
                     if isinstance(mod, torch.nn.Linear) and name not in layers)
    dynamic = any(v["input_quant_scale"] is None for v in layers.values())

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = set(_weight_files(export_dir))
    for path in sorted(export_dir.iterdir()):  # config, tokenizer, modeling code, the scalers' own files
        if path.is_file() and path.name not in _SKIPPED and path not in weights:
            shutil.copy2(path, tmp / path.name)
    config = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = quantization_config(fmt, act_fmt, sorted(layers), ignored, dynamic)
    write_json(tmp / "config.json", config, indent=2, sort_keys=True)
    with atomic_path(tmp / WEIGHTS_FILE) as part:
        save_file(tensors, str(part), metadata={"format": "pt"})
    size = (tmp / WEIGHTS_FILE).stat().st_size
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    scale_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith("_scale"))
    bf16_file = size - stored + scale_bytes + bf16_bytes  # the same header, every weight in BF16, no scales
    source_manifest = export_dir / FOLDER_MANIFEST
    record = {
        "format": "hif8qat-8bit", "version": 1,
        "weight_format": fmt, "weight_dtype": str(STORABLE[fmt]).replace("torch.", ""),
        "element_formats": doc["element_formats"], "rest_dtype": str(rest_dtype).replace("torch.", ""),
        "scale_convention": "value = code_value / quant_scale (float32); weight_scale = input_scale = 1 / quant_scale",
        "activations": "dynamic" if dynamic else "static",
        "layers": layers, "ignored_linears": ignored, "quant": doc,
        "bytes": size, "bf16_bytes": bf16_file, "source_bytes": source_bytes,
        "source": {"manifest_sha256": (sha256_file(source_manifest) if source_manifest.exists() else None)},
        "meta": dict(meta or {}),
    }
    write_json(tmp / EIGHT_BIT_JSON, record, indent=1, sort_keys=True)
    write_folder_manifest(tmp)  # last: a loader verifies every file against it
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return {"bytes": size, "bf16_bytes": bf16_file, "source_bytes": source_bytes, "layers": len(layers),
            "format": fmt}


def read_8bit_export(directory: str | os.PathLike) -> dict[str, Any]:
    """``hif8qat_8bit.json`` of an 8-bit export (its files verified against the folder's manifest first)."""
    directory = Path(directory)
    verify_folder_manifest(directory, REDO)
    return read_json(directory / EIGHT_BIT_JSON, REDO)


def decoded_state_dict(directory: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the model in ``dtype``: the quantized weights decoded with their exact scales
    (``value(code) / s``), the scale tensors left out."""
    directory = Path(directory)
    record = read_8bit_export(directory)
    layers = record["layers"]
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


def load_8bit_export(directory: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                     trust_remote_code: bool | None = None, quantize: bool = True):
    """``(model, tokenizer)`` from an 8-bit export: the decoded weights in ``dtype`` and, with ``quantize``, the
    run's quantized layers with their final scales frozen, i.e. the ``hif8`` evaluation mode's model (their
    weights are already on the 8-bit grid, which the weight quantizer maps to themselves)."""
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
    tok = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=bool(trust_remote_code))
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    if quantize:
        load_quant_export(model, directory)
        freeze_scales(model, True)
    model.eval()
    return model, tok


def _is_tied(model, key: str, state: Mapping[str, torch.Tensor]) -> bool:
    """A parameter missing from the file because it shares its storage with one that is there (a tied head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(key)
    return p is not None and any(params.get(k) is p for k in state if k != key)


def size_line(sizes: Mapping[str, Any]) -> str:
    """``8-bit export: X MiB (BF16: Y MiB, ratio Z)``."""
    mib = 2.0 ** 20
    ratio = sizes["bytes"] / sizes["bf16_bytes"] if sizes["bf16_bytes"] else math.nan
    return (f"8-bit export: {sizes['bytes'] / mib:.2f} MiB (BF16: {sizes['bf16_bytes'] / mib:.2f} MiB, "
            f"ratio {ratio:.3f})")


__all__ = ["EIGHT_BIT_JSON", "STORABLE", "UnstorableFormat", "WEIGHTS_FILE", "decode_weight", "decoded_state_dict",
           "encode_weight", "load_8bit_export", "quantization_config", "read_8bit_export", "size_line",
           "write_8bit_export"]
