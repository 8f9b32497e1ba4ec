"""Compute numerics of a training step or an evaluation: BF16 (native or emulated) over FP32 weights, or FP32.

``train.autocast`` (and ``eval.dtype``, which follows it by default) takes:

- ``bf16``: ``torch.autocast(bfloat16)`` over FP32 master weights, the paper's numerics. Fast where the device
  has native BF16 (CUDA; CPUs with AVX512-BF16 or AMX). On a CPU without it (AVX2 only: most laptops) torch
  runs BF16 GEMMs through a slow path: a SmolLM2-135M step took 30x the FP32 time.
- ``bf16_emulated``: what a BF16 GEMM with FP32 accumulation computes, at about FP32 cost: every GEMM that
  autocast would run in BF16 (linear, matmul, bmm, mm, scaled-dot-product attention) gets its operands
  rounded to BF16, runs in FP32, and has its result rounded to BF16; in backward the incoming gradient and
  the operand gradients are rounded the same way. Tensors stay float32 (holding BF16 values), so the
  elementwise ops between GEMMs run in FP32 where native autocast runs some of them in BF16: the only
  difference from ``bf16`` besides summation order. A GEMM that meets BF16 tensors outside autocast (the
  quantized linear casts its operands itself, in forward and backward) is computed in FP32 from them and
  its result cast to BF16, which is exactly what the BF16 kernel returns up to summation order.
  Regions where a model turns autocast off (rotary position angles) stay FP32, as under native autocast.
- ``auto``: ``bf16`` where the device has native BF16, else ``bf16_emulated``.
- ``none``: FP32, no autocast.

``auto`` is resolved before a run folder is made, so ``config_resolved.yaml`` records the numerics used and a
finished run made with other numerics is neither reused nor paired with this one. Set
``HIF8QAT_NO_NATIVE_BF16=1`` to treat the machine as one without native BF16 (``auto`` then emulates): how the
emulated path is measured and tested on a machine that has native BF16.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .config import NUMERICS as SETTINGS  # train.autocast: auto, bf16, bf16_emulated, none

RESOLVED = tuple(s for s in SETTINGS if s != "auto")
NO_NATIVE_BF16_ENV = "HIF8QAT_NO_NATIVE_BF16"
_BF16 = torch.bfloat16


def native_bf16_supported(device_type: str) -> bool:
    """Whether BF16 GEMMs run natively (fast) on this kind of device here."""
    if os.environ.get(NO_NATIVE_BF16_ENV, "") not in ("", "0"):
        return False
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def resolve(setting: str, device_type: str) -> str:
    """The concrete numerics (one of RESOLVED) for a setting (one of SETTINGS) on a device type."""
    if setting not in SETTINGS:
        raise ValueError(f"numerics must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if setting == "auto":
        return "bf16" if native_bf16_supported(device_type) else "bf16_emulated"
    return setting


def describe(numerics: str, device_type: str) -> dict[str, Any]:
    """What a result file records about the numerics it was made with."""
    info: dict[str, Any] = {"numerics": numerics, "device_type": device_type,
                            "native_bf16": native_bf16_supported(device_type)}
    if device_type == "cpu":
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


# --------------------------------------------------------------------------------------------------
# BF16 emulation
# --------------------------------------------------------------------------------------------------
def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor holding x rounded to the nearest BF16 value (ties to even, as the cast does)."""
    return x.to(_BF16).to(torch.float32)


class _EmulatedLinear(torch.autograd.Function):
    """y = bf16(bf16(x) bf16(W)^T + bf16(b)) computed in FP32; backward rounds g and each gradient likewise."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        xr, wr = round_bf16(x), round_bf16(weight)
        br = None if bias is None else round_bf16(bias)
        ctx.save_for_backward(xr, wr)
        ctx.has_bias = bias is not None
        return round_bf16(F.linear(xr, wr, br))

    @staticmethod
    def backward(ctx, grad):
        xr, wr = ctx.saved_tensors
        g = round_bf16(grad)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = round_bf16(g.matmul(wr))
        if ctx.needs_input_grad[1]:
            dw = round_bf16(g.reshape(-1, g.shape[-1]).t().matmul(xr.reshape(-1, xr.shape[-1])))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = round_bf16(g.reshape(-1, g.shape[-1]).sum(0))
        return dx, dw, db


class _EmulatedOp(torch.autograd.Function):
    """Any other GEMM-like op (matmul, bmm, attention): rounded operands, FP32 op, rounded result; backward
    recomputes the op in FP32 from the rounded operands (cheaper in memory than keeping its graph) and
    rounds the incoming and outgoing gradients."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        rounded = [round_bf16(t) for t in tensors]
        ctx.fn = fn
        ctx.save_for_backward(*rounded)
        return round_bf16(fn(*rounded))

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, round_bf16(grad)))
        return (None, *(round_bf16(next(grads)) if t.requires_grad else None for t in inputs))


