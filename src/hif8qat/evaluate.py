"""Evaluation with lm-eval, in process, in two modes.

Modes
-----
``bf16``  the saved weights without quantization, as the authors evaluated (their vLLM run used BF16).
``hif8``  W8A8 simulated inference in the run's 8-bit format: the plain model is re-converted from
          ``hif8qat_quant.json`` by :func:`hif8qat.qlinear.load_quant_export`, which restores the scalers'
          final state, and the scales are frozen (:func:`hif8qat.qlinear.freeze_scales`): every quantized
          linear uses the last scales of training, with no history update during evaluation. The mode keeps
          its name for every format: an FP8 run (``quant.format`` e4m3 / e5m2 / hybrid) is evaluated in FP8
          (exports written before FP8 are HiF8). A run whose final algorithm is ``current`` keeps
          just-in-time scaling: each tensor is scaled from its own amax, as in training. ``results.json``
          records what ran under ``_meta.quant`` (format, element format per role, algo, scales).

Device and numerics
-------------------
Weights are always loaded in FP32, the trainer's master weights. ``dtype="bf16"`` runs the forward under
bf16 autocast, exactly as a ``train.autocast=bf16`` training step: in ``hif8`` mode the FP32 weight is
quantized and the matmul runs in bf16 (casting the weights to bf16 first would round them twice before
quantization). ``dtype="fp32"``: no autocast. :func:`resolve_numerics` turns ``auto`` into the training
device and numerics (run.py's ``eval.device`` / ``eval.dtype``); without a training config, ``auto`` is
CUDA when available and bf16 there, fp32 on CPU. ``results.json`` records ``device``, ``dtype`` (of the
weights) and ``autocast`` (the matmul dtype, or null). The numerics are applied in one place, around each
model forward of :class:`hif8qat.prefix_lm.SharedContextLM` (:func:`hif8qat.numerics.forward_context`).

Cost
----
lm-eval's HF model runs each request (context + continuation) as its own forward pass, so a
multiple-choice item pays for its context once per choice. The evaluation runs
:class:`hif8qat.prefix_lm.SharedContextLM` instead: each distinct context is forwarded once and its
continuations are scored from the cached prefix (the same log-likelihoods up to float rounding, tested
against lm-eval's model). ``results.json`` ``_meta.eval_tokens`` records the tokens lm-eval's model
would forward (``per_request``) and those forwarded (``forwarded``; ``forwarded_padded`` with padding),
and both are printed per evaluation.

Tasks
-----
Mini tasks (offline, generated from the fact tables in ``minitasks/``; registered with lm-eval's
``TaskManager(include_path=minitasks/)``): ``mini_mmlu`` (MMLU questions, cloze formulation, 1-shot, acc),
``mini_hellaswag`` (1-shot, acc_norm), ``mini_arc`` (1-shot, acc_norm); ``mini_mmlu_letters`` (MMLU's
lettered A-D format, 5-shot, acc) is registered but not in the ``mini`` suite: SmolLM2-135M scores at
chance on lettered options. Shot counts are small because every item's shots + question are forwarded
once on CPU (see ``minitasks/README.md`` for the token counts). Paper tasks (lm-eval's own configs): ``mmlu`` 5-shot acc,
``hellaswag`` 10-shot acc_norm, ``arc_challenge`` 25-shot acc_norm, optional ``arc_easy`` 25-shot acc_norm
and ``gsm8k`` 5-shot exact_match (flexible-extract); ``mmlu_continuation`` (MMLU's cloze form, acc) for small
models. The mini profile runs the real ones 0-shot on the offline copies of :mod:`hif8qat.evaldata`
(``offline_data``) and on fixed seeded subsets (``subset``; :func:`subset_indices`), selected through
lm-eval's own ``samples`` argument so that per-sample doc ids are the documents' indices in the full split.

Datasets for the paper tasks without internet
---------------------------------------------
Put a copy of each hub dataset repository on disk (on a machine with access:
``huggingface-cli download cais/mmlu --repo-type dataset --local-dir /data/lm_eval/cais/mmlu``, likewise
``Rowan/hellaswag``, ``allenai/ai2_arc``, ``openai/gsm8k``) and either

* set ``HIF8QAT_LM_EVAL_DATA=/data/lm_eval`` (a folder laid out as ``<root>/<hub id>``), or
* pass ``local_datasets={"cais/mmlu": "/data/mmlu", ...}`` (keys: hub id or task name; CLI:
  ``--local-dataset cais/mmlu=/data/mmlu``; Hydra: ``eval.local_datasets``).

For every leaf task that reads one of those datasets, a task YAML is generated in a temporary folder
that ``include``s lm-eval's original YAML and sets ``dataset_path`` to the local folder, under the same
task name; it is registered after lm-eval's own tasks, so it replaces them (groups such as ``mmlu``
pick up the overridden subtasks). A populated ``HF_DATASETS_CACHE`` with ``HF_DATASETS_OFFLINE=1`` works
too. When a dataset is neither local, cached nor reachable on the hub, :class:`DatasetUnavailableError`
is raised before any model work, naming the dataset and these two options (no retry loop: the check
probes the hub with one 3-second connection and then loads strictly offline).

Outputs (run-folder layout of docs/design.md), for each mode in ``<run>/eval/<mode>/``:
``results.json`` ``{task: {metric, value, stderr, n, num_fewshot}, "_meta": {...}}`` (keys starting with
``_`` are not tasks; :func:`load_eval_results` drops them), ``samples_<task>.csv``
(``doc_id,correct,gold_ll,gold_margin``: the gold choice's log-likelihood and its lead over the best wrong
choice, raw and unnormalized, empty where the task has no single gold index),
``lm_eval_results.json`` (lm-eval's own output without the samples) and ``samples_<task>.jsonl.gz``
(per sample: doc id, target, per-choice log-likelihoods and metrics; no prompts).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import gzip
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import RunError
from .registry import hub_reachable

log = logging.getLogger(__name__)

MINITASK_DIR = Path(__file__).resolve().parent / "minitasks"
MODES = ("bf16", "hif8")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16", "bf16_emulated")
LOCAL_DATA_ENV = "HIF8QAT_LM_EVAL_DATA"


@dataclass(frozen=True)
class TaskSpec:
    name: str
    num_fewshot: int
    metric: str  # the sample-level metric the paper reports (acc / acc_norm / exact_match)
    filter: str = "none"
    mini: bool = False
    lm_eval_dir: str | None = None  # folder under lm_eval/tasks holding the task's YAMLs (indexed alone: fast)


TASKS: dict[str, TaskSpec] = {
    "mini_mmlu": TaskSpec("mini_mmlu", 1, "acc", mini=True),
    "mini_hellaswag": TaskSpec("mini_hellaswag", 1, "acc_norm", mini=True),
    "mini_arc": TaskSpec("mini_arc", 1, "acc_norm", mini=True),
    "mini_mmlu_letters": TaskSpec("mini_mmlu_letters", 5, "acc", mini=True),
    "mmlu": TaskSpec("mmlu", 5, "acc", lm_eval_dir="mmlu"),
    # MMLU's cloze formulation (question -> answer text): small models are at chance on lettered options
    "mmlu_continuation": TaskSpec("mmlu_continuation", 5, "acc", lm_eval_dir="mmlu"),
    "hellaswag": TaskSpec("hellaswag", 10, "acc_norm", lm_eval_dir="hellaswag"),
    "arc_challenge": TaskSpec("arc_challenge", 25, "acc_norm", lm_eval_dir="arc"),
    "arc_easy": TaskSpec("arc_easy", 25, "acc_norm", lm_eval_dir="arc"),
    "gsm8k": TaskSpec("gsm8k", 5, "exact_match", filter="flexible-extract", lm_eval_dir="gsm8k"),
}
SUITES: dict[str, tuple[str, ...]] = {
    "mini": ("mini_mmlu", "mini_hellaswag", "mini_arc"),
    "paper": ("mmlu", "hellaswag", "arc_challenge"),
    "paper_full": ("mmlu", "hellaswag", "arc_challenge", "arc_easy", "gsm8k"),
}


class DatasetUnavailableError(RunError):
    """A paper task's dataset is neither on disk, in the datasets cache, nor reachable on the hub."""


