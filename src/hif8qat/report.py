"""Tables and figures: accuracy drops with paired confidence intervals, training-loss APE, scaling telemetry.

Definitions (the paper's, as in the authors' log_visualizer and evaluation summary):

* relative drop per task  ``(base - quant) / base * 100`` (percent of the baseline score; positive = worse);
* per seed, the drop's paired 95 % interval: exact (conditional McNemar) when few items differ, else a paired
  percentile bootstrap (the same resampled doc ids for baseline and run, ``n_boot`` times, fixed seed);
* training-loss APE: for every step logged by both runs, ``|L_q - L_b| / |L_b| * 100``; plain mean over all
  common steps, over the last ``last_frac`` of them (the paper: last 1,000 of 10,000 = 10 %) and over the QAT
  phase (the steps after the BF16 warmup, where the quantized run's log says ``quant``); no smoothing. APE is
  unsigned: it measures noise and a systematic gap alike, so the claims use the signed difference instead;
* claims: every run against its same-seed baseline and the experiment it derives from (one pairing rule,
  :func:`hif8qat.runs.find_baseline_run`), pooled over seeds per mode, task and metric (accuracy, the per-item
  gold log-likelihood and margin when recorded, the signed training-loss difference), with an interval from
  between- and within-seed variance, an equivalence verdict against a stated margin, one test per row with
  the seeds pooled, Holm within the claim, and the minimum detectable cost of that test (``hif8qat.stats``);
* seeds: the spread (mean, sd) of each score and drop over seeds and a descriptive seed null (a BF16
  experiment against itself at another seed).

``build_report(runs_root, profile, out_tables, out_figures)`` reads the run folders of docs/design.md
(``results/runs/<profile>/<experiment>/seed<k>/``) and writes ``results/tables/*.csv|md`` and
``results/figures/*.png``; ``python -m hif8qat.report --paper`` (``make paper-tables``) builds the same tables
from the authors' published logs and scores in ``results/paper/`` and prints them.

Every table is written with a sidecar ``<table>.sources.json`` (and a header comment in the ``.md``) naming
the files that produced it and, for run folders, the git commit recorded in their ``run_info.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .errors import RunError
from .files import sha256_file
from .stats import (
    block_variance_of_mean,
    equivalence_verdict,
    exact_difference_ci,
    exact_mcnemar_p,
    item_pair,
    mde_exact_mcnemar,
    mde_from_se,
    mean_variance,
    min_one_way_flips,
    pool_seeds,
)

REPO = Path(__file__).resolve().parents[2]
PAPER_DIR = REPO / "results" / "paper"
TABLES_DIR = REPO / "results" / "tables"
FIGURES_DIR = REPO / "results" / "figures"

# The authors' runs (results/paper/authors_runs) and the pairs whose loss APE the paper family reports.
PAPER_RUNS = {
    "E1": "E1_bf16_lr1e-4", "E2": "E2_cts_lr1e-4", "E3": "E3_dts_mr_lr1e-4", "E4": "E4_dts_es_lr1e-4",
    "E5": "E5_dts_es_hp5_lr1e-4", "E7": "E7_bf16_lr1e-5", "E8": "E8_max_quant_lr1e-5",
    "pilot_bf16": "pilot_bf16_lr1e-4", "pilot_cts": "pilot_cts", "pilot_dts_mr": "pilot_dts_mr",
}
PAPER_APE_PAIRS = [("E8", "E7"), ("E2", "E1"), ("E3", "E1"), ("E4", "E1"), ("E5", "E1"),
                   ("pilot_cts", "pilot_bf16"), ("pilot_dts_mr", "pilot_bf16")]
# Names in the authors' evaluation summaries -> their runs E1..E8 (experiments/README.md).
AUTHORS_RUN_TO_EXP = {"bf16": "E1", "cts": "E2", "dts_exp": "E4|E5", "max_quant": "E6",
                      "bf16_lr1e5": "E7", "max_quant_lr1e5": "E8"}
SUMMARY_TASKS = {"MMLU": "mmlu", "GSM8K": "gsm8k", "MATH500": "minerva_math", "HellaSwag": "hellaswag",
                 "ARC-Easy": "arc_easy", "ARC-Challenge": "arc_challenge"}
HEADLINE_SUMMARY = "summary_20260507_102016.txt"
PAPER_TASK_ORDER = ["mmlu", "hellaswag", "arc_challenge", "arc_easy", "gsm8k", "minerva_math"]


# ================================================================================================ maths
def relative_drop(base: float, quant: float) -> float:
    """``(base - quant) / base * 100``; NaN when the baseline is 0."""
    return float("nan") if base == 0 else (base - quant) / base * 100.0


def loss_ape(steps_q: Sequence[int], loss_q: Sequence[float], steps_b: Sequence[int], loss_b: Sequence[float],
             *, last_frac: float = 0.1, last_n: int | None = None) -> dict[str, float]:
    """Training-loss APE over the steps logged by both runs (mean of ``|Lq - Lb| / |Lb| * 100``).

    ``last_n`` (or ``ceil(last_frac * n_common)``) common steps form the "last" window.
    Returns ``{n_common, ape_all, ape_last, last_n, first_step, last_step}``.
    """
    q = pd.Series(np.asarray(loss_q, float), index=np.asarray(steps_q)).groupby(level=0).last()
    b = pd.Series(np.asarray(loss_b, float), index=np.asarray(steps_b)).groupby(level=0).last()
    common = q.index.intersection(b.index).sort_values()
    if len(common) == 0:
        return {"n_common": 0, "ape_all": float("nan"), "ape_last": float("nan"), "last_n": 0,
                "first_step": None, "last_step": None}
    err = (q[common] - b[common]).abs() / b[common].abs() * 100.0
    n_last = int(last_n) if last_n is not None else max(1, math.ceil(last_frac * len(common)))
    n_last = min(n_last, len(common))
    return {"n_common": int(len(common)), "ape_all": float(err.mean()), "ape_last": float(err.iloc[-n_last:].mean()),
            "last_n": n_last, "first_step": int(common[0]), "last_step": int(common[-1])}


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (NaN stays NaN and does not count as a comparison)."""
    p = np.asarray(pvalues, float)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    order = ok[np.argsort(p[ok], kind="stable")]
    m, running = len(order), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def running_ape(steps_q, loss_q, steps_b, loss_b) -> pd.DataFrame:
    """Per common step: the pointwise APE and its running (cumulative) mean, for the loss figures."""
    q = pd.Series(np.asarray(loss_q, float), index=np.asarray(steps_q)).groupby(level=0).last()
    b = pd.Series(np.asarray(loss_b, float), index=np.asarray(steps_b)).groupby(level=0).last()
    common = q.index.intersection(b.index).sort_values()
    err = (q[common] - b[common]).abs() / b[common].abs() * 100.0
    return pd.DataFrame({"step": common, "ape": err.values, "running_ape": err.expanding().mean().values})


@dataclass
class DropCI:
    base: float
    quant: float
    drop: float
    lo: float
    hi: float
    n: int
    significant: bool


