"""The replay of amax traces through the scaler bank: the scales delayed scaling would pick for them.

Recorded traces (a run's final scaler state) or synthetic ones go through the bank's own call path without a
tensor to quantize (:meth:`hif8qat.scaling.bank.ScalerBank.observe`), so a replay is the training path itself,
not a second implementation of the rules. The report and notebook 03 compare the estimators with it; the tests
hold it against the independent reference in ``tests/reference_scaling.py``. The top of the scaling core: it
imports the bank, nothing in ``scaling`` imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hif8qat.scaling.bank import ScalerBank
from hif8qat.scaling.bank_row import BankedScaler
from hif8qat.scaling.settings import ScalingConfig


def replay(amax_sequence: Sequence[float] | torch.Tensor, config: ScalingConfig | None = None, *,
           steps: Sequence[int] | None = None, role: str = "A",
           target: float | None = None) -> torch.Tensor:
    """Scales the bank would use for a recorded or synthetic amax trace, one call per amax.

    Runs a one-row bank's own call path without any tensor to quantize, ending the micro-batch after each
    call.

    Args:
        amax_sequence: the amaxes, one per call.
        config: the scaling settings (default ``ScalingConfig()``).
        steps: the optimizer step of each call (drives schedules and ``history_unit=step``); None: every call
            at step 0.
        role: "A", "W" or "G".
        target: a scale target overriding the format's.

    Returns:
        A float32 tensor with one scale per call.

    Raises:
        ValueError: ``steps`` is not one entry per amax.
    """
    seq = amax_sequence.tolist() if isinstance(amax_sequence, torch.Tensor) else list(amax_sequence)
    if steps is not None and len(steps) != len(seq):
        raise ValueError(f"replay: steps has {len(steps)} entries for {len(seq)} amaxes")
    scaler = BankedScaler.standalone(role, config, target)
    out = []
    for i, a in enumerate(seq):
        if steps is not None:
            scaler.set_step(int(steps[i]))
        out.append(scaler.observe_amax(float(a)))
    return torch.stack(out) if out else torch.zeros(0)


def replay_rows(amax_rows: Sequence[Sequence[float]] | torch.Tensor, config: ScalingConfig | None = None, *,
                role: str = "A") -> torch.Tensor:
    """:func:`replay` of many equal-length traces at once (no step schedule given, default target): one bank
    with a row per trace, so the bank's per-micro-batch work runs once per call index instead of once per
    trace and call.

    Args:
        amax_rows: ``[n_traces, n_calls]`` amaxes.
        config: the scaling settings.
        role: "A", "W" or "G".

    Returns:
        ``[n_traces, n_calls]`` float32 scales, equal to :func:`replay` of each trace on its own (rows of one
        bank never interact).
    """
    a = torch.as_tensor(amax_rows, dtype=torch.float32)
    if a.ndim != 2:
        raise ValueError(f"replay_rows: expected [n_traces, n_calls] amaxes, got shape {tuple(a.shape)}")
    n, calls = a.shape
    out = torch.zeros(n, calls, dtype=torch.float32)
    if not n:
        return out
    bank = ScalerBank(config, [role] * n)
    with torch.no_grad():
        for t in range(calls):
            for r in range(n):
                out[r, t] = bank.observe(r, a[r, t])
            bank.update()
    return out


__all__ = ["replay", "replay_rows"]
