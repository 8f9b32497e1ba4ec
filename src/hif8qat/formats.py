"""HiF8 (HiFloat8, arXiv 2409.16626) quantize/dequantize on float32 bit patterns.

HiF8 is an 8-bit float with a prefix-coded "dot" field that trades mantissa bits for exponent range:
normal exponents -15..15 carry 3 mantissa bits for |e| <= 3, 2 bits for 4..7 and 1 bit for 8..15; the
denormals are the powers of two 2^-22..2^-16; there is one zero, max finite 32768, |x| >= 40960 becomes
+-inf and the code 0x80 is NaN. ``en_dtypes.hifloat8`` is the ground truth: ``rounding="ta"`` (round half
away from zero) matches it bit for bit on every float32, bfloat16 and float16 input (NaN payloads aside:
a NaN stays a NaN, en_dtypes returns its one canonical NaN).

Why bit arithmetic: for every float32 input the result is "add a rounding bias to the bit pattern, then
clear the dropped mantissa bits", where the number of dropped bits depends only on the exponent field.
Rounding on the sign-magnitude bit pattern is round-half-away by construction, a carry out of the
mantissa lands on the next power of two (always representable, except above 32768 where it means
overflow), and nothing needs log2 (which gets inputs near 2^-22 wrong).

Two implementations of the same rule:

* ``_qdq_bits_arith``: branch-free integer arithmetic written with torch ops; it is what
  ``torch.compile`` fuses into one loop (CPU and CUDA alike) and the reference for the other path.
* ``_qdq_bits_lut`` (eager fallback): the bias and the mask depend only on the top 11 bits of the float
  (sign, exponent, two mantissa bits: enough to see the 40960 overflow threshold), so two 2048-entry
  tables turn the rule into five tensor passes. bfloat16/float16 inputs have only 65,536 patterns and
  use one full table of results.

These functions are not differentiable (inputs are detached); straight-through gradients are the
caller's business (see ``qlinear.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import types
import warnings

import torch

from hif8qat.rules import cold_estimate, scale_of  # current scaling is the delayed scaler's cold start

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
]

HIF8_MAX = 32768.0  # largest finite value
HIF8_OVERFLOW = 40960.0  # |x| >= this rounds to +-inf (midpoint of 32768 and the missing 49152)
HIF8_TIER3_MAX = 15.0  # top of the 3-bit-mantissa tier: the default scaling target
HIF8_MIN_DENORMAL = 2.0**-22  # smallest nonzero magnitude
ROUNDINGS = ("ta", "stochastic", "hr")

# float32 bit patterns used by the rounding rule
_SIGN = -(2**31)  # 0x80000000 as int32
_ABS = 0x7FFFFFFF
_EXP_MASK = -(2**23)  # 0xFF800000: sign + exponent, i.e. "clear the whole mantissa"
_INF = 0x7F800000
_OVERFLOW_BITS = 0x47200000  # 40960.0
_MAX_BITS = 0x47000000  # 32768.0
_MIN_BITS = 0x34800000  # 2^-22, smallest HiF8 magnitude
_HALF_MIN_BITS = 0x34000000  # 2^-23: from here up (ties away) values round to 2^-22
_EXP_BIAS = 127

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------------
# Scalar reference for one exponent: the rule both implementations tabulate or vectorize.


def _dropped_bits(exp_unbiased: int) -> int:
    """Number of float32 mantissa bits HiF8 drops at this exponent (23 = keep none: power of two)."""
    e = exp_unbiased
    if -3 <= e <= 3:
        return 20
    if -7 <= e <= 7:
        return 21
    if -15 <= e <= 15:
        return 22
    return 23  # denormals 2^-22..2^-16 are bare powers of two


def _bias_mask_for_bucket(top11: int) -> tuple[int, int]:
    """Rounding bias and mask for all float32 patterns whose top 11 bits are ``top11`` (unsigned).

    ``y = (bits + bias) & mask`` (int32 arithmetic, never overflowing) is the HiF8 "ta" result.
    """
    sign = top11 >> 10
    exp = (top11 >> 2) & 0xFF
    base = (top11 << 21) - (2**32 if sign else 0)  # smallest int32 pattern in the bucket
    sign_bits = _SIGN if sign else 0
    if exp == 0xFF:  # inf and NaN pass through unchanged
        return 0, -1
    if (top11 & 0x3FF) << 21 >= _OVERFLOW_BITS:  # |x| >= 40960 (whole bucket): +-inf
        return (sign_bits | _INF) - base, _EXP_MASK
    e = exp - _EXP_BIAS
    if e < -23:  # below 2^-23 (and -0, float32 denormals): the single +0
        return 0, 0
    if e == -23:  # [2^-23, 2^-22): always up to 2^-22 (2^-23 itself is a tie, away from zero)
        return 1 << 23, _EXP_MASK
    s = _dropped_bits(e)
    return 1 << (s - 1), -(1 << s)


def _build_bias_mask_tables() -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [_bias_mask_for_bucket(i) for i in range(2048)]
    bias = torch.tensor([p[0] for p in pairs], dtype=torch.int32)
    mask = torch.tensor([p[1] for p in pairs], dtype=torch.int32)
    return bias, mask


# ---------------------------------------------------------------------------------------------------
# Vectorized arithmetic (compiled path and reference)


def _qdq_bits_arith(bits: torch.Tensor, rand: torch.Tensor | None = None) -> torch.Tensor:
    """HiF8 qdq of float32 patterns ``bits`` (int32) by branch-free integer arithmetic.

    With ``rand`` (int32 uniform in [0, 2^23)) the rounding is stochastic: the random integer, shifted
    to the width of the dropped bits, replaces the half-ulp bias, which makes P(round up) equal to the
    distance from the lower neighbour over the spacing. Below 2^-22 (neighbours 0 and 2^-22) the same
    probability is obtained by comparing the magnitude with a random threshold. At and above 32768
    there is no finite upper neighbour, so stochastic rounding falls back to "ta" there.
    """
    a = bits & _ABS
    sign = bits & _SIGN
    e = (a >> 23) - _EXP_BIAS
    ae = e.abs()
    s = 20 + (ae >= 4).int() + (ae >= 8).int() + (e <= -16).int()
    ac = torch.clamp(a, max=_OVERFLOW_BITS)  # keeps the integer add below overflow
    if rand is None:
        inc = torch.bitwise_left_shift(torch.ones_like(s), s - 1)
    else:
        inc = torch.bitwise_right_shift(rand, 23 - s)
    r = (ac + inc) & -torch.bitwise_left_shift(torch.ones_like(s), s)
    if rand is None:
        r = torch.where(e == -23, _MIN_BITS, r)
        r = torch.where(a < _HALF_MIN_BITS, 0, r)
    else:
        # |x| < 2^-22: up with probability |x| / 2^-22 (rand * 2^-45 is a uniform threshold in [0, 2^-22))
        thresh = rand.float() * 2.0**-45
        up = thresh < a.view(torch.float32)
        r = torch.where(a < _MIN_BITS, up.int() * _MIN_BITS, r)
        ta = _qdq_bits_arith(bits)
        r = torch.where(a > _MAX_BITS, ta & _ABS, r)
    r = torch.where(a >= _OVERFLOW_BITS, _INF, r)
    r = torch.where(a > _INF, a, r)  # NaN keeps its payload
    return torch.where(r == 0, 0, r | sign)


def _qdq_fp32_arith(x: torch.Tensor, rand: torch.Tensor | None = None) -> torch.Tensor:
    """qdq of any float tensor through float32 bits; returns float32."""
    bits = x.float().view(torch.int32)
    return _qdq_bits_arith(bits, rand).view(torch.float32)


# ---------------------------------------------------------------------------------------------------
# Eager lookup-table path

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}
_TABLES_LOCK = threading.Lock()


def _table(name: str, device: torch.device) -> torch.Tensor:
    """Lazily built, per-device lookup tables (tiny; built once from the scalar rule)."""
    key = (name, device)
    t = _TABLES.get(key)
    if t is not None:
        return t
    with _TABLES_LOCK:
        if key not in _TABLES:
            if name in ("bias", "mask"):
                bias, mask = _build_bias_mask_tables()
                _TABLES[("bias", device)] = bias.to(device)
                _TABLES[("mask", device)] = mask.to(device)
            elif name in ("lut16_bf16", "lut16_fp16"):
                dt = torch.bfloat16 if name == "lut16_bf16" else torch.float16
                pats = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
                vals = _qdq_fp32_arith(pats.view(dt)).to(dt).view(torch.int16)
                # index by the int16 pattern; negative patterns wrap from the end of the table
                lut = torch.empty(2**16, dtype=torch.int16)
                lut[pats.to(torch.int64) % 2**16] = vals
                _TABLES[key] = lut.to(device)
            elif name == "decode":
                _TABLES[key] = _decode_table().to(device)
            elif name == "encode":
                _TABLES[key] = _encode_table().to(device)
            else:  # pragma: no cover - internal misuse
                raise KeyError(name)
    return _TABLES[key]


def _qdq_fp32_lut_(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Eager fp32 "ta" qdq of flat contiguous ``x`` into flat contiguous fp32 ``out`` (may be ``x``).

    Six passes, each a single vectorised torch kernel, with one scratch buffer besides ``out``:
    index = top 11 bits, gather the bias (into ``out``), add the bits, gather the mask, and.
    ``index_select`` is used for the gathers because it is several times faster than advanced
    indexing on CPU; it needs non-negative indices, hence the extra ``& 2047``.
    """
    bits = x.view(torch.int32)
    ob = out.view(torch.int32)
    idx = torch.bitwise_right_shift(bits, 21)
    idx &= 2047
    m = torch.index_select(_table("mask", x.device), 0, idx)
    bias = _table("bias", x.device)
    if ob.data_ptr() == bits.data_ptr():  # in place: gather the bias into the scratch index buffer's twin
        b = torch.index_select(bias, 0, idx)
        b += bits
        torch.bitwise_and(b, m, out=ob)
        return out
    torch.index_select(bias, 0, idx, out=ob)
    ob += bits
    ob &= m
    return out


