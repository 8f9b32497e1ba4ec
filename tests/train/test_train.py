"""End-to-end trainer behaviour on the tiny model: exact resume after SIGKILL, DDP on CPU, run folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_state

from hif8qat.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["experiment=exp8", "profile=smoke", "stage=train", "logger.progress_bar=false",
         "train.checkpoint_every=3", "train.num_threads=1"]


def run(args: list[str], env_extra: dict | None = None, launcher: list[str] | None = None, check=True):
    env = {**os.environ, "PYTHONHASHSEED": "0", **(env_extra or {})}
    cmd = (launcher or [sys.executable]) + [str(ROOT / "run.py")] + args
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return out


def run_folder(root: Path, experiment="exp8", seed=0) -> Path:
    return root / "smoke" / experiment / f"seed{seed}"


def losses(folder: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _tagged_folder(root: Path, experiment: str) -> Path:
    """The one run folder of the experiment (command-line settings tag its name)."""
    (folder,) = (root / "smoke" / experiment).glob("seed0*")
    return folder


def _file_bytes(folder: Path, *names: str) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in names}


EXPORTED = ("export/model.safetensors", "export/hif8qat_scalers.safetensors", "export/hif8qat_quant.json")
# (experiment, numerics): the smoke default (fp32, max estimator), and the mini profile's default numerics,
# native and emulated BF16, with exp4's exp_smooth forecaster (its state is the hardest to restore).
RESUME_CASES = [("exp8", "none"), ("exp4", "bf16"), ("exp4", "bf16_emulated")]


@pytest.mark.slow
@pytest.mark.parametrize("experiment,numerics", RESUME_CASES, ids=[f"{e}-{n}" for e, n in RESUME_CASES])
def test_sigkill_then_resume_continues_the_loss_series_bit_for_bit(tmp_path, experiment, numerics):
    args = [a for a in SMOKE if not a.startswith("experiment=")] + [f"experiment={experiment}",
                                                                    f"train.autocast={numerics}"]
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    run(args + [f"results_root={whole}", "train.keep_checkpoints_when_done=0"])
    assert (_tagged_folder(whole, experiment) / "export" / "model.safetensors").exists()
    assert not (_tagged_folder(whole, experiment) / "checkpoints").exists()  # freed once the run is done
    # Killed at the start of step 5: the last checkpoint is step 3 (exp8: after the BF16 warmup switched QAT on).
    out = run(args + [f"results_root={crashed}"], env_extra={"HIF8QAT_TEST_KILL_AT_STEP": "5"}, check=False)
    assert out.returncode != 0
    folder = _tagged_folder(crashed, experiment)
    assert not (folder / "DONE").exists()
    assert [p.name for p in (folder / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_0000003"]
    run(args + [f"results_root={crashed}", "train.resume=auto"])
    expected, got = losses(_tagged_folder(whole, experiment)), losses(folder)
    assert [s for s, _ in got] == list(range(8))
    assert got == expected  # exact float equality, quantizer histories included
    # the final weights and scaler state too, byte for byte
    assert _file_bytes(folder, *EXPORTED) == _file_bytes(_tagged_folder(whole, experiment), *EXPORTED)
    assert [p.name for p in ckpt.list_checkpoints(folder / "checkpoints")] == ["step_0000006", "step_0000008"]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["converted_linears"] > 0
    assert summary["numerics"]["numerics"] == numerics
    import yaml

    assert yaml.safe_load((folder / "config_resolved.yaml").read_text())["train"]["autocast"] == numerics


@pytest.mark.slow
def test_finished_run_is_skipped_and_force_keeps_the_old_folder(tmp_path):
    args = SMOKE + [f"results_root={tmp_path}", "train.checkpoint_every=100"]
    run(args)
    folder = run_folder(tmp_path)
    first = (folder / "metrics.jsonl").read_text()
    out = run(args)
    assert "skipping training" in out.stdout
    assert (folder / "metrics.jsonl").read_text() == first
    run(args + ["force=true"])
    archived = [p for p in folder.parent.iterdir() if p.name.startswith("seed0.old-")]
    assert len(archived) == 1 and (archived[0] / "metrics.jsonl").read_text() == first
    export = folder / "export"
    assert (export / "config.json").exists() and (export / "hif8qat_quant.json").exists()
    # The export loads in plain transformers with the same weights as the run's final checkpoint (step 8).
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export)
    final = load_file(ckpt.latest_checkpoint(folder / "checkpoints") / "model.safetensors")
    assert ckpt.checkpoint_step(ckpt.latest_checkpoint(folder / "checkpoints")) == 8
    loaded = dict(model.named_parameters())
    assert loaded and set(loaded) <= set(final)
    for name, param in loaded.items():
        assert torch.equal(param.detach(), final[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["none", "max"])
def test_ddp_two_cpu_ranks_see_different_data_and_max_reduce_agrees(tmp_path, reduce):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run(SMOKE + [f"results_root={tmp_path}", f"quant.amax_reduce={reduce}", "train.global_batch_size=4"],
        launcher=torchrun)
    folder = next((tmp_path / "smoke" / "exp8").iterdir())
    assert (folder / "DONE").exists() and len(losses(folder)) == 8
    final = sorted((folder / "checkpoints").glob("step_*"))[-1]
    ranks = [torch.load(final / f"rank{r:03d}.pt", weights_only=True) for r in (0, 1)]
    activation_scales = [{k: v for k, v in r["scalers"].items() if ".A." in k or k.endswith(".A")} for r in ranks]
    assert activation_scales[0].keys() == activation_scales[1].keys() and activation_scales[0]
    same = all(torch.equal(activation_scales[0][k], activation_scales[1][k]) for k in activation_scales[0])
    # Different data on each rank gives different activation amax histories unless they are all-reduced.
    assert same == (reduce == "max")


@pytest.mark.slow
def test_corrupt_latest_checkpoint_and_torn_metrics_still_resume_bit_for_bit(tmp_path):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    run(SMOKE + [f"results_root={whole}"])
    out = run(SMOKE + [f"results_root={crashed}"], env_extra={"HIF8QAT_TEST_KILL_AT_STEP": "7"}, check=False)
    assert out.returncode != 0
    folder = run_folder(crashed)
    latest = folder / "checkpoints" / "step_0000006"
    # Flip the lowest mantissa bit of 2000 float32 weights: the file still loads, only the checksum differs.
    weights = latest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for i in range(2000):
        data[header + 4 * i] ^= 1
    weights.write_bytes(bytes(data))
    with (folder / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # the torn line a crash mid-write leaves

    out = run(SMOKE + [f"results_root={crashed}", "train.resume=auto"])

    assert "model.safetensors fails its sha256 check" in out.stdout
    assert "resumed from" in out.stdout and "step_0000003 at step 3" in out.stdout
    assert "unparsable line" in out.stdout
    assert losses(folder) == losses(run_folder(whole))  # redone from step 3, bit for bit
    assert len(list((folder / "checkpoints").glob("step_0000006.corrupt-*"))) == 1
    # and it ends in the uninterrupted run's state: weights, optimizer moments and step counts, scheduler,
    # scaler histories, and the exported weights
    from safetensors.torch import load_file

    mine, theirs = (f / "checkpoints" / "step_0000008" for f in (folder, run_folder(whole)))
    assert_same_state(load_file(mine / "model.safetensors"), load_file(theirs / "model.safetensors"), "model")
    for name in ("trainer.pt", "rank000.pt"):
        assert_same_state(torch.load(mine / name, weights_only=True), torch.load(theirs / name, weights_only=True),
                          name)
    assert_same_state(*(load_file(f / "export" / "model.safetensors") for f in (folder, run_folder(whole))),
                      "export")


@pytest.mark.slow
def test_finished_run_without_its_export_is_finished_again_not_a_dead_end(tmp_path):
    import shutil

    args = SMOKE + [f"results_root={tmp_path}", "train.checkpoint_every=100"]
    run(args)
    folder = run_folder(tmp_path)
    series = losses(folder)
    weights = (folder / "export" / "model.safetensors").read_bytes()
    shutil.rmtree(folder / "export")
    evaluated = run([a.replace("stage=train", "stage=eval") for a in args], check=False)
    assert evaluated.returncode == 2 and "stage=all" in evaluated.stderr
    out = run(args)  # re-exports from the final checkpoint, trains nothing
    assert "writing it again from the checkpoint of step 8" in out.stdout
    assert (folder / "export" / "model.safetensors").read_bytes() == weights
    assert losses(folder) == series
    shutil.rmtree(folder / "export")
    shutil.rmtree(folder / "checkpoints")
    refused = run(args, check=False)
    assert refused.returncode == 2 and "force=true" in refused.stderr and "Traceback" not in refused.stderr
