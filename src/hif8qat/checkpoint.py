"""Atomic, resumable training checkpoints.

A checkpoint is a folder `checkpoints/step_<N>/` holding everything a restart needs to continue the loss
series bit for bit: model weights (safetensors), optimizer and scheduler state, and per rank the RNG states,
the data position and the quantization scalers (each rank keeps its own amax histories when amax_reduce is
"none", as the authors did). It is written under a temporary name and renamed when complete, so a crash
mid-write never leaves a checkpoint that looks valid. Everything loads with `weights_only=True`.

Under FSDP (`train.distributed=fsdp`) the same files are written: the weights are gathered into one full
`model.safetensors` (tied weights stored once, as `safetensors.torch.save_model` does) and the optimizer state
is gathered and stored keyed by parameter name (`"optimizer_keys": "name"` in trainer.pt). Either kind of
checkpoint resumes with or without FSDP (same world size); the model file loads into a plain model.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

COMPLETE_MARKER = "COMPLETE"
_PREFIX = "step_"


def checkpoint_path(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:07d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.exists():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()
             and (p / COMPLETE_MARKER).exists()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_full_model(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], filename: str) -> None:
    """save_model's file from a gathered state dict: of tied names only the first (sorted) is stored."""
    from .distributed import tied_groups

    metadata: dict[str, str] = {}
    for group in tied_groups(model):
        for name in group[1:]:
            if state_dict.pop(name, None) is not None:
                metadata[name] = group[0]
    save_file({k: v.contiguous() for k, v in state_dict.items()}, filename, metadata=metadata or None)


def _load_full_model(model: torch.nn.Module, filename: str, rank: int) -> None:
    from .distributed import load_full_model_state_dict, tied_groups

    state_dict: dict[str, torch.Tensor] = {}
    if rank == 0:  # the other ranks receive their shards from rank 0
        state_dict = load_file(filename)
        for group in tied_groups(model):
            present = [n for n in group if n in state_dict]
            for name in group:
                if present and name not in state_dict:
                    state_dict[name] = state_dict[present[0]]
    load_full_model_state_dict(model, state_dict)


def save_checkpoint(root: Path, step: int, *, model: torch.nn.Module, optimizer, scheduler, rank_state: dict,
                    rank: int = 0, world_size: int = 1, barrier=None, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically. Every rank calls this (rank_state is per rank)."""
    from .distributed import full_model_state_dict, full_optimizer_state_dict, is_fsdp

    final = checkpoint_path(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if barrier:
        barrier()
    torch.save(rank_state, tmp / f"rank{rank:03d}.pt")
    if is_fsdp(model):  # collectives: every rank gathers, rank 0 writes
        model_sd, optim_sd = full_model_state_dict(model), full_optimizer_state_dict(model, optimizer)
        if rank == 0:
            _save_full_model(model, model_sd, str(tmp / "model.safetensors"))
            torch.save({"optimizer": optim_sd, "optimizer_keys": "name", "scheduler": scheduler.state_dict(),
                        "step": step, "world_size": world_size}, tmp / "trainer.pt")
        del model_sd, optim_sd
    elif rank == 0:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                    "world_size": world_size}, tmp / "trainer.pt")
    if barrier:
        barrier()
    if rank == 0:
        (tmp / COMPLETE_MARKER).write_text(str(step))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if barrier:
        barrier()
    return final


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer, scheduler, rank: int = 0,
                    world_size: int = 1) -> tuple[int, dict]:
    """Restore model, optimizer and scheduler; return (step, this rank's state)."""
    from .distributed import is_fsdp, load_full_optimizer_state_dict, optimizer_state_by_name

    fsdp = is_fsdp(model)
    # Under FSDP only rank 0 reads the full optimizer state (the others get their shards from it): map the file.
    trainer = torch.load(path / "trainer.pt", weights_only=True, mmap=fsdp and rank != 0)
    if trainer["world_size"] != world_size:
        raise RuntimeError(f"checkpoint {path} was written by {trainer['world_size']} ranks; resuming with "
                           f"{world_size} would change the data order and the amax histories")
    if fsdp:
        _load_full_model(model, str(path / "model.safetensors"), rank)
    else:
        load_model(model, str(path / "model.safetensors"))
    by_name = trainer.get("optimizer_keys") == "name"
    if fsdp or by_name:
        optim_sd = trainer["optimizer"] if by_name else optimizer_state_by_name(model, optimizer, trainer["optimizer"])
        load_full_optimizer_state_dict(model, optimizer, optim_sd if (rank == 0 or not fsdp) else {})
    else:
        optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    rank_state = torch.load(path / f"rank{rank:03d}.pt", weights_only=True)
    return int(trainer["step"]), rank_state
