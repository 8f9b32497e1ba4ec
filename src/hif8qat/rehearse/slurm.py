"""`make slurm-rehearse`: the SLURM launcher for real, on a one-node cluster started on 127.0.0.1.

``python -m hif8qat.rehearse.slurm`` starts munged, slurmctld and slurmd in a temporary folder
(:mod:`hif8qat.rehearse.slurm_cluster`, installing ``slurm-wlm`` and ``munge`` when missing) and drives the
project's own Hydra launcher config (``hydra/launcher=slurm_cpu``, 2 tasks per job over gloo) at the smoke
profile: a 2-seed sweep equal to torchrun bit for bit, a SIGKILLed job and its resume, preemption by
``scancel --signal=USR2`` and by ``scontrol requeue``, a failing sweep point, and a 2-rank evaluation.
docs/running_at_scale.md ("Rehearsed on a local SLURM cluster") lists the checks. When the daemons cannot be
started here it prints ``skipped: <why>`` and exits 0; it stops every daemon it started, by PID."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from hif8qat.rehearse.checks import finish, parse_work_args, run_check
from hif8qat.rehearse.slurm_cluster import ClusterUnavailable, LocalCluster

WORLD = 2
PAUSE_AT = 5  # after the step-4 checkpoint (smoke: checkpoint_every=4, 8 steps)
RESUME_AT = 4  # a job killed outright resumes from the periodic checkpoint
SIGNAL_AT = 6  # a signalled one checkpoints the end of the step the signal came in
COMMON = ["experiment=exp8", "profile=smoke", "logger.progress_bar=false", "train.num_threads=1"]
SLURM = ["hydra/launcher=slurm_cpu", f"hydra.launcher.tasks_per_node={WORLD}", "hydra.launcher.timeout_min=10"]


class _Runner:
    def __init__(self, work: Path, repo: Path, env: dict[str, str]):
        self.work, self.repo, self.env, self.n = work, repo, env, 0

    def start(self, name: str, args: list[str], *, nproc: int = 1, env: dict | None = None):
        """Start run.py (under torchrun when nproc > 1) in the background: (process, log path)."""
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                    if nproc > 1 else [sys.executable])
        self.n += 1
        log = self.work / "logs" / f"{self.n:02d}_{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        fh = log.open("w")
        proc = subprocess.Popen([*launcher, str(self.repo / "run.py"), *args], stdout=fh, stderr=subprocess.STDOUT,
                                env={**self.env, **(env or {})}, cwd=self.work)
        proc.t0, proc.name, proc.fh = time.time(), name, fh
        return proc, log

    def wait(self, started, timeout: float = 600) -> tuple[int, str]:
        proc, log = started
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        proc.fh.close()
        print(f"  {proc.name}: exit {rc} in {time.time() - proc.t0:.0f} s ({log})", flush=True)
        return rc, log.read_text(errors="replace")

    def run(self, name: str, args: list[str], **kw) -> tuple[int, str]:
        return self.wait(self.start(name, args, **kw))


def _folder(results: Path, seed: int) -> Path:
    return results / "smoke" / "exp8" / f"seed{seed}"


def _metrics(folder: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def _same_weights(a: Path, b: Path) -> bool:

    wa, wb = load_file(a / "export" / "model.safetensors"), load_file(b / "export" / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _info(folder: Path) -> dict:
    return json.loads((folder / "run_info.json").read_text())


def _job_ids(sweep: Path) -> list[str]:
    """The sweep's SLURM job ids (array tasks as <array>_<task>), from submitit's folders."""
    sub = sweep / ".submitit"
    return sorted(p.name for p in sub.iterdir() if p.is_dir() and "_" in p.name) if sub.exists() else []


def _one_error_line_per_failed_job(sweep_output: str, sweep: Path, words: str) -> None:
    """The sweep's own output: one `error:` line, naming the failed job's log (which exists) and `words`, and no
    traceback."""
    assert "Traceback" not in sweep_output, sweep_output[-2000:]
    errors = [line for line in sweep_output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], errors or sweep_output[-2000:]
    log = Path(errors[0].rsplit("its log: ", 1)[-1])
    assert log.is_file() and log.is_relative_to(sweep), errors[0]


def _pause_env(marker: Path) -> dict[str, str]:
    """The trainer's test hook: pause at step PAUSE_AT (once), each rank adding a line to `marker` with the SLURM
    job id and its pid."""
    return {"HIF8QAT_TEST_PAUSE_AT_STEP": str(PAUSE_AT), "HIF8QAT_TEST_PAUSE_FILE": str(marker)}


def _signal_when_paused(marker: Path, sweep, command: list[str], timeout: float = 400) -> str:
    """Wait until every rank of the sweep's job pauses at step PAUSE_AT, then run `command <job id>` (`command
    <every rank's pid>` when it is `kill`); what was run, or why not."""
    end = time.time() + timeout
    try:
        while not (marker.exists() and len(re.findall(r"job=\d+", marker.read_text())) >= WORLD):
            if sweep.poll() is not None or time.time() > end:
                raise AssertionError(f"the job never reached step {PAUSE_AT} ({marker} not written)")
            time.sleep(0.5)
        text = marker.read_text()
        targets = re.findall(r"pid=(\d+)", text) if command[0] == "kill" else [re.search(r"job=(\d+)", text)[1]]
        subprocess.run([*command, *targets], check=True, timeout=30, capture_output=True)
        return " ".join([*command, *targets])
    except Exception as err:  # noqa: BLE001 - the check reports it
        return f"not signalled: {err}"


