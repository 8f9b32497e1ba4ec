"""tools/build_env.sh (how make builds .venv) and tools/uv_config.py (pip's sources handed to uv).

The installers are stand-ins here (a ``python`` that logs what pip and uv are asked and fails where a test says):
what is checked is the order of the installs, the constraint, which installer ran, and that uv is given pip's
sources. That uv and pip then install the same files is a measured fact of a real build, not a unit test."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "build_env.sh"

_spec = importlib.util.spec_from_file_location("uv_config", ROOT / "tools" / "uv_config.py")
uv_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uv_config)


# --- tools/uv_config.py -------------------------------------------------------------------------------------------

def test_a_pip_variable_overrides_the_install_section_which_overrides_global():
    listing = ("global.find-links='/g'\ninstall.find-links='/i'\n:env:.find-links='/e'\n"
               "global.index-url='https://g.example/simple'\ninstall.index-url=\"https://i.example/simple\"\n")
    assert uv_config.pip_settings(listing) == {"find-links": "/e", "index-url": "https://i.example/simple"}


def test_other_commands_sections_are_not_an_installs():
    assert uv_config.pip_settings("download.find-links='/d'\nglobal.timeout='5'\n") == {"timeout": "5"}


def test_every_source_becomes_its_uv_flag_and_pip_s_index_choice_is_kept(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    args = uv_config.uv_arguments({"index-url": "https://mirror.example/simple",
                                   "extra-index-url": "https://a.example/simple https://b.example/simple",
                                   "find-links": f"{wheels} file://{wheels}", "constraint": "/etc/c.txt",
                                   "cert": "/etc/ca.pem", "default-timeout": "180"})
    pairs = list(zip(args[::2], args[1::2], strict=True))
    assert pairs[0] == ("--index-strategy", "unsafe-best-match")  # pip: the best version over every index
    assert sorted(pairs[1:]) == sorted([("--default-index", "https://mirror.example/simple"),
                                        ("--index", "https://a.example/simple"), ("--index", "https://b.example/simple"),
                                        ("--find-links", str(wheels)), ("--find-links", f"file://{wheels}"),
                                        ("--constraint", "/etc/c.txt")])


def test_a_local_location_that_does_not_exist_is_skipped_as_pip_skips_it(tmp_path):
    args = uv_config.uv_arguments({"find-links": f"{tmp_path}/absent file://{tmp_path}/gone {tmp_path}"})
    assert args[2:] == ["--find-links", str(tmp_path)]


def test_no_index_is_passed_on_only_when_set():
    assert "--no-index" in uv_config.uv_arguments({"no-index": "true"})
    assert "--no-index" not in uv_config.uv_arguments({"no-index": "false"})


@pytest.mark.parametrize("key", ["pre", "only-binary", "no-binary", "prefer-binary", "upgrade-strategy"])
def test_a_setting_that_changes_what_pip_installs_and_has_no_translation_is_refused_by_name(key):
    with pytest.raises(uv_config.Unsupported, match=key):
        uv_config.uv_arguments({key: "true"})


# --- tools/build_env.sh ------------------------------------------------------------------------------------------

_FAKE_PYTHON = """#!/bin/sh
# a stand-in interpreter: logs what it is asked, fails what FAIL names, runs real scripts for real (but the
# bytecode warm-up, which would import the whole project: logged like an install)
case "$1" in *warm_bytecode.py) ;; *.py) exec {python} "$@" ;; esac
echo "python $*" >> {log}
case "$*" in *{fail}*) exit 1 ;; esac
case "$*" in *"pip install -q uv=="*)
    printf '#!/bin/sh\\necho "uv $*" >> {log}\\ncase "$*" in *{uv_fail}*) exit 1 ;; esac\\n' > {bin}/uv
    chmod +x {bin}/uv ;; esac
