"""The lm-eval runner: an in-memory model, an export folder or a run folder evaluated into its eval folder.

lm-eval runs in process, in two modes: ``bf16`` (the saved weights without quantization, as the authors
evaluated) and ``hif8`` (W8A8 simulated inference in the run's 8-bit format, the scalers restored from the export
and frozen). Weights load in FP32; the numerics are resolved by the caller (a
:class:`~hif8qat.compute_dtype.Numerics`, the run's from :mod:`hif8qat.config.numerics`; FP32 when none is given)
and applied around each forward of :class:`hif8qat.evaluate.prefix_lm.SharedContextLM`, which forwards each
multiple-choice context once. Each mode writes ``<run>/eval/<mode>/``: ``results.json`` (task -> metric, value,
stderr, n, num_fewshot; ``_meta`` records what ran), per-item ``samples_<task>.csv`` and lm-eval's own output.
docs/design.md ("Evaluation") describes the modes, numerics, cost, tasks and outputs; the README ("Evaluation
data") the datasets without internet."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hif8qat.compute_dtype import Numerics
from hif8qat.config.eval_tasks import MINITASK_DIR, MODES, resolve_tasks
from hif8qat.evaluate.loading import load_for_eval, quant_eval_meta, weights_cast_once
from hif8qat.evaluate.offline_benchmarks import CACHE_SUBDIR, ensure_installed
from hif8qat.evaluate.outputs import (
    ITEMS_KEY,
    _jsonable,
    _samples_by_task,
    _task_result,
    items_sha256,
    write_eval_dir,
)
from hif8qat.evaluate.prefix_lm import SharedContextLM
from hif8qat.evaluate.ranks import Ranks, summed
from hif8qat.evaluate.subsets import _limited, check_subset, subset_indices
from hif8qat.evaluate.task_data import (
    _forced_offline,
    compiled_jinja_templates,
    libyaml_safe_load,
    lm_eval_task_dirs,
    prepare_paper_tasks,
    selected_docs_only,
)
from hif8qat.runs.folders import provenance

log = logging.getLogger(__name__)


def evaluate_model(
    model,
    tokenizer,
    tasks: str | Iterable[str] = "mini",
    *,
    out_dir: str | Path | None = None,
    mode: str = "bf16",
    batch_size: int = 16,
    limit: int | float | None = None,
    num_fewshot: Mapping[str, int] | None = None,
    local_datasets: Mapping[str, str | os.PathLike] | None = None,
    device: str | None = None,
    numerics: Numerics | None = None,
    seed: int = 1234,
    subset: Mapping[str, int | None] | str | None = None,
    subset_seed: int = 0,
    offline_data: bool = False,
    extra_meta: Mapping[str, Any] | None = None,
) -> dict:
    """Evaluate an in-memory model with lm-eval; write the eval folder when ``out_dir`` is given.

    The model is used as it is (the caller puts a QAT model into the wanted mode, e.g. by
    :func:`hif8qat.quant.linear.freeze_scales`; :func:`evaluate_export` does it from an export folder). lm-eval's
    ``samples`` selects a subset's documents, so per-sample doc ids are the documents' indices in the full split.

    Args:
        model: the model.
        tokenizer: its tokenizer.
        tasks: ``mini``, ``paper``, ``paper_full``, a task name or a list of them.
        out_dir: where the mode's results go (None: nothing written).
        mode: ``bf16`` or ``hif8`` (recorded; the model is used as it is).
        batch_size: requests per forward.
        limit: first N docs per task (smoke runs; with a subset, the first N of each subtask's subset).
        num_fewshot: task -> shots, overriding the per-task counts.
        local_datasets: hub id or task name -> a local copy of the dataset (README, "Evaluation data").
        device: where the model is (None: where its parameters are).
        numerics: the run's resolved :class:`~hif8qat.compute_dtype.Numerics`; every forward runs under it (e.g.
            the training's bf16 autocast). None: none (FP32).
        seed: lm-eval's random, numpy, torch and few-shot seeds.
        subset: task -> number of documents, a fixed seeded subset (:func:`subset_indices`, stratified by subtask, e.g.
            MMLU subject; ``full``, None or a missing task = every document).
        subset_seed: the subsets' seed.
        offline_data: read the paper tasks' datasets from the offline copies of
            :mod:`hif8qat.evaluate.offline_benchmarks` (installed on first use) unless ``local_datasets`` /
            ``$HIF8QAT_LM_EVAL_DATA`` name another copy.
        extra_meta: more entries for ``results.json``'s ``_meta``.

    Returns:
        The ``results.json`` dict.

    Raises:
        DatasetUnavailableError: a paper task's dataset has no local copy, no cache and no hub (before any model work).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager


    specs = resolve_tasks(tasks)
    device = device or str(next(model.parameters()).device)
    t0 = time.time()
    sizes = check_subset(subset, [s.name for s in specs])
    data_root = None
    if offline_data and any(not s.mini for s in specs):

        data_root = ensure_installed()
    subset_meta: dict[str, dict] = {}
    log_path = None if out_dir is None else Path(out_dir).parent / f"{Path(out_dir).name}.lm_eval.log"
    with (tempfile.TemporaryDirectory(prefix="hif8qat-eval-") as tmp, _quiet_lm_eval(log_path), libyaml_safe_load(),
          compiled_jinja_templates(), selected_docs_only()):
        extra, force_offline = prepare_paper_tasks(specs, local_datasets, Path(tmp), data_root=data_root)
        lm_dirs = lm_eval_task_dirs(specs)
        # later include paths override earlier ones: lm-eval's folders, then the local-dataset overrides
        include = (lm_dirs or []) + [MINITASK_DIR] + extra
        tm = TaskManager(include_path=[str(p) for p in include], include_defaults=lm_dirs is None)
        shots = {s.name: int((num_fewshot or {}).get(s.name, s.num_fewshot)) for s in specs}
        numerics = numerics or Numerics("none", torch.device(device).type)
        ranks = Ranks.current()  # under torchrun: every rank scores its share (hif8qat.evaluate.ranks)
        # log-probabilities in fp32 from the (bf16 under autocast) logits: summed in bf16, an item's
        # log-likelihood of -20..-60 nats is rounded to 0.125-0.25, coarser than the paired per-item differences
        # (gold_ll, gold_margin) that resolve quantization effects, and near-tied choices tie
        lm = SharedContextLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                             numerics=numerics.forward,
                             ranks=ranks, softmax_dtype=torch.float32)
        ctx = _forced_offline() if force_offline else contextlib.nullcontext()
        raw = None
        # no_grad, not inference_mode: autocast keeps no cast copy of a weight in inference mode
        with ctx, torch.no_grad(), weights_cast_once(model):
            # one simple_evaluate per distinct shot count (num_fewshot is global in lm-eval)
            for k in sorted(set(shots.values())):
                names = [n for n, kk in shots.items() if kk == k]
                task_arg, chosen = _select_subsets(tm, names, sizes, subset_seed, limit)
                subset_meta.update(chosen.pop("_meta", {}))
                r = simple_evaluate(
                    model=lm, tasks=task_arg, num_fewshot=k, batch_size=batch_size,
                    limit=None if chosen else limit, samples=chosen or None,
                    task_manager=tm, log_samples=True, bootstrap_iters=1000, random_seed=seed,
                    numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                )
                if r is not None:  # None on the ranks other than LOCAL_RANK 0: they only help score
                    raw = r if raw is None else _merge_lm_eval(raw, r)
    wall = time.time() - t0
    tokens, tokens_by_rank = summed(ranks, lm.token_counts)
    if ranks is not None and ranks.rank != 0:
        return {}  # rank 0 holds the same answers and writes the files
    print(f"eval tokens, {mode} mode: {tokens['per_request']} as lm-eval's HFLM forwards them (one forward per "
          f"request), {tokens['forwarded']} forwarded with shared contexts "
          f"({tokens['per_request'] / max(tokens['forwarded'], 1):.2f}x fewer; {tokens['requests']} requests)")
    results: dict[str, Any] = {}
    samples: dict[str, list] = {}
    for s in specs:
        rows = _samples_by_task(raw["samples"], s, raw.get("group_subtasks", {}))
        samples[s.name] = rows
        results[s.name] = _task_result(raw["results"], s, len(rows), shots[s.name])
    meta = {
        "mode": mode, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": device,
        "autocast": None if numerics.mode == "none" else "bfloat16",
        "numerics": numerics.describe(),
        "batch_size": batch_size, "limit": limit, "seed": seed, "wall_time_s": round(wall, 2),
        "tasks": {s.name: {"metric": s.metric, "filter": s.filter, "num_fewshot": shots[s.name],
                           "mini": s.mini} for s in specs},
        "local_datasets": {k: str(v) for k, v in (local_datasets or {}).items()},
        # Named relative to the cache root: a machine path would not trace anything on another machine.
        "data_root": f"$HIF8QAT_CACHE/{CACHE_SUBDIR}" if data_root else None,
        "subset": subset_meta, "subset_seed": subset_seed,
        # per_request: what lm-eval's HFLM would forward; forwarded: what ran (padding excluded)
        "eval_tokens": tokens,
        # packed or cached: how the shared contexts were scored, which moves bf16 log-likelihoods by its rounding
        "scoring": lm.scoring,
        "ranks": 1 if ranks is None else ranks.world_size,
        **({"eval_tokens_by_rank": tokens_by_rank} if ranks is not None else {}),
        "lm_eval_version": raw.get("lm_eval_version"), "provenance": provenance(),
    }
    if extra_meta:
        meta.update(_jsonable(dict(extra_meta)))
    results["_meta"] = meta
    results[ITEMS_KEY] = {s.name: items_sha256(raw["samples"], s, raw.get("group_subtasks", {})) for s in specs}
    if out_dir is not None:
        write_eval_dir(Path(out_dir), results, samples, raw)
    return results


