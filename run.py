"""hif8-qat entry point, and the only Hydra-aware file.

    python run.py experiment=exp3 profile=mini stage=all     # train + evaluate (+ its row of the report)
    python run.py -m experiment=exp6 quant.history_len=16,32,64 seed=0,1,2
    torchrun --nproc_per_node 8 run.py experiment=exp8 profile=paper

It composes the config, converts it once into the typed, validated `RunConfig` (every setting is checked
before a model is loaded), and dispatches stage=train|eval|report|all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "src"))

from hif8qat.config import ConfigError, RunConfig, resolve_profile  # noqa: E402

# Overrides that select or steer a run without changing what it trains: they never enter its folder name.
_UNTAGGED = ("experiment", "profile", "seed", "stage", "force", "results_root", "run_tag", "train.resume",
             "train.num_threads", "train.checkpoint_every", "train.keep_checkpoints", "train.log_every",
             "train.val_every", "data.eval_windows", "quant.telemetry_dump_every", "quant.telemetry_stats_every", "eval", "logger", "hydra")


def known_experiments() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def run_tag_from_overrides(overrides: list[str]) -> str:
    """Training-relevant command-line overrides, so two sweep points never share a run folder."""
    kept = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if not any(key == p or key.startswith(p + ".") or key.startswith(p + "/") for p in _UNTAGGED):
            kept.append(item.lstrip("+~"))
    return ",".join(sorted(kept))


def to_run_config(cfg: DictConfig, overrides: list[str]) -> RunConfig:
    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    if not data.get("run_tag"):
        data["run_tag"] = run_tag_from_overrides(overrides)
    run_cfg = RunConfig.from_dict(data, known_experiments=known_experiments())
    return resolve_profile(run_cfg)


def ensure_baseline(cfg: RunConfig) -> None:
    """stage=all of an experiment whose baseline has no finished run runs the baseline first."""
    from hif8qat.runs import is_done, run_dir_for

    base = cfg.experiment.baseline
    if not base or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    from dataclasses import replace

    base_dir = run_dir_for(replace(cfg, experiment=replace(cfg.experiment, name=base), run_tag=""))
    if is_done(base_dir) and (base_dir / "eval").exists():
        return
    print(f"baseline {base} has no finished run at {base_dir}: running it first")
    cmd = [sys.executable, str(ROOT / "run.py"), f"experiment={base}", f"profile={cfg.profile.name}",
           f"seed={cfg.seed}", "stage=all", f"results_root={cfg.results_root}", "+baseline_pass=true"]
    subprocess.run(cmd, check=True)


def evaluate(cfg: RunConfig, run_dir: Path) -> None:
    """Evaluate the run's export in each configured mode that has no results yet (force=true redoes them)."""
    from hif8qat.evaluate import evaluate_run

    if not (run_dir / "export").exists():
        raise SystemExit(f"error: {run_dir} has no export/ to evaluate; train it first (stage=train or all)")
    modes = [m for m in cfg.eval.modes if cfg.force or not (run_dir / "eval" / m / "results.json").exists()]
    if not modes:
        print(f"{run_dir}: evaluation already done for modes {cfg.eval.modes} (force=true redoes it)")
        return
    evaluate_run(run_dir, modes=modes, tasks=list(cfg.eval.tasks), batch_size=cfg.eval.batch_size,
                 limit=cfg.eval.limit, num_fewshot=dict(cfg.eval.num_fewshot) or None,
                 local_datasets=dict(cfg.eval.local_datasets) or None, subset=cfg.eval.subset,
                 subset_seed=cfg.eval.subset_seed, offline_data=cfg.eval.offline_data)


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


def dispatch(cfg: RunConfig, baseline_pass: bool = False) -> None:
    from hif8qat.distributed import env_from_slurm
    from hif8qat.runs import prepare_run_dir, run_dir_for

    env_from_slurm()  # under srun, every task must know its rank before deciding anything

    if cfg.stage == "report":
        report(cfg)
        return
    if cfg.stage == "all" and not baseline_pass:
        ensure_baseline(cfg)
    from hif8qat.train import setup_distributed

    if cfg.stage == "eval":  # evaluation never touches the training folder's state
        evaluate(cfg, run_dir_for(cfg))
        return
    ctx = setup_distributed(cfg.train.device)
    run_dir, status = prepare_run_dir(cfg, is_main=ctx.is_main)
    if cfg.stage in ("train", "all"):
        if status == "done":
            print(f"{run_dir} is finished: skipping training (force=true reruns it)")
        else:
            from hif8qat.train import train

            train(cfg, run_dir, ctx)
    if cfg.stage == "all" and ctx.is_main:
        evaluate(cfg, run_dir)
        report(cfg, only_experiment=cfg.experiment.name)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    overrides = list(HydraConfig.get().overrides.task)
    baseline_pass = bool(cfg.get("baseline_pass", False))
    if "baseline_pass" in cfg:
        cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "baseline_pass"])
        overrides = [o for o in overrides if "baseline_pass" not in o]
    try:
        run_cfg = to_run_config(cfg, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    dispatch(run_cfg, baseline_pass=baseline_pass)


if __name__ == "__main__":
    main()
