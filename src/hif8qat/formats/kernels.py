"""The qdq kernels behind :mod:`hif8qat.formats.qdq`: one body per format, compiled per variant or run eagerly.

HiF8 (``_kernel_body``) and FP8 (``_fp8_body``) each have one kernel body, specialised by keyword flags
(scaled, saturating, with amax, stochastic, output dtype) and compiled once per variant with
``torch.compile``; below ``_MIN_COMPILED_NUMEL`` elements, with compilation off or after it failed, the
same result comes from the eager path (HiF8: lookup tables, see :mod:`hif8qat.formats.hif8_codec`).

``_dispatch`` / ``_fp8_run`` take trusted arguments (the checks are here too, called by the public API in
:mod:`hif8qat.formats.qdq`). An optional counter (:func:`count_qdq`) records every kernel call with the bytes
it reads and writes, for benchmarks and tests.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import types
import warnings

import torch

from hif8qat.formats.hif8_codec import (
    _FLOAT_DTYPES,
    HIF8_MAX,
    ROUNDINGS,
    _probe_values,
    _qdq_fp32_arith,
    _qdq_fp32_lut_,
    _table,
)

# ---------------------------------------------------------------------------------------------------
# One kernel body for every variant; compiled per variant, or run eagerly.


def _kernel_body(x, scale, rand, out, *, scaled: bool, saturate: bool, want_amax: bool,
                 out_dtype: torch.dtype | None = None):
    """qdq of a flat tensor: optionally scaled (x * scale, qdq, / scale in fp32), saturated, with amax.

    Written once and specialised by keyword flags; ``torch.compile`` turns each variant into one
    fused loop (the amax reduction reads the same x as the quantisation). ``out_dtype`` (see
    ``_emit_dtype``): the result is written in that dtype, saving the caller a separate cast pass.
    """
    xf = x.float()
    if scaled:
        xf = xf * scale
    y = _qdq_fp32_arith(xf, rand)
    if saturate:
        y = torch.clamp(y, -HIF8_MAX, HIF8_MAX)
    if scaled:
        y = y / scale
    y = _to_out_dtype(y, x.dtype, out_dtype)
    amax = x.abs().amax().float() if want_amax else None
    if out is not None:
        out.copy_(y)
        y = out
    return y, amax


def _to_out_dtype(y, x_dtype, out_dtype):
    """The float32 result in x's dtype, then in ``out_dtype`` (only given for float32 x: one cast, one store)."""
    y = y.to(x_dtype)
    return y if out_dtype is None else y.to(out_dtype)


def _emit_dtype(x_dtype: torch.dtype, out_dtype: torch.dtype | None) -> torch.dtype | None:
    """The ``out_dtype`` a kernel may write itself, or None (write x's dtype, the caller casts).

    Only for float32 x, where the cast to x's dtype is a no-op: inside a fused kernel the compiler drops
    the rounding of an intermediate cast to 16 bits (float32 -> bfloat16 -> float32 stores the float32
    value), so for 16-bit x the rounding to x's dtype would be lost; there the cast follows the kernel.
    """
    if out_dtype is None or out_dtype == x_dtype or x_dtype != torch.float32:
        return None
    return out_dtype


# ---------------------------------------------------------------------------------------------------
# Call counter (benchmarks and tests): how many kernel calls and bytes a step costs.


class QdqCounter:
    """Calls recorded inside :func:`count_qdq`: ``calls``, ``bytes`` (elements read in the input's dtype plus
    written in the result's dtype; a stochastic call's random bits are not counted) and ``records``, one
    ``(shape, input dtype, result dtype, input data_ptr)`` per call (the pointer tells which tensor it was)."""

    def __init__(self):
        self.calls = 0
        self.bytes = 0
        self.records: list[tuple[tuple[int, ...], torch.dtype, torch.dtype, int]] = []

    @property
    def ptrs(self) -> list[int]:
        return [r[3] for r in self.records]


_COUNTERS: list[QdqCounter] = []


@contextlib.contextmanager
def count_qdq():
    """Count the qdq kernel calls (HiF8 and FP8) made at run time inside the block; yields a QdqCounter.

    Every call of the quantized linear's op is counted, compiled model or not (the op runs at call time);
    a qdq function traced into a compiled graph is counted once, when traced.
    """
    c = QdqCounter()
    _COUNTERS.append(c)
    try:
        yield c
    finally:
        _COUNTERS.remove(c)


