"""The learning-rate schedule: linear warmup from 0, then half a cosine down to 0 at the last step.

The same values as ``transformers.get_cosine_schedule_with_warmup`` (tests compare them bit for bit), built on
torch's ``LambdaLR`` so that a checkpoint's scheduler state loads either way. Not imported from transformers:
``transformers.optimization`` pulls in ``trainer_utils`` and, through it, peft when installed (lm-eval's ``hf``
extra installs it), which costs several seconds at the start of every training process.
"""

from __future__ import annotations

import functools
import math

import torch


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """The factor on the base learning rate at optimizer step ``step`` (0-based).

    Args:
        step: the optimizer step.
        warmup_steps: linear warm-up length.
        total_steps: the run's steps (cosine decay to the end).

    Returns:
        The factor.
    """
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int,
                           total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The warm-up then cosine learning-rate schedule as a ``LambdaLR`` (of :func:`warmup_cosine_factor`).

    Args:
        optimizer: the optimizer.
        warmup_steps: linear warm-up length.
        total_steps: the run's steps.

    Returns:
        The scheduler.
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(warmup_cosine_factor, warmup_steps=warmup_steps, total_steps=total_steps))
