"""What reaches torch's GEMM kernels: under ``bf16_emulated`` (and under ``none``) no GEMM-class ATen op receives a
BF16 operand, in every path that runs a model.

On a CPU without native BF16, torch's BF16 GEMM is a slow reference loop (one quantized SmolLM2 step: 80-120 s
instead of 5). A machine with native BF16 runs that path fast, so timing there cannot show a leak; a count of the
ATen ops and their operand dtypes shows it on any machine. The counter here is the test's own (a dispatch mode
for eager code, the profiler's recorded input dtypes for compiled code): nothing of the project's is used to
count.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from hif8qat import compute_dtype as numerics
from hif8qat.config.numerics import resolve_run
from hif8qat.models.loading import build_tiny_llama, enable_activation_checkpointing
from hif8qat.quant import linear as qlinear
from hif8qat.scaling.settings import ScalingConfig

ONE_THREAD = True

# GEMM-class ATen ops: matrix products, convolutions and every fused attention kernel.
_GEMM_NAMES = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "mv", "addmv", "dot", "vdot",
               "matmul", "linear", "convolution", "convolution_backward", "_convolution", "einsum"}


def _is_gemm(name: str) -> bool:
    return name in _GEMM_NAMES or "scaled_dot_product" in name or "attention" in name


class GemmOperandDtypes(TorchDispatchMode):
    """Counts GEMM-class ATen calls by (op, sorted floating operand dtypes)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if _is_gemm(name):
            dtypes = sorted({str(a.dtype) for a in (*args, *kwargs.values())
                             if isinstance(a, torch.Tensor) and a.is_floating_point()})
            self.calls[(name, tuple(dtypes))] += 1
        return func(*args, **kwargs)

    def bf16(self) -> dict:
        return {k: n for k, n in self.calls.items() if "torch.bfloat16" in k[1]}

    def total(self) -> int:
        return sum(self.calls.values())


def _model(variant: str, *, recompute_w: bool = False, seed: int = 0, emulate: bool = False):
    model, tok = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=seed)
    if variant != "plain":  # the layers are told the numerics (the trainer does so from train.autocast)
        qlinear._convert_model(model, variant, None, ScalingConfig(), emulate_bf16=emulate)
        qlinear.set_quantization(model, True)
        if recompute_w:
            qlinear.set_weight_recompute(model, True)
    return model, tok


def _step(model, ids, mode: str, counter: TorchDispatchMode) -> torch.Tensor:
    """One training micro-batch as the trainer runs it: forward under forward_context, backward under
    backward_context."""
    with numerics.forward_context(mode, "cpu"), counter:
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))
    with numerics.backward_context(mode, "cpu"), counter:
        loss.backward()
    return loss.detach()


@pytest.mark.parametrize("mode", ["bf16_emulated", "none"])
@pytest.mark.parametrize("variant,recompute_w,checkpointing", [
    ("plain", False, False), ("plain", False, True),
    ("mlp", False, False), ("attn_mlp", False, False), ("attn_mlp", True, False),
    ("attn_mlp", False, True), ("mlp", True, True),
])
def test_a_training_step_sends_no_bf16_operand_to_a_gemm(mode, variant, recompute_w, checkpointing):
    model, _ = _model(variant, recompute_w=recompute_w, emulate=mode == "bf16_emulated")
    if checkpointing:
        enable_activation_checkpointing(model, numerics.checkpoint_kwargs(mode, "cpu"))
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second step runs with the quantizers' delayed scales
        counter = GemmOperandDtypes()
        loss = _step(model, ids, mode, counter)
        assert torch.isfinite(loss)
        assert counter.bf16() == {}, f"BF16 operands reached GEMMs: {counter.bf16()}"
        assert counter.total() >= 3 * 7 * 2, "the counter saw the step's GEMMs"  # 7 linears a block, fwd + 2 bwd


