"""QuantLinear and model conversion: exactness when off, hand-computed reference when on, conversion rules,
state/export round trips, telemetry plumbing."""

import contextlib
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hif8qat.config.blocks import parse_high_precision_blocks
from hif8qat.formats.qdq import hif8_qdq_scaled
from hif8qat.models.quant_files import dump_telemetry, load_quant_export, save_quant_export
from hif8qat.quant.linear import (
    QuantLinear,
    _convert_model,
    freeze_scales,
    load_quant_state_dict,
    quant_state_dict,
    set_quantization,
    set_step,
    set_weight_recompute,
    step_telemetry,
)
from hif8qat.scaling.bank import RECORD, REPLAY, bank_qdq
from hif8qat.scaling.settings import ScalingConfig

ONE_THREAD = True  # conftest._one_thread


def tiny_llama(num_layers=4, seed=0):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def sc(amax, target=15.0):
    return float(torch.tensor(target / (amax + 1e-12), dtype=torch.float64).to(torch.float32))


# ------------------------------------------------------------------------------------------------ the layer
@pytest.mark.parametrize("bias", [True, False])
def test_off_is_identical_to_nn_linear(bias):
    torch.manual_seed(0)
    ref = nn.Linear(16, 8, bias=bias)
    q = QuantLinear.from_linear(nn.Linear(16, 8, bias=bias), ScalingConfig(), "l")
    q.load_state_dict(ref.state_dict())
    q.quant_enabled = False
    x1 = torch.randn(2, 5, 16, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    g = torch.randn(2, 5, 8)
    y1, y2 = ref(x1), q(x2)
    assert torch.equal(y1, y2)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(x1.grad, x2.grad) and torch.equal(ref.weight.grad, q.weight.grad)
    if bias:
        assert torch.equal(ref.bias.grad, q.bias.grad)
    assert q.scaler_a.telemetry_calls() == (0, 0)  # no quantizer ran


def test_on_matches_hand_computed_forward_and_backward():
    torch.manual_seed(1)
    q = QuantLinear(16, 8, bias=True, config=ScalingConfig(algo="max", history_len=4), name="l")
    w = q.weight.detach().clone()
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 3, 16, generator=gen) * m for m in (1.0, 4.0)]
    gs = [torch.randn(2, 3, 8, generator=gen) * m for m in (0.01, 0.5)]
    amax_w = w.abs().max().item()
    for i, (x, g) in enumerate(zip(xs, gs)):
        x = x.requires_grad_(True)
        q.weight.grad = q.bias.grad = None
        y = q(x)
        y.backward(g)
        # delayed scales: call 0 uses its own amax (cold start), call 1 the history [call-0 amax]
        s_a = sc(xs[0].abs().max().item())
        s_w = sc(amax_w)
        s_g = sc(gs[0].abs().max().item())
        qa, qw = hif8_qdq_scaled(x.detach(), s_a), hif8_qdq_scaled(w, s_w)
        qg = hif8_qdq_scaled(g, s_g)
        torch.testing.assert_close(y, F.linear(qa, qw, q.bias.detach()), rtol=0, atol=0)
        torch.testing.assert_close(x.grad, qg @ qw, rtol=0, atol=0)
        torch.testing.assert_close(q.weight.grad, qg.reshape(-1, 8).t() @ qa.reshape(-1, 16), rtol=0, atol=0)
        torch.testing.assert_close(q.bias.grad, qg.reshape(-1, 8).sum(0), rtol=0, atol=0)
        assert not torch.equal(qa, x.detach())  # it really quantized
        assert q.scaler_a.last["scale"].item() == s_a and q.scaler_g.last["scale"].item() == s_g
        assert i == 0 or q.scaler_a.last["ratio"].item() > 3  # call 1 outgrew the delayed estimate


def test_on_under_bf16_autocast_quantizes_then_matmuls_in_bf16():
    torch.manual_seed(3)
    q = QuantLinear(16, 8, bias=True, config=ScalingConfig(), name="l")
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = q(x)
    assert y.dtype == torch.bfloat16
    s_a, s_w = sc(x.abs().max().item()), sc(q.weight.abs().max().item())
    qa = hif8_qdq_scaled(x.detach(), s_a).bfloat16()
    qw = hif8_qdq_scaled(q.weight.detach(), s_w).bfloat16()
    torch.testing.assert_close(y, F.linear(qa, qw, q.bias.detach().bfloat16()), rtol=0, atol=0)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and q.weight.grad.dtype == torch.float32
    assert torch.isfinite(x.grad).all() and q.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------ conversion
