"""The claims section in words (the markdown experiments/README.md includes between its claims markers), built
from the claims table alone; ``python -m hif8qat.report --readme`` rewrites it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from hif8qat.report.claims import (
    CLAIM_KEYS,
    DEFAULT_MARGINS,
    METRIC_UNITS,
    NOT_RECORDED,
    ONE_SEED,
    PAPER_CLAIMS,
    all_contrasts,
    claims_table,
)
from hif8qat.report.pairing import pair_runs
from hif8qat.report.reach import reach_section, reach_table
from hif8qat.report.replay import replay_table
from hif8qat.report.saturation import saturation_section
from hif8qat.report.sources import FilesUsed, RunInfo, discover_runs
from hif8qat.report.tables import ape_rows, loss_pairs, mark_skipped_updates, runs_table, scaling_pairs_table
from hif8qat.stats.heldout import HELDOUT_METRIC

CLAIMS_BEGIN, CLAIMS_END = "<!-- claims:begin -->", "<!-- claims:end -->"


def _num(v: float, nd: int = 2, sign: bool = True) -> str:
    if v is None or not np.isfinite(v):
        return "-"
    v = round(float(v), nd) + 0.0  # no "-0.00"
    return f"{v:+.{nd}f}" if sign else f"{v:.{nd}f}"


def _df(r) -> str:
    """A row's degrees of freedom as the table shows them: whole when they are, else one decimal."""
    df = r.get("df", np.nan)
    if df is None or not np.isfinite(df):
        return "-"
    return f"{df:.0f}" if abs(df - round(df)) < 0.05 else f"{df:.1f}"


def _claim_words(g: pd.DataFrame) -> list[str]:
    """Sentences for one claim from its rows: the loss difference, then accuracy and per-item metrics by verdict."""
    out = []
    continuous = g[g.metric.isin(["train_loss", HELDOUT_METRIC])]
    for _, r in continuous.iterrows():
        if r["equivalence"] == NOT_RECORDED:
            continue
        cost = _num(r["cost"], 3)
        what = (f"Training loss: {cost} % of the counterpart's loss" if r["metric"] == "train_loss" else
                f"Held-out NLL ({r['mode']} mode): {cost} % of the counterpart's held-out NLL")
        out.append(what + f" (95 % CI {_num(r['ci_lo'], 3)} to "
                   f"{_num(r['ci_hi'], 3)}, {r['n_seeds']} seed(s), {_df(r)} df)"
                   + (f": {ONE_SEED} (no seed variance to borrow)." if r["equivalence"] == ONE_SEED else
                      f": {r['equivalence']}; difference {r['difference']} (p adj {_num(r['p_adj'], 3, False)}; "
                      f"detectable: {_num(r['mde'], 3, False)} %)."))
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
        diff = rows[rows["difference"].isin(["worse", "better"])]
        found = ("; a difference after adjustment on " + ", ".join(f"{r['mode']} {r['task']} ({r['difference']})"
                                                          for _, r in diff.iterrows())) if len(diff) else \
            "; no difference detected after adjustment"
        text = f"{label} (mode x task): " + ", ".join(parts) + found + "."
        if metric == "accuracy":
            flips = int(rows["lost"].sum() + rows["gained"].sum())
            mde = rows["mde"].dropna()
            text += (f" {flips} flips in all ({int(rows['lost'].sum())} lost, {int(rows['gained'].sum())} gained) "
                     f"from {int(rows['flip_items'].sum())} distinct items (summed over the mode x task rows), "
                     "each item "
                     "tested once over its seeds; "
                     + (f"the smallest cost a row's item test detects with 80 % power, under the flip model (the "
                        f"effect's items lose in every seed), is {mde.min():.1f} % of the score"
                        if len(mde) else "no row can size a detectable drop") + ".")
            text += " " + _homogeneity_words(rows)
        out.append(text)
    return out


