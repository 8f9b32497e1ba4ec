"""The schema's outer edges: every integer setting has an upper bound (an extra digit is refused, not trained
for ever), a multirun is checked at every point of its cross product before the first job, and an environment
variable may not enter a run folder's name or its saved config."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_reliability import FAST, assert_user_error, cli, cli_config

from hif8qat.cli import command_line
from hif8qat.config.run_config import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[2]
HUGE = 10**20


@pytest.mark.parametrize("override,setting", [
    (f"profile.steps={HUGE}", "profile.steps"),
    (f"train.steps={HUGE}", "train.steps"),
    (f"train.seq_len={HUGE}", "train.seq_len"),
    (f"train.micro_batch_size={HUGE}", "train.micro_batch_size"),
    (f"train.checkpoint_every={HUGE}", "train.checkpoint_every"),
    (f"quant.history_len={HUGE}", "quant.history_len"),
    (f"quant.interval={{0: 1, {HUGE}: 2}}", "quant.interval"),
    (f"eval.batch_size={HUGE}", "eval.batch_size"),
    (f"eval.num_fewshot={{mmlu: {HUGE}}}", "eval.num_fewshot.mmlu"),
])
def test_huge_values_are_refused_naming_the_allowed_range(override, setting):
    with pytest.raises(ConfigError, match=rf"invalid setting {setting}[ =].*allowed .*at most \d+"):
        cli_config(["experiment=exp3", "profile=smoke", override])


def _integer_settings(data: dict) -> list[tuple[str, str]]:
    """(section, key) of every setting whose value in ``data`` is an integer (booleans apart)."""
    out = []
    for section, values in data.items():
        if isinstance(values, dict):
            out += [(section, k) for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)]
        elif isinstance(values, int) and not isinstance(values, bool):
            out.append((section, ""))
    return out


def test_every_integer_setting_has_an_upper_bound():
    """The class, not the cases: each integer setting set to 10**20 is refused by name (a setting added without
    a bound fails here). Settings that default to null but take an integer are added by hand."""
    base = json.loads(json.dumps(cli_config(["experiment=exp3", "profile=smoke"]).to_dict()))
    settings = _integer_settings(base) + [("eval", "limit"), ("train", "keep_checkpoints_when_done")]
    assert len(settings) > 15
    unbounded = []
    for section, key in settings:
        data = json.loads(json.dumps(base))
        if key:
            data[section][key] = HUGE
        else:
            data[section] = HUGE
        name = f"{section}.{key}" if key else section
        try:
            RunConfig.from_dict(data, check_paths=False)
        except ConfigError as err:
            if f"invalid setting {name}=" not in str(err):
                unbounded.append(f"{name}: refused for another reason ({err})")
        else:
            unbounded.append(f"{name}={HUGE} accepted")
    assert unbounded == []
    assert {f.name for f in dataclasses.fields(RunConfig)} >= {s for s, _ in settings}


def test_a_huge_step_count_creates_no_run_folder(tmp_path):
    out = cli(["experiment=exp1", "stage=train", f"profile.steps={HUGE}"], tmp_path / "runs")
    assert_user_error(out, f"profile.steps={HUGE}", "at most")
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ multirun: the cross product
SWEEP = ["-m", "experiment=exp1", "profile=smoke", "train.micro_batch_size=2,4", "train.global_batch_size=4,6"]


def test_every_point_of_a_sweep_is_checked_not_each_value_alone():
    # (4, 6) is the one bad point: 4 and 6 each pair with a first value (2 or 4) that works.
    problem = command_line.check_command_line(SWEEP)
    assert problem is not None
    assert "train.global_batch_size=6" in problem and "train.micro_batch_size=4" in problem, problem
    # the control: every point of this sweep divides
    assert command_line.check_command_line(
        SWEEP[:3] + ["train.micro_batch_size=1,2", "train.global_batch_size=4,6"]) is None


def test_a_sweep_with_a_bad_combination_trains_nothing(tmp_path):
    root = tmp_path / "runs"
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), *SWEEP[:1], *FAST, *SWEEP[2:], "experiment=exp1",
                          "stage=train", f"results_root={root}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert_user_error(out, "train.global_batch_size=6", "sweep point")
    assert not root.exists()


# ------------------------------------------------------------------ environment variables
SECRET = "hif8qat-test-secret-value"


@pytest.mark.parametrize("overrides,setting", [
    (["run_tag=${oc.env:HIF8QAT_TEST_SECRET}"], "run_tag"),
    # through a setting that may read it (a path), into one that names the folder
    (["data.cache_dir=${oc.env:HIF8QAT_TEST_SECRET}", "run_tag=${data.cache_dir}"], "run_tag"),
    (["logger.wandb_project=${oc.env:HIF8QAT_TEST_SECRET,x}"], "logger.wandb_project"),
])
def test_an_environment_variable_never_enters_a_folder_name_or_saved_config(tmp_path, overrides, setting):
    out = cli(["experiment=exp1", "stage=train", *overrides], tmp_path / "runs",
              env_extra={"HIF8QAT_TEST_SECRET": SECRET})
    assert_user_error(out, f"invalid setting {setting}=", "environment variable")
    assert SECRET not in out.stdout + out.stderr
    assert not (tmp_path / "runs").exists()


def test_a_path_setting_may_read_the_environment(monkeypatch):
    # The control: paths come from the environment in the shipped configs (OPENPANGU_PATH, FINEWEB_PATH).
    monkeypatch.setenv("HIF8QAT_TEST_MODEL", "tiny:2")
    cfg = cli_config(["experiment=exp1", "profile=smoke", "model.name=${oc.env:HIF8QAT_TEST_MODEL}"])
    assert cfg.model.name == "tiny:2"
    assert command_line.check_command_line(["experiment=exp1", "model=openpangu_embedded_1b"]) is None
