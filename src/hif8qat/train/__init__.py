"""The trainer: ``loop`` (BF16 warmup then QAT, AdamW, cosine schedule, accumulation), ``log`` (metrics and
progress), ``checkpoint`` and ``sharded_checkpoint`` (exact resume), ``distributed`` (DDP, FSDP2, SLURM -> torch),
``chunked_loss`` and ``export``. Layer 10: imports every layer below it, never ``evaluate``, ``report`` or
``launch``.
"""
