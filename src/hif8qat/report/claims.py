"""Claims: every run against its baseline, the experiment it derives from and its own bf16 evaluation, as same-seed
paired contrasts pooled over seeds, with an interval, an equivalence verdict, one Holm-adjusted test per row and the
minimum detectable cost of that test.

One model per paired metric, fixed by its design before any data are seen: the training loss has seeds as its only unit
(t on the per-seed means, k - 1 df); the per-item metrics and the held-out ones score the same items or windows in every
seed, so seeds and items (windows) are crossed random effects (:func:`hif8qat.stats.crossed.crossed_mean`); accuracy is
tested by an exact permutation test over items of their net flips, and where few items change its interval includes the
one that inverts that test, so that the two cannot disagree."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import pandas as pd

from hif8qat.report.conditions import task_differences
from hif8qat.report.sources import FilesUsed, RunInfo, dirty_of, eval_results, label_of, qat_start, read_samples, tag_of
from hif8qat.stats.crossed import (
    Contrast,
    crossed_mean,
    hierarchical_bootstrap,
    make_contrast,
    pool_seed_variance,
    seeds_t,
    with_seed_variance,
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
    joint_gain_share_homogeneity,
    mde_item_flips,
)
from hif8qat.stats.paired import (
    benjamini_hochberg,
    block_variance_of_mean,
    equivalence_verdict,
    holm,
    item_pair,
    mde_from_se,
    mean_variance,
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
LOSS_BLOCK = 5  # consecutive steps per block for the within-seed variance of the loss difference
ONE_SEED = "one seed: direction only"  # both verdicts of a one-seed row with no seed variance to borrow

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
    ("Gradients at target 224 (MindSpeed's HiF8 recipe), max(64)", "exp14", "derived_from", "exp8", "scaling "
     "the gradients to 224 is worse than to 15"),
    ("Gradients at target 224 (MindSpeed's HiF8 recipe), most_recent(30)", "exp15", "derived_from", "exp2",
     "scaling the gradients to 224 is worse than to 15"),
    ("The BF16 warmup alone (ours)", "exp9", "derived_from", "exp8", "QAT from step 0 is worse than after the "
     "BF16 warmup"),
    ("Quantized inference of the final recipe", "exp8", "bf16_mode", "exp8", "exp8 evaluated in HiF8 (W8A8, "
     "final frozen scales) is worse than its own weights evaluated in BF16"),
]
# The headline claims (the README states them): one family, Holm over all their rows.
HEADLINE_CLAIMS = frozenset((exp, against, counterpart) for _, exp, against, counterpart, _ in PAPER_CLAIMS)


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
                   used: FilesUsed | None = None, not_compared: list[tuple] | None = None) -> list[dict[str, Any]]:
    """One seed's paired contrasts of ``run`` against ``other``: per evaluation mode and task the accuracy (points, run
    minus other; flips both ways) and the recorded per-item metrics (cost: other minus run), none for two evaluations
    made differently (:mod:`hif8qat.report.conditions`), and the signed training-loss difference (% of other's loss,
    from the run's QAT phase).

    Args:
        run: the run.
        other: its counterpart at the same seed.
        against: "baseline" (every mode of the run against the baseline's bf16 evaluation), "derived_from" (bf16
            against bf16, the quantized mode against the other's when both are quantized) or "bf16_mode" (``other`` is
            ``run``: its quantized evaluation against its bf16 one, the cost of quantized inference; no loss row).
        metrics_cache: run folder -> its metrics table.
        used: collects the samples files read (None: not recorded).
        not_compared: collects the task evaluations left out as made differently, as ``(the two evaluations, task,
            the conditions that differ)``, ``other``'s first as in the conditions (None: not recorded).

    Returns:
        One dict per contrast row."""
    head = _contrast_head(run, other, against)
    rows = []
    if against != "bf16_mode":
        mq, mb = metrics_cache[str(run.path)], metrics_cache[str(other.path)]
        d, v, n = _signed_loss_difference(mq, mb, qat_start(run, mq) if run.quant else None)
        rows.append({**head, "mode": "train", "task": "loss", "metric": "train_loss", "n": n, "recorded": n > 0,
                     "diff": d, "var": v, "within_df": n // LOSS_BLOCK - 1, "base": float("nan"), "lost": 0,
                     "gained": 0})
    modes = [("bf16", "bf16"), ("hif8", "bf16" if against == "baseline" else "hif8")]
    if against == "bf16_mode":
        modes = [("hif8", "bf16")]
    for mode, other_mode in modes:
        if mode == "hif8" and not (run.quant and (against != "derived_from" or other.quant)):
            continue
        base_res, run_res = eval_results(other, other_mode), eval_results(run, mode)
        differs = task_differences(other.path / "eval" / other_mode, run.path / "eval" / mode,
                                   [t for t in run_res if t in base_res])
        if not_compared is not None:
            not_compared += [(f"{label_of(other)} {other_mode} vs {label_of(run)} {mode}", task, why)
                             for task, why in differs.items() if why]
        for task in (t for t, why in differs.items() if not why):
            bs = read_samples(other.path / "eval" / other_mode / f"samples_{task}.csv")
            qs = read_samples(run.path / "eval" / mode / f"samples_{task}.csv")
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
    return {"experiment": run.experiment, "run_tag": tag_of(run), "against": against, "counterpart": other.experiment,
            "seed": run.seed, "run": label_of(run), "counterpart_run": label_of(other),
            "dirty": bool(dirty_of(run) or dirty_of(other))}


def heldout_contrasts(run: RunInfo, baseline: RunInfo | None, used: FilesUsed | None = None ) -> list[dict[str, Any]]:
    """One seed's held-out-text contrasts (``<run>/eval/heldout/summary.json``, :mod:`hif8qat.evaluate.heldout`): each
    evaluation mode against the baseline, and the quantized mode against the bf16 one, as ``heldout_nll`` rows
    (cost: the paired per-token NLL difference in % of the reference's held-out NLL, variance from window
    means), with the seed's mean / p99 KL and top-1 agreement beside, and each window's cost (``units``, read
    from the per-token file, which ``used`` records with the summary). A comparison against a baseline counts
    only when it was computed against the run the report pairs it with (the summary names it), so pairings never
    mix.

    Args:
        run: the run.
        baseline: the run the report pairs it with (None: none).
        used: collects the files read (None: not recorded).

    Returns:
        One dict per ``heldout_nll`` row; empty when the run has no held-out summary."""
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
            if baseline is None or doc.get("baseline_run") != label_of(baseline):
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


def seed_variance_donors(contrasts: Mapping[tuple, Contrast]) -> dict[tuple, tuple[float, float, int]]:
    """Per (against, mode, task, metric): the seed variance of the multi-seed claims of that kind pooled
    (:func:`hif8qat.stats.crossed.pool_seed_variance`). The training loss's seed variance is the variance over seeds
    of the per-seed differences; the other metrics' is the crossed model's seed component.

    Args:
        contrasts: a claim row's key (CLAIM_KEYS + mode, task, metric) -> its contrast.

    Returns:
        kind -> ``(pooled variance, df, number of claims pooled)``."""
    by_kind: dict[tuple, list[tuple[float, float]]] = {}
    for key, c in contrasts.items():
        if c.k >= 2 and np.isfinite(c.seed_var):
            by_kind.setdefault(_kind(key), []).append((c.seed_var, float(c.k - 1)))
    out = {}
    for kind, donors in by_kind.items():
        var, df = pool_seed_variance([v for v, _ in donors], [d for _, d in donors])
        out[kind] = (var, df, len(donors))
    return out


def _kind(key: tuple) -> tuple:
    """A claim row's comparison kind (against, mode, task, metric): what its seed variance is borrowed across."""
    head = dict(zip(CLAIM_KEYS + ["mode", "task", "metric"], key, strict=True))
    return head["against"], head["mode"], head["task"], head["metric"]


def accuracy_interval_and_test(c: Contrast, net: np.ndarray, n_units: int, k: int, homog_p: float, *,
                               alpha: float = 0.05) -> tuple[float, float, float, float, float, str]:
    """An accuracy row's interval (95 % and 90 %, in points) and its test of a zero difference, so that the two
    cannot disagree.

    Two models answer it: the crossed seeds x items t interval (``c``; valid whatever the seeds share, but its
    normal theory is rough for a handful of 0/1 flips) and the exact item test with the interval that inverts it
    (exact for any count, but only if the items' net flips are independent: a training-noise shift shared by one
    seed's items breaks it). The interval is the hull of the two (it covers whenever either does) and the test
    rejects only where both do (p the larger of the two: valid when either model is), so the hull excludes 0
    exactly when the test rejects. Where the homogeneity check (``homog_p``) finds the seeds' shares of gains
    differing, the item test's assumption is refuted: the crossed t interval and test alone. No flip in any
    seed: +-1 item beside the t interval, whose width would be zero.

    Args:
        c: the crossed seeds x items contrast.
        net: per item, its net change over the seeds.
        n_units: items per seed.
        k: seeds.
        homog_p: p of the gain-share homogeneity check.
        alpha: the tests' two-sided level.

    Returns:
        ``(lo95, hi95, lo90, hi90, p, method)``."""
    p_item = item_permutation_test(net)[2]
    t95, t90 = (c.lo, c.hi), (c.lo90, c.hi90)
    if not (net != 0).any():
        one = 100.0 / n_units
        lo95, hi95 = np.nanmin([-one, t95[0]]), np.nanmax([one, t95[1]])
        lo90, hi90 = np.nanmin([-one, t90[0]]), np.nanmax([one, t90[1]])
        return lo95, hi95, lo90, hi90, float(np.nanmax([p_item, c.p])), c.method + "; no flip in any seed: +-1 item"
    if np.isfinite(homog_p) and homog_p < alpha and np.isfinite(c.se):
        return (*t95, *t90, c.p, c.method + f"; the seeds' gain shares differ (homogeneity p {homog_p:.3f}): "
                "the crossed t interval and test alone")
    e95, e90 = (tuple(v * 100 for v in item_test_interval(net, n_units, k, cf)) for cf in (0.95, 0.90))
    lo95, hi95 = np.nanmin([t95[0], e95[0]]), np.nanmax([t95[1], e95[1]])
    lo90, hi90 = np.nanmin([t90[0], e90[0]]), np.nanmax([t90[1], e90[1]])
    return (float(lo95), float(hi95), float(lo90), float(hi90), float(np.nanmax([p_item, c.p])),
            c.method + "; hull with the exact interval of the item test, which must reject too")


def claims_table(contrasts: pd.DataFrame, margins: Mapping[str, float] | None = None, *, alpha: float = 0.05,
                 power: float = 0.8, n_boot: int = 2000, seed: int = 0,
                 headline: Collection[tuple[str, str, str]] | None = None) -> pd.DataFrame:
    """Per claim (a run against its baseline or the experiment it derives from), mode, task and metric: the
    mean over seeds of the same-seed paired cost with a 95 % interval from the design's own units (training
    loss: t on the per-seed means, k - 1 df; per-item and held-out metrics: seeds x items or windows as crossed
    random effects, Satterthwaite df, :func:`hif8qat.stats.crossed.crossed_mean`), the equivalence verdict against
    the metric's margin (two one-sided tests on the 90 % interval), one test of a difference per row (accuracy:
    :func:`accuracy_interval_and_test`; else the t test of the same model), the minimum detectable cost of that
    test and, where the seeds and units allow, a hierarchical bootstrap interval beside (``boot_lo`` / ``boot_hi``).

    One seed cannot show its own seed's shift: its variance borrows the seed variance of the multi-seed claims of the
    same kind (:func:`seed_variance_donors`; ``seed_var_source`` says which), and where there are none both verdicts
    read ONE_SEED. Error control over the whole table: ``p_bh``, Benjamini-Hochberg over every row (false discovery
    rate); ``p_holm_headline``, Holm over the rows of the ``headline`` claims ((experiment, against, counterpart) keys,
    HEADLINE_CLAIMS by default: family-wise); ``family`` / ``p_adj``: the one a row's difference verdict uses (headline
    rows Holm, the others BH); ``p_holm``: Holm within the claim, for reference.

    Args:
        contrasts: the per-seed contrasts of :func:`all_contrasts`.
        margins: equivalence margins per metric (None: DEFAULT_MARGINS).
        alpha: the tests' two-sided level.
        power: power of the minimum detectable cost.
        n_boot: hierarchical bootstrap draws.
        seed: random seed of the draws.
        headline: the headline claims' keys (None: HEADLINE_CLAIMS).

    Returns:
        One row per claim, mode, task and metric; empty without contrasts. cost > 0: the run is worse (accuracy:
        relative drop, % of the baseline score; train_loss: relative loss increase, % of the baseline loss;
        gold_ll / gold_margin: nats lost per item)."""
    margins = {**DEFAULT_MARGINS, **(margins or {})}
    headline = set(HEADLINE_CLAIMS if headline is None else headline)
    if contrasts.empty:
        return pd.DataFrame()
    keys = CLAIM_KEYS + ["mode", "task", "metric"]
    groups, models = [], {}
    for key, g in contrasts.groupby(keys, sort=False):
        g = g.sort_values("seed")
        groups.append((key, g))
        if not g["recorded"].all():
            continue
        if dict(zip(keys, key, strict=True))["metric"] == "train_loss":
            models[key] = (g["diff"].to_numpy(float), _loss_contrast(g))
        else:
            y = _unit_table(g).to_numpy(float)
            models[key] = (y, crossed_mean(y, UNITS_OF[key[-1]]))
    donors = seed_variance_donors({key: c for key, (_, c) in models.items()})
    rows, flip_tables = [], {}
    for key, g in groups:
        head = dict(zip(keys, key, strict=True))
        metric, margin, unit = head["metric"], margins.get(head["metric"], float("nan")), METRIC_UNITS[head["metric"]]
        row = {**head, "unit": unit, "n_seeds": len(g), "seeds": ",".join(str(x) for x in g["seed"]),
               "n_items": int(g["n"].sum()), "dirty_runs": int(g["dirty"].sum()), "margin": margin}
        if key not in models:
            rows.append({**row, "equivalence": NOT_RECORDED, "difference": NOT_RECORDED})
            continue
        y, c = models[key]
        one_seed_bare = False
        if c.k >= 2:
            row["seed_var_source"] = "own seeds"
        elif _kind(key) in donors and np.isfinite(donors[_kind(key)][0]):
            var, df, n_claims = donors[_kind(key)]
            source = (f"pooled from {n_claims} multi-seed claim(s) of the same comparison, mode, task and metric "
                      f"(df-weighted, {df:g} df: the largest claim's)")
            c = with_seed_variance(c, var, df, replaces_own=metric == "train_loss", source=f"({source})")
            row["seed_var_source"] = source
        else:
            one_seed_bare = True
            row["seed_var_source"] = "none: one seed and no multi-seed claim of this kind to borrow from"
        if metric != "train_loss":
            row["n_units"] = y.shape[1]
        boot = hierarchical_bootstrap(y, n_boot=n_boot, seed=seed)
        if metric == "accuracy":
            base = float(g["base"].mean())

            def rel(points, _b=base):
                return -points / _b * 100.0 if _b > 0 else float("nan")

            n_units = y.shape[1]
            net = y.sum(0) / 100.0  # each item's net change over the seeds, in answers
            items_lost, items_gained, _ = item_permutation_test(net)
            homog = gain_share_homogeneity(g["lost"].to_numpy(int), g["gained"].to_numpy(int), seed=seed)
            flip_tables.setdefault(key[: len(CLAIM_KEYS)], []).append((g["lost"].to_numpy(int),
                                                                      g["gained"].to_numpy(int)))
            lo95, hi95, lo90, hi90, p, method = accuracy_interval_and_test(c, net, n_units, len(g), homog[2],
                                                                           alpha=alpha)
            p_item = item_permutation_test(net)[2]
            sizes = pd.Series(np.abs(np.rint(net[net != 0])).astype(int)).value_counts().sort_index()
            mde_pts = mde_item_flips(n_units, net, len(g), alpha=alpha, power=power) * 100.0
            row.update(base=base, cost=rel(c.mean), ci_lo=rel(hi95), ci_hi=rel(lo95), ci90_lo=rel(hi90),
                       ci90_hi=rel(lo90), diff_points=c.mean, lost=int(g["lost"].sum()), gained=int(g["gained"].sum()),
                       flip_items=int((y != 0).any(0).sum()), items_lost=items_lost, items_gained=items_gained,
                       item_change_ms=float(np.mean((net / len(g)) ** 2)),
                       p=p, p_item=p_item, p_t=c.p,
                       test="exact permutation test over items (net flips over seeds) and the crossed t test: "
                       "both must reject" if "alone" not in method else "the crossed t test", ci_method=method,
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
                   equivalence=ONE_SEED if one_seed_bare else equivalence_verdict(
                       row["ci90_lo"], row["ci90_hi"], margin, "" if unit == "nats" else " %"))
        if one_seed_bare:  # its interval leaves out the seed variance: no test, nothing it could detect
            row.update(p=float("nan"), mde=float("nan"), **({"mde_points": float("nan")} if "mde_points" in row
                                                             else {}))
        rows.append(row)
    df = _error_control(pd.DataFrame(rows), headline, alpha)
    # the check over each claim's accuracy rows together, against their joint conditional null (claims share
    # runs with each other, so the check is not summed across claims)
    for claim, tables in flip_tables.items():
        chi2, dof, p, n_rows = joint_gain_share_homogeneity(tables, seed=seed)
        at = (df[CLAIM_KEYS].apply(tuple, axis=1) == claim) & (df["metric"] == "accuracy")
        df.loc[at, ["claim_homog_chi2", "claim_homog_df", "claim_homog_p", "claim_homog_rows"]] = (
            chi2, dof, p, n_rows)
    return df


def _error_control(df: pd.DataFrame, headline: set, alpha: float) -> pd.DataFrame:
    """The adjusted p-values and the difference verdict from the family each row belongs to (see claims_table)."""
    for col in ("p_holm", "p_bh", "p_holm_headline", "p_adj"):
        df[col] = np.nan
    if "p" not in df:
        df["p"] = np.nan
    for _, idx in df.groupby(CLAIM_KEYS, sort=False).groups.items():
        df.loc[idx, "p_holm"] = holm(df.loc[idx, "p"].to_numpy(float))
    df["p_bh"] = benjamini_hochberg(df["p"].to_numpy(float))
    is_headline = np.array([(e, a, c) in headline and not t for e, t, a, c in
                            zip(df["experiment"], df["run_tag"].fillna(""), df["against"], df["counterpart"],
                                strict=True)], bool)
    df.loc[is_headline, "p_holm_headline"] = holm(df.loc[is_headline, "p"].to_numpy(float))
    n_head, n_all = int(np.isfinite(df.loc[is_headline, "p"]).sum()), int(np.isfinite(df["p"]).sum())
    df["family"] = np.where(is_headline, f"headline claims: Holm over {n_head} tests",
                            f"whole table: Benjamini-Hochberg over {n_all} tests")
    df["p_adj"] = np.where(is_headline, df["p_holm_headline"], df["p_bh"])
    tested = (df["equivalence"] != NOT_RECORDED) & (df["equivalence"] != ONE_SEED)
    df["difference"] = np.where(df["equivalence"] == ONE_SEED, ONE_SEED, NOT_RECORDED)
    df.loc[tested, "difference"] = np.where(
        df.loc[tested, "p_adj"] < alpha, np.where(df.loc[tested, "cost"] > 0, "worse", "better"), "not detected")
    return df


def mde_table(claims: pd.DataFrame) -> pd.DataFrame:
    """What each claim's own test can detect: its minimum detectable cost next to the paper's effect sizes.
    Depends only on the claim's own runs, never on others in the folder.

    Args:
        claims: the claims table.

    Returns:
        The recorded claims' rows with their MDE columns; empty without claims."""
    if claims.empty or "mde" not in claims:
        return pd.DataFrame()
    cols = [c for c in ["experiment", "run_tag", "against", "counterpart", "mode", "task", "metric", "unit",
                        "n_seeds", "n_items", "lost", "gained", "mde", "mde_points", "test"] if c in claims]
    return claims[claims["equivalence"] != NOT_RECORDED][cols].reset_index(drop=True)


def all_contrasts(runs: list[RunInfo], baseline_of: Mapping, parent_of: Mapping,
                  metrics_cache: Mapping[str, pd.DataFrame], used: FilesUsed | None = None,
                  not_compared: list[tuple] | None = None) -> pd.DataFrame:
    """Every finished run's contrasts (:func:`seed_contrasts`) against its baseline and its parent (once if the
    same; a counterpart that is not finished counts as absent), and its held-out-text ones (:func:`heldout_contrasts`).

    Args:
        runs: the runs read.
        baseline_of: run folder -> its baseline run (or None).
        parent_of: run folder -> the run it derives from (or None).
        metrics_cache: run folder -> its metrics table.
        used: collects the files read (None: not recorded).
        not_compared: collects the task evaluations left out as made differently (:func:`seed_contrasts`).

    Returns:
        One row per contrast. Column ``units``: each seed's cost per item or window (None for the training loss), what
        the claims' crossed model pools; not a table column."""
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
                rows += seed_contrasts(r, other, against, metrics_cache, used, not_compared)
        rows += heldout_contrasts(r, b, used)
    return pd.DataFrame(rows)


HELDOUT_COLUMNS = ["nll_diff_nats", "kl_mean", "kl_p99", "top1_agreement"]
UNIT_COLUMNS = ["units", "kl_units", "top1_units"]  # per-unit values the claims pool, not table columns


def heldout_table(claims: pd.DataFrame, contrasts: pd.DataFrame) -> pd.DataFrame:
    """The held-out-text claims (``heldout_nll`` rows of the claims table: pooled NLL difference, test, MDE,
    equivalence verdict) with the distances beside them, each the mean over the claim's seeds, and for the mean KL
    and the top-1 agreement a 95 % interval from the crossed seeds x windows model (``kl_ci_*``, ``top1_ci_*``).

    Args:
        claims: the claims table.
        contrasts: the per-seed contrasts.

    Returns:
        The table; empty without held-out claims."""
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
