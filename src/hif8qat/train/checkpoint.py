"""Atomic, resumable training checkpoints.

A checkpoint is a folder `checkpoints/step_<N>/` holding everything a restart needs to continue the loss
series bit for bit: model weights (safetensors), optimizer and scheduler state, and per rank the RNG states,
the data position and the quantization scalers (each rank keeps its own amax histories when amax_reduce is
"none", as the authors did). It is written under a temporary name and renamed when complete, so a crash
mid-write never leaves a checkpoint that looks valid; its `COMPLETE` marker is a manifest of every file's size
and sha256, written last. Everything loads with `weights_only=True`. This module owns saving
(:func:`save_checkpoint`, which says how the sharded format is written under torchrun), verifying and choosing
the checkpoint to resume from (:func:`verify_checkpoint`, :func:`select_checkpoint`), loading, and mapping
per-rank state onto another world size (:func:`rank_state_for`).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from hif8qat.artefacts import require_record
from hif8qat.errors import RunError, one_line
from hif8qat.files import free_space, human_bytes, sha256_file
from hif8qat.quant.linear import scalers_left_out
from hif8qat.runs.checkpoint_names import (  # noqa: F401 (the checkpoint API, re-exported)
    COMPLETE_MARKER,
    STEP_PREFIX,
    checkpoint_path,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    step_folders,
)
from hif8qat.train import sharded_checkpoint as sharded_ckpt
from hif8qat.train.distributed import (
    all_gather_objects,
    full_model_state_dict,
    full_optimizer_state_dict,
    is_fsdp,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    optimizer_state_by_name,
    tied_groups,
)

_TMP, _OLD, _TRASH, _CORRUPT = ".tmp", ".old", ".trash", ".corrupt-"
_MANIFEST_FORMAT = 1
# What a checkpoint cannot be resumed without (rank files beyond rank 0 are checked through the manifest).
_REQUIRED = ("model.safetensors", "trainer.pt", "rank000.pt")
_REQUIRED_SHARDED = ("trainer.pt", "rank000.pt", "dcp/.metadata")
# What a damaged file makes the loaders raise (safetensors, torch.load's zip reader, unpickling).
_LOAD_ERRORS = (SafetensorError, RuntimeError, EOFError, OSError, pickle.UnpicklingError, KeyError, ValueError)


_UNVERIFIED_REDO = ("Remove the files its manifest does not list (they were not written with the checkpoint), or "
                    "start the run over with force=true (the old folder is kept)")
# What a checkpoint records about the run that wrote it (hashed by the manifest like every other file).
PROVENANCE_FILE = "provenance.json"
class CheckpointError(RunError):
    """A checkpoint that cannot be used: incomplete, truncated, corrupt or written for another setup."""


class DiskFull(RunError):
    """The disk holding the run folder filled up while a checkpoint or the export was written."""


def state_bytes(model: torch.nn.Module, optimizer=None) -> int:
    """Bytes of the model's parameters and buffers plus the optimizer's tensors: what a checkpoint stores (an
    optimizer with no state yet counts as AdamW's two moments per parameter).

    Args:
        model: the model.
        optimizer: its optimizer, or None.

    Returns:
        The byte count.
    """
    params = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    states = [v for st in (optimizer.state.values() if optimizer is not None else []) for v in st.values()
              if torch.is_tensor(v)]
    return params + (sum(v.numel() * v.element_size() for v in states) if states else 2 * params)


def is_disk_full(err: BaseException, where: Path, need: int) -> bool:
    """Whether a failed write ran out of disk: ENOSPC/EDQUOT, safetensors' and torch.save's wording of it, or
    (torch.save's "file write failed" names no cause) less free space left than the write needed.

    Args:
        err: the exception the write raised.
        where: the folder written into.
        need: the bytes the write needed.

    Returns:
        True when the disk was full.
    """

    if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT):  # an OSError or files.StorageError
        return True
    text = str(err)
    if any(s in text for s in ("No space left", "StorageFull", "Disk quota exceeded", "os error 28")):
        return True
    # torch.save names no cause: "file write failed", or the C++ stream's "basic_ios::clear" or its zip
    # writer's "unexpected pos N vs M" when the disk filled exactly at a write; a disk without room for the
    # write is the cause then.
    if isinstance(err, RuntimeError) and any(s in text for s in ("write failed", "basic_ios::clear", "unexpected pos")):
        free = free_space(where)
        return free is not None and free < need
    return False


def disk_full_message(what: str, where: Path, need: int, after: str) -> str:
    """The message of a save that ran out of disk: what was written where, the free space and a checkpoint's
    size.

    Args:
        what: what was being written.
        where: the folder.
        need: a checkpoint's size in bytes.
        after: what the user does next (the message's last sentence).

    Returns:
        The message.
    """
    return (f"no space left on the disk holding {where} while writing {what}: {human_bytes(free_space(where))} free, "
            f"a checkpoint of this run takes about {human_bytes(need)}. {after}")


def check_free_space(root: Path, need: int, keep: int) -> None:
    """Before the first save: one checkpoint must fit, or the run would train until it fails to save.

    Args:
        root: the checkpoints folder.
        need: a checkpoint's size in bytes.
        keep: ``train.keep_checkpoints``.

    Raises:
        DiskFull: not even one checkpoint fits (a warning is printed when ``keep + 2`` do not).
    """
    free = free_space(root)
    if free is None:  # a disk that does not say: the save itself will tell
        return
    if free < need:
        raise DiskFull(f"not enough free space for a checkpoint in {root}: {human_bytes(free)} free, a checkpoint of "
                       f"this run takes about {human_bytes(need)} (up to train.keep_checkpoints + 1 = {keep + 1} of "
                       "them at once, plus the export). Free space there, or point results_root at a larger disk")
    if free < need * (keep + 2):
        print(f"warning: {root} has {human_bytes(free)} free; the run keeps up to {keep + 1} checkpoints of about "
              f"{human_bytes(need)} at once plus the export ({human_bytes(need * (keep + 2))}): it may fill the disk",
              file=sys.stderr)


def _rename(src: Path, dst: Path) -> None:  # one place for every rename: tests interrupt saves here
    os.replace(src, dst)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path)


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints; with none left, the empty folder too.
    Quarantined (``*.corrupt-*``) folders stay for inspection.

    Args:
        root: the checkpoints folder.
        keep: how many to keep.
    """
    found = list_checkpoints(root)
    for stale in found[:max(len(found) - keep, 0)]:
        trash = stale.with_name(stale.name + _TRASH)  # renamed first: a half-deleted folder never looks complete
        _rename(stale, trash)
        _remove_tree(trash)
    if keep == 0 and root.exists() and not any(root.iterdir()):
        root.rmdir()


def rng_state() -> dict[str, Any]:
    """This process's RNG states. On CUDA only the current device's generator: a rank draws from its own GPU
    only, and a resume may see another number of GPUs (fewer per node, CUDA_VISIBLE_DEVICES, SLURM binding).

    Returns:
        ``{"torch", "python", "cuda_device"?}``.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved (older checkpoints' one state per GPU too: this device's).

    Args:
        state: the saved states.
    """
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)
    elif state.get("cuda"):  # older checkpoints: one state per GPU then visible; take this device's if saved
        states = state["cuda"]
        torch.cuda.set_rng_state(states[device if device < len(states) else 0], device)


def _save_full_model(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], filename: str) -> None:
    """save_model's file from a gathered state dict: of tied names only the first (sorted) is stored."""

    metadata: dict[str, str] = {}
    for group in tied_groups(model):
        for name in group[1:]:
            if state_dict.pop(name, None) is not None:
                metadata[name] = group[0]
    save_file({k: v.contiguous() for k, v in state_dict.items()}, filename, metadata=metadata or None)


def _load_full_model(model: torch.nn.Module, filename: str, rank: int) -> None:

    state_dict: dict[str, torch.Tensor] = {}
    if rank == 0:  # the other ranks receive their shards from rank 0
        state_dict = load_file(filename)
        for group in tied_groups(model):
            present = [n for n in group if n in state_dict]
            for name in group:
                if present and name not in state_dict:
                    state_dict[name] = state_dict[present[0]]
    load_full_model_state_dict(model, state_dict)


def _file_entries(folder: Path, names) -> dict[str, dict]:
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)} for name in names}


