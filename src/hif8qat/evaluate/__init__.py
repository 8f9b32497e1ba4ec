"""Evaluation with lm-eval, in process, in two modes.

Modes
-----
``bf16``  the saved weights without quantization, as the authors evaluated (their vLLM run used BF16).
``hif8``  W8A8 simulated inference in the run's 8-bit format: the plain model is re-converted from
          ``hif8qat_quant.json`` by :func:`hif8qat.quant.linear.load_quant_export`, which restores the scalers'
          final state, and the scales are frozen (:func:`hif8qat.quant.linear.freeze_scales`): every quantized
          linear uses the last scales of training, with no history update during evaluation. The mode keeps
          its name for every format: an FP8 run (``quant.format`` e4m3 / e5m2 / hybrid) is evaluated in FP8
          (exports written before FP8 are HiF8). A run whose final algorithm is ``current`` keeps
          just-in-time scaling: each tensor is scaled from its own amax, as in training. ``results.json``
          records what ran under ``_meta.quant`` (format, element format per role, algo, scales).

Device and numerics
-------------------
Weights are always loaded in FP32, the trainer's master weights. ``dtype="bf16"`` runs the forward under
bf16 autocast, exactly as a ``train.autocast=bf16`` training step: in ``hif8`` mode the FP32 weight is
quantized and the matmul runs in bf16 (casting the weights to bf16 first would round them twice before
quantization). ``dtype="fp32"``: no autocast. :func:`resolve_numerics` turns ``auto`` into the training
device and numerics (run.py's ``eval.device`` / ``eval.dtype``); without a training config, ``auto`` is
CUDA when available and bf16 there, fp32 on CPU. ``results.json`` records ``device``, ``dtype`` (of the
weights) and ``autocast`` (the matmul dtype, or null). The numerics are applied in one place, around each
model forward of :class:`hif8qat.evaluate.prefix_lm.SharedContextLM` (:func:`hif8qat.compute_dtype.forward_context`).

Cost
----
lm-eval's HF model runs each request (context + continuation) as its own forward pass, so a
multiple-choice item pays for its context once per choice. The evaluation runs
:class:`hif8qat.evaluate.prefix_lm.SharedContextLM` instead: each distinct context is forwarded once and its
continuations are scored from the cached prefix (the same log-likelihoods up to float rounding, tested
against lm-eval's model). ``results.json`` ``_meta.eval_tokens`` records the tokens lm-eval's model
would forward (``per_request``) and those forwarded (``forwarded``; ``forwarded_padded`` with padding),
and both are printed per evaluation.

Tasks
-----
Mini tasks (offline, generated from the fact tables in ``minitasks/``; registered with lm-eval's
``TaskManager(include_path=minitasks/)``): ``mini_mmlu`` (MMLU questions, cloze formulation, 1-shot, acc),
``mini_hellaswag`` (1-shot, acc_norm), ``mini_arc`` (1-shot, acc_norm); ``mini_mmlu_letters`` (MMLU's
lettered A-D format, 5-shot, acc) is registered but not in the ``mini`` suite: SmolLM2-135M scores at
chance on lettered options. Shot counts are small because every item's shots + question are forwarded
once on CPU (see ``minitasks/README.md`` for the token counts). Paper tasks (lm-eval's own configs): ``mmlu`` 5-shot acc,
``hellaswag`` 10-shot acc_norm, ``arc_challenge`` 25-shot acc_norm, optional ``arc_easy`` 25-shot acc_norm
and ``gsm8k`` 5-shot exact_match (flexible-extract); ``mmlu_continuation`` (MMLU's cloze form, acc) for small
models. The mini profile runs the real ones 0-shot on the offline copies of :mod:`hif8qat.evaluate.offline_benchmarks`
(``offline_data``) and on fixed seeded subsets (``subset``; :func:`subset_indices`), selected through
lm-eval's own ``samples`` argument so that per-sample doc ids are the documents' indices in the full split.

Datasets for the paper tasks without internet
---------------------------------------------
Put a copy of each hub dataset repository on disk (on a machine with access:
``huggingface-cli download cais/mmlu --repo-type dataset --local-dir /data/lm_eval/cais/mmlu``, likewise
``Rowan/hellaswag``, ``allenai/ai2_arc``, ``openai/gsm8k``) and either

* set ``HIF8QAT_LM_EVAL_DATA=/data/lm_eval`` (a folder laid out as ``<root>/<hub id>``), or
* pass ``local_datasets={"cais/mmlu": "/data/mmlu", ...}`` (keys: hub id or task name; CLI:
  ``--local-dataset cais/mmlu=/data/mmlu``; Hydra: ``eval.local_datasets``).

For every leaf task that reads one of those datasets, a task YAML is generated in a temporary folder
that ``include``s lm-eval's original YAML and sets ``dataset_path`` to the local folder, under the same
task name; it is registered after lm-eval's own tasks, so it replaces them (groups such as ``mmlu``
pick up the overridden subtasks). A populated ``HF_DATASETS_CACHE`` with ``HF_DATASETS_OFFLINE=1`` works
too. When a dataset is neither local, cached nor reachable on the hub, :class:`DatasetUnavailableError`
is raised before any model work, naming the dataset and these two options (no retry loop: the check
probes the hub with one 3-second connection and then loads strictly offline).

Outputs (run-folder layout of docs/design.md), for each mode in ``<run>/eval/<mode>/``:
``results.json`` ``{task: {metric, value, stderr, n, num_fewshot}, "_meta": {...}}`` (keys starting with
``_`` are not tasks; :func:`load_eval_results` drops them), ``samples_<task>.csv``
(``doc_id,correct,gold_ll,gold_margin``: the gold choice's log-likelihood and its lead over the best wrong
choice, raw and unnormalized, empty where the task has no single gold index),
``lm_eval_results.json`` (lm-eval's own output without the samples) and ``samples_<task>.jsonl.gz``
(per sample: doc id, target, per-choice log-likelihoods and metrics; no prompts).
"""

# The task table lives in hif8qat.config.eval_tasks (torch-free, imported by the config); the names below are the
# package's public surface, re-exported so that callers import them from hif8qat.evaluate.
from hif8qat.config.eval_tasks import DEVICES, DTYPES, MINITASK_DIR, MODES, SUITES, TASKS, TaskSpec, resolve_tasks
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