class EvalSettingError(RunError):
    """An evaluation device or dtype that this machine or this mode cannot honour."""


# ------------------------------------------------------------------------------------------- task lists
def resolve_tasks(tasks: str | Iterable[str]) -> list[TaskSpec]:
    """``"mini"``/``"paper"``/``"paper_full"``, a comma-separated string, or a list of task names."""
    if isinstance(tasks, str):
        names = list(SUITES[tasks]) if tasks in SUITES else [t.strip() for t in tasks.split(",") if t.strip()]
    else:
        names = []
        for t in tasks:
            names.extend(SUITES.get(t, (t,)))
    out = []
    for n in names:
        if n not in TASKS:
            raise ValueError(f"eval.tasks: unknown task {n!r}; allowed: {sorted(TASKS)} or suites {sorted(SUITES)}")
        out.append(TASKS[n])
    if not out:
        raise ValueError("eval.tasks: no task given")
    return out


# --------------------------------------------------------------------------------- paper-task datasets
def lm_eval_task_dirs(specs: Iterable[TaskSpec]) -> list[Path] | None:
    """lm-eval's own YAML folders for the paper tasks (None = index everything: a task without a folder).

    Indexing only these folders takes a second; lm-eval's full index (~15k YAMLs) takes 10-90 s here.
    """
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).resolve().parent
    dirs: list[Path] = []
    for s in specs:
        if s.mini:
            continue
        if s.lm_eval_dir is None:
            return None
        d = root / s.lm_eval_dir
        if d not in dirs:
            dirs.append(d)
    return dirs


def task_index_for(specs: Iterable[TaskSpec]) -> Mapping[str, Any]:
    from lm_eval.tasks._index import TaskIndex

    dirs = lm_eval_task_dirs(specs)
    if dirs is None:
        from lm_eval.tasks import TaskManager

        return TaskManager().task_index
    return TaskIndex.build(dirs)


