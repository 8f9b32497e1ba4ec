"""``python -m hif8qat.report``: the report from the run folders, ``--paper`` the paper's tables, ``--readme``
the claims section written into a README."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from hif8qat.artefacts import trusting_unverified
from hif8qat.boundary import guarded
from hif8qat.files import write_text
from hif8qat.report.build import build_report
from hif8qat.report.claims import DEFAULT_MARGINS
from hif8qat.report.paper import build_paper_tables, format_paper_tables
from hif8qat.report.paths import FIGURES_DIR, PAPER_DIR, REPO, TABLES_DIR
from hif8qat.report.readme import (
    CLAIMS_BEGIN,
    CLAIMS_END,
    between_markers,
    build_claims,
    replace_between_markers,
)
from hif8qat.report.table_files import to_markdown

MARGIN_METRICS = list(DEFAULT_MARGINS)


def format_report(rep: dict) -> str:
    """The report's message and each table (but the runs table) as markdown, for the console.

    Args:
        rep: what :func:`hif8qat.report.build.build_report` returned.

    Returns:
        The text."""
    out = [rep.get("message", "")]
    for name, df in rep.get("tables", {}).items():
        if name.startswith("runs_"):
            continue
        out += ["", name, to_markdown(df, 3) if len(df) else "(empty)"]
    return "\n".join(out)


def main(argv: Iterable[str] | None = None) -> int:
    """The report's command line, behind the boundary every entry point has: a corrupt result file, a disk
    that refuses a write or Ctrl-C is one line, not a traceback.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        The exit status."""
    code: list[int] = []
    status = guarded(lambda: code.append(_main(argv)))
    return status or code[0]


def _main(argv: Iterable[str] | None = None) -> int:
    # prog: run as a package, argparse would name the usage after __main__.py
    ap = argparse.ArgumentParser(prog="python -m hif8qat.report",
                                 description="Tables and figures (results/tables, results/figures)")
    ap.add_argument("--paper", action="store_true", help="the paper's tables from the authors' data")
    ap.add_argument("--profile", default="mini")
    ap.add_argument("--runs-root", type=Path, default=REPO / "results" / "runs")
    ap.add_argument("--tables", type=Path, default=TABLES_DIR)
    ap.add_argument("--figures", type=Path, default=FIGURES_DIR)
    ap.add_argument("--paper-dir", type=Path, default=PAPER_DIR)
    ap.add_argument("--margin", action="append", default=[], metavar="METRIC=M",
                    help=f"equivalence margin of a claim metric ({', '.join(MARGIN_METRICS)}); repeatable")
    ap.add_argument("--readme", type=Path, help="write the claims section between the file's "
                    f"{CLAIMS_BEGIN} / {CLAIMS_END} markers and stop")
    ap.add_argument("--trust-unverified", action="store_true",
                    help="use result files that have no integrity record (each number from them is marked)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    with trusting_unverified(args.trust_unverified):
        return _report(ap, args)


def _report(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    margins = {}
    for item in args.margin:
        key, _, value = item.partition("=")
        try:
            if key not in MARGIN_METRICS:
                raise ValueError
            margins[key] = float(value)
        except ValueError:
            ap.error(f"--margin {item!r}: expected METRIC=number with METRIC one of {', '.join(MARGIN_METRICS)}")
    if args.readme:
        text = args.readme.read_text()
        if between_markers(text) is None:
            ap.error(f"{args.readme} has no {CLAIMS_BEGIN} ... {CLAIMS_END} block")
        write_text(args.readme, replace_between_markers(text, build_claims(args.runs_root, args.profile, margins)))
        print(f"claims section written to {args.readme} from {args.runs_root / args.profile}")
        return 0
    if args.paper:
        tables = build_paper_tables(args.paper_dir, args.tables)
        print(format_paper_tables(tables))
        print(f"\nwritten: {args.tables}/paper_*.csv|md")
        return 0
    rep = build_report(args.runs_root, args.profile, args.tables, args.figures, margins=margins)
    print(format_report(rep))
    return 0
