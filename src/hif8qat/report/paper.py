"""The paper's tables from the authors' published logs and scores (``results/paper/``): training-loss APE per
pair of their runs, every published drop, the headline comparison; ``python -m hif8qat.report --paper``."""

from __future__ import annotations

import gzip
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from hif8qat.files import sha256_file
from hif8qat.report.paths import PAPER_DIR, REPO
from hif8qat.report.table_files import write_table
from hif8qat.stats.paired import loss_ape, relative_drop

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


def read_authors_run(path: str | Path) -> tuple[list[str], pd.DataFrame]:
    """One of the authors' per-step logs (plain or gzipped CSV with ``#`` header lines).

    Args:
        path: the log file.

    Returns:
        ``(the header lines, a frame of step, loss, lr, quant, ...)``."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        header = []
        for line in fh:
            if not line.startswith("#"):
                break
            header.append(line[1:].strip())
    return header, pd.read_csv(path, comment="#")


def _sha256(path: Path) -> str:
    return sha256_file(path)[:16]


def paper_ape_table(paper_dir: Path = PAPER_DIR, *, last_n: int = 1000,
                    pairs: Sequence[tuple[str, str]] = PAPER_APE_PAIRS) -> pd.DataFrame:
    """Training-loss APE of the authors' quantized runs against their baselines, from their logs.

    Args:
        paper_dir: the folder of the authors' data.
        last_n: steps in the "last" window.
        pairs: (quantized, baseline) run keys.

    Returns:
        One row per pair: n_common, ape_all_pct, ape_last<last_n>_pct, ape_last10pct_pct."""
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

    Args:
        path: the summary file.
        run_order: the summary's run columns (first = baseline).

    Returns:
        Rows (task, run, score_pct, drop_pct_printed) for every non-baseline run and task."""
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
    """Every published comparison: per summary file, each quantized run vs the summary's baseline.

    Args:
        paper_dir: the folder of the authors' data.

    Returns:
        One row per (summary, run, task), with the printed drop and the drop recomputed from the scores."""
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
                    "drop_pct_from_scores": (relative_drop(sb, sq) if sb is not None and sq is not None
                                             else float("nan")),
                    "drop_pct_printed": pq["drop_pct_printed"].iloc[0],
                })
    df = pd.DataFrame(rows)
    return df.astype({"drop_pct_printed": float})


def paper_headline(drops: pd.DataFrame) -> pd.DataFrame:
    """exp8 vs exp7 on the paper's tasks (summary_20260507_102016), both drop computations.

    Args:
        drops: the table of :func:`paper_drop_table`.

    Returns:
        The headline rows."""
    sub = drops[(drops.summary_file == HEADLINE_SUMMARY) & (drops.quantized == "max_quant_lr1e5")
                & (drops.task.isin(["mmlu", "hellaswag", "arc_challenge", "arc_easy", "gsm8k"]))]
    return sub[["task", "num_fewshot", "base_pct", "quant_pct", "drop_pct_printed", "drop_pct_from_scores"]] \
        .reset_index(drop=True)



def build_paper_tables(paper_dir: Path = PAPER_DIR, out_tables: Path | None = None) -> dict[str, pd.DataFrame]:
    """The paper's tables from the authors' data.

    Args:
        paper_dir: the folder of the authors' data.
        out_tables: where to write them (None: not written).

    Returns:
        ``{paper_ape, paper_drops, paper_headline}``."""
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
    """The paper's tables as console text.

    Args:
        tables: what :func:`build_paper_tables` returned.

    Returns:
        The text."""
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
