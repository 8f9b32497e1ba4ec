"""Execute the jupytext notebooks headless and write their .ipynb pairs (`make notebooks`).

    python notebooks/execute.py [NAME ...]     # default: every notebooks/NN_*.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbclient

NB_DIR = Path(__file__).resolve().parent


def execute(source: Path, timeout_s: int = 600) -> Path:
    notebook = jupytext.read(source)
    nbclient.NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(NB_DIR.parent)}}).execute()
    target = source.with_suffix(".ipynb")
    jupytext.write(notebook, target)
    return target


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.stem for p in NB_DIR.glob("[0-9][0-9]_*.py"))
    for name in names:
        print("executed", execute(NB_DIR / f"{name}.py"))
