"""Which GEMM weights of a model a conversion quantizes, and why each other one is left out.

Model-agnostic: a model's decoder blocks are found by shape (a ``ModuleList`` whose entries have an attention
or feed-forward submodule). Inside a block, a weight that a GEMM uses is an ``nn.Linear``, a GPT-2 style
``Conv1D`` or one expert's slice of a 3-D expert parameter, and its role (attention, MLP, router) is decided
by where it sits, not by its name (:func:`block_gemms` lists the rules). A weight whose role cannot be decided
is an error, never a silent skip. The pipeline's model loader uses the same block finder, so a run and a
foreign trainer convert the same layers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from torch import nn

SCOPES = ("mlp", "attn_mlp")
# The scope when none is given, for the library and the pipeline alike: the feed-forward GEMMs, as the paper's
# max-estimator runs quantize them (the estimator and history defaults are that recipe's too).
DEFAULT_SCOPE = "mlp"
ROLE_MAP_VALUES = ("attn", "mlp", "none")

# Submodule names that mark a decoder block's parts (Llama, GPT-2, GPT-NeoX, Falcon, OPT, Mixtral, openPangu ...).
MLP_CONTAINERS = frozenset({"mlp", "feed_forward", "ffn", "block_sparse_moe", "moe"})
ATTN_CONTAINERS = frozenset({"self_attn", "attention", "attn", "self_attention", "crossattention", "cross_attn"})
# ...and class-name fragments that mark them when the attribute name is unfamiliar
ATTN_CLASS_MARKS = ("Attention",)
MLP_CLASS_MARKS = ("MLP", "MoE", "Moe", "FeedForward", "Experts")
# An MoE's routing gates: kept in high precision (their logits pick the experts)
ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})

# Reasons a GEMM weight is not quantized (coverage values besides QUANTIZED)
QUANTIZED = "quantized"
SCOPE = "scope"
HIGH_PRECISION_BLOCK = "high_precision_blocks"
FILTERED = "module_filter_fn"
ROUTER = "router (high precision by design)"
MAPPED_OUT = "role_map: none"
NOT_CONVERTED = "not converted"
QUANT_OFF = "quantization switched off"

# module_filter_fn(module, fqn) -> bool, as torchao's float8 conversion takes it: False leaves the module alone.
ModuleFilter = Callable[[nn.Module, str], bool]


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (transformers.pytorch_utils), known by shape: a ``[nx, nf]`` weight, ``y = x W + b``.

    Args:
        module: a module.

    Returns:
        True for a ``Conv1D``.
    """
    w = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(w, nn.Parameter) and w.dim() == 2
            and tuple(w.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def expert_params(module: nn.Module) -> list[str]:
    """Names of the module's own 3-D parameters (each one GEMM weight per expert), in registration order.

    Args:
        module: a module.

    Returns:
        The names.
    """
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]


def _is_router(name: str, module: nn.Module, block: nn.Module) -> bool:
    """An MoE's routing gate: a 2-D weight named like one (or a ``*Router`` class) beside the experts."""
    parent, _, leaf = name.rpartition(".")
    w = getattr(module, "weight", None)
    if not (name and (leaf in ROUTER_NAMES or type(module).__name__.endswith("Router"))
            and isinstance(w, nn.Parameter) and w.dim() == 2):
        return False
    siblings = block.get_submodule(parent).named_children()
    return any(n == "experts" or expert_params(m) for n, m in siblings)


@dataclass
class GemmModule:
    """One module of a block that holds GEMM weights: ``sites`` are the weights' names in the model (one for a
    linear or Conv1D, ``{fqn}.{param}.{expert}`` per expert for a 3-D expert module)."""

    fqn: str
    block: int
    rel: str  # name inside its block
    module: nn.Module
    kind: str  # linear | conv1d | experts | router
    role: str | None  # attn | mlp | router | none (role_map); None: undecidable
    sites: list[str]