def rehearse(work: Path, repo: Path) -> dict[str, str | None]:
    """Run the rehearsal (the cluster must be up).

    Args:
        work: the rehearsal's folder.
        repo: the checkout whose run.py and src/ are rehearsed.

    Returns:
        Check name -> None if it passed, else why it failed."""
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1",
           "HIF8QAT_SLURM_POLL_S": "5",  # a sweep notices a job that ended without a result within seconds
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "HIF8QAT_COMPILE": "0"}  # the eager quantizer is bit-identical and spares each process a cold compile
    runner = _Runner(work, repo, env)
    checks: dict[str, str | None] = {}
    R = {k: work / "runs" / k for k in ("slurm", "torchrun", "killed", "preempted", "requeued", "eval_one")}

    def sweep_args(results: Path | str, name: str, seeds: str, *extra: str) -> list[str]:
        return ["-m", *SLURM, *COMMON, "stage=train", f"seed={seeds}", f"results_root={results}",
                f"hydra.sweep.dir={work / 'sweeps' / name}", *extra]

    # torchrun references run beside the SLURM jobs (the node's 2 CPUs are SLURM's, so both slow down a bit)
    refs = [runner.start(f"torchrun_seed{s}", [*COMMON, "stage=train", f"seed={s}", f"results_root={R['torchrun']}",
                                                f"hydra.run.dir={work / 'hydra' / f'torchrun{s}'}"], nproc=WORLD)
            for s in (0, 1)]
    rc_sweep, log_sweep = runner.run("sweep_2_seeds_x_2_ranks", sweep_args(R["slurm"], "sweep", "0,1"))
    rc_refs = [runner.wait(r) for r in refs]

    # Then, side by side (the partition shares each CPU among up to 4 jobs, so a paused job holds none back):
    # a job killed outright at step 5, a job preempted at step 5, a sweep with an invalid point, the evaluation.
    pauses = {k: work / f"paused_{k}" for k in ("killed", "preempted", "requeued")}
    killed = runner.start("sweep_killed", sweep_args(R["killed"], "killed", "0"), env=_pause_env(pauses["killed"]))
    # USR2 under a time limit that makes any signal a time-out: submitit's requeue path, max_num_timeout 1 -> 0
    preempted = runner.start("sweep_preempted", sweep_args(R["preempted"], "preempted", "0",
                                                           "hydra.launcher.max_num_timeout=1",
                                                           "hydra.launcher.signal_delay_s=30"),
                             env=_pause_env(pauses["preempted"]))
    # an administrator's requeue: SIGTERM to the job's tasks, then SLURM starts it again
    requeued = runner.start("sweep_requeued", sweep_args(R["requeued"], "requeued", "0"),
                            env=_pause_env(pauses["requeued"]))
    # a point that fails in its job (every point's settings are checked before submission; whether results_root
    # can be written is only known where the job runs): seed 1 in R["slurm"] is finished (skipped in seconds)
    not_a_folder = work / "not_a_folder"
    not_a_folder.write_text("")
    bad = runner.start("sweep_with_a_failing_point", sweep_args(f"{R['slurm']},{not_a_folder}", "invalid", "1"))
    # stage=eval on 2 ranks under SLURM, and on one process from a copy of the same run folder
    try:
        shutil.copytree(_folder(R["slurm"], 0), _folder(R["eval_one"], 0), ignore=shutil.ignore_patterns("run.lock"))
    except Exception as err:  # noqa: BLE001 - the check reports what is missing
        print(f"  no run to copy for the one-process evaluation: {err}", flush=True)
    one = runner.start("eval_one_process", [*COMMON, "stage=eval", "seed=0", f"results_root={R['eval_one']}",
                                            f"hydra.run.dir={work / 'hydra' / 'eval_one'}"])
    under_slurm = runner.start("eval_2_ranks_under_slurm", ["-m", *SLURM, *COMMON, "stage=eval", "seed=0",
                                                            f"results_root={R['slurm']}",
                                                            f"hydra.sweep.dir={work / 'sweeps' / 'eval'}"])
    # SIGKILL to the tasks themselves, as the OOM killer or a lost node does: `scancel -s KILL <job>` cancels the
    # job, SIGTERM first, and the job would checkpoint
    kill_note = _signal_when_paused(pauses["killed"], killed[0], ["kill", "-KILL"])
    usr2_note = _signal_when_paused(pauses["preempted"], preempted[0], ["scancel", "--signal=USR2"])
    requeue_note = _signal_when_paused(pauses["requeued"], requeued[0], ["scontrol", "requeue"])
    rc_killed, log_killed = runner.wait(killed)
    rerun = runner.start("sweep_killed_rerun", sweep_args(R["killed"], "killed_rerun", "0"),
                         env=_pause_env(pauses["killed"]))
    rc_preempted, log_preempted = runner.wait(preempted)
    rc_requeued, log_requeued = runner.wait(requeued)
    rc_bad, log_bad = runner.wait(bad)
    rc_eval, log_eval = runner.wait(under_slurm)
    rc_one, log_one = runner.wait(one)
    rc_rerun, log_rerun = runner.wait(rerun)

    def sweep_finishes_both_runs():
        assert rc_sweep == 0, f"exit {rc_sweep}: {log_sweep[-2000:]}"
        for seed in (0, 1):
            assert (_folder(R["slurm"], seed) / "DONE").exists(), f"seed {seed} not finished"

    def sweep_equals_torchrun_bit_for_bit():
        for seed, (rc, log) in zip((0, 1), rc_refs):
            assert rc == 0, f"torchrun seed {seed}: exit {rc}: {log[-1500:]}"
            a, b = _folder(R["slurm"], seed), _folder(R["torchrun"], seed)
            assert _metrics(a) == _metrics(b), f"seed {seed}: losses differ\n{_metrics(a)}\n{_metrics(b)}"
            assert len(_metrics(a)) == 8 and _same_weights(a, b), f"seed {seed}: final weights differ"
        assert _metrics(_folder(R["slurm"], 0)) != _metrics(_folder(R["slurm"], 1)), "the seeds trained alike"

    def run_info_records_the_slurm_launch():
        arrays, tasks = set(), set()
        for seed in (0, 1):
            rec = _info(_folder(R["slurm"], seed))["distributed"]
            assert (rec["launcher"], rec["world_size"], rec["ranks_per_node"]) == ("slurm", WORLD, WORLD), rec
            assert isinstance(rec["slurm"]["job_id"], int), rec
            arrays.add(rec["slurm"]["array_job_id"])
            tasks.add(rec["slurm"]["array_task_id"])
        assert len(arrays) == 1 and None not in arrays and tasks == {0, 1}, (arrays, tasks)
        rec = _info(_folder(R["torchrun"], 0))["distributed"]
        assert (rec["launcher"], rec["world_size"], rec["slurm"]) == ("torchrun", WORLD, None), rec

    def sacct_fallback_says_so_once():
        lines = [line for line in log_sweep.splitlines() if "sacct" in line.lower()]
        assert len(lines) <= 1, "\n".join(lines[:6])
        assert "accounting storage is disabled" not in log_sweep.replace(lines[0] if lines else "", ""), lines

    def killed_job_fails_the_sweep_and_the_rerun_resumes():
        assert kill_note.startswith("kill"), kill_note
        assert rc_killed != 0, f"the sweep with a killed job exited 0: {log_killed[-1500:]}"
        _one_error_line_per_failed_job(log_killed, work / "sweeps" / "killed", "ended without a result")
        assert rc_rerun == 0, f"rerun exit {rc_rerun}: {log_rerun[-2000:]}"
        folder = _folder(R["killed"], 0)
        starts = [h["status"] for h in _info(folder)["history"]]
        assert starts == ["new", "resume"], starts
        logs = "".join(p.read_text(errors="replace") for p in (work / "sweeps" / "killed_rerun").rglob("*_log.*"))
        assert f"at step {RESUME_AT}" in logs, "the rerun did not resume from the step-4 checkpoint"
        assert _metrics(folder) == _metrics(_folder(R["slurm"], 0)), "losses differ from the uninterrupted run"
        assert _same_weights(folder, _folder(R["slurm"], 0)), "final weights differ from the uninterrupted run"

    def requeued_once_as_the_same_job(sweep: str) -> tuple[Path, str]:
        """The run folder of sweep `sweep`, started new then resumed, both times as one SLURM job (restart
        count 0, then 1); and its jobs' logs."""
        folder = _folder(R[sweep], 0)
        history = _info(folder)["history"]
        assert [h["status"] for h in history] == ["new", "resume"], [h["status"] for h in history]
        restarts = [h["distributed"]["slurm"]["restart_count"] for h in history]
        jobs = {h["distributed"]["slurm"]["job_id"] for h in history}
        assert restarts == [0, 1] and len(jobs) == 1, f"not requeued as the same job: {history}"
        return folder, "".join(p.read_text(errors="replace") for p in (work / "sweeps" / sweep).rglob("*_log.*"))

    def preempted_job_is_requeued_and_resumes():
        assert usr2_note.startswith("scancel"), usr2_note
        assert rc_preempted == 0, f"exit {rc_preempted}: {log_preempted[-2000:]}"
        folder, logs = requeued_once_as_the_same_job("preempted")
        for words in (f"SIGUSR2: checkpointed at step {SIGNAL_AT}", "this job is timed-out",
                      "Calling checkpoint method", "(0 remaining timeouts)",
                      f"step_{SIGNAL_AT:07d} at step {SIGNAL_AT}"):
            assert words in logs, f"{words!r} not in the job's logs"
        assert f"at step {RESUME_AT}" not in logs, "resumed from the periodic checkpoint, not the signal's"
        assert _metrics(folder) == _metrics(_folder(R["slurm"], 0)), "losses differ from the uninterrupted run"
        assert _same_weights(folder, _folder(R["slurm"], 0)), "final weights differ from the uninterrupted run"

    def requeued_job_checkpoints_on_sigterm_and_resumes():
        assert requeue_note.startswith("scontrol"), requeue_note
        assert rc_requeued == 0, f"exit {rc_requeued}: {log_requeued[-2000:]}"
        folder, logs = requeued_once_as_the_same_job("requeued")
        # KillWait (30 s here) is ample for the tiny model's checkpoint: the signal's step, not the periodic one
        for words in (f"SIGTERM: checkpointed at step {SIGNAL_AT}", f"step_{SIGNAL_AT:07d} at step {SIGNAL_AT}"):
            assert words in logs, f"{words!r} not in the job's logs"
        assert _metrics(folder) == _metrics(_folder(R["slurm"], 0)), "losses differ from the uninterrupted run"
        assert _same_weights(folder, _folder(R["slurm"], 0)), "final weights differ from the uninterrupted run"

    def invalid_point_fails_alone():
        assert rc_bad != 0, f"the sweep exited 0: {log_bad[-1500:]}"
        jobs = _job_ids(work / "sweeps" / "invalid")
        assert len(jobs) == 2, jobs
        errs = {}
        for job in jobs:
            text = "".join(p.read_text(errors="replace")
                           for p in (work / "sweeps" / "invalid" / ".submitit" / job).glob(f"{job}_0_log.*"))
            errs[job] = [line for line in text.splitlines() if line.startswith("error:")]
        good, bad = errs[jobs[0]], errs[jobs[1]]
        assert not good, good
        assert len(bad) == 1 and "results_root" in bad[0], bad
        _one_error_line_per_failed_job(log_bad, work / "sweeps" / "invalid", "results_root")
        logs = "".join(p.read_text(errors="replace")
                       for p in (work / "sweeps" / "invalid" / ".submitit" / jobs[0]).glob("*_log.*"))
        assert "is finished: skipping training" in logs, "the valid point did not run"
        assert (_folder(R["slurm"], 1) / "DONE").exists()

    def eval_on_2_ranks_equals_one_process():
        assert rc_eval == 0, f"exit {rc_eval}: {log_eval[-2000:]}"
        assert rc_one == 0, f"exit {rc_one}: {log_one[-2000:]}"
        for mode in ("bf16", "hif8"):
            a = json.loads((_folder(R["slurm"], 0) / "eval" / mode / "results.json").read_text())
            b = json.loads((_folder(R["eval_one"], 0) / "eval" / mode / "results.json").read_text())
            assert a["_meta"]["ranks"] == WORLD and b["_meta"].get("ranks", 1) == 1, (a["_meta"], b["_meta"])
            tasks = sorted(t for t in a if not t.startswith("_"))
            assert tasks and tasks == sorted(t for t in b if not t.startswith("_")), (tasks, list(b))
            for task in tasks:
                assert a[task] == b[task], f"{mode} {task}: {a[task]} vs {b[task]}"

    for fn in (sweep_finishes_both_runs, sweep_equals_torchrun_bit_for_bit, run_info_records_the_slurm_launch,
               sacct_fallback_says_so_once, killed_job_fails_the_sweep_and_the_rerun_resumes,
               preempted_job_is_requeued_and_resumes, requeued_job_checkpoints_on_sigterm_and_resumes,
               invalid_point_fails_alone, eval_on_2_ranks_equals_one_process):
        run_check(checks, fn)
    return checks


def main(argv: list[str] | None = None) -> int:
    """``python -m hif8qat.rehearse.slurm [--work DIR] [--repo DIR]``: the cluster up, the rehearsal, the cluster down.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        The exit status: 0 when every check passed."""
    parsed = parse_work_args("python -m hif8qat.rehearse.slurm", __doc__.split("\n")[0], "hif8qat-slurm-", argv)
    if isinstance(parsed, int):
        return parsed
    args, work = parsed
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"SLURM rehearsal in {work} (repo {args.repo})", flush=True)
    cluster = LocalCluster(work / "cluster")
    try:
        cluster.start()
    except ClusterUnavailable as err:
        reason = f"the local SLURM cluster cannot start here: {err}"
        print(f"skipped: {reason}", flush=True)
        (work / "checks.json").write_text(json.dumps({"skipped": reason, "wall_s": time.time() - t0}) + "\n")
        return 0
    try:
        checks = rehearse(work, Path(args.repo).resolve())
    finally:
        cluster.stop()
    return finish(checks, work, t0, keep=bool(args.work))


if __name__ == "__main__":
    raise SystemExit(main())
