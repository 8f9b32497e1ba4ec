"""The trainer: ``loop`` (BF16 warmup then QAT, AdamW, accumulation), ``schedule`` (warmup then cosine), ``log``
(metrics and progress), ``checkpoint`` and ``sharded_checkpoint`` (exact resume), ``distributed`` (DDP, FSDP2,
SLURM -> torch), ``preemption`` (checkpoint on SLURM's signal), ``chunked_loss`` and ``export``. Layer 11: imports
every layer below it, never ``evaluate``, ``report`` or ``launch``.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.train")  # before any module of it imports the extra
