"""The lessons' kit: what the lessons of the convolution tutorial series share and teach with.

Every lesson imports this module plainly (``import common``). It holds what more than one lesson
needs, so no lesson copies a helper from another. The facts the lessons share with the operator's
kernels (a conv's geometry and checks, the device table, the epilogue, TMA im2col's settings, the
reference conv, the ring counter) live in the package's side-effect-free core
(``conv_tutorial.core``, ``conv_tutorial.kernels.blocks``); this module names them for the lessons.
It never imports the package's runtime or torch layer. (Lesson 03's drawings: ``lesson_figures.py``.)

Naming key, used everywhere in the series
-----------------------------------------
- Activations are NHWC: ``[N, H, W, Ci]`` (batch, height, width, input channels).
- Weights are ``[Co, R, S, Ci]``: output channels, filter height R, filter width S, input channels.
- The output is NHWC ``[N, out_h, out_w, Co]``.
- stride, padding and dilation are ``(h, w)`` pairs; an int means the same value for both.
- The GEMM view of a convolution: ``M = N * out_h * out_w`` rows (one per output pixel),
  ``N_GEMM = Co`` columns, and a reduction of ``K = R * S * Ci``, ordered (r, s, ci) with ci fastest.
- FLOPs of one convolution: ``2 * N * out_h * out_w * Co * Ci * R * S``.

What is in here
---------------
- The process set-up: importing this module on a machine without a CUDA GPU turns on the Triton
  interpreter (``TRITON_INTERPRET=1``) before Triton is imported, so plain Triton kernels run on the
  CPU; the Triton version check.
- Random inputs, the tolerance of a comparison with the reference, `check_conv`, bad inputs.
- The cuDNN baseline and the lessons' benchmark shapes (the TFLOPS timer is the package's).
- Plots (matplotlib, Agg backend, one output folder), recorded GPU results, the ladder plot.
- Ahead-of-time builds of a lesson's kernel for sm_90 or sm_100 on a machine with no GPU (in a
  subprocess, through the package's one wrapper of Triton's internal compile API), and the PTX
  walkthrough: instruction counts, the report, the assertions the lessons' tests make, and which
  MMA operands a build reads transposed (lessons 06 and 07).
- A loader for the numbered lesson files (their names start with digits and hold dashes).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple, Union

import torch

REPO_ROOT = Path(__file__).resolve().parent

# %% Environment ---------------------------------------------------------------------------------
# The lessons' process set-up, done here because it must come before Triton is imported:
# - without a CUDA GPU, plain Triton kernels run in Triton's interpreter (`triton.jit` reads
#   TRITON_INTERPRET when a kernel is decorated); the ahead-of-time compiler's child process sets
#   CONV_TUTORIAL_AOT=1 to keep real, compilable kernels although it has no GPU;
# - floating-point fusion (a * b + c as one FMA) on, as the series was measured: Triton 3.9 warns
#   when a program leaves it to its default, which 3.10 turns off.
# The operator package never does this: a program that imports it keeps its environment as it was
# (the package asks for fusion in its own launches).
if not torch.cuda.is_available() and os.environ.get("CONV_TUTORIAL_AOT") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402  (must come after the interpreter decision above)


TRITON_SERIES = (3, 9)     # the Triton minor release the series is written for (requirements.txt)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


TRITON_VERSION = _version_tuple(triton.__version__)
if TRITON_VERSION[:2] != TRITON_SERIES:
    _wanted = f"{TRITON_SERIES[0]}.{TRITON_SERIES[1]}"
    _why = (f"this series is written for Triton {_wanted}: Gluon, the language of lessons 04-05, is "
            f"experimental and its API moves between releases (3.9 changed its cluster barriers), and "
            f"TMA im2col needs 3.8 or newer; Triton {triton.__version__} is installed.")
    if TRITON_VERSION[:2] < TRITON_SERIES:
        raise ImportError(f"{_why} Run the README's commands, which install Triton {_wanted}, or "
                          f"`pip install 'triton>={_wanted},<{TRITON_SERIES[0]}.{TRITON_SERIES[1] + 1}'`.")
    warnings.warn(f"{_why} Lessons 01-03 should run; Gluon code may not compile.", stacklevel=2)


def quiet_teardown():
    """Triton 3.9's compiler library reports "nanobind: leaked N instances" on stderr as the
    interpreter shuts down, after a program that built Gluon code whose layouts Triton's bindings
    looked up (importing a Gluon kernel module can be enough): those bindings keep references to
    Gluon's layout classes (README, "A report at exit that is Triton's"; Triton silences it the same
    way in its compile workers). A lesson run (lesson_args)
    and the test run ask for this: at exit, once everything the program printed (and any
    traceback) is out, stderr goes to /dev/null. CONV_TUTORIAL_SHOW_TEARDOWN=1 keeps it."""
    if os.environ.get("CONV_TUTORIAL_SHOW_TEARDOWN") == "1":
        return

    def silence():
        sys.stderr.flush()
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 2)
        os.close(quiet)
    import atexit
    atexit.register(silence)


# The facts the lessons share with the operator's kernels live in its side-effect-free core (the
# device table, a conv's geometry and checks, the epilogue, TMA im2col's settings, the reference
# conv) and its building blocks (the ring counter, barrier pairs): the kit names them for the lessons.
from conv_tutorial.core.device import (  # noqa: E402,F401
    ARCH_CAPABILITY, DEVICE_PEAKS, GLUON_SKIP_REASON, HAS_CUDA, POWER_LIMITED_PEAK_TFLOPS, SHARED_MEMORY_PER_PROGRAM,
    capability, dense_peak, device_peaks, gpu_name, has_tma_mma_gpu, interpreter_mode, is_blackwell, is_hopper,
    require_tma_mma_gpu, tma_mma_arch_and_sms)
from conv_tutorial.core.epilogue import (  # noqa: E402,F401
    ACTIVATIONS, FP8, RELU_GRAD, check_epilogue, output_dtype, reference_epilogue)
from conv_tutorial.core.geometry import (  # noqa: E402,F401
    check_conv_call, check_conv_inputs, conv_geometry, conv_output_size, has_output, pair)
from conv_tutorial.core.reference import reference_conv2d_nhwc  # noqa: E402,F401
from conv_tutorial.core.timing import bench_tflops  # noqa: E402,F401
from conv_tutorial.core.tma import (  # noqa: E402,F401
    GL_DTYPES, canonical_strides, conv_im2col_settings, conv_tma_descriptors, pad_channels_for_tma,
    validate_im2col_settings)
from conv_tutorial.kernels.aot import compile_for_target  # noqa: E402,F401
from conv_tutorial.kernels.blocks import Counter, allocate_barrier_pairs  # noqa: E402,F401


def device() -> str:
    """Where lessons put their tensors: "cuda" on a GPU machine, "cpu" under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