def _write_manifest(folder: Path, step: int, files: dict[str, dict] | None = None, layout: str = "full") -> None:
    """The COMPLETE marker: every file's size and sha256 (``files``: entries the ranks hashed themselves)."""
    if files is None:
        files = _file_entries(folder, [p.name for p in sorted(folder.iterdir())
                                       if p.is_file() and p.name != COMPLETE_MARKER])
    manifest = {"format": _MANIFEST_FORMAT, "step": step, "layout": layout, "files": dict(sorted(files.items()))}
    (folder / COMPLETE_MARKER).write_text(json.dumps(manifest, indent=1) + "\n")


def _read_manifest(path: Path) -> dict:
    """The manifest. The former one-line marker (the step alone) records no hashes: such a checkpoint cannot
    be told from one with flipped bits, so it is refused rather than loaded unverified."""
    marker = path / COMPLETE_MARKER
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {COMPLETE_MARKER} marker")
    text = marker.read_text(errors="replace").strip()
    if text.isdigit():
        raise CheckpointError(f"checkpoint {path}: its {COMPLETE_MARKER} marker is the former one-line form "
                              f"({text!r}), which records no sizes or sha256 sums, so its files cannot be "
                              "verified; resume from a checkpoint written by this version, or start over with "
                              "force=true")
    try:
        manifest = json.loads(text)
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no file entries")
        if not all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                   for v in files.values()):
            raise ValueError("malformed file entry")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable manifest {marker} ({err})") from None
    return manifest


