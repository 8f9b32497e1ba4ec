"""openPangu-Embedded loads as transformers' Llama from a checkpoint laid out like the hub repo (its config.json
keys, remote-code files that cannot run on the pinned transformers, sharded safetensors, a SentencePiece
tokenizer behind a remote tokenizer class): no remote code runs, every tensor lands, the logits equal a plain
torch forward of the architecture, and the converted fast tokenizer gives SentencePiece's ids with the real
special-token layout. The checkpoints here are the 1B's own config (models.pangu.OPENPANGU_EMBEDDED_1B_CONFIG:
tied head, rope_theta 4e6, 12 query / 6 KV heads) shrunk in depth, width and vocabulary only where a test must be
small, as each says; the untied 7B-style head is kept as a second case."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import yaml
from safetensors.torch import save_file

from hif8qat.models import pangu as pangu_module
from hif8qat.models.loading import load_causal_lm
from hif8qat.models.pangu import OPENPANGU_EMBEDDED_1B_CONFIG, OPENPANGU_SPECIAL_TOKENS

spm = pytest.importorskip("sentencepiece")

# The 1B's config with its head structure (12 query / 6 KV heads, tied, theta 4e6) at a small width (head dim 8),
# 2 blocks and a vocabulary a SentencePiece model trains in well under a second: the fast tests' stand-in.
SMALL_1B = {**OPENPANGU_EMBEDDED_1B_CONFIG, "vocab_size": 400, "hidden_size": 96, "intermediate_size": 384,
            "num_hidden_layers": 2}
# The 7B-style untied head and theta (PanguEmbeddedConfig's defaults), the other layout the loader must take.
SMALL_UNTIED = {**SMALL_1B, "tie_word_embeddings": False, "rope_theta": 16000000.0}
SIZES = {k: SMALL_1B[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads")}
# Ten reserved pieces as the real vocabulary has them; [unused10] is its EOS.
_UNUSED = [f"[unused{i}]" for i in range(11)]
_REMOTE = "raise RuntimeError('remote code ran')\nfrom transformers.utils import LossKwargs  # gone in 5.x\n"
_WORDS = ("the quick brown fox jumps over a lazy dog 中文 测试 naïve café 42 3.14 hello world foo_bar "
          "Ünïcödé — tabs\tand\nnewlines x=y+1;").split(" ")


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def _weights(cfg: dict, bias: bool, std: float = 0.2) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors; a tied head has no lm_head matrix (as the 1B's safetensors and GGUF)."""
    g = torch.Generator().manual_seed(0)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def r(*shape):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": 1 + r(h)}
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = r(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
        for name, shape in shapes.items():
            w[p + f"self_attn.{name}.weight"] = r(*shape)
            if bias:
                w[p + f"self_attn.{name}.bias"] = r(shape[0])
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = r(inter, h), r(inter, h)
        w[p + "mlp.down_proj.weight"] = r(h, inter)
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = 1 + r(h), 1 + r(h)
    return w


def write_sentencepiece(folder, vocab_size: int) -> None:
    """tokenizer.model and tokenizer_config.json with openPangu's special-token layout: ``<unk>`` 0 (also the
    pad), ``<s>`` 1 (prepended, add_bos_token), ``</s>`` 2, EOS ``[unused10]`` among the reserved pieces."""
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus(3000, 0)), model_prefix=str(folder / "sp"),
                                   vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
                                   control_symbols=_UNUSED, minloglevel=2)
    (folder / "sp.model").rename(folder / "tokenizer.model")
    (folder / "sp.vocab").unlink()
    special = OPENPANGU_SPECIAL_TOKENS
    (folder / "tokenizer_config.json").write_text(json.dumps({
        **special, "add_prefix_space": True,
        "auto_map": {"AutoTokenizer": ["tokenization_openpangu.PanguTokenizer", None]},
        "clean_up_tokenization_spaces": False, "legacy": True, "sp_model_kwargs": {},
        "spaces_between_special_tokens": False, "tokenizer_class": "PanguTokenizer"}))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {k: special[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}))


def write_pangu_checkpoint(folder, *, bias: bool = True, config: dict | None = None, std: float = 0.2):
    """The hub repo's layout for ``config`` (default :data:`SMALL_1B`); returns its config.json and tensors."""
    folder.mkdir()
    shape = dict(config or SMALL_1B)
    shape["bias"] = bias
    cfg = {"architectures": ["PanguEmbeddedForCausalLM"],
           "auto_map": {"AutoConfig": "configuration_openpangu_dense.PanguEmbeddedConfig",
                        "AutoModel": "modeling_openpangu_dense.PanguEmbeddedModel",
                        "AutoModelForCausalLM": "modeling_openpangu_dense.PanguEmbeddedForCausalLM"},
           "attention_dropout": 0.0, "initializer_range": 0.02, "model_type": "PanguEmbedded",
           "torch_dtype": "bfloat16", "transformers_version": "4.53.2", "use_cache": True, **shape}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("modeling_openpangu_dense.py", "configuration_openpangu_dense.py", "tokenization_openpangu.py"):
        (folder / name).write_text(_REMOTE)
    weights = _weights(cfg, bias, std)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * 4 for t in weights.values())},
             "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_sentencepiece(folder, min(cfg["vocab_size"], 400))
    return cfg, weights


