"""MoE experts quantized per expert: transformers 5 keeps a layer's experts as 3-D parameters, ``gate_up_proj``
``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` (Mixtral, Qwen3-MoE, DeepSeek-V3 ...). Each expert's slice of each
is a GEMM site of its own, with its own A, W and G scalers (the tokens routed to one expert have their own range),
so a layer with E experts has 2E sites. The router is not here: it stays in high precision.

The forward is the experts' eager loop (tokens grouped by expert, ``act(gate) * up``, weighted by the router's
scores), with each GEMM quantized; with quantization off it is that loop with plain GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hif8qat.quant.gemm import QuantState
from hif8qat.scaling.settings import ScalingConfig

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def check_experts_layout(experts: nn.Module, name: str) -> None:
    """ValueError unless ``experts`` has the layout this module computes: concatenated gate/up, not transposed,
    no biases, the default ``act(gate) * up``, no norm after an expert.

    Args:
        experts: an MoE layer's experts module.
        name: its name (for the error).

    Raises:
        ValueError: another layout.
    """
    own = {n: p for n, p in experts.named_parameters(recurse=False)}
    why = None
    if tuple(own) != EXPERT_PARAMS or any(p.dim() != 3 for p in own.values()):
        why = f"parameters {sorted(own)} (expected 3-D {list(EXPERT_PARAMS)} and nothing else)"
    elif (getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True)
          or not getattr(experts, "has_gate", True) or getattr(experts, "has_bias", False)
          or getattr(experts, "has_post_expert_norm", False)):
        why = "a transposed, interleaved, gateless, biased or post-normed layout"
    elif not _gates_by_default(experts):
        why = "its own gating function"
    elif not hasattr(experts, "act_fn"):
        why = "no act_fn"
    else:
        e, two_i, h = own["gate_up_proj"].shape
        if two_i % 2 or tuple(own["down_proj"].shape) != (e, h, two_i // 2):
            why = f"shapes {tuple(own['gate_up_proj'].shape)} / {tuple(own['down_proj'].shape)}"
    if why is not None:
        raise ValueError(f"{name}: an experts module with {why} has no per-expert quantization here; leave it out "
                         "with module_filter_fn or role_map={'<its name in the block>': 'none'}")


def _gates_by_default(experts: nn.Module) -> bool:
    """Whether a transformers experts module gates with its default ``act(gate) * up``.

    Adapter: transformers keeps the gate function in the private ``_apply_gate``; a model that brings its own
    names it otherwise."""
    return getattr(getattr(experts, "_apply_gate", None), "__name__", "_default_apply_gate") == "_default_apply_gate"


class QuantExperts(QuantState, nn.Module):
    """A layer's MoE experts with each expert's ``gate_up_proj`` and ``down_proj`` GEMMs quantized on their own
    scalers (sites ``gate_up_proj.{e}``, then ``down_proj.{e}``). The 3-D parameters are the original module's
    objects under the same names, so ``state_dict`` keys and checkpoints stay the model's."""

    hif8_kind = "experts"

    def __init__(self, experts: nn.Module, config: ScalingConfig | None = None, name: str = "",
                 enabled: bool = True, *, emulate_bf16: bool = False, own_bank: bool = True):
        check_experts_layout(experts, name or type(experts).__name__)
        nn.Module.__init__(self)
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.act_fn = experts.act_fn
        self.num_experts = experts.gate_up_proj.shape[0]
        self._init_quant(config, name, enabled, emulate_bf16)
        if own_bank:  # a conversion builds one bank for all its modules instead
            self._own_bank(self.gate_up_proj.device)
        self.train(experts.training)

    def site_names(self) -> list[str]:
        """The names of the quantization sites, one per expert and parameter (``gate_up_proj.3``).

        Returns:
            The names.
        """
        return [f"{p}.{e}" for p in EXPERT_PARAMS for e in range(self.gate_up_proj.shape[0])]

    def _gemm(self, x: torch.Tensor, param: int, expert: int) -> torch.Tensor:
        weight = (self.gate_up_proj, self.down_proj)[param][expert]
        if not self.quant_enabled:
            return F.linear(x, weight)
        return self._quant_gemm(x, weight, None, site=param * self.num_experts + expert)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Route each token to its top-k experts, each expert's two GEMMs quantized, and sum the weighted
        outputs.

        Args:
            hidden_states: ``[tokens, hidden]``.
            top_k_index: ``[tokens, k]`` expert indices (-1: padding).
            top_k_weights: ``[tokens, k]`` routing weights.

        Returns:
            ``[tokens, hidden]``.
        """
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [expert, top-k slot, token]; the extra class catches padded (-1 -> E) routes
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        for e in hit:
            if e == self.num_experts:
                continue
            slot, token = torch.where(mask[e])
            gate, up = self._gemm(hidden_states[token], 0, e).chunk(2, dim=-1)
            h = self._gemm(self.act_fn(gate) * up, 1, e)
            out.index_add_(0, token, (h * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        """The expert count, whether quantization is on and the format, for ``repr``.

        Returns:
            The text.
        """
        return f"experts={self.num_experts}, quant={'on' if self.quant_enabled else 'off'}, format={self.config.format}"


__all__ = ["EXPERT_PARAMS", "QuantExperts", "check_experts_layout"]