def test_convert_26_blocks_hp5_mlp_gives_63_and_keeps_state_dict_keys():
    m = tiny_llama(26)
    keys = list(m.state_dict().keys())
    names = _convert_model(m, "mlp", [0, 1, 2, 24, 25], ScalingConfig())
    assert len(names) == 63
    assert names[0] == "model.layers.3.mlp.gate_proj" and names[-1] == "model.layers.23.mlp.down_proj"
    assert list(m.state_dict().keys()) == keys
    assert type(m.lm_head) is nn.Linear and type(m.model.layers[0].mlp.up_proj) is nn.Linear
    assert type(m.model.layers[5].self_attn.q_proj) is nn.Linear
    assert isinstance(m.model.layers[5].mlp.down_proj, QuantLinear)
    assert type(m.model.embed_tokens) is nn.Embedding


def test_convert_attn_mlp_and_first_last_spec():
    m = tiny_llama(26)
    names = _convert_model(m, "attn_mlp", parse_high_precision_blocks("first3_last2", 26), ScalingConfig())
    assert len(names) == 21 * 7
    assert "model.layers.3.self_attn.o_proj" in names and "model.layers.2.self_attn.q_proj" not in names


def test_convert_shares_parameters_and_matches_outputs_when_off():
    m = tiny_llama(3)
    ids = torch.randint(0, 96, (2, 12))
    ref = m(ids).logits
    w = m.model.layers[1].mlp.up_proj.weight
    _convert_model(m, "mlp", None, ScalingConfig(), enabled=False)
    assert m.model.layers[1].mlp.up_proj.weight is w
    assert torch.equal(m(ids).logits, ref)
    set_quantization(m, True)
    assert not torch.equal(m(ids).logits, ref)


def test_convert_errors():
    m = tiny_llama(4)
    with pytest.raises(ValueError, match="scope='mlp_only'.*allowed"):
        _convert_model(m, "mlp_only", None)
    with pytest.raises(ValueError, match="block index 4 out of range 0..3"):
        _convert_model(m, "mlp", [0, 4])
    with pytest.raises(ValueError, match="no ModuleList of decoder layers"):
        _convert_model(nn.Sequential(nn.Linear(4, 4)), "mlp", None)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.LayerNorm(4))  # an MLP container without any GEMM

    with pytest.raises(ValueError, match="no GEMM weight .* in the 2 blocks"):
        _convert_model(nn.ModuleList([Block(), Block()]), "mlp", None)


def test_parse_high_precision_blocks():
    assert parse_high_precision_blocks("first3_last2", 26) == [0, 1, 2, 24, 25]
    assert parse_high_precision_blocks("first2", 10) == [0, 1]
    assert parse_high_precision_blocks("last1", 10) == [9]
    assert parse_high_precision_blocks("none", 10) == [] == parse_high_precision_blocks(None, 10)
    assert parse_high_precision_blocks([5, 1, 1], 10) == [1, 5]
    assert parse_high_precision_blocks("0, 3", 10) == [0, 3]
    for bad in ("first8_last3", [-1], [10], "middle2", [True]):
        with pytest.raises(ValueError, match="high_precision_blocks"):
            parse_high_precision_blocks(bad, 10)


