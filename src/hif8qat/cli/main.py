"""``python run.py``'s job: the composed config made a RunConfig, checked and dispatched. The modules of training,
evaluation and report load here; the quick answers of :mod:`hif8qat.cli.command_line` and ``--estimate``
(:mod:`hif8qat.cli.estimate`) come before them."""

from __future__ import annotations

import sys

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hif8qat.boundary import guarded
from hif8qat.cli.hydra_config import replace_typed_dicts, to_run_config
from hif8qat.cli.stages import check_cache_env, dispatch
from hif8qat.config.numerics import run_numerics
from hif8qat.launch.preflight import preflight
from hif8qat.launch.sweep import run_point
from hif8qat.runs.host_allocator import keep_freed_memory
from hif8qat.runs.launch_env import env_from_slurm


def run_job(cfg: DictConfig) -> dict[str, str] | None:
    """The Hydra job of ``python run.py``: the composed config made the run's RunConfig, checked (the cache folder,
    the preflight: inputs, memory, time), then dispatched. A user's error is one ``error:`` line, exit 2.

    In a multirun sweep the point's outcome is returned instead (done, already done, failed, busy), so a point
    that fails never stops the points after it; the launcher summarizes them (hif8qat.launch.sweep).

    Args:
        cfg: the config Hydra composed.

    Returns:
        The point's outcome (done, already done, failed, busy) under a multirun sweep; None for a single run, which
        exits with the error's status when it fails."""
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)

    def run() -> str | None:
        run_cfg = to_run_config(replace_typed_dicts(cfg, overrides), overrides)
        env_from_slurm()  # under srun, preflight's memory check must know the world size
        keep_freed_memory()  # before any large allocation: a CPU step's memory is reused, not mapped afresh
        check_cache_env()
        # the run's numerics, resolved once here (an evaluation device this machine lacks fails before training)
        numerics = run_numerics(run_cfg)
        preflight(run_cfg, numerics)
        return dispatch(run_cfg, numerics)

    if hydra_cfg.mode == RunMode.MULTIRUN:
        return run_point(run)
    code = guarded(run)
    if code:
        sys.exit(code)