def _leaf_tasks(name: str, index: Mapping[str, Any], _seen: set[str] | None = None) -> list[str]:
    """Leaf task names under a task/group/tag name in lm-eval's task index."""
    from lm_eval.tasks._index import Kind

    _seen = set() if _seen is None else _seen
    if name in _seen:
        return []
    _seen.add(name)
    entry = index.get(name)
    if entry is None:
        return []
    if entry.kind in (Kind.TASK, Kind.PY_TASK):
        return [name]
    members: list[str] = []
    if entry.kind == Kind.TAG:
        members = sorted(entry.tags)
    elif entry.kind == Kind.GROUP:
        members = _group_members((entry.cfg or {}).get("task", []))
    out: list[str] = []
    for m in members:
        out.extend(_leaf_tasks(m, index, _seen))
    return out


def _group_members(items) -> list[str]:
    """Task/tag names in a group's ``task:`` list; inline subgroups (``{group: stem, task: [...]}``, as in
    ``mmlu_continuation``) are flattened."""
    out: list[str] = []
    for m in items if isinstance(items, list) else [items]:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, Mapping):
            out.extend(_group_members(m.get("task", [])))
    return out


def _local_dataset_map(local_datasets: Mapping[str, str | os.PathLike] | None) -> dict[str, Path]:
    out = {k: Path(v).expanduser() for k, v in (local_datasets or {}).items()}
    for k, p in out.items():
        if not p.exists():
            raise DatasetUnavailableError(f"eval.local_datasets[{k!r}] = {p} does not exist")
    return out


def _offline_env() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


@contextlib.contextmanager
def _forced_offline():
    """Make datasets/huggingface_hub fail fast instead of retrying an unreachable hub."""
    import datasets.config as dcfg
    import huggingface_hub.constants as hconst

    saved = (dcfg.HF_HUB_OFFLINE, hconst.HF_HUB_OFFLINE, os.environ.get("HF_DATASETS_OFFLINE"))
    dcfg.HF_HUB_OFFLINE = hconst.HF_HUB_OFFLINE = True
    if hasattr(dcfg, "HF_DATASETS_OFFLINE"):
        dcfg.HF_DATASETS_OFFLINE = True
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        yield
    finally:
        dcfg.HF_HUB_OFFLINE, hconst.HF_HUB_OFFLINE = saved[0], saved[1]
        if hasattr(dcfg, "HF_DATASETS_OFFLINE"):
            dcfg.HF_DATASETS_OFFLINE = saved[0]
        if saved[2] is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = saved[2]


def local_splits(folder: Path, config_name: str | None) -> set[str] | None:
    """Splits a hub-style local copy declares for a config (its README ``configs:`` block); None = unknown."""
    import yaml

    readme = Path(folder) / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text(encoding="utf-8")
    if not text.startswith("---"):
        return None
    try:
        meta = yaml.safe_load(text.split("---", 2)[1]) or {}
    except yaml.YAMLError:
        return None
    for cfg in meta.get("configs") or []:
        if cfg.get("config_name", "default") == (config_name or "default"):
            files = cfg.get("data_files")
            return {f["split"] for f in files if isinstance(f, Mapping) and "split" in f} \
                if isinstance(files, list) else None
    return None


