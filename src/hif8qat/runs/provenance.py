"""Provenance: what every result file records so a number can be traced to the code that made it (git commit,
package versions, host, time)."""

from __future__ import annotations

import platform
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

_TRACKED_PACKAGES = ("torch", "transformers", "lm_eval", "datasets", "hydra-core", "en_dtypes", "numpy", "hif8qat")


def git_commit(repo: Path | None = None) -> dict[str, Any]:
    """The git commit of the code and whether tracked files differ from it.

    Args:
        repo: the repository (default: the one holding this package).

    Returns:
        ``{commit, dirty}``; both None outside a git checkout."""
    repo = repo or Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def package_versions() -> dict[str, str | None]:
    """The Python version and the tracked packages' versions.

    Returns:
        name -> version, None for a package not installed."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance() -> dict[str, Any]:
    """What any result file records so a number can be traced to the code that made it.

    Returns:
        ``{git, versions, host, time}``."""
    return {"git": git_commit(), "versions": package_versions(), "host": socket.gethostname(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
