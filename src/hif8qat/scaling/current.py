"""Just-in-time ("current") scaling: a tensor's scale from its own amax, and the qdq that uses it.

Transformer Engine's current scaling (``Float8CurrentScaling``) and torchao's dynamic scaling take
``FP8_MAX / amax`` of the tensor being cast; with the target of the format this is one rule for every
format, and the bound a delayed estimate can reach (no lag, nothing clipped). It is the delayed scaler's cold
start applied on every call (:func:`hif8qat.scaling.rules.cold_estimate` and
:func:`~hif8qat.scaling.rules.scale_of`), so the bank under ``algo="current"`` and these functions pick the
same scale from the same amax. A scaling algorithm, not a number format: it sits above
:mod:`hif8qat.formats`, which knows nothing of scaling.
"""

from __future__ import annotations

import math

import torch

from hif8qat.formats.qdq import qdq_scaled_amax
from hif8qat.scaling.rules import cold_estimate, scale_of


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as a 0-d float32 tensor in one pass (aminmax: |x| is never materialised); 0 for an empty x.
    NaN and inf propagate; no host synchronisation.

    Args:
        x: a tensor.

    Returns:
        The amax.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    mn, mx = torch.aminmax(x.detach())
    return torch.maximum(mx.float(), -mn.float())


def current_scale(amax, target: float) -> torch.Tensor:
    """Just-in-time scale from a tensor's own amax: ``target / (amax + 1e-12)`` (in float64).

    A non-finite or non-positive amax gives ``scale = target``, the delayed scaler's cold-start fallback, so
    the two agree on every call. No host synchronisation.

    Args:
        amax: the tensor's amax (number or tensor).
        target: the scale target.

    Returns:
        The scale as a 0-d float32 tensor on amax's device.
    """
    if not (isinstance(target, (int, float)) and not isinstance(target, bool) and math.isfinite(target)
            and target > 0):
        raise ValueError(f"target must be a finite number > 0; got {target!r}")
    return scale_of(float(target), cold_estimate(torch.as_tensor(amax).detach().reshape(())))


def current_qdq(x: torch.Tensor, fmt: str, target: float, rounding: str = "ta", *, saturate: bool = False,
                generator: torch.Generator | None = None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Just-in-time scaled qdq: amax of x itself, ``scale = current_scale(amax, target)``, then
    :func:`hif8qat.formats.qdq.qdq_scaled_amax` (which checks the arguments); reads x twice (amax, then cast).

    Args:
        x: the tensor to quantize.
        fmt: the element format.
        target: the scale target.
        rounding: as in ``qdq_scaled_amax``.
        saturate: as in ``qdq_scaled_amax``.
        generator: the random source of stochastic rounding.
        out: optional preallocated result.

    Returns:
        ``(y, amax, scale)``.
    """
    if not isinstance(x, torch.Tensor):  # before the amax pass; the qdq checks the rest
        raise ValueError(f"x must be a torch.Tensor of dtype float32, bfloat16 or float16; got {type(x)}")
    amax = tensor_amax(x)
    scale = current_scale(amax, target)
    y, _ = qdq_scaled_amax(x, scale, fmt, rounding, saturate=saturate, generator=generator, out=out)
    return y, amax, scale


__all__ = ["current_qdq", "current_scale", "tensor_amax"]
