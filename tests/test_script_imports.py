"""Scripts outside the package import the project by name: the benchmarks and the Python that benchmarks/gpu_check.sh
feeds to its interpreter. Those imports run only on a GPU node or in the minutes-long rehearsals, so a renamed
function or a moved test module surfaces there, late (a moved ``test_openpangu`` and a ``run.config_for`` that
had left run.py once failed CI's rehearsal after a green suite). This reads every such script, adds the folders
it puts on ``sys.path`` (relative to the repository root, as the scripts run from there), and checks that each
project module it imports exists and has each name it takes."""

from __future__ import annotations

import ast
import importlib.machinery
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEREDOC = re.compile(r'"\$PY" -[^\n]*<<\'EOF\'[^\n]*\n(.*?)\nEOF\n', re.S)


def _scripts() -> list[tuple[str, str]]:
    found = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "benchmarks").glob("*.py"))]
    for sh in sorted(ROOT.glob("benchmarks/*.sh")) + sorted(ROOT.glob("scripts/*.sh")):
        for i, block in enumerate(HEREDOC.findall(sh.read_text())):
            found.append((f"{sh.relative_to(ROOT)} (python block {i + 1})", block))
    return found


def _path_entries(tree: ast.AST, script: str) -> list[Path]:
    """Folders the script adds to sys.path: string constants in sys.path.insert(...) / sys.path[:0] = [...], and
    ``Path(__file__)...`` forms (read as the script's own folder, or the root for ``parents[1]``)."""
    entries = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "sys.path.insert":
            arg = node.args[1]
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]).startswith("sys.path["):
            arg = node.value
        else:
            continue
        text = ast.unparse(arg)
        for const in re.findall(r"'([^']+)'", text):
            entries.append(ROOT / const)
        if "__file__" in text:
            here = (ROOT / script.split(" ")[0]).parent
            entries.append(ROOT / "src" if "src" in text else here.parent if "parents[1]" in text else here)
    return entries


def _project_imports(tree: ast.AST, local: set[str]) -> list[tuple[str, list[str]]]:
    wanted = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in local:
                wanted.append((node.module, [a.name for a in node.names if a.name != "*"]))
        elif isinstance(node, ast.Import):
            wanted += [(a.name, []) for a in node.names if a.name.split(".")[0] in local]
    return wanted


SCRIPTS = _scripts()
# any module named like a file of this repository is the project's, wherever it lives now (a moved one must fail)
REPO_MODULES = {p.stem for top in ("benchmarks", "tests", "scripts") for p in (ROOT / top).rglob("*.py")} | {"run"}


def test_the_scan_finds_gpu_checks_python():
    # the heredoc pattern must keep matching how gpu_check.sh runs Python, or the test below checks nothing
    assert sum("gpu_check.sh" in name for name, _ in SCRIPTS) >= 8


def _find(module: str, folders: list[Path]):
    """The spec of ``module`` searched in ``folders`` only (importlib's path finder: no cache of modules this
    process already holds, so a module the script cannot reach is not found through the test's own path)."""
    parts, spec = module.split("."), None
    for i in range(len(parts)):
        where = [str(f) for f in folders] if spec is None else list(spec.submodule_search_locations or [])
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), where)
        if spec is None:
            return None
    return spec


def _top_level_names(path: str) -> set[str]:
    """Names a module binds at its top level (read, not imported), descending into if/try blocks."""
    names, todo = set(), list(ast.parse(Path(path).read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


@pytest.mark.parametrize("name,source", SCRIPTS, ids=[n for n, _ in SCRIPTS])
def test_every_project_import_of_a_script_resolves(name, source):
    tree = ast.parse(source)
    folders = [ROOT / "src"] + _path_entries(tree, name)
    missing = []
    for module, names in _project_imports(tree, {"hif8qat"} | REPO_MODULES):
        spec = _find(module, folders)
        if spec is None:
            missing.append(f"module {module}")
            continue
        bound = _top_level_names(spec.origin)
        missing += [f"{module}.{n}" for n in names
                    if n not in bound and not (spec.submodule_search_locations and _find(f"{module}.{n}", folders))]
    assert not missing, f"{name} imports what does not exist: {missing}"
