"""hif8-qat entry point, and the only Hydra-aware file.

    python run.py experiment=exp3 profile=mini stage=all     # train + evaluate (+ its row of the report)
    python run.py -m experiment=exp6 quant.history_len=16,32,64 seed=0,1,2
    torchrun --nproc_per_node 8 run.py experiment=exp8 profile=paper

It composes the config, converts it once into the typed, validated `RunConfig`, checks that the model, data
and evaluation datasets it names can be had (every setting is checked before a model is loaded or a run
folder is created), and dispatches stage=train|eval|report|all. Every user-actionable failure (a RunError)
is printed as ``error: <message>`` with exit status 2.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "src"))

from hif8qat.config import ConfigError, RunConfig, resolve_profile  # noqa: E402
from hif8qat.errors import RunError  # noqa: E402

# Overrides that select or steer a run without changing what it trains: they never enter its folder name.
# The profile group is in the folder path, but its settings (profile.steps) change the training: tagged.
_UNTAGGED = ("experiment", "seed", "stage", "force", "results_root", "run_tag", "train.resume",
             "train.num_threads", "train.checkpoint_every", "train.keep_checkpoints", "train.keep_checkpoints_when_done", "train.log_every",
             "train.val_every", "data.eval_windows", "data.cache_dir", "quant.telemetry_dump_every",
             "quant.telemetry_stats_every", "eval", "logger", "hydra")
_IN_PATH = ("profile", "profile.name")
# key={...} typed on the command line (schedules such as quant.interval={0:1,1000:10}, eval.local_datasets).
_DICT_OVERRIDE = re.compile(r"^\+{0,2}(?!hydra[./])([A-Za-z_][\w.]*)=(\{.*)$", re.S)


def known_experiments() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def run_tag_from_overrides(overrides: list[str]) -> str:
    """Training-relevant command-line overrides, so two sweep points never share a run folder."""
    kept = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in _IN_PATH:
            continue
        if not any(key == p or key.startswith(p + ".") or key.startswith(p + "/") for p in _UNTAGGED):
            kept.append(item.lstrip("+~"))
    return ",".join(sorted(kept))


def force_add_dict_overrides(argv: list[str]) -> list[str]:
    """Rewrite ``key={...}`` as ``++key={...}``: Hydra refuses a plain override that adds a key to a dict
    (``eval.local_datasets={mmlu: ...}`` would need ``+``); ``++`` always applies. See replace_typed_dicts."""
    out = list(argv[:1])
    for arg in argv[1:]:
        match = _DICT_OVERRIDE.match(arg)
        out.append(f"++{match[1]}={match[2]}" if match else arg)
    return out


def replace_typed_dicts(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A dict typed on the command line replaces the configured one: Hydra would merge them, so exp3's
    ``quant.interval={0: 1, 1000: 10}`` overridden by ``{0: 5}`` would silently run ``{0: 5, 1000: 10}``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(overrides):
        if not override.is_delete() and isinstance(override.value(), dict):
            with open_dict(cfg):
                OmegaConf.update(cfg, override.key_or_group, override.value(), merge=False)
    return cfg


def to_run_config(cfg: DictConfig, overrides: list[str]) -> RunConfig:
    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    if not data.get("run_tag"):
        data["run_tag"] = run_tag_from_overrides(overrides)
    run_cfg = RunConfig.from_dict(data, known_experiments=known_experiments())
    return resolve_profile(run_cfg)


def baseline_note(cfg: RunConfig) -> None:
    """stage=all does not start the baseline (`make expN` does, under any launcher): say how, when it is missing."""
    from dataclasses import replace

    from hif8qat.runs import is_done, run_dir_for

    base = cfg.experiment.baseline
    if not base:
        return
    base_dir = run_dir_for(replace(cfg, experiment=replace(cfg.experiment, name=base), run_tag=""))
    if is_done(base_dir) and (base_dir / "eval").exists():
        return
    print(f"note: baseline {base} has no finished, evaluated run at {base_dir}, so the report has no drops "
          f"for {cfg.experiment.name} yet. Run it with `make {base} PROFILE={cfg.profile.name} SEED={cfg.seed}` "
          f"(or `python run.py experiment={base} profile={cfg.profile.name} seed={cfg.seed} stage=all "
          f"results_root={cfg.results_root}`); `make {cfg.experiment.name}` runs it first.")


def eval_numerics(cfg: RunConfig) -> tuple[str, str]:
    """eval.device / eval.dtype, with auto resolved to the training device and numerics."""
    from hif8qat.evaluate import resolve_numerics

    return resolve_numerics(cfg.eval.device, cfg.eval.dtype, train_device=cfg.train.device,
                            train_autocast=cfg.train.autocast)


def evaluate(cfg: RunConfig, run_dir: Path) -> None:
    """Evaluate the run's export in each configured mode that has no results yet (force=true redoes them)."""
    from hif8qat.evaluate import evaluate_run
    from hif8qat.runs import lock_run_dir

    if not (run_dir / "export").exists():
        raise RunError(f"{run_dir} has no export/ to evaluate; train it first (stage=train or all)")
    lock_run_dir(run_dir)  # eval/ is written into the run folder: one writer at a time
    modes = [m for m in cfg.eval.modes if cfg.force or not (run_dir / "eval" / m / "results.json").exists()]
    if not modes:
        print(f"{run_dir}: evaluation already done for modes {cfg.eval.modes} (force=true redoes it)")
        return
    device, dtype = eval_numerics(cfg)
    evaluate_run(run_dir, modes=modes, tasks=list(cfg.eval.tasks), batch_size=cfg.eval.batch_size,
                 device=device, dtype=dtype,
                 limit=cfg.eval.limit, num_fewshot=dict(cfg.eval.num_fewshot) or None,
                 local_datasets=dict(cfg.eval.local_datasets) or None, subset=cfg.eval.subset,
                 subset_seed=cfg.eval.subset_seed, offline_data=cfg.eval.offline_data,
                 results_root=Path(cfg.results_root), trust_remote_code=cfg.model.trust_remote_code)


