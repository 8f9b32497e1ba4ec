"""The test session's own home: HOME and every cache the libraries write point into one temporary folder, and
the real home is checked at the end for anything that appeared there anyway.

The first pytest process (the controller under pytest-xdist) makes the folder and exports it through
``os.environ``, before torch, transformers, datasets, matplotlib or wandb are imported; xdist workers and the
subprocesses tests launch inherit it and reuse it instead of making their own. The project cache's files (the
offline SmolLM2 weights and benchmark data that ``make venv`` installs, the token caches) are linked into the
temporary cache file by file: tests read the same inputs as before, and whatever they write lands beside the
links (writes go through an atomic rename, which replaces a link, never its target).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Set by the session that owns the temporary home; a process that finds it set reuses that home.
OWNER_MARK = "HIF8QAT_TESTS_REAL_HOME"
REAL_CACHE_MARK = "HIF8QAT_TESTS_REAL_CACHE"  # the project cache whose files are linked in

# Where the libraries the tests use would write under the real home: walked at session start and end. The whole
# home is not walked: it can be large, and other programs write into it concurrently (pip's cache, browsers,
# editors); a new top-level entry, or a new entry directly in ~/.cache, ~/.config or ~/.local/share, still counts.
WATCHED_TREES = (".cache/huggingface", ".cache/hif8qat", ".cache/matplotlib", ".cache/torch", ".cache/wandb",
                 ".cache/triton", ".config/matplotlib", ".config/wandb", ".ipython", ".jupyter",
                 ".local/share/jupyter", ".triton", ".keras", ".nv")
WATCHED_LISTINGS = ("", ".cache", ".config", ".local/share")
# Written by interactive shells and pip's own cache concurrently with a run: never by a test.
IGNORED = {".bash_history", ".python_history", ".lesshst", ".viminfo", ".cache/pip"}


def project_cache(environ=os.environ) -> Path:
    """The project cache as the library finds it (``$HIF8QAT_CACHE`` or ``~/.cache/hif8qat``)."""
    env = environ.get("HIF8QAT_CACHE")
    return Path(env).expanduser() if env else Path(environ.get("HOME", str(Path.home()))) / ".cache" / "hif8qat"


def link_tree(source: Path, dest: Path) -> None:
    """Recreate ``source``'s folders under ``dest`` with a symbolic link for each file (nothing is copied)."""
    for folder, _, files in os.walk(source):
        target = dest / Path(folder).relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            (target / name).symlink_to(Path(folder) / name)


def redirect(environ=os.environ) -> Path | None:
    """Point HOME and the caches at a new temporary folder, unless an enclosing session already did; link the
    project cache's files into it. Returns the temporary folder when this process owns it, else None."""
    if OWNER_MARK in environ:
        return None
    real_home = Path(environ.get("HOME", str(Path.home())))
    cache = project_cache(environ)
    root = Path(tempfile.mkdtemp(prefix="hif8qat-tests-home-"))
    home = root / "home"
    home.mkdir()
    for name in (".gitconfig",):  # read by git (user name, safe directories); a copy, so the real one stays put
        if (real_home / name).is_file():
            shutil.copy2(real_home / name, home / name)
    if cache.is_dir():
        link_tree(cache, root / "hif8qat-cache")
    pip_conf = real_home / ".config" / "pip" / "pip.conf"
    if "PIP_CONFIG_FILE" not in environ and pip_conf.is_file():
        environ["PIP_CONFIG_FILE"] = str(pip_conf)  # the user's package index (read only)
    # Variables that name a folder override HOME's defaults: each is set, so a user's own setting (which may
    # lie in their home) is not written either. The torch compile caches default to the system temp folder,
    # outside the home, and are kept there so compiled kernels stay warm across sessions.
    environ.update({
        OWNER_MARK: str(real_home), REAL_CACHE_MARK: str(cache), "HOME": str(home),
        "HIF8QAT_CACHE": str(root / "hif8qat-cache"),
        "XDG_CACHE_HOME": str(home / ".cache"), "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"), "XDG_STATE_HOME": str(home / ".local" / "state"),
        "HF_HOME": str(home / ".cache" / "huggingface"),
        "HF_DATASETS_CACHE": str(home / ".cache" / "huggingface" / "datasets"),
        "MPLCONFIGDIR": str(home / ".config" / "matplotlib"), "IPYTHONDIR": str(home / ".ipython"),
        "JUPYTER_CONFIG_DIR": str(home / ".jupyter"), "JUPYTER_DATA_DIR": str(home / ".local" / "share" / "jupyter"),
        "TORCH_HOME": str(home / ".cache" / "torch"), "WANDB_DIR": str(home / "wandb"),
        "WANDB_CACHE_DIR": str(home / ".cache" / "wandb"), "WANDB_CONFIG_DIR": str(home / ".config" / "wandb"),
        "WANDB_DATA_DIR": str(home / ".local" / "share" / "wandb"),
    })
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE",
                 "HF_ASSETS_CACHE", "HF_XET_CACHE"):
        environ.pop(name, None)  # each defaults to a folder under HF_HOME
    return root


def snapshot(home: Path) -> dict[str, int]:
    """The watched part of ``home``: each path (relative) with its modification time in ns (-1 for folders)."""
    seen: dict[str, int] = {}

    def add(path: Path) -> None:
        rel = path.relative_to(home).as_posix()
        if rel in IGNORED:
            return
        try:
            seen[rel] = -1 if path.is_dir() else path.lstat().st_mtime_ns
        except OSError:  # removed meanwhile
            pass

    for listing in WATCHED_LISTINGS:
        if (home / listing).is_dir():
            for entry in (home / listing).iterdir():
                add(entry)
    for tree in WATCHED_TREES:
        for folder, dirs, files in os.walk(home / tree):
            for name in dirs + files:
                add(Path(folder) / name)
    return seen


def appeared(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Paths new in ``after`` or whose file was rewritten since ``before``, sorted."""
    return sorted(p for p, mtime in after.items() if p not in before or (mtime != -1 and before[p] != mtime))
