"""Faults: one atomic writer (tables and logs included), per-step logs a resume can repeat without duplicates,
full-disk and read-only errors as one ``error:`` line naming the folder and its free space, and run.py's
exception boundary, which turns the project's errors into that line and leaves bugs as tracebacks."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch
from test_reliability import FAST, assert_user_error, cli
from test_report import make_fake_runs
from test_train import SMOKE, run

from hif8qat import boundary
from hif8qat.errors import RunError
from hif8qat.report.table_files import write_table
from hif8qat.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


# ------------------------------------------------------------------ per-step telemetry: idempotent
def _tiny_quantized():
    from hif8qat.models.loading import build_tiny_llama
    from hif8qat.quant.linear import _convert_model
    from hif8qat.scaling.settings import ScalingConfig

    model, _ = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=0)
    names = _convert_model(model, "mlp", None, ScalingConfig(telemetry_dump_every=1))
    model(torch.randint(0, 100, (2, 8))).logits.sum().backward()
    return model, names


def test_dumping_a_step_twice_leaves_one_copy_and_keeps_other_steps(tmp_path):
    from hif8qat.models.quant_files import dump_telemetry

    model, names = _tiny_quantized()
    path = tmp_path / "telemetry" / "dump.jsonl"
    n = dump_telemetry(model, path, step=4)
    assert n == 3 * len(names)
    dump_telemetry(model, path, step=4)  # a resume that reruns step 4
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [4] * n
    dump_telemetry(model, path, step=8)
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [4] * n + [8] * n


@pytest.mark.slow
def test_a_killed_and_resumed_run_writes_the_same_telemetry_as_an_uninterrupted_one(tmp_path):
    """Killed at the start of step 5 with the last checkpoint after step 2 (step_0000003), the resume reruns
    steps 3 and 4, and with them the telemetry dump of step 4."""
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    run(SMOKE + [f"results_root={whole}"])
    out = run(SMOKE + [f"results_root={crashed}"], env_extra={"HIF8QAT_TEST_KILL_AT_STEP": "5"}, check=False)
    assert out.returncode != 0
    (folder,) = (crashed / "smoke" / "exp8").glob("seed0*")
    assert (folder / "telemetry" / "step0000004_rank0.jsonl").exists()  # dumped before the kill
    assert [p.name for p in ckpt.list_checkpoints(folder / "checkpoints")] == ["step_0000003"]
    run(SMOKE + [f"results_root={crashed}", "train.resume=auto"])

    def dumps(root: Path) -> dict[str, list[dict]]:
        (folder,) = (root / "smoke" / "exp8").glob("seed0*")
        return {p.name: [json.loads(line) for line in p.read_text().splitlines()]
                for p in sorted((folder / "telemetry").glob("*.jsonl"))}

    expected, got = dumps(whole), dumps(crashed)
    assert "step0000004_rank0.jsonl" in got
    assert {k: len(v) for k, v in got.items()} == {k: len(v) for k, v in expected.items()}
    assert got == expected


# ------------------------------------------------------------------ full disk, wherever it happens
def test_metrics_append_on_a_full_disk_is_a_storage_error_naming_the_file(tmp_path, monkeypatch):
    from hif8qat.train.log import MetricsSink

    sink = MetricsSink.__new__(MetricsSink)
    sink.enabled, sink.path, sink.wandb = True, tmp_path / "metrics.jsonl", None
    real_open = pathlib.Path.open

    def full(self, *a, **k):
        if self == sink.path:
            raise _enospc(self)
        return real_open(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "open", full)
    with pytest.raises(RunError) as err:
        sink.log({"step": 1, "loss": 2.0})
    text = str(err.value)
    assert str(sink.path) in text and "no space left" in text and " free" in text


def test_torch_save_basic_ios_failure_on_a_full_disk_is_disk_full_and_keeps_the_last_checkpoint(tmp_path,
                                                                                                   monkeypatch):
    """torch.save reports a disk that fills exactly at a write as ``RuntimeError: basic_ios::clear``."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 1, model=model, optimizer=opt, scheduler=sched, rank_state={"x": 1})
    real_save = torch.save

    def full(obj, f, *a, **k):
        if str(f).endswith("trainer.pt"):
            raise RuntimeError("basic_ios::clear: iostream error")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(ckpt, "free_space", lambda path: 0)  # the disk is exactly full
    with pytest.raises(ckpt.DiskFull, match="no space left"):
        ckpt.save_checkpoint(root, 2, model=model, optimizer=opt, scheduler=sched, rank_state={"x": 2})
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_0000001"]


