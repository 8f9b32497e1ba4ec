"""Every failure a user (or the machine) can cause ends in ``error: <message>`` with exit status 2, before any
work where it can be known before: Hydra's own composition failures, results_root, the model's limits, a full
disk, unreadable result files, booleans that are not booleans; and the report says which runs it left out."""

from __future__ import annotations

import errno
import json
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import torch
from test_config import EXPERIMENTS, PROFILES, compose_cfg
from test_reliability import assert_user_error, cli, cli_config
from test_report import make_fake_runs

from hif8qat.cli import command_line
from hif8qat.config.numerics import train_numerics
from hif8qat.config.run_config import ConfigError, RunConfig, setting_keys
from hif8qat.launch import preflight
from hif8qat.launch.memory import step_memory
from hif8qat.train import checkpoint as ckpt


# ------------------------------------------------------------------ Hydra's failures (unknown names, parsing)
@pytest.mark.parametrize("override,needles", [
    ("experiment=exp99", ["experiment='exp99'", "exp1, exp2", "exp8"]),
    ("train.unknown_key=1", ["unknown setting train.unknown_key", "The settings of train:", "seq_len"]),
    ("train.lrr=1e-4", ["unknown setting train.lrr", "did you mean train.lr"]),
    ("quant.interval={0:1", ["cannot parse", "quant.interval={0:1", "no viable alternative"]),
    ("eval.subset.mini_mmlu=3", ["eval.subset is one setting holding a mapping", "eval.subset={mini_mmlu: 3}"]),
])
def test_hydra_composition_failures_are_user_errors(tmp_path, override, needles):
    args = ["stage=train", override] + ([] if override.startswith("experiment=") else ["experiment=exp1"])
    out = cli(args, tmp_path / "runs")
    assert_user_error(out, *needles)
    assert not (tmp_path / "runs").exists()


def test_multirun_lines_are_checked_value_by_value():
    # Each swept value is composed: a bad one anywhere in the sweep is found before the first job starts.
    problem = command_line.check_command_line(["-m", "experiment=exp1,exp99", "seed=0,1"])
    assert problem and "experiment='exp99'" in problem
    problem = command_line.check_command_line(["-m", "experiment=exp6", "quant.history_len=16,32", "train.lrr=1,2"])
    assert problem and "did you mean train.lr" in problem
    assert command_line.check_command_line(["-m", "experiment=exp6", "quant.history_len=16,32", "seed=0,1,2"]) is None
    # Without -m a sweep is ambiguous (Hydra's rule), and says how to sweep.
    assert "--multirun" in command_line.check_command_line(["experiment=exp1", "seed=0,1"])


@pytest.mark.parametrize("line", [
    ["experiment=exp1", "seed=0"], ["-m", "seed=0,1", "--cfg", "hydra", "-p", "hydra.launcher"],
    ["--cfg", "job", "-m", "seed=0,1", "stage=train"], ["-m"], ["--multi", "seed=0,1"],
    ["seed=0", "--resolve", "-c", "all"],
    ["experiment=exp1", "-m", "seed=0,1"], ["--info"], ["-i", "defaults", "seed=1"], ["--info", "experiment=exp1"],
    ["-cn", "other", "seed=1"], ["--config-dir", "/tmp/elsewhere", "seed=1"], ["-cp", "x", "-r", "seed=1"],
    ["--experimental-rerun", "config.pickle"], ["-h"], ["--hydra-help"], ["-sc"], ["--bogus", "seed=1"],
    ["--cfg", "everything"], ["-p"],
])
def test_run_py_reads_a_command_line_as_hydra_does(line):
    # run.py keeps its own copy of Hydra's flags (Hydra's parser is private): a flag Hydra adds or changes
    # shows here, against Hydra's own parser, before a value is taken for an override.
    from hydra._internal.utils import get_args_parser

    try:
        hydra_args = get_args_parser().parse_args(line)
    except SystemExit:
        hydra_args = None
    ours = command_line.hydra_command_line(line)
    assert (ours is None) == (hydra_args is None), (ours, hydra_args)
    if ours is not None:
        assert (ours.overrides, ours.multirun) == (hydra_args.overrides, hydra_args.multirun)
        plain = not any(getattr(hydra_args, k) for k in ("help", "hydra_help", "info", "shell_completion",
                                                          "experimental_rerun", "config_path", "config_name",
                                                          "config_dir"))
        assert ours.plain == plain
        if not plain:  # Hydra answers these itself: run.py composes nothing
            assert command_line.check_command_line(line) is None


