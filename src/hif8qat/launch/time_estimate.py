"""How long a batch of runs will take on this machine, from a short measured training step.

Loads the profile's model (timed), times a few training steps at the profile's batch, sequence length and
numerics and an evaluation-sized forward pass, plain and quantized (:func:`measure`); then adds up, for every
run that is not finished yet, its steps, evaluation forwards and model loads (:func:`run_seconds`). Printed before
``make all`` and the other long targets, so a user on a slower machine knows what they started. The mini profile
is measured here; the one-GPU profile (gpu1) is estimated from FLOPs at a stated throughput (:func:`flop_costs`),
labelled so; elsewhere it says nothing."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hif8qat.compute_dtype import Numerics
from hif8qat.config.numerics import train_numerics
from hif8qat.evaluate.heldout import heldout_window_count
from hif8qat.launch.memory import describe, step_memory
from hif8qat.models.loading import load_causal_lm, model_config_facts
from hif8qat.models.pangu import OPENPANGU_EMBEDDED_1B_CONFIG
from hif8qat.quant.linear import freeze_scales
from hif8qat.quant.training import convert_to_hif8_training
from hif8qat.runs.folders import is_done, run_dir_for
from hif8qat.train.loop import build_optimizer, lm_loss

# Tokens an evaluation of one run forwards at the mini profile (its three subsets, each item's context once,
# the bf16 mode only), counted by the evaluation itself into results.json (_meta.eval_tokens); used when no
# finished evaluation of this profile exists yet to read it from. A workload size, not a time.
# mini: the committed reference run of exp1 forwarded 51,287 positions, padding included (was 60,000, which put a
# fresh clone's estimate of each evaluation 17 % high).
# gpu1: MMLU 1,140 items x about 540 tokens (5 shots and the question), HellaSwag 1,000 x about 1,160 (10 shots,
# the context once and four endings), ARC-Challenge 1,172 x about 1,300 (25 shots): about 3.3 M, a planning figure
# until the first gpu1 evaluation records its own count.
_EVAL_TOKENS_FALLBACK = {"mini": 51_300, "gpu1": 3_300_000}

# The gpu1 estimate's stated assumptions (none of them measured by this project on a GPU): BF16 training at
# 250 TFLOP/s on one H200 (about a quarter of its dense BF16 peak; the authors' logs imply about 335 TFLOP/s per
# H800-class GPU at micro-batch 16, and micro-batch 4 runs less efficiently), the project's target QAT/BF16 step
# ratio of 1.25, evaluation forwards at a third of the training rate (small batches, padding, lm-eval's host
# work) and 30 s to load the 1B model.
GPU1_TFLOPS = 250.0
GPU1_QAT_RATIO = 1.25
GPU1_EVAL_EFFICIENCY = 1 / 3
GPU1_LOAD_S = 30.0


def eval_tokens(results_root: Path, profile: str) -> int:
    """Tokens one run's evaluation forwards: from the newest recorded evaluation of the profile, else a fallback.

    Args:
        results_root: the folder that holds the runs.
        profile: the profile.

    Returns:
        The tokens; a per-profile fallback when no evaluation is recorded."""
    counts = []
    for path in sorted((results_root / profile).glob("*/seed*/eval/bf16/results.json")):
        tokens = (json.loads(path.read_text()).get("_meta") or {}).get("eval_tokens") or {}
        if tokens.get("forwarded_padded") or tokens.get("forwarded"):
            counts.append(int(tokens.get("forwarded_padded") or tokens["forwarded"]))
    return max(counts) if counts else _EVAL_TOKENS_FALLBACK.get(profile, 0)


# Per evaluation mode, besides the forwards: lm-eval building its three tasks from the offline copies and
# writing the per-item files (about 15 s measured at the mini profile, docs/calibration.md).
EVAL_SETUP_S = 15.0


@dataclass(frozen=True)
class Costs:
    """What one piece of a run costs on this machine, measured by :func:`measure`."""

    numerics: str
    load_s: float  # loading the model (once for training, once per evaluation mode)
    train_step_s: float  # a plain (BF16-warmup) optimizer step at the profile's batch
    qat_step_s: float  # a step with the quantized linears on
    eval_token_s: float  # one evaluated token, unquantized forward
    quant_eval_token_s: float  # one evaluated token, quantized forward with frozen scales


def run_seconds(cfg, costs: Costs, eval_tokens_per_mode: int) -> float:
    """Seconds one run takes: its plain and quantized steps, each evaluation mode's forwards and setup, and
    one model load per process that needs the model (training, then each evaluation mode); for a quantized run
    also the held-out distances computed after its evaluation.

    Args:
        cfg: the run's resolved config.
        costs: what each piece costs (:func:`measure` or :func:`flop_costs`).
        eval_tokens_per_mode: tokens one evaluation mode forwards.

    Returns:
        The seconds."""

    modes = list(cfg.eval.modes)
    qat_steps = max(cfg.train.steps - cfg.quant.bf16_warmup_steps, 0) if cfg.quant.enabled else 0
    train = (cfg.train.steps - qat_steps) * costs.train_step_s + qat_steps * costs.qat_step_s
    evaluate = sum(eval_tokens_per_mode * (costs.eval_token_s if mode == "bf16" else costs.quant_eval_token_s)
                   + EVAL_SETUP_S for mode in modes)
    heldout = 0.0
    if cfg.quant.enabled:  # held-out distances: the baseline's export and each mode of the run, forwarded once
        tokens = heldout_window_count(cfg.train.seq_len) * cfg.train.seq_len
        heldout = sum(costs.load_s + tokens * (costs.eval_token_s if mode == "bf16" else costs.quant_eval_token_s)
                      for mode in ["bf16", *modes])
    return train + evaluate + heldout + costs.load_s * (1 + len(modes))


def flops_per_token(facts: dict, seq_len: int) -> tuple[float, float]:
    """(training, forward) FLOPs per token: 6 N and 2 N over the parameters that multiply (the blocks and the head,
    which a tied embedding still computes; not the embedding lookup), plus attention's scores and values,
    12 L d T and 4 L d T (counted without the causal half, the usual convention).

    Args:
        facts: the model's config.json as :func:`hif8qat.models.loading.model_config_facts` reads it.
        seq_len: the sequence length.

    Returns:
        ``(training, forward)`` FLOPs per token."""
    h, layers, vocab = facts["hidden_size"], facts["num_hidden_layers"], facts["vocab_size"]
    inter = facts["intermediate_size"]
    heads = facts["num_attention_heads"]
    kv, d = facts.get("num_key_value_heads") or heads, facts.get("head_dim") or h // heads
    block = 2 * h * heads * d + 2 * h * kv * d + 3 * h * inter
    matmul = layers * block + vocab * h
    attention = layers * heads * d * seq_len
    return 6 * matmul + 12 * attention, 2 * matmul + 4 * attention


def flop_costs(cfg, facts: dict, tflops: float = GPU1_TFLOPS) -> Costs:
    """What a run's pieces cost from FLOPs at ``tflops`` (BF16 training), not measured: see GPU1_* above.

    Args:
        cfg: the run's resolved config.
        facts: the model's config.json as :func:`hif8qat.models.loading.model_config_facts` reads it.
        tflops: the assumed BF16 throughput, TFLOP/s.

    Returns:
        The costs, labelled ``bf16 (assumed)``."""
    train_flops, forward_flops = flops_per_token(facts, cfg.train.seq_len)
    step = cfg.train.global_batch_size * cfg.train.seq_len * train_flops / (tflops * 1e12)
    token = forward_flops / (tflops * 1e12 * GPU1_EVAL_EFFICIENCY)
    return Costs("bf16 (assumed)", GPU1_LOAD_S, step, step * GPU1_QAT_RATIO, token, token * GPU1_QAT_RATIO)


def _gpu1_facts(cfg) -> tuple[dict, str]:
    """The model's sizes from its config.json, or the published 1B's when it is not on this machine yet."""
    facts = model_config_facts(cfg.model.name, revision=cfg.model.revision)
    if facts and all(isinstance(facts.get(k), int) for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                             "intermediate_size", "num_attention_heads")):
        return facts, cfg.model.name
    return OPENPANGU_EMBEDDED_1B_CONFIG, "openPangu-Embedded-1B's published config"


def measure(cfg, numerics: Numerics, repeats: int = 1, say: Callable[[str], None] = lambda line: None) -> Costs:
    """Time the pieces of a run with the run's model, batch and numerics (quantized ones with cfg's quant), on this
    machine's CPU.

    Each kind of step runs once to warm up (allocation, AdamW's moments, the quantizers' cold start), then
    ``repeats`` times timed; the evaluation forward is timed once, after the training steps have warmed the
    kernels up.

    Args:
        cfg: the run's resolved config.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics` (its mode is timed on the
            CPU).
        repeats: timed steps per kind after its warm-up (the fastest is kept).
        say: told each phase as it starts.

    Returns:
        The measured costs."""
    say(f"loading {cfg.model.name}")
    t0 = time.perf_counter()
    model, _ = load_causal_lm(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    load_s = time.perf_counter() - t0
    numerics = replace(numerics, device_type="cpu")  # the model is timed where it loads: the CPU
    ids = torch.randint(0, model.config.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
    batch = torch.randint(0, model.config.vocab_size, (16, 128))

    def step_s(opt) -> float:
        def once() -> float:
            t = time.perf_counter()
            with numerics.forward():
                loss = lm_loss(model, ids)
            with numerics.backward():
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t

        model.train()
        once()  # first call: allocation, the quantizers' cold start
        return min(once() for _ in range(repeats)) * cfg.grad_accum_steps(1)

    def token_s() -> float:
        model.eval()
        with torch.inference_mode(), numerics.forward():
            t = time.perf_counter()
            model(input_ids=batch, use_cache=False)
            return (time.perf_counter() - t) / batch.numel()

    # the run's AdamW, in its implementation (train.optimizer_impl): a large share of a mini-profile step
    say(f"timing {1 + repeats} training steps of {cfg.train.micro_batch_size} x {cfg.train.seq_len} tokens, "
        "the first a warm-up")
    plain_step = step_s(build_optimizer(model, cfg))
    say(f"timing an evaluation forward of {batch.shape[0]} x {batch.shape[1]} tokens")
    plain_token = token_s()
    qat_step, quant_token = plain_step, plain_token
    if cfg.quant.enabled:
        training = cfg.quant.training
        say(f"converting to {training.format} ({training.scope}), timing {1 + repeats} quantized "
            "training steps and a quantized evaluation forward")
        convert_to_hif8_training(model, config=replace(training, emulate_bf16=numerics.emulates_bf16))
        qat_step = step_s(build_optimizer(model, cfg))
        freeze_scales(model, True)
        quant_token = token_s()
    return Costs(numerics.mode, load_s, plain_step, qat_step, plain_token, quant_token)


def print_memory(cfg, numerics: Numerics, world_size: int | None, device: str | None) -> None:
    """The simulated memory of one training step of the run (:mod:`hif8qat.launch.memory`), when its model's
    config.json is at hand.

    Args:
        cfg: the run's resolved config.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics`.
        world_size: processes (None: every local GPU for the paper profile, else one).
        device: the device type the run trains on, replacing ``numerics``' (None: ``numerics``' own, where
            ``train.device`` puts it here)."""
    facts = model_config_facts(cfg.model.name.strip(), revision=cfg.model.revision)
    if not facts:
        return
    if world_size is None:  # the Makefile launches the paper profile on every local GPU, the others in one process
        world_size = max(torch.cuda.device_count(), 1) if cfg.profile.name == "paper" else 1
    if device is not None:
        numerics = replace(numerics, device_type=device)
    parts = step_memory(cfg, facts, numerics, world_size)
    print(f"memory: {cfg.experiment.name} at profile {cfg.profile.name}: one training step needs about "
          f"{describe(cfg, parts, world_size, numerics)}")


def main(argv, config_for: Callable[..., Any]) -> int:
    """``python run.py --estimate --profile P --experiments E... [--seeds S...] [--label L] [--baseline E
    --baseline-overrides K=V...] [--overrides K=V...]``: the time (and memory) the runs that are not finished yet
    will take here.

    Args:
        argv: the arguments after ``--estimate``.
        config_for: ``config_for(profile, experiment, seed, overrides)``: the resolved RunConfig run.py would build
            (run.py composes it).

    Returns:
        The exit status."""
    ap = argparse.ArgumentParser(prog="run.py --estimate", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="mini")
    ap.add_argument("--experiments", nargs="+", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--results-root", default="results/runs")
    ap.add_argument("--label", default="these runs")
    ap.add_argument("--baseline", default="", help="an experiment run first with --baseline-overrides (make expN)")
    ap.add_argument("--overrides", nargs="*", default=[], help="the command line's settings (make's ARGS)")
    ap.add_argument("--baseline-overrides", nargs="*", default=[], help="the baseline's settings (BASELINE_ARGS)")
    ap.add_argument("--world-size", type=int, default=None,
                    help="processes the run is launched with (default: the local GPUs for the paper profile, as make "
                         "launches it, else 1): for the memory estimate")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="where the run trains, for the memory estimate (default: where train.device puts it here)")
    args = ap.parse_args(argv)
    plain_config_for = config_for

    def config_for(profile, experiment, seed):  # every run with the settings it will be started with
        extra = args.baseline_overrides if experiment == args.baseline else args.overrides
        return plain_config_for(profile, experiment, seed, tuple(extra))

    started = time.perf_counter()

    def say(phase: str) -> None:  # a line per phase, as it starts: the user sees what the seconds go to
        print(f"estimate: {args.label}: [{time.perf_counter() - started:.0f} s] {phase}...", flush=True)

    experiments = [e for e in (args.baseline, *args.experiments) if e]
    say("simulating a training step's memory")
    first = config_for(args.profile, args.experiments[0], args.seeds[0])
    print_memory(first, train_numerics(first), args.world_size, args.device)
    if args.profile not in ("mini", "gpu1"):
        return 0

    say(f"composing the configs of {len(experiments) * len(args.seeds)} run(s) and looking for finished ones")
    pending = []
    for seed in args.seeds:
        for experiment in experiments:
            cfg = config_for(args.profile, experiment, seed)
            if not is_done(run_dir_for(cfg)) and (experiment, seed) not in pending:
                pending.append((experiment, seed))
    if not pending:
        print(f"estimate: every run of {args.label} is finished; only the report is left")
        return 0
    configs = [config_for(args.profile, experiment, seed) for experiment, seed in pending]
    tokens = eval_tokens(Path(args.results_root), args.profile)
    if args.profile == "gpu1":
        facts, source = _gpu1_facts(configs[0])
        costs = flop_costs(configs[0], facts)
        total = sum(run_seconds(c, costs, tokens) for c in configs)
        train_flops = flops_per_token(facts, configs[0].train.seq_len)[0]
        print(f"estimate: {args.label}: {len(pending)} run(s) to train and evaluate, about {total / 60:.0f} min on "
              f"one GPU, from FLOPs, not measured: {train_flops / 1e9:.2f} GFLOP per training token ({source}), "
              f"{configs[0].train.global_batch_size * configs[0].train.seq_len:,} tokens per step, an assumed "
              f"{GPU1_TFLOPS:.0f} TFLOP/s BF16 (H200-class) and QAT at {GPU1_QAT_RATIO}x: a step "
              f"{costs.train_step_s:.2f} s plain / {costs.qat_step_s:.2f} s quantized; evaluation {tokens / 1e6:.1f} M "
              f"tokens per mode at a third of that rate; {costs.load_s:.0f} s per model load")
        return 0
    # Measure on a quantized run when there is one: it times both kinds of step and both forwards.
    measured = next((c for c in configs if c.quant.enabled), configs[0])
    print(f"estimate: {args.label}: timing {measured.model.name} with {measured.experiment.name}'s settings on this "
          "machine", flush=True)
    costs = measure(measured, train_numerics(measured), say=say)
    total = sum(run_seconds(c, costs, tokens) for c in configs)
    print(f"estimate: {args.label}: {len(pending)} run(s) to train and evaluate, about {total / 60:.1f} min on "
          f"this machine ({costs.numerics} numerics, measured just now in {time.perf_counter() - started:.0f} s: a "
          f"training step {costs.train_step_s:.2f} s plain / {costs.qat_step_s:.2f} s quantized, "
          f"{costs.eval_token_s * 1e3:.2f} / {costs.quant_eval_token_s * 1e3:.2f} ms per evaluated token, "
          f"{costs.load_s:.0f} s to load the model)")
    return 0
