"""``train.autocast`` resolved for the machine a run trains on, before its folder is made (the numerics themselves
are the library core's :mod:`hif8qat.compute_dtype`)."""

from __future__ import annotations

import dataclasses

from hif8qat.compute_dtype import resolve, training_device_type
from hif8qat.config.run_config import ConfigError, RunConfig


def resolve_run(cfg: RunConfig) -> RunConfig:
    """The RunConfig with ``train.autocast`` resolved for its training device, so the saved config names the
    numerics actually used. The one place ``auto`` is resolved: training, evaluation (``eval.dtype=auto``), the
    time estimate and the run's records read the resolved value."""
    autocast = resolve(cfg.train.autocast, training_device_type(cfg.train.device))
    if autocast == "bf16_emulated" and cfg.train.compile:
        # torch.compile traces the backward under the forward's autocast, so the emulated GEMMs' gradients would
        # run as BF16 GEMMs: torch's slow path on exactly the machines the emulation is for.
        raise ConfigError(f"invalid setting train.compile=true with train.autocast={cfg.train.autocast} "
                          "(bf16_emulated numerics on this machine): allowed train.compile=false, or "
                          "train.autocast=none (FP32, compiles) or bf16 (native BF16)")
    if autocast == cfg.train.autocast:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, autocast=autocast))
