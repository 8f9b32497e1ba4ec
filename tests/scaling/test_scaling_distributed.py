"""amax_reduce="max": two CPU processes (gloo) that see different amaxes end with identical scales; frozen
(evaluation) scalers never communicate, so one rank can evaluate alone."""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["HIF8QAT_COMPILE"] = "0"  # eager quantizer: no compile warm-up in the child processes
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from hif8qat.scaling.bank_row import BankedScaler
        from hif8qat.scaling.settings import ScalingConfig

        result = {}
        for reduce in ("max", "none"):
            sc = BankedScaler.standalone("A", ScalingConfig(algo="max", history_len=4, amax_reduce=reduce))
            gen = torch.Generator().manual_seed(100 + rank)
            scales = []
            for i in range(8):
                x = torch.randn(16, 16, generator=gen) * (1 + 3 * rank) * (1 + i % 3)
                if rank == 1 and i == 5:
                    x[0, 0] = float("nan")  # one rank's NaN must be skipped by both ranks
                sc.quantize(x)
                scales.append(sc.last["scale"].item())
            scales.append(sc.scale.item())
            result[reduce] = {"scales": scales, "history": sc.history_values()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_amax_reduce_max_gives_identical_scales_across_ranks(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["max"]["scales"] == r1["max"]["scales"]
    assert r0["max"]["history"] == r1["max"]["history"]
    assert len(r0["max"]["history"]) == 4  # 8 calls, one skipped everywhere (NaN on rank 1), window 4
    # without the reduction each rank keeps its own history (authors' behaviour) and the ranks differ
    assert r0["none"]["scales"] != r1["none"]["scales"]
    assert len(r1["none"]["history"]) == 4 and len(r0["none"]["history"]) == 4
    # the reduced history is the elementwise max of what the ranks saw (rank 1 has the larger tensors)
    assert r0["max"]["scales"][0] == r1["none"]["scales"][0]


def _frozen_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Both ranks train with amax_reduce=max, then only rank 0 evaluates with frozen scales."""
    import datetime

    os.environ["HIF8QAT_COMPILE"] = "0"
    torch.set_num_threads(1)
    # a frozen quantizer that still all-reduced would block here until this timeout, then fail
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        from hif8qat.quant.linear import _convert_model, freeze_scales, quant_state_dict
        from hif8qat.scaling.bank_row import BankedScaler
        from hif8qat.scaling.settings import ScalingConfig

        cfg = ScalingConfig(algo="max", history_len=4, amax_reduce="max")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        _convert_model(model, "mlp", None, cfg)
        alone, fresh = BankedScaler.standalone("A", cfg), BankedScaler.standalone("A", cfg)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):  # training: every rank, amaxes all-reduced
            ids = torch.randint(0, 64, (2, 8), generator=gen)
            model(ids, labels=ids).loss.backward()
            alone.quantize(torch.randn(8, 8, generator=gen) * (1 + rank))
        state = quant_state_dict(model)
        if rank == 0:  # evaluation on rank 0 only: must not wait for rank 1
            freeze_scales(model, True)
            alone.freeze(True)
            fresh.freeze(True)
            with torch.no_grad():
                for _ in range(3):
                    model(torch.randint(0, 64, (2, 8), generator=gen))
                    alone.quantize(torch.randn(8, 8, generator=gen))
                    fresh.quantize(torch.randn(8, 8, generator=gen))  # cold start while frozen: local amax
            after = quant_state_dict(model)
            assert all(torch.equal(state[k], after[k]) for k in state if not k.endswith(".meta"))
        dist.barrier()
        with open(os.path.join(out_dir, f"frozen{rank}.json"), "w") as fh:
            json.dump({k: v.tolist() for k, v in state.items() if k.endswith(".history")}, fh)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_frozen_scalers_never_communicate(tmp_path):
    mp.spawn(_frozen_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"frozen{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 and r0  # the bank's amax_reduce=max made the training histories identical