# The functions native CPU/CUDA autocast runs in BF16 that a causal LM calls (HF Llama-style models use
# F.linear, F.scaled_dot_product_attention, and matmul in eager attention).
_LINEAR = {F.linear}
_OTHER_GEMMS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
                torch.bmm, torch.Tensor.bmm, F.scaled_dot_product_attention}


def _is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class BF16Emulation(TorchFunctionMode):
    """Runs BF16 GEMMs as FP32 GEMMs on BF16 values (see the module doc)."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _LINEAR and func not in _OTHER_GEMMS:
            return func(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if any(t.dtype == _BF16 for t in tensors):
            # BF16 operands outside autocast (the quantized linear's own casts): FP32 GEMM, BF16 result.
            up = [a.float() if isinstance(a, torch.Tensor) and a.dtype == _BF16 else a for a in args]
            kw = {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == _BF16 else v for k, v in kwargs.items()}
            return func(*up, **kw).to(_BF16)
        if not torch.is_autocast_enabled(self.device_type) or not all(t.dtype == torch.float32 for t in tensors):
            return func(*args, **kwargs)  # an FP32 region of the model (or a dtype autocast leaves alone)
        with torch.autocast(self.device_type, enabled=False):
            if func in _LINEAR:
                x, weight, bias = _linear_args(args, kwargs)
                if not torch.is_grad_enabled():  # evaluation: each weight is rounded once, not once per call
                    b = None if bias is None else _rounded_weight(bias)
                    return round_bf16(F.linear(round_bf16(x), _rounded_weight(weight), b))
                return _EmulatedLinear.apply(x, weight, bias)
            positions = [i for i, a in enumerate(args) if _is_float_tensor(a)]

            def call(*tensor_values, _args=args, _kwargs=kwargs, _pos=positions, _func=func):
                full = list(_args)
                for i, value in zip(_pos, tensor_values):
                    full[i] = value
                return _func(*full, **_kwargs)

            return _EmulatedOp.apply(call, *(args[i] for i in positions))


_ROUNDED_ATTR = "_hif8qat_bf16_rounded"  # on a parameter: ((version, data_ptr) when rounded, the rounded copy)


def _rounded_weight(weight: torch.Tensor) -> torch.Tensor:
    """round_bf16(weight), kept while the weight is unchanged: an evaluation calls each linear hundreds of times."""
    if not isinstance(weight, torch.nn.Parameter):
        return round_bf16(weight)
    key = (weight._version, weight.data_ptr())  # an in-place update bumps the version; `.data = ...` moves the data
    cached = getattr(weight, _ROUNDED_ATTR, None)
    if cached is None or cached[0] != key:
        cached = (key, round_bf16(weight.detach()))
        setattr(weight, _ROUNDED_ATTR, cached)
    return cached[1]


def _linear_args(args, kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    names = ("input", "weight", "bias")
    values = list(args) + [None] * (3 - len(args))
    for i, name in enumerate(names):
        if name in kwargs:
            values[i] = kwargs[name]
    return values[0], values[1], values[2]


def forward_context(numerics: str, device_type: str) -> contextlib.AbstractContextManager:
    """Around a forward pass (training step, held-out loss, evaluation)."""
    if numerics == "none":
        return contextlib.nullcontext()
    if numerics == "bf16":
        return torch.autocast(device_type=device_type, dtype=_BF16)
    if numerics == "bf16_emulated":
        return _stacked(BF16Emulation(device_type), torch.autocast(device_type=device_type, dtype=_BF16))
    raise ValueError(f"numerics must be one of {', '.join(RESOLVED)}, got {numerics!r}")


def backward_context(numerics: str, device_type: str) -> contextlib.AbstractContextManager:
    """Around loss.backward(): the emulation must also see the GEMMs a custom backward runs on BF16 tensors."""
    if numerics == "bf16_emulated":
        return BF16Emulation(device_type)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _stacked(*managers: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield



def training_device_type(device_setting: str) -> str:
    """The device type a training with ``train.device`` runs on (as train.setup_distributed picks it)."""
    return "cuda" if device_setting != "cpu" and torch.cuda.is_available() else "cpu"


def resolve_run(cfg):
    """The RunConfig with ``train.autocast`` resolved for its training device, so the saved config names the
    numerics actually used."""
    import dataclasses

    numerics = resolve(cfg.train.autocast, training_device_type(cfg.train.device))
    if numerics == cfg.train.autocast:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, autocast=numerics))


def main() -> int:
    """``python -m hif8qat.numerics``: what ``train.autocast=auto`` means on this machine."""
    device_type = training_device_type("auto")
    info = describe(resolve("auto", device_type), device_type)
    print(info["numerics"])
    note = "native BF16" if info["native_bf16"] else "no native BF16: BF16 is emulated at about FP32 speed"
    print(f"# {device_type}, {info.get('cpu_capability', '')}: {note}", file=__import__("sys").stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
