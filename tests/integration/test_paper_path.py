"""What a first paper-profile run would hit: a remote-code model's evaluation, telemetry dumps of the right
steps, the gradient norm under FSDP2, and streaming data split across ranks."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hif8qat.cli import stages
from hif8qat.config.numerics import run_numerics, train_numerics
from hif8qat.config.run_config import RunConfig, resolve_profile
from hif8qat.models.loading import load_causal_lm
from hif8qat.rehearse.standins import write_remote_code_model

ROOT = Path(__file__).resolve().parents[2]


def _smoke(tmp_path: Path, *overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="config", overrides=["profile=smoke", "stage=train",
                                                            "logger.progress_bar=false", "train.num_threads=1",
                                                            f"results_root={tmp_path}", *overrides])
    return resolve_profile(RunConfig.from_dict(OmegaConf.to_container(composed, resolve=True), check_paths=False))


@pytest.fixture
def remote_model(tmp_path):
    # A unique folder name: transformers caches remote code in a module named after the folder.
    return write_remote_code_model(tmp_path / f"tiny_pangu_{uuid.uuid4().hex[:8]}", num_layers=2)


# ------------------------------------------------------------------------------------------------
# evaluation of a remote-code export
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trusted", [True, None])
def test_evaluation_loads_a_remote_code_export_only_when_the_run_trusted_remote_code(tmp_path, remote_model,
                                                                                    trusted):
    from hif8qat.models.loading import load_causal_lm
    from hif8qat.train.export import export_model

    cfg = _smoke(tmp_path, "experiment=exp1", f"model.name={remote_model}", "eval.tasks=[mini_arc]",
                 "eval.limit=2", "eval.modes=[bf16]", "eval.batch_size=2",
                 f"model.trust_remote_code={'true' if trusted else 'null'}")
    model, tok = load_causal_lm(str(remote_model), trust_remote_code=True)
    run_dir = tmp_path / "run"
    export_model(model, tok, run_dir / "export", cfg, [])
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported.get("auto_map"), "the export keeps its remote code, as an openPangu export does"
    if trusted:
        stages.evaluate(cfg, run_dir, numerics=run_numerics(cfg))
        results = json.loads((run_dir / "eval" / "bf16" / "results.json").read_text())
        assert results["mini_arc"]["n"] == 2
    else:  # a run that did not opt in never runs the export's code at evaluation either
        with pytest.raises(ValueError, match="model.trust_remote_code"):
            stages.evaluate(cfg, run_dir, numerics=run_numerics(cfg))


def test_an_fsdp_run_exports_a_remote_code_model_with_its_own_modeling_code(tmp_path, remote_model):
    """FSDP2 swaps the root's class for a generated FSDP<cls>: save_pretrained copied torch's FSDP files into
    the export and pointed auto_map at them, so the export of every paper run failed to load."""
    import torch.distributed as dist

    from hif8qat.evaluate.loading import load_for_eval
    from hif8qat.models.loading import load_causal_lm
    from hif8qat.train.distributed import apply_fsdp, full_model_state_dict
    from hif8qat.train.export import export_model

    cfg = _smoke(tmp_path, "experiment=exp1", f"model.name={remote_model}", "model.trust_remote_code=true")
    model, tok = load_causal_lm(str(remote_model), trust_remote_code=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        apply_fsdp(model)
        export_model(model, tok, tmp_path / "export", cfg, [], state_dict=full_model_state_dict(model))
    finally:
        dist.destroy_process_group()
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_tiny_pangu.TinyPanguForCausalLM"
    assert sorted(p.name for p in (tmp_path / "export").glob("*.py")) == ["configuration_tiny_pangu.py",
                                                                         "modeling_tiny_pangu.py"]
    loaded, _ = load_for_eval(tmp_path / "export", "bf16", trust_remote_code=True)
    assert type(loaded).__name__ == "TinyPanguForCausalLM"
    assert type(model).__name__.startswith("FSDP")  # the trained model is left as it was


# ------------------------------------------------------------------------------------------------
# per-layer telemetry dumps
# ------------------------------------------------------------------------------------------------
def test_telemetry_dumps_hold_the_counts_of_their_own_steps(tmp_path, monkeypatch):
    from hif8qat.train.loop import train

    monkeypatch.setenv("HIF8QAT_COMPILE", "0")  # the eager quantizer: no cold compile for an 8-step run
    # 2 micro-batches per step: each quantizer runs twice a step (A, W in forward; G in backward).
    cfg = _smoke(tmp_path, "experiment=exp2", "train.global_batch_size=4", "train.micro_batch_size=2",
                 "quant.telemetry_dump_every=3", "train.checkpoint_every=100")
    assert cfg.quant.bf16_warmup_steps == 0 and cfg.train.steps == 8
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train(cfg, run_dir, numerics=train_numerics(cfg))
    dumps = sorted((run_dir / "telemetry").glob("*.jsonl"))
    assert [p.name for p in dumps] == [f"step{s:07d}_rank0.jsonl" for s in (0, 3, 6)]
    initial, _ = load_causal_lm(cfg.model.name)  # the same seeded weights the run starts from
    training = cfg.quant.training
    target = {"A": training.target_fwd, "W": training.target_fwd, "G": training.target_bwd}
    below = beyond = 0
    for path in dumps:
        step = int(path.name[4:11])
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert records and {r["role"] for r in records} == {"A", "W", "G"}
        for r in records:
            assert r["step"] == step
            # this step's calls, each with saturation statistics (a dump step is a statistics step)
            assert (r["calls"], r["stats_calls"]) == (2, 2), (path.name, r)
            # the last call's numbers obey their definitions: ratio = amax / estimate, scale = target / estimate
            assert r["ratio"] == pytest.approx(r["amax"] / r["estimate"], rel=1e-5), r
            assert r["scale"] == pytest.approx(target[r["role"]] / r["estimate"], rel=1e-5), r
            # |x * s| tops the target only where the amax outgrew the estimate: none when ratio < 1, at least
            # the largest element when ratio > 1. At ratio 1 the largest element lands on the target up to
            # float32 rounding of amax * s (15.000001 is counted), so at most a few ties count there
            if r["ratio"] < 1 - 1e-6:
                assert r["exceed_frac"] == 0, r
                below += 1
            elif r["ratio"] > 1 + 1e-6:
                assert r["exceed_frac"] > 0, r
                beyond += 1
            else:
                assert r["exceed_frac"] <= 1e-3, r
            assert r["exceed_frac"] <= r["exceed_frac_max"] <= 1 and r["amax"] <= r["amax_max"], r
            if step == 0 and r["role"] == "W":  # not yet updated: the largest |weight| of the initial model
                weight = initial.get_submodule(r["layer"]).weight
                assert r["amax"] == weight.abs().max().item(), r["layer"]
    assert below > 0 and beyond > 0  # both sides of the rule above are exercised in this run


# ------------------------------------------------------------------------------------------------
# gradient norm under FSDP2
# ------------------------------------------------------------------------------------------------
_NORM_WORKER = '''
import json, sys, torch, torch.distributed as dist
from hif8qat.train.distributed import apply_fsdp
from hif8qat.models.loading import build_tiny_llama
from hif8qat.train.guards import clip_gradients

dist.init_process_group("gloo")
rank = dist.get_rank()
model, _ = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64)
reference, _ = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64)  # same seeded init
apply_fsdp(model)
batches = [torch.randint(3, 250, (2, 17), generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
def loss(m, tokens):
    return m(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
loss(model, batches[rank]).backward()  # FSDP averages the two ranks' gradients
(sum(loss(reference, b) for b in batches) / 2).backward()
unsharded = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in reference.parameters()]))
norm = float(clip_gradients(model, 1.0))
model.zero_grad()
loss(model, batches[rank]).backward()
if rank == 1:  # a NaN in one rank's shard only
    next(p for p in model.parameters() if p.to_local().numel()).grad.to_local().view(-1)[0] = float("nan")
nan_norm = float(clip_gradients(model, 1.0))
json.dump({"norm": norm, "unsharded": float(unsharded), "nan_norm": repr(nan_norm)},
          open(sys.argv[1] + f"/rank{rank}.json", "w"))
'''


@pytest.mark.slow  # two ranks under torchrun
def test_fsdp_gradient_norm_is_the_whole_models_and_agreed_by_all_ranks(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(_NORM_WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["norm"] == ranks[1]["norm"]  # one value: the same clip and skip decision everywhere
    assert ranks[0]["norm"] == pytest.approx(ranks[0]["unsharded"], rel=1e-5)  # not one shard's norm
    assert [r["nan_norm"] for r in ranks] == ["nan", "nan"]  # both ranks skip the step


# ------------------------------------------------------------------------------------------------
# streaming data split across ranks
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [3, 4])
def test_each_rank_reads_only_its_own_part_of_parquet_shards(tmp_path, monkeypatch, shards):
    """3 files for 2 ranks used to make both ranks read every row and keep every other document."""
    import re

    from datasets.packaged_modules.parquet.parquet import Parquet

    from hif8qat.data.loader import build_train_stream
    from hif8qat.models.loading import build_tiny_tokenizer
    from hif8qat.rehearse.standins import write_fineweb_shards

    write_fineweb_shards(tmp_path / "fineweb", shards=shards, docs_per_shard=24, row_group_size=5)
    rows_read: list[int] = []
    real = Parquet._generate_tables

    def counting(self, *args, **kwargs):  # rows the parquet reader decodes, whoever keeps them
        for key, table in real(self, *args, **kwargs):
            rows_read.append(table.num_rows)
            yield key, table

    monkeypatch.setattr(Parquet, "_generate_tables", counting)
    seen, read = [], []
    for rank in (0, 1):
        rows_read.clear()
        stream = build_train_stream(str(tmp_path / "fineweb"), build_tiny_tokenizer(), seq_len=31,
                                    micro_batch_size=2, rank=rank, world_size=2)
        seen.append({re.match(r"<doc:(\d+-\d+)>", r["text"])[1] for r in stream._make(0)})
        read.append(sum(rows_read))
    total = shards * 24
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == total  # disjoint, and together everything
    assert all(n <= total // 2 + 5 for n in read), read  # each rank decodes about its half (+- one row group)


def test_a_rank_of_resharded_parquet_resumes_exactly_across_its_epoch_end(tmp_path):
    import torch

    from hif8qat.data.loader import build_train_stream
    from hif8qat.models.loading import build_tiny_tokenizer
    from hif8qat.rehearse.standins import write_fineweb_shards

    write_fineweb_shards(tmp_path / "fineweb", shards=3, docs_per_shard=12, row_group_size=4)
    kw = dict(seq_len=63, micro_batch_size=2, rank=1, world_size=2)
    tok = build_tiny_tokenizer()
    reference = build_train_stream(str(tmp_path / "fineweb"), tok, **kw)
    expected = [next(reference) for _ in range(30)]
    assert reference.epoch >= 1  # the rank's part wraps inside 30 batches
    for k in (7, 19):
        stream = build_train_stream(str(tmp_path / "fineweb"), tok, **kw)
        for _ in range(k):
            next(stream)
        resumed = build_train_stream(str(tmp_path / "fineweb"), tok, **kw)
        resumed.load_state_dict(stream.state_dict())
        assert all(torch.equal(next(resumed), want) for want in expected[k:]), k


def test_the_step_log_records_the_data_epoch_and_a_wrap_is_announced(tmp_path, capsys):
    from hif8qat.rehearse.standins import write_fineweb_shards
    from hif8qat.train.loop import train

    write_fineweb_shards(tmp_path / "fineweb", shards=2, docs_per_shard=1)  # a few steps of data
    cfg = _smoke(tmp_path, "experiment=exp1", f"data.source={tmp_path / 'fineweb'}", "train.checkpoint_every=100")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train(cfg, run_dir, numerics=train_numerics(cfg))
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(epochs) == 8 and epochs[0] == 0 and epochs[-1] >= 1 and epochs == sorted(epochs)
    first_wrap = epochs.index(1)
    assert f"rank 0: step {first_wrap}: the training data ran out; data epoch 1" in capsys.readouterr().out


def test_a_run_that_keeps_no_checkpoint_when_done_never_writes_the_final_one(tmp_path, monkeypatch):
    from hif8qat.train import checkpoint as ckpt
    from hif8qat.train.loop import train

    saved = []
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda root, step, **kw: saved.append(step))
    cfg = _smoke(tmp_path, "experiment=exp1", "train.checkpoint_every=3", "train.keep_checkpoints_when_done=0")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train(cfg, run_dir, numerics=train_numerics(cfg))
    assert saved == [3, 6]  # the step-8 checkpoint would have been pruned right after its write
    assert (run_dir / "export" / "model.safetensors").exists() and (run_dir / "DONE").exists()
