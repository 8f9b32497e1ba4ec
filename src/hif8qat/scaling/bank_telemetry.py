"""Telemetry of the scaler bank: per-row accumulators since the last ``reset_telemetry`` and last-call values.

Columns of ``tel_max`` / ``tel_cnt`` are named by ``settings.TELEMETRY_MAX_FIELDS`` /
``settings.TELEMETRY_COUNT_FIELDS``: the largest ``amax / estimate`` (> 1: the tensor outgrew its delayed
estimate), exceeded fraction and amax; the calls with ratio > 1, the clipped values
(``formats.FormatSpec.clipped``) and the non-finite amaxes. Everything stays on the device until
:func:`records` copies it once for the whole bank.

``bank`` is a :class:`~hif8qat.scaling.bank.ScalerBank`, passed in and typed ``Any``: this module sits below
the bank (the bank imports it) and uses only the public attributes its docstring lists.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hif8qat.scaling.settings import ALGOS, LAST_CALL_FIELDS, TELEMETRY_COUNT_FIELDS, TELEMETRY_MAX_FIELDS


def record_calls(bank: Any, amax: torch.Tensor, finite: torch.Tensor, called: torch.Tensor | bool) -> None:
    """Accumulate one micro-batch's (reduced) amaxes of the ``called`` rows (``True``: every row).

    Args:
        bank: the scaler bank.
        amax: ``[n]`` amaxes of the micro-batch.
        finite: ``[n]`` whether each amax is finite.
        called: ``[n]`` rows that ran, or True.
    """
    ratio = amax / bank.est
    amax64 = amax.to(torch.float64)
    # fmax ignores NaN (a NaN amax leaves the maxima alone); an inf amax shows as an inf ratio
    new_max = torch.fmax(bank.tel_max, torch.stack((ratio, bank.tel_max[:, 1], amax64), dim=1))
    cnt = torch.stack(((ratio > 1), torch.zeros_like(finite), ~finite), dim=1)
    last = torch.stack((amax64, bank.est, ratio, bank.scale.to(torch.float64)), dim=1)
    if called is True:
        bank.tel_max, bank.last_vals = new_max, last
    else:
        bank.tel_max = torch.where(called.view(-1, 1), new_max, bank.tel_max)
        bank.last_vals = torch.where(called.view(-1, 1), last, bank.last_vals)
        cnt &= called.view(-1, 1)
    bank.tel_cnt += cnt


def record_stats(bank: Any, x: torch.Tensor, row: int, scale: torch.Tensor, amax: torch.Tensor) -> None:
    """Exceeded fraction (``|x*s| > target``) and clipped count of one call (a reduction over ``x`` each, skipped on a
    CPU where the call's largest ``|x*s|`` is within the target, or the format's range: the count is then 0).

    Args:
        bank: the scaler bank.
        x: the call's input.
        row: the quantizer's row.
        scale: the scale the call used.
        amax: the call's ``max |x|`` (float32), as its kernel computed it.
    """
    target, spec = bank.targets[row], bank.specs[row]
    # float32 rounding is monotonic, so no |x_i|*s exceeds amax*s (a NaN amax bounds nothing). On a CPU reading it
    # costs nothing: at the mini profile about half the statistics calls need no pass for the exceeded fraction,
    # and nearly all none for the clipped count (the format's range is far above the target).
    top = amax.to(torch.float32) * scale
    bounded = x.device.type == "cpu" and not bool(top.isnan())
    count_exceed = not bounded or bool(top > target)
    count_clipped = not bounded or bool(spec.clipped(top))
    exceed, clipped = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    if count_exceed or count_clipped:
        ax = x.detach().abs().to(torch.float32).mul_(scale)  # |x*s|
        if count_exceed:
            exceed = (ax > target).to(torch.float32).mean().to(torch.float64)
        if count_clipped:  # formats.clipped_count's rule, on the |x*s| computed here
            clipped = spec.clipped(ax)
    bank.tel_max[row, 1] = torch.fmax(bank.tel_max[row, 1], exceed)
    bank.tel_cnt[row, 1] += clipped
    bank.last_stats[row] = torch.stack((exceed, clipped.to(torch.float64)))
    bank.tel_stat_calls[row] += 1


def records(bank: Any) -> list[dict[str, Any]]:
    """Per-row telemetry dicts (one host copy for the whole bank).

    Args:
        bank: the scaler bank.

    Returns:
        One dict per row.
    """
    host = torch.cat((bank.last_vals, bank.last_stats, bank.tel_max, bank.tel_cnt.double(),
                      bank.total.double().view(-1, 1)), dim=1).cpu().tolist()
    L = bank.history.shape[1]
    out = []
    for r, v in enumerate(host):
        rec: dict[str, Any] = {k: (None if math.isnan(x) else x) for k, x in zip(LAST_CALL_FIELDS, v[:6])}
        rec.update({k: float(x) for k, x in zip(TELEMETRY_MAX_FIELDS, v[6:9])})
        rec.update({k: int(x) for k, x in zip(TELEMETRY_COUNT_FIELDS, v[9:12])})
        rec.update(calls=int(bank.tel_calls[r]), stats_calls=int(bank.tel_stat_calls[r]),
                   history_count=min(int(v[12]), L),
                   algo=ALGOS[bank.block_algo[r]] if bank.block_algo[r] >= 0 else "", format=bank.formats[r],
                   target=float(bank.targets[r]),
                   interval=int(bank.block_len[r]))
        out.append(rec)
    return out


__all__ = ["record_calls", "record_stats", "records"]
