"""Number formats: HiF8 and FP8 (E4M3, E5M2) quantize-dequantize, bit-exact with the formats.

``hif8_codec`` (the HiF8 format itself: encode, decode, round), ``kernels`` (one kernel body per format,
compiled per variant or run eagerly) and ``qdq`` (the public API: ``hif8_qdq*``, ``fp8_qdq*``, ``FORMATS``,
re-exported here: ``from hif8qat.formats import hif8_qdq``). ``conformance`` ships HiF8 test vectors and checks
any HiF8 decoder or encoder against them (``python -m hif8qat.formats.conformance``; not imported here); ``bf16``
rounds float32 tensors to BF16 values, a copy or in place (the BF16 emulation). Layer 1
of the library core: imports only torch and numpy; knows nothing of scaling, models or the pipeline.
"""

from hif8qat.formats.qdq import (
    FORMAT_SETTINGS,
    FORMATS,
    FP8_FORMATS,
    HIF8_MAX,
    HIF8_MIN_DENORMAL,
    HIF8_OVERFLOW,
    HIF8_TIER3_MAX,
    ROUNDINGS,
    FormatSpec,
    clipped_count,
    element_format,
    format_spec,
    fp8_qdq,
    fp8_qdq_scaled,
    fp8_qdq_scaled_amax,
    hif8_decode,
    hif8_encode,
    hif8_qdq,
    hif8_qdq_scaled,
    hif8_qdq_scaled_amax,
    hif8_values,
    qdq_scaled_amax,
    target_for,
)

__all__ = [
    "FORMATS", "FORMAT_SETTINGS", "FP8_FORMATS", "HIF8_MAX", "HIF8_MIN_DENORMAL", "HIF8_OVERFLOW", "HIF8_TIER3_MAX",
    "ROUNDINGS", "FormatSpec", "clipped_count", "element_format", "format_spec", "fp8_qdq", "fp8_qdq_scaled",
    "fp8_qdq_scaled_amax", "hif8_decode", "hif8_encode", "hif8_qdq", "hif8_qdq_scaled", "hif8_qdq_scaled_amax",
    "hif8_values", "qdq_scaled_amax", "target_for",
]
