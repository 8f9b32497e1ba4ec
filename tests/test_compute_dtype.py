"""Compute numerics: the choice of native / emulated BF16, and what the emulation computes.

Oracles are float64 products of BF16-rounded operands (an independent formula), and torch's own native BF16
kernels where this CPU has them.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hif8qat import compute_dtype as numerics

ONE_THREAD = True


def _bf16_values(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _to_bf16(x64: torch.Tensor) -> torch.Tensor:
    # float64 -> bf16 directly would round twice through float32 only in rare ties; fine for an oracle
    return x64.float().to(torch.bfloat16).float()


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs().clamp_min(1e-30))[1] - 8)


def test_auto_resolves_to_native_where_supported_and_emulated_elsewhere(monkeypatch):
    monkeypatch.delenv(numerics.NO_NATIVE_BF16_ENV, raising=False)
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert numerics.resolve("auto", "cpu") == ("bf16" if native else "bf16_emulated")
    monkeypatch.setenv(numerics.NO_NATIVE_BF16_ENV, "1")
    assert numerics.resolve("auto", "cpu") == "bf16_emulated"
    assert numerics.resolve("bf16", "cpu") == "bf16"  # an explicit choice is honoured
    assert numerics.resolve("none", "cpu") == "none"
    with pytest.raises(ValueError, match="bf16_emulated"):
        numerics.resolve("fp16", "cpu")


def test_emulated_linear_is_a_bf16_gemm_with_fp32_accumulation():
    torch.manual_seed(0)
    x = torch.randn(3, 17, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    with numerics.forward_context("bf16_emulated", "cpu"):
        y = F.linear(x, w, b)
    assert y.dtype == torch.float32
    assert torch.equal(y, y.to(torch.bfloat16).float()), "outputs must be BF16 values"
    oracle = _to_bf16(_bf16_values(x) @ _bf16_values(w).T + _bf16_values(b))
    close = (y - oracle).abs() <= _ulp_bf16(oracle)
    assert close.all(), "every output within one BF16 ulp of the exact product of BF16 operands"
    assert (y == oracle).float().mean() > 0.97  # differences only where FP32 summation order tips a rounding

    g = torch.randn_like(y)
    with numerics.backward_context("bf16_emulated", "cpu"):
        y.backward(g)
    g64 = _bf16_values(g)
    dx = _to_bf16(g64 @ _bf16_values(w))
    dw = _to_bf16(g64.reshape(-1, 48).T @ _bf16_values(x).reshape(-1, 64))
    db = _to_bf16(g64.reshape(-1, 48).sum(0))
    for got, want in ((x.grad, dx), (w.grad, dw), (b.grad, db)):
        assert (got - want).abs().le(_ulp_bf16(want)).all()


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="needs native BF16 on this CPU")
def test_emulated_gemm_matches_native_bf16_kernel():
    torch.manual_seed(1)
    x, w = torch.randn(256, 576), torch.randn(1536, 576)
    with numerics.forward_context("bf16_emulated", "cpu"):
        emulated = F.linear(x, w)
    with numerics.forward_context("bf16", "cpu"):
        native = F.linear(x, w).float()
    assert (emulated == native).float().mean() > 0.999
    # elsewhere FP32 summation order differs: bounded by the accumulation error of the |terms|, plus one ulp
    terms = x.bfloat16().float().abs() @ w.bfloat16().float().abs().T
    assert (emulated - native).abs().le(_ulp_bf16(native) + terms * 2**-12).all()


def test_regions_with_autocast_turned_off_stay_fp32():
    # Llama's rotary angles are computed under autocast(enabled=False): they must not be rounded.
    a, b = torch.randn(8, 1) * 1000, torch.randn(1, 16)
    with numerics.forward_context("bf16_emulated", "cpu"), torch.autocast("cpu", enabled=False):
        out = torch.matmul(a, b)
    assert torch.equal(out, a @ b)


def test_bf16_tensors_outside_autocast_get_an_fp32_gemm_and_a_bf16_result():
    # The quantized linear casts its operands to BF16 itself and calls F.linear with autocast off.
    torch.manual_seed(2)
    a, w = torch.randn(32, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    with numerics.backward_context("bf16_emulated", "cpu"):
        out = F.linear(a, w)
    assert out.dtype == torch.bfloat16
    want = _to_bf16(a.double() @ w.double().T)
    assert (out.float() - want).abs().le(_ulp_bf16(want)).all()


def test_emulated_attention_rounds_operands_and_backpropagates():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    with numerics.forward_context("bf16_emulated", "cpu"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = F.scaled_dot_product_attention(*(t.detach().to(torch.bfloat16).float() for t in (q, k, v)), is_causal=True)
    assert torch.equal(out.detach(), want.to(torch.bfloat16).float())
    g = torch.randn(out.shape)  # an upstream gradient that is not BF16 yet: the backward must round it
    out.backward(g)
    assert all(t.grad is not None and torch.equal(t.grad, t.grad.to(torch.bfloat16).float()) for t in (q, k, v))
    # value oracle: causal attention's gradients by hand in float64 from the BF16 operands and the BF16 upstream
    # gradient (S = q k^T / sqrt(d), P = softmax(S), O = P v), each rounded once to BF16
    q64, k64, v64, g64 = (_to_bf16(t.detach().double()).double() for t in (q, k, v, g))
    n, d = q64.shape[-2], q64.shape[-1]
    s_ = q64 @ k64.transpose(-1, -2) / math.sqrt(d)
    s_ = s_.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p_ = torch.softmax(s_, dim=-1)
    dp = g64 @ v64.transpose(-1, -2)
    ds = p_ * (dp - (dp * p_).sum(-1, keepdim=True))
    want = {"q": ds @ k64 / math.sqrt(d), "k": ds.transpose(-1, -2) @ q64 / math.sqrt(d),
            "v": p_.transpose(-1, -2) @ g64}
    for name, t in zip("qkv", (q, k, v)):
        w = _to_bf16(want[name])
        # one BF16 step of the exact value (FP32 summation order), plus FP32 noise on near-cancelled entries
        tol = _ulp_bf16(w) + 1e-6 * want[name].abs().max().float()
        assert ((t.grad - w).abs() <= tol).all(), (name, (t.grad - w).abs().max())


def test_tiny_llama_step_under_emulation_tracks_native_bf16():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 32))

    def loss_and_grads(mode):
        model.zero_grad()
        with numerics.forward_context(mode, "cpu"):
            loss = model(input_ids=ids, labels=ids).loss
        with numerics.backward_context(mode, "cpu"):
            loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    fp32_loss, fp32_grad = loss_and_grads("none")
    emu_loss, emu_grad = loss_and_grads("bf16_emulated")
    assert emu_loss != fp32_loss  # the emulation did round something
    assert abs(emu_loss - fp32_loss) / fp32_loss < 1e-2
    assert (emu_grad - fp32_grad).norm() / fp32_grad.norm() < 5e-2
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        native_loss, native_grad = loss_and_grads("bf16")
        assert abs(emu_loss - native_loss) / native_loss < 1e-2
        assert (emu_grad - native_grad).norm() / native_grad.norm() < 5e-2


def test_an_emulated_evaluation_rounds_its_results_in_place_to_the_values_training_computes():
    """Without gradients the emulation rounds each GEMM's result in place (no copy of an evaluation's logits is
    allocated); with them it rounds a copy. The logits must be the same, bit for bit, and the logits tensor
    the GEMM's own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 32))
    with numerics.forward_context("bf16_emulated", "cpu"):
        trained = model(input_ids=ids).logits.detach()
    allocated, round_in_place = [], numerics.round_bf16_

    def recorded(y):  # the rounding's argument: the tensor the GEMM returned
        allocated.append(y)
        return round_in_place(y)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(numerics, "round_bf16_", recorded)
        with torch.no_grad(), numerics.forward_context("bf16_emulated", "cpu"):
            evaluated = model(input_ids=ids).logits
    assert torch.equal(evaluated, trained)
    assert torch.equal(trained, trained.to(torch.bfloat16).float())  # BF16 values held in float32
    assert any(y.data_ptr() == evaluated.data_ptr() for y in allocated)  # the logits were rounded where they lay


