"""What every rehearsal shares: its command line (``--work``, ``--repo``), running its checks one by one (a failure
is reported and the others still run), and its summary line and ``checks.json``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def run_check(checks: dict[str, str | None], fn: Callable[[], None]) -> None:
    """Run one check (named by its function), print ok / FAIL, and record None or the failure.

    Args:
        checks: check name -> None if it passed, else why it failed.
        fn: the check; it raises on failure."""
    name = fn.__name__
    try:
        fn()
        checks[name] = None
        print(f"ok    {name}", flush=True)
    except Exception as err:  # noqa: BLE001 - every failure is reported, the other checks still run
        checks[name] = f"{type(err).__name__}: {err}"[:2000]
        print(f"FAIL  {name}: {checks[name]}", flush=True)


def parse_work_args(prog: str, description: str, prefix: str, argv: list[str] | None):
    """A rehearsal's command line (``--work``, ``--repo``).

    Args:
        prog: the program name for the usage line.
        description: the help text.
        prefix: prefix of the temporary work folder.
        argv: the arguments (default sys.argv[1:]).

    Returns:
        ``(args, work folder)``, or exit status 2 when --work is a folder that is not empty (a rehearsal never writes
        into earlier files)."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--work", help="folder for the rehearsal's files (default: a new temporary folder, removed "
                                   "when every check passed)")
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[3]),
                    help="the checkout whose run.py and src/ are rehearsed (default: this one)")
    args = ap.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix=prefix))
    if args.work and work.exists() and any(work.iterdir()):
        print(f"error: --work {work} is not empty; give a new folder", file=sys.stderr)
        return 2
    return args, work


def finish(checks: dict[str, str | None], work: Path, t0: float, keep: bool) -> int:
    """Print and record (``checks.json``) a rehearsal's checks; remove its folder when all passed and not kept.

    Args:
        checks: check name -> None if it passed, else why it failed.
        work: the rehearsal's folder.
        t0: its start time (time.time()).
        keep: keep the folder even when every check passed.

    Returns:
        The exit status: 1 when a check failed, else 0."""
    failed = [name for name, why in checks.items() if why]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed in {time.time() - t0:.0f} s"
          + (f"; failed: {', '.join(failed)} (files kept in {work})" if failed else ""))
    (work / "checks.json").write_text(json.dumps({"checks": checks, "wall_s": time.time() - t0}, indent=1) + "\n")
    if not failed and not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0