@contextlib.contextmanager
def _quiet_lm_eval(path: Path | None):
    """The console keeps one bar per evaluation (the requests, with their ETA) and lm-eval's errors.

    lm-eval's INFO and WARNING records (hundreds per evaluation: "Building contexts ...", one line per task) go
    to ``path`` (beside the mode's eval folder), or are dropped below ERROR without one. Its other bars are
    silenced: one per task while it builds the contexts (about 65 for the MMLU subjects alone), one while it
    tokenizes, and datasets' bars when a split is prepared for the first time.
    """
    import datasets
    import lm_eval.api.model
    import lm_eval.api.task

    logger = logging.getLogger("lm_eval")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    console = logging.StreamHandler()
    console.setLevel(logging.ERROR)
    handlers: list[logging.Handler] = [console]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(path, mode="w", encoding="utf-8")
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(to_file)
    logger.handlers, logger.propagate = handlers, False
    logger.setLevel(logging.INFO)
    # lm-eval calls its module's ``tqdm`` name with its own ``disable=``: the replacement overrides that too
    bar_modules = (lm_eval.api.task, lm_eval.api.model)
    saved_bars = [module.tqdm for module in bar_modules]
    for module, bar in zip(bar_modules, saved_bars):
        module.tqdm = functools.partial(_silent_bar, bar)
    datasets_bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    # lm-eval records the working folder's git commit by running git with the console as its stderr: outside
    # a checkout git prints "fatal: not a git repository". The same answer, asked quietly.
    import lm_eval.evaluator

    saved_git = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = _quiet_git_commit_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = saved_git
        for handler in handlers:
            handler.close()
        logger.handlers, logger.level, logger.propagate = saved
        for module, bar in zip(bar_modules, saved_bars):
            module.tqdm = bar
        if datasets_bars:
            datasets.enable_progress_bars()


