"""The per-run tables: the runs overview, drops and loss APE against the baseline, telemetry, one-factor
ablations and scaling pairs against the experiment each run derives from, drops against the untrained base
model. One builder per table; rows follow the order of the runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from hif8qat.report.conditions import task_differences
from hif8qat.report.items import align_samples, item_stats, paired_comparison
from hif8qat.report.sources import (
    FilesUsed,
    RunInfo,
    dirty_of,
    eval_results,
    format_of,
    get_dotted,
    git_of,
    qat_start,
    read_metrics,
    read_report_json,
    read_samples,
    tag_of,
    targets_of,
)
from hif8qat.report.telemetry import scaling_outcome, telemetry_summary
from hif8qat.stats.heldout import run_label
from hif8qat.stats.paired import loss_ape, relative_drop

# A run, its baseline and both their metrics.jsonl frames: one loss-curve comparison.
LossPair = tuple[RunInfo, RunInfo, pd.DataFrame, pd.DataFrame]


def runs_table(runs: list[RunInfo], skipped: list[dict], used: FilesUsed
               ) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """One row per run (steps, final loss, wall time, provenance, ``<mode>:<task>`` scores) and every run's metrics.

    Args:
        runs: the runs read.
        skipped: collects a run without a loss curve, or unfinished, with why.
        used: collects the files read.

    Returns:
        ``(runs table, run folder -> its metrics.jsonl frame)``."""
    run_rows, metrics_cache = [], {}
    for r in runs:
        mp = r.path / "metrics.jsonl"
        m = read_metrics(mp) if mp.exists() else pd.DataFrame()
        metrics_cache[str(r.path)] = m
        summ = read_report_json(r.path / "summary.json") if (r.path / "summary.json").exists() else {}
        if "loss" not in m or not len(m):
            skipped.append({"run_dir": str(r.path),
                            "reason": f"{mp.name} {'holds no loss' if mp.exists() else 'is missing'}"
                            + (" although the run is finished" if r.done else " (unfinished run)")
                            + ": no loss curve, left out of the APE, telemetry and scaling-pair tables"})
        elif not r.done:
            skipped.append({"run_dir": str(r.path), "reason": "unfinished (no DONE marker): its losses so far are "
                            "in the runs table, its curve is partial"})
        row = {"experiment": r.experiment, "run_tag": tag_of(r), "seed": r.seed, "paper_run": r.paper_run,
               "quant": r.quant,
               "estimator": r.estimator, "baseline": r.baseline, "done": r.done,
               "steps": int(m["step"].max()) + 1 if "step" in m and len(m) else 0,
               "skipped_updates": skipped_updates(summ, m),
               "final_loss": float(m["loss"].iloc[-1]) if "loss" in m and len(m) else float("nan"),
               "wall_time_s": next((summ[k] for k in ("wall_time_s", "train_wall_s", "train_wall_s_this_session")
                                    if k in summ), float("nan")),
               "git": git_of(r), "dirty": dirty_of(r), "run_dir": str(r.path)}
        for mode in ("bf16", "hif8"):
            for task, res in eval_results(r, mode).items():
                row[f"{mode}:{task}"] = res.get("value", float("nan")) * 100.0
                used.add(r, r.path / "eval" / mode / "results.json")
        if mp.exists():
            used.add(r, mp)
        used.add_run(r)
        run_rows.append(row)
    runs_df = pd.DataFrame(run_rows).sort_values(["experiment", "run_tag", "seed"]).reset_index(drop=True)
    return runs_df, metrics_cache


def skipped_updates(summary: Mapping[str, Any], metrics: pd.DataFrame) -> int:
    """Optimizer updates the run skipped for a non-finite gradient norm: summary.json's count when the run
    finished, else its step log's last (an unfinished run).

    Args:
        summary: the run's summary.json content.
        metrics: its metrics table.

    Returns:
        The count."""
    if isinstance(summary.get("skipped_steps"), int):
        return int(summary["skipped_steps"])
    if "skipped_steps" in metrics and metrics["skipped_steps"].notna().any():
        return int(metrics["skipped_steps"].dropna().iloc[-1])
    return 0


def mark_skipped_updates(claims: pd.DataFrame, contrasts: pd.DataFrame, runs_df: pd.DataFrame) -> pd.DataFrame:
    """Name, on each claim, the runs it pairs that skipped optimizer updates ("exp8/seed2: 1 update"). Such a run
    trained on fewer updates than its counterpart, so the claim's difference is not quantization's alone.

    Args:
        claims: the claims table.
        contrasts: the per-seed contrasts.
        runs_df: the runs table.

    Returns:
        The claims with a ``skipped_update_runs`` column ("" where none did)."""
    if claims.empty:
        return claims
    skipped = {run_label(Path(d)): int(n) for d, n in zip(runs_df["run_dir"], runs_df["skipped_updates"]) if n}
    keys = [k for k in ("experiment", "run_tag", "against", "counterpart", "mode", "task", "metric")
            if k in claims and k in contrasts]
    named: dict[tuple, set] = {}
    for row in contrasts.to_dict("records"):
        for label in (row.get("run"), row.get("counterpart_run")):
            if label in skipped:
                named.setdefault(tuple(str(row[k]) for k in keys), set()).add(label)
    text = [", ".join(f"{label}: {skipped[label]} update{'s' if skipped[label] != 1 else ''}"
                      for label in sorted(named.get(tuple(str(row[k]) for k in keys), ())))
            for row in claims.to_dict("records")]
    return claims.assign(skipped_update_runs=text)


def loss_pairs(runs: list[RunInfo], baseline_of: Mapping[str, RunInfo | None],
               metrics_cache: Mapping[str, pd.DataFrame]) -> list[LossPair]:
    """Every run paired with a baseline where both logged a loss (the APE rows and the loss figures).

    Args:
        runs: the runs read.
        baseline_of: run folder -> its baseline run (or None).
        metrics_cache: run folder -> its metrics table.

    Returns:
        ``(run, baseline, run metrics, baseline metrics)`` per pair."""
    pairs = []
    for r in runs:
        b = baseline_of[str(r.path)]
        if b is None:
            continue
        mq, mb = metrics_cache[str(r.path)], metrics_cache[str(b.path)]
        if "loss" in mq and "loss" in mb and len(mq) and len(mb):
            pairs.append((r, b, mq, mb))
    return pairs


def ape_rows(curves: Sequence[LossPair], last_frac: float) -> list[dict[str, Any]]:
    """Per loss pair: the training-loss APE over all common steps, the last ``last_frac`` and the QAT phase.

    Args:
        curves: the pairs of :func:`loss_pairs`.
        last_frac: share of the common steps in the "last" window.

    Returns:
        One dict per pair."""
    rows = []
    for r, b, mq, mb in curves:
        a = loss_ape(mq["step"], mq["loss"], mb["step"], mb["loss"], last_frac=last_frac)
        qat_from = qat_start(r, mq)
        qat = mq[mq["step"] >= qat_from] if qat_from is not None else mq.iloc[:0]
        aq = loss_ape(qat["step"], qat["loss"], mb["step"], mb["loss"], last_frac=last_frac)
        rows.append({"experiment": r.experiment, "run_tag": tag_of(r), "baseline": b.experiment,
                     "seed": r.seed,
                     "n_common": a["n_common"], "ape_all_pct": a["ape_all"], "ape_last_pct": a["ape_last"],
                     "last_n": a["last_n"], "last_frac": last_frac, "qat_from_step": qat_from,
                     "n_qat": aq["n_common"], "ape_qat_pct": aq["ape_all"],
                     "final_loss_quant": float(mq["loss"].iloc[-1]), "final_loss_base": float(mb["loss"].iloc[-1])})
    return rows


def drops_table(runs: list[RunInfo], baseline_of: Mapping[str, RunInfo | None], used: FilesUsed, n_boot: int,
                seed: int) -> pd.DataFrame:
    """Per run, evaluation mode and task: the relative drop against the baseline's bf16 evaluation, one row per
    seed, with its paired interval when both evaluations saved their items; none where the two were evaluated
    differently (``eval_differs`` names how, :mod:`hif8qat.report.conditions`).

    Args:
        runs: the runs read.
        baseline_of: run folder -> its baseline run (or None).
        used: collects the files read.
        n_boot: bootstrap draws.
        seed: random seed of the draws.

    Returns:
        The table."""
    drop_rows = []
    for r in runs:
        b = baseline_of[str(r.path)]
        if b is None:
            continue
        base_res = eval_results(b, "bf16")
        for qmode in ("bf16", "hif8"):
            q_res = eval_results(r, qmode)
            differs = task_differences(b.path / "eval" / "bf16", r.path / "eval" / qmode,
                                       [t for t in q_res if t in base_res])
            for task, why in differs.items():
                qr = q_res[task]
                bs = None if why else read_samples(b.path / "eval" / "bf16" / f"samples_{task}.csv")
                qs = None if why else read_samples(r.path / "eval" / qmode / f"samples_{task}.csv")
                row = {"experiment": r.experiment, "run_tag": tag_of(r), "baseline": b.experiment, "seed": r.seed,
                       "quant_mode": qmode,
                       "task": task, "metric": qr.get("metric"), "base_pct": base_res[task]["value"] * 100.0,
                       "quant_pct": qr["value"] * 100.0,
                       "drop_pct": float("nan") if why else relative_drop(base_res[task]["value"], qr["value"])}
                if bs is not None and qs is not None:
                    xb, xq = align_samples(bs, qs)
                    row.update(drop_paired_pct=relative_drop(float(xb.mean()), float(xq.mean()))
                               if len(xb) else float("nan"), **item_stats(xb, xq, n_boot, seed))
                    used.add(b, b.path / "eval" / "bf16" / f"samples_{task}.csv")
                    used.add(r, r.path / "eval" / qmode / f"samples_{task}.csv")
                else:
                    row.update(n_paired=0, drop_paired_pct=float("nan"), ci_lo=float("nan"), ci_hi=float("nan"),
                               significant=False, discordant=float("nan"), p_mcnemar=float("nan"),
                               ci_method="")
                drop_rows.append({**row, "eval_differs": why})
    return pd.DataFrame(drop_rows)


def telemetry_table(runs: list[RunInfo], metrics_cache: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Per run and role, the telemetry summary of its metrics.jsonl (:func:`telemetry_summary`).

    Args:
        runs: the runs read.
        metrics_cache: run folder -> its metrics table.

    Returns:
        The table."""
    tel_rows = []
    for r in runs:
        m = metrics_cache[str(r.path)]
        if not len(m):
            continue
        ts = telemetry_summary(m)
        for _, t in ts.iterrows():
            tel_rows.append({"experiment": r.experiment, "seed": r.seed, "format": format_of(r),
                             "estimator": r.estimator, **t.to_dict()})
    return pd.DataFrame(tel_rows)


