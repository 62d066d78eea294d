"""The operator runs what the lessons teach: the package's production kernels, built with their
extra features off, against the lessons' own kernels at the configs the lessons teach.

Ahead of time, on any machine, for sm_90 and sm_100: both builds must have the same PTX code, line
for line (every instruction with its operands, in order; only what says where the source was is left
out: the debug sections, `.loc` and `.file` lines, comments), hence the same count of every opcode;
and the same shared memory, warps, tensor-memory columns and (where cuobjdump is at hand) registers
and stack. On a Hopper or Blackwell GPU: the same bits for the same inputs. (wgrad's ordered sum is a
plain Triton kernel, compared by its bits on a GPU.)

- lesson 05's `conv2d_fprop_kernel` (Part I's kernel) against `conv_tutorial.kernels.fprop`'s: the
  production kernel adds Part II's tails and split-K (sections 6 and 7, which the lesson tours there)
  and the backward's switches (an output window and a dgrad's phases, a filter read in place, channel
  statistics, ReLU's backward), each a constexpr None or off here;
- lesson 07's `conv2d_wgrad_kernel` against `conv_tutorial.kernels.wgrad`'s (the same kernel).
"""
import re
from collections import Counter

import common
import pytest
import torch

LESSON05, LESSON07 = "05-warp-specialized-conv", "07-conv-wgrad"
PACKAGE_AOT = "conv_tutorial.kernels.aot"

fprop = pytest.importorskip("conv_tutorial.kernels.fprop")
FIXED = list(fprop.FIXED_CONFIG)
PLAIN, FUSED = [False, False, False, "none"], [True, True, True, "relu"]

# (arch, what lesson 05 teaches with it, build parameters): its configs (the headline's 256-row tile
# among them), the plain and the fused epilogue, and e4m3 (section 9). (A grouped conv, section 10, is
# the same build with other run-time integers; the tails and split-K of sections 6 and 7 are the
# package's only, checked by tests/lessons/test_05_extensions.py.)
FPROP_CASES = [
    ("sm_90", "fixed config, plain epilogue", dict()),
    ("sm_90", "fixed config, fused epilogue", dict(epilogue=FUSED)),
    ("sm_90", "ping-pong", dict(config=list(fprop.FIXED_CONFIG._replace(consumers=2)), epilogue=FUSED)),
    ("sm_90", "256-row tile, one 8-warp consumer",
     dict(Ci=128, Co=256, config=list(fprop.KernelConfig(256, 128, 64, 3, 8)))),
    ("sm_90", "128 x 64 tile, 6 stages", dict(config=list(fprop.KernelConfig(128, 64, 64, 6, 4)), epilogue=FUSED)),
    ("sm_90", "e4m3 operands", dict(dtype="float8_e4m3fn")),
    ("sm_100", "fixed config, plain epilogue", dict()),
    ("sm_100", "fixed config, fused epilogue", dict(epilogue=FUSED)),
    ("sm_100", "128 x 64 tile, 6 stages", dict(config=list(fprop.KernelConfig(128, 64, 64, 6, 4)))),
]


def ptx_code(ptx):
    """The PTX's code lines: without the debug sections, `.loc`/`.file` lines, comments and blank lines
    (what says where the source was, which differs between two files holding the same kernel)."""
    code = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    return [line.strip() for line in code.splitlines()
            if line.strip() and not re.match(r"\s*(\.loc|\.file|//)", line)]


def fingerprint(build):
    """What must agree between two builds of one kernel: the PTX's code lines, each opcode's count
    (for a readable report), shared memory, warps, tensor-memory columns, registers and stack (None
    where cuobjdump is missing)."""
    code, opcodes = ptx_code(build["ptx"]), Counter()
    for line in code:
        match = re.match(r"([a-z][\w.:]*)[\s;]", re.sub(r"^@!?%\w+\s+", "", line))
        if match and not line.startswith("."):
            opcodes[match.group(1)] += 1
    return {"code": code, "opcodes": dict(sorted(opcodes.items())),
            **{key: build.get(key) for key in ("shared", "num_warps", "tmem_size", "registers", "stack")}}


