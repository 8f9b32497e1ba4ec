"""The scaling core's imports run one way, and formats (the lower layer) never reaches up into scaling.

Every import counts here, also those inside functions and under ``if TYPE_CHECKING:``: a cycle hidden in either
is still a cycle for the reader. The order is the one stated in ``hif8qat/scaling/__init__.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "hif8qat"
# rank of each scaling module: a module may import only modules of a lower rank
ORDER = {"autograd_engine": 0, "rules": 0, "settings": 1, "current": 2, "forecast": 2, "bank_state": 3,
         "bank_telemetry": 3, "bank_extras": 3, "bank": 4, "bank_row": 5, "replay": 6}


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    return [n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _targets(node: ast.Import | ast.ImportFrom) -> list[str]:
    """Dotted module names an import statement reaches (``from pkg import sub`` reaches ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert node.level == 0, "the package uses absolute imports"
    return [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]


def _scaling_module(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["hif8qat", "scaling"] else None


def test_every_scaling_module_has_a_rank():
    assert {p.stem for p in (SRC / "scaling").glob("*.py")} - {"__init__"} == set(ORDER)


@pytest.mark.parametrize("module", sorted(ORDER))
def test_scaling_modules_import_only_lower_ones(module):
    bad = []
    for node in _imports(SRC / "scaling" / f"{module}.py"):
        for target in _targets(node):
            other = _scaling_module(target)
            if other is not None and other in ORDER and ORDER[other] >= ORDER[module]:
                bad.append(f"line {node.lineno}: {target}")
            if target.startswith("hif8qat.") and _scaling_module(target) is None and \
                    not target.startswith(("hif8qat.formats", "hif8qat.errors", "hif8qat.scaling")):
                bad.append(f"line {node.lineno}: {target} (above the scaling layer)")
    assert not bad, f"scaling.{module} imports upward: {bad}"


@pytest.mark.parametrize("module", sorted(ORDER))
def test_no_private_name_crosses_a_scaling_module(module):
    """No ``from x import _name`` of another module, and no ``bank._attr`` outside bank.py."""
    path = SRC / "scaling" / f"{module}.py"
    bad = [f"line {n.lineno}: {a.name}" for n in _imports(path) if isinstance(n, ast.ImportFrom)
           for a in n.names if a.name.startswith("_") and a.name != "__future__"]
    if module != "bank":
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                owner = n.value.attr if isinstance(n.value, ast.Attribute) else getattr(n.value, "id", "")
                if owner == "bank":
                    bad.append(f"line {n.lineno}: bank.{n.attr}")
    assert not bad, f"scaling.{module} uses private names of other modules: {bad}"


@pytest.mark.parametrize("path", sorted((SRC / "formats").glob("*.py")), ids=lambda p: p.stem)
def test_formats_never_import_scaling_or_higher(path):
    bad = [f"line {n.lineno}: {t}" for n in _imports(path) for t in _targets(n)
           if t.startswith("hif8qat.") and not t.startswith(("hif8qat.formats", "hif8qat.errors", "hif8qat.files"))]
    assert not bad, f"formats.{path.stem} imports a higher layer: {bad}"