# ------------------------------------------------------------------ every setting exists in every profile
def _setting_names() -> set[str]:
    names = set()
    for f in fields(RunConfig):
        default = f.default_factory() if callable(f.default_factory) else None
        keys = setting_keys(type(default)) if is_dataclass(default) else []
        names |= {f"{f.name}.{key}" for key in keys} if keys else {f.name}  # quant's as the YAML writes them
    return names


@pytest.mark.parametrize("profile", PROFILES)
def test_every_setting_exists_under_every_profile_and_experiment(profile):
    from omegaconf import OmegaConf

    for experiment in EXPERIMENTS:
        composed = compose_cfg([f"experiment={experiment}", f"profile={profile}"])
        missing = sorted(n for n in _setting_names() if OmegaConf.select(composed, n, default="<absent>") == "<absent>")
        assert not missing, (experiment, profile, missing)  # each would need a `+` to be set


def test_a_setting_the_smoke_profile_used_to_lack_is_validated_not_refused_by_hydra(tmp_path):
    out = cli(["experiment=exp1", "stage=all", "eval.subset=bogus"], tmp_path / "runs")
    assert_user_error(out, "eval.subset='bogus'", "allowed full")
    assert not (tmp_path / "runs").exists()  # refused before any folder


# ------------------------------------------------------------------ booleans
BOOLEAN_SETTINGS = ["force", "quant.enabled", "quant.saturate", "train.compile", "train.activation_checkpointing",
                    "eval.offline_data", "quirks.double_label_shift", "quirks.bf16_params", "logger.wandb",
                    "logger.progress_bar"]


@pytest.mark.parametrize("setting", BOOLEAN_SETTINGS)
@pytest.mark.parametrize("value", ["maybe", "1"])
def test_boolean_settings_take_a_boolean_only(setting, value):
    with pytest.raises(ConfigError) as err:
        cli_config(["experiment=exp8", "profile=smoke", f"{setting}={value}"])
    assert f"{setting}=" in str(err.value) and "true or false" in str(err.value)
    for text, want in (("false", False), ("true", True)):
        cfg = cli_config(["experiment=exp8", "profile=smoke", f"{setting}={text}"])
        section, _, key = setting.partition(".")
        got = cfg.to_dict()[section][key] if key else getattr(cfg, section)  # as the saved config records it
        assert got is want, (setting, text, got)


def test_trust_remote_code_takes_a_boolean_or_null():
    with pytest.raises(ConfigError, match="model.trust_remote_code.*true, false or null"):
        cli_config(["experiment=exp1", "profile=smoke", "model.trust_remote_code=maybe"])


def test_force_maybe_leaves_a_finished_run_alone(tmp_path):
    run_dir = tmp_path / "runs" / "smoke" / "exp1" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "DONE").write_text("finished\n")
    out = cli(["experiment=exp1", "stage=train", "force=maybe"], tmp_path / "runs")
    assert_user_error(out, "force='maybe'", "true or false")
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["seed0"]  # not archived, not retrained
    assert sorted(p.name for p in run_dir.iterdir()) == ["DONE"]


