"""The repository's layering (README, "Layout"), read from the source.

Every way one file reaches another is an edge of one graph: an `import` anywhere (inside a function
too), `importlib.import_module("name")`, a lesson loaded by name (`common.load_lesson("04-...")`, or
any string that is a lesson's stem), a file loaded by path (`spec_from_file_location`,
`SourceFileLoader`, `runpy.run_path`) and a folder put on `sys.path`, whose modules the file's bare
imports then find. The rules:

- a lesson or the kit (common.py, lesson_figures.py) reaches nothing under tests/, benchmarks/ or
  tools/;
- the package conv_tutorial/ imports nothing of the repository outside itself, loads no file by
  path, edits no sys.path and names no lesson: it installs and runs alone;
- lessons and the kit use only the package's side-effect-free layers, conv_tutorial.core and
  conv_tutorial.kernels, and those import nothing above them (core imports only core);
- a tool never imports a benchmark;
- no chain of edges returns to where it started.

Each rule is a function of a graph, so the tests also run it on planted sources: a rule that could
not see an edge would pass on an empty graph."""
import ast
import collections
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("site/", "out/", "build/", "docs/lessons/", "docs/lessons_src/", "docs/_build/", "docs/_generated/")
LESSON_STEM = re.compile(r"(\d\d-[a-z][a-z0-9-]*)(\.py)?")
KIT = ("common", "lesson_figures")
OUTSIDE_THE_SERIES = ("tests", "benchmarks", "tools")
PACKAGE = "conv_tutorial"
SIDE_EFFECT_FREE = ("conv_tutorial.core", "conv_tutorial.kernels")
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


class Edge(NamedTuple):
    """`file`, at `line`, reaches `target` by `how` ("import", "load_lesson", "names lesson",
    "path load", "run_path" or "sys.path"). A target is a module's dotted name (a file that does not
    exist too: "tests.x"), a folder's ("benchmarks"; the repository's root is "."), an absolute path
    outside the repository, or "?" and the expression that could not be resolved. A piece of a path
    that could not be resolved stands for one path component, "*"."""
    file: str
    line: int
    how: str
    target: str

    def __str__(self):
        return f"{self.file}:{self.line}: {self.how} {self.target}"


def module_name(path):
    """"conv_tutorial/core/tma.py" -> "conv_tutorial.core.tma"; a folder "tests/lessons" -> "tests.lessons"."""
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def in_package(name, package):
    return name == package or name.startswith(package + ".")


def in_any(name, packages):
    return any(in_package(name, package) for package in packages)


def is_lesson_or_kit(name):
    return bool(LESSON_STEM.fullmatch(name)) or name in KIT


def repository_sources():
    """{path relative to the root: source} of every Python file of the repository (not the venv,
    not generated output)."""
    sources = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if not any(part.startswith(".") for part in Path(relative).parts) and not relative.startswith(GENERATED):
            sources[relative] = path.read_text()
    return sources


