"""HiF8 and FP8 fake quantization: the public API (contract: docs/design.md, section 1).

HiF8 (HiFloat8, arXiv 2409.16626) is an 8-bit float with a prefix-coded "dot" field; ``rounding="ta"``
matches ``en_dtypes.hifloat8`` bit for bit on every float32, bfloat16 and float16 input. FP8 (OCP E4M3 /
E5M2) uses torch's native casts under the same scaled fake quantization. The code is split by job:

* :mod:`hif8qat.formats.hif8_codec`: HiF8 numerics (the rounding rule on float32 bits, lookup tables, byte codes);
* :mod:`hif8qat.formats.kernels`: the kernels (HiF8 and FP8, compiled per variant or eager), argument checks
  and dispatch, and the qdq call counter;
* this module: the public functions, FP8 format specs and the per-format scale conventions.

The private kernel helpers live in :mod:`hif8qat.formats.kernels` and :mod:`hif8qat.formats.hif8_codec`; import them
from there.

These functions are not differentiable (inputs are detached); straight-through gradients are the
caller's business (see ``quant/linear.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from hif8qat.formats.hif8_codec import (
    _FLOAT_DTYPES,
    HIF8_MAX,
    HIF8_MIN_DENORMAL,
    HIF8_OVERFLOW,
    HIF8_TIER3_MAX,
    ROUNDINGS,
    _table,
    hif8_values,
)
from hif8qat.formats.kernels import (
    _check_out,
    _check_out_dtype,
    _check_rounding,
    _check_scale,
    _check_x,
    _dispatch,
    _empty_result,
    _flat_args,
    _fp8_run,
    _shaped_result,
    _with_out_dtype,
    compile_status,
    count_qdq,
)

__all__ = [
    "HIF8_MAX",
    "HIF8_OVERFLOW",
    "HIF8_TIER3_MAX",
    "HIF8_MIN_DENORMAL",
    "ROUNDINGS",
    "hif8_encode",
    "hif8_decode",
    "hif8_qdq",
    "hif8_qdq_scaled",
    "hif8_qdq_scaled_amax",
    "hif8_values",
    "compile_status",
    "count_qdq",
]


# ---------------------------------------------------------------------------------------------------
# HiF8 public API


_UNSCALED = object()  # marks the unscaled qdq (a scale of None is a caller's error, checked as such)


def _check_args(x, rounding, out, scale=_UNSCALED, out_dtype=None):
    """The argument checks every public qdq function makes, in one place (ValueError on bad input)."""
    x = _check_x(x)
    rounding = _check_rounding(rounding)
    out = _check_out(out, x, _check_out_dtype(out_dtype))
    return x, rounding, out, (None if scale is _UNSCALED else _check_scale(scale, x))


def hif8_qdq(
    x: torch.Tensor,
    rounding: str = "ta",
    *,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantize ``x`` to HiF8: the nearest HiF8 value, returned in x's dtype, shape and device.

    Args:
        x: a float32, bfloat16 or float16 tensor.
        rounding: "ta" (half away from zero; bit-exact with en_dtypes), "stochastic" (unbiased; draws from
            ``generator``) or "hr" (not available).
        generator: the random source of stochastic rounding (None: torch's default).
        out: optional preallocated result (same dtype/shape/device as x; may be x itself), which saves an
            allocation.

    Returns:
        The quantized tensor (``out`` when given).

    Raises:
        NotImplementedError: ``rounding="hr"``.
    """
    x, rounding, out, _ = _check_args(x, rounding, out)
    return _dispatch(x, None, rounding, generator, out, scaled=False, saturate=False, want_amax=False)[0]


