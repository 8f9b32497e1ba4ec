"""Which GEMMs reach torch, by operand dtype: the check that BF16 emulation keeps every GEMM off torch's slow BF16
path on a machine without native BF16.

``python -m hif8qat.quant.gemm_check`` prints what ``train.autocast=auto`` means on this machine (stdout: the
numerics alone, for scripts) and, on stderr, the GEMM-class ATen calls of one quantized training step by operand
dtype; it exits 1 when one would take the slow path. A count at the ATen dispatch level shows a slow path on any
machine; a timing shows it only on the machine that has it.
"""

from __future__ import annotations

import collections
import sys

import torch

from hif8qat.compute_dtype import backward_context, describe, forward_context, resolve, training_device_type
from hif8qat.quant.linear import _convert_model, set_quantization
from hif8qat.scaling.settings import ScalingConfig

_GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "mv", "addmv", "dot", "vdot",
             "convolution", "convolution_backward"}


def _torch_dispatch_mode() -> type:
    """Adapter: torch's base class of a mode that sees every ATen call below autograd and autocast (what reaches
    the kernels). Torch exports it only from the private ``torch.utils._python_dispatch``; the public
    ``torch.overrides.TorchFunctionMode`` sees Python-level calls, before autocast picks the dtypes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class GemmOperandCount(_torch_dispatch_mode()):
    """Counts the GEMM-class ATen calls (matrix products, convolutions, fused attention) by operand dtype: what
    reaches torch's kernels, whatever the Python above them does."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _GEMM_OPS or "scaled_dot_product" in name or "attention" in name:
            dtypes = {str(a.dtype).removeprefix("torch.") for a in (*args, *kwargs.values())
                      if isinstance(a, torch.Tensor) and a.is_floating_point()}
            self.counts["+".join(sorted(dtypes))] += 1
        return func(*args, **kwargs)

    def bf16_calls(self) -> int:
        """How many of the counted GEMMs had a BF16 operand.

        Returns:
            The count.
        """
        return sum(n for dtypes, n in self.counts.items() if "bfloat16" in dtypes)


def _tiny_llama() -> torch.nn.Module:
    """A 2-block Llama of random weights (a few hundred kilobytes): the GEMMs of a real decoder step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def count_step_gemms(numerics: str, device_type: str = "cpu") -> GemmOperandCount:
    """One training step (forward and backward) of a tiny quantized Llama under ``numerics``, its GEMMs counted.

    Args:
        numerics: a resolved ``train.autocast`` value.
        device_type: "cpu" or "cuda".

    Returns:
        The GEMMs counted by operand dtypes.
    """
    model = _tiny_llama()
    _convert_model(model, "attn_mlp", None, ScalingConfig(), emulate_bf16=numerics == "bf16_emulated")
    set_quantization(model, True)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    counter = GemmOperandCount()
    with forward_context(numerics, device_type), counter:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    with backward_context(numerics, device_type), counter:
        loss.backward()
    return counter


def main() -> int:
    """``python -m hif8qat.quant.gemm_check``: what ``train.autocast=auto`` means on this machine (stdout: the numerics
    alone, for scripts), and on stderr the GEMMs one quantized training step sends to torch, by operand dtype.

    Returns:
        Exit status.
    """
    device_type = training_device_type("auto")
    info = describe(resolve("auto", device_type), device_type)
    print(info["numerics"])
    note = "native BF16" if info["native_bf16"] else "no native BF16: BF16 is emulated at about FP32 speed"
    print(f"# {device_type}, {info.get('cpu_capability', '')}: {note}", file=sys.stderr)
    counter = count_step_gemms(info["numerics"], device_type)
    counts = ", ".join(f"{n} {dtypes}" for dtypes, n in sorted(counter.counts.items()))
    print(f"# one quantized training step: GEMM-class calls by operand dtype: {counts}", file=sys.stderr)
    if counter.bf16_calls() and not info["native_bf16"]:
        print(f"# WARNING: {counter.bf16_calls()} GEMMs got BF16 operands on a machine without native BF16: "
              "they take torch's slow path (tens of times an FP32 GEMM)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
