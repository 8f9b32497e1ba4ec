"""Mutation check: does the test suite see the bugs it is meant to catch?

Each mutant in ``mutants.yaml`` is a small, plausible bug: an exact snippet of a source file, its replacement, and
the tests that should fail on it. The script copies the working tree once into a temporary folder, and for each
mutant writes the mutated file there, runs the listed tests against the copy (its ``src/`` first on the path, its
``run.py`` for subprocesses), and puts the file back. A mutant is *killed* when the tests fail (or run past the
time limit), *survived* when they pass. The repository itself is never written, so an interrupted run (Ctrl-C)
leaves it as it was; the copy is removed on the way out.

    python tests/mutation/run_mutants.py                      # the whole list, then the score
    python tests/mutation/run_mutants.py --only emu-drop-bmm  # one or more mutants by id
    python tests/mutation/run_mutants.py --list               # ids and what each one breaks
    python tests/mutation/run_mutants.py --check              # are the snippets still in the code? (no tests)

Before the mutants, every test they name runs once on the unmutated copy (``--no-baseline`` skips it): a test that fails
without a mutant would count every mutant as killed. A snippet that is no longer in its file (the code moved on) is
reported as ``snippet not found``, not run, and left out of the score; exit status 1 then, as when the score is under
``--min-score``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).with_name("mutants.yaml")
# What the copy leaves out: version control, environments, caches and run outputs are not what the tests read.
_SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "runs"}


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    original: str  # exact text, found exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest node ids (or test files) that should fail on the mutant
    area: str
    note: str = ""


def load_mutants(path: Path = MUTANTS) -> list[Mutant]:
    entries = yaml.safe_load(path.read_text())
    mutants = []
    for entry in entries:
        tests = entry["tests"]
        if any(t.startswith("-") for t in ([tests] if isinstance(tests, str) else tests)):
            raise SystemExit(f"error: {path}: mutant {entry['id']}: tests are node ids or files, not options")
        mutants.append(Mutant(id=entry["id"], file=entry["file"], original=entry["original"],
                              replacement=entry["replacement"],
                              tests=tuple(tests.split() if isinstance(tests, str) else tests),
                              area=entry.get("area") or (entry["file"].split("/") + ["", ""])[2],
                              note=entry.get("note", "")))
    ids = [m.id for m in mutants]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise SystemExit(f"error: {path}: mutant ids used twice: {', '.join(duplicated)}")
    return mutants


def mutate(text: str, mutant: Mutant) -> str | None:
    """The file's text with the mutant applied, or None when its snippet is not there exactly once."""
    if text.count(mutant.original) != 1:
        return None
    return text.replace(mutant.original, mutant.replacement)


def _tree_files(root: Path) -> list[Path]:
    """The working tree's files as git sees them (tracked and untracked, ignored ones left out); every file
    outside the skipped folders when this is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                             check=True, timeout=60).stdout
        return [Path(p) for p in out.decode().split("\0") if p and (root / p).is_file()]
    except (OSError, subprocess.SubprocessError):
        return [p.relative_to(root) for p in root.rglob("*")
                if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts)]


def copy_tree(root: Path, dest: Path) -> None:
    for rel in _tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy / "src"), *filter(None, [env.get("PYTHONPATH")])])
    # no bytecode: a cached .pyc of the unmutated file (same size, same second) could be imported instead
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.setdefault(var, "1")
    return env


def _kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float, python: str) -> tuple[str, float, str]:
    """(outcome, seconds, output tail): passed, failed, timeout or error (pytest could not run the selection)."""
    cmd = [python, "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    # a session of its own: a timeout or Ctrl-C ends pytest and every process its tests started
    proc = subprocess.Popen(cmd, cwd=copy, env=_env(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        return "timeout", time.monotonic() - start, out[-3000:]
    except BaseException:  # Ctrl-C: end the tests too, then let the copy be removed
        _kill_session(proc.pid)
        proc.wait()
        raise
    seconds = time.monotonic() - start
    outcome = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
    return outcome, seconds, out[-3000:]


def check_imports_copy(copy: Path, python: str) -> None:
    """The tests must import the copy's package, not an installed one: else no mutant could be seen."""
    probe = subprocess.run([python, "-c", "import hif8qat; print(hif8qat.__file__)"], cwd=copy, env=_env(copy),
                           capture_output=True, text=True, timeout=120)
    where = probe.stdout.strip()
    if probe.returncode != 0 or not Path(where).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"error: the tests would import hif8qat from {where or probe.stderr[-500:]!r}, not from "
                         f"the copy {copy}")


