"""The report's inputs: discovering the run folders of a profile, reading their result files (metrics, results,
samples, telemetry dumps), and the fields of a run the tables use (seed, tag, format, provenance)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from hif8qat.artefacts import (
    METRICS_FIELDS,
    RESULTS_SCHEMA,
    RUN_INFO_SCHEMA,
    TELEMETRY_FIELDS,
    CorruptArtefact,
    read_csv,
    read_json,
    read_jsonl,
    read_yaml,
    results_record,
    unverified,
)
from hif8qat.errors import RunError
from hif8qat.evaluate.outputs import ITEMS_KEY
from hif8qat.files import sha256_file
from hif8qat.runs.folders import is_archive, sanitize_tag
from hif8qat.scaling.settings import ROLES, ScalingConfig
from hif8qat.stats.heldout import run_label


def read_metrics(path: str | Path) -> pd.DataFrame:
    """A run's step log; a cut last line (a killed run) is dropped, any other bad line is an error.

    Args:
        path: the run's metrics.jsonl.

    Returns:
        One row per step (the last of a step logged twice), by step.

    Raises:
        UnreadableResultFile: a bad line (the error names the file and what to run)."""
    try:
        rows = read_jsonl(path, REPORT_REDO, fields=METRICS_FIELDS)
    except CorruptArtefact as err:
        raise UnreadableResultFile(path, err.why, REPORT_REDO) from None
    df = pd.DataFrame(rows)
    if "step" in df:
        df = df.drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)
    return df


class UnreadableResultFile(CorruptArtefact):
    """A run's result file (results.json, summary.json, samples) that does not read back: truncated or edited."""


REPORT_REDO = ("Write it again (for a file under eval/<mode>/: run.py ... stage=eval, which redoes a corrupt "
               "mode; for summary.json: retrain with force=true) or move the run out of the results folder")


def read_report_json(path: Path, schema: Any = None) -> Any:
    """A result file through the verified reader, naming the file and the way out when it does not parse or
    a field has the wrong type (``schema``: artefacts.schema_problem).

    Args:
        path: the result file (JSON).
        schema: the schema its value must follow, or None.

    Returns:
        The parsed object.

    Raises:
        UnreadableResultFile: not readable, not a JSON object, or off the schema."""
    try:
        return read_json(path, REPORT_REDO, schema=schema)
    except CorruptArtefact as err:
        raise UnreadableResultFile(path, err.why, REPORT_REDO) from None


def read_telemetry_dumps(run_dir: Path) -> pd.DataFrame:
    """Every telemetry dump of a run (``<run>/telemetry/*.jsonl``) in one frame.

    Args:
        run_dir: the run folder.

    Returns:
        One row per recorded call; empty without dumps.

    Raises:
        UnreadableResultFile: a bad line."""
    rows = []
    for p in sorted((Path(run_dir) / "telemetry").glob("*.jsonl")):
        try:
            rows += read_jsonl(p, REPORT_REDO, fields=TELEMETRY_FIELDS)
        except CorruptArtefact as err:
            raise UnreadableResultFile(p, err.why, REPORT_REDO) from None
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


def get_dotted(d: Mapping, dotted: str, default=None):
    """``d["a"]["b"]`` for ``dotted="a.b"`` in a nested mapping (a run's config), or ``default`` where a key is
    missing.

    Args:
        d: the nested mapping.
        dotted: the keys, joined by dots.
        default: what a missing key (or a non-mapping on the way) gives.

    Returns:
        The value, or ``default``."""
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return cur


def discover_runs(runs_root: Path, profile: str, skipped: list[dict] | None = None) -> list[RunInfo]:
    """The runs under runs_root/profile.

    Args:
        runs_root: the folder that holds the runs.
        profile: the profile's name.
        skipped: collects each folder that cannot be used, with why.

    Returns:
        The runs, in folder order."""


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
            info = (read_json(d / "run_info.json", REPORT_REDO, schema=RUN_INFO_SCHEMA)
                    if (d / "run_info.json").exists() else {})
        except CorruptArtefact as err:
            if skipped is not None:
                skipped.append({"run_dir": str(d), "reason": f"{err.path.name} does not parse ({err.why[:120]})"
                                                             ": left out of every table"})
            continue
        misplaced = placement_problem(d, cfg, profile)
        if misplaced:  # a copied or duplicated folder: counting it would count one run twice
            if skipped is not None:
                skipped.append({"run_dir": str(d), "reason": f"{misplaced}: left out of every table"})
            continue
        algo = get_dotted(cfg, "quant.algo")
        runs.append(RunInfo(
            path=d, experiment=str(get_dotted(cfg, "experiment.name", d.parent.name)),
            baseline=get_dotted(cfg, "experiment.baseline"), seed=get_dotted(cfg, "seed"),
            quant=bool(get_dotted(cfg, "quant.enabled", False)), paper_run=get_dotted(cfg, "experiment.paper_run"),
            config=cfg, info=info, done=(d / "DONE").exists(),
            estimator=(json.dumps(algo, sort_keys=True) if isinstance(algo, dict) else str(algo))
            if get_dotted(cfg, "quant.enabled", False) else "bf16",
        ))
    return runs


