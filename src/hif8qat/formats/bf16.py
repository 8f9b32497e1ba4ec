"""float32 tensors rounded to BF16 values (nearest, ties to even): the BF16 emulation's rounding.

:func:`round_bf16` rounds a copy (autograd rounds the gradient too): ``x.to(bfloat16).to(float32)``, a BF16
copy and a float32 copy. On a CPU a tensor above glibc's mmap threshold (32 MiB at most), such as an evaluation
batch's logits (32 x 128 positions x a 49,152-entry vocabulary: 805 MB), is then mapped and faulted in afresh for
each copy, which costs several times the rounding itself. :func:`round_bf16_` rounds a tensor in place a slice at
a time, each slice through a small BF16 buffer that the allocator reuses: the same values (the cast's own
rounding), with no large allocation. Torch only.
"""

from __future__ import annotations

import torch


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor holding x rounded to the nearest BF16 value (ties to even, as the cast does).

    Args:
        x: a float tensor.

    Returns:
        The rounded float32 tensor.
    """
    return x.to(torch.bfloat16).to(torch.float32)


# elements rounded per slice: a 512 KiB BF16 buffer, far below the mmap threshold, reused slice after slice
SLICE_NUMEL = 1 << 18


def round_bf16_(x: torch.Tensor) -> torch.Tensor:
    """x (float32, not recorded by autograd) rounded to the nearest BF16 values in place, ties to even, as
    ``x.to(torch.bfloat16)`` rounds: for a GEMM's fresh result.

    Args:
        x: a float32 tensor that no autograd graph records.

    Returns:
        x, rounded.

    Raises:
        ValueError: x is not float32, or autograd records it.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"round_bf16_ rounds float32 tensors in place; got {x.dtype}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("round_bf16_ would change a tensor autograd records; round a copy instead")
    if not x.is_contiguous():
        return x.copy_(x.to(torch.bfloat16))
    for part in x.view(-1).split(SLICE_NUMEL):
        part.copy_(part.to(torch.bfloat16))
    return x