# ------------------------------------------------------------------ results_root
def test_results_root_that_is_a_file_is_rejected(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("keep me\n")
    for root in (plain, plain / "below"):
        out = cli(["experiment=exp1", "stage=train"], root)
        assert_user_error(out, "results_root=", "is a file, not a folder")
    assert plain.read_text() == "keep me\n"


@pytest.mark.parametrize("stage", ["train", "eval", "report", "all"])
def test_unwritable_results_root_is_rejected_before_any_work(tmp_path, monkeypatch, stage):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(preflight.tempfile, "TemporaryFile", read_only)
    cfg = cli_config(["experiment=exp1", "profile=smoke", f"stage={stage}", f"results_root={tmp_path / 'runs'}"])
    with pytest.raises(ConfigError, match=r"results_root=.*cannot write in .*Read-only file system"):
        preflight.check_results_root(cfg)
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ the model's limits
def test_seq_len_beyond_the_models_positions_is_rejected_before_any_work(tmp_path):
    out = cli(["experiment=exp1", "stage=train", "train.seq_len=100000"], tmp_path / "runs")
    assert_user_error(out, "train.seq_len=100000", "at most 4096", "max_position_embeddings")
    assert not (tmp_path / "runs").exists()


def test_a_step_larger_than_any_machine_is_rejected_before_any_work(tmp_path):
    # 4096 sequences of 4096 tokens through eager attention: petabytes, on any machine.
    out = cli(["experiment=exp1", "stage=train", "train.seq_len=4096", "train.micro_batch_size=4096",
               "train.global_batch_size=4096"], tmp_path / "runs")
    assert_user_error(out, "train.micro_batch_size=4096", "GiB", "activation_checkpointing")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("layers", [1, 3])
def test_memory_estimate_counts_the_real_models_parameters(layers):
    from hif8qat.models.loading import build_tiny_llama, model_config_facts

    model, _ = build_tiny_llama(num_layers=layers)
    facts = model_config_facts(f"tiny:{layers}")
    cfg = cli_config(["experiment=exp1", "profile=smoke", f"model.name=tiny:{layers}"])
    parts = step_memory(cfg, facts, train_numerics(cfg))
    n = sum(p.numel() for p in model.parameters())
    # the simulated model is the real one: FP32 weights (and the rotary buffer), two AdamW moments and a step count
    assert parts["weights"] == 4 * n + sum(b.numel() * b.element_size() for b in model.buffers())
    assert parts["AdamW state"] == 8 * n + 4 * len(list(model.parameters()))
    assert parts["activations"] > 0


def test_profiles_as_shipped_pass_the_model_checks():
    for profile in ("smoke", "mini"):
        cfg = cli_config(["experiment=exp8", f"profile={profile}"])
        preflight.check_model_fits(cfg, train_numerics(cfg))


# ------------------------------------------------------------------ a full disk
def _enospc_on(monkeypatch, target, name: str, after: int = 0):
    """Make target.name raise ENOSPC from its (after+1)-th call on, as a write to a full disk does."""
    real, calls = getattr(target, name), {"n": 0}

    def full(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, full)


def _tiny_training_state():
    from hif8qat.models.loading import build_tiny_llama

    model, _ = build_tiny_llama(num_layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.arange(8)[None]).logits.sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler,
            "rank_state": {"rng": torch.get_rng_state()}}


@pytest.mark.parametrize("where", ["torch.save", "safetensors"])
def test_disk_full_during_a_checkpoint_names_the_folder_and_keeps_the_last_one(tmp_path, monkeypatch, where):
    from safetensors import SafetensorError

    root, state = tmp_path / "checkpoints", _tiny_training_state()
    ckpt.save_checkpoint(root, 4, **state)
    if where == "torch.save":
        _enospc_on(monkeypatch, ckpt.torch, "save")
    else:
        def full(*args, **kwargs):  # safetensors words ENOSPC as its own error type
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })')
        monkeypatch.setattr(ckpt, "save_model", full)
    with pytest.raises(ckpt.DiskFull) as err:
        ckpt.save_checkpoint(root, 8, **state)
    text = str(err.value)
    assert str(root) in text and "checkpoint step 8" in text and "free" in text
    # what one checkpoint needs: the weights and AdamW's two moments, 3 x 4 bytes per parameter
    size, unit = re.search(r"a checkpoint of this run takes about ([\d.]+) (kB|MB)", text).groups()
    params = sum(p.numel() for p in state["model"].parameters())
    assert float(size) * {"kB": 1e3, "MB": 1e6}[unit] == pytest.approx(12 * params, rel=0.02)
    assert "step_0000004 is intact" in text
    monkeypatch.undo()
    assert [p.name for p in root.iterdir()] == ["step_0000004"]  # the partial write is gone
    ckpt.verify_checkpoint(root / "step_0000004")


