"""The names in a run's ``checkpoints/`` folder: ``step_<N>`` per checkpoint, complete once its ``COMPLETE``
marker (the manifest) is written. Read by the run folders (is a finished run re-exportable?) and by the
trainer's checkpoints (:mod:`hif8qat.train.checkpoint`), which writes, verifies and prunes them."""

from __future__ import annotations

from pathlib import Path

COMPLETE_MARKER = "COMPLETE"
STEP_PREFIX = "step_"


def checkpoint_path(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step:07d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint folder named `step_<N>`, None for anything else (tmp, old, corrupt)."""
    digits = path.name[len(STEP_PREFIX):]
    return int(digits) if path.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def step_folders(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir()), key=checkpoint_step)


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoints marked complete, oldest first (not yet verified: see `select_checkpoint`)."""
    return [p for p in step_folders(root) if (p / COMPLETE_MARKER).exists()]


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None
