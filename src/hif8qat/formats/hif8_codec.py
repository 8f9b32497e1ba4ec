"""HiF8 (HiFloat8, arXiv 2409.16626) numerics: the rounding rule on float32 bit patterns and the byte codes.

HiF8 is an 8-bit float with a prefix-coded "dot" field that trades mantissa bits for exponent range: normal
exponents -15..15 carry 3 mantissa bits for |e| <= 3, 2 bits for 4..7 and 1 bit for 8..15; the denormals are
the powers of two 2^-22..2^-16; there is one zero, max finite 32768, |x| >= 40960 becomes +-inf and the code
0x80 is NaN. ``en_dtypes.hifloat8`` is the ground truth: ``rounding="ta"`` (round half away from zero) matches
it bit for bit on every float32, bfloat16 and float16 input.

The rule, "add a rounding bias to the bit pattern, then clear the dropped mantissa bits", is written as
branch-free arithmetic (``_qdq_bits_arith``, what ``torch.compile`` fuses) and as lookup tables (the eager
fallback). Nothing here is differentiable; the kernels are in :mod:`hif8qat.formats.kernels`, the public API
in :mod:`hif8qat.formats.qdq`.
"""

from __future__ import annotations

import math
import threading

import torch

__all__ = ["HIF8_MAX", "HIF8_OVERFLOW", "HIF8_TIER3_MAX", "HIF8_MIN_DENORMAL", "ROUNDINGS", "hif8_values"]

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

    Why bit arithmetic: rounding on the sign-magnitude bit pattern is round-half-away by construction, a carry
    out of the mantissa lands on the next power of two (always representable, except above 32768 where it
    means overflow), and nothing needs log2 (which gets inputs near 2^-22 wrong). Written with torch ops, it
    is what ``torch.compile`` fuses into one loop (CPU and CUDA alike) and the reference for the lookup-table
    path.
    """
    a = bits & _ABS
    sign = bits & _SIGN
    e = (a >> 23) - _EXP_BIAS
    ae = e.abs()
    # Integer comparisons are strict (> < ==) on purpose: inductor's 256-bit (AVX2) code spells int32 >=, <=
    # and != as a compare plus an all-ones XOR, and GCC 12 compiling that with AVX-512BW/VL enabled (inductor
    # passes -march=native, so an AVX-512 CPU limited to ATen's AVX2 kernels gets both) drops the XOR when the
    # mask feeds a blend: torch.where(a >= t, ...) then chose the wrong side for every element (all +-inf).
    s = 20 + (ae > 3).int() + (ae > 7).int() + (e < -15).int()
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
    r = torch.where(a > _OVERFLOW_BITS - 1, _INF, r)  # a >= 40960, strict (see above)
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

    The bias and the mask depend only on the top 11 bits of the float (sign, exponent, two mantissa bits:
    enough to see the 40960 overflow threshold), so two 2048-entry tables turn the rule into these passes.
    bfloat16 and float16 inputs have only 65,536 patterns and use one full table of results instead.
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
    """float32 value of each of the 256 codes (index = code); code 0x80 is NaN, 0x6F/0xEF are +-inf.

    Returns:
        A (256,) float32 tensor indexed by code.
    """
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
# Probe inputs: the first-call check of each compiled kernel (qdq_kernels) compares it with the eager path here.


def _probe_values(dtype: torch.dtype) -> torch.Tensor:
    """Inputs that reach every branch of the rounding rule, as a 1-d CPU tensor of ``dtype``.

    16-bit dtypes: every bit pattern (all 65,536 values). float32: every value with a 16-bit pattern (each sign
    and exponent band, float32 denormals, inf, NaN; every FP8 value and midpoint is one of them), the same plus
    half a bfloat16 ulp (the ties of a bfloat16 ``out_dtype`` cast), every HiF8 value and rounding midpoint with
    their float32 neighbours ("ta" ties, the subnormal steps at 2^-23 and below), and values from HIF8_MAX up to
    float32's max (overflow, the saturating clamp). The length is no multiple of a vector width, so the last
    values, the special cases again, fall in a compiled loop's scalar tail.
    """
    tail = torch.tensor([0.0, -0.0, 2.0**-23, -(2.0**-23), 1.5 * 2.0**-23, 2.0**-22, HIF8_MAX, HIF8_OVERFLOW,
                         -HIF8_OVERFLOW, 49152.0, math.inf, -math.inf, math.nan], dtype=torch.float64)
    if dtype != torch.float32:
        return torch.cat([torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype),
                          tail.to(dtype)])
    p16 = torch.arange(0, 2**16, dtype=torch.int64).mul(2**16).to(torch.int32)  # 16-bit patterns, as float32 bits
    v = hif8_values().double()
    v = v[torch.isfinite(v)].unique()
    grid = torch.cat([v, (v[1:] + v[:-1]) / 2]).float()  # midpoints are exact: neighbours differ in few bits
    grid = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    big = torch.logspace(math.log10(HIF8_MAX), 38.5, 200, dtype=torch.float64).clamp(max=3.4e38).float()
    return torch.cat([p16.view(torch.float32), (p16 | 0x8000).view(torch.float32), grid, -grid, big, -big,
                      tail.float()])
