"""The SLURM launcher's resources read from the partition, and the run folder's record of its launch."""

from __future__ import annotations

import pytest

from hif8qat.launch.slurm import LauncherError, gone_as_completed, parse_sinfo, resolve_resources
from hif8qat.runs.launch_env import env_from_slurm, launch_record

SINFO = "\n".join([
    "gpu*|64|gpu:h100:8(S:0-1)",
    "gpu4|32|gpu:4",
    "cpu|2|(null)",
    "mixed|16|gpu:a100:4",
    "mixed|8|gpu:a100:2",  # a partition of two node kinds: what every node has
])
AUTO = {"gpus_per_node": "auto", "tasks_per_node": "auto", "cpus_per_task": "auto", "partition": None}


def test_sinfo_lines_give_each_partitions_cpus_and_gpus():
    parts = parse_sinfo(SINFO + "\nnot a partition line\n")
    assert parts == {"gpu": {"cpus": 64, "gpus": 8, "default": True},
                     "gpu4": {"cpus": 32, "gpus": 4, "default": False},
                     "cpu": {"cpus": 2, "gpus": 0, "default": False},
                     "mixed": {"cpus": 8, "gpus": 2, "default": False}}


@pytest.mark.parametrize("partition, want", [
    (None, {"gpus_per_node": 8, "tasks_per_node": 8, "cpus_per_task": 8}),  # default partition, 8 CPUs cap
    ("gpu4", {"gpus_per_node": 4, "tasks_per_node": 4, "cpus_per_task": 8}),
    ("cpu", {"gpus_per_node": None, "tasks_per_node": 1, "cpus_per_task": 2}),  # no silent GPU request
    ("mixed", {"gpus_per_node": 2, "tasks_per_node": 2, "cpus_per_task": 4}),
])
def test_auto_resources_follow_the_partition(partition, want):
    assert resolve_resources({**AUTO, "partition": partition}, parse_sinfo(SINFO)) == want


def test_explicit_settings_are_kept_and_tasks_follow_the_gpus():
    parts = parse_sinfo(SINFO)
    got = resolve_resources({**AUTO, "partition": "gpu", "gpus_per_node": 2}, parts)
    assert got == {"gpus_per_node": 2, "tasks_per_node": 2, "cpus_per_task": 8}
    got = resolve_resources({**AUTO, "partition": "cpu", "gpus_per_node": None, "tasks_per_node": 2}, parts)
    assert got == {"gpus_per_node": None, "tasks_per_node": 2, "cpus_per_task": 1}


@pytest.mark.parametrize("settings, words", [
    ({"partition": "cpu", "gpus_per_node": 8}, ["gpus_per_node=8", "no GPUs", "gpus_per_node=null"]),
    ({"partition": "gpu4", "gpus_per_node": 8}, ["gpus_per_node=8", "4 GPUs", "allowed 1 to 4"]),
    ({"partition": "cpu", "gpus_per_node": None, "tasks_per_node": 2, "cpus_per_task": 8},
     ["cpus_per_task=8", "2 CPUs", "at most 1"]),
    ({"partition": "nosuch"}, ["nosuch", "cpu, gpu, gpu4, mixed", "hydra.launcher.gpus_per_node=",
                               "hydra/launcher=slurm_cpu"]),
])
def test_settings_a_partition_cannot_run_are_refused_with_the_fix(settings, words):
    with pytest.raises(LauncherError) as err:
        resolve_resources({**AUTO, **settings}, parse_sinfo(SINFO))
    for word in words:
        assert word in str(err.value)


def test_without_sinfo_auto_is_an_error_and_explicit_values_pass():
    with pytest.raises(LauncherError, match="gpus_per_node, tasks_per_node, cpus_per_task are auto"):
        resolve_resources(AUTO, LauncherError("sinfo could not be run"))
    explicit = {"gpus_per_node": 4, "tasks_per_node": 4, "cpus_per_task": 6, "partition": "x"}
    assert resolve_resources(explicit, LauncherError("no sinfo")) == {
        k: explicit[k] for k in explicit if k != "partition"}


def test_jobs_squeue_has_forgotten_read_as_completed():
    listed = {"12_0": {"State": "RUNNING"}}
    assert gone_as_completed(listed, {"12_0", "12_1", "13"}) == {
        "12_1": {"JobID": "12_1", "State": "COMPLETED", "NodeList": ""},
        "13": {"JobID": "13", "State": "COMPLETED", "NodeList": ""}}


