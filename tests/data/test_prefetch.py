"""Streamed data is read and tokenized in a thread while the step runs, and what the trainer sees (batches,
checkpointed state, resumes) is exactly the stream without prefetching."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest
import torch

from hif8qat.data import streams
from hif8qat.data.loader import build_train_stream
from hif8qat.models.loading import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def corpus(tmp_path):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    path = tmp_path / "docs.jsonl"
    with path.open("w") as f:
        for i in range(30):
            f.write(json.dumps({"text": f"{i} " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))})
                    + "\n")
    return str(path)


def _stream(corpus):
    return build_train_stream(corpus, build_tiny_tokenizer(), seq_len=32, micro_batch_size=2)


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                        for k in a)


def test_prefetched_batches_states_and_resumes_equal_the_plain_streams(corpus):
    from hif8qat.data.prefetch import PrefetchedStream

    plain, ahead = _stream(corpus), PrefetchedStream(_stream(corpus), depth=3)
    n = 150  # past the end of the data: the epoch wraps
    for i in range(n):
        assert torch.equal(next(plain), next(ahead)), i
        if i in (0, 7, 60, n - 1):
            assert ahead.epoch == plain.epoch and _same_state(ahead.state_dict(), plain.state_dict()), i
    assert plain.epoch >= 1
    resumed = PrefetchedStream(_stream(corpus))
    resumed.load_state_dict(ahead.state_dict())
    for i in range(20):
        assert torch.equal(next(plain), next(resumed)), i
    resumed.close()
    ahead.close()  # rewound to what it served: continues where the trainer stopped
    plain_again = _stream(corpus)
    for _ in range(n):
        next(plain_again)
    for i in range(5):
        assert torch.equal(next(plain_again), next(ahead)), i


def test_training_on_streamed_data_tokenizes_off_the_main_thread(tmp_path, corpus, monkeypatch):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hif8qat.config.numerics import train_numerics
    from hif8qat.config.run_config import RunConfig, resolve_profile
    from hif8qat.train.loop import train

    threads = []
    real = streams.tokenize_documents

    def recording(texts, tokenizer):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(texts, tokenizer)

    monkeypatch.setattr(streams, "tokenize_documents", recording)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="config", overrides=[
            "profile=smoke", "experiment=exp1", "stage=train", f"data.source={corpus}", "logger.progress_bar=false",
            "train.num_threads=1", f"results_root={tmp_path / 'runs'}", "train.keep_checkpoints_when_done=0"])
    cfg = resolve_profile(RunConfig.from_dict(OmegaConf.to_container(composed, resolve=True), check_paths=False))
    readers = [t for t in threading.enumerate() if t.name == "hif8qat-prefetch"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train(cfg, run_dir, numerics=train_numerics(cfg))
    assert threads and not any(threads), threads  # every training batch was tokenized by the reader thread
    assert [t for t in threading.enumerate() if t.name == "hif8qat-prefetch"] == readers  # it ended with the run
