"""make wheelhouse: the wheels a GPU node that already has torch and transformers lacks, for an offline install.

The pipeline's and the tests' packages (pyproject.toml's ``pipeline`` and ``test`` extras, at requirements.txt's
pinned versions) are resolved together with the node's own packages (benchmarks/gpu_node_packages.txt); what the
node's packages and their dependencies already cover is left out, the rest is downloaded with ``--no-deps`` for
each target Python (manylinux x86_64). The folder holds the wheels and a requirements.txt naming each missing
package at its version, which ``benchmarks/gpu_check.sh`` installs with ``pip install --no-index``:

    python benchmarks/wheelhouse.py [--out wheelhouse] [--python 3.12 3.11] [--max-mib 60]

Prints each wheel, the total size, and exits 1 when the folder is over --max-mib (what can be carried to the
node), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hif8qat.launch.versions import declared  # noqa: E402

# manylinux tags a current x86_64 node accepts (glibc 2.28 and older); pip takes no range, only a list
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(28, 4, -1)] + ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                        "manylinux1_x86_64"]


def _requirement_lines(path: Path) -> list[str]:
    return [b for b in (line.split("#", 1)[0].strip() for line in path.read_text().splitlines()) if b]


def wanted_pins(requirements: Path, extras: tuple[str, ...]) -> list[str]:
    """The pinned lines of requirements.txt that the core and ``extras`` declare (extras of a line kept)."""
    names = set(declared(extras=extras))
    return [line for line in _requirement_lines(requirements) if canonicalize_name(Requirement(line).name) in names]


def resolve(requirements: list[str]) -> dict[str, str]:
    """{canonical name: version} of everything pip would install for ``requirements`` into an empty environment
    (metadata only: ``--dry-run``)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), *requirements], check=True)
        items = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def optional_extras(pyproject: Path = ROOT / "pyproject.toml") -> set[str]:
    """The extras pyproject.toml declares (its optional dependencies)."""
    import tomllib

    return set(tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {}))


# ------------------------------------------------------------------------------------------------ usage
# Every argument is checked before anything is created: bad usage is one `error:` line, exit 2, no folder left.
def _usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (naming the option and what it allows), None when they can be used."""
    out = args.out
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder; allowed a new (or empty) folder"
    if out.is_dir() and any(out.iterdir()):
        return f"--out {out} is not empty; remove it or give --out a new folder"
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"--out {out}: {parent} is not a folder this user can write"
    for option, path in (("--node", args.node), ("--requirements", args.requirements)):
        if not path.is_file():
            return f"{option} {path}: no such file; allowed a requirements file (one pinned package a line)"
        try:
            [Requirement(line) for line in _requirement_lines(path)]
        except (OSError, UnicodeDecodeError, InvalidRequirement) as err:
            return f"{option} {path} is not a requirements file ({type(err).__name__}: {err})"
    bad = [v for v in args.python if not re.fullmatch(r"3\.(1[0-9]|[89])", v)]
    if bad:
        return f"--python {' '.join(bad)}: allowed Python versions written 3.N (3.8 to 3.19), e.g. 3.12 3.11"
    known = sorted(optional_extras())
    unknown = [e for e in args.extras if e not in known]
    if unknown:
        return f"--extras {' '.join(unknown)}: allowed {', '.join(known)} (pyproject.toml's optional dependencies)"
    if not (args.max_mib > 0 and math.isfinite(args.max_mib)):
        return f"--max-mib {args.max_mib:g}: allowed a size in MiB above 0"
    return None


def parse_usage(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked arguments; bad usage exits 2 with one `error:` line, before anything is created."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "wheelhouse")
    ap.add_argument("--node", type=Path, default=ROOT / "benchmarks" / "gpu_node_packages.txt")
    ap.add_argument("--requirements", type=Path, default=ROOT / "requirements.txt")
    ap.add_argument("--python", nargs="+", default=["3.12", "3.11"],
                    help="target Python versions (default 3.12 3.11); the running one's wheels always come")
    ap.add_argument("--extras", nargs="+", default=["pipeline", "test"])
    ap.add_argument("--max-mib", type=float, default=60.0)
    args = ap.parse_args(argv)
    problem = _usage_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return args


def cli(argv: list[str] | None = None) -> int:
    """main inside the usage contract: a pip that cannot reach its index (offline) or find a pinned version is
    one `error:` line with exit 2, and the folder this run created is removed (one that was empty is emptied)."""
    out = parse_usage(argv).out
    existed = out.exists()
    try:
        return main(argv)
    except subprocess.CalledProcessError as err:
        if existed:
            for entry in out.iterdir() if out.is_dir() else ():
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        else:
            shutil.rmtree(out, ignore_errors=True)
        print(f"error: `{' '.join(map(str, err.cmd[1:5]))} ...` failed (exit {err.returncode}): pip could not reach "
              "its index (offline? set PIP_INDEX_URL to a reachable mirror) or has no wheel of a pinned version; "
              "nothing was kept", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_usage(argv)
    node_lines = _requirement_lines(args.node)
    node_names = {canonicalize_name(Requirement(line).name) for line in node_lines}
    wanted = [line for line in wanted_pins(args.requirements, tuple(args.extras))
              if canonicalize_name(Requirement(line).name) not in node_names]
    node = resolve(node_lines)
    full = resolve(node_lines + wanted)
    missing = {name: version for name, version in sorted(full.items()) if name not in node}
    for name, version in sorted(full.items()):
        if name in node and node[name] != version:  # the node's copy may be older than the pipeline needs
            print(f"note: {name}: the pipeline resolves {version}, a fresh node install {node[name]}; "
                  f"the node's own version is not known here")
    args.out.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version}" for name, version in missing.items()]
    (args.out / "requirements.txt").write_text("\n".join(pins) + "\n")
    # This interpreter's wheels first: pip wheel downloads them and builds the few packages published only as
    # sources (pure Python, e.g. hydra's antlr4 runtime) into wheels that every Python takes.
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(args.out), *pins],
                   check=True)
    # wheels every Python 3 takes (py3-none-any); py311-none-any (multiprocess) or cp311 ones need their 3.12 twin
    pure = {name for name, _, _, tags in map(parse_wheel_filename, (w.name for w in args.out.glob("*.whl")))
            if all(t.interpreter in ("py3", "py2") and t.abi == "none" and t.platform == "any" for t in tags)}
    compiled = [pin for pin in pins if canonicalize_name(pin.split("==")[0]) not in pure]
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    for py in (v for v in args.python if v != here):
        if compiled:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                            "--python-version", py, "--implementation", "cp", *platforms, "-d", str(args.out),
                            *compiled], check=True)
    wheels = sorted(args.out.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"wheelhouse: {len(missing)} packages, {len(wheels)} wheels for Python {', '.join(sorted({here, *args.python}))}, "
          f"{total / 2**20:.1f} MiB in {args.out} (limit {args.max_mib:g} MiB)")
    if total > args.max_mib * 2**20:
        print(f"error: the wheelhouse is {total / 2**20:.1f} MiB, over the {args.max_mib:g} MiB that can be carried "
              "to the node", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
