"""What the trainer writes besides checkpoints: the step log (metrics.jsonl, mirrored to wandb), its repair
on resume, the progress bar, and the run's training summary."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hif8qat.artefacts import METRICS_FIELDS, CorruptArtefact, read_jsonl
from hif8qat.config.run_config import RunConfig
from hif8qat.errors import concerning
from hif8qat.files import append_text, write_text
from hif8qat.runs.folders import METRICS_FILE


def truncate_metrics(path: Path, from_step: int) -> None:
    """On resume, drop the log lines of steps that will be redone (no duplicates in the series) and any line
    that does not parse (the torn last line a crash leaves), saying what was dropped.

    Args:
        path: metrics.jsonl.
        from_step: the first step to be redone.
    """
    if not path.exists():
        return
    kept, redone, broken = [], [], []
    lines = path.read_text(errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = record["step"] if isinstance(record, dict) else None
        except (ValueError, KeyError):
            step = None
        if not isinstance(step, int) and number != last:  # only a killed writer's last line may be cut
            raise CorruptArtefact(path, f"line {number} does not parse as a step record and is not the last "
                                        "line, so it was not cut by a killed writer",
                                  "Repair or delete that line (the steps after it are then redone or kept as "
                                  "read), or start the run over with force=true")
        if not isinstance(step, int):
            broken.append(number)
        elif step < from_step:
            kept.append(line)
        else:
            redone.append(step)
    if redone or broken:
        notes = ([f"{len(redone)} line(s) of steps {min(redone)}..{max(redone)} that will be redone"] if redone else [])
        notes += [f"{len(broken)} unparsable line(s) (line {', '.join(map(str, broken[:5]))}"
                  f"{', ...' if len(broken) > 5 else ''})"] if broken else []
        print(f"{path}: resuming at step {from_step}, dropped " + " and ".join(notes))
    write_text(path, "".join(line + "\n" for line in kept))  # a kill mid-rewrite leaves the old log, not half of it


class MetricsSink:
    """metrics.jsonl on the main rank, mirrored to wandb when configured."""

    def __init__(self, cfg: RunConfig, run_dir: Path, is_main: bool):
        self.enabled = is_main
        self.path = run_dir / METRICS_FILE
        self.wandb = None
        if self.enabled and cfg.logger.wandb:
            import wandb

            with concerning(f"logger.wandb_mode={cfg.logger.wandb_mode} (logger.wandb=true)"):
                self.wandb = wandb.init(project=cfg.logger.wandb_project, mode=cfg.logger.wandb_mode,
                                        dir=str(run_dir), name=run_dir.relative_to(cfg.results_root).as_posix(),
                                        config=cfg.to_dict(), resume="allow", id=_wandb_id(run_dir))

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (a step's metrics) to metrics.jsonl and wandb, on the main rank.

        Args:
            record: the metrics, with their ``step``.
        """
        if not self.enabled:
            return
        append_text(self.path, json.dumps(record) + "\n")  # repeated steps of a resume: truncate_metrics
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_id(run_dir: Path) -> str:
    return "".join(c if c.isalnum() else "-" for c in run_dir.as_posix())[-64:]


def progress_bar(cfg: RunConfig, is_main: bool, start_step: int):

    """The run's tqdm bar over its steps (disabled off the main rank or when ``logger.progress_bar`` is off).

    Args:
        cfg: the run's configuration.
        is_main: this is the main rank.
        start_step: the step the run starts at.

    Returns:
        The bar.
    """
    return tqdm(total=cfg.train.steps, initial=start_step, desc=f"{cfg.experiment.name} train",
                disable=not (is_main and cfg.logger.progress_bar), dynamic_ncols=True)


def train_summary(metrics_path: Path, step_times: dict[bool, list[float]], val_loss: float,
                   converted: list[str], wall_s: float) -> dict[str, Any]:
    """What summary.json says about the training: steps, final losses, median step times of the BF16 and QAT
    phases (their first step left out) and their ratio, the converted layer count.

    Args:
        metrics_path: metrics.jsonl.
        step_times: step times in seconds, by whether the step was quantized.
        val_loss: the held-out loss.
        converted: the names of the quantized layers.
        wall_s: this session's training time.

    Returns:
        The summary fields.
    """
    records = read_jsonl(metrics_path, "Start the run over with force=true", fields=METRICS_FIELDS)
    losses = [r["loss"] for r in records if "loss" in r]
    tail = losses[-max(1, len(losses) // 10):]
    bf16_t, qat_t = step_times[False], step_times[True]
    # The first step of each phase pays one-off costs (allocation, compilation): leave it out of medians.
    med = lambda xs: statistics.median(xs[1:] if len(xs) > 2 else xs) if xs else None  # noqa: E731
    ratio = med(qat_t) / med(bf16_t) if bf16_t and qat_t else None
    return {
        "steps": len(losses), "final_loss": losses[-1] if losses else None,
        "final_loss_last10pct": sum(tail) / len(tail) if tail else None, "val_loss": val_loss,
        "train_wall_s_this_session": wall_s, "median_step_s_bf16": med(bf16_t), "median_step_s_qat": med(qat_t),
        "qat_to_bf16_step_time_ratio": ratio, "converted_linears": len(converted),
    }
