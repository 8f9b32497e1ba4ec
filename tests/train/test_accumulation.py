"""Gradient accumulation: a step of several micro-batches yields the gradient of their mean loss, computed here
with plain torch (the model's logits and F.cross_entropy) as the oracle, so a loss not divided by the number
of micro-batches, or one micro-batch counted twice, is seen on one process (DDP and FSDP would share the error)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from hif8qat.compute_dtype import Numerics
from hif8qat.models.loading import build_tiny_llama
from hif8qat.train import loop

ONE_THREAD = True


def _model(seed: int = 0):
    model, _ = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=seed)
    return model.float().train()


def _oracle_grads(model, micro_batches):
    model.zero_grad(set_to_none=True)
    losses = []
    for tokens in micro_batches:
        logits = model(input_ids=tokens[:, :-1]).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()))
    torch.stack(losses).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, float(torch.stack(losses).mean().detach())


@pytest.mark.parametrize("accum", [2, 3])
def test_accumulated_micro_batches_give_the_gradient_of_their_mean_loss(accum):
    gen = torch.Generator().manual_seed(accum)
    batches = [torch.randint(3, 250, (2, 17), generator=gen) for _ in range(accum)]
    model = _model()
    want, want_loss = _oracle_grads(model, batches)
    model.zero_grad(set_to_none=True)
    cfg = types.SimpleNamespace(quirks=types.SimpleNamespace(double_label_shift=False),
                                train=types.SimpleNamespace(activation_checkpointing=False))
    got_loss = loop._forward_backward(model, iter(batches), accum, Numerics("none"), cfg, loop.DistContext())
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], rtol=1e-5, atol=1e-7, msg=name)
