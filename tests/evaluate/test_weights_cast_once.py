"""An evaluation casts and quantizes each weight once: the same logits bit for bit as at every forward, and a
weight or scale that changes is cast and quantized afresh."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from hif8qat.compute_dtype import Numerics
from hif8qat.evaluate.runner import weights_cast_once
from hif8qat.formats.kernels import count_qdq
from hif8qat.quant.gemm import reusing_frozen_weights
from hif8qat.quant.linear import _convert_model, freeze_scales, scaler_banks, set_step
from hif8qat.scaling.settings import ScalingConfig

ONE_THREAD = True  # conftest._one_thread
BF16 = Numerics("bf16", "cpu")


def _model(quantized: bool, seed: int = 0):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    if quantized:
        _convert_model(m, "attn_mlp", None, ScalingConfig())
        set_step(m, 0)
        with BF16.forward():  # record scales from one training-like forward, then freeze them
            m(torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))).logits.sum().backward()
        m.zero_grad(set_to_none=True)
        freeze_scales(m, True)
    return m


def _forward(m, ids):
    with BF16.forward():
        return m(ids).logits


class _Casts(TorchDispatchMode):
    """Counts FP32 -> BF16 copies of tensors shaped like the model's weights."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in self.shapes \
                and args[0].dtype == torch.float32 and kwargs.get("dtype") == torch.bfloat16:
            self.count += 1
        return func(*args, **kwargs)


def _weight_quantizations(counter, m):
    ptrs = {p.data_ptr() for n, p in m.named_parameters() if n.endswith("proj.weight")}
    return sum(p in ptrs for *_, p in counter.records)


@pytest.mark.parametrize("quantized", [False, True])
def test_the_weights_are_cast_and_quantized_once_with_the_same_logits(quantized):
    m = _model(quantized)
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(1))
    shapes = {tuple(p.shape) for p in m.parameters() if p.dim() == 2}
    with torch.no_grad():
        with _Casts(shapes) as casts, count_qdq() as qdq:
            every = [_forward(m, ids) for _ in range(3)]
        per_forward = (casts.count, _weight_quantizations(qdq, m))
        with weights_cast_once(m), _Casts(shapes) as casts, count_qdq() as qdq:
            once = [_forward(m, ids) for _ in range(3)]
        held = (casts.count, _weight_quantizations(qdq, m))
    assert all(torch.equal(a, b) for a, b in zip(every, once))
    gemms = 14  # 7 per block, and the output layer (lm_head) besides
    if quantized:  # the block GEMMs' weights are quantized (straight to BF16), the output layer's is cast
        assert per_forward == (3, 3 * gemms) and held == (1, gemms)
    else:
        assert per_forward == (3 * (gemms + 1), 0) and held == (gemms + 1, 0)


def test_a_weight_or_scale_changed_inside_is_quantized_afresh():
    m, fresh = _model(True), _model(True)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    layer = m.model.layers[0].mlp.down_proj
    with torch.no_grad(), reusing_frozen_weights(scaler_banks(m)):
        _forward(m, ids)
        layer.weight.mul_(1.5)  # in place: the version counter moves
        fresh.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        assert torch.equal(_forward(m, ids), _forward(fresh, ids))
        layer.weight = torch.nn.Parameter(layer.weight.detach() * 0.5)  # a new tensor
        fresh.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(
            fresh.model.layers[0].mlp.down_proj.weight.detach() * 0.5)
        assert torch.equal(_forward(m, ids), _forward(fresh, ids))
        for model in (m, fresh):  # a new scale for that weight, written in place into the bank's table
            bank, row = scaler_banks(model)[0], model.model.layers[0].mlp.down_proj._rows[1]
            bank.scale[row] *= 4
        out = _forward(m, ids)
        assert torch.equal(out, _forward(fresh, ids))
        with count_qdq() as qdq:
            _forward(m, ids)
        assert _weight_quantizations(qdq, m) == 0  # and unchanged ones are reused again


def test_training_calls_never_reuse():
    m = _model(True)
    freeze_scales(m, False)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with reusing_frozen_weights(scaler_banks(m)), count_qdq() as qdq:
        for step in (1, 2):
            set_step(m, step)
            _forward(m, ids).sum().backward()
        with torch.no_grad():  # an unfrozen bank records its forward-only calls: quantized each time too
            _forward(m, ids)
            _forward(m, ids)
    assert _weight_quantizations(qdq, m) == 4 * 14
