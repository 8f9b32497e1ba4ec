"""Which linears of a model a conversion quantizes: the decoder blocks, the scope's projections, the filter.

Model-agnostic: a model's decoder blocks are found by shape (a ``ModuleList`` whose entries have an MLP or
attention submodule), and a linear belongs to a scope by the names Llama-style models give their projections.
The pipeline's model loader uses the same finder, so a run and a foreign trainer convert the same layers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from torch import nn

SCOPES = ("mlp", "attn_mlp")

# Submodule names that mark a decoder block (Llama, GPT-2, GPT-NeoX, OPT, openPangu name theirs so).
MLP_CONTAINERS = frozenset({"mlp", "feed_forward", "ffn"})
ATTN_CONTAINERS = frozenset({"self_attn", "attention", "attn", "self_attention"})

# Linear layers converted per scope: container segment + leaf name (Llama / SmolLM2 / Qwen / openPangu
# use mlp.{gate,up,down}_proj and self_attn.{q,k,v,o}_proj; a few other common spellings are accepted).
MLP_LEAVES = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2", "w1", "w2", "w3"})
ATTN_LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "out_proj", "query", "key", "value",
                         "query_key_value", "dense"})

# module_filter_fn(module, fqn) -> bool, as torchao's float8 conversion takes it: False leaves the linear alone.
ModuleFilter = Callable[[nn.Module, str], bool]


def find_transformer_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, ModuleList)`` of the decoder layers: the longest ModuleList whose entries all have an MLP or
    attention submodule; for a model without such names, the longest non-empty ModuleList."""
    decoder, largest = None, None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if largest is None or len(mod) > len(largest[1]):
            largest = (name, mod)
        if all(any(hasattr(b, c) for c in MLP_CONTAINERS | ATTN_CONTAINERS) for b in mod):
            if decoder is None or len(mod) > len(decoder[1]):
                decoder = (name, mod)
    found = decoder or largest
    if found is None:
        raise ValueError(f"{type(model).__name__}: no ModuleList of decoder layers (blocks with an 'mlp' or "
                         "'self_attn' submodule) found; is this a Llama-style causal LM?")
    return found


def in_scope(name: str, scope: str) -> bool:
    """Whether the linear at ``name`` (relative to its block) is one the scope quantizes."""
    parts = name.split(".")
    leaf, containers = parts[-1], set(parts[:-1])
    if containers & MLP_CONTAINERS and leaf in MLP_LEAVES:
        return True
    return scope == "attn_mlp" and bool(containers & ATTN_CONTAINERS) and leaf in ATTN_LEAVES


def check_block_indices(indices: Collection[int], num_blocks: int) -> list[int]:
    """Sorted high-precision block indices, each in ``0..num_blocks-1`` (ValueError naming the bad one)."""
    out = set()
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_blocks:
            raise ValueError(f"high_precision_blocks: block index {i!r} out of range 0..{num_blocks - 1} (the model "
                             f"has {num_blocks} blocks)")
        out.add(i)
    return sorted(out)


def select_linears(model: nn.Module, scope: str, high_precision_blocks: Collection[int] = (),
                   module_filter_fn: ModuleFilter | None = None) -> tuple[list[tuple[str, nn.Module, str]], int]:
    """``([(fqn, parent, leaf)], candidates)``: the linears to convert (the scope's, outside the high-precision
    blocks, accepted by ``module_filter_fn``), and how many linears the scope matched before blocks and filter."""
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is invalid; allowed: {SCOPES}")
    prefix, blocks = find_transformer_blocks(model)
    hp = set(check_block_indices(high_precision_blocks, len(blocks)))
    found, candidates = [], 0
    for i, block in enumerate(blocks):
        for name, mod in block.named_modules():
            if not isinstance(mod, nn.Linear) or not in_scope(name, scope):
                continue
            candidates += 1
            fqn = f"{prefix}.{i}.{name}" if prefix else f"{i}.{name}"
            if i in hp or (module_filter_fn is not None and not module_filter_fn(mod, fqn)):
                continue
            parent_name, _, leaf = name.rpartition(".")
            found.append((fqn, block.get_submodule(parent_name) if parent_name else block, leaf))
    if not candidates:
        raise ValueError(f"no nn.Linear matched scope={scope!r} in the {len(blocks)} blocks of {prefix!r} "
                         "(expected names like mlp.gate_proj / self_attn.q_proj)")
    return found, candidates


__all__ = ["ATTN_CONTAINERS", "ATTN_LEAVES", "MLP_CONTAINERS", "MLP_LEAVES", "SCOPES", "ModuleFilter",
           "check_block_indices", "find_transformer_blocks", "in_scope", "select_linears"]
