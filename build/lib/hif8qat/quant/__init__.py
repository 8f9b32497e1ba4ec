"""The quantized linear and model conversion: ``linear`` (``QuantLinear``: activation, weight and output gradient
quantized, straight-through; ``convert_model`` swaps the chosen blocks' linears). ``blocks`` (which linears a conversion
takes), ``training`` (``Hif8TrainingConfig``, ``convert_to_hif8_training``: the public API any trainer uses) and
``gemm_check``. Layer 5, the top of the library core: imports ``formats``, ``scaling``, ``compute_dtype``, ``errors``,
torch and numpy, never the pipeline.
"""
