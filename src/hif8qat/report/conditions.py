"""Like with like for evaluations: the conditions two evaluations of ``results.json`` were made under
(``_meta``: scoring, shots, subset, batch size, data, lm-eval, numerics) and which of them differ. The report
compares two evaluations' scores only where none does: a difference in how they were evaluated would read as
the quantization's."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hif8qat.artefacts import RESULTS_SCHEMA
from hif8qat.evaluate.outputs import ITEMS_KEY, recorded_scoring
from hif8qat.report.sources import read_report_json

# Evaluation-wide conditions compared as recorded.
_WIDE = ("dtype", "batch_size", "limit", "seed", "lm_eval_version")
# The numerics as the training pairing rule reads a run's: the numerics mode, the device type and whether BF16 has
# native kernels count; the CPU's instruction set (cpu_capability) does not.
_NUMERICS = ("numerics", "device_type", "native_bf16")
_PER_TASK = ("metric", "filter", "num_fewshot", "mini")
# Every _meta key an evaluation writes is one or the other (a test reads the evaluation's code to hold it so).
CONDITION_KEYS = frozenset({"scoring", *_WIDE, "numerics", "autocast", "device", "tasks", "subset", "subset_seed",
                            "data_root", "local_datasets"})
# The mode and its quantized format are what is compared; the number of ranks gives the same answers (tested).
NOT_CONDITION_KEYS = frozenset({"mode", "quant", "ranks", "wall_time_s", "provenance", "eval_tokens",
                                "eval_tokens_by_rank", "run_dir", "export_dir", "paths_relative_to"})
_UNRECORDED = object()  # a key an older results.json lacks: its value then is not known, so it is not compared
AGAIN = ("to compare them, evaluate one again with the other's evaluation settings, the older one for scoring: "
         "python run.py <that run's settings> stage=eval force=true")
# What each comparison table's note says of the column.
EVAL_DIFFERS_NOTE = ("eval_differs: the evaluation conditions in which the two evaluations differ (scoring, a task's "
                     "shots, metric or subset, the data, batch size, lm-eval version, numerics; "
                     "hif8qat.report.conditions); where any does, the drop and its interval are left empty and no "
                     "claim pools that seed's task, since the difference would read as the quantization's.")


def _show(value: Any) -> str:
    return "none" if value is None else str(value)


def _subset(meta: Mapping[str, Any], task: str) -> Any:
    if not isinstance(meta.get("subset"), Mapping):
        return _UNRECORDED
    s = meta["subset"].get(task)
    if not isinstance(s, Mapping):
        return "all items"
    return f"{s.get('size')} of {s.get('of')} items (seed {s.get('seed', meta.get('subset_seed'))})"


def _data(meta: Mapping[str, Any], task: str) -> Any:
    local = meta.get("local_datasets") if isinstance(meta.get("local_datasets"), Mapping) else {}
    if task in local:
        return local[task]
    if (meta.get("tasks") or {}).get(task, {}).get("mini"):
        return "the packaged mini tasks"
    return meta.get("data_root", _UNRECORDED) or "lm-eval's hub datasets"


def _numerics(meta: Mapping[str, Any]) -> dict[str, Any]:
    num = meta.get("numerics") if isinstance(meta.get("numerics"), Mapping) else {}
    found = {k: num[k] for k in _NUMERICS if k in num}
    if "device_type" not in found and isinstance(meta.get("device"), str):
        found["device_type"] = meta["device"].split(":")[0]
    if "autocast" in meta:  # what an evaluation recorded before the numerics block (which implies it)
        found["autocast"] = meta["autocast"]
    return found


def evaluation_differences(a: Mapping[str, Any], b: Mapping[str, Any], tasks: Iterable[str] | None = None
                           ) -> list[str]:
    """The conditions two evaluations were made under that differ, as ``"<setting>: <a> vs <b>"`` lines
    (``scoring: packed vs cached``, ``hellaswag num_fewshot: 10 vs 0``). A key one of them lacks was recorded
    before it existed: ``scoring`` then reads as ``cached`` (how such evaluations scored), any other is not
    compared. A task's data (its local copy or the data folder, named by path) does not count where both
    evaluations recorded the same hash of the task's items: the items themselves are then the same.

    Args:
        a: one evaluation's results.json (or its ``_meta`` alone, which records no item hashes).
        b: the other's.
        tasks: the tasks whose own conditions count (shots, metric, filter, subset, data); None: every task both
            evaluated.

    Returns:
        The differing conditions, evaluation-wide first, then per task; empty when the two are alike."""
    (meta_a, items_a), (meta_b, items_b) = _meta_and_items(a), _meta_and_items(b)
    diff = []

    def compare(name: str, a: Any, b: Any) -> None:
        if a is not _UNRECORDED and b is not _UNRECORDED and a != b:
            diff.append(f"{name}: {_show(a)} vs {_show(b)}")

    compare("scoring", recorded_scoring(meta_a), recorded_scoring(meta_b))
    for key in _WIDE:
        compare(key, meta_a.get(key, _UNRECORDED), meta_b.get(key, _UNRECORDED))
    num_a, num_b = _numerics(meta_a), _numerics(meta_b)
    both = num_a.keys() & num_b.keys()
    for key in sorted(both - {"autocast"} if "numerics" in both else both):
        compare(key, num_a[key], num_b[key])
    tasks_a, tasks_b = meta_a.get("tasks") or {}, meta_b.get("tasks") or {}
    chosen = sorted(tasks_a.keys() & tasks_b.keys()) if tasks is None else list(tasks)
    for task in chosen:
        ta, tb = tasks_a.get(task) or {}, tasks_b.get(task) or {}
        for key in _PER_TASK:
            compare(f"{task} {key}", ta.get(key, _UNRECORDED), tb.get(key, _UNRECORDED))
        compare(f"{task} subset", _subset(meta_a, task), _subset(meta_b, task))
        if not (isinstance(items_a.get(task), str) and items_a.get(task) == items_b.get(task)):
            compare(f"{task} data", _data(meta_a, task), _data(meta_b, task))
    return diff


def _meta_and_items(doc: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """``(_meta, task -> item hash)`` of a results.json, or of a ``_meta`` block given alone."""
    if "_meta" not in doc and ITEMS_KEY not in doc:
        return doc, {}
    items = doc.get(ITEMS_KEY)
    return doc.get("_meta") or {}, items if isinstance(items, Mapping) else {}


def read_evaluation(eval_dir: Path) -> dict[str, Any]:
    """An evaluation folder's ``results.json`` (read as its scores are: the readers of the scores and samples check
    the integrity record).

    Args:
        eval_dir: the folder (``<run>/eval/<mode>``, or the base model's).

    Returns:
        Its content; {} when the folder has no results.json."""
    path = Path(eval_dir) / "results.json"
    return dict(read_report_json(path, RESULTS_SCHEMA)) if path.exists() else {}


def task_differences(base_eval: Path, other_eval: Path, tasks: Iterable[str]) -> dict[str, str]:
    """Per task, the conditions in which two evaluation folders differ (:func:`evaluation_differences`), joined.

    Args:
        base_eval: one evaluation folder.
        other_eval: the other.
        tasks: the tasks compared.

    Returns:
        Task -> the differing conditions joined by "; " ("" where the two evaluations are alike)."""
    base, other = read_evaluation(base_eval), read_evaluation(other_eval)
    return {t: "; ".join(evaluation_differences(base, other, [t])) for t in tasks}
