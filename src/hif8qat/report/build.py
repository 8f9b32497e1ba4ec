"""``build_report``: every table of one profile's run folders, written with its note and sources, the claims
section and the figures; what was built, and what was left out and why, in one message."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from hif8qat.artefacts import accepted_unverified
from hif8qat.files import write_text
from hif8qat.report.anchor import anchor_beside
from hif8qat.report.claims import UNIT_COLUMNS, heldout_table, mde_table
from hif8qat.report.conditions import AGAIN
from hif8qat.report.figures import make_figures
from hif8qat.report.notes import multiple_comparisons, table_notes
from hif8qat.report.reach import reach_table
from hif8qat.report.readme import claims_parts
from hif8qat.report.seeds import seed_null_table, seed_spread
from hif8qat.report.sources import FilesUsed, RunInfo, check_same_items, discover_runs
from hif8qat.report.sweeps import plot_sweeps, sweep_table
from hif8qat.report.table_files import write_table
from hif8qat.report.tables import ablations_table, drops_table, telemetry_table, vs_base_table


def build_report(runs_root: Path, profile: str, out_tables: Path, out_figures: Path, *, n_boot: int = 10000,
                 seed: int = 0, last_frac: float = 0.1, figures: bool = True, replay: bool | None = None,
                 margins: Mapping[str, float] | None = None) -> dict:
    """Tables and figures for all runs of ``profile``; with no runs, writes nothing and says so.

    Args:
        runs_root: the folder that holds the runs.
        profile: the profile's name.
        out_tables: where the tables go.
        out_figures: where the figures go.
        n_boot: bootstrap draws of the paired drop intervals.
        seed: random seed of the draws.
        last_frac: share of the common steps in the APE's "last" window.
        figures: whether to draw figures.
        replay: whether to replay the estimators on the recorded traces (None: as ``figures``).
        margins: equivalence margins per metric (default DEFAULT_MARGINS).

    Returns:
        ``{"tables": {name: DataFrame}, "files": [...], "message": str, "claims_section": markdown}`` (no
        ``claims_section`` when there are no runs)."""
    runs_root, out_tables, out_figures = Path(runs_root), Path(out_tables), Path(out_figures)
    skipped: list[dict] = []  # runs (or parts of them) the tables could not use, and why
    runs = discover_runs(runs_root, profile, skipped)
    if not runs:
        msg = f"no runs under {runs_root / profile} (train some first, e.g. `make exp8 PROFILE={profile}`)"
        msg += "".join(f"\n  not used: {s['run_dir']}: {s['reason']}" for s in skipped)
        return {"tables": {}, "files": [], "message": msg}
    unhashed = check_same_items(runs, runs_root, profile)  # before anything is written: never half a report
    used = FilesUsed()

    parts = claims_parts(runs, runs_root, profile, margins=margins, last_frac=last_frac,
                         replay=figures if replay is None else replay, skipped=skipped, used=used)
    runs_df, metrics_cache, claims_df = parts.runs_df, parts.metrics_cache, parts.claims_df
    baseline_of, parent_of = parts.baseline_of, parts.parent_of
    # against the baseline (same seed): accuracy drops; against the experiment each run derives from: one factor
    drops_df = drops_table(runs, baseline_of, used, n_boot, seed)
    tel_df = telemetry_table(runs, metrics_cache)
    abl_df = ablations_table(runs, parent_of, n_boot, seed)
    vs_base_df = vs_base_table(runs, runs_root, profile, n_boot, seed)
    # seeds: the spread and the BF16-vs-BF16 seed null
    seeds_df = seed_spread(runs_df, drops_df)
    null_df = seed_null_table(runs, n_boot, seed)
    sweeps_df = sweep_table(runs, claims_df, runs_df)
    heldout_df = heldout_table(claims_df, parts.contrasts_df)

    tables = {f"runs_{profile}": runs_df, f"drops_{profile}": drops_df, f"ape_{profile}": pd.DataFrame(parts.ape),
              f"telemetry_{profile}": tel_df, f"replay_{profile}": parts.replay_df, f"ablations_{profile}": abl_df,
              f"scaling_pairs_{profile}": parts.scaling_pairs_df,
              f"vs_base_{profile}": vs_base_df, f"seeds_{profile}": seeds_df, f"seed_null_{profile}": null_df,
              f"claims_{profile}": claims_df, f"mde_{profile}": mde_table(claims_df),
              f"reach_{profile}": reach_table(claims_df),
              "anchor": anchor_beside(runs_root),
              f"pairing_{profile}": parts.pairing_df,
              f"paired_{profile}": parts.contrasts_df.drop(columns=UNIT_COLUMNS, errors="ignore"),
              f"sweeps_{profile}": sweeps_df, f"heldout_{profile}": heldout_df}
    unverified = accepted_unverified()  # trust_unverified=true: files read without an integrity record
    if unverified:
        tables = {name: mark_unverified(df, runs, unverified) for name, df in tables.items()}
    multiple, n_tests = multiple_comparisons(claims_df, profile)
    notes = table_notes(profile, n_boot=n_boot, seed=seed, last_frac=last_frac, margins=margins, multiple=multiple)
    sources = {"files": used.listing(), "runs_root": str(runs_root), "profile": profile, "runs_not_used": skipped}
    if unverified:
        sources["unverified"] = unverified
    files = write_tables(tables, notes, sources, out_tables)
    section_p = out_tables / f"claims_section_{profile}.md"
    if unverified:  # the claims in words carry no column: the warning heads them
        parts.section = ("> **Unverified inputs** (trust_unverified=true): " + "; ".join(sorted(unverified))
                         + ". Every claim below from their runs rests on files with no integrity record.\n\n"
                         + parts.section)
    write_text(section_p, parts.section + "\n")
    files.append(str(section_p))
    if figures:
        files += make_figures(parts.curves, runs, metrics_cache, tel_df, out_figures, profile)
        files += plot_sweeps(sweeps_df, out_figures, profile)
    msg = report_message(runs, tables, profile, parts.unpaired, skipped, multiple if n_tests else "",
                         parts.not_compared)
    if unhashed:
        msg += (f"\nnote: {unhashed} task evaluation(s) recorded no hash of the items they scored (evaluated "
                "before evaluations recorded one): their items are paired by document id, unchecked")
    if unverified:
        msg += (f"\nwarning: {len(unverified)} files were used without an integrity record (trust_unverified="
                "true); every row built from them says so in its column unverified:" + "".join(
                    f"\n  {path}: {why}" for path, why in sorted(unverified.items())))
    return {"tables": tables, "files": files, "message": msg, "claims_section": parts.section}


# Columns of a table row that name a run's experiment (its own, or the one it is compared with).
_EXPERIMENT_COLUMNS = ("experiment", "baseline", "against", "counterpart", "derived_from")
UNVERIFIED_COLUMN = "unverified"


def mark_unverified(df: pd.DataFrame, runs: Sequence[RunInfo], unverified: Mapping[str, str]) -> pd.DataFrame:
    """Mark, on each row, the files used without an integrity record by the runs the row comes from (its
    experiment and the ones it is compared with, at its seed when it has one). A table with no column naming runs
    gets the column on every row: it may come from any of them.

    Args:
        df: the table.
        runs: the runs read.
        unverified: path -> why, for the files read unverified.

    Returns:
        ``df`` with the column added ("" on the other rows); ``df`` itself when empty."""
    if df is None or not len(df):
        return df
    by_run: dict[tuple[str, Any], list[str]] = {}
    for run in runs:
        inside = sorted(p for p in unverified if Path(p).is_relative_to(run.path))
        if inside:
            by_run.setdefault((run.experiment, run.seed), []).extend(inside)
    every = "; ".join(sorted(unverified))
    named = [c for c in _EXPERIMENT_COLUMNS if c in df.columns]
    if not named and "trace_source" not in df.columns:
        return df.assign(**{UNVERIFIED_COLUMN: every})

    def files_of(row) -> str:
        keys = [row[c] for c in named]
        if "trace_source" in row and isinstance(row["trace_source"], str) and "/seed" in row["trace_source"]:
            exp, _, seed = row["trace_source"].rpartition("/seed")
            return "; ".join(by_run.get((exp, int(seed)) if seed.isdigit() else (exp, seed), []))
        seed = row.get("seed") if "seed" in row else None
        found = [f for (exp, run_seed), files in by_run.items() if exp in keys
                 and (seed is None or pd.isna(seed) or run_seed == seed) for f in files]
        return "; ".join(sorted(set(found)))

    return df.assign(**{UNVERIFIED_COLUMN: [files_of(row) for _, row in df.iterrows()]})


def write_tables(tables: Mapping[str, pd.DataFrame], notes: Mapping[str, str], sources: Mapping[str, Any],
                 out_tables: Path) -> list[str]:
    """Every table's csv, md and sources.json, each with its note.

    Args:
        tables: name -> table.
        notes: name -> its note.
        sources: what every sidecar records.
        out_tables: the folder to write into.

    Returns:
        The paths written."""
    files = []
    for name, df in tables.items():
        files += list(write_table(df, out_tables, name, title=name.replace("_", " "),
                                  sources={**sources, "note": notes[name]}).values())
    return files


def report_message(runs: list[RunInfo], tables: Mapping[str, pd.DataFrame], profile: str, unpaired: Sequence[str],
                   skipped: Sequence[Mapping[str, str]], multiple: str, not_compared: Sequence[tuple] = ()) -> str:
    """What was built; runs made from a dirty tree, runs without a pair, evaluations not compared as made
    differently, runs not used (and why).

    Args:
        runs: the runs read.
        tables: name -> table.
        profile: the profile's name.
        unpaired: the runs without a pair, with why.
        skipped: the runs (or parts) not used, with why.
        multiple: the multiple-comparisons note, when the claims hold any test.
        not_compared: the claims' task evaluations left out as made differently, ``(the two evaluations, task,
            the conditions that differ)`` (the seed-null and base-model tables' are read from their ``eval_differs``
            column).

    Returns:
        The message, several lines."""
    runs_df = tables[f"runs_{profile}"]
    msg = f"{len(runs)} runs, {len(tables[f'drops_{profile}'])} drop rows, {len(tables[f'ape_{profile}'])} APE rows"
    n_dirty = int(runs_df["dirty"].fillna(False).astype(bool).sum())
    if n_dirty:
        msg += (f"\nwarning: {n_dirty} of {len(runs)} runs were made from a tree with uncommitted changes (runs_"
                f"{profile} column dirty): their recorded commit does not hold their exact code")
    if unpaired:
        msg += f"\nnot paired ({len(unpaired)}; pairing_{profile}):\n  " + "\n  ".join(unpaired)
    grouped: dict[tuple[str, str], list[str]] = {}  # one line per two evaluations and their differences
    for pair, task, why in [*not_compared, *_eval_differs_rows(tables, profile)]:
        grouped.setdefault((pair, why), []).append(task)
    if grouped:
        msg += (f"\nnot compared, evaluated differently ({len(grouped)}; column eval_differs; {AGAIN}):\n  "
                + "\n  ".join(f"{pair} ({', '.join(tasks)}): {why}" for (pair, why), tasks in grouped.items()))
    if skipped:
        msg += "\nruns not used, or used in part (also in each table's .sources.json, runs_not_used):" + "".join(
            f"\n  {s['run_dir']}: {s['reason']}" for s in skipped)
    if multiple:
        msg += "\n" + multiple
    return msg


def _eval_differs_rows(tables: Mapping[str, pd.DataFrame], profile: str) -> list[tuple[str, str, str]]:
    """The seed-null and base-model comparisons left out as made differently, as ``(the two evaluations, task,
    the conditions that differ)`` (the claims name their own)."""
    rows = []
    for name, first, second in ((f"seed_null_{profile}", "{experiment}/seed{seed_a}", "{experiment}/seed{seed_b}"),
                                (f"vs_base_{profile}", "base model", "{experiment}/seed{seed}")):
        df = tables.get(name)
        if df is None or "eval_differs" not in df:
            continue
        for row in df[df["eval_differs"].fillna("") != ""].to_dict("records"):
            rows.append((f"{first.format(**row)} bf16 vs {second.format(**row)} bf16", row["task"],
                         row["eval_differs"]))
    return rows
