"""``python run.py``, the pipeline's entry point: ``hydra_config`` (conf/ composed by Hydra into the typed, validated
RunConfig), ``command_line`` (the command line checked before Hydra reads it), ``stages`` (train, eval, report, all on
one process or under torchrun), ``main`` (the Hydra job and run.py's own ``--baseline``) and ``estimate``
(run.py's ``--estimate``, before the job's modules load; ``startup_timer`` times a run's start-up beside it).
run.py itself only declares the Hydra entry point; everything it does is here, under the layout rules.
The top layer: it may import every other part of the package, and nothing imports it.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.cli")  # before any module of it imports the extra