def versions() -> dict:
    """Versions and device for data files and plot titles."""
    info = {"device": gpu_name(), "torch": torch.__version__, "triton": triton.__version__}
    if HAS_CUDA:
        info["capability"] = "%d.%d" % capability()
        info["cudnn"] = torch.backends.cudnn.version()
        info["cuda"] = torch.version.cuda
    return info


def cudnn_version_text(version) -> str:
    """cuDNN's version for titles and labels: torch.backends.cudnn.version()'s int (91900, as the
    data files record it) as "9.19.0"; anything else (None, a string) as it is."""
    if isinstance(version, int) and not isinstance(version, bool) and version > 0:
        major = version // 10000 if version >= 10000 else version // 1000   # cuDNN 9: 9*10000 + minor*100 + patch
        return f"{major}.{version // 100 % (100 if version >= 10000 else 10)}.{version % 100}"   # cuDNN 8: 8*1000 + ...
    return str(version)


def random_conv_inputs(N, H, W, Ci, Co, R, S, dtype=torch.float16, device_name=None, seed=0):
    """Random NHWC input and [Co, R, S, Ci] weight, scaled so outputs stay near unit size."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(N, H, W, Ci, generator=generator)
    w = torch.randn(Co, R, S, Ci, generator=generator) / math.sqrt(R * S * Ci)
    target = device_name or device()
    return x.to(target, dtype), w.to(target, dtype)


def assert_close_to_reference(out, expected, *, dtype, K):
    """Compare a kernel's NHWC output with the fp32 reference, with a tolerance that says why.

    fp32 inputs on the CPU interpreter are exact up to summation order: 1e-4. fp16 keeps 11 bits of
    mantissa: each product is exact in the fp32 accumulator, and the final rounding to fp16 costs
    half an ulp (~5e-4 relative), so 2e-3 leaves room. bf16 keeps 8 bits (~4e-3 relative per
    rounding): 2e-2. The absolute part scales with sqrt(K), the growth of a random sum."""
    rtol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    atol = rtol * max(1.0, math.sqrt(K) / 8)
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


def check_conv(entry, N, H, W, Ci, Co, R, S, stride=1, padding=0, dilation=1, dtype=torch.float16,
               with_bias=False, seed=0, scale=False, residual=False, activation="none", groups=1, **kwargs):
    """Run a lesson's conv entry point on random inputs and compare it with the fp32 reference.

    `entry(x_nhwc, w, stride=, padding=, dilation=[, bias=][, scale=, residual=, activation=]
    [, groups=], **kwargs)` returns NHWC. `with_bias`, `scale` and `residual` ask for random epilogue
    operands (scale in [0.5, 1.5)), checked against reference_epilogue. Returns the output."""
    x_nhwc, w = random_conv_inputs(N, H, W, Ci, Co, R, S, dtype, seed=seed)
    if groups > 1:        # [Co, R, S, Ci / groups], at the scale of a filter that deep
        w = (w[..., :Ci // groups].float() * math.sqrt(groups)).to(dtype).contiguous()
        kwargs["groups"] = groups
    geometry = conv_geometry(x_nhwc.shape, w.shape, stride, padding, dilation, groups)
    generator = torch.Generator().manual_seed(seed + 1)
    operands = {"bias": torch.randn(Co, generator=generator) if with_bias else None,
                "scale": torch.rand(Co, generator=generator) + 0.5 if scale else None,
                "residual": torch.randn(geometry.N, geometry.out_h, geometry.out_w, Co,
                                        generator=generator).to(dtype) if residual else None}
    operands = {name: t.to(x_nhwc.device) for name, t in operands.items() if t is not None}
    if activation != "none":
        kwargs["activation"] = activation
    out = entry(x_nhwc, w, stride=stride, padding=padding, dilation=dilation, **operands, **kwargs)
    expected = reference_conv2d_nhwc(x_nhwc, w, None, stride, padding, dilation, out_dtype=torch.float32,
                                     groups=groups)
    expected = reference_epilogue(expected, operands.get("bias"), operands.get("scale"),
                                  operands.get("residual"), activation).to(dtype)
    if out.shape != expected.shape or out.dtype != dtype:
        raise AssertionError(f"got {tuple(out.shape)} {out.dtype}, expected {tuple(expected.shape)} {dtype}")
    assert_close_to_reference(out, expected, dtype=dtype, K=geometry.K)
    return out


class PlainInt(int):
    """An int whose arithmetic stays a PlainInt and which ignores `.to(dtype)`: a Gluon kernel's
    index arithmetic, casts included, run as plain Python (`SomeAggregate.method.fn(...)`) by the
    tests that check it against a model (lesson 05)."""
    def to(self, dtype):
        return self


for _name in ("__add__", "__radd__", "__sub__", "__mul__", "__rmul__", "__floordiv__", "__mod__"):
    setattr(PlainInt, _name, lambda self, other, _op=getattr(int, _name): PlainInt(_op(self, other)))


# %% Benchmarks -------------------------------------------------------------------------------------


def cudnn_conv2d(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1):
    """Return a closure running cuDNN on the same data, in channels_last memory format.

    An NHWC tensor permuted to NCHW *is* a channels_last tensor: no copy is made, and cuDNN sees
    exactly the bytes our kernels read."""
    x_nchw = x_nhwc.permute(0, 3, 1, 2)
    w_kcrs = w.permute(0, 3, 1, 2)
    if not x_nchw.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"x_nhwc must be a contiguous NHWC tensor, got strides {x_nhwc.stride()}")
    stride, padding, dilation = (pair(stride, "stride", 1), pair(padding, "padding", 0),
                                 pair(dilation, "dilation", 1))
    return lambda: torch.nn.functional.conv2d(x_nchw, w_kcrs, bias, stride, padding, dilation)


def bad_conv_inputs(mismatched_dtype):
    """Bad-input cases every conv entry point must refuse, as pytest parameters
    (make_args(x, w) -> (x, w), kwargs, error type, message pattern). `mismatched_dtype` is a
    supported dtype other than the test tensors'. Lessons add their own cases."""
    return [
        (lambda x, w: (x.float(), w.float()), {}, TypeError, "dtype"),
        (lambda x, w: (x, w.to(mismatched_dtype)), {}, TypeError, "mismatch"),
        (lambda x, w: (x[0], w), {}, ValueError, "rank 4"),
        (lambda x, w: (x, w[..., :4]), {}, ValueError, "channel mismatch"),
        (lambda x, w: (x, w), {"stride": 0}, ValueError, "stride"),
        (lambda x, w: (x[:, :2, :2], w), {}, ValueError, "empty output"),
        (lambda x, w: (x.transpose(1, 2), w), {}, ValueError, "contiguous NHWC"),
    ]


