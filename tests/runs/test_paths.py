"""One path rule: every user string that becomes part of a run's path (experiment.name, profile.name, run_tag,
seed) is checked before any folder exists, results_root must be non-empty, and nothing is written outside it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_reliability import FAST, assert_user_error, cli_config

from hif8qat.config.run_config import ConfigError
from hif8qat.runs import folders as runs

ROOT = Path(__file__).resolve().parents[2]

# Each escaped results_root, or wrote a folder it should not have, before the rule existed.
HOSTILE = [
    ("experiment.name=../../../escape_exp", "experiment.name"),
    ("profile.name=../../x", "profile.name"),
    ("experiment.name=", "experiment.name"),
    ("experiment.name=a/b", "experiment.name"),
    ("profile.name=..", "profile.name"),
    ("experiment.name=/tmp/abs", "experiment.name"),
    ("results_root=", "results_root"),
]


def _written(top: Path, work: Path) -> list[str]:
    """Every file or folder under ``top``, leaving out Hydra's own job log (outputs/ in the cwd, by design)."""
    return sorted(str(p.relative_to(top)) for p in top.rglob("*") if not p.is_relative_to(work / "outputs"))


@pytest.mark.parametrize("override,setting", HOSTILE, ids=[o for o, _ in HOSTILE])
def test_no_run_is_written_outside_results_root(tmp_path, override, setting):
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    root = work / "runs"
    args = [*FAST, "experiment=exp1", "stage=train"] + ([] if override.startswith("results_root=")
                                                        else [f"results_root={root}"]) + [override]
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=work, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert_user_error(out, f"invalid setting {setting}=")
    assert _written(tmp_path, work) == ["a", "a/b", "a/b/c"]  # no run folder, inside results_root or out


HOSTILE_NAMES = ["..", ".", "../x", "x/..", "a/b", "/abs", "~", "a\\b", " x", "x y", "-x", "", ".hidden", "x" * 101]
PLAIN_NAMES = ["exp1", "my_exp-2", "sweep.v2", "a=b+c", "X" * 100]


@pytest.mark.parametrize("setting", ["experiment.name", "profile.name"])
def test_one_rule_refuses_every_name_that_is_not_one_plain_folder(tmp_path, setting):
    accepted = []
    for name in HOSTILE_NAMES:
        try:
            cli_config(["experiment=exp1", "profile=smoke", f"{setting}='{name}'"])
        except ConfigError as err:
            assert f"invalid setting {setting}=" in str(err), err
        else:
            accepted.append(name)
    assert accepted == []
    for name in PLAIN_NAMES:  # the control: plain names pass and name one folder inside results_root
        cfg = cli_config(["experiment=exp1", "profile=smoke", f"results_root={tmp_path}", f"{setting}='{name}'"])
        run_dir = runs.run_dir_for(cfg)
        assert run_dir.parents[2] == tmp_path and name in run_dir.relative_to(tmp_path).parts[:2]


def test_run_dir_for_refuses_a_config_that_skipped_validation(tmp_path):
    # A RunConfig built without from_dict (a script, a test) is checked where the path is made.
    cfg = cli_config(["experiment=exp1", "profile=smoke", f"results_root={tmp_path}"])
    evil = dataclasses.replace(cfg, experiment=dataclasses.replace(cfg.experiment, name="../../escape"))
    with pytest.raises(ConfigError, match="experiment.name"):
        runs.run_dir_for(evil)
    with pytest.raises(runs.RunFolderError, match="results_root"):
        runs.run_dir_for(dataclasses.replace(cfg, results_root=""))
    for tag in ("../../../x", "a/b/../../..", "..", "/etc/passwd"):  # a run tag is sanitized into one component
        run_dir = runs.run_dir_for(dataclasses.replace(cfg, run_tag=tag))
        assert run_dir.parent == tmp_path / "smoke" / "exp1" and run_dir.name.startswith("seed0-"), run_dir


@pytest.mark.parametrize("seed,allowed", [("true", "an integer"), ("99999999999999999999", "from 0 to")])
def test_seed_is_an_integer_in_range(seed, allowed):
    with pytest.raises(ConfigError, match=rf"invalid setting seed=.*{allowed}"):
        cli_config(["experiment=exp1", "profile=smoke", f"seed={seed}"])
