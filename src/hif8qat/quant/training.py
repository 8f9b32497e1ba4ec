"""The library's entry point for any trainer: one frozen config and one conversion call.

    from hif8qat import Hif8TrainingConfig, convert_to_hif8_training
    config = Hif8TrainingConfig(algo="most_recent", history_len=30, interval={0: 1, 1000: 10}, scope="attn_mlp")
    convert_to_hif8_training(model, config=config, module_filter_fn=lambda mod, fqn: "layers.0." not in fqn)

The conversion swaps the chosen ``nn.Linear`` layers of the decoder blocks for :class:`~hif8qat.quant.linear.QuantLinear`
in place (parameters shared, so an optimizer built before or after stays valid), builds one scaler bank for all of
them, and puts the scalers' state into ``model.state_dict()``, so the trainer's own checkpointing saves and restores
the delayed-scaling history bit for bit. Call :func:`~hif8qat.quant.linear.set_step` with the optimizer step before
each step when the config has step schedules (``interval``, ``algo``) or ``history_unit="step"``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from hif8qat.quant.blocks import SCOPES, ModuleFilter, coverage_summary
from hif8qat.quant.linear import convert_model, coverage, set_state_in_state_dict
from hif8qat.scaling.settings import ScalingConfig

log = logging.getLogger(__name__)


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"Hif8TrainingConfig.{name}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class Hif8TrainingConfig(ScalingConfig):
    """Everything a conversion needs, checked once when made (ValueError naming the field and what is allowed).

    The delayed-scaling fields are :class:`~hif8qat.scaling.settings.ScalingConfig`'s: ``format`` (hif8, e4m3,
    e5m2, hybrid), ``algo`` (the estimator, or a step schedule ``{step: algo}``), ``history_len``, ``interval``
    (a number or a step schedule), ``history_unit``, ``amax_reduce``, ``grad_rounding`` (G's rounding: ta or
    stochastic), ``saturate``, ``margin`` (FP8), ``target`` (HiF8 scale target for every role, a number, or per
    role, ``{"A": .., "W": .., "G": ..}``; roles left out keep ``target_fwd`` / ``target_bwd``). Added here:

    * ``scope``: ``mlp`` (the feed-forward / MoE experts' GEMMs) or ``attn_mlp`` (also attention's);
    * ``high_precision_blocks``: indices of decoder blocks left unquantized;
    * ``emulate_bf16``: run the quantized layers' BF16 GEMMs as FP32 GEMMs on BF16 values (for machines without
      native BF16; use it with :func:`hif8qat.compute_dtype.forward_context` ``("bf16_emulated", ...)``).
    """

    scope: str = "attn_mlp"
    high_precision_blocks: tuple[int, ...] = ()
    emulate_bf16: bool = False

    def __post_init__(self) -> None:
        blocks = self.high_precision_blocks
        if isinstance(blocks, (list, tuple, set, frozenset, range)):
            object.__setattr__(self, "high_precision_blocks", tuple(sorted(set(blocks))))
        super().__post_init__()  # normalises the schedules, then validate(): the one check

    def validate(self) -> Hif8TrainingConfig:
        super().validate()
        if self.scope not in SCOPES:
            _fail("scope", self.scope, f"one of {SCOPES}")
        if not isinstance(self.high_precision_blocks, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.high_precision_blocks):
            _fail("high_precision_blocks", self.high_precision_blocks, "a list of block indices (integers >= 0)")
        if not isinstance(self.emulate_bf16, bool):
            _fail("emulate_bf16", self.emulate_bf16, "true or false")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.update(scope=self.scope, high_precision_blocks=list(self.high_precision_blocks),
                 emulate_bf16=self.emulate_bf16)
        return d

    def scaling(self) -> ScalingConfig:
        """The delayed-scaling part alone (what a scaler bank reads)."""
        return ScalingConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ScalingConfig)})


def convert_to_hif8_training(model: nn.Module, *, config: Hif8TrainingConfig | None = None,
                             module_filter_fn: ModuleFilter | None = None,
                             role_map: Mapping[str, str] | None = None) -> nn.Module:
    """Quantize ``model``'s decoder-block GEMMs (``nn.Linear``, GPT-2's ``Conv1D``, MoE experts per expert) for
    HiF8 (or FP8) training, in place; returns ``model``. Logs one line: how many of the blocks' GEMM weights are
    quantized, and why the others are not (:func:`~hif8qat.quant.linear.coverage` lists them).

    ``module_filter_fn(module, fqn)``: called for each GEMM module the scope selects outside the high-precision
    blocks (``fqn`` is its name in ``model``); False leaves it alone. ``role_map``: ``{name inside a block:
    "attn" | "mlp" | "none"}`` for a layout whose roles the block's structure does not tell (e.g.
    ``{"mixer": "attn", "channel": "mlp"}``). The quantizers are on and their state is part of
    ``model.state_dict()`` from here on.
    """
    config = config if config is not None else Hif8TrainingConfig()
    convert_model(model, config.scope, config.high_precision_blocks, config, module_filter_fn=module_filter_fn,
                  emulate_bf16=config.emulate_bf16, role_map=role_map)
    set_state_in_state_dict(model, True)
    log.info("hif8qat: %s (scope=%s)", coverage_summary(coverage(model)), config.scope)
    return model


__all__ = ["Hif8TrainingConfig", "convert_to_hif8_training"]
