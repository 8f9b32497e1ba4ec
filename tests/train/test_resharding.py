"""Checkpoints of several ranks (torch.distributed.checkpoint) and resuming them on another world size.

Oracles: the gathered full state at save time (model and optimizer equal after loading on one process, and on
two FSDP ranks), the manifest's per-file entries against sha256 of the files, and set arithmetic on what each
rank's data stream reads: the windows / documents read before and after a resize never overlap within the
epoch and together cover it (up to the token buffers a resize drops)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from test_distributed import _optimizer
from test_distributed import _tiny as _tiny_llama

from hif8qat.data.loader import PackedTokenStream, build_train_stream
from hif8qat.train import checkpoint as ckpt

ONE_THREAD = True


# ------------------------------------------------------------------------------------------- data: packed
def _packed(rank: int, world: int, n: int = 103) -> PackedTokenStream:
    tokens = np.repeat(np.arange(n), 4)  # seq_len 3: window w is [w, w, w, w], so a batch names its windows
    return PackedTokenStream(tokens, seq_len=3, micro_batch_size=2, rank=rank, world_size=world, seed=7)


def _windows(batch: torch.Tensor) -> list[int]:
    return [int(row[0]) for row in batch]


@pytest.mark.parametrize("new_world", [1, 3])
def test_packed_resize_reads_the_rest_of_the_epoch_once(new_world):
    old = [_packed(r, 2) for r in range(2)]
    before = [w for _ in range(5) for s in old for w in _windows(next(s))]  # 5 steps: 20 windows
    states = [s.state_dict() for s in old]
    new = [_packed(r, new_world) for r in range(new_world)]
    for s in new:
        s.resize(states)
    resized_state = new[0].state_dict()
    after = []
    while all(s.epoch == 0 for s in new):
        batches = [next(s) for s in new]
        if any(s.epoch != 0 for s in new):
            break
        after += [w for b in batches for w in _windows(b)]
    assert len(before) == 20 and not set(before) & set(after), "a window read twice in the epoch"
    assert len(after) == len(set(after))
    # everything but the tail no world size can share out in whole batches
    assert len(set(before) | set(after)) > 103 - 2 * new_world
    resumed = _packed(0, new_world)
    resumed.load_state_dict(resized_state)  # a later same-size resume keeps the resized epoch's order
    assert resumed.base == 20 and _windows(next(resumed)) == after[:2]


# ---------------------------------------------------------------------------------------- data: streamed
def _tags(batches: list[torch.Tensor], tok) -> list[str]:
    text = "".join(tok.decode(row.tolist()) for b in batches for row in b)
    return re.findall(r"<doc:([0-9]+-[0-9]+)>", text)


@pytest.mark.parametrize("new_world", [1, 3])
def test_streamed_resize_skips_the_documents_the_saved_ranks_read(tmp_path, new_world):
    from hif8qat.models.loading import build_tiny_tokenizer
    from hif8qat.rehearse.standins import write_fineweb_shards

    tok = build_tiny_tokenizer()
    write_fineweb_shards(tmp_path / "fw", shards=3, docs_per_shard=8, row_group_size=2)

    def stream(rank, world):
        return build_train_stream(str(tmp_path / "fw"), tok, seq_len=31, micro_batch_size=2, rank=rank,
                                  world_size=world)

    old = [stream(r, 2) for r in range(2)]
    before = [[next(s) for _ in range(3)] for s in old]
    states = [json.loads(json.dumps({k: v for k, v in s.state_dict().items() if k != "buffer"})) for s in old]
    for s, st in zip(old, states):
        st["buffer"] = torch.from_numpy(s._buf.copy())
    new = [stream(r, new_world) for r in range(new_world)]
    notes = [s.resize(states) for s in new]
    assert "skipped" in notes[0]
    after = [[next(s)] for s in new]
    mid = new[0].state_dict()  # a checkpoint during the resized epoch
    for i, s in enumerate(new):
        while True:
            b = next(s)
            if s.epoch != 0:
                break
            after[i].append(b)
    seen_before = [t for b in before for t in _tags(b, tok)]
    seen_after = [t for b in after for t in _tags(b, tok)]
    assert seen_before and seen_after
    assert not set(seen_before) & set(seen_after), "a document read again in the same epoch"
    assert len(seen_after) == len(set(seen_after))
    everything = {f"{s}-{i}" for s in range(3) for i in range(8)}
    # the buffers a resize drops hold at most the documents a rank had read but not trained on
    missing = everything - set(seen_before) - set(seen_after)
    assert len(missing) <= 2 * 3, missing
    # a later resume at the same size rebuilds the skip list from the saved layout
    again = stream(0, new_world)
    again.load_state_dict(mid)
    assert again.skip_from["world_size"] == 2 and again._skip
    assert torch.equal(next(again), after[0][1])


# ----------------------------------------------------------------------------------------- checkpoints
def _tiny():
    return _tiny_llama(tied=True)


def _save_worker(rank: int, world: int, store: str, root: str, fsdp: bool) -> None:
    import torch.distributed as dist

    from hif8qat.train.distributed import apply_fsdp, full_model_state_dict, full_optimizer_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = apply_fsdp(_tiny()) if fsdp else _tiny()
        opt, sched = _optimizer(model)
        tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1 + rank))
        model(input_ids=tokens, labels=tokens).loss.backward()
        if not fsdp:  # DDP's all-reduce, by hand: replicas stay equal
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        sched.step()
        ckpt.save_checkpoint(Path(root), 1, model=model, optimizer=opt, scheduler=sched,
                             rank_state={"rank": rank, "data": {"r": rank}}, rank=rank, world_size=world,
                             barrier=dist.barrier)
        weights = full_model_state_dict(model) if fsdp else dict(model.state_dict())
        optim = full_optimizer_state_dict(model, opt)
        if rank == 0:
            torch.save({"model": weights, "optim": optim}, Path(root) / "reference.pt")
    finally:
        dist.destroy_process_group()


def _two_rank_checkpoint(tmp_path: Path, fsdp: bool) -> Path:
    root = tmp_path / "ckpts"
    mp.spawn(_save_worker, args=(2, str(tmp_path / "store"), str(root), fsdp), nprocs=2)
    return root


@pytest.mark.slow  # two spawned ranks save, then one process loads
@pytest.mark.parametrize("fsdp", [True, False])
def test_two_rank_checkpoint_is_sharded_hashed_by_its_writers_and_loads_on_one_process(tmp_path, fsdp):
    root = _two_rank_checkpoint(tmp_path, fsdp)
    reference = torch.load(root / "reference.pt", weights_only=True)
    path = ckpt.checkpoint_path(root, 1)
    manifest = json.loads((path / ckpt.COMPLETE_MARKER).read_text())
    assert manifest["layout"] == "dcp" and not (path / "model.safetensors").exists()
    shards = [n for n in manifest["files"] if n.endswith(".distcp")]
    assert {n.split("/")[1].split("_")[2] for n in shards} == {"0", "1"}, shards  # both ranks wrote shards
    for name, entry in manifest["files"].items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == entry["sha256"], name
    assert sorted(manifest["files"]) == sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                                               if p.is_file() and p.name != ckpt.COMPLETE_MARKER)
    ckpt.verify_checkpoint(path)

    model = _tiny()
    opt, sched = _optimizer(model)
    step, state = ckpt.load_checkpoint(path, model=model, optimizer=opt, scheduler=sched, rank=0, world_size=1)
    assert step == 1 and state["resized_from"] == 2
    assert [d["r"] for d in state["data_by_rank"]] == [0, 1]  # every saved rank's data position
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference["model"][k]), k
    for i, (name, _) in enumerate(model.named_parameters()):
        for key, value in reference["optim"]["state"][name].items():
            assert torch.equal(opt.state_dict()["state"][i][key], value), (name, key)
    assert sched.last_epoch == 1

    shard = path / shards[-1]  # a flipped bit in a shard rank 1 wrote is caught before loading
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="sha256"):
        ckpt.verify_checkpoint(path)


# ------------------------------------------------------------------------------- verification shared out
def _plain_checkpoint(root: Path, step: int) -> Path:
    model = torch.nn.Linear(4, 3)
    opt, sched = _optimizer(model)
    return ckpt.save_checkpoint(root, step, model=model, optimizer=opt, scheduler=sched, rank_state={"s": step},
                                keep=5)


def test_ranks_hash_disjoint_shares_of_a_checkpoint_and_agree_on_a_damaged_one(tmp_path, monkeypatch):
    import threading

    root = tmp_path / "ckpts"
    good, bad = _plain_checkpoint(root, 2), _plain_checkpoint(root, 4)
    data = bytearray((bad / "trainer.pt").read_bytes())
    data[len(data) // 2] ^= 1  # same size, one bit changed
    (bad / "trainer.pt").write_bytes(bytes(data))
    hashed: dict[int, list[str]] = {0: [], 1: []}
    real = ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file",
                        lambda p: hashed[int(threading.current_thread().name[-1])].append(Path(p).name) or real(p))
    world, box, sync = 2, [None, None], threading.Barrier(2)

    def gather(obj):
        r = int(threading.current_thread().name[-1])
        sync.wait()
        box[r] = obj
        sync.wait()
        out = list(box)
        sync.wait()
        return out

    chosen, logs = {}, []
    threads = [threading.Thread(target=lambda r=r: chosen.__setitem__(r, ckpt.select_checkpoint(
        root, logs.append, rank=r, world_size=world, gather=gather, barrier=sync.wait)), name=f"rank{r}")
        for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert chosen == {0: good, 1: good}  # both ranks fall back to the intact one
    assert len(logs) == 2 and "trainer.pt fails its sha256 check" in logs[0]  # rank 0 reports, once
    assert len(list(root.glob("step_0000004.corrupt-*"))) == 1
    # each file of each checkpoint was hashed by exactly one rank
    assert sorted(hashed[0] + hashed[1]) == sorted(["model.safetensors", "rank000.pt", "trainer.pt"] * 2)
    assert hashed[0] and hashed[1] and not set(hashed[0]) & set(hashed[1])
