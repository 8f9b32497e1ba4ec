"""Run-level records: ``folders`` (where a run lives, what it records about itself, how reruns treat it),
``provenance`` (the commit, versions and host every result file records) and ``downloads`` (the network sources
the project touches). Layer 8: imports ``config``, ``compute_dtype`` and the base modules.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.runs")  # before any module of it imports the extra