# ---------------------------------------------------------------------------------------------------
# Codes: en_dtypes' byte layout, derived once from the value set.


def _code_value(code: int) -> float:
    """Value of one HiF8 byte (en_dtypes layout), decoded from the format's fields.

    Layout after the sign bit: a prefix-coded dot field D selects the exponent width; the exponent is
    sign-magnitude with an implicit leading 1; the remaining bits are mantissa. Dot 0000 (+ 3 bits)
    holds zero and the denormals 2^(m-23); 0x80 (negative zero) is NaN; 0x6F/0xEF are +-inf.
    """
    if code == 0x80:
        return math.nan
    sign = -1.0 if code & 0x80 else 1.0
    body = code & 0x7F
    if body == 0x6F:
        return sign * math.inf
    if body >> 3 == 0:  # dot "0000" (after D's own prefix): zero and denormals
        m = body & 7
        return 0.0 if m == 0 else sign * 2.0 ** (m - 23)
    if body >> 3 == 1:  # dot "0001": exponent 0, 3 mantissa bits
        return sign * (1 + (body & 7) / 8)
    if body >> 4 == 1:  # dot "001": exponent +-1 (1 bit), 3 mantissa bits
        es, m = (body >> 3) & 1, body & 7
        return sign * (1 + m / 8) * 2.0 ** (-1 if es else 1)
    if body >> 5 == 1:  # dot "01": exponent +-(2..3) (sign + 1 bit below implicit 1), 3 mantissa bits
        es, em, m = (body >> 4) & 1, (body >> 3) & 1, body & 7
        e = 2 + em
        return sign * (1 + m / 8) * 2.0 ** (-e if es else e)
    if body >> 5 == 2:  # dot "10": exponent +-(4..7) (sign + 2 bits), 2 mantissa bits
        es, em, m = (body >> 4) & 1, (body >> 2) & 3, body & 3
        e = 4 + em
        return sign * (1 + m / 4) * 2.0 ** (-e if es else e)
    # dot "11": exponent +-(8..15) (sign + 3 bits), 1 mantissa bit
    es, em, m = (body >> 4) & 1, (body >> 1) & 7, body & 1
    e = 8 + em
    return sign * (1 + m / 2) * 2.0 ** (-e if es else e)


