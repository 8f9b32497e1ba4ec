"""Data pipeline: packing, rank disjointness, determinism, exact resume, epoch rollover, sources."""

import json
import random
import time

import numpy as np
import pytest
import torch
from conftest import mini_corpus_missing

from hif8qat.data import corpus
from hif8qat.data import loader as data
from hif8qat.data.loader import (
    PackedTokenStream,
    StreamingTokenStream,
    build_eval_windows,
    build_train_stream,
    tokenize_documents,
)
from hif8qat.models.loading import build_tiny_tokenizer

WORDS = ("the king queen love night day sword crown heart fair lord lady good speak hear see go come "
         "death life sweet noble gentle time world").split()


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def docs():
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) + f" #{i}." for i in range(240)]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, docs):
    path = tmp_path_factory.mktemp("local") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)))
    return path


def _stream_tokens(texts, tok):
    kept = [t for t in texts if not corpus.stream_is_heldout(t)]
    return np.concatenate(tokenize_documents(kept, tok))


def _take(stream, n):
    return [next(stream) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- packed
def test_packed_windows_concatenate_back_to_the_token_stream():
    tokens = np.arange(1000)
    s = PackedTokenStream(tokens, seq_len=9, micro_batch_size=4, seed=3)
    assert s.num_windows == 100 and s.batches_per_epoch == 25
    got = torch.cat(_take(s, 25))
    assert got.shape == (100, 10) and got.dtype == torch.long
    order = torch.argsort(got[:, 0])
    assert torch.equal(got[order].reshape(-1), torch.arange(1000))


def test_packed_ranks_are_disjoint_and_lockstep():
    tokens = np.arange(10 * 103)  # 103 windows: not divisible by world_size * mbs
    seen = []
    streams = [PackedTokenStream(tokens, seq_len=9, micro_batch_size=4, rank=r, world_size=2, seed=1)
               for r in range(2)]
    assert streams[0].batches_per_epoch == streams[1].batches_per_epoch == 12
    for s in streams:
        seen.append({int(w[0]) // 10 for b in _take(s, s.batches_per_epoch) for w in b})
    assert len(seen[0]) == len(seen[1]) == 48
    assert not seen[0] & seen[1]


def test_packed_determinism_by_seed():
    tokens = np.arange(5000)
    a = _take(PackedTokenStream(tokens, seq_len=15, micro_batch_size=2, seed=7), 10)
    b = _take(PackedTokenStream(tokens, seq_len=15, micro_batch_size=2, seed=7), 10)
    c = _take(PackedTokenStream(tokens, seq_len=15, micro_batch_size=2, seed=8), 10)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_packed_epoch_rollover_reshuffles_and_covers_every_window():
    tokens = np.arange(8 * 40)
    s = PackedTokenStream(tokens, seq_len=7, micro_batch_size=5, seed=0)
    e0 = torch.cat(_take(s, s.batches_per_epoch))
    assert s.epoch == 0 and s.state_dict()["position"] == 40
    e1 = torch.cat(_take(s, s.batches_per_epoch))
    assert s.epoch == 1
    assert sorted(e0[:, 0].tolist()) == sorted(e1[:, 0].tolist()) == list(range(0, 320, 8))
    assert not torch.equal(e0, e1)


@pytest.mark.parametrize("k", [0, 3, 8, 11])  # 8 = epoch boundary, 11 = into epoch 1
def test_packed_resume_gives_the_next_unseen_batches(k):
    tokens = np.arange(10 * 64)
    kw = dict(seq_len=9, micro_batch_size=4, rank=1, world_size=2, seed=5)
    ref = _take(PackedTokenStream(tokens, **kw), k + 10)
    s = PackedTokenStream(tokens, **kw)
    _take(s, k)
    state = json.loads(json.dumps(s.state_dict()))  # must survive serialization
    resumed = PackedTokenStream(tokens, **kw)
    resumed.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(_take(resumed, 10), ref[k:]))


def test_packed_resume_rejects_changed_settings():
    tokens = np.arange(1000)
    s = PackedTokenStream(tokens, seq_len=9, micro_batch_size=4)
    other = PackedTokenStream(tokens, seq_len=9, micro_batch_size=2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        other.load_state_dict(s.state_dict())


def test_too_small_source_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one batch"):
        PackedTokenStream(np.arange(50), seq_len=9, micro_batch_size=4, world_size=2)


# ---------------------------------------------------------------------------------------------- streaming
def test_local_jsonl_stream_packs_exactly(jsonl, docs, tok):
    s = build_train_stream(str(jsonl), tok, seq_len=31, micro_batch_size=3)
    assert isinstance(s, StreamingTokenStream)
    got = torch.cat(_take(s, 20)).reshape(-1).numpy()
    assert np.array_equal(got, _stream_tokens(docs, tok)[: len(got)])
    assert s.state_dict()["position"] == 60


def test_local_stream_ranks_read_disjoint_documents(jsonl, docs, tok):
    for rank in range(2):
        s = build_train_stream(str(jsonl), tok, seq_len=31, micro_batch_size=2, rank=rank, world_size=2)
        got = torch.cat(_take(s, 15)).reshape(-1).numpy()
        assert np.array_equal(got, _stream_tokens(docs[rank::2], tok)[: len(got)])


@pytest.mark.parametrize("fast", [True, False])
def test_local_stream_resume_across_epochs(tmp_path, docs, tok, fast):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:12]))
    kw = dict(seq_len=63, micro_batch_size=2)
    ref_stream = build_train_stream(str(path), tok, **kw)
    ref = _take(ref_stream, 30)
    assert ref_stream.epoch >= 1  # the small source rolls over inside 30 batches
    for k in (0, 5, 13, 22):
        s = build_train_stream(str(path), tok, **kw)
        _take(s, k)
        state = s.state_dict()
        if not fast:
            state = {key: v for key, v in state.items() if key not in ("ds_state", "buffer")}
        elif k:
            assert "ds_state" in state
        resumed = build_train_stream(str(path), tok, **kw)
        resumed.load_state_dict(state)
        assert all(torch.equal(x, y) for x, y in zip(_take(resumed, 30 - k), ref[k:])), k


