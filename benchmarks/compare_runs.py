"""Agreement of two runs of one experiment made with different numerics (or on different machines).

    python benchmarks/compare_runs.py RUN_A RUN_B [--mode bf16] [--json]

RUN_A and RUN_B are run folders (``results/runs/<profile>/<experiment>/seed<k>``) of the same experiment, seed
and data. Printed: the numerics each used, the training-loss curves side by side (largest and mean relative
difference per step, and the final losses), and for each evaluated task both accuracies, the items that
flipped each way with the exact two-sided McNemar p-value, and the mean paired difference of the gold answer's
log-likelihood where the per-sample files record it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
from scipy.stats import binomtest


def _losses(run: Path) -> pd.Series:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return pd.Series({r["step"]: r["loss"] for r in rows if "loss" in r}).sort_index()


def _numerics(run: Path) -> str:
    summary = run / "summary.json"
    if summary.exists():
        info = json.loads(summary.read_text()).get("numerics") or {}
        if info.get("numerics"):
            return str(info["numerics"])
    import yaml

    return str(yaml.safe_load((run / "config_resolved.yaml").read_text())["train"]["autocast"])


def compare(a: Path, b: Path, mode: str = "bf16") -> dict:
    la, lb = _losses(a), _losses(b)
    common = la.index.intersection(lb.index)
    rel = ((la[common] - lb[common]).abs() / lb[common].abs())
    out = {"a": str(a), "b": str(b), "numerics": [_numerics(a), _numerics(b)], "steps": len(common),
           "loss_max_rel_diff": float(rel.max()), "loss_mean_rel_diff": float(rel.mean()),
           "final_loss": [float(la[common].iloc[-1]), float(lb[common].iloc[-1])], "tasks": {}}
    for csv_a in sorted((a / "eval" / mode).glob("samples_*.csv")):
        csv_b = b / "eval" / mode / csv_a.name
        if not csv_b.exists():
            continue
        sa, sb = pd.read_csv(csv_a), pd.read_csv(csv_b)
        both = sa.merge(sb, on="doc_id", suffixes=("_a", "_b"))
        a_only = int(((both["correct_a"] == 1) & (both["correct_b"] == 0)).sum())
        b_only = int(((both["correct_a"] == 0) & (both["correct_b"] == 1)).sum())
        task = {"items": len(both), "acc": [float(both["correct_a"].mean()), float(both["correct_b"].mean())],
                "right_only_in_a": a_only, "right_only_in_b": b_only,
                "mcnemar_exact_p": float(binomtest(a_only, a_only + b_only).pvalue) if a_only + b_only else 1.0}
        if "gold_ll_a" in both and "gold_ll_b" in both:
            diff = both["gold_ll_a"] - both["gold_ll_b"]
            task["gold_ll_mean_diff"] = float(diff.mean())
            task["gold_ll_max_abs_diff"] = float(diff.abs().max())
        out["tasks"][csv_a.stem.removeprefix("samples_")] = task
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--mode", default="bf16", help="evaluation mode folder to compare (bf16 | hif8)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = compare(args.run_a, args.run_b, args.mode)
    if args.json:
        print(json.dumps(res))
        return res
    print(f"{res['numerics'][0]} vs {res['numerics'][1]}: {res['steps']} steps, loss relative difference per step "
          f"max {res['loss_max_rel_diff']:.2e}, mean {res['loss_mean_rel_diff']:.2e}; final loss "
          f"{res['final_loss'][0]:.4f} vs {res['final_loss'][1]:.4f}")
    for name, t in res["tasks"].items():
        extra = (f", gold log-likelihood mean diff {t['gold_ll_mean_diff']:+.4f} (max |diff| "
                 f"{t['gold_ll_max_abs_diff']:.4f})" if "gold_ll_mean_diff" in t else "")
        print(f"  {name}: acc {100 * t['acc'][0]:.2f} vs {100 * t['acc'][1]:.2f} on {t['items']} items, right only "
              f"in A {t['right_only_in_a']}, only in B {t['right_only_in_b']} (exact McNemar p = "
              f"{t['mcnemar_exact_p']:.3f}){extra}")
    return res


if __name__ == "__main__":
    main()