# Shapes used by the benchmarks of lessons 02 and 05: (label, N, H, W, Ci, Co, R, S, stride, padding)
HEADLINE_SHAPE = ("headline 64x64 384->384 3x3", 128, 64, 64, 384, 384, 3, 3, 1, 1)
RESNET50_3X3_SHAPES = [
    ("RN50 56x56 64->64 3x3", 128, 56, 56, 64, 64, 3, 3, 1, 1),
    ("RN50 28x28 128->128 3x3", 128, 28, 28, 128, 128, 3, 3, 1, 1),
    ("RN50 14x14 256->256 3x3", 128, 14, 14, 256, 256, 3, 3, 1, 1),
    ("RN50 7x7 512->512 3x3", 128, 7, 7, 512, 512, 3, 3, 1, 1),
]


# %% Plots and output folder --------------------------------------------------------------------------


def output_dir(path=None, announce=True) -> Path:
    """The one folder where the series writes plots and data: --outdir, $CONV_TUTORIAL_OUT or the
    repository's out/. Inside the current folder, or with both inside the repository, it is
    returned (and printed) relative to the current folder, so that the lines naming it and its
    plots show no machine's absolute path (the site's pages print what a run prints)."""
    folder = Path(path or os.environ.get("CONV_TUTORIAL_OUT") or REPO_ROOT / "out").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    here = Path.cwd().resolve()
    if folder.is_relative_to(here) or (folder.is_relative_to(REPO_ROOT) and here.is_relative_to(REPO_ROOT)):
        try:
            folder = Path(os.path.relpath(folder, here))
        except ValueError:            # another drive (Windows): keep it absolute
            pass
    if announce:
        print(f"[output] plots and data go to {folder}")
    return folder


