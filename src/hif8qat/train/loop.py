"""The shared trainer: BF16 warmup then 8-bit QAT (HiF8 or FP8), AdamW + linear warmup / cosine, gradient
accumulation, atomic checkpoints with exact resume, data parallel by DDP or FSDP2 (``train.distributed``) under torchrun
or srun.

Quantization enters only through module swapping (`hif8qat.convert_to_hif8_training`, the library's own entry
point) and the two switches the trainer flips (`set_quantization` at the end of the BF16 warmup, `set_step` before
each optimizer step); nothing below branches on whether a layer is quantized.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hif8qat.compute_dtype import Numerics
from hif8qat.config.numerics import optimizer_impl_for
from hif8qat.config.run_config import RunConfig
from hif8qat.data.loader import build_eval_windows, build_train_stream
from hif8qat.data.prefetch import PrefetchedStream
from hif8qat.errors import RunError, concerning
from hif8qat.models.loading import enable_activation_checkpointing, load_causal_lm
from hif8qat.models.quant_files import dump_telemetry
from hif8qat.quant.linear import (
    freeze_scales,
    quant_modules,
    scaler_state_dict,
    scalers_left_out,
    set_quantization,
    set_step,
    step_telemetry,
)
from hif8qat.quant.training import convert_to_hif8_training
from hif8qat.runs.folders import METRICS_FILE, mark_done, mark_failed, update_summary
from hif8qat.runs.launch_env import env_from_slurm
from hif8qat.train import checkpoint as ckpt
from hif8qat.train.chunked_loss import install_loss_head, lm_loss
from hif8qat.train.compiled_blocks import compile_blocks
from hif8qat.train.distributed import (
    all_gather_objects,
    apply_fsdp,
    cuda_device_for,
    full_model_state_dict,
    grad_sync,
    is_fsdp,
)
from hif8qat.train.export import export_or_explain
from hif8qat.train.guards import _first_nonfinite, clip_gradients
from hif8qat.train.log import MetricsSink, progress_bar, train_summary, truncate_metrics
from hif8qat.train.preemption import Preempted, StopSignalExit, StopSignals, hooked_stream
from hif8qat.train.provenance import (
    ALLOW_MISMATCH_SETTING,
    SCALERS_KEY,
    check_provenance,
    load_saved_scalers,
    run_provenance,
)
from hif8qat.train.schedule import warmup_cosine_schedule

# torch's default is 10 minutes; a 1B model's export or checkpoint to a network filesystem can take longer.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=60)


class TrainingDiverged(RunError):
    """The loss, the gradients (persistently) or the weights became non-finite; no bad state is saved."""


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_gather(self, obj: Any) -> list[Any]:

        """Every rank's ``obj``, in rank order.

        Args:
            obj: this rank's object (picklable).

        Returns:
            One object per rank.
        """
        return all_gather_objects(obj, self.world_size)


def setup_distributed(device_pref: str = "auto") -> DistContext:
    """Read torchrun's environment (or srun's, mapped by env_from_slurm); initialise the process group
    (NCCL on GPU, gloo on CPU).

    Args:
        device_pref: the ``train.device`` setting ("auto", "cpu" or "cuda").

    Returns:
        This process's rank, world size and device.
    """

    env_from_slurm()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_pref != "cpu"
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is available")
    device = cuda_device_for(local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        # device_id binds NCCL to this rank's GPU up front; the long timeout covers what one rank does while the
        # others wait at a barrier (rank 0's export and pruning, a checkpoint on a slow shared filesystem)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=PROCESS_GROUP_TIMEOUT,
                                device_id=device if use_cuda else None)
    rank = dist.get_rank() if world_size > 1 else 0
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's random generators.

    Args:
        seed: the seed.
    """
    random.seed(seed)
    torch.manual_seed(seed)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: biases and norm gains are not decayed (the usual AdamW practice).

    Args:
        model: the model.
        weight_decay: the decay of the matrices.

    Returns:
        AdamW's parameter groups.
    """
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def held_out_loss(model, windows: torch.Tensor, cfg: RunConfig, numerics: Numerics, device: torch.device,
                  batch: int = 4) -> float:
    """Mean loss on held-out windows, with the quantizers' scales frozen so evaluation leaves no trace.

    Args:
        model: the model.
        windows: ``[n, seq_len + 1]`` held-out windows.
        cfg: the run's configuration.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics`; every forward runs under
            it.
        device: where the model runs.
        batch: windows per forward.

    Returns:
        The mean loss.
    """
    was_training = model.training
    model.eval()
    freeze_scales(model, True)
    try:
        losses = []
        for start in range(0, len(windows), batch):
            chunk = windows[start:start + batch].to(device)
            with numerics.forward():
                losses.append(lm_loss(model, chunk, double_label_shift=cfg.quirks.double_label_shift).item())
    finally:
        freeze_scales(model, False)
        model.train(was_training)
    return float(sum(losses) / max(len(losses), 1))


def _reduce_step(value: float, flags: list[float], ctx: DistContext) -> tuple[float, list[float]]:
    """The ranks' mean loss, and the stop-signal flags summed over the ranks, in the one all-reduce a step
    makes anyway: every rank sends its flags every step, so all agree on a signal only some of them got,
    at no extra collective (the sum is elementwise: the loss is the same as reduced alone)."""
    if ctx.world_size == 1:
        return value, flags
    t = torch.tensor([value, *flags], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return float(t[0].item() / ctx.world_size), t[1:].tolist()


def _build_model(cfg: RunConfig, ctx: DistContext, numerics: Numerics):
    with concerning(f"model.name={cfg.model.name}"):  # a folder without tokenizer files, truncated weights
        model, tokenizer = load_causal_lm(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code,
                                          revision=cfg.model.revision)
    return model, tokenizer, prepare_model(model, cfg, ctx.device, numerics)


def prepare_model(model: torch.nn.Module, cfg: RunConfig, device: torch.device, numerics: Numerics) -> list[str]:
    """The loaded model made the one the run trains, in place: BF16 parameters (quirk), quantized linears (off
    until the BF16 warmup ends), the chunked loss head, the device, activation checkpointing. Returns the
    converted layers' names. The memory estimate (`launch.memory`) builds its simulated model through this too.

    Args:
        model: the loaded model.
        cfg: the run's configuration.
        device: where it trains.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics` (the quantized layers are
            told whether BF16 is emulated; the activation-checkpointing recompute runs under them).

    Returns:
        The converted layers' names.
    """
    # (moves only when needed: a model built under FakeTensorMode, as the memory estimate's, cannot move)
    if cfg.quirks.bf16_params and any(p.dtype != torch.bfloat16 for p in model.parameters()):
        model.to(torch.bfloat16)
    converted: list[str] = []
    emulate = numerics.emulates_bf16  # the layers are told the numerics, never guess them
    if cfg.quant.enabled:
        convert_to_hif8_training(model, config=replace(cfg.quant.training, emulate_bf16=emulate))
        converted = [name for name, _ in quant_modules(model)]
        set_quantization(model, False)
    install_loss_head(model, emulate)  # the loss in chunks: the micro-batch's whole FP32 logits never exist
    if any(t.device != device for t in (*model.parameters(), *model.buffers())):
        model.to(device)
    model.train()
    if cfg.train.activation_checkpointing:  # the recompute reuses the forward's HiF8 scales, records nothing
        enable_activation_checkpointing(model, numerics.checkpoint_kwargs())
    return converted


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, device_type: str | None = None) -> torch.optim.AdamW:
    """The run's AdamW in its implementation (``train.optimizer_impl``; ``auto`` when the config was not resolved
    is resolved here) for device_type (default: the parameters'; the memory estimate simulates a CUDA run on the
    CPU). torch's default is asked for explicitly on CUDA, where it is foreach, so that the simulation runs it.

    Args:
        model: the prepared model.
        cfg: the run's configuration.
        device_type: the device the optimizer runs on (default the parameters').

    Returns:
        The optimizer.
    """
    device_type = device_type or next(model.parameters()).device.type
    impl = optimizer_impl_for(cfg.train.optimizer_impl, device_type)
    options = {"fused": True} if impl == "fused" else {"foreach": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(parameter_groups(model, cfg.train.weight_decay), lr=cfg.train.lr,
                             betas=tuple(cfg.train.betas), eps=cfg.train.eps, **options)


def train_step(model: torch.nn.Module, optimizer, scheduler, batches, cfg: RunConfig, numerics: Numerics) -> float:
    """An optimizer step as :func:`train` takes it on one process, less the log: what the time estimate times.

    Args:
        model: the prepared model (:func:`prepare_model`; a quantized one told the step by ``set_step``).
        optimizer: its optimizer (:func:`build_optimizer`).
        scheduler: the optimizer's learning-rate schedule.
        batches: an iterator of ``[micro_batch_size, seq_len + 1]`` token ids, one per micro-batch.
        cfg: the run's configuration.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics`.

    Returns:
        The step's mean loss.
    """
    loss = _forward_backward(model, batches, cfg.grad_accum_steps(1), numerics, cfg, DistContext())
    _optimizer_step(model, optimizer, scheduler, cfg, DistContext(), {"skipped_steps": 0, "consecutive_skips": 0}, 0)
    return loss


def _wrap_distributed(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext) -> torch.nn.Module:
    if ctx.world_size == 1:
        return model
    if cfg.train.distributed == "fsdp":

        return apply_fsdp(model)

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def train(cfg: RunConfig, run_dir: Path, ctx: DistContext | None = None, *, numerics: Numerics) -> dict[str, Any]:
    """Train one run into run_dir (resuming from its latest checkpoint when train.resume allows).

    Args:
        cfg: the run's resolved configuration.
        run_dir: the run folder.
        ctx: the distributed context (default: set up from the environment).
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics`
            (``hif8qat.config.numerics.run_numerics(cfg).train``); every forward and backward runs under it.

    Returns:
        The training summary on the main rank (what summary.json records), {} on the others.
    """
    run = _Run(cfg, run_dir, ctx or setup_distributed(cfg.train.device), numerics)
    start_step = run.resume()
    run.open_log(start_step)
    if run.ctx.is_main:  # before the first step, not when the first save fails after hours of training
        ckpt.check_free_space(run_dir, ckpt.state_bytes(run.model, run.optimizer), cfg.train.keep_checkpoints)
    run.steps(start_step)
    return run.finish()


class _Run:
    """One training run's parts (model, optimizer, schedule, data stream, log), so that each phase of
    :func:`train` is a method that says what it does: resume, steps, save, stop on a signal, finish."""

    def __init__(self, cfg: RunConfig, run_dir: Path, ctx: DistContext, numerics: Numerics):
        self.cfg, self.run_dir, self.ctx, self.numerics = cfg, run_dir, ctx, numerics
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        seed_everything(cfg.seed)
        self.model, self.tokenizer, self.converted = _build_model(cfg, ctx, numerics)
        if cfg.train.compile:  # each decoder block on its own: identical blocks share one graph
            compile_blocks(self.model)
        self.wrapped = _wrap_distributed(self.model, cfg, ctx)
        self.quant_on_step = cfg.quant.bf16_warmup_steps if cfg.quant.enabled else None
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = warmup_cosine_schedule(self.optimizer, cfg.train.lr_warmup_steps, cfg.train.steps)
        with concerning(f"data.source={cfg.data.source}"):  # a corpus with bad lines, an unusable cache_dir
            stream = build_train_stream(cfg.data.source, self.tokenizer, seq_len=cfg.train.seq_len,
                                        micro_batch_size=cfg.train.micro_batch_size, rank=ctx.rank,
                                        world_size=ctx.world_size, seed=cfg.seed, cache_dir=cfg.data.cache_dir)
        if stream.kind == "stream":  # tokenized on the fly: the next batches are read in a thread during the step
            stream = PrefetchedStream(stream)
        self.stream = stream
        self.accum = cfg.grad_accum_steps(ctx.world_size)
        self.ckpt_root = run_dir / "checkpoints"
        # Optimizer steps skipped for a non-finite gradient norm: in total, and in the current streak.
        self.skips = {"skipped_steps": 0, "consecutive_skips": 0}
        self.step_times: dict[bool, list[float]] = {False: [], True: []}
        self._held_out_windows = None

    def resume(self) -> int:
        """Load the checkpoint train.resume names (auto: the newest that verifies); the step to start at."""
        cfg, ctx, model = self.cfg, self.ctx, self.model
        resume_from = None
        if cfg.train.resume == "auto":
            # every rank hashes its share of the files; rank 0 repairs and renames rejected checkpoints
            resume_from = _on_every_rank(ctx, lambda: ckpt.select_checkpoint(
                self.ckpt_root, rank=ctx.rank, world_size=ctx.world_size, gather=ctx.all_gather,
                barrier=ctx.barrier if ctx.world_size > 1 else None))
        elif cfg.train.resume != "never":
            resume_from = Path(cfg.train.resume)
            _on_every_rank(ctx, lambda: _verify_shared(resume_from, ctx))  # named explicitly: never replaced
        if resume_from is None:
            if cfg.quant.enabled and self.quant_on_step == 0:
                set_quantization(model, True)
            return 0
        # verified above, so its record of the settings that made it is what was written
        _on_every_rank(ctx, lambda: check_provenance(
            resume_from, run_provenance(cfg), allow_mismatch=cfg.train.resume_allow_mismatch,
            explicit=cfg.train.resume != "auto", log=print if ctx.is_main else (lambda _line: None)))
        start_step, rank_state = ckpt.load_checkpoint(resume_from, model=model, optimizer=self.optimizer,
                                                      scheduler=self.scheduler, rank=ctx.rank,
                                                      world_size=ctx.world_size)
        if "data_by_rank" in rank_state:  # written by another number of ranks (checkpoint.rank_state_for)
            try:
                note = self.stream.resize(rank_state["data_by_rank"])
            except ValueError as err:  # data settings changed, or a checkpoint without per-document positions
                raise ckpt.CheckpointError(f"cannot resume {resume_from} on {ctx.world_size} rank(s): {err}") from None
            if ctx.is_main:
                print(f"resuming {rank_state['resized_from']} rank(s)' checkpoint on {ctx.world_size}: {note}. The "
                      "data order from here on differs from an uninterrupted run's (no document is read twice "
                      "in this epoch); the scalers are those of saved rank (rank % saved ranks)")
        else:
            self.stream.load_state_dict(rank_state["data"])
        self.skips.update(rank_state.get("train", {}))
        if cfg.quant.enabled:
            load_saved_scalers(model, resume_from, rank_state, start_step=start_step,
                               quant_on_step=self.quant_on_step, allow_mismatch=cfg.train.resume_allow_mismatch)
            # after the load: the saved state holds each layer's on/off flag, off in a checkpoint written at the
            # last warmup step, and a resume from that step is the first quantized one (switched on: cold start)
            set_quantization(model, start_step >= self.quant_on_step)
        ckpt.set_rng_state(rank_state["rng"])
        if ctx.is_main:
            print(f"resumed from {resume_from} at step {start_step}")
        return start_step

    def open_log(self, start_step: int) -> None:
        self.metrics_path = self.run_dir / METRICS_FILE
        if self.ctx.is_main:
            truncate_metrics(self.metrics_path, start_step)
        self.sink = MetricsSink(self.cfg, self.run_dir, self.ctx.is_main)
        self.progress = progress_bar(self.cfg, self.ctx.is_main, start_step)
        self.wall_start = time.perf_counter()

    def held_out(self) -> float:
        if self._held_out_windows is None:  # tokenized once, reused by every validation
            with concerning(f"data.source={self.cfg.data.source}"):
                self._held_out_windows = build_eval_windows(self.cfg.data.source, self.tokenizer,
                                                            seq_len=self.cfg.train.seq_len,
                                                            num_windows=self.cfg.data.eval_windows)
        return held_out_loss(self.model, self._held_out_windows, self.cfg, self.numerics, self.ctx.device)

    def diverged(self, reason: str) -> TrainingDiverged:
        self.sink.close()
        if self.ctx.is_main:
            mark_failed(self.run_dir, reason)
        last = ckpt.latest_checkpoint(self.ckpt_root)
        if last is None:
            kept = ("no checkpoint was written before it "
                    f"(the first is due at step {self.cfg.train.checkpoint_every}); "
                    "change the settings that diverged (e.g. a lower train.lr) and run again")
        else:
            kept = (f"the newest checkpoint is {last} (step {ckpt.checkpoint_step(last)}, finite weights); rerunning "
                    "these settings resumes from it and will likely diverge again: change the settings that "
                    f"diverged (e.g. a lower train.lr), optionally continuing from it with train.resume={last} "
                    f"{ALLOW_MISMATCH_SETTING}=true (it was written under the old settings)")
        return TrainingDiverged(f"{reason}; {kept}")

    def save(self, step: int) -> None:
        bad = _first_nonfinite(self.model, self.optimizer, self.ctx)
        if bad:
            raise self.diverged(f"{bad} became non-finite by step {step}; it was not checkpointed")
        rank_state = {"rng": ckpt.rng_state(), "data": self.stream.state_dict(), "train": dict(self.skips),
                      SCALERS_KEY: scaler_state_dict(self.model) if self.cfg.quant.enabled else {}}
        ctx = self.ctx
        ckpt.save_checkpoint(self.ckpt_root, step, model=self.model, optimizer=self.optimizer,
                             scheduler=self.scheduler, rank_state=rank_state, rank=ctx.rank,
                             world_size=ctx.world_size, barrier=ctx.barrier if ctx.world_size > 1 else None,
                             keep=self.cfg.train.keep_checkpoints, provenance=run_provenance(self.cfg))

    def stop_here(self, step: int, signals: list, stop: StopSignals, saved: bool) -> None:
        """A stop signal came during the step before `step`: checkpoint `step` (unless just done), verify it,
        hand the signals to the handlers installed before ours (submitit's requeues the job), and stop."""
        path = ckpt.checkpoint_path(self.ckpt_root, step)
        if not saved:
            self.save(step)
        try:  # as a resume will: every rank hashes its share
            _verify_shared(path, self.ctx)
            where = f"checkpointed at step {step} ({path}, verified)"
        except ckpt.CheckpointError as err:  # the resume will reject it too and take the one before
            where = f"the checkpoint of step {step} failed its check ({err})"
        self.sink.close()
        self.progress.close()
        if self.ctx.is_main:
            print(f"{stop.names(signals)}: {where}", flush=True)
        try:
            stop.chain(signals)  # under submitit: requeues the job and exits, on rank 0
        except SystemExit as err:
            raise StopSignalExit(err.code) from None
        if not self.ctx.is_main:
            raise StopSignalExit(2)  # rank 0 says why, once
        how = "the same command" if self.cfg.train.resume == "auto" else f"train.resume={path} (or train.resume=auto)"
        raise Preempted(f"stopped by {stop.names(signals)}: {where}; resume with {how}")

    def steps(self, start_step: int) -> None:
        """The training steps; the bar closed however they end (an error's line then starts a line of its own)."""
        try:
            self._steps(start_step)
        finally:
            self.progress.close()

    def _steps(self, start_step: int) -> None:
        cfg, ctx, model = self.cfg, self.ctx, self.model
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        telemetry_dir = self.run_dir / "telemetry"
        quant_active = cfg.quant.enabled and start_step >= (self.quant_on_step or 0)
        # SIGTERM / USR2 only set a flag while the loop runs; the step they come in ends with a checkpoint
        with StopSignals() as stop:
            self.stream = hooked_stream(self.stream, self.accum, start_step, stop)  # crash tests, rehearsals only
            for step in range(start_step, cfg.train.steps):
                if cfg.quant.enabled:
                    if step == self.quant_on_step and not quant_active:
                        set_quantization(model, True)  # resets every scaler: cold start on the first QAT call
                        quant_active = True
                    set_step(model, step)
                t0 = time.perf_counter()
                epoch = self.stream.epoch
                loss_value, flags = _reduce_step(
                    _forward_backward(self.wrapped, self.stream, self.accum, self.numerics, cfg, ctx),
                    stop.flags(), ctx)
                if self.stream.epoch != epoch:  # each rank's part of a streamed source may end at its own step
                    order = "in a new order" if self.stream.kind == "packed" else "in the same order"
                    print(f"rank {ctx.rank}: step {step}: the training data ran out; data epoch {self.stream.epoch} "
                          f"reads it again {order}")
                if not math.isfinite(loss_value):
                    raise self.diverged(f"loss became {loss_value} at step {step}")
                lr = self.scheduler.get_last_lr()[0]
                grad_norm, skipped = _optimizer_step(model, self.optimizer, self.scheduler, cfg, ctx, self.skips, step)
                if self.skips["consecutive_skips"] > cfg.train.max_consecutive_skips:
                    raise self.diverged(
                        f"gradient norm non-finite for {self.skips['consecutive_skips']} consecutive steps (through "
                        f"step {step}; train.max_consecutive_skips={cfg.train.max_consecutive_skips})")
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
                step_time = time.perf_counter() - t0
                self.step_times[quant_active].append(step_time)

                record: dict[str, Any] = {
                    "step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                    "tokens": (step + 1) * tokens_per_step, "step_time_s": step_time,
                    "tokens_per_s": tokens_per_step / step_time, "quant": bool(quant_active),
                    "skipped_steps": self.skips["skipped_steps"], "epoch": self.stream.epoch,
                }
                if quant_active:
                    record.update(_telemetry(model, cfg, step, telemetry_dir, ctx.rank))
                if cfg.train.val_every and (step + 1) % cfg.train.val_every == 0 and step + 1 < cfg.train.steps:
                    record["val_loss"] = self.held_out()
                if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1 or skipped:
                    self.sink.log(record)
                self.progress.update(1)
                self.progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}",
                                          tok_s=f"{record['tokens_per_s']:.0f}", q=int(quant_active))
                due = (step + 1) % cfg.train.checkpoint_every == 0 and step + 1 < cfg.train.steps
                if due:
                    self.save(step + 1)
                signals = stop.agreed(flags)
                if signals:
                    self.stop_here(step + 1, signals, stop, saved=due)
        self.progress.close()

    def finish(self) -> dict[str, Any]:
        """The last checkpoint, the held-out loss, the export and the run's summary; then prune checkpoints."""
        cfg, ctx, model = self.cfg, self.ctx, self.model
        if cfg.train.keep_checkpoints_when_done == 0:  # it would be deleted at once (at 1B: 17 GB written, hashed)
            bad = _first_nonfinite(model, self.optimizer, ctx)
            if bad:
                raise self.diverged(f"{bad} became non-finite by step {cfg.train.steps}; it was not exported")
        else:
            self.save(cfg.train.steps)
        val_loss = self.held_out()
        self.sink.close()
        if hasattr(self.stream, "close"):  # a prefetching reader's thread ends with the run (sweeps run many)
            self.stream.close(rewind=False)
        summary: dict[str, Any] = {}

        with scalers_left_out(model):  # the weights alone, as save_pretrained writes them
            full_state = full_model_state_dict(model) if is_fsdp(model) else None  # FSDP: every rank gathers
        if ctx.is_main:
            export_or_explain(model, self.tokenizer, self.run_dir, cfg, self.converted, full_state, self.optimizer)
            summary = update_summary(self.run_dir, **train_summary(self.metrics_path, self.step_times, val_loss,
                                                                   self.converted,
                                                                   time.perf_counter() - self.wall_start),
                                     skipped_steps=self.skips["skipped_steps"],
                                     numerics=self.numerics.describe())
            mark_done(self.run_dir)
        ctx.barrier()
        if ctx.is_main and cfg.train.keep_checkpoints_when_done is not None:
            ckpt.prune_checkpoints(self.ckpt_root, cfg.train.keep_checkpoints_when_done)
        return summary


def _forward_backward(wrapped, stream, accum: int, numerics: Numerics, cfg: RunConfig, ctx: DistContext) -> float:
    """One optimizer step's micro-batches, forward and backward; their mean loss on this rank."""
    loss_sum = 0.0
    # each weight cast to BF16 once per step, not per micro-batch (not where it costs memory: FSDP, checkpointing)
    with numerics.optimizer_step(keep_casts=not (is_fsdp(wrapped) or cfg.train.activation_checkpointing)):
        for micro in range(accum):
            tokens = next(stream)
            if ctx.device.type == "cuda":  # page-locked: the copy to the GPU runs asynchronously
                tokens = tokens.pin_memory()
            tokens = tokens.to(ctx.device, non_blocking=True)
            with grad_sync(wrapped, micro == accum - 1):  # one gradient reduction per step
                with numerics.forward():
                    loss = lm_loss(wrapped, tokens, double_label_shift=cfg.quirks.double_label_shift)
                with numerics.backward():
                    (loss / accum).backward()
            loss_sum += loss.detach().float()
    return float(loss_sum / accum)


def _optimizer_step(model, optimizer, scheduler, cfg: RunConfig, ctx: DistContext, skips: dict[str, int],
                    step: int) -> tuple[float, bool]:
    """Clip, then update unless the gradient norm is non-finite; returns (norm before clipping, skipped).

    A non-finite gradient would make AdamW's moments NaN for good: the update is skipped (the step still
    consumes its data and LR slot; the scalers have already seen its amax, so under delayed scaling the next
    step's scales adapt, as a loss scaler backs off). The caller stops on a streak of them."""
    grad_norm = float(clip_gradients(model, cfg.train.grad_clip))
    skipped = not math.isfinite(grad_norm)
    if skipped:
        skips["skipped_steps"] += 1
        skips["consecutive_skips"] += 1
        if ctx.is_main:
            print(f"step {step}: gradient norm {grad_norm}, optimizer step skipped "
                  f"({skips['consecutive_skips']} in a row)")
    else:
        skips["consecutive_skips"] = 0
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def _telemetry(model, cfg: RunConfig, step: int, telemetry_dir: Path, rank: int) -> dict[str, Any]:
    """This step's quantization counters for the step log, after the per-layer dump when one is due.

    The banks gather saturation statistics on steps divisible by telemetry_dump_every: those steps are
    dumped before step_telemetry resets the counters, so a dump holds its own step's counts."""
    every = cfg.quant.training.telemetry_dump_every
    if every and step % every == 0:
        telemetry_dir.mkdir(exist_ok=True)
        dump_telemetry(model, telemetry_dir / f"step{step:07d}_rank{rank}.jsonl")
    return step_telemetry(model)


def _verify_shared(path: Path, ctx: DistContext) -> None:
    """verify_checkpoint with the hashing shared by the ranks; the first problem found is every rank's error."""
    try:
        ckpt.verify_checkpoint(path, (ctx.rank, ctx.world_size))
        problem = None
    except ckpt.CheckpointError as err:
        problem = str(err)
    problems = [p for p in ctx.all_gather(problem) if p]
    if problems:
        raise ckpt.CheckpointError(problems[0])


def _on_every_rank(ctx: DistContext, fn):
    """fn() on every rank; a CheckpointError is reported by rank 0 only, the other ranks exit quietly."""
    try:
        return fn()
    except ckpt.CheckpointError:
        if ctx.is_main:
            raise
        raise SystemExit(2) from None