def placement_problem(run_dir: Path, cfg: Mapping, profile: str) -> str | None:
    """Why a folder's recorded profile, experiment, seed or run_tag disagrees with where it sits
    (<profile>/<experiment>/seed<k>[-<tag>], the path run.py made for it). A run folder copied into another
    experiment's seed, or duplicated beside its seeds, is not a run.

    Args:
        run_dir: the folder.
        cfg: its saved config.
        profile: the profile's name.

    Returns:
        The reason, or None when it is where its run belongs."""
    seed, tag = get_dotted(cfg, "seed"), str(get_dotted(cfg, "run_tag", "") or "")
    recorded = {"profile": get_dotted(cfg, "profile.name"), "experiment": get_dotted(cfg, "experiment.name")}
    if isinstance(seed, bool) or not isinstance(seed, int):
        return f"its config_resolved.yaml records no integer seed (seed: {seed!r})"
    expected = f"seed{seed}" + (f"-{sanitize_tag(tag)}" if tag else "")
    wrong = [f"{key} {value!r} but it sits under {where!r}" for key, value, where in (
        ("profile", recorded["profile"], profile), ("experiment", recorded["experiment"], run_dir.parent.name))
        if value is not None and str(value) != where]
    if run_dir.name != expected:
        wrong.append(f"seed {seed}{f' and run_tag {tag!r}' if tag else ''}, whose folder is {expected!r}, but "
                     f"it is named {run_dir.name!r}")
    return f"its config_resolved.yaml records {'; '.join(wrong)} (a copied or renamed folder)" if wrong else None


class ItemsDiffer(RunError):
    """Two evaluations in one report scored different items for one task (its data changed between them)."""


def check_same_items(runs: list[RunInfo], runs_root: Path, profile: str) -> int:
    """Refuse when two evaluations of the report recorded different item hashes for one task: pairing their
    per-item results by document id would report a change of data as an effect of training or quantization.
    Every evaluation (each run's eval/<mode>/, and the base model's) is compared, since the report pairs runs
    with their baselines, parents, other seeds and the base model alike. An evaluation that recorded no item
    hash (made before evaluations recorded them) cannot be checked: it is paired as before.

    Args:
        runs: the runs read.
        runs_root: the folder that holds the runs.
        profile: the profile's name.

    Returns:
        How many task evaluations had no hash, for the report's message.

    Raises:
        ItemsDiffer: naming the two evaluations."""
    first: dict[str, tuple[str, Path]] = {}
    unhashed = 0
    folders = [d for r in runs for d in sorted((r.path / "eval").glob("*")) if (d / "results.json").is_file()]
    base_model = Path(runs_root).parent / "base_model" / profile
    if (base_model / "results.json").is_file():
        folders.append(base_model)
    for folder in folders:
        data = read_report_json(folder / "results.json", RESULTS_SCHEMA)
        digests = data.get(ITEMS_KEY) if isinstance(data.get(ITEMS_KEY), dict) else {}
        for task in (k for k in data if not k.startswith("_")):
            digest = digests.get(task)
            if not isinstance(digest, str):
                unhashed += 1
                continue
            seen = first.setdefault(task, (digest, folder))
            if seen[0] != digest:
                raise ItemsDiffer(
                    f"task {task} was scored on different items in {seen[1]} and {folder} (item hashes "
                    f"{seen[0][:12]} and {digest[:12]}): its data changed between the two evaluations, so their "
                    "per-item results cannot be paired. Evaluate the older one again on today's data (python "
                    "run.py ... stage=eval force=true), or move one of the runs out of "
                    f"{Path(runs_root) / profile}; nothing was written")
    return unhashed


def tag_of(run: RunInfo) -> str:
    """The run's ``run_tag`` ("" when it has none).

    Args:
        run: the run.

    Returns:
        The tag, as a string."""
    return str(get_dotted(run.config, "run_tag", "") or "")


def label_of(run: RunInfo | None) -> str:
    """The run's label in tables (its folder, as :func:`hif8qat.stats.heldout.run_label` names it); "" for none.

    Args:
        run: the run, or None.

    Returns:
        ``<experiment>/<seed folder>``, or ""."""
    return run_label(run.path) if run is not None else ""


def dirty_of(run: RunInfo) -> bool | None:
    """Whether the run was made from a tree with uncommitted changes (its exact code is not in the commit).

    Args:
        run: the run.

    Returns:
        The run record's ``dirty`` flag; None where it records none."""
    g = run.info.get("git") or get_dotted(run.info, "provenance.git") or {}
    return g.get("dirty") if isinstance(g, Mapping) else None


