"""The report's inputs: discovering the run folders of a profile, reading their result files (metrics, results,
samples, telemetry dumps), and the fields of a run the tables use (seed, tag, format, provenance)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from hif8qat.artefacts import CorruptArtefact, read_csv, read_json, read_yaml
from hif8qat.runs.folders import is_archive
from hif8qat.stats.heldout import run_label


def read_metrics(path: str | Path) -> pd.DataFrame:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn last line of a killed run
    df = pd.DataFrame(rows)
    if "step" in df:
        df = df.drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)
    return df


class UnreadableResultFile(CorruptArtefact):
    """A run's result file (results.json, summary.json, samples) that does not read back: truncated or edited."""


REPORT_REDO = ("Write it again (for a file under eval/<mode>/: run.py ... stage=eval, which redoes a corrupt "
               "mode; for summary.json: retrain with force=true) or move the run out of the results folder")


def _read_json(path: Path) -> Any:
    """A result file through the verified reader, naming the file and the way out when it does not parse."""
    try:
        return read_json(path, REPORT_REDO)
    except CorruptArtefact as err:
        raise UnreadableResultFile(path, err.why, REPORT_REDO) from None


def read_telemetry_dumps(run_dir: Path) -> pd.DataFrame:
    rows = []
    for p in sorted((Path(run_dir) / "telemetry").glob("*.jsonl")):
        with open(p, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return pd.DataFrame(rows)


@dataclass
class RunInfo:
    path: Path
    experiment: str
    baseline: str | None
    seed: int | None
    quant: bool
    paper_run: str | None
    config: dict
    info: dict
    done: bool
    estimator: str


def _get(d: Mapping, dotted: str, default=None):
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return cur


def discover_runs(runs_root: Path, profile: str, skipped: list[dict] | None = None) -> list[RunInfo]:
    """The runs under runs_root/profile; a folder that cannot be used is appended to `skipped` with why."""


    base = Path(runs_root) / profile
    runs = []
    if not base.exists():
        return runs
    for cfg_p in sorted(base.glob("*/*/config_resolved.yaml")):
        d = cfg_p.parent
        if is_archive(d):  # set aside by force=true: its rerun is the run
            continue
        try:  # the verified reader: a file that does not parse, is not UTF-8 or not a mapping is named
            cfg = read_yaml(cfg_p, REPORT_REDO, expect=None) or {}
            if not isinstance(cfg, dict):
                raise CorruptArtefact(cfg_p, f"a YAML {type(cfg).__name__} where a mapping belongs", REPORT_REDO)
            info = read_json(d / "run_info.json", REPORT_REDO) if (d / "run_info.json").exists() else {}
        except CorruptArtefact as err:
            if skipped is not None:
                skipped.append({"run_dir": str(d), "reason": f"{err.path.name} does not parse ({err.why[:120]})"
                                                             ": left out of every table"})
            continue
        algo = _get(cfg, "quant.algo")
        runs.append(RunInfo(
            path=d, experiment=str(_get(cfg, "experiment.name", d.parent.name)),
            baseline=_get(cfg, "experiment.baseline"), seed=_get(cfg, "seed"),
            quant=bool(_get(cfg, "quant.enabled", False)), paper_run=_get(cfg, "experiment.paper_run"),
            config=cfg, info=info, done=(d / "DONE").exists(),
            estimator=(json.dumps(algo, sort_keys=True) if isinstance(algo, dict) else str(algo))
            if _get(cfg, "quant.enabled", False) else "bf16",
        ))
    return runs


def _tag(run: RunInfo) -> str:
    return str(_get(run.config, "run_tag", "") or "")


def _run_label(run: RunInfo | None) -> str:
    return run_label(run.path) if run is not None else ""


def _dirty_of(run: RunInfo) -> bool | None:
    """Whether the run was made from a tree with uncommitted changes (its exact code is not in the commit)."""
    g = run.info.get("git") or _get(run.info, "provenance.git") or {}
    return g.get("dirty") if isinstance(g, Mapping) else None


def _git_of(run: RunInfo):
    g = run.info.get("git") or _get(run.info, "provenance.git") or {}
    return g.get("commit") if isinstance(g, Mapping) else g


def _read_samples(p: Path) -> pd.DataFrame | None:
    """A mode's samples_<task>.csv, whole rows only, with the sha256 its results.json recorded (if any)."""
    if not p.exists():
        return None
    results = p.parent / "results.json"
    recorded = (_read_json(results).get("_files") or {}) if results.exists() else {}
    return read_csv(p, REPORT_REDO, sha256=recorded.get(p.name), dtype={"doc_id": str})


def _eval_results(run: RunInfo, mode: str) -> dict:
    p = run.path / "eval" / mode / "results.json"
    if not p.exists():
        return {}
    data = _read_json(p)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def _format_of(run: RunInfo) -> str:
    """The run's ``quant.format`` (runs from before FP8 are HiF8; BF16 runs: bf16)."""
    return str(_get(run.config, "quant.format", "hif8") or "hif8") if run.quant else "bf16"


def _qat_start(run: RunInfo, metrics: pd.DataFrame) -> int | None:
    """First step of the QAT phase: where the run's log says ``quant``, else after quant.bf16_warmup_steps."""
    if not run.quant:
        return None
    if "quant" in metrics and metrics["quant"].astype(bool).any():
        return int(metrics.loc[metrics["quant"].astype(bool), "step"].min())
    return int(_get(run.config, "quant.bf16_warmup_steps", 0) or 0)


class FilesUsed:
    """The run files the tables were built from, each with the git commits of the runs it belongs to (listed in
    every table's .sources.json)."""

    def __init__(self) -> None:
        self.commits: dict[str, set] = {}

    def add(self, run: RunInfo, *files: Path) -> None:
        for f in files:
            self.commits.setdefault(str(f), set()).add(_git_of(run))

    def listing(self) -> list[dict[str, Any]]:
        return [{"path": p, "git_commits": sorted(c for c in g if c)} for p, g in sorted(self.commits.items())]