def prepare_paper_tasks(
    specs: list[TaskSpec],
    local_datasets: Mapping[str, str | os.PathLike] | None,
    workdir: Path,
    *,
    index: Mapping[str, Any] | None = None,
    check: bool = True,
    data_root: str | os.PathLike | None = None,
) -> tuple[list[Path], bool]:
    """Write override YAMLs for paper tasks with a local dataset copy and check the rest can be loaded.

    A dataset is looked up in ``local_datasets`` (hub id or task name), then under ``$HIF8QAT_LM_EVAL_DATA``,
    then under ``data_root`` (the offline benchmark copies of :mod:`hif8qat.evaldata`). When the local copy
    has no train split and the task takes its few-shot examples from it (HellaSwag, ARC; the offline copies
    ship none), the override also sets ``training_split: null``, so lm-eval's own fallback picks the
    few-shot source: the validation split (ARC: disjoint from test; HellaSwag: the evaluated split, with
    the evaluated document excluded from its own context by lm-eval's sampler).

    Returns (extra include paths, whether evaluation must run with the hub forced offline).
    Raises :class:`DatasetUnavailableError` for a dataset with no local copy, no cache and no hub.
    """
    paper = [s for s in specs if not s.mini]
    if not paper:
        return [], False
    if index is None:
        index = task_index_for(paper)
    local = _local_dataset_map(local_datasets)
    roots = [Path(r) for r in (os.environ.get(LOCAL_DATA_ENV), data_root) if r]
    override_dir = workdir / "task_overrides"
    written = 0
    unresolved: dict[str, tuple[str, str | None]] = {}  # dataset_path -> (first leaf, dataset_name)
    for spec in paper:
        leaves = _leaf_tasks(spec.name, index)
        if not leaves:
            raise ValueError(f"lm-eval has no task named {spec.name!r}")
        for leaf in leaves:
            entry = index[leaf]
            cfg = entry.cfg or {}
            ds_path = cfg.get("dataset_path")
            if not ds_path:
                continue
            target = local.get(leaf) or local.get(spec.name) or local.get(ds_path)
            if target is None:
                target = next((r / ds_path for r in roots if (r / ds_path).exists()), None)
            if target is not None:
                override_dir.mkdir(parents=True, exist_ok=True)
                text = (f"# generated by hif8qat.evaluate: {leaf} on a local copy of {ds_path}\n"
                        f"include: {json.dumps(str(Path(entry.yaml_path).resolve()))}\n"
                        f"task: {json.dumps(leaf)}\n"
                        f"dataset_path: {json.dumps(str(Path(target).resolve()))}\n")
                splits = local_splits(Path(target), cfg.get("dataset_name"))
                train = cfg.get("training_split")
                if splits is not None and train and train not in splits and not cfg.get("fewshot_split"):
                    text += "training_split: null\n"
                (override_dir / f"{leaf}.yaml").write_text(text)
                written += 1
            elif ds_path not in unresolved:
                unresolved[ds_path] = (leaf, cfg.get("dataset_name"))
    force_offline = False
    if unresolved and check:
        online = not _offline_env() and hub_reachable()
        if not online:
            force_offline = True
            missing = []
            with _forced_offline():
                import datasets

                for ds_path, (leaf, ds_name) in unresolved.items():
                    try:
                        datasets.load_dataset(ds_path, ds_name)
                    except Exception as err:  # noqa: BLE001 - any failure means "not available"
                        missing.append(f"  {ds_path} (task {leaf}): {type(err).__name__}: {str(err)[:160]}")
            if missing:
                raise DatasetUnavailableError(
                    "lm-eval datasets not available: the hub is unreachable"
                    + (" (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE set)" if _offline_env() else "")
                    + " and there is no local or cached copy of:\n" + "\n".join(missing)
                    + f"\nProvide a copy of each hub dataset repo and set {LOCAL_DATA_ENV}=<root> (laid out as "
                    "<root>/<hub id>, e.g. <root>/cais/mmlu) or eval.local_datasets={<hub id>: <dir>}; "
                    "or run the mini tasks (eval.tasks=mini)."
                )
    return ([override_dir] if written else []), force_offline


# ---------------------------------------------------------------------------------------- model loading
def resolve_numerics(device: str = "auto", dtype: str = "auto", *, train_device: str | None = None,
                     train_autocast: str | None = None) -> tuple[str, str]:
    """Concrete ``(device, dtype)`` for an evaluation (``dtype``: ``fp32``, ``bf16`` or ``bf16_emulated``, see
    the module doc and :mod:`hif8qat.numerics`).

    ``auto`` follows the training settings when given: device as ``train.device`` resolves (CUDA unless it
    is ``cpu`` or there is no GPU), dtype the training numerics (``train.autocast``, ``auto`` resolved for
    this machine; ``none`` is ``fp32``). Without them: native bf16 where the device has it (CUDA), else fp32.
    Raises :class:`EvalSettingError` for an unknown value or ``cuda`` on a machine without a GPU.
    """
    import torch

    for setting, value, allowed in (("eval.device", device, DEVICES), ("eval.dtype", dtype, DTYPES)):
        if value not in allowed and not (setting == "eval.device" and str(value).startswith("cuda:")):
            raise EvalSettingError(f"invalid setting {setting}={value!r}: allowed one of {', '.join(allowed)}")
    if device == "auto":
        wanted = str(train_device or "auto")
        device = "cpu" if wanted == "cpu" or not torch.cuda.is_available() else wanted.replace("auto", "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalSettingError(f"eval.device={device} but this machine has no CUDA device; use eval.device=cpu "
                               "(or auto: the training device)")
    if dtype == "auto":
        if train_autocast is not None:
            from .numerics import resolve

            compute = resolve(train_autocast, torch.device(device).type)
            dtype = "fp32" if compute == "none" else compute
        else:
            dtype = "bf16" if device.startswith("cuda") else "fp32"
    return device, dtype


def eval_compute(dtype: str | None) -> str:
    """The compute numerics (hif8qat.numerics: none | bf16 | bf16_emulated) of an evaluation dtype."""
    if dtype in (None, "fp32"):
        return "none"
    if dtype in ("bf16", "bf16_emulated"):
        return dtype
    raise EvalSettingError(f"invalid setting eval.dtype={dtype!r}: allowed one of fp32, bf16, bf16_emulated (or auto)")


def load_for_eval(export_dir: str | Path, mode: str, *, device: str = "cpu", trust_remote_code: bool | None = None):
    """Load an exported model folder for evaluation in ``mode``, FP32 weights on ``device`` (module doc).

    trust_remote_code: the run's model.trust_remote_code; an export of a remote-code model (openPangu) keeps
    its ``auto_map`` and modeling file, and loads only with the opt-in its training had."""
    import torch

    if mode not in MODES:
        raise ValueError(f"eval mode {mode!r}; allowed: {MODES}")
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").exists():
        raise FileNotFoundError(f"{export_dir} is not a save_pretrained folder (no config.json)")
    try:
        from .models import load_causal_lm

        model, tok = load_causal_lm(str(export_dir), dtype=torch.float32, trust_remote_code=trust_remote_code)
    except ImportError:  # models.py not available: plain transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(export_dir)
    if mode == "hif8":
        quant_json = export_dir / "hif8qat_quant.json"
        if not quant_json.exists():
            raise FileNotFoundError(f"mode hif8 needs {quant_json} (written by save_quant_export)")
        from .qlinear import freeze_scales, load_quant_export

        load_quant_export(model, export_dir)
        freeze_scales(model, True)
    model.to(device=device)
    model.eval()
    return model, tok


