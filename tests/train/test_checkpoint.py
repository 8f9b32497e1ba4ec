"""Checkpoint integrity and recovery: damaged checkpoints are rejected (kept, renamed) in favour of the newest
intact one, re-saving a step survives a kill at every point, torn metrics never block a resume, and
non-finite gradients or weights are never applied or saved."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import assert_same_state
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

from hif8qat.config.run_config import RunConfig, resolve_profile
from hif8qat.errors import RunError
from hif8qat.train import checkpoint as ckpt
from hif8qat.train.guards import _first_nonfinite
from hif8qat.train.log import truncate_metrics
from hif8qat.train.loop import TrainingDiverged, train
from hif8qat.train.provenance import check_provenance, run_provenance

ROOT = Path(__file__).resolve().parents[2]


def _model(seed: int, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                torch.optim.lr_scheduler.LRScheduler]:
    """A model trained ``steps`` steps: AdamW state exists (trainer.pt holds tensors) and the LR has moved (a
    constant LR would hide a scheduler state that was not restored)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    for _ in range(steps):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _save(root: Path, step: int, seed: int, keep: int = 5) -> Path:
    model, optimizer, scheduler = _model(seed)
    return ckpt.save_checkpoint(root, step, model=model, optimizer=optimizer, scheduler=scheduler,
                                rank_state={"seed": seed}, keep=keep)


def _loaded_seed(path: Path) -> int:
    """The seed of the model a checkpoint holds, after checking that weights, optimizer and scheduler state all
    loaded bit for bit (into a model that has not trained: nothing of its own state can pass for the saved one)."""
    model, optimizer, scheduler = _model(99, steps=0)
    step, rank_state = ckpt.load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert step == ckpt.checkpoint_step(path)
    reference, ref_optimizer, ref_scheduler = _model(rank_state["seed"])
    assert_same_state(model.state_dict(), reference.state_dict(), "model")
    assert_same_state(optimizer.state_dict(), ref_optimizer.state_dict(), "optimizer")
    assert_same_state(scheduler.state_dict(), ref_scheduler.state_dict(), "scheduler")
    assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"] == 1e-2 * 0.5 ** 2
    return rank_state["seed"]


