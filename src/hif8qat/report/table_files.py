"""Table files: each table as ``<name>.csv``, ``<name>.md`` (title, note, markdown) and ``<name>.sources.json``."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hif8qat.files import write_text


def _fmt(v, nd=4):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        return f"{v:.{nd}f}"
    return str(v)


def to_markdown(df: pd.DataFrame, nd: int = 4) -> str:
    """A table as markdown, floats rounded, NaN blank.

    Args:
        df: the table.
        nd: decimal places of floats.

    Returns:
        The markdown (``_(no rows)_`` for an empty table)."""
    if df.empty:
        return "_(no rows)_\n"
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c], nd) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_table(df: pd.DataFrame, out_dir: Path, name: str, *, title: str, sources: Mapping[str, Any],
                nd: int = 4) -> dict[str, str]:
    """Write ``<name>.csv``, ``<name>.md`` (title + source note) and ``<name>.sources.json``, each atomically.

    Args:
        df: the table.
        out_dir: the folder.
        name: the file stem.
        title: the markdown title.
        sources: what the sidecar records (``note``, ``files``, ...).
        nd: decimal places of floats in the markdown.

    Returns:
        ``{csv, md, sources}`` -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_p, md_p, src_p = out_dir / f"{name}.csv", out_dir / f"{name}.md", out_dir / f"{name}.sources.json"
    # each file replaced atomically: a failure (a full disk) leaves every earlier table file whole
    write_text(csv_p, df.to_csv(index=False))
    note = sources.get("note", "")
    files = sources.get("files", [])
    md = [f"# {title}", "", f"<!-- sources: {src_p.name} ({len(files)} files) -->"]
    if note:
        md += ["", note]
    md += ["", to_markdown(df, nd)]
    write_text(md_p, "\n".join(md))
    write_text(src_p, json.dumps(sources, indent=1, default=str) + "\n")
    return {"csv": str(csv_p), "md": str(md_p), "sources": str(src_p)}
