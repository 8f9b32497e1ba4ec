"""Evaluation: lm-eval in process, in two modes (``bf16``: the saved weights; ``hif8``: W8A8 simulated inference in
the run's 8-bit format with the scales of training frozen), and the held-out token distances against a baseline.

``runner`` (the whole story: modes, device and numerics, cost, tasks, outputs), ``loading`` (an export back
into a model, quantized or not), ``prefix_lm`` (each context forwarded once), ``ranks`` (requests shared over
ranks), ``task_data``, ``offline_benchmarks`` and ``minitasks/`` (the tasks' data), ``outputs``, ``settings``,
``subsets``, ``heldout`` (per-token NLL, KL, top-1 against the baseline), ``cli``.
Layer 11: imports ``train`` (ranks' gathers), ``quant``, ``models``, ``data``, ``runs``, ``config`` and below;
never ``report`` or ``launch``.
"""

# The task table lives in hif8qat.config.eval_tasks (torch-free, imported by the config); the names below are the
# package's public surface, re-exported so that callers import them from hif8qat.evaluate.
from hif8qat.config.eval_tasks import (
    DEVICES,
    DTYPES,
    MINITASK_DIR,
    MODES,
    SUITES,
    TASKS,
    TaskSpec,
    resolve_tasks,
)
from hif8qat.evaluate.cli import main
from hif8qat.evaluate.loading import load_for_eval, quant_eval_meta
from hif8qat.evaluate.outputs import format_results, gold_scores, load_eval_results, write_eval_dir
from hif8qat.evaluate.runner import evaluate_export, evaluate_model, evaluate_run
from hif8qat.evaluate.settings import EvalSettingError, eval_compute, resolve_numerics
from hif8qat.evaluate.subsets import check_subset, subset_indices
from hif8qat.evaluate.task_data import (
    LOCAL_DATA_ENV,
    DatasetUnavailableError,
    _leaf_tasks,  # noqa: F401 - the tests walk lm-eval's task index with it
    lm_eval_task_dirs,
    local_splits,
    prepare_paper_tasks,
    task_index_for,
)

__all__ = [
    "DEVICES", "DTYPES", "LOCAL_DATA_ENV", "MINITASK_DIR", "MODES", "SUITES", "TASKS", "DatasetUnavailableError",
    "EvalSettingError", "TaskSpec", "check_subset", "eval_compute", "evaluate_export", "evaluate_model",
    "evaluate_run", "format_results", "gold_scores", "lm_eval_task_dirs", "load_eval_results", "load_for_eval",
    "local_splits", "main", "prepare_paper_tasks", "quant_eval_meta", "resolve_numerics", "resolve_tasks",
    "subset_indices", "task_index_for", "write_eval_dir",
]
