"""The installed libraries against the supported ranges, checked before any work.

The ranges have one source: ``pyproject.toml``'s ``dependencies`` and ``pipeline`` extra, read from the checkout
when this code runs from one, else from the installed package's metadata. A library outside its range is
``error: <name> <found> is not supported (supported: <range>)`` and exit status 2, before anything else of the
project's is imported (run.py calls :func:`exit_if_unsupported` first). Standard library and ``packaging`` only:
a broken torch or transformers must not stop the check that names it."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # 3.10: the installed package's metadata is read instead
    tomllib = None
from packaging.utils import canonicalize_name

PACKAGE = "hif8qat"
CHECKED_EXTRAS = ("pipeline",)  # the core's dependencies and these; optional extras (wandb, test) are not required
PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def _pyproject_requirements(path: Path) -> list[str] | None:
    """The dependency strings of the checkout's pyproject.toml, extras as ``; extra == "x"`` markers like the
    installed metadata's; None when not running from a checkout (or Python 3.10 without tomllib)."""
    if tomllib is None or not path.is_file():
        return None
    project = tomllib.loads(path.read_text()).get("project", {})
    if project.get("name") != PACKAGE:
        return None
    found = list(project.get("dependencies", []))
    for extra, reqs in project.get("optional-dependencies", {}).items():
        found += [f'{r}; extra == "{extra}"' for r in reqs]
    return found


def declared(extras: tuple[str, ...] = CHECKED_EXTRAS, pyproject: Path = PYPROJECT) -> dict[str, Requirement]:
    """The supported range of each package the core and ``extras`` need.

    Args:
        extras: the optional-dependency groups to include.
        pyproject: the checkout's pyproject.toml.

    Returns:
        Canonical name -> requirement; {} when the ranges cannot be found (an unpacked copy without metadata checks
        nothing)."""
    strings = _pyproject_requirements(pyproject)
    if strings is None:
        try:
            strings = md.requires(PACKAGE) or []
        except md.PackageNotFoundError:
            return {}
    wanted: dict[str, Requirement] = {}
    for text in strings:
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            continue
        wanted[canonicalize_name(req.name)] = req
    return wanted


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def supported(req: Requirement) -> str:
    """The range as a reader writes it: lower bound first (``>=5.17,<6``).

    Args:
        req: the requirement.

    Returns:
        The range, e.g. ``>=5.17,<6``; ``any version`` when unbounded."""
    specs = sorted(req.specifier, key=lambda s: (not s.operator.startswith((">", "=", "~")), s.version))
    return ",".join(str(s) for s in specs) or "any version"


def problems(wanted: dict[str, Requirement] | None = None) -> list[str]:
    """One message per declared package that is missing or outside its range.

    Args:
        wanted: the ranges (None: :func:`declared`).

    Returns:
        The messages; empty when all are supported."""
    wanted = declared() if wanted is None else wanted
    found = []
    for _, req in sorted(wanted.items()):
        allowed = supported(req)
        version = _installed(req.name)
        if version is None:
            found.append(f"{req.name} is not installed (supported: {allowed}); "
                         f"pip install '{PACKAGE}[{','.join(CHECKED_EXTRAS)}]' or make venv")
        elif not req.specifier.contains(version, prereleases=True):  # a CUDA build's 2.11.0+cu130 included
            found.append(f"{req.name} {version} is not supported (supported: {allowed})")
    return found


def exit_if_unsupported() -> None:
    """Print each problem as one ``error:`` line on stderr and exit with status 2; return when there is none."""
    found = problems()
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    if found:
        raise SystemExit(2)


def lowest(name: str, wanted: dict[str, Requirement] | None = None) -> str:
    """The lowest version ``name``'s declared range allows, from its ``>=`` or ``==`` bound.

    Args:
        name: the package.
        wanted: the ranges (None: :func:`declared`).

    Returns:
        The version.

    Raises:
        KeyError: not a declared dependency.
        ValueError: the range has no single lower bound."""
    wanted = declared() if wanted is None else wanted
    req = wanted.get(canonicalize_name(name))
    if req is None:
        raise KeyError(f"{name} is not a declared dependency of {PACKAGE}")
    bounds = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
    if len(bounds) != 1:
        raise ValueError(f"{name}: no single lower bound in {req.specifier}")
    return bounds[0]


def lowest_requirements(requirements: str, names: list[str]) -> str:
    """A requirements file with some packages pinned to their lowest supported version instead of their line there
    (order kept: torch stays first).

    Args:
        requirements: the file's text.
        names: the packages to pin.

    Returns:
        The new text."""
    wanted = declared()
    pins = {canonicalize_name(n): f"{n}=={lowest(n, wanted)}" for n in names}
    out = []
    for line in requirements.splitlines():
        body = line.split("#", 1)[0].strip()
        name = canonicalize_name(Requirement(body).name) if body else None
        out.append(pins.pop(name) if name in pins else line)
    out += pins.values()
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m hif8qat.launch.versions``: check this environment (exit 2 when unsupported);
    ``--lowest torch transformers --requirements requirements.txt`` prints requirements.txt with those packages at
    their lowest supported version (what make test-compat installs).

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        The exit status."""
    ap = argparse.ArgumentParser(prog="python -m hif8qat.launch.versions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lowest", nargs="+", metavar="PACKAGE",
                    help="print the requirements file with these packages at their lowest supported version")
    ap.add_argument("--requirements", type=Path, default=Path("requirements.txt"))
    args = ap.parse_args(argv)
    if args.lowest:
        sys.stdout.write(lowest_requirements(args.requirements.read_text(), args.lowest))
        return 0
    exit_if_unsupported()
    print(f"ok: {len(declared())} declared packages within their supported ranges")
    return 0


if __name__ == "__main__":
    sys.exit(main())
