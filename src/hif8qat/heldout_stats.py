"""Statistics of held-out per-token distances (pure functions; :mod:`hif8qat.heldout` computes the tokens).

One comparison pairs a reference model (a run's BF16 baseline, or the run's own unquantized export) with
another (the run, or its quantized mode) on the same held-out tokens. Per token it has both models' NLL of the
actual next token, KL(P_ref || P_other) of the next-token distributions and whether their top-1 tokens agree.

Tokens of one window share their context, so they are not independent: the variance of a token mean is taken
from the window means (batch means, one block per window; all windows have the same number of tokens, so the
mean of the window means is the token mean), with ``n_windows - 1`` degrees of freedom
(:func:`hif8qat.stats.block_variance_of_mean`). Over seeds, the per-seed paired NLL differences are pooled by
:func:`hif8qat.stats.pool_seeds` (between-seed spread, within-seed block variance as its floor), with an
equivalence verdict against a margin in % of the baseline's held-out NLL, as the report does for the training
loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats as st

from .stats import _quantile, block_variance_of_mean, equivalence_verdict, mde_from_se, pool_seeds

# Equivalence margin of the held-out NLL difference, % of the baseline's held-out NLL: the training-loss margin
# of the report (DEFAULT_MARGINS["train_loss"]), since both are the same quantity on seen and unseen text.
HELDOUT_MARGIN_PCT = 0.25
HELDOUT_METRIC = "heldout_nll"  # its claim metric; `python -m hif8qat.report --margin heldout_nll=M` sets the margin
KL_PERCENTILES = (50.0, 99.0, 99.9)


def run_label(run_dir) -> str:
    """How a held-out summary names the baseline it was paired with: ``<experiment>/<seed folder>``."""
    return f"{run_dir.parent.name}/{run_dir.name}"


def block_mean(x: Sequence[float], tokens_per_window: int, *, alpha: float = 0.05, power: float = 0.8
               ) -> dict[str, float]:
    """Mean of a per-token series laid out window after window, with its block (window) standard error, a
    (1 - alpha) t interval on ``n_windows - 1`` degrees of freedom, the 90 % interval, a two-sided p-value for
    a zero mean, and the minimum detectable mean (two-sided ``alpha``, ``power``) of that test.

    ``se_iid`` is the standard error as if tokens were independent: the ratio se / se_iid shows how much the
    within-window correlation widens the interval."""
    a = np.asarray(x, float)
    n = int(a.size)
    nb = n // int(tokens_per_window) if tokens_per_window > 0 else 0
    mean = float(a.mean()) if n else float("nan")
    var = block_variance_of_mean(a, int(tokens_per_window)) if nb >= 2 else float("nan")
    se = math.sqrt(var) if np.isfinite(var) else float("nan")
    df = float(nb - 1) if nb >= 2 else float("nan")
    out = {"mean": mean, "se": se, "var": var, "df": df, "n_tokens": n, "n_windows": nb,
           "se_iid": float(a.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")}
    if not np.isfinite(se):
        return {**out, "ci_lo": float("nan"), "ci_hi": float("nan"), "ci90_lo": float("nan"),
                "ci90_hi": float("nan"), "p": float("nan"), "mde": float("nan")}
    q, q90 = _quantile(1 - alpha / 2, df), _quantile(0.95, df)
    p = float(2 * st.t.sf(abs(mean) / se, df)) if se > 0 else (1.0 if mean == 0 else 0.0)
    return {**out, "ci_lo": mean - q * se, "ci_hi": mean + q * se, "ci90_lo": mean - q90 * se,
            "ci90_hi": mean + q90 * se, "p": p, "mde": mde_from_se(se, df, alpha=alpha, power=power)}


def kl_summary(kl: Sequence[float]) -> dict[str, float]:
    """llama.cpp's KL statistics of a quantized model against its reference: mean, median, high percentiles,
    maximum (nats per token)."""
    a = np.asarray(kl, float)
    if not a.size:
        return {"mean": float("nan"), "max": float("nan"), **{f"p{p:g}": float("nan") for p in KL_PERCENTILES}}
    return {"mean": float(a.mean()), "max": float(a.max()),
            **{f"p{p:g}": float(np.percentile(a, p)) for p in KL_PERCENTILES}}


def comparison_summary(nll_ref: Sequence[float], nll_other: Sequence[float], kl: Sequence[float],
                       top1_agree: Sequence[float], tokens_per_window: int, *, alpha: float = 0.05,
                       power: float = 0.8) -> dict[str, Any]:
    """Everything one comparison reports from its per-token columns (window-major order).

    ``nll_diff``: other minus reference, nats per token (positive: the other model predicts the text worse),
    with its block interval and minimum detectable difference; ``nll_diff_pct``: the same in % of the
    reference's mean NLL (the unit of the equivalence margin); ``kl``: mean and percentiles; ``top1``: the share
    of tokens whose most likely next token is the same under both models, with its block interval."""
    ref = np.asarray(nll_ref, float)
    other = np.asarray(nll_other, float)
    if ref.shape != other.shape:
        raise ValueError(f"paired columns differ in length: {ref.shape} vs {other.shape}")
    diff = block_mean(other - ref, tokens_per_window, alpha=alpha, power=power)
    base = float(ref.mean()) if ref.size else float("nan")
    scale = 100.0 / base if base > 0 else float("nan")
    pct = {k: (v * scale if k in ("mean", "se", "se_iid", "ci_lo", "ci_hi", "ci90_lo", "ci90_hi", "mde")
               else v * scale**2 if k == "var" else v) for k, v in diff.items()}
    return {"n_tokens": int(ref.size), "tokens_per_window": int(tokens_per_window),
            "nll_ref": base, "nll_other": float(other.mean()) if other.size else float("nan"),
            "ppl_ref": math.exp(base) if np.isfinite(base) else float("nan"),
            "ppl_other": math.exp(float(other.mean())) if other.size else float("nan"),
            "nll_diff": diff, "nll_diff_pct": pct, "kl": kl_summary(kl),
            "top1": block_mean(np.asarray(top1_agree, float), tokens_per_window, alpha=alpha, power=power)}


# ------------------------------------------------------------------------------------------ over seeds
def pool_heldout(per_seed: Iterable[Mapping[str, Any]], margin_pct: float = HELDOUT_MARGIN_PCT, *,
                 alpha: float = 0.05, power: float = 0.8) -> dict[str, Any]:
    """The mean over seeds of the per-seed paired held-out NLL difference (% of the reference NLL), a 95 %
    interval from the between-seed spread (within-seed block variance as the floor, its degrees of freedom the
    seeds' ``n_windows - 1`` summed), the equivalence verdict against ``margin_pct`` (two one-sided tests on the
    90 % interval) and the minimum detectable difference of the same test. ``per_seed``: comparison summaries
    (:func:`comparison_summary`), one per seed; also the pooled mean KL, p99 KL and top-1 agreement."""
    per_seed = list(per_seed)
    diffs = [s["nll_diff_pct"]["mean"] for s in per_seed]
    within = [s["nll_diff_pct"]["var"] for s in per_seed]
    within_df = float(sum(max(s["nll_diff_pct"]["n_windows"] - 1, 0) for s in per_seed))
    pooled = pool_seeds(diffs, within, within_df if within_df > 0 else math.inf)
    nats = pool_seeds([s["nll_diff"]["mean"] for s in per_seed], [s["nll_diff"]["var"] for s in per_seed],
                      within_df if within_df > 0 else math.inf)

    def mean_of(path: tuple[str, str]) -> float:
        vals = [s[path[0]][path[1]] for s in per_seed]
        return float(np.mean(vals)) if vals else float("nan")

    return {"n_seeds": pooled.k, "unit": "% of baseline held-out NLL", "margin": margin_pct,
            "cost": pooled.mean, "ci_lo": pooled.lo, "ci_hi": pooled.hi, "ci90_lo": pooled.lo90,
            "ci90_hi": pooled.hi90, "p": pooled.p, "variance_from": pooled.variance_from,
            "between_seed_sd": pooled.between_sd,
            "mde": mde_from_se(pooled.se, pooled.df, alpha=alpha, power=power),
            "equivalence": equivalence_verdict(pooled.lo90, pooled.hi90, margin_pct, " %"),
            "nll_diff_nats": nats.mean, "nll_diff_nats_ci_lo": nats.lo, "nll_diff_nats_ci_hi": nats.hi,
            "kl_mean": mean_of(("kl", "mean")), "kl_p99": mean_of(("kl", "p99")),
            "top1_agreement": mean_of(("top1", "mean")), "n_tokens": int(sum(s["n_tokens"] for s in per_seed))}


def heldout_claims_table(entries: Iterable[Mapping[str, Any]], margin_pct: float = HELDOUT_MARGIN_PCT):
    """One row per (experiment, run_tag, comparison) with its seeds pooled (:func:`pool_heldout`).

    ``entries``: one per run and seed, ``{"experiment", "run_tag", "seed", "comparison", "against",
    "counterpart", "summary"}`` (``summary``: a comparison summary), as :func:`heldout_entries` reads them."""
    import pandas as pd

    entries = list(entries)
    if not entries:
        return pd.DataFrame()
    df = pd.DataFrame(entries)
    rows = []
    keys = ["experiment", "run_tag", "against", "counterpart", "comparison"]
    for key, g in df.groupby(keys, sort=False):
        g = g.sort_values("seed")
        rows.append({**dict(zip(keys, key, strict=True)), "seeds": ",".join(str(s) for s in g["seed"]),
                     "metric": HELDOUT_METRIC, **pool_heldout(g["summary"], margin_pct)})
    return pd.DataFrame(rows)


def heldout_entries(runs: Iterable[Any], baseline_of: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The held-out comparisons recorded in each run's ``eval/heldout/summary.json``, for the report.

    ``runs``: objects with ``path``, ``experiment``, ``seed`` and ``config`` (the report's RunInfo);
    ``baseline_of``: run folder -> the baseline run the report pairs it with (or None). A comparison against a
    baseline is kept only when it was computed against that same baseline folder (matched by its name
    ``<experiment>/<run folder>``), so a table never mixes pairings."""
    from .heldout import read_summary

    out = []
    for run in runs:
        doc = read_summary(run.path)
        if doc is None:
            continue
        base = baseline_of.get(str(run.path))
        base_label = run_label(base.path) if base is not None else None
        for name, cmp in doc.get("comparisons", {}).items():
            against_baseline = cmp["reference"] == "baseline"
            if against_baseline and (base_label is None or doc.get("baseline_run") != base_label):
                continue
            out.append({"experiment": run.experiment, "run_tag": str((run.config or {}).get("run_tag", "") or ""),
                        "seed": run.seed, "comparison": name,
                        "against": "baseline" if against_baseline else "bf16_mode",
                        "counterpart": base.experiment if against_baseline else run.experiment,
                        "summary": cmp["summary"]})
    return out


HELDOUT_TABLE_NOTE = (
    "Held-out text (hif8qat.heldout; <run>/eval/heldout/): per token of a fixed held-out set (the corpus' "
    "held-out windows, the same for every run of the profile), the run's NLL of the actual next token against its "
    "baseline's (against = baseline) or its quantized mode against its own bf16 mode (bf16_mode). cost: the mean "
    "paired NLL difference (run minus reference) in % of the reference's held-out NLL, pooled over seeds (t over "
    "seeds when their spread dominates, else the within-seed variance from window means, one block per window); "
    "nll_diff_nats: the same in nats per token; equivalence: two one-sided tests (90 % CI) against `margin`; mde: "
    "the difference that test detects with 80 % power. kl_mean / kl_p99: KL(P_reference || P_run) of the "
    "next-token distributions (nats), mean over seeds of each seed's mean and 99th percentile over tokens; "
    "top1_agreement: share of tokens whose most likely next token is the same.")
