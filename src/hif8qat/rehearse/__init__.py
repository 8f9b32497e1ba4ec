"""Rehearsals of paths this machine does not have: ``paper_path`` (the paper profile on CPU: 2 ranks, FSDP2,
remote-code model, FineWeb-format shards, kill and resume) with the measurements it holds the runs against
(``probes``), ``slurm`` on a local cluster (``slurm_cluster``), and the toy inputs they use (``standins``).
Layer 15, the top: may import every layer.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.rehearse")  # before any module of it imports the extra
