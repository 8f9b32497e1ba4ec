"""A training step with glibc's allocator as it starts against the same step with freed memory kept in the heap.

``hif8qat.runs.host_allocator.keep_freed_memory`` (what every ``run.py`` process does) keeps a step's freed memory
for the next step instead of giving it back to the system. Each measurement is its own process (glibc's malloc is
set once, before a process allocates), ``default`` started with ``HIF8QAT_HOST_ALLOCATOR=default``; the two kinds
alternate, their order swapped every round, and each process times ``--steps`` warm optimizer steps of the profile
and experiment (the trainer's model and ``train.loop.train_step``). Printed: per kind the median step (wall and
process CPU time, which a busy neighbour moves less), the ratio kept / default, the peak resident memory, and the
losses of both kinds, which must be equal (only where memory comes from differs).

    python benchmarks/bench_allocator.py                            # mini exp1, 3 rounds of 6 steps
    python benchmarks/bench_allocator.py --experiment exp3 --rounds 4

Offline: the model comes from the local cache (``HF_HUB_OFFLINE=1``); the tokens are random and fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_ONE = r"""
import json, resource, sys, time
import torch
from hif8qat.runs.host_allocator import keep_freed_memory
record = keep_freed_memory()
from hif8qat.cli.hydra_config import config_for
from hif8qat.compute_dtype import Numerics
from hif8qat.models.loading import load_causal_lm
from hif8qat.quant.linear import set_quantization
from hif8qat.train.loop import build_optimizer, prepare_model, train_step
from hif8qat.train.schedule import warmup_cosine_schedule
profile, experiment, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = config_for(profile, experiment, 0)
torch.manual_seed(0)
model, _ = load_causal_lm(cfg.model.name)
numerics = Numerics(cfg.train.autocast)
prepare_model(model, cfg, torch.device("cpu"), numerics)
if cfg.quant.enabled:
    set_quantization(model, True)
optimizer = build_optimizer(model, cfg)
scheduler = warmup_cosine_schedule(optimizer, cfg.train.lr_warmup_steps, cfg.train.steps)
ids = torch.randint(0, model.config.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1),
                    generator=torch.Generator().manual_seed(0))
batches = lambda: iter([ids] * cfg.grad_accum_steps(1))
losses = [train_step(model, optimizer, scheduler, batches(), cfg, numerics) for _ in range(2)]  # warm-up
wall, cpu = [], []
for _ in range(steps):
    w, c = time.perf_counter(), time.process_time()
    losses.append(train_step(model, optimizer, scheduler, batches(), cfg, numerics))
    wall.append(time.perf_counter() - w)
    cpu.append(time.process_time() - c)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"record": record, "wall": wall, "cpu": cpu, "losses": losses, "peak_bytes": peak}))
"""


def one(kind: str, profile: str, experiment: str, steps: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HIF8QAT_HOST_ALLOCATOR", None)
    if kind == "default":
        env["HIF8QAT_HOST_ALLOCATOR"] = "default"
    out = subprocess.run([sys.executable, "-c", _ONE, profile, experiment, str(steps)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="mini")
    ap.add_argument("--experiment", default="exp1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per process")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {"default": [], "kept": []}
    for r in range(args.rounds):
        for kind in (("default", "kept") if r % 2 == 0 else ("kept", "default")):
            runs[kind].append(one(kind, args.profile, args.experiment, args.steps))
    out = {"profile": args.profile, "experiment": args.experiment, "rounds": args.rounds, "steps": args.steps}
    for kind, results in runs.items():
        out[kind] = {"record": results[0]["record"],
                     "wall_s": statistics.median(t for r in results for t in r["wall"]),
                     "cpu_s": statistics.median(t for r in results for t in r["cpu"]),
                     "peak_gib": max(r["peak_bytes"] for r in results) / 2**30}
    out["ratio_wall"] = out["kept"]["wall_s"] / out["default"]["wall_s"]
    out["ratio_cpu"] = out["kept"]["cpu_s"] / out["default"]["cpu_s"]
    out["same_losses"] = len({tuple(r["losses"]) for results in runs.values() for r in results}) == 1
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.profile}/{args.experiment}, {args.rounds} rounds x {args.steps} steps, median step:")
        for kind in ("default", "kept"):
            o = out[kind]
            print(f"  {kind:8s} wall {o['wall_s']:.3f} s  cpu {o['cpu_s']:.3f} s  peak {o['peak_gib']:.2f} GiB  "
                  f"{o['record']}")
        print(f"  kept / default: wall {out['ratio_wall']:.3f}, cpu {out['ratio_cpu']:.3f}; losses identical: "
              f"{out['same_losses']}")
    return 0 if out["same_losses"] else 1


if __name__ == "__main__":
    sys.exit(main())
