"""What the recorded evaluations of a profile tell the time estimate: how much one evaluation mode forwards
(:func:`eval_work`), and how long one took in training steps of its own run (:func:`eval_in_steps`), read from the
runs' results.json and metrics.jsonl."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from hif8qat.evaluate.outputs import recorded_scoring

# What an evaluation mode of one run forwards at the profile, (positions padding included, forward calls), per way of
# scoring shared contexts, counted by the evaluation itself into results.json (_meta.eval_tokens); used when no finished
# evaluation of this profile and way exists yet to read it from. A workload size, not a time.
# mini: exp1 forwarded 50,970 positions in 21 calls packed, 51,287 in 227 cached (the committed reference run).
# gpu1: MMLU 1,140 items x about 540 tokens (5 shots and the question), HellaSwag 1,000 x about 1,160 (10 shots,
# the context once and four endings), ARC-Challenge 1,172 x about 1,300 (25 shots): about 3.3 M, a planning figure
# until the first gpu1 evaluation records its own count (its cost is from FLOPs per token: the calls are not used).
_EVAL_FALLBACK = {("mini", "packed"): (51_000, 21), ("mini", "cached"): (51_300, 227),
                  ("gpu1", "packed"): (3_300_000, 0), ("gpu1", "cached"): (3_300_000, 0)}

# A bf16 evaluation of the mini profile in warm plain steps of its run, packed, where no recorded run of this
# machine scored that way (the committed reference runs predate packing): exp1 of two fresh clones' `make exp3` on
# the AMX Xeon, 2026-12-06, evaluation wall time over the median warm step: 29.4 s / 1.23 s = 23.9 on a fast hour,
# 45.4 s / 1.68 s = 27.0 on a slow one; their mean.
_EVAL_STEPS_FALLBACK = {("mini", "packed"): 25.5}


@dataclass(frozen=True)
class EvalWork:
    """What one evaluation mode forwards: positions (padding included) in how many forward calls."""

    tokens: int
    calls: int


def eval_work(results_root: Path, profile: str, scoring: str) -> EvalWork:
    """What one run's evaluation mode forwards: from the newest recorded evaluation of the profile scored the same
    way, else a fallback.

    Args:
        results_root: the folder that holds the runs.
        profile: the profile.
        scoring: how the evaluation will score shared contexts (:func:`hif8qat.evaluate.packed_rows.scoring_of`).

    Returns:
        The workload; a per-profile fallback when no such evaluation is recorded."""
    newest = None
    for path in (results_root / profile).glob("*/seed*/eval/*/results.json"):
        meta = json.loads(path.read_text()).get("_meta") or {}
        tokens = meta.get("eval_tokens") or {}
        count = tokens.get("forwarded_padded") or tokens.get("forwarded")
        if count and recorded_scoring(meta) == scoring and (newest is None or path.stat().st_mtime > newest[0]):
            newest = (path.stat().st_mtime, EvalWork(int(count), int(tokens.get("forward_calls") or 0)))
    if newest is not None and newest[1].calls:
        return newest[1]
    tokens, calls = _EVAL_FALLBACK.get((profile, scoring), (0, 0))
    return EvalWork(newest[1].tokens if newest else tokens, calls)


def eval_in_steps(roots: list[Path], profile: str, scoring: str) -> tuple[float, str] | None:
    """One bf16 evaluation's wall time in warm plain training steps of the same run, from the newest finished plain
    run of ``profile`` scored ``scoring`` under the first of ``roots`` that has one (results.json
    ``_meta.wall_time_s`` over the median of metrics.jsonl's ``step_time_s`` after the first), else the profile's
    figure for that way. Both were timed on the same machine in the same hour, so the ratio carries to this
    machine's speed now (33 to 38 in every mini run of the AMX Xeon scored cached), where a forward timed alone
    misses lm-eval's setup and its real mix of rows and per-request work.

    Args:
        roots: results folders, the preferred first (this machine's runs, then the committed reference runs).
        profile: the profile.
        scoring: how the evaluation will score shared contexts (an evaluation scored another way took another time).

    Returns:
        ``(steps, the run or figure it was read from)``, or None when there is neither."""
    for root in roots:
        found = []
        for path in (root / profile).glob("*/seed*/eval/bf16/results.json"):
            try:
                meta = json.loads(path.read_text()).get("_meta") or {}
                rows = [json.loads(line) for line in (path.parents[2] / "metrics.jsonl").read_text().splitlines()
                        if line.strip()]
            except (OSError, ValueError):
                continue
            wall = meta.get("wall_time_s")
            times = [r["step_time_s"] for r in rows[1:] if "step_time_s" in r]
            if not wall or not times or any(r.get("quant") for r in rows):  # a plain run's steps only
                continue
            if recorded_scoring(meta) == scoring:
                found.append((path.stat().st_mtime, wall / statistics.median(times), str(path.parents[2])))
        if found:
            _, steps, run = max(found)
            return steps, run
    steps = _EVAL_STEPS_FALLBACK.get((profile, scoring))
    return (steps, f"the {profile} profile's {scoring} evaluations") if steps else None
