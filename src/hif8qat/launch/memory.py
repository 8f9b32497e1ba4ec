"""The memory one training step needs, by simulating the step: no hand formula.

:func:`step_memory` builds the run's model from its ``config.json`` (no weights) under torch's ``FakeTensorMode``,
prepares it and runs one step of it as the trainer does while torch's own ``MemTracker`` follows every tensor
storage that is alive (:func:`simulate_step`), then adds what a one-process fake step cannot see (DDP's
gradient buckets, FSDP's sharding). Fake tensors have shapes and no data, so a 1B model's step at the paper's
batch takes seconds and no memory. The peak is what the step's tensors occupy at the worst moment, by kind,
which is what ``torch.cuda.max_memory_allocated`` counts on a GPU; what no tensor count sees (the CUDA context,
cuBLAS/attention workspaces, the allocator's fragmentation) needs the headroom.

``python run.py --estimate --profile paper --experiments exp8 --world-size 8 --device cuda`` prints the figure
(`make expN` prints it for the run it starts)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import masking_utils

from hif8qat.compute_dtype import Numerics
from hif8qat.config.run_config import RunConfig
from hif8qat.models.loading import PANGU_MODEL_TYPES, transformer_blocks
from hif8qat.models.pangu import pangu_llama_config
from hif8qat.quant.gemm import keep_weights_under_fake_tensors
from hif8qat.quant.linear import set_quantization
from hif8qat.runs.downloads import cache_root
from hif8qat.train.chunked_loss import lm_loss
from hif8qat.train.loop import build_optimizer, prepare_model

GIB = 2 ** 30

#: The parts of the estimate, in the order they are printed.
PARTS = ("weights", "gradients", "AdamW state", "activations", "backward temporaries", "DDP gradient buckets")


def model_config(facts: dict):
    """The transformers config a run's model is built from: its config.json as read by ``model_config_facts``
    (openPangu's mapped to Llama, as ``load_causal_lm`` loads it).

    Args:
        facts: the model's config.json as :func:`hif8qat.models.loading.model_config_facts` reads it.

    Returns:
        The config."""
    from transformers import AutoConfig, LlamaConfig

    facts = dict(facts)
    attn = facts.pop("attn_implementation", None) or "sdpa"  # from_pretrained's default where torch has SDPA
    model_type = facts.get("model_type")
    if model_type in PANGU_MODEL_TYPES:
        config = pangu_llama_config(facts)
    elif model_type:
        config = AutoConfig.for_model(**facts)
    else:  # the tiny model's facts: a Llama config's own keys
        config = LlamaConfig(**facts)
    _set_attention_implementation(config, attn)
    return config


def _set_attention_implementation(config, attn: str) -> None:
    """Adapter: which attention a config's model is built with. transformers takes it as ``from_pretrained``'s
    ``attn_implementation``; on a config already made (here from a config.json's facts, by three constructors)
    its one setter is the private ``_attn_implementation``."""
    config._attn_implementation = attn


@contextlib.contextmanager
def _one_sequence_per_row() -> Iterator[None]:
    """transformers decides whether a batch packs several sequences per row by reading its position ids, which
    fake tensors do not have: it then takes every batch as packed and builds a full (batch, 1, seq, seq) mask,
    which also turns off SDPA's grouped-query path (keys and values repeated to every head). The trainer's
    windows hold one sequence per row (positions 0..n-1), where the real check finds no packing and attention
    runs causal without a mask: told so here (measured: 2.0 GiB more per GPU at the paper's batch otherwise)."""
    old = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda *args, **kwargs: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = old


def _unique_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in model.parameters() if p.requires_grad}.values())


def _fake_tensor_mode():
    """Adapter: torch's ``FakeTensorMode`` (tensors with shapes and no data), which torch exports only from the
    private ``torch._subclasses``. ``allow_non_fake_inputs``: the scaler banks build their tables from numpy
    arrays."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _peak_tracker():
    """Adapter: torch's ``MemTracker`` (the private ``torch.distributed._tools``), the one tool that counts every
    live tensor storage by kind, keeping the whole step's peak only (its per-module peaks walk every module at
    every op, 80 % of a 1B model's simulation, and nothing here reads them). Its kinds and its peak bookkeeping
    are private names too: all of them stay in here."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class PeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

        def peak_parts(self) -> dict[str, int]:
            """The bytes alive at the step's peak by part (:data:`PARTS` but the DDP buckets)."""
            peak = next(iter(self.get_tracker_snapshot("peak").values()))
            kinds = {"weights": (_MemRefType.PARAM, _MemRefType.BUFFER), "gradients": (_MemRefType.GRAD,),
                     "AdamW state": (_MemRefType.OPT,), "activations": (_MemRefType.ACT,),
                     "backward temporaries": (_MemRefType.TEMP, _MemRefType.OTH)}
            return {name: sum(peak.get(k, 0) for k in refs) for name, refs in kinds.items()}

    return PeakTracker()


@dataclasses.dataclass(frozen=True)
class Simulated:
    """One process's simulated step: the bytes alive at its peak by kind (:data:`PARTS` but the DDP buckets),
    and what the distributed wrappers' extras are computed from."""

    parts: dict[str, int]
    grad_bytes: int  # one copy of the gradients (each tied parameter once)
    block_bytes: int  # the largest transformer block's parameters
    root_bytes: int  # the parameters outside the blocks (embedding, head, final norm)


def simulate_step(cfg: RunConfig, facts: dict, numerics: Numerics, *, micro_batches: int = 2) -> Simulated:
    """One optimizer step of one process under fake tensors.

    The model is prepared as the trainer does (:func:`hif8qat.train.loop.prepare_model`: BF16-parameter quirk,
    quantized linears switched on, the chunked loss head, activation checkpointing), with the trainer's AdamW
    (:func:`~hif8qat.train.loop.build_optimizer`) in the implementation ``train.optimizer_impl`` names for the device
    (``fused``; or torch's default, on CUDA ``foreach``, one temporary the size of the parameters), asked for
    explicitly. The step runs forward and backward under the run's numerics, gradient clipping and the AdamW update
    with its moments already made. Simulated on the CPU (the CPU-only torch has no CUDA autocast to simulate with),
    for the device the run trains on.

    Args:
        cfg: the run's config.
        facts: the model's config.json as :func:`hif8qat.models.loading.model_config_facts` reads it.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics`; its ``device_type`` is the
            device the run trains on (``cpu`` or ``cuda``).
        micro_batches: above 1, the measured micro-batch runs with the previous one's gradients held, as every
            micro-batch after the first of an accumulating step does.

    Returns:
        A :class:`Simulated`."""
    from transformers import AutoModelForCausalLM

    t = cfg.train
    # the device the estimate is for (the paper profile's GPU, estimated on a CPU), not necessarily this one
    device_type = numerics.device_type
    # the simulation runs on fake CPU tensors: the run's numerics, on the CPU
    on_cpu = dataclasses.replace(numerics, device_type="cpu")
    config = model_config(facts)
    with _fake_tensor_mode(), keep_weights_under_fake_tensors(), _one_sequence_per_row():
        # built in the dtype and on the device the run trains it in: a module of fake tensors cannot move
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if cfg.quirks.bf16_params else torch.float32)
        prepare_model(model, cfg, torch.device("cpu"), on_cpu)
        if cfg.quant.enabled:
            set_quantization(model, True)  # after the BF16 warmup: the larger step
        optimizer = build_optimizer(model, cfg, device_type)
        # AdamW makes its moments at its first step: an earlier step's, with gradients that are only shapes; they
        # stay as the previous micro-batch's when the step accumulates
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        if micro_batches < 2:
            optimizer.zero_grad(set_to_none=True)
        tracker = _peak_tracker()
        tracker.track_external(model, optimizer)
        tokens = torch.zeros(t.micro_batch_size, t.seq_len + 1, dtype=torch.long)
        with tracker:
            _micro_batch(model, cfg, on_cpu, tokens, tracker)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        parts = tracker.peak_parts()
        params = _unique_parameters(model)
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        blocks = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in transformer_blocks(model)]
    return Simulated(parts, grad_bytes, max(blocks, default=0), grad_bytes - sum(blocks))


