"""Atomic, resumable training checkpoints.

A checkpoint is a folder `checkpoints/step_<N>/` holding everything a restart needs to continue the loss
series bit for bit: model weights (safetensors), optimizer and scheduler state, and per rank the RNG states,
the data position and the quantization scalers (each rank keeps its own amax histories when amax_reduce is
"none", as the authors did). It is written under a temporary name and renamed when complete, so a crash
mid-write never leaves a checkpoint that looks valid. Everything loads with `weights_only=True`.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

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


def save_checkpoint(root: Path, step: int, *, model: torch.nn.Module, optimizer, scheduler, rank_state: dict,
                    rank: int = 0, world_size: int = 1, barrier=None, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically. Every rank calls this (rank_state is per rank)."""
    final = checkpoint_path(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if barrier:
        barrier()
    torch.save(rank_state, tmp / f"rank{rank:03d}.pt")
    if rank == 0:
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
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    if trainer["world_size"] != world_size:
        raise RuntimeError(f"checkpoint {path} was written by {trainer['world_size']} ranks; resuming with "
                           f"{world_size} would change the data order and the amax histories")
    load_model(model, str(path / "model.safetensors"))
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    rank_state = torch.load(path / f"rank{rank:03d}.pt", weights_only=True)
    return int(trainer["step"]), rank_state
