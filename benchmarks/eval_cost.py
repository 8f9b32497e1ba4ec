"""Evaluation cost per item of each task on the base SmolLM2-135M, measured side by side in one process.

    python benchmarks/eval_cost.py                       # 0-shot, the mini profile's tasks
    python benchmarks/eval_cost.py --shots paper --items 12

Every task is evaluated on a fixed seeded subset (hif8qat.evaluate.subset_indices) and timed; the generated
mini_mmlu task runs first and last as the reference, so a loaded machine shows up as a ratio rather than a
wrong absolute number. Prints seconds per item, the ratio to mini_mmlu per item, the score on the items and
the load average; use the ratios with an unloaded mini_mmlu cost to size eval subsets (conf/eval/mini.yaml).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

PAPER_SHOTS = {"mmlu": 5, "mmlu_continuation": 5, "hellaswag": 10, "arc_challenge": 25, "arc_easy": 25}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="mmlu_continuation,hellaswag,arc_challenge,arc_easy,mmlu")
    ap.add_argument("--items", type=int, default=57, help="documents per task (MMLU: >= 57, one per subject)")
    ap.add_argument("--shots", default="0", help="a number, or 'paper' (5/10/25 as the paper)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--json", action="store_true", help="one JSON line per task as well")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from hif8qat.evaluate.runner import evaluate_model
    from hif8qat.models.loading import load_causal_lm

    model, tok = load_causal_lm(args.model, dtype=torch.float32)
    model.eval()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    plan = ["mini_mmlu", *tasks, "mini_mmlu"]
    ref = []
    print(f"{'task':<20}{'shots':>6}{'items':>7}{'s/item':>9}{'x mini':>8}{'score %':>9}{'load1':>7}")
    for task in plan:
        shots = 0 if task.startswith("mini_") else (PAPER_SHOTS.get(task, 0) if args.shots == "paper"
                                                    else int(args.shots))
        n = args.items if not task.startswith("mmlu") else max(args.items, 57)
        t0 = time.perf_counter()
        res = evaluate_model(model, tok, [task], batch_size=args.batch_size, num_fewshot={task: shots},
                             subset={task: n}, offline_data=not task.startswith("mini_"), device="cpu")
        wall = time.perf_counter() - t0
        r = res[task]
        per_item = wall / r["n"]
        if task == "mini_mmlu":
            ref.append(per_item)
        ratio = per_item / ref[0]
        load = os.getloadavg()[0]
        print(f"{task:<20}{shots:>6}{r['n']:>7}{per_item:>9.3f}{ratio:>8.2f}{100 * r['value']:>9.2f}{load:>7.1f}",
              flush=True)
        if args.json:
            print(json.dumps({"task": task, "shots": shots, "n": r["n"], "s_per_item": per_item,
                              "ratio_to_mini_mmlu": ratio, "score": r["value"], "load1": load}))
    print(f"mini_mmlu reference drift (last/first): {ref[-1] / ref[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
