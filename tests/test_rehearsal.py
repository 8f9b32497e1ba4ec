"""`make rehearse`: the paper profile's code path on CPU, with only sizes and device changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_paper_path_rehearsal_passes_every_check(tmp_path):
    work = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "hif8qat.rehearse.paper_path", "--work", str(work)], capture_output=True,
                         text=True, timeout=900, env=env, cwd=ROOT)
    result = json.loads((work / "checks.json").read_text())
    failed = {name: why for name, why in result["checks"].items() if why}
    assert out.returncode == 0 and not failed, f"{failed}\n{out.stdout[-4000:]}\n{out.stderr[-2000:]}"
    # what a user of a paper run checks (each is one of the rehearsal's checks)
    assert set(result["checks"]) >= {
        "whole_run_finished", "evaluation_in_both_modes_on_both_ranks", "sharded_evaluation_equals_one_process",
        "telemetry_dumps_hold_their_steps", "identical_parameters_on_all_ranks",
        "grad_norm_equals_the_unsharded_one", "data_never_duplicated_across_ranks", "epoch_wraps_logged",
        "kill_and_resume_equal_the_uninterrupted_run", "resume_on_one_rank_continues_the_saved_state",
        "resume_on_one_rank_reads_no_document_twice", "report_builds"}
    assert result["wall_s"] < 600
