"""amax_reduce="max": two CPU processes (gloo) that see different amaxes end with identical scales."""

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
        from hif8qat.scaling import DelayedScaler, ScalingConfig

        result = {}
        for reduce in ("max", "none"):
            sc = DelayedScaler("A", ScalingConfig(algo="max", history_len=4, amax_reduce=reduce))
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
