"""The source tree keeps its shape: a library core that knows nothing of the pipeline, subpackages in one layer
order, no import cycle, imports at the top of each file, and no module so long that one file does several jobs.

The core (``formats``, ``scaling``, ``compute_dtype``, ``quant``: the quantizer any trainer can import) imports
only itself, ``errors``, the standard library, torch and numpy. ``run.py``, the entry point, is part of the graph:
it sits above every layer, nothing imports it, and it stays a thin declaration over ``hif8qat.cli``.

Every import statement counts, wherever it stands: at module level, inside a function, under
``if TYPE_CHECKING:``. An import inside a function is still a dependency (it only moves the failure to run time),
so the layer order and the cycle check read all of them. Only imports of the heavy optional libraries in
``LAZY_LIBRARIES`` may stand inside a function, each library with its reason there, in the package and in
``run.py`` alike. No module loads another by name at run time (``importlib.import_module``, ``__import__``,
``pkgutil.resolve_name``) or hands out its names through a module-level ``__getattr__``: such an import is one
that no reader of the import statements sees. The exceptions, in ``LOADS_BY_NAME``, load a module the user names."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "hif8qat"
ENTRY_POINTS = {"run": ROOT / "run.py"}  # above every layer
MAX_LINES = 550  # "about 500": a module past this has grown a second job
ENTRY_POINT_MAX_LINES = 60  # run.py declares the Hydra application; what it does lives in hif8qat.cli
MAX_TOP_LEVEL_MODULES = 12

# The layers, lowest first: a module may import its own layer and those below it, never one above. Each entry
# is a subpackage or a top-level module of hif8qat; docs/design.md draws the same picture.
LAYERS = [
    ("errors",),  # the one base class of user-facing failures
    # the library core
    ("formats",),  # HiF8 / FP8 quantize-dequantize
    ("scaling",),  # delayed scaling: settings, rules, bank
    ("compute_dtype",),  # BF16 native / emulated / FP32 compute
    ("quant",),  # the quantized linear, model conversion, the public training API
    ("integrations",),  # the library's glue to other trainers (transformers.Trainer)
    # the pipeline
    ("files", "boundary", "artefacts", "stats"),  # base of the pipeline: no torch model, no settings
    ("config",),  # the validated run configuration
    ("runs",),  # run folders and downloads
    ("models",),
    ("data",),
    ("train",),
    ("evaluate",),
    ("report",),
    ("launch",),  # preflight, time estimate, SLURM resources
    ("rehearse",),  # rehearsals of the paper path and of SLURM
    ("cli",),  # what run.py does: its config composed and checked, its stages dispatched
]

CORE = ("formats", "scaling", "compute_dtype", "quant")
CORE_MAY_IMPORT = (*CORE, "errors")
# What a core module may import from outside the project: the standard library, torch and numpy (a user's
# environment with torch has all of them).
CORE_LIBRARIES = ("torch", "numpy")

# Libraries that may be imported inside a function, and why: each is slow to import or optional, and the modules
# that use them are also imported on paths that never call them. Everything else, the project's own modules
# included, is imported at the top of its file.
LAZY_LIBRARIES = {
    "transformers": "seconds to import; run folders and checks use models.loading's names only, and the core's "
                    "GEMM check builds its tiny model only when run",
    "lm_eval": "seconds to import, and it registers every task: evaluation only",
    "datasets": "seconds to import: streamed corpora and evaluation data only",
    "pandas": "report tables only",
    "scipy": "a second to import (scipy.stats), on run.py's path to its first answer: the statistics of the "
             "report and of held-out evaluation only",
    "matplotlib": "figures only",
    "wandb": "only when the wandb logger is on (an optional install)",
    "submitit": "only under the SLURM launcher",
    "pyarrow": "parquet stand-in shards only",
    "safetensors": "a core dependency the library's 8-bit export and its loader use; `import hif8qat` stays "
                   "torch and numpy only",
}

# Modules that load a module by name, and why: the name is the user's, given on the command line, so it is no
# dependency of the project that an import statement could show.
LOADS_BY_NAME = {
    "hif8qat.formats.conformance": "checks the user's HiF8 implementation, named as MODULE:FUNC",
}


def _modules(src: Path = SRC) -> dict[str, Path]:
    found = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _graph_modules() -> dict[str, Path]:
    return {**_modules(), **ENTRY_POINTS}


def _imports(tree: ast.Module):
    """(node, inside_a_function) for every import statement of the file."""
    stack = [(node, False) for node in tree.body]
    while stack:
        node, in_function = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            continue
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack += [(child, inner) for child in ast.iter_child_nodes(node)]


def _targets(node: ast.Import | ast.ImportFrom, here: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = here.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        # `from pkg import sub` imports the submodule; `from mod import name` imports mod
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = []
    for target in targets:
        while target and target not in modules and "." in target:
            target = target.rpartition(".")[0]
        found.append(target)
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, by every import statement in it (run.py included)."""
    modules = _graph_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, _ in _imports(ast.parse(path.read_text(), str(path))):
            graph[name] |= {t for t in _targets(node, here, modules) if t in modules and t != name}
    return graph


