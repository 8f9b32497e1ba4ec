"""The names in a run's ``checkpoints/`` folder: ``step_<N>`` per checkpoint, complete once its ``COMPLETE``
marker (the manifest) is written. Read by the run folders (is a finished run re-exportable?) and by the
trainer's checkpoints (:mod:`hif8qat.train.checkpoint`), which writes, verifies and prunes them."""

from __future__ import annotations

from pathlib import Path

COMPLETE_MARKER = "COMPLETE"
STEP_PREFIX = "step_"


def checkpoint_path(root: Path, step: int) -> Path:
    """The folder of the checkpoint saved at ``step`` (``step_<N>``, 7 digits).

    Args:
        root: the run's checkpoints folder.
        step: the optimizer step.

    Returns:
        Its path (which may not exist)."""
    return root / f"{STEP_PREFIX}{step:07d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint folder named ``step_<N>``.

    Args:
        path: a folder.

    Returns:
        The step, or None for any other name (tmp, old, corrupt)."""
    digits = path.name[len(STEP_PREFIX):]
    return int(digits) if path.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def step_folders(root: Path) -> list[Path]:
    """Every ``step_<N>`` folder, complete or not, oldest first.

    Args:
        root: the run's checkpoints folder.

    Returns:
        The folders sorted by step; empty when ``root`` does not exist."""
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir()), key=checkpoint_step)


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoints marked complete, oldest first (not yet verified: see ``select_checkpoint``).

    Args:
        root: the run's checkpoints folder.

    Returns:
        Their folders."""
    return [p for p in step_folders(root) if (p / COMPLETE_MARKER).exists()]


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint marked complete (not yet verified).

    Args:
        root: the run's checkpoints folder.

    Returns:
        Its folder, or None when there is none."""
    found = list_checkpoints(root)
    return found[-1] if found else None
