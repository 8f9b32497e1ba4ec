"""Evaluation: lm-eval in process, in two modes (``bf16``: the saved weights; ``hif8``: W8A8 simulated inference in
the run's 8-bit format with the scales of training frozen), and the held-out token distances against a baseline.

``runner`` (a model, an export or a run evaluated into its eval folder), ``loading`` (an export back
into a model, quantized or not), ``prefix_lm`` (each context forwarded once), ``ranks`` (requests shared over
ranks), ``task_data``, ``offline_benchmarks`` and ``minitasks/`` (the tasks' data), ``outputs``,
``subsets``, ``heldout`` (per-token NLL, KL, top-1 against the baseline), ``heldout_set`` (its windows), ``cli``.
The package itself holds no
names: each is imported from its module, so reading the outputs never imports lm-eval and the whole evaluator
(the evaluation's device and numerics are resolved with the run's config, in ``hif8qat.config.numerics``).
Layer 12: imports ``train`` (ranks' gathers), ``quant``, ``models``, ``data``, ``runs``, ``config`` and below;
never ``report`` or ``launch``.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.evaluate")  # before any module of it imports the extra