# ------------------------------------------------------------------------------------------ evaluation
def _sample_correct(sample: dict, metric: str) -> int:
    v = sample.get(metric)
    if v is None:
        raise KeyError(f"lm-eval sample has no {metric!r} (keys: {sorted(sample)})")
    return int(round(float(v)))


def _samples_by_task(raw: dict, spec: TaskSpec, group_subtasks: Mapping[str, list]) -> list[tuple[str, int, dict]]:
    """(doc_id, correct, compact sample) for the task's metric; groups use "<subtask>:<doc_id>" ids."""
    leaves = [spec.name] if spec.name in raw else _flatten_group(spec.name, group_subtasks)
    rows = []
    for leaf in leaves:
        for s in raw.get(leaf, []):
            if s.get("filter", "none") != spec.filter:
                continue
            doc_id = str(s["doc_id"]) if leaf == spec.name else f"{leaf}:{s['doc_id']}"
            rows.append((doc_id, _sample_correct(s, spec.metric), _compact_sample(s, doc_id, leaf)))
    return rows


def _flatten_group(name: str, group_subtasks: Mapping[str, list]) -> list[str]:
    out = []
    for child in group_subtasks.get(name, []):
        if child in group_subtasks and group_subtasks[child]:
            out.extend(_flatten_group(child, group_subtasks))
        else:
            out.append(child)
    return out


def _jsonable(x):
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _compact_sample(s: dict, doc_id: str, leaf: str) -> dict:
    keep = {"doc_id": doc_id, "task": leaf, "target": s.get("target"),
            "filtered_resps": s.get("filtered_resps"), "filter": s.get("filter")}
    for m in s.get("metrics", []):
        if m in s:
            keep[m] = s[m]
    return _jsonable(keep)


def _task_result(res: dict, spec: TaskSpec, n: int, nshot: int) -> dict:
    key = f"{spec.metric},{spec.filter}"
    r = res.get(spec.name, {})
    if key not in r:
        raise KeyError(f"lm-eval returned no {key!r} for {spec.name} (keys: {sorted(r)})")
    stderr = r.get(f"{spec.metric}_stderr,{spec.filter}")
    try:
        stderr = float(stderr)
    except (TypeError, ValueError):
        stderr = float("nan")
    return {"metric": spec.metric, "value": float(r[key]), "stderr": stderr, "n": int(n), "num_fewshot": int(nshot)}