def hif8_values() -> torch.Tensor:
    """float32 value of each of the 256 codes (index = code); code 0x80 is NaN, 0x6F/0xEF are +-inf."""
    return torch.tensor([_code_value(c) for c in range(256)], dtype=torch.float32)


def _decode_table() -> torch.Tensor:
    return hif8_values()


def _encode_table() -> torch.Tensor:
    """Code for each HiF8 value, indexed by the value's top 12 float32 bits (sign, exponent, 3 mantissa)."""
    vals = hif8_values()
    table = torch.zeros(4096, dtype=torch.uint8)
    bits = vals.view(torch.int32)
    for code in range(256):
        if code == 0x80:
            continue
        top = (int(bits[code]) >> 20) & 0xFFF
        table[top] = code
    return table


# ---------------------------------------------------------------------------------------------------
# One kernel body for every variant; compiled per variant, or run eagerly.


def _kernel_body(x, scale, rand, out, *, scaled: bool, saturate: bool, want_amax: bool):
    """qdq of a flat tensor: optionally scaled (x * scale, qdq, / scale in fp32), saturated, with amax.

    Written once and specialised by keyword flags; ``torch.compile`` turns each variant into one
    fused loop (the amax reduction reads the same x as the quantisation).
    """
    xf = x.float()
    if scaled:
        xf = xf * scale
    y = _qdq_fp32_arith(xf, rand)
    if saturate:
        y = torch.clamp(y, -HIF8_MAX, HIF8_MAX)
    if scaled:
        y = y / scale
    y = y.to(x.dtype)
    amax = x.abs().amax().float() if want_amax else None
    if out is not None:
        out.copy_(y)
        y = out
    return y, amax