def test_launch_record_of_an_srun_task_in_a_job_array():
    env = {"SLURM_JOB_ID": "17", "SLURM_ARRAY_JOB_ID": "16", "SLURM_ARRAY_TASK_ID": "1", "SLURM_PROCID": "1",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_RESTART_COUNT": "1"}
    env_from_slurm(env)
    assert launch_record(env) == {"world_size": 2, "ranks_per_node": 2, "launcher": "slurm",
                                  "slurm": {"job_id": 17, "array_job_id": 16, "array_task_id": 1,
                                            "restart_count": 1}}


@pytest.mark.parametrize("env, launcher, world, per_node, job", [
    ({}, "local", 1, 1, None),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "torchrun", 4, 2, None),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "SLURM_JOB_ID": "5",
      "SLURM_PROCID": "0"}, "torchrun", 2, 2, 5),  # torchrun inside an allocation
    ({"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "local", 1, 1, 5),  # a batch script
    ({"SUBMITIT_LOCAL_JOB_ID": "99", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "submitit_local", 2, 2, None),
])
def test_launch_record_names_the_launcher(env, launcher, world, per_node, job):
    rec = launch_record(env)
    assert (rec["launcher"], rec["world_size"], rec["ranks_per_node"]) == (launcher, world, per_node)
    assert (rec["slurm"] or {}).get("job_id") == job


def test_a_slurm_sweep_that_cannot_know_its_resources_stops_before_submitting(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # an empty slurm.conf: sinfo fails at once (a missing one makes sinfo retry its read for a minute)
    (tmp_path / "empty-slurm.conf").touch()
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "SLURM_CONF": str(tmp_path / "empty-slurm.conf")}
    out = subprocess.run([sys.executable, str(root / "run.py"), "-m", "hydra/launcher=slurm", "experiment=exp8",
                          "profile=smoke", "stage=train", "seed=0,1", f"results_root={tmp_path / 'runs'}",
                          f"hydra.sweep.dir={tmp_path / 'sweep'}"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "hydra.launcher.gpus_per_node=" in errors[0] and "slurm_cpu" in errors[0], errors
    assert "Traceback" not in out.stderr and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("argv", [["-m", "seed=0,1", "--cfg", "hydra", "-p", "hydra.launcher"],
                                  ["--cfg", "job", "-m", "seed=0,1", "stage=train"], ["-m"]])
def test_pinned_launcher_settings_join_the_overrides_wherever_the_options_are(argv):
    from hydra._internal.utils import get_args_parser

    from hif8qat.cli.command_line import insert_overrides

    extra = ["hydra.launcher.gpus_per_node=null", "hydra.launcher.tasks_per_node=2"]
    before = get_args_parser().parse_args(argv)
    after = get_args_parser().parse_args(insert_overrides(["run.py", *argv], extra)[1:])  # no SystemExit
    assert after.overrides == before.overrides + extra
    assert (after.cfg, after.package, after.multirun) == (before.cfg, before.package, before.multirun)


def test_a_failed_jobs_line_names_its_own_error_or_else_its_state(tmp_path):
    from submitit.core.utils import UncompletedJobError

    from hif8qat.launch.slurm import failure_line

    class Job:
        job_id, state = "41_1", "CANCELLED"

        class paths:
            folder = tmp_path

    log = tmp_path / "41_1_0_log.err"
    log.write_text("some traceback\n")
    lost = UncompletedJobError("Job 41_1 (task: 0) with path x\nhas not produced any output (state: CANCELLED)")
    line = failure_line(Job, ["seed=1", "hydra.sweep.dir=/s"], lost)
    assert line == f"error: sweep job 41_1 (seed=1) failed: it ended without a result (state CANCELLED); its log: {log}"
    log.write_text("error: an earlier one\nerror: invalid setting seed=-1: allowed an integer >= 0\n")
    assert "failed: invalid setting seed=-1: allowed an integer >= 0; its log" in failure_line(Job, ["seed=-1"], lost)
    log.unlink()  # a task's own exception (hydra caught it in the job): its last line
    assert "failed: ValueError: bad; its log" in failure_line(Job, ["seed=1"], RuntimeError("x\n----\nValueError: bad"))


@pytest.mark.slow
def test_a_sweep_reports_every_failed_job_in_one_error_line_without_a_traceback(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [tmp_path / "a_file", tmp_path / "another_file"]
    for f in files:
        f.write_text("")
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "HIF8QAT_COMPILE": "0"}
    out = subprocess.run([sys.executable, str(root / "run.py"), "-m", "hydra/launcher=local", "experiment=exp8",
                          "profile=smoke", "stage=train", f"results_root={files[0]},{files[1]}",
                          f"hydra.sweep.dir={tmp_path / 'sweep'}"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, out.stderr[-3000:]  # both, not only the first one's
    for line, f in zip(sorted(errors, key=lambda e: "another" in e), files):
        assert f"results_root={f})" in line and f"{f} is a file" in line, line
        log = Path(line.rsplit("its log: ", 1)[1])
        assert log.is_file() and f"{f} is a file" in log.read_text(), line