def reference_logits(cfg: dict, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The architecture from its description, in float64: RMSNorm, rotary (rotate-half), grouped-query causal
    attention with biased projections, SwiGLU MLP, the head tied to the embedding or its own matrix."""
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
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return norm(x, w["model.norm.weight"]) @ head.T


@pytest.fixture
def pangu(tmp_path, monkeypatch):
    monkeypatch.setenv("HIF8QAT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "openPangu-Embedded-1B"
    cfg, weights = write_pangu_checkpoint(folder)
    return folder, cfg, weights


def test_the_1b_config_maps_to_the_published_shape():
    """The whole 1B config, built on the meta device (no memory): head dim 128, theta 4e6, a tied head, and a
    parameter count that equals the sizes' own arithmetic."""
    from transformers import LlamaForCausalLM

    config = pangu_module.pangu_llama_config(OPENPANGU_EMBEDDED_1B_CONFIG)
    assert config.head_dim == 128 and config.num_attention_heads == 12 and config.num_key_value_heads == 6
    assert config.tie_word_embeddings is True and config.attention_bias is True and config.mlp_bias is False
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    assert theta == 4e6
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    counted = sum(p.numel() for p in model.parameters())  # a shared parameter once
    h, inter, layers, vocab = 1536, 6144, 26, 153376
    block = (h * h + h) * 2 + (h * 768 + 768) * 2 + 3 * h * inter + 2 * h  # q,o + k,v (6 x 128) + MLP + norms
    assert counted == layers * block + vocab * h + h == pangu_module.pangu_parameter_count(OPENPANGU_EMBEDDED_1B_CONFIG)


@pytest.mark.parametrize("config,bias", [(SMALL_1B, True), (SMALL_UNTIED, True), (SMALL_1B, False)],
                         ids=["1b-tied", "untied-7b-head", "tied-no-bias"])
def test_openpangu_loads_as_llama_and_matches_a_plain_forward(tmp_path, monkeypatch, config, bias):
    from transformers import LlamaForCausalLM

    monkeypatch.setenv("HIF8QAT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "pangu"
    cfg, weights = write_pangu_checkpoint(folder, bias=bias, config=config)
    tied = cfg["tie_word_embeddings"]
    assert ("lm_head.weight" in weights) is not tied  # a tied checkpoint has no output matrix
    model, tok = load_causal_lm(str(folder), trust_remote_code=True)  # as the paper profile asks
    assert type(model) is LlamaForCausalLM
    assert model.config.attention_bias is bias and model.config.mlp_bias is False
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    state = model.state_dict()
    assert set(state) == set(weights) | {"lm_head.weight"}  # nothing missing, nothing left over
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
    ids = torch.randint(0, cfg["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(input_ids=ids).logits.double()
    torch.testing.assert_close(got, reference_logits(cfg, weights, ids), rtol=1e-4, atol=1e-4)


def test_one_block_at_the_1b_width_matches_a_plain_forward(tmp_path, monkeypatch):
    """The 1B's real block (hidden 1536, MLP 6144, 12 x 128 query and 6 x 128 KV heads, theta 4e6, tied): one
    block and a small vocabulary, so that the float64 reference stays seconds. Theta matters at this head dim: the
    slowest rotary frequencies differ between 4e6 and 16e6 by more than the tolerance over these positions."""
    monkeypatch.setenv("HIF8QAT_CACHE", str(tmp_path / "cache"))
    config = {**OPENPANGU_EMBEDDED_1B_CONFIG, "num_hidden_layers": 1, "vocab_size": 400}
    cfg, weights = write_pangu_checkpoint(tmp_path / "pangu", config=config, std=0.02)
    model, _ = load_causal_lm(str(tmp_path / "pangu"), trust_remote_code=True)
    ids = torch.randint(0, 400, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(input_ids=ids).logits.double()
    want = reference_logits(cfg, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    other = reference_logits({**cfg, "rope_theta": 16e6}, weights, ids)
    assert not torch.allclose(got, other, rtol=1e-4, atol=1e-4)  # the check would see a wrong theta


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


@pytest.mark.parametrize("spec", [
    {"user_defined_symbols": ["<sep>", "foo"]},  # emitted whole, never merged across
    {"remove_extra_whitespaces": False},  # runs of spaces and a leading space kept
    {"add_dummy_prefix": False},
    {"model_type": "unigram", "vocab_size": 320},
], ids=["user-defined", "spaces-kept", "no-dummy-prefix", "unigram"])
def test_the_pipeline_follows_the_sentencepiece_models_own_settings(tmp_path, spec):
    """The openPangu model's settings are the tests' default (BPE, extra whitespace removed, a dummy prefix); a
    model with other settings gets them too, whatever the transformers version."""
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus(3000, 0)), model_prefix=str(tmp_path / "sp"),
                                   **{"model_type": "bpe", "vocab_size": 400, **spec}, byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    tk = pangu_module.sentencepiece_pipeline(tmp_path / "sp.model")
    rng = random.Random(3)
    texts = _corpus(300, 1) + ["", " ", " lead", "  two  spaces ", "\n\nx", "a<sep>b", "<sep>", "x <sep> foo y"]
    texts += ["".join(rng.choice("ab \n中é!") for _ in range(rng.randint(1, 30))) for _ in range(300)]
    wrong = [t for t in texts if tk.encode(t, add_special_tokens=False).ids != sp.encode(t)]
    assert not wrong, wrong[:5]
    assert [tk.decode(sp.encode(t)) for t in texts[:50]] == [sp.decode(sp.encode(t)) for t in texts[:50]]


def test_the_real_special_token_layout(pangu):
    """BOS <s> = 1 prepended for evaluation, pad <unk> = 0, EOS [unused10]; the training data is each document's
    SentencePiece ids without BOS, ended by that EOS (data.tokens.tokenize_documents)."""
    from hif8qat.data.tokens import tokenize_documents

    folder, _, _ = pangu
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    eos = sp.piece_to_id("[unused10]")
    assert sp.id_to_piece(0) == "<unk>" and sp.id_to_piece(1) == "<s>" and eos not in (0, 1, 2)
    tok = pangu_module.pangu_tokenizer(str(folder))
    assert (tok.bos_token, tok.bos_token_id) == ("<s>", 1)
    assert (tok.pad_token, tok.pad_token_id) == ("<unk>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("[unused10]", eos)
    docs = ["the quick brown fox", "中文 测试 naïve café", "x=y+1;"]
    assert tok(docs[0])["input_ids"] == [1, *sp.encode(docs[0])]  # add_bos_token, no EOS appended
    packed = tokenize_documents(docs, tok)
    assert [list(map(int, ids)) for ids in packed] == [sp.encode(d) + [eos] for d in docs]


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_checkpoint_without_a_readable_tokenizer_model_is_refused_before_a_run_folder(tmp_path, damage):
    from test_reliability import assert_user_error, cli

    folder = tmp_path / "pangu"
    write_pangu_checkpoint(folder)
    if damage == "missing":
        (folder / "tokenizer.model").unlink()
    else:  # truncated, as an interrupted copy leaves it
        (folder / "tokenizer.model").write_bytes((folder / "tokenizer.model").read_bytes()[:100])
    out = cli(["experiment=exp1", "stage=all", f"model.name={folder}", "model.trust_remote_code=true"],
              tmp_path / "runs", env_extra={"HIF8QAT_CACHE": str(tmp_path / "cache")})
    assert_user_error(out, "model.name", str(folder / "tokenizer.model"))
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_1b_shaped_checkpoint_trains_and_evaluates_through_the_paper_profile(tmp_path):
    """The paper profile's model settings (its model config, trust_remote_code, bf16 autocast, exp8's quantization
    with first3_last2 high-precision blocks, both evaluation modes) on the 1B's structure: tied head, theta 4e6,
    12/6 heads, the real special tokens; 6 blocks at head dim 8 so that first3_last2 leaves one block quantized.
    Only the sizes, the step count, the data (the offline corpus) and the tasks (a mini task) are changed."""
    from test_train import run

    folder = tmp_path / "pangu"
    write_pangu_checkpoint(folder, config={**SMALL_1B, "num_hidden_layers": 6}, std=0.02)
    root = tmp_path / "runs"
    run(["experiment=exp8", "profile=paper", "stage=all", f"model.name={folder}", f"results_root={root}",
         "profile.steps=4", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32",
         "train.device=cpu", "train.num_threads=1", "train.keep_checkpoints_when_done=0", "train.checkpoint_every=2",
         "data.source=mini", "data.eval_windows=2", "eval.tasks=[mini_arc]", "eval.limit=4", "eval.batch_size=4",
         "eval.num_fewshot={}", "logger.progress_bar=false"],
        env_extra={"HIF8QAT_CACHE": str(tmp_path / "cache"), "HIF8QAT_COMPILE": "0"})
    (run_dir,) = (root / "paper" / "exp8").glob("seed0*")  # the overrides tag the folder's name
    assert (run_dir / "DONE").is_file()
    saved = yaml.safe_load((run_dir / "config_resolved.yaml").read_text())
    assert saved["train"]["autocast"] == "bf16" and saved["model"]["trust_remote_code"] is True
    assert saved["quant"]["high_precision_blocks"] == [0, 1, 2, 4, 5]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    assert len(steps) == 4 and all(math.isfinite(r["loss"]) for r in steps)
    assert [r["quant"] for r in steps] == [False, True, True, True]  # one BF16 warmup step, then HiF8
    for mode in ("bf16", "hif8"):
        assert (run_dir / "eval" / mode / "results.json").is_file(), mode
    export = json.loads((run_dir / "export" / "config.json").read_text())
    assert export["tie_word_embeddings"] is True and export["num_key_value_heads"] == 6
    theta = (export.get("rope_parameters") or {}).get("rope_theta", export.get("rope_theta"))
    assert theta == 4e6
    from safetensors import safe_open

    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # still tied: the export stores the embedding once
