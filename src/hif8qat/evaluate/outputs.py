"""The evaluation folder: per-task results and per-sample rows from lm-eval's output, written and read back."""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hif8qat.artefacts import FILES_KEY, RESULTS_SCHEMA, read_csv, read_json, results_record, verify_sha256
from hif8qat.config.eval_tasks import TaskSpec
from hif8qat.files import atomic_path, sha256_file, write_bytes, write_json, write_text
from hif8qat.runs.downloads import cache_root


def _sample_correct(sample: dict, metric: str) -> int:
    v = sample.get(metric)
    if v is None:
        raise KeyError(f"lm-eval sample has no {metric!r} (keys: {sorted(sample)})")
    return int(round(float(v)))


def _samples_by_task(raw: dict, spec: TaskSpec, group_subtasks: Mapping[str, list]) -> list[tuple[str, int, dict]]:
    """(doc_id, correct, compact sample) for the task's metric; groups use "<subtask>:<doc_id>" ids."""
    return [(doc_id, _sample_correct(s, spec.metric), _compact_sample(s, doc_id, leaf))
            for leaf, doc_id, s in _task_samples(raw, spec, group_subtasks)]


def _task_samples(raw: dict, spec: TaskSpec, group_subtasks: Mapping[str, list]):
    """(leaf task, doc_id, sample) of every sample the task scored under its filter, a group's by subtask."""
    leaves = [spec.name] if spec.name in raw else _flatten_group(spec.name, group_subtasks)
    for leaf in leaves:
        for s in raw.get(leaf, []):
            if s.get("filter", "none") == spec.filter:
                yield leaf, (str(s["doc_id"]) if leaf == spec.name else f"{leaf}:{s['doc_id']}"), s


ITEMS_KEY = "_items_sha256"  # results.json: per task, a content hash of the exact items that were scored


def items_sha256(raw: dict, spec: TaskSpec, group_subtasks: Mapping[str, list]) -> str:
    """A content hash of the items the task's samples scored: per item its id, the document as lm-eval read it,
    the target and lm-eval's own hashes of document, prompt and target, in doc-id order. Two evaluations with
    the same digest scored the same questions with the same gold answers (and prompts); the report pairs items
    of two evaluations only then.

    Args:
        raw: lm-eval's results with samples.
        spec: the task.
        group_subtasks: group -> its subtasks.

    Returns:
        The hex digest."""
    items = [(doc_id, json.dumps(_jsonable([s.get("doc"), s.get("target"), s.get("doc_hash"), s.get("prompt_hash"),
                                            s.get("target_hash")]), sort_keys=True))
             for _, doc_id, s in _task_samples(raw, spec, group_subtasks)]
    digest = hashlib.sha256()
    for doc_id, content in sorted(items):
        digest.update(f"{doc_id}\t{content}\n".encode())
    return digest.hexdigest()


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


def gold_scores(compact: Mapping[str, Any]) -> tuple[float, float]:
    """The gold choice's log-likelihood and its margin over the best wrong choice, for one logged sample.

    From lm-eval's per-choice ``filtered_resps`` (``[log-likelihood, is_greedy]`` per choice) and the gold
    index ``target``. Raw log-likelihoods: a continuous, paired per-item measure that moves before the item's
    0/1 score does (acc_norm decides on length-normalized ones, so a margin's sign can differ from ``correct``).

    Args:
        compact: the logged sample.

    Returns:
        ``(gold log-likelihood, margin)``; NaN where there is no single integer gold index within the choices or fewer
        than two choices."""
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


EVAL_REDO = "Rerun the same `python run.py ... stage=eval` (it redoes a mode whose files are corrupt)"