def hif8_qdq_scaled(
    x: torch.Tensor,
    scale,
    rounding: str = "ta",
    *,
    saturate: bool = False,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``qdq(x * scale) / scale`` computed in float32 and cast back to x's dtype.

    Args:
        x: a float32, bfloat16 or float16 tensor.
        scale: a positive finite python number or a 1-element float tensor. A CPU tensor is validated; a
            tensor on an accelerator is not (validating it would force a host sync on every call).
        rounding: as in :func:`hif8_qdq`.
        saturate: clamp results to +-HIF8_MAX instead of +-inf (infinite inputs too); NaN propagates.
        generator: the random source of stochastic rounding.
        out: optional preallocated result, as in :func:`hif8_qdq`.

    Returns:
        The fake-quantized tensor in x's dtype.
    """
    x, rounding, out, scale = _check_args(x, rounding, out, scale)
    return _dispatch(x, scale, rounding, generator, out, scaled=True, saturate=saturate, want_amax=False)[0]


def hif8_qdq_scaled_amax(
    x: torch.Tensor,
    scale,
    rounding: str = "ta",
    *,
    saturate: bool = False,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hif8_qdq_scaled`` plus ``amax = max|x|``.

    The delayed scaler needs the amax of every quantized tensor; the compiled path computes it in the same
    kernel as the quantization, so x is read once.

    Args:
        x: a float32, bfloat16 or float16 tensor.
        scale: as in :func:`hif8_qdq_scaled`.
        rounding: as in :func:`hif8_qdq`.
        saturate: as in :func:`hif8_qdq_scaled`.
        generator: the random source of stochastic rounding.
        out: optional preallocated result (in ``out_dtype``).
        out_dtype: the result's dtype (default x's), bit for bit ``hif8_qdq_scaled_amax(x,
            ...)[0].to(out_dtype)`` without the separate cast pass.

    Returns:
        ``(y, amax)``: the fake-quantized tensor and max|x| of the unscaled x (0-d float32 on x's device;
        NaN/inf in x propagate into it, an empty x gives 0).
    """
    x, rounding, out, scale = _check_args(x, rounding, out, scale, out_dtype)
    return _dispatch(x, scale, rounding, generator, out, scaled=True, saturate=saturate, want_amax=True,
                     out_dtype=out_dtype)


def hif8_encode(x: torch.Tensor) -> torch.Tensor:
    """HiF8 byte codes (en_dtypes layout) of x rounded with "ta". NaN -> 0x80, one zero 0x00.

    Args:
        x: a float tensor.

    Returns:
        A uint8 tensor of x's shape.
    """
    x = _check_x(x)
    y = hif8_qdq(x).float()  # exact: every HiF8 value is a bf16/fp16 value too
    top = torch.bitwise_right_shift(y.view(torch.int32), 20) & 0xFFF
    codes = _table("encode", x.device)[top.reshape(-1)].view(x.shape)  # 1-d index: always a copy
    return codes.masked_fill_(torch.isnan(y), 0x80)


def hif8_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of HiF8 byte codes (en_dtypes layout).

    Args:
        codes: a uint8 tensor.
        dtype: float32, bfloat16 or float16.

    Returns:
        The values, of codes' shape, in ``dtype``.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes)
        raise ValueError(f"codes must be a torch.uint8 tensor; got {got}")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype}")
    vals = _table("decode", codes.device)[codes.reshape(-1).int()]  # 1-d index: always a copy
    return vals.view(codes.shape).to(dtype)


