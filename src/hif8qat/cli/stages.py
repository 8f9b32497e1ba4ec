"""What ``python run.py`` does with a checked RunConfig: stage=train|eval|report|all, on one process or on every
rank under torchrun (rank 0 alone decides about the run folder and tells the others)."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from hif8qat.artefacts import CorruptArtefact, UnverifiedArtefact, trusting_unverified
from hif8qat.config.run_config import RunConfig
from hif8qat.errors import RunError, concerning
from hif8qat.evaluate.heldout import after_eval
from hif8qat.evaluate.outputs import verify_eval_dir
from hif8qat.evaluate.runner import evaluate_run
from hif8qat.evaluate.settings import resolve_numerics
from hif8qat.files import folder_problem
from hif8qat.launch.sweep import SKIPPED
from hif8qat.report import build_report, format_report
from hif8qat.runs.folders import (
    failure_reason,
    find_baseline_run,
    has_export,
    is_done,
    lock_run_dir,
    prepare_run_dir,
    release_run_dir,
    run_dir_for,
)
from hif8qat.runs.launch_env import env_from_slurm
from hif8qat.train.export import export_8bit_stage
from hif8qat.train.loop import setup_distributed, train


def baseline_note(cfg: RunConfig, run_dir: Path) -> None:
    """stage=all does not start the baseline (`make expN` does, under any launcher): say how, when the one run
    the report would pair this run with (same seed, same training settings) is missing or unevaluated.

    Args:
        cfg: the run's config.
        run_dir: the run folder."""
    base = cfg.experiment.baseline
    if not base:
        return
    found, why = find_baseline_run(Path(cfg.results_root), cfg.profile.name, base, run_dir)
    if found is not None and is_done(found) and (found / "eval").exists():
        return
    state = why or f"{found} is not finished and evaluated"
    settings = " ".join(o for o in cfg.run_tag.split(",") if o and not o.lstrip("+").startswith("quant."))
    print(f"note: baseline {base}: {state}, so the report has no drops for {cfg.experiment.name} yet. Run it with "
          f"`python run.py experiment={base} profile={cfg.profile.name} seed={cfg.seed} stage=all "
          f"results_root={cfg.results_root}{' ' + settings if settings else ''}`; `make {cfg.experiment.name}` "
          "runs it first.")


def eval_numerics(cfg: RunConfig) -> tuple[str, str]:
    """The evaluation's device and autocast: eval.device / eval.dtype, auto being the training's device and its
    (resolved) train.autocast.

    Args:
        cfg: the run's config.

    Returns:
        ``(device, autocast)``."""
    return resolve_numerics(cfg.eval.device, cfg.eval.dtype, train_device=cfg.train.device,
                            train_autocast=cfg.train.autocast)


def evaluate(cfg: RunConfig, run_dir: Path, ctx=None) -> bool:
    """Evaluate the run's export in each configured mode that has no results yet (force=true redoes them).

    Under torchrun (ctx of several ranks) every rank evaluates its share of the requests and rank 0, which
    alone checks and locks the folder and chooses the modes, writes the results (hif8qat.evaluate.ranks).

    Args:
        cfg: the run's config.
        run_dir: the run folder.
        ctx: the distributed context (None: one process).

    Returns:
        Whether any mode was evaluated."""
    main = ctx is None or ctx.is_main
    modes = on_rank0(ctx, lambda: _modes_to_evaluate(cfg, run_dir))
    device, autocast = eval_numerics(cfg)
    if modes:
        on_gpu_ranks = ctx is not None and ctx.world_size > 1 and device == "cuda"
        settings = (f"the evaluation settings (eval.tasks={list(cfg.eval.tasks)}, eval.num_fewshot="
                    f"{dict(cfg.eval.num_fewshot)}, eval.limit={cfg.eval.limit}, eval.subset={cfg.eval.subset})")
        with concerning(settings, libraries=("lm_eval", "datasets", "pyarrow")):  # what lm-eval cannot honour
            evaluate_run(run_dir, modes=modes, tasks=list(cfg.eval.tasks), batch_size=cfg.eval.batch_size,
                         device=str(ctx.device) if on_gpu_ranks else device,  # each rank its own GPU
                         dtype=autocast, limit=cfg.eval.limit, num_fewshot=dict(cfg.eval.num_fewshot) or None,
                         local_datasets=dict(cfg.eval.local_datasets) or None, subset=cfg.eval.subset,
                         subset_seed=cfg.eval.subset_seed, offline_data=cfg.eval.offline_data,
                         results_root=Path(cfg.results_root), trust_remote_code=cfg.model.trust_remote_code)
    elif main:
        print(f"{run_dir}: evaluation already done for modes {cfg.eval.modes} (force=true redoes it)")
    if main:  # one process computes a quantized run's held-out distances (up to three models); once per run
        after_eval(cfg, run_dir, device=device, dtype=autocast)
    return bool(modes)


def _modes_to_evaluate(cfg: RunConfig, run_dir: Path) -> list[str]:
    if not has_export(run_dir):
        if is_done(run_dir):
            raise RunError(f"{run_dir} is marked finished but has no export/ to evaluate: run stage=all, which "
                           "writes it again from the run's final checkpoint (or says how to retrain it)")
        diverged = failure_reason(run_dir)
        if diverged is not None:
            raise RunError(f"{run_dir} diverged in training, so it has no export/ to evaluate ({diverged}); "
                           "change the settings that diverged (e.g. a lower train.lr) and train it again")
        raise RunError(f"{run_dir} has no export/ to evaluate; train it first (stage=train or all)")
    lock_run_dir(run_dir)  # eval/ is written into the run folder: one writer at a time
    return [m for m in cfg.eval.modes if cfg.force or not _mode_done(run_dir / "eval" / m)]


def _mode_done(mode_dir: Path) -> bool:
    """A mode is done when its results.json and the files it recorded read back intact; a truncated or
    edited one is evaluated again rather than kept."""
    if not (mode_dir / "results.json").exists():
        return False
    try:
        verify_eval_dir(mode_dir)
    except CorruptArtefact as err:
        print(f"{err.path} is corrupt or truncated: evaluating {mode_dir.name} again")
        return False
    except UnverifiedArtefact as err:  # an older layout or a manifest that leaves a file out: redone, recorded
        print(f"{err.path} is unverified ({err.why}): evaluating {mode_dir.name} again")
        return False
    return True


def on_rank0(ctx, decide):
    """decide() on rank 0, its answer (or its RunError) sent to every rank, so no rank waits at a collective
    for a rank 0 that refused; the other ranks exit quietly (rank 0 reports the error once).

    Args:
        ctx: the distributed context (None: one process).
        decide: a zero-argument callable.

    Returns:
        decide()'s answer, on every rank.

    Raises:
        RunError: decide()'s, on rank 0."""
    if ctx is None or ctx.world_size == 1:
        return decide()

    box: list = [None]
    error = None
    if ctx.is_main:
        try:
            box = [(decide(), None)]
        except RunError as err:
            error, box = err, [(None, str(err))]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    answer, message = box[0]
    if message is not None:
        raise SystemExit(2)
    return answer