def write_eval_dir(out: Path, results: dict, samples: dict[str, list], raw: dict | None) -> None:
    """Write a mode's samples (csv and jsonl.gz per task) and results.json, recording every file's sha256.

    Args:
        out: the mode's folder.
        results: the results to write.
        samples: task -> its per-item rows.
        raw: lm-eval's raw results (its logged samples), or None."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for task, rows in samples.items():
        written += [out / f"samples_{task}.csv", out / f"samples_{task}.jsonl.gz"]
        with atomic_path(out / f"samples_{task}.csv") as tmp, tmp.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["doc_id", "correct", "gold_ll", "gold_margin"])
            for doc_id, correct, compact in rows:
                ll, margin = gold_scores(compact)
                # repr keeps every digit, so paired differences are recomputable exactly; NaN as empty
                w.writerow([doc_id, correct, *("" if math.isnan(v) else repr(v) for v in (ll, margin))])
        # no time stamp and no file name in the gzip header: the same samples give the same bytes (and sha256)
        lines = "".join(json.dumps(compact) + "\n" for _, _, compact in rows)
        write_bytes(out / f"samples_{task}.jsonl.gz", gzip.compress(lines.encode("utf-8"), mtime=0))
    if raw is not None:

        lm_json = {k: v for k, v in raw.items() if k != "samples"}
        # lm-eval records the offline copies' machine paths: name them relative to the cache root instead
        text = json.dumps(_jsonable(lm_json), indent=1).replace(str(cache_root()), "$HIF8QAT_CACHE")
        write_text(out / "lm_eval_results.json", text + "\n")
        written.append(out / "lm_eval_results.json")
    hashes = {p.name: sha256_file(p) for p in written}
    for stale in out.iterdir():  # a redone mode's files of tasks no longer evaluated: superseded, not vouched for
        if stale.is_file() and stale.name not in hashes and (stale.name.startswith("samples_")
                                                              or stale.name == "lm_eval_results.json"):
            stale.unlink()
    # last: its presence marks a finished eval
    write_json(out / "results.json", {**_jsonable(results), FILES_KEY: hashes}, indent=1)


def verify_eval_dir(out: Path) -> dict:
    """A finished mode's results.json, read through the verified reader with every file whose sha256 it
    recorded (and every samples_*.csv, whole rows only).

    Args:
        out: the mode's folder.

    Returns:
        The results.

    Raises:
        CorruptArtefact: naming the first bad file.
        UnverifiedArtefact: a results.json that records no sha256 for a file beside it."""

    results = read_json(out / "results.json", EVAL_REDO, schema=RESULTS_SCHEMA)
    recorded = results_record(out, results, EVAL_REDO)
    for name, digest in recorded.items():
        verify_sha256(out / name, digest, EVAL_REDO)
    for path in sorted(out.glob("samples_*.csv")):
        read_csv(path, EVAL_REDO, dtype={"doc_id": str})
    return results


def load_eval_results(path: str | Path) -> dict[str, dict]:
    """Task entries of a ``results.json`` (drops ``_meta`` and other ``_``-prefixed keys).

    Args:
        path: the file.

    Returns:
        Task -> its entry."""
    data = json.loads(Path(path).read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def recorded_scoring(meta: dict) -> str:
    """How a recorded evaluation scored its shared contexts (results.json ``_meta.scoring``; one recorded before
    packing existed scored them from the KV cache).

    Args:
        meta: the results.json ``_meta``.

    Returns:
        ``"packed"`` or ``"cached"``."""
    return meta.get("scoring") or "cached"


def format_results(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Results as a console table: task, metric, value and stderr in %, n, shots.

    Args:
        results: task -> its entry.

    Returns:
        The table."""
    lines = [f"{'task':<20}{'metric':<10}{'value':>8}{'stderr':>8}{'n':>7}{'shots':>6}"]
    for task, r in results.items():
        if task.startswith("_"):
            continue
        lines.append(f"{task:<20}{r['metric']:<10}{100 * r['value']:>7.2f}%{100 * r['stderr']:>7.2f}%"
                     f"{r['n']:>7}{r['num_fewshot']:>6}")
    return "\n".join(lines)