def find_transformer_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, ModuleList)`` of the decoder layers: the longest ModuleList whose entries all have an MLP or
    attention submodule; for a model without such names, the longest non-empty ModuleList.

    Args:
        model: the model.

    Returns:
        ``(name, ModuleList)``.

    Raises:
        ValueError: the model has no ModuleList.
    """
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
        raise ValueError(f"{type(model).__name__}: no ModuleList of decoder layers (blocks with an attention "
                         f"submodule, one of {sorted(ATTN_CONTAINERS)}, or a feed-forward one, one of "
                         f"{sorted(MLP_CONTAINERS)}) found; is this a decoder-only causal LM?")
    return found


def _parts(block: nn.Module) -> tuple[set[str], set[str]]:
    """Names of the block's attention children and feed-forward children."""
    attn, mlp = set(), set()
    for name, child in block.named_children():
        cls = type(child).__name__
        if name in ATTN_CONTAINERS or any(m in cls for m in ATTN_CLASS_MARKS):
            attn.add(name)
        elif name in MLP_CONTAINERS or any(m in cls for m in MLP_CLASS_MARKS):
            mlp.add(name)
    return attn, mlp


def _mapped(rel: str, role_map: Mapping[str, str]) -> str | None:
    """The role the longest ``role_map`` key that is ``rel`` or a module above it gives, if any."""
    keys = [k for k in role_map if rel == k or rel.startswith(k + ".")]
    return role_map[max(keys, key=len)] if keys else None


def _gemm_kind(name: str, module: nn.Module, block: nn.Module) -> str | None:
    if _is_router(name, module, block):
        return "router"
    if isinstance(module, nn.Linear):
        return "linear"
    if is_conv1d(module) or getattr(module, "hif8_kind", None) == "conv1d":
        return "conv1d"
    if expert_params(module):
        return "experts"
    return None


def block_gemms(model: nn.Module, role_map: Mapping[str, str] | None = None) -> tuple[str, int, list[GemmModule]]:
    """``(blocks' name, number of blocks, [GemmModule])`` in module order, each with its role by structure.

    Roles: attention, inside the block's attention submodule (``self_attn``, ``attention``, ``attn``, ... or a
    class named ``*Attention*``); MLP, inside the feed-forward or MoE submodule (``mlp``, ``ffn``,
    ``feed_forward``, ... or a class named ``*MLP*`` / ``*MoE*`` / ``*FeedForward*``), or directly in the
    block beside its attention (OPT's ``fc1``/``fc2``); router, an MoE's routing gate, kept in high precision
    by design. A GPT-2 ``Conv1D`` stores its weight ``[in, out]``; a 3-D expert parameter (transformers 5 MoE
    layers) is one GEMM weight per expert.

    Args:
        model: the model.
        role_map: block-relative name -> ``attn`` / ``mlp`` / ``none``, for weights whose role cannot be
            decided.

    Returns:
        ``(blocks' name, number of blocks, GEMM modules)``.

    Raises:
        ValueError: a weight whose role cannot be decided and that ``role_map`` does not name.
    """
    role_map = dict(role_map or {})
    bad = {k: v for k, v in role_map.items() if v not in ROLE_MAP_VALUES}
    if bad:
        raise ValueError(f"role_map={bad!r} is invalid; each value must be one of {ROLE_MAP_VALUES}")
    prefix, blocks = find_transformer_blocks(model)
    out, used = [], set()
    for i, block in enumerate(blocks):
        attn, mlp = _parts(block)
        for rel, mod in block.named_modules():
            if rel in role_map:
                used.add(rel)
            kind = _gemm_kind(rel, mod, block)
            if kind is None:
                continue
            fqn = ".".join(p for p in (prefix, str(i), rel) if p)
            head = rel.split(".")[0]
            role = _mapped(rel, role_map)
            if role is None:
                if kind == "router":
                    role = "router"
                elif head in attn:
                    role = "attn"
                elif head in mlp or (rel and "." not in rel and attn):
                    role = "mlp"  # directly in the block beside its attention: OPT's fc1/fc2
            sites = ([f"{fqn}.{p}.{e}" for p in expert_params(mod) for e in range(getattr(mod, p).shape[0])]
                     if kind == "experts" else [fqn])
            out.append(GemmModule(fqn, i, rel, mod, kind, role, sites))
    unknown = sorted(set(role_map) - used)
    if unknown:
        raise ValueError(f"role_map names {unknown}, which no decoder block of {prefix!r} has (keys are names "
                         "inside a block, e.g. 'self_attn' or 'mlp.fc1')")
    return prefix, len(blocks), out