def test_local_stream_epoch_rollover_restarts_the_data(tmp_path, docs, tok):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:40]))
    s = build_train_stream(str(path), tok, seq_len=63, micro_batch_size=2)
    first = next(s)
    while s.epoch == 0:
        batch = next(s)
    assert s.state_dict()["position"] == 2
    assert torch.equal(batch, first)


def test_local_text_files_and_eval_windows_are_held_out(tmp_path, docs, tok):
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, t in enumerate(docs):
        (folder / f"d{i:03d}.txt").write_text(t)
    held = [t for t in docs if corpus.stream_is_heldout(t)]
    assert held, "fixture should contain held-out documents"
    ev = build_eval_windows(str(folder), tok, seq_len=15, num_windows=1000)
    assert ev.shape[1] == 16 and 0 < ev.shape[0] < 1000
    held_tokens = np.concatenate(tokenize_documents(held, tok))
    assert np.array_equal(ev.reshape(-1).numpy(), held_tokens[: ev.numel()])
    train = torch.cat(_take(build_train_stream(str(folder), tok, seq_len=15, micro_batch_size=4), 10))
    assert train.shape == (40, 16)


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("source", ["nope", "", "/does/not/exist", "/tmp/*.nothing-here"])
def test_bad_source_name(source, tok):
    with pytest.raises(ValueError, match="data.source"):
        build_train_stream(source, tok, seq_len=8, micro_batch_size=1)


def test_fineweb_offline_fails_fast(monkeypatch, tok):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(OSError, match="local copy"):
        build_train_stream("fineweb", tok, seq_len=8, micro_batch_size=1)
    assert time.time() - t0 < 5


# ---------------------------------------------------------------------------------------------- mini corpus
@pytest.fixture(scope="module")
def mini_available():
    reason = mini_corpus_missing()
    if reason:
        pytest.skip(reason)


def test_mini_corpus_train_and_eval(mini_available, tok):
    docs = data.mini_corpus_documents()
    assert len(docs) > 500 and any("Hamlet" in d["text"] for d in docs)
    s = build_train_stream("mini", tok, seq_len=127, micro_batch_size=4, world_size=2, rank=1)
    b = next(s)
    assert b.shape == (4, 128) and b.dtype == torch.long
    assert "\x00" not in tok.decode(b[0])
    ev = build_eval_windows("mini", tok, seq_len=127, num_windows=8)
    assert ev.shape == (8, 128)
    train_ids = {d["id"] for d in docs if not corpus.mini_is_heldout(d["id"])}
    held_ids = {d["id"] for d in docs if corpus.mini_is_heldout(d["id"])}
    assert held_ids and not train_ids & held_ids
    assert 0.01 < len(held_ids) / len(docs) < 0.04
