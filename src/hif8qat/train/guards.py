"""The trainer's guards against bad numbers: gradient clipping that returns the whole model's norm (so a non-finite
norm skips the same step on every rank), and the check that names the first weight or optimizer state holding
inf/NaN before a checkpoint is written."""

from __future__ import annotations

import torch
import torch.distributed as dist


def clip_gradients(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip the gradients to a total norm of ``max_norm``.

    Under FSDP2 the norm comes back as a DTensor: `full_tensor()` makes it the whole model's norm, one value
    on every rank, so a non-finite norm makes every rank skip the same step (a rank that alone skipped would
    leave its shard of the weights behind the others').

    Args:
        model: the model.
        max_norm: the largest total norm (0 or None: no clipping).

    Returns:
        The total norm before clipping.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _first_nonfinite(model: torch.nn.Module, optimizer, ctx) -> str | None:
    """Name of the first weight (or its optimizer state) holding inf/NaN, agreed by all ranks (``ctx``: the trainer's
    DistContext); None if clean.

    One host sync per checkpoint; sharded (FSDP) tensors are checked locally. min/max propagate NaN and
    inf, and read the tensor without allocating a mask (10x faster than isfinite().all() on CPU here)."""
    extremes, owners = [], []
    for name, param in model.named_parameters():
        for label, t in [(name, param), *((f"{name} (optimizer {k})", v)
                                          for k, v in optimizer.state.get(param, {}).items()
                                          if k != "step" and torch.is_tensor(v))]:
            t = t.to_local() if hasattr(t, "to_local") else t
            if t.is_floating_point():  # an empty local shard still gets an entry: every rank's list aligns
                extremes.append(torch.stack(torch.aminmax(t.detach())).float() if t.numel()
                                else torch.zeros(2, device=t.device))
                owners.append(label)
    if not extremes:
        return None
    finite = torch.stack(extremes).isfinite().all(dim=1)
    if ctx.world_size > 1:
        finite = finite.to(ctx.device, torch.int32)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    bad = (~finite.bool()).nonzero()
    return owners[int(bad[0])] if len(bad) else None
