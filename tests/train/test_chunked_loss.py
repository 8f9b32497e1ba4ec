"""The training loss in chunks: the same loss and gradients as over the whole logits, and no tensor of the
micro-batch's whole logits is ever made."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hif8qat.models.loading import build_tiny_llama
from hif8qat.train import chunked_loss
from hif8qat.train.chunked_loss import IGNORE, chunked_cross_entropy, install_loss_head
from hif8qat.train.loop import lm_loss


def _oracle(hidden, weight, bias, targets):
    """Mean negative log-likelihood from the definition: logsumexp of the row minus the target's logit."""
    logits = (hidden.double() @ weight.double().T + bias.double()).reshape(-1, weight.shape[0])
    t = targets.reshape(-1)
    keep = t != IGNORE
    nll = torch.logsumexp(logits, dim=1) - logits.gather(1, t.clamp(min=0).view(-1, 1)).view(-1)
    return nll[keep].sum() / keep.sum()


@pytest.mark.parametrize("rows", [1, 7, 16, 1000])
def test_chunked_cross_entropy_matches_the_definition_with_its_gradients(rows):
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(3, 16, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 16), generator=g)
    targets[1, -1] = targets[2, 3] = IGNORE
    got = chunked_cross_entropy(hidden, weight, bias, targets, rows)
    grads = torch.autograd.grad(got, (hidden, weight, bias))
    want = _oracle(hidden, weight, bias, targets)
    want_grads = torch.autograd.grad(want, (hidden, weight, bias))
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-6)


class _LargestLogits(TorchDispatchMode):
    """The most elements of any float tensor an op returns with one entry per vocabulary word (logits, their
    FP32 copy, log-softmax, gradients)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("double_shift", [False, True])
def test_a_large_micro_batch_never_makes_its_whole_logits_and_keeps_loss_and_gradients(monkeypatch, double_shift):
    model, _ = build_tiny_llama(num_layers=2)
    tokens = torch.randint(3, 259, (2, 129), generator=torch.Generator().manual_seed(1))
    whole = tokens[:, :-1].numel() * model.config.vocab_size
    model.train()
    plain = lm_loss(model, tokens, double_label_shift=double_shift)  # logits fit: the whole-logits path
    plain_grads = torch.autograd.grad(plain, list(model.parameters()))

    install_loss_head(model)  # as the trainer does; these logits are now "large"
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 10 * model.config.vocab_size)
    with _LargestLogits(model.config.vocab_size) as seen:
        chunked = lm_loss(model, tokens, double_label_shift=double_shift)
        grads = torch.autograd.grad(chunked, list(model.parameters()))
    weight = model.lm_head.weight.numel()  # its transpose is vocabulary-wide too
    assert seen.largest <= max(10 * model.config.vocab_size, weight) < whole  # a chunk's logits at most
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-5)
    for a, b in zip(grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert "lm_head.weight" in model.state_dict()  # checkpoints and exports keep their names