def _homogeneity_words(rows: pd.DataFrame) -> str:
    """The item test's independence assumption checked on a claim's accuracy rows: the seeds' shares of gains
    among their flips (chi-square of seeds x lost / gained summed over the claim's rows that can show it, p from
    their joint conditional null)."""
    if "claim_homog_rows" not in rows:
        return ""
    n_rows = rows["claim_homog_rows"].fillna(0)
    if not (n_rows > 0).any():
        return ("Gain share across seeds (the item test's independence check): no row has flips both ways in two "
                "seeds, nothing to compare.")
    r0 = rows[n_rows > 0].iloc[0]
    low = rows[rows["homog_p"] < 0.05]
    return (f"Gain share across seeds (the item test's independence check): chi-square {r0['claim_homog_chi2']:.1f} "
            f"on {int(r0['claim_homog_df'])} df over {int(r0['claim_homog_rows'])} row(s) (p "
            f"{_num(r0['claim_homog_p'], 3, False)}, from the rows' joint conditional null); "
            + ("no row below p 0.05." if low.empty else "below p 0.05, so that row takes the crossed t interval and "
               "test alone: " + ", ".join(f"{r['mode']} {r['task']} (p {r['homog_p']:.3f})"
                                          for _, r in low.iterrows()) + "."))


def _summary_words(g: pd.DataFrame) -> str:
    """A claim's verdicts in one sentence, from its rows: what differs, what is not equivalent, what is."""
    rows = g[g["equivalence"] != NOT_RECORDED]

    def where(sub, verdict=False):
        return ", ".join((f"{r['mode']} {r['task']} {r['metric']}" if r["metric"] != "train_loss" else
                          "training loss") + (f" ({r['difference']})" if verdict else "")
                         for _, r in sub.iterrows()) or "none"

    diff = rows[rows["difference"].isin(["worse", "better"])]
    parts = [f"differences detected after adjustment: {where(diff, verdict=True)}",
             f"not equivalent: {where(rows[rows['equivalence'] == 'not equivalent'])}",
             f"equivalent within the margin: {len(rows[rows['equivalence'].str.startswith('equivalent')])} of "
             f"{len(rows)} rows"]
    bare = rows[rows["equivalence"] == ONE_SEED]
    if len(bare):
        parts.append(f"{ONE_SEED} (no seed variance to borrow): {len(bare)} rows")
    return "In sum: " + "; ".join(parts) + "."


def _pair_words(r) -> str:
    """A claim row's comparison in words: "exp8 in hif8 vs bf16 mode", "exp2 vs exp1 (bf16)"."""
    tag = f" [{r['run_tag']}]" if r.get("run_tag") else ""
    if r["against"] == "bf16_mode":
        return f"{r['experiment']}{tag} in {r['mode']} vs bf16 mode"
    return f"{r['experiment']}{tag} vs {r['counterpart']} ({r['mode']})"


def accuracy_checks(claims: pd.DataFrame) -> list[str]:
    """The accuracy rows' interval against their test, and the item test's assumption per claim, in words
    (after the claims).

    Args:
        claims: the claims table.

    Returns:
        Markdown lines; empty without accuracy rows."""
    if claims.empty or "homog_df" not in claims:
        return []
    acc = claims[(claims["metric"] == "accuracy") & ~claims["equivalence"].isin([NOT_RECORDED, ONE_SEED])]
    if acc.empty:
        return []
    excludes = (acc["ci_lo"] > 0) | (acc["ci_hi"] < 0)
    disagree = int(((acc["p"] < 0.05) != excludes).sum())
    checked = acc.drop_duplicates(CLAIM_KEYS)
    checked = checked[checked["claim_homog_rows"].fillna(0) > 0]
    flagged = checked[checked["claim_homog_p"] < 0.05]
    rows_ok = acc[acc["homog_df"].fillna(0) > 0]
    low = rows_ok[rows_ok["homog_p"] < 0.05]
    lines = ["#### Accuracy: the interval, the test and its assumption", "",
             f"Of {len(acc)} accuracy rows with a test, {disagree} have a 95 % interval and a test (p < 0.05) that "
             "disagree about a zero difference: each interval is the hull of the crossed t interval and the one "
             "that inverts the exact item test, and a difference needs both tests to reject. The item test is "
             "exact only if the items' net flips are independent; a training-noise shift shared by all items of "
             "one seed would break it and would show as seeds whose shares of gains among their flips differ. "
             f"Per claim (claims share runs, so their checks are not summed), p from the rows' joint conditional "
             f"null: {len(flagged)} of {len(checked)} claims below p 0.05"
             + (" (" + "; ".join(f"{_pair_words(r)}, p {r['claim_homog_p']:.3f}" for _, r in flagged.iterrows())
                + ")" if len(flagged) else "")
             + f"; per row, {len(low)} of {len(rows_ok)} below p 0.05 (about {0.05 * len(rows_ok):.1f} expected "
             "by chance)" + (", which take the crossed t interval and test alone: " + "; ".join(
                 f"{_pair_words(r)} {r['task']}, p {r['homog_p']:.3f}" for _, r in low.iterrows())
                 if len(low) else "") + ".", ""]
    return lines


