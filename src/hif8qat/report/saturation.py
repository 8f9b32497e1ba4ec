"""The saturation telemetry in words, for the claims section: how often each estimator's delayed estimate is
exceeded on the same recorded amax traces (the replay), and per one-factor pair of quantized runs (element format,
estimator or scale target) the share of exceeded calls and the clipped values per statistics call, mean (sd) over
seeds; for the pairs that change the scale targets, the gradients' counts and the loss, in a table and in words."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

REPLAY_SOURCE = "exp6/seed0"  # the recipe at LR 1e-4: its recorded traces replayed under each estimator


def _pct(v: float) -> str:
    return f"{100 * v:.1f} %" if np.isfinite(v) else "-"


def _algo(value) -> str:
    """An estimator, or a schedule of them (``{"0": "most_recent", "4": "exp_smooth"}``) as "a, b from step k"."""
    try:
        sched = json.loads(value) if isinstance(value, str) and value.startswith("{") else value
    except json.JSONDecodeError:
        return str(value)
    if isinstance(sched, dict):
        steps = sorted(sched, key=int)
        return ", ".join(str(sched[k]) if int(k) == 0 else f"{sched[k]} from step {k}" for k in steps)
    return str(sched)


def _mean_sd(x: pd.Series, fmt) -> str:
    x = pd.to_numeric(x, errors="coerce").dropna()
    if x.empty:
        return "-"
    return fmt(x.mean()) + (f" (sd {fmt(x.std(ddof=1))})" if len(x) > 1 else "")


def saturation_section(pairs: pd.DataFrame, replay: pd.DataFrame, profile: str) -> list[str]:
    """The saturation telemetry and clipping in words, for the claims section.

    Args:
        pairs: the scaling-pairs table.
        replay: the estimator replay table.
        profile: the profile's name.

    Returns:
        Markdown lines; empty when there is neither a replay nor a scaling pair."""
    if pairs.empty and replay.empty:
        return []
    lines = ["#### Saturation telemetry (failure mode i) and clipping", ""]
    if not replay.empty:
        sources = list(dict.fromkeys(replay["trace_source"]))
        src = REPLAY_SOURCE if REPLAY_SOURCE in sources else sources[0]
        r = replay[replay["trace_source"] == src]
        first = r.iloc[0]
        lines += [f"Each estimator replayed on the per-call amax traces recorded in {src} (`replay_{profile}`: "
                  f"{int(first['traces'])} traces per role, {int(first['calls']):,} calls per role in all): the share "
                  "of calls whose amax exceeds the delayed estimate it is scaled with, and of calls scaled past "
                  "HiF8's 2-bit-mantissa tier (amax over 128/15 times the estimate).", "",
                  "| estimator | A exceeded | W exceeded | G exceeded | beyond the 2-bit tier (A / W / G) |",
                  "|---|---|---|---|---|"]
        for est, g in r.groupby("estimator", sort=False):
            by = g.set_index("role")
            cell = {role: by.loc[role] if role in by.index else None for role in ("A", "W", "G")}
            lines.append(f"| {est} | " + " | ".join(_pct(c["frac_exceeded"]) if c is not None else "-"
                                                     for c in cell.values()) + " | "
                         + " / ".join(_pct(c["frac_beyond_2bit_tier"]) if c is not None else "-"
                                      for c in cell.values()) + " |")
        lines.append("")
    if not pairs.empty:
        lines += [f"One-factor pairs of quantized runs (`scaling_pairs_{profile}`), mean (sd) over seeds: the share "
                  "of quantizer calls whose amax outgrew the estimate, and the values clipped per statistics call "
                  "(FP8: |x * scale| above the format max; HiF8: overflow, |x * scale| >= 40960), all roles pooled.",
                  "", "| run (format, estimator) | counterpart | seeds | exceeded calls | clipped per statistics "
                  "call |", "|---|---|---|---|---|"]
        for (exp, cp), g in pairs.groupby(["experiment", "counterpart"], sort=False):
            f = g.iloc[0]
            seeds = ",".join(str(s) for s in sorted(g["seed"]))
            lines.append(f"| {exp} ({f['format']}, {_algo(f['algo'])}{_targets(f, '')}) | {cp} ({f['cp_format']}, "
                         f"{_algo(f['cp_algo'])}{_targets(f, 'cp_')}) "
                         f"| {seeds} "
                         f"| {_vs(g, 'calls_exceeded', _pct)} | {_vs(g, 'clipped_per_stats_call', '{:.2f}'.format)} |")
        lines.append("")
        lines += _target_pairs(pairs)
    return lines


def _vs(g: pd.DataFrame, column: str, fmt) -> str:
    """"run vs counterpart": a column's mean (sd) over seeds beside the counterpart's (``cp_`` + column)."""
    return f"{_mean_sd(g[column], fmt)} vs {_mean_sd(g['cp_' + column], fmt)}"


def _targets(row: pd.Series, side: str) -> str:
    """", targets 15/15/224" for a HiF8 run off the paper's target 15 for every role, else nothing."""
    t = row.get(f"{side}targets")
    return f", targets A/W/G {t}" if isinstance(t, str) and t and row[f"{side}format"] == "hif8" and t != "15/15/15" \
        else ""


