"""Model loading: ``loading`` (any Hugging Face causal LM, the offline SmolLM2, a tiny test Llama) and ``pangu``
(openPangu-Embedded loaded as transformers' Llama), and ``quant_files`` (the quantized layers' export and
telemetry files). Layer 9: imports ``runs.downloads``, the library core and the base modules.
"""