def _provenance() -> dict:
    try:
        from .runs import provenance

        return provenance()
    except Exception:  # noqa: BLE001 - runs.py absent or git missing: record what we can
        import platform

        import lm_eval
        import torch
        import transformers

        return {"versions": {"python": platform.python_version(), "torch": torch.__version__,
                             "transformers": transformers.__version__, "lm_eval": lm_eval.__version__}}


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
    dtype: str | None = None,
    seed: int = 1234,
    subset: Mapping[str, int | None] | str | None = None,
    subset_seed: int = 0,
    offline_data: bool = False,
    extra_meta: Mapping[str, Any] | None = None,
) -> dict:
    """Evaluate an in-memory model with lm-eval; write the eval folder when ``out_dir`` is given.

    The model is used as it is (the caller puts a QAT model into the wanted mode, e.g. by
    :func:`hif8qat.qlinear.freeze_scales`; :func:`evaluate_export` does it from an export folder).
    ``dtype="bf16"`` runs every forward under bf16 autocast (the training numerics); None or ``"fp32"``: none.
        ``num_fewshot`` overrides the per-task shot counts (a dict task -> k). ``subset``: task -> number of
    documents, a fixed seeded subset (:func:`subset_indices`, stratified by subtask, e.g. MMLU subject;
    ``"full"``, None or a missing task = every document); lm-eval's ``samples`` selects them, so per-sample
    doc ids are the documents' indices in the full split. ``limit``: first N docs per task (smoke runs;
    with a subset, the first N of each subtask's subset). ``offline_data``: read the paper tasks' datasets
    from the offline copies of :mod:`hif8qat.evaldata` (installed on first use) unless
    ``local_datasets`` / ``$HIF8QAT_LM_EVAL_DATA`` name another copy. Returns the ``results.json`` dict.
    """
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from . import numerics
    from .eval_ranks import Ranks, summed
    from .prefix_lm import SharedContextLM

    specs = resolve_tasks(tasks)
    device = device or str(next(model.parameters()).device)
    t0 = time.time()
    sizes = check_subset(subset, [s.name for s in specs])
    data_root = None
    if offline_data and any(not s.mini for s in specs):
        from .evaldata import CACHE_SUBDIR, ensure_installed

        data_root = ensure_installed()
    subset_meta: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hif8qat-eval-") as tmp:
        extra, force_offline = prepare_paper_tasks(specs, local_datasets, Path(tmp), data_root=data_root)
        lm_dirs = lm_eval_task_dirs(specs)
        # later include paths override earlier ones: lm-eval's folders, then the local-dataset overrides
        include = (lm_dirs or []) + [MINITASK_DIR] + extra
        tm = TaskManager(include_path=[str(p) for p in include], include_defaults=lm_dirs is None)
        task_cfgs: list[str | dict] = []
        shots = {}
        for s in specs:
            k = int((num_fewshot or {}).get(s.name, s.num_fewshot))
            shots[s.name] = k
            task_cfgs.append(s.name)
        compute = eval_compute(dtype)
        device_type = torch.device(device).type
        ranks = Ranks.current()  # under torchrun: every rank scores its share (hif8qat.eval_ranks)
        lm = SharedContextLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                             numerics=functools.partial(numerics.forward_context, compute, device_type),
                             ranks=ranks)
        ctx = _forced_offline() if force_offline else contextlib.nullcontext()
        per_task_shots = {s.name: shots[s.name] for s in specs}
        raw = None
        with ctx, torch.inference_mode():
            # one simple_evaluate per distinct shot count (num_fewshot is global in lm-eval)
            for k in sorted(set(per_task_shots.values())):
                names = [n for n, kk in per_task_shots.items() if kk == k]
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
        "autocast": None if compute == "none" else "bfloat16",
        "numerics": numerics.describe(compute, device_type),
        "batch_size": batch_size, "limit": limit, "seed": seed, "wall_time_s": round(wall, 2),
        "tasks": {s.name: {"metric": s.metric, "filter": s.filter, "num_fewshot": shots[s.name],
                           "mini": s.mini} for s in specs},
        "local_datasets": {k: str(v) for k, v in (local_datasets or {}).items()},
        # Named relative to the cache root: a machine path would not trace anything on another machine.
        "data_root": f"$HIF8QAT_CACHE/{CACHE_SUBDIR}" if data_root else None,
        "subset": subset_meta, "subset_seed": subset_seed,
        # per_request: what lm-eval's HFLM would forward; forwarded: what ran (padding excluded)
        "eval_tokens": tokens,
        "ranks": 1 if ranks is None else ranks.world_size,
        **({"eval_tokens_by_rank": tokens_by_rank} if ranks is not None else {}),
        "lm_eval_version": raw.get("lm_eval_version"), "provenance": _provenance(),
    }
    if extra_meta:
        meta.update(_jsonable(dict(extra_meta)))
    results["_meta"] = meta
    if out_dir is not None:
        write_eval_dir(Path(out_dir), results, samples, raw)
    return results


# ------------------------------------------------------------------------------------------- subsets
def check_subset(subset: Mapping[str, int | None] | str | None, tasks: Iterable[str]) -> dict[str, int]:
    """Validated ``{task: size}`` (tasks evaluated in full left out); raises ValueError naming the setting."""
    if subset is None or subset == "full":
        return {}
    if not isinstance(subset, Mapping):
        raise ValueError(f"eval.subset={subset!r}: allowed 'full' or a mapping task -> number of documents")
    tasks = list(tasks)
    out = {}
    for task, n in subset.items():
        if task not in tasks:
            raise ValueError(f"eval.subset: task {task!r} is not evaluated; allowed: {tasks}")
        if n is None or n == "full":
            continue
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"eval.subset.{task}={n!r}: allowed a positive number of documents or 'full'")
        out[task] = int(n)
    return out


def subset_indices(sizes: Mapping[str, int], n: int, *, seed: int) -> dict[str, list[int]]:
    """A fixed, seeded subset of ``n`` documents over subtasks of ``sizes`` (subtask -> documents).

    Stratified: every subtask keeps at least one document and the rest of ``n`` is shared in proportion
    to the subtasks' sizes (largest remainder). Within a subtask the documents are the first ones of a
    permutation seeded by ``(seed, crc32(subtask name))``: independent of the model, the training seed and
    the other subtasks, and nested (a larger subset contains a smaller one where the allocation grows).
    Returns sorted indices per subtask (lm-eval's ``samples`` needs them sorted); all when ``n`` >= total.
    """
    import zlib

    import numpy as np

    leaves = sorted(sizes)
    total = sum(sizes.values())
    if any(sizes[leaf] < 1 for leaf in leaves):
        raise ValueError(f"subset: empty subtask in {dict(sizes)}")
    if n >= total:
        return {leaf: list(range(sizes[leaf])) for leaf in leaves}
    if n < len(leaves):
        raise ValueError(f"subset of {n} documents cannot cover {len(leaves)} subtasks (one each at least)")
    spare, pool = n - len(leaves), total - len(leaves)
    share = {leaf: spare * (sizes[leaf] - 1) / pool for leaf in leaves}
    alloc = {leaf: 1 + math.floor(share[leaf]) for leaf in leaves}
    rest = n - sum(alloc.values())
    for leaf in sorted(leaves, key=lambda x: (-(share[x] - math.floor(share[x])), x))[:rest]:
        alloc[leaf] += 1
    out = {}
    for leaf in leaves:
        rng = np.random.default_rng([seed, zlib.crc32(leaf.encode())])
        out[leaf] = sorted(int(i) for i in rng.permutation(sizes[leaf])[:alloc[leaf]])
    return out


