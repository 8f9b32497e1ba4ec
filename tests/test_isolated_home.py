"""The suite runs in a temporary home (conftest.py, isolated_home.py): the libraries and the subprocesses tests
start write there, the project's offline inputs are still found, and a write into the real home is caught."""

import os
import subprocess
import sys
from pathlib import Path

import isolated_home

REAL_HOME = Path(os.environ[isolated_home.OWNER_MARK])


def test_home_and_caches_point_away_from_the_real_home_in_subprocesses_too():
    code = ("import os, pathlib, huggingface_hub.constants as c, datasets.config as d; "
            "print(pathlib.Path.home(), c.HF_HOME, c.HF_HUB_CACHE, d.HF_DATASETS_CACHE, d.HF_MODULES_CACHE, "
            "os.environ['MPLCONFIGDIR'], os.environ['IPYTHONDIR'], os.environ['WANDB_DIR'], sep='\\n')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    folders = [Path(line) for line in out.stdout.splitlines()]
    assert len(folders) == 8 and Path(os.environ["HOME"]) == folders[0] != REAL_HOME
    for folder in folders:
        assert folder.is_relative_to(folders[0]), folder


def test_the_project_caches_files_are_all_readable_from_the_temporary_cache():
    from hif8qat.runs.downloads import cache_root

    real = Path(os.environ[isolated_home.REAL_CACHE_MARK])
    assert cache_root() != real and not cache_root().is_relative_to(REAL_HOME)
    for folder, _, files in os.walk(real):
        for name in files:
            rel = (Path(folder) / name).relative_to(real)
            assert (cache_root() / rel).resolve() == (real / rel).resolve(), rel


def test_a_new_or_rewritten_file_under_the_home_is_reported_and_unrelated_ones_are_not(tmp_path):
    home = tmp_path / "home"
    for rel in (".cache/huggingface/hub/a", ".config/matplotlib/old", ".cache/pip/wheel", "notes.txt"):
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text("x")
    before = isolated_home.snapshot(home)
    os.utime(home / ".config/matplotlib/old", ns=(0, 0))  # rewritten
    for rel in (".cache/huggingface/modules/transformers_modules/m.py", ".ipython/profile_default/h.sqlite",
                ".cache/newtool/x", ".cache/pip/http/y", ".bash_history"):
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text("y")
    assert isolated_home.appeared(before, isolated_home.snapshot(home)) == [
        ".cache/huggingface/modules", ".cache/huggingface/modules/transformers_modules",
        ".cache/huggingface/modules/transformers_modules/m.py", ".cache/newtool", ".config/matplotlib/old",
        ".ipython", ".ipython/profile_default", ".ipython/profile_default/h.sqlite"]
