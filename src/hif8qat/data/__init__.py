"""Training data: ``corpus`` (where text comes from), ``tokens`` (tokenize, pack), ``streams`` (windows that shard
across ranks and resume exactly), ``prefetch`` (the next batches while a step runs), ``loader`` (the one entry
point, ``build_train_stream``). Layer 10: imports ``models`` (tokenizers), ``runs.downloads`` and the base modules.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.data")  # before any module of it imports the extra
