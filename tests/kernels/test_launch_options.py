"""The package asks Triton for floating-point fusion in each of its own launches, so that a program
using it sees no "TRITON_DEFAULT_FP_FUSION is unset" warning and the kernels build as they were
measured whatever the program's environment says (Triton 3.10 turns the default off)."""
import ast
from pathlib import Path

import common

PACKAGE = Path(__file__).resolve().parents[2] / "conv_tutorial"


def launches_without_fp_fusion(source, filename="<source>"):
    """`kernel[grid](...)` launches in `source` that name no `enable_fp_fusion` keyword and pass no
    `**options` that could carry it: (line, text) each. A launch of an already compiled kernel
    (`<...>.compiled[grid](...)`, a CompiledKernel) is left out: its options were fixed when it compiled."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and not (
                isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "compiled"):
            keywords = {k.arg for k in node.keywords}
            if "enable_fp_fusion" not in keywords and None not in keywords:      # None: a ** splat
                found.append((node.lineno, ast.get_source_segment(source, node.func)))
    return found


def test_every_launch_in_the_package_asks_for_fp_fusion():
    missing = {f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
               for path in sorted(PACKAGE.rglob("*.py"))
               for line, text in launches_without_fp_fusion(path.read_text(), str(path))}
    assert not missing, "launches that leave floating-point fusion to the environment:\n" + "\n".join(sorted(missing))


def test_the_check_sees_a_launch_without_it():
    source = ("k[grid](x, BLOCK=4)\nk[grid](x, BLOCK=4, enable_fp_fusion=True)\nk[grid](x, **options)\n"
              "self.compiled[grid](x)\n")
    assert launches_without_fp_fusion(source) == [(1, "k[grid]")]


def test_building_the_kernels_warns_of_nothing(run_without_interpreter):
    """The forward and wgrad kernels compiled ahead of time for sm_90 in a fresh process whose
    environment leaves fusion unset: no warning from Triton."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from conv_tutorial.kernels import aot\n"
            "for build in (aot.fprop_build, aot.wgrad_build):\n"
            "    aot.compile_for_target(*build('sm_90'), 'sm_90')\n"
            "print('built')\n")
    proc = run_without_interpreter(code, unset=("TRITON_DEFAULT_FP_FUSION",), timeout=900)
    if "Cannot find ptxas" in proc.stderr:
        import pytest
        pytest.skip("this Triton install has no assembler for sm_90")
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr[-3000:]
    assert "FP_FUSION" not in proc.stderr, proc.stderr[-3000:]
    assert common   # (conftest's kit set the lessons' environment in this process, not in the child's)
