"""Stop signals: the handler only flags, the trainer checkpoints the step the signal came in and stops, every
rank agrees even when one got the signal, and resuming from that checkpoint is exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hif8qat.train import checkpoint as ckpt
from hif8qat.train.preemption import StopSignals, watched_signals

ROOT = Path(__file__).resolve().parents[2]
# checkpoint_every=4: the periodic checkpoint before the pause at step 5 is step 4; the signal's is step 6
SMOKE = ["experiment=exp8", "profile=smoke", "stage=train", "logger.progress_bar=false", "train.num_threads=1",
         "train.checkpoint_every=4"]
PAUSE_AT = 5
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.fixture
def previous_handlers():
    """Python handlers for the watched signals that record their calls (restored afterwards)."""
    calls: list[int] = []
    saved = {s: signal.getsignal(s) for s in watched_signals()}
    for s in saved:
        signal.signal(s, lambda signum, frame: calls.append(signum))
    yield calls
    for s, h in saved.items():
        signal.signal(s, h)


def test_the_handler_only_flags_and_the_previous_handlers_come_back(previous_handlers):
    before = {s: signal.getsignal(s) for s in watched_signals()}
    with pytest.raises(RuntimeError):
        with StopSignals() as stop:
            assert not stop.pending()
            signal.raise_signal(signal.SIGTERM)
            assert stop.pending() and stop.flags() == [0.0, 1.0, 0.0]  # USR2, TERM, INT
            assert previous_handlers == []  # not passed on while the loop runs
            raise RuntimeError("the loop failed")  # an exception: nothing is raised again
    assert {s: signal.getsignal(s) for s in watched_signals()} == before
    assert previous_handlers == []


def test_a_signal_of_the_last_step_goes_to_the_previous_handler_when_the_loop_ends(previous_handlers):
    with StopSignals():
        signal.raise_signal(signal.SIGUSR2)
        assert previous_handlers == []
    assert previous_handlers == [signal.SIGUSR2]


def test_only_the_summed_flags_decide_and_chain_calls_the_preemption_handler_first(previous_handlers):
    with StopSignals() as stop:
        assert stop.agreed([0.0, 0.0]) == []
        signal.raise_signal(signal.SIGUSR2)  # came after the all-reduce: the next step's business
        assert stop.agreed([0.0, 1.0]) == [signal.SIGTERM]
        stop.chain(stop.agreed([0.0, 1.0]))  # this rank's own USR2 is passed on too, before TERM
        assert previous_handlers == [signal.SIGUSR2, signal.SIGTERM]
        assert not stop.pending()
    assert previous_handlers == [signal.SIGUSR2, signal.SIGTERM]  # not raised a second time


def test_ctrl_c_is_a_stop_at_the_step_boundary_and_a_second_one_interrupts_at_once():
    with StopSignals() as stop:
        signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt: the step ends and checkpoints
        assert stop.agreed(stop.flags()) == [signal.SIGINT]
        stop.chain([signal.SIGINT])  # Python's own handler is not chained: it would only raise
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_signal_stays_ignored():
    saved = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
            signal.raise_signal(signal.SIGUSR2)
            assert not stop.pending()
    finally:
        signal.signal(signal.SIGUSR2, saved)


def test_the_preemption_signal_follows_submitit(monkeypatch):
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert watched_signals() == [signal.SIGUSR1, signal.SIGTERM]


# ------------------------------------------------------------------------------------------------------------
# the trainer, in a subprocess
# ------------------------------------------------------------------------------------------------------------
def _start(args: list[str], env_extra: dict | None = None, launcher: list[str] | None = None):
    env = {**os.environ, "PYTHONHASHSEED": "0", "HIF8QAT_COMPILE": "0", **(env_extra or {})}
    # SIGINT as in a terminal (a background shell starts its children with it ignored)
    return subprocess.Popen([*(launcher or [sys.executable]), str(ROOT / "run.py"), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _finish(proc, timeout: float = 300) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def _folder(root: Path) -> Path:
    return root / "smoke" / "exp8" / "seed0"


def _rows(root: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (_folder(root) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def _paused_pids(marker: Path, ranks: int, proc) -> dict[int, int]:
    """{rank: pid} once every rank has paused at step PAUSE_AT."""
    end = time.time() + 240
    while time.time() < end:
        lines = marker.read_text().splitlines() if marker.exists() else []
        if len(lines) == ranks:
            return {int(line.split()[0].split("=")[1]): int(line.split("pid=")[1]) for line in lines}
        assert proc.poll() is None, f"the run ended before pausing: {_finish(proc)[1][-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{marker}: not every rank paused")


def _signalled_then_resumed(root: Path, marker: Path, sig, ranks: int, extra_args=(), release=False) -> str:
    """Run to the pause at step PAUSE_AT, send `sig` to rank `ranks - 1` only, stop; then resume. The
    interrupted run's output."""
    launcher = TORCHRUN if ranks > 1 else None
    args = [*SMOKE, *extra_args, f"results_root={root}"]
    proc = _start(args, {"HIF8QAT_TEST_PAUSE_AT_STEP": str(PAUSE_AT), "HIF8QAT_TEST_PAUSE_FILE": str(marker)},
                  launcher)
    pids = _paused_pids(marker, ranks, proc)
    os.kill(pids[ranks - 1], sig)
    if release:  # the other ranks got nothing: their pause ends when the marker goes, as a real step would
        time.sleep(1)
        marker.unlink()
    rc, out = _finish(proc)
    assert rc != 0, f"the signalled run exited 0:\n{out[-3000:]}"
    names = [p.name for p in ckpt.list_checkpoints(_folder(root) / "checkpoints")]
    # the step the signal came in was checkpointed, not only the periodic step 4
    assert names == ["step_0000004", "step_0000006"], names
    ckpt.verify_checkpoint(_folder(root) / "checkpoints" / "step_0000006")
    rc, resumed = _finish(_start(args, launcher=launcher))
    assert rc == 0, resumed[-3000:]
    assert "checkpoints/step_0000006 at step 6" in resumed, resumed[-3000:]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    rc, out = _finish(_start([*SMOKE, f"results_root={root}"]))
    assert rc == 0, out[-3000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2, signal.SIGINT], ids=["SIGTERM", "SIGUSR2", "SIGINT"])
