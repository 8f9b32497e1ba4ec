"""The export of a trained run: a save_pretrained folder that plain transformers and lm-eval load, plus the
quantizers' final state; a full disk while writing it is reported as what filled and how to finish. stage=export
writes the deployable 8-bit export from it (:mod:`hif8qat.models.eight_bit`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from hif8qat.artefacts import write_folder_manifest
from hif8qat.config.run_config import RunConfig
from hif8qat.errors import RunError
from hif8qat.models.eight_bit import size_line, write_8bit_export
from hif8qat.models.quant_files import save_quant_export
from hif8qat.quant.linear import scalers_left_out
from hif8qat.runs.folders import (
    EXPORT_8BIT_DIR,
    EXPORT_DIR,
    has_export,
    lock_run_dir,
    provenance,
    refuse_staging_links,
    release_run_dir,
    run_dir_for,
)
from hif8qat.train import checkpoint as ckpt
from hif8qat.train.distributed import unsharded_class


def export_or_explain(model, tokenizer, run_dir: Path, cfg: RunConfig, converted: list[str], full_state,
                       optimizer) -> None:
    """export_model, with a full disk reported as what filled and how to finish (the final checkpoint holds
    every trained step, so a rerun only writes the export).

    Args:
        model: as in :func:`export_model`.
        tokenizer: as in :func:`export_model`.
        run_dir: the run folder (the export goes to its ``export/``).
        cfg: as in :func:`export_model`.
        converted: as in :func:`export_model`.
        full_state: :func:`export_model`'s ``state_dict``.
        optimizer: the optimizer (its size goes into the message).

    Raises:
        DiskFull: the disk filled.
    """

    try:
        export_model(model, tokenizer, run_dir / EXPORT_DIR, cfg, converted, state_dict=full_state)
    except (OSError, RuntimeError, SafetensorError) as err:
        need = ckpt.state_bytes(model, optimizer)
        if not ckpt.is_disk_full(err, run_dir, need):
            raise
        shutil.rmtree(run_dir / (EXPORT_DIR + ".tmp"), ignore_errors=True)
        last = ckpt.latest_checkpoint(run_dir / "checkpoints")
        raise ckpt.DiskFull(ckpt.disk_full_message(
            f"the export ({EXPORT_DIR}/, about a third of a checkpoint)", run_dir, need,
            f"Training is complete in {last}; the unfinished export was removed. Free space there, then rerun the "
            "same command: it resumes from that checkpoint and writes only the export.")) from None


def export_model(model, tokenizer, directory: Path, cfg: RunConfig, converted: list[str],
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """A save_pretrained folder that plain transformers and lm-eval load, plus the scalers' final state.

    Args:
        model: the trained model.
        tokenizer: its tokenizer.
        directory: the export folder.
        cfg: the run's configuration.
        converted: the names of the quantized layers.
        state_dict: the gathered full weights of an FSDP-sharded model (distributed.full_model_state_dict).
    """
    tmp = directory.with_name(directory.name + ".tmp")
    refuse_staging_links(directory.parent)  # a link made while training ran: never followed nor removed
    if tmp.exists():

        shutil.rmtree(tmp)

    # FSDP2's generated class would replace the model's own modeling code; the scalers go to their own file
    with unsharded_class(model), scalers_left_out(model):
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if cfg.quant.enabled:
        training = cfg.quant.training
        save_quant_export(model, tmp, {"scope": training.scope,
                                       "high_precision_blocks": list(training.high_precision_blocks),
                                       "scaling": training.scaling().to_dict(), "converted": converted})
    write_folder_manifest(tmp)  # last: evaluation verifies every file against it
    if directory.exists():

        shutil.rmtree(directory)
    tmp.rename(directory)


def export_8bit_stage(cfg: RunConfig) -> Path:
    """stage=export: ``<run>/export_8bit/`` from the run's export/ (the quantized weights as 8-bit codes with their
    final scales, the rest in BF16), replaced if there; prints its size against the same tensors in BF16.

    Args:
        cfg: the run's configuration.

    Returns:
        The 8-bit export folder.

    Raises:
        RunError: the run has no export.
    """
    run_dir = run_dir_for(cfg)
    if not has_export(run_dir):  # checked before the lock, which would create the folder
        raise RunError(f"{run_dir} has no export/ to write the 8-bit export from; train it first "
                       f"(python run.py experiment={cfg.experiment.name} profile={cfg.profile.name} seed={cfg.seed} "
                       "stage=all)")
    lock_run_dir(run_dir)  # one writer of the run folder at a time
    try:
        refuse_staging_links(run_dir)
        out = run_dir / EXPORT_8BIT_DIR
        sizes = write_8bit_export(run_dir / EXPORT_DIR, out, trust_remote_code=cfg.model.trust_remote_code,
                                  meta={"config": cfg.to_dict(), **provenance()})
    finally:
        release_run_dir(run_dir)
    print(f"{size_line(sizes)}: {sizes['layers']} linears in {sizes['format']}, {out}")
    return out