def _micro_batch(model, cfg: RunConfig, numerics: Numerics, tokens: torch.Tensor, tracker=None) -> None:
    if tracker is not None:  # MemTracker takes a second call of the model as the next iteration unless told
        tracker.reset_mod_stats()
    with numerics.forward():
        loss = lm_loss(model, tokens, double_label_shift=cfg.quirks.double_label_shift)
    with numerics.backward():
        loss.backward()


def step_memory(cfg: RunConfig, facts: dict, numerics: Numerics, world_size: int = 1) -> dict[str, int]:
    """Bytes one training process holds at the peak of a step, by part (:data:`PARTS`; the sum is the estimate).
    Added to the simulated step: DDP's gradient buckets (``DistributedDataParallel`` as the trainer builds it keeps
    ``gradient_as_bucket_view`` False: a second copy of every gradient); under FSDP the weights and AdamW state
    shared out over the ranks while the gradients accumulate unsharded between micro-batches (an approximation,
    not measured).

    Args:
        cfg: the run's config.
        facts: the model's config.json as :func:`hif8qat.models.loading.model_config_facts` reads it.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics`, on the device type it
            trains on.
        world_size: processes the run trains on.

    Returns:
        Part -> bytes."""
    t = cfg.train
    accumulates = t.global_batch_size > t.micro_batch_size * world_size
    sim = simulate_step(cfg, facts, numerics, micro_batches=2 if accumulates else 1)
    parts = dict(sim.parts)
    if world_size > 1 and t.distributed == "fsdp":
        # sharded weights and AdamW state, plus the units gathered while they run (the root, one block and the
        # next one prefetched); the gradients accumulate unsharded between micro-batches
        parts["weights"] = parts["weights"] // world_size + sim.root_bytes + 2 * sim.block_bytes
        parts["AdamW state"] //= world_size
    parts["DDP gradient buckets"] = sim.grad_bytes if world_size > 1 and t.distributed == "ddp" else 0
    return parts


