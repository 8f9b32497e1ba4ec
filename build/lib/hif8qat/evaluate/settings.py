"""The evaluation's device and numerics: ``auto`` resolved, and the compute numerics of an ``eval.dtype``."""

from __future__ import annotations

import torch

from hif8qat.compute_dtype import resolve
from hif8qat.config.eval_tasks import DEVICES, DTYPES
from hif8qat.errors import RunError


class EvalSettingError(RunError):
    """An evaluation device or dtype that this machine or this mode cannot honour."""


def resolve_numerics(device: str = "auto", dtype: str = "auto", *, train_device: str | None = None,
                     train_autocast: str | None = None) -> tuple[str, str]:
    """Concrete ``(device, dtype)`` for an evaluation (``dtype``: ``fp32``, ``bf16`` or ``bf16_emulated``, see
    the module doc and :mod:`hif8qat.compute_dtype`).

    ``auto`` follows the training settings when given: device as ``train.device`` resolves (CUDA unless it
    is ``cpu`` or there is no GPU), dtype the training numerics (``train.autocast``, ``auto`` resolved for
    this machine; ``none`` is ``fp32``). Without them: native bf16 where the device has it (CUDA), else fp32.
    Raises :class:`EvalSettingError` for an unknown value or ``cuda`` on a machine without a GPU.
    """

    for setting, value, allowed in (("eval.device", device, DEVICES), ("eval.dtype", dtype, DTYPES)):
        if value not in allowed and not (setting == "eval.device" and str(value).startswith("cuda:")):
            raise EvalSettingError(f"invalid setting {setting}={value!r}: allowed one of {', '.join(allowed)}")
    if device == "auto":
        wanted = str(train_device or "auto")
        device = "cpu" if wanted == "cpu" or not torch.cuda.is_available() else wanted.replace("auto", "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalSettingError(f"eval.device={device} but this machine has no CUDA device; use eval.device=cpu "
                               "(or auto: the training device)")
    if dtype == "auto":
        if train_autocast is not None:

            compute = resolve(train_autocast, torch.device(device).type)
            dtype = "fp32" if compute == "none" else compute
        else:
            dtype = "bf16" if device.startswith("cuda") else "fp32"
    return device, dtype


def eval_compute(dtype: str | None) -> str:
    """The compute numerics (hif8qat.compute_dtype: none | bf16 | bf16_emulated) of an evaluation dtype."""
    if dtype in (None, "fp32"):
        return "none"
    if dtype in ("bf16", "bf16_emulated"):
        return dtype
    raise EvalSettingError(f"invalid setting eval.dtype={dtype!r}: allowed one of fp32, bf16, bf16_emulated (or auto)")
