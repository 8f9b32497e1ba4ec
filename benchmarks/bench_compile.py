"""First compiled training step, whole-model ``torch.compile`` versus each decoder block compiled on its own.

A small QAT Llama (hidden 64, every attention and MLP linear quantized, bank rows per layer) of 8, 26 and 52 blocks;
each measurement runs in its own process with an empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a fresh
temporary folder: the cold cache of a first run on a node), and times the first forward + backward + AdamW step,
compile included. The quantizer's own kernels run eagerly (``HIF8QAT_COMPILE=0``; ``--quantizer-compiled`` compiles
them too): their compile is the same fixed part in both ways of compiling and would only hide the difference. Printed
side by side, with the graphs Dynamo compiled and its graph breaks:

* ``block``: ``train.compiled_blocks.compile_blocks`` (what ``train.compile=true`` does): its time must not grow
  with the depth (52 blocks within 1.2x of 8);
* ``model``: one ``torch.compile`` of the whole model (what ``train.compile=true`` did before): its time grows with
  the depth, and at 26 blocks the per-block compile takes at most half of it.

    python benchmarks/bench_compile.py [--depths 8 26 52] [--modes block model] [--json out.json]

Exits 1 when a run fails or the two targets above are missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch  # for its version only: each measurement runs in its own process

ROOT = Path(__file__).resolve().parents[1]

_ONE_RUN = r"""
import json, sys, time
import torch
from torch._dynamo.utils import counters
from hif8qat.models.loading import build_tiny_llama
from hif8qat.quant.linear import _convert_model, set_quantization
from hif8qat.scaling.settings import ScalingConfig
from hif8qat.train.compiled_blocks import compile_blocks
depth, mode = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
model, _ = build_tiny_llama(num_layers=depth, hidden_size=64, intermediate_size=128)
_convert_model(model, "attn_mlp", None, ScalingConfig(algo="max", history_len=16))
set_quantization(model, True)
model.train()
run = torch.compile(model) if mode == "model" else model
if mode == "block":
    compile_blocks(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(3, 250, (2, 64), generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter()
run(input_ids=ids, labels=ids, use_cache=False).loss.backward()
opt.step()
first = time.perf_counter() - t0
print(json.dumps({"depth": depth, "mode": mode, "first_step_s": round(first, 2),
                  "graphs": counters["stats"]["unique_graphs"],
                  "graph_breaks": sum(counters["graph_break"].values())}))
"""


def measure(depth: int, mode: str, timeout_s: int, quantizer_compiled: bool = False) -> dict:
    """One cold first step in a fresh process with an empty Inductor cache."""
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT / "src"),
               "HIF8QAT_COMPILE": "1" if quantizer_compiled else "0"}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-c", _ONE_RUN, str(depth), mode], capture_output=True,
                                  text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"depth": depth, "mode": mode, "first_step_s": None, "error": f"over {timeout_s} s"}
    if proc.returncode != 0:
        return {"depth": depth, "mode": mode, "first_step_s": None, "error": proc.stderr.strip()[-500:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = round(time.perf_counter() - t0, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 26, 52])
    ap.add_argument("--modes", nargs="+", default=["block", "model"], choices=("block", "model"))
    ap.add_argument("--timeout", type=int, default=1200, help="seconds for one run")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    ap.add_argument("--quantizer-compiled", action="store_true", help="compile the quantizer's kernels too")
    args = ap.parse_args(argv)
    rows = []
    for mode in args.modes:  # per-block first: the whole-model runs at depth are the long ones
        for depth in args.depths:
            rows.append(measure(depth, mode, args.timeout, args.quantizer_compiled))
            r = rows[-1]
            print(f"{depth:>3} blocks  {mode:<5}  "
                  + (f"first step {r['first_step_s']:7.1f} s  graphs {r['graphs']:>3}  "
                     f"graph breaks {r['graph_breaks']}" if r["first_step_s"] is not None else f"FAILED: {r['error']}"),
                  flush=True)
    t = {(r["depth"], r["mode"]): r["first_step_s"] for r in rows}
    failed = any(r["first_step_s"] is None for r in rows)
    verdicts = []
    lo, hi = min(args.depths), max(args.depths)
    if t.get((lo, "block")) and t.get((hi, "block")):
        growth = t[(hi, "block")] / t[(lo, "block")]
        verdicts.append((growth <= 1.2, f"per-block {hi} / {lo} blocks: {growth:.2f} (target <= 1.2)"))
    for depth in args.depths:
        if t.get((depth, "block")) and t.get((depth, "model")):
            share = t[(depth, "block")] / t[(depth, "model")]
            verdicts.append((share <= 0.5 or depth != 26,
                             f"per-block / whole-model at {depth} blocks: {share:.2f}"
                             + (" (target <= 0.5)" if depth == 26 else "")))
    for ok, line in verdicts:
        print(("ok    " if ok else "MISSED ") + line)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        args.json.write_text(json.dumps({"rows": rows, "verdicts": [line for _, line in verdicts],
                                         "config": {"depths": args.depths, "modes": args.modes, "hidden": 64,
                                                    "scope": "attn_mlp", "batch": [2, 64], "threads": 1,
                                                    "quantizer_compiled": args.quantizer_compiled},
                                         "torch": torch.__version__, "git_commit": commit,
                                         "cpus": os.cpu_count()}, indent=1) + "\n")
    return 1 if failed or not all(ok for ok, _ in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