def _count(x: torch.Tensor, out_dtype: torch.dtype | None) -> None:
    dt = out_dtype or x.dtype
    n = x.numel()
    nbytes = n * (x.element_size() + dt.itemsize)
    for c in _COUNTERS:
        c.calls += 1
        c.bytes += nbytes
        c.records.append((tuple(x.shape), x.dtype, dt, x.data_ptr()))


# ---------------------------------------------------------------------------------------------------
# Compilation


_COMPILE_LOCK = threading.Lock()
_compiled: dict[tuple, object] = {}
_compile_failed: str | None = None
_MIN_COMPILED_NUMEL = 1024  # below this the eager path is as fast and avoids size-0/1 specialisation


def _compile_enabled() -> bool:
    return os.environ.get("HIF8QAT_COMPILE", "1") not in ("0", "false", "no") and _compile_failed is None


def compile_status() -> dict[str, object]:
    """Whether the compiled path is enabled, why compilation failed if it did, and the variants that disagreed with
    the eager path at their first call (``rejected``: "<variant> on <device>" -> first difference; run eagerly).

    Returns:
        ``{"enabled": bool, "failed": the compile error or None, "rejected": {variant: first difference}}``.
    """
    return {"enabled": _compile_enabled(), "failed": _compile_failed, "rejected": dict(_rejected.values())}


def _variant_name(prefix: str, key: tuple) -> str:  # "hif8 kernel (scaled=True, ..., torch.float32, cpu, none)"
    return f"{prefix} kernel (" + ", ".join(f"{k[0]}={k[1]}" if isinstance(k, tuple) else str(k) for k in key) + ")"


def _own_code_variant(prefix: str, body, key: tuple, flags: dict):
    """A fresh function calling ``body(*args, **flags)``, *with its own code object*, for one variant.

    Dynamo keeps its cache (and its recompile limit of 8) per code object. Giving every variant
    (flags, dtype, device type, out mode) its own copy of the code means each compiles once, with a
    dynamic length, and no mix of dtypes or out modes can exhaust a shared recompile budget.
    """
    name = f"{prefix}_kernel_" + "_".join(str(k).replace(".", "_") for k in key)

    def kernel(*args):
        return body(*args, **flags)

    code = kernel.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, kernel.__globals__, name, kernel.__defaults__, kernel.__closure__)


def _variant_function(key: tuple, flags: dict):
    """The HiF8 kernel of one variant: ``(x, scale, rand, out)``."""
    return _own_code_variant("hif8", _kernel_body, key, flags)


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
            c = _get_compiled(key, flags)
            if _checked.get((key, str(x.device))) is not c:
                return _checked_first_call("hif8", key, c, c, lambda *a: _eager(flags, *a), x, scale, rand, out)
            return c(x, scale, rand, out)
    except Exception as err:  # noqa: BLE001 - any compiler failure means: fall back to eager
        _disable_compile(err)
        return None


# ---------------------------------------------------------------------------------------------------
# First-call check of each compiled variant against the eager path
#
# Compiled code is generated and built on the user's machine by a toolchain we do not control (once, GCC
# miscompiled inductor's AVX2 code on an AVX-512 CPU: every value inf, the loss NaN). So the first result of each
# variant (per device, once per process) is compared bit for bit with the eager path on a probe of the format's
# edge values and on the caller's own input; a variant that disagrees runs eagerly from then on.

_checked: dict[tuple, object] = {}  # (variant key, device) -> the compiled function that passed the check
_rejected: dict[tuple, tuple[str, str]] = {}  # (variant key, device) -> ("<variant> on <device>", first difference)
_CHECK_LOCK = threading.Lock()