def test_a_signal_checkpoints_its_step_and_the_resume_is_bit_for_bit(tmp_path, uninterrupted, sig):
    out = _signalled_then_resumed(tmp_path / "runs", tmp_path / "paused", sig, ranks=1)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"stopped by {sig.name}: checkpointed at step 6" in errors[0], out[-3000:]
    assert "resume with the same command" in errors[0]
    assert _rows(tmp_path / "runs") == _rows(uninterrupted)
    exported = [(_folder(r) / "export" / "model.safetensors").read_bytes() for r in (tmp_path / "runs", uninterrupted)]
    assert exported[0] == exported[1]


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_both_at_the_same_step_without_deadlock(tmp_path):
    whole = tmp_path / "whole"
    rc, out = _finish(_start([*SMOKE, f"results_root={whole}"], launcher=TORCHRUN))
    assert rc == 0, out[-3000:]
    # USR2 to rank 1 alone; rank 0 learns of it through the step's all-reduce, both save step 6 and stop
    out = _signalled_then_resumed(tmp_path / "runs", tmp_path / "paused", signal.SIGUSR2, ranks=2, release=True)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stopped by SIGUSR2: checkpointed at step 6" in errors[0], out[-3000:]
    assert _rows(tmp_path / "runs") == _rows(whole)
    assert ((_folder(tmp_path / "runs") / "export" / "model.safetensors").read_bytes()
            == (_folder(whole) / "export" / "model.safetensors").read_bytes())


@pytest.mark.slow
def test_a_stop_signal_stops_an_in_process_sweep_and_the_same_command_resumes_it(tmp_path, uninterrupted):
    """The process was told to stop: the sweep must not start its next point (which SLURM would SIGKILL after
    KillWait, uncheckpointed). The same command then resumes the point from the signal's checkpoint and runs the
    rest."""
    root, marker = tmp_path / "runs", tmp_path / "paused"
    args = ["-m", *SMOKE, "seed=0,1", f"results_root={root}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = _start(args, {"HIF8QAT_TEST_PAUSE_AT_STEP": str(PAUSE_AT), "HIF8QAT_TEST_PAUSE_FILE": str(marker)})
    os.kill(_paused_pids(marker, 1, proc)[0], signal.SIGTERM)
    rc, out = _finish(proc)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "stopped by SIGTERM: checkpointed at step 6" in errors[0], out[-3000:]
    assert not (root / "smoke" / "exp8" / "seed1").exists(), "the sweep went on to its next point"
    assert "sweep summary" not in out
    rc, out = _finish(_start(args))
    assert rc == 0 and "2 point(s): 2 done" in out, out[-3000:]
    assert "checkpoints/step_0000006 at step 6" in out, out[-3000:]
    assert _rows(root) == _rows(uninterrupted)
