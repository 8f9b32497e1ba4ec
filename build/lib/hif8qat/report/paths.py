"""Where the report reads and writes by default: folders of this repository."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PAPER_DIR = REPO / "results" / "paper"
TABLES_DIR = REPO / "results" / "tables"
FIGURES_DIR = REPO / "results" / "figures"
ANCHOR_DIR = REPO / "results" / "anchor"
ANCHOR_PUBLISHED = ANCHOR_DIR / "published_smollm2_135m.csv"