def own_nodes(scope):
    """The nodes of `scope`'s body, not those of the functions and classes inside it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def callee(call):
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)


class Repository:
    """Python sources by relative path, read into edges (`graph_of`)."""

    def __init__(self, sources):
        self.trees = {path: ast.parse(source) for path, source in sources.items()}
        self.file_of = {module_name(path): path for path in sources}
        self._constants = {}

    def constants(self, module):
        """The names `module` assigns at its top level (for `common.REPO_ROOT` in another file)."""
        if module not in self._constants:
            self._constants[module] = {}        # two modules reading each other's constants end here
            path = self.file_of[module]
            self._constants[module] = Reader(self, path).assignments(self.trees[path], [])
        return self._constants[module]


class Reader:
    """One file's edges."""

    def __init__(self, repository, path):
        self.repository, self.path, self.name = repository, path, module_name(path)
        folder = path.rpartition("/")[0]
        self.package = self.name if path.endswith("/__init__.py") else module_name(folder) if folder else ""
        self.in_a_package = f"{folder}/__init__.py" in repository.trees if folder else False
        self.search = [] if self.in_a_package else [folder]    # a script's own folder is sys.path[0]
        self.imports, self.edges = [], []

    def assignments(self, scope, outer):
        """The names `scope` binds, evaluated in order with `outer`'s names in sight. A name bound by
        anything but one plain assignment of one value (a parameter, a loop, two different values)
        holds None, which hides an outer binding of the name."""
        nodes = list(own_nodes(scope))
        plain = sorted((node for node in nodes if isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Name)), key=lambda node: node.lineno)
        stores = collections.Counter(node.id for node in nodes
                                     if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store))
        plain_stores = collections.Counter(node.targets[0].id for node in plain)
        arguments = ast.walk(scope.args) if hasattr(scope, "args") else ()
        parameters = [arg.arg for arg in arguments if isinstance(arg, ast.arg)]
        names = dict.fromkeys(parameters + [name for name in stores if stores[name] != plain_stores[name]])
        unknown, scopes = set(names), outer + [names]
        for node in plain:
            name, value = node.targets[0].id, self.evaluate(node.value, scopes)
            if name not in unknown:
                names[name] = value if names.get(name, value) == value else None
        return names

    def evaluate(self, node, scopes):
        """The str or Path `node` holds, as far as string constants, `__file__`, the names in
        `scopes` and other modules' constants tell; None where nothing is known."""
        def piece(part):
            value = self.evaluate(part, scopes)
            return "*" if value is None else value

        def path_of(part):
            value = self.evaluate(part, scopes)
            return None if value is None else Path(value)

        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.JoinedStr):
            return "".join(str(piece(part.value)) if isinstance(part, ast.FormattedValue) else str(part.value)
                           for part in node.values)
        if isinstance(node, ast.Name):
            if node.id == "__file__":
                return str(ROOT / self.path)
            return next((scope[node.id] for scope in reversed(scopes) if node.id in scope), None)
        if isinstance(node, ast.Attribute):
            if node.attr == "parent":
                value = path_of(node.value)
                return None if value is None else value.parent
            if isinstance(node.value, ast.Name) and node.value.id in self.repository.file_of:
                return self.repository.constants(node.value.id).get(node.attr)     # common.REPO_ROOT
            return None
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "parents" and isinstance(node.slice, ast.Constant)):
            value = path_of(node.value.value)
            return None if value is None else value.parents[node.slice.value]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return Path(piece(node.left)) / piece(node.right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return f"{piece(node.left)}{piece(node.right)}"
        if isinstance(node, ast.Call):
            name, args = callee(node), node.args
            receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
            if name in ("resolve", "absolute") and receiver is not None and not args:
                return path_of(receiver)
            if name in ("Path", "PurePath") and args:
                return Path(*map(piece, args))
            if name == "joinpath" and receiver is not None:
                return Path(piece(receiver)).joinpath(*map(piece, args))
            if name == "join" and args:                                          # os.path.join
                return os.path.join(*map(str, map(piece, args)))
            if name in ("str", "fspath", "abspath", "realpath", "normpath", "dirname") and len(args) == 1:
                value = self.evaluate(args[0], scopes)
                return None if value is None else os.path.dirname(value) if name == "dirname" else str(value)
        return None

    def target(self, value, expression):
        """The module or folder that a path value names (see Edge)."""
        if value is None:
            return "?" + ast.unparse(expression)
        path = Path(os.path.normpath(ROOT / value))
        if not path.is_relative_to(ROOT):
            return str(path)
        relative = path.relative_to(ROOT).as_posix()
        return "." if relative == "." else module_name(relative)

    def add(self, node, how, target):
        self.edges.append(Edge(self.path, node.lineno, how, target))

    def scan(self, node, scopes):
        if isinstance(node, SCOPES):
            scopes = scopes + [self.assignments(node, scopes)]
        if isinstance(node, ast.Import):
            self.imports += [(node, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = self.package.split(".")[:len(self.package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            self.imports += [(node, [f"{base}.{alias.name}", base] if base else [alias.name]) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and LESSON_STEM.fullmatch(node.value):
            self.add(node, "names lesson", LESSON_STEM.fullmatch(node.value)[1])
        elif isinstance(node, ast.Call):
            self.scan_call(node, scopes)
        for child in ast.iter_child_nodes(node):
            self.scan(child, scopes)

    def scan_call(self, node, scopes):
        name, args = callee(node), node.args
        keywords = {keyword.arg: keyword.value for keyword in node.keywords}
        if name in ("import_module", "__import__") and args and isinstance(args[0], ast.Constant):
            self.imports.append((node, [args[0].value]))
        elif name == "load_lesson" and args:
            stem = self.evaluate(args[0], scopes)
            self.add(node, "load_lesson", self.target(f"{'*' if stem is None else stem}.py", args[0]))
        elif name in ("spec_from_file_location", "SourceFileLoader"):
            location = args[1] if len(args) > 1 else keywords.get("location", keywords.get("path"))
            if location is not None:
                self.add(node, "path load", self.target(self.evaluate(location, scopes), location))
        elif name == "run_path" and (args or "path_name" in keywords):
            location = args[0] if args else keywords["path_name"]
            self.add(node, "run_path", self.target(self.evaluate(location, scopes), location))
        elif ((name in ("insert", "append") and isinstance(node.func, ast.Attribute)
               and ast.unparse(node.func.value) == "sys.path") or name == "addsitedir") and args:
            value = self.evaluate(args[-1], scopes)
            self.add(node, "sys.path", self.target(value, args[-1]))
            if value is not None and Path(os.path.normpath(ROOT / value)).is_relative_to(ROOT):
                self.search.append(Path(os.path.normpath(ROOT / value)).relative_to(ROOT).as_posix())

    def read(self):
        """The file's edges: imports resolve where Python would find them, in the file's own folder
        (a script's), a folder it put on sys.path, or the repository's root."""
        tree = self.repository.trees[self.path]
        self.scan(tree, [self.repository.constants(self.name)])
        modules = self.repository.file_of
        for node, candidates in self.imports:
            for folder in self.search + [""]:
                prefix = module_name(folder) + "." if folder not in ("", ".") else ""
                found = next((prefix + name for name in candidates if prefix + name in modules), None)
                if found:
                    self.add(node, "import", found)
                    break
        loaded = {(edge.line, edge.target) for edge in self.edges if edge.how == "load_lesson"}
        return [edge for edge in self.edges if edge.how != "names lesson" or (edge.line, edge.target) not in loaded]


def graph_of(sources):
    """{module: [Edge]} of `sources`, {path relative to the root: source}."""
    repository = Repository(sources)
    return {module_name(path): Reader(repository, path).read() for path in sources}


def may_reach(edge, folders):
    """Whether `edge` may lead into one of the top-level `folders`: an unresolved path may."""
    if edge.target.startswith("?"):
        return True
    parts = edge.target.split(".")
    if edge.how != "sys.path" and len(parts) == 1:
        return False                                        # a module at the root
    return any(fnmatch.fnmatchcase(folder, parts[0]) for folder in folders)


# %% The rules, each a function of a graph that returns the edges breaking it ------------------------

def lessons_and_kit_reaching_outside_the_series(graph):
    """A lesson or the kit (common.py, lesson_figures.py) must not import or load anything under
    tests/, benchmarks/ or tools/ (nor a path the test cannot resolve):"""
    return [edge for name, edges in graph.items() if is_lesson_or_kit(name)
            for edge in edges if may_reach(edge, OUTSIDE_THE_SERIES)]


def package_reaching_outside_itself(graph):
    """conv_tutorial/ must stand alone: import nothing of the repository outside itself (no lesson,
    common, lesson_figures, benchmark, test or tool), load no file by path, edit no sys.path and name
    no lesson:"""
    return [edge for name, edges in graph.items() if in_package(name, PACKAGE)
            for edge in edges if edge.how != "import" or not in_package(edge.target, PACKAGE)]


def lessons_and_kit_using_the_torch_layer(graph):
    """A lesson or the kit may use conv_tutorial.core and conv_tutorial.kernels only, never
    conv_tutorial itself nor its runtime or torch layer:"""
    return [edge for name, edges in graph.items() if is_lesson_or_kit(name) for edge in edges
            if in_package(edge.target, PACKAGE) and not in_any(edge.target, SIDE_EFFECT_FREE)]


def core_and_kernels_importing_above_themselves(graph):
    """conv_tutorial.core imports only core; conv_tutorial.kernels only core and kernels:"""
    allowed = {"conv_tutorial.core": ("conv_tutorial.core",), "conv_tutorial.kernels": SIDE_EFFECT_FREE}
    return [edge for name, edges in graph.items() for layer, below in allowed.items() if in_package(name, layer)
            for edge in edges if in_package(edge.target, PACKAGE) and not in_any(edge.target, below)]


def tools_importing_benchmarks(graph):
    """A tool (tools/*.py) must not import a benchmark module (nor put benchmarks/ on sys.path):"""
    return [edge for name, edges in graph.items() if in_package(name, "tools")
            for edge in edges if may_reach(edge, ("benchmarks",))]


def import_cycles(graph):
    """Chains of edges that return to where they started, as lists of modules."""
    state, cycles = {}, []

    def visit(name, chain):
        state[name] = "open"
        for target in sorted({edge.target for edge in graph[name] if edge.how != "sys.path"} & graph.keys() - {name}):
            if state.get(target) == "open":
                cycles.append(chain[chain.index(target):] + [target])
            elif target not in state:
                visit(target, chain + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def lessons_loading_later_lessons(graph):
    """A lesson builds on earlier lessons only: it may load lesson NN only when NN is below its own
    number (a reader meets a kernel before a lesson reuses it):"""
    return [edge for name, edges in graph.items() if LESSON_STEM.fullmatch(name)
            for edge in edges if edge.how == "load_lesson" and LESSON_STEM.fullmatch(edge.target)
            and edge.target[:2] >= name[:2]]


def explain(rule, edges):
    return "\n".join([textwrap.dedent(rule.__doc__).strip()] + [f"  {edge}" for edge in edges])


# %% The repository keeps the rules ------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph():
    return graph_of(repository_sources())


@pytest.mark.parametrize("rule", [lessons_and_kit_reaching_outside_the_series, package_reaching_outside_itself,
                                  lessons_and_kit_using_the_torch_layer, core_and_kernels_importing_above_themselves,
                                  tools_importing_benchmarks, lessons_loading_later_lessons],
                         ids=lambda rule: rule.__name__)
def test_the_repository_keeps_the_rule(graph, rule):
    edges = rule(graph)
    assert not edges, explain(rule, edges)


def test_no_import_cycle(graph):
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_graph_sees_the_repository(graph):
    """The rules would pass on an empty graph: the repository's lessons must be there, with edges of
    every kind (common.load_lesson's path load among them)."""
    assert sum(bool(LESSON_STEM.fullmatch(name)) for name in graph) >= 6
    kinds = {edge.how for edges in graph.values() for edge in edges}
    assert {"import", "load_lesson", "path load", "sys.path"} <= kinds
    assert ("import", "lesson_figures") in {(edge.how, edge.target) for edge in graph["03-tma-im2col-modes"]}


# %% The rules see what is planted -------------------------------------------------------------------

PLANTED = {
    "common.py": """
        import importlib.util
        from pathlib import Path
        REPO_ROOT = Path(__file__).resolve().parent
        def load_lesson(stem):
            path = REPO_ROOT / f"{stem}.py"
            return importlib.util.spec_from_file_location(stem, path)
        """,
    "lesson_figures.py": "import common\n",
    "01-first.py": """
        import importlib.util
        import common
        def figures():
            import lesson_figures
            return importlib.util.spec_from_file_location("f", common.REPO_ROOT / "tests" / "lessons" / "x.py")
        """,
    "02-second.py": """
        import runpy
        import common
        from conv_tutorial.core import geometry
        from conv_tutorial import conv2d
        first = common.load_lesson("01-first")
        def later(where):
            import conv_tutorial.ops
            runpy.run_path(where)
        def ahead():
            return common.load_lesson("03-third"), common.load_lesson("02-second")
        """,
    "tests/lessons/x.py": "",
    "benchmarks/suite.py": "",
    "tools/tool.py": """
        import sys
        from pathlib import Path
        ROOT = Path(__file__).resolve().parent.parent
        sys.path.insert(0, str(ROOT))
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import common
        import suite
        """,
    "conv_tutorial/__init__.py": "",
    "conv_tutorial/ops.py": """
        import importlib.util
        from pathlib import Path
        from .core import geometry
        STEM = "05-lesson"
        def kit():
            path = Path(__file__).resolve().parent.parent / "common.py"
            return importlib.util.spec_from_file_location("kit", path)
        """,
    "conv_tutorial/core/__init__.py": "",
    "conv_tutorial/core/geometry.py": "from . import device\nfrom ..kernels import blocks\n",
    "conv_tutorial/core/device.py": "def lazy():\n    import common\n",
    "conv_tutorial/kernels/__init__.py": "",
    "conv_tutorial/kernels/blocks.py": "",
    "conv_tutorial/kernels/fprop.py": "from ..core import geometry\nfrom ..runtime import launch\n",
    "conv_tutorial/runtime.py": "",
    "a.py": "import b\n",
    "b.py": "def lazy():\n    import a\n",
}


@pytest.fixture(scope="module")
def planted():
    return graph_of({path: textwrap.dedent(source).lstrip() for path, source in PLANTED.items()})


def found(edges):
    return {(edge.file, edge.how, edge.target) for edge in edges}


def test_the_graph_sees_every_kind_of_edge(planted):
    assert found(planted["01-first"]) == {("01-first.py", "import", "common"),
                                          ("01-first.py", "import", "lesson_figures"),           # in a function
                                          ("01-first.py", "path load", "tests.lessons.x")}
    assert ("02-second.py", "load_lesson", "01-first") in found(planted["02-second"])
    assert ("02-second.py", "run_path", "?where") in found(planted["02-second"])
    assert found(planted["tools.tool"]) == {("tools/tool.py", "sys.path", "."),
                                            ("tools/tool.py", "sys.path", "benchmarks"),
                                            ("tools/tool.py", "import", "common"),
                                            ("tools/tool.py", "import", "benchmarks.suite")}
    assert found(planted["common"]) == {("common.py", "path load", "*")}     # a lesson at the root


def test_a_lesson_loading_itself_or_a_later_lesson_is_reported(planted):
    assert found(lessons_loading_later_lessons(planted)) == {
        ("02-second.py", "load_lesson", "03-third"), ("02-second.py", "load_lesson", "02-second")}


def test_a_lesson_loading_a_test_file_is_reported(planted):
    assert found(lessons_and_kit_reaching_outside_the_series(planted)) == {
        ("01-first.py", "path load", "tests.lessons.x"), ("02-second.py", "run_path", "?where")}


def test_the_package_loading_anything_outside_itself_is_reported(planted):
    assert found(package_reaching_outside_itself(planted)) == {
        ("conv_tutorial/ops.py", "names lesson", "05-lesson"), ("conv_tutorial/ops.py", "path load", "common"),
        ("conv_tutorial/core/device.py", "import", "common")}


def test_a_lesson_using_the_torch_layer_is_reported(planted):
    assert found(lessons_and_kit_using_the_torch_layer(planted)) == {
        ("02-second.py", "import", "conv_tutorial"), ("02-second.py", "import", "conv_tutorial.ops")}


def test_core_or_kernels_importing_above_themselves_is_reported(planted):
    assert found(core_and_kernels_importing_above_themselves(planted)) == {
        ("conv_tutorial/core/geometry.py", "import", "conv_tutorial.kernels.blocks"),
        ("conv_tutorial/kernels/fprop.py", "import", "conv_tutorial.runtime")}


def test_a_tool_importing_a_benchmark_is_reported(planted):
    assert found(tools_importing_benchmarks(planted)) == {
        ("tools/tool.py", "sys.path", "benchmarks"), ("tools/tool.py", "import", "benchmarks.suite")}


def test_an_import_cycle_is_reported(planted):
    assert import_cycles(planted) == [["a", "b", "a"]]


# %% The package without the lessons -----------------------------------------------------------------

ALONE = """
import importlib.util, pathlib, sys
# an editable install may put the checkout on sys.path: take it off, so the lessons are absent
sys.path[:] = [p for p in sys.path if not (pathlib.Path(p or ".") / "common.py").exists()]
import conv_tutorial, torch
assert importlib.util.find_spec("common") is None, "the lessons' kit is importable: the lessons are not absent"
assert pathlib.Path(conv_tutorial.__file__).parent.parent == pathlib.Path(sys.argv[1]), conv_tutorial.__file__
x, w, b = torch.randn(2, 3, 9, 7), torch.randn(4, 3, 3, 3), torch.randn(4)
torch.testing.assert_close(conv_tutorial.conv2d(x, w, b, stride=2, padding=1),
                           torch.nn.functional.conv2d(x, w, b, stride=2, padding=1))
print("conv_tutorial.conv2d matches torch on CPU tensors")
"""

LAYERS_ONLY = """
import sys
import conv_tutorial.core, conv_tutorial.kernels
print(" ".join(sorted(name for name in sys.modules if name.startswith("conv_tutorial"))))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """conv_tutorial/ alone in a folder, as an installed package is; and an empty folder to run in."""
    folder = tmp_path_factory.mktemp("installed")
    shutil.copytree(ROOT / PACKAGE, folder / "site" / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "empty").mkdir()
    return folder


def run_alone(site, code):
    """`code` in a fresh Python that finds only the copied package, as a user's would: no
    TRITON_INTERPRET or TRITON_DEFAULT_FP_FUSION (the lessons' kit sets them in this process)."""
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("PYTHONPATH", "TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    # the copied package first; of the caller's PYTHONPATH only folders outside the repository (where a
    # machine keeps its Triton, say), so that nothing of the checkout is found
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not Path(p).resolve().is_relative_to(ROOT)]
    environment.update(PYTHONPATH=os.pathsep.join([str(site / "site"), *kept]), PYTHONNOUSERSITE="1")
    return subprocess.run([sys.executable, "-c", code, str(site / "site")], cwd=site / "empty", env=environment,
                          capture_output=True, text=True, timeout=600)


def test_the_package_runs_without_the_lessons(site):
    result = run_alone(site, ALONE)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "TRITON_DEFAULT_FP_FUSION" not in output, output


def test_core_and_kernels_import_without_the_torch_layer(site):
    result = run_alone(site, LAYERS_ONLY)
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = result.stdout.split()
    above = [name for name in loaded if name != PACKAGE and not in_any(name, SIDE_EFFECT_FREE)]
    assert not above, f"importing conv_tutorial.core and conv_tutorial.kernels loaded {above}"


# %% Each lesson is a chapter read in one sitting --------------------------------------------------

LESSONS = sorted(ROOT.glob("[0-9][0-9]-*.py"))
MAX_LESSON_LINES = 800      # ../docs: a chapter is read in one sitting, tests that teach included
CLOSING = re.compile(r"^# What (this lesson|lesson \d\d) measured, what limits it(, what comes next)?", re.M)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.stem)
def test_a_lesson_is_at_most_800_lines(lesson):
    lines = len(lesson.read_text().splitlines())
    assert lines <= MAX_LESSON_LINES, f"{lesson.name}: {lines} lines, more than {MAX_LESSON_LINES}"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.stem)
def test_a_lesson_ends_with_what_it_measured_and_what_comes_next(lesson):
    """Each lesson closes with a cell headed "What ... measured, what limits it, what comes next",
    and every lesson but the last names the next one there: the series is one causal chain."""
    text = lesson.read_text()
    closing = list(CLOSING.finditer(text))
    assert closing, f"{lesson.name}: no closing cell headed 'What ... measured, what limits it, what comes next'"
    following = [path for path in LESSONS if path.name[:2] > lesson.name[:2]]
    if following:
        next_number = following[0].name[:2]
        tail = text[closing[-1].start():]
        assert re.search(rf"[Ll]esson {next_number}\b", tail), (
            f"{lesson.name}: its closing cell does not name lesson {next_number}, the next one")


def test_the_lessons_are_numbered_without_gaps():
    numbers = [int(path.name[:2]) for path in LESSONS]
    assert numbers == list(range(1, len(numbers) + 1)), [path.name for path in LESSONS]
