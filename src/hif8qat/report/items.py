"""Two evaluations of the same items compared per seed: scores, the relative drop and its interval (exact when
few items flip, else a paired bootstrap), the flips both ways."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hif8qat.report.conditions import task_differences
from hif8qat.report.sources import read_report_json, read_samples
from hif8qat.stats.paired import (
    exact_difference_ci,
    exact_mcnemar_p,
    item_pair,
    paired_bootstrap_drop,
    relative_drop,
)

# Below this many discordant items the percentile bootstrap is anti-conservative: the exact test decides.
EXACT_BELOW_DISCORDANT = 25


def align_samples(base: pd.DataFrame, quant: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Inner-join two ``doc_id,correct`` frames on doc_id (as strings), in the baseline's order.

    Args:
        base: the baseline's per-item frame.
        quant: the run's.

    Returns:
        ``(baseline correct, run correct)`` as float arrays over the common items."""
    b = base.assign(doc_id=base["doc_id"].astype(str)).drop_duplicates("doc_id")
    q = quant.assign(doc_id=quant["doc_id"].astype(str)).drop_duplicates("doc_id")
    m = b.merge(q, on="doc_id", suffixes=("_b", "_q"), how="inner")
    return m["correct_b"].to_numpy(float), m["correct_q"].to_numpy(float)


def _discordant(a: np.ndarray, b: np.ndarray) -> float:
    """Share of items two evaluations score differently (the variance of a paired difference)."""
    return float(np.mean((np.asarray(a) > 0.5) != (np.asarray(b) > 0.5))) if len(a) else float("nan")


def item_stats(xb: np.ndarray, xq: np.ndarray, n_boot: int, seed: int) -> dict[str, Any]:
    """One seed's paired 0/1 items: the relative drop's 95 % interval and significance, from the exact
    conditional McNemar interval and test when fewer than EXACT_BELOW_DISCORDANT items differ, else from the
    paired percentile bootstrap; flips both ways and the exact p-value in every case.

    Args:
        xb: the baseline's per-item scores (0/1).
        xq: the run's, aligned with ``xb`` (:func:`align_samples`).
        n_boot: the bootstrap's resamples (used when it decides).
        seed: the bootstrap's seed.

    Returns:
        ``n_paired``, ``n_lost``, ``n_gained``, ``discordant``, ``p_mcnemar``, ``ci_lo``, ``ci_hi`` (percent),
        ``ci_method`` (``exact`` or ``bootstrap``) and ``significant``."""
    ip = item_pair(xb, xq)
    p = exact_mcnemar_p(ip.lost, ip.gained)
    row = {"n_paired": ip.n, "n_lost": ip.lost, "n_gained": ip.gained, "discordant": _discordant(xb, xq),
           "p_mcnemar": p}
    base = float(np.mean(xb)) if len(xb) else float("nan")
    if ip.discordant < EXACT_BELOW_DISCORDANT:
        lo, hi = exact_difference_ci(ip.lost, ip.gained, ip.n)
        rel = (lambda d: -d / base * 100.0 + 0.0) if base > 0 else (lambda d: float("nan"))
        row.update(ci_lo=rel(hi), ci_hi=rel(lo), ci_method="exact", significant=bool(p < 0.05))
    else:
        ci = paired_bootstrap_drop(xb, xq, n_boot=n_boot, seed=seed)
        row.update(ci_lo=ci.lo, ci_hi=ci.hi, ci_method="bootstrap", significant=ci.significant)
    return row


def paired_comparison(base_eval: Path, other_eval: Path, n_boot: int, seed: int) -> list[dict]:
    """Per task: both scores, the relative drop and its paired interval (:func:`item_stats`), from two eval
    folders; where the two were evaluated differently (:mod:`hif8qat.report.conditions`) no drop, and why.

    Args:
        base_eval: the baseline's eval folder (``results.json``, ``samples_<task>.csv``).
        other_eval: the run's eval folder.
        n_boot: the bootstrap's resamples.
        seed: the bootstrap's seed.

    Returns:
        One row per task in both ``results.json`` files: ``task``, ``base_pct``, ``run_pct``, ``drop_pct``,
        ``eval_differs`` (the evaluation conditions that differ; then ``drop_pct`` is NaN) and the
        :func:`item_stats` columns where both folders hold the task's samples and were evaluated alike."""
    def scores(folder: Path) -> dict:
        path = folder / "results.json"
        if not path.exists():
            return {}
        return {k: v for k, v in read_report_json(path).items() if not k.startswith("_")}

    base, other = scores(base_eval), scores(other_eval)
    differs = task_differences(base_eval, other_eval, [t for t in other if t in base])
    rows = []
    for task, why in differs.items():
        res = other[task]
        row = {"task": task, "base_pct": base[task]["value"] * 100.0, "run_pct": res["value"] * 100.0,
               "drop_pct": float("nan") if why else relative_drop(base[task]["value"], res["value"])}
        bs, rs = read_samples(base_eval / f"samples_{task}.csv"), read_samples(other_eval / f"samples_{task}.csv")
        if bs is not None and rs is not None and not why:
            xb, xr = align_samples(bs, rs)
            row.update(item_stats(xb, xr, n_boot, seed))
        rows.append({**row, "eval_differs": why})
    return rows