def new_figure(*args, **kwargs):
    """A matplotlib figure drawn with the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)


def save_figure(fig, outdir, name: str, data=None) -> Path:
    """Save `fig` as outdir/name.png (and `data` as name.json beside it); print and return the path."""
    import matplotlib.pyplot as plt
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    if os.environ.get("CONV_TUTORIAL_KEEP_FIGURES") != "1":   # the site's builder collects open figures
        plt.close(fig)
    if data is not None:
        save_json(outdir, name, data)
    print(f"[plot] {path}")
    return path


def save_json(outdir, name: str, data) -> Path:
    """Write `data` as outdir/name.json (what recorded_results reads back from results/)."""
    path = Path(outdir) / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def lesson_args(description: str, argv=None):
    """The small command line every lesson shares: --bench, --outdir, --quick, --verbose."""
    import argparse
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bench", action="store_true", help="run the GPU benchmark (needs a GPU)")
    parser.add_argument("--outdir", default=None, help="folder for plots and data (default ./out)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, for a fast look")
    parser.add_argument("--verbose", action="store_true",
                        help="print everything (e.g. lesson 03's pixel-by-pixel listings)")
    quiet_teardown()
    return parser.parse_args(argv)


# %% Loading lessons -------------------------------------------------------------------------------


_LESSONS = {}   # stem -> module


def load_lesson(stem: str):
    """Import a numbered lesson (e.g. "02-im2col-explicit") as a module, once per process.

    Lesson files start with digits and hold dashes, so `import` cannot name them. Importing a lesson
    has no side effects beyond defining its kernels and functions."""
    if stem in _LESSONS:
        return _LESSONS[stem]
    path = REPO_ROOT / f"{stem}.py"
    if not path.exists():
        raise FileNotFoundError(f"no lesson file {path}")
    # Already imported (as __main__, or by pytest under its own name)? Use that module: a second
    # copy would have kernels of its own. (Comparing paths over sys.modules takes ~40 ms.)
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) and Path(module.__file__).resolve() == path:
            _LESSONS[stem] = module
            return module
    module_name = "lesson_" + stem.replace("-", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    _LESSONS[stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:          # a lesson that failed to import is not kept half-made
        del _LESSONS[stem], sys.modules[module_name]
        raise
    return module


# %% Ahead-of-time compilation for a GPU target on a machine without one --------------------------

compile_kernel_for_target = compile_for_target    # (the package's: one home for Triton's internal APIs)


def _aot_child(stem: str, builder: str, arch: str, params_json: str) -> None:
    """Runs in the subprocess: build the kernel's launch arguments and print PTX + metadata as JSON."""
    # a lesson by its stem, the kit itself, or a module by its dotted name (the package's kernels)
    module = (sys.modules[__name__] if stem == "common" else importlib.import_module(stem) if "." in stem
              else load_lesson(stem))
    kernel, args, kwargs = getattr(module, builder)(arch=arch, **json.loads(params_json))
    compiled = compile_kernel_for_target(kernel, args, kwargs, arch)
    meta = compiled.metadata
    print("AOT-JSON:" + json.dumps({"ptx": compiled.asm["ptx"], "shared": meta.shared,
                                    "tmem_size": getattr(meta, "tmem_size", 0),
                                    "num_warps": meta.num_warps,
                                    **cubin_resources(compiled.asm.get("cubin"))}))


