"""A run process's start-up (the interpreter and the run job's imports), timed for ``run.py --estimate`` in a child
process. It imports the standard library only (torch is loaded already, by the package): run.py starts it before
the estimate's own imports (transformers and the trainer, seconds), so the two import side by side and the child is
done before the estimate's first timed step, which it would otherwise share the cores with."""

from __future__ import annotations

import os
import subprocess
import sys

RUN_MODULE = "hif8qat.cli.main"  # what a run's process imports before its work


class StartupTimer:
    """A child process that imports ``module`` beside the estimate's own imports and single-threaded work (the
    configs, the model's load); it also brings those files into the page cache, as the run's own start will find
    them. Its CPU seconds are taken, not its wall time: beside the estimate it shares the cores, which the run's own
    start will not.

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