def test_quantized_linear_under_emulation_matches_native_autocast():
    import copy

    from hif8qat.quant.linear import QuantLinear

    torch.manual_seed(4)
    emulated_layer = QuantLinear(64, 32, name="probe")
    native_layer = copy.deepcopy(emulated_layer)  # same weights, same (empty) scaler state
    x = torch.randn(4, 64)
    with torch.no_grad():
        with numerics.forward_context("bf16_emulated", "cpu"):
            emulated = emulated_layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            native = native_layer(x)  # BF16 operands after HiF8, BF16 GEMM (torch's kernel, any speed)
    assert emulated.dtype == native.dtype == torch.bfloat16
    assert (emulated == native).float().mean() > 0.99
    assert (emulated.float() - native.float()).abs().le(_ulp_bf16(native.float()) + 1e-3).all()


def test_evaluation_reuses_a_weights_rounding_until_the_weight_changes():
    torch.manual_seed(5)
    layer = torch.nn.Linear(32, 16)
    x = torch.randn(4, 32)
    with torch.no_grad(), numerics.forward_context("bf16_emulated", "cpu"):
        first = layer(x)
        again = layer(x)
    assert torch.equal(first, again)
    with torch.no_grad():
        layer.weight.add_(1.0)  # an in-place update (an optimizer step) must not leave a stale rounding
    with torch.no_grad(), numerics.forward_context("bf16_emulated", "cpu"):
        updated = layer(x)
    want = _to_bf16(_bf16_values(x) @ _bf16_values(layer.weight).T + _bf16_values(layer.bias))
    assert (updated - want).abs().le(_ulp_bf16(want)).all()
    assert not torch.equal(updated, first)


@pytest.mark.parametrize("mode", ["none", "bf16_emulated", "bf16"])
def test_the_gemm_operand_dtype_is_the_one_a_linear_sends_to_its_gemm(mode):
    """What a benchmark times the machine's GEMMs in: the operands' dtype that a linear's GEMM receives under the
    numerics' forward, as ATen sees the call (a BF16 operand under emulation would be the slow path it avoids)."""
    from test_gemm_dtypes import GemmOperandDtypes

    n = numerics.Numerics(mode)
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    with n.forward(), GemmOperandDtypes() as recorded:
        F.linear(x, w)
    assert set(recorded.calls) and {dtypes for _, dtypes in recorded.calls} == {(str(n.gemm_operand_dtype),)}