def cubin_resources(cubin: bytes) -> dict:
    """{"registers": per thread, "stack": bytes of stack frame per thread} of a compiled kernel,
    read from its cubin with cuobjdump (shipped with Triton); None each where no cuobjdump is at
    hand. A stack frame in a Triton kernel is where registers spill to."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if not cubin or not tool:
        return {"registers": None, "stack": None}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([tool, "-res-usage", file.name], capture_output=True, text=True).stdout
    found = {name: re.search(rf"{key}:(\d+)", usage) for name, key in (("registers", "REG"), ("stack", "STACK"))}
    return {name: int(match.group(1)) if match else None for name, match in found.items()}


class AotToolMissing(RuntimeError):
    """The installed Triton lacks the assembler for a target, so it cannot be compiled here."""


SHOW_PROGRESS = None     # text -> None, where a test run shows what a slow step is doing (conftest.py)


@functools.lru_cache(maxsize=None)
def _aot_cached(stem, builder, arch, params_json):
    env = dict(os.environ, CONV_TUTORIAL_AOT="1", TRITON_INTERPRET="0",
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    code = (f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); import common; "
            f"common._aot_child({stem!r}, {builder!r}, {arch!r}, {params_json!r})")
    if SHOW_PROGRESS is not None:      # a build takes seconds to a minute: say so (conftest.py sets it)
        SHOW_PROGRESS(f" [compiling {stem} for {arch}]")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("AOT-JSON:"):
            return json.loads(line[len("AOT-JSON:"):])
    if "Cannot find ptxas" in proc.stderr:
        raise AotToolMissing(f"this Triton install has no assembler for {arch} (ptxas"
                             f"{'-blackwell' if arch == 'sm_100' else ''} is missing from "
                             f"triton/backends/nvidia/bin), so {arch} builds cannot be checked here; "
                             f"a complete `pip install triton` has it")
    raise RuntimeError(f"ahead-of-time compile of {stem}.{builder} for {arch} failed "
                       f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def aot_compile(stem: str, builder: str, arch: str, **params) -> dict:
    """Compile a lesson's kernel for `arch` in a fresh subprocess; return {"ptx", "shared", ...}.

    `builder` names a function of the lesson, `builder(arch=..., **params)`, that returns
    `(kernel, args, kwargs)` built from CPU tensors. A subprocess, because a kernel built for the wrong
    architecture aborts the whole Python process (an LLVM error, not an exception). Results are
    cached per process."""
    return _aot_cached(stem, builder, arch, json.dumps(params, sort_keys=True))


def aot_compile_or_say_why(stem: str, builder: str, arch: str, **params):
    """aot_compile for a lesson's demo: None (and one printed line) where Triton cannot target `arch`."""
    try:
        return aot_compile(stem, builder, arch, **params)
    except AotToolMissing as missing:
        print(f"\n[skip] {arch} PTX: {missing}")
        return None