def test_pruning_keeps_the_newest_and_quarantined_folders(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _save(root, step, seed=step)
    ckpt.prune_checkpoints(root, 1)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000006"]
    assert _loaded_seed(ckpt.checkpoint_path(root, 6)) == 6
    ckpt.prune_checkpoints(root, 0)
    assert not root.exists()  # nothing left: the folder goes too
    _save(root, 2, seed=2)
    kept = ckpt.quarantine(_save(root, 4, seed=4))
    ckpt.prune_checkpoints(root, 0)
    assert sorted(p.name for p in root.iterdir()) == [kept.name]


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flip_mantissa_bits(file: Path) -> None:
    """Flip the lowest mantissa bit of every weight in place: same size, still a valid safetensors file."""
    tensors = load_file(file)
    data = bytearray(file.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for offset in range(header, len(data), 4):
        data[offset] ^= 1
    file.write_bytes(bytes(data))
    assert load_file(file).keys() == tensors.keys()  # still loads: only a checksum can tell


DAMAGE = {
    "truncated model.safetensors": lambda p: _truncate(p / "model.safetensors"),
    "truncated trainer.pt": lambda p: _truncate(p / "trainer.pt"),
    "truncated rank000.pt": lambda p: _truncate(p / "rank000.pt"),
    "missing model.safetensors": lambda p: (p / "model.safetensors").unlink(),
    "flipped mantissa bits": lambda p: _flip_mantissa_bits(p / "model.safetensors"),
    "garbled manifest": lambda p: (p / ckpt.COMPLETE_MARKER).write_text("{not json"),
    "no COMPLETE marker": lambda p: (p / ckpt.COMPLETE_MARKER).unlink(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one_and_is_kept(tmp_path, damage, capsys):
    root = tmp_path / "checkpoints"
    _save(root, 2, seed=2)
    latest = _save(root, 4, seed=4)
    DAMAGE[damage](latest)
    with pytest.raises(ckpt.CheckpointError, match="step_0000004"):
        ckpt.verify_checkpoint(latest)

    chosen = ckpt.select_checkpoint(root)

    assert chosen == ckpt.checkpoint_path(root, 2) and _loaded_seed(chosen) == 2
    kept = [p.name for p in root.iterdir() if p.name.startswith("step_0000004.corrupt-")]
    assert len(kept) == 1 and not latest.exists()  # renamed for inspection, never deleted
    out = capsys.readouterr().out
    assert "checkpoint rejected" in out and "step_0000004" in out and "resuming from the newest intact" in out
    assert ckpt.latest_checkpoint(root) == chosen  # what the other ranks pick up after rank 0's selection


def test_intact_checkpoints_verify_and_load_bit_for_bit(tmp_path):
    path = _save(tmp_path, 3, seed=3)
    ckpt.verify_checkpoint(path)
    manifest = json.loads((path / ckpt.COMPLETE_MARKER).read_text())
    assert set(manifest["files"]) == {"model.safetensors", "trainer.pt", "rank000.pt"} and manifest["step"] == 3
    assert ckpt.select_checkpoint(tmp_path) == path and _loaded_seed(path) == 3


def test_no_intact_checkpoint_is_a_clear_error_now_and_on_every_rerun(tmp_path):
    root = tmp_path / "checkpoints"
    _truncate(_save(root, 2, seed=2) / "model.safetensors")
    for _ in range(2):  # the second call sees only the renamed copy: still refuses to start over silently
        with pytest.raises(RunError, match=r"no intact checkpoint in .*force=true"):
            ckpt.select_checkpoint(root)
    assert ckpt.select_checkpoint(tmp_path / "never_written") is None


def test_the_former_one_line_marker_is_refused_not_loaded_unhashed(tmp_path):
    """A flipped bit under the former marker (the step alone, no hashes) would load unnoticed: refused."""
    root = tmp_path / "checkpoints"
    good, legacy = _save(root, 2, seed=2), _save(root, 4, seed=4)
    _flip_mantissa_bits(legacy / "model.safetensors")
    (legacy / ckpt.COMPLETE_MARKER).write_text("4")
    with pytest.raises(ckpt.CheckpointError, match="former one-line form.*cannot be verified"):
        ckpt.verify_checkpoint(legacy)
    assert ckpt.select_checkpoint(root) == good  # auto resume takes the verified one before it


def test_a_checkpoint_from_another_model_fails_with_a_checkpoint_error(tmp_path):
    path = _save(tmp_path, 1, seed=1)
    other = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(other.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with pytest.raises(ckpt.CheckpointError, match="cannot load checkpoint .*step_0000001"):
        ckpt.load_checkpoint(path, model=other, optimizer=optimizer, scheduler=scheduler)


class _Kill(Exception):
    """Stands for SIGKILL: nothing after it runs, on-disk state stays as it is."""


def _interrupt_at(monkeypatch, k: int, partial: bool) -> list[str]:
    """Make the k-th rename/delete inside train/checkpoint.py raise; `partial` deletes one file first, as a kill
    in the middle of rmtree would."""
    calls: list[str] = []
    real_rename, real_remove = ckpt._rename, ckpt._remove_tree

    def rename(src, dst):
        calls.append(f"rename {Path(src).name} -> {Path(dst).name}")
        if len(calls) == k:
            raise _Kill
        real_rename(src, dst)

    def remove(path):
        calls.append(f"remove {Path(path).name}")
        if len(calls) == k:
            if partial and (Path(path) / "model.safetensors").exists():
                (Path(path) / "model.safetensors").unlink()
            raise _Kill
        real_remove(path)

    monkeypatch.setattr(ckpt, "_rename", rename)
    monkeypatch.setattr(ckpt, "_remove_tree", remove)
    return calls


@pytest.mark.parametrize("partial", [False, True], ids=["between-steps", "mid-delete"])
def test_resaving_a_step_survives_a_kill_at_every_point(tmp_path, monkeypatch, partial):
    k, points = 1, []
    while True:
        root = tmp_path / f"k{k}" / "checkpoints"
        _save(root, 2, seed=2)
        _save(root, 4, seed=40)  # the copy of step 4 being replaced
        calls = _interrupt_at(monkeypatch, k, partial)
        try:
            _save(root, 4, seed=41, keep=1)  # re-save step 4, then prune step 2
            finished = True
        except _Kill:
            finished = False
        monkeypatch.undo()
        points.append(calls[-1])
        # What the next run does: recover, verify, resume.
        chosen = ckpt.select_checkpoint(root, log=lambda _: None)
        assert chosen == ckpt.checkpoint_path(root, 4), f"killed at {calls[-1]!r}"
        # the new copy is what resumes once it was complete and the old one moved aside: a kill before that
        # move leaves the old copy in place
        moving_old_aside = not finished and calls[-1].endswith("-> step_0000004.old")
        assert _loaded_seed(chosen) == (40 if moving_old_aside else 41), f"killed at {calls[-1]!r}"
        leftovers = sorted(p.name for p in root.iterdir() if not ckpt.checkpoint_step(p))
        assert leftovers == [], f"killed at {calls[-1]!r}: {leftovers}"
        if finished:
            break
        k += 1
    # The swap (move old aside, move new in, delete old) and the pruning were each interrupted.
    assert any("-> step_0000004.old" in c for c in points) and any("step_0000004.tmp -> step_0000004" in c
                                                                   for c in points)
    assert any(c.startswith("remove step_0000004.old") for c in points)
    assert any(c.startswith("remove step_0000002.trash") for c in points)


def test_an_unpublished_write_is_discarded_and_the_previous_copy_kept(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _save(root, 4, seed=40)

    def killed_mid_write(*args, **kwargs):
        raise _Kill

    monkeypatch.setattr(ckpt, "_write_manifest", killed_mid_write)
    with pytest.raises(_Kill):
        _save(root, 4, seed=41)
    monkeypatch.undo()
    assert (root / "step_0000004.tmp").exists()
    assert _loaded_seed(ckpt.select_checkpoint(root, log=lambda _: None)) == 40
    assert not (root / "step_0000004.tmp").exists()


def test_a_torn_last_metrics_line_is_dropped_with_a_note_and_a_malformed_middle_one_refused(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / (s + 1)}) for s in range(6)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 6, "lo')  # a crash tore the last line
    truncate_metrics(path, from_step=4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    out = capsys.readouterr().out
    assert "2 line(s) of steps 4..5" in out and "1 unparsable line(s) (line 7)" in out
    lines.insert(2, "garbage")  # no killed writer leaves this: the log was edited or damaged
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RunError, match=r"metrics.jsonl is unreadable \(line 3 does not parse"):
        truncate_metrics(path, from_step=4)


def test_first_nonfinite_names_the_weight_or_optimizer_state():
    from hif8qat.train.loop import DistContext

    model, optimizer, _ = _model(0)
    assert _first_nonfinite(model, optimizer, DistContext()) is None
    next(iter(optimizer.state.values()))["exp_avg_sq"][0] = float("nan")
    assert _first_nonfinite(model, optimizer, DistContext()) == "0.weight (optimizer exp_avg_sq)"
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    assert _first_nonfinite(model, optimizer, DistContext()) == "0.weight (optimizer exp_avg_sq)"
    optimizer.state.clear()
    assert _first_nonfinite(model, optimizer, DistContext()) == "1.bias"


# In-process runs of the smoke profile's exp1 (a tiny model, a few seconds each).
def _smoke(tmp_path: Path, *overrides: str, experiment: str = "exp1") -> RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="config", overrides=[f"experiment={experiment}", "profile=smoke", "stage=train",
                                                            "logger.progress_bar=false", "train.num_threads=1",
                                                            f"results_root={tmp_path}", *overrides])
    return resolve_profile(RunConfig.from_dict(OmegaConf.to_container(composed, resolve=True), check_paths=False))


def _run_dir(tmp_path: Path) -> Path:
    (tmp_path / "run").mkdir()
    return tmp_path / "run"


def _all_finite(folder: Path) -> bool:
    tensors = list(load_file(folder / "model.safetensors").values())
    trainer = torch.load(folder / "trainer.pt", weights_only=True)
    tensors += [v for s in trainer["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def test_nonfinite_gradients_are_skipped_then_stop_the_run_without_saving_bad_weights(tmp_path, capsys):
    """lr=1e6 gives a finite loss with a NaN gradient norm (step 3 on this model): that update is never applied."""
    run_dir = _run_dir(tmp_path)
    with pytest.raises(TrainingDiverged) as err:
        train(_smoke(tmp_path, "train.lr=1e6"), run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if not math.isfinite(r["grad_norm"])]
    assert skipped and all(math.isfinite(r["loss"]) for r in records)
    assert [r["skipped_steps"] for r in records if r["step"] in skipped] == list(range(1, len(skipped) + 1))
    assert "optimizer step skipped" in capsys.readouterr().out
    message = str(err.value)
    assert "gradient norm non-finite for 4 consecutive steps" in message
    saved = ckpt.list_checkpoints(run_dir / "checkpoints")
    assert saved and all(_all_finite(p) for p in saved)
    # The message names the checkpoint that really exists, with its step.
    assert f"newest checkpoint is {saved[-1]} (step {ckpt.checkpoint_step(saved[-1])}" in message
    assert (run_dir / "FAILED").exists()


def test_divergence_before_any_checkpoint_says_none_exists(tmp_path):
    with pytest.raises(TrainingDiverged, match="no checkpoint was written before it") as err:
        train(_smoke(tmp_path, "train.lr=1e6", "train.checkpoint_every=100", "train.max_consecutive_skips=0"),
              _run_dir(tmp_path))
    assert "gradient norm non-finite for 1 consecutive steps" in str(err.value)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not ckpt.list_checkpoints(checkpoints)


def test_weights_that_became_nonfinite_are_never_checkpointed(tmp_path, monkeypatch):
    """A finite gradient can still give inf weights (an overflowing update): the save refuses them."""
    real_step = torch.optim.AdamW.step
    calls = []

    def step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 6:  # the update of step 5 overflows; step 6's checkpoint must not be written
            with torch.no_grad():
                self.param_groups[0]["params"][0][0, 0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    run_dir = _run_dir(tmp_path)
    with pytest.raises(TrainingDiverged, match="became non-finite by step 6; it was not checkpointed") as err:
        train(_smoke(tmp_path, "train.checkpoint_every=3"), run_dir)
    saved = ckpt.list_checkpoints(run_dir / "checkpoints")
    assert [ckpt.checkpoint_step(p) for p in saved] == [3] and _all_finite(saved[0])
    assert f"newest checkpoint is {saved[0]} (step 3" in str(err.value)


def test_an_explicitly_named_damaged_checkpoint_is_refused_not_replaced(tmp_path):
    first = _run_dir(tmp_path)
    train(_smoke(tmp_path), first)
    named = ckpt.checkpoint_path(first / "checkpoints", 4)
    _truncate(named / "trainer.pt")
    second = tmp_path / "second"
    second.mkdir()
    with pytest.raises(ckpt.CheckpointError, match=r"step_0000004: trainer.pt has \d+ bytes"):
        train(_smoke(tmp_path, f"train.resume={named}"), second)
    assert named.exists()  # the user's checkpoint stays where it is


@pytest.mark.parametrize("setting", ["train.max_consecutive_skips", "train.keep_checkpoints_when_done"])
def test_checkpoint_counts_must_be_counts(tmp_path, setting):
    from hif8qat.config.run_config import ConfigError

    with pytest.raises(ConfigError, match=rf"{setting}=-1.*integer >= 0"):
        _smoke(tmp_path, f"{setting}=-1")


def test_checkpoints_save_and_verify_without_hashlib_file_digest(tmp_path, monkeypatch):
    # Python 3.10 (the oldest the project supports) has no hashlib.file_digest.
    import hashlib

    monkeypatch.delattr(hashlib, "file_digest", raising=False)
    path = _save(tmp_path, 3, seed=1)
    ckpt.verify_checkpoint(path)
    manifest = json.loads((path / ckpt.COMPLETE_MARKER).read_text())
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == hashlib.sha256((path / name).read_bytes()).hexdigest()
    assert _loaded_seed(path) == 1


def test_the_rng_state_round_trips_through_a_checkpoint(tmp_path):
    """torch's and Python's generators continue after a load exactly where they were at the save."""
    import random

    torch.manual_seed(123)
    random.seed(123)
    torch.rand(7), random.random()  # somewhere inside both streams, not at a seed
    model, optimizer, scheduler = _model(5)
    path = ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler,
                                rank_state={"rng": ckpt.rng_state()})
    expected = (torch.rand(16), torch.randint(0, 1 << 23, (16,)), random.random())
    torch.manual_seed(0)
    random.seed(0)
    _, rank_state = ckpt.load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    ckpt.set_rng_state(rank_state["rng"])
    got = (torch.rand(16), torch.randint(0, 1 << 23, (16,)), random.random())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]


class _KilledHere(Exception):
    """Stands for the SIGKILL of the kill-at-step test hook, in-process: nothing after it runs."""


def test_stochastic_rounding_resumes_bit_for_bit(tmp_path, monkeypatch):
    """quant.grad_rounding=stochastic draws from torch's generator in every backward: a run killed at step 5 and
    resumed from its step-3 checkpoint gives the uninterrupted run's losses, gradient norms and final state only
    if the generator's state was saved and restored (ta rounding, which never draws, cannot show it)."""
    import os
    import signal

    monkeypatch.setenv("HIF8QAT_COMPILE", "0")  # the eager quantizer: bit-identical, no compile warm-up
    settings = ("experiment=exp3", "quant.grad_rounding=stochastic", "train.checkpoint_every=3")
    whole = _run_dir(tmp_path)
    train(_smoke(tmp_path, *settings), whole)

    crashed = tmp_path / "crashed"
    crashed.mkdir()
    real_kill = os.kill

    def kill(pid, sig):
        if pid == os.getpid() and sig == signal.SIGKILL:
            raise _KilledHere
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setenv("HIF8QAT_TEST_KILL_AT_STEP", "5")
    with pytest.raises(_KilledHere):
        train(_smoke(tmp_path, *settings), crashed)
    monkeypatch.undo()
    monkeypatch.setenv("HIF8QAT_COMPILE", "0")
    assert [p.name for p in ckpt.list_checkpoints(crashed / "checkpoints")] == ["step_0000003"]
    train(_smoke(tmp_path, *settings, "train.resume=auto"), crashed)

    def rows(folder: Path) -> list[tuple]:
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]

    assert [r[0] for r in rows(crashed)] == list(range(8))
    assert rows(crashed) == rows(whole)
    mine, theirs = (f / "checkpoints" / "step_0000008" for f in (crashed, whole))
    assert_same_state(load_file(mine / "model.safetensors"), load_file(theirs / "model.safetensors"), "model")
    for name in ("trainer.pt", "rank000.pt"):
        assert_same_state(torch.load(mine / name, weights_only=True), torch.load(theirs / name, weights_only=True),
                          name)


class _FakeCuda:
    """Per-device generator states of a node with ``count`` visible GPUs; an index past them raises, as
    torch.cuda does."""

    def __init__(self, count: int, current: int):
        self.count, self.current = count, current
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}

    def _check(self, device: int) -> int:
        if not 0 <= device < self.count:
            raise IndexError(f"device {device} of {self.count}")
        return device

    def get_rng_state(self, device: int = 0) -> torch.Tensor:
        return self.states[self._check(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device: int = 0) -> None:
        self.states[self._check(device)] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.count)]

    def set_rng_state_all(self, states) -> None:
        for i, state in enumerate(states):
            self.set_rng_state(state, i)

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


def test_rng_state_resumes_on_a_node_with_fewer_visible_gpus(monkeypatch):
    """Rank 3 of an 8-GPU node saves; the resume runs with one visible GPU per task (SLURM binding): its
    cuda:0 generator continues from what rank 3's own GPU had, and nothing indexes a GPU that is not there."""
    saving = _FakeCuda(count=8, current=3)
    saving.states[3] = torch.arange(16, dtype=torch.uint8) * 7
    saving.install(monkeypatch)
    state = ckpt.rng_state()
    resuming = _FakeCuda(count=1, current=0)
    resuming.install(monkeypatch)
    ckpt.set_rng_state(state)
    assert torch.equal(resuming.states[0], torch.arange(16, dtype=torch.uint8) * 7)


def test_a_checkpoint_of_other_settings_is_refused_naming_them(tmp_path):
    """exp7's checkpoint named by an exp1 run would bring exp7's LR and weights under exp1's name."""
    other = tmp_path / "exp7"
    other.mkdir()
    train(_smoke(tmp_path, "train.lr=1e-5", "train.checkpoint_every=2"), other)
    named = ckpt.list_checkpoints(other / "checkpoints")[0]
    mine = _run_dir(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=r"other settings \(train.lr: checkpoint 1e-05, this run "
                                                   r"0.0001\).*train.resume_allow_mismatch=true"):
        train(_smoke(tmp_path, f"train.resume={named}"), mine)
    assert not (mine / "export").exists()
    train(_smoke(tmp_path, f"train.resume={named}", "train.resume_allow_mismatch=true"), mine)  # deliberately
    assert (mine / "export").exists()


def test_a_bf16_checkpoint_resumed_by_a_quantized_run_is_a_clear_error(tmp_path):
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    train(_smoke(tmp_path, "train.checkpoint_every=2"), bf16)
    named = ckpt.list_checkpoints(bf16 / "checkpoints")[0]
    (tmp_path / "q").mkdir()
    with pytest.raises(ckpt.CheckpointError, match=r"quant.enabled: checkpoint False, this run True"):
        train(_smoke(tmp_path, f"train.resume={named}", experiment="exp8"), tmp_path / "q")
    # Deliberately: the BF16 weights continue under QAT, the scalers starting cold (no KeyError).
    train(_smoke(tmp_path, f"train.resume={named}", "train.resume_allow_mismatch=true", experiment="exp8"),
          tmp_path / "q")
    assert (tmp_path / "q" / "export").exists()


def test_auto_resume_of_a_runs_own_checkpoint_checks_and_keeps_working(tmp_path):
    run_dir = _run_dir(tmp_path)
    train(_smoke(tmp_path, "train.checkpoint_every=2"), run_dir)
    saved = ckpt.list_checkpoints(run_dir / "checkpoints")
    recorded = json.loads((saved[-1] / ckpt.PROVENANCE_FILE).read_text())
    assert recorded["train.lr"] == 1e-4 and recorded["experiment.name"] == "exp1"
    assert ckpt.PROVENANCE_FILE in json.loads((saved[-1] / ckpt.COMPLETE_MARKER).read_text())["files"]
    check_provenance(saved[-1], run_provenance(_smoke(tmp_path)), allow_mismatch=False, explicit=False)
