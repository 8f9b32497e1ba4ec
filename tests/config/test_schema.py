"""One schema: every setting's type and range is checked, whether or not the experiment uses it, for every point
of a multirun before the first job starts and before any folder exists; interpolations that do not resolve are
``error:`` lines."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_reliability import FAST, assert_user_error, cli, cli_config

from hif8qat.cli import command_line
from hif8qat.config.run_config import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[2]

# Each was accepted (and trained, or failed with a traceback) before the schema checked it.
BAD_VALUES = [
    (["train.eps=-1"], "train.eps"),
    (["train.eps=nan"], "train.eps"),
    (["train.lr=inf"], "train.lr"),
    (["train.weight_decay=inf"], "train.weight_decay"),
    (["train.grad_clip=inf"], "train.grad_clip"),
    (["train.betas=[a,b]"], "train.betas"),
    (["train.betas=0.9"], "train.betas"),
    (["eval.modes=[]"], "eval.modes"),
    (["quant.history_len=-5"], "quant.history_len"),  # exp1 is BF16: checked all the same
    (["quant.target_fwd=inf"], "quant.target_fwd"),
    (["quant.target={G:-224}"], "quant.target"),
    (["quant.target={A:15,W:15,G:224}", "quant.target_bwd=7"], "quant.target"),  # G's target given twice
    (["quant.scope=everything"], "quant.scope"),
    (["model.revision=5"], "model.revision"),
    (["experiment.description=[a]"], "experiment.description"),
]


@pytest.mark.parametrize("overrides,setting", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_bad_values_are_refused_by_name(overrides, setting):
    with pytest.raises(ConfigError, match=rf"invalid setting {setting}"):
        cli_config(["experiment=exp1", "profile=smoke", *overrides])


def _annotated_settings() -> list[tuple[str, str]]:
    out = []
    for f in dataclasses.fields(RunConfig):
        default = f.default_factory() if callable(f.default_factory) else None
        if dataclasses.is_dataclass(default):
            out += [(f"{f.name}.{g.name}", g.type) for g in dataclasses.fields(default)]
        else:
            out.append((f.name, f.type))
    return out


# A value of the wrong type for each declared type; str fields get a number, numbers and lists a word.
_WRONG = {"int": "word", "float": "word", "str": 5, "list[float]": ["word"], "list[str]": [5],
          "dict[str, int]": "word", "dict[str, str]": "word"}


def test_every_typed_setting_refuses_a_value_of_another_type():
    """The class, not the cases: every setting declared int, float, str, list or dict is type-checked by name,
    including those no experiment reads (one test over all of them, so a setting left out of the schema fails
    it)."""
    base = cli_config(["experiment=exp1", "profile=smoke"]).to_dict()
    typed = [s for s in _annotated_settings() if s[1].removesuffix(" | None") in _WRONG]
    assert len(typed) > 50  # the walk over the dataclasses found the settings
    unchecked = []
    for setting, annotation in typed:
        data = json.loads(json.dumps(base))
        section, _, key = setting.partition(".")
        wrong = _WRONG[annotation.removesuffix(" | None")]
        if key:
            data[section][key] = wrong
        else:
            data[section] = wrong
        try:
            RunConfig.from_dict(data, check_paths=False)
        except ConfigError as err:
            if not re.search(rf"invalid setting {re.escape(setting)}[=.\[]", str(err)):
                unchecked.append(f"{setting}: refused for another reason ({err})")
        else:
            unchecked.append(f"{setting}={wrong!r} accepted")
    assert unchecked == []


def test_train_resume_names_a_complete_checkpoint(tmp_path):
    empty = tmp_path / "not_a_checkpoint"
    empty.mkdir()
    with pytest.raises(ConfigError, match="train.resume"):
        cli_config(["experiment=exp1", "profile=smoke", f"train.resume={empty}"])
    done = tmp_path / "step_0000004"
    done.mkdir()
    (done / "COMPLETE").write_text("4\n")
    assert cli_config(["experiment=exp1", "profile=smoke", f"train.resume={done}"]).train.resume == str(done)


def test_a_folder_without_a_checkpoint_as_resume_creates_no_run_folder(tmp_path):
    out = cli(["experiment=exp1", "stage=train", f"train.resume={tmp_path}"], tmp_path / "runs")
    assert_user_error(out, "train.resume", "COMPLETE")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("line,needles", [
    (["-m", "experiment=exp1", "profile=smoke", "train.lr=1e-4,nan"], ["train.lr=nan", "sweep point"]),
    (["-m", "experiment=exp1,exp6", "profile=smoke", "quant.history_len=-1"], ["quant.history_len=-1"]),
    (["-m", "experiment=exp1", "profile=smoke", "seed=0,true"], ["seed=True"]),
    (["-m", "experiment=exp1", "profile=smoke", "experiment.name=ok,../up"], ["experiment.name='../up'"]),
])
def test_every_multirun_point_is_validated_before_the_first_job(line, needles):
    problem = command_line.check_command_line(line)
    assert problem is not None
    for needle in needles:
        assert needle in problem, (needle, problem)
    # the control: the same sweep with valid values passes the check
    assert command_line.check_command_line(["-m", "experiment=exp1", "profile=smoke", "train.lr=1e-4,2e-4",
                                          "seed=0,1"]) is None


def test_a_sweep_with_one_bad_point_trains_nothing(tmp_path):
    root = tmp_path / "runs"
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", *FAST, "experiment=exp1", "stage=train",
                          f"results_root={root}", "train.lr=1e-4,nan", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert_user_error(out, "train.lr=nan")
    assert not root.exists()


@pytest.mark.parametrize("override", ["train.seq_len=${oc.env:HIF8QAT_SURELY_UNSET_VAR}",
                                      "train.seq_len=${train.nonexistent}"])
def test_an_interpolation_that_does_not_resolve_is_an_error_line(tmp_path, override):
    out = cli(["experiment=exp1", "stage=train", override], tmp_path / "runs")
    assert_user_error(out, "cannot resolve train.seq_len")
    assert not (tmp_path / "runs").exists()


def test_a_model_folder_without_config_json_is_refused_before_any_run_folder(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="model.name=.*no config.json"):
        cli_config(["experiment=exp1", "profile=smoke", f"model.name={tmp_path / 'model'}"])
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # the control: a local GGUF file is a model source
    assert cli_config(["experiment=exp1", "profile=smoke", f"model.name={tmp_path / 'model.gguf'}"]).model.name


@pytest.mark.parametrize("config, needle", [({"model_type": "surely_not_an_architecture"},
                                              "surely_not_an_architecture"),
                                             ({"hidden_size": 8}, "model_type=None"),
                                             ("{not json", "cannot be read")])
def test_a_model_folder_transformers_cannot_build_is_refused_before_any_run_folder(tmp_path, config, needle):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    out = cli(["experiment=exp1", "stage=train", f"model.name={folder}"], tmp_path / "runs")
    assert_user_error(out, "model.name=", needle)
    assert not (tmp_path / "runs").exists()


def test_a_folder_with_a_known_model_type_passes_the_model_check(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = cli_config(["experiment=exp1", "profile=smoke", f"model.name={folder}"])
    from hif8qat.launch import preflight

    preflight.check_model(cfg)  # raises on a refusal


def test_a_bad_per_role_target_is_one_error_line_before_any_folder(tmp_path):
    out = cli(["experiment=exp14", "stage=train", "quant.target={A:15,W:15,Q:224}"], tmp_path / "runs")
    assert_user_error(out, "quant.target=", "mapping of roles A, W, G")
    assert not (tmp_path / "runs").exists()