def test_the_quantized_backward_under_emulation_computes_what_torchs_bf16_kernel_does():
    """Keeping BF16 out of the GEMMs keeps the numbers: a quantized layer's dX and dW under emulation equal torch's
    own BF16 GEMM on the same quantized operands (tiny shapes: fast on any CPU) up to summation order."""
    torch.manual_seed(0)
    emulated_layer = qlinear.QuantLinear(64, 32, name="probe", config=ScalingConfig(), emulate_bf16=True)
    native_layer = copy.deepcopy(emulated_layer)
    native_layer.emulate_bf16 = False
    x = torch.randn(8, 64)
    g = torch.randn(8, 32).to(torch.bfloat16)

    def grads(layer, forward_ctx, backward_ctx):
        xi = x.clone().requires_grad_(True)
        with forward_ctx:
            y = layer(xi)
        with backward_ctx:
            y.backward(g)
        return y.detach().float(), xi.grad, layer.weight.grad

    emulated = grads(emulated_layer, numerics.forward_context("bf16_emulated", "cpu"),
                     numerics.backward_context("bf16_emulated", "cpu"))
    native = grads(native_layer, torch.autocast("cpu", dtype=torch.bfloat16), contextlib.nullcontext())
    for got, want in zip(emulated, native):
        assert torch.equal(got, got.to(torch.bfloat16).float()), "BF16 values"
        ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want.abs().clamp_min(1e-30))[1] - 8)
        assert (got - want).abs().le(ulp).all(), "within one BF16 ulp of the native kernel"
        assert (got == want).float().mean() > 0.95


def test_compiled_training_in_fp32_sends_no_bf16_operand_and_emulated_compile_is_refused():
    from test_reliability import cli_config

    from hif8qat.config.run_config import ConfigError

    model, _ = _model("attn_mlp")
    model.train()
    compiled = torch.compile(model, backend="aot_eager")  # the ATen graphs compile runs, fwd and bwd
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    # compiled kernels run below a dispatch mode's reach: the profiler records each ATen call's input dtypes
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            _step(compiled, ids, "none", contextlib.nullcontext())
    seen = collections.Counter()
    if not any(hasattr(event, "input_dtypes") for event in prof.events()):
        pytest.skip("this torch's profiler records no input dtypes (torch 2.11 does not): checked at the pinned torch")
    for event in prof.events():
        name = event.name.removeprefix("aten::")
        if event.name.startswith("aten::") and _is_gemm(name):
            seen[(name, tuple(sorted({d for d in event.input_dtypes if d})))] += 1
    assert seen, "the profiler saw the compiled step's GEMMs"
    assert not [k for k in seen if any("BFloat16" in d for d in k[1])], seen

    # torch.compile traces the backward under the forward's autocast: emulated BF16 cannot be compiled, and the
    # setting is refused before a run starts (on every machine: train.autocast=bf16_emulated set explicitly)
    cfg = _with_autocast(cli_config(["experiment=exp3", "profile=smoke", "train.compile=true"]), "bf16_emulated")
    with pytest.raises(ConfigError, match="train.compile"):
        resolve_run(cfg)


def _with_autocast(cfg, value):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, autocast=value))


def test_held_out_comparison_sends_no_bf16_operand_to_a_gemm():
    from hif8qat.evaluate.heldout import stream_token_stats

    base, _ = _model("plain", seed=2)
    quant, _ = _model("attn_mlp", seed=2)
    with torch.no_grad():  # the quantizers get their scales, then are frozen as the hif8 evaluation has them
        quant(input_ids=torch.randint(0, 200, (2, 16)))
    qlinear.freeze_scales(quant, True)
    windows = torch.randint(0, base.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(2))
    counter = GemmOperandDtypes()
    with counter:
        cols = stream_token_stats({"base": base.eval(), "run": quant.eval()}, [("base", "run")], windows,
                                  numerics=numerics.Numerics("bf16_emulated"), batch_windows=2)
    assert len(cols["nll_run"]) == 3 * 16
    assert counter.bf16() == {}, counter.bf16()
    assert counter.total() > 0


