"""FP8 (E4M3 / E5M2) fake quantization, the per-format scale conventions and the just-in-time scale.

Two references for the casts: torch's own float8 round trip (on its non-saturating range) and an
independent one, the nearest of the format's 256 code values with ties to the even code, computed in
float64 from the value table. Every value check runs through the compiled path and the eager one.
"""

from __future__ import annotations

import math

import pytest
import torch

from hif8qat.formats import kernels as qdq_kernels
from hif8qat.formats import qdq as formats
from hif8qat.formats.qdq import (
    FORMATS,
    HIF8_OVERFLOW,
    clipped_count,
    element_format,
    format_spec,
    fp8_qdq,
    fp8_qdq_scaled,
    fp8_qdq_scaled_amax,
    hif8_qdq_scaled,
    qdq_scaled_amax,
    target_for,
)
from hif8qat.scaling.bank_row import BankedScaler
from hif8qat.scaling.current import current_qdq, current_scale
from hif8qat.scaling.settings import ScalingConfig

FP8 = ["e4m3", "e5m2"]


@pytest.fixture(params=["compiled", "eager"])
def path(request, monkeypatch):
    compiled = request.param == "compiled"
    monkeypatch.setenv("HIF8QAT_COMPILE", "1" if compiled else "0")
    if compiled and formats.compile_status()["failed"]:
        pytest.skip(f"torch.compile unavailable here: {formats.compile_status()['failed']}")
    # the FP8 kernels keep their own compile state: once they fell back to eager (reported as a failure by the
    # case where it happened, below), a "compiled" case would only rerun the eager path
    if compiled and qdq_kernels._fp8_compile_failed:
        pytest.skip(f"the FP8 compile failed earlier in this process: {qdq_kernels._fp8_compile_failed}")
    yield request.param
    if compiled:
        assert qdq_kernels._fp8_compile_failed is None, (
            f"the compiled FP8 path fell back to eager: {qdq_kernels._fp8_compile_failed}")


def all_bf16() -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def nearest_even_reference(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round-to-nearest-even onto the format's finite values, saturating, from the 256-code value table.

    Independent of torch's cast: the codes' values come from viewing the bytes as the float8 dtype (a
    decode, not a rounding); ties go to the code with an even mantissa (even byte). float64 throughout.
    """
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(FORMATS[fmt].dtype).double()
    keep = torch.isfinite(vals) & ~((vals == 0) & (codes >= 128))  # one zero, no NaN/inf
    vals, codes = vals[keep], codes[keep].int()
    order = torch.argsort(vals)
    vals, codes = vals[order], codes[order]
    xd = x.double().clamp(vals[0].item(), vals[-1].item())  # saturate (inf too)
    hi = torch.searchsorted(vals, xd).clamp(1, len(vals) - 1)
    lo = hi - 1
    dlo, dhi = xd - vals[lo], vals[hi] - xd
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0))
    out = torch.where(pick_hi, vals[hi], vals[lo])
    out = torch.where(out == 0, torch.copysign(torch.zeros_like(out), xd), out)  # IEEE: zero keeps x's sign
    return torch.where(torch.isnan(x.double()), x.double(), out)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN, and the same sign of zero."""
    a, b = a.double(), b.double()
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])
                and torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan])))


# ---------------------------------------------------------------------------------------------------
# casts


@pytest.mark.parametrize("fmt", FP8)
def test_every_bf16_pattern_matches_torchs_cast_inside_the_range(fmt, path):
    x = all_bf16()
    y = fp8_qdq(x, fmt)
    assert y.dtype == torch.bfloat16
    inside = torch.isfinite(x) & (x.float().abs() <= FORMATS[fmt].max)
    torch_rt = x[inside].to(FORMATS[fmt].dtype).to(torch.bfloat16)
    assert torch.equal(y[inside].view(torch.int16), torch_rt.view(torch.int16))  # bit for bit, -0 included
    assert same(y, nearest_even_reference(x, fmt))  # all 65,536 patterns, NaN and saturation included


