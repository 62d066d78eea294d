"""The package's one door to the lessons: lesson 05's kernel, its plain launcher and its configs,
loaded from the lesson file a reader reads, so the operator runs the very source the chapter
teaches; and lesson 06's backward kernels (`lesson06`), loaded on first use. Every other module of
the package takes them from here.

Lesson 05 imports the lessons' kit, ``common.py``, as ``import common``. Loaded from here, the kit
skips its process set-up (``PROCESS_SETUP = False``: it neither switches Triton to its interpreter
on a machine without a GPU nor sets a floating-point-fusion default; the package asks for fusion
in its own launches), and the name ``common`` is lent to the lesson only while it loads, so a
program's own module of that name is left alone.

The lessons live beside the package in the repository (``pip install -e .`` from a checkout); an
install without them stops here with an ImportError that says so.
"""
import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LESSON05_STEM = "05-warp-specialized-conv"
LESSON06_STEM = "06-conv-backward"      # the backward's kernels (backward.py), loaded on first use


def _already_loaded(path):
    """The module already imported from `path` (by a lesson run, pytest or an earlier load), or None."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path:
            return module
    return None


def _lessons_kit():
    path = REPO_ROOT / "common.py"
    kit = _already_loaded(path)
    if kit is not None:
        return kit
    if not (path.exists() and (REPO_ROOT / f"{LESSON05_STEM}.py").exists()):
        raise ImportError(f"conv_tutorial runs lesson 05's kernel from the lesson file beside the package, and "
                          f"{REPO_ROOT} has no common.py or {LESSON05_STEM}.py: install the package from a "
                          f"checkout of the repository with `pip install -e .`")
    spec = importlib.util.spec_from_file_location("conv_tutorial._lessons_common", path)
    kit = importlib.util.module_from_spec(spec)
    kit.PROCESS_SETUP = False
    sys.modules[spec.name] = kit
    try:
        spec.loader.exec_module(kit)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return kit


def _load_lesson(kit, stem=LESSON05_STEM):
    borrowed = sys.modules.get("common")
    sys.modules["common"] = kit          # what the lessons' `import common` finds while they load
    try:
        return kit.load_lesson(stem)
    finally:
        if borrowed is None:
            del sys.modules["common"]
        else:
            sys.modules["common"] = borrowed


common = _lessons_kit()
lesson05 = _load_lesson(common)


def __getattr__(name):
    """`lesson06`, loaded the first time it is asked for (the operator's backward with
    set_backward("lesson06")): importing the package does not load it."""
    if name == "lesson06":
        module = globals()["lesson06"] = _load_lesson(common, LESSON06_STEM)
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
