"""The kit's own tools (benchmarks/wheelhouse.py, benchmarks/gpu_check.sh) check every argument and setting before
creating anything: bad usage is one ``error:`` line, exit 2, no traceback and no folder left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.sh"
WHEELHOUSE = ROOT / "benchmarks" / "wheelhouse.py"


def _refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


# ------------------------------------------------------------------ gpu_check.sh
def gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DEVICE": "cpu", **env}
    return subprocess.run(["bash", str(GPU_CHECK), str(out)], capture_output=True, text=True, timeout=120,
                          env=full, cwd=ROOT)


@pytest.mark.parametrize("env,needles", [
    ({"GPU_CHECK_ONLY": "qdq no_such_stage"}, ["unknown stage no_such_stage", "exp8_paper_shapes"]),  # T04
    ({"GPU_CHECK_ONLY": " "}, ["GPU_CHECK_ONLY", "selects no stage"]),  # T06
    ({"GPU_CHECK_ONLY": ""}, ["GPU_CHECK_ONLY", "selects no stage"]),
    ({"GPU_CHECK_TIMEOUT": "abc"}, ["GPU_CHECK_TIMEOUT=abc", "seconds above 0"]),  # T07
    ({"GPU_CHECK_TIMEOUT": "0"}, ["GPU_CHECK_TIMEOUT=0", "seconds above 0"]),
    ({"GPU_CHECK_TIMEOUT": "-5"}, ["GPU_CHECK_TIMEOUT=-5"]),
    ({"GPU_CHECK_PLAN": "yes"}, ["GPU_CHECK_PLAN=yes", "allowed 1"]),
    ({"PYTHON": "/no/such/python"}, ["PYTHON=/no/such/python"]),
    ({"GPU_CHECK_DEVICE": "tpu"}, ["GPU_CHECK_DEVICE=tpu", "allowed cuda, cpu"]),
], ids=["T04-unknown-stage", "T06-blank-only", "empty-only", "T07-timeout-word", "timeout-zero", "timeout-negative",
        "plan-word", "python-missing", "device"])
def test_gpu_check_refuses_bad_settings_before_making_its_folder(tmp_path, env, needles):
    proc = gpu_check(tmp_path / "out", **env)
    _refused(proc, *needles)
    assert tree(tmp_path) == []  # no OUT folder, not even an empty one


def test_gpu_check_refuses_a_file_as_its_folder_and_two_folders(tmp_path):
    (tmp_path / "taken").write_text("a file\n")
    _refused(gpu_check(tmp_path / "taken"), f"{tmp_path / 'taken'} is a file")
    assert (tmp_path / "taken").read_text() == "a file\n"
    proc = subprocess.run(["bash", str(GPU_CHECK), str(tmp_path / "a"), str(tmp_path / "b")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable})
    _refused(proc, "one argument at most")
    assert tree(tmp_path) == ["taken"]


def test_gpu_check_takes_a_decimal_timeout_and_a_plan_creates_nothing(tmp_path):
    proc = gpu_check(tmp_path / "plan", GPU_CHECK_TIMEOUT="0.5", GPU_CHECK_PLAN="1", GPU_CHECK_ONLY="qdq")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["qdq", "0.5", "total", "0.5"]
    assert tree(tmp_path) == []


# ------------------------------------------------------------------ wheelhouse.py
def wheelhouse(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WHEELHOUSE), *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, **env})


@pytest.mark.parametrize("case", ["W02-out-is-a-file", "W03-node-missing", "W05-python-word", "python-2",
                                  "extras-unknown", "max-mib-zero", "requirements-missing"])
def test_wheelhouse_refuses_bad_arguments_before_making_its_folder(tmp_path, case):
    (tmp_path / "a_file").write_text("kept\n")
    out = tmp_path / "wheels"
    args, needles = {
        "W02-out-is-a-file": (["--out", str(tmp_path / "a_file")], ["--out", "is a file"]),
        "W03-node-missing": (["--out", str(out), "--node", str(tmp_path / "nodes.txt")], ["--node", "no such file"]),
        "W05-python-word": (["--out", str(out), "--python", "3.12", "3.x"], ["--python 3.x", "3.N"]),
        "python-2": (["--out", str(out), "--python", "2.7"], ["--python 2.7"]),
        "extras-unknown": (["--out", str(out), "--extras", "nope"], ["--extras nope", "pipeline"]),
        "max-mib-zero": (["--out", str(out), "--max-mib", "0"], ["--max-mib 0"]),
        "requirements-missing": (["--out", str(out), "--requirements", str(tmp_path / "r.txt")],
                                 ["--requirements", "no such file"]),
    }[case]
    _refused(wheelhouse(*args), *needles)
    assert tree(tmp_path) == ["a_file"] and (tmp_path / "a_file").read_text() == "kept\n"


def test_wheelhouse_offline_is_an_error_line_and_leaves_no_folder(tmp_path):  # W04
    proc = wheelhouse("--out", str(tmp_path / "wheels"), PIP_NO_INDEX="1", PIP_FIND_LINKS="",
                      PIP_CONFIG_FILE=os.devnull)
    _refused(proc, "pip could not reach its index")
    assert tree(tmp_path) == []
