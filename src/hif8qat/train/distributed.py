"""Scale-out helpers: FSDP2 sharding, SLURM -> torch.distributed environment, gathered state dicts.

- `apply_fsdp(model)` shards a causal LM with PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`): each
  transformer block is its own unit (its parameters are all-gathered just before it runs and freed after),
  then the root takes the rest (embeddings, final norm, lm_head). Parameters become DTensors sharded over
  the data-parallel ranks; their names do not change, so HiF8 conversion, scalers and `quant_state_dict`
  work as without FSDP. The HiF8 weight quantizer sees the full (all-gathered) weight, so its scale is the
  same on every rank, exactly as under DDP. Works with NCCL on GPU and gloo on CPU.
- `unsharded_class(model)`: the model's own class back for the time of a save_pretrained (export).
- `grad_sync(model, enabled)`: gradient accumulation without communication on the non-final micro-batches,
  for DDP (`no_sync`) and FSDP2 (`set_requires_gradient_sync`; FSDP2 has no `no_sync`), so gradients are
  reduced once per optimizer step.
- `env_from_slurm()` fills torch's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from SLURM's
  variables when a process was started by `srun` (one task per GPU, e.g. by `hydra/launcher=slurm`) instead
  of `torchrun`. torchrun sets WORLD_SIZE itself; then nothing is changed.
- `launch_record()`: world size, ranks per node, launcher and SLURM job ids, recorded in run_info.json.
- `full_model_state_dict` / `load_full_model_state_dict` / `full_optimizer_state_dict` /
  `load_full_optimizer_state_dict`: whole (gathered, CPU) state under FSDP through
  `torch.distributed.checkpoint.state_dict`, so checkpoints and exports keep the single-process format
  (a checkpoint written under FSDP loads without it and vice versa). Every rank must call them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# ------------------------------------------------------------------------------------------------
# SLURM
# ------------------------------------------------------------------------------------------------
# Not submitit's helpers.TorchDistributedEnvironment, on purpose: it activates only inside a submitit-launched
# job (plain `srun python run.py` needs this too), takes the world size from SLURM_NTASKS (the allocation, also
# in a batch script that runs one process), the master from the job's node list (a step on a subset of the
# nodes would rendezvous on a node running no task) and a port in 20000-60000, inside Linux's ephemeral range.
_PORT_BASE, _PORT_SPAN = 15000, 15000  # below Linux's ephemeral range (32768+)


def distributed_info(cfg: Any, environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """How one optimizer step is made, for run_info.json: ranks, ranks per node, micro-batches per rank. The
    amax history counts micro-batches, so runs that differ here differ in what a window spans."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE") or 1)
    return {"world_size": world, "ranks_per_node": int(env.get("LOCAL_WORLD_SIZE") or world),
            "grad_accum_steps": cfg.grad_accum_steps(world)}


def launch_differences(info_a: Mapping[str, Any], info_b: Mapping[str, Any]) -> list[str]:
    """The step-shaping keys of two run_info.json contents that differ, over every start of each run (a resume
    may change the world size); a run recorded before these keys existed differs in nothing."""
    def shapes(info: Mapping[str, Any], key: str) -> set:
        starts = [info, *(info.get("history") or [])]
        return {s["distributed"][key] for s in starts if isinstance(s, Mapping)
                and isinstance(s.get("distributed"), Mapping) and key in s["distributed"]}

    diff = []
    for key in ("world_size", "grad_accum_steps"):
        a, b = shapes(info_a, key), shapes(info_b, key)
        if a and b and a != b:
            diff.append(f"distributed.{key} ({'/'.join(map(str, sorted(a)))} vs {'/'.join(map(str, sorted(b)))})")
    return diff


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist expression: "gpu[001-003,7],login1" -> gpu001 gpu002 gpu003 gpu7 login1."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        parts = re.split(r"(\[[^\]]*\])", item)
        expanded = [""]
        for part in parts:
            if part.startswith("["):
                choices = []
                for rng in part[1:-1].split(","):
                    lo, _, hi = rng.partition("-")
                    if hi:
                        width = len(lo)
                        choices += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
                    else:
                        choices.append(lo)
                expanded = [e + c for e in expanded for c in choices]
            else:
                expanded = [e + part for e in expanded]
        hosts += [h for h in expanded if h]
    return hosts


def _slurm_world_size(env: Mapping[str, str]) -> int | None:
    # srun steps export SLURM_STEP_NUM_TASKS; a batch script (no srun) has SLURM_NTASKS for the whole
    # allocation but runs one process, so without a step it must not be read as a world size.
    if env.get("SLURM_STEP_NUM_TASKS"):
        return int(env["SLURM_STEP_NUM_TASKS"])
    if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_NTASKS"):
        return int(env["SLURM_NTASKS"])
    return None