exit 0
"""


def _build(tmp_path: Path, installer: str, fail: str = "never-matches",
           uv_fail: str = "never-matches") -> tuple[subprocess.CompletedProcess, list[str]]:
    """tools/build_env.sh run with a stand-in interpreter whose pip fails on calls containing ``fail`` and whose
    uv (installed by that pip) fails on calls containing ``uv_fail``; returns its result and the calls logged."""
    venv, log = tmp_path / "venv", tmp_path / "log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(_FAKE_PYTHON.format(python=shlex.quote(sys.executable), log=log, fail=fail, uv_fail=uv_fail,
                                          bin=venv / "bin"))
    python.chmod(0o755)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("numpy==2.0.0\ntorch==2.9.0\nsix==1.17.0\n")
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nfind-links = {tmp_path}\n")
    env = {**os.environ, "INSTALLER": installer, "PIP_CONFIG_FILE": str(config)}
    env = {k: v for k, v in env.items() if not k.startswith("PIP_") or k == "PIP_CONFIG_FILE"}
    out = subprocess.run(["bash", str(SCRIPT), str(venv), str(requirements), "extra-first"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    return out, log.read_text().splitlines() if log.exists() else []


def _installs(lines: list[str], tool: str) -> list[str]:
    return [line for line in lines if line.startswith(tool)]


def test_uv_installs_torch_alone_then_the_rest_under_its_pin_then_the_project(tmp_path):
    out, lines = _build(tmp_path, "auto")
    assert out.returncode == 0, out.stderr
    assert lines[0] == "python -m pip install -q --upgrade pip extra-first"
    uv = _installs(lines, "uv")
    assert [line.split()[-1] for line in uv] == ["torch==2.9.0", str(tmp_path / "requirements.txt"), "."]
    assert f"-c {tmp_path}/venv/torch-constraint.txt" in uv[1] and "--no-deps -e ." in uv[2]
    assert all(f"--find-links {tmp_path}" in line for line in uv)  # pip's own find-links, told to uv
    # no bytecode for all 20,000 installed files: the project's imports get theirs once everything is installed
    assert not [line for line in uv if "--compile-bytecode" in line]
    assert lines[-1] == f"python {ROOT}/tools/warm_bytecode.py"
    assert (tmp_path / "venv" / "torch-constraint.txt").read_text() == "torch==2.9.0\n"
    assert not [line for line in lines if "pip install -q torch" in line]  # pip never installed the pins


def test_when_uv_cannot_be_had_pip_builds_the_environment_the_same_way(tmp_path):
    out, lines = _build(tmp_path, "auto", fail="uv==")
    assert out.returncode == 0, out.stderr
    assert "installing with pip" in out.stderr
    pip = [line for line in lines if line.startswith("python -m pip install -q") and "uv==" not in line][1:]
    assert not [line for line in lines if "warm_bytecode" in line]  # pip compiles every file it installs
    assert pip == ["python -m pip install -q torch==2.9.0",
                   f"python -m pip install -q -c {tmp_path}/venv/torch-constraint.txt -r {tmp_path}/requirements.txt",
                   "python -m pip install -q --no-deps -e ."]


def test_when_uv_fails_midway_pip_completes_the_environment(tmp_path):
    out, lines = _build(tmp_path, "auto", uv_fail="torch-constraint")  # uv installs torch, fails on the rest
    assert out.returncode == 0, out.stderr
    assert [line.split()[-1] for line in _installs(lines, "uv")] == ["torch==2.9.0", str(tmp_path / "requirements.txt")]
    assert _installs(lines, "python -m pip install -q -c") and lines[-1] == "python -m pip install -q --no-deps -e ."


def test_installer_pip_never_asks_for_uv_and_installer_uv_fails_without_it(tmp_path):
    out, lines = _build(tmp_path / "pip", "pip")
    assert out.returncode == 0 and not [line for line in lines if "uv" in line], lines
    out, lines = _build(tmp_path / "uv", "uv", fail="uv==")
    assert out.returncode == 1 and "INSTALLER=uv" in out.stderr
    assert not [line for line in lines if "pip install -q torch" in line]


def test_an_unknown_installer_is_refused_with_the_allowed_values_before_anything_is_built(tmp_path):
    out, lines = _build(tmp_path, "conda")
    assert out.returncode == 2 and "INSTALLER=conda" in out.stderr and "auto, uv, pip" in out.stderr
    assert lines == []


def test_a_failed_bytecode_warm_up_leaves_a_working_environment_and_says_so(tmp_path):
    out, lines = _build(tmp_path, "auto", fail="warm_bytecode")
    assert out.returncode == 0, out.stderr
    assert "bytecode not written" in out.stderr
    assert not [line for line in lines if "pip install -q torch" in line]  # uv's install stands; pip redid nothing


# --- tools/warm_bytecode.py --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_warm_bytecode_writes_the_bytecode_of_the_project_and_of_what_it_imports_lazily(tmp_path):
    # under PYTHONDONTWRITEBYTECODE, with the bytecode redirected to tmp_path: what the script wrote is all there is
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "warm_bytecode.py")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    written = {p.name.split(".")[0] for p in tmp_path.rglob("*.pyc")}
    project = {p.stem for p in (ROOT / "src" / "hif8qat").rglob("*.py") if p.stem != "__main__"}
    assert project <= written, sorted(project - written)
    # imported only inside functions at run time: the model's code, the memory simulation's tracker, lm-eval's HF model
    assert {"modeling_llama", "mem_tracker", "huggingface"} <= written