def test_table_files_are_replaced_atomically_when_the_disk_fills(tmp_path, monkeypatch):
    out = tmp_path / "tables"
    write_table(pd.DataFrame({"a": [1, 2, 3]}), out, "t", title="T", sources={"files": ["x"]})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_write_text = pathlib.Path.write_text

    def half_then_full(self, data, *a, **k):  # the disk fills halfway through a file
        real_write_text(self, data[: len(data) // 2], *a, **k)
        raise _enospc(self)

    monkeypatch.setattr(pathlib.Path, "write_text", half_then_full)
    with pytest.raises(RunError, match="no space left"):
        write_table(pd.DataFrame({"a": [4, 5, 6, 7]}), out, "t", title="T2", sources={"files": ["y"]})
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no torn file, no temporary left


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_report_on_a_full_disk_is_one_error_line_and_tears_no_table(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("needs root to mount a small tmpfs (the monkeypatched cases above cover the mechanism)")
    try:
        runs_root = make_fake_runs(disk / "runs", exps=("exp7", "exp8"))
        out = cli(["experiment=exp8", "stage=report"], runs_root)
        assert out.returncode == 0, out.stderr[-3000:]
        tables = runs_root / "tables" / "smoke"
        before = {p.name: p.read_bytes() for p in tables.iterdir()}
        filler = disk / "filler"
        try:  # fill the disk to the last block
            with filler.open("wb", buffering=0) as fh:
                while True:
                    fh.write(b"\0" * 4096)
        except OSError:
            pass
        out = cli(["experiment=exp8", "stage=report"], runs_root)
        assert_user_error(out, "no space left", "free")
        after = {p.name: p.read_bytes() for p in tables.iterdir()}
        assert after == before  # every table as it was (same inputs): none torn, no temporary left
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# ------------------------------------------------------------------ the exception boundary in run.py
def test_boundary_turns_a_run_error_into_one_error_line(capsys):
    def job():
        raise RunError("the thing the user can fix")

    assert boundary.guarded(job) == 2
    err = capsys.readouterr().err
    assert err == "error: the thing the user can fix\n"


def test_boundary_turns_a_full_disk_from_any_library_into_an_error_line_naming_folder_and_free_space(tmp_path,
                                                                                                      capsys):
    target = tmp_path / "eval" / "bf16" / "results.json"

    def job():
        raise _enospc(target)

    assert boundary.guarded(job) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert str(target) in err and "no space left" in err and f"{target.parent} has" in err and " free" in err


@pytest.mark.parametrize("bug", [KeyError("x"), TypeError("bad call"), ValueError("bad value"),
                                 OSError(errno.ENOENT, "No such file", "/nope"), ZeroDivisionError()])
def test_boundary_does_not_swallow_bugs(bug):
    def job():
        raise bug

    with pytest.raises(type(bug)):
        boundary.guarded(job)


def test_refusing_remote_code_is_a_run_error():
    from hif8qat.models.loading import RemoteCodeError

    assert issubclass(RemoteCodeError, RunError) and issubclass(RemoteCodeError, ValueError)


# ------------------------------------------------------------------ caches that cannot be written
def test_a_cache_that_is_a_file_is_an_error_line_before_any_run_folder(tmp_path):
    cache = tmp_path / "cache_file"
    cache.write_text("")
    out = run([*FAST, f"results_root={tmp_path / 'runs'}", "experiment=exp1", "stage=train"],
              env_extra={"HIF8QAT_CACHE": str(cache)}, check=False)
    assert_user_error(out, "HIF8QAT_CACHE", "is a file")
    assert not (tmp_path / "runs").exists()


def test_a_data_cache_dir_that_is_a_file_is_refused_by_name(tmp_path):
    cache = tmp_path / "cache_file"
    cache.write_text("")
    out = cli(["experiment=exp1", "stage=train", f"data.cache_dir={cache}"], tmp_path / "runs")
    assert_user_error(out, "data.cache_dir", "is a file")
    assert not (tmp_path / "runs").exists()


def test_a_read_only_cache_folder_is_refused(tmp_path):
    cache = tmp_path / "ro"
    if not _mount_tmpfs(cache, "1m") or subprocess.run(["mount", "-o", "remount,ro", str(cache)]).returncode:
        pytest.skip("needs root to mount a read-only tmpfs (permissions alone do not stop root)")
    try:
        out = run([*FAST, f"results_root={tmp_path / 'runs'}", "experiment=exp1", "stage=train"],
                  env_extra={"HIF8QAT_CACHE": str(cache)}, check=False)
        assert_user_error(out, "HIF8QAT_CACHE", "not writable")
        assert not (tmp_path / "runs").exists()
    finally:
        subprocess.run(["umount", str(cache)], check=False)

