"""pip's configuration as ``uv pip install`` arguments, so that uv installs the files pip would.

``tools/build_env.sh`` installs the pinned requirements with uv (seconds instead of minutes), but uv reads none
of pip's configuration: on a machine whose pip finds torch's CPU build through ``find-links`` or an extra index,
uv alone would take PyPI's CUDA build. This script reads the configuration pip would use (``pip config list``:
its files and its ``PIP_*`` variables) and prints the same sources as uv arguments, shell-quoted, with pip's way
of choosing among indexes (the best version across all of them). A setting that changes what gets installed and
has no uv counterpart here makes it exit 3 with its name, and the build uses pip.

    python tools/uv_config.py          # e.g. --index-strategy unsafe-best-match --find-links /opt/wheels

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

# pip's sections an install reads, lowest priority first (a PIP_* variable overrides both files' values)
SECTIONS = ("global", "install", ":env:")
# settings that choose where packages come from, and their uv flags (several values: one flag each)
SOURCES = {"index-url": "--default-index", "extra-index-url": "--index", "find-links": "--find-links",
           "constraint": "--constraint"}
# settings that only say how pip talks or prints: they do not change which files are installed
HARMLESS = {"cert", "client-cert", "default-timeout", "timeout", "retries", "disable-pip-version-check",
            "progress-bar", "quiet", "verbose", "no-cache-dir", "cache-dir", "root-user-action",
            "break-system-packages", "no-input", "trusted-host", "proxy", "require-virtualenv", "no-color", "log",
            "exists-action", "keyring-provider", "config-file"}  # config-file: PIP_CONFIG_FILE, whose values are listed


class Unsupported(ValueError):
    """pip's configuration holds a setting that changes what is installed and that this translation lacks."""


def pip_settings(listing: str) -> dict[str, str]:
    """The value of each setting an install uses, from ``pip config list``'s lines (``section.key='value'``).

    Args:
        listing: ``pip config list``'s output.

    Returns:
        ``{key: value}``, a PIP_* variable's value over the ``install`` section's over ``global``'s."""
    found: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, sep, raw = line.partition("=")
        section, dot, key = name.strip().rpartition(".")
        if not sep or not dot or section not in SECTIONS:
            continue
        value = raw.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        rank = SECTIONS.index(section)
        if key not in found or rank >= found[key][0]:
            found[key] = (rank, value)
    return {key: value for key, (_, value) in found.items()}


def _usable(location: str) -> bool:
    """A location pip would read: a ``file://`` one only if it exists (pip warns and skips the others, uv fails)."""
    if location.startswith("file://"):
        return Path(location[len("file://"):]).exists()
    return "://" in location or Path(location).exists()  # a remote index is for the installer to reach


def uv_arguments(settings: dict[str, str]) -> list[str]:
    """``uv pip install`` arguments that install from the sources pip's settings name, chosen as pip chooses.

    Args:
        settings: pip's settings (:func:`pip_settings`).

    Returns:
        The arguments.

    Raises:
        Unsupported: a setting changes what pip installs and has no translation here."""
    args = ["--index-strategy", "unsafe-best-match"]  # pip takes the best version across every index
    for key, value in sorted(settings.items()):
        if key in HARMLESS:
            continue
        if key == "no-index":
            if value.lower() in ("1", "true", "yes", "on"):
                args.append("--no-index")
            continue
        if key not in SOURCES:
            raise Unsupported(f"pip's configuration sets {key!r}, which this translation does not give uv")
        for location in value.split():  # a missing constraint file stays: pip fails on it, and so should uv
            if key == "constraint" or _usable(location):
                args += [SOURCES[key], location]
    return args


def main() -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    try:
        print(shlex.join(uv_arguments(pip_settings(listing))))
    except Unsupported as err:
        print(f"uv_config: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
