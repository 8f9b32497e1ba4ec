"""The evaluation task table: tasks, suites and the allowed modes, devices and dtypes.

Torch-free and free of lm-eval and of the rest of the project, so that :mod:`hif8qat.config.run_config` can validate
``eval.*`` settings against it without importing the evaluation (which would import :mod:`hif8qat.runs.folders`,
which imports the config).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

MINITASK_DIR = Path(__file__).resolve().parents[1] / "evaluate" / "minitasks"
MODES = ("bf16", "hif8")
DEVICES = ("auto", "cpu", "cuda")
# eval.dtype: train.autocast's values (auto = the training's); fp32 is the old name of none, still read.
FP32_OLD_NAME = "fp32"
DTYPES = ("auto", "bf16", "bf16_emulated", "none", FP32_OLD_NAME)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    num_fewshot: int
    metric: str  # the sample-level metric the paper reports (acc / acc_norm / exact_match)
    filter: str = "none"
    mini: bool = False
    lm_eval_dir: str | None = None  # folder under lm_eval/tasks holding the task's YAMLs (indexed alone: fast)


TASKS: dict[str, TaskSpec] = {
    "mini_mmlu": TaskSpec("mini_mmlu", 1, "acc", mini=True),
    "mini_hellaswag": TaskSpec("mini_hellaswag", 1, "acc_norm", mini=True),
    "mini_arc": TaskSpec("mini_arc", 1, "acc_norm", mini=True),
    "mini_mmlu_letters": TaskSpec("mini_mmlu_letters", 5, "acc", mini=True),
    "mmlu": TaskSpec("mmlu", 5, "acc", lm_eval_dir="mmlu"),
    # MMLU's cloze formulation (question -> answer text): small models are at chance on lettered options
    "mmlu_continuation": TaskSpec("mmlu_continuation", 5, "acc", lm_eval_dir="mmlu"),
    "hellaswag": TaskSpec("hellaswag", 10, "acc_norm", lm_eval_dir="hellaswag"),
    "arc_challenge": TaskSpec("arc_challenge", 25, "acc_norm", lm_eval_dir="arc"),
    "arc_easy": TaskSpec("arc_easy", 25, "acc_norm", lm_eval_dir="arc"),
    "gsm8k": TaskSpec("gsm8k", 5, "exact_match", filter="flexible-extract", lm_eval_dir="gsm8k"),
}
SUITES: dict[str, tuple[str, ...]] = {
    "mini": ("mini_mmlu", "mini_hellaswag", "mini_arc"),
    "paper": ("mmlu", "hellaswag", "arc_challenge"),
    "paper_full": ("mmlu", "hellaswag", "arc_challenge", "arc_easy", "gsm8k"),
}


def resolve_tasks(tasks: str | Iterable[str]) -> list[TaskSpec]:
    """The tasks an ``eval.tasks`` setting names.

    Args:
        tasks: ``"mini"``/``"paper"``/``"paper_full"``, a comma-separated string, or a list of task names.

    Returns:
        The tasks' specs.

    Raises:
        ValueError: an unknown task, or none.
    """
    if isinstance(tasks, str):
        names = list(SUITES[tasks]) if tasks in SUITES else [t.strip() for t in tasks.split(",") if t.strip()]
    else:
        names = []
        for t in tasks:
            names.extend(SUITES.get(t, (t,)))
    out = []
    for n in names:
        if n not in TASKS:
            raise ValueError(f"eval.tasks: unknown task {n!r}; allowed: {sorted(TASKS)} or suites {sorted(SUITES)}")
        out.append(TASKS[n])
    if not out:
        raise ValueError("eval.tasks: no task given")
    return out


def _read_task_yaml(path: Path) -> dict:
    """A mini task's YAML, lm-eval's ``!function`` tags read as plain strings."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506 - SafeLoader plus one tag


def fewshot_pool(name: str) -> int | None:
    """How many few-shot examples a mini task can draw: the documents of its few-shot split (lm-eval's samplers
    refuse more, after training). None for a paper task, whose pool is known only once its dataset loads.

    Args:
        name: the task's name.

    Returns:
        The number, or None.
    """
    spec = TASKS.get(name)
    if spec is None or not spec.mini:
        return None
    cfg = _read_task_yaml(MINITASK_DIR / f"{name}.yaml")
    split = cfg.get("fewshot_split")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
    if split not in files:
        return None
    lines = (MINITASK_DIR / files[split]).read_text(encoding="utf-8").splitlines()
    pool = sum(1 for line in lines if line.strip())
    return pool - 1 if split == cfg.get("test_split") else pool  # the evaluated document is left out
