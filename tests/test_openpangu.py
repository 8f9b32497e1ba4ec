"""openPangu-Embedded loads as transformers' Llama from a checkpoint laid out like the hub repo (its config.json
keys, remote-code files that cannot run on the pinned transformers, sharded safetensors, a SentencePiece
tokenizer behind a remote tokenizer class): no remote code runs, every tensor lands, the logits equal a plain
torch forward of the architecture, and the converted fast tokenizer gives SentencePiece's ids."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from safetensors.torch import save_file

from hif8qat.models import pangu as pangu_module
from hif8qat.models.loading import load_causal_lm

spm = pytest.importorskip("sentencepiece")

SIZES = dict(vocab_size=400, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
_REMOTE = "raise RuntimeError('remote code ran')\nfrom transformers.utils import LossKwargs  # gone in 5.x\n"
_WORDS = ("the quick brown fox jumps over a lazy dog 中文 测试 naïve café 42 3.14 hello world foo_bar "
          "Ünïcödé — tabs\tand\nnewlines x=y+1;").split(" ")


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def _weights(cfg: dict, bias: bool, std: float = 0.2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d

    def r(*shape):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": 1 + r(h), "lm_head.weight": r(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h)}
        for name, shape in shapes.items():
            w[p + f"self_attn.{name}.weight"] = r(*shape)
            if bias:
                w[p + f"self_attn.{name}.bias"] = r(shape[0])
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = r(inter, h), r(inter, h)
        w[p + "mlp.down_proj.weight"] = r(h, inter)
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = 1 + r(h), 1 + r(h)
    return w


def write_pangu_checkpoint(folder, *, bias: bool = True):
    """The hub repo's layout at tiny sizes."""
    folder.mkdir()
    cfg = {"architectures": ["PanguEmbeddedForCausalLM"],
           "auto_map": {"AutoConfig": "configuration_openpangu_dense.PanguEmbeddedConfig",
                        "AutoModel": "modeling_openpangu_dense.PanguEmbeddedModel",
                        "AutoModelForCausalLM": "modeling_openpangu_dense.PanguEmbeddedForCausalLM"},
           "bias": bias, "attention_dropout": 0.0, "bos_token_id": 1, "pad_token_id": 0, "eos_token_id": 2,
           "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 32768,
           "model_type": "PanguEmbedded", "rms_norm_eps": 1e-05, "rope_theta": 16000000.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.53.2",
           "use_cache": True, **SIZES}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("modeling_openpangu_dense.py", "configuration_openpangu_dense.py", "tokenization_openpangu.py"):
        (folder / name).write_text(_REMOTE)
    weights = _weights(cfg, bias)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * 4 for t in weights.values())},
             "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus(3000, 0)), model_prefix=str(folder / "sp"),
                                   vocab_size=SIZES["vocab_size"], model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2)
    (folder / "sp.model").rename(folder / "tokenizer.model")
    (folder / "sp.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "add_prefix_space": True,
        "auto_map": {"AutoTokenizer": ["tokenization_openpangu.PanguTokenizer", None]},
        "bos_token": "<s>", "clean_up_tokenization_spaces": False, "eos_token": "</s>", "legacy": True,
        "pad_token": "<unk>", "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
        "tokenizer_class": "PanguTokenizer", "unk_token": "<unk>"}))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>", "unk_token": "<unk>"}))
    return cfg, weights


def reference_logits(cfg: dict, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The architecture from its description, in float64: RMSNorm, rotary (rotate-half), grouped-query causal
    attention with biased projections, SwiGLU MLP, untied head."""
    w = {k: v.double() for k, v in w.items()}
    nh, nkv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    d = cfg["hidden_size"] // nh
    T = ids.shape[1]

    def norm(x, g):
        return g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rope(x):  # (B, heads, T, d)
        half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)
        return x * cos + half * sin

    x = w["model.embed_tokens.weight"][ids]
    mask = torch.full((T, T), -math.inf, dtype=torch.float64).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hN = norm(x, w[p + "input_layernorm.weight"])
        B = x.shape[0]
        q = rope(lin(hN, p + "self_attn.q_proj").view(B, T, nh, d).transpose(1, 2))
        k = rope(lin(hN, p + "self_attn.k_proj").view(B, T, nkv, d).transpose(1, 2))
        v = lin(hN, p + "self_attn.v_proj").view(B, T, nkv, d).transpose(1, 2)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, -1) @ v
        x = x + lin(att.transpose(1, 2).reshape(B, T, nh * d), p + "self_attn.o_proj")
        hN = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = lin(hN, p + "mlp.gate_proj"), lin(hN, p + "mlp.up_proj")
        x = x + lin(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj")
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.fixture
def pangu(tmp_path, monkeypatch):
    monkeypatch.setenv("HIF8QAT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "openPangu-Embedded-1B"
    cfg, weights = write_pangu_checkpoint(folder)
    return folder, cfg, weights


@pytest.mark.parametrize("bias", [True, False])
def test_openpangu_loads_as_llama_and_matches_a_plain_forward(tmp_path, monkeypatch, bias):
    from transformers import LlamaForCausalLM

    monkeypatch.setenv("HIF8QAT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / f"pangu-bias-{bias}"
    cfg, weights = write_pangu_checkpoint(folder, bias=bias)
    model, tok = load_causal_lm(str(folder), trust_remote_code=True)  # as the paper profile asks
    assert type(model) is LlamaForCausalLM
    assert model.config.attention_bias is bias and model.config.mlp_bias is False
    state = model.state_dict()
    assert set(state) == set(weights)  # nothing missing, nothing left over
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
    ids = torch.randint(0, cfg["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(input_ids=ids).logits.double()
    torch.testing.assert_close(got, reference_logits(cfg, weights, ids), rtol=1e-4, atol=1e-4)


def test_the_converted_tokenizer_gives_sentencepiece_ids_and_is_cached(pangu):
    folder, _, _ = pangu
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tok = pangu_module.pangu_tokenizer(str(folder))
    assert tok.is_fast
    rng = random.Random(7)
    texts = _corpus(3000, 1) + ["", " ", "  two  spaces ", "\n\nx", "tab\tend\t", "ÿ€𝄞 unseen ✓"]
    texts += ["".join(rng.choice("ab \n中é!") for _ in range(rng.randint(1, 30))) for _ in range(1000)]
    wrong = [t for t in texts if tok(t)["input_ids"] != [sp.bos_id()] + sp.encode(t)]
    assert not wrong, wrong[:5]
    cached = list((folder.parent / "cache" / "tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer.json").is_file()
    pangu_module.pangu_tokenizer(str(folder))  # the second time from the cache, converted once
    assert list((folder.parent / "cache" / "tokenizers").iterdir()) == cached
