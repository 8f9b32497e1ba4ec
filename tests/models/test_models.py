"""Model loading: tiny Llama, safe generic loading, offline SmolLM2 (skipped when not installed)."""

import json
import math
import time

import pytest
import torch
from torch import nn

from hif8qat.models import loading as models
from hif8qat.models.loading import (
    build_tiny_llama,
    build_tiny_tokenizer,
    load_causal_lm,
    num_blocks,
    transformer_blocks,
)


def test_tiny_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    m1, _ = build_tiny_llama(seed=0)
    after = torch.rand(3)
    assert torch.equal(before, after)
    m2, _ = build_tiny_llama(seed=0)
    m3, _ = build_tiny_llama(seed=1)
    sd1, sd2, sd3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert not all(torch.equal(sd1[k], sd3[k]) for k in sd1)


def test_tiny_forward_and_depth():
    model, tok = load_causal_lm("tiny")
    assert num_blocks(model) == 4 and transformer_blocks(model) is model.model.layers
    ids = torch.tensor([tok("hello world").input_ids])
    out = model(ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(out.loss)
    assert math.isclose(out.loss.item(), math.log(len(tok)), rel_tol=0.1)  # ~uniform at init
    deep, _ = load_causal_lm("tiny:26")
    assert num_blocks(deep) == 26
    with pytest.raises(ValueError, match="tiny:<num_layers>"):
        load_causal_lm("tiny:x")


def test_tiny_tokenizer_roundtrip_and_specials(tmp_path):
    tok = build_tiny_tokenizer()
    text = "Shall I compare thee to a summer's day?\n  Thou art more lovely — ünïcödé ✓"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and tok.bos_token_id not in ids  # no BOS prepended
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2) and len(tok) == 259
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text).input_ids == ids and again.eos_token == "<|endoftext|>"


def test_load_saved_local_folder_through_safetensors(tmp_path):
    model, tok = build_tiny_llama(num_layers=2)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    again, tok2 = load_causal_lm(str(tmp_path), dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16 and num_blocks(again) == 2
    assert torch.equal(again.lm_head.weight.float(), model.lm_head.weight.to(torch.bfloat16).float())
    assert tok2.pad_token_id is not None


def test_loading_prints_its_timed_line_not_a_weights_bar_and_leaves_the_bar_setting_as_it_was(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    model, tok = build_tiny_llama(num_layers=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    capfd.readouterr()
    for enabled in (True, False):
        (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
        load_causal_lm(str(tmp_path))
        assert hf_logging.is_progress_bar_enabled() is enabled
    hf_logging.enable_progress_bar()
    console = capfd.readouterr()
    assert "Loading weights" not in console.out + console.err


def test_missing_local_path_names_the_setting(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.name"):
        load_causal_lm(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="model.name"):
        load_causal_lm("./relative/missing/model")


def test_uncached_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(OSError, match="HF_HUB_OFFLINE"):
        load_causal_lm("hif8qat-test-org/definitely-not-cached-model")
    assert time.time() - t0 < 5


def test_remote_code_requires_config_and_explicit_opt_in(tmp_path):
    model, tok = build_tiny_llama(num_layers=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    # no auto_map: remote code is never enabled, even when asked for
    assert models.decide_remote_code("x", cfg, True) is False
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for flag in (None, False):
        with pytest.raises(ValueError, match="model.trust_remote_code=true"):
            load_causal_lm(str(tmp_path), trust_remote_code=flag)
    assert models.decide_remote_code("x", cfg, True) is True


def test_transformer_blocks_fallback_finds_largest_modulelist():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(2, 2)])
            self.stack = nn.Sequential(nn.Linear(2, 2))
            self.stack.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(5)])

    m = Custom()
    assert transformer_blocks(m) is m.stack.blocks and num_blocks(m) == 5
    with pytest.raises(ValueError):
        transformer_blocks(nn.Linear(2, 2))


def test_openpangu_is_documented():
    info = models.OPENPANGU_EMBEDDED_1B
    assert info["trust_remote_code"] is True and "openPangu-Embedded-1B" in info["hub_id"]
    assert models.resolve_model_source("openpangu_embedded_1b") == info["hub_id"]


def test_tiny_works_with_lm_eval_hflm():
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok = build_tiny_llama(num_layers=1)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2, device="cpu")
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=("To be", " or not"), idx=0)]
    (ll, greedy), = lm.loglikelihood(reqs, disable_tqdm=True)
    assert math.isfinite(ll) and ll < 0


# ---------------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2_offline():
    path = models.cache_root() / models.SMOLLM2_CACHE_SUBDIR
    if not (path / "model.safetensors").is_file():
        pytest.skip("offline SmolLM2 weights not installed "
                    "(python -m hif8qat.models.loading --install-offline-weights)")
    return path


def test_smollm2_offline_weights_are_sane(smollm2_offline, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.resolve_model_source("smollm2_135m") == str(smollm2_offline)
    model, tok = load_causal_lm("smollm2_135m")
    assert num_blocks(model) == 30
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    text = "Paris is the capital and most populous city of France."
    ids = torch.tensor([[tok.eos_token_id] + tok(text).input_ids])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert math.exp(loss) < 50
