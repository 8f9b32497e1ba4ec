"""The pipeline's files of a quantized model: the export beside ``save_pretrained`` (``hif8qat_quant.json`` and
``hif8qat_scalers.safetensors``) and the per-layer telemetry lines of a dump step.

The quantizers themselves are the library core's (:mod:`hif8qat.quant.linear`); this module only writes and reads
their state in the run folder's formats, with the pipeline's atomic file writes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import nn

from hif8qat.files import atomic_path, replace_step_records, write_text
from hif8qat.quant.export import (
    QUANT_JSON,
    SCALERS_FILE,
    complete_quant_document,
    convert_as_recorded,
    element_formats,
    quant_document,
    scaler_tensors,
)
from hif8qat.quant.linear import load_quant_state_dict, quant_modules, quant_sites, scaler_banks
from hif8qat.scaling.settings import ROLES


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def dump_telemetry(model: nn.Module, path: str | os.PathLike, *, step: int | None = None) -> int:
    """Write one JSON line per scaler (last call values + accumulators since the last step_telemetry) into
    ``path``, replacing the lines of the same step already there (a resumed run that redoes a step leaves one
    copy) and keeping other steps' lines; the file is replaced atomically.

    Call it before :func:`step_telemetry` in a step to get that step's per-layer aggregates.
    Returns the number of lines written.

    Args:
        model: a converted model.
        path: the JSON-lines file.
        step: the step the lines belong to.

    Returns:
        The number of lines written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for bank in scaler_banks(model):  # count the last micro-batch too, as step_telemetry does
        bank.update()
    records = {id(bank): bank.telemetry_records() for bank in scaler_banks(model)}
    for name, mod, rows in quant_sites(model):  # one line per role of each GEMM site (per expert for MoE)
        for role, row in zip(ROLES, rows):
            rec = {"step": mod.bank.step if step is None else int(step), "layer": name, "role": role}
            rec.update(records[id(mod.bank)][row])
            lines.append(json.dumps({k: _json_value(v) for k, v in rec.items()}))
    replace_step_records(path, lines)
    return len(lines)


def save_quant_export(model: nn.Module, directory: str | os.PathLike, meta: Mapping[str, Any] | None = None) -> None:
    """Write hif8qat_quant.json and hif8qat_scalers.safetensors into ``directory`` (beside save_pretrained).

    Args:
        model: a converted model.
        directory: the export folder.
        meta: what :func:`load_quant_export` gives back (e.g. the step).
    """

    if getattr(model, "_hif8qat_conversion", None) is None:
        raise ValueError("save_quant_export: the model was not converted (hif8qat.convert_to_hif8_training)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    doc = quant_document(model, meta)
    tensors = scaler_tensors(model)

    with atomic_path(directory / SCALERS_FILE) as tmp:
        save_file(tensors, str(tmp))
    write_text(directory / QUANT_JSON, json.dumps(doc, indent=2, sort_keys=True))


def read_quant_export(directory: str | os.PathLike) -> dict[str, Any]:
    """``hif8qat_quant.json`` of an export, with its scaling config completed: an export written before FP8
    (no ``format`` in its config) is HiF8, and ``element_formats`` and ``targets`` (each role's scale target)
    are filled in when absent.

    Args:
        directory: the export folder.

    Returns:
        The file's contents.
    """
    return complete_quant_document(json.loads((Path(directory) / QUANT_JSON).read_text(encoding="utf-8")))


def load_quant_export(model: nn.Module, directory: str | os.PathLike) -> dict[str, Any]:
    """Convert a plain HF model as recorded in ``directory`` (if not yet converted), restore the scalers.

    The model quantizes in the export's format (HiF8 for exports written before FP8). Returns the ``meta``
    dict given to :func:`save_quant_export`.

    Args:
        model: a plain or already converted model.
        directory: the export folder.

    Returns:
        The ``meta`` dict.
    """

    directory = Path(directory)
    doc = read_quant_export(directory)
    if not any(True for _ in quant_modules(model)):
        try:
            convert_as_recorded(model, doc)  # the layers it names, whatever rule chose them
        except ValueError as err:
            raise ValueError(f"load_quant_export: {err}") from None
    load_quant_state_dict(model, load_file(str(directory / SCALERS_FILE)))
    return doc.get("meta", {})


__all__ = ["QUANT_JSON", "SCALERS_FILE", "dump_telemetry", "element_formats", "load_quant_export", "read_quant_export",
           "save_quant_export"]
