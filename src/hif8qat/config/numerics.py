"""``train.autocast`` and ``train.optimizer_impl`` resolved for the machine a run trains on, before its folder is
made (the numerics themselves are the library core's :mod:`hif8qat.compute_dtype`)."""

from __future__ import annotations

import dataclasses

from hif8qat.compute_dtype import resolve, training_device_type
from hif8qat.config.run_config import ConfigError, RunConfig


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
