"""``train.autocast`` and ``train.optimizer_impl`` resolved for the machine a run trains on, before its folder is
made, and the run's compute numerics made one typed value (:class:`RunNumerics`: training's and evaluation's,
``eval.dtype`` / ``eval.device`` resolved against them). The one place where ``auto`` numerics are resolved; the
numerics themselves are the library core's :mod:`hif8qat.compute_dtype`. ``eval.dtype`` takes
``train.autocast``'s values (``fp32``, the name earlier versions gave ``none``, is still read)."""

from __future__ import annotations

import dataclasses

import torch

from hif8qat.compute_dtype import RESOLVED, Numerics, resolve, training_device_type
from hif8qat.config.eval_tasks import DEVICES, DTYPES, FP32_OLD_NAME
from hif8qat.config.run_config import ConfigError, RunConfig
from hif8qat.errors import RunError


class EvalSettingError(RunError):
    """An evaluation device or dtype that this machine or this mode cannot honour."""


@dataclasses.dataclass(frozen=True)
class RunNumerics:
    """A run's compute numerics, resolved once from its (resolved) config and passed to what runs its model:
    ``train`` (training steps, the memory and time estimates), ``eval`` and ``eval_device`` (lm-eval, the held-out
    comparison; None for a stage that does not evaluate)."""

    train: Numerics
    eval: Numerics | None
    eval_device: str | None


def optimizer_impl_for(requested: str, device_type: str) -> str:
    """The AdamW implementation ``train.optimizer_impl=requested`` names on a device type: ``auto`` is ``fused``
    where torch has a fused AdamW kernel for the device (CPU and CUDA), else ``torch_default``.

    Args:
        requested: the ``train.optimizer_impl`` setting.
        device_type: "cpu" or "cuda".

    Returns:
        ``requested`` itself unless it is ``auto``; else ``fused`` or ``torch_default``.
    """
    if requested != "auto":
        return requested
    return "fused" if device_type in _fused_adamw_device_types() else "torch_default"


def _fused_adamw_device_types() -> list[str]:
    """Adapter: the device types torch has fused optimizer kernels for. Torch keeps that list private (its own
    optimizers read it from ``torch.utils._foreach_utils`` to validate ``fused=True``); asking here avoids trying
    a fused AdamW on a device that would refuse it."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def resolve_run(cfg: RunConfig, *, saved_optimizer_impl: str | None = None) -> RunConfig:
    """The RunConfig with ``train.autocast`` and ``train.optimizer_impl`` resolved for its training device, so
    the saved config names the numerics actually used. The one place ``auto`` is resolved: training,
    evaluation (``eval.dtype=auto``), the time estimate and the run's records read the resolved value.

    Args:
        cfg: the run's configuration.
        saved_optimizer_impl: the implementation the run folder's saved config records, when this run resumes
            (or finds finished) a run: ``auto`` keeps it, as a run's optimizer must not change in the middle
            of its training.

    Returns:
        The resolved configuration.
    """
    device_type = training_device_type(cfg.train.device)
    autocast = resolve(cfg.train.autocast, device_type)
    if autocast == "bf16_emulated" and cfg.train.compile:
        # torch.compile traces the backward under the forward's autocast, so the emulated GEMMs' gradients would
        # run as BF16 GEMMs: torch's slow path on exactly the machines the emulation is for.
        raise ConfigError(f"invalid setting train.compile=true with train.autocast={cfg.train.autocast} "
                          "(bf16_emulated numerics on this machine): allowed train.compile=false, or "
                          "train.autocast=none (FP32, compiles) or bf16 (native BF16)")
    optimizer_impl = cfg.train.optimizer_impl
    if optimizer_impl == "auto":
        optimizer_impl = saved_optimizer_impl or optimizer_impl_for("auto", device_type)
    if (autocast, optimizer_impl) == (cfg.train.autocast, cfg.train.optimizer_impl):
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, autocast=autocast,
                                                              optimizer_impl=optimizer_impl))


def train_numerics(cfg: RunConfig) -> Numerics:
    """``train.autocast`` on the run's training device type (the training steps, the memory and time estimates).

    Args:
        cfg: the run's configuration.

    Returns:
        The training's :class:`Numerics` (never ``auto``).
    """
    device_type = training_device_type(cfg.train.device)
    return Numerics(resolve(cfg.train.autocast, device_type), device_type)


def run_numerics(cfg: RunConfig) -> RunNumerics:
    """The numerics of a run: :func:`train_numerics`, and for a stage that evaluates (eval, all) ``eval.device`` /
    ``eval.dtype`` (``auto``: the training's), checked before any training.

    Args:
        cfg: the run's configuration.

    Returns:
        The run's :class:`RunNumerics` (``eval`` and ``eval_device`` None for a stage that does not evaluate).

    Raises:
        EvalSettingError: an evaluation device this machine lacks, or an unknown ``eval.device`` /
            ``eval.dtype``.
    """
    train = train_numerics(cfg)
    if cfg.stage not in ("eval", "all"):
        return RunNumerics(train, None, None)
    eval_device, numerics = eval_numerics(cfg.eval.device, cfg.eval.dtype, train_device=cfg.train.device,
                                          train=train)
    return RunNumerics(train, numerics, eval_device)


def eval_numerics(device: str = "auto", dtype: str | None = "auto", *, train_device: str | None = None,
                  train: Numerics | None = None) -> tuple[str, Numerics]:
    """Concrete ``(device, numerics)`` of an evaluation.

    ``auto`` follows the training when given: the device as ``train.device`` resolves (CUDA unless it is ``cpu``
    or there is no GPU), the numerics the training's mode, passed on unchanged. Without a training: native bf16
    where the device has it (CUDA), else none (FP32); None and ``fp32`` are ``none``.

    Args:
        device: ``eval.device`` (auto, cpu, cuda or cuda:N).
        dtype: ``eval.dtype`` (one of DTYPES, or None).
        train_device: the run's ``train.device``, if any.
        train: the run's training :class:`Numerics`, if any.

    Returns:
        ``(device, numerics)``: the concrete device and the evaluation's :class:`Numerics` on its device type.

    Raises:
        EvalSettingError: an unknown value, or ``cuda`` on a machine without a GPU.
    """
    dtype = "none" if dtype in (None, FP32_OLD_NAME) else dtype
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
        dtype = train.mode if train is not None else "bf16" if device.startswith("cuda") else "none"
    if dtype not in RESOLVED:
        raise EvalSettingError(f"invalid setting eval.dtype={dtype!r}: allowed one of {', '.join(RESOLVED)} (or auto)")
    return device, Numerics(dtype, torch.device(device).type)
