"""Run settings: the typed, validated run configuration and the tables it checks names against.

``run_config`` (``RunConfig``: every setting, its type, range and allowed values), ``schema`` (the path rule and
type checks), ``blocks`` (which blocks stay in high precision), ``eval_tasks`` (tasks, suites, modes),
``data_source`` (``data.source``: named sources and local files). Layer 7: imports the library core's settings
(``scaling.settings``, ``compute_dtype``) and the base modules, never a model, the data or the evaluation: a bad setting
fails before anything heavy loads.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.config")  # before any module of it imports the extra
