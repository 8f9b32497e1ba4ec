"""How long a batch of runs will take on this machine, from a short measured training step.

Loads the profile's model (timed), times a few training steps at the profile's batch, sequence length and
numerics and an evaluation-sized forward pass, plain and quantized (:func:`measure`); then adds up, for every
run that is not finished yet, its steps, evaluation forwards and model loads (:func:`run_seconds`). Printed before
``make all`` and the other long targets, so a user on a slower machine knows what they started. The mini profile
is measured here; the one-GPU profile (gpu1) is estimated from FLOPs at a stated throughput (:func:`flop_costs`),
labelled so; elsewhere it says nothing."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hif8qat.compute_dtype import Numerics
from hif8qat.config.numerics import train_numerics
from hif8qat.evaluate.heldout_set import BATCH_WINDOWS as HELDOUT_BATCH_WINDOWS
from hif8qat.evaluate.heldout_set import heldout_window_count
from hif8qat.evaluate.loading import weights_cast_once
from hif8qat.evaluate.packed_rows import scoring_of
from hif8qat.files import human_bytes
from hif8qat.launch.memory import (
    SCREEN_MARGIN,
    cached_step_memory,
    describe,
    generous_count,
    screen_step,
    simulated_before,
)
from hif8qat.launch.recorded_evals import EvalWork, eval_in_steps, eval_work
from hif8qat.models.loading import load_causal_lm, model_config_facts
from hif8qat.models.pangu import OPENPANGU_EMBEDDED_1B_CONFIG
from hif8qat.quant.linear import freeze_scales, set_quantization, set_step
from hif8qat.runs.folders import is_done, run_dir_for
from hif8qat.train import checkpoint as ckpt
from hif8qat.train.compiled_blocks import compile_blocks
from hif8qat.train.loop import build_optimizer, prepare_model, train_step
from hif8qat.train.schedule import warmup_cosine_schedule

# The gpu1 estimate's stated assumptions (none of them measured by this project on a GPU): BF16 training at
# 250 TFLOP/s on one H200 (about a quarter of its dense BF16 peak; the authors' logs imply about 335 TFLOP/s per
# H800-class GPU at micro-batch 16, and micro-batch 4 runs less efficiently), the project's target QAT/BF16 step
# ratio of 1.25, evaluation forwards at a third of the training rate (small batches, padding, lm-eval's host
# work) and 30 s to load the 1B model.
GPU1_TFLOPS = 250.0
GPU1_QAT_RATIO = 1.25
GPU1_EVAL_EFFICIENCY = 1 / 3
GPU1_LOAD_S = 30.0


# A quantized run's first step, with the compile cache warm, costs this many warm quantized steps more than they do
# (mini exp3 on the AMX Xeon: 5.3 s over 2.32 s steps with 2 threads; 10.6 s over 5.0 s with 1 thread, loaded).
QAT_FIRST_STEP_EXTRA = 2.2

# Per evaluation mode, besides its forwards: lm-eval building its three tasks from the offline copies and writing the
# per-item files (about 15 s measured at the mini profile, docs/calibration.md).
EVAL_SETUP_S = 15.0


@dataclass(frozen=True)
class Costs:
    """What one piece of a run costs on this machine, measured by :func:`measure` (or assumed, :func:`flop_costs`)."""

    numerics: str
    load_s: float  # loading the model (once for training, once per evaluation mode and held-out model)
    train_step_s: float  # a warm plain (BF16) optimizer step at the profile's batch
    qat_step_s: float  # a warm step with the quantized linears on
    eval_token_s: float  # one evaluated position, unquantized forward, at the evaluation's mean call size
    quant_eval_token_s: float  # one evaluated position, quantized forward with frozen scales
    first_step_s: float = 0.0  # the first step's extra over a warm one (AdamW's state, first calls at the shape)
    qat_start_s: float = 0.0  # the first quantized step's extra: the quantizer kernels' compile, the cold start
    heldout_batch_s: float = 0.0  # a held-out batch of windows through one unquantized model, log-probabilities
    startup_s: float = 0.0  # a run process's start before its work (the interpreter, the imports)
    write_byte_s: float = 0.0  # writing and hashing one byte of a checkpoint or the export
    eval_setup_s: float = EVAL_SETUP_S  # per evaluation mode: lm-eval building its tasks, the per-item files
    eval_steps: float = 0.0  # a bf16 evaluation in warm plain steps (eval_in_steps); 0: from the forwards timed
    scoring: str = "packed"  # how the evaluation scores shared contexts (hif8qat.evaluate.packed_rows.scoring_of)


def _quant_ratio(costs: Costs) -> float:
    return costs.quant_eval_token_s / costs.eval_token_s if costs.eval_token_s else 1.0


def run_parts(cfg, costs: Costs, work: EvalWork, model_bytes: int = 0, state_bytes: int = 0) -> dict[str, float]:
    """Seconds each part of one run takes, counted from its config: the process's start, the model load, the
    plain (BF16 warmup) and quantized steps at their own costs (the first of each with its extra), the
    checkpoints written on the way and the export, each evaluation mode (a load, lm-eval's setup, its forwards)
    and, for a quantized run, the held-out comparison (a load and a pass over the windows per model compared:
    the baseline's export when the run has a baseline, and each evaluation mode).

    Args:
        cfg: the run's resolved config.
        costs: what each piece costs (:func:`measure` or :func:`flop_costs`).
        work: what one evaluation mode forwards (:func:`eval_work`).
        model_bytes: the export's weights, bytes.
        state_bytes: one checkpoint, bytes (weights and the optimizer's state).

    Returns:
        ``{"start", "train", "write", "evaluate", "heldout"}`` seconds."""
    steps = cfg.train.steps
    qat_steps = max(steps - cfg.quant.bf16_warmup_steps, 0) if cfg.quant.enabled else 0
    plain_steps = steps - qat_steps
    # the held-out loss at the end of training, and every val_every steps: batches of 4 windows
    validations = 1 + ((steps - 1) // cfg.train.val_every if cfg.train.val_every else 0)
    validation = validations * -(-cfg.data.eval_windows // 4) * costs.heldout_batch_s * (
        _quant_ratio(costs) if qat_steps else 1.0)
    train = (costs.first_step_s + plain_steps * costs.train_step_s + qat_steps * costs.qat_step_s
             + (costs.qat_start_s if qat_steps else 0.0) + validation)
    every, keep_last = cfg.train.checkpoint_every, cfg.train.keep_checkpoints_when_done != 0
    checkpoints = (steps - 1) // every + (1 if keep_last else 0) if every else int(keep_last)
    write = (checkpoints * state_bytes + model_bytes) * costs.write_byte_s
    modes = [m for m in cfg.eval.modes if m == "bf16" or cfg.quant.enabled]  # hif8 needs a quantized export
    if costs.eval_steps:  # a recorded evaluation's wall time, at this machine's step; a quantized mode's forwards
        evaluate = sum(costs.eval_steps * costs.train_step_s * (1.0 if mode == "bf16" else _quant_ratio(costs))
                       for mode in modes)
    else:
        evaluate = sum(costs.load_s + costs.eval_setup_s
                       + work.tokens * (costs.eval_token_s if mode == "bf16" else costs.quant_eval_token_s)
                       for mode in modes)
    heldout = 0.0
    if cfg.quant.enabled:  # the baseline's export (bf16) when there is a baseline, and each mode of the run
        batches = -(-heldout_window_count(cfg.train.seq_len) // HELDOUT_BATCH_WINDOWS)
        compared = (["bf16"] if cfg.experiment.baseline else []) + list(modes)
        heldout = sum(costs.load_s + batches * costs.heldout_batch_s * (1.0 if mode == "bf16" else _quant_ratio(costs))
                      for mode in compared)
    return {"start": costs.startup_s + costs.load_s, "train": train, "write": write, "evaluate": evaluate,
            "heldout": heldout}


def run_seconds(cfg, costs: Costs, work: EvalWork, model_bytes: int = 0, state_bytes: int = 0) -> float:
    """Seconds one run takes: the sum of :func:`run_parts`.

    Args:
        cfg: as in :func:`run_parts`.
        costs: as in :func:`run_parts`.
        work: as in :func:`run_parts`.
        model_bytes: as in :func:`run_parts`.
        state_bytes: as in :func:`run_parts`.

    Returns:
        The seconds."""
    return sum(run_parts(cfg, costs, work, model_bytes, state_bytes).values())


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


def process_age_s() -> float:
    """Seconds since this process started: its interpreter and imports, what each run's own process also pays
    before its work (read from /proc; 0 where there is none).

    Returns:
        The seconds."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, clock ticks
        return max(float(Path("/proc/uptime").read_text().split()[0]) - started / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def write_byte_seconds(folder: Path, size: int = 64 << 20) -> float:
    """Seconds per byte to write a file to disk (synced) and hash it, as checkpoints and exports are written, in the
    nearest existing folder of ``folder`` (the run folders' disk); the file is removed.

    Args:
        folder: where the runs will be written.
        size: bytes written.

    Returns:
        Seconds per byte."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    payload = os.urandom(1 << 20) * (size >> 20)
    t = time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".hif8qat-estimate-") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
        f.seek(0)
        hashlib.sha256(f.read()).hexdigest()
    return (time.perf_counter() - t) / len(payload)


def measure(cfg, numerics: Numerics, *, plain: bool = True, quantized_eval: bool = True,
            say: Callable[[str], None] = lambda line: None,
            eval_shape: Callable[[str], tuple[int, int] | None] = lambda scoring: (32, 8),
            wait_beside: Callable[[], None] = lambda: None) -> tuple[Costs, dict[str, int]]:
    """Time the pieces of a run with the run's model, batch and numerics, built as the trainer builds it
    (:func:`hif8qat.train.loop.prepare_model`: the quantized linears, the loss head, activation checkpointing; the
    run's optimizer and schedule) and stepped as it steps (:func:`hif8qat.train.loop.train_step`), on this machine's
    CPU. One loaded model serves every phase.

    A quantized config runs two quantized steps, the first as the run's first (AdamW's state, the quantizer's compile
    and cold start), then, when plain steps are pending too, one warm plain step (the first step's extra is counted
    once, with the quantized one); a plain config runs two plain steps. The evaluation is timed by a forward at its
    mean call shape (a quantized one only when ``quantized_eval``) unless it is counted without one, the held-out
    comparison by one of its batches.

    Args:
        cfg: the run's resolved config (a quantized one times both kinds of step).
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics` (its mode is timed on the
            CPU).
        plain: time a plain (BF16) step too (False: only quantized steps are pending).
        quantized_eval: time a quantized evaluation forward too (a pending run evaluates a quantized mode).
        say: told each phase as it starts.
        eval_shape: ``(rows, positions)`` of the evaluation forward timed, given how the model's evaluation scores
            shared contexts (its calls differ: packed rows, or cached contexts and short continuations); None where
            the evaluation is counted without its forward (a recorded evaluation in steps, no quantized mode), so
            none is timed.
        wait_beside: waits for work running beside this process (a run's start-up timed in a child process); called
            before the first timed step, so no step shares the cores with it.

    Returns:
        The measured costs, and ``{"model_bytes", "state_bytes"}``: the export's and a checkpoint's size."""
    if cfg.train.num_threads:  # as the trainer sets them for its process
        torch.set_num_threads(cfg.train.num_threads)
    say(f"loading {cfg.model.name}")
    t0 = time.perf_counter()
    model, _ = load_causal_lm(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code,
                              revision=cfg.model.revision)
    load_s = time.perf_counter() - t0
    numerics = replace(numerics, device_type="cpu")  # the model is timed where it loads: the CPU
    prepare_model(model, cfg, torch.device("cpu"), numerics)  # converted with quantization off, as training starts
    if cfg.train.compile:
        compile_blocks(model)
    optimizer = build_optimizer(model, cfg)
    scheduler = warmup_cosine_schedule(optimizer, cfg.train.lr_warmup_steps, cfg.train.steps)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
    steps = itertools.count(cfg.quant.bf16_warmup_steps)  # the quantized steps' indices, from the first

    def step_s() -> float:
        model.train()
        if cfg.quant.enabled:  # as the trainer tells the quantizers the step before each
            set_step(model, next(steps))
        t = time.perf_counter()
        train_step(model, optimizer, scheduler, iter([ids] * cfg.grad_accum_steps(1)), cfg, numerics)
        return time.perf_counter() - t

    def token_s(rows: int, positions: int, evaluation: bool = True) -> float:
        """A forward and its FP32 log-probabilities, per position: as the evaluation runs it (weights cast and
        quantized once, by the untimed first call) or as the held-out comparison does (inference mode)."""
        model.eval()
        batch = torch.randint(0, vocab, (rows, positions))
        kept = weights_cast_once(model) if evaluation else contextlib.nullcontext()
        with kept, torch.no_grad() if evaluation else torch.inference_mode():
            for _ in range(2):  # the first call at a shape allocates (and casts the kept weights)
                with numerics.forward():
                    t = time.perf_counter()
                    torch.log_softmax(model(input_ids=batch, use_cache=False).logits.float(), dim=-1)
                    seconds = time.perf_counter() - t
        return seconds / (rows * positions)

    batch_line = (f"{cfg.train.micro_batch_size} x {cfg.train.seq_len} tokens"
                  + (f", {cfg.grad_accum_steps(1)} micro-batches" if cfg.grad_accum_steps(1) > 1 else ""))
    scoring = scoring_of(model)
    shape = eval_shape(scoring)
    quantized_eval = quantized_eval and shape is not None
    first_extra = qat_start = 0.0
    quant_token_s = None
    if cfg.quant.enabled:
        training = cfg.quant.training
        kind = f"{training.format} ({training.scope})"
        wait_beside()  # no timed step shares the cores with it
        say(f"timing a first {kind} training step of {batch_line}, as the run's first (AdamW's state, the "
            "quantizer's compile)")
        set_quantization(model, True)
        first = step_s()
        say(f"timing a warm {kind} training step" + (" and a quantized evaluation forward" if quantized_eval else ""))
        qat_step_s = step_s()
        # What the run's first step adds: the estimate's own first step paid the quantizer's compile (tens of seconds
        # in a new environment); the run finds the compile cache it filled and pays dynamo's tracing, the kernels'
        # first-call checks and AdamW's state, in proportion to the machine's speed.
        compile_s = first - qat_step_s
        qat_start = min(compile_s, QAT_FIRST_STEP_EXTRA * qat_step_s)
        if quantized_eval:
            freeze_scales(model, True)
            quant_token_s = token_s(*shape)
            freeze_scales(model, False)
        set_quantization(model, False)
    if plain and cfg.quant.enabled:
        say(f"timing a plain (BF16) training step of {batch_line}")
        train_step_s = step_s()
    elif cfg.quant.enabled:
        train_step_s = qat_step_s
    else:
        wait_beside()
        say(f"timing 2 training steps of {batch_line}, the first as the run's first (AdamW's state)")
        first, train_step_s = step_s(), step_s()
        first_extra = first - train_step_s
        qat_step_s = train_step_s
    heldout_line = f"a held-out batch of {HELDOUT_BATCH_WINDOWS} x {cfg.train.seq_len}"
    if shape is None:
        say(f"timing {heldout_line}")
        eval_token_s = 0.0
    else:
        say(f"timing an evaluation forward of {shape[0]} x {shape[1]} tokens and {heldout_line}")
        eval_token_s = token_s(*shape)
    heldout_batch_s = token_s(HELDOUT_BATCH_WINDOWS, cfg.train.seq_len, evaluation=False) * (
        HELDOUT_BATCH_WINDOWS * cfg.train.seq_len)
    say("timing a write to the results' disk")
    write_s = write_byte_seconds(Path(cfg.results_root))
    sizes = {"model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
             "state_bytes": ckpt.state_bytes(model, optimizer)}
    costs = Costs(numerics.mode, load_s, train_step_s, qat_step_s, eval_token_s,
                  eval_token_s if quant_token_s is None else quant_token_s,
                  first_step_s=max(first_extra, 0.0), qat_start_s=max(qat_start, 0.0), heldout_batch_s=heldout_batch_s,
                  write_byte_s=write_s, scoring=scoring)
    return costs, sizes


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
    if device is None:  # the run's step is this machine's: as its preflight, no simulation for one that fits easily
        screen = screen_step(cfg, facts)
        if screen.fits_easily:
            print(f"memory: {cfg.experiment.name} at profile {cfg.profile.name}: one training step fits here with "
                  f"room to spare, not simulated: {SCREEN_MARGIN} times a generous count from the model's sizes "
                  f"({human_bytes(generous_count(cfg, facts), binary=True)}) is within the "
                  f"{human_bytes(screen.have, binary=True)} of {screen.where}")
            return
    if world_size is None:  # the Makefile launches the paper profile on every local GPU, the others in one process
        world_size = max(torch.cuda.device_count(), 1) if cfg.profile.name == "paper" else 1
    if device is not None:
        numerics = replace(numerics, device_type=device)
    parts = cached_step_memory(cfg, facts, numerics, world_size)
    print(f"memory: {cfg.experiment.name} at profile {cfg.profile.name}: one training step needs about "
          f"{describe(cfg, parts, world_size, numerics)}")


def main(argv, config_for: Callable[..., Any], run_startup: Callable[[], float | None] | None = None) -> int:
    """``python run.py --estimate --profile P --experiments E... [--seeds S...] [--label L] [--baseline E
    --baseline-overrides K=V...] [--overrides K=V...]``: the time (and memory) the runs that are not finished yet
    will take here.

    Args:
        argv: the arguments after ``--estimate``.
        config_for: ``config_for(profile, experiment, seed, overrides)``: the resolved RunConfig run.py would build
            (run.py composes it).
        run_startup: waits for and returns a run process's start-up seconds (its interpreter and imports, timed
            beside this process's single-threaded phases), None when unknown: this process's own start stands for it.

    Returns:
        The exit status."""
    ap = argparse.ArgumentParser(prog="run.py --estimate", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="mini")
    ap.add_argument("--experiments", nargs="+", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--results-root", default=None,
                    help="where recorded evaluations are read (default: the runs' own results_root)")
    ap.add_argument("--reference-root", default="results/reference_runs",
                    help="the committed runs whose evaluation time is read when this machine has none recorded")
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
    startup_s = process_age_s()  # this process's start; a run's imports more (the evaluator, the report)
    plain_config_for = config_for

    def config_for(profile, experiment, seed):  # every run with the settings it will be started with
        extra = args.baseline_overrides if experiment == args.baseline else args.overrides
        return plain_config_for(profile, experiment, seed, tuple(extra))

    started = time.perf_counter() - startup_s  # the user waits from the command's start: its imports count

    def say(phase: str) -> None:  # a line per phase, as it starts: the user sees what the seconds go to
        print(f"estimate: {args.label}: [{time.perf_counter() - started:.0f} s] {phase}...", flush=True)

    experiments = [e for e in (args.baseline, *args.experiments) if e]
    say("a training step's memory: its simulation, unless it fits far below this machine's")
    first = config_for(args.profile, args.experiments[0], args.seeds[0])
    t = time.perf_counter()
    print_memory(first, train_numerics(first), args.world_size, args.device)
    preflight_s = time.perf_counter() - t  # what a run's preflight pays when its step is not in the cache yet
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
    results_root = Path(args.results_root or configs[0].results_root)
    if args.profile == "gpu1":
        facts, source = _gpu1_facts(configs[0])
        costs = flop_costs(configs[0], facts)
        work = eval_work(results_root, args.profile, costs.scoring)
        total = sum(run_seconds(c, costs, work) for c in configs)
        train_flops = flops_per_token(facts, configs[0].train.seq_len)[0]
        print(f"estimate: {args.label}: {len(pending)} run(s) to train and evaluate, about {total / 60:.0f} min on "
              f"one GPU, from FLOPs, not measured: {train_flops / 1e9:.2f} GFLOP per training token ({source}), "
              f"{configs[0].train.global_batch_size * configs[0].train.seq_len:,} tokens per step, an assumed "
              f"{GPU1_TFLOPS:.0f} TFLOP/s BF16 (H200-class) and QAT at {GPU1_QAT_RATIO}x: a step "
              f"{costs.train_step_s:.2f} s plain / {costs.qat_step_s:.2f} s quantized; evaluation "
              f"{work.tokens / 1e6:.1f} M tokens per mode at a third of that rate; {costs.load_s:.0f} s per model load")
        return 0
    # Measure on a quantized run when there is one: it times both kinds of step and both forwards.
    measured = next((c for c in configs if c.quant.enabled), configs[0])
    quantized_eval = any(c.quant.enabled and any(m != "bf16" for m in c.eval.modes) for c in configs)
    roots = [results_root, Path(args.reference_root)]
    # per way of scoring: its evaluation in recorded plain steps, or None (read once, used three times below)
    in_steps = {way: eval_in_steps(roots, args.profile, way) for way in ("packed", "cached")}
    # a plain step is the unit a recorded evaluation is counted in, even where only quantized steps are pending
    plain = any(in_steps.values()) or any(not c.quant.enabled or c.quant.bf16_warmup_steps > 0 for c in configs)
    started_up = []

    def wait_for_startup() -> None:  # the child's CPU seconds: the cores this process shares with it do not count
        if run_startup is not None:
            say("waiting for a run process's start-up (its imports), timed beside this one's and the model's load")
            started_up.append(run_startup())

    print(f"estimate: {args.label}: timing {measured.model.name} with {measured.experiment.name}'s settings on this "
          "machine", flush=True)
    rows = measured.eval.batch_size

    def eval_shape(scoring: str) -> tuple[int, int] | None:  # the recorded evaluation's mean call, where needed
        if in_steps[scoring] and not quantized_eval:
            return None  # counted in plain steps: a forward's time would not be used
        work = eval_work(results_root, args.profile, scoring)
        return rows, max(round(work.tokens / max(work.calls, 1) / rows), 1)

    costs, sizes = measure(measured, train_numerics(measured), plain=plain, quantized_eval=quantized_eval, say=say,
                           eval_shape=eval_shape, wait_beside=wait_for_startup)
    startup_s = next(iter(started_up), None) or startup_s
    work = eval_work(results_root, args.profile, costs.scoring)
    calibrated = in_steps[costs.scoring]
    costs = replace(costs, startup_s=startup_s, eval_steps=calibrated[0] if calibrated else 0.0)

    def preflight_cost(c) -> float:  # nothing where the cache holds its step (the simulation above, an earlier run)
        facts = model_config_facts(c.model.name.strip(), revision=c.model.revision)
        if not facts or simulated_before(c, facts, train_numerics(c)):
            return 0.0
        return preflight_s if screen_step(c, facts).to_simulate else 0.0  # as preflight screens it

    parts = [run_parts(c, replace(costs, startup_s=startup_s + preflight_cost(c)), work, **sizes) for c in configs]
    total = sum(sum(p.values()) for p in parts)
    each = ", ".join(f"{c.experiment.name} {sum(p.values()) / 60:.1f}" for c, p in zip(configs, parts, strict=True))
    summed = {k: sum(p[k] for p in parts) for k in parts[0]}
    print(f"estimate: {args.label}: {len(pending)} run(s) to train and evaluate, about {total / 60:.1f} min on "
          f"this machine ({each} min; training {summed['train'] / 60:.1f}, evaluation "
          f"{summed['evaluate'] / 60:.1f}, held-out comparison {summed['heldout'] / 60:.1f}, start-up and "
          f"writing {(summed['start'] + summed['write']) / 60:.1f}), from {costs.numerics} numerics measured just now "
          f"in {time.perf_counter() - started:.0f} s: a training step {costs.train_step_s:.2f} s plain / "
          f"{costs.qat_step_s:.2f} s quantized (+{costs.qat_start_s:.1f} s for the first quantized), "
          + (f"an evaluation {costs.eval_steps:.1f} plain steps as in {calibrated[1]}, " if calibrated else
             f"{costs.eval_token_s * 1e3:.2f} / {costs.quant_eval_token_s * 1e3:.2f} ms per evaluated position, ")
          + f"{costs.load_s:.1f} s to load the model, {costs.startup_s:.1f} s to start a run)")
    return 0