def env_from_slurm(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set torch's distributed variables from SLURM's, when started by srun and WORLD_SIZE is unset.

    RANK <- SLURM_PROCID, WORLD_SIZE <- SLURM_STEP_NUM_TASKS (or SLURM_NTASKS inside a step),
    LOCAL_RANK <- SLURM_LOCALID, LOCAL_WORLD_SIZE <- tasks on this node, GROUP_RANK <- SLURM_NODEID,
    MASTER_ADDR <- first host of the step's (or job's) node list, MASTER_PORT <- derived from the job id
    (same on every task of the job, different for jobs sharing a node). Variables already set are kept.
    Returns the variables it set (empty when not under srun or when torchrun's variables are present).
    The same mapping is done for submitit's local executor when it starts more than one task
    (SUBMITIT_LOCAL_NTASKS/GLOBALID/LOCALID, master 127.0.0.1).
    """
    env = os.environ if environ is None else environ
    if env.get("WORLD_SIZE"):
        return {}
    if env.get("SLURM_PROCID") is None:
        return _env_from_submitit_local(env)
    world = _slurm_world_size(env)
    if world is None:
        return {}
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    hosts = expand_hostlist(nodelist) if nodelist else []
    job_id = env.get("SLURM_JOB_ID", "0")  # unique per array task too
    new = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "GROUP_RANK": env.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": hosts[0] if hosts else "127.0.0.1",
        "MASTER_PORT": str(_PORT_BASE + int(re.sub(r"\D", "", job_id) or 0) % _PORT_SPAN),
    }
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    if re.fullmatch(r"\d+(\(x\d+\))?", per_node):
        new["LOCAL_WORLD_SIZE"] = per_node.split("(")[0]
    set_now = {k: v for k, v in new.items() if not env.get(k)}
    env.update(set_now)
    return set_now


def _env_from_submitit_local(env: dict[str, str]) -> dict[str, str]:
    """submitit's local executor (hydra/launcher=local with tasks_per_node > 1): one machine, N tasks."""
    ntasks = int(env.get("SUBMITIT_LOCAL_NTASKS") or 1)
    if ntasks <= 1 or env.get("SUBMITIT_LOCAL_GLOBALID") is None:
        return {}
    job_id = re.sub(r"\D", "", env.get("SUBMITIT_LOCAL_JOB_ID", "")) or "0"
    new = {"RANK": env["SUBMITIT_LOCAL_GLOBALID"], "WORLD_SIZE": str(ntasks),
           "LOCAL_RANK": env.get("SUBMITIT_LOCAL_LOCALID", "0"), "LOCAL_WORLD_SIZE": str(ntasks),
           "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_PORT_BASE + int(job_id) % _PORT_SPAN)}
    set_now = {k: v for k, v in new.items() if not env.get(k)}
    env.update(set_now)
    return set_now


def launch_record(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """How this process was launched, for run_info.json's "distributed" entry: world size, ranks per node,
    ``launcher`` (slurm: an srun task; torchrun; submitit_local: hydra/launcher=local; local: one plain
    process) and ``slurm`` (job, array job and array task ids, restarts; None outside a SLURM job).
    Read after env_from_slurm, so an srun task has its WORLD_SIZE and LOCAL_WORLD_SIZE."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE") or 1)
    if env.get("TORCHELASTIC_RUN_ID"):  # set by torchrun only (also inside a SLURM allocation)
        launcher = "torchrun"
    elif env.get("SLURM_JOB_ID") and env.get("SLURM_PROCID") is not None and _slurm_world_size(env):
        launcher = "slurm"
    elif env.get("SUBMITIT_LOCAL_JOB_ID"):
        launcher = "submitit_local"
    else:
        launcher = "local"

    def number(key: str) -> int | None:
        value = env.get(key)
        return int(value) if value and value.isdigit() else None

    slurm = None
    if env.get("SLURM_JOB_ID"):
        slurm = {"job_id": number("SLURM_JOB_ID"), "array_job_id": number("SLURM_ARRAY_JOB_ID"),
                 "array_task_id": number("SLURM_ARRAY_TASK_ID"),
                 "restart_count": number("SLURM_RESTART_COUNT") or 0}  # > 0 after a requeue
    return {"world_size": world, "ranks_per_node": int(env.get("LOCAL_WORLD_SIZE") or world),
            "launcher": launcher, "slurm": slurm}


def all_gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (one process: ``[obj]``)."""
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def cuda_device_for(local_rank: int) -> torch.device:
    """The GPU of this local rank; with one visible GPU per task (SLURM GPU binding) that GPU is cuda:0."""
    count = torch.cuda.device_count()
    return torch.device("cuda", local_rank % count if count > 1 else 0)


# ------------------------------------------------------------------------------------------------
# FSDP2
# ------------------------------------------------------------------------------------------------
def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def apply_fsdp(model: nn.Module, *, mesh=None, reshard_after_forward: bool = True,
               mp_policy=None, blocks: Iterable[nn.Module] | None = None) -> nn.Module:
    """Shard `model` in place with FSDP2: each transformer block, then the root. Returns the model.

    Parameters stay FP32 master weights sharded over the ranks; the all-gather is in FP32 unless an
    `mp_policy` (`torch.distributed.fsdp.MixedPrecisionPolicy`) says otherwise. The trainer's default keeps
    FP32 so the HiF8 weight quantizer sees the same values as under DDP (BF16 comes from autocast).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if blocks is None:
        from hif8qat.models.loading import transformer_blocks

        blocks = list(transformer_blocks(model))
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward,
                              "mp_policy": mp_policy or MixedPrecisionPolicy()}
    if mesh is not None:
        kwargs["mesh"] = mesh
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    from hif8qat.quant.linear import set_weight_recompute

    set_weight_recompute(model)  # keeping a quantized full weight from forward to backward would undo the sharding
    return model


@contextmanager
def unsharded_class(model: nn.Module) -> Iterator[nn.Module]:
    """Inside, an FSDP2-sharded `model` has its own class again (fully_shard swaps it for a generated
    ``FSDP<cls>`` defined in torch): save_pretrained then records and copies the model's modeling code (a
    remote-code model's ``auto_map``), not torch's FSDP files. Nothing else changes; a plain model is left alone."""
    from torch.distributed.fsdp import FSDPModule

    sharded = type(model)
    if not isinstance(model, FSDPModule):
        yield model
        return
    model.__class__ = next(c for c in sharded.__mro__[1:] if not issubclass(c, FSDPModule))
    try:
        yield model
    finally:
        model.__class__ = sharded


@contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Run a micro-batch's forward *and* backward inside: with enabled=False its gradients only accumulate
    locally (no all-reduce / reduce-scatter); the final micro-batch of a step runs with enabled=True.

    `model` is what the trainer calls: a DDP module, an FSDP2 root, a plain module (nothing to do) or any of
    them behind torch.compile. DDP decides in forward and FSDP2 in backward, hence one block around both.
    """
    from torch.distributed.fsdp import FSDPModule

    target = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule wraps the module
    if enabled or not (isinstance(target, FSDPModule) or hasattr(target, "no_sync")):
        yield
    elif isinstance(target, FSDPModule):
        # Unsharded gradients accumulate across micro-batches; the final one reduce-scatters their sum.
        target.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            target.set_requires_gradient_sync(True)
    else:
        with target.no_sync():
            yield


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of state-dict entries that are one tensor (tied weights), sorted; only groups of 2+."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), []).append(name)
    return [sorted(names) for names in by_id.values() if len(names) > 1]


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gathered full model state on CPU on rank 0 (empty dict on the other ranks). All ranks call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_model_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict held by rank 0 into a sharded model (other ranks may pass {}). All ranks call it."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, dict(state_dict),
                         options=_options(full_state_dict=True, broadcast_from_rank0=True, strict=True))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Gathered optimizer state keyed by parameter name, on CPU on rank 0 ({} elsewhere). All ranks call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: Mapping[str, Any]) -> None:
    """Load a name-keyed full optimizer state (held by rank 0; others may pass {}). All ranks call it."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    broadcast = dist.is_available() and dist.is_initialized() and is_fsdp(model)
    set_optimizer_state_dict(model, optimizer, dict(state_dict),
                             options=_options(full_state_dict=True, broadcast_from_rank0=broadcast))


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer,
                            indexed: Mapping[str, Any]) -> dict[str, Any]:
    """Convert `optimizer.state_dict()` (parameters numbered in param_groups order) to the name-keyed form.

    The numbering follows the parameters of `optimizer`, which must have been built the same way as the
    one that wrote `indexed` (the trainer always builds it from the same model and parameter groups).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    index_to_name: dict[int, str] = {}
    idx = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            index_to_name[idx] = names[id(p)]
            idx += 1
    state = {index_to_name[int(i)]: s for i, s in indexed["state"].items()}
    groups = [{**g, "params": [index_to_name[int(i)] for i in g["params"]]} for g in indexed["param_groups"]]
    return {"state": state, "param_groups": groups}