@functools.cache
def _probe(dtype: torch.dtype, device: str) -> torch.Tensor:
    return _probe_values(dtype).to(device)


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where a and b differ bit for bit (any NaN matches any NaN: a payload is not a value)."""
    ints = {4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
    return (a.view(ints) != b.view(ints)) & ~(torch.isnan(a) & torch.isnan(b))


def _compare(run_c, run_e, x, scale, rand, out, out_mode) -> str | None:
    """The first difference, in words, between the compiled and the eager kernel on x (None: they agree).
    Each writes into its own buffers (an in-place variant gets its own copy of x), so both read the same x."""
    def run_fresh(run):
        xx = x.clone() if out_mode == "alias" else x
        return run(xx, scale, rand, xx if out_mode == "alias" else None if out is None else torch.empty_like(out))

    (y, amax), (y_ref, amax_ref) = run_fresh(run_c), run_fresh(run_e)
    if y.dtype != y_ref.dtype or y.shape != y_ref.shape:
        return f"result {y.dtype} {tuple(y.shape)}, eager {y_ref.dtype} {tuple(y_ref.shape)}"
    bad = _bits_differ(y.reshape(-1), y_ref.reshape(-1))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        xi, yi, ri = (float(t.reshape(-1)[i]) for t in (x, y, y_ref))
        return f"input {xi!r}: compiled {yi!r}, eager {ri!r} ({int(bad.sum())} of {bad.numel()} values differ)"
    a, r = (None if t is None else t.reshape(1).float() for t in (amax, amax_ref))
    if (a is None) != (r is None) or (a is not None and bool(_bits_differ(a, r))):
        return f"amax: compiled {a if a is None else float(a)!r}, eager {r if r is None else float(r)!r}"
    return None


def _checked_first_call(prefix, key, compiled, run_c, run_e, x, scale, rand, out):
    """A call of ``compiled`` not yet checked on x's device: ``run_c`` (calling it) against the eager ``run_e``, both
    ``(x, scale, rand, out) -> (y, amax)``, on the probe and on this input. Agreement: the variant is marked
    checked, the result is the compiled one. Disagreement (now or before): rejected (eager from now on, in
    ``compile_status()``, one warning naming it and its first difference), the result is the eager one."""
    vkey = (key, str(x.device))
    with _CHECK_LOCK:  # one check per variant: a second thread waits for its verdict
        if _checked.get(vkey) is compiled:
            return run_c(x, scale, rand, out)
        out_mode = "none" if out is None else ("alias" if out.data_ptr() == x.data_ptr() else "out")
        if vkey not in _rejected:
            px = _probe(x.dtype, str(x.device))
            ps = None if scale is None else torch.ones((), dtype=torch.float32, device=x.device)  # x * 1 is x
            g = torch.Generator(x.device).manual_seed(0)  # its own: the check leaves the caller's random stream
            pr = None if rand is None else _random_bits(px.numel(), x.device, g)
            po = None if out is None else torch.empty(px.shape, dtype=out.dtype, device=x.device)
            diff, where = _compare(run_c, run_e, px, ps, pr, po, out_mode), "probe"
            if diff is None:
                diff, where = _compare(run_c, run_e, x, scale, rand, out, out_mode), "first input"
            if diff is None:
                _checked[vkey] = compiled
                return run_c(x, scale, rand, out)
            name = f"{_variant_name(prefix, key)} on {x.device}"
            _rejected[vkey] = (name, f"{where}: {diff}")
            warnings.warn(f"hif8qat: the compiled {name} disagrees with the eager implementation ({where}: "
                          f"{diff}); that variant runs eagerly from now on", RuntimeWarning, stacklevel=5)
    return run_e(x, scale, rand, out)  # x and out are untouched: the check wrote only into its own buffers


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
    if flags["out_dtype"] is not None:  # the x-dtype result, then one cast (into out if given)
        y, amax = _eager({**flags, "out_dtype": None}, x, scale, rand, None)
        if out is None:
            return y.to(flags["out_dtype"]), amax
        return out.copy_(y), amax
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


def _check_out(out, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``out`` must have x's shape and device, and ``dtype`` (the result's; default x's)."""
    if out is None:
        return None
    dtype = dtype or x.dtype
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != dtype
        or out.shape != x.shape
        or out.device != x.device
    ):
        whose = "x's dtype" if dtype == x.dtype else "out_dtype"
        raise ValueError(
            f"out must be a tensor with {whose} {dtype}, shape {tuple(x.shape)} and device {x.device}"
        )
    return out


def _check_out_dtype(out_dtype) -> torch.dtype | None:
    if out_dtype is not None and out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be None, float32, bfloat16 or float16; got {out_dtype!r}")
    return out_dtype


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
# Dispatch