def _layer_of(module: str) -> int | None:
    if module in ENTRY_POINTS:
        return len(LAYERS)
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package itself
    for index, units in enumerate(LAYERS):
        if parts[1] in units:
            return index
    return None


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_reader_sees_imports_in_functions_and_under_type_checking():
    source = ("from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    import a.b\n"
              "class C:\n    def m(self):\n        from . import c\n"
              "def f():\n    def g():\n        import d\n")
    seen = {(ast.unparse(node), inner) for node, inner in _imports(ast.parse(source))}
    assert seen == {("from typing import TYPE_CHECKING", False), ("import os", False), ("import a.b", False),
                    ("from . import c", True), ("import d", True)}


def test_every_subpackage_and_top_level_module_has_a_layer():
    units = {name.split(".")[1] for name in _modules() if name.count(".") >= 1}
    assert not {u for u in units if _layer_of(f"{PACKAGE}.{u}") is None}
    assert sum(1 for p in (SRC / PACKAGE).glob("*.py") if p.name != "__init__.py") <= MAX_TOP_LEVEL_MODULES


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    wrong = sorted(f"{name} -> {target}" for name, targets in _import_graph().items() for target in targets
                   if (a := _layer_of(name)) is not None and (b := _layer_of(target)) is not None and b > a)
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(wrong)


def _core_violations(graph: dict[str, set[str]]) -> list[str]:
    """``module -> target`` for every import from a core module (or the package's own ``__init__``, which is the
    public API) into anything but the core and ``errors``."""
    def unit(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else None

    return sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                  if (unit(name) in CORE or name == PACKAGE) and unit(target) not in CORE_MAY_IMPORT)


def test_the_core_rule_catches_an_import_into_the_pipeline():
    graph = {"hif8qat.quant.linear": {"hif8qat.models.loading", "hif8qat.scaling.bank"},
             "hif8qat.scaling.bank": {"hif8qat.errors"}, "hif8qat": {"hif8qat.config.run_config"},
             "hif8qat.train.loop": {"hif8qat.quant.linear"}, "run": {"hif8qat.files"}}
    assert _core_violations(graph) == ["hif8qat -> hif8qat.config.run_config",
                                       "hif8qat.quant.linear -> hif8qat.models.loading"]


def test_the_core_imports_nothing_of_the_pipeline():
    wrong = _core_violations(_import_graph())
    assert not wrong, "the library core imports the pipeline:\n" + "\n".join(wrong)


def test_the_core_imports_no_library_but_torch_and_numpy_at_import_time():
    wrong = []
    for name, path in _modules().items():
        if name.split(".")[1:2] and name.split(".")[1] not in CORE and name != PACKAGE:
            continue
        for node, in_function in _imports(ast.parse(path.read_text(), str(path))):
            if in_function or (isinstance(node, ast.ImportFrom) and node.level):
                continue
            top = (node.names[0].name if isinstance(node, ast.Import) else node.module).split(".")[0]
            if top not in (*CORE_LIBRARIES, PACKAGE, "__future__") and top not in sys.stdlib_module_names:
                wrong.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "the core imports a library beyond torch and numpy:\n" + "\n".join(wrong)


