"""A sweep point's failure is its outcome, never the end of the sweep; the summary lists every point and the
sweep's exit status says whether any failed or was busy (in-process, submitit-local and SLURM launchers alike)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from hif8qat.errors import RunError
from hif8qat.launch import sweep
from hif8qat.launch.slurm import ReportFailedJobs
from hif8qat.runs.folders import RunFolderBusy
from hif8qat.train.preemption import Preempted, StopSignalExit


def test_each_kind_of_failure_is_an_outcome_with_its_error_line():
    stream = io.StringIO()

    def diverged():
        raise RunError("gradient norm non-finite for 4 consecutive steps")

    def busy():
        raise RunFolderBusy("/r/seed1 is in use by another process")

    def bug():
        return {}["missing"]

    def follower_exit():
        raise SystemExit(2)

    assert sweep.run_point(diverged, stream=stream) == {
        "state": "failed", "error": "error: gradient norm non-finite for 4 consecutive steps"}
    assert sweep.run_point(busy, stream=stream)["state"] == "busy"
    got = sweep.run_point(bug, stream=stream)
    assert got["state"] == "failed" and "KeyError" in got["error"]
    assert "Traceback" in stream.getvalue()  # a bug keeps its traceback for the report
    assert sweep.run_point(follower_exit, stream=stream)["state"] == "failed"
    assert sweep.run_point(lambda: None, stream=stream) == {"state": "done", "error": ""}
    assert sweep.run_point(lambda: sweep.SKIPPED, stream=stream)["state"] == "already done"
    with pytest.raises(SystemExit) as stop:  # Ctrl-C stops the whole sweep, not one point
        sweep.run_point(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), stream=stream)
    assert stop.value.code == 130 and "interrupted (Ctrl-C)" in stream.getvalue()


def test_a_stop_signal_stops_the_sweep_and_leaves_no_outcome():
    """A preemption or requeue checkpoints the point and ends the process: an outcome returned here would be
    pickled by submitit as the job's result, which the sweep reads as the point's end while SLURM runs the job
    again; and an in-process sweep would start its next point on a process told to stop."""
    stream = io.StringIO()

    def rank0_preempted():
        raise Preempted("stopped by SIGTERM: checkpointed at step 6 (/r/ckpt/step_0000006, verified); "
                        "resume with the same command")

    def exits(code):  # a follower rank's exit (2); submitit's, after rank 0 chained it and it requeued the job (-1)
        def job():
            raise StopSignalExit(code)
        return job

    with pytest.raises(StopSignalExit) as stop:
        sweep.run_point(rank0_preempted, stream=stream)
    assert stop.value.code == 2
    assert stream.getvalue() == ("error: stopped by SIGTERM: checkpointed at step 6 (/r/ckpt/step_0000006, "
                                 "verified); resume with the same command\n")
    for code in (2, -1):  # re-raised as they are, nothing printed (rank 0 said it)
        quiet = io.StringIO()
        with pytest.raises(StopSignalExit) as stop:
            sweep.run_point(exits(code), stream=quiet)
        assert stop.value.code == code and quiet.getvalue() == ""


def test_summary_names_every_point_and_a_failure_makes_the_exit_status_nonzero(tmp_path, capsys):
    points = [(0, ["train.lr=1e-4", "hydra.sweep.dir=/x"], sweep.outcome("done")),
              (1, ["train.lr=1e30"], sweep.outcome("failed", "error: diverged at step 5")),
              (2, ["train.lr=2e-4"], sweep.outcome("already done")),
              (3, ["train.lr=3e-4"], sweep.outcome("busy", "error: in use by another process"))]
    with pytest.raises(SystemExit) as stop:
        sweep.finish_sweep(tmp_path, points)
    assert stop.value.code == 1
    text = (tmp_path / "sweep_summary.txt").read_text()
    assert text in capsys.readouterr().err
    assert "4 point(s): 1 done, 1 already done, 1 failed, 1 busy" in text
    assert "#1 failed" in text and "error: diverged at step 5" in text and "hydra.sweep.dir" not in text

    sweep.finish_sweep(tmp_path / "ok", [points[0], points[2]])  # nothing failed: status 0
    assert "0 failed, 0 busy" in (tmp_path / "ok" / "sweep_summary.txt").read_text()


class _Job:
    job_id = "77"
    state = "COMPLETED"
    paths = SimpleNamespace(folder="/nonexistent")


def _ret(value, status="COMPLETED"):
    return SimpleNamespace(status=SimpleNamespace(name=status), return_value=value, _return_value=value)


class _Submitted:
    """What hydra-submitit-launcher's launch hands back (one JobReturn per job), without submitting."""

    def __init__(self, returns):
        self.returns = returns

    def launch(self, job_overrides, initial_job_idx):
        return self.returns


def test_the_submitit_launchers_write_the_same_summary(tmp_path, monkeypatch, capsys):
    import hif8qat.launch.slurm as slurm

    returns = [_ret(sweep.outcome("done")), _ret(sweep.outcome("busy", "error: in use")), _ret(None)]

    class Launcher(ReportFailedJobs, _Submitted):
        config = SimpleNamespace(hydra=SimpleNamespace(sweep=SimpleNamespace(dir=str(tmp_path))))

    monkeypatch.setattr(slurm, "_outcomes", lambda: _JobList([_Job()] * 3))
    with pytest.raises(SystemExit) as stop:
        Launcher(returns).launch([["seed=0"], ["seed=1"], ["seed=2"]], 0)
    assert stop.value.code == 1  # a busy point: the sweep is not complete
    text = (tmp_path / "sweep_summary.txt").read_text()
    assert "3 point(s): 2 done, 0 already done, 0 failed, 1 busy" in text and "#1 busy" in text


class _JobList:
    def __init__(self, jobs):
        self.jobs = jobs

    def __enter__(self):
        return self.jobs

    def __exit__(self, *exc):
        return False
