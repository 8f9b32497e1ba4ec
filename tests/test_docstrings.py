"""Docstrings in one fixed form (Google style, as torchao writes them): a module docstring is a summary of what
the module owns in 150 words or fewer; a public function or method names each of its parameters under `Args:`
and says what it gives back under `Returns:` (or `Yields:`)."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "hif8qat"
MODULE_WORDS = 150
# The whole package: every module under src/hif8qat (a folder: all its modules).
SCOPE = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__" or p.suffix == ".py")
ENTRY = re.compile(r"^\s+(\*{0,2}\w+)(?:\s*\([^)]*\))?\s*:")


def _modules() -> list[Path]:
    found = []
    for entry in SCOPE:
        path = PACKAGE / entry
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []
    return found


def _section(doc: str, title: str) -> list[str] | None:
    """The entry names under `title:` (None when the section is missing)."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f"{title}:":
            head = len(line) - len(line.lstrip())
            names = []
            for entry in lines[i + 1:]:
                if entry.strip() and len(entry) - len(entry.lstrip()) <= head:
                    break
                if (m := ENTRY.match(entry)) and len(entry) - len(entry.lstrip()) == head + 4:
                    names.append(m.group(1))
            return names
    return None


def _returns_value(func: ast.FunctionDef) -> bool:
    """Whether the function says it returns a value: its annotation, or (unannotated) a `return <value>`."""
    if func.returns is not None:  # None, NoReturn, or a context manager's Iterator[None]: nothing given back
        text = ast.unparse(func.returns)
        nothing = re.fullmatch(r"(\w+\.)*(Iterator|Generator)\[None.*", text)
        return text not in ("None", "NoReturn", "Never") and not nothing
    stack = list(func.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and node.value is not None and \
                not (isinstance(node.value, ast.Constant) and node.value.value is None):
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def _public_functions(tree: ast.Module):
    """(qualified name, node, is a method) of every public function and method of a public class."""
    def walk(body, prefix, in_class):
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                yield from walk(node.body, f"{prefix}{node.name}.", True)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                decorators = {ast.unparse(d) for d in node.decorator_list}
                if not decorators & {"property", "overload", "typing.overload"} and \
                        not any(d.endswith((".setter", ".deleter")) for d in decorators):
                    yield f"{prefix}{node.name}", node, in_class
    yield from walk(tree.body, "", False)


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE).as_posix()
    found = []
    words = len((ast.get_docstring(tree) or "").split())
    if words > MODULE_WORDS:
        found.append(f"{rel}: module docstring has {words} words (at most {MODULE_WORDS})")
    for name, func, is_method in _public_functions(tree):
        doc = ast.get_docstring(func) or ""
        a = func.args
        params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
        if is_method and params and params[0] in ("self", "cls") and \
                "staticmethod" not in {ast.unparse(d) for d in func.decorator_list}:
            params = params[1:]
        params += [f"*{a.vararg.arg}"] if a.vararg else []
        params += [f"**{a.kwarg.arg}"] if a.kwarg else []
        if params:
            named = _section(doc, "Args")
            missing = [p for p in params if named is None or (p not in named and p.lstrip("*") not in named)]
            if missing:
                found.append(f"{rel}:{func.lineno} {name}: Args: lacks {', '.join(missing)}")
        if _returns_value(func) and _section(doc, "Returns") is None and _section(doc, "Yields") is None:
            found.append(f"{rel}:{func.lineno} {name}: no Returns: section")
    return found


def test_scope_names_existing_modules():
    assert all((PACKAGE / entry).exists() for entry in SCOPE), [e for e in SCOPE if not (PACKAGE / e).exists()]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_docstrings_summarise_modules_and_document_arguments_and_returns(path):
    problems = _problems(path)
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_missing_argument_a_missing_returns_and_a_long_module_docstring(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""' + "word " * (MODULE_WORDS + 1) + '"""\n\n'
                   'def f(a, *rest, b=1, **extra) -> int:\n'
                   '    """Sum.\n\n    Args:\n        a: first.\n        *rest: more.\n    """\n    return a\n\n'
                   'class C:\n    def m(self, x):\n        """M.\n\n        Args:\n            x: the x.\n        """\n'
                   '        return x\n\n    def _hidden(self, y):\n        return y\n')
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        problems = _problems(bad)
    finally:
        PACKAGE = saved
    assert problems == ["bad.py: module docstring has 151 words (at most 150)",
                        "bad.py:3 f: Args: lacks b, **extra", "bad.py:3 f: no Returns: section",
                        "bad.py:13 C.m: no Returns: section"]
