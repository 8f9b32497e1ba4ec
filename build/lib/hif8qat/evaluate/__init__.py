"""Evaluation: lm-eval in process, in two modes (``bf16``: the saved weights; ``hif8``: W8A8 simulated inference in
the run's 8-bit format with the scales of training frozen), and the held-out token distances against a baseline.

``runner`` (the whole story: modes, device and numerics, cost, tasks, outputs), ``loading`` (an export back
into a model, quantized or not), ``prefix_lm`` (each context forwarded once), ``ranks`` (requests shared over
ranks), ``task_data``, ``offline_benchmarks`` and ``minitasks/`` (the tasks' data), ``outputs``, ``settings``,
``subsets``, ``heldout`` (per-token NLL, KL, top-1 against the baseline), ``cli``.
Layer 12: imports ``train`` (ranks' gathers), ``quant``, ``models``, ``data``, ``runs``, ``config`` and below;
never ``report`` or ``launch``.
"""

import importlib

# The package's public surface, resolved on first use (PEP 562): importing one submodule, or this package for
# one name, does not import lm-eval and the whole evaluator (seconds at every start of run.py, of preflight and
# of the trainer, which need only the task table and data).
_SOURCE = {
    "hif8qat.config.eval_tasks": ("DEVICES", "DTYPES", "MINITASK_DIR", "MODES", "SUITES", "TASKS", "TaskSpec",
                                  "resolve_tasks"),
    "hif8qat.evaluate.cli": ("main",),
    "hif8qat.evaluate.loading": ("load_for_eval", "quant_eval_meta"),
    "hif8qat.evaluate.outputs": ("format_results", "gold_scores", "load_eval_results", "write_eval_dir"),
    "hif8qat.evaluate.runner": ("evaluate_export", "evaluate_model", "evaluate_run"),
    "hif8qat.evaluate.settings": ("EvalSettingError", "eval_compute", "resolve_numerics"),
    "hif8qat.evaluate.subsets": ("check_subset", "subset_indices"),
    "hif8qat.evaluate.task_data": ("LOCAL_DATA_ENV", "DatasetUnavailableError", "_leaf_tasks", "lm_eval_task_dirs",
                                   "local_splits", "prepare_paper_tasks", "task_index_for"),
}
_MODULE_OF = {name: module for module, names in _SOURCE.items() for name in names}
__all__ = sorted(name for name in _MODULE_OF if not name.startswith("_"))


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