def check_block_indices(indices: Collection[int], num_blocks: int) -> list[int]:
    """Sorted high-precision block indices, each in ``0..num_blocks-1`` (ValueError naming the bad one).

    Args:
        indices: the high-precision block indices.
        num_blocks: the model's number of blocks.

    Returns:
        The indices, sorted.

    Raises:
        ValueError: an index out of range.
    """
    out = set()
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_blocks:
            raise ValueError(f"high_precision_blocks: block index {i!r} out of range 0..{num_blocks - 1} (the model "
                             f"has {num_blocks} blocks)")
        out.add(i)
    return sorted(out)


@dataclass
class Selection:
    """What a conversion takes: ``chosen`` modules (module order) and, for every GEMM weight of the blocks,
    ``coverage[site]``: :data:`QUANTIZED` or the reason it is left out."""

    chosen: list[GemmModule]
    coverage: dict[str, str]


def select_gemms(model: nn.Module, scope: str, high_precision_blocks: Collection[int] = (),
                 module_filter_fn: ModuleFilter | None = None,
                 role_map: Mapping[str, str] | None = None) -> Selection:
    """The GEMM modules to convert: the scope's, outside the high-precision blocks, accepted by
    ``module_filter_fn(module, fqn)``; routers and ``role_map`` ``none`` entries stay in high precision.

    Args:
        model: the model.
        scope: "mlp" or "attn_mlp".
        high_precision_blocks: block indices kept in high precision.
        module_filter_fn: ``fn(module, fqn) -> bool``, False leaves a GEMM out.
        role_map: as in :func:`block_gemms`.

    Returns:
        The selection: the GEMMs to convert and, for every GEMM weight, why it is or is not converted.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is invalid; allowed: {SCOPES}")
    prefix, n_blocks, gemms = block_gemms(model, role_map)
    hp = set(check_block_indices(high_precision_blocks, n_blocks))
    chosen, coverage, undecided = [], {}, []
    for g in gemms:
        if g.role == "router":
            reason = ROUTER
        elif g.role == "none":
            reason = MAPPED_OUT
        elif g.role is None:
            if module_filter_fn is None or module_filter_fn(g.module, g.fqn):
                undecided.append(g.fqn)
                continue
            reason = FILTERED
        elif g.role == "attn" and scope == "mlp":
            reason = SCOPE
        elif g.block in hp:
            reason = HIGH_PRECISION_BLOCK
        elif module_filter_fn is not None and not module_filter_fn(g.module, g.fqn):
            reason = FILTERED
        else:
            reason = QUANTIZED
            chosen.append(g)
        coverage.update(dict.fromkeys(g.sites, reason))
    if undecided:
        shown = ", ".join(undecided[:8]) + (f" ... ({len(undecided)} in all)" if len(undecided) > 8 else "")
        raise ValueError(f"cannot tell whether these GEMM weights belong to attention or the MLP: {shown}; map them "
                         f"with role_map={{name inside the block: one of {ROLE_MAP_VALUES}}} or leave them out with "
                         "module_filter_fn")
    if not gemms:
        raise ValueError(f"no GEMM weight (nn.Linear, Conv1D or 3-D expert parameter) in the {n_blocks} blocks of "
                         f"{prefix!r}")
    if not chosen and FILTERED in coverage.values():
        raise ValueError(f"module_filter_fn left out every GEMM module that scope={scope!r} selects outside the "
                         "high-precision blocks: nothing to quantize")
    return Selection(chosen, coverage)


def coverage_summary(coverage: Mapping[str, str]) -> str:
    """``N of M GEMM weights quantized`` and the count for each reason the others are left out.

    Args:
        coverage: GEMM weight name -> reason.

    Returns:
        The summary line.
    """
    counts = Counter(coverage.values())
    n = counts.pop(QUANTIZED, 0)
    rest = "; left out: " + ", ".join(f"{reason} {c}" for reason, c in sorted(counts.items())) if counts else ""
    return f"{n} of {len(coverage)} GEMM weights in the decoder blocks quantized{rest}"


__all__ = ["ATTN_CONTAINERS", "DEFAULT_SCOPE", "FILTERED", "HIGH_PRECISION_BLOCK", "MAPPED_OUT", "MLP_CONTAINERS",
           "NOT_CONVERTED", "QUANTIZED", "QUANT_OFF", "ROLE_MAP_VALUES", "ROUTER", "SCOPE", "SCOPES", "GemmModule",
           "ModuleFilter", "Selection", "block_gemms", "check_block_indices", "coverage_summary", "expert_params",
           "find_transformer_blocks", "is_conv1d", "select_gemms"]
