"""``python run.py --estimate``: how long a target's unfinished runs will take here, answered with only the modules
that the time estimate needs (the runs' configs, the trainer's step, the model's loader), not the evaluator, the
report or the launch checks that a run's own job loads (:mod:`hif8qat.cli.main`)."""

from __future__ import annotations

import os
import subprocess
import sys

from hif8qat.boundary import guarded
from hif8qat.cli.hydra_config import config_for
from hif8qat.launch.time_estimate import main as estimate_main
from hif8qat.runs.host_allocator import keep_freed_memory

RUN_MODULE = "hif8qat.cli.main"  # what a run's process imports before its work


class StartupTimer:
    """A run process's start-up (the interpreter and the run job's imports), timed in a child process that imports
    ``module`` while the estimate does its own single-threaded work (the memory simulation, the configs, the model's
    load) and its first quantized step (the quantizer's compile, whose time is not taken at face value); it also
    brings those files into the page cache, as the run's own start will find them. Its CPU seconds are taken, not
    its wall time: beside the estimate it shares the cores, which the run's own start will not.

    Args:
        module: the module a run's process imports before its work."""

    def __init__(self, module: str):
        # run as a script: its body is its imports (a run job's module has no main block)
        self._child = subprocess.Popen([sys.executable, "-m", module], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)

    def seconds(self) -> float | None:
        """Wait for the child.

        Returns:
            Its CPU seconds (user and system), None when it failed."""
        _, status, usage = os.wait4(self._child.pid, 0)
        self._child.returncode = os.waitstatus_to_exitcode(status)
        return usage.ru_utime + usage.ru_stime if self._child.returncode == 0 else None

    def stop(self) -> None:
        """End the child if it still runs (an estimate that did not need it)."""
        if self._child.poll() is None:
            self._child.kill()
            self._child.wait()


def estimate(argv: list[str]) -> int:
    """``python run.py --estimate ...`` (make all & co.): how long their unfinished runs will take here.

    Args:
        argv: the arguments after ``--estimate``.

    Returns:
        The exit status."""
    # the steps it times run with the allocator the runs will have (a bad switch: one error line, as a run's)
    timer = StartupTimer(RUN_MODULE)
    try:
        return guarded(keep_freed_memory) or estimate_main(argv, config_for, run_startup=timer.seconds)
    finally:
        timer.stop()