@pytest.mark.parametrize("fmt", FP8)
def test_saturation_clips_to_max_and_keeps_nan(fmt, path):
    m = FORMATS[fmt].max
    x = all_bf16()
    y = fp8_qdq(x, fmt).float()
    xf = x.float()
    over = xf.abs() > m  # includes +-inf
    assert over.sum() > 0
    assert torch.equal(y[over], torch.sign(xf[over]) * m)
    assert torch.isnan(y[torch.isnan(xf)]).all()
    edge = torch.tensor([m, -m, math.inf, -math.inf, 2 * m, 1e30], dtype=torch.float32)
    assert fp8_qdq(edge, fmt).tolist() == [m, -m, m, -m, m, m]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", FP8)
def test_float32_and_float16_inputs_round_to_nearest_even(fmt, dtype, path):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.float32:  # random bit patterns: every exponent, NaN/inf included
        x = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int32).view(torch.float32)
    else:
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    y = fp8_qdq(x, fmt)
    assert y.dtype == dtype
    assert same(y, nearest_even_reference(x, fmt))


@pytest.mark.parametrize("fmt", FP8)
def test_scaled_and_amax_equal_the_manual_computation(fmt, path):
    g = torch.Generator().manual_seed(1)
    spec = FORMATS[fmt]
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3000, 7, generator=g) * 30).to(dtype)
        for s in (0.37, 16.0, torch.tensor(5.5)):
            manual = ((x.float() * float(s)).clamp(-spec.max, spec.max).to(spec.dtype).float() / float(s)).to(dtype)
            assert torch.equal(fp8_qdq_scaled(x, s, fmt), manual)
            y, amax = fp8_qdq_scaled_amax(x, s, fmt)
            assert torch.equal(y, manual)
            assert amax.dtype == torch.float32 and amax.item() == x.float().abs().max().item()
            buf = torch.empty_like(x)
            y2, _ = fp8_qdq_scaled_amax(x, s, fmt, out=buf)
            assert y2 is buf and torch.equal(buf, manual)
        t = x.t()  # non-contiguous input and output
        assert torch.equal(fp8_qdq_scaled(t, 2.0, fmt), fp8_qdq_scaled(t.contiguous(), 2.0, fmt))
        xc = x.clone()
        fp8_qdq(xc, fmt, out=xc)  # in place
        assert torch.equal(xc, fp8_qdq(x, fmt))


def test_empty_and_bad_arguments():
    y, amax = fp8_qdq_scaled_amax(torch.zeros(0), 1.0, "e4m3")
    assert y.numel() == 0 and amax.item() == 0
    with pytest.raises(ValueError, match="e4m3"):
        fp8_qdq(torch.ones(3), "e3m4")
    with pytest.raises(ValueError, match="hif8_"):
        fp8_qdq(torch.ones(3), "hif8")
    with pytest.raises(ValueError, match="scale"):
        fp8_qdq_scaled(torch.ones(3), 0.0, "e5m2")
    with pytest.raises(ValueError, match="dtype"):
        fp8_qdq(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="HiF8-only"):
        qdq_scaled_amax(torch.ones(3), 1.0, "e4m3", "stochastic")


def test_qdq_scaled_amax_dispatches_on_the_format():
    x = torch.randn(500) * 100
    assert torch.equal(qdq_scaled_amax(x, 3.0, "e5m2")[0], fp8_qdq_scaled(x, 3.0, "e5m2"))
    assert torch.equal(qdq_scaled_amax(x, 3.0, "hif8")[0], hif8_qdq_scaled(x, 3.0))
    sat = qdq_scaled_amax(torch.tensor([1e5]), 1.0, "hif8", saturate=True)[0]
    assert sat.item() == formats.HIF8_MAX


# ---------------------------------------------------------------------------------------------------
# clipped values per call