def _random_bits(n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform int32 in [0, 2^23) per element, drawn from ``generator`` (or the default) on device."""
    return torch.randint(0, 1 << 23, (n,), dtype=torch.int32, device=device, generator=generator)


def _dispatch(x, scale, rounding, generator, out, *, scaled, saturate, want_amax, site: str = "",
              out_dtype: torch.dtype | None = None):
    """Flatten, pick compiled or eager, and put the result where the caller wants it.

    ``out_dtype``: the result's dtype (None: x's; ``out`` must have it); bit-identical to the qdq in x's
    dtype cast to it afterwards.
    """
    def run(out, emit):
        flags = {"scaled": scaled, "saturate": bool(saturate), "want_amax": want_amax, "out_dtype": emit}
        if x.numel() == 0:
            return _empty_result(x, out, emit, want_amax)
        xf, of, direct = _flat_args(x, out)
        rand = _random_bits(xf.numel(), x.device, generator) if rounding == "stochastic" else None
        r = _run_compiled(flags, xf, scale, rand, of, site)
        if r is None:
            r = _eager(flags, xf, scale, rand, of)
        return _shaped_result(r[0], r[1], x, out, direct)

    return _with_out_dtype(run, x, out, out_dtype)


def _with_out_dtype(run, x, out, out_dtype):
    """Count the call, then ``run(out, emit)``: the kernel writes ``out_dtype`` itself where that is exact
    (``_emit_dtype``), else it writes x's dtype and one cast follows."""
    if _COUNTERS:
        _count(x, out_dtype)
    emit = _emit_dtype(x.dtype, out_dtype)
    if out_dtype is None or out_dtype == x.dtype or emit is not None:
        return run(out, emit)
    y, amax = run(None, None)
    return (y.to(out_dtype) if out is None else out.copy_(y)), amax


def _empty_result(x, out, dtype, want_amax):
    y = out if out is not None else torch.empty_like(x, dtype=dtype or x.dtype)
    return y, (torch.zeros((), dtype=torch.float32, device=x.device) if want_amax else None)


def _flat_args(x, out):
    """Detached flat x, and flat ``out`` when the kernel can write it in place (``direct``).

    Flat tensors without a view base: the compiled kernels' guards then see neither the caller's shape nor
    its requires_grad (a weight, an activation and a gradient share one compiled variant).
    """
    xf = x.contiguous().view(-1).detach()
    # an out of another dtype over x's memory would be written while x is still read: result apart, then copied
    direct = out is not None and out.is_contiguous() and (out.dtype == x.dtype or out.data_ptr() != x.data_ptr())
    of = out.view(-1).detach() if direct else None
    if direct and out.data_ptr() == x.data_ptr() and x.is_contiguous():
        of = xf  # in place: one tensor object, which the compiler handles as an input mutation
    return xf, of, direct


def _shaped_result(y, amax, x, out, direct):
    """A kernel's flat result back in x's shape, in ``out`` when one was given (``direct``: written in place)."""
    if direct:
        return out, amax
    if out is not None:
        out.copy_(y.view(x.shape))
        return out, amax
    return y.view(x.shape), amax


def _fp8_body(x, scale, out, *, fmax: float, dtype: torch.dtype, scaled: bool, want_amax: bool,
              out_dtype: torch.dtype | None = None):
    """Saturating FP8 qdq of a flat tensor, optionally scaled (in float32), optionally with max|x|, written
    in ``out_dtype`` (None: x's dtype; see ``_emit_dtype``)."""
    xf = x.float()
    if scaled:
        xf = xf * scale
    y = torch.clamp(xf, -fmax, fmax).to(dtype).float()
    if scaled:
        y = y / scale
    y = _to_out_dtype(y, x.dtype, out_dtype)
    amax = None
    if want_amax:
        mn, mx = torch.aminmax(x)  # one pass; NaN propagates
        amax = torch.maximum(mx.float(), -mn.float())
    if out is not None:
        out.copy_(y)
        y = out
    return y, amax


def _fp8_variant_function(key: tuple, flags: dict):
    """The FP8 kernel of one variant: ``(x, scale, out)``."""
    return _own_code_variant("fp8", _fp8_body, key, flags)


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
                if _checked.get((key, str(x.device))) is not c:  # first call: checked as the HiF8 variants
                    return _checked_first_call("fp8", key, c, lambda x, s, r, o: c(x, s, o),
                                               lambda x, s, r, o: _fp8_body(x, s, o, **flags), x, scale, None, out)
                return c(x, scale, out)
        except Exception as err:  # noqa: BLE001 - any compiler failure means: fall back to eager
            _fp8_compile_failed = " ".join(f"{type(err).__name__}: {err}".split())[:500]
            warnings.warn(f"hif8qat: torch.compile of the FP8 quantizer failed ({_fp8_compile_failed}); "
                          "using the eager implementation from now on", RuntimeWarning, stacklevel=4)
    return _fp8_body(x, scale, out, **flags)


