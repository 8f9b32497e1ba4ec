"""A run's compute numerics are resolved in one place and travel as one value.

``auto`` (``train.autocast``, ``eval.dtype``, ``eval.device``) becomes a concrete
:class:`hif8qat.compute_dtype.Numerics` in :mod:`hif8qat.config.numerics` alone; what runs a model (training,
evaluation, the memory and time estimates, the probes) is handed that value. The resolving functions may be
called only by the entry points below, each starting from a config of its own; a call anywhere else is a
second resolution site, which could resolve the same run differently (another device, another default)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "hif8qat"

# The functions that turn settings into numerics, by the module that defines them.
RESOLVERS = {
    "hif8qat.compute_dtype": {"resolve", "native_bf16_supported"},
    "hif8qat.config.numerics": {"resolve_run", "train_numerics", "run_numerics", "eval_numerics"},
    "hif8qat.evaluate.heldout": {"saved_eval_numerics"},
}
# compute_dtype.resolve itself: where `auto` is decided.
CORE_RESOLVE_SITES = {
    "hif8qat.compute_dtype": "defines it",
    "hif8qat.config.numerics": "the one place a run's numerics are resolved",
    "hif8qat.quant.gemm_check": "the library core's diagnostic: prints what `auto` means on this machine, no run",
}
# Who may ask for a run's numerics, and why.
ENTRY_POINTS = {
    **CORE_RESOLVE_SITES,
    "hif8qat.cli.hydra_config": "the run's config: train.autocast resolved before it is saved (resolve_run)",
    "hif8qat.cli.main": "python run.py: the run's numerics once, handed to preflight and every stage",
    "hif8qat.launch.time_estimate": "run.py --estimate: the training numerics of each run it estimates",
    "hif8qat.evaluate.cli": "python -m hif8qat.evaluate: an evaluation without a run config",
    "hif8qat.evaluate.heldout": "a saved run folder's numerics, its config read back as a RunConfig",
    "hif8qat.rehearse.probes": "a saved run folder's numerics (through the held-out module's reader)",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolver_calls(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, defining module, function) of each call of a resolving function, by the names the file imports."""
    direct: dict[str, tuple[str, str]] = {}  # local name -> (module, function)
    modules: dict[str, str] = {}  # local name -> resolver module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                local = alias.asname or alias.name
                if alias.name in RESOLVERS.get(node.module, ()):
                    direct[local] = (node.module, alias.name)
                if f"{node.module}.{alias.name}" in RESOLVERS:
                    modules[local] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in RESOLVERS and alias.asname:
                    modules[alias.asname] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in direct:
            found.append((node.lineno, *direct[func.id]))
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
            module = modules[func.value.id]
            if func.attr in RESOLVERS[module]:
                found.append((node.lineno, module, func.attr))
    return found


def _calls_by_module() -> dict[str, list[tuple[int, str, str]]]:
    calls = {}
    for path in sorted(SRC.rglob("*.py")):
        name = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        # a module's own calls of what it defines are its implementation, not another site
        found = [c for c in _resolver_calls(tree) if c[1] != name]
        if name in RESOLVERS:
            found += [(n.lineno, name, n.func.id) for n in ast.walk(tree)
                      if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in RESOLVERS[name]]
        if found:
            calls[name] = found
    return calls


def test_the_finder_sees_each_way_of_calling_a_resolver():
    source = ("from hif8qat import compute_dtype as cd\nfrom hif8qat.config.numerics import run_numerics as rn\n"
              "import hif8qat.compute_dtype as core\nfrom hif8qat.compute_dtype import Numerics\n"
              "cd.resolve('auto', 'cpu')\nrn(cfg)\ncore.native_bf16_supported('cpu')\nNumerics('bf16')\n"
              "cd.forward_context('bf16', 'cpu')\n")
    assert _resolver_calls(ast.parse(source)) == [
        (5, "hif8qat.compute_dtype", "resolve"), (6, "hif8qat.config.numerics", "run_numerics"),
        (7, "hif8qat.compute_dtype", "native_bf16_supported")]


def test_numerics_are_resolved_only_where_a_run_starts():
    calls = _calls_by_module()
    stray = {m: c for m, c in calls.items() if m not in ENTRY_POINTS}
    assert not stray, f"numerics resolved outside the entry points (pass the run's Numerics down instead): {stray}"
    core = {m: [c for c in found if c[2] == "resolve"] for m, found in calls.items()}
    core = {m: c for m, c in core.items() if c and m not in CORE_RESOLVE_SITES}
    assert not core, f"compute_dtype.resolve called outside hif8qat.config.numerics: {core}"


def test_the_numerics_go_by_one_name():
    """Resolved numerics are a Numerics value named `numerics`: no parameter carries them as a string named
    `autocast`, and the core module is not imported under the concept's name."""
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                wrong += [f"{path.name}:{node.lineno} {node.name}({a.arg})" for a in args
                          if a.arg in ("autocast", "train_autocast")]
            if isinstance(node, ast.ImportFrom) and node.module in ("hif8qat", "hif8qat.compute_dtype"):
                wrong += [f"{path.name}:{node.lineno} {a.name} as {a.asname}" for a in node.names
                          if a.asname and a.name in ("compute_dtype", "SETTINGS")]
    assert not wrong, wrong
