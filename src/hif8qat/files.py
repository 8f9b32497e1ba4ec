"""Small file helpers shared by checkpoints, the evaluation data, the runs and the report.

Atomic writes: every file a reader may open while a run is killed (run records, caches, results, exports)
is written to a temporary file in the same folder, flushed to disk and renamed over the old one, so a
reader sees either the old file or the new one, never half of one. The same folder keeps the rename on
one file system, where ``os.replace`` is atomic.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20
_FILE_MODE = 0o644  # mkstemp creates 0600; a result or cache file is as readable as any other


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks (hashlib.file_digest needs Python 3.11; the project supports 3.10)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; on a clean exit it replaces ``path`` atomically.

    The caller writes and closes the temporary file inside the block (any writer that takes a path or an
    open file: ``np.save``, ``safetensors.save_file``...). An exception in the block removes the temporary
    file and leaves ``path`` as it was. The parent folder is created when missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync_path(tmp)  # the data reaches the disk before the rename publishes it
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:  # a kill (KeyboardInterrupt, SystemExit) must not leave a stray temp file either
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename itself made durable; best effort (not on every platform)
        _fsync_path(path.parent, directory=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> None:
    """Atomically replace ``path`` with ``text``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)


def write_json(path: str | os.PathLike, payload: Any, **dumps_kwargs: Any) -> None:
    """Atomically replace ``path`` with ``payload`` as JSON (``json.dumps`` options; a final newline)."""
    write_text(path, json.dumps(payload, **dumps_kwargs) + "\n")
