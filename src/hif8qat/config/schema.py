"""The schema's rules that are not one setting's: the one path rule for every user string that becomes part of
a run's path, and each declared type's check (config.RunConfig applies them to every setting by name)."""

from __future__ import annotations

import math
import re
from typing import Any

# One rule for every user string that becomes one component of a run's path (experiment.name, profile.name):
# a letter or digit first (no "..", no hidden or empty name), then letters, digits and _ . + = -. No "/" can
# enter, so a run folder is always <results_root>/<profile>/<experiment>/seed<k>[-<tag>].
PATH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]{0,99}")
PATH_NAME_RULE = "a name of 1-100 letters, digits and _ . + = - starting with a letter or digit (no /, no ..)"
# Seeds feed numpy's generator (below 2**32) and enter the folder name.
MAX_SEED = 2**32 - 1


def is_path_name(value: Any) -> bool:
    """Whether ``value`` may name a folder of a run's path (a letter or digit first, then letters, digits and
    ``_ . + = -``; at most 100 characters).

    Args:
        value: the setting's value.

    Returns:
        True when it may.
    """
    return isinstance(value, str) and PATH_NAME.fullmatch(value) is not None


# Each setting's type, declared once by its dataclass annotation and checked for every setting (whether or
# not the experiment uses it) before any value is compared or any folder exists.
_TYPE_RULES: dict[str, tuple[Any, str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list[float]": (lambda v: isinstance(v, (list, tuple)) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v),
        "a list of finite numbers, e.g. [0.9,0.95]"),
    "list[str]": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
                  "a list of names, e.g. [a,b]"),
    "dict[str, int]": (lambda v: isinstance(v, dict), "a mapping, e.g. {name: 1}"),
    "dict[str, str]": (lambda v: isinstance(v, dict), "a mapping, e.g. {name: value}"),
}


def type_problem(annotation: str, value: Any) -> str | None:
    """What a setting annotated ``annotation`` allows, when ``value`` is not of that type (else None).

    Args:
        annotation: the setting's annotation, as text.
        value: its value.

    Returns:
        The problem, or None.
    """
    optional = annotation.endswith(" | None")
    base = annotation[: -len(" | None")] if optional else annotation
    rule = _TYPE_RULES.get(base)
    if rule is None or (optional and value is None):
        return None  # bool is checked by _validate_booleans; Any-typed settings by their own rules
    ok, allowed = rule
    return None if ok(value) else allowed + (" or null" if optional else "")


# train.optimizer_impl: which of torch's AdamW implementations a run's optimizer is. auto is resolved when the run's
# config is made (hif8qat.config.numerics): fused where torch has a fused AdamW for the training device, else
# torch_default; a resumed or finished run keeps the one it started with. torch_default is torch's own choice
# (foreach on a GPU, one parameter at a time on a CPU), what every run saved before the setting existed used.
OPTIMIZER_IMPLS = ("auto", "fused", "torch_default")


# Upper bounds, so that a typed-in extra digit (profile.steps=100000000000) is refused instead of training forever
# or allocating without end. Each is far beyond any real run of this project: the paper trains 10,000 steps of
# 1,024 sequences of 1,024 tokens.
MAX_STEPS = 10**8  # optimizer steps (or a step count: warmups, intervals, schedule switch points)
MAX_SEQUENCES = 2**20  # sequences in one batch
MAX_TOKENS = 2**20  # tokens in one sequence
# setting -> (the largest value allowed, what it counts); "{...}" marks a mapping's keys or values.
UPPER_BOUNDS: dict[str, tuple[int, str]] = {
    "train.steps": (MAX_STEPS, "steps"),
    "profile.steps": (MAX_STEPS, "steps"),
    "train.lr_warmup_steps": (MAX_STEPS, "steps"),
    "quant.bf16_warmup_steps": (MAX_STEPS, "steps"),
    "train.checkpoint_every": (MAX_STEPS, "steps"),
    "train.log_every": (MAX_STEPS, "steps"),
    "train.val_every": (MAX_STEPS, "steps"),
    "train.max_consecutive_skips": (MAX_STEPS, "steps"),
    "quant.telemetry_dump_every": (MAX_STEPS, "steps"),
    "quant.telemetry_stats_every": (MAX_STEPS, "steps"),
    "quant.interval": (MAX_STEPS, "steps"),
    "quant.interval{keys}": (MAX_STEPS, "steps"),
    "quant.algo{keys}": (MAX_STEPS, "steps"),
    "quant.history_len": (MAX_SEQUENCES, "amax values kept per tensor"),
    "quant.margin": (64, "halvings of the format's largest value"),
    "train.global_batch_size": (MAX_SEQUENCES, "sequences"),
    "train.micro_batch_size": (MAX_SEQUENCES, "sequences"),
    "eval.batch_size": (MAX_SEQUENCES, "sequences"),
    "train.seq_len": (MAX_TOKENS, "tokens"),
    "data.eval_windows": (MAX_SEQUENCES, "windows"),
    "train.keep_checkpoints": (10_000, "checkpoints"),
    "train.keep_checkpoints_when_done": (10_000, "checkpoints"),
    "train.num_threads": (4096, "threads"),
    "eval.num_fewshot{values}": (10_000, "examples"),
    "eval.limit": (10**9, "documents"),
    "eval.subset{values}": (10**9, "documents"),
    "eval.subset_seed": (MAX_SEED, "a seed"),
}


def upper_bound_problems(settings: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(setting, value, allowed) for each integer above its bound in UPPER_BOUNDS; ``settings`` maps each
    dotted setting to its value (others, and values that are not integers, are checked elsewhere).

    Args:
        settings: dotted setting -> value.

    Returns:
        ``(setting, value, allowed)`` per violation.
    """
    out = []
    for key, (bound, unit) in UPPER_BOUNDS.items():
        setting, _, part = key.partition("{")
        value = settings.get(setting)
        items = value.items() if part and isinstance(value, dict) else ()
        if part == "keys}":  # a schedule's switch steps
            pairs = [(f"{setting} key", k, "keys") for k, _ in items]
        elif part:
            pairs = [(f"{setting}.{k}", v, "integers") for k, v in items]
        else:
            pairs = [(setting, value, "an integer")]
        for name, v, what in pairs:
            if isinstance(v, int) and not isinstance(v, bool) and v > bound:
                out.append((name, v, f"{what} of at most {bound} ({unit})"))
    return out
