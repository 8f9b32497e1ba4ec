"""The evaluation's device and numerics. ``eval.dtype`` takes ``train.autocast``'s values (``bf16``,
``bf16_emulated``, ``none``), so the training's value reaches the evaluation under its own name; ``auto`` is that
value, which the run's configuration resolved. ``fp32``, the name earlier versions gave ``none`` here, is still
read (command lines, saved configs)."""

from __future__ import annotations

import torch

from hif8qat.compute_dtype import RESOLVED
from hif8qat.config.eval_tasks import DEVICES, DTYPES, FP32_OLD_NAME
from hif8qat.errors import RunError


class EvalSettingError(RunError):
    """An evaluation device or dtype that this machine or this mode cannot honour."""


def resolve_numerics(device: str = "auto", dtype: str = "auto", *, train_device: str | None = None,
                     train_autocast: str | None = None) -> tuple[str, str]:
    """Concrete device and autocast for an evaluation.

    ``auto`` follows the training settings when given: device as ``train.device`` resolves (CUDA unless it
    is ``cpu`` or there is no GPU), dtype the run's resolved ``train.autocast``, passed on unchanged. Without
    them: native bf16 where the device has it (CUDA), else none (FP32).

    Args:
        device: ``eval.device`` (auto, cpu, cuda or cuda:N).
        dtype: ``eval.dtype`` (one of DTYPES).
        train_device: the run's ``train.device``, if any.
        train_autocast: the run's resolved ``train.autocast``, if any.

    Returns:
        ``(device, autocast)``, autocast ``bf16``, ``bf16_emulated`` or ``none`` as :mod:`hif8qat.compute_dtype` takes
        it.

    Raises:
        EvalSettingError: an unknown value, or ``cuda`` on a machine without a GPU."""

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
            dtype = train_autocast
        else:
            dtype = "bf16" if device.startswith("cuda") else "none"
    return device, eval_autocast(dtype)


def eval_autocast(dtype: str | None) -> str:
    """An evaluation's resolved ``autocast`` value from a concrete ``dtype``.

    Args:
        dtype: ``bf16``, ``bf16_emulated``, ``none``, or None and the old name ``fp32`` (both ``none``).

    Returns:
        ``none``, ``bf16`` or ``bf16_emulated``.

    Raises:
        EvalSettingError: any other value."""
    if dtype in (None, FP32_OLD_NAME):
        return "none"
    if dtype in RESOLVED:
        return dtype
    raise EvalSettingError(f"invalid setting eval.dtype={dtype!r}: allowed one of {', '.join(RESOLVED)} (or auto)")