# ===================================================================================================
# FP8 (OCP E4M3 / E5M2) under the same scaled fake-quantization, and the per-format scale conventions.
#
# Used to compare HiF8 with FP8 under identical delayed scaling. The casts are torch's native
# ``float8_e4m3fn`` / ``float8_e5m2`` conversions (round to nearest, ties to even). They are made
# saturating by clamping to +-max first, as torchao's ``to_fp8_saturated`` does: the plain cast of an
# out-of-range value is version and device dependent (NaN for e4m3fn, inf for e5m2 on some builds,
# +-max on others), and Transformer Engine clips values beyond the range to +-FP8_MAX ("If some value
# exceeds fp8 range, it is clipped to FP8_MAX or -FP8_MAX", TE docs, FP8 delayed scaling). Infinite
# inputs therefore become +-max as well; NaN stays NaN.
#
# Scale conventions (amax -> target):
#   HiF8: the paper's target 15, the top of the 3-bit-mantissa tier (``target_fwd`` / ``target_bwd``).
#   FP8:  TE ``DelayedScaling``: ``scale = (FP8_MAX / amax) / 2^margin`` with ``margin`` 0 by default,
#         i.e. target = FP8_MAX / 2^margin (448 for E4M3, 57344 for E5M2).
#   ``hybrid``: TE's ``Format.HYBRID``: E4M3 in the forward pass (activations A, weights W), E5M2 in the
#         backward pass (output gradients G).
# Clipped values per call: for HiF8 the overflow |x * s| >= 40960 (values that become inf, or are
# clamped when saturating); for FP8 |x * s| > FP8_MAX (values the saturating cast clips).


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """One 8-bit element format: its range and its scale convention."""

    name: str
    max: float  # largest finite value
    # |x * scale| from which a value is clipped (FP8, strictly above max) or overflows (HiF8, >= 40960)
    clip_threshold: float
    clip_inclusive: bool
    # amax -> this value at margin 0
    default_target: float
    dtype: torch.dtype | None  # torch's native dtype (None: HiF8, simulated on float32 bits)

    @property
    def is_fp8(self) -> bool:
        return self.dtype is not None

    def target(self, margin: int = 0) -> float:
        """Scale target: amax maps to ``max / 2^margin`` (FP8, TE's rule) or to 15 (HiF8, margin 0 only).

        Args:
            margin: FP8's power-of-two headroom below the format max.

        Returns:
            The value amax is scaled to.
        """
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin must be an integer >= 0; got {margin!r}")
        if not self.is_fp8 and margin:
            raise ValueError("margin applies to FP8 formats only; HiF8's target is set directly (15 by default)")
        return self.default_target / 2.0**margin

    def clipped(self, scaled_abs: torch.Tensor) -> torch.Tensor:
        """Number of clipped (FP8) or overflowing (HiF8) elements given ``|x * scale|`` (0-d int64).

        Args:
            scaled_abs: ``|x * scale|``.

        Returns:
            The count as a 0-d int64 tensor.
        """
        t = self.clip_threshold
        return (scaled_abs >= t if self.clip_inclusive else scaled_abs > t).sum()


FORMATS: dict[str, FormatSpec] = {
    "hif8": FormatSpec("hif8", HIF8_MAX, HIF8_OVERFLOW, True, HIF8_TIER3_MAX, None),
    "e4m3": FormatSpec("e4m3", 448.0, 448.0, False, 448.0, torch.float8_e4m3fn),
    "e5m2": FormatSpec("e5m2", 57344.0, 57344.0, False, 57344.0, torch.float8_e5m2),
}
FP8_FORMATS = ("e4m3", "e5m2")
# The values of the ``format`` setting: an element format for every role, or TE's HYBRID recipe.
FORMAT_SETTINGS = ("hif8", "e4m3", "e5m2", "hybrid")
_HYBRID_ROLES = {"A": "e4m3", "W": "e4m3", "G": "e5m2"}


def format_spec(fmt: str) -> FormatSpec:
    """The spec of an element format.

    Args:
        fmt: "hif8", "e4m3" or "e5m2".

    Returns:
        The format's :class:`FormatSpec`.

    Raises:
        ValueError: an unknown format, naming the allowed values.
    """
    spec = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if spec is None:
        raise ValueError(f"format must be one of {tuple(FORMATS)}; got {fmt!r}")
    return spec


def element_format(setting: str, role: str) -> str:
    """Element format of a tensor role under a ``format`` setting (``hybrid``: E4M3 for A and W, E5M2 for G,
    as TE's HYBRID recipe).

    Args:
        setting: the ``format`` setting ("hif8", "e4m3", "e5m2" or "hybrid").
        role: "A" (activations), "W" (weights) or "G" (gradients).

    Returns:
        The element format's name.
    """
    if role not in _HYBRID_ROLES:
        raise ValueError(f"role must be one of {tuple(_HYBRID_ROLES)}; got {role!r}")
    if setting == "hybrid":
        return _HYBRID_ROLES[role]
    return format_spec(setting).name