@pytest.mark.parametrize("mode", ["bf16", "hif8"])
def test_evaluation_sends_no_bf16_operand_to_a_gemm(mode, tmp_path):
    from conftest import write_quantized_export

    from hif8qat.evaluate import runner

    export = write_quantized_export(tmp_path / "export", scope="attn_mlp", seed=3)
    counter = GemmOperandDtypes()
    with counter:
        res = runner.evaluate_export(export, mode, "mini_arc", numerics=numerics.Numerics("bf16_emulated"),
                                     device="cpu", limit=2, batch_size=4)
    assert res, "the evaluation produced results"
    assert counter.bf16() == {}, counter.bf16()
    assert counter.total() > 0


def test_time_estimate_measures_with_no_bf16_operand(monkeypatch):
    from test_reliability import cli_config

    from hif8qat.launch import time_estimate as estimate

    cfg = _with_autocast(cli_config(["experiment=exp3", "profile=smoke"]), "bf16_emulated")
    counter = GemmOperandDtypes()
    with counter:
        costs, _ = estimate.measure(cfg, numerics.Numerics(cfg.train.autocast))
    assert costs.numerics == "bf16_emulated" and costs.qat_step_s > 0
    assert counter.bf16() == {}, counter.bf16()
    assert counter.total() > 0



def test_the_numerics_check_a_user_runs_reports_the_counts_and_no_bf16(monkeypatch):
    """`python -m hif8qat.quant.gemm_check` as a user runs it (a fresh process, the module as __main__)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HIF8QAT_NO_NATIVE_BF16": "1"}
    done = subprocess.run([sys.executable, "-m", "hif8qat.quant.gemm_check"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "bf16_emulated"  # stdout is the numerics alone: the Makefile reads it
    counts = [line for line in done.stderr.splitlines() if "GEMM-class calls by operand dtype" in line]
    assert len(counts) == 1 and "float32" in counts[0] and "bfloat16" not in counts[0], done.stderr[-2000:]


def test_the_chunked_loss_recomputes_under_the_emulation(monkeypatch):
    """The paper profile's loss head recomputes each chunk's logits in backward (a checkpoint): under emulation the
    recompute must run emulated too, or it would hand BF16 operands to the head's GEMM."""
    from hif8qat.train import chunked_loss

    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 8 * 259)  # chunks of 8 tokens at the tiny vocabulary
    model, _ = _model("mlp", seed=4, emulate=True)
    assert chunked_loss.install_loss_head(model, emulate_bf16=True) is not None
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    counter = GemmOperandDtypes()
    with numerics.forward_context("bf16_emulated", "cpu"), counter:
        loss = chunked_loss.lm_loss(model, ids)
    with numerics.backward_context("bf16_emulated", "cpu"), counter:
        loss.backward()
    assert torch.isfinite(loss) and model.lm_head.weight.grad is not None
    assert counter.bf16() == {}, counter.bf16()
    assert counter.total() > 0, "the counter saw the loss head's GEMMs"


