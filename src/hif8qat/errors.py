"""The one base class for failures a user can act on, and the boundary that turns them into one line.

run.py prints such an error as ``error: <message>`` and exits with status 2, so every module raises a
subclass of RunError (with a message that names the setting or file and what to do) for anything caused by
the user's input, files on disk or the environment, and lets real bugs propagate.

What a library raises on bad input (pyarrow on a corpus with bad lines, safetensors on truncated weights) is
not a RunError: the code that hands user input to a library wraps the call in :func:`concerning` naming the
setting or file, and the boundary (:func:`hif8qat.boundary.guarded`) maps what escapes to one line with the
library's own message and that setting. Nothing here imports a library: an exception's class is recognised by
the module that defines it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

# The status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED_STATUS = 130


class RunError(RuntimeError):
    """A failure caused by input, files or environment, reported as ``error: <message>`` (exit status 2)."""


# What the pipeline's modules import when they load (the 'pipeline' extra of pyproject.toml, by import name);
# the library (import hif8qat) needs torch and numpy only.
PIPELINE_IMPORTS = ("yaml", "omegaconf", "hydra", "pandas", "scipy", "transformers", "tokenizers", "huggingface_hub",
                    "sentencepiece", "tqdm")
PIPELINE_INSTALL = "pip install 'hif8qat[pipeline]'"


@functools.cache
def _missing_pipeline_imports() -> tuple[str, ...]:
    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # a finder that refuses it, or a module set to None
            return True

    return tuple(m for m in PIPELINE_IMPORTS if absent(m))


def require_pipeline_extra(package: str) -> None:
    """ImportError naming the install line when ``package`` (a pipeline subpackage, being imported) would fail
    on a library of the 'pipeline' extra that is not installed (found without importing it).

    Args:
        package: the subpackage being imported.

    Raises:
        ImportError: a library of the extra is missing.
    """
    missing = _missing_pipeline_imports()
    if missing:
        raise ImportError(f"{package} is part of the hif8qat pipeline, which needs the 'pipeline' extra "
                          f"({', '.join(missing)} not installed): {PIPELINE_INSTALL}. The library API "
                          "(import hif8qat) needs only torch and numpy.")


CONCERNING = "_hif8qat_concerning"
# Libraries whose exceptions, raised while they read the user's input, are about that input.
_LIBRARIES = ("pyarrow", "datasets", "safetensors", "transformers", "tokenizers", "huggingface_hub", "wandb",
              "lm_eval", "torch", "yaml", "jinja2", "sentencepiece", "pydantic", "pydantic_core")
# Exception classes (package, class name) that only ever mean "this input is bad", wherever they escape from.
_INPUT_CLASSES = {("safetensors", "SafetensorError"), ("pyarrow", "ArrowInvalid"), ("pyarrow", "ArrowException"),
                  ("datasets", "DatasetGenerationError"), ("wandb", "UsageError"), ("wandb", "Error")}
@contextlib.contextmanager
def concerning(what: str, libraries: tuple[str, ...] | None = None) -> Iterator[None]:
    """Exceptions a library raises inside the block concern ``what`` (``data.source=...``, a file): the
    boundary names it with the library's message. The innermost block's name wins. ``libraries``: only those
    libraries' exceptions (a block that also runs the model leaves torch's errors to be bugs).

    Args:
        what: the setting or file, as the user wrote it.
        libraries: only these libraries' exceptions (a block that also runs the model leaves torch's errors to
            be bugs); default all.
    """
    try:
        yield
    except Exception as err:
        if (not isinstance(err, RunError) and getattr(err, CONCERNING, None) is None
                and (libraries is None or raised_in_library(err) in libraries)):
            with contextlib.suppress(AttributeError, TypeError):  # a few C exceptions take no attributes
                setattr(err, CONCERNING, what)
        raise


def input_class(cls: type) -> bool:
    """Whether an exception class is one a library raises for bad input (recognised by its module and name).

    Args:
        cls: the exception class.

    Returns:
        True for such a class.
    """
    return (cls.__module__.split(".")[0], cls.__name__) in _INPUT_CLASSES


def raised_in_library(err: BaseException) -> str | None:
    """The library the exception came from: its class's package, else that of the innermost frame (lm-eval
    raises a bare AssertionError, transformers an OSError), None for this project's code or the standard
    library.

    Args:
        err: the exception.

    Returns:
        The library's top-level package, or None.
    """
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
    """The text on one line (its lines joined by "; "), cut at ``limit`` characters.

    Args:
        text: the text.
        limit: the longest line kept whole.

    Returns:
        The line.
    """
    line = "; ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return line if len(line) <= limit else line[:limit] + " ..."


def library_message(err: BaseException) -> str:
    """``Type: message`` of the exception and of the library error that caused it (datasets wraps pyarrow's).

    Args:
        err: the exception.

    Returns:
        The message.
    """
    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = one_line(str(err))
        parts.append(f"{type(err).__name__}: {text}" if text else type(err).__name__)
        err = err.__cause__ or (err.__context__ if not err.__suppress_context__ else None)
    return " <- ".join(parts[:3])