# ------------------------------------------------------------------------------------------------ model-level helpers
def _train_steps(m, steps, start=0, seed=0):
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    for step in range(start, start + steps):
        set_step(m, step)
        gen = torch.Generator().manual_seed(seed + step)
        for _ in range(2):  # two micro-batches per step
            ids = torch.randint(0, 96, (2, 12), generator=gen)
            loss = m(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def test_quant_state_round_trip_resumes_exactly():
    cfg = ScalingConfig(algo={0: "most_recent", 1: "max"}, history_len=3, interval={0: 1, 2: 3})
    a = tiny_llama(3)
    _convert_model(a, "mlp", [0], cfg)
    _train_steps(a, 2)
    weights = {k: v.clone() for k, v in a.state_dict().items()}
    qsd = quant_state_dict(a)
    ref = _train_steps(a, 2, start=2)  # resumes mid-interval (2 calls per step, interval 3)
    b = tiny_llama(3, seed=9)
    _convert_model(b, "mlp", [0], cfg)
    b.load_state_dict(weights)
    load_quant_state_dict(b, qsd)
    assert _train_steps(b, 2, start=2) == ref
    with pytest.raises(KeyError, match="missing scalers"):
        load_quant_state_dict(b, {k: v for k, v in qsd.items() if ".G." not in k})


def test_set_quantization_resets_only_on_switch_on():
    m = tiny_llama(2)
    _convert_model(m, "mlp", None, ScalingConfig(), enabled=False)
    layer = m.model.layers[0].mlp.gate_proj
    _train_steps(m, 1)
    assert not layer.scaler_a.initialized  # off: quantizers never ran
    set_quantization(m, True)
    _train_steps(m, 1)
    total = layer.scaler_a.total.item()
    assert total == 2
    set_quantization(m, True)  # already on: no reset
    assert layer.scaler_a.total.item() == total
    set_quantization(m, False)
    set_quantization(m, True)  # off -> on: cold start
    assert layer.scaler_a.total.item() == 0 and not layer.scaler_a.initialized


def test_freeze_scales_keeps_history():
    m = tiny_llama(2)
    _convert_model(m, "mlp", None, ScalingConfig())
    _train_steps(m, 1)
    before = quant_state_dict(m)
    freeze_scales(m, True)
    with torch.no_grad():
        m(torch.randint(0, 96, (2, 12)))
    after = quant_state_dict(m)
    for k in before:
        if k.endswith((".history", ".total")):
            assert torch.equal(before[k], after[k]), k


def test_step_telemetry_and_dump(tmp_path):
    m = tiny_llama(2)
    names = _convert_model(m, "mlp", None, ScalingConfig(telemetry_dump_every=2))
    _train_steps(m, 1, start=0)
    n = dump_telemetry(m, tmp_path / "telemetry" / "layers.jsonl")
    tel = step_telemetry(m)
    assert n == 3 * len(names)
    lines = [json.loads(s) for s in (tmp_path / "telemetry" / "layers.jsonl").read_text().splitlines()]
    assert len(lines) == n and {r["role"] for r in lines} == {"A", "W", "G"}
    assert all(r["calls"] == 2 and r["stats_calls"] == 2 for r in lines)  # step 0 is a dump step
    for role in "AWG":
        assert tel[f"tel/{role}/calls"] == 2 * len(names)
        assert tel[f"tel/{role}/amax_ratio_max"] >= 1.0  # cold start = exactly 1 on the first call
        assert tel[f"tel/{role}/clipped_count"] == 0
    assert step_telemetry(m)["tel/A/calls"] == 0  # reset by the previous call


def test_export_round_trip_restores_scales(tmp_path):
    cfg = ScalingConfig(algo="max", history_len=8)
    m = tiny_llama(4)
    names = _convert_model(m, "mlp", parse_high_precision_blocks("first1_last1", len(m.model.layers)), cfg)
    _train_steps(m, 2)
    m.save_pretrained(tmp_path)
    save_quant_export(m, tmp_path, {"experiment": "exp8"})
    plain = LlamaForCausalLM.from_pretrained(tmp_path)  # plain transformers loads it: same keys
    assert not any(isinstance(mod, QuantLinear) for mod in plain.modules())
    meta = load_quant_export(plain, tmp_path)
    assert meta == {"experiment": "exp8"}
    assert plain._hif8qat_conversion["converted"] == names
    qa, qb = quant_state_dict(m), quant_state_dict(plain)
    assert qa.keys() == qb.keys()
    for k in qa:
        assert torch.equal(qa[k], qb[k]), k
    freeze_scales(m, True)
    freeze_scales(plain, True)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, plain.eval()(ids).logits)


