"""How a run is launched: `make expN PROFILE=paper` counts the GPUs once the venv exists, run_info.json records
the ranks and accumulation steps, and runs made with other ones are never paired."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hif8qat.cli import main as cli_main
from hif8qat.config.numerics import train_numerics
from hif8qat.config.run_config import RunConfig, resolve_profile
from hif8qat.runs import host_allocator
from hif8qat.runs.folders import find_baseline_run, prepare_run_dir, release_run_dir

ROOT = Path(__file__).resolve().parents[2]


def _smoke(tmp_path: Path, *overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="config", overrides=["profile=smoke", "stage=train", "experiment=exp1",
                                                            f"results_root={tmp_path}", *overrides])
    return resolve_profile(RunConfig.from_dict(OmegaConf.to_container(composed, resolve=True), check_paths=False))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_paper_counts_gpus_after_the_venv_is_created(tmp_path):
    """A fresh checkout: .venv does not exist when make reads the Makefile, only once its prerequisite ran. The
    stand-in venv's python reports 8 GPUs; torchrun must be started with all 8."""
    venv, calls = tmp_path / "venv", tmp_path / "torchrun_args"
    fresh = tmp_path / "fresh.mk"  # replaces the recipe that installs the venv with one that fakes it
    fresh.write_text(
        "$(STAMP):\n"
        f"\tmkdir -p {venv}/bin\n"
        f"\tprintf '#!/bin/sh\\n[ \"$$1\" = -c ] && echo 8\\nexit 0\\n' > {venv}/bin/python\n"
        f"\tprintf '#!/bin/sh\\necho \"$$@\" >> {calls}\\n' > {venv}/bin/torchrun\n"
        f"\tchmod +x {venv}/bin/python {venv}/bin/torchrun\n"
        "\ttouch $(STAMP)\n")
    out = subprocess.run(["make", "--no-print-directory", "-f", "Makefile", "-f", str(fresh), "exp1",
                          "PROFILE=paper", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    launched = calls.read_text().split()
    assert launched[launched.index("--nproc_per_node") + 1] == "8", launched


def test_run_info_records_ranks_and_accumulation(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = _smoke(tmp_path, "train.global_batch_size=24", "train.micro_batch_size=2")
    run_dir, _ = prepare_run_dir(cfg)
    release_run_dir(run_dir)
    info = json.loads((run_dir / "run_info.json").read_text())
    shape = {k: info["distributed"][k] for k in ("world_size", "ranks_per_node", "grad_accum_steps")}
    assert shape == {"world_size": 4, "ranks_per_node": 2, "grad_accum_steps": 24 // (2 * 4)}
    assert info["distributed"]["launcher"] == "local" and info["distributed"]["slurm"] is None  # the launch record
    assert info["host_allocator"] == host_allocator.current()  # how this process's allocator was set, traceable


def _run(root: Path, exp: str, quant: bool, distributed: dict | None) -> Path:
    d = root / "paper" / exp / "seed0"
    d.mkdir(parents=True)
    cfg = {"experiment": {"name": exp}, "seed": 0, "train": {"lr": 1e-5, "global_batch_size": 1024},
           "quant": {"enabled": quant}}
    (d / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
    if distributed is not None:
        start = {"status": "new", "distributed": distributed}
        (d / "run_info.json").write_text(json.dumps({**start, "history": [start]}))
    (d / "DONE").write_text("")
    return d


def _shape(world: int, accum: int) -> dict:
    return {"world_size": world, "ranks_per_node": min(world, 8), "grad_accum_steps": accum}


def test_runs_made_on_other_ranks_and_accumulation_are_not_paired(tmp_path):
    _run(tmp_path, "exp7", False, _shape(1, 64))
    run = _run(tmp_path, "exp8", True, _shape(8, 8))
    path, why = find_baseline_run(tmp_path, "paper", "exp7", run)
    assert path is None
    assert "distributed.world_size (8 vs 1)" in why and "distributed.grad_accum_steps (8 vs 64)" in why


@pytest.mark.parametrize("baseline", [_shape(8, 8), None], ids=["same", "recorded-before"])
def test_runs_made_alike_or_recorded_before_still_pair(tmp_path, baseline):
    base = _run(tmp_path, "exp7", False, baseline)
    run = _run(tmp_path, "exp8", True, _shape(8, 8))
    assert find_baseline_run(tmp_path, "paper", "exp7", run) == (base, "")


def _with_numerics(run: Path, first: dict, resumed: dict | None = None) -> Path:
    """run_info.json as the trainer records it: the numerics of the first start, and of a resume if any."""
    info = json.loads((run / "run_info.json").read_text())
    starts = [{**info["history"][0], "numerics": first}] \
        + ([{"status": "resumed", "numerics": resumed}] if resumed else [])
    (run / "run_info.json").write_text(json.dumps({**starts[-1], "history": starts}))
    return run


NATIVE = {"device_type": "cpu", "numerics": "bf16", "native_bf16": True, "cpu_capability": "AVX512"}
EMULATED = {"device_type": "cpu", "numerics": "bf16_emulated", "native_bf16": False, "cpu_capability": "AVX2"}
FORCED = {"device_type": "cpu", "numerics": "bf16", "native_bf16": False, "cpu_capability": "AVX2"}


@pytest.mark.parametrize("other,resumed,paired", [
    (NATIVE, None, True),  # the same numerics on another host of the same kind
    ({**NATIVE, "cpu_capability": "AVX512_BF16"}, None, True),  # the ISA alone does not decide
    (EMULATED, None, False), (FORCED, None, False), ({**NATIVE, "device_type": "cuda"}, None, False),
    (NATIVE, EMULATED, False),  # resumed on a machine without native BF16: part of its steps differ
], ids=["same", "other-isa", "emulated", "bf16-without-native", "cuda", "resumed-elsewhere"])
def test_runs_trained_with_other_compute_numerics_are_not_paired(tmp_path, other, resumed, paired):
    base = _with_numerics(_run(tmp_path, "exp7", False, _shape(1, 8)), NATIVE)
    run = _with_numerics(_run(tmp_path, "exp8", True, _shape(1, 8)), other, resumed)
    path, why = find_baseline_run(tmp_path, "paper", "exp7", run)
    assert (path == base) is paired, why
    if not paired:
        assert "numerics." in why


def test_process_group_outlives_a_slow_rank0_and_binds_the_rank_gpu(monkeypatch):
    """Two ranks on a node with 2 GPUs: the process group gets this rank's GPU and a timeout longer than torch's
    10-minute default (rank 0 exports and prunes while the others wait)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hif8qat.train import loop as train

    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    ctx = train.setup_distributed("auto")
    assert ctx.device == torch.device("cuda", 1)
    assert seen["backend"] == "nccl" and seen.get("device_id") == torch.device("cuda", 1)
    assert seen.get("timeout", timedelta(minutes=10)) >= timedelta(minutes=30)


def test_preflight_sees_the_world_size_of_srun(tmp_path, monkeypatch):
    """Under srun (SLURM variables, no WORLD_SIZE) an FSDP step that fits 8 ranks' memory but not one rank's
    passes preflight: SLURM's variables are mapped before it runs."""
    import importlib.util
    import sys

    from hif8qat.launch import memory
    from hif8qat.models.loading import model_config_facts

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "x")  # recorded, so the mapping below is undone after the test
        monkeypatch.delenv(name)
    for name, value in {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NODEID": "0",
                        "SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_STEP_NODELIST": "gpu01", "SLURM_JOB_ID": "7"}.items():
        monkeypatch.setenv(name, value)
    overrides = ["experiment=exp1", "profile=smoke", "stage=train", "train.distributed=fsdp",
                 "train.global_batch_size=16", "train.micro_batch_size=2", f"results_root={tmp_path}"]
    cfg = _smoke(tmp_path, "train.distributed=fsdp", "train.global_batch_size=16", "train.micro_batch_size=2")
    facts = model_config_facts(cfg.model.name)
    one, eight = (sum(memory.step_memory(cfg, facts, train_numerics(cfg), w).values()) for w in (1, 8))
    assert one > eight
    monkeypatch.setattr(memory, "machine_memory", lambda device: (eight, "memory on GPU 0"))

    spec = importlib.util.spec_from_file_location("hif8qat_run_srun", ROOT / "run.py")
    run_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_module)
    dispatched = []
    monkeypatch.setattr(cli_main, "dispatch", lambda cfg, numerics: dispatched.append(cfg))
    # hydra finds conf/ beside the file of a __main__ function, as when run.py is started as a script
    monkeypatch.setattr(run_module.main.__wrapped__, "__module__", "__main__")
    monkeypatch.setattr(sys, "argv", ["run.py", *overrides, f"hydra.run.dir={tmp_path / 'hydra'}",
                                      "hydra.output_subdir=null"])
    run_module.main()
    assert len(dispatched) == 1