def _quiet_git_commit_hash() -> str | None:
    """lm-eval's get_git_commit_hash (``git describe --always`` in the working folder, else the commit read
    from a .git folder there), with git's complaints kept off the console."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip()
    return get_commit_from_path(os.getcwd())


def _silent_bar(bar_class, *args, **kwargs):
    return bar_class(*args, **{**kwargs, "disable": True})


def _select_subsets(tm, names: list[str], sizes: Mapping[str, int], seed: int, limit) -> tuple[list, dict]:
    """Tasks for simple_evaluate and lm-eval's ``samples`` (leaf task -> doc indices) for the subsets.

    With a subset among ``names``, every task of the call is built here (its documents must be counted;
    a task without a subset gets all its indices, as ``samples`` replaces ``limit``) and handed to
    simple_evaluate as an object, so no dataset is loaded twice. ``samples["_meta"]``: what was chosen.
    """
    if not any(n in sizes for n in names):
        return names, {}
    task_arg: list = []
    samples: dict[str, Any] = {"_meta": {}}
    for name in names:
        loaded = tm.load([name])
        task_arg.append(loaded["groups"].get(name) or loaded["tasks"][name])
        counts = {leaf: len(t.eval_docs) for leaf, t in loaded["tasks"].items()}
        if name in sizes:
            chosen = subset_indices(counts, sizes[name], seed=seed)
        else:
            chosen = {leaf: list(range(c)) for leaf, c in counts.items()}
        chosen = {leaf: _limited(ix, limit) for leaf, ix in chosen.items()}
        samples.update(chosen)
        samples["_meta"][name] = {"size": sum(len(ix) for ix in chosen.values()), "of": sum(counts.values()),
                                  "subtasks": len(counts), "seed": seed if name in sizes else None}
    return task_arg, samples


def _merge_lm_eval(a: dict, b: dict) -> dict:
    out = dict(a)
    for key in ("results", "samples", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
                "group_subtasks"):
        merged = dict(a.get(key) or {})
        merged.update(b.get(key) or {})
        out[key] = merged
    return out


def evaluate_export(export_dir: str | Path, mode: str, tasks="mini", *, out_dir=None, device: str = "cpu",
                    numerics: Numerics | None = None, trust_remote_code: bool | None = None, **kwargs) -> dict:
    """Evaluate an export folder in one mode: loaded in FP32 (:func:`load_for_eval`), then :func:`evaluate_model`.

    Args:
        export_dir: the export folder.
        mode: ``bf16`` or ``hif8``.
        tasks: ``mini``, ``paper``, ``paper_full``, a task name or a list of them.
        out_dir: where the mode's results go (None: nothing written).
        device: where to load and run the model (a concrete device; the run's is resolved with its numerics).
        numerics: the run's resolved :class:`~hif8qat.compute_dtype.Numerics` (None: FP32, no autocast).
        trust_remote_code: the run's model.trust_remote_code.
        **kwargs: :func:`evaluate_model`'s.

    Returns:
        The ``results.json`` dict."""
    model, tok = load_for_eval(export_dir, mode, device=device, trust_remote_code=trust_remote_code)
    meta = {"export_dir": str(Path(export_dir).resolve()), **kwargs.pop("extra_meta", {})}
    if mode == "hif8":
        meta["quant"] = quant_eval_meta(model, export_dir)
    return evaluate_model(model, tok, tasks, out_dir=out_dir, mode=mode, device=device, numerics=numerics,
                          extra_meta=meta, **kwargs)


def evaluate_run(run_dir: str | Path, modes: Iterable[str] = MODES, tasks="mini", *,
                 results_root: str | Path | None = None, **kwargs) -> dict[str, dict]:
    """Evaluate ``<run>/export`` in each mode into ``<run>/eval/<mode>/``. A run trained without quantization has no
    ``hif8qat_quant.json``; its ``hif8`` mode is skipped with a log message.

    Args:
        run_dir: the run folder.
        modes: the modes.
        tasks: ``mini``, ``paper``, ``paper_full``, a task name or a list of them.
        results_root: what ``results.json`` records ``run_dir`` and ``export_dir`` relative to (default: the folder
            three levels up, ``<root>/<profile>/<experiment>/<run>``), so result files hold no machine paths.
        **kwargs: :func:`evaluate_export`'s.

    Returns:
        Mode -> its ``results.json`` dict."""
    run_dir = Path(run_dir)
    export = run_dir / "export"
    root = Path(results_root) if results_root is not None else run_dir.resolve().parents[2]
    try:
        rel = Path(os.path.relpath(run_dir.resolve(), root.resolve())).as_posix()
    except ValueError:  # another drive (Windows): keep only the folder's name
        rel = run_dir.name
    meta = {"run_dir": rel, "export_dir": f"{rel}/export", "paths_relative_to": "results_root"}
    out = {}
    for mode in modes:
        if mode == "hif8" and not (export / "hif8qat_quant.json").exists():
            log.info("%s: no hif8qat_quant.json in export/, skipping hif8 evaluation", run_dir)
            continue
        out[mode] = evaluate_export(export, mode, tasks, out_dir=run_dir / "eval" / mode,
                                    extra_meta=meta, **kwargs)
    return out
