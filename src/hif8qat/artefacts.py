"""The one reader of the project's own artefacts read back from a run folder (results, samples, held-out tokens
and summary, run_info, configs).

Each reader parses the whole file, checks its top-level type, checks the sha256 where one was recorded when
the file was written, and on any failure raises :class:`CorruptArtefact` naming the file, what is wrong and
what to run to write it again. A caller that can redo the work (stage=eval) catches it and redoes; one that
cannot (the report) lets it reach the user as an ``error:`` line. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from hif8qat.errors import RunError, require_pipeline_extra

require_pipeline_extra("hif8qat.artefacts")  # before yaml, so a library-only install is told what to install

import yaml  # noqa: E402

from hif8qat.files import sha256_file, write_json  # noqa: E402


class CorruptArtefact(RunError):
    """A project file that is truncated, edited or not what its writer wrote."""

    def __init__(self, path: str | Path, why: str, redo: str):
        super().__init__(f"{path} is unreadable ({why}); it was truncated or edited. {redo}")
        self.path, self.why = Path(path), why


# ---------------------------------------------------------------------------------------------------------
# Absent is unverified. A file whose integrity record is missing (results.json without _files, an export
# without its manifest, a manifest that leaves out a file that is there) cannot be told from an edited or
# corrupted copy, so every reader refuses it through the one rule below, unless the user opted in with
# trust_unverified=true; what was then accepted unverified is listed (accepted_unverified) for the report
# to name beside the numbers that came from it.
# ---------------------------------------------------------------------------------------------------------
TRUST_SETTING = "trust_unverified"
_TRUST: ContextVar[bool] = ContextVar("hif8qat_trust_unverified", default=False)
_ACCEPTED: ContextVar[dict[str, str] | None] = ContextVar("hif8qat_accepted_unverified", default=None)


class UnverifiedArtefact(RunError):
    """A project file (or folder) whose integrity record is missing or incomplete."""

    def __init__(self, path: str | Path, why: str, redo: str):
        super().__init__(f"{path} is unverified ({why}), so an edited or corrupted copy would go unnoticed; it is "
                         f"not used. {redo}; or set {TRUST_SETTING}=true to use it anyway (every number taken "
                         "from it is then marked unverified)")
        self.path, self.why = Path(path), why


@contextlib.contextmanager
def trusting_unverified(trust: bool) -> Iterator[dict[str, str]]:
    """Inside the block, files without a whole integrity record are accepted when ``trust`` is true; yields
    the map path -> why of those accepted (empty when trust is false: they were refused).

    Args:
        trust: the ``trust_unverified`` setting.

    Yields:
        Path -> why, for each file accepted unverified.
    """
    accepted: dict[str, str] = {}
    tokens = (_TRUST.set(bool(trust)), _ACCEPTED.set(accepted))
    try:
        yield accepted
    finally:
        _ACCEPTED.reset(tokens[1])
        _TRUST.reset(tokens[0])


def accepted_unverified() -> dict[str, str]:
    """What the current trusting_unverified block accepted unverified (path -> why).

    Returns:
        Path -> why.
    """
    return dict(_ACCEPTED.get() or {})


def unverified(path: str | Path, why: str, redo: str) -> None:
    """The one rule: a file without a whole integrity record is refused, or, trusted, accepted and listed.

    Args:
        path: the file or folder.
        why: what record is missing.
        redo: what the user does to make it again (the error's last sentence).

    Raises:
        UnverifiedArtefact: outside a trusting block.
    """
    if not _TRUST.get():
        raise UnverifiedArtefact(path, why, redo)
    accepted = _ACCEPTED.get()
    if accepted is not None:
        accepted.setdefault(str(path), why)


def require_record(subject: str | Path, recorded: Iterable[str] | None, present: Iterable[str], redo: str, *,
                   record: str) -> None:
    """``recorded`` (the names an integrity record lists, None when there is no record) covers every name in
    ``present`` (the files beside it); else the unverified rule for ``subject`` naming ``record``.

    Args:
        subject: the file or folder the record belongs to.
        recorded: the names the record lists, None when there is no record.
        present: the files beside it.
        redo: what the user does to make it again.
        record: the record's name (for the message).

    Raises:
        UnverifiedArtefact: a name is not covered, outside a trusting block.
    """
    if recorded is None:
        unverified(subject, f"it has no {record}", redo)
        return
    unlisted = sorted(set(present) - set(recorded))
    if unlisted:
        more = f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
        unverified(subject, f"its {record} does not list {unlisted[0]}{more}, which is there", redo)


def verify_sha256(path: str | Path, expected: str | None, redo: str) -> None:
    """The file's sha256 equals the one recorded when it was written (no check when none was recorded).

    Args:
        path: the file.
        expected: the recorded hex sha256, or None.
        redo: what the user does to make it again.

    Raises:
        CorruptArtefact: the digests differ.
    """
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


def read_json(path: str | Path, redo: str, *, expect: type | None = dict, sha256: str | None = None,
              schema: Any = None) -> Any:
    """The parsed file, of type ``expect``, following ``schema`` (:func:`schema_problem`) when given.

    Args:
        path: the file.
        redo: what the user does to make it again.
        expect: the type the top-level value must have (None: any).
        sha256: the recorded digest to check first, or None.
        schema: the schema the value must follow, or None.

    Returns:
        The value.

    Raises:
        CorruptArtefact: unreadable, not JSON, of another type or off the schema.
    """
    path = Path(path)
    verify_sha256(path, sha256, redo)
    try:
        value = json.loads(_text(path, redo))
    except json.JSONDecodeError as err:
        raise CorruptArtefact(path, f"JSONDecodeError: {err}", redo) from None
    value = _check_type(path, value, expect, redo)
    return value if schema is None else check_schema(path, value, schema, redo)


def read_yaml(path: str | Path, redo: str, *, expect: type | None = dict) -> Any:

    """The parsed YAML file, of type ``expect``.

    Args:
        path: the file.
        redo: what the user does to make it again.
        expect: the type the top-level value must have (None: any).

    Returns:
        The value.

    Raises:
        CorruptArtefact: unreadable, not YAML or of another type.
    """
    path = Path(path)
    try:  # libyaml's loader when built: the pure-Python one dominates a report over dozens of runs
        value = yaml.load(_text(path, redo), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as err:
        raise CorruptArtefact(path, f"YAMLError: {str(err)[:200]}", redo) from None
    return _check_type(path, value, expect, redo)


def read_csv(path: str | Path, redo: str, *, sha256: str | None = None, dtype: dict | None = None):
    """A CSV table as a DataFrame, refused when empty, when a row has more or fewer fields than the header
    (pandas would pad a row cut mid-line with NaN) or when the last line has no newline (a cut file).

    Args:
        path: the file.
        redo: what the user does to make it again.
        sha256: the recorded digest to check first, or None.
        dtype: column -> dtype, passed to pandas.

    Returns:
        The DataFrame.

    Raises:
        CorruptArtefact: empty, ragged or cut.
    """
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# What a record of each appended log must hold (a wrongly typed field is a corrupt file, not a row to plot).
METRICS_FIELDS = {"step": int, "loss": "number", "lr": "number", "grad_norm": "number?", "tokens": int,
                  "val_loss": "number"}
TELEMETRY_FIELDS = {"step": int}


def _field_problem(record: dict, fields: dict[str, Any]) -> str | None:
    for key, kind in fields.items():
        if key not in record:
            if key == "step":
                return "no step"
            continue
        value = record[key]
        if kind == "number?":
            ok = value is None or _is_number(value)
        elif kind == "number":
            ok = _is_number(value)
        else:
            ok = isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            return f"{key} is {value!r}, not {'a number' if 'number' in str(kind) else 'an integer'}"
    return None


def read_jsonl(path: str | Path, redo: str, *, fields: dict[str, Any] | None = None,
               note=None) -> list[dict]:
    """The records of an appended JSON-lines log (metrics.jsonl, telemetry dumps).

    A writer killed mid-line leaves its last line cut: that line alone is dropped (``note`` is told). A line
    that does not parse anywhere else, or a record that is not an object or has a wrongly typed field
    (``fields``: name -> int | "number" | "number?"), is a CorruptArtefact naming the file and line.

    Args:
        path: the log.
        redo: what the user does to make it again.
        fields: name -> type each record's field must have.
        note: called with a message when a cut last line is dropped.

    Returns:
        The records.
    """
    path = Path(path)
    lines = _text(path, redo).split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if i == last:  # the torn last line of a killed writer
                if note is not None:
                    note(f"{path}: dropped its cut last line {i + 1}")
                continue
            raise CorruptArtefact(path, f"line {i + 1} does not parse ({err.msg}) and is not the last line, so "
                                        "it was not cut by a killed writer", redo) from None
        problem = "not a JSON object" if not isinstance(record, dict) else _field_problem(record, fields or {})
        if problem:
            raise CorruptArtefact(path, f"line {i + 1}: {problem}", redo)
        records.append(record)
    return records


# The size and sha256 of every file of a folder written as a whole (the export), written last in it.
FOLDER_MANIFEST = "hif8qat_files.json"


def write_folder_manifest(folder: str | Path) -> None:
    """Record every file under ``folder`` (before it is published) for :func:`verify_folder_manifest`.

    Args:
        folder: the folder.
    """
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != FOLDER_MANIFEST}
    write_json(folder / FOLDER_MANIFEST, {"format": 1, "files": files}, indent=1)


def _folder_files(folder: Path) -> list[str]:
    return [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != FOLDER_MANIFEST]


def verify_folder_manifest(folder: str | Path, redo: str) -> bool:
    """Every file recorded in ``folder``'s manifest is there with its size and sha256 (CorruptArtefact naming
    the first that is not), and every file there is recorded. A folder without a manifest, or with files its
    manifest does not list, is unverified (:func:`unverified`): refused unless trusted; False when trusted
    without a manifest.

    Args:
        folder: the folder.
        redo: what the user does to make it again.

    Returns:
        True when verified by its manifest.

    Raises:
        CorruptArtefact: a recorded file is missing or differs.
        UnverifiedArtefact: no manifest, or unlisted files, outside a trusting block.
    """
    folder = Path(folder)
    if not (folder / FOLDER_MANIFEST).exists():
        require_record(folder, None, (), redo, record=FOLDER_MANIFEST)
        return False
    doc = read_json(folder / FOLDER_MANIFEST, redo)
    files = doc.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()):
        raise CorruptArtefact(folder / FOLDER_MANIFEST, "its files entry is not a map of name -> {bytes, sha256}",
                              redo)
    require_record(folder, files, _folder_files(folder), redo, record=FOLDER_MANIFEST)
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            raise CorruptArtefact(path, "the file is missing", redo)
        if path.stat().st_size != entry["bytes"]:
            raise CorruptArtefact(path, f"{path.stat().st_size} bytes where {entry['bytes']} were written", redo)
        verify_sha256(path, entry["sha256"], redo)
    return True


# ---------------------------------------------------------------------------------------------------------
# One schema per kind of document, so a wrongly typed field is named when the file is read, not a traceback
# wherever the field is used. A schema is a type name ("number", "int", "str", "bool", "dict", "list",
# "any"; a trailing "?" also allows null), a dict of key -> schema (a key written "?name" may be absent; "*"
# is the schema of every other key, "_*" of every other key starting with "_"), or a one-element list: the
# schema of each item.
# ---------------------------------------------------------------------------------------------------------
_KINDS = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool), "number": _is_number,
          "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
          "dict": lambda v: isinstance(v, dict), "list": lambda v: isinstance(v, list), "any": lambda v: True}
_KIND_WORDS = {"int": "an integer", "number": "a number", "str": "a string", "bool": "true or false",
               "dict": "an object", "list": "a list", "any": "a value"}


def _not(value: Any, where: str, what: str) -> str:
    return f"{where or 'the document'} is {json.dumps(value, default=str)[:60]}, not {what}"


def schema_problem(value: Any, schema: Any, where: str = "") -> str | None:
    """The first place where ``value`` does not follow ``schema`` (a JSON path and what belongs there).

    Args:
        value: the parsed value.
        schema: a kind name ("str", "number", ...; "?" suffix: may be null), a one-element list (each item),
            or a dict (keys; "?key" optional, "*" / "_*" any other key).
        where: the JSON path of ``value`` (for the message).

    Returns:
        The problem, or None when ``value`` follows ``schema``.
    """
    if isinstance(schema, str):
        kind, nullable = schema.rstrip("?"), schema.endswith("?")
        if (value is None and nullable) or _KINDS[kind](value):
            return None
        return _not(value, where, _KIND_WORDS[kind])
    if isinstance(schema, list):
        if not isinstance(value, list):
            return _not(value, where, "a list")
        for i, item in enumerate(value):
            problem = schema_problem(item, schema[0], f"{where}[{i}]")
            if problem:
                return problem
        return None
    if not isinstance(value, dict):
        return _not(value, where, "an object")
    named = {key.lstrip("?"): sub for key, sub in schema.items() if key not in ("*", "_*")}
    for key in schema:
        if key not in ("*", "_*") and not key.startswith("?") and key not in value:
            return f"{where + '.' if where else ''}{key} is missing"
    for key, item in value.items():
        other = schema.get("_*", schema.get("*")) if str(key).startswith("_") else schema.get("*")
        sub = named.get(key, other)
        if sub is not None:
            problem = schema_problem(item, sub, f"{where + '.' if where else ''}{key}")
            if problem:
                return problem
    return None


def check_schema(path: str | Path, value: Any, schema: Any, redo: str) -> Any:
    """``value`` (read from ``path``) when it follows ``schema``; else CorruptArtefact naming the field.

    Args:
        path: the file it was read from.
        value: the parsed value.
        schema: the schema.
        redo: what the user does to make it again.

    Returns:
        ``value``.

    Raises:
        CorruptArtefact: off the schema.
    """
    problem = schema_problem(value, schema)
    if problem:
        raise CorruptArtefact(path, problem, redo)
    return value


RESULTS_FILE = "results.json"
FILES_KEY = "_files"  # results.json: sha256 of each file written beside it, checked when it is read back


def results_record(mode_dir: str | Path, results: Mapping[str, Any], redo: str) -> dict[str, str]:
    """The sha256 per file that ``mode_dir``'s results.json (``results``, already read) recorded for the files
    beside it, after the unverified rule: no ``_files``, or a file there that it does not list, is refused
    unless trusted (then what it does record, possibly nothing).

    Args:
        mode_dir: the folder of results.json.
        results: results.json, already read.
        redo: what the user does to make it again.

    Returns:
        File name -> sha256.
    """
    mode_dir = Path(mode_dir)
    recorded = results.get(FILES_KEY)
    present = [p.name for p in sorted(mode_dir.iterdir()) if p.is_file() and p.name != RESULTS_FILE
               and not p.name.startswith(".")]
    require_record(mode_dir / RESULTS_FILE, recorded, present, redo, record=f"{FILES_KEY} record")
    return dict(recorded or {})


# eval/<mode>/results.json: one entry per task, _files (sha256 of the files beside it), _meta.
# Its fields are typed where present (results written by hand for tests or older runs may lack some).
TASK_RESULT = {"?metric": "str", "?value": "number", "?stderr": "number?", "?n": "int", "?num_fewshot": "int",
               "*": "any"}
RESULTS_SCHEMA = {"?_files": {"*": "str"}, "?_meta": "dict", "_*": "any", "*": TASK_RESULT}
# eval/heldout/summary.json: the fields the report and the eval stage read.
_STAT = {"mean": "number", "*": "any"}
HELDOUT_SUMMARY_SCHEMA = {
    "?models": {"*": "dict"}, "?baseline_run": "str?", "?tokens_file": "str?", "?tokens_sha256": "str?",
    "?comparisons": {"*": {"reference": "str", "other": "str", "summary": {
        "nll_diff_pct": {"mean": "number", "var": "number", "n_windows": "int", "*": "any"},
        "n_tokens": "int", "nll_ref": "number", "nll_diff": _STAT, "kl": {"mean": "number", "p99": "number",
                                                                          "*": "any"},
        "top1": _STAT, "*": "any"}, "*": "any"}},
    "*": "any",
}
# run_info.json: this start's record and the history of the earlier ones.
RUN_INFO_SCHEMA = {"?history": ["dict"], "?git": "any", "?versions": "dict?", "*": "any"}
# An export's hif8qat_quant.json.
QUANT_EXPORT_SCHEMA = {"config": "dict", "*": "any"}