def differences(lesson, package):
    """Where two fingerprints differ, one line each: the opcodes whose counts differ, the resources,
    and else the first code line that differs (same counts, other operands or order)."""
    lines = []
    for op in sorted(set(lesson["opcodes"]) | set(package["opcodes"])):
        a, b = lesson["opcodes"].get(op, 0), package["opcodes"].get(op, 0)
        if a != b:
            lines.append(f"{op}: lesson {a}, package {b}")
    lines += [f"{key}: lesson {lesson[key]}, package {package[key]}" for key in lesson
              if key not in ("code", "opcodes") and lesson[key] != package[key]]
    if not lines and lesson["code"] != package["code"]:
        at = next((i for i, (a, b) in enumerate(zip(lesson["code"], package["code"])) if a != b),
                  min(len(lesson["code"]), len(package["code"])))
        lines.append(f"PTX line {at}: lesson {lesson['code'][at:at + 1]}, package {package['code'][at:at + 1]}")
    return lines


def assert_same_build(kernel, lesson_stem, lesson_builder, package_builder, arch, what, params):
    """The lesson's build and the package's of one kernel at `params`, compared (`differences`)."""
    lesson = common.aot_compile_or_skip(lesson_stem, lesson_builder, arch, **params)
    package = common.aot_compile_or_skip(PACKAGE_AOT, package_builder, arch, **params)
    found = differences(fingerprint(lesson), fingerprint(package))
    assert not found, f"{arch}, {what}: the package's {kernel} and {lesson_stem}'s differ:\n" + "\n".join(found)


@pytest.mark.parametrize("arch, what, params", FPROP_CASES, ids=[f"{a}-{w}" for a, w, _ in FPROP_CASES])
def test_forward_kernel_builds_as_lesson_05_teaches_it(arch, what, params):
    assert_same_build("forward kernel", LESSON05, "aot_conv2d_fprop", "fprop_build", arch, what, params)


def test_the_comparison_sees_one_instruction():
    """The check above is not vacuous: one more instruction (one without operands too), one other
    operand, or one byte of shared memory is a difference; where the source was is not."""
    ptx = (".visible .entry k()\n{\n\t.loc\t1 10 4\n\tadd.s32 \t%r1, %r2, %r3;\n\tret;\n}\n"
           ".section\t.debug_info\n{\n}\n")
    base = {"ptx": ptx, "shared": 1024, "num_warps": 4, "tmem_size": 0, "registers": None, "stack": None}
    changed = lambda old, new: fingerprint(dict(base, ptx=ptx.replace(old, new)))  # noqa: E731
    assert differences(fingerprint(base), fingerprint(base)) == []
    assert differences(fingerprint(base), changed("\t.loc\t1 10 4", "\t.loc\t2 99 1")) == []
    assert differences(fingerprint(base), changed("\tret;", "\tmul.lo.s32 \t%r4, %r1, %r1;\n\tret;")) == [
        "mul.lo.s32: lesson 0, package 1"]
    assert differences(fingerprint(base), changed("\tret;", "\twgmma.fence.sync.aligned;\n\tret;")) == [
        "wgmma.fence.sync.aligned: lesson 0, package 1"]
    assert differences(fingerprint(base), changed("%r3;", "%r4;")) == [
        "PTX line 2: lesson ['add.s32 \\t%r1, %r2, %r3;'], package ['add.s32 \\t%r1, %r2, %r4;']"]
    assert differences(fingerprint(base), fingerprint(dict(base, shared=1025))) == ["shared: lesson 1024, package 1025"]


