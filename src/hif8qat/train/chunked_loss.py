"""Next-token loss without the micro-batch's whole logits.

At the paper's shape (16 x 1024 tokens, vocabulary 153,376) the logits are 5 GB in BF16, and their FP32 copy, its
log-softmax and its gradient 10 GB each. :class:`LossHead` is the model's ``lm_head`` (same parameters, same
names, so checkpoints and exports do not change) that, when :func:`lm_loss` hands it the targets for one forward,
returns the mean cross entropy instead of logits: it runs the head and the loss over ``chunk_rows`` tokens at a
time and recomputes each chunk's logits in backward, so one chunk's logits are alive at a time. The loss comes out
of the model's own forward, so DDP and FSDP see an ordinary forward. A micro-batch whose logits fit in
:data:`CHUNK_ELEMENTS` takes the plain path (the small profiles' numbers stay bit for bit those of before).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hif8qat import compute_dtype as numerics

#: Logit elements per chunk: 2^28 is 0.5 GB in BF16 and 1 GB in FP32 (about 1,750 tokens of openPangu's vocabulary).
CHUNK_ELEMENTS = 1 << 28
IGNORE = -100


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab``.

    Args:
        vocab: the vocabulary size.

    Returns:
        The chunk's token count.
    """
    return max(1, CHUNK_ELEMENTS // vocab)


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor, rows: int, emulate_bf16: bool = False) -> torch.Tensor:
    """Mean cross entropy of ``F.linear(hidden, weight, bias)`` (upcast to FP32) against ``targets``, ``rows``
    tokens at a time.

    Args:
        hidden: the last hidden states.
        weight: the output layer's weight.
        bias: its bias, or None.
        targets: the target ids (``IGNORE`` positions left out).
        rows: tokens per chunk.
        emulate_bf16: the forward runs under the BF16 emulation (the run's numerics), which each chunk's
            recompute must enter again.

    Returns:
        The 0-d loss.
    """
    h = hidden.reshape(-1, hidden.size(-1))
    t = targets.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    # non-reentrant checkpoint: torch restores autocast for the recompute, and the kwargs re-enter the BF16
    # emulation when this forward runs under it
    kwargs = numerics.checkpoint_kwargs("bf16_emulated" if emulate_bf16 else "none", h.device.type)
    for start in range(0, h.size(0), rows):
        part = (h[start:start + rows], weight, bias, t[start:start + rows])
        total = total + (checkpoint(_chunk_loss_sum, *part, **kwargs) if torch.is_grad_enabled()
                         else _chunk_loss_sum(*part))
    return total / (t != IGNORE).sum().clamp(min=1)


class LossHead(nn.Linear):
    """An ``nn.Linear`` lm_head that returns the loss for one forward when given targets (see module doc)."""

    pending_targets: torch.Tensor | None = None
    emulate_bf16 = False  # the run's numerics are bf16_emulated (set by install_loss_head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The loss when targets are pending (set by the caller for this one forward), else the whole logits.

        Args:
            hidden: the last hidden states.

        Returns:
            The loss, or the logits.
        """
        targets, self.pending_targets = self.pending_targets, None
        if targets is None:
            return super().forward(hidden)
        return chunked_cross_entropy(hidden, self.weight, self.bias, targets, chunk_rows(self.out_features),
                                     self.emulate_bf16)


def install_loss_head(model: nn.Module, emulate_bf16: bool = False) -> LossHead | None:
    """Make the model's output layer a :class:`LossHead` in place (its parameters and names are untouched);
    None for a model whose head is not a plain ``nn.Linear`` (it keeps computing whole logits).
    ``emulate_bf16``: the forwards run under BF16 emulation (``compute_dtype``'s ``bf16_emulated``).

    Args:
        model: a causal LM.
        emulate_bf16: the forwards run under BF16 emulation (``compute_dtype``'s ``bf16_emulated``).

    Returns:
        The head, or None.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, LossHead):
        if type(head) is not nn.Linear:
            return None
        head.__class__ = LossHead
    head.emulate_bf16 = bool(emulate_bf16)
    return head


def loss_head(model: nn.Module) -> LossHead | None:
    """The LossHead inside ``model`` (also through DDP, FSDP or torch.compile wrappers), or None.

    Args:
        model: the model, possibly wrapped.

    Returns:
        The head, or None.
    """
    return next((m for m in model.modules() if isinstance(m, LossHead)), None)


def lm_loss(model: nn.Module, tokens: torch.Tensor, *, double_label_shift: bool = False) -> torch.Tensor:
    """Next-token cross entropy on packed windows of seq_len + 1 tokens.

    double_label_shift reproduces the authors' bug: labels shifted once by them and again by the HF loss, so
    position t is trained on token t + 2 (the last position has no target).

    use_cache=False: a causal LM builds a key/value cache in training too unless told; under transformers 5.17 it
    holds a copy of every block's keys and values until the forward ends (1.2 GiB more per GPU at the paper's
    micro-batch than under 5.24, which keeps the tensors themselves).

    Args:
        model: the causal LM (possibly wrapped).
        tokens: ``[batch, seq_len + 1]`` packed windows.
        double_label_shift: reproduce the authors' label bug.

    Returns:
        The 0-d mean loss.
    """
    inputs = tokens[:, :-1]
    head = loss_head(model)
    if head is not None and inputs.numel() * head.out_features > CHUNK_ELEMENTS:
        targets = tokens[:, 1:]
        if double_label_shift:
            targets = torch.cat((tokens[:, 2:], torch.full_like(tokens[:, :1], IGNORE)), dim=1)
        head.pending_targets = targets
        try:
            return model(input_ids=inputs, use_cache=False).logits
        finally:
            head.pending_targets = None
    logits = model(input_ids=inputs, use_cache=False).logits
    if double_label_shift:
        logits, targets = logits[:, :-1], tokens[:, 2:]
    else:
        targets = tokens[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
