"""hif8qat: HiF8 W8A8 quantization-aware training with delayed tensor scaling.

The library, for any trainer (imports torch and numpy only)::

    from hif8qat import Hif8TrainingConfig, convert_to_hif8_training, set_step
    convert_to_hif8_training(model, config=Hif8TrainingConfig(algo="most_recent", history_len=30))
    ...                                       # train: set_step(model, step) before each optimizer step
    export_8bit(model, "out/", tokenizer=tok)  # the deployable 8-bit export; load_8bit_export reads it back

``hif8qat.integrations.hf.StepCallback`` calls ``set_step`` for ``transformers.Trainer``.

The quantizer functions themselves are in :mod:`hif8qat.formats` (``hif8_qdq``, ``fp8_qdq``, ...). The rest of
the package (``config``, ``runs``, ``models``, ``data``, ``train``, ``evaluate``, ``report``, ``launch``) is the
experiment pipeline built on this API.
"""

from hif8qat.quant.export import export_8bit, load_8bit_export
from hif8qat.quant.linear import (
    QuantLinear,
    coverage,
    freeze_scales,
    load_quant_state_dict,
    quant_state_dict,
    set_bf16_emulation,
    set_quantization,
    set_step,
    set_weight_recompute,
    step_telemetry,
    update_scales,
)
from hif8qat.quant.training import Hif8TrainingConfig, convert_to_hif8_training
from hif8qat.scaling.settings import ScalingConfig

__version__ = "0.1.0"

__all__ = [
    "Hif8TrainingConfig", "QuantLinear", "ScalingConfig", "convert_to_hif8_training", "coverage", "export_8bit",
    "freeze_scales", "load_8bit_export", "load_quant_state_dict", "quant_state_dict", "set_bf16_emulation",
    "set_quantization", "set_step",
    "set_weight_recompute", "step_telemetry", "update_scales",
]
