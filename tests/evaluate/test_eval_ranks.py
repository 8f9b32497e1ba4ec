"""Data-parallel evaluation (hif8qat.evaluate.ranks) against a single process, the oracle: two gloo ranks spawned
in process score the same requests / evaluate the same export, and must give the single-process answers
(log-likelihoods within test_prefix_lm's fp32 tolerance, the same is_greedy and choices), each rank scoring
only part of the requests, with whole context groups per rank; rank 0 alone writes the files."""

import csv
import json
import pickle
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from hif8qat.evaluate.ranks import deal

ONE_THREAD = True
TOL = (1e-4, 1e-5)  # test_prefix_lm's fp32 tolerance: other batch shapes, other summation orders


def test_deal_keeps_equal_keys_together_and_balances_by_cost():
    keys = ["a", "b", "a", "c", "d", "b", "a"]
    costs = [5, 4, 5, 6, 1, 4, 5]  # groups: a = 15 (0, 2, 6), b = 8 (1, 5), c = 6 (3), d = 1 (4)
    # largest first, each to the least-loaded rank: a -> 0 (15), b -> 1 (8), c -> 1 (8 < 15: 14), d -> 1 (14 < 15)
    assert deal(keys, costs, 2) == [[0, 2, 6], [1, 3, 4, 5]]
    assert deal(keys, costs, 3) == [[0, 2, 6], [1, 5], [3, 4]]
    assert deal(keys, costs, 1) == [list(range(7))]
    assert deal(["x"], [3], 4) == [[0], [], [], []]  # a rank may get nothing; the others still answer


def _tiny():
    from hif8qat.models.loading import build_tiny_llama

    return build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=3)


def _requests(model):
    from test_prefix_lm import _requests as hand_made  # shared, unshared, greedy and truncated contexts

    return hand_made(model)


def _worker(rank: int, world: int, store: str, out: str, what: str, export: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        from hif8qat.evaluate.ranks import Ranks

        if what == "tokens":
            from hif8qat.evaluate.prefix_lm import SharedContextLM

            model, tok = _tiny()
            lm = SharedContextLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=4, max_length=64,
                                 ranks=Ranks.current())
            answers = lm._loglikelihood_tokens(_requests(model))
            Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps({"answers": answers,
                                                                    "counts": dict(lm.token_counts)}))
        else:
            from hif8qat.evaluate.runner import evaluate_export

            res = evaluate_export(export, what, "mini", out_dir=Path(out) / what, device="cpu",
                                  limit=4, batch_size=4)
            Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, what: str, export: str = "") -> Path:
    out = tmp_path / f"ranks_{what}"
    out.mkdir()
    mp.spawn(_worker, args=(2, str(tmp_path / f"store_{what}"), str(out), what, export), nprocs=2)
    return out


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL[0] + TOL[1] * abs(a)


def test_two_ranks_score_each_context_group_once_and_return_the_single_process_answers(tmp_path):
    from hif8qat.evaluate.prefix_lm import SharedContextLM

    model, tok = _tiny()
    reqs = _requests(model)
    single = SharedContextLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=4, max_length=64)
    want = single._loglikelihood_tokens(reqs)
    out = _spawn(tmp_path, "tokens")
    ranks = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for got in ranks:  # every rank holds every answer, in request order
        assert len(got["answers"]) == len(want)
        for (la, ga), (lb, gb) in zip(want, got["answers"]):
            assert _close(la, lb) and ga == gb, (la, lb, ga, gb)
    counts = [r["counts"] for r in ranks]
    assert all(0 < c["requests"] < len(reqs) for c in counts), counts  # each rank scored a part only
    assert sum(c["requests"] for c in counts) == len(reqs)
    # a context forwarded on both ranks would add its tokens twice: the sums equal the single process's
    for key in ("per_request", "forwarded"):
        assert sum(c[key] for c in counts) == single.token_counts[key], key


def _rows(folder: Path, task: str) -> list[list[str]]:
    with (folder / f"samples_{task}.csv").open() as fh:
        return list(csv.reader(fh))[1:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hif8"])  # bf16 mode: the rehearsal
def test_two_rank_evaluation_writes_the_single_process_files(tmp_path, mode):
    from conftest import write_quantized_export

    from hif8qat.evaluate.runner import evaluate_export

    export = write_quantized_export(tmp_path / "export", scope="attn_mlp", seed=4)
    single = evaluate_export(export, mode, "mini", out_dir=tmp_path / "single", device="cpu",
                             limit=4, batch_size=4)
    out = _spawn(tmp_path, mode, str(export))
    sharded = json.loads((out / "rank0.json").read_text())
    assert json.loads((out / "rank1.json").read_text()) == {}  # rank 1 scored its share, wrote nothing
    files = sorted(p.name for p in (out / mode).iterdir())
    assert files == sorted(p.name for p in (tmp_path / "single").iterdir())
    for task in ("mini_mmlu", "mini_hellaswag", "mini_arc"):
        assert sharded[task] == single[task], task
        a, b = _rows(tmp_path / "single", task), _rows(out / mode, task)
        assert [r[:2] for r in a] == [r[:2] for r in b], task  # same documents, same correct/incorrect
        for ra, rb in zip(a, b):
            assert _close(float(ra[2]), float(rb[2])), (task, ra, rb)
    meta = sharded["_meta"]
    assert meta["ranks"] == 2 and len(meta["eval_tokens_by_rank"]) == 2
    assert all(c["requests"] > 0 for c in meta["eval_tokens_by_rank"])
    assert meta["eval_tokens"]["forwarded"] == single["_meta"]["eval_tokens"]["forwarded"]
    assert meta["eval_tokens"]["per_request"] == single["_meta"]["eval_tokens"]["per_request"]