def baseline_selection(mutants: list[Mutant]) -> list[str]:
    """Every test any mutant names, once: one pytest call checks them all without a mutant."""
    return sorted({t for m in mutants for t in m.tests})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", type=Path, default=MUTANTS, help="the list (YAML); default: %(default)s")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check that every snippet is in its file, exactly once (runs no test)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selections")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant (past it: killed)")
    parser.add_argument("--min-score", type=float, default=0.95, help="exit 1 under this killed fraction")
    parser.add_argument("--json", type=Path, help="also write the per-mutant results here")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    args = parser.parse_args(argv)

    mutants = load_mutants(args.mutants)
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in mutants})
        if unknown:
            print(f"error: no mutant with id {', '.join(unknown)} in {args.mutants}", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.id in set(args.only)]
    if args.list:
        for m in mutants:
            print(f"{m.id:34s} {m.file}: {m.note}")
        return 0

    if args.check:
        missing = []
        for m in mutants:
            path = REPO / m.file
            text = path.read_text() if path.is_file() else None
            if text is None or mutate(text, m) is None:
                missing.append(m.id)
                print(f"snippet not found  {m.id} ({m.file}: "
                      f"{'file missing' if text is None else f'found {text.count(m.original)} times'})")
        print(f"{len(mutants) - len(missing)}/{len(mutants)} snippets found")
        return 1 if missing else 0

    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hif8qat-mutants-") as tmp:
        copy = Path(tmp) / "tree"
        copy_tree(REPO, copy)
        check_imports_copy(copy, args.python)
        print(f"{len(mutants)} mutant(s); working on a copy of the tree in {copy}", flush=True)
        if not args.no_baseline:
            selection = baseline_selection(mutants)
            outcome, seconds, out = run_tests(copy, tuple(selection), args.timeout * 4, args.python)
            if outcome != "passed":
                print(f"error: without any mutant, the mutants' tests {outcome} ({seconds:.0f} s): fix the tests or "
                      f"the list first\n{out}", file=sys.stderr)
                return 2
            print(f"baseline: the {len(selection)} test selection(s) pass without a mutant ({seconds:.0f} s)",
                  flush=True)
        for mutant in mutants:
            target = copy / mutant.file
            original = target.read_text() if target.is_file() else None
            mutated = None if original is None else mutate(original, mutant)
            if mutated is None:
                where = "file missing" if original is None else f"found {original.count(mutant.original)} times"
                status, seconds, tail = "snippet not found", 0.0, where
            else:
                target.write_text(mutated)
                try:
                    outcome, seconds, tail = run_tests(copy, mutant.tests, args.timeout, args.python)
                finally:
                    target.write_text(original)
                status = {"failed": "killed", "timeout": "killed (timeout)", "passed": "survived"}.get(outcome,
                                                                                                    "error")
            results.append({"id": mutant.id, "file": mutant.file, "area": mutant.area, "status": status,
                            "seconds": round(seconds, 1), "tests": " ".join(mutant.tests), "note": mutant.note})
            print(f"{status:18s} {seconds:6.1f} s  {mutant.id}  ({mutant.file})", flush=True)
            if status in ("error", "snippet not found"):
                print("    " + tail.strip().replace("\n", "\n    ")[-1500:], flush=True)

    killed = sum(r["status"].startswith("killed") for r in results)
    survived = [r for r in results if r["status"] == "survived"]
    other = [r for r in results if not r["status"].startswith("killed") and r["status"] != "survived"]
    scored = killed + len(survived)
    score = killed / scored if scored else 0.0
    print(f"\nscore: {killed}/{scored} killed ({100 * score:.1f} %); {len(survived)} survived"
          + (f"; {len(other)} not run ({', '.join(r['id'] + ': ' + r['status'] for r in other)})" if other else ""))
    for r in survived:
        print(f"  survived: {r['id']} ({r['file']}): {r['note']}")
    if args.json:
        args.json.write_text(json.dumps({"score": score, "killed": killed, "scored": scored, "results": results},
                                        indent=1) + "\n")
    return 0 if score >= args.min_score and not other else 1


if __name__ == "__main__":
    raise SystemExit(main())