def claims_section(claims: pd.DataFrame, runs_df: pd.DataFrame, profile: str,
                   margins: Mapping[str, float] | None = None, telemetry: Sequence[str] = ()) -> str:
    """The claims, numbers and verdicts in words, as markdown built from the claims table (the README includes
    it between CLAIMS_BEGIN and CLAIMS_END; ``python -m hif8qat.report --readme`` updates it).

    Args:
        claims: the claims table.
        runs_df: the runs table (for the commits).
        profile: the profile's name.
        margins: equivalence margins per metric (None: DEFAULT_MARGINS).
        telemetry: lines of :func:`hif8qat.report.saturation.saturation_section`, placed before the reach.

    Returns:
        The markdown."""
    margins = {**DEFAULT_MARGINS, **(margins or {})}
    lines = [f"_Generated by the report from the run files (`claims_{profile}`); do not edit by hand._", ""]
    if len(runs_df) and "dirty" in runs_df:
        dirty = runs_df[runs_df["dirty"].fillna(False).astype(bool)]
        commits = runs_df.groupby("experiment")["git"].agg(lambda c: ", ".join(sorted({str(x)[:7] for x in c})))
        state = ("all made from a clean tree (`git.dirty` false in their run_info.json), so each commit holds "
                 "the exact code of its runs" if dirty.empty else
                 f"**{len(dirty)} of them were made from a tree with uncommitted changes** (`git.dirty` in their "
                 "run_info.json): their commit does not hold their exact code")
        lines += [f"**Provenance.** {len(runs_df)} runs, {state}. Commits per experiment: "
                  + "; ".join(f"{e} {c}" for e, c in commits.items()) + ".", ""]
    lines += ["**Reading.** cost > 0: the run is worse than its counterpart (accuracy: relative drop in % of the "
              "counterpart's score; training loss: signed per-step difference over the QAT phase in % of the "
              "counterpart's loss; gold log-likelihood and margin: nats per item; held-out NLL: paired per-token "
              "difference on held-out text in % of the counterpart's). Each row pools the same-seed "
              "pairs; its 95 % CI comes from the design's own units, fixed by the metric: training loss, t on the "
              "per-seed means (seeds - 1 df); the other metrics score the same items (held-out windows) in every "
              "seed, so seeds and items are crossed random effects (Satterthwaite df, a component within 1e-9 of "
              "the mean squares' scale of zero counting as none). One seed cannot show its own seed's shift: "
              "its interval adds the seed variance of the multi-seed claims of the same comparison, mode, task "
              "and metric (pooled with weights seeds - 1, on the largest claim's df; `seed_var_source` in the "
              "table), and where there is none to borrow both verdicts read \"one seed: direction only\". df: "
              "the interval's degrees of freedom (accuracy: its interval is the hull of the crossed t one and "
              "the exact one of the item test, below). "
              "Equivalence: two one-sided tests against the margin ("
              + ", ".join(f"{k} {v:g} {METRIC_UNITS[k]}" for k, v in margins.items())
              + "): \"equivalent within M\", \"not equivalent\" or \"inconclusive at this size\"; a "
              "non-significant difference is never read as no effect. Difference: one test per row with the "
              "seeds pooled (accuracy: an exact permutation test over items of each item's net flips over the "
              "seeds, so an item flipping in several seeds counts once, and the crossed t test: both must "
              "reject), p adj: adjusted in its family, named under each claim: the headline claims below form "
              "one family, Holm-adjusted over all their rows (family-wise error); every other row of the table "
              "is Benjamini-Hochberg-adjusted over the whole table (false discovery rate; `p_bh` is there for "
              "every row). MDE: the cost "
              "that test detects with 80 % power (accuracy: under a flip model where the effect's items lose in "
              "every seed). Flips: lost / gained summed over seeds, and the distinct items behind them.", ""]
    if claims.empty:
        return "\n".join(lines + ["_(no claims: no paired runs)_", ""])
    ran = set(runs_df["experiment"]) if "experiment" in runs_df else set()
    for title, exp, against, counterpart, meaning in PAPER_CLAIMS:
        if exp not in ran:  # not run in this folder (yet): nothing to claim, no empty heading
            continue
        g = claims[(claims.experiment == exp) & (claims.run_tag == "") & (claims.against == against)
                   & (claims.counterpart == counterpart)]
        seeds = ", ".join(sorted({x for s in g["seeds"] for x in str(s).split(",")})) if len(g) else ""
        pair = f"{exp} in hif8 vs bf16 mode" if against == "bf16_mode" else f"{exp} vs {counterpart}"
        lines += [f"#### {title}: {pair}" + (f" (seeds {seeds})" if seeds else ""), ""]
        if g.empty:
            lines += [f"No paired runs of {exp} and {counterpart} (see `pairing_{profile}`).", ""]
            continue
        family = g["family"].dropna().iloc[0] if "family" in g and g["family"].notna().any() else ""
        lines += [f"cost > 0: {meaning}." + (f" Difference verdicts: family of the {family}." if family else ""), ""]
        lines += ["| mode | task | metric | seeds | cost (95 % CI) | df | lost / gained | p adj | MDE | margin | "
                  "equivalence | difference |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for _, r in g.iterrows():
            if r["equivalence"] == NOT_RECORDED:
                continue
            flips = f"{int(r['lost'])} / {int(r['gained'])}" if r["metric"] not in ("train_loss", HELDOUT_METRIC) and \
                np.isfinite(r.get("lost", np.nan)) else "-"
            if r["metric"] == "accuracy" and np.isfinite(r.get("flip_items", np.nan)):
                flips += f" ({int(r['flip_items'])} items)"
            alone = "within seed: " if r["equivalence"] == ONE_SEED else ""  # no seed variance in its interval
            lines.append(f"| {r['mode']} | {r['task']} | {r['metric']} | {r['n_seeds']} | {_num(r['cost'])} "
                         f"({alone}{_num(r['ci_lo'])} to {_num(r['ci_hi'])}) | {_df(r)} | {flips} | "
                         f"{_num(r['p_adj'], 3, False)} | "
                         f"{_num(r['mde'], 2, False)} | {r['margin']:g} | {r['equivalence']} | "
                         f"{r['difference']} |")
        lines += [""] + [f"- {w}" for w in _claim_words(g)] + [f"- {_summary_words(g)}", ""]
    lines += accuracy_checks(claims) + list(telemetry) + reach_section(reach_table(claims))
    return "\n".join(lines)


def replace_between_markers(text: str, block: str) -> str:
    """Replace what lies between CLAIMS_BEGIN and CLAIMS_END.

    Args:
        text: the document.
        block: the new content.

    Returns:
        ``text`` with the block replaced.

    Raises:
        ValueError: the markers are missing or out of order."""
    i, j = text.find(CLAIMS_BEGIN), text.find(CLAIMS_END)
    if i < 0 or j < i:
        raise ValueError(f"no {CLAIMS_BEGIN} ... {CLAIMS_END} block")
    return text[: i + len(CLAIMS_BEGIN)] + "\n" + block.strip() + "\n" + text[j:]


def between_markers(text: str) -> str | None:
    """What lies between CLAIMS_BEGIN and CLAIMS_END.

    Args:
        text: the document.

    Returns:
        The block, stripped; None when the markers are missing."""
    i, j = text.find(CLAIMS_BEGIN), text.find(CLAIMS_END)
    return text[i + len(CLAIMS_BEGIN): j].strip() if 0 <= i < j else None


@dataclass
class ClaimsParts:
    """What the claims section is built from, and the section: shared by the report and the README."""

    runs_df: pd.DataFrame
    metrics_cache: dict[str, pd.DataFrame]
    baseline_of: dict
    parent_of: dict
    pairing_df: pd.DataFrame
    unpaired: list[str]
    curves: list
    ape: list[dict]
    scaling_pairs_df: pd.DataFrame
    replay_df: pd.DataFrame
    contrasts_df: pd.DataFrame
    claims_df: pd.DataFrame
    section: str
    not_compared: list[tuple]  # (evaluations, task, conditions) the claims leave out as made differently


def skipped_updates_note(claims_df: pd.DataFrame, profile: str) -> str:
    """A paragraph naming every claim that rests on a run with skipped optimizer updates.

    Args:
        claims_df: the claims table.
        profile: the profile's name.

    Returns:
        The paragraph; "" when no claim does."""
    if claims_df.empty or "skipped_update_runs" not in claims_df:
        return ""
    marked = claims_df[claims_df["skipped_update_runs"] != ""]
    if marked.empty:
        return ""
    lines = [f"- {r.experiment}{f' ({r.run_tag})' if r.run_tag else ''} vs {r.counterpart}, {r.mode} {r.task} "
             f"{r.metric}: {r.skipped_update_runs}" for r in marked.itertuples()]
    return (f"\n\n**Claims that rest on runs with skipped optimizer updates** (a non-finite gradient norm; "
            f"claims_{profile} column skipped_update_runs): those runs trained on fewer updates than their "
            "counterparts, so the difference is not the quantization's alone.\n\n" + "\n".join(lines))


def claims_parts(runs: list[RunInfo], runs_root: Path, profile: str, *, margins: Mapping[str, float] | None = None,
                 last_frac: float = 0.1, replay: bool = True, skipped: list[dict] | None = None,
                 used: FilesUsed | None = None) -> ClaimsParts:
    """The pairs, contrasts, claims, saturation telemetry and the claims section of ``runs``.

    Args:
        runs: the runs read.
        runs_root: the folder that holds the runs.
        profile: the profile's name.
        margins: equivalence margins per metric (None: DEFAULT_MARGINS).
        last_frac: share of the common steps in the APE's "last" window.
        replay: whether to replay the estimators on the recorded traces.
        skipped: collects the runs (or parts) left out, with why.
        used: collects the files read.

    Returns:
        A :class:`ClaimsParts`."""
    used = used if used is not None else FilesUsed()
    runs_df, metrics_cache = runs_table(runs, skipped if skipped is not None else [], used)
    baseline_of, parent_of, pairing_df, unpaired = pair_runs(runs, runs_root, profile)
    curves = loss_pairs(runs, baseline_of, metrics_cache)
    ape = ape_rows(curves, last_frac)
    scaling_pairs_df = scaling_pairs_table(runs, parent_of, metrics_cache, ape)
    replay_df = replay_table(runs if replay else [], used)
    not_compared: list[tuple] = []
    contrasts_df = all_contrasts(runs, baseline_of, parent_of, metrics_cache, used, not_compared)
    claims_df = mark_skipped_updates(claims_table(contrasts_df, margins), contrasts_df, runs_df)
    section = claims_section(claims_df, runs_df, profile, margins,
                             saturation_section(scaling_pairs_df, replay_df, profile))
    section += skipped_updates_note(claims_df, profile)
    return ClaimsParts(runs_df, metrics_cache, baseline_of, parent_of, pairing_df, unpaired, curves, ape,
                       scaling_pairs_df, replay_df, contrasts_df, claims_df, section, not_compared)


def build_claims(runs_root: Path, profile: str, margins: Mapping[str, float] | None = None) -> str:
    """The claims section alone, from the run folders (what the README includes): no bootstrap, no figures.

    Args:
        runs_root: the folder that holds the runs.
        profile: the profile's name.
        margins: equivalence margins per metric.

    Returns:
        The markdown."""
    runs_root = Path(runs_root)
    return claims_parts(discover_runs(runs_root, profile), runs_root, profile, margins=margins).section