def test_other_write_failures_are_not_reported_as_a_full_disk(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ckpt.torch, "save", broken)
    with pytest.raises(OSError, match="Input/output error"):
        ckpt.save_checkpoint(tmp_path / "checkpoints", 4, **_tiny_training_state())


def test_training_checks_free_space_before_the_first_step(tmp_path, monkeypatch):
    from hif8qat.runs import folders as runs
    from hif8qat.train import loop as train

    cfg = cli_config(["experiment=exp1", "profile=smoke", f"results_root={tmp_path / 'runs'}",
                      "logger.progress_bar=false"])
    run_dir, _ = runs.prepare_run_dir(cfg)
    try:
        monkeypatch.setattr(ckpt, "free_space", lambda path: 1000)
        with pytest.raises(ckpt.DiskFull, match=r"not enough free space for a checkpoint .*1\.0 kB free"):
            train.train(cfg, run_dir, numerics=train_numerics(cfg))
        assert not (run_dir / "metrics.jsonl").exists()  # no step was trained
    finally:
        runs.release_run_dir(run_dir)


def test_disk_full_while_exporting_says_training_is_kept(tmp_path, monkeypatch):
    from hif8qat.runs import folders as runs
    from hif8qat.train import export
    from hif8qat.train import loop as train

    cfg = cli_config(["experiment=exp1", "profile=smoke", f"results_root={tmp_path / 'runs'}",
                      "logger.progress_bar=false", "profile.steps=2", "train.checkpoint_every=2"])
    run_dir, _ = runs.prepare_run_dir(cfg)
    try:
        _enospc_on(monkeypatch, export, "export_model")
        with pytest.raises(ckpt.DiskFull, match="the export.*Training is complete in .*step_0000002"):
            train.train(cfg, run_dir, numerics=train_numerics(cfg))
    finally:
        runs.release_run_dir(run_dir)
    assert not (run_dir / "export.tmp").exists() and not (run_dir / "DONE").exists()


# ------------------------------------------------------------------ the report
def test_truncated_eval_results_are_an_error_naming_the_file(tmp_path):
    runs_root = make_fake_runs(tmp_path / "runs", exps=("exp7",))
    results = runs_root / "smoke" / "exp7" / "seed0" / "eval" / "bf16" / "results.json"
    results.write_text(results.read_text()[:25])
    out = cli(["experiment=exp7", "stage=report"], runs_root)
    assert_user_error(out, str(results), "stage=eval")
    assert not (runs_root / "tables").exists() and not (runs_root / "figures").exists()  # no table written


def test_report_lists_the_runs_it_could_not_use(tmp_path):
    runs_root = make_fake_runs(tmp_path / "runs")
    empty = runs_root / "smoke" / "exp8" / "seed0"
    (empty / "metrics.jsonl").write_text("")
    broken = runs_root / "smoke" / "exp1" / "seed0"
    broken.mkdir(parents=True)
    (broken / "config_resolved.yaml").write_text("experiment: {name: [exp1\n")
    out = cli(["experiment=exp8", "stage=report"], runs_root)
    assert out.returncode == 0, out.stderr[-3000:]
    listed = out.stdout[out.stdout.index("runs not used"):]
    assert f"{empty}: metrics.jsonl holds no loss although the run is finished" in listed
    assert f"{broken}: config_resolved.yaml does not parse" in listed
    sources = json.loads((runs_root / "tables" / "smoke" / "ape_smoke.sources.json").read_text())
    assert {s["run_dir"] for s in sources["runs_not_used"]} == {str(empty), str(broken)}
    assert "exp7" not in {Path(s["run_dir"]).parent.name for s in sources["runs_not_used"]}
