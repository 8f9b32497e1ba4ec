"""Saved state of the scaler bank, one quantizer (row) at a time.

The per-quantizer format (keys ``settings.STATE_KEYS``, optional ``settings.OPTIONAL_STATE_KEYS``) is the one
the per-layer scalers wrote before the bank existed: checkpoints and exports of any version load unchanged.

* ``history`` [L] float32, ``total`` int64, ``pending`` float32, ``pending_valid`` bool (step-unit maximum);
* ``scale_block`` float32 / ``est_block`` float64: the current block's scales and estimates (one entry, or the
  k entries of an exp_smooth block);
* ``meta`` int64, laid out as ``settings.META_FIELDS``;
* exp_smooth forecaster state ``es_obs`` / ``es_meta`` / ``es_scores`` when the row has a forecaster.

``bank`` is a :class:`~hif8qat.scaling.bank.ScalerBank`, passed in and typed ``Any``: this module sits below
the bank (the bank imports it) and uses only the public attributes its docstring lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hif8qat.scaling.forecast import new_forecaster
from hif8qat.scaling.settings import META_FIELDS, check_state_keys

_HOST_TABLES = ("history", "total", "pending", "pending_valid", "scale", "est", "blk_scale", "blk_est")


def host_tables(bank: Any) -> dict[str, torch.Tensor]:
    """CPU copies of the tables a saved state is made of (one copy per table for the whole bank).

    Args:
        bank: the scaler bank.

    Returns:
        Table name -> CPU tensor.
    """
    return {k: getattr(bank, k).detach().cpu() for k in _HOST_TABLES}


def row_state(bank: Any, row: int, host: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Row ``row``'s state from ``host`` (:func:`host_tables` of a bank whose micro-batch has ended).

    Args:
        bank: the scaler bank.
        row: the row.
        host: the bank's host tables.

    Returns:
        The row's saved state (keys ``settings.STATE_KEYS``).
    """
    size = int(bank.blk_size[row])
    if size > 1:
        sb, eb = host["blk_scale"][row, :size].clone(), host["blk_est"][row, :size].clone()
    else:
        sb, eb = host["scale"][row:row + 1].clone(), host["est"][row:row + 1].clone()
    meta = [int(bank.initialized[row]), int(bank.block_j[row]), int(bank.block_len[row]),
            int(bank.block_algo[row]), bank.step, int(bank.pending_step[row]), int(bank.frozen),
            int(bank.calls[row]), int(bank.seen_total[row])]
    sd = {"history": host["history"][row].clone(), "total": host["total"][row].clone(),
          "pending": host["pending"][row].clone(), "pending_valid": host["pending_valid"][row].clone(),
          "scale_block": sb, "est_block": eb, "meta": torch.tensor(meta, dtype=torch.int64)}
    if bank.forecasters[row] is not None:
        sd.update(bank.forecasters[row].state_tensors())
    return sd


@torch.no_grad()
def load_rows(bank: Any, states: Mapping[int, Mapping[str, torch.Tensor]], strict: bool = True) -> None:
    """Restore rows of ``bank`` (micro-batch ended) from saved states; the step is the last state's.

    Args:
        bank: the scaler bank.
        states: row -> saved state.
        strict: refuse missing or unexpected keys.

    Raises:
        ValueError: a state's history length or exp_smooth block does not fit the bank.
    """
    host = host_tables(bank)
    L = bank.history.shape[1]
    for row, sd in states.items():
        name = bank.row_name(row)
        check_state_keys(sd, strict, f"scaler {name}")
        if tuple(sd["history"].shape) != (L,):
            raise ValueError(f"scaler {name}: history_len mismatch: saved {tuple(sd['history'].shape)} vs "
                             f"({L},) configured")
        size = sd["scale_block"].numel()
        if size > bank.max_block and size > 1:
            raise ValueError(f"scaler {name}: saved exp_smooth block of {size} scales exceeds the configured "
                             f"largest interval {bank.max_block}")
        m = dict(zip(META_FIELDS, (int(v) for v in sd["meta"].tolist())))
        host["history"][row] = sd["history"].float()
        host["total"][row] = sd["total"].long()
        host["pending"][row] = sd["pending"].float()
        host["pending_valid"][row] = sd["pending_valid"].bool()
        j = min(m["block_j"], size - 1)
        if size > 1:
            host["blk_scale"][row, :size] = sd["scale_block"].float()
            host["blk_est"][row, :size] = sd["est_block"].double()
        host["scale"][row] = sd["scale_block"].float().reshape(-1)[j]
        host["est"][row] = sd["est_block"].double().reshape(-1)[j]
        bank.initialized[row] = bool(m["initialized"])
        bank.block_j[row], bank.block_len[row] = m["block_j"], m["block_len"]
        bank.block_algo[row] = m["block_algo"]
        bank.blk_size[row] = size
        bank.pending_step[row] = m["pending_step"]
        bank.calls[row], bank.seen_total[row] = m["calls"], m["seen_total"]
        bank.step = m["step"]
        if "es_obs" in sd:
            fc = new_forecaster(bank.roles[row])
            fc.load_state_tensors(sd)
            bank.forecasters[row] = fc
        else:
            bank.forecasters[row] = None
    for k, v in host.items():
        if k == "scale":
            bank.scale.copy_(v.to(bank.device))  # in place: the per-row views the kernels read stay valid
        else:
            setattr(bank, k, v.to(bank.device))


__all__ = ["host_tables", "load_rows", "row_state"]
