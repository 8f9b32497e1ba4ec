"""Compute numerics of a training step or an evaluation: BF16 (native or emulated) over FP32 weights, or FP32.

This module owns the values of ``train.autocast`` (and ``eval.dtype``, which follows it by default): ``bf16``,
``bf16_emulated``, ``auto`` and ``none`` (:func:`resolve` says what each computes), whether a device has
native BF16, the BF16 emulation itself (rounding, emulated GEMMs, the mode that applies them) and the contexts
a forward, a backward and an activation-checkpointing recompute run in. ``auto`` is resolved before a run
folder is made, so ``config_resolved.yaml`` records the numerics used and a finished run made with other
numerics is neither reused nor paired with this one. Set ``HIF8QAT_NO_NATIVE_BF16=1`` to treat the machine as
one without native BF16 (``auto`` then emulates): how the emulated path is measured and tested on a machine
that has it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hif8qat.formats.bf16 import round_bf16, round_bf16_
from hif8qat.scaling.autograd_engine import tensor_version

# The values of train.autocast (the run configuration checks it against these; evaluation's eval.dtype takes the
# same names): auto = native BF16 autocast where the device has it, else BF16 emulated. Resolved, the value is a
# :class:`Numerics`, named ``numerics`` wherever it is passed.
SETTINGS = ("auto", "bf16", "bf16_emulated", "none")
RESOLVED = tuple(s for s in SETTINGS if s != "auto")
NO_NATIVE_BF16_ENV = "HIF8QAT_NO_NATIVE_BF16"
_BF16 = torch.bfloat16


def native_bf16_supported(device_type: str) -> bool:
    """Whether BF16 GEMMs run natively (fast) on this kind of device here.

    Args:
        device_type: "cpu" or "cuda".

    Returns:
        True when native.
    """
    if os.environ.get(NO_NATIVE_BF16_ENV, "") not in ("", "0"):
        return False
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        return _cpu_bf16_kernels_native()
    return False


def _cpu_bf16_kernels_native() -> bool:
    """Adapter: whether torch's oneDNN BF16 kernels run natively on this CPU (AVX512-BF16 or AMX). Torch answers
    only through a private op; ``torch.backends.cpu.get_cpu_capability`` names the vector ISA, not BF16 support."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve(setting: str, device_type: str) -> str:
    """The concrete mode (one of RESOLVED) of a ``train.autocast`` setting (one of SETTINGS) on a device type. The
    pipeline calls it once per run, when its configuration is made (``hif8qat.config.numerics``).

    The settings: ``bf16``, ``torch.autocast(bfloat16)`` over FP32 master weights, the paper's numerics; fast
    where the device has native BF16 (CUDA; CPUs with AVX512-BF16 or AMX); on a CPU without it (AVX2 only:
    most laptops) torch runs BF16 GEMMs through a slow path (a SmolLM2-135M step took 30x the FP32 time).
    ``bf16_emulated``, what a BF16 GEMM with FP32 accumulation computes, at about FP32 cost: every GEMM that
    autocast would run in BF16 (linear, matmul, bmm, mm, scaled-dot-product attention) gets its operands
    rounded to BF16, runs in FP32, and has its result rounded to BF16; in backward the incoming gradient and
    the operand gradients are rounded the same way. Tensors stay float32 (holding BF16 values), so the
    elementwise ops between GEMMs run in FP32 where native autocast runs some of them in BF16: the only
    difference from ``bf16`` besides summation order. A GEMM that meets BF16 tensors outside autocast (the
    quantized linear casts its operands itself) is computed in FP32 from them and its result cast to BF16,
    exactly what the BF16 kernel returns up to summation order; regions where a model turns autocast off
    (rotary position angles) stay FP32, as under native autocast. ``auto``, ``bf16`` where the device has
    native BF16, else ``bf16_emulated``. ``none``, FP32, no autocast.

    Args:
        setting: one of SETTINGS.
        device_type: "cpu" or "cuda".

    Returns:
        ``bf16``, ``bf16_emulated`` or ``none``.
    """
    if setting not in SETTINGS:
        raise ValueError(f"autocast must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if setting == "auto":
        return "bf16" if native_bf16_supported(device_type) else "bf16_emulated"
    return setting


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Resolved compute numerics: ``mode`` one of RESOLVED (never ``auto``) on ``device_type``. What a forward, a
    backward, an activation-checkpointing recompute and a result file need of the numerics, from one value that
    the pipeline makes once per run (``hif8qat.config.numerics``) and hands to whatever runs the model."""

    mode: str
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.mode not in RESOLVED:
            raise ValueError(f"numerics must be one of {', '.join(RESOLVED)}, got {self.mode!r}")

    @property
    def emulates_bf16(self) -> bool:
        """Whether BF16 GEMMs run emulated in FP32 (the quantized layers are told so when converted)."""
        return self.mode == "bf16_emulated"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the GEMMs compute in under autocast (None: FP32, no autocast)."""
        return None if self.mode == "none" else _BF16

    @property
    def gemm_operand_dtype(self) -> torch.dtype:
        """The dtype a GEMM's operands have under :meth:`forward`: BF16 where it is computed natively; FP32 where it
        is emulated (operands rounded to BF16 values, multiplied in FP32) and with no autocast. A benchmark timing
        the machine's GEMMs times them in this dtype (a BF16 GEMM on a CPU without native BF16 takes a slow path)."""
        return _BF16 if self.mode == "bf16" else torch.float32

    def forward(self) -> contextlib.AbstractContextManager:
        """Around a forward pass (training step, held-out loss, evaluation).

        Returns:
            The context manager (:func:`forward_context` of these numerics).
        """
        return forward_context(self.mode, self.device_type)

    def backward(self) -> contextlib.AbstractContextManager:
        """Around loss.backward().

        Returns:
            The context manager (:func:`backward_context` of these numerics).
        """
        return backward_context(self.mode, self.device_type)

    def optimizer_step(self, keep_casts: bool = True) -> contextlib.AbstractContextManager:
        """Around all the forwards and backwards of one optimizer step (every micro-batch).

        Args:
            keep_casts: keep each weight's cast for the whole step (False where the weights are gathered and freed
                per use, as under FSDP, or recomputed, as under activation checkpointing).

        Returns:
            The context manager (:func:`keeping_weight_casts`, or one that does nothing).
        """
        return keeping_weight_casts() if keep_casts else contextlib.nullcontext()

    def checkpoint_kwargs(self) -> dict[str, Any]:
        """Arguments under which an activation-checkpointing recompute runs with these numerics.

        Returns:
            Keyword arguments for ``torch.utils.checkpoint.checkpoint`` (:func:`checkpoint_kwargs`).
        """
        return checkpoint_kwargs(self.mode, self.device_type)

    def describe(self) -> dict[str, Any]:
        """What a result file records about these numerics.

        Returns:
            ``{"numerics", "device_type", ...}`` (:func:`describe`).
        """
        return describe(self.mode, self.device_type)


def describe(mode: str, device_type: str) -> dict[str, Any]:
    """What a result file records about the numerics it was made with (the key ``numerics``, as files have it).

    Args:
        mode: the resolved mode (one of RESOLVED).
        device_type: "cpu" or "cuda".

    Returns:
        ``{"numerics", "device_type", ...}``.
    """
    info: dict[str, Any] = {"numerics": mode, "device_type": device_type,
                            "native_bf16": native_bf16_supported(device_type)}
    if device_type == "cpu":
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


# --------------------------------------------------------------------------------------------------
# BF16 emulation
# --------------------------------------------------------------------------------------------------
def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to BF16 and returned in ``dtype`` (BF16 itself, or float32 holding BF16 values)."""
    return x.to(_BF16) if dtype == _BF16 else round_bf16(x)


def _round_result_to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A GEMM's result rounded to BF16 in ``dtype``: in place where autograd does not record it (an evaluation's
    logits are the largest tensor it makes; rounded in place, no copy of them is allocated). The GEMM ran on the
    emulation's own rounded copies of its operands, so a result that is a view shares memory only with those."""
    if dtype == torch.float32 and y.dtype == torch.float32 and not torch.is_grad_enabled():
        return round_bf16_(y)
    return _round_to(y, dtype)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """BF16 values as float32 (exact); float32 rounded to BF16 values."""
    return x.float() if x.dtype == _BF16 else round_bf16(x)


# The emulation is plain differentiable torch: round (x.to(bf16).to(fp32)), an FP32 op, round. Autograd then
# rounds each incoming and outgoing gradient to BF16 (the backward of a cast casts the gradient) and runs the
# op's backward in FP32: nothing in a backward, nor in an activation-checkpointing recompute, depends on a mode
# being active, and torch.compile traces it without a graph break.
def emulated_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A BF16 GEMM with FP32 accumulation computed in FP32 (no gradient): for code that runs its own GEMMs on BF16
    operands, such as the quantized linear's backward.

    Args:
        a: the left operand (BF16 values).
        b: the right operand (BF16 values).
        out_dtype: the result's dtype.

    Returns:
        ``a @ b``, rounded to BF16 and cast to ``out_dtype``.
    """
    with torch.autocast(a.device.type, enabled=False):
        return _round_to(_fp32(a).matmul(_fp32(b)), _BF16).to(out_dtype)


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on BF16 operands computed in FP32 with a BF16 result (no gradient: the quantized linear's forward).

    Args:
        x: the input (BF16 values).
        weight: the weight (BF16 values).
        bias: the bias, or None.

    Returns:
        The BF16 result.
    """
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(_fp32(x), _fp32(weight), None if bias is None else _fp32(bias)).to(_BF16)


# The functions native CPU/CUDA autocast runs in BF16 that a causal LM calls (HF Llama-style models use
# F.linear and F.scaled_dot_product_attention, eager attention matmul; others addmm (GPT-2's Conv1D), einsum).
_LINEAR = {F.linear}
_OTHER_GEMMS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm,
                torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.baddbmm,
                torch.Tensor.baddbmm, torch.addbmm, torch.einsum, F.scaled_dot_product_attention, F.conv1d,
                F.conv2d}