def verify_checkpoint(path: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Check a checkpoint against its manifest before loading, so truncated, missing or bit-flipped files are
    caught (sha256: ~1.2 GB/s on one core here, under the cost of writing the same bytes; checkable with
    `sha256sum`).

    Args:
        path: the checkpoint folder.
        share: ``(rank, world_size)``: hash only every world_size-th file of the manifest from the rank-th on,
            so the ranks of a resume check a checkpoint together (`select_checkpoint`).

    Raises:
        CheckpointError: naming the first problem: no marker, missing file, wrong size, wrong checksum.
    """
    manifest = _read_manifest(path)
    files = manifest["files"]
    for name in _REQUIRED_SHARDED if manifest.get("layout") == "dcp" else _REQUIRED:
        if name not in files:
            raise CheckpointError(f"checkpoint {path}: manifest lists no {name}")
    # a file the manifest leaves out would be loaded (or shadow one) unchecked: refused, unless trusted
    present = [p.relative_to(path).as_posix() for p in sorted(path.rglob("*"))
               if p.is_file() and p.name != COMPLETE_MARKER]
    require_record(path, files, present, _UNVERIFIED_REDO, record=f"{COMPLETE_MARKER} manifest")
    for i, (name, entry) in enumerate(files.items()):
        if i % share[1] != share[0]:
            continue
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} has {size} bytes, {entry['bytes']} were written "
                                  "(truncated or replaced)")
        if sha256_file(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} fails its sha256 check (the file changed after "
                                  "it was written)")


def recover_interrupted(root: Path) -> list[str]:
    """Finish or undo what a kill interrupted (rank 0, before any load).

    Re-saving an existing step swaps folders so that one complete copy of the step is on disk at every
    instant: new -> `step_<N>.tmp`, old -> `step_<N>.old`, tmp -> final, then delete old. So `step_N.old`
    means a re-save of step N had begun and its new copy was complete before the old one was moved: publish
    the new copy if it is not in place yet, then drop the old. A `.tmp` without an `.old` is a write that
    never got published: drop it (its steps are redone). `.trash` is an interrupted pruning.

    Args:
        root: the checkpoints folder.

    Returns:
        One note per action.
    """
    notes: list[str] = []
    if not root.exists():
        return notes
    for old in sorted(root.glob(f"{STEP_PREFIX}*{_OLD}")):
        final, tmp = old.with_name(old.name[:-len(_OLD)]), old.with_name(old.name[:-len(_OLD)] + _TMP)
        if not final.exists():
            if (tmp / COMPLETE_MARKER).exists():
                _rename(tmp, final)
                notes.append(f"finished the interrupted re-save of {final.name}")
            else:
                _rename(old, final)
                notes.append(f"restored {final.name} from its interrupted re-save")
                continue
        _remove_tree(old)
    for tmp in sorted(root.glob(f"{STEP_PREFIX}*{_TMP}")):
        _remove_tree(tmp)
        notes.append(f"removed the unfinished checkpoint write {tmp.name}")
    for trash in sorted(root.glob(f"{STEP_PREFIX}*{_TRASH}")):
        _remove_tree(trash)
    return notes


def quarantine(path: Path) -> Path:
    """Move a rejected checkpoint out of the way (to `step_<N>.corrupt-<time>`), keeping it for inspection.

    Args:
        path: the checkpoint folder.

    Returns:
        Its new path.
    """
    target = path.with_name(f"{path.name}{_CORRUPT}{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while target.exists():
        target, n = path.with_name(f"{path.name}{_CORRUPT}{time.strftime('%Y%m%d-%H%M%S')}-{n}"), n + 1
    _rename(path, target)
    return target


def select_checkpoint(root: Path, log: Callable[[str], None] = print, *, rank: int = 0, world_size: int = 1,
                      gather=None, barrier=None) -> Path | None:
    """The newest intact checkpoint under root, after recovering interrupted writes.

    Rejected checkpoints are renamed `*.corrupt-<time>` (never deleted) with a printed reason. Several ranks
    (every rank calls it) share the hashing, each its share of the files; rank 0 alone repairs, renames and
    logs.

    Args:
        root: the checkpoints folder.
        log: where the notes go.
        rank: this process's rank.
        world_size: the number of ranks.
        gather: ``gather(obj)`` -> every rank's obj (several ranks).
        barrier: waits for every rank (several ranks).

    Returns:
        The checkpoint folder, or None when the run never wrote a checkpoint.

    Raises:
        CheckpointError: it wrote some and none is intact (starting over silently would throw their steps
            away).
    """
    if rank == 0:
        for note in recover_interrupted(root):
            log(f"checkpoint recovery: {note}")
    if barrier:
        barrier()  # every rank lists the folders rank 0 repaired
    rejected: list[str] = []
    for path in reversed(step_folders(root)):
        try:
            verify_checkpoint(path, (rank, world_size))
            problem = None
        except CheckpointError as err:
            problem = str(err)
        problems = [p for p in (gather(problem) if gather else [problem]) if p]
        if problems:
            if rank == 0:
                kept = quarantine(path)
                log(f"checkpoint rejected: {problems[0]}; kept as {kept.name}")
            if barrier:
                barrier()  # renamed before any rank looks for the rejected ones
            rejected.append(path.name)
            continue
        if rejected and rank == 0:
            log(f"resuming from the newest intact checkpoint {path} (step {checkpoint_step(path)}) instead of "
                f"{', '.join(rejected)}")
        return path
    earlier = sorted(p.name for p in root.glob(f"{STEP_PREFIX}*{_CORRUPT}*")) if root.exists() else []
    if earlier:
        raise CheckpointError(f"no intact checkpoint in {root} (rejected: {', '.join(earlier)}); rerun with "
                              "force=true to start the run over (the old folder is kept), or delete the run folder")
    return None


def save_checkpoint(root: Path, step: int, *, model: torch.nn.Module, optimizer, scheduler, rank_state: dict,
                    rank: int = 0, world_size: int = 1, barrier=None, keep: int = 2,
                    provenance: dict | None = None) -> Path:
    """Write checkpoint `step` atomically. Every rank calls this (rank_state is per rank).

    Under torchrun (world size > 1, DDP or FSDP) model and optimizer go through torch.distributed.checkpoint
    (:mod:`hif8qat.train.sharded_checkpoint`): every rank writes its own shards into `dcp/` and hashes the
    files it wrote; rank 0 gathers those entries into the manifest (`"layout": "dcp"`), so no rank gathers 14
    GB or hashes them alone, and trainer.pt holds the scheduler and step only. Such a checkpoint resumes on
    any world size (DCP reshards; a single process reads it without a process group). A single process writes
    the full format (one `model.safetensors`; under FSDP of one rank the weights are gathered, tied weights
    stored once, the optimizer keyed by parameter name, `"optimizer_keys": "name"`), which also resumes on any
    world size.

    Args:
        root: the checkpoints folder.
        step: the optimizer steps done.
        model: the model.
        optimizer: its optimizer.
        scheduler: its learning-rate scheduler.
        rank_state: this rank's RNG states, data position and scalers.
        rank: this process's rank.
        world_size: the number of ranks.
        barrier: waits for every rank (several ranks).
        keep: how many complete checkpoints to keep.
        provenance: the settings that made it (:func:`run_provenance`), checked by :func:`check_provenance`.

    Returns:
        The checkpoint folder.

    Raises:
        DiskFull: naming the folder, the free space and the checkpoint's size; earlier checkpoints stay.
    """
    final = checkpoint_path(root, step)
    tmp, old = final.with_name(final.name + _TMP), final.with_name(final.name + _OLD)
    try:
        with scalers_left_out(model):  # the weights' files are every rank's; each rank's scalers are its own
            _write(tmp, step, model=model, optimizer=optimizer, scheduler=scheduler, rank_state=rank_state,
                   rank=rank, world_size=world_size, barrier=barrier, provenance=provenance)
    except (OSError, RuntimeError, SafetensorError) as err:
        need = state_bytes(model, optimizer)
        if not is_disk_full(err, root, need):
            raise
        if rank == 0:  # the unfinished copy only takes space; the checkpoints before it are untouched
            shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(root)
        kept = f"the last checkpoint {last.name} is intact" if last else "no earlier checkpoint was written"
        raise DiskFull(disk_full_message(f"checkpoint step {step}", root, need,
                                         f"Nothing was lost: {kept} and the unfinished write was removed. Free "
                                         "space there (or lower train.keep_checkpoints), then rerun the same "
                                         "command: it resumes from the last checkpoint.")) from None
    if rank == 0:
        if final.exists():  # re-save: one complete copy of this step on disk at every instant
            if old.exists():
                _remove_tree(old)
            _rename(final, old)
            _rename(tmp, final)
            _remove_tree(old)
        else:
            _rename(tmp, final)
        prune_checkpoints(root, keep)
    if barrier:
        barrier()
    return final


def _write(tmp: Path, step: int, *, model, optimizer, scheduler, rank_state: dict, rank: int, world_size: int,
           barrier, provenance: dict | None = None) -> None:
    """Every file of checkpoint `step` into `tmp`, manifest last (not yet published)."""

    if rank == 0:
        if tmp.exists():
            _remove_tree(tmp)
        tmp.mkdir(parents=True)
        if provenance is not None:
            (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1, sort_keys=True) + "\n")
    if barrier:
        barrier()
    rank_file = f"rank{rank:03d}.pt"
    torch.save(rank_state, tmp / rank_file)
    if world_size > 1:  # every rank writes and hashes its own shards; rank 0 gathers the entries

        mine = [rank_file, *sharded_ckpt.save(tmp, model, optimizer)]
        if rank == 0:
            torch.save({"scheduler": scheduler.state_dict(), "step": step, "world_size": world_size},
                       tmp / "trainer.pt")  # the layout is the manifest's
            mine += ["trainer.pt", *([PROVENANCE_FILE] if provenance is not None else [])]
        entries = all_gather_objects(_file_entries(tmp, mine), world_size)  # a few names and hashes
        if rank == 0:
            _write_manifest(tmp, step, {k: v for part in entries for k, v in part.items()}, layout="dcp")
        return
    if is_fsdp(model):  # one rank under FSDP: the full format, gathered
        model_sd, optim_sd = full_model_state_dict(model), full_optimizer_state_dict(model, optimizer)
        _save_full_model(model, model_sd, str(tmp / "model.safetensors"))
        torch.save({"optimizer": optim_sd, "optimizer_keys": "name", "scheduler": scheduler.state_dict(),
                    "step": step, "world_size": world_size}, tmp / "trainer.pt")
        del model_sd, optim_sd
    else:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                    "world_size": world_size}, tmp / "trainer.pt")
    _write_manifest(tmp, step)


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer, scheduler, rank: int = 0,
                    world_size: int = 1) -> tuple[int, dict]:
    """Restore model, optimizer and scheduler from a verified checkpoint.

    Args:
        path: the checkpoint folder.
        model: the model (built as the one saved).
        optimizer: its optimizer.
        scheduler: its scheduler.
        rank: this process's rank.
        world_size: the number of ranks.

    Returns:
        ``(step, this rank's state)``.

    Raises:
        CheckpointError: a damaged or mismatched file (the library's error, naming the checkpoint).
    """
    try:
        with scalers_left_out(model):  # the weights; the scalers come back from the rank's state
            return _load(path, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank,
                         world_size=world_size)
    except CheckpointError:
        raise
    except _LOAD_ERRORS as err:
        raise CheckpointError(f"cannot load checkpoint {path} ({type(err).__name__}: {one_line(str(err), 300)}); "
                              "it was written by another version or model, or is damaged: resume from another "
                              "checkpoint (train.resume=<folder>) or start over with force=true") from None


def _load(path: Path, *, model, optimizer, scheduler, rank: int, world_size: int) -> tuple[int, dict]:

    fsdp = is_fsdp(model)
    # Under FSDP only rank 0 reads the full optimizer state (the others get their shards from it): map the file.
    trainer = torch.load(path / "trainer.pt", weights_only=True, mmap=fsdp and rank != 0)
    if sharded_ckpt.is_sharded(path):
        sharded_ckpt.load(path, model, optimizer)  # any world size: DCP reshards
    else:
        if fsdp:
            _load_full_model(model, str(path / "model.safetensors"), rank)
        else:
            load_model(model, str(path / "model.safetensors"))
        by_name = trainer.get("optimizer_keys") == "name"
        if fsdp or by_name:
            optim_sd = (trainer["optimizer"] if by_name
                        else optimizer_state_by_name(model, optimizer, trainer["optimizer"]))
            load_full_optimizer_state_dict(model, optimizer, optim_sd if (rank == 0 or not fsdp) else {})
        else:
            optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    saved_world = int(trainer["world_size"])
    rank_state = rank_state_for(path, rank, saved_world) if saved_world != world_size else \
        torch.load(path / f"rank{rank:03d}.pt", weights_only=True)
    return int(trainer["step"]), rank_state


def rank_state_for(path: Path, rank: int, saved_world: int) -> dict:
    """This rank's state when the checkpoint was written by another number of ranks.

    RNG and quantization scalers: those of saved rank ``rank % saved_world`` (with amax_reduce they are the
    same on every rank). Data: every saved rank's position, under ``"data_by_rank"``, for the stream's
    ``resize`` to place this rank after everything the saved ranks read (docs/design.md, "Resuming on another
    world size").

    Args:
        path: the checkpoint folder.
        rank: this process's rank.
        saved_world: the world size that wrote it.

    Returns:
        The rank state.
    """
    own = torch.load(path / f"rank{rank % saved_world:03d}.pt", weights_only=True)
    datas = [own["data"] if r == rank % saved_world else
             torch.load(path / f"rank{r:03d}.pt", weights_only=True).get("data")
             for r in range(saved_world)] if "data" in own else []
    return {**own, "data_by_rank": datas, "resized_from": saved_world}