def _more(a: pd.Series, b: pd.Series) -> str:
    """" (higher)", " (lower)" or " (the same)": the mean over seeds of ``a`` against ``b``; "" where either is
    not logged."""
    a, b = (pd.to_numeric(x, errors="coerce").dropna() for x in (a, b))
    if a.empty or b.empty:
        return ""
    return " (higher)" if a.mean() > b.mean() else " (lower)" if a.mean() < b.mean() else " (the same)"


def _target_pairs(pairs: pd.DataFrame) -> list[str]:
    """The pairs that change the scale target (MindSpeed's HiF8 recipe: gradients at 224): the gradients'
    telemetry and the loss, side by side, then in words."""
    if "changes" not in pairs:
        return []
    tp = pairs[pairs["changes"].astype(str).str.split(",").map(lambda c: "quant.target" in c)]
    if tp.empty:
        return []
    lines = ["Pairs that change the scale targets (A/W/G), mean (sd) over seeds: the gradients' (G) share of calls "
             "whose amax outgrew the delayed estimate, G's overflowed values per statistics call, and the training "
             "loss over the QAT phase against the BF16 baseline's (mean absolute difference in % of the baseline's "
             "loss; the claims above test the paired loss difference).", "",
             "| run (targets) | counterpart (targets) | seeds | G exceeded calls | G clipped per statistics call | "
             "QAT loss APE vs baseline |", "|---|---|---|---|---|---|"]
    words = []
    fmt2 = "{:.2f}".format
    fmt3 = "{:.3f} %".format
    for (exp, cp), g in tp.groupby(["experiment", "counterpart"], sort=False):
        f = g.iloc[0]
        seeds = ",".join(str(s) for s in sorted(g["seed"]))
        lines.append(f"| {exp} ({f['targets']}) | {cp} ({f['cp_targets']}) | {seeds} | "
                     f"{_vs(g, 'G_calls_exceeded', _pct)} | {_vs(g, 'G_clipped_per_stats_call', fmt2)} | "
                     f"{_vs(g, 'ape_qat_pct', fmt3)} |")
        words.append(
            f"{exp} (targets A/W/G {f['targets']}) against {cp} ({f['cp_targets']}), seeds {seeds}: the gradients' "
            f"delayed estimate was exceeded in {_mean_sd(g['G_calls_exceeded'], _pct)} of G's calls against "
            f"{_mean_sd(g['cp_G_calls_exceeded'], _pct)}{_more(g['G_calls_exceeded'], g['cp_G_calls_exceeded'])}, "
            f"G overflowed {_mean_sd(g['G_clipped_per_stats_call'], fmt2)} values per statistics call against "
            f"{_mean_sd(g['cp_G_clipped_per_stats_call'], fmt2)}"
            f"{_more(g['G_clipped_per_stats_call'], g['cp_G_clipped_per_stats_call'])}, and the QAT-phase loss "
            f"differed from the BF16 baseline's by {_mean_sd(g['ape_qat_pct'], fmt3)} on average (absolute) against "
            f"{_mean_sd(g['cp_ape_qat_pct'], fmt3)}{_more(g['ape_qat_pct'], g['cp_ape_qat_pct'])}; whether the "
            f"loss difference between the two is real is the claim \"{exp} vs {cp}\" above.")
    return lines + [""] + words + [""]