def aot_compile_or_skip(stem: str, builder: str, arch: str, **params) -> dict:
    """aot_compile for tests: skip (with the reason) where the Triton install cannot target `arch`."""
    import pytest
    try:
        return aot_compile(stem, builder, arch, **params)
    except AotToolMissing as missing:
        pytest.skip(str(missing))


# The TMA instructions lessons 04 and 05 teach, as their PTX lines begin
PTX_IM2COL_LOAD = "cp.async.bulk.tensor.4d.shared::cta.global.im2col"
PTX_TILED_LOAD = "cp.async.bulk.tensor.2d.shared::cta.global"
PTX_TMA_STORE = "cp.async.bulk.tensor.2d.global.shared::cta"


def ptx_instructions(ptx: str, prefixes) -> dict:
    """Count the PTX lines that start with each prefix (e.g. "wgmma.mma_async")."""
    counts = {prefix: 0 for prefix in prefixes}
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith("@"):  # predicated instruction: "@%p1 cp.async..."
            stripped = stripped.split(None, 1)[-1] if " " in stripped else stripped
        for prefix in prefixes:
            if stripped.startswith(prefix):
                counts[prefix] += 1
    return counts


def show_ptx(stem: str, builder: str, taught: dict, heading, **params) -> dict:
    """A lesson demo's PTX report, for readers without a GPU: what the compiler made of the kernel.

    `taught` is {arch: [(instruction prefix, why it is there and why that many), ...]}. For each
    arch, compile `builder`'s kernel (ahead of time), print `heading(arch, compiled)`, its
    resources (shared memory, registers per thread, tensor memory), then per taught instruction
    its count in the program text, one whole instruction as the PTX has it, and the explanation.
    Archs this Triton cannot target get one line saying why. `params` go to the builder. Returns
    {arch: counts}."""
    import textwrap
    report = {}
    for arch, rows in taught.items():
        compiled = aot_compile_or_say_why(stem, builder, arch, **params)
        if compiled is None:
            continue
        counts = report[arch] = ptx_instructions(compiled["ptx"], [prefix for prefix, _ in rows])
        print(f"\n{arch}: {heading(arch, compiled)}")
        resources = [f"{compiled['shared']} bytes of shared memory"]
        if compiled.get("registers"):
            resources.append(f"{compiled['registers']} registers per thread")
        if arch == "sm_100":
            resources.append(f"{compiled.get('tmem_size', 0)} columns of tensor memory")
        print("   resources: " + ", ".join(resources))
        for prefix, why in rows:
            example = first_ptx_instruction(compiled["ptx"], prefix)
            print(f"   {counts[prefix]} x {prefix}")
            print(f"      {example}")          # one whole instruction, as the PTX has it
            for chunk in textwrap.wrap(why, 92):
                print(f"      | {chunk}")
    return report


def assert_ptx_teaches(stem: str, builder: str, arch: str, taught: dict, **params) -> dict:
    """A lesson's test that its kernel's `arch` build (`params` to the builder) holds every
    instruction its table `taught` explains (skipped where this Triton cannot target `arch`);
    returns the compiled build."""
    compiled = aot_compile_or_skip(stem, builder, arch, **params)
    counts = ptx_instructions(compiled["ptx"], [prefix for prefix, _ in taught[arch]])
    missing = [prefix for prefix, count in counts.items() if count == 0]
    assert not missing, f"{arch}: PTX lacks {missing}"
    return compiled


