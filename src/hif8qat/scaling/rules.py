"""The delayed-scaling rules, once: cold start, history estimators, the refresh rule, the amax reduction and
the history append (contract: docs/design.md, section 2).

Functions on tables of rows (one row per quantizer: history ``[n, L]``, counters ``[n]``), so the bank applies
each rule to the whole model in one vectorised op; a single quantizer is a one-row table. Tensor ops only,
no host synchronisation; the refresh decision is numpy on the bank's per-row bookkeeping.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

EPS = 1e-12  # scale = target / (estimate + EPS): finite for a zero estimate
FALLBACK_ESTIMATE = 1.0  # authors: a non-finite or non-positive estimate counts as 1.0 (scale = target)


def scale_of(target: torch.Tensor | float, est: torch.Tensor) -> torch.Tensor:
    """``target / (est + EPS)`` computed in float64, stored as float32.

    Args:
        target: the scale target.
        est: the amax estimate.

    Returns:
        The scale (float32).
    """
    return torch.div(target, est.to(torch.float64) + EPS).to(torch.float32)


def cold_estimate(amax: torch.Tensor) -> torch.Tensor:
    """The estimate of a cold start (and of every just-in-time call): the tensor's own amax (float64), or
    FALLBACK_ESTIMATE when that amax is NaN, inf or <= 0.

    Args:
        amax: the tensor's amax.

    Returns:
        The estimate.
    """
    est = amax.to(torch.float64)
    return torch.where((est > 0) & (est < math.inf), est, torch.full_like(est, FALLBACK_ESTIMATE))


def history_estimate(history: torch.Tensor, total: torch.Tensor, algo: str, previous: torch.Tensor) -> torch.Tensor:
    """Per-row float64 estimate of ``max`` / ``most_recent`` / ``mean`` over the history window.

    A row whose estimate is 0 (empty or all-zero history) keeps ``previous``: the authors fall back to 1.0,
    which is what ``previous`` is after a non-finite cold start.

    Args:
        history: ``[n, L]`` finite amaxes, newest last, unused leading slots 0 (neutral for max and sum).
        total: ``[n]`` entries ever appended.
        algo: "max", "most_recent" or "mean".
        previous: ``[n]`` the current estimates.

    Returns:
        ``[n]`` float64 estimates.
    """
    if algo == "max":
        est = history.amax(1).to(torch.float64)
    elif algo == "most_recent":
        est = history[:, -1].to(torch.float64)
    elif algo == "mean":
        est = history.sum(1, dtype=torch.float64) / total.clamp(1, history.shape[1])
    else:
        raise ValueError(f"history estimator must be max, most_recent or mean; got {algo!r}")
    return torch.where(est > 0, est, previous)


def refresh_due(block_algo: np.ndarray, block_len: np.ndarray, block_j: np.ndarray, algo: int, k: int,
                current: bool) -> np.ndarray:
    """Rows whose next unit (call or step) opens a new block: the block of ``block_len`` units is used up, or
    the scheduled algorithm or interval changed (the authors restart only on an interval change; with interval
    1 the two agree). Under ``current`` every unit opens a block.

    Args:
        block_algo: ``[n]`` the algorithm index of each row's block.
        block_len: ``[n]`` each block's length.
        block_j: ``[n]`` units used in each block.
        algo: the scheduled algorithm's index now.
        k: the interval now.
        current: the scheduled algorithm is ``current``.

    Returns:
        ``[n]`` booleans.
    """
    due = (block_algo != algo) | (block_len != k) | (block_j + 1 >= block_len)
    return due | current


def reduce_amax(amax: torch.Tensor, mode: str) -> torch.Tensor:
    """All-reduce the amaxes over ranks.

    ``mode="max"``: all-reduce (MAX) over the default process group when one is initialised. NaN is mapped to
    +inf first so that every rank sees the same non-finite value (and drops it).

    Args:
        amax: the local amaxes.
        mode: "max" or "none".

    Returns:
        The amaxes: a new tensor after an all-reduce, ``amax`` itself otherwise.
    """
    if mode == "max" and dist.is_available() and dist.is_initialized():
        amax = torch.where(torch.isnan(amax), torch.full_like(amax, math.inf), amax).clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return amax


def append(history: torch.Tensor, total: torch.Tensor, value: torch.Tensor,
           ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift ``value`` (one per row) into the rows where ``ok``. Rows not ``ok`` are unchanged, so a
    non-finite amax never enters the history.

    Args:
        history: ``[n, L]`` histories.
        total: ``[n]`` entries ever appended.
        value: ``[n]`` the amaxes.
        ok: ``[n]`` finite amax and row called.

    Returns:
        The new ``(history, total)``.
    """
    shifted = torch.cat((history[:, 1:], value.view(-1, 1)), dim=1)
    return torch.where(ok.view(-1, 1), shifted, history), total + ok


__all__ = ["EPS", "FALLBACK_ESTIMATE", "append", "cold_estimate", "history_estimate", "reduce_amax", "refresh_due",
           "scale_of"]