def report(cfg: RunConfig, only_experiment: str | None = None) -> None:
    """Tables and figures for the profile; with only_experiment, print that experiment's rows.

    Args:
        cfg: the run's config.
        only_experiment: print only this experiment's rows (and draw no figures)."""
    # Tables and figures live in the results root they come from (<results_root>/{tables,figures}/<profile>/):
    # a user's report never rewrites the committed tables of results/reference_runs.
    root = Path(cfg.results_root)
    rep = build_report(root, cfg.profile.name, root / "tables" / cfg.profile.name,
                       root / "figures" / cfg.profile.name, figures=only_experiment is None)
    if only_experiment is None:
        print(format_report(rep))
        return
    # The console gets the experiment's verdicts against its baseline; the tables (hundreds of characters wide)
    # stay in their files.
    claims = rep["tables"].get(f"claims_{cfg.profile.name}")
    if claims is not None and len(claims) and "experiment" in claims:
        rows = claims[(claims["experiment"] == only_experiment) & (claims["against"] == "baseline")]
        if len(rows):
            print(f"\n{only_experiment} against {rows['counterpart'].iloc[0]} "
                  f"({int(rows['n_seeds'].max())} seed(s); difference, 95 % CI, verdict):")
        for row in rows.itertuples():
            where = "training" if row.mode == "train" else f"{row.mode} {row.task}"
            # one seed with no seed variance to borrow: its interval holds the seed's own noise alone (items, windows
            # or step blocks), so no verdict
            bare = row.difference == row.equivalence
            verdict = row.difference if bare else f"{row.difference}, {row.equivalence}"
            print(f"  {where:<30} {row.metric:<12} {row.cost:+9.3f} {'within-seed ' if bare else ''}"
                  f"[{row.ci_lo:+.3f}, {row.ci_hi:+.3f}] {row.unit}: {verdict}")
    print(f"tables: {root / 'tables' / cfg.profile.name}/ (claims, drops, ape, heldout, ...: .md and .csv)")