# Every GEMM entry the emulation covers, with operands of the test's own making: (shapes of the float operands,
# the call). A GEMM the emulation lost would run as torch's BF16 kernel under autocast: a BF16 result from BF16
# operands, which the counter and the result's dtype both show.
_T = torch.Tensor
GEMM_ENTRIES = {
    "F.linear": (torch.nn.functional.linear, [(3, 8), (5, 8), (5,)], lambda f, a, b, c: f(a, b, c)),
    "torch.matmul": (torch.matmul, [(2, 3, 8), (8, 5)], lambda f, a, b: f(a, b)),
    "Tensor.matmul": (_T.matmul, [(3, 8), (8, 5)], lambda f, a, b: a.matmul(b)),
    "Tensor.__matmul__": (_T.__matmul__, [(3, 8), (8, 5)], lambda f, a, b: a @ b),
    "Tensor.__rmatmul__": (_T.__rmatmul__, [(8, 5), (3, 8)], lambda f, a, b: a.__rmatmul__(b)),
    "torch.mm": (torch.mm, [(3, 8), (8, 5)], lambda f, a, b: f(a, b)),
    "Tensor.mm": (_T.mm, [(3, 8), (8, 5)], lambda f, a, b: a.mm(b)),
    "torch.bmm": (torch.bmm, [(2, 3, 8), (2, 8, 5)], lambda f, a, b: f(a, b)),
    "Tensor.bmm": (_T.bmm, [(2, 3, 8), (2, 8, 5)], lambda f, a, b: a.bmm(b)),
    "torch.addmm": (torch.addmm, [(3, 5), (3, 8), (8, 5)], lambda f, c, a, b: f(c, a, b)),
    "Tensor.addmm": (_T.addmm, [(3, 5), (3, 8), (8, 5)], lambda f, c, a, b: c.addmm(a, b)),
    "torch.baddbmm": (torch.baddbmm, [(2, 3, 5), (2, 3, 8), (2, 8, 5)], lambda f, c, a, b: f(c, a, b)),
    "Tensor.baddbmm": (_T.baddbmm, [(2, 3, 5), (2, 3, 8), (2, 8, 5)], lambda f, c, a, b: c.baddbmm(a, b)),
    "torch.addbmm": (torch.addbmm, [(3, 5), (2, 3, 8), (2, 8, 5)], lambda f, c, a, b: f(c, a, b)),
    "torch.einsum": (torch.einsum, [(2, 3, 8), (2, 8, 5)], lambda f, a, b: f("bij,bjk->bik", a, b)),
    "F.scaled_dot_product_attention": (torch.nn.functional.scaled_dot_product_attention,
                                       [(1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)], lambda f, q, k, v: f(q, k, v)),
    "F.conv1d": (torch.nn.functional.conv1d, [(2, 4, 9), (5, 4, 3)], lambda f, x, w: f(x, w)),
    "F.conv2d": (torch.nn.functional.conv2d, [(2, 4, 6, 6), (5, 4, 3, 3)], lambda f, x, w: f(x, w)),
}


def test_the_gemm_entries_tested_are_the_ones_the_emulation_covers():
    covered = numerics._LINEAR | numerics._OTHER_GEMMS
    assert {entry[0] for entry in GEMM_ENTRIES.values()} == covered, "a covered GEMM without a test, or vice versa"


@pytest.mark.parametrize("operands", ["float32-autocast", "bfloat16"])
@pytest.mark.parametrize("entry", sorted(GEMM_ENTRIES))
def test_every_emulated_gemm_rounds_its_operands_and_result_and_keeps_bf16_off_aten(entry, operands):
    """float32 operands under the emulated autocast give a float32 result holding BF16 values; BF16 operands (as
    the quantized linear hands over) a BF16 result. Either way the value is the FP32 op on the operands rounded
    to BF16, rounded to BF16, and no GEMM kernel receives a BF16 operand."""
    func, shapes, call = GEMM_ENTRIES[entry]
    gen = torch.Generator().manual_seed(len(entry))
    args = [torch.randn(s, generator=gen) * 3 for s in shapes]
    if operands == "bfloat16":
        args = [a.to(torch.bfloat16) for a in args]
        context = numerics.backward_context("bf16_emulated", "cpu")  # the mode alone: BF16 tensors, no autocast
    else:
        context = numerics.forward_context("bf16_emulated", "cpu")
    counter = GemmOperandDtypes()
    with context, counter:
        got = call(func, *args)
    want_dtype = torch.bfloat16 if operands == "bfloat16" else torch.float32
    with torch.autocast("cpu", enabled=False):  # the oracle: torch's FP32 op on BF16 values, its result cast
        want = call(func, *[a.to(torch.bfloat16).float() for a in args]).to(torch.bfloat16).to(want_dtype)
    assert got.dtype == want_dtype
    assert torch.equal(got, want)
    assert counter.total() > 0, "the counter saw the GEMM"
    assert counter.bf16() == {}, f"BF16 operands reached a GEMM: {counter.bf16()}"
