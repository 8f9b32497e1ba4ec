"""Provenance: what every result file records so a number can be traced to the code that made it (git commit,
package versions, host, time) and a time to the machine that measured it (its CPU and the features that set its
GEMM speed: a step takes 2 s on a CPU with AMX and 5 s on one with AVX2 only)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

_TRACKED_PACKAGES = ("torch", "transformers", "lm_eval", "datasets", "hydra-core", "en_dtypes", "numpy", "hif8qat")

# The CPU features that decide which GEMM kernels torch can run (x86: vector width, BF16 dot products, AMX tiles;
# Arm: NEON, SVE, BF16), as /proc/cpuinfo names them.
GEMM_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve", "bf16")


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


def cpu_facts(cpuinfo: str) -> dict[str, Any]:
    """The CPU's model and its GEMM features, from the text of Linux's /proc/cpuinfo (its first processor's entry;
    x86 says ``model name`` and ``flags``, Arm ``Features`` and, on some kernels, ``model name`` or ``Hardware``).

    Args:
        cpuinfo: the file's text ("" where there is none).

    Returns:
        ``{"cpu": model or None, "cpu_features": the present GEMM_FEATURES, in that order}``."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("hardware") or fields.get("cpu model") or None
    present = set((fields.get("flags") or fields.get("features") or "").split())
    return {"cpu": model, "cpu_features": [f for f in GEMM_FEATURES if f in present]}


def machine() -> dict[str, Any]:
    """The machine a result was measured on: its CPU (model, GEMM features), the cores this process may use, and
    the GPU where this process has started CUDA (not started for this: a CPU run on a GPU node records none).

    Returns:
        ``{"cpu", "cpu_features", "logical_cpus", "usable_cpus", "gpu"}``."""
    try:
        facts = cpu_facts(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        facts = cpu_facts("")
    facts["cpu"] = facts["cpu"] or platform.processor() or None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch = sys.modules.get("torch")  # not loaded: CUDA not started either (and not loaded for this)
    gpu = torch.cuda.get_device_name(torch.cuda.current_device()) if torch and torch.cuda.is_initialized() else None
    return {**facts, "logical_cpus": os.cpu_count(), "usable_cpus": usable, "gpu": gpu}


def provenance() -> dict[str, Any]:
    """What any result file records so a number can be traced to the code that made it.

    Returns:
        ``{git, versions, host, machine, time}``."""
    return {"git": git_commit(), "versions": package_versions(), "host": socket.gethostname(), "machine": machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
