"""The SLURM launcher's resources, resolved before anything is submitted, and a quiet job watcher.

:func:`resolve_resources` fills the ``auto`` resources of `hydra/launcher=slurm` from the partition and checks
explicit ones against it, so what cannot be had is one ``error: ...`` line before any job is submitted;
:func:`quiet_sacct` makes submitit's job watcher fall back to ``squeue`` on a cluster without accounting; and
:class:`ReportFailedJobs`, mixed into hydra-submitit-launcher's launchers (hydra_plugins.hif8qat_launcher, the
``_target_`` of conf/hydra/launcher/slurm.yaml and local.yaml), waits for every job of a sweep and reports each
failed one as one ``error:`` line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hif8qat.launch.sweep import BUSY, DONE, FAILED, STATES, finish_sweep, outcome

RESOURCE_KEYS = ("gpus_per_node", "tasks_per_node", "cpus_per_task")
_GPU_CPUS_CAP = 8  # cpus_per_task when derived on a GPU partition: data loading + the CPU side of a rank


class LauncherError(ValueError):
    """The SLURM launcher's settings cannot work on the partition (the message names the setting and fix)."""


def parse_sinfo(text: str) -> dict[str, dict[str, Any]]:
    """Partitions from ``sinfo -h -o '%P|%c|%G'`` output. A partition with several node kinds keeps the smallest CPU
    and GPU counts (what every node has).

    Args:
        text: sinfo's output.

    Returns:
        ``{partition: {"cpus": int, "gpus": int, "default": bool}}``."""
    parts: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        if line.count("|") != 2:
            continue
        name, cpus, gres = (f.strip() for f in line.split("|"))
        default = name.endswith("*")
        name = name.rstrip("*")
        gpus = sum(int(m) for m in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))
        cpus_n = int(re.match(r"\d+", cpus)[0]) if re.match(r"\d+", cpus) else 0
        old = parts.get(name)
        parts[name] = {"cpus": min(cpus_n, old["cpus"]) if old else cpus_n,
                       "gpus": min(gpus, old["gpus"]) if old else gpus,
                       "default": default or bool(old and old["default"])}
    return parts