def target_for(config, role: str) -> float:
    """Scale target of ``role`` under a scaling config.

    HiF8: ``target_bwd`` for G, ``target_fwd`` for A and W (the paper's 15 by default), unless the config has
    a ``target`` (one number for every role, or a mapping role -> number) naming this role. FP8: the format
    max of the role's element format over ``2^margin`` (TE ``DelayedScaling``).

    Args:
        config: any object with ``format``, ``margin``, ``target_fwd`` and ``target_bwd`` (e.g.
            ``scaling.ScalingConfig``).
        role: "A", "W" or "G".

    Returns:
        The value amax maps to.
    """
    fmt = element_format(getattr(config, "format", "hif8"), role)
    if fmt == "hif8":
        override = getattr(config, "target", None)
        if isinstance(override, (int, float)):
            return float(override)
        if override is not None and role in override:
            return float(override[role])
        return float(config.target_bwd if role == "G" else config.target_fwd)
    return FORMATS[fmt].target(getattr(config, "margin", 0))


def _fp8_dispatch(x, scale, fmt, out, *, scaled: bool, want_amax: bool, site: str = "",
                  out_dtype: torch.dtype | None = None):
    """The FP8 counterpart of ``kernels._dispatch`` (same ``out`` and ``out_dtype`` rules)."""
    spec = format_spec(fmt)
    if not spec.is_fp8:
        raise ValueError(f"fmt must be one of {FP8_FORMATS} (use the hif8_* functions for HiF8); got {fmt!r}")

    def run(out, emit):
        flags = {"fmax": spec.max, "dtype": spec.dtype, "scaled": scaled, "want_amax": want_amax, "out_dtype": emit}
        if x.numel() == 0:
            return _empty_result(x, out, emit, want_amax)
        xf, of, direct = _flat_args(x, out)
        y, amax = _fp8_run(flags, xf, scale, of, site)
        return _shaped_result(y, amax, x, out, direct)

    return _with_out_dtype(run, x, out, out_dtype)


