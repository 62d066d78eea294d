"""The repository's import rules (README, "Layout"), read from the source, lazy imports included:
no file imports the operator package from a lesson or from common.py, only conv_tutorial/kernel.py
loads lesson 05 into the package, and no chain of imports returns to where it started."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSON_STEM = re.compile(r"\d\d-[a-z0-9-]+")


def python_files():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if not any(part.startswith(".") or part in ("site", "out", "docs") for part in parts):
            yield path


def module_name(path):
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports_of(path):
    """The modules `path` imports anywhere in its body (a function's import too), as dotted names,
    and the lessons it may load by name (common.load_lesson("04-..."), or a stem kept in a
    constant): every string that is a lesson's stem counts, which errs towards more edges."""
    name, tree, found = module_name(path), ast.parse(path.read_text()), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
            if node.module:
                found.add(base)
    found.update(node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and LESSON_STEM.fullmatch(node.value))
    return found


def import_graph():
    modules = {module_name(path): path for path in python_files()}
    return {name: {target for target in imports_of(path) if target in modules and target != name}
            for name, path in modules.items()}


def test_no_lesson_and_not_common_imports_the_package():
    graph = import_graph()
    lessons = [name for name in graph if re.match(r"\d\d-", name)] + ["common"]
    assert len(lessons) >= 6
    for name in lessons:
        assert not any(target.split(".")[0] == "conv_tutorial" for target in graph[name]), name


def test_only_the_kernel_module_loads_lesson_05_into_the_package():
    graph = import_graph()
    loaders = {name for name, targets in graph.items()
               if name.startswith("conv_tutorial") and "05-warp-specialized-conv" in targets}
    assert loaders == {"conv_tutorial.kernel"}


def test_no_import_cycle():
    graph, state, cycles = import_graph(), {}, []

    def visit(name, chain):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(chain[chain.index(target):] + [target])
            elif target not in state:
                visit(target, chain + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_the_graph_sees_lazy_imports():
    """The checks above would pass on an empty graph: the import inside a function and a lesson
    loaded by name must both appear."""
    graph = import_graph()
    assert "common" in graph["05-warp-specialized-conv"]
    assert "04-implicit-gemm-single-buffer" in graph["05-warp-specialized-conv"]     # load_lesson
    assert "05-warp-specialized-conv" in graph["conv_tutorial.kernel"]
