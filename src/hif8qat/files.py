"""Small file helpers shared by checkpoints, the evaluation data, the runs and the report.

Atomic writes: every file a reader may open while a run is killed (run records, caches, results, exports)
is written to a temporary file in the same folder, flushed to disk and renamed over the old one, so a
reader sees either the old file or the new one, never half of one. The same folder keeps the rename on
one file system, where ``os.replace`` is atomic.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hif8qat.errors import RunError

_CHUNK = 1 << 20
# A write that fails for the disk, not the code: full, over quota, read-only, or not ours to write.
_STORAGE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
                   errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                   errno.EPERM: "operation not permitted"}


class StorageError(RunError):
    """A write the disk refused (full, over quota, read-only): named with the folder and its free space."""

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(message)
        self.errno = errno_  # as OSError's, so checkpoint.is_disk_full recognises a full disk through it


def free_space(path: str | os.PathLike) -> int | None:
    """Free bytes on the disk holding ``path`` (its nearest existing parent), None when it cannot be known.

    Args:
        path: a file or folder, existing or not.

    Returns:
        The bytes, or None.
    """
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human_bytes(n: float | None, binary: bool = False) -> str:
    """A byte count in decimal units (``"12.3 MB"``; ``"unknown"`` for None), or binary ones (``"1.5 GiB"``) as
    memory is counted.

    Args:
        n: the count, or None.
        binary: steps of 1024 and units KiB, MiB, GiB, TiB.

    Returns:
        The text.
    """
    if n is None:
        return "unknown"
    step, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "kB", "MB", "GB", "TB"))
    for unit in units[:-1]:
        if abs(n) < step:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= step
    return f"{n:.1f} {units[-1]}"


def storage_error(err: BaseException, where: str | os.PathLike | None = None) -> StorageError | None:
    """The StorageError for an OSError the disk caused (None for any other error: that one is a bug or has
    its own handler). ``where``: the file being written when the error does not name one.

    Args:
        err: the exception.
        where: the file being written, when the error does not name one.

    Returns:
        The StorageError, or None.
    """
    if not isinstance(err, OSError) or err.errno not in _STORAGE_ERRNOS:
        return None
    target = Path(err.filename if err.filename else where or ".")
    folder = target if target.is_dir() else target.parent
    return StorageError(f"cannot write {target}: {_STORAGE_ERRNOS[err.errno]} ({folder} has "
                        f"{human_bytes(free_space(folder))} free). Free space there or make it writable (or "
                        "point results_root / HIF8QAT_CACHE elsewhere), then rerun the same command: finished "
                        "steps are kept", err.errno)


@contextlib.contextmanager
def storage_errors(where: str | os.PathLike) -> Iterator[None]:
    """Turn a disk's refusal inside the block into a StorageError naming ``where`` and its free space.

    Args:
        where: the file or folder being written.
    """
    try:
        yield
    except OSError as err:
        mapped = storage_error(err, where)
        if mapped is None:
            raise
        raise mapped from None
def file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file under this process's umask (mkstemp's 0600 would
    hide a result from the group a user shares it with; a fixed 0644 would show it to users a umask of 077
    hides it from). Linux states the umask in /proc; elsewhere it is read by setting it and back.

    Returns:
        The mode bits.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks (hashlib.file_digest needs Python 3.11; the project supports 3.10).

    Args:
        path: the file.

    Returns:
        The hex digest.
    """
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

    Args:
        path: the file to replace.

    Yields:
        The temporary path.
    """
    path = Path(path)
    with storage_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        with storage_errors(path):
            yield tmp
            _fsync_path(tmp)  # the data reaches the disk before the rename publishes it
            os.chmod(tmp, file_mode())
            os.replace(tmp, path)
    except BaseException:  # a kill (KeyboardInterrupt, SystemExit) must not leave a stray temp file either
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename itself made durable; best effort (not on every platform)
        _fsync_path(path.parent, directory=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``.

    Args:
        path: the file.
        data: its new contents.
    """
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> None:
    """Atomically replace ``path`` with ``text``.

    Args:
        path: the file.
        text: its new contents.
        encoding: the text's encoding.
    """
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)


def write_json(path: str | os.PathLike, payload: Any, **dumps_kwargs: Any) -> None:
    """Atomically replace ``path`` with ``payload`` as JSON (``json.dumps`` options; a final newline).

    Args:
        path: the file.
        payload: a JSON-serialisable value.
        **dumps_kwargs: ``json.dumps`` options.
    """
    write_text(path, json.dumps(payload, **dumps_kwargs) + "\n")


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` to a log (metrics.jsonl); a full or read-only disk is a StorageError naming the file.
    A log that a resume can repeat is made idempotent by its reader-side repair (trainlog.truncate_metrics).

    Args:
        path: the log.
        text: the lines to append.
    """
    path = Path(path)
    with storage_errors(path), path.open("a", encoding="utf-8") as fh:
        fh.write(text)


def replace_step_records(path: str | os.PathLike, lines: list[str]) -> None:
    """Write JSON lines (each a record with a "step") into a log, replacing the lines of those steps already
    there, atomically: rerunning a step (a resume) leaves the file exactly as one run of it would.

    Args:
        path: the log.
        lines: the JSON lines to write.
    """
    path = Path(path)
    steps = {json.loads(line).get("step") for line in lines}
    kept = []
    if path.exists():
        old = path.read_text(encoding="utf-8", errors="replace").splitlines()
        last = max((i for i, line in enumerate(old) if line.strip()), default=-1)
        for i, line in enumerate(old):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                if i == last:
                    continue  # the torn last line of a killed writer: its step's records are written again below
                raise RunError(f"{path} is unreadable (line {i + 1} does not parse and is not the last line, so "
                               "it was not cut by a killed writer). Repair or delete that line, or start the run "
                               "over with force=true") from None
            if isinstance(record, dict) and record.get("step") not in steps:
                kept.append(line)
    write_text(path, "".join(line + "\n" for line in kept + list(lines)))


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs: Any) -> None:
    """``fig.savefig`` through a temporary file, so a failed save (a full disk) leaves the old figure whole.

    Args:
        fig: a matplotlib figure.
        path: the image file.
        **savefig_kwargs: ``savefig`` options.
    """
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **savefig_kwargs)


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot serve as a folder this process writes into (None when it can): it, or the nearest
    part of it that exists, is a file, or is not writable (a read-only mount, permissions).

    Args:
        path: the folder, existing or not.

    Returns:
        The reason, or None.
    """
    path = Path(path).expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        if probe.is_symlink():  # exists() follows links: a dangling one or a loop reads as absent, yet mkdir fails
            return f"{probe} is a symbolic link to {os.readlink(probe)}, which does not exist (or loops)"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable (read-only or not yours)"
    return None