_COMPILE_LOCK = threading.Lock()
_compiled: dict[tuple, object] = {}
_compile_failed: str | None = None
_MIN_COMPILED_NUMEL = 1024  # below this the eager path is as fast and avoids size-0/1 specialisation


def _compile_enabled() -> bool:
    return os.environ.get("HIF8QAT_COMPILE", "1") not in ("0", "false", "no") and _compile_failed is None


def compile_status() -> dict[str, object]:
    """Whether the compiled path is enabled and, if compilation failed, why (for logs and benchmarks)."""
    return {"enabled": _compile_enabled(), "failed": _compile_failed}


def _variant_function(key: tuple, flags: dict):
    """A fresh function object *with its own code object* for one variant.

    Dynamo keeps its cache (and its recompile limit of 8) per code object. Giving every variant
    (flags, dtype, device type, out mode) its own copy of the code means each compiles once, with a
    dynamic length, and no mix of dtypes or out modes can exhaust a shared recompile budget.
    """
    name = "hif8_kernel_" + "_".join(str(k).replace(".", "_") for k in key)

    def kernel(x, scale, rand, out):
        return _kernel_body(x, scale, rand, out, **flags)

    code = kernel.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, kernel.__globals__, name, kernel.__defaults__, kernel.__closure__)


def _get_compiled(key: tuple, flags: dict, variant=None):
    """The compiled kernel for ``key``, built once (thread-safe) from ``variant`` (default: the HiF8 one)."""
    c = _compiled.get(key)
    if c is None:
        with _COMPILE_LOCK:
            c = _compiled.get(key)
            if c is None:
                c = torch.compile((variant or _variant_function)(key, flags), dynamic=True, fullgraph=True)
                _compiled[key] = c
    return c


def _disable_compile(err: BaseException) -> None:
    global _compile_failed
    if _compile_failed is None:
        lines = [ln.strip() for ln in f"{type(err).__name__}: {err}".splitlines() if ln.strip()]
        _compile_failed = " ".join(lines[:3])[:500]
        warnings.warn(
            f"hif8qat: torch.compile of the HiF8 quantizer failed ({_compile_failed}); "
            "using the eager implementation from now on",
            RuntimeWarning,
            stacklevel=4,
        )


def _run_compiled(flags: dict, x, scale, rand, out, site: str = ""):
    """The compiled variant's result, or None when compilation is off, unavailable or has failed.

    A failure (no compiler, unsupported backend, ...) is caught at the call, remembered for the rest of
    the process and reported by one warning; the caller then takes the eager path.
    """
    if not _compile_enabled() or x.numel() < _MIN_COMPILED_NUMEL or torch.compiler.is_compiling():
        return None
    out_mode = "none" if out is None else ("alias" if out.data_ptr() == x.data_ptr() else "out")
    # site: callers running in another dispatch context (inside a custom op autograd keys are excluded,
    # which dynamo guards on) get their own code object, hence their own recompile budget
    key = (*sorted(flags.items()), rand is not None, x.dtype, x.device.type, out_mode, *((site,) if site else ()))
    try:
        with torch.no_grad():  # one grad mode for every caller: a grad-mode change would cost a recompile
            return _get_compiled(key, flags)(x, scale, rand, out)
    except Exception as err:  # noqa: BLE001 - any compiler failure means: fall back to eager
        _disable_compile(err)
        return None


# ---------------------------------------------------------------------------------------------------
# Eager paths (flat, contiguous tensors)


