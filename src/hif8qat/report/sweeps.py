"""Sweeps: experiments run under several run tags, the knobs that differ between the tags, and each claim
metric's cost against the baseline per knob value (table and figures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hif8qat.files import save_figure
from hif8qat.report.claims import NOT_RECORDED
from hif8qat.report.figures import _plt
from hif8qat.report.sources import RunInfo, get_dotted, tag_of
from hif8qat.runs.folders import training_differences


def _value(v: Any) -> str:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)


def sweep_table(runs: list[RunInfo], claims: pd.DataFrame, runs_df: pd.DataFrame) -> pd.DataFrame:
    """Sweeps: for each experiment with runs under more than one run tag, the training settings that differ
    between its tags (the knobs, read from the saved configs) and each claim metric against the knob's value:
    the cost against the baseline with its 95 % CI over seeds (the claims table's rows), beside the baseline's
    own seed spread (sd over its seeds of the score, or of the final loss, in % of its mean).

    Args:
        runs: the runs read.
        claims: the claims table.
        runs_df: the runs table.

    Returns:
        One row per (experiment, knob, value, claim metric); empty without claims."""

    if claims.empty:
        return pd.DataFrame()
    by_exp: dict[str, dict[str, dict]] = {}
    for r in sorted(runs, key=lambda r: (r.experiment, tag_of(r), r.seed if r.seed is not None else -1)):
        by_exp.setdefault(r.experiment, {}).setdefault(tag_of(r), r.config)
    rows = []
    for exp, tags in sorted(by_exp.items()):
        if len(tags) < 2:
            continue
        ref = next(iter(tags.values()))
        knobs = sorted(set().union(*(training_differences(ref, c, may_differ=()) for c in tags.values())))
        if not knobs:
            continue
        for tag, cfg in tags.items():
            values = [get_dotted(cfg, k) for k in knobs]
            sub = claims[(claims.experiment == exp) & (claims.run_tag == tag) & (claims.against == "baseline")
                         & (claims.equivalence != NOT_RECORDED)]
            for _, c in sub.iterrows():
                base = runs_df[(runs_df.experiment == c["counterpart"]) & (runs_df.run_tag == "")]
                col = "final_loss" if c["metric"] == "train_loss" else f"bf16:{c['task']}"
                v = base[col].dropna() if col in base else pd.Series(dtype=float)
                spread = float(v.std(ddof=1) / v.mean() * 100) if len(v) > 1 and v.mean() else float("nan")
                num = pd.to_numeric(pd.Series(values), errors="coerce")
                rows.append({"experiment": exp, "knob": ",".join(knobs), "value": ",".join(map(_value, values)),
                             "value_num": float(num.iloc[0]) if len(knobs) == 1 and num.notna().all() else np.nan,
                             "run_tag": tag, "baseline": c["counterpart"], "mode": c["mode"], "task": c["task"],
                             "metric": c["metric"], "unit": c["unit"], "n_seeds": c["n_seeds"], "cost": c["cost"],
                             "ci_lo": c["ci_lo"], "ci_hi": c["ci_hi"], "baseline_seed_sd_pct": spread,
                             "baseline_seeds": len(v)})
    return pd.DataFrame(rows)


def plot_sweeps(sweeps: pd.DataFrame, out: Path, profile: str) -> list[str]:
    """One figure per swept experiment: each metric's cost against the knob's value (95 % CI over seeds), with
    the baseline's seed spread as a band around 0.

    Args:
        sweeps: the table of :func:`sweep_table`.
        out: the figures folder.
        profile: the profile's name.

    Returns:
        The paths written."""
    if sweeps.empty:
        return []
    plt = _plt()
    files = []
    for (exp, knob), g in sweeps.groupby(["experiment", "knob"]):
        panels = list(g.groupby(["mode", "task", "metric"], sort=False))
        fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False)
        for ax, ((mode, task, metric), p) in zip(axes[0], panels, strict=True):
            numeric = p["value_num"].notna().all()
            p = p.sort_values("value_num" if numeric else "value")
            x = p["value_num"].to_numpy() if numeric else np.arange(len(p))
            y = p["cost"].to_numpy(float)
            err = np.vstack([y - p["ci_lo"].to_numpy(float), p["ci_hi"].to_numpy(float) - y])
            ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, lw=0.9)
            sd = p["baseline_seed_sd_pct"].dropna()
            if len(sd) and metric in ("accuracy", "train_loss"):
                ax.axhspan(-sd.iloc[0], sd.iloc[0], color="0.85", label="baseline seed sd")
                ax.legend(fontsize=6)
            ax.axhline(0, color="k", lw=0.6)
            if not numeric:
                ax.set_xticks(x, p["value"], fontsize=6, rotation=20)
            ax.set_title(f"{metric} {task} ({mode})", fontsize=8)
            ax.set_xlabel(knob, fontsize=7)
            ax.set_ylabel(f"cost ({p['unit'].iloc[0]})", fontsize=7)
        fig.suptitle(f"{exp}: cost vs its baseline against {knob}", fontsize=9)
        fig.tight_layout()
        path = out / f"sweep_{profile}_{exp}.png"
        out.mkdir(parents=True, exist_ok=True)
        save_figure(fig, path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    return files

