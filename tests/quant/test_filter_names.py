"""module_filter_fn receives each linear's full dotted name, as model.named_modules() spells it (torchao's
convention), not a name relative to its block that a suffix test would accept just the same."""

from __future__ import annotations

from torch import nn

from hif8qat.models.loading import build_tiny_llama
from hif8qat.quant.blocks import select_gemms
from hif8qat.quant.linear import QuantLinear, _convert_model
from hif8qat.scaling.settings import ScalingConfig

ONE_THREAD = True


def test_the_filter_sees_the_full_names_of_the_linears_in_scope():
    model, _ = build_tiny_llama(num_layers=3, hidden_size=32, intermediate_size=64)
    full = {name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and ".mlp." in name}
    seen = []
    select_gemms(model, "mlp", [0], lambda mod, fqn: seen.append((fqn, mod)) or True)
    # block 0 is high precision: the filter is asked about the others, by the names named_modules gives
    assert sorted(f for f, _ in seen) == sorted(n for n in full if not n.startswith("model.layers.0."))
    assert all(dict(model.named_modules())[fqn] is mod for fqn, mod in seen)


def test_a_filter_on_one_full_name_leaves_exactly_that_linear():
    model, _ = build_tiny_llama(num_layers=3, hidden_size=32, intermediate_size=64)
    _convert_model(model, "mlp", None, ScalingConfig(),
                   module_filter_fn=lambda mod, fqn: fqn != "model.layers.1.mlp.up_proj")
    quantized = {name for name, mod in model.named_modules() if isinstance(mod, QuantLinear)}
    assert "model.layers.1.mlp.up_proj" not in quantized
    assert {"model.layers.0.mlp.up_proj", "model.layers.2.mlp.up_proj", "model.layers.1.mlp.gate_proj"} <= quantized
    assert len(quantized) == 3 * 3 - 1