def git_of(run: RunInfo):
    """The commit the run was made from, as its run record gives it.

    Args:
        run: the run.

    Returns:
        The commit (``git.commit``, or ``git`` itself where that is not a mapping); None where none is recorded."""
    g = run.info.get("git") or get_dotted(run.info, "provenance.git") or {}
    return g.get("commit") if isinstance(g, Mapping) else g


def read_samples(p: Path) -> pd.DataFrame | None:
    """A mode's samples_<task>.csv, whole rows only, with the sha256 its results.json recorded (if any).

    Args:
        p: the samples file, beside its mode's results.json.

    Returns:
        The per-item rows (``doc_id`` as strings); None when the file does not exist."""
    if not p.exists():
        return None
    results = p.parent / "results.json"
    recorded = (results_record(p.parent, read_report_json(results, RESULTS_SCHEMA), REPORT_REDO)
                if results.exists() else {})
    if not results.exists():  # samples with no results.json beside them: nothing vouches for them
        unverified(p, "there is no results.json beside it recording its sha256", REPORT_REDO)
    return read_csv(p, REPORT_REDO, sha256=recorded.get(p.name), dtype={"doc_id": str})


def eval_results(run: RunInfo, mode: str) -> dict:
    """The run's evaluation ``mode`` by task (its verified results.json without the bookkeeping keys); {} when
    it has none.

    Args:
        run: the run.
        mode: the evaluation mode (a folder under ``<run>/eval``).

    Returns:
        Task -> its results."""
    p = run.path / "eval" / mode / "results.json"
    if not p.exists():
        return {}
    data = read_report_json(p, RESULTS_SCHEMA)
    results_record(p.parent, data, REPORT_REDO)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def targets_of(run: RunInfo) -> str:
    """The scale target of each role, A/W/G ("15/15/224"), from the run's saved quant settings (runs saved before
    ``quant.target`` existed: target_fwd / target_bwd); "" for a BF16 run or settings that do not load.

    Args:
        run: the run.

    Returns:
        The targets joined by "/", in role order, or ""."""
    if not run.quant:
        return ""
    quant = get_dotted(run.config, "quant", {}) or {}
    fields = {f.name for f in dataclasses.fields(ScalingConfig)}
    try:
        targets = ScalingConfig.from_dict({k: v for k, v in quant.items() if k in fields and v is not None}).targets()
    except (TypeError, ValueError):
        return ""
    return "/".join(f"{targets[r]:g}" for r in ROLES)


def format_of(run: RunInfo) -> str:
    """The run's ``quant.format`` (runs from before FP8 are HiF8; BF16 runs: bf16).

    Args:
        run: the run.

    Returns:
        The format's name."""
    return str(get_dotted(run.config, "quant.format", "hif8") or "hif8") if run.quant else "bf16"


def qat_start(run: RunInfo, metrics: pd.DataFrame) -> int | None:
    """First step of the QAT phase: where the run's log says ``quant``, else after quant.bf16_warmup_steps.

    Args:
        run: the run.
        metrics: its step log (:func:`read_metrics`).

    Returns:
        The step; None for a BF16 run."""
    if not run.quant:
        return None
    if "quant" in metrics and metrics["quant"].astype(bool).any():
        return int(metrics.loc[metrics["quant"].astype(bool), "step"].min())
    return int(get_dotted(run.config, "quant.bf16_warmup_steps", 0) or 0)


# What the report reads of every run besides its results: the configuration (pairing, seed, format), the run
# record (commit, dirty tree), the DONE marker (a finished run) and the training summary (wall time).
RUN_FILES = ("config_resolved.yaml", "run_info.json", "DONE", "summary.json")


class FilesUsed:
    """The run files the tables were built from, each with the git commits of the runs it belongs to and its
    sha256 when listed (in every table's .sources.json)."""

    def __init__(self) -> None:
        self.commits: dict[str, set] = {}

    def add(self, run: RunInfo, *files: Path) -> None:
        """Record files read for a run, with the run's commit.

        Args:
            run: the run.
            *files: the files."""
        for f in files:
            self.commits.setdefault(str(f), set()).add(git_of(run))

    def add_run(self, run: RunInfo) -> None:
        """The run's own files the report reads (RUN_FILES), those that exist.

        Args:
            run: the run."""
        self.add(run, *(run.path / name for name in RUN_FILES if (run.path / name).exists()))

    def listing(self) -> list[dict[str, Any]]:
        """Every file recorded, for a table's sources.json.

        Returns:
            One ``{path, sha256, git_commits}`` per file, by path."""
        return [{"path": p, "sha256": sha256_file(p) if Path(p).is_file() else None,
                 "git_commits": sorted(c for c in g if c)} for p, g in sorted(self.commits.items())]