def _eager_ta_into(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Table-driven "ta" qdq of flat x into flat ``out`` (allocated when None)."""
    if x.dtype == torch.float32:
        return _qdq_fp32_lut_(x, torch.empty_like(x) if out is None else out)
    name = "lut16_bf16" if x.dtype == torch.bfloat16 else "lut16_fp16"
    lut = _table(name, x.device)
    idx = x.view(torch.int16).int()
    idx &= 0xFFFF  # index_select wants non-negative indices
    if out is None:
        out = torch.empty_like(x)
    torch.index_select(lut, 0, idx, out=out.view(torch.int16))
    return out


def _eager(flags: dict, x, scale, rand, out):
    """Eager counterpart of the compiled kernel; tables for "ta", the arithmetic for stochastic."""
    if rand is not None:
        return _kernel_body(x, scale, rand, out, **flags)
    if not flags["scaled"]:
        return _eager_ta_into(x, out), None
    if x.dtype == torch.float32 and out is not None and out.data_ptr() != x.data_ptr():
        xs = torch.mul(x, scale, out=out)  # work in the caller's buffer: no temporary
    else:
        xs = x.float() * scale
    y = _qdq_fp32_lut_(xs, xs)
    if flags["saturate"]:
        y.clamp_(-HIF8_MAX, HIF8_MAX)
    y.div_(scale)
    y = y.to(x.dtype)
    amax = None
    if flags["want_amax"]:
        # aminmax is one fused pass; x.abs().amax() would first materialise |x|
        mn, mx = torch.aminmax(x)
        amax = torch.maximum(mx.float(), -mn.float())
    if out is not None and y is not out:
        out.copy_(y)
        y = out
    return y, amax


# ---------------------------------------------------------------------------------------------------
# Argument checks


def _check_x(x, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(
            f"{name} must be a torch.Tensor of dtype float32, bfloat16 or float16; got {type(x)}"
        )
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must have dtype float32, bfloat16 or float16; got {x.dtype}")
    return x.detach()


def _check_rounding(rounding) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}; got {rounding!r}")
    if rounding == "hr":
        raise NotImplementedError(
            "rounding='hr' (HiF8 hybrid rounding) is not available: the public sources name it (round half "
            "away for |exponent| < 4, a stochastic-style rounding elsewhere) but do not specify the "
            "random source or the threshold bit widths of the stochastic part; the one public "
            "reconstruction found (a CANN host codec: up iff the top 14 dropped bits >= the lowest 14 "
            "bits) rounds exactly representable values such as 16.0 up to 20.0, so it is not a usable "
            "specification. Use rounding='ta' or 'stochastic'"
        )
    return rounding


def _check_out(out, x: torch.Tensor) -> torch.Tensor | None:
    if out is None:
        return None
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != x.dtype
        or out.shape != x.shape
        or out.device != x.device
    ):
        raise ValueError(
            f"out must be a tensor with x's dtype {x.dtype}, shape {tuple(x.shape)} and device {x.device}"
        )
    return out


def _check_scale(scale, x: torch.Tensor) -> torch.Tensor:
    """A positive finite scale as a 0-d float32 tensor on x's device.

    Python numbers and CPU tensors are validated. A tensor on an accelerator is not (reading it would
    force a host sync on every call); a bad value there shows up as inf/NaN/0 in the result.
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(
                f"scale must be a positive finite float or a 1-element float tensor; got {scale!r}"
            )
        if scale.device.type == "cpu":
            v = float(scale)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"scale must be positive and finite (0 < scale < inf); got {v}")
        return scale.detach().reshape(()).to(device=x.device, dtype=torch.float32)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(
            f"scale must be a positive finite float or a 1-element float tensor; got {type(scale)}"
        )
    v = float(scale)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"scale must be positive and finite (0 < scale < inf); got {v}")
    # torch.full fills on the device (no host-to-device copy, no sync)
    return torch.full((), v, dtype=torch.float32, device=x.device)


# ---------------------------------------------------------------------------------------------------
# Public API


