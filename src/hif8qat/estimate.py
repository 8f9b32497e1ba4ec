"""How long a batch of runs will take on this machine, from a short measured training step.

    python run.py --estimate --profile mini --experiments exp1 exp2 ... --seeds 0 [--label "make all"]

Loads the profile's model, times a few training steps at the profile's batch, sequence length and numerics
(``train.autocast=auto`` resolved here), and an evaluation-sized forward pass; then multiplies by the steps
and evaluation tokens of every run that is not finished yet. Printed before ``make all`` and the other
long targets, so a user on a slower machine knows what they started. Only the mini profile is estimated
(its runs take minutes to an hour on a CPU); elsewhere it says nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Tokens an evaluation of one run forwards at the mini profile (its three subsets, each item's context once,
# the bf16 mode only), counted by the evaluation itself into results.json (_meta.eval_tokens); used when no
# finished evaluation of this profile exists yet to read it from. A workload size, not a time.
_EVAL_TOKENS_FALLBACK = {"mini": 60_000}


def eval_tokens(results_root: Path, profile: str) -> int:
    """Tokens one run's evaluation forwards: from the newest recorded evaluation of the profile, else a fallback."""
    counts = []
    for path in sorted((results_root / profile).glob("*/seed*/eval/bf16/results.json")):
        tokens = (json.loads(path.read_text()).get("_meta") or {}).get("eval_tokens") or {}
        if tokens.get("forwarded_padded") or tokens.get("forwarded"):
            counts.append(int(tokens.get("forwarded_padded") or tokens["forwarded"]))
    return max(counts) if counts else _EVAL_TOKENS_FALLBACK.get(profile, 0)


def measure(cfg, repeats: int = 2) -> dict[str, float]:
    """Seconds per training step and per evaluated token, measured with the run's model and numerics."""
    import torch

    from . import numerics
    from .models import load_causal_lm

    model, _ = load_causal_lm(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9)
    mode = numerics.resolve(cfg.train.autocast, "cpu")
    ids = torch.randint(0, model.config.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))

    def step() -> float:
        t0 = time.perf_counter()
        with numerics.forward_context(mode, "cpu"):
            loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        with numerics.backward_context(mode, "cpu"):
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step()
    train_s = min(step() for _ in range(repeats)) * cfg.grad_accum_steps(1)
    model.eval()
    batch = torch.randint(0, model.config.vocab_size, (16, 128))
    with torch.inference_mode(), numerics.forward_context(mode, "cpu"):
        model(input_ids=batch)
        t0 = time.perf_counter()
        model(input_ids=batch)
        token_s = (time.perf_counter() - t0) / batch.numel()
    return {"numerics": mode, "train_step_s": train_s, "eval_token_s": token_s}


def main(argv, config_for: Callable[[str, str, int], Any]) -> int:
    """``config_for(profile, experiment, seed)``: the resolved RunConfig run.py would build (run.py composes it)."""
    ap = argparse.ArgumentParser(prog="run.py --estimate", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="mini")
    ap.add_argument("--experiments", nargs="+", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--results-root", default="results/runs")
    ap.add_argument("--label", default="these runs")
    args = ap.parse_args(argv)
    if args.profile != "mini":
        return 0
    from .runs import is_done, run_dir_for

    pending = []
    for seed in args.seeds:
        for experiment in args.experiments:
            cfg = config_for(args.profile, experiment, seed)
            if not is_done(run_dir_for(cfg)) and (experiment, seed) not in pending:
                pending.append((experiment, seed))
    if not pending:
        print(f"estimate: every run of {args.label} is finished; only the report is left")
        return 0
    cfg = config_for(args.profile, pending[0][0], pending[0][1])
    m = measure(cfg)
    per_run = cfg.train.steps * m["train_step_s"] + eval_tokens(Path(args.results_root), args.profile) * m["eval_token_s"]
    total = len(pending) * per_run
    print(f"estimate: {args.label} has {len(pending)} run(s) to train and evaluate, about {total / 60:.0f} min on "
          f"this machine ({m['numerics']} numerics: {m['train_step_s']:.1f} s per training step, "
          f"{m['eval_token_s'] * 1e3:.2f} ms per evaluated token, measured just now; quantized runs take up to "
          "1.5x longer)")
    return 0
