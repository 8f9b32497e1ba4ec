"""Statistics for the claims, pure functions: ``paired`` (run vs baseline per item and seed), ``crossed`` (the
claims' variance model: seeds crossed with items), ``item_flips`` (the exact item-level flip model of accuracy)
and ``heldout`` (per-token held-out distances). Layer 6: imports only the base modules, numpy, scipy and statsmodels.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.stats")  # before any module of it imports the extra