def _changes(run: RunInfo) -> list[str]:
    """The settings the run's experiment declares it changes from the one it derives from."""
    return list(get_dotted(run.config, "experiment.changes", []) or [])


def ablations_table(runs: list[RunInfo], parent_of: Mapping[str, RunInfo | None], n_boot: int,
                    seed: int) -> pd.DataFrame:
    """One-factor ablations: each run against the experiment it derives from (e.g. exp7 vs exp1 = the learning
    rate alone, both BF16: the forgetting comparison; exp9 vs exp8 = the BF16 warmup alone), in bf16 mode and,
    when both runs are quantized, in the quantized mode too (exp11 vs exp8: FP8 vs HiF8 inference).

    Args:
        runs: the runs read.
        parent_of: run folder -> the run it derives from (or None).
        n_boot: bootstrap draws.
        seed: random seed of the draws.

    Returns:
        The table."""
    abl_rows = []
    for r in runs:
        parent = parent_of[str(r.path)]
        if parent is None:
            continue
        head = {"experiment": r.experiment, "run_tag": tag_of(r), "derived_from": parent.experiment,
                "changes": ",".join(_changes(r)), "seed": r.seed}
        for mode in ("bf16", "hif8"):
            if mode != "bf16" and not (r.quant and parent.quant):
                continue
            abl_rows += [{**head, "mode": mode, **row} for row in paired_comparison(
                parent.path / "eval" / mode, r.path / "eval" / mode, n_boot, seed)]
    return pd.DataFrame(abl_rows)