def paired_bootstrap_drop(base_correct: Sequence[float], quant_correct: Sequence[float], *, n_boot: int = 10000,
                          seed: int = 0, ci: float = 0.95) -> DropCI:
    """Relative drop of mean(quant) vs mean(base) on the same documents, with a paired percentile CI.

    Both arrays are per-document 0/1 (or scores) in the same document order.
    """
    b = np.asarray(base_correct, float)
    q = np.asarray(quant_correct, float)
    if b.shape != q.shape or b.ndim != 1:
        raise ValueError(f"paired bootstrap needs equal-length 1-d arrays, got {b.shape} and {q.shape}")
    n = len(b)
    if n == 0:
        nan = float("nan")
        return DropCI(nan, nan, nan, nan, nan, 0, False)
    base, quant = float(b.mean()), float(q.mean())
    rng = np.random.default_rng(seed)
    drops = np.empty(n_boot)
    chunk = max(1, min(n_boot, 2_000_000 // max(n, 1)))
    for start in range(0, n_boot, chunk):
        m = min(chunk, n_boot - start)
        idx = rng.integers(0, n, size=(m, n))
        mb, mq = b[idx].mean(1), q[idx].mean(1)
        with np.errstate(divide="ignore", invalid="ignore"):
            drops[start:start + m] = np.where(mb > 0, (mb - mq) / mb * 100.0, np.nan)
    alpha = (1.0 - ci) / 2.0
    lo, hi = np.nanquantile(drops, [alpha, 1.0 - alpha]) if np.isfinite(drops).any() else (np.nan, np.nan)
    drop = relative_drop(base, quant)
    sig = bool(np.isfinite(lo) and np.isfinite(hi) and (lo > 0 or hi < 0))
    return DropCI(base, quant, drop, float(lo), float(hi), n, sig)


def align_samples(base: pd.DataFrame, quant: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Inner-join two ``doc_id,correct`` frames on doc_id (as strings), in the baseline's order."""
    b = base.assign(doc_id=base["doc_id"].astype(str)).drop_duplicates("doc_id")
    q = quant.assign(doc_id=quant["doc_id"].astype(str)).drop_duplicates("doc_id")
    m = b.merge(q, on="doc_id", suffixes=("_b", "_q"), how="inner")
    return m["correct_b"].to_numpy(float), m["correct_q"].to_numpy(float)


def _clipped_column(metrics: pd.DataFrame, role: str) -> pd.Series:
    """Per-step clipped-value counts of ``role``: ``clipped_count`` (HiF8 overflow or FP8 clipping), or
    ``overflow_count`` in logs written before FP8 (the same HiF8 count)."""
    out = pd.Series(np.nan, index=metrics.index, dtype=float)
    for name in ("overflow_count", "clipped_count"):  # the newer name wins where both exist
        c = f"tel/{role}/{name}"
        if c in metrics:
            out = pd.to_numeric(metrics[c], errors="coerce").combine_first(out)
    return out


def telemetry_summary(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per role, from the ``tel/<role>/<stat>`` columns of metrics.jsonl (steps with telemetry only).

    Columns: steps, frac_steps_ratio_gt1 (steps whose max amax/estimate > 1), max_ratio, frac_calls_ratio_gt1
    (calls with amax > estimate over all calls), clipped_total (values beyond the format's range on statistics
    calls: HiF8 overflow, FP8 clipping), stats_calls, clipped_per_stats_call, max_exceed_frac, nonfinite_total,
    max_amax.
    """
    roles = sorted({c.split("/")[1] for c in metrics.columns if c.startswith("tel/") and c.count("/") == 2})
    rows = []
    for r in roles:
        def col(stat, _r=r):
            c = f"tel/{_r}/{stat}"
            return pd.to_numeric(metrics[c], errors="coerce") if c in metrics else pd.Series(dtype=float)

        ratio = col("amax_ratio_max")
        valid = ratio.notna() & (ratio > 0)
        calls, gt1 = col("calls"), col("amax_ratio_gt1")
        clipped, stats = _clipped_column(metrics, r), col("stats_calls")
        rows.append({
            "role": r,
            "steps": int(valid.sum()),
            "frac_steps_ratio_gt1": float((ratio[valid] > 1).mean()) if valid.any() else float("nan"),
            "max_ratio": float(ratio[valid].max()) if valid.any() else float("nan"),
            "frac_calls_ratio_gt1": float(gt1.sum() / calls.sum()) if len(calls) and calls.sum() > 0 else float("nan"),
            "clipped_total": float(clipped.sum()) if clipped.notna().any() else float("nan"),
            "stats_calls": float(stats.sum()) if len(stats) else float("nan"),
            "clipped_per_stats_call": float(clipped.sum() / stats.sum())
            if clipped.notna().any() and len(stats) and stats.sum() > 0 else float("nan"),
            "max_exceed_frac": float(col("exceed_frac_max").max()) if len(col("exceed_frac_max")) else float("nan"),
            "nonfinite_total": float(col("nonfinite_count").sum()) if len(col("nonfinite_count")) else float("nan"),
            "max_amax": float(col("amax_max").max()) if len(col("amax_max")) else float("nan"),
        })
    return pd.DataFrame(rows)


# ============================================================================================ file I/O
def read_authors_run(path: str | Path) -> tuple[list[str], pd.DataFrame]:
    """One of the authors' per-step logs: ('#' header lines, DataFrame step, loss, lr, quant, ...)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        header = []
        for line in fh:
            if not line.startswith("#"):
                break
            header.append(line[1:].strip())
    return header, pd.read_csv(path, comment="#")


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


class UnreadableResultFile(RunError):
    """A run's result file (results.json, summary.json) that does not parse: a truncated or edited file."""


def _read_json(path: Path) -> Any:
    """json.loads of a result file, naming the file and the way out when it does not parse."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnreadableResultFile(f"{path} is unreadable ({type(err).__name__}: {err}); it was truncated or "
                                   "edited. Write it again (for eval/<mode>/results.json: run.py ... stage=eval "
                                   "force=true; for summary.json: retrain with force=true) or move the run out of "
                                   "the results folder") from None


def _sha256(path: Path) -> str:
    return sha256_file(path)[:16]


def _fmt(v, nd=4):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        return f"{v:.{nd}f}"
    return str(v)


def to_markdown(df: pd.DataFrame, nd: int = 4) -> str:
    if df.empty:
        return "_(no rows)_\n"
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c], nd) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_table(df: pd.DataFrame, out_dir: Path, name: str, *, title: str, sources: Mapping[str, Any],
                nd: int = 4) -> dict[str, str]:
    """``<name>.csv``, ``<name>.md`` (title + source note) and ``<name>.sources.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_p, md_p, src_p = out_dir / f"{name}.csv", out_dir / f"{name}.md", out_dir / f"{name}.sources.json"
    df.to_csv(csv_p, index=False)
    note = sources.get("note", "")
    files = sources.get("files", [])
    md = [f"# {title}", "", f"<!-- sources: {src_p.name} ({len(files)} files) -->"]
    if note:
        md += ["", note]
    md += ["", to_markdown(df, nd)]
    md_p.write_text("\n".join(md))
    src_p.write_text(json.dumps(sources, indent=1, default=str) + "\n")
    return {"csv": str(csv_p), "md": str(md_p), "sources": str(src_p)}


# ===================================================================================== paper tables
def paper_ape_table(paper_dir: Path = PAPER_DIR, *, last_n: int = 1000,
                    pairs: Sequence[tuple[str, str]] = PAPER_APE_PAIRS) -> pd.DataFrame:
    runs_dir = paper_dir / "authors_runs"
    cache: dict[str, pd.DataFrame] = {}

    def load(key):
        if key not in cache:
            cache[key] = read_authors_run(runs_dir / f"{PAPER_RUNS[key]}.csv.gz")[1]
        return cache[key]

    rows = []
    for q, b in pairs:
        dq, db = load(q), load(b)
        a = loss_ape(dq["step"], dq["loss"], db["step"], db["loss"], last_n=last_n)
        a10 = loss_ape(dq["step"], dq["loss"], db["step"], db["loss"], last_frac=0.1)
        rows.append({"quantized": q, "baseline": b, "quant_log": PAPER_RUNS[q], "base_log": PAPER_RUNS[b],
                     "n_common": a["n_common"], "ape_all_pct": a["ape_all"], f"ape_last{last_n}_pct": a["ape_last"],
                     "ape_last10pct_pct": a10["ape_last"], "last10pct_n": a10["last_n"],
                     "final_loss_quant": float(dq["loss"].iloc[-1]), "final_loss_base": float(db["loss"].iloc[-1])})
    return pd.DataFrame(rows)


_NUM = re.compile(r"(-?\d+(?:\.\d+)?)%|N/A")


def parse_summary(path: Path, run_order: Sequence[str]) -> pd.DataFrame:
    """Scores and the authors' printed drops (from unrounded scores) of one evaluation summary.

    ``run_order``: the summary's run columns (first = baseline). Returns rows
    (task, run, score_pct, drop_pct_printed) for every non-baseline run and task.
    """
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^(MMLU|GSM8K|MATH500|HellaSwag|ARC-Easy|ARC-Challenge)\s*\(\s*(\d+)-shot\)", line)
        if not m:
            continue
        task, shots = SUMMARY_TASKS[m.group(1)], int(m.group(2))
        vals = [None if t.group(0) == "N/A" else float(t.group(1)) for t in _NUM.finditer(line[m.end():])]
        k = len(run_order)
        if len(vals) != 2 * k - 1:
            raise ValueError(f"{path.name}: cannot parse {line!r} for runs {run_order}")
        scores, drops = vals[:k], vals[k:]
        for i, run in enumerate(run_order):
            rows.append({"task": task, "num_fewshot": shots, "run": run, "score_pct": scores[i],
                         "drop_pct_printed": None if i == 0 else drops[i - 1]})
    return pd.DataFrame(rows)


def _summary_run_order(scores: pd.DataFrame, summary_file: str) -> list[str]:
    sub = scores[scores["summary_file"] == summary_file]
    return list(dict.fromkeys(sub["run"]))


def paper_drop_table(paper_dir: Path = PAPER_DIR) -> pd.DataFrame:
    """Every published comparison: per summary file, each quantized run vs the summary's baseline."""
    scores = pd.read_csv(paper_dir / "authors_scores.csv")
    rows = []
    for summary in sorted(scores["summary_file"].unique()):
        order = _summary_run_order(scores, summary)
        parsed = parse_summary(paper_dir / "authors_eval" / summary, order)
        base_run = order[0]
        for run in order[1:]:
            for task in PAPER_TASK_ORDER:
                pb = parsed[(parsed.run == base_run) & (parsed.task == task)]
                pq = parsed[(parsed.run == run) & (parsed.task == task)]
                if pb.empty or pq.empty:
                    continue
                sb, sq = pb["score_pct"].iloc[0], pq["score_pct"].iloc[0]
                rows.append({
                    "summary_file": summary, "baseline": base_run, "quantized": run,
                    "baseline_exp": AUTHORS_RUN_TO_EXP.get(base_run, ""), "quant_exp": AUTHORS_RUN_TO_EXP.get(run, ""),
                    "task": task, "num_fewshot": int(pq["num_fewshot"].iloc[0]),
                    "base_pct": sb, "quant_pct": sq,
                    "drop_pct_from_scores": relative_drop(sb, sq) if sb is not None and sq is not None else float("nan"),
                    "drop_pct_printed": pq["drop_pct_printed"].iloc[0],
                })
    df = pd.DataFrame(rows)
    return df.astype({"drop_pct_printed": float})


def paper_headline(drops: pd.DataFrame) -> pd.DataFrame:
    """exp8 vs exp7 on the paper's three tasks (summary_20260507_102016), both drop computations."""
    sub = drops[(drops.summary_file == HEADLINE_SUMMARY) & (drops.quantized == "max_quant_lr1e5")
                & (drops.task.isin(["mmlu", "hellaswag", "arc_challenge", "arc_easy", "gsm8k"]))]
    return sub[["task", "num_fewshot", "base_pct", "quant_pct", "drop_pct_printed", "drop_pct_from_scores"]] \
        .reset_index(drop=True)


def binomial_se_pp(p_pct: float, n: int) -> float:
    p = p_pct / 100.0
    return math.sqrt(p * (1 - p) / n) * 100.0


def build_paper_tables(paper_dir: Path = PAPER_DIR, out_tables: Path | None = None) -> dict[str, pd.DataFrame]:
    """The paper's tables from the authors' data; written to ``out_tables`` when given."""
    ape = paper_ape_table(paper_dir)
    drops = paper_drop_table(paper_dir)
    head = paper_headline(drops)
    tables = {"paper_ape": ape, "paper_drops": drops, "paper_headline": head}
    if out_tables is not None:
        files = sorted(p for p in paper_dir.rglob("*") if p.is_file() and p.name != "README.md")
        src = {"files": [{"path": str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p),
                          "sha256_16": _sha256(p)} for p in files],
               "origin": "authors' repository chengyingyingcs-pixel/ICME_2026_challange_openpangu_pretrain "
                         "(see results/paper/README.md)"}
        notes = {
            "paper_ape": "Training-loss APE (%), mean over common steps of |Lq-Lb|/|Lb|*100; last 1000 steps and "
                         "last 10 % of the common steps.",
            "paper_drops": "Relative drop (%) = (base-quant)/base*100. drop_pct_printed: the authors' summary "
                           "(unrounded scores); drop_pct_from_scores: from the 2-decimal scores.",
            "paper_headline": "exp8 (max_quant_lr1e5) vs exp7 (bf16_lr1e5), summary_20260507_102016. Abstract: "
                              "0.43 % MMLU (= printed 0.4271), 0.58 % HellaSwag, 0.22 % ARC-Challenge "
                              "(= from the rounded scores; the summary prints 0.2320).",
        }
        for name, df in tables.items():
            write_table(df, out_tables, name, title=name.replace("_", " "), sources={**src, "note": notes[name]})
    return tables


def format_paper_tables(tables: Mapping[str, pd.DataFrame]) -> str:
    ape, drops, head = tables["paper_ape"], tables["paper_drops"], tables["paper_headline"]
    out = ["Training-loss APE (authors' logs), % of the baseline loss"]
    out.append(f"  {'quantized':<14}{'baseline':<12}{'steps':>7}{'all':>9}{'last1000':>10}{'last10%':>9}")
    for _, r in ape.iterrows():
        out.append(f"  {r.quantized:<14}{r.baseline:<12}{r.n_common:>7}{r.ape_all_pct:>9.4f}"
                   f"{r.ape_last1000_pct:>10.4f}{r.ape_last10pct_pct:>9.4f}")
    out.append("")
    out.append("Headline: exp8 (max_quant_lr1e5) vs exp7 (bf16_lr1e5), summary_20260507_102016")
    out.append(f"  {'task':<15}{'shots':>5}{'exp7':>8}{'exp8':>8}{'drop printed':>14}{'drop from scores':>18}")
    for _, r in head.iterrows():
        out.append(f"  {r.task:<15}{r.num_fewshot:>5}{r.base_pct:>8.2f}{r.quant_pct:>8.2f}"
                   f"{r.drop_pct_printed:>13.4f}%{r.drop_pct_from_scores:>17.4f}%")
    out.append("  abstract: 0.43 % MMLU, 0.58 % HellaSwag, 0.22 % ARC-Challenge")
    out.append("")
    out.append("All published comparisons (latest summary per pair), drop % as printed by the authors")
    latest = drops.sort_values("summary_file").groupby(["baseline", "quantized", "task"], as_index=False).last()
    piv = latest.pivot_table(index=["baseline", "quantized"], columns="task", values="drop_pct_printed")
    piv = piv[[t for t in PAPER_TASK_ORDER if t in piv.columns]]
    out.append("  " + f"{'baseline':<12}{'quantized':<17}" + "".join(f"{t:>14}" for t in piv.columns))
    for (b, q), row in piv.iterrows():
        out.append("  " + f"{b:<12}{q:<17}" + "".join(f"{v:>14.4f}" if pd.notna(v) else f"{'':>14}" for v in row))
    return "\n".join(out)


# ===================================================================================== our run folders
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
    import yaml

    from .runs import is_archive

    base = Path(runs_root) / profile
    runs = []
    if not base.exists():
        return runs
    for cfg_p in sorted(base.glob("*/*/config_resolved.yaml")):
        d = cfg_p.parent
        if is_archive(d):  # set aside by force=true: its rerun is the run
            continue
        try:
            cfg = yaml.load(cfg_p.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
        except yaml.YAMLError as err:
            if skipped is not None:
                skipped.append({"run_dir": str(d), "reason": f"config_resolved.yaml does not parse ({str(err)[:120]})"
                                                             ": left out of every table"})
            continue
        info = {}
        if (d / "run_info.json").exists():
            try:
                info = json.loads((d / "run_info.json").read_text())
            except json.JSONDecodeError:
                info = {}
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


def _pair(run: RunInfo, experiment: str | None, runs: list[RunInfo], runs_root: Path, profile: str,
          may_differ: Sequence[str]) -> tuple[RunInfo | None, str]:
    """The run of ``experiment`` that ``run`` is compared with (same seed, same training settings apart from
    ``may_differ``; :func:`hif8qat.runs.find_baseline_run`), or None and the reason."""
    from .runs import find_baseline_run

    if not experiment:
        return None, ""
    path, why = find_baseline_run(runs_root, profile, str(experiment), run.path, may_differ=may_differ)
    if path is None:
        return None, why
    found = {r.path.resolve(): r for r in runs}.get(path.resolve())
    return (found, "") if found else (None, f"{path} is not a run the report could read")


def _run_label(run: RunInfo | None) -> str:
    return f"{run.path.parent.name}/{run.path.name}" if run is not None else ""


def _dirty_of(run: RunInfo) -> bool | None:
    """Whether the run was made from a tree with uncommitted changes (its exact code is not in the commit)."""
    g = run.info.get("git") or _get(run.info, "provenance.git") or {}
    return g.get("dirty") if isinstance(g, Mapping) else None


def _git_of(run: RunInfo):
    g = run.info.get("git") or _get(run.info, "provenance.git") or {}
    return g.get("commit") if isinstance(g, Mapping) else g


def _read_samples(p: Path) -> pd.DataFrame | None:
    return pd.read_csv(p, dtype={"doc_id": str}) if p.exists() else None


def _eval_results(run: RunInfo, mode: str) -> dict:
    p = run.path / "eval" / mode / "results.json"
    if not p.exists():
        return {}
    data = _read_json(p)
    return {k: v for k, v in data.items() if not k.startswith("_")}


# Estimators compared on the same recorded amax traces: the paper's three candidates.
REPLAY_ESTIMATORS: dict[str, dict[str, Any]] = {
    "most_recent(30)": {"algo": "most_recent", "history_len": 30},
    "exp_smooth(30)": {"algo": "exp_smooth", "history_len": 30},
    "max(64)": {"algo": "max", "history_len": 64},
}
# Scaled values above 128 leave HiF8's 2-bit-mantissa tier: amax/estimate > 128/15 costs two mantissa bits.
_TWO_BIT_TIER_RATIO = 128.0 / 15.0


def recorded_amax_traces(export_dir: Path) -> dict[str, list[float]]:
    """Per-call amax traces from a run's final scaler state, keyed "<layer>.<role>".

    The scalers keep their last history_len amaxes (newest last); a trace is returned only when it is complete,
    i.e. the scaler was called no more often than its history holds.
    """
    from safetensors.torch import load_file

    path = Path(export_dir) / "hif8qat_scalers.safetensors"
    if not path.exists():
        return {}
    state = load_file(str(path))
    traces = {}
    for key, history in state.items():
        if not key.endswith(".history"):
            continue
        prefix = key[: -len(".history")]
        total = int(state[prefix + ".total"])
        if 0 < total <= history.numel():
            traces[prefix] = history[-total:].double().tolist()
    return traces


def replay_exceedance(traces: Mapping[str, Sequence[float]], estimators: Mapping[str, Mapping[str, Any]] = REPLAY_ESTIMATORS,
                      ) -> pd.DataFrame:
    """How often, and by how much, each estimator's delayed estimate is exceeded on the same traces.

    Every trace is replayed call by call through `scaling.replay` (interval 1); ratio = amax / estimate, where
    estimate = target / scale is what the scale was computed from before the call's own amax was known.
    """
    import torch

    from .scaling import ScalingConfig, replay

    rows = []
    for name, overrides in estimators.items():
        cfg = ScalingConfig.from_dict({**overrides, "interval": 1})
        for role in ("A", "W", "G"):
            ratios = []
            for key, trace in traces.items():
                if not key.endswith("." + role) or not trace:
                    continue
                target = cfg.target_bwd if role == "G" else cfg.target_fwd
                scales = replay(trace, cfg, role=role).double()
                amax = torch.tensor(trace, dtype=torch.float64)
                ratios.append((amax * scales / target).numpy())  # = amax / estimate
            if not ratios:
                continue
            r = np.concatenate(ratios)
            exceeded = r > 1 + 1e-6
            rows.append({"estimator": name, "role": role, "traces": len(ratios), "calls": int(r.size),
                         "frac_exceeded": float(exceeded.mean()),
                         "median_ratio_when_exceeded": float(np.median(r[exceeded])) if exceeded.any() else float("nan"),
                         "p99_ratio": float(np.quantile(r, 0.99)), "max_ratio": float(r.max()),
                         "frac_beyond_2bit_tier": float((r > _TWO_BIT_TIER_RATIO).mean()),
                         "mean_headroom_lost_bits": float(np.log2(np.maximum(r, 1.0)).mean())})
    return pd.DataFrame(rows)


# Below this many discordant items the percentile bootstrap is anti-conservative: the exact test decides.
EXACT_BELOW_DISCORDANT = 25


def _item_stats(xb: np.ndarray, xq: np.ndarray, n_boot: int, seed: int) -> dict[str, Any]:
    """One seed's paired 0/1 items: the relative drop's 95 % interval and significance, from the exact
    conditional McNemar interval and test when fewer than EXACT_BELOW_DISCORDANT items differ, else from the
    paired percentile bootstrap; flips both ways and the exact p-value in every case."""
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


def _paired_comparison(base_eval: Path, other_eval: Path, n_boot: int, seed: int) -> list[dict]:
    """Per task: both scores, the relative drop and its paired bootstrap CI, from two eval folders."""
    def scores(folder: Path) -> dict:
        path = folder / "results.json"
        if not path.exists():
            return {}
        return {k: v for k, v in _read_json(path).items() if not k.startswith("_")}

    base, other = scores(base_eval), scores(other_eval)
    rows = []
    for task, res in other.items():
        if task not in base:
            continue
        row = {"task": task, "base_pct": base[task]["value"] * 100.0, "run_pct": res["value"] * 100.0,
               "drop_pct": relative_drop(base[task]["value"], res["value"])}
        bs, rs = _read_samples(base_eval / f"samples_{task}.csv"), _read_samples(other_eval / f"samples_{task}.csv")
        if bs is not None and rs is not None:
            xb, xr = align_samples(bs, rs)
            row.update(_item_stats(xb, xr, n_boot, seed))
        rows.append(row)
    return rows


# Settings whose one-factor pairs the scaling-pairs table compares (element format, scale algorithm).
SCALING_FACTORS = {"quant.format", "quant.margin", "quant.algo"}


def _format_of(run: RunInfo) -> str:
    """The run's ``quant.format`` (runs from before FP8 are HiF8; BF16 runs: bf16)."""
    return str(_get(run.config, "quant.format", "hif8") or "hif8") if run.quant else "bf16"


def scaling_outcome(metrics: pd.DataFrame) -> dict[str, float]:
    """All roles pooled: share of calls whose amax outgrew the estimate, clipped values per statistics call."""
    roles = sorted({c.split("/")[1] for c in metrics.columns if c.startswith("tel/") and c.count("/") == 2})

    def total(stat):
        cols = [f"tel/{r}/{stat}" for r in roles if f"tel/{r}/{stat}" in metrics]
        return float(sum(pd.to_numeric(metrics[c], errors="coerce").sum() for c in cols)) if cols else float("nan")

    calls, gt1, stats = total("calls"), total("amax_ratio_gt1"), total("stats_calls")
    clipped = float(sum(_clipped_column(metrics, r).sum() for r in roles)) if roles else float("nan")
    return {"calls_exceeded": gt1 / calls if calls > 0 else float("nan"),
            "clipped_per_stats_call": clipped / stats if stats > 0 else float("nan")}


def _scaling_pair(run: RunInfo, other: RunInfo, changes: Sequence[str], metrics_cache: Mapping[str, pd.DataFrame],
                  ape_of: Mapping[tuple, Mapping[str, Any]]) -> dict[str, Any]:
    """One row of the scaling-pairs table: ``run`` and the run it derives from, side by side."""
    row: dict[str, Any] = {"experiment": run.experiment, "counterpart": other.experiment,
                           "changes": ",".join(changes), "seed": run.seed}
    for side, r in (("", run), ("cp_", other)):
        m = metrics_cache[str(r.path)]
        ape = ape_of.get((r.experiment, _tag(r), r.seed), {})
        row.update({f"{side}format": _format_of(r), f"{side}algo": r.estimator,
                    **{f"{side}{k}": v for k, v in (scaling_outcome(m) if len(m) else {}).items()},
                    f"{side}ape_qat_pct": ape.get("ape_qat_pct", float("nan")),
                    f"{side}final_loss": float(m["loss"].iloc[-1]) if "loss" in m and len(m) else float("nan")})
    return row


def _discordant(a: np.ndarray, b: np.ndarray) -> float:
    """Share of items two evaluations score differently (the variance of a paired difference)."""
    return float(np.mean((np.asarray(a) > 0.5) != (np.asarray(b) > 0.5))) if len(a) else float("nan")


def _qat_start(run: RunInfo, metrics: pd.DataFrame) -> int | None:
    """First step of the QAT phase: where the run's log says ``quant``, else after quant.bf16_warmup_steps."""
    if not run.quant:
        return None
    if "quant" in metrics and metrics["quant"].astype(bool).any():
        return int(metrics.loc[metrics["quant"].astype(bool), "step"].min())
    return int(_get(run.config, "quant.bf16_warmup_steps", 0) or 0)


def seed_spread(runs_df: pd.DataFrame, drops_df: pd.DataFrame) -> pd.DataFrame:
    """Mean and sd over seeds of every score (``<mode>:<task>`` columns of the runs table) and drop."""
    rows = []
    for col in [c for c in runs_df.columns if ":" in c]:
        mode, task = col.split(":", 1)
        for (exp, tag), g in runs_df.groupby(["experiment", "run_tag"]):
            v = g[col].dropna()
            if len(v):
                rows.append({"experiment": exp, "run_tag": tag, "what": "score", "mode": mode, "task": task, "n_seeds": len(v),
                             "mean_pct": v.mean(), "sd_pct": v.std(ddof=1) if len(v) > 1 else float("nan"),
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
    drop with its paired CI. Same recipe, same data, only the seed differs: the noise floor of a drop."""
    rows = []
    by_exp: dict[str, list[RunInfo]] = {}
    for r in runs:
        if not r.quant and not _tag(r):
            by_exp.setdefault(r.experiment, []).append(r)
    for exp, rs in sorted(by_exp.items()):
        rs = sorted(rs, key=lambda r: (r.seed, not r.done))
        rs = [r for i, r in enumerate(rs) if i == 0 or r.seed != rs[i - 1].seed]  # one run per seed
        for i, a in enumerate(rs):
            for b in rs[i + 1:]:
                rows += [{"experiment": exp, "seed_a": a.seed, "seed_b": b.seed, **row}
                         for row in _paired_comparison(a.path / "eval" / "bf16", b.path / "eval" / "bf16",
                                                       n_boot, seed)]
    return pd.DataFrame(rows)


# ======================================================================================= claims
# Equivalence margins (two one-sided tests), in the unit of each metric's cost; positive cost = the run is worse.
# accuracy: % of the baseline score (the paper's drops are 0.2-0.6 %); train_loss: % of the baseline's loss
# (the paper's APE is 0.11 %); gold_ll / gold_margin: nats per item.
DEFAULT_MARGINS = {"accuracy": 1.0, "train_loss": 0.25, "gold_ll": 0.02, "gold_margin": 0.02}
METRIC_UNITS = {"accuracy": "% of score", "train_loss": "% of loss", "gold_ll": "nats", "gold_margin": "nats"}
ITEM_METRICS = ("gold_ll", "gold_margin")  # per-item columns of samples_<task>.csv, when the run recorded them
NOT_RECORDED = "not recorded in this run"
LOSS_BLOCK = 5  # consecutive steps per block for the within-seed variance of the loss difference


def _signed_loss_difference(mq: pd.DataFrame, mb: pd.DataFrame, from_step: int | None) -> tuple[float, float, int]:
    """Mean over common steps (from ``from_step``) of ``(Lq - Lb) / Lb * 100``, the variance of that mean from
    blocks of LOSS_BLOCK steps, and the number of steps."""
    if "loss" not in mq or "loss" not in mb or not len(mq) or not len(mb):
        return float("nan"), float("nan"), 0
    q = mq.set_index("step")["loss"].astype(float)
    b = mb.set_index("step")["loss"].astype(float)
    common = q.index.intersection(b.index).sort_values()
    if from_step is not None:
        common = common[common >= from_step]
    if not len(common):
        return float("nan"), float("nan"), 0
    rel = ((q[common] - b[common]) / b[common] * 100.0).to_numpy()
    return float(rel.mean()), block_variance_of_mean(rel, LOSS_BLOCK), int(len(rel))


def seed_contrasts(run: RunInfo, other: RunInfo, against: str, metrics_cache: Mapping[str, pd.DataFrame]
                   ) -> list[dict[str, Any]]:
    """One seed's paired contrasts of ``run`` against ``other``: per evaluation mode and task the accuracy
    (points, run minus other; flips both ways) and the recorded per-item metrics (cost: other minus run), and
    the signed training-loss difference (% of other's loss, from the run's QAT phase).

    ``against``: "baseline" (every mode of the run against the baseline's bf16 evaluation), "derived_from"
    (bf16 against bf16, and the quantized mode against the other's when both are quantized) or "bf16_mode"
    (``other`` is ``run``: its quantized evaluation against its own bf16 one, the cost of quantized inference;
    no training-loss row)."""
    head = {"experiment": run.experiment, "run_tag": _tag(run), "against": against, "counterpart": other.experiment,
            "seed": run.seed, "run": _run_label(run), "counterpart_run": _run_label(other),
            "dirty": bool(_dirty_of(run) or _dirty_of(other))}
    rows = []
    if against != "bf16_mode":
        mq, mb = metrics_cache[str(run.path)], metrics_cache[str(other.path)]
        d, v, n = _signed_loss_difference(mq, mb, _qat_start(run, mq) if run.quant else None)
        rows.append({**head, "mode": "train", "task": "loss", "metric": "train_loss", "n": n, "recorded": n > 0,
                     "diff": d, "var": v, "base": float("nan"), "lost": 0, "gained": 0})
    modes = [("bf16", "bf16"), ("hif8", "bf16" if against == "baseline" else "hif8")]
    if against == "bf16_mode":
        modes = [("hif8", "bf16")]
    for mode, other_mode in modes:
        if mode == "hif8" and not (run.quant and (against != "derived_from" or other.quant)):
            continue
        base_res = _eval_results(other, other_mode)
        for task in _eval_results(run, mode):
            if task not in base_res:
                continue
            bs = _read_samples(other.path / "eval" / other_mode / f"samples_{task}.csv")
            qs = _read_samples(run.path / "eval" / mode / f"samples_{task}.csv")
            if bs is None or qs is None:
                continue
            m = bs.drop_duplicates("doc_id").merge(qs.drop_duplicates("doc_id"), on="doc_id", suffixes=("_b", "_q"))
            ip = item_pair(m["correct_b"].to_numpy(float), m["correct_q"].to_numpy(float))
            at = {**head, "mode": mode, "task": task}
            rows.append({**at, "metric": "accuracy", "n": ip.n, "recorded": ip.n > 0, "diff": ip.diff * 100.0,
                         "var": ip.var * 1e4, "base": float(m["correct_b"].mean()) * 100.0, "lost": ip.lost,
                         "gained": ip.gained})
            for col in ITEM_METRICS:
                cb, cq = f"{col}_b", f"{col}_q"
                ok = cb in m and cq in m and bool(np.isfinite(m[[cb, cq]].to_numpy(float)).all()) and len(m) > 1
                cost = (m[cb].to_numpy(float) - m[cq].to_numpy(float)) if ok else np.array([])
                rows.append({**at, "metric": col, "n": len(cost), "recorded": ok,
                             "diff": float(cost.mean()) if ok else float("nan"),
                             "var": mean_variance(cost) if ok else float("nan"),
                             "base": float(m[cb].mean()) if ok else float("nan"),
                             "lost": int((cost > 0).sum()), "gained": int((cost < 0).sum())})
    return rows


CLAIM_KEYS = ["experiment", "run_tag", "against", "counterpart"]


def claims_table(contrasts: pd.DataFrame, margins: Mapping[str, float] | None = None, *, alpha: float = 0.05,
                 power: float = 0.8) -> pd.DataFrame:
    """Per claim (a run against its baseline or the experiment it derives from), mode, task and metric: the
    mean over seeds of the same-seed paired cost with a 95 % interval (between- and within-seed variance,
    :func:`hif8qat.stats.pool_seeds`), the equivalence verdict against the metric's margin (two one-sided
    tests), one test of a difference with the seeds pooled (accuracy: exact McNemar over all seeds' discordant
    items), Holm-adjusted within the claim, and the minimum detectable cost of that same test.

    cost > 0: the run is worse (accuracy: relative drop, % of the baseline score; train_loss: relative loss
    increase, % of the baseline loss; gold_ll / gold_margin: nats lost per item).
    """
    margins = {**DEFAULT_MARGINS, **(margins or {})}
    if contrasts.empty:
        return pd.DataFrame()
    rows = []
    keys = CLAIM_KEYS + ["mode", "task", "metric"]
    for key, g in contrasts.groupby(keys, sort=False):
        head = dict(zip(keys, key, strict=True))
        metric, margin, unit = head["metric"], margins.get(head["metric"], float("nan")), METRIC_UNITS[head["metric"]]
        g = g.sort_values("seed")
        row = {**head, "unit": unit, "n_seeds": len(g), "seeds": ",".join(str(x) for x in g["seed"]),
               "n_items": int(g["n"].sum()), "dirty_runs": int(g["dirty"].sum()), "margin": margin}
        if not g["recorded"].all():
            rows.append({**row, "equivalence": NOT_RECORDED, "difference": NOT_RECORDED})
            continue
        # a loss variance comes from a few blocks of steps per seed: t with their degrees of freedom
        within_df = float((g["n"] // LOSS_BLOCK - 1).sum()) if metric == "train_loss" else math.inf
        pooled = pool_seeds(g["diff"], g["var"], within_df)
        if metric == "accuracy":
            base = float(g["base"].mean())
            lost, gained, n = int(g["lost"].sum()), int(g["gained"].sum()), int(g["n"].sum())
            m = lost + gained

            def rel(points, _b=base):
                return -points / _b * 100.0 if _b > 0 else float("nan")

            lo95, hi95, lo90, hi90 = pooled.lo, pooled.hi, pooled.lo90, pooled.hi90
            method = f"seeds pooled ({pooled.variance_from})"
            if m < EXACT_BELOW_DISCORDANT:  # few flips: widen to the exact interval of all seeds' items
                e95, e90 = (exact_difference_ci(lost, gained, n, c) for c in (0.95, 0.90))
                lo95, hi95 = min(lo95, e95[0] * 100), max(hi95, e95[1] * 100)
                lo90, hi90 = min(lo90, e90[0] * 100), max(hi90, e90[1] * 100)
                method += " and exact"
            mde_pts = mde_exact_mcnemar(n, m, alpha=alpha, power=power) * 100.0
            row.update(base=base, cost=rel(pooled.mean), ci_lo=rel(hi95), ci_hi=rel(lo95), ci90_lo=rel(hi90),
                       ci90_hi=rel(lo90), diff_points=pooled.mean, lost=lost, gained=gained,
                       p=exact_mcnemar_p(lost, gained), test="exact McNemar, seeds pooled", ci_method=method,
                       mde=mde_pts / base * 100.0 if base > 0 else float("nan"), mde_points=mde_pts)
        else:
            row.update(base=float(g["base"].mean()), cost=pooled.mean, ci_lo=pooled.lo, ci_hi=pooled.hi,
                       ci90_lo=pooled.lo90, ci90_hi=pooled.hi90, p=pooled.p,
                       test="t over seeds" if pooled.variance_from == "between seeds" else
                       "t over step blocks" if metric == "train_loss" else "normal, within-seed item variance",
                       ci_method=f"seeds pooled ({pooled.variance_from})",
                       mde=mde_from_se(pooled.se, pooled.df, alpha=alpha, power=power))
            if metric != "train_loss":
                row.update(lost=int(g["lost"].sum()), gained=int(g["gained"].sum()))
        row.update(between_seed_sd=pooled.between_sd, equivalence=equivalence_verdict(
            row["ci90_lo"], row["ci90_hi"], margin, "" if unit == "nats" else " %"))
        rows.append(row)
    df = pd.DataFrame(rows)
    df["p_holm"] = np.nan
    for _, idx in df.groupby(CLAIM_KEYS, sort=False).groups.items():
        df.loc[idx, "p_holm"] = holm(df.loc[idx, "p"].to_numpy(float)) if "p" in df else np.nan
    recorded = df["equivalence"] != NOT_RECORDED
    df.loc[recorded, "difference"] = np.where(
        df.loc[recorded, "p_holm"] < alpha, np.where(df.loc[recorded, "cost"] > 0, "worse", "better"),
        "not detected")
    return df


def mde_table(claims: pd.DataFrame) -> pd.DataFrame:
    """What each claim's own test can detect: its minimum detectable cost next to the paper's effect sizes.
    Depends only on the claim's own runs, never on others in the folder."""
    if claims.empty or "mde" not in claims:
        return pd.DataFrame()
    cols = [c for c in ["experiment", "run_tag", "against", "counterpart", "mode", "task", "metric", "unit",
                        "n_seeds", "n_items", "lost", "gained", "mde", "mde_points", "test"] if c in claims]
    return claims[claims["equivalence"] != NOT_RECORDED][cols].reset_index(drop=True)


def _value(v: Any) -> str:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)


def sweep_table(runs: list[RunInfo], claims: pd.DataFrame, runs_df: pd.DataFrame) -> pd.DataFrame:
    """Sweeps: for each experiment with runs under more than one run tag, the training settings that differ
    between its tags (the knobs, read from the saved configs) and each claim metric against the knob's value:
    the cost against the baseline with its 95 % CI over seeds (the claims table's rows), beside the baseline's
    own seed spread (sd over its seeds of the score, or of the final loss, in % of its mean)."""
    from .runs import training_differences

    if claims.empty:
        return pd.DataFrame()
    by_exp: dict[str, dict[str, dict]] = {}
    for r in sorted(runs, key=lambda r: (r.experiment, _tag(r), r.seed if r.seed is not None else -1)):
        by_exp.setdefault(r.experiment, {}).setdefault(_tag(r), r.config)
    rows = []
    for exp, tags in sorted(by_exp.items()):
        if len(tags) < 2:
            continue
        ref = next(iter(tags.values()))
        knobs = sorted(set().union(*(training_differences(ref, c, may_differ=()) for c in tags.values())))
        if not knobs:
            continue
        for tag, cfg in tags.items():
            values = [_get(cfg, k) for k in knobs]
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
    the baseline's seed spread as a band around 0."""
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
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    return files


# The paper's claims and ours, each answered by one comparison of the claims table:
# (title, experiment, against, counterpart, what a cost > 0 means).
PAPER_CLAIMS = [
    ("Near-lossless final recipe", "exp8", "baseline", "exp7", "the HiF8 recipe is worse than BF16 at LR 1e-5"),
    ("Saturation cost, most_recent(30) at LR 1e-4", "exp3", "baseline", "exp1", "QAT with the lagging estimator "
     "is worse than BF16"),
    ("Saturation cost, max(64) recipe at LR 1e-4", "exp6", "baseline", "exp1", "the recipe at LR 1e-4 is worse "
     "than BF16"),
    ("Forgetting at LR 1e-4", "exp7", "derived_from", "exp1", "LR 1e-5 is worse than LR 1e-4 (forgetting at "
     "1e-4 shows as a negative cost)"),
    ("Delayed estimator vs the just-in-time oracle, max(64)", "exp12", "derived_from", "exp8", "the oracle is "
     "worse than the delayed estimate"),
    ("Delayed estimator vs the just-in-time oracle, most_recent(30)", "exp13", "derived_from", "exp2", "the "
     "oracle is worse than the delayed estimate"),
    ("FP8 HYBRID vs HiF8, max(64)", "exp11", "derived_from", "exp8", "FP8 is worse than HiF8"),
    ("FP8 HYBRID vs HiF8, most_recent(30)", "exp10", "derived_from", "exp2", "FP8 is worse than HiF8"),
    ("The BF16 warmup alone (ours)", "exp9", "derived_from", "exp8", "QAT from step 0 is worse than after the "
     "BF16 warmup"),
    ("Quantized inference of the final recipe", "exp8", "bf16_mode", "exp8", "exp8 evaluated in HiF8 (W8A8, "
     "final frozen scales) is worse than its own weights evaluated in BF16"),
]
CLAIMS_BEGIN, CLAIMS_END = "<!-- claims:begin -->", "<!-- claims:end -->"


def _num(v: float, nd: int = 2, sign: bool = True) -> str:
    if v is None or not np.isfinite(v):
        return "-"
    v = round(float(v), nd) + 0.0  # no "-0.00"
    return f"{v:+.{nd}f}" if sign else f"{v:.{nd}f}"


def _claim_words(g: pd.DataFrame) -> list[str]:
    """Sentences for one claim from its rows: the loss difference, then accuracy and per-item metrics by verdict."""
    out = []
    loss = g[g.metric == "train_loss"]
    for _, r in loss.iterrows():
        if r["equivalence"] == NOT_RECORDED:
            continue
        out.append(f"Training loss: {_num(r['cost'], 3)} % of the counterpart's loss (95 % CI {_num(r['ci_lo'], 3)} to "
                   f"{_num(r['ci_hi'], 3)}, {r['n_seeds']} seed(s)): {r['equivalence']}; difference "
                   f"{r['difference']} (p Holm {_num(r['p_holm'], 3, False)}; detectable: "
                   f"{_num(r['mde'], 3, False)} %).")
    for metric, label in (("accuracy", "Accuracy"), ("gold_ll", "Gold log-likelihood"),
                          ("gold_margin", "Gold margin")):
        rows = g[g.metric == metric]
        if rows.empty:
            continue
        if (rows["equivalence"] == NOT_RECORDED).all():
            out.append(f"{label}: {NOT_RECORDED}.")
            continue
        rows = rows[rows["equivalence"] != NOT_RECORDED]
        verdicts = rows["equivalence"].value_counts()
        parts = [f"{v} on {n} of {len(rows)}" for v, n in verdicts.items()]
        diff = rows[rows["difference"] != "not detected"]
        found = ("; a difference after Holm on " + ", ".join(f"{r['mode']} {r['task']} ({r['difference']})"
                                                          for _, r in diff.iterrows())) if len(diff) else \
            "; no difference detected after Holm"
        text = f"{label} (mode x task): " + ", ".join(parts) + found + "."
        if metric == "accuracy":
            flips = int(rows["lost"].sum() + rows["gained"].sum())
            mde = rows["mde"].dropna()
            text += (f" {flips} items flipped in all ({int(rows['lost'].sum())} lost, {int(rows['gained'].sum())} "
                     f"gained); the exact test needs {min_one_way_flips()} one way per row, and "
                     + (f"where the flips allow it, it detects {mde.min():.1f} % of the score or more"
                        if len(mde) else "no row has flips enough to detect any drop") + ".")
        out.append(text)
    return out


def claims_section(claims: pd.DataFrame, runs_df: pd.DataFrame, profile: str,
                   margins: Mapping[str, float] | None = None) -> str:
    """The claims, numbers and verdicts in words, as markdown built from the claims table alone (the README
    includes it between CLAIMS_BEGIN and CLAIMS_END; ``python -m hif8qat.report --readme`` updates it)."""
    margins = {**DEFAULT_MARGINS, **(margins or {})}
    lines = [f"_Generated by the report from the run files (`claims_{profile}`); do not edit by hand._", ""]
    if len(runs_df) and "dirty" in runs_df:
        dirty = runs_df[runs_df["dirty"].fillna(False).astype(bool)]
        commits = runs_df.groupby("experiment")["git"].agg(lambda c: ", ".join(sorted({str(x)[:7] for x in c})))
        lines += [f"**Provenance.** {len(runs_df)} runs; **{len(dirty)} of them were made from a tree with "
                  "uncommitted changes** (`git.dirty` in their run_info.json): their commit does not hold their "
                  "exact code. Commits per experiment: "
                  + "; ".join(f"{e} {c}" for e, c in commits.items()) + ".", ""]
    lines += ["**Reading.** cost > 0: the run is worse than its counterpart (accuracy: relative drop in % of the "
              "counterpart's score; training loss: signed per-step difference over the QAT phase in % of the "
              "counterpart's loss; gold log-likelihood and margin: nats per item). Each row pools the same-seed "
              "pairs; its 95 % CI combines between-seed spread and within-seed item (or step-block) variance. "
              "Equivalence: two one-sided tests against the margin ("
              + ", ".join(f"{k} {v:g} {METRIC_UNITS[k]}" for k, v in margins.items())
              + "): \"equivalent within M\", \"not equivalent\" or \"inconclusive at this size\"; a "
              "non-significant difference is never read as no effect. Difference: one test per row with the "
              "seeds pooled (accuracy: exact McNemar on every seed's flips), Holm within the claim. MDE: the cost "
              "that test detects with 80 % power.", ""]
    if claims.empty:
        return "\n".join(lines + ["_(no claims: no paired runs)_", ""])
    for title, exp, against, counterpart, meaning in PAPER_CLAIMS:
        g = claims[(claims.experiment == exp) & (claims.run_tag == "") & (claims.against == against)
                   & (claims.counterpart == counterpart)]
        seeds = ", ".join(sorted({x for s in g["seeds"] for x in str(s).split(",")})) if len(g) else ""
        pair = f"{exp} in hif8 vs bf16 mode" if against == "bf16_mode" else f"{exp} vs {counterpart}"
        lines += [f"#### {title}: {pair}" + (f" (seeds {seeds})" if seeds else ""), ""]
        if g.empty:
            lines += [f"No paired runs of {exp} and {counterpart} (see `pairing_{profile}`).", ""]
            continue
        lines += [f"cost > 0: {meaning}.", ""]
        lines += ["| mode | task | metric | seeds | cost (95 % CI) | lost / gained | p Holm | MDE | margin | "
                  "equivalence | difference |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for _, r in g.iterrows():
            if r["equivalence"] == NOT_RECORDED:
                continue
            flips = f"{int(r['lost'])} / {int(r['gained'])}" if r["metric"] != "train_loss" and \
                np.isfinite(r.get("lost", np.nan)) else "-"
            lines.append(f"| {r['mode']} | {r['task']} | {r['metric']} | {r['n_seeds']} | {_num(r['cost'])} "
                         f"({_num(r['ci_lo'])} to {_num(r['ci_hi'])}) | {flips} | {_num(r['p_holm'], 3, False)} | "
                         f"{_num(r['mde'], 2, False)} | {r['margin']:g} | {r['equivalence']} | "
                         f"{r['difference']} |")
        lines += [""] + [f"- {w}" for w in _claim_words(g)] + [""]
    return "\n".join(lines)


def replace_between_markers(text: str, block: str) -> str:
    """``text`` with what lies between CLAIMS_BEGIN and CLAIMS_END replaced by ``block``."""
    i, j = text.find(CLAIMS_BEGIN), text.find(CLAIMS_END)
    if i < 0 or j < i:
        raise ValueError(f"no {CLAIMS_BEGIN} ... {CLAIMS_END} block")
    return text[: i + len(CLAIMS_BEGIN)] + "\n" + block.strip() + "\n" + text[j:]


def between_markers(text: str) -> str | None:
    i, j = text.find(CLAIMS_BEGIN), text.find(CLAIMS_END)
    return text[i + len(CLAIMS_BEGIN): j].strip() if 0 <= i < j else None


ANCHOR_DIR = REPO / "results" / "anchor"
ANCHOR_PUBLISHED = ANCHOR_DIR / "published_smollm2_135m.csv"


def anchor_table(anchor_dir: Path = ANCHOR_DIR, published: Path = ANCHOR_PUBLISHED) -> pd.DataFrame:
    """Our evaluations of the base model on the full real sets (``<anchor_dir>/<model>/<shots>/results.json``,
    ``make anchor``) next to the scores HuggingFace published for SmolLM2-135M and -Instruct (the CSV, with
    its source). ``arc_average`` is the mean of arc_easy and arc_challenge, as the model card's "ARC
    (Average)". Rows without our evaluation show the published score alone."""
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


def pair_runs(runs: list[RunInfo], runs_root: Path, profile: str):
    """Each run's BF16 baseline (quant.* may differ) and the run of the experiment it derives from (its declared
    changes may differ): same seed and training settings, else None. Returns (baseline_of, parent_of, the
    pairing table, the unpaired runs with their reasons); the dicts are keyed by run folder."""
    baseline_of, parent_of, rows, unpaired = {}, {}, [], []
    for r in runs:
        b, why_b = _pair(r, r.baseline, runs, runs_root, profile, ("quant",))
        parent_name = _get(r.config, "experiment.derived_from")
        p, why_p = _pair(r, parent_name, runs, runs_root, profile,
                         list(_get(r.config, "experiment.changes", []) or []))
        baseline_of[str(r.path)], parent_of[str(r.path)] = b, p
        rows.append({"experiment": r.experiment, "run_tag": _tag(r), "seed": r.seed, "run": _run_label(r),
                     "baseline": r.baseline, "baseline_run": _run_label(b), "baseline_unpaired": why_b,
                     "derived_from": parent_name, "derived_from_run": _run_label(p), "derived_from_unpaired": why_p})
        unpaired += [f"{_run_label(r)} vs {why}" for why in (why_b, why_p) if why]
    return baseline_of, parent_of, pd.DataFrame(rows), unpaired


def all_contrasts(runs: list[RunInfo], baseline_of: Mapping, parent_of: Mapping,
                  metrics_cache: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Every seed's contrasts (:func:`seed_contrasts`) against its baseline and its parent (once if the same)."""
    rows = []
    for r in runs:
        b, p = baseline_of[str(r.path)], parent_of[str(r.path)]
        for against, other in (("baseline", b), ("derived_from", p if p is not b else None),
                               ("bf16_mode", r if r.quant else None)):
            if other is not None:
                rows += seed_contrasts(r, other, against, metrics_cache)
    return pd.DataFrame(rows)


def build_claims(runs_root: Path, profile: str, margins: Mapping[str, float] | None = None) -> str:
    """The claims section alone, from the run folders (what the README includes): no bootstrap, no figures."""
    runs_root = Path(runs_root)
    runs = discover_runs(runs_root, profile)
    metrics_cache = {str(r.path): read_metrics(r.path / "metrics.jsonl") if (r.path / "metrics.jsonl").exists()
                     else pd.DataFrame() for r in runs}
    baseline_of, parent_of, _, _ = pair_runs(runs, runs_root, profile)
    claims = claims_table(all_contrasts(runs, baseline_of, parent_of, metrics_cache), margins)
    runs_df = pd.DataFrame([{"experiment": r.experiment, "git": _git_of(r), "dirty": _dirty_of(r)} for r in runs])
    return claims_section(claims, runs_df, profile, margins)


def build_report(runs_root: Path, profile: str, out_tables: Path, out_figures: Path, *, n_boot: int = 10000,
                 seed: int = 0, last_frac: float = 0.1, figures: bool = True, replay: bool | None = None,
                 margins: Mapping[str, float] | None = None) -> dict:
    """Tables and figures for all runs of ``profile``. Returns ``{"tables": {name: DataFrame}, "files": [...],
    "message": str, "claims_section": markdown}``; with no runs, writes nothing and says so in ``message``.
    ``margins``: equivalence margins per metric (default DEFAULT_MARGINS)."""
    runs_root, out_tables, out_figures = Path(runs_root), Path(out_tables), Path(out_figures)
    skipped: list[dict] = []  # runs (or parts of them) the tables could not use, and why
    runs = discover_runs(runs_root, profile, skipped)
    if not runs:
        msg = f"no runs under {runs_root / profile} (train some first, e.g. `make exp8 PROFILE={profile}`)"
        msg += "".join(f"\n  not used: {s['run_dir']}: {s['reason']}" for s in skipped)
        return {"tables": {}, "files": [], "message": msg}
    used: dict[str, set] = {}

    def use(run: RunInfo, *files: Path):
        for f in files:
            used.setdefault(str(f), set()).add(_git_of(run))

    # ---- runs overview
    run_rows, metrics_cache = [], {}
    for r in runs:
        mp = r.path / "metrics.jsonl"
        m = read_metrics(mp) if mp.exists() else pd.DataFrame()
        metrics_cache[str(r.path)] = m
        summ = _read_json(r.path / "summary.json") if (r.path / "summary.json").exists() else {}
        if "loss" not in m or not len(m):
            skipped.append({"run_dir": str(r.path), "reason": f"{mp.name} {'holds no loss' if mp.exists() else 'is missing'}"
                            + (" although the run is finished" if r.done else " (unfinished run)")
                            + ": no loss curve, left out of the APE, telemetry and scaling-pair tables"})
        elif not r.done:
            skipped.append({"run_dir": str(r.path), "reason": "unfinished (no DONE marker): its losses so far are "
                            "in the runs table, its curve is partial"})
        row = {"experiment": r.experiment, "run_tag": _tag(r), "seed": r.seed, "paper_run": r.paper_run,
               "quant": r.quant,
               "estimator": r.estimator, "baseline": r.baseline, "done": r.done,
               "steps": int(m["step"].max()) + 1 if "step" in m and len(m) else 0,
               "final_loss": float(m["loss"].iloc[-1]) if "loss" in m and len(m) else float("nan"),
               "wall_time_s": next((summ[k] for k in ("wall_time_s", "train_wall_s", "train_wall_s_this_session")
                                    if k in summ), float("nan")),
               "git": _git_of(r), "dirty": _dirty_of(r), "run_dir": str(r.path)}
        for mode in ("bf16", "hif8"):
            for task, res in _eval_results(r, mode).items():
                row[f"{mode}:{task}"] = res.get("value", float("nan")) * 100.0
                use(r, r.path / "eval" / mode / "results.json")
        if mp.exists():
            use(r, mp)
        run_rows.append(row)
    runs_df = pd.DataFrame(run_rows).sort_values(["experiment", "run_tag", "seed"]).reset_index(drop=True)

    # ---- pairing: each run against its BF16 baseline and the experiment it derives from, or no pair and why
    baseline_of, parent_of, pairing_df, unpaired = pair_runs(runs, runs_root, profile)

    # ---- drops and APE per (run, baseline)
    drop_rows, ape_rows, curves = [], [], []
    for r in runs:
        b = baseline_of[str(r.path)]
        if b is None:
            continue
        mq, mb = metrics_cache[str(r.path)], metrics_cache[str(b.path)]
        if "loss" in mq and "loss" in mb and len(mq) and len(mb):
            a = loss_ape(mq["step"], mq["loss"], mb["step"], mb["loss"], last_frac=last_frac)
            qat_from = _qat_start(r, mq)
            qat = mq[mq["step"] >= qat_from] if qat_from is not None else mq.iloc[:0]
            aq = loss_ape(qat["step"], qat["loss"], mb["step"], mb["loss"], last_frac=last_frac)
            ape_rows.append({"experiment": r.experiment, "run_tag": _tag(r), "baseline": b.experiment,
                             "seed": r.seed,
                             "n_common": a["n_common"], "ape_all_pct": a["ape_all"], "ape_last_pct": a["ape_last"],
                             "last_n": a["last_n"], "last_frac": last_frac, "qat_from_step": qat_from,
                             "n_qat": aq["n_common"], "ape_qat_pct": aq["ape_all"],
                             "final_loss_quant": float(mq["loss"].iloc[-1]), "final_loss_base": float(mb["loss"].iloc[-1])})
            curves.append((r, b, mq, mb))
        base_res = _eval_results(b, "bf16")
        for qmode in ("bf16", "hif8"):
            q_res = _eval_results(r, qmode)
            for task, qr in q_res.items():
                if task not in base_res:
                    continue
                bs = _read_samples(b.path / "eval" / "bf16" / f"samples_{task}.csv")
                qs = _read_samples(r.path / "eval" / qmode / f"samples_{task}.csv")
                row = {"experiment": r.experiment, "run_tag": _tag(r), "baseline": b.experiment, "seed": r.seed,
                       "quant_mode": qmode,
                       "task": task, "metric": qr.get("metric"), "base_pct": base_res[task]["value"] * 100.0,
                       "quant_pct": qr["value"] * 100.0,
                       "drop_pct": relative_drop(base_res[task]["value"], qr["value"])}
                if bs is not None and qs is not None:
                    xb, xq = align_samples(bs, qs)
                    row.update(drop_paired_pct=relative_drop(float(xb.mean()), float(xq.mean()))
                               if len(xb) else float("nan"), **_item_stats(xb, xq, n_boot, seed))
                    use(b, b.path / "eval" / "bf16" / f"samples_{task}.csv")
                    use(r, r.path / "eval" / qmode / f"samples_{task}.csv")
                else:
                    row.update(n_paired=0, drop_paired_pct=float("nan"), ci_lo=float("nan"), ci_hi=float("nan"),
                               significant=False, discordant=float("nan"), p_mcnemar=float("nan"),
                               ci_method="")
                drop_rows.append(row)
    drops_df = pd.DataFrame(drop_rows)
    ape_df = pd.DataFrame(ape_rows)

    # ---- telemetry
    tel_rows = []
    for r in runs:
        m = metrics_cache[str(r.path)]
        if not len(m):
            continue
        ts = telemetry_summary(m)
        for _, t in ts.iterrows():
            tel_rows.append({"experiment": r.experiment, "seed": r.seed, "format": _format_of(r),
                             "estimator": r.estimator, **t.to_dict()})
    tel_df = pd.DataFrame(tel_rows)

    # ---- one-factor ablations: each run against the experiment it derives from (e.g. exp7 vs exp1 = the
    # learning rate alone, both BF16: the forgetting comparison; exp9 vs exp8 = the BF16 warmup alone), in bf16
    # mode and, when both runs are quantized, in the quantized mode too (exp11 vs exp8: FP8 vs HiF8 inference)
    abl_rows, pair_rows = [], []
    ape_of = {(a["experiment"], a["run_tag"], a["seed"]): a for a in ape_rows}
    for r in runs:
        parent = parent_of[str(r.path)]
        if parent is None:
            continue
        changes = list(_get(r.config, "experiment.changes", []) or [])
        head = {"experiment": r.experiment, "run_tag": _tag(r), "derived_from": parent.experiment,
                "changes": ",".join(changes), "seed": r.seed}
        for mode in ("bf16", "hif8"):
            if mode != "bf16" and not (r.quant and parent.quant):
                continue
            abl_rows += [{**head, "mode": mode, **row} for row in _paired_comparison(
                parent.path / "eval" / mode, r.path / "eval" / mode, n_boot, seed)]
        if r.quant and parent.quant and changes and set(changes) <= SCALING_FACTORS:
            pair_rows.append(_scaling_pair(r, parent, changes, metrics_cache, ape_of))
    abl_df = pd.DataFrame(abl_rows)
    pairs_df = pd.DataFrame(pair_rows)

    # ---- every run against the untrained base model, when its evaluation is on file (forgetting)
    base_model_dir = runs_root.parent / "base_model" / profile
    vs_base_rows = []
    if (base_model_dir / "results.json").exists():
        for r in runs:
            head = {"experiment": r.experiment, "seed": r.seed, "lr": _get(r.config, "train.lr"), "quant": r.quant}
            vs_base_rows += [{**head, **row} for row in _paired_comparison(base_model_dir, r.path / "eval" / "bf16",
                                                                           n_boot, seed)]
    vs_base_df = pd.DataFrame(vs_base_rows)

    # ---- estimators replayed on the same recorded traces (complete traces only; see recorded_amax_traces)
    replay_frames = []
    for r in runs if (figures if replay is None else replay) else []:
        traces = recorded_amax_traces(r.path / "export")
        if traces:
            df = replay_exceedance(traces)
            df.insert(0, "trace_source", f"{r.experiment}/seed{r.seed}")
            replay_frames.append(df)
            use(r, r.path / "export" / "hif8qat_scalers.safetensors")
    replay_df = pd.concat(replay_frames, ignore_index=True) if replay_frames else pd.DataFrame()

    # ---- seeds: spread, the BF16-vs-BF16 seed null, which claims survive it; detectable effect sizes
    seeds_df = seed_spread(runs_df, drops_df)
    null_df = seed_null_table(runs, n_boot, seed)
    contrasts_df = all_contrasts(runs, baseline_of, parent_of, metrics_cache)
    claims_df = claims_table(contrasts_df, margins)
    section = claims_section(claims_df, runs_df, profile, margins)
    mde_df = mde_table(claims_df)
    from .heldout_stats import HELDOUT_TABLE_NOTE, heldout_claims_table, heldout_entries

    heldout_df = heldout_claims_table(heldout_entries(runs, baseline_of))
    sweeps_df = sweep_table(runs, claims_df, runs_df)
    n_tests = int(claims_df["p"].notna().sum()) if "p" in claims_df else 0
    n_claims = int(claims_df.groupby(CLAIM_KEYS).ngroups) if len(claims_df) else 0

    anchor_df = anchor_table(runs_root.parent / "anchor", runs_root.parent / "anchor" / ANCHOR_PUBLISHED.name)
    if anchor_df.empty and ANCHOR_PUBLISHED.exists():
        anchor_df = anchor_table()

    tables = {f"runs_{profile}": runs_df, f"drops_{profile}": drops_df, f"ape_{profile}": ape_df,
              f"telemetry_{profile}": tel_df, f"replay_{profile}": replay_df, f"ablations_{profile}": abl_df,
              f"scaling_pairs_{profile}": pairs_df,
              f"vs_base_{profile}": vs_base_df, f"seeds_{profile}": seeds_df, f"seed_null_{profile}": null_df,
              f"claims_{profile}": claims_df, f"mde_{profile}": mde_df, "anchor": anchor_df,
              f"pairing_{profile}": pairing_df, f"paired_{profile}": contrasts_df,
              f"sweeps_{profile}": sweeps_df, f"heldout_{profile}": heldout_df}
    multiple = (f"Multiple comparisons: one family per claim ({n_claims} claims, {n_tests} tests in "
                f"claims_{profile}), seeds pooled into one test per task and metric; p_holm is Holm-adjusted "
                "within the claim. Per-seed rows (drops, ablations) are descriptive and unadjusted.")
    margins_text = ", ".join(f"{k} {v:g} {METRIC_UNITS[k]}" for k, v in {**DEFAULT_MARGINS, **(margins or {})}.items())
    notes = {
        f"heldout_{profile}": HELDOUT_TABLE_NOTE,
        f"runs_{profile}": "One row per run; eval columns are <mode>:<task> scores in %. dirty: made from a tree "
                           "with uncommitted changes (run_info.json), so its commit does not hold its exact code.",
        f"drops_{profile}": "Relative drop (%) = (base-quant)/base*100 against the baseline experiment's bf16 "
                            "evaluation, one row per seed. 95 % CI: exact (conditional McNemar, Clopper-Pearson) "
                            f"when fewer than {EXACT_BELOW_DISCORDANT} items differ (ci_method exact; significant: "
                            "exact p_mcnemar < 0.05), else a paired percentile bootstrap "
                            f"({n_boot} resamples of the common documents, seed {seed}; significant: CI excludes "
                            "0). n_lost / n_gained: items right in the baseline and wrong in the run, and the "
                            "reverse; discordant: their share. " + multiple,
        f"ape_{profile}": f"Training-loss APE (%) over all common steps, the last {last_frac:.0%} of them, and the "
                          "QAT phase (ape_qat_pct: steps from qat_from_step, the first step the quantized run "
                          "logged as quantized, i.e. after its BF16 warmup).",
        f"pairing_{profile}": "Every run's pairs: its BF16 baseline (same seed, same training settings apart "
                              "from quant.*) and the experiment it derives from (same seed, same training "
                              "settings apart from its declared changes). Logging, evaluation and checkpoint "
                              "cadence and run_tag do not count. An empty *_run names no pair; *_unpaired says "
                              "why, and the run is left out of that comparison.",
        f"paired_{profile}": "Per seed, the paired contrasts the claims pool: diff (accuracy: run minus "
                             "counterpart in points; train_loss: signed loss difference, % of the counterpart's "
                             "loss; gold_ll / gold_margin: counterpart minus run, nats per item), var (its "
                             "within-seed variance: items, or blocks of 5 steps), lost / gained (items right only "
                             "in the counterpart / only in the run; for the per-item metrics, items worse / "
                             "better), recorded (false: the run files lack the metric).",
        f"sweeps_{profile}": "Sweeps: each experiment run under several run tags (e.g. a Hydra multirun over a "
                             "knob), the knobs that differ between them (from the saved configs), and each claim "
                             "metric's cost against the baseline per knob value, 95 % CI over seeds as in "
                             "claims; baseline_seed_sd_pct: the baseline's own sd over seeds (score, or final "
                             "loss) in % of its mean. Figures: sweep_<profile>_<experiment>.png.",
        f"seeds_{profile}": "Spread over seeds: mean, sd, min and max of each score and each drop (%).",
        f"seed_null_{profile}": "Seed null: each BF16 experiment against itself at another seed (bf16 evaluations): "
                                "relative drop (%) with a paired bootstrap 95 % CI. Only the seed differs, so "
                                "these drops are the noise floor of any claim.",
        f"claims_{profile}": "Each run against its baseline and against the experiment it derives from, pooled "
                             "over same-seed pairs, and a quantized run's quantized evaluation against its own "
                             "bf16 one (against = bf16_mode): cost (positive = the run is worse; accuracy: relative drop, % "
                             "of the baseline score; train_loss: signed per-step loss difference over the QAT "
                             "phase, % of the baseline loss; gold_ll / gold_margin: nats per item) with a 95 % CI "
                             "whose variance is the larger of the between-seed spread and the within-seed item or "
                             "step-block variance (t over seeds when the spread dominates), widened to the exact "
                             f"interval when fewer than {EXACT_BELOW_DISCORDANT} items flip. equivalence: two "
                             "one-sided tests (90 % CI) against `margin`; difference: one test with the seeds "
                             "pooled (accuracy: exact McNemar over every seed's flips), Holm within the claim. "
                             f"mde: the cost that test detects with 80 % power. Margins: {margins_text}. Runs "
                             "made from a tree with uncommitted changes count in dirty_runs.",
        "anchor": "The base SmolLM2-135M on the full real benchmarks (make anchor; our weights: the Instruct model "
                  "dequantized from Q4_1, lm-eval's prompts) next to the scores HuggingFace published (lighteval, "
                  "0-shot; results/anchor/published_smollm2_135m.csv names the source). ARC (Average) = mean of "
                  "ARC-Easy and ARC-Challenge.",
        f"mde_{profile}": "Minimum detectable cost per claim (80 % power, two-sided alpha 0.05) under the test "
                          "the claim uses: accuracy, the exact McNemar test on the claim's own pooled flips "
                          f"(it needs at least {min_one_way_flips()} flips all one way; empty: fewer flips than "
                          "that), in % of the baseline score and in points; train_loss, the t (or normal) test "
                          "on the seeds' mean. Only the claim's own runs enter. The paper's drops are 0.2-0.6 % "
                          "of the score, its loss APE 0.11 %.",
        f"telemetry_{profile}": "Scaling telemetry from metrics.jsonl, per run and role: share of steps and of "
                                "calls whose amax outgrew the delayed estimate (amax/estimate > 1), the largest "
                                "ratio, and the clipped values on statistics calls (clipped_total, "
                                "clipped_per_stats_call): for HiF8 the overflow |x*s| >= 40960 (at target 15 only "
                                "a tensor 2731x its estimate overflows), for FP8 |x*s| > max (at margin 0 every "
                                "call with amax/estimate > 1 clips its largest values).",
        f"ablations_{profile}": "Each run against the experiment it derives from (same seed): relative drop (%) with "
                                "a paired bootstrap 95 % CI, in bf16 mode and, when both are quantized, in the "
                                "quantized mode (`mode` hif8: each run in its own format); `changes` lists the "
                                "settings that differ. exp7 vs exp1 isolates the learning rate (forgetting), "
                                "exp9 vs exp8 the BF16 warmup, exp10/exp11 the FP8 format (vs exp2/exp8), "
                                "exp12/exp13 just-in-time scaling (vs exp8/exp2): a positive drop there is what the "
                                "oracle loses against the delayed estimator, a negative one how far the delayed "
                                "estimator is from the oracle.",
        f"scaling_pairs_{profile}": "One-factor pairs that change only the element format or the scale algorithm "
                                    "(quant.format / quant.margin / quant.algo), side by side: format and "
                                    "algorithm, share of quantizer calls whose amax outgrew the estimate, clipped "
                                    "values per statistics call (HiF8 overflow, FP8 clipping; all roles pooled), "
                                    "QAT-phase loss APE against the common baseline and the final loss. Accuracy "
                                    f"differences with CIs: ablations_{profile}.",
        f"vs_base_{profile}": "Each run's bf16 evaluation against the untrained base model's "
                              f"(results/base_model/{profile}/): relative drop (%) with a paired bootstrap 95 % CI. "
                              "Drops common to quantized and BF16 runs at one learning rate are forgetting, not "
                              "quantization.",
        f"replay_{profile}": "Each estimator replayed (interval 1) on the same per-call amax traces recorded in a run's "
                             "final scaler state: share of calls whose amax exceeded the delayed estimate, how far, "
                             "and the share beyond the 2-bit-mantissa tier (ratio > 128/15).",
    }
    sources = {"files": [{"path": p, "git_commits": sorted(c for c in g if c)} for p, g in sorted(used.items())],
               "runs_root": str(runs_root), "profile": profile, "runs_not_used": skipped}
    files = []
    for name, df in tables.items():
        files += list(write_table(df, out_tables, name, title=name.replace("_", " "),
                                  sources={**sources, "note": notes[name]}).values())
    section_p = out_tables / f"claims_section_{profile}.md"
    section_p.write_text(section + "\n")
    files.append(str(section_p))
    if figures:
        files += make_figures(curves, runs, metrics_cache, tel_df, out_figures, profile)
        files += plot_sweeps(sweeps_df, out_figures, profile)
    msg = f"{len(runs)} runs, {len(drops_df)} drop rows, {len(ape_df)} APE rows"
    n_dirty = int(runs_df["dirty"].fillna(False).astype(bool).sum())
    if n_dirty:
        msg += (f"\nwarning: {n_dirty} of {len(runs)} runs were made from a tree with uncommitted changes (runs_"
                f"{profile} column dirty): their recorded commit does not hold their exact code")
    if unpaired:
        msg += f"\nnot paired ({len(unpaired)}; pairing_{profile}):\n  " + "\n  ".join(unpaired)
    if skipped:
        msg += "\nruns not used, or used in part (also in each table's .sources.json, runs_not_used):" + "".join(
            f"\n  {s['run_dir']}: {s['reason']}" for s in skipped)
    if n_tests:
        msg += "\n" + multiple
    return {"tables": tables, "files": files, "message": msg, "claims_section": section}


# ============================================================================================ figures
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_pair(steps_q, loss_q, steps_b, loss_b, *, label_q: str, label_b: str, path: Path, title: str = ""):
    plt = _plt()
    ra = running_ape(steps_q, loss_q, steps_b, loss_b)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps_b, loss_b, lw=0.8, label=label_b)
    ax.plot(steps_q, loss_q, lw=0.8, label=label_q)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax2 = ax.twinx()
    ax2.plot(ra["step"], ra["running_ape"], color="k", lw=0.8, ls="--", label="running APE")
    ax2.set_ylabel("running APE (%)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8)
    ax.set_title(title or f"{label_q} vs {label_b}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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


def make_figures(curves, runs, metrics_cache, tel_df, out: Path, profile: str) -> list[str]:
    plt = _plt()
    files = []
    out.mkdir(parents=True, exist_ok=True)
    for r, b, mq, mb in curves:
        p = out / f"loss_{profile}_{r.experiment}_vs_{b.experiment}_seed{r.seed}.png"
        plot_loss_pair(mq["step"], mq["loss"], mb["step"], mb["loss"], label_q=r.experiment, label_b=b.experiment,
                       path=p)
        files.append(str(p))
    for r in runs:
        m = metrics_cache[str(r.path)]
        tel = read_telemetry_dumps(r.path)
        cols = [c for c in m.columns if c.endswith("/amax_max") or c.endswith("/amax_ratio_max")] if len(m) else []
        if not cols and tel.empty:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        if not tel.empty and {"step", "role", "amax", "estimate"} <= set(tel.columns):
            g = tel.groupby(["step", "role"])[["amax", "estimate"]].max().reset_index()
            for role, sub in g.groupby("role"):
                axes[0].semilogy(sub["step"], sub["amax"], lw=0.9, label=f"{role} amax")
                axes[0].semilogy(sub["step"], sub["estimate"], lw=0.9, ls="--", label=f"{role} estimate")
            axes[0].set_title("max over layers (telemetry dumps)")
        else:
            for c in [c for c in cols if c.endswith("/amax_max")]:
                s = pd.to_numeric(m[c], errors="coerce")
                axes[0].semilogy(m["step"], s.where(s > 0), lw=0.9, label=c.split("/")[1] + " amax")
            axes[0].set_title("amax per step (metrics.jsonl)")
        axes[0].set_xlabel("step")
        axes[0].legend(fontsize=7)
        for c in [c for c in cols if c.endswith("/amax_ratio_max")]:
            s = pd.to_numeric(m[c], errors="coerce")
            axes[1].plot(m["step"], s.where(s > 0), lw=0.9, label=c.split("/")[1])
        axes[1].axhline(1.0, color="k", lw=0.6, ls=":")
        axes[1].set_title("max amax / estimate (>1: outgrew the estimate)")
        axes[1].set_xlabel("step")
        axes[1].legend(fontsize=7)
        fig.suptitle(f"{r.experiment} seed {r.seed} ({r.estimator})", fontsize=9)
        fig.tight_layout()
        p = out / f"scales_{profile}_{r.experiment}_seed{r.seed}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        files.append(str(p))
    if len(tel_df):
        # Share of quantizer calls, not of steps: with hundreds of linears nearly every step has one
        # exceeded call, whichever the estimator, so the per-step share hides the difference.
        piv = tel_df.groupby(["estimator", "role"])["frac_calls_ratio_gt1"].mean().unstack("role")
        fig, ax = plt.subplots(figsize=(7, 3.6))
        piv.plot.bar(ax=ax)
        ax.set_ylabel("share of calls with amax > estimate")
        ax.set_title("saturation events per estimator")
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
        fig.tight_layout()
        p = out / f"saturation_{profile}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        files.append(str(p))
    return files


def format_report(rep: dict) -> str:
    out = [rep.get("message", "")]
    for name, df in rep.get("tables", {}).items():
        if name.startswith("runs_"):
            continue
        out += ["", name, to_markdown(df, 3) if len(df) else "(empty)"]
    return "\n".join(out)


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Tables and figures (results/tables, results/figures)")
    ap.add_argument("--paper", action="store_true", help="the paper's tables from the authors' data")
    ap.add_argument("--profile", default="mini")
    ap.add_argument("--runs-root", type=Path, default=REPO / "results" / "runs")
    ap.add_argument("--tables", type=Path, default=TABLES_DIR)
    ap.add_argument("--figures", type=Path, default=FIGURES_DIR)
    ap.add_argument("--paper-dir", type=Path, default=PAPER_DIR)
    ap.add_argument("--margin", action="append", default=[], metavar="METRIC=M",
                    help=f"equivalence margin of a claim metric ({', '.join(DEFAULT_MARGINS)}); repeatable")
    ap.add_argument("--readme", type=Path, help="write the claims section between the file's "
                    f"{CLAIMS_BEGIN} / {CLAIMS_END} markers and stop")
    args = ap.parse_args(list(argv) if argv is not None else None)
    margins = {}
    for item in args.margin:
        key, _, value = item.partition("=")
        try:
            if key not in DEFAULT_MARGINS:
                raise ValueError
            margins[key] = float(value)
        except ValueError:
            ap.error(f"--margin {item!r}: expected METRIC=number with METRIC one of {', '.join(DEFAULT_MARGINS)}")
    if args.readme:
        text = args.readme.read_text()
        if between_markers(text) is None:
            ap.error(f"{args.readme} has no {CLAIMS_BEGIN} ... {CLAIMS_END} block")
        args.readme.write_text(replace_between_markers(text, build_claims(args.runs_root, args.profile, margins)))
        print(f"claims section written to {args.readme} from {args.runs_root / args.profile}")
        return 0
    if args.paper:
        tables = build_paper_tables(args.paper_dir, args.tables)
        print(format_paper_tables(tables))
        print(f"\nwritten: {args.tables}/paper_*.csv|md")
        return 0
    rep = build_report(args.runs_root, args.profile, args.tables, args.figures, margins=margins)
    print(format_report(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