def _is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class BF16Emulation(TorchFunctionMode):
    """Runs BF16 GEMMs as FP32 GEMMs on BF16 values (see the module doc). A GEMM whose operands are float32 under
    BF16 autocast, or that meets a BF16 operand in any region, is emulated; FP32 regions (autocast turned off,
    float32 operands) and other dtypes are left alone. No GEMM under this mode receives a BF16 operand."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _LINEAR and func not in _OTHER_GEMMS:
            return func(*args, **kwargs)
        floats = [a for a in (*args, *kwargs.values()) if _is_float_tensor(a)]
        dtypes = {t.dtype for t in floats}
        autocast_bf16 = (torch.is_autocast_enabled(self.device_type)
                         and torch.get_autocast_dtype(self.device_type) == _BF16)
        emulate = bool(floats) and dtypes <= {torch.float32, _BF16} and (_BF16 in dtypes or autocast_bf16)
        if not emulate:
            return func(*args, **kwargs)  # an FP32 region of the model (or a dtype autocast leaves alone)
        out_dtype = _BF16 if _BF16 in dtypes else torch.float32  # the dtype the native kernel would return
        with torch.autocast(self.device_type, enabled=False):
            if func in _LINEAR and not torch.is_grad_enabled():
                # evaluation: each weight is rounded once, not once per call
                x, weight, bias = _linear_args(args, kwargs)
                if weight.dtype == torch.float32:
                    b = None if bias is None else _rounded_weight(bias)
                    return _round_result_to(F.linear(_fp32(x), _rounded_weight(weight), b), out_dtype)
            up_args = [_fp32(a) if _is_float_tensor(a) else a for a in args]
            up_kwargs = {k: _fp32(v) if _is_float_tensor(v) else v for k, v in kwargs.items()}
            return _round_result_to(func(*up_args, **up_kwargs), out_dtype)


_ROUNDED_ATTR = "_hif8qat_bf16_rounded"  # on a parameter: ((version, data_ptr) when rounded, the rounded copy)


def _rounded_weight(weight: torch.Tensor) -> torch.Tensor:
    """round_bf16(weight), kept while the weight is unchanged: an evaluation calls each linear hundreds of times."""
    if not isinstance(weight, torch.nn.Parameter):
        return round_bf16(weight)
    # an in-place update bumps the version; `.data = ...` moves the data
    key = (tensor_version(weight), weight.data_ptr())
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


def checkpoint_kwargs(mode: str, device_type: str) -> dict[str, Any]:
    """``torch.utils.checkpoint`` arguments under which an activation-checkpointing recompute runs with the
    forward's numerics: autocast is restored by torch, a mode is not, so the emulation is entered explicitly (a
    recompute without it would run native BF16 GEMMs and produce tensors of another dtype than the forward's).

    Args:
        mode: the resolved mode (one of RESOLVED).
        device_type: "cpu" or "cuda".

    Returns:
        Keyword arguments for ``torch.utils.checkpoint.checkpoint``.
    """
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "bf16_emulated":
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), BF16Emulation(device_type))
    return kwargs


def forward_context(mode: str, device_type: str) -> contextlib.AbstractContextManager:
    """Around a forward pass (training step, held-out loss, evaluation), for a resolved mode (one of RESOLVED).

    Args:
        mode: the resolved mode.
        device_type: "cpu" or "cuda".

    Returns:
        The context manager.
    """
    if mode == "none":
        return contextlib.nullcontext()
    if mode == "bf16":
        return torch.autocast(device_type=device_type, dtype=_BF16)
    if mode == "bf16_emulated":
        return _stacked(BF16Emulation(device_type), torch.autocast(device_type=device_type, dtype=_BF16))
    raise ValueError(f"autocast must be one of {', '.join(RESOLVED)}, got {mode!r}")


def backward_context(mode: str, device_type: str) -> contextlib.AbstractContextManager:
    """Around loss.backward(): the emulation must also see the GEMMs a custom backward runs on BF16 tensors.

    Args:
        mode: the resolved mode.
        device_type: "cpu" or "cuda".

    Returns:
        The context manager.
    """
    if mode == "bf16_emulated":
        return BF16Emulation(device_type)
    return contextlib.nullcontext()


@contextlib.contextmanager
def keeping_weight_casts() -> Iterator[None]:
    """Within it, autocast's BF16 cast of each FP32 weight is made at its first use and kept until it exits.

    torch caches the cast of a parameter (a leaf that requires grad; not in inference mode) only until the
    outermost autocast region exits, that is after each forward: without this, every forward casts every weight
    again. Wrapped around an optimizer step's micro-batches (the weights do not change before the optimizer step)
    or an evaluation (they do not change at all), the kept casts hold the same values bit for bit. Holding the
    nesting level above zero keeps the cache; autocast itself stays as the forward and backward contexts set it.
    In training the cast copies are already alive at the end of each forward (saved for its backward), so the peak
    memory does not grow; under activation checkpointing they are not (the recompute casts again), and keeping
    them would cost 2 bytes a parameter.
    """
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


@contextlib.contextmanager
def _stacked(*managers: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def training_device_type(device_setting: str) -> str:
    """The device type a training with ``train.device`` runs on (as train.setup_distributed picks it).

    Args:
        device_setting: "auto", "cpu" or "cuda".

    Returns:
        "cpu" or "cuda".
    """
    return "cuda" if device_setting != "cpu" and torch.cuda.is_available() else "cpu"
