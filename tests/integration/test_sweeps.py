"""End to end (smoke profile): a sweep whose middle point diverges finishes the other two and exits nonzero; its
rerun runs only what failed; a point held by another process is reported busy while the other points finish."""

from __future__ import annotations

import fcntl
import os

import pytest
from test_train import run

FAST = ["experiment=exp7", "profile=smoke", "stage=train", "logger.progress_bar=false", "train.num_threads=1"]
NO_COMPILE = {"HIF8QAT_COMPILE": "0"}


def _summary(sweep_dir) -> str:
    return (sweep_dir / "sweep_summary.txt").read_text()


@pytest.mark.slow
def test_a_failing_point_leaves_the_others_done_and_a_rerun_retries_only_it(tmp_path):
    root, lrs = tmp_path / "runs", "train.lr=1e-4,1e30,2e-4"
    out = run(["-m", *FAST, lrs, f"results_root={root}", f"hydra.sweep.dir={tmp_path / 's1'}"],
              env_extra=NO_COMPILE, check=False)
    assert out.returncode == 1, out.stderr[-3000:]
    folders = {lr: root / "smoke" / "exp7" / f"seed0-train.lr={lr}" for lr in ("0.0001", "1e+30", "0.0002")}
    assert (folders["0.0001"] / "DONE").exists() and (folders["0.0002"] / "DONE").exists()
    assert not (folders["1e+30"] / "DONE").exists()
    text = _summary(tmp_path / "s1")
    assert "3 point(s): 2 done, 0 already done, 1 failed, 0 busy" in text
    assert "#1 failed" in text and "error: gradient norm non-finite" in text and text in out.stderr

    again = run(["-m", *FAST, lrs, f"results_root={root}", f"hydra.sweep.dir={tmp_path / 's2'}"],
                env_extra=NO_COMPILE, check=False)
    assert again.returncode == 1
    text = _summary(tmp_path / "s2")
    assert "#0 already done" in text and "#1 failed" in text and "#2 already done" in text
    assert again.stdout.count("skipping training") == 2 and "resumed from" in again.stdout  # only #1 trained


@pytest.mark.slow
def test_a_point_busy_in_another_process_does_not_stop_the_other_points(tmp_path):
    root = tmp_path / "runs"
    shared = root / "smoke" / "exp7" / "seed0-train.lr=0.0002"
    shared.mkdir(parents=True)
    with open(shared / "run.lock", "a+") as held:  # another sweep training the shared point right now
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(f"pid {os.getpid()} on test\n")
        held.flush()
        out = run(["-m", *FAST, "train.lr=2e-4,1e-4", f"results_root={root}",
                   f"hydra.sweep.dir={tmp_path / 's'}"], env_extra=NO_COMPILE, check=False)
    assert out.returncode == 1, out.stderr[-3000:]
    assert (root / "smoke" / "exp7" / "seed0-train.lr=0.0001" / "DONE").exists()
    text = _summary(tmp_path / "s")
    assert "1 done, 0 already done, 0 failed, 1 busy" in text and "in use by another process" in text