def report(cfg: RunConfig, only_experiment: str | None = None) -> None:
    """Tables and figures for the profile; with only_experiment, print that experiment's rows."""
    from hif8qat.report import build_report, format_report, to_markdown

    # Tables and figures sit beside the runs they come from: results/{tables,figures}/<profile>/ by default.
    results = Path(cfg.results_root).parent
    rep = build_report(Path(cfg.results_root), cfg.profile.name, results / "tables" / cfg.profile.name,
                       results / "figures" / cfg.profile.name, figures=only_experiment is None)
    if only_experiment is None:
        print(format_report(rep))
        return
    for name, table in rep["tables"].items():
        if len(table) and "experiment" in table and not name.startswith("runs_"):
            rows = table[table["experiment"] == only_experiment]
            if len(rows):
                print(f"\n{name} ({only_experiment})\n" + to_markdown(rows, 3))


def prepare_shared(cfg: RunConfig, ctx) -> tuple[Path, str]:
    """Rank 0 alone locks the run folder and decides what to do with it; the other ranks follow its decision.

    Rank 0 holds the folder's lock for the whole job, on behalf of every rank (torchrun stops them all when
    it exits). Its decision, or its error, is broadcast, so no rank waits at a collective for a rank 0 that
    refused to start.
    """
    from hif8qat.runs import prepare_run_dir

    if ctx.world_size == 1:
        return prepare_run_dir(cfg)
    import torch.distributed as dist

    decision: list = [None]
    error = None
    if ctx.is_main:
        try:
            run_dir, status = prepare_run_dir(cfg)
            decision = [(str(run_dir), status, None)]
        except RunError as err:
            error, decision = err, [(None, None, str(err))]
    dist.broadcast_object_list(decision, src=0)
    run_dir, status, message = decision[0]
    if error is not None:
        raise error
    if message is not None:
        raise SystemExit(2)  # rank 0 reports the error once
    return Path(run_dir), status


def dispatch(cfg: RunConfig) -> None:
    from hif8qat.distributed import env_from_slurm
    from hif8qat.runs import release_run_dir, run_dir_for

    env_from_slurm()  # under srun, every task must know its rank before deciding anything

    if cfg.stage == "report":
        report(cfg)
        return
    if cfg.stage in ("eval", "all"):
        eval_numerics(cfg)  # an evaluation device this machine lacks fails before training, not after
    from hif8qat.train import setup_distributed

    if cfg.stage == "eval":  # evaluation never touches the training folder's state
        if int(os.environ.get("RANK", "0")) != 0:
            return  # one process evaluates (and writes eval/); under torchrun that is rank 0
        try:
            evaluate(cfg, run_dir_for(cfg))
        finally:
            release_run_dir(run_dir_for(cfg))
        return
    ctx = setup_distributed(cfg.train.device)
    run_dir, status = prepare_shared(cfg, ctx)
    if cfg.stage == "all" and ctx.is_main:
        baseline_note(cfg)
    try:
        if cfg.stage in ("train", "all"):
            if status == "done":
                print(f"{run_dir} is finished: skipping training (force=true reruns it)")
            else:
                from hif8qat.train import train

                train(cfg, run_dir, ctx)
        if cfg.stage == "all" and ctx.is_main:
            evaluate(cfg, run_dir)
            report(cfg, only_experiment=cfg.experiment.name)
    finally:
        release_run_dir(run_dir)  # a multirun sweep runs its jobs in this one process


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hif8qat.preflight import preflight

    overrides = list(HydraConfig.get().overrides.task)
    try:
        run_cfg = to_run_config(replace_typed_dicts(cfg, overrides), overrides)
        preflight(run_cfg)
        dispatch(run_cfg)
    except (RunError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.argv = force_add_dict_overrides(sys.argv)
    main()
