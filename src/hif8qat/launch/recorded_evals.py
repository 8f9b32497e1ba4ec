"""What the recorded evaluations of a profile tell the time estimate: how much one evaluation mode forwards
(:func:`eval_work`), and how long one took in training steps of its own run (:func:`eval_in_steps`), read from the
runs' results.json and metrics.jsonl."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

# What an evaluation mode of one run forwards at the profile, (positions padding included, forward calls), counted by
# the evaluation itself into results.json (_meta.eval_tokens); used when no finished evaluation of this profile exists
# yet to read it from. A workload size, not a time.
# mini: the committed reference run of exp1 forwarded 51,287 positions in 227 calls.
# gpu1: MMLU 1,140 items x about 540 tokens (5 shots and the question), HellaSwag 1,000 x about 1,160 (10 shots,
# the context once and four endings), ARC-Challenge 1,172 x about 1,300 (25 shots): about 3.3 M, a planning figure
# until the first gpu1 evaluation records its own count (its cost is from FLOPs per token: the calls are not used).
_EVAL_FALLBACK = {"mini": (51_300, 227), "gpu1": (3_300_000, 0)}


@dataclass(frozen=True)
class EvalWork:
    """What one evaluation mode forwards: positions (padding included) in how many forward calls."""

    tokens: int
    calls: int


def eval_work(results_root: Path, profile: str) -> EvalWork:
    """What one run's evaluation mode forwards: from the newest recorded evaluation of the profile, else a fallback.

    Args:
        results_root: the folder that holds the runs.
        profile: the profile.

    Returns:
        The workload; a per-profile fallback when no evaluation is recorded."""
    newest = None
    for path in (results_root / profile).glob("*/seed*/eval/*/results.json"):
        tokens = (json.loads(path.read_text()).get("_meta") or {}).get("eval_tokens") or {}
        count = tokens.get("forwarded_padded") or tokens.get("forwarded")
        if count and (newest is None or path.stat().st_mtime > newest[0]):
            newest = (path.stat().st_mtime, EvalWork(int(count), int(tokens.get("forward_calls") or 0)))
    if newest is not None and newest[1].calls:
        return newest[1]
    tokens, calls = _EVAL_FALLBACK.get(profile, (0, 0))
    return EvalWork(newest[1].tokens if newest else tokens, calls)


def eval_in_steps(roots: list[Path], profile: str) -> tuple[float, str] | None:
    """One bf16 evaluation's wall time in warm plain training steps of the same run, from the newest finished plain
    run of ``profile`` under the first of ``roots`` that has one (results.json ``_meta.wall_time_s`` over the median
    of metrics.jsonl's ``step_time_s`` after the first). Both were timed on the same machine in the same hour, so
    the ratio carries to this machine's speed now (33 to 38 in every mini run of the AMX Xeon), where a forward timed
    alone misses lm-eval's setup and its real mix of long contexts, cached continuations and per-request work.

    Args:
        roots: results folders, the preferred first (this machine's runs, then the committed reference runs).
        profile: the profile.

    Returns:
        ``(steps, the run it was read from)``, or None when no such run is recorded."""
    for root in roots:
        found = []
        for path in (root / profile).glob("*/seed*/eval/bf16/results.json"):
            try:
                wall = (json.loads(path.read_text()).get("_meta") or {}).get("wall_time_s")
                rows = [json.loads(line) for line in (path.parents[2] / "metrics.jsonl").read_text().splitlines()
                        if line.strip()]
            except (OSError, ValueError):
                continue
            times = [r["step_time_s"] for r in rows[1:] if "step_time_s" in r]
            if not wall or not times or any(r.get("quant") for r in rows):  # a plain run's steps only
                continue
            found.append((path.stat().st_mtime, wall / statistics.median(times), str(path.parents[2])))
        if found:
            _, steps, run = max(found)
            return steps, run
    return None
