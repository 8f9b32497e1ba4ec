"""The scaler bank against the test reference (tests/reference_scaling.py; scales, losses and gradients bit for
bit), traceability, recompute safety, the backward's weight re-quantization and loading exports written before
the bank."""

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference_scaling import DelayedScaler
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hif8qat.formats.qdq import hif8_qdq_scaled
from hif8qat.models.loading import enable_activation_checkpointing
from hif8qat.models.quant_files import load_quant_export
from hif8qat.quant.linear import (
    QuantLinear,
    _convert_model,
    freeze_scales,
    quant_linears,
    quant_state_dict,
    set_quantization,
    set_step,
    update_scales,
)
from hif8qat.scaling.bank import QuantizerCalledTwice, ScalerBank
from hif8qat.scaling.bank_row import BankedScaler
from hif8qat.scaling.settings import ROLES, ScalingConfig

REPO = Path(__file__).resolve().parents[2]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal values, NaN equal to NaN (unset exp_smooth scores are NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


# The exp_smooth forecaster's float64 internals (forecast estimates, cross-validation errors) are computed in a
# different order by the reference (plain Python) and the bank (numpy): they agree to rounding, not bit for
# bit. Everything else, the float32 scales included, must be identical.
ROUNDED = ("est_block", "es_scores")


def agree(key: str, ref: torch.Tensor, got: torch.Tensor) -> bool:
    if key not in ROUNDED:
        return same(ref, got)
    return ref.dtype == got.dtype and ref.shape == got.shape and torch.allclose(ref, got, rtol=1e-9, atol=0,
                                                                                  equal_nan=True)


ONE_THREAD = True  # conftest._one_thread


def tiny_llama(num_layers=2, seed=0):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


# ------------------------------------------------------------------------------------------------ reference layer
class _RefFn(torch.autograd.Function):
    """A quantized linear built from reference scalers: one per role, Q(W) saved for backward."""

    @staticmethod
    def forward(ctx, x, w, b, sa, sw, sg):
        qa, qw = sa.quantize(x), sw.quantize(w)
        ctx.save_for_backward(qa, qw)
        ctx.sg, ctx.has_b = sg, b is not None
        return F.linear(qa, qw, b)

    @staticmethod
    def backward(ctx, g):
        qa, qw = ctx.saved_tensors
        qg = ctx.sg.quantize(g)
        dw = qg.reshape(-1, qg.shape[-1]).t().matmul(qa.reshape(-1, qa.shape[-1]))
        db = qg.reshape(-1, qg.shape[-1]).sum(0) if ctx.has_b else None
        return qg.matmul(qw), dw, db, None, None, None


class RefLinear(nn.Linear):
    def __init__(self, lin: nn.Linear, cfg: ScalingConfig):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        self.weight, self.bias = lin.weight, lin.bias
        self.sc = nn.ModuleList([DelayedScaler(r, cfg) for r in ROLES])
        self.on = False

    def forward(self, x):
        if not self.on:
            return F.linear(x, self.weight, self.bias)
        return _RefFn.apply(x, self.weight, self.bias, *self.sc)


def reference_model(cfg: ScalingConfig, scope: str, seed: int) -> tuple[nn.Module, dict[str, RefLinear]]:
    ref = tiny_llama(seed=seed)
    names = _convert_model(tiny_llama(seed=seed), scope, None, cfg)  # which linears, by the real rule
    layers = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        layers[name] = RefLinear(ref.get_submodule(name), cfg)
        setattr(ref.get_submodule(parent), leaf, layers[name])
    return ref, layers


CONFIGS = [
    ScalingConfig(algo="max", history_len=4),
    ScalingConfig(algo={0: "most_recent", 2: "exp_smooth"}, history_len=30, interval={0: 1, 2: 3}),
    ScalingConfig(algo="mean", history_len=3, interval=2, history_unit="step"),
    ScalingConfig(algo={0: "most_recent", 3: "max"}, history_len=5, history_unit="step", grad_rounding="stochastic"),
    # FP8 (E4M3 for A/W, E5M2 for G; a margin) and just-in-time scaling, alone and as a phase of a schedule
    ScalingConfig(format="hybrid", algo="max", history_len=4),
    ScalingConfig(format="e5m2", margin=2, algo={0: "most_recent", 2: "exp_smooth"}, history_len=30,
                  interval={0: 1, 2: 3}),
    ScalingConfig(algo="current", history_len=4),
    ScalingConfig(format="hybrid", algo={0: "max", 2: "current", 4: "most_recent"}, history_len=5,
                  history_unit="step", interval=2),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["max", "mr_es_interval", "mean_step", "step_stochastic", "hybrid_max",
                                              "e5m2_margin_es", "current", "hybrid_current_phase_step"])
def test_model_training_matches_reference_scalers_bitwise(cfg):
    """Losses, gradients and every scaler's state equal the per-scaler reference, with gradient
    accumulation, a BF16 warmup step (QAT switched on at step 1), schedules and a state round trip."""
    bank_m = tiny_llama(seed=1)
    names = _convert_model(bank_m, "attn_mlp", None, cfg, enabled=False)
    ref_m, ref_layers = reference_model(cfg, "attn_mlp", seed=1)
    gen = torch.Generator().manual_seed(0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (bank_m, ref_m)]
    for step in range(6):
        if step == 1:
            set_quantization(bank_m, True)
            for lay in ref_layers.values():
                lay.on = True
                for s in lay.sc:
                    s.reset()
        set_step(bank_m, step)
        for lay in ref_layers.values():
            for s in lay.sc:
                s.set_step(step)
        for _ in range(2):  # accumulation: two micro-batches per step
            ids = torch.randint(0, 96, (2, 10), generator=gen)
            # the bank's stochastic rounding draws from its own generator, the reference's from the default one:
            # the same state, so the same draws
            bank_gen = bank_m.hif8qat_bank.generator()
            states = bank_gen.get_state() if bank_gen is not None else torch.random.get_rng_state()
            loss_b = bank_m(ids, labels=ids).loss
            loss_b.backward()
            torch.random.set_rng_state(states)
            loss_r = ref_m(ids, labels=ids).loss
            loss_r.backward()
            assert loss_b.item() == loss_r.item(), step
        for (nb, pb), (nr, pr) in zip(bank_m.named_parameters(), ref_m.named_parameters()):
            assert nb == nr and torch.equal(pb.grad, pr.grad), (step, nb)
        for o in opts:
            o.step()
            o.zero_grad()
    qsd = quant_state_dict(bank_m)
    for name in names:
        for role, sc in zip(ROLES, ref_layers[name].sc):
            for k, v in sc.state_dict().items():
                if k == "meta":  # frozen flag / step bookkeeping are bank-wide; the rest must agree
                    assert v.tolist()[:6] + v.tolist()[7:] == qsd[f"{name}.{role}.{k}"].tolist()[:6] + \
                        qsd[f"{name}.{role}.{k}"].tolist()[7:], (name, role)
                else:
                    assert agree(k, v, qsd[f"{name}.{role}.{k}"]), (name, role, k)


@pytest.mark.parametrize("cfg", [
    ScalingConfig(algo={0: "max", 4: "exp_smooth", 9: "mean"}, history_len=6, interval={0: 1, 4: 3}),
    ScalingConfig(format="hybrid", algo={0: "max", 4: "current", 9: "exp_smooth", 15: "current"}, history_len=6,
                  interval={0: 1, 9: 2}),
], ids=["hif8", "hybrid_current"])
def test_many_rows_with_uneven_calls_match_one_reference_scaler_each(cfg):
    """Rows that skip micro-batches (disabled layers, no backward) keep their own timeline exactly."""
    rng = random.Random(5)
    roles = ["A", "W", "G", "A", "G", "W"]
    bank = ScalerBank(cfg, roles)
    refs = [DelayedScaler(r, cfg) for r in roles]
    for mb in range(80):
        step = mb // 3
        bank.set_step(step)
        called = [rng.random() < 0.7 for _ in roles]
        for r, (c, ref) in enumerate(zip(called, refs)):
            if not c:
                continue
            a = math.exp(rng.gauss(0.02 * mb, 0.5)) if rng.random() > 0.05 else rng.choice([math.nan, math.inf, 0.0])
            ref.set_step(step)
            want = ref.observe_amax(a)
            got = bank.observe(r, torch.tensor(a))
            assert got.item() == want.item() or (math.isnan(got.item()) and math.isnan(want.item())), (mb, r)
        bank.update()
        if mb == 40:  # reset two rows mid-way, as switching a layer off and on does
            bank.reset([1, 4])
            refs[1].reset()
            refs[4].reset()
    for r, ref in enumerate(refs):
        want = ref.state_dict()
        got = bank.row_state_dict(r)
        for k in want:
            if k != "meta":
                assert agree(k, want[k], got[k]), (r, k)


@pytest.mark.parametrize("role", ["A", "G"])  # G forecasts with the authors' "D" parameter set
@pytest.mark.parametrize("cfg", [
    ScalingConfig(algo="exp_smooth", history_len=30, interval={0: 1, 60: 4, 120: 7}),
    ScalingConfig(algo={0: "max", 30: "exp_smooth", 150: "mean"}, history_len=64, interval=3),
], ids=["es_interval_schedule", "max_es_mean"])
def test_exp_smooth_forecasts_match_the_reference_on_long_traces(cfg, role):
    """Past the 20-observation warm-up: cross-validated ensemble forecasts, horizons 1 to 7 (both bound sets),
    spikes, NaN and zero amaxes; the scales agree bit for bit, the forecaster state to rounding."""
    rng = random.Random(7)
    trace = []
    for i in range(200):
        a = math.exp(rng.gauss(0.01 * i + (3.0 if i % 37 == 5 else 0.0), 0.4))  # a drift and periodic spikes
        trace.append(math.nan if i % 53 == 7 else 0.0 if i % 71 == 9 else a)
    bank, ref = BankedScaler.standalone(role, cfg), DelayedScaler(role, cfg)
    for step, a in enumerate(trace):
        bank.set_step(step)
        ref.set_step(step)
        assert bank.observe_amax(a).item() == ref.observe_amax(a).item(), step
    want, got = ref.state_dict(), bank.state_dict()
    assert set(want) == set(got) and len(got["es_obs"]) > 100
    for k in want:
        assert agree(k, want[k], got[k]), k


# ------------------------------------------------------------------------------------------------ traceability
@pytest.mark.parametrize("cfg", [ScalingConfig(), ScalingConfig(format="hybrid"), ScalingConfig(algo="current")],
                         ids=["hif8", "hybrid", "current"])
def test_whole_model_compile_has_no_graph_break_from_quantized_linears(cfg):
    m = tiny_llama()
    _convert_model(m, "attn_mlp", None, cfg)
    ids = torch.randint(0, 96, (2, 8))

    def train_forward(ids):
        return m(input_ids=ids).logits

    explain = torch._dynamo.explain(train_forward)(ids)
    update_scales(m)  # explain ran a forward whose backward never comes
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1


def test_compiled_training_step_records_like_eager():
    eager = tiny_llama()
    _convert_model(eager, "mlp", None, ScalingConfig(algo="max", history_len=4))
    compiled_src = tiny_llama()
    _convert_model(compiled_src, "mlp", None, ScalingConfig(algo="max", history_len=4))
    compiled = torch.compile(compiled_src)
    ids = torch.randint(0, 96, (2, 8))
    for _ in range(3):
        for m in (eager, compiled):
            m(input_ids=ids, labels=ids).loss.backward()
    a, b = quant_state_dict(eager), quant_state_dict(compiled_src)
    # W sees the same weights: identical histories; every quantizer appended once per micro-batch
    for k in a:
        if k.endswith(".W.history"):
            assert torch.equal(a[k], b[k]), k
        if k.endswith(".total"):
            assert a[k].item() == b[k].item() == 3, k


# ------------------------------------------------------------------------------------------------ backward memory
@pytest.mark.parametrize("recompute", [False, True])
def test_backward_saves_quantized_weight_unless_told_to_recompute_it(recompute):
    """Unsharded: the forward's Q(W) is saved for the backward. FSDP (set_weight_recompute): W itself is saved
    and re-quantized in the backward, which records nothing."""
    from hif8qat.quant.linear import set_weight_recompute

    torch.manual_seed(0)
    layer = QuantLinear(32, 48, config=ScalingConfig())
    set_weight_recompute(layer, recompute)
    x = torch.randn(4, 32, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    weight_sized = [t for t in saved if t.shape == layer.weight.shape]
    assert len(weight_sized) == 1
    is_w = weight_sized[0].data_ptr() == layer.weight.data_ptr()
    assert is_w == recompute
    if not recompute:  # Q(W): the weight's own values, quantized with the W scaler's scale
        w = layer.weight.detach()
        s_w = 15.0 / (w.abs().max().double() + 1e-12)
        assert torch.equal(weight_sized[0], hif8_qdq_scaled(w, s_w.float()))
    y.backward(torch.randn_like(y))
    assert layer.scaler_w.total.item() == 1  # one W record per micro-batch either way


# ------------------------------------------------------------------------------------------------ recompute safety
def _grads_with_checkpointing(use_ckpt: bool, steps: int = 3):
    m = tiny_llama(num_layers=3, seed=2)
    _convert_model(m, "attn_mlp", None, ScalingConfig(algo="max", history_len=4, interval=2))
    if use_ckpt:
        enable_activation_checkpointing(m, {"use_reentrant": False})
    m.train()
    grads = []
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        set_step(m, step)
        ids = torch.randint(0, 96, (2, 10), generator=gen)
        m(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        m.zero_grad()
    return grads, quant_state_dict(m)


def test_activation_checkpointing_reuses_forward_scales_and_records_once():
    ref_grads, ref_state = _grads_with_checkpointing(False)
    grads, state = _grads_with_checkpointing(True)
    for g_ref, g in zip(ref_grads, grads):
        for n in g_ref:
            assert torch.equal(g_ref[n], g[n]), n
    for k in ref_state:
        assert torch.equal(ref_state[k], state[k]), k
    assert all(v.item() == 3 for k, v in state.items() if k.endswith(".total"))


def test_layer_called_twice_in_one_micro_batch_is_refused():
    layer = QuantLinear(8, 8, config=ScalingConfig(), name="blocks.0.mlp.up_proj")
    x = torch.randn(2, 8, requires_grad=True)
    y = layer(x)
    with pytest.raises(QuantizerCalledTwice, match=r"blocks\.0\.mlp\.up_proj\.A was called twice"):
        layer(y)
    update_scales(layer)  # what the message suggests for a forward whose backward never ran
    layer(x).sum().backward()
    # the refused call recorded nothing: one entry from the flushed forward, one from the training pass
    assert layer.scaler_a.total.item() == 2 and layer.scaler_g.total.item() == 1


def test_forward_only_passes_record_one_entry_per_call():
    m = tiny_llama()
    _convert_model(m, "mlp", None, ScalingConfig(algo="most_recent", history_len=8))
    with torch.no_grad():
        for _ in range(3):
            m(torch.randint(0, 96, (2, 8)))
    state = quant_state_dict(m)
    assert all(state[k].item() == (0 if ".G." in k else 3) for k in state if k.endswith(".total"))


def test_frozen_bank_records_nothing():
    m = tiny_llama()
    _convert_model(m, "mlp", None, ScalingConfig())
    m(torch.randint(0, 96, (2, 8)), labels=torch.randint(0, 96, (2, 8))).loss.backward()
    before = quant_state_dict(m)
    freeze_scales(m, True)
    with torch.no_grad():
        for _ in range(2):
            m(torch.randint(0, 96, (2, 8)))
    after = quant_state_dict(m)
    assert all(torch.equal(before[k], after[k]) for k in before if not k.endswith(".meta"))


# ------------------------------------------------------------------------------------------------ exports
def test_reference_run_export_loads_for_evaluation():
    """Exports written by the per-scaler implementation load into the bank unchanged."""
    exports = sorted((REPO / "results" / "reference_runs" / "mini").glob("exp*/seed*/export/hif8qat_quant.json"))
    if not exports:
        pytest.skip("no committed reference runs")
    from safetensors.torch import load_file

    export = exports[0].parent
    import json

    doc = json.loads(exports[0].read_text())
    layers = max(int(n.split(".")[2]) for n in doc["converted"]) + 1
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    load_quant_export(model, export)
    saved = load_file(str(export / "hif8qat_scalers.safetensors"))
    state = quant_state_dict(model)
    assert set(state) == set(saved)
    for k in saved:
        if not k.endswith(".meta"):
            assert same(state[k], saved[k]), k
    # the restored scales are what a frozen evaluation uses
    name, layer = next(iter(quant_linears(model)))
    meta = saved[f"{name}.A.meta"].tolist()
    block = saved[f"{name}.A.scale_block"]
    assert layer.scaler_a.scale.item() == block[min(meta[1], block.numel() - 1)].item()
    freeze_scales(model, True)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 64, (1, 6))).logits).all()