# (arch, what lesson 07 teaches with it, build parameters): the wgrad kernel with x read by im2col and split-K,
# x read tiled (a 1x1 conv), the launcher's own configs, and a folded stem's few channels.
WGRAD_CASES = [
    ("sm_90", "3x3, split-K in 2", dict()),
    ("sm_90", "1x1, x read tiled", dict(R=1, S=1, padding=0)),
    ("sm_90", "the launcher's 128 x 128 x 64 tiles", dict(N=8, H=14, W=14, Ci=128, Co=256, default_config=True)),
    ("sm_90", "the launcher's 64 x 128 x 128 tiles", dict(N=8, H=14, W=14, Ci=256, Co=512, R=1, S=1, padding=0,
                                                         default_config=True)),
    ("sm_100", "3x3, split-K in 2", dict()),
    ("sm_100", "1x1, x read tiled", dict(R=1, S=1, padding=0)),
]


@pytest.mark.parametrize("arch, what, params", WGRAD_CASES, ids=[f"{a}-{w}" for a, w, _ in WGRAD_CASES])
def test_wgrad_kernel_builds_as_lesson_07_teaches_it(arch, what, params):
    assert_same_build("wgrad kernel", LESSON07, "aot_conv2d_wgrad", "wgrad_build", arch, what, params)


@pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
@pytest.mark.parametrize("config, epilogue", [(fprop.FIXED_CONFIG, fprop.Epilogue()),
                                              (fprop.KernelConfig(256, 128, 64, 3, 8),
                                               fprop.Epilogue(True, True, True, "relu"))])
def test_forward_kernel_gives_lesson_05s_bits(config, epilogue):
    """On a GPU: the package's kernel and lesson 05's, launched on the same inputs, write the same bits."""
    lesson05 = common.load_lesson(LESSON05)
    x, w = common.random_conv_inputs(4, 20, 20, 128, 192, 3, 3, torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    g = common.conv_geometry(x.shape, w.shape, 1, 1)
    bias, scale = (torch.randn(g.Co, generator=generator).cuda() for _ in range(2))
    residual = torch.randn(*g.output_shape_nhwc, generator=generator).to("cuda", torch.bfloat16)
    operands = {"bias": bias, "scale": scale, "residual": residual} if epilogue.bias else {}
    activation = {"activation": epilogue.activation} if epilogue.bias else {}
    ours = fprop.conv2d_fprop_launch(x, w, padding=1, config=config, **operands, **activation)
    theirs = lesson05.conv2d_fprop_launch(x, w, padding=1, config=lesson05.KernelConfig(*config), **operands,
                                          **activation)
    assert torch.equal(ours, theirs)


@pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
@pytest.mark.parametrize("R, split_k", [(3, 2), (1, 1)])
def test_wgrad_kernel_gives_lesson_07s_bits(R, split_k):
    """On a GPU: the package's wgrad kernel and lesson 07's, launched by the same prepared launch, write the same bits."""
    lesson07 = common.load_lesson(LESSON07)
    wgrad = pytest.importorskip("conv_tutorial.kernels.wgrad")
    x, _, dy, g = lesson07.backward_inputs(4, 20, 20, 128, 256, R, R, 1, R // 2, device_name="cuda")
    arch, num_sms = common.tma_mma_arch_and_sms("the wgrad equivalence test")
    outputs = []
    for kernel, total in ((lesson07.conv2d_wgrad_kernel, lesson07.wgrad_split_k_sum_kernel),
                          (wgrad.conv2d_wgrad_kernel, wgrad.wgrad_split_k_sum_kernel)):
        launch = wgrad.prepare_wgrad(x, dy, g, wgrad.wgrad_config(g.Co, g.Ci)._replace(split_k=split_k), arch, num_sms)
        dw = torch.zeros(g.Co, g.R * g.S * g.Ci, device="cuda", dtype=x.dtype)
        kernel[launch.grid](*launch.kernel_args(dw), **wgrad.wgrad_kernel_options(launch.config, arch))
        if launch.partial is not None:
            grid, args, constexprs = wgrad.sum_partials_launch(launch, dw)
            total[grid](*args, **constexprs)
        outputs.append(dw)
    assert torch.equal(*outputs)