def prepare_shared(cfg: RunConfig, ctx) -> tuple[Path, str]:
    """Rank 0 alone locks the run folder and decides what to do with it; the other ranks follow its decision.
    Rank 0 holds the folder's lock for the whole job, on behalf of every rank (torchrun stops them all when it
    exits).

    Args:
        cfg: the run's config.
        ctx: the distributed context (None: one process).

    Returns:
        ``(run folder, status)`` as :func:`hif8qat.runs.folders.prepare_run_dir` returns them."""
    return on_rank0(ctx, lambda: prepare_run_dir(cfg))


def dispatch(cfg: RunConfig) -> str | None:
    """Run cfg.stage. Files without an integrity record are refused unless cfg.trust_unverified.

    Args:
        cfg: the run's config.

    Returns:
        SKIPPED when the run was found finished with nothing left to do (a sweep's rerun), else None."""
    with trusting_unverified(cfg.trust_unverified):
        return _dispatch(cfg)


def _dispatch(cfg: RunConfig) -> str | None:
    env_from_slurm()  # under srun, every task must know its rank before deciding anything

    if cfg.stage == "report":
        report(cfg)
        return
    if cfg.stage == "export":  # the deployable 8-bit export of a trained run
        export_8bit_stage(cfg)
        return
    if cfg.stage in ("eval", "all"):
        eval_numerics(cfg)  # an evaluation device this machine lacks fails before training, not after

    ctx = setup_distributed(cfg.train.device if cfg.stage != "eval" else eval_numerics(cfg)[0])
    if cfg.stage == "eval":  # evaluation never touches the training folder's state
        try:  # under torchrun every rank scores its share; rank 0 writes eval/
            evaluated = evaluate(cfg, run_dir_for(cfg), ctx)
        finally:
            if ctx.is_main:
                release_run_dir(run_dir_for(cfg))
        return None if evaluated else SKIPPED
    run_dir, status = prepare_shared(cfg, ctx)
    evaluated = False
    if cfg.stage == "all" and ctx.is_main:
        baseline_note(cfg, run_dir)
    try:
        if cfg.stage in ("train", "all"):
            if status == "done":
                print(f"{run_dir} is finished: skipping training (force=true reruns it)")
            else:

                train(cfg, run_dir, ctx)
        if cfg.stage == "all":
            evaluated = evaluate(cfg, run_dir, ctx)
            if ctx.is_main:
                report(cfg, only_experiment=cfg.experiment.name)
    finally:
        release_run_dir(run_dir)  # a multirun sweep runs its jobs in this one process
    return SKIPPED if status == "done" and not evaluated else None


def check_cache_env() -> None:
    """$HIF8QAT_CACHE (models, tokens, evaluation data) must be a folder this process can write, before any
    run folder exists."""
    path = os.environ.get("HIF8QAT_CACHE")
    problem = folder_problem(path) if path else None
    prefilled = bool(path) and Path(path).expanduser().is_dir() and any(Path(path).expanduser().iterdir())
    if problem and not (prefilled and "not writable" in problem):  # a shared read-only cache, filled: used
        raise RunError(f"HIF8QAT_CACHE={path} cannot hold the project's cache: {problem}. Point it at a "
                       "writable folder, or unset it (default ~/.cache/hif8qat)")
