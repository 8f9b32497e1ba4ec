"""The library's entry point for any trainer: one frozen config and one conversion call.

    from hif8qat import Hif8TrainingConfig, convert_to_hif8_training
    config = Hif8TrainingConfig(algo="most_recent", history_len=30, interval={0: 1, 1000: 10}, scope="attn_mlp")
    convert_to_hif8_training(model, config=config, module_filter_fn=lambda mod, fqn: "layers.0." not in fqn)

The conversion swaps the chosen ``nn.Linear`` layers of the decoder blocks for
:class:`~hif8qat.quant.linear.QuantLinear` in place (parameters shared, so an optimizer built before or after stays
valid), builds one scaler bank for all of them, and puts the scalers' state into ``model.state_dict()``, so the
trainer's own checkpointing saves and restores the delayed-scaling history bit for bit. Call
:func:`~hif8qat.quant.linear.set_step` with the optimizer step before each step when the config has step schedules
(``interval``, ``algo``) or ``history_unit="step"``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from hif8qat.formats.qdq import FORMAT_SETTINGS, HIF8_MAX
from hif8qat.quant.blocks import DEFAULT_SCOPE, SCOPES, ModuleFilter, coverage_summary
from hif8qat.quant.linear import _convert_model, coverage, quant_modules, set_state_in_state_dict
from hif8qat.scaling.settings import (
    ALGOS,
    AMAX_REDUCES,
    GRAD_ROUNDINGS,
    HISTORY_UNITS,
    ScalingConfig,
    SettingError,
)

log = logging.getLogger(__name__)


def _fail(name: str, value: Any, allowed: str) -> None:
    raise SettingError("Hif8TrainingConfig", name, value, allowed)


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

    scope: str = DEFAULT_SCOPE
    high_precision_blocks: tuple[int, ...] = ()
    emulate_bf16: bool = False

    def __post_init__(self) -> None:
        blocks = self.high_precision_blocks
        if isinstance(blocks, (list, tuple, set, frozenset, range)):
            object.__setattr__(self, "high_precision_blocks", tuple(sorted(set(blocks))))
        super().__post_init__()  # normalises the schedules, then validate(): the one check

    def validate(self) -> Hif8TrainingConfig:
        """Check every field, the delayed-scaling ones and those of the conversion.

        Returns:
            This config.

        Raises:
            ValueError: naming the first invalid field and its allowed values.
        """
        super().validate()
        if self.scope not in SCOPES:
            _fail("scope", self.scope, "one of " + ", ".join(SCOPES))
        if not isinstance(self.high_precision_blocks, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.high_precision_blocks):
            _fail("high_precision_blocks", self.high_precision_blocks, "a list of block indices (integers >= 0)")
        if not isinstance(self.emulate_bf16, bool):
            _fail("emulate_bf16", self.emulate_bf16, "true or false")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (``high_precision_blocks`` a list).

        Returns:
            Field name -> value.
        """
        d = super().to_dict()
        d.update(scope=self.scope, high_precision_blocks=list(self.high_precision_blocks),
                 emulate_bf16=self.emulate_bf16)
        return d

    def scaling(self) -> ScalingConfig:
        """The delayed-scaling part alone (what a scaler bank reads).

        Returns:
            The ``ScalingConfig``.
        """
        return ScalingConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ScalingConfig)})


def _one_of(values) -> str:
    return " \\| ".join(f"`{v}`" for v in values)