def _limited(ix: list[int], limit: int | float | None) -> list[int]:
    if limit is None:
        return ix
    return ix[: int(limit) if limit >= 1 else max(1, math.ceil(limit * len(ix)))]


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


def gold_scores(compact: Mapping[str, Any]) -> tuple[float, float]:
    """(log-likelihood of the gold choice, its margin over the best wrong choice) of one logged sample.

    From lm-eval's per-choice ``filtered_resps`` (``[log-likelihood, is_greedy]`` per choice) and the gold
    index ``target``. Raw log-likelihoods: a continuous, paired per-item measure that moves before the item's
    0/1 score does (acc_norm decides on length-normalized ones, so a margin's sign can differ from ``correct``).
    NaN where there is no single integer gold index within the choices or fewer than two choices.
    """
    nan = float("nan")
    target, resps = compact.get("target"), compact.get("filtered_resps")
    if isinstance(target, str) and target.strip().isdigit():
        target = int(target)
    if isinstance(target, bool) or not isinstance(target, int) or not isinstance(resps, list) or len(resps) < 2:
        return nan, nan
    try:
        lls = [float(r[0] if isinstance(r, (list, tuple)) else r) for r in resps]
    except (TypeError, ValueError, IndexError):
        return nan, nan
    if not 0 <= target < len(lls):
        return nan, nan
    wrong = lls[:target] + lls[target + 1:]
    return lls[target], lls[target] - max(wrong)


def write_eval_dir(out: Path, results: dict, samples: dict[str, list], raw: dict | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for task, rows in samples.items():
        with (out / f"samples_{task}.csv").open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["doc_id", "correct", "gold_ll", "gold_margin"])
            for doc_id, correct, compact in rows:
                ll, margin = gold_scores(compact)
                # repr keeps every digit, so paired differences are recomputable exactly; NaN as empty
                w.writerow([doc_id, correct, *("" if math.isnan(v) else repr(v) for v in (ll, margin))])
        with gzip.open(out / f"samples_{task}.jsonl.gz", "wt", encoding="utf-8") as fh:
            for _, _, compact in rows:
                fh.write(json.dumps(compact) + "\n")
    if raw is not None:
        from .models import cache_root

        lm_json = {k: v for k, v in raw.items() if k != "samples"}
        # lm-eval records the offline copies' machine paths: name them relative to the cache root instead
        text = json.dumps(_jsonable(lm_json), indent=1).replace(str(cache_root()), "$HIF8QAT_CACHE")
        (out / "lm_eval_results.json").write_text(text + "\n")
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(_jsonable(results), indent=1) + "\n")
    os.replace(tmp, out / "results.json")


