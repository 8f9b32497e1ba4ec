"""The exception boundary of every entry point (run.py, ``python -m hif8qat.report``, ``python -m
hif8qat.evaluate``): a failure the user can act on is one ``error:`` line and status 2, Ctrl-C one
``interrupted`` line and status 130, anything else a traceback (see :mod:`hif8qat.errors`)."""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable

from hif8qat.errors import (
    CONCERNING,
    INTERRUPTED_STATUS,
    RunError,
    input_class,
    library_message,
    raised_in_library,
)
from hif8qat.files import storage_error

# errno values that name a path the user chose (results_root, run_tag, a cache folder) and what to do.
_PATH_ERRNOS = {
    errno.EEXIST: "something that is not a folder is in the way (a file, or a symlink to nothing): remove it, or "
                  "point the setting that names it (results_root, data.cache_dir, HIF8QAT_CACHE) elsewhere",
    errno.ELOOP: "the path runs through a loop of symlinks: fix the links, or point the setting that names it "
                 "(results_root, data.cache_dir, HIF8QAT_CACHE) elsewhere",
    errno.ENAMETOOLONG: "a name in the path is longer than the file system allows (usually 255 bytes): shorten "
                        "run_tag, results_root or the overrides that name the run folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "a folder is where a file belongs",
}


def user_error(err: BaseException) -> str | None:
    """The one-line message for an exception the user can act on; None for a bug (left a traceback).

    Args:
        err: the exception.

    Returns:
        The message, or None.
    """
    if isinstance(err, RunError):
        return str(err)
    if isinstance(err, OSError):
        mapped = storage_error(err)
        if mapped is not None:
            return str(mapped)
        if err.errno in _PATH_ERRNOS:
            where = err.filename or getattr(err, CONCERNING, None) or "a path"
            return f"cannot use {where}: {err.strerror or library_message(err)}; {_PATH_ERRNOS[err.errno]}"
    what = getattr(err, CONCERNING, None)
    by_class = any(input_class(cls) for cls in type(err).__mro__)
    library = raised_in_library(err)
    if by_class or (what is not None and library is not None):
        where = f"{what}: " if what else ""
        return f"{where}{library or type(err).__module__.split('.')[0]} refused it: {library_message(err)}"
    return None


def guarded(job: Callable[[], object], *, stream=None) -> int:
    """The exception boundary of an entry point: run ``job``; a failure the user can act on (user_error)
    becomes one ``error:`` line and status 2, Ctrl-C one ``interrupted`` line and status 130; anything else
    propagates as a traceback.

    Args:
        job: the entry point's work.
        stream: where the line goes (default stderr).

    Returns:
        Exit status: 0, 2 (a user error) or 130 (interrupted).
    """
    stream = stream or sys.stderr
    try:
        job()
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C): stopped; files are written atomically, so what finished is kept and an "
              "interrupted training resumes from its last checkpoint with the same command", file=stream)
        return INTERRUPTED_STATUS
    except Exception as err:
        message = user_error(err)
        if message is None:
            raise
        print(f"error: {message}", file=stream)
        return 2
    return 0
