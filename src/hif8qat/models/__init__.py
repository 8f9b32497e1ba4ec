"""Model loading: ``loading`` (any Hugging Face causal LM, the offline SmolLM2, a tiny test Llama), ``hub`` (a
model name read as a folder or a hub id, and the hub cache), ``pangu`` (openPangu-Embedded loaded as
transformers' Llama), and ``quant_files`` (the quantized layers' export and
telemetry files). Layer 9: imports ``runs.downloads``, the library core and the base modules.
"""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.models")  # before any module of it imports the extra