SCALING_FACTORS = {"quant.format", "quant.margin", "quant.algo", "quant.target"}



def _scaling_pair(run: RunInfo, other: RunInfo, changes: Sequence[str], metrics_cache: Mapping[str, pd.DataFrame],
                  ape_of: Mapping[tuple, Mapping[str, Any]]) -> dict[str, Any]:
    """One row of the scaling-pairs table: ``run`` and the run it derives from, side by side."""
    row: dict[str, Any] = {"experiment": run.experiment, "counterpart": other.experiment,
                           "changes": ",".join(changes), "seed": run.seed}
    for side, r in (("", run), ("cp_", other)):
        m = metrics_cache[str(r.path)]
        ape = ape_of.get((r.experiment, tag_of(r), r.seed), {})
        row.update({f"{side}format": format_of(r), f"{side}algo": r.estimator, f"{side}targets": targets_of(r),
                    **{f"{side}{k}": v for k, v in (scaling_outcome(m) if len(m) else {}).items()},
                    # the gradients alone: what a change of G's target moves
                    **{f"{side}G_{k}": v for k, v in (scaling_outcome(m, ("G",)) if len(m) else {}).items()},
                    f"{side}ape_qat_pct": ape.get("ape_qat_pct", float("nan")),
                    f"{side}final_loss": float(m["loss"].iloc[-1]) if "loss" in m and len(m) else float("nan")})
    return row


