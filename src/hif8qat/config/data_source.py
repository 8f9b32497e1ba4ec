"""``data.source``: the named sources and the local files a path, folder or glob names.

Torch-free, so the config check resolves a local source (and refuses one with no usable file) before anything
heavy is imported; the corpus reads the same files."""

from __future__ import annotations

import glob
import os
from pathlib import Path

NAMED_SOURCES = ("mini", "fineweb")
# datasets' builder for each local file suffix
LOCAL_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}


def local_files(source: str) -> tuple[str, list[str]] | None:
    """(builder, files) when ``source`` names local data files, else None.

    Args:
        source: the ``data.source`` setting.

    Returns:
        ``(datasets builder, files)``, or None.

    Raises:
        ValueError: the path exists but holds no data file.
    """
    p = Path(source).expanduser()
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix in LOCAL_BUILDERS)
    elif p.is_file():
        files = [str(p)]
    elif any(c in source for c in "*?["):
        files = sorted(f for f in glob.glob(os.path.expanduser(source), recursive=True) if Path(f).is_file())
    else:
        return None
    if not files:
        raise ValueError(f"data.source={source!r}: no .parquet/.jsonl/.json/.txt files found there")
    kinds = {LOCAL_BUILDERS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"data.source={source!r}: files must all be one of .parquet, .jsonl/.json, .txt; "
                         f"found suffixes {sorted({Path(f).suffix for f in files})}")
    return kinds.pop(), files


def validate_source(source) -> str:
    """The ``data.source`` setting, stripped, once it names a known source or existing local data.

    Args:
        source: the setting.

    Returns:
        The source.

    Raises:
        ValueError: naming the setting and what it allows.
    """
    if not isinstance(source, (str, os.PathLike)) or not str(source).strip():
        raise ValueError(f"data.source must be 'mini', 'fineweb' or a local path, got {source!r}")
    source = str(source).strip()
    if source in NAMED_SOURCES:
        return source
    if local_files(source) is None:
        raise ValueError(
            f"data.source={source!r} is not a known source: expected 'mini', 'fineweb', or an existing local "
            f"directory / file / glob of .parquet, .jsonl, .json or .txt files"
        )
    return source
