"""Where a checkpoint came from: the settings of the run that wrote it (``provenance.json`` in the checkpoint,
hashed by its manifest like every other file), checked when a run resumes it, so that a checkpoint of another
run (another experiment, LR, seed or quantization) never continues under this run's name unnoticed.
``train.resume_allow_mismatch=true`` resumes one deliberately."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hif8qat.quant.linear import load_quant_state_dict, load_scaler_state_dict
from hif8qat.train.checkpoint import PROVENANCE_FILE, CheckpointError

# The settings that decide what a checkpoint's weights, optimizer and scheduler state are: resuming one made
# under other values would continue another run's training under this run's name. Settings that only steer
# the run (checkpoint cadence, logging, device, threads, the resume itself) are left out: they may change.
PROVENANCE_SETTINGS = (
    "experiment.name", "seed", "model.name", "model.revision", "data.source", "quant", "quirks",
    "train.steps", "train.lr", "train.lr_warmup_steps", "train.betas", "train.eps", "train.weight_decay",
    "train.grad_clip", "train.global_batch_size", "train.micro_batch_size", "train.seq_len",
)
# Inside those sections, what only steers the run's logging.
_PROVENANCE_IGNORED = ("quant.telemetry_dump_every", "quant.telemetry_stats_every")
ALLOW_MISMATCH_SETTING = "train.resume_allow_mismatch"


def run_provenance(cfg) -> dict[str, Any]:
    """The values of PROVENANCE_SETTINGS in a resolved RunConfig (plain JSON values).

    Args:
        cfg: the resolved RunConfig.

    Returns:
        Setting -> value.
    """
    flat = cfg.to_dict()
    out: dict[str, Any] = {}
    for name in PROVENANCE_SETTINGS:
        value: Any = flat
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[name] = json.loads(json.dumps(value, default=str))  # tuples as lists, as read back
    return out


def _flatten(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict) and value and prefix in ("quant", "quirks"):
        return {f"{prefix}.{k}": v for k, v in value.items()}
    return {prefix: value}


def provenance_differences(recorded: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """'setting: checkpoint X, this run Y' for each setting whose recorded value differs.

    Args:
        recorded: the checkpoint's provenance.
        expected: this run's.

    Returns:
        One line per differing setting.
    """
    rec = {k: v for name, value in recorded.items() for k, v in _flatten(name, value).items()}
    exp = {k: v for name, value in expected.items() for k, v in _flatten(name, value).items()}
    return [f"{k}: checkpoint {rec.get(k, '(not recorded)')!r}, this run {exp.get(k, '(not set)')!r}"
            for k in sorted(set(rec) | set(exp))
            if k not in _PROVENANCE_IGNORED and rec.get(k, KeyError) != exp.get(k, KeyError)]


def check_provenance(path: Path, expected: dict[str, Any], *, allow_mismatch: bool, explicit: bool,
                     log: Callable[[str], None] = print) -> None:
    """Refuse a verified checkpoint that a run with other settings wrote.

    Args:
        path: the checkpoint folder.
        expected: this run's provenance.
        allow_mismatch: turn the refusal into a note (``train.resume_allow_mismatch``).
        explicit: the checkpoint was named by train.resume=<folder>; one that records no settings (written
            before checkpoints recorded them) is then refused too, as its origin is unknown. A run's own
            checkpoints (train.resume=auto) without a record are its own.
        log: where notes go.

    Raises:
        CheckpointError: naming the settings that differ.
    """
    how = (f"{ALLOW_MISMATCH_SETTING}=true resumes it deliberately (its weights, optimizer and LR schedule "
           "position continue under this run's settings)")
    file = path / PROVENANCE_FILE
    if not file.is_file():
        if not explicit:
            return
        problem = f"checkpoint {path} records no settings ({PROVENANCE_FILE}), so its origin cannot be checked"
    else:
        try:
            recorded = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(recorded, dict):
                raise ValueError(f"a JSON {type(recorded).__name__} where an object belongs")
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise CheckpointError(f"checkpoint {path}: unreadable {PROVENANCE_FILE} ({err})") from None
        differences = provenance_differences(recorded, expected)
        if not differences:
            return
        problem = (f"checkpoint {path} was written by a run with other settings ({'; '.join(differences)})")
    if allow_mismatch:
        log(f"note: {problem}; resuming it anyway ({ALLOW_MISMATCH_SETTING}=true)")
        return
    raise CheckpointError(f"{problem}. Resume from a checkpoint of these settings (train.resume=auto continues "
                          f"this run's own), or {how}")


# A rank's scalers in its state: the scaler entries of its model.state_dict() (quant.linear.scaler_state_dict).
SCALERS_KEY = "scalers"
# Checkpoints written before the scalers travelled in that form hold quant.linear.quant_state_dict's under this key.
LEGACY_SCALERS_KEY = "quant"


def load_saved_scalers(model, path: Path, rank_state: dict, *, start_step: int, quant_on_step: int | None,
                       allow_mismatch: bool) -> None:
    """The quantization scalers a checkpoint saved in this rank's state. A checkpoint without them (trained
    unquantized, or before QAT began) starts them cold, as at the first QAT step, but only where quantization had
    not yet begun at its step or the user resumed it deliberately (train.resume_allow_mismatch).

    Args:
        model: the converted model.
        path: the checkpoint folder.
        rank_state: this rank's saved state: its scalers under ``"scalers"`` (``model.state_dict()`` entries), or
            under ``"quant"`` in ``quant_state_dict``'s form for a checkpoint written before.
        start_step: the step the checkpoint was written at.
        quant_on_step: the first quantized step (None: never).
        allow_mismatch: ``train.resume_allow_mismatch``.

    Raises:
        CheckpointError: the saved scalers do not match this run's quantized layers, or are missing where
            quantization had begun (unless allowed).
    """
    saved, legacy = rank_state.get(SCALERS_KEY) or {}, rank_state.get(LEGACY_SCALERS_KEY) or {}
    if not saved and not legacy and (start_step <= (quant_on_step or 0) or allow_mismatch):
        return
    try:
        if legacy and not saved:
            load_quant_state_dict(model, legacy)
        else:
            load_scaler_state_dict(model, saved)
    except (KeyError, RuntimeError) as err:
        raise CheckpointError(
            f"checkpoint {path} does not hold this run's quantization scalers ({str(err).strip(chr(39))[:300]}): "
            "it was written by a run with other quant settings. Resume from a checkpoint of these settings, "
            f"or {ALLOW_MISMATCH_SETTING}=true to start its scalers cold") from None
