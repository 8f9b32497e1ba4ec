"""`make slurm-rehearse`: the SLURM launcher on a real one-node cluster (skipped where it cannot start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.slurm
def test_the_slurm_rehearsal_passes_every_check(tmp_path):
    work = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "hif8qat.rehearse.slurm", "--work", str(work)], capture_output=True,
                         text=True, timeout=900, env=env, cwd=ROOT)
    result = json.loads((work / "checks.json").read_text())
    if "skipped" in result:
        assert out.returncode == 0, out.stderr[-2000:]
        pytest.skip(result["skipped"])
    failed = {name: why for name, why in result["checks"].items() if why}
    assert out.returncode == 0 and not failed, f"{failed}\n{out.stdout[-4000:]}\n{out.stderr[-2000:]}"
    assert set(result["checks"]) >= {
        "sweep_finishes_both_runs", "sweep_equals_torchrun_bit_for_bit", "run_info_records_the_slurm_launch",
        "sacct_fallback_says_so_once", "killed_job_fails_the_sweep_and_the_rerun_resumes",
        "preempted_job_is_requeued_and_resumes", "requeued_job_checkpoints_on_sigterm_and_resumes",
        "invalid_point_fails_alone", "eval_on_2_ranks_equals_one_process"}
    # every daemon it started is gone
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _has_conf(p, work)]


def _has_conf(proc: Path, work: Path) -> bool:
    try:
        return str(work).encode() in (proc / "environ").read_bytes()
    except OSError:
        return False


def test_a_cluster_that_cannot_start_is_a_skip_with_its_reason(tmp_path, monkeypatch, capsys):
    from hif8qat.rehearse import slurm as slurm_rehearsal
    from hif8qat.rehearse.slurm_cluster import ClusterUnavailable, LocalCluster

    def refuse(self):
        raise ClusterUnavailable("slurmctld did not start (exit 1): no munge here")

    monkeypatch.setattr(LocalCluster, "start", refuse)
    ran = []
    monkeypatch.setattr(slurm_rehearsal, "rehearse", lambda *a: ran.append(a) or {})
    assert slurm_rehearsal.main(["--work", str(tmp_path / "w")]) == 0
    assert not ran
    reason = json.loads((tmp_path / "w" / "checks.json").read_text())["skipped"]
    assert "slurmctld did not start" in reason and f"skipped: {reason}" in capsys.readouterr().out
