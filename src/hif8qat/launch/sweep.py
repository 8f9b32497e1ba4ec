"""A multirun sweep that finishes every point it can, and says at the end what became of each.

A sweep point runs through :func:`run_point`: whatever stops it (a divergence, a refused setting, a run folder
that another process holds, any exception) is recorded as that point's outcome instead of ending the sweep, so
the points after it still run. A stop signal (Ctrl-C, a preemption's USR2, SIGTERM) is not a point's failure: the
sweep stops there, its point checkpointed (under SLURM the job may run again). The launcher
(``hydra_plugins.hif8qat_launcher``: in-process, submitit-local and SLURM alike) hands every point's outcome to
:func:`finish_sweep`, which prints one summary, writes it to ``<sweep dir>/sweep_summary.txt`` and exits with
status 1 when a point failed or was busy. A rerun of the same command skips the finished points (their run folders
are DONE), runs the missing ones and retries the failed.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from hif8qat.boundary import guarded, user_error
from hif8qat.errors import one_line
from hif8qat.files import write_text
from hif8qat.runs.folders import RunFolderBusy
from hif8qat.train.preemption import Preempted, StopSignalExit

SUMMARY_FILE = "sweep_summary.txt"
# A point's state: trained/evaluated now, found finished (nothing to do), stopped by an error, or its run
# folder held by another live process (another sweep sharing the point).
DONE, SKIPPED, FAILED, BUSY = "done", "already done", "failed", "busy"
STATES = (DONE, SKIPPED, FAILED, BUSY)
FAILURE_STATUS = 1  # a point failed or was busy; 2 stays the status of a refused command line


def outcome(state: str, error: str = "") -> dict[str, str]:
    """A point's outcome as the launcher receives it (a plain dict: submitit pickles it across processes).

    Args:
        state: one of STATES.
        error: the point's ``error:`` line, if any.

    Returns:
        ``{state, error}``."""
    return {"state": state, "error": error}


def run_point(job: Callable[[], str | None], *, stream=None) -> dict[str, str]:
    """Run one sweep point; its outcome, never an exception. A user's error is printed as the one ``error:`` line a
    single run prints; anything else also prints its traceback (a bug to report), then the sweep goes on.

    Args:
        job: the point's work; it returns SKIPPED when it found its work already done.
        stream: where the lines go (default sys.stderr).

    Returns:
        The point's :func:`outcome`.

    Raises:
        SystemExit: status 130 on Ctrl-C, which stops the whole sweep with one ``interrupted`` line; a
            :class:`~hif8qat.train.preemption.StopSignalExit` when a stop signal (SIGTERM, USR2, Ctrl-C) ended the
            point's training at a checkpoint: the process was told to stop, so the sweep stops too, after rank 0's
            ``error:`` line, and no outcome is left for a job that SLURM may start again."""
    stream = stream or sys.stderr
    try:
        return outcome(SKIPPED if job() == SKIPPED else DONE)
    except KeyboardInterrupt:  # the whole sweep stops, with the one line and status of any entry point
        raise SystemExit(guarded(_interrupted, stream=stream)) from None
    except StopSignalExit:  # a follower rank's, or submitit's exit after it requeued the job
        raise
    except Preempted as err:  # rank 0's: it says where it checkpointed and how to resume
        print(f"error: {user_error(err)}", file=stream, flush=True)
        raise StopSignalExit(2) from None
    except SystemExit as err:  # a library or a follower rank that exits: that point only
        if err.code in (0, None):
            return outcome(DONE)
        message = f"the point exited with status {err.code}"
    except Exception as err:  # noqa: BLE001 - isolating every point is the point of this function
        message = user_error(err)
        if message is None:
            traceback.print_exc(file=stream)
            message = f"{type(err).__name__}: {one_line(str(err))} (a bug: its traceback is above)"
        if isinstance(err, RunFolderBusy):
            print(f"error: {message}", file=stream, flush=True)
            return outcome(BUSY, f"error: {message}")
    print(f"error: {message}", file=stream, flush=True)
    return outcome(FAILED, f"error: {message}")


def _interrupted() -> None:
    raise KeyboardInterrupt


def point_label(overrides: Sequence[str]) -> str:
    """The point as its command-line overrides say it (Hydra's own settings left out).

    Args:
        overrides: the point's overrides.

    Returns:
        The overrides joined, or ``(no overrides)``."""
    return " ".join(o for o in overrides if not o.lstrip("+~").startswith("hydra.")) or "(no overrides)"


def summary_text(points: Sequence[tuple[int, Sequence[str], dict[str, str]]]) -> str:
    """The summary of a sweep: a count per state, then one line per point (and its error).

    Args:
        points: (job number, overrides, outcome) per point.

    Returns:
        The text."""
    counts = {state: sum(1 for _, _, o in points if o["state"] == state) for state in STATES}
    head = ", ".join(f"{counts[s]} {s}" for s in STATES)
    lines = [f"sweep summary: {len(points)} point(s): {head}"]
    for num, overrides, result in points:
        line = f"  #{num} {result['state']:<12} {point_label(overrides)}"
        if result.get("error"):
            line += f"\n      {result['error']}"
        lines.append(line)
    if counts[FAILED] or counts[BUSY]:
        lines.append("the same command again skips the finished points, runs the missing ones and retries the "
                     "failed and busy ones")
    return "\n".join(lines) + "\n"


def finish_sweep(sweep_dir: str | Path, points: Sequence[tuple[int, Sequence[str], dict[str, str]]]) -> None:
    """Print the summary and write it beside the sweep's job folders.

    Args:
        sweep_dir: the sweep's folder.
        points: (job number, overrides, outcome) per point.

    Raises:
        SystemExit: status 1 when a point failed or was busy (the shell, make and CI then see that the sweep is not
            complete)."""
    text = summary_text(points)
    path = Path(sweep_dir) / SUMMARY_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text)
        where = f"(also in {path})"
    except OSError as err:
        where = f"(not written to {path}: {err.strerror or err})"
    print(f"{text.rstrip()}\n{where}", file=sys.stderr, flush=True)
    if any(o["state"] in (FAILED, BUSY) for _, _, o in points):
        raise SystemExit(FAILURE_STATUS)
