"""``python run.py --estimate``: how long a target's unfinished runs will take here, answered with only the modules
that the time estimate needs (the runs' configs, the trainer's step, the model's loader), not the evaluator, the
report or the launch checks that a run's own job loads (:mod:`hif8qat.cli.main`)."""

from __future__ import annotations

from hif8qat.boundary import guarded
from hif8qat.cli.hydra_config import config_for
from hif8qat.cli.startup_timer import StartupTimer
from hif8qat.launch.time_estimate import main as estimate_main
from hif8qat.runs.host_allocator import keep_freed_memory


def estimate(argv: list[str], timer: StartupTimer) -> int:
    """``python run.py --estimate ...`` (make all & co.): how long their unfinished runs will take here.

    Args:
        argv: the arguments after ``--estimate``.
        timer: the run start-up's timer, started by run.py before this module's imports.

    Returns:
        The exit status."""
    # the steps it times run with the allocator the runs will have (a bad switch: one error line, as a run's)
    try:
        return guarded(keep_freed_memory) or estimate_main(argv, config_for, run_startup=timer.seconds)
    finally:
        timer.stop()
