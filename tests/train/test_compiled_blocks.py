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
    eager, _ = build_tiny_llama(num_layers=4, hidden_size=64, intermediate_size=128)
    _convert_model(eager, "attn_mlp", None, ScalingConfig(algo="max", history_len=4))
    set_quantization(eager, True)
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == 4
    assert set(compiled.state_dict()) == set(eager.state_dict())  # in place: a checkpoint reads the same keys
    ids = torch.randint(3, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        losses[name] = [model(input_ids=ids, labels=ids, use_cache=False).loss for _ in range(1)][0]
        losses[name].backward()
    assert sum(counters["graph_break"].values()) == 0
    # the first block's rows are constants, the second's make them graph inputs, the other blocks reuse that graph
    assert counters["stats"]["unique_graphs"] <= 2
    assert losses["compiled"].item() == pytest.approx(losses["eager"].item(), rel=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
