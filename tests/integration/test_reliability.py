"""Bad input is rejected before any work, failures are reported as ``error: ...`` (exit 2), one process writes
a run folder, the report ignores archived runs, result files hold no machine paths, wandb gets the metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_config import compose_cfg
from test_train import losses, run, run_folder

from hif8qat.cli import command_line, hydra_config
from hif8qat.config.run_config import ConfigError, RunConfig, resolve_profile
from hif8qat.errors import RunError
from hif8qat.runs import folders as runs

ROOT = Path(__file__).resolve().parents[2]
FAST = ["profile=smoke", "logger.progress_bar=false", "train.num_threads=1"]


def cli(args: list[str], root: Path, **kw) -> subprocess.CompletedProcess:
    return run(FAST + [f"results_root={root}", *args], check=False, **kw)


def assert_user_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert error, out.stderr[-3000:]
    text = out.stderr[out.stderr.index("error: "):]
    for needle in needles:
        assert needle in text, (needle, text)


def cli_config(overrides: list[str]) -> RunConfig:
    """The RunConfig run.py would build from these command-line overrides."""
    argv = command_line.force_add_dict_overrides(["run.py", *overrides])[1:]
    cfg = hydra_config.replace_typed_dicts(compose_cfg(argv), argv)
    return hydra_config.to_run_config(cfg, argv)


# ------------------------------------------------------------------------- rejected before any work
REJECTED = [
    # data.source: a path that does not exist (was found only after the model had loaded)
    (["experiment=exp1", "stage=train", "data.source=./no_such_data"], ["data.source", "'mini', 'fineweb'"]),
    # eval.tasks: was found only after the whole training
    (["experiment=exp1", "stage=all", "eval.tasks=[no_such_task]"], ["eval.tasks", "mini_mmlu", "arc_challenge"]),
    (["experiment=exp1", "stage=train", "data.eval_windows=0"], ["data.eval_windows"]),
    (["experiment=exp3", "stage=train", "model.name=tiny:0"], ["model.name", "tiny:N"]),
    (["experiment=exp1", "stage=train", "model.name=nosuchorg/nosuchmodel"], ["model.name", "cached"]),
    # A schedule that does not start at step 0: Hydra used to merge it into exp3's {0: 1, 1000: 10}.
    (["experiment=exp3", "stage=train", "quant.interval={1000:10}"], ["quant.interval", "key 0"]),
    # Without '+', and validated: a mini task reads its packaged data, so a local copy for it is an error.
    (["experiment=exp1", "stage=all", "eval.local_datasets={mini_mmlu:./nonexistent}"],
     ["eval.local_datasets.mini_mmlu", "paper task"]),
    (["experiment=exp1", "stage=all", "eval.tasks=[mmlu]", "eval.local_datasets={mmlu:./nonexistent}"],
     ["eval.local_datasets.mmlu", "does not exist"]),
    # A paper task's dataset, offline and nowhere on disk: DatasetUnavailableError before training.
    (["experiment=exp1", "stage=all", "eval.tasks=[hellaswag]"], ["Rowan/hellaswag", "eval.local_datasets"]),
]


@pytest.mark.parametrize("args,needles", REJECTED, ids=[" ".join(a[2:]) for a, _ in REJECTED])
def test_bad_input_is_rejected_before_any_work(tmp_path, args, needles):
    out = cli(args, tmp_path / "runs")
    assert_user_error(out, *needles)
    assert "name_or_path" not in out.stderr  # the setting is model.name
    assert not (tmp_path / "runs").exists()  # no run folder, not even an empty one


def test_cuda_device_without_a_gpu_is_rejected_early(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert_user_error(cli(["experiment=exp1", "stage=train", "train.device=cuda"], tmp_path / "runs"), "train.device")
    assert not (tmp_path / "runs").exists()


def test_typed_dict_replaces_the_experiments_dict_instead_of_merging():
    # exp3 sets quant.interval={0: 1, 1000: 10}; Hydra alone would give {0: 5, 1000: 10}.
    cfg = cli_config(["experiment=exp3", "profile=paper", "quant.interval={0:5}"])
    assert cfg.quant.training.interval == {0: 5}
    cfg = cli_config(["experiment=exp3", "profile=paper", "quant.interval={0:1,500:10}"])  # a new key: no '+'
    assert cfg.quant.training.interval == {0: 1, 500: 10}
    cfg = cli_config(["experiment=exp4", "profile=paper", "quant.algo={0:max}"])
    assert cfg.quant.training.algo == {0: "max"}
    assert command_line.force_add_dict_overrides(["run.py", "-m", "a.b={0:1}", "+c={x:y}", "d=1", "hydra.x={a:1}"]) \
        == ["run.py", "-m", "++a.b={0:1}", "++c={x:y}", "d=1", "hydra.x={a:1}"]


def test_local_datasets_need_no_plus_and_are_checked(tmp_path):
    cfg = cli_config(["experiment=exp1", "profile=smoke", "eval.tasks=[mmlu]",
                      f"eval.local_datasets={{mmlu:{tmp_path}}}"])
    assert cfg.eval.local_datasets == {"mmlu": str(tmp_path)}
    cfg = cli_config(["experiment=exp1", "profile=smoke", "eval.tasks=[mmlu]",
                      f"eval.local_datasets={{cais/mmlu:{tmp_path}}}"])  # a hub dataset id as the key
    assert cfg.eval.local_datasets == {"cais/mmlu": str(tmp_path)}
    with pytest.raises(ConfigError, match="eval.local_datasets.hellaswag"):  # not an evaluated task: ignored
        cli_config(["experiment=exp1", "profile=smoke", "eval.tasks=[mmlu]",
                    f"eval.local_datasets={{hellaswag:{tmp_path}}}"])


def test_every_user_facing_failure_is_a_run_error():
    from hif8qat.evaluate.task_data import DatasetUnavailableError
    from hif8qat.train.loop import TrainingDiverged

    for cls in (ConfigError, DatasetUnavailableError, TrainingDiverged, runs.RunFolderError, runs.SettingsDiffer,
                runs.CorruptRunFile, runs.RunFolderBusy):
        assert issubclass(cls, RunError), cls
    assert issubclass(ConfigError, ValueError)  # callers validating values still catch it


# ------------------------------------------------------------------------------------- run folders
def _smoke_cfg(tmp_path: Path, *overrides: str) -> RunConfig:
    cfg = cli_config(["experiment=exp1", "profile=smoke", f"results_root={tmp_path}", *overrides])
    return resolve_profile(cfg)


def _prepared(cfg: RunConfig) -> Path:
    run_dir, _ = runs.prepare_run_dir(cfg)
    runs.release_run_dir(run_dir)
    return run_dir


def test_profile_settings_enter_the_folder_name():
    tag = hydra_config.run_tag_from_overrides
    assert tag(["experiment=exp3", "profile=smoke", "profile.steps=8"]) == "profile.steps=8"
    assert tag(["profile.steps=8"]) != tag(["profile.steps=12"])
    assert tag(["profile=smoke", "profile.name=smoke", "data.cache_dir=/x", "eval.limit=3"]) == ""


def test_long_tags_that_differ_only_at_the_end_get_different_folders():
    common = ",".join(f"quant.setting_{i}=value_{i}" for i in range(12))
    a, b = runs.sanitize_tag(common + ",x=1"), runs.sanitize_tag(common + ",x=2")
    assert a != b and len(a) <= 120 and len(b) <= 120


@pytest.mark.slow
def test_sweep_over_profile_steps_trains_each_point_in_its_own_folder(tmp_path):
    root = tmp_path / "runs"
    out = run(["-m", "experiment=exp1", "stage=train", "profile.steps=2,3", f"results_root={root}",
               f"hydra.sweep.dir={tmp_path / 'multirun'}", *FAST])
    assert "skipping training" not in out.stdout
    for steps in (2, 3):
        folder = root / "smoke" / "exp1" / f"seed0-profile.steps={steps}"
        assert [s for s, _ in losses(folder)] == list(range(steps))


def _mark_finished(run_dir: Path) -> None:
    """What a finished run holds for the folder rules: its export (weights elided) and the DONE marker."""
    (run_dir / "export").mkdir()
    (run_dir / "export" / "config.json").write_text("{}")
    runs.mark_done(run_dir)


def test_finished_run_with_other_settings_is_refused_not_skipped(tmp_path):
    cfg = _smoke_cfg(tmp_path, "run_tag=mine")
    run_dir = _prepared(cfg)
    _mark_finished(run_dir)
    assert runs.prepare_run_dir(cfg)[1] == "done"
    runs.release_run_dir(run_dir)
    # Same folder (run_tag pins it), a setting that changes the training: an edited YAML, an env variable, ...
    other = _smoke_cfg(tmp_path, "run_tag=mine", "train.lr=3e-4")
    with pytest.raises(runs.SettingsDiffer, match=r"train\.lr") as err:
        runs.prepare_run_dir(other)
    assert "force=true" in str(err.value)


def test_run_saved_before_a_setting_existed_matches_only_the_setting_old_behaviour(tmp_path):
    cfg = _smoke_cfg(tmp_path, "run_tag=old")
    run_dir = _prepared(cfg)
    _mark_finished(run_dir)
    saved = yaml.safe_load((run_dir / runs.CONFIG_FILE).read_text())
    del saved["train"]["activation_checkpointing"]  # as written by the code before the setting was added
    (run_dir / runs.CONFIG_FILE).write_text(yaml.safe_dump(saved))
    assert runs.prepare_run_dir(cfg)[1] == "done"
    runs.release_run_dir(run_dir)
    with pytest.raises(runs.SettingsDiffer, match=r"train\.activation_checkpointing"):
        runs.prepare_run_dir(_smoke_cfg(tmp_path, "run_tag=old", "train.activation_checkpointing=true"))


@pytest.mark.parametrize("name,text", [("config_resolved.yaml", "train: [unclosed\n"),
                                       ("config_resolved.yaml", "just a string\n"),
                                       ("run_info.json", '{"status": "new", "hist')])
def test_corrupt_run_file_is_reported_by_name(tmp_path, name, text):
    root = tmp_path / "runs"
    folder = root / "smoke" / "exp1" / "seed0"
    folder.mkdir(parents=True)
    (folder / "config_resolved.yaml").write_text(yaml.safe_dump(_smoke_cfg(root).to_dict()))
    (folder / name).write_text(text)
    before = sorted((p.name, p.read_bytes()) for p in folder.iterdir() if p.name != runs.LOCK_FILE)
    out = cli(["experiment=exp1", "stage=train"], root)
    assert_user_error(out, str(folder / name), "force=true")
    assert sorted((p.name, p.read_bytes()) for p in folder.iterdir() if p.name != runs.LOCK_FILE) == before


def test_settings_differ_refusal_is_an_error_message(tmp_path):
    root = tmp_path / "runs"
    folder = _prepared(_smoke_cfg(root, "run_tag=mine", "train.lr=3e-4"))  # an unfinished run with another lr
    before = sorted((p.name, p.read_bytes()) for p in folder.iterdir() if p.name != runs.LOCK_FILE)
    out = cli(["experiment=exp1", "stage=train", "run_tag=mine"], root)
    assert_user_error(out, "cannot resume", "train.lr", "config_resolved.yaml")
    # nothing written: the saved config and the run's history of starts are as they were
    assert sorted((p.name, p.read_bytes()) for p in folder.iterdir() if p.name != runs.LOCK_FILE) == before


def test_second_process_is_refused_and_touches_nothing(tmp_path):
    root = tmp_path / "runs"
    folder = run_folder(root, "exp1")
    runs.lock_run_dir(folder)  # this test process is the live writer
    try:
        before = sorted(p.name for p in folder.iterdir())
        out = cli(["experiment=exp1", "stage=train"], root)
        assert_user_error(out, str(folder), f"in use by another process (pid {os.getpid()}")
        assert sorted(p.name for p in folder.iterdir()) == before == [runs.LOCK_FILE]
    finally:
        runs.release_run_dir(folder)


def test_lock_is_released_when_its_holder_is_killed(tmp_path):
    folder = tmp_path / "run"
    code = ("import os, signal, sys; sys.path.insert(0, sys.argv[2]); from pathlib import Path; "
            "from hif8qat.runs.folders import lock_run_dir; lock_run_dir(Path(sys.argv[1])); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code, str(folder), str(ROOT / "src")], timeout=60)
    assert out.returncode == -9
    assert re.match(r"pid \d+ on ", (folder / runs.LOCK_FILE).read_text())  # the dead holder's note stays
    runs.lock_run_dir(folder)  # ... but its lock went with it
    runs.release_run_dir(folder)


def test_forced_rerun_archives_and_locks_the_fresh_folder(tmp_path):
    cfg = _smoke_cfg(tmp_path)
    run_dir = _prepared(cfg)
    runs.mark_done(run_dir)
    from dataclasses import replace

    new_dir, status = runs.prepare_run_dir(replace(cfg, force=True))
    try:
        assert status == "new" and new_dir == run_dir
        archived = [p for p in run_dir.parent.iterdir() if runs.is_archive(p)]
        assert len(archived) == 1 and (archived[0] / runs.DONE_MARKER).exists()
        code = ("import sys; sys.path.insert(0, sys.argv[2]); from pathlib import Path; "
                "from hif8qat.runs.folders import lock_run_dir; lock_run_dir(Path(sys.argv[1]))")
        other = subprocess.run([sys.executable, "-c", code, str(run_dir), str(ROOT / "src")], capture_output=True,
                               text=True, timeout=60)
        assert other.returncode != 0 and "RunFolderBusy" in other.stderr
    finally:
        runs.release_run_dir(run_dir)


@pytest.mark.slow
def test_two_identical_runs_started_together_write_one_folder_once(tmp_path):
    root = tmp_path / "runs"
    args = [sys.executable, str(ROOT / "run.py"), "experiment=exp1", "stage=train", f"results_root={root}", *FAST]
    procs = [subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    # The second either finds the folder busy (refused) or, on a loaded machine where the first finished
    # before it started, finished (skipped): never a second training into the same folder.
    codes = sorted(code for code, _, _ in outs)
    assert codes in ([0, 2], [0, 0]), outs
    if codes == [0, 2]:
        assert "in use by another process" in next(err for code, _, err in outs if code == 2)
    else:
        assert sum("is finished: skipping training" in out for _, out, _ in outs) == 1, outs
    folder = run_folder(root, "exp1")
    assert [s for s, _ in losses(folder)] == list(range(8))
    assert json.loads((folder / "summary.json").read_text())["steps"] == 8


@pytest.mark.slow
def test_torchrun_ranks_exit_cleanly_when_the_folder_is_busy(tmp_path):
    root = tmp_path / "runs"
    folder = run_folder(root, "exp1")
    runs.lock_run_dir(folder)
    try:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        out = run(["experiment=exp1", "stage=train", f"results_root={root}", *FAST], launcher=torchrun, check=False)
    finally:
        runs.release_run_dir(folder)
    assert out.returncode != 0  # no rank waits forever for a rank 0 that refused to start (the timeout)
    assert "in use by another process" in out.stderr
    assert sorted(p.name for p in folder.iterdir()) == [runs.LOCK_FILE]


# ------------------------------------------------------------------------------------------- report
def test_report_does_not_count_force_archives(tmp_path):
    from hif8qat.report import discover_runs

    for name in ("seed0", "seed0.old-20260101-120000", "seed0.old-20260102-090000"):
        d = tmp_path / "smoke" / "exp1" / name
        d.mkdir(parents=True)
        (d / "config_resolved.yaml").write_text(yaml.safe_dump({"experiment": {"name": "exp1"}, "seed": 0}))
    found = discover_runs(tmp_path, "smoke")
    assert [r.path.name for r in found] == ["seed0"]


# ------------------------------------------------------------------------------ paths in result files
_ABSOLUTE = re.compile(r"""(^|[\s"'(=\[,])(/(home|work|tmp|root|Users|mnt|scratch|data|var|opt|srv|private)/"""
                       r"""|[A-Za-z]:\\\\)""")


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_committed_result_files_hold_no_absolute_paths():
    tracked = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked, "no committed result files found"
    offenders = []
    for rel in tracked:
        path = ROOT / rel
        if path.suffix in (".json", ".yaml", ".jsonl"):
            text = path.read_text()
            docs = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
                else [yaml.safe_load(text) if path.suffix == ".yaml" else json.loads(text)]
            bad = [s for d in docs for s in _strings(d) if os.path.isabs(s) and s.count("/") > 1]
        elif path.suffix in (".md", ".csv", ".txt"):
            bad = [m.group(0) for m in _ABSOLUTE.finditer(path.read_text())]
        else:
            continue
        offenders += [f"{rel}: {b}" for b in bad[:3]]
    assert not offenders, offenders


def test_eval_results_record_run_paths_relative_to_the_results_root(tmp_path, monkeypatch):
    from hif8qat.evaluate import runner

    seen = {}

    def fake_export(export, mode, tasks, *, out_dir, extra_meta, **kw):
        seen[mode] = extra_meta
        return {}

    monkeypatch.setattr(runner, "evaluate_export", fake_export)  # where evaluate_run looks it up
    run_dir = tmp_path / "runs" / "smoke" / "exp1" / "seed0"
    (run_dir / "export").mkdir(parents=True)
    runner.evaluate_run(run_dir, modes=["bf16"], results_root=tmp_path / "runs")
    assert seen["bf16"]["run_dir"] == "smoke/exp1/seed0"
    assert seen["bf16"]["export_dir"] == "smoke/exp1/seed0/export"
    seen.clear()
    runner.evaluate_run(run_dir, modes=["bf16"])  # default root: <root>/<profile>/<experiment>/<run>
    assert seen["bf16"]["run_dir"] == "smoke/exp1/seed0"


# ------------------------------------------------------------------------------------------- wandb
@pytest.mark.slow
def test_wandb_offline_run_holds_the_training_metrics(tmp_path):
    root = tmp_path / "runs"
    run(["experiment=exp1", "stage=train", "logger=wandb", f"results_root={root}", *FAST],
        env_extra={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    folder = run_folder(root, "exp1")
    logs = list((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, list((folder / "wandb").rglob("*"))
    # wandb's own reader of its transaction log, one JSON record per line
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(logs[0])],
                         capture_output=True, text=True, timeout=120, check=True)
    history = [json.loads(line)["history"]["item"] for line in out.stdout.splitlines()
               if line.startswith("{") and '"type":"history"' in line]
    logged = {(h["step"], h["loss"]) for h in history if "loss" in h}
    assert logged == set(losses(folder)) and len(logged) == 8


# ------------------------------------------------------------------------------ a clone stands alone
# Built from pieces so this file does not match itself.
_FOREIGN = re.compile("|".join([r"\.\./" + "shared", "shared/" + "reference", "DESIGN" + r"\.md", r"\." + "notes/",
                                "\u00a7", r"\b[Ii]ssue" + r" #?\d+"]))


def test_no_tracked_file_points_to_material_a_clone_lacks():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    offenders = []
    for rel in tracked.split("\n"):
        path = ROOT / rel
        if not rel or rel.startswith("results/paper/authors_") or path.suffix in (".png", ".gz", ".safetensors"):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        offenders += [f"{rel}: {m.group(0)}" for m in _FOREIGN.finditer(text)]
    assert not offenders, offenders
    for doc in ("docs/design.md", "results/paper/README.md", "LICENSE"):
        assert (ROOT / doc).is_file(), doc


def test_license_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