def load_eval_results(path: str | Path) -> dict[str, dict]:
    """Task entries of a ``results.json`` (drops ``_meta`` and other ``_``-prefixed keys)."""
    data = json.loads(Path(path).read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def quant_eval_meta(model, export_dir: str | Path) -> dict:
    """What a quantized evaluation of ``export_dir`` runs: the format per role and how scales are chosen."""
    from .qlinear import hif8_linears, read_quant_export

    doc = read_quant_export(export_dir)
    cfg = doc["config"]
    jit = any(layer.bank.just_in_time for _, layer in hif8_linears(model))
    return {"format": cfg["format"], "element_formats": doc["element_formats"], "margin": cfg["margin"],
            "algo": cfg["algo"],
            "scales": "just-in-time (each tensor's own amax)" if jit else "frozen (final training scales)"}


def evaluate_export(export_dir: str | Path, mode: str, tasks="mini", *, out_dir=None, dtype="auto",
                    device: str = "auto", trust_remote_code: bool | None = None, **kwargs) -> dict:
    device, dtype = resolve_numerics(device, dtype)
    model, tok = load_for_eval(export_dir, mode, device=device, trust_remote_code=trust_remote_code)
    meta = {"export_dir": str(Path(export_dir).resolve()), **kwargs.pop("extra_meta", {})}
    if mode == "hif8":
        meta["quant"] = quant_eval_meta(model, export_dir)
    return evaluate_model(model, tok, tasks, out_dir=out_dir, mode=mode, device=device, dtype=dtype,
                          extra_meta=meta, **kwargs)


def evaluate_run(run_dir: str | Path, modes: Iterable[str] = MODES, tasks="mini", *,
                 results_root: str | Path | None = None, **kwargs) -> dict[str, dict]:
    """Evaluate ``<run>/export`` in each mode into ``<run>/eval/<mode>/``. A run trained without
    quantization has no ``hif8qat_quant.json``; its ``hif8`` mode is skipped with a log message.

    ``results.json`` records ``run_dir`` and ``export_dir`` relative to ``results_root`` (default: the folder
    three levels up, ``<root>/<profile>/<experiment>/<run>``), so result files hold no machine paths."""
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


def format_results(results: Mapping[str, Mapping[str, Any]]) -> str:
    lines = [f"{'task':<20}{'metric':<10}{'value':>8}{'stderr':>8}{'n':>7}{'shots':>6}"]
    for task, r in results.items():
        if task.startswith("_"):
            continue
        lines.append(f"{task:<20}{r['metric']:<10}{100 * r['value']:>7.2f}%{100 * r['stderr']:>7.2f}%"
                     f"{r['n']:>7}{r['num_fewshot']:>6}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lm-eval evaluation of a model, an export folder or a run")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="a run folder: evaluates export/ into eval/<mode>/")
    src.add_argument("--export", type=Path, help="a save_pretrained folder (+ hif8qat files for hif8)")
    src.add_argument("--model", help="a load_causal_lm name (tiny, smollm2_135m) or path; bf16 mode only")
    ap.add_argument("--modes", default="bf16,hif8", help="comma-separated subset of bf16,hif8")
    ap.add_argument("--tasks", default=None, help="mini | paper | paper_full | comma-separated names (default: "
                    "mini, or those of --eval-config)")
    ap.add_argument("--eval-config", type=Path, metavar="YAML",
                    help="take tasks, shots, subsets, batch size and offline_data from an eval config "
                         "(e.g. conf/eval/mini.yaml: the base model on exactly what the runs are evaluated on); "
                         "flags given here win")
    ap.add_argument("--force", action="store_true", help="overwrite an existing --out evaluation")
    ap.add_argument("--out", type=Path, help="output folder (--export/--model); default: print only")
    ap.add_argument("--limit", type=float, default=None, help="first N docs per task (smoke runs)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 16 (or the eval config's)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="auto (bf16 on CUDA, fp32 on CPU) | bf16 (FP32 weights, bf16 autocast) | fp32")
    ap.add_argument("--device", default="auto", help="auto (CUDA when available) | cpu | cuda | cuda:N")
    ap.add_argument("--fewshot", action="append", default=[], metavar="TASK=K")
    ap.add_argument("--local-dataset", action="append", default=[], metavar="HUBID_OR_TASK=DIR")
    ap.add_argument("--subset", action="append", default=[], metavar="TASK=N",
                    help="a fixed seeded subset of N documents of TASK (stratified by subtask)")
    ap.add_argument("--subset-seed", type=int, default=None, help="default 0 (or the eval config's)")
    ap.add_argument("--offline-data", action="store_true",
                    help="paper tasks on the offline benchmark copies (python -m hif8qat.evaldata --install)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    base: dict[str, Any] = {}
    if args.eval_config:
        import yaml

        base = yaml.safe_load(args.eval_config.read_text()) or {}
    limit = base.get("limit") if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    subset = dict(base.get("subset") or {}) if isinstance(base.get("subset"), dict) else base.get("subset")
    if args.subset:
        subset = {**(subset if isinstance(subset, dict) else {}),
                  **{k: int(v) for k, v in (x.split("=", 1) for x in args.subset)}}
    kw = dict(limit=limit, batch_size=args.batch_size or base.get("batch_size", 16),
              num_fewshot={**(base.get("num_fewshot") or {}),
                           **{k: int(v) for k, v in (x.split("=", 1) for x in args.fewshot)}},
              local_datasets={**(base.get("local_datasets") or {}),
                              **dict(x.split("=", 1) for x in args.local_dataset)},
              subset=subset or None, subset_seed=args.subset_seed if args.subset_seed is not None else base.get("subset_seed", 0),
              offline_data=args.offline_data or bool(base.get("offline_data", False)))
    tasks = args.tasks or ",".join(base.get("tasks") or []) or "mini"
    args.tasks = tasks
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.out and not args.force:  # never overwrite a finished evaluation
        done = [p for p in ([args.out] if args.model else [args.out / m for m in modes])
                if (p / "results.json").exists()]
        if done:
            print(f"error: {done[0]}/results.json exists; pass --force to overwrite it or choose another --out",
                  file=sys.stderr)
            return 2
    try:
        device, dtype = resolve_numerics(args.device, args.dtype)
        if args.run_dir:
            res = evaluate_run(args.run_dir, modes, args.tasks, dtype=dtype, device=device, **kw)
        elif args.export:
            res = {m: evaluate_export(args.export, m, args.tasks, out_dir=args.out / m if args.out else None,
                                      dtype=dtype, device=device, **kw) for m in modes}
        else:
            from .models import load_causal_lm

            model, tok = load_causal_lm(args.model)
            model.to(device).eval()
            res = {"bf16": evaluate_model(model, tok, args.tasks, out_dir=args.out, mode="bf16", device=device,
                                          dtype=dtype, extra_meta={"model": args.model}, **kw)}
    except (RunError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for mode, r in res.items():
        meta = r["_meta"]
        print(f"== {mode}  ({meta['wall_time_s']:.1f} s, {meta['device']}, {meta['dtype']} weights, "
              f"autocast {meta['autocast']})")
        print(format_results(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