def test_nothing_imports_the_entry_point_and_it_is_in_the_graph():
    graph = _import_graph()
    assert "run" in graph and any(t.startswith(PACKAGE) for t in graph["run"])
    assert not [name for name, targets in graph.items() if "run" in targets]


def test_no_import_cycle_between_modules():
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _imports_inside_functions(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements inside a function that import anything but a library of LAZY_LIBRARIES."""
    inside = []
    for node, in_function in _imports(tree):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [
            "." if node.level else node.module]
        if in_function and any(m.split(".")[0] not in LAZY_LIBRARIES for m in modules):
            inside.append(node)
    return inside


def test_the_inside_function_rule_catches_a_project_import_and_spares_a_heavy_library():
    source = ("import os\ndef f():\n    from hif8qat.train.loop import train\n    import transformers\n"
              "    import datasets, hif8qat.report\n    from . import sibling\n")
    caught = sorted(ast.unparse(node) for node in _imports_inside_functions(ast.parse(source)))
    assert caught == ["from . import sibling", "from hif8qat.train.loop import train",
                      "import datasets, hif8qat.report"]


def test_imports_stand_at_the_top_of_each_file_but_for_the_heavy_libraries():
    inside = []
    for name, path in _graph_modules().items():  # run.py too
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports_inside_functions(tree):
            if node in _adapter_imports(name, tree):  # an adapter imports the private module it adapts itself
                continue
            inside.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not inside, "imports inside functions (move them to the top of the file):\n" + "\n".join(inside)


def _loads_by_name(tree: ast.Module) -> list[str]:
    """What makes an import no import statement shows: a call of importlib.import_module, importlib.__import__,
    __import__ or pkgutil.resolve_name, and a module-level __getattr__ (PEP 562), which hands out names loaded on
    first use."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__", "resolve_name"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and node.module in ("importlib", "pkgutil") and any(
                a.name in ("import_module", "__import__", "resolve_name") for a in node.names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    found += [f"{node.lineno}: def {node.name}" for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__")]
    return found


def test_the_by_name_rule_catches_importlib_and_a_module_getattr_and_spares_a_class_getattr():
    source = ("import importlib\nfrom importlib import metadata\nx = importlib.import_module('hif8qat.report')\n"
              "y = __import__('os')\ndef __getattr__(name):\n    return name\n"
              "class C:\n    def __getattr__(self, name):\n        return name\n"
              "import pkgutil\nz = pkgutil.resolve_name('os:sep')\n")
    assert _loads_by_name(ast.parse(source)) == ["3: importlib.import_module('hif8qat.report')",
                                                 "4: __import__('os')", "11: pkgutil.resolve_name('os:sep')",
                                                 "5: def __getattr__"]


def test_no_module_loads_another_by_name_or_through_a_module_getattr():
    found = [f"{path.relative_to(ROOT)}:{hit}" for name, path in _graph_modules().items() if name not in LOADS_BY_NAME
             for hit in _loads_by_name(ast.parse(path.read_text(), str(path)))]
    assert all(_loads_by_name(ast.parse(_graph_modules()[name].read_text())) for name in LOADS_BY_NAME), (
        "a module in LOADS_BY_NAME no longer loads by name: take it off the list")
    assert not found, "imports that no import statement shows (import at the top instead):\n" + "\n".join(found)


def test_the_entry_point_stays_a_thin_declaration():
    lines = len(ENTRY_POINTS["run"].read_text().splitlines())
    assert lines <= ENTRY_POINT_MAX_LINES, f"run.py has {lines} lines: move its logic into hif8qat.cli"


def test_each_subpackage_says_what_it_owns():
    for init in (SRC / PACKAGE).glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.splitlines()) <= 40, f"{init.relative_to(SRC)}: a docstring saying what it owns"


def _length(text: str) -> int:
    """A module's lines less its docstrings' fixed-form sections (from the blank line before ``Args:``,
    ``Returns:``, ``Yields:`` or ``Raises:`` to the closing quotes): those grow with the number of public
    functions, not with the jobs a module does."""
    lines = text.splitlines()
    sections = 0
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and \
                isinstance(doc := node.body[0], ast.Expr) and isinstance(doc.value, ast.Constant) and \
                isinstance(doc.value.value, str):
            body = lines[doc.lineno - 1:doc.end_lineno]
            first = next((i for i, line in enumerate(body)
                          if line.strip() in ("Args:", "Returns:", "Yields:", "Raises:")), None)
            if first is not None:
                sections += len(body) - first + (first > 0 and not body[first - 1].strip())
    return len(lines) - sections


def test_no_module_does_several_jobs_by_length():
    long = {name: n for name, path in _modules().items() if (n := _length(path.read_text())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


# --------------------------------------------------------------------------------------------------------------
# Private names. A name a module of one unit (subpackage or top-level module) takes from another is public, in
# the module that owns it. A private name of a library (torch, transformers, lm-eval, ...) is used only inside
# one adapter function, named here with why no public name serves, so a library release that moves it breaks
# that function alone. An adapter may import the private module it adapts inside itself.
# --------------------------------------------------------------------------------------------------------------
ADAPTERS = {
    ("hif8qat.scaling.autograd_engine", "in_backward"): "torch has no public query for a running backward pass",
    ("hif8qat.scaling.autograd_engine", "queue_at_backward_end"): "the engine's queue_callback is private",
    ("hif8qat.scaling.autograd_engine", "tensor_version"): "a tensor's in-place counter has no public name",
    ("hif8qat.compute_dtype", "_cpu_bf16_kernels_native"): "oneDNN's native-BF16 answer is a private op",
    ("hif8qat.config.numerics", "_fused_adamw_device_types"): "torch keeps its fused-kernel devices private",
    ("hif8qat.quant.gemm_check", "_torch_dispatch_mode"): "TorchDispatchMode has no public import path",
    ("hif8qat.quant.experts", "_gates_by_default"): "transformers' experts keep their gate function private",
    ("hif8qat.train.distributed", "_compiled_inner"): "torch.compile's wrapper keeps the module in _orig_mod",
    ("hif8qat.evaluate.task_data", "_lm_eval_task_index"): "lm-eval's index of chosen task folders is private",
    ("hif8qat.launch.memory", "_fake_tensor_mode"): "FakeTensorMode has no public import path",
    ("hif8qat.launch.memory", "_peak_tracker"): "MemTracker, its kinds and its peak bookkeeping are private",
    ("hif8qat.launch.memory", "_set_attention_implementation"): "a made config's attention setter is private",
    ("hif8qat.evaluate.packed_rows", "_attention_implementation"): "a built model's attention has no public getter",
    ("hif8qat.launch.slurm", "quiet_sacct"): "submitit has no setting for a watcher without sacct",
    ("hif8qat.launch.slurm", "_task_exception"): "hydra's JobReturn keeps a failed task's exception private",
    ("hif8qat.rehearse.probes", "_counting_parquet_rows"): "datasets counts no decoded parquet rows publicly",
}
# The prefix of the attributes the project hangs on objects it does not own (a model, a parameter, a class of
# another library): a name it defines, though no assignment to `self` shows it.
OWN_ATTRIBUTE_PREFIX = "_hif8qat"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _unit(module: str) -> str:
    """The subpackage or top-level module a module belongs to (the package's own ``__init__``: itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _nodes_with_functions(tree: ast.Module):
    """(node, names of the functions around it, outermost first) for every node of the file."""
    stack = [(node, ()) for node in tree.body]
    while stack:
        node, functions = stack.pop()
        yield node, functions
        inner = functions + (node.name,) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else functions
        stack += [(child, inner) for child in ast.iter_child_nodes(node)]


def _in_adapter(module: str, functions: tuple[str, ...], adapters=ADAPTERS) -> bool:
    return any((module, f) in adapters for f in functions)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _private_imports_across_units(src: Path = SRC) -> list[str]:
    """Each private name a module takes from a module of another unit: ``from owner import _name`` (relative
    too), ``import owner._module``, and ``owner._name`` on a module imported whole."""
    modules = _modules(src)
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        whole: dict[str, str] = {}  # local name -> project module imported whole
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(node, name, path.name == "__init__.py")
                if base.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in modules:
                        whole[alias.asname or alias.name] = target
                    owner = target if target in modules else base
                    privates = [p for p in target.split(".") if _is_private(p)]
                    if privates and _unit(owner) != _unit(name):
                        found.append(f"{path.relative_to(src)}:{node.lineno}: {privates[-1]} from {base}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != PACKAGE:
                        continue
                    if alias.asname:
                        whole[alias.asname] = alias.name
                    if any(_is_private(p) for p in alias.name.split(".")) and _unit(alias.name) != _unit(name):
                        found.append(f"{path.relative_to(src)}:{node.lineno}: import {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = whole.get(ast.unparse(node.value))
                if owner is not None and _unit(owner) != _unit(name):
                    found.append(f"{path.relative_to(src)}:{node.lineno}: {ast.unparse(node)} ({owner})")
    return sorted(found)


def _project_names(src: Path) -> set[str]:
    """The private names the project defines: functions, classes, variables and arguments, attributes assigned on
    ``self`` or ``cls`` (also through ``setattr`` / ``object.__setattr__``)."""
    names = set()
    for path in (src / PACKAGE).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load) and (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__") and (
                    len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and ast.unparse(node.args[0]) in ("self", "cls")):
                names.add(node.args[1].value)
    return {n for n in names if isinstance(n, str) and _is_private(n)}


def _library_privates(module: str, tree: ast.Module, project_names: set[str]) -> list[tuple[ast.AST, tuple]]:
    """(node, the functions around it) for each private name of another library the module uses: a private
    module or name it imports; a private attribute reached from a library it imports (``torch._C``, or through a
    plain alias of one); and, as an AST knows no types, any private attribute (read, or named to ``getattr``)
    that the project does not define (a tensor's ``_version``). The standard library is not a library here."""
    def library(dotted: str) -> bool:
        top = dotted.split(".")[0]
        return bool(top) and top not in (PACKAGE, "__future__") and top not in sys.stdlib_module_names

    nodes = list(_nodes_with_functions(tree))
    bound: dict[str, bool] = {}  # local name -> whether it is a library's (False: the standard library's)
    for node, _ in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                bound[a.asname or a.name.split(".")[0]] = library(a.name)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            for a in node.names:
                bound[a.asname or a.name] = library(node.module or "")
    for node, _ in nodes:  # plain aliases: `watcher = slurm.SlurmInfoWatcher`
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(node.value, ast.Attribute) and isinstance(root, ast.Name) and bound.get(root.id):
                bound.setdefault(node.targets[0].id, True)

    def flagged(node: ast.AST) -> bool:
        if isinstance(node, ast.Import):
            return any(library(a.name) and any(_is_private(p) for p in a.name.split(".")) for a in node.names)
        if isinstance(node, ast.ImportFrom):
            return not node.level and library(node.module or "") and (
                any(_is_private(p) for p in node.module.split(".")) or any(_is_private(a.name) for a in node.names))
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            root_bound = bound.get(root.id) if isinstance(root, ast.Name) else None
            if root_bound is not None:  # reached from an import: a library's, or the standard library's
                return root_bound
            return node.attr not in project_names and not node.attr.startswith(OWN_ATTRIBUTE_PREFIX)
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr") and len(node.args) > 1:
            name = node.args[1]
            return (isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value)
                    and name.value not in project_names and not name.value.startswith(OWN_ATTRIBUTE_PREFIX))
        return False

    hits = [(node, functions) for node, functions in nodes if flagged(node)]
    inner = {id(node.value) for node, _ in hits if isinstance(node, ast.Attribute)}
    return [(node, functions) for node, functions in hits if id(node) not in inner]  # `torch._C._x` once


def _library_privates_outside_adapters(src: Path = SRC, adapters=ADAPTERS) -> list[str]:
    project_names = _project_names(src)
    found = []
    for name, path in _modules(src).items():
        for node, functions in _library_privates(name, ast.parse(path.read_text(), str(path)), project_names):
            if not _in_adapter(name, functions, adapters):
                where = ".".join(functions) or "module level"
                found.append(f"{path.relative_to(src)}:{node.lineno} ({where}): {ast.unparse(node)[:90]}")
    return sorted(found)


def _adapter_imports(module: str, tree: ast.Module) -> list[ast.AST]:
    """The private-module imports that stand inside an adapter of the module."""
    return [node for node, functions in _library_privates(module, tree, set())
            if isinstance(node, (ast.Import, ast.ImportFrom)) and _in_adapter(module, functions)]


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_crossing_rule_catches_a_private_name_taken_from_another_unit_only(tmp_path):
    src = _write_tree(tmp_path, {
        "hif8qat/__init__.py": "", "hif8qat/a/__init__.py": "", "hif8qat/b/__init__.py": "",
        "hif8qat/a/owner.py": "def _p(): pass\ndef q(): pass\n",
        "hif8qat/a/same.py": "from hif8qat.a.owner import _p\n",  # its own unit: spared
        "hif8qat/b/user.py": ("from hif8qat.a.owner import _p, q\nfrom hif8qat.a import owner\nimport hif8qat.a.owner "
                              "as o\nowner._p()\no._p()\nowner.q()\nfrom ..a.owner import _p as p2\n"),
        "hif8qat/top.py": "from .a.owner import q\nfrom .a import owner\nowner._p\n",
    })
    assert _private_imports_across_units(src) == [
        "hif8qat/b/user.py:1: _p from hif8qat.a.owner", "hif8qat/b/user.py:4: owner._p (hif8qat.a.owner)",
        "hif8qat/b/user.py:5: o._p (hif8qat.a.owner)", "hif8qat/b/user.py:7: _p from hif8qat.a.owner",
        "hif8qat/top.py:3: owner._p (hif8qat.a.owner)"]


def test_no_private_name_crosses_from_one_subpackage_to_another():
    found = _private_imports_across_units()
    assert not found, ("private names used outside their subpackage (make them public where they are defined, "
                       "and import them from there):\n" + "\n".join(found))


def test_the_adapter_rule_catches_a_library_private_outside_its_adapter_only(tmp_path):
    src = _write_tree(tmp_path, {"hif8qat/__init__.py": "", "hif8qat/m.py": (
        "import os\nimport torch\nfrom torch.utils._x import y\nfrom lm_eval.tasks import _index\n"
        "torch._C._f()\n"  # 5
        "os._exit\n"  # the standard library: spared
        "class C:\n    def __init__(self):\n        self._mine = 1\n    def f(self, t):\n"
        "        return self._mine, t._version, getattr(t, '_orig_mod', t), t._hif8qat_x\n"  # 11
        "def adapter():\n    from torch._subclasses import fake\n    def inner():\n        return torch._dynamo\n"
        "    return fake, torch.ops.mkldnn._is_supported()\n"
        "engine = torch.autograd.Variable\nengine._execution_engine\n")})  # 18
    found = _library_privates_outside_adapters(src, adapters={("hif8qat.m", "adapter"): "why"})
    assert found == ["hif8qat/m.py:11 (f): getattr(t, '_orig_mod', t)", "hif8qat/m.py:11 (f): t._version",
                     "hif8qat/m.py:18 (module level): engine._execution_engine",
                     "hif8qat/m.py:3 (module level): from torch.utils._x import y",
                     "hif8qat/m.py:4 (module level): from lm_eval.tasks import _index",
                     "hif8qat/m.py:5 (module level): torch._C._f"]
    assert len(_library_privates_outside_adapters(src, adapters={})) == len(found) + 3


def test_library_private_names_stay_in_their_named_adapters():
    found = _library_privates_outside_adapters()
    assert not found, ("private names of other libraries outside an adapter of ADAPTERS (move each into one "
                       "function that says why no public name serves, and name it there):\n" + "\n".join(found))
    project_names, modules = _project_names(SRC), _modules()
    used = {(name, f) for name, path in modules.items()
            for _, functions in _library_privates(name, ast.parse(path.read_text()), project_names) for f in functions}
    assert not set(ADAPTERS) - used, f"adapters that adapt nothing any more: {sorted(set(ADAPTERS) - used)}"
