"""Which launcher started this process, and torch.distributed's environment from SLURM's.

- `env_from_slurm()` fills torch's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from SLURM's
  variables when a process was started by `srun` (one task per GPU, e.g. by `hydra/launcher=slurm`) instead
  of `torchrun`. torchrun sets WORLD_SIZE itself; then nothing is changed.
- `launch_record()`: world size, ranks per node, launcher and SLURM job ids, recorded in run_info.json;
  `distributed_info(cfg)` and `launch_differences` compare two runs' launches and compute numerics.

Torch-free: the run folder records and compares launches without importing torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

# ------------------------------------------------------------------------------------------------
# SLURM
# ------------------------------------------------------------------------------------------------
# Not submitit's helpers.TorchDistributedEnvironment, on purpose: it activates only inside a submitit-launched
# job (plain `srun python run.py` needs this too), takes the world size from SLURM_NTASKS (the allocation, also
# in a batch script that runs one process), the master from the job's node list (a step on a subset of the
# nodes would rendezvous on a node running no task) and a port in 20000-60000, inside Linux's ephemeral range.
_PORT_BASE, _PORT_SPAN = 15000, 15000  # below Linux's ephemeral range (32768+)


def distributed_info(cfg: Any, environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """How one optimizer step is made, for run_info.json. The amax history counts micro-batches, so runs that
    differ here differ in what a window spans.

    Args:
        cfg: the run's config (it gives ``grad_accum_steps``).
        environ: the environment (default os.environ).

    Returns:
        ``{world_size, ranks_per_node, grad_accum_steps}``."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE") or 1)
    return {"world_size": world, "ranks_per_node": int(env.get("LOCAL_WORLD_SIZE") or world),
            "grad_accum_steps": cfg.grad_accum_steps(world)}


def launch_differences(info_a: Mapping[str, Any], info_b: Mapping[str, Any]) -> list[str]:
    """The step-shaping keys of two run_info.json contents that differ, over every start of each run (a resume
    may change the world size or the machine): the launch's shape, and what of the compute numerics the config
    does not name: the device (``train.device`` may stay ``auto``) and whether BF16 ran on native kernels.

    Args:
        info_a: one run_info.json content.
        info_b: the other.

    Returns:
        The differing keys with their values, one line each; empty for a run recorded before these keys existed."""
    def recorded(info: Mapping[str, Any], section: str, key: str) -> set:
        starts = [info, *(info.get("history") or [])]
        return {s[section][key] for s in starts if isinstance(s, Mapping)
                and isinstance(s.get(section), Mapping) and key in s[section]}

    diff = []
    for section, key in (("distributed", "world_size"), ("distributed", "grad_accum_steps"),
                         ("numerics", "device_type"), ("numerics", "native_bf16")):
        a, b = recorded(info_a, section, key), recorded(info_b, section, key)
        if a and b and a != b:
            diff.append(f"{section}.{key} ({'/'.join(map(str, sorted(a)))} vs {'/'.join(map(str, sorted(b)))})")
    return diff


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist expression: "gpu[001-003,7],login1" -> gpu001 gpu002 gpu003 gpu7 login1.

    Args:
        hostlist: the expression.

    Returns:
        The host names in order."""
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
    The same mapping is done for submitit's local executor when it starts more than one task
    (SUBMITIT_LOCAL_NTASKS/GLOBALID/LOCALID, master 127.0.0.1).

    Args:
        environ: the environment to read and update (default os.environ).

    Returns:
        The variables it set (empty when not under srun or when torchrun's variables are present)."""
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
    """How this process was launched, for run_info.json's "distributed" entry. Read after env_from_slurm, so an
    srun task has its WORLD_SIZE and LOCAL_WORLD_SIZE.

    Args:
        environ: the environment (default os.environ).

    Returns:
        ``{world_size, ranks_per_node, launcher, slurm}``: launcher ``slurm`` (an srun task), ``torchrun``,
        ``submitit_local`` (hydra/launcher=local) or ``local``; slurm the job, array job and array task ids and restarts
        (None outside a SLURM job)."""
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
