"""The preflight memory estimate of a training step against the peak a step really reaches (measured on CPU by
torch's MemTracker, the same tensor accounting on any device), with the loss over whole logits and in chunks,
and the paper profile's estimate against an 80 GB GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import LlamaConfig, LlamaForCausalLM

from hif8qat.config.run_config import RunConfig, resolve_profile
from hif8qat.launch.preflight import step_memory
from hif8qat.train import chunked_loss

ROOT = Path(__file__).resolve().parents[1]
FACTS = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False, attn_implementation="sdpa")


def _cfg(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="config", overrides=["stage=train", *overrides])
    return resolve_profile(RunConfig.from_dict(OmegaConf.to_container(composed, resolve=True), check_paths=False))


def _measured_peak(chunk_elements: int | None, batch: int, seq: int) -> int:
    """Peak bytes of the second micro-batch of a step (the first one's gradients are held) and the optimizer
    step, with AdamW's state already made by an earlier step."""
    torch.manual_seed(0)
    config = {k: v for k, v in FACTS.items() if k != "attn_implementation"}
    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation=FACTS["attn_implementation"]))
    if chunk_elements is not None:
        chunked_loss.install_loss_head(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, FACTS["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    chunked_loss.lm_loss(model, tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    chunked_loss.lm_loss(model, tokens).backward()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        chunked_loss.lm_loss(model, tokens).backward()
        opt.step()
    return max(per_device["Total"] for per_device in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.parametrize("chunk_elements", [None, 250 * 32000], ids=["whole-logits", "chunked"])
def test_estimate_is_within_20_percent_of_the_measured_peak(monkeypatch, chunk_elements):
    batch, seq = 4, 256
    if chunk_elements is not None:
        monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", chunk_elements)
    peak = _measured_peak(chunk_elements, batch, seq)
    cfg = _cfg("profile=smoke", "experiment=exp1", "train.autocast=none", f"train.micro_batch_size={batch}",
               f"train.seq_len={seq}", f"train.global_batch_size={2 * batch}")
    estimate = sum(step_memory(cfg, FACTS).values())
    assert 0.8 <= estimate / peak <= 1.2, (estimate / 2**20, peak / 2**20)


def test_the_paper_profile_fits_an_80gb_gpu_with_room_for_what_it_does_not_count():
    """openPangu-Embedded-1B (26 blocks, hidden 1536, GQA 12/6, MLP 6144, vocabulary 153,376), DDP on 8 GPUs,
    micro-batch 16 x 1024 in BF16: the whole logits alone were 5 GB, their FP32 copies 10 GB each."""
    pangu = dict(hidden_size=1536, num_hidden_layers=26, intermediate_size=6144, num_attention_heads=12,
                 num_key_value_heads=6, vocab_size=153376, tie_word_embeddings=False, attn_implementation="sdpa")
    cfg = _cfg("profile=paper", "experiment=exp8")
    parts = step_memory(cfg, pangu, world_size=8)
    assert parts["logits"] < 5 * 2**30  # one chunk, not 16 x 1024 x 153,376 logits
    assert sum(parts.values()) < 0.7 * 80e9, {k: round(v / 2**30, 1) for k, v in parts.items()}
