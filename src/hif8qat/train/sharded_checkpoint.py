"""Model and optimizer state of a multi-rank checkpoint, through torch.distributed.checkpoint (DCP).

Under torchrun every rank writes its own shards in parallel into ``<checkpoint>/dcp/`` (``__<rank>_<n>.distcp``;
rank 0 adds DCP's ``.metadata``): no rank gathers the whole model and optimizer (14 GB at 1B parameters) and no
rank waits while another writes. FSDP2 ranks write their DTensor shards; DDP replicas are written once, the
writes spread over the ranks by DCP's planner. Loading reshards: the metadata says where every slice of every
tensor is, so a checkpoint of W ranks loads on any world size, FSDP or not, including one process without a
process group (DCP then reads everything locally).

Integrity without one rank hashing everything: each rank hashes the files it wrote, rank 0 gathers those
entries into the checkpoint's manifest (see :mod:`hif8qat.train.checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

DCP_DIR = "dcp"
METADATA = f"{DCP_DIR}/.metadata"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _options():

    # sharded (not gathered) state; the optimizer keyed by parameter name, so any world size can read it
    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def save(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Write this rank's shards of model and optimizer under ``folder/dcp`` (every rank calls it); return the
    files this rank wrote, relative to ``folder``.

    Args:
        folder: the checkpoint folder.
        model: the (sharded) model.
        optimizer: its optimizer.

    Returns:
        The files written.
    """

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=folder / DCP_DIR)
    rank = dist.get_rank() if _distributed() else 0
    mine = sorted(p for p in (folder / DCP_DIR).glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine.append(folder / METADATA)
    return [p.relative_to(folder).as_posix() for p in mine]


def load(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer from ``folder/dcp`` on this world size (every rank calls it).

    Args:
        folder: the checkpoint folder.
        model: the (sharded) model.
        optimizer: its optimizer.
    """

    # get_state_dict creates the optimizer's state tensors (a fresh optimizer has none) for DCP to fill
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=folder / DCP_DIR)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_options())


def is_sharded(folder: Path) -> bool:
    """Whether a checkpoint holds DCP shards.

    Args:
        folder: the checkpoint folder.

    Returns:
        True when it does.
    """
    return (folder / METADATA).is_file()
