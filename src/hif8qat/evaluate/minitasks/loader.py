"""Dataset loader used by the mini-task YAMLs (``custom_dataset: !function loader.load_local_json``).

lm-eval hands ``dataset_kwargs`` to this function. ``datasets`` would resolve the relative
``data_files`` in the YAML against the current working directory; here they are resolved against this
folder instead, so the tasks work from any directory and from an installed package.
"""

from __future__ import annotations

import json
from pathlib import Path

from hif8qat.errors import RunError

HERE = Path(__file__).resolve().parent


def resolve_data_files(data_files: dict[str, str]) -> dict[str, str]:
    """Data file paths relative to this folder made absolute.

    Args:
        data_files: split -> path (relative to the minitasks folder, or absolute).

    Returns:
        Split -> absolute path.

    Raises:
        FileNotFoundError: a missing file (the message says how to regenerate it)."""
    out = {}
    for split, rel in data_files.items():
        p = Path(rel)
        p = p if p.is_absolute() else HERE / p
        if not p.exists():
            raise FileNotFoundError(
                f"mini-task data file {p} is missing; "
                "regenerate it with `python -m hif8qat.evaluate.minitasks.generate`"
            )
        out[split] = str(p)
    return out


REBUILD = ("rebuild the task data with `python -m hif8qat.evaluate.minitasks.generate` (it rewrites data/ from "
           "facts/), or restore the file from the package")


def check_records(path: Path) -> None:
    """Refuse a data file that holds a line that is not a whole JSON record (a file cut mid-record, or edited by
    hand): datasets' own error names neither the file nor the line.

    Args:
        path: the data file.

    Raises:
        RunError: naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise RunError(f"mini-task data file {path} cannot be read ({err}); {REBUILD}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            record = err
        if not isinstance(record, dict):
            why = f"{record.msg} at column {record.colno}" if isinstance(record, json.JSONDecodeError) else \
                f"a JSON {type(record).__name__}, not a record"
            raise RunError(f"mini-task data file {path}, line {number}, is not a whole JSON record ({why}): the "
                           f"file is cut or edited; {REBUILD}")


def load_local_json(data_files: dict[str, str] | None = None, **_ignored):
    """The loader lm-eval's mini-task YAMLs name (``custom_dataset``): the JSON-lines splits, checked.

    Args:
        data_files: split -> path, from the YAML's ``dataset_kwargs``.
        **_ignored: lm-eval's other arguments.

    Returns:
        The datasets.DatasetDict.

    Raises:
        ValueError: the YAML sets no data_files."""
    import datasets  # lazy: lm-eval calls this only when it builds a mini task

    if not data_files:
        raise ValueError("mini task YAML must set dataset_kwargs.data_files")
    files = resolve_data_files(data_files)
    for path in files.values():
        check_records(Path(path))
    try:
        return datasets.load_dataset("json", data_files=files)
    except Exception as err:  # the files are whole (checked above): what failed is the cache of their tables
        cache = Path(datasets.config.HF_DATASETS_CACHE) / "json"
        raise RunError(f"the datasets cache of the mini-task data ({', '.join(files.values())}) cannot be read "
                       f"({type(err).__name__}: {str(err)[:300]}): it is corrupt or was cut while written. Remove "
                       f"{cache} (datasets rebuilds it from the data files on the next run) and run again") from err
