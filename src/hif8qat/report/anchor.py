"""The anchor: the base model on the full real benchmarks next to the scores HuggingFace published."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from hif8qat.report.paths import ANCHOR_DIR, ANCHOR_PUBLISHED


def anchor_table(anchor_dir: Path = ANCHOR_DIR, published: Path = ANCHOR_PUBLISHED) -> pd.DataFrame:
    """Our evaluations of the base model on the full real sets (``make anchor``) next to the scores HuggingFace
    published for SmolLM2-135M and -Instruct (the CSV, with its source). ``arc_average`` is the mean of arc_easy
    and arc_challenge, as the model card's "ARC (Average)". Rows without our evaluation show the published score
    alone.

    Args:
        anchor_dir: the folder of our evaluations, ``<anchor_dir>/<model>/<shots>/results.json``.
        published: the CSV of published scores.

    Returns:
        The table; empty when the published CSV is missing."""
    if not published.exists():
        return pd.DataFrame()
    pub = pd.read_csv(published)
    ours: dict[str, dict[str, dict]] = {}
    for res in sorted(Path(anchor_dir).glob("*/*/results.json")):
        data = json.loads(res.read_text())
        ours[f"{res.parent.parent.name}/{res.parent.name}"] = {k: v for k, v in data.items() if not k.startswith("_")}
    rows = []
    for (bench, task), g in pub.groupby(["benchmark", "task"], sort=False):
        row = {"benchmark": bench, "task": task, "metric": g["metric"].iloc[0]}
        for _, p in g.iterrows():
            row[f"published {p['model'].split('/')[-1]}"] = p["score_pct"]
        for name, res in ours.items():
            parts = ["arc_easy", "arc_challenge"] if task == "arc_average" else [task]
            if all(t in res for t in parts):
                row[f"ours {name}"] = float(np.mean([res[t]["value"] for t in parts])) * 100.0
                row[f"n {name}"] = int(sum(res[t]["n"] for t in parts))
                row[f"shots {name}"] = "/".join(str(res[t]["num_fewshot"]) for t in parts)
        rows.append(row)
    return pd.DataFrame(rows)


def anchor_beside(runs_root: Path) -> pd.DataFrame:
    """The anchor table from the ``anchor`` folder next to ``runs_root``; else from this repository's.

    Args:
        runs_root: the folder that holds the runs.

    Returns:
        The table (empty when neither has one)."""
    anchor_df = anchor_table(runs_root.parent / "anchor", runs_root.parent / "anchor" / ANCHOR_PUBLISHED.name)
    if anchor_df.empty and ANCHOR_PUBLISHED.exists():
        anchor_df = anchor_table()
    return anchor_df
