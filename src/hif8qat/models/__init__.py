"""Model loading: ``loading`` (any Hugging Face causal LM, the offline SmolLM2, a tiny test Llama) and ``pangu``
(openPangu-Embedded loaded as transformers' Llama). Layer 7: imports ``runs.downloads`` and the base modules.
"""
