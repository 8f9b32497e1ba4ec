"""Pairing: each run with its same-seed BF16 baseline and the run of the experiment it derives from, or no pair
and why (one rule, :func:`hif8qat.runs.folders.find_baseline_run`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from hif8qat.report.sources import RunInfo, get_dotted, label_of, tag_of
from hif8qat.runs.folders import find_baseline_run


def _pair(run: RunInfo, experiment: str | None, runs: list[RunInfo], runs_root: Path, profile: str,
          may_differ: Sequence[str]) -> tuple[RunInfo | None, str]:
    """The run of ``experiment`` that ``run`` is compared with (same seed, same training settings apart from
    ``may_differ``; :func:`hif8qat.runs.folders.find_baseline_run`), or None and the reason."""

    if not experiment:
        return None, ""
    path, why = find_baseline_run(runs_root, profile, str(experiment), run.path, may_differ=may_differ)
    if path is None:
        return None, why
    found = {r.path.resolve(): r for r in runs}.get(path.resolve())
    return (found, "") if found else (None, f"{path} is not a run the report could read")


def pair_runs(runs: list[RunInfo], runs_root: Path, profile: str):
    """Each run's BF16 baseline (quant.* may differ) and the run of the experiment it derives from (its declared
    changes may differ): same seed and training settings, else None.

    Args:
        runs: the runs read.
        runs_root: the folder that holds the runs.
        profile: the profile's name.

    Returns:
        ``(baseline_of, parent_of, pairing table, unpaired runs with their reasons)``; the dicts are keyed by run
        folder."""
    baseline_of, parent_of, rows, unpaired = {}, {}, [], []
    for r in runs:
        b, why_b = _pair(r, r.baseline, runs, runs_root, profile, ("quant",))
        parent_name = get_dotted(r.config, "experiment.derived_from")
        p, why_p = _pair(r, parent_name, runs, runs_root, profile,
                         list(get_dotted(r.config, "experiment.changes", []) or []))
        baseline_of[str(r.path)], parent_of[str(r.path)] = b, p
        rows.append({"experiment": r.experiment, "run_tag": tag_of(r), "seed": r.seed, "run": label_of(r),
                     "baseline": r.baseline, "baseline_run": label_of(b), "baseline_unpaired": why_b,
                     "derived_from": parent_name, "derived_from_run": label_of(p), "derived_from_unpaired": why_p})
        unpaired += [f"{label_of(r)} vs {why}" for why in (why_b, why_p) if why]
    return baseline_of, parent_of, pd.DataFrame(rows), unpaired
