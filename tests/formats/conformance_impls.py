"""HiF8 implementations for the conformance checker's tests, named to it as ``conformance_impls:FUNC``.

Built on en_dtypes, never on this package's codec: a faithful pair that must pass, and two faulty ones modelled on
mistakes seen in public HiF8 code (a decoder that adds the sign instead of multiplying by it; an encoder that
saturates at the largest finite value where HiF8 overflows to inf), plus callables that misbehave as callables.
"""

from __future__ import annotations

import math

import en_dtypes
import numpy as np
import torch

HIF8_MAX = 32768.0
NOT_CALLABLE = 42


def faithful_decode(codes: np.ndarray) -> np.ndarray:
    return codes.view(en_dtypes.hifloat8).astype(np.float32)


def faithful_encode(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # numpy warns on casting NaN to en_dtypes' type; it becomes 0x80
        return x.astype(en_dtypes.hifloat8)  # the checker reads an 8-bit float array as its byte codes


def sign_added_decode(codes: np.ndarray) -> np.ndarray:
    """sign + magnitude instead of sign * magnitude, and no special codes: 0x80 reads as a zero magnitude and the
    inf codes as their fields (1.5 * 2^15), which en_dtypes cannot give, so they are filled in by hand."""
    body = (codes & 0x7F).view(en_dtypes.hifloat8).astype(np.float64)
    body[np.isinf(body)] = 1.5 * 2.0**15
    sign = np.where(codes & 0x80, -1.0, 1.0)
    return np.where(body == 0, 0.0, sign + body)


def saturating_encode(x: np.ndarray) -> np.ndarray:
    """Clamps to +-32768 first, so 40960, 49152 and inf all become +-32768 (NaN stays NaN)."""
    return faithful_encode(np.clip(x, -HIF8_MAX, HIF8_MAX)).view(np.uint8)


def torch_only_decode(codes: torch.Tensor) -> torch.Tensor:
    if not isinstance(codes, torch.Tensor):
        raise TypeError("torch tensors only")
    return torch.from_numpy(faithful_decode(codes.numpy()))


def raising_on_nan_encode(x) -> np.ndarray:
    if any(math.isnan(float(v)) for v in x):
        raise ValueError("NaN is not supported")
    return faithful_encode(np.asarray(x))


def two_dimensional_decode(codes: np.ndarray) -> np.ndarray:
    return faithful_decode(codes).reshape(-1, 1)


def text_decode(codes: np.ndarray) -> np.ndarray:
    return faithful_decode(codes).astype(str)


def bfloat16_tensor_decode(codes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(faithful_decode(codes)).to(torch.bfloat16)  # every HiF8 value is a bfloat16 value


def float8_tensor_encode(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(faithful_encode(x).view(np.uint8)).view(torch.float8_e4m3fn)  # the bytes, retyped


def other_nan_decode(codes: np.ndarray) -> np.ndarray:
    values = faithful_decode(codes)
    values[np.isnan(values)] = np.array([0xFFC00001], dtype=np.uint32).view(np.float32)  # negative, other payload
    return values


def negative_zero_decode(codes: np.ndarray) -> np.ndarray:
    values = faithful_decode(codes)
    values[values == 0] = -0.0
    return values
