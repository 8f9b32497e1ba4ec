"""What this profile can and cannot show of the paper's effects: each claim's estimate here beside the effect
the paper reports for the same pair of runs, and whether the claim's own test could resolve that effect."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from hif8qat.report.claims import ONE_SEED
from hif8qat.report.paper import PAPER_RUNS, paper_drop_table, read_authors_run
from hif8qat.report.paths import PAPER_DIR
from hif8qat.stats.item_flips import items_needed_flip_model

# The paper's loss pairs among its eight runs (E6 has no published log) and the tasks it scores that the
# profiles here evaluate (MMLU in its cloze form here, lettered 5-shot in the paper).
_LOSS_PAIRS = [("E8", "E7"), ("E2", "E1"), ("E3", "E1"), ("E4", "E1"), ("E5", "E1")]
_TASK_HERE = {"mmlu": "mmlu_continuation", "hellaswag": "hellaswag", "arc_challenge": "arc_challenge"}


def paper_loss_gap(quantized: pd.DataFrame, baseline: pd.DataFrame) -> tuple[float, int]:
    """Signed mean per-step loss difference over the quantized run's QAT phase (steps it logged with quant
    ON), in % of the baseline's loss: the quantity the claims measure here.

    Args:
        quantized: the quantized run's log.
        baseline: the baseline's log.

    Returns:
        ``(gap in %, number of QAT steps)``."""
    both = quantized.merge(baseline, on="step", suffixes=("_q", "_b"))
    qat = both[both["quant_q"].astype(str).str.upper() == "ON"]
    diff = (qat["loss_q"] - qat["loss_b"]) / qat["loss_b"] * 100
    return float(diff.mean()), len(diff)


def paper_effects(paper_dir: Path = PAPER_DIR) -> pd.DataFrame:
    """The paper's effect per (experiment, counterpart, metric, task), as this project's claims express it:
    train_loss from the authors' per-step logs, accuracy drops (% of the baseline's score) from their newest
    evaluation summary that holds the pair.

    Args:
        paper_dir: the folder of the authors' data.

    Returns:
        One row per effect, with ``paper_effect`` and ``paper_basis``."""
    rows = []
    logs = {key: read_authors_run(paper_dir / "authors_runs" / f"{PAPER_RUNS[key]}.csv.gz")[1]
            for key in {k for pair in _LOSS_PAIRS for k in pair}}
    for q, b in _LOSS_PAIRS:
        gap, n = paper_loss_gap(logs[q], logs[b])
        rows.append({"experiment": f"exp{q[1:]}", "counterpart": f"exp{b[1:]}", "metric": "train_loss",
                     "task": "loss", "paper_effect": gap, "paper_basis": f"{n} QAT steps, {q} vs {b}"})
    drops = paper_drop_table(paper_dir)
    drops = drops[drops["quant_exp"].str.fullmatch(r"E\d") & drops["task"].isin(_TASK_HERE)]
    for (q, b, task), group in drops.groupby(["quant_exp", "baseline_exp", "task"]):
        newest = group.sort_values("summary_file").iloc[-1]
        rows.append({"experiment": f"exp{q[1:]}", "counterpart": f"exp{b[1:]}", "metric": "accuracy",
                     "task": _TASK_HERE[task], "paper_effect": float(newest["drop_pct_from_scores"]),
                     "paper_basis": f"{task} {int(newest['num_fewshot'])}-shot, {newest['summary_file']}"})
    return pd.DataFrame(rows)


# Full sizes of the benchmarks (test splits; HellaSwag validation), the most items an accuracy test can use.
BENCHMARK_ITEMS = {"mmlu_continuation": 14_042, "hellaswag": 10_042, "arc_challenge": 1_172}


def parse_sizes(text) -> dict[int, int]:
    """A claim row's ``changed_by_size`` ("1:3 2:1": three items changed by one answer net over the seeds, one
    by two).

    Args:
        text: the cell.

    Returns:
        ``{size: count}``; empty for a blank or missing cell."""
    if not isinstance(text, str) or not text.strip():
        return {}
    return {int(w): int(c) for w, c in (part.split(":") for part in text.split())}


def items_needed(paper_effect: float, base_pct: float, n_items: int, sizes: dict[int, int], k: int) -> float:
    """Items the claim's own item test needs to detect the paper's relative drop with 80 % power, under the
    flip model its MDE states (:func:`hif8qat.stats.item_flips.items_needed_flip_model`). The seeds score the same
    items, so this counts items, not items per seed.

    Args:
        paper_effect: the paper's relative drop, %.
        base_pct: the baseline's score here, %.
        n_items: items here.
        sizes: ``{size: count}`` of the items that changed here.
        k: seeds.

    Returns:
        The number of items; NaN for no effect or no items."""
    net = abs(paper_effect) / 100 * base_pct / 100
    if net == 0 or n_items <= 0:
        return math.nan
    return items_needed_flip_model(net, n_items, sizes, k)


def reach_verdict(paper_effect: float, mde: float, ci_lo: float, ci_hi: float, n: float, unit_of_n: str) -> str:
    """Whether the claim's own test can resolve the paper's effect (its minimum detectable cost is at most
    that effect), else how large a sample it would need; and whether the estimate here agrees with the paper's
    (its 95 % interval holds the paper's value).

    Args:
        paper_effect: the paper's effect.
        mde: the claim's minimum detectable cost.
        ci_lo: the claim's 95 % interval, lower bound.
        ci_hi: its upper bound.
        n: the sample the test would need (NaN: cannot be sized).
        unit_of_n: what ``n`` counts, in words.

    Returns:
        The verdict in words."""
    agrees = ("consistent with the paper" if ci_lo <= paper_effect <= ci_hi
              else "differs from the paper (95 % CI excludes its value)")
    if not math.isfinite(n):
        return f"{agrees}; too few items flip to size a test"
    if mde is not None and math.isfinite(mde) and mde <= abs(paper_effect):
        return f"resolvable; {agrees}"
    return f"not resolvable: needs about {n:,.0f} {unit_of_n}; {agrees}"


def reach_table(claims: pd.DataFrame, effects: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per claim row here that the paper also measured (against its BF16 baseline, the bf16 mode for
    accuracy): estimate, 95 % CI, equivalence verdict, minimum detectable cost, the paper's effect, and the
    reach verdict of :func:`reach_verdict`.

    Args:
        claims: the claims table.
        effects: the paper's effects (None: :func:`paper_effects`).

    Returns:
        The table; empty when there are no claims."""
    if claims.empty:
        return pd.DataFrame()
    effects = paper_effects() if effects is None else effects
    here = claims[(claims["against"] == "baseline") & claims["mode"].isin(["bf16", "train"])]
    if "run_tag" in here:
        here = here[here["run_tag"].fillna("") == ""]  # the experiment as defined, not a sweep point
    merged = here.merge(effects, on=["experiment", "counterpart", "metric", "task"], how="inner")
    if merged.empty:
        return pd.DataFrame()
    def needed(r) -> float:
        if r.metric == "train_loss":  # between-seed spread dominates: more seeds, not more steps
            return math.ceil(r.n_seeds * (r.mde / abs(r.paper_effect)) ** 2) if math.isfinite(r.mde) else math.nan
        items = items_needed(r.paper_effect, r.base, int(r.n_units), parse_sizes(r.changed_by_size), int(r.n_seeds))
        return math.ceil(items) if math.isfinite(items) else math.nan

    merged["needed"] = [needed(r) for r in merged.itertuples()]
    merged["reach"] = [reach_verdict(r.paper_effect, r.mde, r.ci_lo, r.ci_hi, r.needed,
                                     "seeds" if r.metric == "train_loss"
                                     else f"items at {r.n_seeds} seed(s) "
                                          f"(the benchmark holds {BENCHMARK_ITEMS[r.task]:,})")
                       if r.equivalence != ONE_SEED else
                       f"{ONE_SEED}: its interval lacks the seed variance, so it is not set against the paper's"
                       for r in merged.itertuples()]
    cols = ["experiment", "counterpart", "mode", "task", "metric", "unit", "n_seeds", "cost", "ci_lo", "ci_hi",
            "margin", "equivalence", "mde", "paper_effect", "paper_basis", "needed", "reach"]
    return merged[cols].sort_values(["experiment", "metric", "task"]).reset_index(drop=True)


def reach_section(reach: pd.DataFrame) -> list[str]:
    """The reach table in words, for the claims section.

    Args:
        reach: the table of :func:`reach_table`.

    Returns:
        Markdown lines; empty for an empty table."""
    if reach.empty:
        return []
    lines = ["#### What this profile can show of the paper's effects", "",
             "Each claim measured here that the paper also measured: the estimate here (95 % CI), the paper's "
             "effect for the same pair of runs (its training loss as here, the signed per-step difference over the "
             "QAT phase; its accuracy drops few-shot, MMLU lettered), this claim's minimum detectable cost, and "
             "the sample the test would need to resolve the paper's effect.", "",
             "| claim | metric | task | seeds | here (95 % CI) | paper | MDE here | reach |",
             "|---|---|---|---|---|---|---|---|"]
    for r in reach.itertuples():
        mde = f"{r.mde:.2f}" if math.isfinite(r.mde) else "-"
        lines.append(f"| {r.experiment} vs {r.counterpart} | {r.metric} | {r.task} | {r.n_seeds} | {r.cost:+.2f} "
                     f"({r.ci_lo:+.2f} to {r.ci_hi:+.2f}) | {r.paper_effect:+.2f} | {mde} | {r.reach} |")
    return lines + [""]
