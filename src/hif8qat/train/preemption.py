"""Preemption signals, noticed by the trainer at a step boundary so it can checkpoint the step it is at.

A job about to be stopped gets a signal first: SLURM sends ``USR2`` ``signal_delay_s`` before the time limit
(submitit's preemption signal, ``$SUBMITIT_PREEMPT_SIGNAL`` naming another), and ``SIGTERM`` when the job is
requeued (``scontrol requeue``, a preempting partition) or cancelled, ``KillWait`` seconds before ``SIGKILL``.
This module owns :class:`StopSignals`, which records those signals (and Ctrl-C's SIGINT) while the training
loop runs, lets every rank agree on them and chains the handlers they replaced, and how a stopped process ends
(:class:`Preempted` on rank 0, :class:`StopSignalExit` elsewhere). Also here, because they stop a run the same way
from outside: the test hooks that SIGKILL a training process (``HIF8QAT_TEST_KILL_AT_STEP``) or pause it
(``HIF8QAT_TEST_PAUSE_AT_STEP``) at a known step.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from hif8qat.errors import RunError


class Preempted(RunError):
    """A stop signal (SIGTERM, USR2, Ctrl-C's SIGINT) came and no handler before ours took it over: rank 0 checkpointed
    and stopped; its message says where and how to resume."""


class StopSignalExit(SystemExit):
    """A process's exit after the step a stop signal came in was checkpointed: a follower rank's (rank 0 says why),
    or the exit of the handler chained after ours (submitit's, once it has requeued the job). The process was told
    to stop, so a sweep stops with it (:func:`hif8qat.launch.sweep.run_point`) rather than going on to its next
    point, and leaves no outcome: under SLURM the job may be started again, and a result of this attempt would be
    read as the point's end."""


def watched_signals() -> list[signal.Signals]:
    """The signals the trainer checkpoints on, in the order their handlers are chained: the preemption signal
    (submitit's ``$SUBMITIT_PREEMPT_SIGNAL``, default USR2), then SIGTERM.

    Returns:
        The signals.
    """
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    preempt = getattr(signal, f"SIG{name}", signal.SIGUSR2)
    return [preempt] if preempt == signal.SIGTERM else [preempt, signal.SIGTERM]


class StopSignals:
    """While entered: the watched signals only set a flag; on leaving, the previous handlers are back.

    A signal still pending when the loop ends normally (it came during the last step) is raised again once the
    previous handlers are back, so it does what it did before this class existed (submitit's requeue, the
    default termination) instead of being lost. Outside the main thread (signals cannot be handled there)
    it watches nothing.

    The handler only records which signal came (no I/O, no lock: a handler can interrupt anything, the step's
    own I/O included). The trainer sends the record with the step's loss all-reduce (:meth:`flags`), so every
    rank learns at the same step that some rank was signalled, even a rank that never got the signal, and no
    rank waits at a collective the others skip. After saving the checkpoint every rank calls :meth:`chain`:
    the handlers that were installed before, in the order the signals mean it (the preemption signal's first:
    submitit's requeues the job on rank 0, checks its ``max_num_timeout`` and exits; its ``SIGTERM`` handler
    only logs), as if each rank had got the signal itself. A handler that was the default (outside submitit:
    terminate) is not called: the trainer stops with a message saying where it checkpointed. A signal whose
    handler was ``SIG_IGN`` stays ignored.
    """

    def __init__(self):
        # Ctrl-C too, last: the user's own stop checkpoints the step as a preemption does; a second Ctrl-C
        # before the step ends interrupts at once (KeyboardInterrupt, as without this class).
        self.signals = [*watched_signals(), signal.SIGINT]
        self.received = {s: False for s in self.signals}
        self._previous: dict[signal.Signals, object] = {}

    def _note(self, signum, frame) -> None:  # the handler: a flag, nothing else
        sig = signal.Signals(signum)
        if sig == signal.SIGINT and self.received[sig]:
            self.received[sig] = False  # delivered now, not again when the loop ends
            raise KeyboardInterrupt
        self.received[sig] = True

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:  # ignored on purpose (nohup, a parent's choice): left so
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._note)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if exc_type is None:
            for sig in self.signals:
                if self.received[sig]:
                    self.received[sig] = False
                    signal.raise_signal(sig)

    def pending(self) -> bool:
        """Whether this rank got a watched signal.

        Returns:
            True when one came.
        """
        return any(self.received.values())

    def flags(self) -> list[float]:
        """This rank's record, one number per watched signal, to be summed over the ranks.

        Returns:
            1.0 for each signal received, else 0.0.
        """
        return [1.0 if self.received[s] else 0.0 for s in self.signals]

    def agreed(self, summed: list[float]) -> list[signal.Signals]:
        """The signals some rank got by the all-reduce that summed these flags. Only the summed flags decide:
        a signal this rank got since then is the next step's business, or every rank would not stop alike.

        Args:
            summed: the flags summed over the ranks.

        Returns:
            The signals to stop for.
        """
        return [s for s, n in zip(self.signals, summed) if n > 0]

    def chain(self, signals: list[signal.Signals]) -> None:
        """Call the handlers installed before ours for `signals` and any this rank got since they were agreed
        (submitit's USR2 just after its SIGTERM), in order, as if this process had got them. submitit's
        preemption handler exits the process (SystemExit) on rank 0 after requeuing the job, or raises its
        UncompletedJobError when it will not requeue; handlers that return let the caller stop.

        Args:
            signals: the agreed signals.
        """
        for sig in self.signals:
            previous = self._previous.get(sig)
            if previous is signal.default_int_handler:  # Python's Ctrl-C handler would only raise KeyboardInterrupt
                self.received[sig] = False
                continue
            if (sig in signals or self.received[sig]) and callable(previous):
                self.received[sig] = False
                previous(int(sig), None)

    def names(self, signals: list[signal.Signals]) -> str:
        """The signals' names for a message (``"USR2 and SIGTERM"``).

        Args:
            signals: the signals.

        Returns:
            The text.
        """
        return " and ".join(s.name for s in signals)


# Test hooks: SIGKILL the process, or pause it, at the start of the given step (crash/resume tests, rehearsals).
_KILL_AT_STEP_ENV = "HIF8QAT_TEST_KILL_AT_STEP"
_PAUSE_AT_STEP_ENV, _PAUSE_FILE_ENV = "HIF8QAT_TEST_PAUSE_AT_STEP", "HIF8QAT_TEST_PAUSE_FILE"


class _KilledStream:
    """The training stream, SIGKILLing the process when step `kill_at` asks for its first batch.

    For crash/resume tests only (HIF8QAT_TEST_KILL_AT_STEP): a real kill, with nothing flushed or saved,
    kept out of the training loop by wrapping the one thing every step reads first."""

    def __init__(self, stream, batches_before_kill: int):
        self._stream, self._left = stream, batches_before_kill

    def __next__(self):
        if self._left == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        self._left -= 1
        return next(self._stream)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class _PausedStream(_KilledStream):
    """The training stream, stopping when step `pause_at` asks for its first batch, after adding a line (rank,
    job, pid) to `marker`, until a stop signal comes (`stop`: the step then ends with a checkpoint), `marker` is
    removed, or 600 s have passed. Every rank of a run that started without `marker` pauses (a rank blocked in
    a collective instead could not run a signal handler); a rerun that finds it does not.

    For tests and the SLURM rehearsal only (HIF8QAT_TEST_PAUSE_AT_STEP, HIF8QAT_TEST_PAUSE_FILE): a job caught
    mid-run at a known step, to requeue, signal or kill it there."""

    def __init__(self, stream, batches_before_pause: int, marker: Path, stop: StopSignals):
        super().__init__(stream, batches_before_pause)
        self._marker, self._stop = marker, stop

    def __next__(self):
        if self._left == 0:
            with self._marker.open("a") as f:
                f.write(f"rank={os.environ.get('RANK', '0')} job={os.environ.get('SLURM_JOB_ID', '')} "
                        f"pid={os.getpid()}\n")
            end = time.monotonic() + 600
            while not self._stop.pending() and self._marker.exists() and time.monotonic() < end:
                time.sleep(0.1)  # short: a signal's handler runs between two sleeps
        self._left -= 1
        return next(self._stream)


def hooked_stream(stream, accum: int, start_step: int, stop: StopSignals):
    """The training stream, or it wrapped to kill or pause the process at a step the environment names.

    Args:
        stream: the training stream.
        accum: micro-batches per step.
        start_step: the step the run starts at.
        stop: the run's signal record (the pause hook waits on it).

    Returns:
        The stream, possibly wrapped.
    """
    kill_at = int(os.environ.get(_KILL_AT_STEP_ENV, "-1"))
    pause_at = int(os.environ.get(_PAUSE_AT_STEP_ENV, "-1"))
    if pause_at >= start_step and os.environ.get(_PAUSE_FILE_ENV) and not Path(os.environ[_PAUSE_FILE_ENV]).exists():
        return _PausedStream(stream, (pause_at - start_step) * accum, Path(os.environ[_PAUSE_FILE_ENV]), stop)
    if kill_at < start_step:
        return stream
    return _KilledStream(stream, (kill_at - start_step) * accum)
