"""The package asks Triton for floating-point fusion in each of its own launches, so that a program
using it sees no "TRITON_DEFAULT_FP_FUSION is unset" warning and the kernels build as they were
measured whatever the program's environment says (Triton 3.10 turns the default off)."""
import ast
import os
import subprocess
import sys
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


def run_without_interpreter(code, unset=(), timeout=600):
    """Run `code` in a child Python process that imports this package, with TRITON_INTERPRET (and the
    variables in `unset`) left out of its environment: Triton builds real kernels there, as on a GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", *unset)}
    return subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=os.pathsep.join(
                              [str(PACKAGE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])),
                          capture_output=True, text=True, timeout=timeout, cwd=PACKAGE.parent)


def test_every_launch_in_the_package_asks_for_fp_fusion():
    missing = {f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
               for path in sorted(PACKAGE.rglob("*.py"))
               for line, text in launches_without_fp_fusion(path.read_text(), str(path))}
    assert not missing, "launches that leave floating-point fusion to the environment:\n" + "\n".join(sorted(missing))


def test_the_check_sees_a_launch_without_it():
    source = ("k[grid](x, BLOCK=4)\nk[grid](x, BLOCK=4, enable_fp_fusion=True)\nk[grid](x, **options)\n"
              "self.compiled[grid](x)\n")
    assert launches_without_fp_fusion(source) == [(1, "k[grid]")]


def test_building_the_kernels_warns_of_nothing():
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


def test_the_split_k_sum_compiles_once_for_every_count():
    """The split-K sum kernel's specialization (what keys its compiles) depends on its tile, dtypes and the
    alignment of Co and Ci_group alone: layers that differ in their counts (taps, tiles, slices; 1, a multiple
    of 16, or neither) share one build, and a Ci_group that breaks 16-element vectors gets its own. (Worked
    out in a child process where Triton is not the interpreter, as a GPU's process would.)"""
    code = ("import torch\n"
            "from conv_tutorial.kernels import aot, wgrad\n"
            "partial, dw = torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)\n"
            "def specialization(Co, Ci_group, *counts):\n"
            "    src, _, _ = aot.compile_source(wgrad.wgrad_split_k_sum_kernel, (partial, dw, Co, Ci_group, *counts),\n"
            "                                   dict(BLOCK_M=128, BLOCK_N=128, BLOCK=256), 'sm_90')\n"
            "    return repr((src.constants, src.attrs))\n"
            # (Co, Ci_group, then taps, num_pid_m, ci_blocks, whole_tiles, split_tiles, split_k)
            "layers = [(256, 64, 9, 2, 1, 0, 16, 2), (512, 128, 1, 1, 3, 132, 7, 11), (64, 64, 1, 16, 32, 48, 1, 3)]\n"
            "print('builds', len({specialization(*layer) for layer in layers}),\n"
            "      specialization(256, 24, 9, 2, 1, 0, 16, 2) != specialization(*layers[0]))\n")
    proc = run_without_interpreter(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "builds 1 True" in proc.stdout, proc.stdout


def test_the_depthwise_kernel_builds_once_for_every_batch_and_image_size():
    """The depthwise kernel's specialization depends on its channels, filter, strides, dilations, blocks and
    epilogue, not on the batch or image size: a batch of 1 and one of 128, 224x224 and 7x9 images share a build
    (in a child process where Triton is not the interpreter, as on a GPU)."""
    code = ("import torch\n"
            "from conv_tutorial import depthwise\n"
            "from conv_tutorial.kernels import aot\n"
            "def specialization(N, H, W, stride, padding):\n"
            "    C, R = 32, 3\n"
            "    x, w = torch.zeros(N, H, W, C, dtype=torch.bfloat16), torch.zeros(C, R, R, dtype=torch.bfloat16)\n"
            "    out_h, out_w = (H + 2 * padding - R) // stride + 1, (W + 2 * padding - R) // stride + 1\n"
            "    out = torch.zeros(N, out_h, out_w, C, dtype=torch.bfloat16)\n"
            "    args = (x, w, out, out, out, out, N, H, W, out_h, out_w, stride, stride, padding, padding, 1, 1)\n"
            "    kwargs = dict(C=C, R=R, S=R, BLOCK_P=128, BLOCK_C=32, EPILOGUE=depthwise.fprop.Epilogue())\n"
            "    src, _, _ = aot.compile_source(depthwise.depthwise_conv2d_kernel, args, kwargs, 'sm_90')\n"
            "    return repr((src.constants, src.attrs))\n"
            "sizes = [(1, 224, 224, 1, 1), (128, 7, 9, 1, 1), (16, 16, 16, 1, 0), (3, 33, 17, 1, 1)]\n"
            "print('builds', len({specialization(*size) for size in sizes}),\n"
            "      specialization(1, 224, 224, 2, 1) != specialization(*sizes[0]))\n")
    proc = run_without_interpreter(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "builds 1 True" in proc.stdout, proc.stdout      # (a stride of 2 is another build: it stays specialized)