def test_model_dtype_cast_keeps_scaler_state_in_fp32():
    m = tiny_llama(2)
    _convert_model(m, "mlp", None, ScalingConfig())
    m.to(torch.bfloat16)  # the authors' BF16 parameters (quirks=authors)
    layer = m.model.layers[1].mlp.up_proj
    assert layer.weight.dtype == torch.bfloat16
    assert layer.scaler_a.history.dtype == torch.float32 and layer.scaler_a.est_block.dtype == torch.float64
    ids = torch.randint(0, 96, (2, 8))
    loss = m(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and layer.weight.grad.dtype == torch.bfloat16
    assert layer.scaler_g.total.item() == 1


# ------------------------------------------------------------------------------------------------ hot path
class _OldFormulation(torch.autograd.Function):
    """The quantized linear as it was before the kernels wrote the matmul dtype and the forward's Q(W) was
    kept: quantize in the input's dtype, then cast; re-quantize W in the backward with the forward's scale."""

    @staticmethod
    def forward(ctx, x, weight, bias, bank_id, rows):
        qa = bank_qdq(x, bank_id, rows[0], RECORD)
        qw = bank_qdq(weight, bank_id, rows[1], RECORD)
        cdt = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        if cdt is not None:
            qa, qw = qa.to(cdt), qw.to(cdt)
            with torch.autocast("cpu", enabled=False):
                out = F.linear(qa, qw, bias.to(cdt))
        else:
            out = F.linear(qa, qw, bias)
        ctx.save_for_backward(qa, weight)
        ctx.quant = (bank_id, rows, cdt, x.dtype, weight.dtype, bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qa, weight = ctx.saved_tensors
        bank_id, rows, cdt, x_dtype, w_dtype, b_dtype = ctx.quant
        qg = bank_qdq(grad_out, bank_id, rows[2], RECORD)
        qw = bank_qdq(weight, bank_id, rows[1], REPLAY)
        if cdt is not None:
            qw = qw.to(cdt)
        qg = qg.to(qw.dtype)
        g2 = qg.reshape(-1, qg.shape[-1])
        return (qg.matmul(qw).to(x_dtype), g2.t().matmul(qa.reshape(-1, qa.shape[-1])).to(w_dtype),
                g2.sum(0).to(b_dtype), None, None)


def _steps(layer, xs, gs, autocast, old=False):
    """Forward + backward per micro-batch; returns (y, dx, dW, db) of each, and the layer's scale history."""
    out = []
    for x, g in zip(xs, gs):
        x = x.detach().clone().requires_grad_(True)
        layer.weight.grad = layer.bias.grad = None
        torch.manual_seed(7)  # stochastic G rounding draws the same bits on both paths
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if old:
                y = _OldFormulation.apply(x, layer.weight, layer.bias, layer.bank.bank_id, layer._rows)
            else:
                y = layer(x)
        y.backward(g.to(y.dtype))
        out.append((y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    return out, layer.bank.history.clone()


@pytest.mark.parametrize("autocast,x_dtype", [(False, torch.float32), (True, torch.float32),
                                              (True, torch.bfloat16)])
@pytest.mark.parametrize("fmt,grad_rounding", [("hif8", "ta"), ("hif8", "stochastic"), ("hybrid", "ta")])
@pytest.mark.parametrize("recompute", [False, True])
def test_hot_path_is_bitwise_the_old_formulation(autocast, x_dtype, fmt, grad_rounding, recompute):
    """Kernels writing the matmul dtype and the kept Q(W) (or, under FSDP, the recomputed one) give the
    outputs, all three gradients and the scale histories of quantize-then-cast with Q(W) re-quantized."""
    torch.manual_seed(11)
    cfg = ScalingConfig(algo="max", history_len=4, format=fmt, grad_rounding=grad_rounding)
    new = QuantLinear(64, 48, bias=True, config=cfg, name="l")  # >= 1024 elements each: the compiled kernels
    old = copy.deepcopy(new)
    set_weight_recompute(new, recompute)
    gen = torch.Generator().manual_seed(12)
    xs = [(torch.randn(4, 8, 64, generator=gen) * m).to(x_dtype) for m in (1.0, 3.0, 0.5)]
    gs = [torch.randn(4, 8, 48, generator=gen) * m for m in (0.01, 0.2, 0.05)]
    got, hist = _steps(new, xs, gs, autocast)
    want, hist_old = _steps(old, xs, gs, autocast, old=True)
    for a, b in zip(got, want):
        for t, u in zip(a, b):
            assert t.dtype == u.dtype and torch.equal(t.view(torch.int16 if t.element_size() == 2 else torch.int32),
                                                      u.view(torch.int16 if u.element_size() == 2 else torch.int32))
    assert torch.equal(hist, hist_old)
    assert not torch.equal(got[0][0].float(), F.linear(xs[0].float(), new.weight, new.bias).to(got[0][0].dtype))


def _weight_calls(counter, layer):
    return sum(p == layer.weight.data_ptr() for p in counter.ptrs)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_weight_is_quantized_once_per_micro_batch(checkpointed):
    """A, W, G once each per micro-batch; activation checkpointing recomputes A, and reuses the forward's
    Q(W) (bit for bit what re-quantizing gives); under FSDP (recompute) the backward quantizes W again."""
    from torch.utils.checkpoint import checkpoint

    from hif8qat.formats.qdq import count_qdq

    torch.manual_seed(5)
    layers = {k: QuantLinear(64, 48, bias=True, config=ScalingConfig(), name="l") for k in ("keep", "fsdp")}
    layers["fsdp"].load_state_dict(layers["keep"].state_dict())
    set_weight_recompute(layers["fsdp"])
    x = torch.randn(4, 8, 64, requires_grad=True)
    res = {}
    for k, layer in layers.items():
        with count_qdq() as c:
            for _ in range(2):  # two micro-batches
                x.grad = None
                y = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
                y.sum().backward()
        res[k] = (c, y.detach(), x.grad.clone(), layer.weight.grad.clone())
    keep, fsdp = res["keep"][0], res["fsdp"][0]
    assert _weight_calls(keep, layers["keep"]) == 2  # once per micro-batch
    assert keep.calls == 2 * (4 if checkpointed else 3)  # A (twice when recomputed), W, G
    assert _weight_calls(fsdp, layers["fsdp"]) == 2 * (3 if checkpointed else 2)
    for a, b in zip(res["keep"][1:], res["fsdp"][1:]):
        assert torch.equal(a, b)


def test_qdq_counter_counts_bytes_and_dtypes():
    from hif8qat.formats.qdq import count_qdq, hif8_qdq_scaled_amax, qdq_scaled_amax

    x = torch.randn(3, 700)
    with count_qdq() as c:
        hif8_qdq_scaled_amax(x, 2.0, out_dtype=torch.bfloat16)
        qdq_scaled_amax(x.bfloat16(), 2.0, "e4m3")
    assert c.calls == 2
    assert c.bytes == 2100 * (4 + 2) + 2100 * (2 + 2)
    assert [r[:3] for r in c.records] == [((3, 700), torch.float32, torch.bfloat16),
                                         ((3, 700), torch.bfloat16, torch.bfloat16)]
    hif8_qdq_scaled_amax(x, 2.0)
    assert c.calls == 2  # nothing counted outside the block


def test_a_kept_quantized_weight_is_dropped_by_its_layers_backward():
    """Q(W) kept for a checkpoint recompute must not outlive its layer's backward: held to the end of the
    micro-batch, every layer's Q(W) would be alive at once late in the backward."""
    torch.manual_seed(6)
    first, second = (QuantLinear(32, 32, config=ScalingConfig(), name=n) for n in ("a", "b"))
    x = torch.randn(4, 32, requires_grad=True)
    hidden = first(x)
    seen = {}
    # the gradient of `hidden` is ready once `second`'s backward has run, and before `first`'s
    hidden.register_hook(lambda g: seen.update(second=len(second._bank._kept), first=len(first._bank._kept)))
    second(hidden).sum().backward()
    assert seen == {"second": 0, "first": 1}


@pytest.mark.parametrize("hooked", [False, True])
def test_under_fake_tensors_the_hook_keeps_the_forwards_quantized_weight_for_the_recompute(monkeypatch, hooked):
    """Fake tensors run the bank op's shape-only implementation, which keeps nothing: without the hook a checkpoint
    recompute quantizes W again, where the real op hands back the forward's Q(W) (as
    test_weight_is_quantized_once_per_micro_batch pins). Within keep_weights_under_fake_tensors the recompute gets
    the forward's result, and the layer's backward drops it: one W call per micro-batch reaches the op, as on real
    tensors, and no Q(W) outlives its backward."""
    import weakref

    from torch._subclasses.fake_tensor import FakeTensorMode  # the mode the memory estimate simulates under
    from torch.utils.checkpoint import checkpoint

    from hif8qat.quant import gemm

    op, reached, results = gemm.bank_qdq, [], []

    def spy(x, bank_id, row, mode, out_dtype=None, keep=False):
        y = op(x, bank_id, row, mode, out_dtype, keep)
        reached.append(row)
        results.append(weakref.ref(y))
        return y

    monkeypatch.setattr(gemm, "bank_qdq", spy)
    with FakeTensorMode(allow_non_fake_inputs=True), (
            gemm.keep_weights_under_fake_tensors() if hooked else contextlib.nullcontext()):
        layer = QuantLinear(32, 16, config=ScalingConfig(), name="l")
        w_row = layer._row0 + 1
        x = torch.randn(4, 32, requires_grad=True)
        for _ in range(2):  # two micro-batches
            checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert gemm.bank_qdq is spy  # the hook puts back what it found
    assert reached.count(w_row) == (2 if hooked else 4)
    w_results = [r for row, r in zip(reached, results) if row == w_row]
    assert all(r() is None for r in w_results), "a quantized weight outlived its layer's backward"
