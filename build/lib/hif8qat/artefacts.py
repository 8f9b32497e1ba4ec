"""The one reader of the project's own artefacts read back from a run folder (results, samples, held-out tokens
and summary, run_info, configs).

Each reader parses the whole file, checks its top-level type, checks the sha256 where one was recorded when
the file was written, and on any failure raises :class:`CorruptArtefact` naming the file, what is wrong and
what to run to write it again. A caller that can redo the work (stage=eval) catches it and redoes; one that
cannot (the report) lets it reach the user as an ``error:`` line. Nothing here imports torch.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import yaml

from hif8qat.errors import RunError
from hif8qat.files import sha256_file


class CorruptArtefact(RunError):
    """A project file that is truncated, edited or not what its writer wrote."""

    def __init__(self, path: str | Path, why: str, redo: str):
        super().__init__(f"{path} is unreadable ({why}); it was truncated or edited. {redo}")
        self.path, self.why = Path(path), why


def verify_sha256(path: str | Path, expected: str | None, redo: str) -> None:
    """The file's sha256 equals the one recorded when it was written (no check when none was recorded)."""
    if expected is None:
        return
    try:
        got = sha256_file(path)
    except OSError as err:
        raise CorruptArtefact(path, f"{type(err).__name__}: {err}", redo) from None
    if got != expected:
        raise CorruptArtefact(path, f"sha256 {got[:12]}... differs from the {expected[:12]}... recorded when it "
                                    "was written", redo)


def _text(path: Path, redo: str) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CorruptArtefact(path, f"{type(err).__name__}: {str(err)[:200]}", redo) from None


def _check_type(path: Path, value: Any, expect: type | None, redo: str) -> Any:
    if expect is not None and not isinstance(value, expect):
        raise CorruptArtefact(path, f"a JSON/YAML {type(value).__name__} where a {expect.__name__} belongs", redo)
    return value


def read_json(path: str | Path, redo: str, *, expect: type | None = dict, sha256: str | None = None) -> Any:
    path = Path(path)
    verify_sha256(path, sha256, redo)
    try:
        value = json.loads(_text(path, redo))
    except json.JSONDecodeError as err:
        raise CorruptArtefact(path, f"JSONDecodeError: {err}", redo) from None
    return _check_type(path, value, expect, redo)


def read_yaml(path: str | Path, redo: str, *, expect: type | None = dict) -> Any:

    path = Path(path)
    try:  # libyaml's loader when built: the pure-Python one dominates a report over dozens of runs
        value = yaml.load(_text(path, redo), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as err:
        raise CorruptArtefact(path, f"YAMLError: {str(err)[:200]}", redo) from None
    return _check_type(path, value, expect, redo)


def read_csv(path: str | Path, redo: str, *, sha256: str | None = None, dtype: dict | None = None):
    """A CSV table as a DataFrame, refused when empty, when a row has more or fewer fields than the header
    (pandas would pad a row cut mid-line with NaN) or when the last line has no newline (a cut file)."""
    import pandas as pd

    path = Path(path)
    verify_sha256(path, sha256, redo)
    text = _text(path, redo)
    if not text.strip():
        raise CorruptArtefact(path, "an empty file", redo)
    if not text.endswith("\n"):
        raise CorruptArtefact(path, "its last line is cut (no final newline)", redo)
    rows = list(csv.reader(io.StringIO(text, newline="")))
    width = len(rows[0])
    bad = next((i for i, row in enumerate(rows[1:], 2) if len(row) != width), None)
    if bad is not None:
        raise CorruptArtefact(path, f"line {bad} has {len(rows[bad - 1])} fields, the header {width}", redo)
    return pd.read_csv(io.StringIO(text), dtype=dtype)
