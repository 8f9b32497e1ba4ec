"""The pipeline's deployable 8-bit export: ``stage=export`` writes it from a run's ``export/`` folder with the
library's own :func:`hif8qat.export_8bit` (the model the ``hif8`` evaluation mode runs: the export reloaded, its
scalers restored and frozen), adding the pipeline's provenance and the folder manifest every reader verifies.
The layout is :mod:`hif8qat.quant.export`'s (docs/8bit_export.md is the reference a loader is written from).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hif8qat.artefacts import FOLDER_MANIFEST, read_json, verify_folder_manifest, write_folder_manifest
from hif8qat.files import sha256_file
from hif8qat.models.loading import load_causal_lm
from hif8qat.models.quant_files import QUANT_JSON, load_quant_export, read_quant_export
from hif8qat.quant import export as library
from hif8qat.quant.export import (
    EIGHT_BIT_JSON,
    STORABLE,
    WEIGHTS_FILE,
    UnstorableFormat,
    decode_weight,
    encode_weight,
    export_8bit,
    quantization_config,
)
from hif8qat.quant.linear import freeze_scales

REDO = ("Delete that folder and write it again from the run's export (python run.py ... stage=export)")


def _load_hif8_mode(export_dir: Path, trust_remote_code: bool | None):
    """The model the ``hif8`` evaluation mode runs: FP32 weights, the export's scalers restored and frozen."""
    verify_folder_manifest(export_dir, REDO)
    model, tok = load_causal_lm(str(export_dir), dtype=torch.float32, trust_remote_code=trust_remote_code)
    load_quant_export(model, export_dir)
    freeze_scales(model, True)
    model.eval()
    return model, tok


def write_8bit_export(export_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      rest_dtype: torch.dtype = torch.bfloat16, trust_remote_code: bool | None = None,
                      meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the 8-bit export of a save_pretrained folder with :func:`hif8qat.export_8bit`.

    Args:
        export_dir: the save_pretrained folder (with its ``hif8qat_quant.json``).
        out_dir: where the 8-bit export goes (replaced as a whole, atomically).
        rest_dtype: the dtype of every tensor that is not a quantized weight (BF16 for deployment; the
            export's own float32 keeps them exactly).
        trust_remote_code: allow the model's own code (where its config declares some).
        meta: extra entries for ``hif8qat_8bit.json``.

    Returns:
        Sizes and the layer count: ``bytes``, ``bf16_bytes`` (the same tensors all in BF16), ``source_bytes``,
        ``layers``.
    """
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    if not (export_dir / QUANT_JSON).exists():
        raise FileNotFoundError(f"{export_dir} has no {QUANT_JSON}: only a quantized run has an 8-bit export")
    doc = read_quant_export(export_dir)
    fmt = doc["element_formats"]["W"]
    if fmt not in STORABLE:
        raise UnstorableFormat(f"{export_dir}: weights in {fmt!r} (quant.format={doc['config']['format']!r}) have no "
                               f"8-bit layout here; allowed weight formats {tuple(STORABLE)} (quant.format hif8, "
                               "e4m3 or hybrid)")
    if not sorted(export_dir.glob("model*.safetensors")):
        raise FileNotFoundError(f"{export_dir} has no model*.safetensors (not a save_pretrained folder)")
    model, _ = _load_hif8_mode(export_dir, trust_remote_code)
    source_manifest = export_dir / FOLDER_MANIFEST
    source = {"manifest_sha256": (sha256_file(source_manifest) if source_manifest.exists() else None)}
    return export_8bit(model, out_dir, rest_dtype=rest_dtype, meta=meta, source_dir=export_dir,
                       record_extra={"source": source}, finish=write_folder_manifest, skip_files=(FOLDER_MANIFEST,))


def read_8bit_export(directory: str | os.PathLike) -> dict[str, Any]:
    """``hif8qat_8bit.json`` of an 8-bit export (its files verified against the folder's manifest first).

    Args:
        directory: the 8-bit export.

    Returns:
        The file's contents.
    """
    directory = Path(directory)
    verify_folder_manifest(directory, REDO)
    return read_json(directory / EIGHT_BIT_JSON, REDO)


def decoded_state_dict(directory: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the model in ``dtype`` (:func:`hif8qat.quant.export.decoded_state_dict`), the folder
    verified against its manifest first.

    Args:
        directory: the 8-bit export.
        dtype: the tensors' dtype.

    Returns:
        Name -> tensor.
    """
    read_8bit_export(directory)
    return library.decoded_state_dict(directory, dtype)


def load_8bit_export(directory: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                     trust_remote_code: bool | None = None, quantize: bool = True):
    """:func:`hif8qat.load_8bit_export`, the folder verified against its manifest first (where it has one).

    Args:
        directory: the 8-bit export.
        dtype: the decoded weights' dtype.
        trust_remote_code: allow the model's own code.
        quantize: convert the layers as recorded, their final scales frozen.

    Returns:
        ``(model, tokenizer)``, the tokenizer None where none was saved.
    """
    read_8bit_export(directory)
    return library.load_8bit_export(directory, dtype=dtype, trust_remote_code=trust_remote_code, quantize=quantize)


def size_line(sizes: Mapping[str, Any]) -> str:
    """``8-bit export: X MiB (BF16: Y MiB, ratio Z)``.

    Args:
        sizes: what :func:`write_8bit_export` returned.

    Returns:
        The line.
    """
    mib = 2.0 ** 20
    ratio = sizes["bytes"] / sizes["bf16_bytes"] if sizes["bf16_bytes"] else math.nan
    return (f"8-bit export: {sizes['bytes'] / mib:.2f} MiB (BF16: {sizes['bf16_bytes'] / mib:.2f} MiB, "
            f"ratio {ratio:.3f})")


__all__ = ["EIGHT_BIT_JSON", "STORABLE", "UnstorableFormat", "WEIGHTS_FILE", "decode_weight", "decoded_state_dict",
           "encode_weight", "load_8bit_export", "quantization_config", "read_8bit_export", "size_line",
           "write_8bit_export"]