#: The settings a step's simulation reads (the model, its preparation, the step's shape and numerics, AdamW)
SIMULATED_SECTIONS = ("model", "train", "quant", "quirks")


@functools.cache
def _code_digest() -> str:
    """A digest of this package's source: a cached estimate is one the code that reads it would make."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _cache_file(cfg: RunConfig, facts: dict, numerics: Numerics, world_size: int) -> Path:
    import transformers

    key = {"settings": {k: dataclasses.asdict(getattr(cfg, k)) for k in SIMULATED_SECTIONS}, "facts": facts,
           "numerics": dataclasses.asdict(numerics), "world_size": world_size, "torch": torch.__version__,
           "transformers": transformers.__version__, "code": _code_digest()}
    name = hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:32]
    return cache_root() / "step_memory" / f"{name}.json"


def cached_step_memory(cfg: RunConfig, facts: dict, numerics: Numerics, world_size: int = 1) -> dict[str, int]:
    """:func:`step_memory`, kept in the project cache under everything the simulation depends on (the settings it
    reads, the model's config.json, the numerics, the processes, torch's and transformers' versions, this package's
    source): ``make expN``'s estimate and the preflight of the run it then starts simulate the step once (seconds
    each). An unreadable entry is simulated again.

    Args:
        cfg: the run's config.
        facts: the model's config.json as :func:`hif8qat.models.loading.model_config_facts` reads it.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics`.
        world_size: processes the run trains on.

    Returns:
        Part -> bytes, as :func:`step_memory`."""
    path = _cache_file(cfg, facts, numerics, world_size)
    try:
        parts = json.loads(path.read_text())
        if isinstance(parts, dict) and set(parts) == set(PARTS) and all(type(v) is int for v in parts.values()):
            return parts
    except (OSError, ValueError):
        pass
    parts = step_memory(cfg, facts, numerics, world_size)
    try:  # written whole or not at all: a concurrent reader sees no half-written entry
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(parts))
        os.replace(partial, path)
    except OSError:
        pass  # a read-only cache: the next caller simulates again
    return parts


def simulated_before(cfg: RunConfig, facts: dict, numerics: Numerics, world_size: int = 1) -> bool:
    """Whether :func:`cached_step_memory` holds this step already (a run's preflight then simulates nothing).

    Args:
        cfg: the run's config, as for :func:`cached_step_memory`.
        facts: the model's facts, likewise.
        numerics: the training numerics, likewise.
        world_size: the processes, likewise.

    Returns:
        True when the cache has it."""
    return _cache_file(cfg, facts, numerics, world_size).is_file()


def machine_memory(device: str) -> tuple[int | None, str]:
    """The memory a run's step has here: the GPU's for a CUDA run, else the RAM (a container's limit where one is
    set), shared by the ranks on this machine.

    Args:
        device: ``train.device`` (``auto``: CUDA when available).

    Returns:
        ``(bytes, what they are)``; ``(None, "")`` where the RAM cannot be read."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        index = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
        return torch.cuda.get_device_properties(index).total_memory, f"memory on GPU {index}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None, ""
    try:  # a container's memory limit, when one is set
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    # Ranks on one machine without GPUs share its memory.
    return total // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1), "RAM"


# How far the simulated step may exceed the generous count: measured 0.32-1.27x over the shipped profiles (the mini
# experiments plain and quantized, FP32, micro-batch 16, 1,024 tokens; the smoke model; the paper's 1B with and
# without activation checkpointing), so four times the count leaves three times that to spare.
SCREEN_MARGIN = 4
# config.json keys that give a model experts, whose parameters the count does not hold: always simulated
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def generous_count(cfg: RunConfig, facts: dict) -> int | None:
    """A dense decoder's step counted from its sizes, not simulated: 16 bytes per parameter (weights, gradients,
    AdamW's two moments), and per token and block 4 bytes per hidden, MLP and attention-score element, and 16 per
    logit. Not an estimate: a screen's yardstick (:func:`far_below`).

    Args:
        cfg: the run's config.
        facts: the model's config.json as :func:`hif8qat.models.loading.model_config_facts` reads it.

    Returns:
        Bytes; None for a model it cannot count (sizes missing, experts)."""
    h, layers = facts.get("hidden_size"), facts.get("num_hidden_layers")
    if not (isinstance(h, int) and isinstance(layers, int)) or any((facts.get(k) or 0) > 1 for k in _EXPERT_KEYS):
        return None
    inter = facts.get("intermediate_size") or 4 * h
    heads, vocab = facts.get("num_attention_heads") or 1, facts.get("vocab_size") or 0
    params = layers * (4 * h * h + 3 * h * inter) + 2 * vocab * h
    t = cfg.train
    tokens = t.micro_batch_size * t.seq_len
    return 16 * params + 4 * layers * tokens * (h + inter + heads * t.seq_len) + 16 * tokens * vocab


def far_below(cfg: RunConfig, facts: dict, limit: int) -> bool:
    """Whether a step cannot come near ``limit`` bytes, so neither preflight nor the time estimate need simulate it
    (seconds each): SCREEN_MARGIN times its :func:`generous_count` fits.

    Args:
        cfg: the run's config.
        facts: the model's config.json as :func:`hif8qat.models.loading.model_config_facts` reads it.
        limit: the machine's memory, bytes.

    Returns:
        True when a step cannot come near ``limit``."""
    count = generous_count(cfg, facts)
    return count is not None and SCREEN_MARGIN * count < limit


class MemoryScreen(NamedTuple):
    """What a run's step is checked against on this machine (:func:`screen_step`)."""

    have: int | None  #: bytes of memory the step has here; None where they cannot be read
    where: str  #: what they are ("RAM", "memory on GPU 0")
    fits_easily: bool  #: the step is far below them (:func:`far_below`): no simulation needed

    @property
    def to_simulate(self) -> bool:
        """Whether the step must be simulated to be compared with the memory: it is known and may come near."""
        return bool(self.have) and not self.fits_easily


def screen_step(cfg: RunConfig, facts: dict) -> MemoryScreen:
    """The one decision preflight, the time estimate and its count of a run's preflight share: the machine's
    memory for the run's step, and whether the step fits it so easily that simulating it (seconds) tells nothing.

    Args:
        cfg: the run's config (``train.device`` picks the GPU's memory or the RAM).
        facts: the model's config.json as :func:`hif8qat.models.loading.model_config_facts` reads it.

    Returns:
        The :class:`MemoryScreen`."""
    have, where = machine_memory(cfg.train.device)
    return MemoryScreen(have or None, where, bool(have) and far_below(cfg, facts, have))


def describe(cfg: RunConfig, parts: dict[str, int], world_size: int, numerics: Numerics) -> str:
    """The estimate, its parts and the settings it is for, in one line (`run.py --estimate`, preflight).

    Args:
        cfg: the run's config.
        parts: the estimate by part (:func:`step_memory`).
        world_size: processes.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics` (its device type: where
            the run trains).

    Returns:
        The line."""
    t = cfg.train
    per = "GPU" if numerics.device_type == "cuda" else "process"
    layout = f"{t.distributed.upper()} over {world_size} processes" if world_size > 1 else "one process"
    detail = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items() if v)
    return (f"{sum(parts.values()) / GIB:.1f} GiB per {per} ({layout}, micro-batch {t.micro_batch_size} x "
            f"{t.seq_len}, {numerics.mode} numerics, activation checkpointing "
            f"{'on' if t.activation_checkpointing else 'off'}; {detail} GiB)")



def ratio_verdict(measured: int, estimate: int, tolerance: float = 0.1) -> tuple[bool, str]:
    """Whether a measured peak agrees with the estimate (measured / estimated within 1 -/+ tolerance), and the
    line that says so (`make gpu-check`'s memory stage).

    Args:
        measured: the measured peak, bytes.
        estimate: the estimate, bytes.
        tolerance: how far the ratio may be from 1.

    Returns:
        ``(whether it agrees, the line)``."""
    ratio = measured / estimate if estimate else float("inf")
    ok = 1 - tolerance <= ratio <= 1 + tolerance
    return ok, (f"peak {measured / GIB:.2f} GiB, estimate {estimate / GIB:.2f} GiB, measured/estimated "
                f"{ratio:.3f} ({'within' if ok else 'outside'} {1 - tolerance:.1f}-{1 + tolerance:.1f})")
