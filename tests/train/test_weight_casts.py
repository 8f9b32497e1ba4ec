"""Under BF16 autocast over FP32 weights, the trainer casts each weight to BF16 once per optimizer step, not once per
micro-batch, and the steps' losses and gradients stay bit for bit those of casting per micro-batch (the oracle
here: plain torch.autocast around each forward, as a training loop without the step-wide cache runs)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hif8qat.compute_dtype import Numerics
from hif8qat.models.loading import build_tiny_llama, enable_activation_checkpointing
from hif8qat.train import loop

ONE_THREAD = True


def _cfg(activation_checkpointing: bool = False):
    return types.SimpleNamespace(quirks=types.SimpleNamespace(double_label_shift=False),
                                 train=types.SimpleNamespace(activation_checkpointing=activation_checkpointing))


def _model():
    model, _ = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=0)
    return model.float().train()


def _batches(accum: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (2, 17), generator=gen) for _ in range(accum)]


class _WeightCasts(TorchDispatchMode):
    """Counts the dtype casts whose source is one of the given parameters."""

    def __init__(self, params):
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _per_micro_batch_step(model, batches):
    """The step as autocast alone does it: its cache emptied when each micro-batch's forward ends."""
    losses = []
    for tokens in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
        (loss / len(batches)).backward()
        losses.append(loss.detach().float())
    return float(sum(losses) / len(batches))


def test_each_weight_is_cast_once_per_step_not_once_per_micro_batch():
    model = _model()
    matrices = [p for p in model.parameters() if p.ndim == 2 and p is not model.get_input_embeddings().weight]
    accum = 3
    with _WeightCasts(matrices) as casts:
        _per_micro_batch_step(model, _batches(accum))
    assert casts.count == accum * len(matrices)  # the counter sees autocast's casts at all
    model.zero_grad(set_to_none=True)
    with _WeightCasts(matrices) as casts:
        loop._forward_backward(model, iter(_batches(accum)), accum, Numerics("bf16"), _cfg(), loop.DistContext())
    assert casts.count == len(matrices)
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "activation_checkpointing"])
def test_losses_and_weights_are_bit_identical_to_casting_per_micro_batch(recompute):
    cached, uncached = _model(), _model()
    if recompute:  # the trainer then casts per micro-batch again, and its backward recomputes
        for model in (cached, uncached):
            enable_activation_checkpointing(model, Numerics("bf16").checkpoint_kwargs())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cached, uncached)]
    accum = 2
    for step in range(3):
        got = loop._forward_backward(cached, iter(_batches(accum, step)), accum, Numerics("bf16"), _cfg(recompute),
                                     loop.DistContext())
        want = _per_micro_batch_step(uncached, _batches(accum, step))
        assert got == want
        for (name, a), b in zip(cached.named_parameters(), uncached.parameters()):
            assert torch.equal(a.grad, b.grad), name
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b in zip(cached.parameters(), uncached.parameters()):
        assert torch.equal(a, b)