def _random_bits(n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform int32 in [0, 2^23) per element, drawn from ``generator`` (or the default) on device."""
    return torch.randint(0, 1 << 23, (n,), dtype=torch.int32, device=device, generator=generator)


def _dispatch(x, scale, rounding, generator, out, *, scaled, saturate, want_amax, site: str = ""):
    """Flatten, pick compiled or eager, and put the result where the caller wants it."""
    flags = {"scaled": scaled, "saturate": bool(saturate), "want_amax": want_amax}
    if x.numel() == 0:
        y = out if out is not None else torch.empty_like(x)
        amax = torch.zeros((), dtype=torch.float32, device=x.device) if want_amax else None
        return y, amax
    # detached flat tensors without a view base: the compiled kernels' guards then see neither the caller's
    # shape nor its requires_grad (a weight, an activation and a gradient share one compiled variant)
    xf = x.contiguous().view(-1).detach()
    direct = out is not None and out.is_contiguous()
    of = out.view(-1).detach() if direct else None
    if direct and out.data_ptr() == x.data_ptr() and x.is_contiguous():
        of = xf  # in place: one tensor object, which the compiler handles as an input mutation
    rand = _random_bits(xf.numel(), x.device, generator) if rounding == "stochastic" else None
    r = _run_compiled(flags, xf, scale, rand, of, site)
    if r is None:
        r = _eager(flags, xf, scale, rand, of)
    return _shaped_result(r[0], r[1], x, out, direct)


def _shaped_result(y, amax, x, out, direct):
    """A kernel's flat result back in x's shape, in ``out`` when one was given (``direct``: written in place)."""
    if direct:
        return out, amax
    if out is not None:
        out.copy_(y.view(x.shape))
        return out, amax
    return y.view(x.shape), amax


_UNSCALED = object()  # marks the unscaled qdq (a scale of None is a caller's error, checked as such)


def _check_args(x, rounding, out, scale=_UNSCALED):
    """The argument checks every public qdq function makes, in one place (ValueError on bad input)."""
    x = _check_x(x)
    rounding = _check_rounding(rounding)
    out = _check_out(out, x)
    return x, rounding, out, (None if scale is _UNSCALED else _check_scale(scale, x))


def hif8_qdq(
    x: torch.Tensor,
    rounding: str = "ta",
    *,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantize ``x`` to HiF8: the nearest HiF8 value, returned in x's dtype, shape and device.

    rounding: "ta" (half away from zero; bit-exact with en_dtypes), "stochastic" (unbiased; draws
    from ``generator``), "hr" (not available, raises NotImplementedError). ``out``: optional
    preallocated result (same dtype/shape/device as x; may be x itself), which saves an allocation.
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

    scale: a positive finite python number or a 1-element float tensor. A CPU tensor is validated; a
    tensor on an accelerator is not (validating it would force a host sync on every call).
    saturate=True clamps results to +-HIF8_MAX instead of +-inf (infinite inputs too); NaN propagates.
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hif8_qdq_scaled`` plus ``amax = max|x|`` (unscaled x, 0-d float32 on x's device).

    The delayed scaler needs the amax of every quantized tensor; the compiled path computes it in the
    same kernel as the quantization, so x is read once. NaN/inf in x propagate into amax; an empty x
    gives amax 0.
    """
    x, rounding, out, scale = _check_args(x, rounding, out, scale)
    return _dispatch(x, scale, rounding, generator, out, scaled=True, saturate=saturate, want_amax=True)


def hif8_encode(x: torch.Tensor) -> torch.Tensor:
    """HiF8 byte codes (en_dtypes layout, uint8) of x rounded with "ta". NaN -> 0x80, one zero 0x00."""
    x = _check_x(x)
    y = hif8_qdq(x).float()  # exact: every HiF8 value is a bf16/fp16 value too
    top = torch.bitwise_right_shift(y.view(torch.int32), 20) & 0xFFF
    codes = _table("encode", x.device)[top.reshape(-1)].view(x.shape)  # 1-d index: always a copy
    return codes.masked_fill_(torch.isnan(y), 0x80)


def hif8_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of HiF8 byte codes (uint8, en_dtypes layout) in ``dtype`` (float32, bfloat16 or float16)."""
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
        """Scale target: amax maps to ``max / 2^margin`` (FP8, TE's rule) or to 15 (HiF8, margin 0 only)."""
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin must be an integer >= 0; got {margin!r}")
        if not self.is_fp8 and margin:
            raise ValueError("margin applies to FP8 formats only; HiF8's target is set directly (15 by default)")
        return self.default_target / 2.0**margin

    def clipped(self, scaled_abs: torch.Tensor) -> torch.Tensor:
        """Number of clipped (FP8) or overflowing (HiF8) elements given ``|x * scale|`` (0-d int64)."""
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
    """The spec of an element format ("hif8", "e4m3", "e5m2"); ValueError naming the allowed values."""
    spec = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if spec is None:
        raise ValueError(f"format must be one of {tuple(FORMATS)}; got {fmt!r}")
    return spec


def element_format(setting: str, role: str) -> str:
    """Element format of tensor role "A", "W" or "G" under a ``format`` setting (``hybrid``: E4M3 for A and
    W, E5M2 for G, as TE's HYBRID recipe)."""
    if role not in _HYBRID_ROLES:
        raise ValueError(f"role must be one of {tuple(_HYBRID_ROLES)}; got {role!r}")
    if setting == "hybrid":
        return _HYBRID_ROLES[role]
    return format_spec(setting).name


def target_for(config, role: str) -> float:
    """Scale target of ``role`` under a scaling config (any object with ``format``, ``margin``,
    ``target_fwd`` and ``target_bwd``, e.g. ``scaling.ScalingConfig``).

    HiF8: ``target_bwd`` for G, ``target_fwd`` for A and W (the paper's 15 by default). FP8: the format max
    of the role's element format over ``2^margin`` (TE ``DelayedScaling``).
    """
    fmt = element_format(getattr(config, "format", "hif8"), role)
    if fmt == "hif8":
        return float(config.target_bwd if role == "G" else config.target_fwd)
    return FORMATS[fmt].target(getattr(config, "margin", 0))


def current_scale(amax, target: float) -> torch.Tensor:
    """Just-in-time scale from a tensor's own amax: ``target / (amax + 1e-12)`` (float64, returned as a
    0-d float32 tensor on amax's device).

    TE's current scaling (``Float8CurrentScaling``) and torchao's dynamic scaling use ``FP8_MAX / amax``
    of the tensor being cast; with the target of the format this is the same rule for every format and
    the upper bound a delayed estimate can reach (no lag, nothing clipped). A non-finite or non-positive
    amax gives ``scale = target``, the delayed scaler's cold-start fallback, so the two agree on every call.
    No host synchronisation.
    """
    if not (isinstance(target, (int, float)) and not isinstance(target, bool) and math.isfinite(target)
            and target > 0):
        raise ValueError(f"target must be a finite number > 0; got {target!r}")
    return scale_of(float(target), cold_estimate(torch.as_tensor(amax).detach().reshape(())))


def _fp8_body(x, scale, out, *, fmax: float, dtype: torch.dtype, scaled: bool, want_amax: bool):
    """Saturating FP8 qdq of a flat tensor, optionally scaled (in float32), optionally with max|x|."""
    xf = x.float()
    if scaled:
        xf = xf * scale
    y = torch.clamp(xf, -fmax, fmax).to(dtype).float()
    if scaled:
        y = y / scale
    y = y.to(x.dtype)
    amax = None
    if want_amax:
        mn, mx = torch.aminmax(x)  # one pass; NaN propagates
        amax = torch.maximum(mx.float(), -mn.float())
    if out is not None:
        out.copy_(y)
        y = out
    return y, amax


def _fp8_variant_function(key: tuple, flags: dict):
    """Own code object per variant (as ``_variant_function``): one dynamo cache and recompile budget each."""
    name = "fp8_kernel_" + "_".join(str(k).replace(".", "_") for k in key)

    def kernel(x, scale, out):
        return _fp8_body(x, scale, out, **flags)

    code = kernel.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, kernel.__globals__, name, kernel.__defaults__, kernel.__closure__)


_fp8_compile_failed: str | None = None


def _fp8_run(flags: dict, x, scale, out, site: str = ""):
    """Compiled variant when enabled, else eager (``site`` as in ``_run_compiled``).

    A compiler failure (e.g. a GPU whose compiler backend has no float8 conversion) turns the compiled
    FP8 path off for the process with one warning; unlike the HiF8 path's failure it leaves HiF8's
    compiled path on.
    """
    global _fp8_compile_failed
    if (_compile_enabled() and _fp8_compile_failed is None and x.numel() >= _MIN_COMPILED_NUMEL
            and not torch.compiler.is_compiling()):
        out_mode = "none" if out is None else ("alias" if out.data_ptr() == x.data_ptr() else "out")
        key = ("fp8", *sorted(flags.items()), x.dtype, x.device.type, out_mode, *((site,) if site else ()))
        try:
            c = _get_compiled(key, flags, _fp8_variant_function)
            with torch.no_grad():  # one grad mode for every caller, as the HiF8 path
                return c(x, scale, out)
        except Exception as err:  # noqa: BLE001 - any compiler failure means: fall back to eager
            _fp8_compile_failed = " ".join(f"{type(err).__name__}: {err}".split())[:500]
            warnings.warn(f"hif8qat: torch.compile of the FP8 quantizer failed ({_fp8_compile_failed}); "
                          "using the eager implementation from now on", RuntimeWarning, stacklevel=4)
    return _fp8_body(x, scale, out, **flags)


def _fp8_dispatch(x, scale, fmt, out, *, scaled: bool, want_amax: bool, site: str = ""):
    spec = format_spec(fmt)
    if not spec.is_fp8:
        raise ValueError(f"fmt must be one of {FP8_FORMATS} (use the hif8_* functions for HiF8); got {fmt!r}")
    flags = {"fmax": spec.max, "dtype": spec.dtype, "scaled": scaled, "want_amax": want_amax}
    if x.numel() == 0:
        y = out if out is not None else torch.empty_like(x)
        return y, (torch.zeros((), dtype=torch.float32, device=x.device) if want_amax else None)
    # detached flat tensors without a view base: the compiled kernels' guards then see neither the caller's
    # shape nor its requires_grad (a weight, an activation and a gradient share one compiled variant)
    xf = x.contiguous().view(-1).detach()
    direct = out is not None and out.is_contiguous()
    of = out.view(-1).detach() if direct else None
    if direct and out.data_ptr() == x.data_ptr() and x.is_contiguous():
        of = xf
    y, amax = _fp8_run(flags, xf, scale, of, site)
    return _shaped_result(y, amax, x, out, direct)


def fp8_qdq(x: torch.Tensor, fmt: str = "e4m3", *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` to FP8 ``fmt`` ("e4m3" or "e5m2"): nearest value, ties to even, saturating at
    +-max (inf too; NaN stays NaN); returned in x's dtype, shape and device. ``out`` as in ``hif8_qdq``."""
    x = _check_x(x)
    return _fp8_dispatch(x, None, fmt, _check_out(out, x), scaled=False, want_amax=False)[0]


def fp8_qdq_scaled(x: torch.Tensor, scale, fmt: str = "e4m3", *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``qdq(x * scale) / scale`` in float32, cast back to x's dtype (the convention of ``hif8_qdq_scaled``)."""
    x = _check_x(x)
    out, scale = _check_out(out, x), _check_scale(scale, x)
    return _fp8_dispatch(x, scale, fmt, out, scaled=True, want_amax=False)[0]


def fp8_qdq_scaled_amax(x: torch.Tensor, scale, fmt: str = "e4m3", *,
                        out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_qdq_scaled`` plus ``amax = max|x|`` (unscaled x, 0-d float32), as ``hif8_qdq_scaled_amax``."""
    x = _check_x(x)
    out, scale = _check_out(out, x), _check_scale(scale, x)
    return _fp8_dispatch(x, scale, fmt, out, scaled=True, want_amax=True)


def qdq_scaled_amax(x: torch.Tensor, scale, fmt: str, rounding: str = "ta", *, saturate: bool = False,
                    generator: torch.Generator | None = None,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled qdq + amax in any element format: the one entry point a format-pluggable quantizer needs.

    HiF8 honours ``rounding`` and ``saturate``. FP8 always rounds to nearest even and saturates (TE's
    casts); there ``rounding`` must be "ta" (the deterministic rounding of the format) and ``saturate``
    is ignored.
    """
    if format_spec(fmt).is_fp8:
        if rounding != "ta":
            raise ValueError(f"rounding={rounding!r} is HiF8-only; FP8 casts round to nearest even (use 'ta')")
        return fp8_qdq_scaled_amax(x, scale, fmt, out=out)
    return hif8_qdq_scaled_amax(x, scale, rounding, saturate=saturate, generator=generator, out=out)


def clipped_count(x: torch.Tensor, scale, fmt: str) -> torch.Tensor:
    """Number of elements of ``x * scale`` beyond the format's range (0-d int64, on x's device, no sync).

    FP8: ``|x * scale| > max`` (what the saturating cast clips). HiF8: ``|x * scale| >= 40960`` (the
    overflow: inf, or HIF8_MAX when saturating). NaN is not counted. One extra pass over x, so telemetry
    computes it on statistics calls only.
    """
    spec = format_spec(fmt)
    x = _check_x(x)
    s = _check_scale(scale, x)
    return spec.clipped(x.abs().to(torch.float32).mul_(s))  # |x| * s == |x * s| exactly in float32


def current_qdq(x: torch.Tensor, fmt: str, target: float, rounding: str = "ta", *, saturate: bool = False,
                generator: torch.Generator | None = None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Just-in-time scaled qdq (TE's current scaling): amax of x itself, ``scale = current_scale(amax,
    target)``, then ``qdq_scaled_amax``. Returns ``(y, amax, scale)``; reads x twice (amax, then cast)."""
    x = _check_x(x)
    if x.numel():
        mn, mx = torch.aminmax(x)
        amax = torch.maximum(mx.float(), -mn.float())
    else:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
    scale = current_scale(amax, target)
    y, _ = qdq_scaled_amax(x, scale, fmt, rounding, saturate=saturate, generator=generator, out=out)
    return y, amax, scale


__all__ += [
    "FORMATS",
    "FORMAT_SETTINGS",
    "FP8_FORMATS",
    "FormatSpec",
    "clipped_count",
    "current_qdq",
    "current_scale",
    "element_format",
    "format_spec",
    "fp8_qdq",
    "fp8_qdq_scaled",
    "fp8_qdq_scaled_amax",
    "qdq_scaled_amax",
    "target_for",
]