def test_clipped_counts_equal_manual_counts():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20000, generator=g) * 300
    x[:3] = torch.tensor([math.nan, math.inf, -math.inf])
    for fmt, s in (("e4m3", 2.0), ("e5m2", 300.0), ("hif8", 300.0)):
        spec = FORMATS[fmt]
        ax = (x.double() * s).abs()
        manual = int((ax >= HIF8_OVERFLOW).sum()) if fmt == "hif8" else int((ax > spec.max).sum())
        got = clipped_count(x, s, fmt)
        assert got.dtype == torch.int64 and got.item() == manual and manual > 2
    # the HiF8 count is exactly the values that overflow to inf
    y = hif8_qdq_scaled(x[3:], 300.0)
    assert clipped_count(x[3:], 300.0, "hif8").item() == int(torch.isinf(y).sum())
    # FP8: a value exactly at max is not clipped, the next float32 above it is
    m = FORMATS["e4m3"].max
    m32 = torch.tensor(m, dtype=torch.float32)
    edge = torch.stack((m32, torch.nextafter(m32, torch.tensor(math.inf))))
    assert clipped_count(edge, 1.0, "e4m3").item() == 1


# ---------------------------------------------------------------------------------------------------
# scale conventions


def test_format_targets_follow_each_formats_convention():
    assert format_spec("e4m3").target() == 448.0 and format_spec("e4m3").target(2) == 112.0
    assert format_spec("e5m2").target(1) == 28672.0
    assert format_spec("hif8").target() == 15.0
    with pytest.raises(ValueError, match="FP8 formats only"):
        format_spec("hif8").target(1)
    with pytest.raises(ValueError, match="margin"):
        format_spec("e4m3").target(-1)
    assert [element_format("hybrid", r) for r in "AWG"] == ["e4m3", "e4m3", "e5m2"]
    assert [element_format("e5m2", r) for r in "AWG"] == ["e5m2"] * 3
    with pytest.raises(ValueError, match="role"):
        element_format("hybrid", "X")


def test_target_for_each_role():
    hif8 = ScalingConfig(target_fwd=12.0, target_bwd=7.0)
    assert [target_for(hif8, r) for r in "AWG"] == [12.0, 12.0, 7.0]
    hybrid = ScalingConfig(format="hybrid", margin=1)
    assert [target_for(hybrid, r) for r in "AWG"] == [224.0, 224.0, 28672.0]
    assert target_for(ScalingConfig(format="e4m3"), "G") == 448.0


def test_current_scale_equals_manual_amax_scaling():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g).to(torch.bfloat16) * 37
    amax = x.float().abs().max()
    for target in (15.0, 448.0, 57344.0 / 4):
        s = current_scale(amax, target)
        assert s.dtype == torch.float32 and s.shape == ()
        assert s.item() == torch.tensor(target / (amax.double().item() + 1e-12), dtype=torch.float32).item()
    # a non-finite or non-positive amax falls back to amax 1 (scale = target), like the cold start
    for bad in (0.0, -1.0, math.inf, math.nan):
        assert current_scale(bad, 448.0).item() == 448.0
    with pytest.raises(ValueError, match="target"):
        current_scale(amax, 0.0)


@pytest.mark.parametrize("fmt,target", [("hif8", 15.0), ("e4m3", 448.0), ("e5m2", 57344.0)])
def test_current_qdq_scales_each_tensor_from_its_own_amax(fmt, target):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 33, generator=g) * 1e-3
    y, amax, s = current_qdq(x, fmt, target)
    assert amax.item() == x.abs().max().item()
    assert s.item() == current_scale(x.abs().max(), target).item()
    assert torch.equal(y, qdq_scaled_amax(x, s, fmt)[0])
    # the largest element is scaled onto the target, a value of the format: it comes back (nearly) exact
    i = x.abs().argmax()
    assert abs(y.view(-1)[i].item() - x.view(-1)[i].item()) <= 1e-6 * abs(x.view(-1)[i].item())
    assert clipped_count(x, s * 1.01, fmt).item() == (0 if fmt == "hif8" else 1)  # FP8 has no headroom