def scaling_pairs_table(runs: list[RunInfo], parent_of: Mapping[str, RunInfo | None],
                        metrics_cache: Mapping[str, pd.DataFrame], ape: Sequence[Mapping[str, Any]]
                        ) -> pd.DataFrame:
    """The one-factor pairs of two quantized runs that change only SCALING_FACTORS, side by side.

    Args:
        runs: the runs read.
        parent_of: run folder -> the run it derives from (or None).
        metrics_cache: run folder -> its metrics table.
        ape: the rows of :func:`ape_rows`.

    Returns:
        The table."""
    pair_rows = []
    ape_of = {(a["experiment"], a["run_tag"], a["seed"]): a for a in ape}
    for r in runs:
        parent = parent_of[str(r.path)]
        if parent is None:
            continue
        changes = _changes(r)
        if r.quant and parent.quant and changes and set(changes) <= SCALING_FACTORS:
            pair_rows.append(_scaling_pair(r, parent, changes, metrics_cache, ape_of))
    return pd.DataFrame(pair_rows)


def vs_base_table(runs: list[RunInfo], runs_root: Path, profile: str, n_boot: int, seed: int) -> pd.DataFrame:
    """Every run against the untrained base model, when its evaluation is on file (forgetting).

    Args:
        runs: the runs read.
        runs_root: the folder that holds the runs.
        profile: the profile's name.
        n_boot: bootstrap draws.
        seed: random seed of the draws.

    Returns:
        The table; empty when the base model's evaluation is not on file."""
    base_model_dir = runs_root.parent / "base_model" / profile
    vs_base_rows = []
    if (base_model_dir / "results.json").exists():
        for r in runs:
            head = {"experiment": r.experiment, "seed": r.seed, "lr": get_dotted(r.config, "train.lr"),
                    "quant": r.quant}
            vs_base_rows += [{**head, **row} for row in paired_comparison(base_model_dir, r.path / "eval" / "bf16",
                                                                           n_boot, seed)]
    return pd.DataFrame(vs_base_rows)
