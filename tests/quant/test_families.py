"""Every decoder family converts fully: each family built tiny from transformers' own config classes (no download),
converted under ``attn_mlp``, has every GEMM weight of its blocks quantized (routers kept in high precision), the
scopes change the loss, the backward is finite, the state_dict keeps the plain model's keys and shapes, and a resume
is bit-identical. The Llama family (Llama, SmolLM2, openPangu as Llama) converts exactly the layers, in the order,
it always did. Unfamiliar layouts are covered fully or refused, never partly."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

from hif8qat import Hif8TrainingConfig, convert_to_hif8_training, coverage
from hif8qat.artefacts import write_folder_manifest
from hif8qat.models.pangu import OPENPANGU_EMBEDDED_1B_CONFIG, pangu_llama_config
from hif8qat.models.quant_files import dump_telemetry
from hif8qat.quant.linear import _convert_model, quant_state_dict, scaler_banks, set_step

V, H, L = 64, 32, 2  # vocab, hidden, blocks
E = 4  # experts per MoE layer
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)
_LLAMA = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L, **_ATTN)
_MOE = dict(vocab_size=V, hidden_size=H, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=L,
            num_experts_per_tok=2, **_ATTN)

# family: (model class, config, GEMM weights per block counted by hand from the modeling code: attention's,
# the MLP's (each expert's slice counted once), routers)
FAMILIES = {
    "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**_LLAMA), (4, 3, 0)),
    "qwen2": (tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(**_LLAMA), (4, 3, 0)),
    "qwen3": (tf.Qwen3ForCausalLM, lambda: tf.Qwen3Config(**_LLAMA, head_dim=8), (4, 3, 0)),
    "mistral": (tf.MistralForCausalLM, lambda: tf.MistralConfig(**_LLAMA), (4, 3, 0)),
    "gemma2": (tf.Gemma2ForCausalLM, lambda: tf.Gemma2Config(**_LLAMA, head_dim=8), (4, 3, 0)),
    "phi3": (tf.Phi3ForCausalLM, lambda: tf.Phi3Config(**_LLAMA, pad_token_id=0), (2, 2, 0)),  # fused qkv, gate_up
    "gpt_neox": (tf.GPTNeoXForCausalLM, lambda: tf.GPTNeoXConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4), (2, 2, 0)),
    "falcon": (tf.FalconForCausalLM, lambda: tf.FalconConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=4), (2, 2, 0)),
    "opt": (tf.OPTForCausalLM, lambda: tf.OPTConfig(
        vocab_size=V, hidden_size=H, ffn_dim=64, num_hidden_layers=L, num_attention_heads=4, word_embed_proj_dim=H,
        dropout=0.0, attention_dropout=0.0),
        (4, 2, 0)),  # fc1 / fc2 sit in the block itself
    "gpt2": (tf.GPT2LMHeadModel, lambda: tf.GPT2Config(
        vocab_size=V, n_embd=H, n_layer=L, n_head=4, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0), (2, 2, 0)),  # Conv1D
    "mixtral": (tf.MixtralForCausalLM, lambda: tf.MixtralConfig(
        **_LLAMA, num_local_experts=E, num_experts_per_tok=2), (4, 2 * E, 1)),
    "qwen3_moe": (tf.Qwen3MoeForCausalLM, lambda: tf.Qwen3MoeConfig(**_MOE, num_experts=E, head_dim=8),
                  (4, 2 * E, 1)),
    "deepseek_v3": (tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(
        **{**_MOE, "num_key_value_heads": 4}, n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1,
        topk_group=1), (5, 2 * E + 3, 1)),  # MLA: q_a, q_b, kv_a, kv_b, o; shared expert's gate/up/down
}


def _build(family: str, seed: int = 0) -> nn.Module:
    cls, config, _ = FAMILIES[family]
    torch.manual_seed(seed)
    return cls(config()).train()


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(seed))


def _train(model, opt, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        set_step(model, step)
        loss = _loss(model, _tokens(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_converts_every_block_gemm_and_resumes_bit_identically(family, tmp_path, caplog):
    attn, mlp, routers = FAMILIES[family][2]
    plain = _build(family)
    scoped = {}
    for scope in ("mlp", "attn_mlp"):
        model = copy.deepcopy(plain)
        with caplog.at_level(logging.INFO, logger="hif8qat"):
            convert_to_hif8_training(model, config=Hif8TrainingConfig(scope=scope))
        scoped[scope] = model
    cov = coverage(scoped["attn_mlp"])
    counts = {r: list(cov.values()).count(r) for r in set(cov.values())}
    expected = {"quantized": L * (attn + mlp)}
    if routers:
        expected["router (high precision by design)"] = L * routers
    assert counts == expected, cov
    assert f"{L * (attn + mlp)} of {L * (attn + mlp + routers)} GEMM weights" in caplog.text
    assert list(coverage(scoped["mlp"]).values()).count("scope") == L * attn
    assert set(coverage(plain).values()) == {"not converted"}

    # the scopes are different experiments: three different losses, finite gradients
    tokens = _tokens(99)
    losses = {}
    for name, model in (("plain", plain), *scoped.items()):
        loss = _loss(model, tokens)
        loss.backward()
        losses[name] = loss.item()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), name
        model.zero_grad(set_to_none=True)
    assert len(set(losses.values())) == 3, losses

    # the plain model's keys and shapes, plus the scalers'
    full = scoped["attn_mlp"].state_dict()
    for key, value in plain.state_dict().items():
        assert key in full and full[key].shape == value.shape, key

    # a resume from the state_dict continues bit for bit
    model = _build(family, seed=1)
    convert_to_hif8_training(model, config=Hif8TrainingConfig(scope="attn_mlp", history_len=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 2)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    straight = _train(model, opt, 2, start=2)
    resumed = _build(family, seed=2)
    convert_to_hif8_training(resumed, config=Hif8TrainingConfig(scope="attn_mlp", history_len=4))
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    opt2.load_state_dict(ckpt["opt"])
    assert _train(resumed, opt2, 2, start=2) == straight


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_each_expert_has_its_own_scalers(family, tmp_path):
    model = _build(family)
    convert_to_hif8_training(model, config=Hif8TrainingConfig(scope="mlp", algo="max", history_len=4))
    _loss(model, _tokens(0)).backward()
    sd = model.state_dict()
    experts = next(n for n, m in model.named_modules() if n.endswith("mlp.experts"))
    weights = dict(model.named_parameters())
    w_amax = []
    for param in ("gate_up_proj", "down_proj"):
        for e in range(E):
            if sd[f"{experts}.hif8_scaler.{param}.{e}.W.total"].item() == 0:
                continue  # no token was routed to expert e
            w_amax.append(sd[f"{experts}.hif8_scaler.{param}.{e}.W.history"].max().item())
            # the W scaler of expert e saw expert e's slice alone
            assert w_amax[-1] == pytest.approx(weights[f"{experts}.{param}"][e].abs().max().item(), rel=1e-6)
    assert len(w_amax) >= E and len(set(w_amax)) == len(w_amax)
    assert f"{experts}.gate_up_proj.0.A.history" in quant_state_dict(model)
    bank = scaler_banks(model)[0]
    assert f"{experts}.down_proj.{E - 1}.G" in bank._row_names
    dump_telemetry(model, tmp_path / "layers.jsonl")  # one line per role of every expert's GEMMs
    lines = [json.loads(x) for x in (tmp_path / "layers.jsonl").read_text().splitlines()]
    assert {(r["layer"], r["role"]) for r in lines if r["layer"].startswith(experts)} == {
        (f"{experts}.{p}.{e}", role) for p in ("gate_up_proj", "down_proj") for e in range(E) for role in "AWG"}


# ------------------------------------------------------------------ the Llama family: unchanged selection
@pytest.mark.parametrize("config", [
    lambda: tf.LlamaConfig(**_LLAMA),                                                         # Llama
    lambda: tf.LlamaConfig(**{**_LLAMA, "num_key_value_heads": 4}, tie_word_embeddings=True),  # SmolLM2's shape
    lambda: pangu_llama_config({**OPENPANGU_EMBEDDED_1B_CONFIG, "vocab_size": V, "hidden_size": H,
                                "intermediate_size": 64, "num_hidden_layers": 3, **_ATTN}),   # openPangu
], ids=["llama", "smollm2", "openpangu"])
@pytest.mark.parametrize(("scope", "hp"), [("mlp", ()), ("attn_mlp", ()), ("attn_mlp", (0,)), ("mlp", (1,))])
def test_llama_family_converts_the_same_layers_in_the_same_order(config, scope, hp):
    model = tf.LlamaForCausalLM(config())
    n = model.config.num_hidden_layers
    attn = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = [f"model.layers.{i}.{p}" for i in range(n) if i not in hp
                for p in ((attn if scope == "attn_mlp" else []) + mlp)]
    skip_down = lambda mod, fqn: not fqn.endswith("layers.2.mlp.down_proj")  # noqa: E731
    got = _convert_model(model, scope, hp, module_filter_fn=skip_down)
    assert got == [e for e in expected if not e.endswith("layers.2.mlp.down_proj")]
    assert scaler_banks(model)[0]._row_names == [f"{e}.{r}" for e in got for r in "AWG"]


# ------------------------------------------------------------------ unfamiliar layouts, bad input
class _Part(nn.Module):
    def __init__(self, *names):
        super().__init__()
        for n in names:
            setattr(self, n, nn.Linear(8, 8))


class _Block(nn.Module):
    def __init__(self, attn_name="attn", mlp_name="ffn"):
        super().__init__()
        setattr(self, attn_name, _Part("wq", "wk", "wv", "wo"))
        setattr(self, mlp_name, _Part("w1", "w2", "w3"))

    def forward(self, x):
        parts = list(self.children())
        return x + sum(lin(x) for part in parts for lin in part.children())


def _stack(**kw) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([_Block(**kw) for _ in range(2)])
    return model


def test_unfamiliar_names_inside_known_containers_are_covered_fully():
    model = _stack()
    convert_to_hif8_training(model, config=Hif8TrainingConfig(scope="attn_mlp"))
    assert list(coverage(model).values()) == ["quantized"] * 14


def test_a_dense_mlps_gate_projection_is_no_router():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module() for _ in range(2)])
    for block in model.layers:
        block.self_attn, block.mlp = _Part("wq", "wo"), _Part("gate", "up", "down")
    convert_to_hif8_training(model, config=Hif8TrainingConfig(scope="attn_mlp"))
    assert list(coverage(model).values()) == ["quantized"] * 10


def test_an_undecidable_layout_is_refused_whole_then_mapped_by_role_map():
    model = _stack(attn_name="mixer", mlp_name="channel")
    with pytest.raises(ValueError, match=r"cannot tell.*layers\.0\.mixer\.wq.*role_map=.*module_filter_fn"):
        convert_to_hif8_training(model)
    assert coverage(model) and set(coverage(model).values()) == {"not converted"}  # nothing was swapped
    convert_to_hif8_training(model, config=Hif8TrainingConfig(scope="mlp"),
                             role_map={"mixer": "attn", "channel": "mlp"})
    cov = coverage(model)
    assert [k for k, v in cov.items() if v == "quantized"] == [
        f"layers.{i}.channel.{w}" for i in range(2) for w in ("w1", "w2", "w3")]
    assert sum(v == "scope" for v in cov.values()) == 8


def test_role_map_refusals():
    with pytest.raises(ValueError, match=r"role_map names \['mixer.nope'\]"):
        convert_to_hif8_training(_stack(attn_name="mixer"), role_map={"mixer": "attn", "mixer.nope": "mlp"})
    with pytest.raises(ValueError, match="role_map=.*one of"):
        convert_to_hif8_training(_stack(), role_map={"attn": "attention"})


def test_a_filter_that_excludes_everything_is_refused():
    with pytest.raises(ValueError, match="nothing to quantize"):
        convert_to_hif8_training(_stack(), module_filter_fn=lambda mod, fqn: False)


def test_a_model_without_decoder_blocks_names_what_was_looked_for():
    with pytest.raises(ValueError, match=r"no ModuleList of decoder layers.*self_attn.*mlp"):
        convert_to_hif8_training(nn.Sequential(nn.Linear(4, 4)))


def test_quantized_conv1d_matches_a_quantized_linear_with_the_transposed_weight():
    from transformers.pytorch_utils import Conv1D

    from hif8qat.quant.linear import QuantConv1D, QuantLinear

    torch.manual_seed(0)
    conv = Conv1D(6, 5)
    x = torch.randn(3, 5, requires_grad=True)
    off = QuantConv1D(conv, enabled=False)
    assert torch.equal(off(x), conv(x))  # off: Conv1D's own arithmetic
    qc = QuantConv1D(conv)
    lin = nn.Linear(5, 6)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    ql = QuantLinear.from_linear(lin)
    x2 = x.detach().clone().requires_grad_()
    y1, y2 = qc(x), ql(x2)
    assert torch.equal(y1, y2) and not torch.equal(y1, conv(x))
    (y1 * 3).sum().backward()
    (y2 * 3).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(conv.weight.grad, lin.weight.grad.t())
    assert dict(qc.named_parameters()).keys() == {"weight", "bias"} and qc.weight.shape == (5, 6)


def test_the_8bit_export_encodes_each_expert_with_its_own_scale(tmp_path):
    from safetensors import safe_open

    from hif8qat.evaluate.loading import load_for_eval
    from hif8qat.models import eight_bit
    from hif8qat.models.loading import build_tiny_tokenizer
    from hif8qat.models.quant_files import save_quant_export
    from hif8qat.quant.linear import QuantExperts, quant_modules
    from hif8qat.scaling.bank import RECORD_NO_GRAD
    from hif8qat.scaling.settings import ScalingConfig

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**{**_MOE, "vocab_size": len(tok)}, num_experts=E, head_dim=8))
    export = tmp_path / "export"
    model.save_pretrained(export)
    tok.save_pretrained(export)
    _convert_model(model, "mlp", None, ScalingConfig(algo="max", history_len=4))
    with torch.no_grad():
        for seed in range(2):
            model(torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(seed)))
    save_quant_export(model, export, {"step": 2})
    write_folder_manifest(export)  # as the export stage records it: the 8-bit writer reads a verified folder
    out = tmp_path / "export_8bit"
    eight_bit.write_8bit_export(export, out)

    frozen, _ = load_for_eval(export, "hif8")
    decoded = eight_bit.decoded_state_dict(out)
    record = eight_bit.read_8bit_export(out)
    with safe_open(str(out / eight_bit.WEIGHTS_FILE), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    checked = 0
    for name, mod in quant_modules(frozen):
        if not isinstance(mod, QuantExperts):
            continue
        scales = set()
        for e in range(E):
            # transformers saves Qwen3-MoE experts as per-expert gate / up / down linears
            disk = {p: f"{name}.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
            for i, (param, pieces) in enumerate((("gate_up_proj", ("gate_proj", "up_proj")),
                                                 ("down_proj", ("down_proj",)))):
                want = mod.bank.quantize(getattr(mod, param)[e].detach(), mod._rows[3 * (i * E + e) + 1],
                                         RECORD_NO_GRAD)
                got = torch.cat([decoded[f"{disk[p]}.weight"] for p in pieces])
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (name, param, e)  # bit for bit
                for p in pieces:
                    assert stored[f"{disk[p]}.weight"].dtype == torch.uint8
                    assert record["layers"][disk[p]]["site"] == f"{name}.{param}.{e}"
                scales.add(record["layers"][disk[pieces[0]]]["weight_quant_scale"])
                checked += 1
        assert len(scales) == 2 * E  # each expert's own scale
    assert checked == L * 2 * E
