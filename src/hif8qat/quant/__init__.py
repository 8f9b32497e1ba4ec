"""The quantized linear and model conversion: ``linear`` (``QuantLinear``: activation, weight and output gradient
quantized, straight-through; ``convert_model`` swaps the chosen blocks' linears). Layer 9: imports ``formats``,
``scaling``, ``config``, ``compute_dtype``, ``models`` and the base modules.
"""