def first_ptx_instruction(ptx: str, prefix: str) -> str:
    """The first instruction that contains `prefix`, whole: PTX may spread one instruction over
    several lines (a wgmma's register list), and it ends at the semicolon."""
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        if prefix in line and not line.strip().startswith("//"):
            parts = [line.strip()]
            while not parts[-1].endswith(";") and i + len(parts) < len(lines):
                parts.append(lines[i + len(parts)].strip())
            return " ".join(parts)
    return "(none)"


def transposed_operands(ptx: str, arch: str) -> tuple:
    """(A transposed, B transposed) of a build's first MMA, read from its PTX: on sm_90 the WGMMA's
    imm-trans-a and imm-trans-b (its last two values); on sm_100 bits 15 and 16 of the tcgen05
    instruction descriptor, an immediate the PTX moves into the register the MMA names. 0: the
    operand is K-major, as the tensor cores read by default; 1: M- or N-major (lessons 06 and 07)."""
    if arch == "sm_90":
        trans_a, trans_b = re.search(r"wgmma\.mma_async[^;]*, (\d), (\d);", ptx).groups()
        return int(trans_a), int(trans_b)
    descriptor = tcgen05_instruction_descriptor(ptx)
    return descriptor >> 15 & 1, descriptor >> 16 & 1


def tcgen05_instruction_descriptor(ptx: str) -> int:
    """The 32-bit instruction descriptor of a build's first tcgen05.mma: an immediate the PTX moves
    into the register the MMA names (its fields: the PTX ISA's "Instruction descriptor" table)."""
    register = re.search(r"tcgen05\.mma\.[^;]*, (%r\d+), %p\d+;", ptx).group(1)
    return int(re.search(rf"mov\.b32\s+{re.escape(register)}, (\d+);", ptx).group(1))


def cpu_closing_line(lesson: str, checked: str, needs_gpu: str, gpu: str = "a Hopper or Blackwell GPU") -> str:
    """The last line of a lesson run without a suitable GPU: what was checked, what was not."""
    return (f"lesson {lesson}, on this machine ({gpu_name()}): checked {checked}; "
            f"needs {gpu}: {needs_gpu}")


# %% Recorded GPU results ---------------------------------------------------------------------------
# Readers without a GPU (and the series' web pages) see what a GPU run printed and drew, from the
# JSON files that the benchmarks write and the repository keeps under results/<device>-<date>/.

RESULTS_DIR = REPO_ROOT / "results"


def recorded_results(name: str):
    """The newest recorded `name`.json under results/ as (data, info), or None.

    info has "device", "torch", "triton", "cudnn" (from the file, where recorded), "date" and
    "folder" (from the folder name, <device>-<YYYY-MM-DD>), and "label": one line for titles."""
    def date(path):      # the folder's <YYYY-MM-DD>, wherever it stands ("h100-2026-11-24-package")
        found = re.search(r"\d{4}-\d{2}-\d{2}", path.parent.name)
        return found.group(0) if found else ""
    found = sorted(RESULTS_DIR.glob(f"*-*/{name}.json"), key=lambda path: (date(path), path.parent.name))
    if not found:
        return None
    path = found[-1]
    data = json.loads(path.read_text())
    info = {key: data.get(key) for key in ("device", "torch", "triton", "cudnn")}
    info.update(date=date(path), folder=str(path.parent.relative_to(REPO_ROOT)))
    info["label"] = (f"recorded {info['date']} on {info['device']}, torch {info['torch']}, "
                     f"Triton {info['triton']}, cuDNN {cudnn_version_text(info['cudnn'])} ({info['folder']})")
    return data, info


def announce_recorded(name: str, what: str):
    """For a lesson run where a step needs a GPU: recorded_results(name), announced with one line
    that says what it is, that it was not measured here, and where and when it was; None (and one
    line saying so) when the repository holds no such record."""
    recorded = recorded_results(name)
    if recorded is None:
        print(f"[skip] {what}: needs a GPU, and no recorded results are under results/")
        return None
    print(f"\n{what} as measured on a GPU (RECORDED, not measured here; {recorded[1]['label']}):")
    return recorded

# %% The ladder's plot (lesson 05 draws the recorded one; benchmarks/network_suite.py a measured one) --

LADDER_SERIES = ["02 implicit GEMM", "04 single-buffer", "05 warp-specialized", "cuDNN"]


