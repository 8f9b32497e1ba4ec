"""The evaluation task table is torch-free and the config imports only it: no import circle
config -> evaluate -> runs -> config."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_task_table_imports_neither_torch_nor_lm_eval_nor_the_evaluation():
    loaded = _modules_after("import hif8qat.config.eval_tasks")
    # torch comes with the package itself (hif8qat exports the public quantization API); lm-eval, the evaluation
    # and the run configuration must not
    assert not {"lm_eval", "hif8qat.evaluate", "hif8qat.runs.folders", "hif8qat.config.run_config"} & loaded


def test_config_imports_the_task_table_but_not_the_evaluation_or_the_runs():
    loaded = _modules_after("import hif8qat.config.run_config")
    assert "hif8qat.config.eval_tasks" in loaded
    assert not {"hif8qat.evaluate", "hif8qat.runs.folders", "lm_eval"} & loaded


def test_the_evaluation_package_loads_no_evaluator_for_one_of_its_light_modules():
    # the package holds no names of its own: reading a run's evaluation outputs or held-out summary must not cost
    # lm-eval's import (seconds at every start of run.py)
    loaded = _modules_after("import hif8qat.evaluate.outputs, hif8qat.stats.heldout")
    assert not {"lm_eval", "hif8qat.evaluate.runner", "hif8qat.evaluate.prefix_lm"} & loaded
