"""The one base class for failures a user can act on, and the boundary that turns them into one line.

run.py prints such an error as ``error: <message>`` and exits with status 2 instead of a traceback, so every
module raises a subclass of RunError (with a message that names the setting or file and what to do) for
anything caused by the user's input, files on disk or the environment, and lets real bugs propagate.

What the world raises on bad input is not a RunError: a library's exception (pyarrow on a corpus with bad
lines, safetensors on truncated weights, transformers on a model folder without tokenizer files, wandb on an
unknown mode, lm-eval's assertions on settings it cannot honour) and the file system's errno values. The code
that hands user input to a library wraps the call in :func:`concerning` naming the setting or file; the
boundary (:func:`guarded`, in every entry point) maps what escapes through :func:`user_error` to one line
with the library's own message and that setting. Anything else stays a traceback: it is a bug to fix.
Nothing here imports a library: an exception's class is recognised by the module that defines it.
"""

from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Callable, Iterator

# The status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED_STATUS = 130


class RunError(RuntimeError):
    """A failure caused by input, files or environment, reported as ``error: <message>`` (exit status 2)."""


_ATTR = "_hif8qat_concerning"
# Libraries whose exceptions, raised while they read the user's input, are about that input.
_LIBRARIES = ("pyarrow", "datasets", "safetensors", "transformers", "tokenizers", "huggingface_hub", "wandb",
              "lm_eval", "torch", "yaml", "jinja2", "sentencepiece", "pydantic", "pydantic_core")
# Exception classes (package, class name) that only ever mean "this input is bad", wherever they escape from.
_INPUT_CLASSES = {("safetensors", "SafetensorError"), ("pyarrow", "ArrowInvalid"), ("pyarrow", "ArrowException"),
                  ("datasets", "DatasetGenerationError"), ("wandb", "UsageError"), ("wandb", "Error")}
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


@contextlib.contextmanager
def concerning(what: str, libraries: tuple[str, ...] | None = None) -> Iterator[None]:
    """Exceptions a library raises inside the block concern ``what`` (``data.source=...``, a file): the
    boundary names it with the library's message. The innermost block's name wins. ``libraries``: only those
    libraries' exceptions (a block that also runs the model leaves torch's errors to be bugs)."""
    try:
        yield
    except Exception as err:
        if (not isinstance(err, RunError) and getattr(err, _ATTR, None) is None
                and (libraries is None or _raised_in_library(err) in libraries)):
            with contextlib.suppress(AttributeError, TypeError):  # a few C exceptions take no attributes
                setattr(err, _ATTR, what)
        raise


def _input_class(cls: type) -> bool:
    return (cls.__module__.split(".")[0], cls.__name__) in _INPUT_CLASSES


def _raised_in_library(err: BaseException) -> str | None:
    """The library the exception came from: its class's package, else that of the innermost frame (lm-eval
    raises a bare AssertionError, transformers an OSError), None for this project's code or the standard
    library."""
    for cls in type(err).__mro__:
        top = cls.__module__.split(".")[0].removesuffix("_rust")
        if top in _LIBRARIES:
            return top
    tb, module = err.__traceback__, None
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "") or module
        tb = tb.tb_next
    top = (module or "").split(".")[0]
    return top if top in _LIBRARIES else None


def one_line(text: str, limit: int = 600) -> str:
    line = "; ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return line if len(line) <= limit else line[:limit] + " ..."


def library_message(err: BaseException) -> str:
    """``Type: message`` of the exception and of the library error that caused it (datasets wraps pyarrow's)."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = one_line(str(err))
        parts.append(f"{type(err).__name__}: {text}" if text else type(err).__name__)
        err = err.__cause__ or (err.__context__ if not err.__suppress_context__ else None)
    return " <- ".join(parts[:3])


def user_error(err: BaseException) -> str | None:
    """The one-line message for an exception the user can act on; None for a bug (left a traceback)."""
    if isinstance(err, RunError):
        return str(err)
    if isinstance(err, OSError):
        from hif8qat.files import storage_error

        mapped = storage_error(err)
        if mapped is not None:
            return str(mapped)
        if err.errno in _PATH_ERRNOS:
            where = err.filename or getattr(err, _ATTR, None) or "a path"
            return f"cannot use {where}: {err.strerror or library_message(err)}; {_PATH_ERRNOS[err.errno]}"
    what = getattr(err, _ATTR, None)
    by_class = any(_input_class(cls) for cls in type(err).__mro__)
    library = _raised_in_library(err)
    if by_class or (what is not None and library is not None):
        where = f"{what}: " if what else ""
        return f"{where}{library or type(err).__module__.split('.')[0]} refused it: {library_message(err)}"
    return None


def guarded(job: Callable[[], object], *, stream=None) -> int:
    """The exception boundary of an entry point: run ``job``; a failure the user can act on (user_error)
    becomes one ``error:`` line and status 2, Ctrl-C one ``interrupted`` line and status 130; anything else
    propagates as a traceback."""
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
