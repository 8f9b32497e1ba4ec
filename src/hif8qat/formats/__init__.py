"""Number formats: HiF8 and FP8 (E4M3, E5M2) quantize-dequantize, bit-exact with the formats.

``hif8_codec`` (the HiF8 format itself: encode, decode, round), ``kernels`` (one kernel body per format,
compiled per variant or run eagerly) and ``qdq`` (the public API: ``hif8_qdq*``, ``fp8_qdq*``, ``FORMATS``).
Layer 2: imports only the base modules (``errors``, ``files``) and torch; knows nothing of scaling or models.
"""