def test_exp_smooth_costs_one_host_copy_per_refresh_round_for_the_whole_model(monkeypatch):
    m = tiny_llama(num_layers=3)
    _convert_model(m, "attn_mlp", None, ScalingConfig(algo="exp_smooth", history_len=8, interval=3))
    copies = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *a, **k):
        copies.append(self.numel())
        return real_cpu(self, *a, **k)

    ids = torch.randint(0, 96, (2, 8))
    per_mb = []
    for _ in range(8):
        monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
        m(ids, labels=ids).loss.backward()
        monkeypatch.setattr(torch.Tensor, "cpu", real_cpu)
        per_mb.append(len(copies))
        copies.clear()
    # the cold start's block covers calls 0-2 (interval 3), refreshes at 3 and 6: one copy for 63 quantizers
    assert per_mb == [0, 0, 0, 1, 0, 0, 1, 0]


def test_host_decisions_reach_the_bank_device_only_through_the_sync_free_copy():
    """Every numpy mask, index or forecast the bank moves to its device goes through host_to_device: a direct
    `torch.from_numpy(x).to(device)` is a blocking copy from pageable memory on CUDA (a host sync per
    micro-batch, an error under torch.cuda.set_sync_debug_mode("error"))."""
    import ast

    src = Path(__file__).resolve().parents[2] / "src" / "hif8qat"
    direct = []
    for path in sorted(src.glob("bank*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                    and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Attribute)
                    and node.func.value.func.attr == "from_numpy"):
                direct.append(f"{path.name}:{node.lineno}")
    assert not direct, f"blocking host-to-device copies: {direct}"


def test_host_to_device_pins_and_copies_without_blocking_on_cuda(monkeypatch):
    """What the copy asks of torch on a CUDA device (emulated: no GPU here): page-locked memory first, then a
    non-blocking copy; on CPU the array is used in place."""
    import numpy as np

    from hif8qat.scaling.bank import host_to_device

    mask = np.array([True, False, True])
    on_cpu = host_to_device(mask, torch.device("cpu"))
    mask[1] = True
    assert on_cpu.tolist() == [True, True, True]  # shared, no copy
    asked = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: asked.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: asked.append(("to", a, k)) or self)
    host_to_device(mask, torch.device("cuda", 0))
    assert asked[0] == "pin" and asked[1:] == [("to", (torch.device("cuda", 0),), {"non_blocking": True})]
