"""Writes the bytecode (``.pyc``) of the modules this project's processes import, for an environment installed
without it (``tools/build_env.sh`` installs with uv, which compiles nothing unless asked).

Where ``PYTHONDONTWRITEBYTECODE`` is set (CI machines, containers), a module without a ``.pyc`` is compiled again
by every process that imports it: ``import hif8qat.cli.main`` then takes 18 s instead of 7. Compiling every
installed file up front (``--compile-bytecode``, pip's default) costs about a minute on 2 cores for ~20,000 files,
most of which no process here ever imports. This script imports every module of the package plus the libraries it
loads lazily at run time, with bytecode writing on: ~3,700 files, the ones the runs and tests load.

    .venv/bin/python tools/warm_bytecode.py     # prints how many modules it loaded and how long it took

A module that fails to import (an optional dependency absent) is skipped: its users compile it as before.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time

# imported inside functions at run time (model building, the memory simulation, the quantizer's compile and its
# C++ build, evaluation, reports, tests); found by running `make exp3 PROFILE=smoke` and listing the .pyc it wrote
LAZY = ("transformers.models.llama.modeling_llama", "transformers.models.auto.modeling_auto",
        "transformers.models.auto.tokenization_auto", "torch._dynamo", "torch._inductor.compile_fx",
        "torch._inductor.compiler_bisector", "torch._inductor.codegen.wrapper_fxir", "torch.utils.cpp_extension",
        "torch.export", "torch.fx.experimental.validator", "torch.distributed._tools.mem_tracker",
        "torch.distributed.tensor.experimental", "torch.distributed.fsdp", "torch.distributed.checkpoint",
        "torch.profiler", "torch.utils.checkpoint", "sympy.combinatorics", "sympy.tensor.tensor", "setuptools",
        "lm_eval.evaluator", "lm_eval.models.huggingface", "lm_eval.tasks", "lm_eval.api.task", "datasets",
        "safetensors.torch", "scipy.stats", "scipy.io", "threadpoolctl", "more_itertools", "pandas",
        "pandas.io.formats.csvs", "matplotlib.pyplot", "hydra", "pytest", "xdist", "en_dtypes")


def _registries() -> None:
    """What registries import on first use: Hydra's plugins (each run's launch), dynamo's backends and inductor's
    code generators (the quantizer's first compile)."""
    from hydra.core.plugins import Plugins

    Plugins.instance()
    import torch._dynamo
    from torch._inductor.codegen.common import init_backend_registration

    torch._dynamo.list_backends()
    init_backend_registration()


def main() -> int:
    sys.dont_write_bytecode = False  # whatever PYTHONDONTWRITEBYTECODE says: writing them is the point
    started, loaded, skipped = time.perf_counter(), 0, []
    import hif8qat

    names = [m.name for m in pkgutil.walk_packages(hif8qat.__path__, "hif8qat.")
             if not m.name.endswith("__main__")]
    for name in (*names, *LAZY):
        try:
            importlib.import_module(name)
            loaded += 1
        except Exception as err:  # noqa: BLE001 - an optional module: its users compile it as before
            skipped.append(f"{name} ({type(err).__name__})")
    try:
        _registries()
    except Exception as err:  # noqa: BLE001 - as above
        skipped.append(f"registries ({type(err).__name__})")
    print(f"bytecode written for the imports of {loaded} modules ({len(sys.modules)} loaded) in "
          f"{time.perf_counter() - started:.0f} s" + (f"; skipped {', '.join(skipped)}" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
