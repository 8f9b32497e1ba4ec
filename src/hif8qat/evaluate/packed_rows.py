"""Packed rows: a multiple-choice context and its continuations in one row of an evaluation forward.

Which models take one (:func:`scoring_of`) and the attention mask that keeps the continuations apart
(:func:`segment_mask`). No lm-eval here: the time estimate asks which way a model's evaluation will run."""

from __future__ import annotations

import torch

#: attention implementations whose transformers code takes a custom 4-D mask as it is
_MASKED_ATTENTION = ("sdpa", "eager")


def scoring_of(model: torch.nn.Module) -> str:
    """How :class:`hif8qat.evaluate.prefix_lm.SharedContextLM` scores ``model``'s shared contexts: ``packed`` for
    transformers' own decoders (their masks are built by ``transformers.masking_utils``, which passes a 4-D mask
    through) with SDPA or eager attention, else ``cached`` (each continuation from a copy of its context's KV cache).

    Args:
        model: the evaluated model.

    Returns:
        ``"packed"`` or ``"cached"``."""
    takes_mask = (type(model).__module__.startswith("transformers.models.")
                  and _attention_implementation(model) in _MASKED_ATTENTION)
    return "packed" if takes_mask else "cached"


def _attention_implementation(model: torch.nn.Module) -> str | None:
    """Adapter: the attention a built model runs. transformers takes it publicly as ``from_pretrained``'s
    ``attn_implementation`` and ``set_attn_implementation``, and reads it back only from the config's private
    ``_attn_implementation``."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def segment_mask(segments: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """The attention mask of packed rows: position q attends to k when k <= q and k is in the context (segment 0)
    or in q's own segment.

    Args:
        segments: ``[batch, width]`` segment of each position: 0 for the context, 1, 2, ... for the continuations,
            and a distinct negative value per padding position (so padding attends to the context and itself only,
            never to nothing, which would give NaN, and no real position attends to it).
        model: the model it is for: eager attention adds the mask to the scores (an additive mask in the model's
            dtype), SDPA takes a boolean one.

    Returns:
        ``[batch, 1, width, width]``: boolean (True: attend), or additive for eager (0 or the dtype's minimum)."""
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril()
    q, k = segments.unsqueeze(2), segments.unsqueeze(1)
    allowed = (causal & ((k == 0) | (k == q))).unsqueeze(1)
    if _attention_implementation(model) == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill(~allowed,
                                                                                             torch.finfo(dtype).min)
    return allowed
