"""train.compile=true compiles each decoder block on its own: blocks of the same structure share one graph (the
number of graphs does not grow with the depth), no block breaks its graph, and the compiled QAT step gives the
eager step's loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from hif8qat.models.loading import build_tiny_llama
from hif8qat.quant.linear import _convert_model, set_quantization
from hif8qat.scaling.settings import ScalingConfig
from hif8qat.train.compiled_blocks import compile_blocks


@pytest.mark.slow
def test_blocks_share_one_graph_without_breaks_and_the_compiled_qat_step_equals_eager(monkeypatch):
    monkeypatch.setenv("HIF8QAT_COMPILE", "0")  # the quantizer's own kernels eager: only the blocks' graphs count
    torch._dynamo.reset()
    counters.clear()
    base, _ = build_tiny_llama(num_layers=4, hidden_size=64, intermediate_size=128)
    _convert_model(base, "attn_mlp", None, ScalingConfig(algo="max", history_len=4))
    set_quantization(base, True)
    ids = torch.randint(3, 250, (2, 32), generator=torch.Generator().manual_seed(0))

    def step(dtype, compile_them=True):
        """One QAT step of fresh eager and compiled copies of ``base`` (fresh scaler state) in ``dtype``."""
        out = {}
        for name in ("eager", "compiled") if compile_them else ("eager",):
            model = copy.deepcopy(base).to(dtype)
            if name == "compiled":
                assert compile_blocks(model) == 4
                assert set(model.state_dict()) == set(base.state_dict())  # in place: a checkpoint reads the same keys
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            out[name] = loss.item(), [p.grad for p in model.parameters()]
        return out

    float32 = step(torch.float32)
    assert sum(counters["graph_break"].values()) == 0
    # the first block's rows are constants, the second's make them graph inputs, the other blocks reuse that graph
    assert counters["stats"]["unique_graphs"] <= 2
    assert float32["compiled"][0] == pytest.approx(float32["eager"][0], rel=1e-5)
    # Gradients are compared in float64: in float32 the compiled kernels' other summation order moves some
    # gradient by an ulp, across a HiF8 rounding boundary now and then (it did on an AVX2 CPU), and that one
    # flipped code then spreads through every block below. In float64 the order's effect stays far below
    # float32's resolution, where the quantizer rounds (the scaler bank's eager HiF8 path reads float64 as float32
    # and writes float64).
    float64 = step(torch.float64)
    names = [name for name, _ in base.named_parameters()]
    for name, a, b in zip(names, float64["eager"][1], float64["compiled"][1]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
    # ...and the comparison can fail: quantization off changes every gradient by far more than the tolerance
    set_quantization(base, False)
    plain = step(torch.float64, compile_them=False)["eager"][1]
    assert all(not torch.allclose(p, q, rtol=1e-3, atol=1e-6) for p, q in zip(plain, float64["eager"][1]))