def fp8_qdq(x: torch.Tensor, fmt: str = "e4m3", *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` to FP8: nearest value, ties to even, saturating at +-max (inf too; NaN stays NaN).

    Args:
        x: a float tensor.
        fmt: "e4m3" or "e5m2".
        out: optional preallocated result, as in ``hif8_qdq``.

    Returns:
        The quantized tensor in x's dtype, shape and device.
    """
    x = _check_x(x)
    return _fp8_dispatch(x, None, fmt, _check_out(out, x), scaled=False, want_amax=False)[0]


def fp8_qdq_scaled(x: torch.Tensor, scale, fmt: str = "e4m3", *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``qdq(x * scale) / scale`` in float32, cast back to x's dtype (the convention of ``hif8_qdq_scaled``).

    Args:
        x: a float tensor.
        scale: a positive finite number or 1-element float tensor.
        fmt: "e4m3" or "e5m2".
        out: optional preallocated result.

    Returns:
        The fake-quantized tensor in x's dtype.
    """
    x = _check_x(x)
    out, scale = _check_out(out, x), _check_scale(scale, x)
    return _fp8_dispatch(x, scale, fmt, out, scaled=True, want_amax=False)[0]


def fp8_qdq_scaled_amax(x: torch.Tensor, scale, fmt: str = "e4m3", *, out: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_qdq_scaled`` plus ``amax = max|x|``, as ``hif8_qdq_scaled_amax``.

    Args:
        x: a float tensor.
        scale: a positive finite number or 1-element float tensor.
        fmt: "e4m3" or "e5m2".
        out: optional preallocated result.
        out_dtype: the result's dtype (default x's).

    Returns:
        ``(y, amax)``, amax a 0-d float32 of the unscaled x.
    """
    x = _check_x(x)
    out, scale = _check_out(out, x, _check_out_dtype(out_dtype)), _check_scale(scale, x)
    return _fp8_dispatch(x, scale, fmt, out, scaled=True, want_amax=True, out_dtype=out_dtype)


def qdq_scaled_amax(x: torch.Tensor, scale, fmt: str, rounding: str = "ta", *, saturate: bool = False,
                    generator: torch.Generator | None = None, out: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled qdq + amax in any element format: the one entry point a format-pluggable quantizer needs.

    Args:
        x: a float tensor.
        scale: a positive finite number or 1-element float tensor.
        fmt: "hif8", "e4m3" or "e5m2".
        rounding: HiF8's rounding; FP8 always rounds to nearest even, so there it must be "ta".
        saturate: HiF8 only (FP8 always saturates, TE's casts).
        generator: the random source of stochastic rounding.
        out: optional preallocated result.
        out_dtype: as in ``hif8_qdq_scaled_amax``.

    Returns:
        ``(y, amax)`` as ``hif8_qdq_scaled_amax``.
    """
    if format_spec(fmt).is_fp8:
        if rounding != "ta":
            raise ValueError(f"rounding={rounding!r} is HiF8-only; FP8 casts round to nearest even (use 'ta')")
        return fp8_qdq_scaled_amax(x, scale, fmt, out=out, out_dtype=out_dtype)
    return hif8_qdq_scaled_amax(x, scale, rounding, saturate=saturate, generator=generator, out=out,
                                out_dtype=out_dtype)


def scaled_qdq_kernel(fmt: str, site: str = ""):
    """The fused scaled qdq (+ amax) of an element format without per-call checks, for a caller that quantizes
    on every call of a hot path with arguments it made itself (the scaler bank).

    The caller guarantees what the public functions check: ``x`` a float32 / bfloat16 / float16 tensor,
    ``scale`` a positive finite 0-d float32 tensor on x's device, ``rounding`` one of ``ROUNDINGS`` (FP8
    ignores ``rounding`` and ``saturate``: nearest even, always saturating).

    Args:
        fmt: "hif8", "e4m3" or "e5m2".
        site: the calling context; a caller in another dispatch context (the body of a custom op) gets
            compiled variants of its own.

    Returns:
        ``kernel(x, scale, rounding, saturate, want_amax, out_dtype=None, generator=None) -> (y, amax or
        None)``: ``y`` in ``out_dtype`` (default x's), bit for bit the cast of the x-dtype result;
        ``generator`` is where stochastic rounding draws its random bits (None: torch's default).
    """
    if format_spec(fmt).is_fp8:
        def kernel(x, scale, rounding, saturate, want_amax, out_dtype=None, generator=None):
            return _fp8_dispatch(x, scale, fmt, None, scaled=True, want_amax=want_amax, site=site,
                                 out_dtype=out_dtype)
    else:
        def kernel(x, scale, rounding, saturate, want_amax, out_dtype=None, generator=None):
            return _dispatch(x, scale, rounding, generator, None, scaled=True, saturate=saturate, want_amax=want_amax,
                             site=site, out_dtype=out_dtype)
    return kernel


def clipped_count(x: torch.Tensor, scale, fmt: str) -> torch.Tensor:
    """Number of elements of ``x * scale`` beyond the format's range, on x's device without a sync.

    FP8: ``|x * scale| > max`` (what the saturating cast clips). HiF8: ``|x * scale| >= 40960`` (the overflow:
    inf, or HIF8_MAX when saturating). NaN is not counted. One extra pass over x, so telemetry computes it on
    statistics calls only.

    Args:
        x: a float tensor.
        scale: a positive finite number or 1-element float tensor.
        fmt: "hif8", "e4m3" or "e5m2".

    Returns:
        The count as a 0-d int64 tensor.
    """
    spec = format_spec(fmt)
    x = _check_x(x)
    s = _check_scale(scale, x)
    return spec.clipped(x.abs().to(torch.float32).mul_(s))  # |x| * s == |x * s| exactly in float32


__all__ += [
    "FORMATS",
    "FORMAT_SETTINGS",
    "FP8_FORMATS",
    "FormatSpec",
    "clipped_count",
    "element_format",
    "format_spec",
    "fp8_qdq",
    "fp8_qdq_scaled",
    "fp8_qdq_scaled_amax",
    "qdq_scaled_amax",
    "scaled_qdq_kernel",
    "target_for",
]
