"""The in-place BF16 rounding (hif8qat.formats.bf16) against the definition of rounding to the nearest BF16 value,
ties to even, worked out in float64 from the two BF16 neighbours of each float32: every sign, exponent and upper
mantissa (all 65,536 upper halves) with the low halves that decide a rounding (zero, just below, at and just above
the midpoint, the extremes), so NaN, infinities, subnormals, overflow and every tie are covered."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hif8qat.formats import bf16

LOW_HALVES = (0x0000, 0x0001, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF)


def every_deciding_float32() -> torch.Tensor:
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    bits = (upper[:, None] | np.array(LOW_HALVES, dtype=np.uint32)[None, :]).reshape(-1)
    return torch.from_numpy(bits.view(np.float32).copy())


def nearest_bf16_by_definition(x: torch.Tensor) -> torch.Tensor:
    """The BF16 value nearest each float32 (ties to the one with an even last mantissa bit), in float32: the two
    neighbours are the float32 with its low 16 bits cleared and the next BF16 magnitude above it (2^128 past the
    largest finite one, which then reads as infinity), compared in exact float64 arithmetic."""
    v = x.numpy()
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and infinities pass through; 2^128 becomes infinity
        bits = v.view(np.uint32).astype(np.int64)
        below = (bits & 0x7FFF0000).astype(np.uint32)
        below_value = below.view(np.float32).astype(np.float64)
        exponent = np.maximum(below >> 23, 1).astype(np.int64)
        above_value = below_value + np.ldexp(1.0, exponent - 127 - 7)  # one unit in BF16's last mantissa place
        magnitude = np.abs(v.astype(np.float64))
        to_below, to_above = magnitude - below_value, above_value - magnitude
        odd = ((below >> 16) & 1) == 1
        up = (to_above < to_below) | ((to_above == to_below) & odd)
        rounded = np.where(up, above_value, below_value)
        out = np.where(bits >> 31 == 1, -rounded, rounded).astype(np.float32)
    out[np.isnan(v)] = np.nan
    return torch.from_numpy(out)


def assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    # bit for bit elsewhere: -0.0 and 0.0 differ
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_in_place_rounding_gives_the_nearest_bf16_of_every_deciding_float32():
    x = every_deciding_float32()
    assert x.numel() > bf16.SLICE_NUMEL  # several slices
    want = nearest_bf16_by_definition(x)
    rounded = x.clone()
    assert bf16.round_bf16_(rounded) is rounded
    assert_same_values(rounded, want)
    transposed = x.clone().view(-1, 8).t()  # not contiguous: rounded whole, in place all the same
    assert bf16.round_bf16_(transposed) is transposed
    assert_same_values(transposed, want.view(-1, 8).t())


def test_torch_cast_agrees_with_the_definition_on_normal_values():
    """What the emulation's other roundings use (x.to(bfloat16)): rounding to nearest, ties to even, as defined."""
    x = every_deciding_float32()
    normal = torch.isnan(x) | torch.isinf(x) | (x.abs() >= torch.finfo(torch.float32).tiny) | (x == 0)
    assert_same_values(x[normal].to(torch.bfloat16).float(), nearest_bf16_by_definition(x[normal]))


def test_in_place_rounding_refuses_a_tensor_autograd_records_and_other_dtypes():
    with pytest.raises(ValueError, match="autograd"):
        bf16.round_bf16_(torch.zeros(4, requires_grad=True))
    with pytest.raises(ValueError, match="float32"):
        bf16.round_bf16_(torch.zeros(4, dtype=torch.bfloat16))
    with torch.no_grad():
        assert torch.equal(bf16.round_bf16_(torch.full((3,), 1 + 2 ** -9, requires_grad=True)), torch.ones(3))