def read_partitions() -> dict[str, dict[str, Any]]:
    """The cluster's partitions, from sinfo.

    Returns:
        What :func:`parse_sinfo` reads.

    Raises:
        LauncherError: sinfo cannot be run or fails."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P|%c|%G"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LauncherError(f"sinfo could not be run ({err})") from None
    if out.returncode:
        last = (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        raise LauncherError(f"sinfo failed: {last[0][:300]}")
    return parse_sinfo(out.stdout)


def resolve_resources(launcher: Mapping[str, Any], partitions: Mapping[str, dict] | Exception) -> dict[str, Any]:
    """The values of gpus_per_node / tasks_per_node / cpus_per_task to submit with.

    A setting left at ``auto`` is filled from the partition (GPUs in the nodes' gres, CPUs per node), so a CPU
    partition or a 4-GPU node needs no override and no silent default asks for GPUs a partition does not have. An
    explicit setting is kept and checked: ``cpus_per_task`` x ``tasks_per_node`` may not exceed a node's CPUs, nor
    ``gpus_per_node`` its GPUs.

    Args:
        launcher: the launcher config, ``auto`` for a setting left to the partition.
        partitions: parse_sinfo's answer, or the exception that kept it from being read.

    Returns:
        ``{gpus_per_node, tasks_per_node, cpus_per_task}``.

    Raises:
        LauncherError: a resource that cannot be had (it names the setting and the fix)."""
    # "auto" (or a missing key): left to the partition; gpus_per_node=null is an answer (no GPUs), the others'
    # null means the same as auto
    unset = [k for k in RESOURCE_KEYS
             if launcher.get(k, "auto") == "auto" or (k != "gpus_per_node" and launcher.get(k) is None)]
    launcher = {k: (None if k in unset else launcher.get(k)) for k in (*RESOURCE_KEYS, "partition")}
    gpus = launcher["gpus_per_node"]
    name = launcher.get("partition")
    part = None
    if isinstance(partitions, Exception):
        why = str(partitions)
    else:
        chosen = [p for p, v in partitions.items() if (p == name if name else v["default"])]
        part = partitions[chosen[0]] if chosen else None
        why = (f"partition {name!r} is not among the cluster's ({', '.join(sorted(partitions)) or 'none'})" if name
               else "no partition given and the cluster has no default one")
    where = f"partition {name}" if name else "the default partition"
    if part is None and unset:
        fixes = {"gpus_per_node": "hydra.launcher.gpus_per_node=<GPUs per node, null on a CPU partition>",
                 "tasks_per_node": "hydra.launcher.tasks_per_node=<ranks per node>",
                 "cpus_per_task": "hydra.launcher.cpus_per_task=<CPUs per rank>"}
        raise LauncherError(
            f"hydra.launcher: {', '.join(unset)} {'is' if len(unset) == 1 else 'are'} auto (read from the partition) "
            f"but {where} cannot be read ({why}): set "
            f"{' '.join(fixes[k] for k in unset)}, or hydra.launcher.partition=<partition>, or use "
            "hydra/launcher=slurm_cpu on a CPU cluster")
    if part is not None and part["gpus"] == 0 and gpus not in (None, 0) and "gpus_per_node" not in unset:
        raise LauncherError(f"hydra.launcher.gpus_per_node={gpus}, but {where} has no GPUs in its nodes' gres: "
                            "set hydra.launcher.gpus_per_node=null (CPU ranks) or pick a GPU partition with "
                            "hydra.launcher.partition=<partition>")
    if part is not None and gpus and gpus > part["gpus"] > 0:
        raise LauncherError(f"hydra.launcher.gpus_per_node={gpus} is above the {part['gpus']} GPUs of a node in "
                            f"{where}: allowed 1 to {part['gpus']}")
    if "gpus_per_node" in unset:
        gpus = part["gpus"] or None
    tasks = launcher.get("tasks_per_node") or (gpus or 1)  # one rank per GPU
    if not isinstance(tasks, int) or tasks < 1:
        raise LauncherError(f"hydra.launcher.tasks_per_node={tasks!r}: allowed an integer >= 1")
    cpus = launcher.get("cpus_per_task")
    if cpus is None:
        cpus = max(1, part["cpus"] // tasks)
        if gpus:
            cpus = min(cpus, _GPU_CPUS_CAP)
    elif not isinstance(cpus, int) or cpus < 1:
        raise LauncherError(f"hydra.launcher.cpus_per_task={cpus!r}: allowed an integer >= 1")
    if part is not None and cpus * tasks > part["cpus"]:
        raise LauncherError(
            f"hydra.launcher.cpus_per_task={cpus} x tasks_per_node={tasks} is above the {part['cpus']} CPUs of a "
            f"node in {where}: allowed cpus_per_task at most {max(part['cpus'] // tasks, 0)} with {tasks} tasks "
            "per node (the job would never start)")
    return {"gpus_per_node": gpus, "tasks_per_node": tasks, "cpus_per_task": cpus}


def launcher_overrides(launcher: Mapping[str, Any], explicit: set[str]) -> tuple[list[str], str]:
    """Command-line overrides that pin the launcher's resources, and where they came from.

    Args:
        launcher: the composed (resolved) launcher config.
        explicit: resource keys set on the command line.

    Returns:
        ``(overrides, a one-line note)``.

    Raises:
        LauncherError: as :func:`resolve_resources`."""
    partitions: Mapping[str, dict] | Exception
    try:
        partitions = read_partitions()
    except LauncherError as err:
        partitions = err
    values = resolve_resources(launcher, partitions)
    pinned = [f"hydra.launcher.{k}={'null' if v is None else v}" for k, v in values.items() if k not in explicit]
    note = (f"hydra/launcher: partition {launcher.get('partition') or '(default)'}: "
            + ", ".join(f"{k}={'null' if v is None else v}" for k, v in values.items()))
    return pinned, note


# ------------------------------------------------------------------------------------------------------------
# job watching without accounting storage
# ------------------------------------------------------------------------------------------------------------
def gone_as_completed(listed: Mapping[str, Any], pending: set[str]) -> dict[str, dict[str, str]]:
    """A COMPLETED record for each job submitit still waits for that squeue no longer lists (slurmctld forgets
    a finished job after MinJobAge): submitit then reads the job's result file, or reports that it left none,
    instead of waiting for ever.

    Args:
        listed: squeue's records by job id.
        pending: the job ids submitit waits for.

    Returns:
        Job id -> its COMPLETED record."""
    return {job: {"JobID": job, "State": "COMPLETED", "NodeList": ""} for job in sorted(pending - set(listed))}


def quiet_sacct(note=print) -> None:
    """Make submitit's SLURM watcher fall back to squeue, with one note, once sacct fails (on a cluster without
    accounting storage every poll printed an error three times). ``HIF8QAT_SLURM_POLL_S`` caps the time between
    polls (submitit's own cap is 10 minutes). Idempotent.

    Adapter: submitit has no setting for this, so its watcher's update is replaced here, and with it the private
    state the watcher keeps (its jobs, their states, its clock and its poll delay): the one place that touches
    them.

    Args:
        note: where the one note goes."""
    from submitit.core import core
    from submitit.slurm import slurm

    watcher_cls = slurm.SlurmInfoWatcher
    if getattr(watcher_cls, "_hif8qat_quiet", False):
        return
    make_command = watcher_cls._make_command

    def update(self) -> None:
        command = make_command(self)
        if command is None:
            return
        self._num_calls += 1
        if not getattr(self, "_no_sacct", False):
            try:
                output = subprocess.run(command, capture_output=True, check=True).stdout
            except (OSError, subprocess.CalledProcessError) as err:
                self._no_sacct = True
                stderr = getattr(err, "stderr", b"") or b""
                note(f"note: sacct is not available ({stderr.decode(errors='replace').strip() or err}); "
                     "following the jobs with squeue")
            else:
                self._info_dict.update(self.read_info(output))
        if getattr(self, "_no_sacct", False):
            jobs = sorted({j.split("_")[0] for j in self._registered - self._finished})
            out = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i|%T|%N", "-j", ",".join(jobs)],
                                 capture_output=True, text=True)
            # squeue refuses ids it has forgotten ("Invalid job id"): then none is listed; any other failure
            # (controller unreachable) keeps the last states until the next poll
            if out.returncode == 0 or "nvalid job id" in out.stderr:
                listed = self.read_info("JobID|State|NodeList\n" + (out.stdout if out.returncode == 0 else ""))
                self._info_dict.update(listed)
                self._info_dict.update(gone_as_completed(listed, self._registered - self._finished))
        self._last_status_check = core._time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    watcher_cls.update = update
    watcher_cls._hif8qat_quiet = True
    if os.environ.get("HIF8QAT_SLURM_POLL_S"):  # submitit polls ever more slowly (up to 10 min) otherwise
        slurm.SlurmJob.watcher._delay_s = float(os.environ["HIF8QAT_SLURM_POLL_S"])


# ------------------------------------------------------------------------------------------------------------
# a sweep's failed jobs, one error line each
# ------------------------------------------------------------------------------------------------------------
class _Outcome:
    """A submitted job whose results() answers its failure (the exception) instead of raising it."""

    def __init__(self, job):
        self.job = job

    def results(self) -> list:
        from submitit.core.utils import FailedJobError, UncompletedJobError

        try:
            return self.job.results()
        except (UncompletedJobError, FailedJobError) as err:
            return [err]


@contextmanager
def _outcomes():
    """While inside: an executor's map_array hands back _Outcome-wrapped jobs, and the yielded list gets the
    jobs. The plugin's launch submits the sweep and then reads `[job.results()[0] for job in jobs]`, which
    raises at the first failed job while the others still run: this lets it wait for every job, without a
    copy of its submission code."""
    from submitit.core.core import Executor

    plain, submitted = Executor.map_array, []

    def map_array(self, fn, *iterable):
        jobs = plain(self, fn, *iterable)
        submitted.extend(jobs)
        return [_Outcome(job) for job in jobs]

    Executor.map_array = map_array
    try:
        yield submitted
    finally:
        Executor.map_array = plain


def _task_exception(ret):
    """Adapter: the exception a failed sweep task raised, from hydra's ``JobReturn``. Its public ``return_value``
    raises that exception instead of returning it; the value sits in the private ``_return_value``."""
    return ret._return_value


def _job_log(job) -> Path:
    """Task 0's error stream (rank 0 prints the `error:` lines), or its output when stderr goes there."""
    from submitit.core.utils import JobPaths

    paths = JobPaths(job.paths.folder, job_id=job.job_id, task_id=0)
    return paths.stderr if paths.stderr.exists() or not paths.stdout.exists() else paths.stdout


def failure_line(job, overrides: list[str], failure) -> str:
    """One ``error:`` line for a sweep job that failed: the job's own last ``error:`` line, or its state, and its log.

    Args:
        job: the submitit job.
        overrides: its sweep point.
        failure: its exception (submitit's, when it left no result, or the task's own, when the task raised).

    Returns:
        The line."""
    log = _job_log(job)
    said = []
    for path in (log, log.with_suffix(".out")):
        if path.exists():
            said += [line[len("error:"):].strip() for line in path.read_text(errors="replace").splitlines()
                     if line.startswith("error:")]
    if said:
        why = said[-1]
    elif type(failure).__name__ == "UncompletedJobError" and "has not produced any output" in str(failure):
        why = f"it ended without a result (state {job.state})"
    else:
        lines = [line.strip() for line in str(failure).splitlines() if line.strip() and not line.startswith("-")]
        why = lines[-1] if lines else type(failure).__name__
    point = " ".join(o for o in overrides if not o.startswith("hydra"))
    return f"error: sweep job {job.job_id} ({point}) failed: {why}; its log: {log}"


class ReportFailedJobs:
    """Mixed into hydra-submitit-launcher's launchers: launch() waits for every job of the sweep, prints one
    `error:` line per failed job, then the sweep's summary (hif8qat.launch.sweep: the format the in-process
    launcher writes too), and exits with status 1 when a point failed or was busy."""

    def launch(self, job_overrides, initial_job_idx):
        """Launch the sweep's jobs and wait for every one (hydra-submitit-launcher raised the first failure while the
        others still ran); print one ``error:`` line per failed job and the summary.

        Args:
            job_overrides: each job's overrides.
            initial_job_idx: the first job's number.

        Returns:
            The jobs' returns, as the launcher's own launch().

        Raises:
            SystemExit: status 1 when a point failed or was busy."""
        with _outcomes() as jobs:
            returns = super().launch(job_overrides, initial_job_idx)
        lines, points = [], []
        for num, (overrides, job, ret) in enumerate(zip(job_overrides, jobs, returns), start=initial_job_idx):
            failure = ret if isinstance(ret, BaseException) else None
            if failure is None and getattr(ret.status, "name", "") == "FAILED":
                failure = _task_exception(ret)
            if failure is not None:
                lines.append(failure_line(job, list(overrides), failure))
                result = outcome(FAILED, lines[-1])
            else:  # the point's own outcome (run.py's job returns it under -m); a failed one names its log
                value = ret.return_value
                result = value if isinstance(value, dict) and value.get("state") in STATES else outcome(DONE)
                if result["state"] in (FAILED, BUSY):
                    lines.append(failure_line(job, list(overrides), RuntimeError(result["error"])))
                    result = outcome(result["state"], lines[-1])
            points.append((num, list(overrides), result))
        if lines:
            print("\n".join(lines), file=sys.stderr, flush=True)
        finish_sweep(self.config.hydra.sweep.dir, points)
        return returns
