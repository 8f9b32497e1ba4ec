"""Claims: every run against its baseline, the experiment it derives from and its own bf16 evaluation, as
same-seed paired contrasts pooled over seeds, with an interval, an equivalence verdict, one Holm-adjusted test
per row and the minimum detectable cost of that test.

One model per paired metric, fixed by its design before any data are seen: the training loss has seeds as its
only unit (t on the per-seed means, k - 1 df); the per-item metrics and the held-out ones score the same items
or windows in every seed, so seeds and items (windows) are crossed random effects
(:func:`hif8qat.stats.paired.crossed_mean`); accuracy is tested by an exact permutation test over items of their net flips,
and where few items change its interval includes the one that inverts that test, so that the two cannot disagree."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from hif8qat.report.items import EXACT_BELOW_DISCORDANT
from hif8qat.report.sources import (
    FilesUsed,
    RunInfo,
    _dirty_of,
    _eval_results,
    _qat_start,
    _read_samples,
    _run_label,
    _tag,
)
from hif8qat.stats.heldout import (
    HELDOUT_MARGIN_PCT,
    HELDOUT_METRIC,
    heldout_dir,
    read_summary,
    window_costs,
    window_means,
)
from hif8qat.stats.item_flips import (
    gain_share_homogeneity,
    item_permutation_test,
    item_test_interval,
    mde_item_flips,
)
from hif8qat.stats.paired import (
    Contrast,
    block_variance_of_mean,
    crossed_mean,
    equivalence_verdict,
    hierarchical_bootstrap,
    holm,
    item_pair,
    make_contrast,
    mde_from_se,
    mean_variance,
    seeds_t,
)

# Equivalence margins (two one-sided tests), in the unit of each metric's cost; positive cost = the run is worse.
# accuracy: % of the baseline score (the paper's drops are 0.2-0.6 %); train_loss: % of the baseline's loss
# (the paper's APE is 0.11 %); gold_ll / gold_margin: nats per item; heldout_nll: % of the baseline's held-out NLL.
DEFAULT_MARGINS = {"accuracy": 1.0, "train_loss": 0.25, "gold_ll": 0.02, "gold_margin": 0.02,
                   HELDOUT_METRIC: HELDOUT_MARGIN_PCT}
METRIC_UNITS = {"accuracy": "% of score", "train_loss": "% of loss", "gold_ll": "nats", "gold_margin": "nats",
                HELDOUT_METRIC: "% of held-out NLL"}
ITEM_METRICS = ("gold_ll", "gold_margin")  # per-item columns of samples_<task>.csv, when the run recorded them
NOT_RECORDED = "not recorded in this run"
UNITS_OF = {"accuracy": "items", HELDOUT_METRIC: "windows", **{m: "items" for m in ITEM_METRICS}}
# "Few" changed items: an accuracy row whose items with a non-zero net change over the seeds number fewer than
# this takes the interval that inverts the exact item test (item_test_interval), not the crossed t interval,
# whose normal theory does not hold for a handful of 0/1 flips; the per-seed tables switch to the exact
# McNemar interval at the same count.
FEW_CHANGED_ITEMS = EXACT_BELOW_DISCORDANT
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


def seed_contrasts(run: RunInfo, other: RunInfo, against: str, metrics_cache: Mapping[str, pd.DataFrame],
                   used: FilesUsed | None = None) -> list[dict[str, Any]]:
    """One seed's paired contrasts of ``run`` against ``other``: per evaluation mode and task the accuracy
    (points, run minus other; flips both ways) and the recorded per-item metrics (cost: other minus run), and
    the signed training-loss difference (% of other's loss, from the run's QAT phase). ``used`` records the
    samples files read.

    ``against``: "baseline" (every mode of the run against the baseline's bf16 evaluation), "derived_from"
    (bf16 against bf16, and the quantized mode against the other's when both are quantized) or "bf16_mode"
    (``other`` is ``run``: its quantized evaluation against its own bf16 one, the cost of quantized inference;
    no training-loss row)."""
    head = _contrast_head(run, other, against)
    rows = []
    if against != "bf16_mode":
        mq, mb = metrics_cache[str(run.path)], metrics_cache[str(other.path)]
        d, v, n = _signed_loss_difference(mq, mb, _qat_start(run, mq) if run.quant else None)
        rows.append({**head, "mode": "train", "task": "loss", "metric": "train_loss", "n": n, "recorded": n > 0,
                     "diff": d, "var": v, "within_df": n // LOSS_BLOCK - 1, "base": float("nan"), "lost": 0,
                     "gained": 0})
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
            if used is not None:
                used.add(other, other.path / "eval" / other_mode / f"samples_{task}.csv")
                used.add(run, run.path / "eval" / mode / f"samples_{task}.csv")
            m = bs.drop_duplicates("doc_id").merge(qs.drop_duplicates("doc_id"), on="doc_id", suffixes=("_b", "_q"))
            ip = item_pair(m["correct_b"].to_numpy(float), m["correct_q"].to_numpy(float))
            at = {**head, "mode": mode, "task": task}
            ids = m["doc_id"].astype(str).to_numpy()
            flips = pd.Series(((m["correct_q"].to_numpy(float) > 0.5).astype(float)
                               - (m["correct_b"].to_numpy(float) > 0.5)) * 100.0, index=ids)
            rows.append({**at, "metric": "accuracy", "n": ip.n, "recorded": ip.n > 0, "diff": ip.diff * 100.0,
                         "var": ip.var * 1e4, "within_df": math.inf, "base": float(m["correct_b"].mean()) * 100.0,
                         "lost": ip.lost, "gained": ip.gained, "units": flips})
            for col in ITEM_METRICS:
                cb, cq = f"{col}_b", f"{col}_q"
                ok = cb in m and cq in m and bool(np.isfinite(m[[cb, cq]].to_numpy(float)).all()) and len(m) > 1
                cost = (m[cb].to_numpy(float) - m[cq].to_numpy(float)) if ok else np.array([])
                rows.append({**at, "metric": col, "n": len(cost), "recorded": ok,
                             "diff": float(cost.mean()) if ok else float("nan"),
                             "var": mean_variance(cost) if ok else float("nan"), "within_df": math.inf,
                             "base": float(m[cb].mean()) if ok else float("nan"),
                             "lost": int((cost > 0).sum()), "gained": int((cost < 0).sum()),
                             "units": pd.Series(cost, index=ids) if ok else None})
    return rows


def _contrast_head(run: RunInfo, other: RunInfo, against: str) -> dict[str, Any]:
    return {"experiment": run.experiment, "run_tag": _tag(run), "against": against, "counterpart": other.experiment,
            "seed": run.seed, "run": _run_label(run), "counterpart_run": _run_label(other),
            "dirty": bool(_dirty_of(run) or _dirty_of(other))}


def heldout_contrasts(run: RunInfo, baseline: RunInfo | None, used: FilesUsed | None = None
                      ) -> list[dict[str, Any]]:
    """One seed's held-out-text contrasts (``<run>/eval/heldout/summary.json``, :mod:`hif8qat.evaluate.heldout`): each
    evaluation mode against the baseline, and the quantized mode against the bf16 one, as ``heldout_nll`` rows
    (cost: the paired per-token NLL difference in % of the reference's held-out NLL, variance from window
    means), with the seed's mean / p99 KL and top-1 agreement beside, and each window's cost (``units``, read
    from the per-token file, which ``used`` records with the summary). A comparison against a baseline counts
    only when it was computed against the run the report pairs it with (the summary names it), so pairings never
    mix."""
    doc = read_summary(run.path)
    if doc is None:
        return []
    rows = []
    tokens = heldout_dir(run.path) / str(doc.get("tokens_file") or "tokens.csv.gz")
    table = pd.read_csv(tokens) if tokens.exists() else None
    if used is not None:
        used.add(run, heldout_dir(run.path) / "summary.json", *([tokens] if table is not None else []))
    for cmp in (doc.get("comparisons") or {}).values():
        if cmp["reference"] == "baseline":
            if baseline is None or doc.get("baseline_run") != _run_label(baseline):
                continue
            head = _contrast_head(run, baseline, "baseline")
        else:
            head = _contrast_head(run, run, "bf16_mode")
        mode, s = cmp["other"], cmp["summary"]
        pct = s["nll_diff_pct"]
        units = window_costs(table, cmp["reference"], mode) if table is not None else None
        ok = bool(np.isfinite(pct["mean"]) and np.isfinite(pct["var"])) and units is not None
        rows.append({**head, "mode": mode, "task": "heldout", "metric": HELDOUT_METRIC, "n": int(s["n_tokens"]),
                     "recorded": ok, "diff": pct["mean"], "var": pct["var"],
                     "within_df": max(int(pct["n_windows"]) - 1, 0), "base": s["nll_ref"], "lost": 0, "gained": 0,
                     "nll_diff_nats": s["nll_diff"]["mean"], "kl_mean": s["kl"]["mean"], "kl_p99": s["kl"]["p99"],
                     "top1_agreement": s["top1"]["mean"], "units": units,
                     **{f"{what}_units": window_means(table, f"{what}_{mode}_vs_{cmp['reference']}")
                        if table is not None else None for what in ("kl", "top1")}})
    return rows


CLAIM_KEYS = ["experiment", "run_tag", "against", "counterpart"]


def _unit_table(g: pd.DataFrame) -> pd.DataFrame:
    """Seeds x units (items or windows) of a claim row's per-seed costs, on the units every seed scored."""
    return pd.concat([u.rename(seed) for seed, u in zip(g["seed"], g["units"], strict=True)], axis=1,
                     join="inner").T


def _loss_contrast(g: pd.DataFrame) -> Contrast:
    """Training loss: t on the per-seed means; one seed has no seed spread to use, so its interval comes from
    blocks of its own steps, and says so."""
    if len(g) > 1:
        return seeds_t(g["diff"])
    d, v, df = float(g["diff"].iloc[0]), float(g["var"].iloc[0]), float(g["within_df"].iloc[0])
    return make_contrast(1, 1, d, v, df, (float("nan"),) * 3, f"one seed: t over step blocks, {df:g} df (no seed "
                     "variance)")


def _disagrees(p: float, lo: float, hi: float, alpha: float = 0.05) -> bool:
    """Whether a 95 % interval and a test at 5 % say different things about a zero difference."""
    return bool((p < alpha) != (lo > 0 or hi < 0))


def claims_table(contrasts: pd.DataFrame, margins: Mapping[str, float] | None = None, *, alpha: float = 0.05,
                 power: float = 0.8, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per claim (a run against its baseline or the experiment it derives from), mode, task and metric: the
    mean over seeds of the same-seed paired cost with a 95 % interval from the design's own units (training
    loss: t on the per-seed means, k - 1 df; per-item and held-out metrics: seeds x items or windows as crossed
    random effects, Satterthwaite df, :func:`hif8qat.stats.paired.crossed_mean`), the equivalence verdict against the
    metric's margin (two one-sided tests on the 90 % interval), one test of a difference per row (accuracy: an
    exact permutation test over items of their net flips summed over seeds, :func:`hif8qat.stats.item_flips.item_permutation_test`; else
    the t test of the same model), Holm-adjusted within the claim, the minimum detectable cost of that same test
    and, where the seeds and units allow, a hierarchical bootstrap interval beside (``boot_lo`` / ``boot_hi``).

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
        if metric == "train_loss":
            c = _loss_contrast(g)
            y = g["diff"].to_numpy(float)
        else:
            y = _unit_table(g).to_numpy(float)
            c = crossed_mean(y, UNITS_OF[metric])
            row["n_units"] = y.shape[1]
        boot = hierarchical_bootstrap(y, n_boot=n_boot, seed=seed)
        if metric == "accuracy":
            base = float(g["base"].mean())

            def rel(points, _b=base):
                return -points / _b * 100.0 if _b > 0 else float("nan")

            n_units = y.shape[1]
            net = y.sum(0) / 100.0  # each item's net change over the seeds, in answers
            items_lost, items_gained, p = item_permutation_test(net)
            lo95, hi95, lo90, hi90 = c.lo, c.hi, c.lo90, c.hi90
            method = c.method
            changed = items_lost + items_gained
            if not (y != 0).any():  # no flip in any seed: a zero-width interval would claim too much
                lo95 = lo90 = -100.0 / n_units
                hi95 = hi90 = 100.0 / n_units
                method = "no flip in any seed: +-1 item"
            elif changed < FEW_CHANGED_ITEMS or _disagrees(p, lo95, hi95):
                # few items changed (or the crossed t interval contradicts the item test): the t interval's normal
                # theory does not hold for a handful of flips, and the interval that inverts the exact item test
                # (exact at 0, conditional on how many items changed) is narrow where few changed. Their hull
                # covers whenever either does; where it would still contradict the test (the test finds a
                # difference that the t interval holds 0 for) the inverted interval alone, so that the interval
                # and the test cannot disagree
                e95, e90 = (item_test_interval(net, n_units, len(g), cf) for cf in (0.95, 0.90))
                e95, e90 = (e95[0] * 100, e95[1] * 100), (e90[0] * 100, e90[1] * 100)
                hull = (min(lo95, e95[0]), max(hi95, e95[1]))
                why = (f"{changed} items changed, fewer than {FEW_CHANGED_ITEMS}" if changed < FEW_CHANGED_ITEMS
                       else "the crossed t interval contradicted the item test")
                if not _disagrees(p, *hull):
                    lo95, hi95 = hull
                    lo90, hi90 = min(lo90, e90[0]), max(hi90, e90[1])
                    method += f"; {why}: widened to the exact interval of the item test"
                else:
                    (lo95, hi95), (lo90, hi90) = e95, e90
                    method = f"exact: inverts the item test ({why}; the t interval holds 0, the test rejects it)"
            homog = gain_share_homogeneity(g["lost"].to_numpy(int), g["gained"].to_numpy(int), seed=seed)
            sizes = pd.Series(np.abs(np.rint(net[net != 0])).astype(int)).value_counts().sort_index()
            mde_pts = mde_item_flips(n_units, net, len(g), alpha=alpha, power=power) * 100.0
            row.update(base=base, cost=rel(c.mean), ci_lo=rel(hi95), ci_hi=rel(lo95), ci90_lo=rel(hi90),
                       ci90_hi=rel(lo90), diff_points=c.mean, lost=int(g["lost"].sum()), gained=int(g["gained"].sum()),
                       flip_items=int((y != 0).any(0).sum()), items_lost=items_lost, items_gained=items_gained,
                       item_change_ms=float(np.mean((net / len(g)) ** 2)),
                       p=p, test="exact permutation test over items (net flips over seeds)", ci_method=method,
                       mde=mde_pts / base * 100.0 if base > 0 else float("nan"), mde_points=mde_pts,
                       boot_lo=rel(boot[1]), boot_hi=rel(boot[0]), homog_chi2=homog[0], homog_df=homog[1],
                       homog_p=homog[2], changed_by_size=" ".join(f"{w}:{c}" for w, c in sizes.items()))
        else:
            row.update(base=float(g["base"].mean()), cost=c.mean, ci_lo=c.lo, ci_hi=c.hi, ci90_lo=c.lo90,
                       ci90_hi=c.hi90, p=c.p, test=f"t on the interval's model, {c.df:.1f} df", ci_method=c.method,
                       mde=mde_from_se(c.se, c.df, alpha=alpha, power=power), boot_lo=boot[0], boot_hi=boot[1])
            if metric in ITEM_METRICS:
                row.update(lost=int(g["lost"].sum()), gained=int(g["gained"].sum()))
        row.update(df=c.df, seed_var=c.seed_var, unit_var=c.unit_var, resid_var=c.resid_var,
                   between_seed_sd=float(np.std(g["diff"].to_numpy(float), ddof=1)) if len(g) > 1 else float("nan"),
                   equivalence=equivalence_verdict(row["ci90_lo"], row["ci90_hi"], margin,
                                                   "" if unit == "nats" else " %"))
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


def all_contrasts(runs: list[RunInfo], baseline_of: Mapping, parent_of: Mapping,
                  metrics_cache: Mapping[str, pd.DataFrame], used: FilesUsed | None = None) -> pd.DataFrame:
    """Every finished run's contrasts (:func:`seed_contrasts`) against its baseline and its parent (once if the
    same; a counterpart that is not finished counts as absent), and its held-out-text ones
    (:func:`heldout_contrasts`; ``used`` records the held-out files read). Column ``units``: each seed's cost per
    item or window (None for the training loss), what the claims' crossed model pools; not a table column."""
    rows = []
    for r in runs:
        if not r.done:  # a run still training (or killed) would pool a partial loss curve
            continue
        b, p = baseline_of[str(r.path)], parent_of[str(r.path)]
        b = b if b is not None and b.done else None
        p = p if p is not None and p.done else None
        for against, other in (("baseline", b), ("derived_from", p if p is not b else None),
                               ("bf16_mode", r if r.quant else None)):
            if other is not None:
                rows += seed_contrasts(r, other, against, metrics_cache, used)
        rows += heldout_contrasts(r, b, used)
    return pd.DataFrame(rows)


HELDOUT_COLUMNS = ["nll_diff_nats", "kl_mean", "kl_p99", "top1_agreement"]
UNIT_COLUMNS = ["units", "kl_units", "top1_units"]  # per-unit values the claims pool, not table columns


def heldout_table(claims: pd.DataFrame, contrasts: pd.DataFrame) -> pd.DataFrame:
    """The held-out-text claims (``heldout_nll`` rows of the claims table: pooled NLL difference, its test,
    MDE and equivalence verdict) with the distances beside them, each the mean over the claim's seeds, and for
    the mean KL and the top-1 agreement a 95 % interval from the same crossed seeds x windows model
    (``kl_ci_lo`` / ``kl_ci_hi``, ``top1_ci_lo`` / ``top1_ci_hi``; descriptive, no test)."""
    if claims.empty or contrasts.empty or HELDOUT_METRIC not in set(claims["metric"]):
        return pd.DataFrame()
    keys = CLAIM_KEYS + ["mode"]
    per_seed = contrasts[contrasts["metric"] == HELDOUT_METRIC]
    beside = per_seed.groupby(keys, sort=False)[HELDOUT_COLUMNS].mean().reset_index()
    for what in ("kl", "top1"):
        col = f"{what}_units"
        if col not in per_seed:
            continue
        ci = []
        for _, g in per_seed.groupby(keys, sort=False):
            ok = g[col].map(lambda u: u is not None and not (isinstance(u, float) and np.isnan(u))).all()
            c = crossed_mean(_unit_table(g.assign(units=g[col])).to_numpy(float), "windows") if ok else None
            ci.append((c.lo, c.hi) if c is not None else (float("nan"), float("nan")))
        beside[f"{what}_ci_lo"], beside[f"{what}_ci_hi"] = [x[0] for x in ci], [x[1] for x in ci]
    rows = claims[claims["metric"] == HELDOUT_METRIC].drop(columns=["lost", "gained"], errors="ignore")
    return rows.merge(beside, on=keys, how="left").reset_index(drop=True)