def draw_peaks(ax, device_name, horizontal=True):
    """The data sheet's dense bf16 peak and, where measured, the peak at the board's power limit."""
    for peak, style, label in ((dense_peak(device_name), "--", "dense bf16 peak, data sheet"),
                               (next((v for k, v in POWER_LIMITED_PEAK_TFLOPS.items() if k in device_name), None),
                                ":", "peak at the 700 W limit (~1440 MHz, measured)")):
        if peak:
            ax.axhline(peak, color="red", ls=style, lw=1, label=f"{label}: {peak:.0f}")


def plot_ladder(rows, info, dtype, outdir, data, recorded=None):
    """The per-shape bars and the ladder of the headline shape. `recorded` (the info of
    recorded_results) marks plots drawn from a recorded run: titled so, saved as *_recorded."""
    colors = ["#999999", "#d08040", "#2060c0", "#40a040"]
    mark = f"RECORDED {recorded['date']} (not measured on this machine): " if recorded else ""
    suffix = "_recorded" if recorded else ""
    dtype = str(dtype).replace("torch.", "")
    fig, ax = new_figure(figsize=(12, 5))
    width = 0.2
    for i, name in enumerate(LADDER_SERIES):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ax.bar(xs, [r[name]["tflops"] for r in rows], width, label=name, color=colors[i])
    draw_peaks(ax, info["device"])
    tallest = max([dense_peak(info["device"]) or 0] + [r[n]["tflops"] for r in rows for n in LADDER_SERIES])
    ax.set_ylim(0, 1.1 * tallest)
    ax.set_xticks(range(len(rows)), [r["shape"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_xlabel("layer: input size, Ci->Co, filter, stride (batch 128; SD UNet at batch 8)")
    ax.set_ylabel("TFLOPS (higher is better)")
    ax.set_title(f"{mark}Forward convolution throughput per layer: lessons 02, 04, 05 and cuDNN, {dtype}\n"
                 f"{info['device']}, Triton {info['triton']}, torch {info['torch']}, "
                 f"cuDNN {cudnn_version_text(info.get('cudnn'))}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)   # below: no line hidden
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, outdir, "05_tflops_per_shape" + suffix, data)

    headline = rows[0]
    fig, ax = new_figure(figsize=(7, 4.5))
    values = [headline[n]["tflops"] for n in LADDER_SERIES]
    bars = ax.bar(["lesson 02\nimplicit GEMM", "lesson 04\nTMA + MMA", "lesson 05\nwarp-specialized",
                   "cuDNN"], values, color=colors)
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom")
    draw_peaks(ax, info["device"])
    ax.set_ylim(0, 1.25 * max([dense_peak(info["device"]) or 0] + values))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax.set_ylabel("TFLOPS (higher is better)")
    ax.set_title(f"{mark + chr(10) if mark else ''}Each lesson's kernel and cuDNN on the headline layer, {dtype}\n"
                 f"{headline['geometry']}\n{info['device']}, Triton {info['triton']}, torch {info['torch']}, "
                 f"cuDNN {cudnn_version_text(info.get('cudnn'))}", fontsize=9)
    save_figure(fig, outdir, "05_ladder" + suffix)


def show_recorded_ladder(outdir, describe_config=str):
    """The ladder as a GPU recorded it (benchmarks/network_suite.py --ladder), printed and drawn,
    marked RECORDED with its device and date; None where no record exists.
    `describe_config` turns a row's recorded lesson-05 config (a list of its fields) into text."""
    recorded = announce_recorded("05_tflops_per_shape", "The ladder (TFLOPS, bf16)")
    if recorded is None:
        return None
    data, info = recorded
    print(f"  {'shape':<30}{'02':>7}{'04':>7}{'05':>7}{'cuDNN':>7}  05/cuDNN  05 config")
    for row in data["rows"]:
        print(f"  {row['shape']:<30}" + "".join(f"{row[n]['tflops']:7.1f}" for n in LADDER_SERIES)
              + f"  {row['ratio_05_cudnn']:7.2f}x  {describe_config(row['config_05'])}")
    print(f"  geometric mean of 05/cuDNN over the 3x3 shapes: {data['geomean_3x3_ratio']:.3f}x")
    plot_ladder(data["rows"], info, data["dtype"], outdir, None, recorded=info)
    return data


