"""The quantized GEMMs and model conversion: ``gemm`` (the autograd function, A, W and G quantized, straight-through,
and the scaler plumbing of a module with GEMM sites), ``linear`` (``QuantLinear``, ``QuantConv1D``; the swap
of the chosen blocks' GEMM modules, private to this package; ``coverage``), ``experts`` (MoE experts quantized per
expert), ``blocks`` (the role of each GEMM weight of a block, by structure), ``training`` (``Hif8TrainingConfig``,
``convert_to_hif8_training``: the public API any trainer uses) and ``gemm_check``. Layer 5, the top of the library
core: imports ``formats``, ``scaling``, ``compute_dtype``, ``errors``, torch and numpy, never the pipeline.
"""