def _field_rules() -> dict[str, tuple[str, str]]:
    """Per field of :class:`Hif8TrainingConfig`: (allowed values, meaning), built from the constants the checks
    use, so the README's table (:func:`config_table`) cannot drift from what ``validate`` accepts."""
    schedule = ", or a step schedule `{0: .., step: ..}`"
    hif8_number = f"a number in (0, {HIF8_MAX:g}]"
    return {
        "algo": (_one_of(ALGOS) + schedule, "the amax estimator (`current`: just in time, from the tensor itself)"),
        "history_len": ("an int >= 1", "amax history length"),
        "interval": ("an int >= 1" + schedule, "steps or calls between scale refreshes"),
        "target_fwd": (hif8_number + " (HiF8 only)", "HiF8 scale target of A and W unless `target` names them"),
        "target_bwd": (hif8_number + " (HiF8 only)", "HiF8 scale target of G unless `target` names it"),
        "target": ("`None`, " + hif8_number + ", or `{\"A\": .., \"W\": .., \"G\": ..}` (HiF8 only)",
                   "HiF8 scale target, all roles or per role"),
        "history_unit": (_one_of(HISTORY_UNITS), "what one history entry is (`step`: the max over its micro-batches)"),
        "amax_reduce": (_one_of(AMAX_REDUCES), "amax all-reduce across data-parallel ranks"),
        "saturate": ("`True` \\| `False`", "clamp HiF8 overflow to +-32768 instead of inf"),
        "grad_rounding": (_one_of(GRAD_ROUNDINGS) + " (`stochastic`: HiF8 only)", "rounding of the gradients G"),
        "telemetry_dump_every": ("an int >= 0", "steps between telemetry dumps (0: never)"),
        "telemetry_stats_every": ("an int >= 0", "calls between overflow statistics (0: dump steps only)"),
        "format": (_one_of(FORMAT_SETTINGS), "element format (`hybrid`: E4M3 for A and W, E5M2 for G)"),
        "margin": ("an int >= 0 (FP8 only)", "FP8 target: the format max / 2^margin"),
        "scope": (_one_of(SCOPES), "which linears of each block are quantized"),
        "high_precision_blocks": ("block indices (ints >= 0)", "decoder blocks left unquantized"),
        "emulate_bf16": ("`True` \\| `False`", "BF16 GEMMs run as FP32 GEMMs on BF16 values"),
    }


def config_table() -> str:
    """The markdown table of every :class:`Hif8TrainingConfig` field: default, allowed values, meaning.

    Returns:
        The table.
    """
    rules = _field_rules()
    rows = ["| field | default | allowed | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(Hif8TrainingConfig):
        allowed, meaning = rules[f.name]
        rows.append(f"| `{f.name}` | `{f.default!r}` | {allowed} | {meaning} |")
    return "\n".join(rows)


def convert_to_hif8_training(model: nn.Module, *, config: Hif8TrainingConfig | None = None,
                             module_filter_fn: ModuleFilter | None = None,
                             role_map: Mapping[str, str] | None = None) -> nn.Module:
    """Quantize ``model``'s decoder-block GEMMs (``nn.Linear``, GPT-2's ``Conv1D``, MoE experts per expert)
    for HiF8 (or FP8) training, in place. Logs one line: how many of the blocks' GEMM weights are quantized,
    and why the others are not (:func:`~hif8qat.quant.linear.coverage` lists them). The quantizers are on and
    their state is part of ``model.state_dict()`` from here on.

    Args:
        model: the model.
        config: the settings (default ``Hif8TrainingConfig()``).
        module_filter_fn: ``fn(module, fqn) -> bool``, called for each GEMM module the scope selects outside
            the high-precision blocks (``fqn`` is its name in ``model``); False leaves it alone.
        role_map: ``{name inside a block: "attn" | "mlp" | "none"}`` for a layout whose roles the block's
            structure does not tell (e.g. ``{"mixer": "attn", "channel": "mlp"}``).

    Returns:
        ``model``.
    """
    if config is None:
        config = Hif8TrainingConfig()
    elif not isinstance(config, Hif8TrainingConfig):
        hint = "Hif8TrainingConfig(**your_dict)" if isinstance(config, Mapping) else "Hif8TrainingConfig(...)"
        raise TypeError(f"convert_to_hif8_training: config is a {type(config).__name__}; allowed: a "
                        f"hif8qat.Hif8TrainingConfig (build one with {hint})")
    done = [name for name, _ in quant_modules(model)]
    if done:
        raise ValueError(f"convert_to_hif8_training: {type(model).__name__} is already converted ({len(done)} "
                         f"quantized layers, e.g. {done[0]}); a second conversion would replace the first one's "
                         "settings. Convert a fresh copy of the unquantized model instead")
    _convert_model(model, config.scope, config.high_precision_blocks, config, module_filter_fn=module_filter_fn,
                  emulate_bf16=config.emulate_bf16, role_map=role_map)
    set_state_in_state_dict(model, True)
    log.info("hif8qat: %s (scope=%s)", coverage_summary(coverage(model)), config.scope)
    return model


__all__ = ["Hif8TrainingConfig", "config_table", "convert_to_hif8_training"]
