"""Starting runs: ``preflight`` (everything checked before compute), ``time_estimate`` (how long a batch of runs
takes here, from a measured step), ``slurm`` (the Hydra SLURM launcher's resources read from the partition).
Layer 14: may import every layer below it.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.launch")  # before any module of it imports the extra