def test_current_scale_is_the_delayed_scalers_cold_start():
    """The oracle and the first call of a delayed scaler pick the same scale from the same amax:
    float32(15 / (amax + 1e-12)) computed in float64."""
    x = torch.randn(257) * 5
    scaler = BankedScaler.standalone("A", ScalingConfig())
    scaler.quantize(x)
    want = torch.tensor(15.0 / (x.abs().max().item() + 1e-12), dtype=torch.float64).to(torch.float32).item()
    assert scaler.scale.item() == current_scale(x.abs().max(), 15.0).item() == want


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP8)
def test_cuda_matches_the_reference_on_every_bf16_pattern(fmt, path):
    """CUDA's plain cast of out-of-range values differs from the CPU's; the saturating qdq must not."""
    x = all_bf16()
    y = fp8_qdq(x.cuda(), fmt).cpu()
    assert same(y, nearest_even_reference(x, fmt))
    xs = torch.randn(1 << 16, generator=torch.Generator().manual_seed(5)) * 1000
    y2, amax = fp8_qdq_scaled_amax(xs.cuda(), torch.tensor(0.7, device="cuda"), fmt)
    assert torch.equal(y2.cpu(), fp8_qdq_scaled(xs, 0.7, fmt)) and amax.item() == xs.abs().max().item()
    assert clipped_count(xs.cuda(), 0.7, fmt).item() == clipped_count(xs, 0.7, fmt).item()


def test_a_failing_fp8_compile_falls_back_to_eager_and_leaves_hif8_compiled(monkeypatch):
    monkeypatch.setenv("HIF8QAT_COMPILE", "1")
    monkeypatch.setattr(qdq_kernels, "_fp8_compile_failed", None)  # the compile state lives with the kernels

    def broken(*args, **kwargs):
        raise RuntimeError("no float8 conversion on this backend")

    monkeypatch.setattr(qdq_kernels, "_fp8_variant_function", lambda key, flags: broken)
    monkeypatch.setattr(qdq_kernels, "_compiled", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    x = torch.randn(4096) * 100
    with pytest.warns(RuntimeWarning, match="FP8 quantizer failed"):
        y = fp8_qdq(x, "e4m3")
    assert torch.equal(y, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert formats.compile_status()["failed"] is None  # HiF8's compiled path is untouched


# ---------------------------------------------------------------------------------------------------
# out_dtype: the kernel writes the caller's compute dtype itself


def _varied(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(21)
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 16, (4096,), generator=g).float())
    x[:6] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e30])
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _check_out_dtype(fmt, x_dtype, out_dtype):
    x = _varied(x_dtype)
    want, want_amax = qdq_scaled_amax(x, 0.37, fmt)
    want = want.to(out_dtype)  # the old formulation: quantize in x's dtype, then cast
    got, amax = qdq_scaled_amax(x, 0.37, fmt, out_dtype=out_dtype)
    buf = torch.empty_like(x, dtype=out_dtype)
    got_out, _ = qdq_scaled_amax(x, 0.37, fmt, out=buf, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got_out is buf
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(_bits(buf), _bits(want))
    assert same(amax, want_amax)


@pytest.mark.parametrize("fmt", ["hif8", "e4m3"])
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float16, torch.bfloat16)])
def test_out_dtype_is_bitwise_the_cast_of_the_result(fmt, x_dtype, out_dtype, path):
    _check_out_dtype(fmt, x_dtype, out_dtype)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hif8", "e4m3", "e5m2"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_dtype_is_bitwise_the_cast_of_the_result_every_pair(fmt, x_dtype, out_dtype, path):
    _check_out_dtype(fmt, x_dtype, out_dtype)


def test_out_dtype_arguments_are_checked():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="out_dtype must be"):
        qdq_scaled_amax(x, 1.0, "hif8", out_dtype=torch.int32)
    with pytest.raises(ValueError, match="out must be a tensor with out_dtype"):
        qdq_scaled_amax(x, 1.0, "e4m3", out=torch.empty(8), out_dtype=torch.bfloat16)
