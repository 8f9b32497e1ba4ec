"""Seeds: the spread of every score and drop over seeds, and the seed null (a BF16 experiment against itself at
another seed: the noise floor of any drop)."""

from __future__ import annotations

import pandas as pd

from hif8qat.report.items import paired_comparison
from hif8qat.report.sources import RunInfo, tag_of


def seed_spread(runs_df: pd.DataFrame, drops_df: pd.DataFrame) -> pd.DataFrame:
    """Mean and sd over seeds of every score (``<mode>:<task>`` columns of the runs table) and drop.

    Args:
        runs_df: the runs table.
        drops_df: the drops table.

    Returns:
        One row per (experiment, tag, score or drop)."""
    rows = []
    for col in [c for c in runs_df.columns if ":" in c]:
        mode, task = col.split(":", 1)
        for (exp, tag), g in runs_df.groupby(["experiment", "run_tag"]):
            v = g[col].dropna()
            if len(v):
                rows.append({"experiment": exp, "run_tag": tag, "what": "score", "mode": mode, "task": task,
                             "n_seeds": len(v), "mean_pct": v.mean(),
                             "sd_pct": v.std(ddof=1) if len(v) > 1 else float("nan"),
                             "min_pct": v.min(), "max_pct": v.max()})
    if len(drops_df):
        for (exp, tag, base, mode, task), g in drops_df.groupby(["experiment", "run_tag", "baseline", "quant_mode",
                                                                 "task"]):
            v = g["drop_pct"].dropna()
            if len(v):
                rows.append({"experiment": exp, "run_tag": tag, "what": f"drop vs {base}", "mode": mode, "task": task,
                             "n_seeds": len(v), "mean_pct": v.mean(),
                             "sd_pct": v.std(ddof=1) if len(v) > 1 else float("nan"), "min_pct": v.min(),
                             "max_pct": v.max()})
    return pd.DataFrame(rows)


def seed_null_table(runs: list[RunInfo], n_boot: int, seed: int) -> pd.DataFrame:
    """Every unquantized experiment against itself at another seed (bf16 evaluations, per task): relative
    drop with its paired CI. Same recipe, same data, only the seed differs: the noise floor of a drop.

    Args:
        runs: the runs read.
        n_boot: bootstrap draws.
        seed: random seed of the draws.

    Returns:
        One row per (experiment, seed pair, task)."""
    rows = []
    by_exp: dict[str, list[RunInfo]] = {}
    for r in runs:
        if not r.quant and not tag_of(r):
            by_exp.setdefault(r.experiment, []).append(r)
    for exp, rs in sorted(by_exp.items()):
        rs = sorted(rs, key=lambda r: (r.seed, not r.done))
        rs = [r for i, r in enumerate(rs) if i == 0 or r.seed != rs[i - 1].seed]  # one run per seed
        for i, a in enumerate(rs):
            for b in rs[i + 1:]:
                rows += [{"experiment": exp, "seed_a": a.seed, "seed_b": b.seed, **row}
                         for row in paired_comparison(a.path / "eval" / "bf16", b.path / "eval" / "bf16",
                                                       n_boot, seed)]
    return pd.DataFrame(rows)
