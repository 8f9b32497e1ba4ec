"""Scale-out helpers: FSDP2 sharding, gradient sync, gathered state dicts (the launch environment itself,
SLURM's mapped to torch's, is :mod:`hif8qat.runs.launch_env`).

This module owns how a model is sharded (:func:`apply_fsdp`: each transformer block its own unit, FP32 master
weights, so the weight quantizer sees the same values as under DDP), gradient accumulation without
communication (:func:`grad_sync`, for DDP and FSDP2 alike), and whole (gathered, CPU) state dicts under FSDP
(:func:`full_model_state_dict` and its kin), so checkpoints and exports keep the single-process format. Works
with NCCL on GPU and gloo on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hif8qat.models.loading import transformer_blocks
from hif8qat.quant.linear import set_weight_recompute


def all_gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (one process: ``[obj]``).

    Args:
        obj: this rank's object (picklable).
        world_size: the number of ranks.

    Returns:
        One object per rank.
    """
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def cuda_device_for(local_rank: int) -> torch.device:
    """The GPU of this local rank; with one visible GPU per task (SLURM GPU binding) that GPU is cuda:0.

    Args:
        local_rank: the rank on this node.

    Returns:
        The device.
    """
    count = torch.cuda.device_count()
    return torch.device("cuda", local_rank % count if count > 1 else 0)


# ------------------------------------------------------------------------------------------------
# FSDP2
# ------------------------------------------------------------------------------------------------
def is_fsdp(model: nn.Module) -> bool:

    """Whether any module of ``model`` is sharded with FSDP2.

    Args:
        model: the model.

    Returns:
        True when sharded.
    """
    return any(isinstance(m, FSDPModule) for m in model.modules())


def apply_fsdp(model: nn.Module, *, mesh=None, reshard_after_forward: bool = True,
               mp_policy=None, blocks: Iterable[nn.Module] | None = None) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (``torch.distributed.fsdp.fully_shard``): each transformer block is
    its own unit (its parameters all-gathered just before it runs and freed after), then the root takes the
    rest (embeddings, final norm, lm_head).

    Parameters become DTensors sharded over the data-parallel ranks; their names do not change, so HiF8
    conversion and scalers work as without FSDP. They stay FP32 master weights; the all-gather is in FP32
    unless an ``mp_policy`` says otherwise: the trainer's default keeps FP32 so the HiF8 weight quantizer sees
    the same (full, all-gathered) weight as under DDP (BF16 comes from autocast).

    Args:
        model: a causal LM.
        mesh: the device mesh (default all ranks).
        reshard_after_forward: free the gathered parameters after each block's forward.
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, or None.
        blocks: the units to shard (default the decoder blocks).

    Returns:
        The model.
    """

    if blocks is None:

        blocks = list(transformer_blocks(model))
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward,
                              "mp_policy": mp_policy or MixedPrecisionPolicy()}
    if mesh is not None:
        kwargs["mesh"] = mesh
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)

    set_weight_recompute(model)  # keeping a quantized full weight from forward to backward would undo the sharding
    return model


@contextmanager
def unsharded_class(model: nn.Module) -> Iterator[nn.Module]:
    """Inside, an FSDP2-sharded `model` has its own class again (fully_shard swaps it for a generated
    ``FSDP<cls>`` defined in torch): save_pretrained then records and copies the model's modeling code (a
    remote-code model's ``auto_map``), not torch's FSDP files. Nothing else changes; a plain model is left alone.

    Args:
        model: the model, sharded or not.

    Yields:
        The model.
    """

    sharded = type(model)
    if not isinstance(model, FSDPModule):
        yield model
        return
    model.__class__ = next(c for c in sharded.__mro__[1:] if not issubclass(c, FSDPModule))
    try:
        yield model
    finally:
        model.__class__ = sharded


def _compiled_inner(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) runs, or ``model`` itself when not wrapped.

    Adapter: the wrapper keeps the module in its private ``_orig_mod``, the one way torch gives to reach it."""
    return getattr(model, "_orig_mod", model)


@contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Run a micro-batch's forward *and* backward inside: with enabled=False its gradients only accumulate
    locally (no all-reduce / reduce-scatter); the final micro-batch of a step runs with enabled=True, so
    gradients are reduced once per optimizer step. DDP decides in forward (``no_sync``) and FSDP2 in backward
    (``set_requires_gradient_sync``), hence one block around both.

    Args:
        model: what the trainer calls: a DDP module, an FSDP2 root, a plain module (nothing to do) or any of
            them behind torch.compile.
        enabled: synchronise this micro-batch's gradients.
    """

    target = _compiled_inner(model)
    if enabled or not (isinstance(target, FSDPModule) or hasattr(target, "no_sync")):
        yield
    elif isinstance(target, FSDPModule):
        # Unsharded gradients accumulate across micro-batches; the final one reduce-scatters their sum.
        target.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            target.set_requires_gradient_sync(True)
    else:
        with target.no_sync():
            yield


def _options(**kw):

    return StateDictOptions(**kw)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of state-dict entries that are one tensor (tied weights), sorted; only groups of 2+.

    Args:
        model: the model.

    Returns:
        The groups of names.
    """
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), []).append(name)
    return [sorted(names) for names in by_id.values() if len(names) > 1]


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gathered full model state on CPU on rank 0 (empty dict on the other ranks). All ranks call it.

    Args:
        model: the (sharded) model.

    Returns:
        Name -> tensor on rank 0, {} elsewhere.
    """

    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_model_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict held by rank 0 into a sharded model (other ranks may pass {}). All ranks call it.

    Args:
        model: the sharded model.
        state_dict: the full state (rank 0).
    """

    set_model_state_dict(model, dict(state_dict),
                         options=_options(full_state_dict=True, broadcast_from_rank0=True, strict=True))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Gathered optimizer state keyed by parameter name, on CPU on rank 0 ({} elsewhere). All ranks call it.

    Args:
        model: the (sharded) model.
        optimizer: its optimizer.

    Returns:
        The state on rank 0, {} elsewhere.
    """

    return get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: Mapping[str, Any]) -> None:
    """Load a name-keyed full optimizer state (held by rank 0; others may pass {}). All ranks call it.

    Args:
        model: the sharded model.
        optimizer: its optimizer.
        state_dict: the full name-keyed state (rank 0).
    """

    broadcast = dist.is_available() and dist.is_initialized() and is_fsdp(model)
    set_optimizer_state_dict(model, optimizer, dict(state_dict),
                             options=_options(full_state_dict=True, broadcast_from_rank0=broadcast))


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer,
                            indexed: Mapping[str, Any]) -> dict[str, Any]:
    """Convert ``optimizer.state_dict()`` (parameters numbered in param_groups order) to the name-keyed form.

    The numbering follows the parameters of ``optimizer``, which must have been built the same way as the one
    that wrote ``indexed`` (the trainer always builds it from the same model and parameter groups).

    Args:
        model: the model.
        optimizer: its optimizer.
        indexed: the numbered state.

    Returns:
        The name-keyed state.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    index_to_name: dict[int, str] = {}
    idx = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            index_to_name[idx] = names[id(p)]
            idx += 1
    state = {index_to_name[int(i)]: s for i, s in indexed["state"].items()}
    groups = [{**g, "params": [index_to_name[int(i)] for i in g["params"]]} for g in indexed["param_groups"]]
    return {"state": state, "param_groups": groups}
