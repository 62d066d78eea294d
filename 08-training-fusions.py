"""
Lesson 08: training fusions, or what a training step spends its time on once the convs are fast
===============================================================================================

Lessons 05-07 brought a ResNet-50's convs, forward and backward, to cuDNN's pace. A training step
is not only convs, though: BatchNorm, ReLU, residual adds, pooling and the loss run between them, as
passes over memory. This lesson measures what those passes cost, and folds three of them into the
convs' kernels.

What you will learn:

- where a ResNet-50 training step spends its GPU time once the convs run at cuDNN's pace: more than
  half of it in the memory-bound passes around them (a recorded profile);
- BatchNorm's batch statistics summed in the forward kernel's epilogue, from the tile it has just
  staged for its TMA store: where to sum (not in the accumulator's registers), how the sums leave
  (`red.global.add`, relaxed, four channels at a time), and the limits (split-K, E[y^2] - E[y]^2 in
  fp32). This one paid;
- ReLU's backward applied as a gate in dgrad's epilogue, read the way lesson 05's epilogue reads a
  residual. It works, and it was measured as fast as without it;
- BatchNorm's apply and the ReLU on the next conv's load (A through registers on Hopper): its first
  measurement used tiles two to four times as wide as its 64-channel layers, so it is re-measured at
  the tile the runtime picks (`benchmarks/bn_relu_on_load.py`), and kept or cut by that; and why two
  attempts around it failed (a WGMMA's A registers rewritten in flight; a hang on an integer that
  Triton compiled in as a constant);
- what limits a training step now, and what the operator (`conv_tutorial`) does with all of it.

Builds on: lesson 05 (the forward kernel, its fused epilogue and staging buffer), lesson 06 (dgrad as
a forward conv of dY: `conv2d_dgrad_launch`, `backward_inputs`, `reference_gradients`) and lesson 07
(wgrad). The kernel here is the operator's copy of lesson 05's (conv_tutorial/kernels/fprop.py,
which builds to lesson 05's PTX with its switches off: tests/kernels/test_equivalence.py), with the
two switches this lesson explains: `channel_stats` and the "relu_grad" activation.

Requires: sm_90 (H100/H200) or sm_100 (B200/GB200) for the GPU runs. On a CPU: the epilogue's sums
on a model of its tiles, the sm_90 and sm_100 builds of the channel sums with their PTX (the gate's in
the tests), ReLU's backward through dgrad against torch's gradients, and the recorded measurements.

Note: the Blackwell path is compiled and its PTX inspected here; it has not run on a Blackwell GPU.

Run:  python 08-training-fusions.py [--outdir out]

Tests: pytest 08-training-fusions.py (more cases: tests/lessons/test_08_training_fusions.py)
"""

# %%
import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch

from conv_tutorial.core.batchnorm import batch_stats_from_sums
from conv_tutorial.kernels import fprop as forward
from conv_tutorial.kernels.aot import fprop_build
from conv_tutorial.kernels.dgrad import dgrad_through_relu, relu_gated_in_epilogue, side_by_side_launch

lesson06 = common.load_lesson("06-conv-dgrad")      # backward_inputs, reference_gradients, conv2d_dgrad_launch
ARCHS = ("sm_90", "sm_100")
needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)

# %%
# Each `if __name__ == "__main__"` cell runs the demo of the section above it (importing the
# lesson runs nothing); the GPU parts run where a Hopper or Blackwell GPU is present.
if __name__ == "__main__":
    args = common.lesson_args("Lesson 08: training fusions")
    outdir, on_gpu = common.output_dir(args.outdir), common.has_tma_mma_gpu()

# %%
# 1. Where a training step's time goes
# ------------------------------------
# A ResNet-50 training step at batch 128 in bf16, under CUDA graphs (so the host's Python is not in
# the timing), profiled by torch.profiler and summed by kind of kernel: torch.compile with cuDNN's
# convs, against the same model with lessons 05-07's kernels for every conv (forward, dgrad, wgrad)
# and the first fusion below (H100, 2026-11-26; `results/h100-2026-11-26/training_relugrad.json`,
# `python benchmarks/training.py --nets resnet50 --steps 50 --profile 3 --no-gradient-check
# --variants compile-cudagraphs ours-lesson06-bnstats-cudagraphs ...`). `run_step_profile` prints it
# from that file. What it shows: our convs take 9.13 ms of the step's 22.41 ms (cuDNN's and cuBLAS's
# kernels 9.61 in the other column), and Inductor's kernels, BatchNorm's statistics and
# normalization, the ReLUs, the residual adds, pooling and the loss, forward and backward, take
# 12.17 ms. Those kernels read and write whole activations and do little arithmetic per byte. So a faster
# conv no longer makes a faster step: the bytes those passes move have to go, and the way to remove
# a pass over an activation is to do its arithmetic where a kernel already holds that activation on
# chip: in the epilogue of the conv that writes it, or in the load of the conv that reads it.


def run_step_profile():
    """The recorded profile of a ResNet-50 step, GPU milliseconds per step by kind of kernel."""
    recorded = common.recorded_results("training_relugrad")
    if recorded is None:
        print("[skip] no recorded training profile under results/")
        return None
    data, info = recorded
    rows = {row["variant"]: row for row in data["rows"]}
    names = ["compile-cudagraphs", "ours-lesson06-bnstats-cudagraphs"]
    kinds = sorted({kind for name in names for kind in rows[name]["gpu_ms_by_kind"]},
                   key=lambda kind: -max(rows[name]["gpu_ms_by_kind"].get(kind, 0.0) for name in names))
    print(f"\nA ResNet-50 training step, batch 128, GPU ms by kind of kernel ({info['label']}):")
    print(f"   {'kind of kernel':<46}{'torch.compile':>14}{'ours + stats':>14}")
    for kind in kinds:
        print(f"   {kind:<46}" + "".join(f"{rows[name]['gpu_ms_by_kind'].get(kind, 0.0):14.2f}" for name in names))
    totals = [sum(rows[name]["gpu_ms_by_kind"].values()) for name in names]
    print(f"   {'all':<46}{totals[0]:14.2f}{totals[1]:14.2f}   images/s: "
          + ", ".join(f"{rows[name]['img_s']:.0f}" for name in names))
    return rows


# %%
if __name__ == "__main__":
    run_step_profile()

# %%
# What you should see: Inductor's row is the largest in both columns (13.06 and 12.17 ms), ours has
# almost no cuDNN time (0.02 ms in its cuDNN/cuBLAS row), and the totals are 23.44 and 22.41 ms
# (5250 and 5283 images/s).

# %%
# 2. BatchNorm's statistics from the forward's epilogue
# -----------------------------------------------------
# In training, the BatchNorm after a conv cannot be folded into its weights (lesson 05, section 5):
# it normalizes with the batch's own mean and variance per channel, a reduction over N, H and W of
# the conv's output. torch.compile runs that reduction as a kernel of its own, which reads the whole
# output once more before the kernel that normalizes it reads it again. The forward kernel holds
# each tile of the output on chip in its epilogue, so it can sum there. With `channel_stats` (None,
# or a zeroed fp32 tensor [2, Co]) the operator's forward kernel adds each tile's column sums of y
# and of y^2 into rows 0 and 1; rows past the last pixel (a partial tile) are masked out. Then::
#
#     mean = sum / count        var = sum_sq / count - mean^2        (count = N * out_h * out_w)
#
# Where to sum. The obvious place is the accumulator's registers, before the cast. There it cost up
# to 4.1x the kernel's time (H200, results/h200-2026-11-25/channel_stats_first_build.json): the
# accumulator's layout is the MMA's, where a thread holds pieces of two rows, so a column's 128
# values are spread over 64 threads of several warps, and `gl.sum(axis=0)`
# reduces them in rounds of shuffles and then across warps through shared memory (770 shuffles in
# the sm_90 128 x 256 build, and spills with the fp32 tile live beside the sums; results/notebook.md).
# But the epilogue already writes the tile, cast to the output's dtype, into a staging buffer for its
# TMA store (lesson 05). So the sums read the tile back from there, in a layout of their own
# (`staged_tile_layout` with the columns split among the warps, conv_tutorial/kernels/windows.py):
# each thread loads vectors of one row (16 bytes in the sm_90 build), the warps split the columns, a
# warp's lanes take a few columns and the rows. A thread sums its rows in registers, a few shuffle rounds sum a warp's
# lanes, and no sum crosses a warp (except in a column tail too narrow to split among the warps).
# `add_channel_sums`, the epilogue's lines::
#
#     values = staged.load(layout).to(gl.float32)                        # the tile as stored, back from smem
#     counted = gl.where(gl.expand_dims(pixels < M, 1), values, 0.0)     # a partial tile's missing rows
#     gl.atomic_add(stats_ptr + channels, gl.sum(counted, axis=0), mask=inside, sem="relaxed")
#     gl.atomic_add(stats_ptr + Co + channels, gl.sum(counted * counted, axis=0), mask=inside, sem="relaxed")
#
# Two hazards, both covered by barriers the plain kernel has already: the TMA store waits for every
# thread's writes to the buffer (a `bar.sync` before it is issued) and these reads come after it;
# the next tile writes the buffer only after `tma.store_wait` and a `bar.sync` of the epilogue's
# warps. What gets summed is the output as stored, the values BatchNorm itself would read.
#
# How the sums leave. Of the lanes that share a channel, one adds into global memory with
# `red.global.gpu.relaxed.add`, four channels per instruction (`.v4.f32`) where Co is a multiple of
# 16: an atomic add that returns nothing, relaxed because nothing waits on the sums before the
# kernel ends. Every program adds into the same [2, Co] tensor (a copy per SM was measured slower:
# zeroing and adding up 132 copies cost more than the queueing it avoided; results/notebook.md).
# Tiles add in whatever order they finish, so the sums' last bits vary from run to run.
#
# The limits. A split-K config (lesson 05, section 7) holds partial sums in its epilogue, and the
# squares of partial sums do not add up to the square of the whole: the launch refuses it (the
# operator's runtime then sums that output with torch). And E[y^2] - E[y]^2 in fp32 loses digits
# when a channel's mean is large against its spread, a relative error of about 2^-24 (mean/std)^2
# per rounding (the test below): negligible for the activations BatchNorm sees, whose means are of
# the order of their spread, and the reason Welford's update exists where they are not.


def conv2d_with_channel_stats(x_nhwc, w, stride=1, padding=0, dilation=1, config=forward.FIXED_CONFIG):
    """(y NHWC, stats): the conv, its epilogue adding each output channel's sum (stats[0]) and sum of
    squares (stats[1]), fp32 [2, Co], as it stores y: every program into the same zeroed tensor."""
    stats = torch.zeros(2, w.shape[0], device=x_nhwc.device, dtype=torch.float32)
    y = forward.conv2d_fprop_launch(x_nhwc, w, None, stride, padding, dilation, config=config, channel_stats=stats)
    return y, stats


def batch_norm_from_sums(y_nhwc, stats, gamma, beta, eps=1e-5):
    """BatchNorm's training-mode output (batch mean, biased variance) from a conv's channel sums."""
    mean, var = batch_stats_from_sums(stats, y_nhwc.numel() // y_nhwc.shape[-1])   # (the operator's function)
    scale = gamma.float() * torch.rsqrt(var + eps)
    return (y_nhwc.float() * scale + (beta.float() - mean * scale)).to(y_nhwc.dtype)


def channel_sums_by_tiles(y_2d, block_m=128, seed=0):
    """The epilogue's arithmetic on a CPU: y [M, Co] cut into tiles of block_m rows, each tile's column
    sums of y and y^2 in fp32, added into [2, Co] in a random order (the tiles' finishing order)."""
    tiles = list(torch.split(y_2d.float(), block_m))
    order = torch.randperm(len(tiles), generator=torch.Generator().manual_seed(seed))
    stats = torch.zeros(2, y_2d.shape[1])
    for i in order.tolist():
        stats += torch.stack((tiles[i].sum(0), (tiles[i] * tiles[i]).sum(0)))
    return stats


def test_tile_sums_give_batch_norms_statistics():
    # the CPU model against torch's own batch statistics: mean, and the biased variance BatchNorm normalizes with
    y = torch.randn(1000, 24, generator=torch.Generator().manual_seed(3)) * 2.0 + 0.5
    stats = channel_sums_by_tiles(y, block_m=128)
    mean, var = batch_stats_from_sums(stats, y.shape[0])
    torch.testing.assert_close(mean, y.mean(0), rtol=0, atol=1e-5)
    torch.testing.assert_close(var, y.var(0, unbiased=False), rtol=1e-5, atol=0)
    # another finishing order: the same statistics up to the last bits of fp32
    torch.testing.assert_close(channel_sums_by_tiles(y, seed=1), stats, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("mean_over_std", [1.0, 1e3])
def test_variance_from_sums_loses_digits_with_large_means(mean_over_std):
    # E[y^2] - E[y]^2 in fp32 against the same in fp64: fine at a mean of the spread's order, and off by
    # about 2^-24 * (mean / std)^2 * sqrt(tiles) relative when the mean dwarfs the spread
    y = (torch.randn(65536, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + mean_over_std)
    stats = channel_sums_by_tiles(y.float())
    var32 = stats[1] / y.shape[0] - (stats[0] / y.shape[0]) ** 2
    error = ((var32.double() - y.var(0, unbiased=False)).abs() / y.var(0, unbiased=False)).max().item()
    if mean_over_std == 1.0:
        assert error < 1e-5
    else:
        assert error > 1e-2            # (mean / std)^2 = 1e6: 2^-24 * 1e6 = 6e-2 per rounding


def run_channel_sums_model():
    y = torch.randn(50000, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    print("\nE[y^2] - E[y]^2 in fp32 from tile sums (a CPU model of the epilogue), against fp64:")
    for shift in (0.0, 10.0, 100.0, 1000.0):
        stats = channel_sums_by_tiles((y + shift).float())
        _, var32 = batch_stats_from_sums(stats, y.shape[0])
        error = ((var32.double() - y.var(0, unbiased=False)) / y.var(0, unbiased=False)).abs().max().item()
        print(f"   mean / std = {shift:6.0f}: relative error of the variance {error:.1e}")


# %%
if __name__ == "__main__":
    run_channel_sums_model()

# %%
# What you should see: the variance's error grows about as (mean/std)^2, from 3.6e-07 at a mean of 0
# to 1.0e-02 at 100 and 6.8e-01 at 1000 (2^-24 (mean/std)^2 per rounding, and there are many adds).
#
# The build. The tile still leaves through one TMA store; the sums add 16 `ld.shared.v4` (sm_90: the
# staged 128 x 128 bf16 tile back, 16 bytes at a time, 128 threads x 16 x 16 bytes = 32 KiB), 48
# butterfly shuffles, four `red.global` and not one `bar.sync` more. The sm_100 build reads the tile
# back two bf16 at a time (64 `ld.shared.v2.b16`), with as many shuffles and `red.global`.

READ_BACK = {"sm_90": ("ld.shared.v4", "16 bytes"), "sm_100": ("ld.shared.v2.b16", "two bf16")}
STATS_PTX = {
    arch: [
        (READ_BACK[arch][0], f"The staged tile read back, {READ_BACK[arch][1]} at a time, in a layout whose "
                             f"warps split the columns."),
        ("shfl.sync.bfly", "The lanes that share a channel add their sums: 8 lanes a column, 3 rounds, for each "
                           "of a thread's 8 channels and both sums: 48 (the plain build has none)."),
        ("red.global", "The sums leave: an atomic add without a return value, relaxed, four channels at a "
                       "time (.v4.f32), into the one [2, Co] tensor every program adds to."),
        (common.PTX_TMA_STORE, "The tile itself still leaves through one TMA store, before the sums read it."),
        ("bar.sync", "As many as the plain build: the sums cross no warp, and the store's own barriers order "
                     "the reads."),
    ] for arch in ARCHS
}


def aot_conv_with_channel_stats(arch):
    """(kernel, args, kwargs) of the forward kernel with channel_stats, 128x128x64, on CPU tensors."""
    return fprop_build(arch, channel_stats=torch.zeros(2, 128))


@pytest.mark.parametrize("arch", ARCHS)
def test_stats_build_adds_with_relaxed_reductions(arch):
    built = common.assert_ptx_teaches("08-training-fusions", "aot_conv_with_channel_stats", arch, STATS_PTX)
    plain = common.aot_compile_or_skip("conv_tutorial.kernels.aot", "fprop_build", arch)
    counts = common.ptx_instructions(built["ptx"], ["red.global", common.PTX_TMA_STORE, "ld.shared", "bar.sync"])
    assert counts[common.PTX_TMA_STORE] == 1
    assert common.ptx_instructions(plain["ptx"], ["red.global"])["red.global"] == 0
    assert counts["ld.shared"] > common.ptx_instructions(plain["ptx"], ["ld.shared"])["ld.shared"]
    assert common.ptx_instructions(built["ptx"], [READ_BACK[arch][0]])[READ_BACK[arch][0]] == {"sm_90": 16,
                                                                                             "sm_100": 64}[arch]
    assert counts["bar.sync"] == common.ptx_instructions(plain["ptx"], ["bar.sync"])["bar.sync"]
    assert ".relaxed.add.v4.f32" in common.first_ptx_instruction(built["ptx"], "red.global")
    assert built["stack"] in (0, None)          # no registers spilled (None: no cuobjdump to ask)


STATS_CASES = [   # (N, H, W, Ci, Co, R, S, stride, padding): partial tiles, Co not a multiple of the tile, Ci=3
    (2, 20, 18, 3, 100, 7, 7, 2, 3),
    (3, 13, 11, 64, 72, 1, 1, 1, 0),
    (4, 28, 28, 128, 128, 3, 3, 2, 1),
    (2, 9, 17, 32, 200, 3, 1, (1, 2), (1, 0)),
]


def check_channel_sums(N, H, W, Ci, Co, R, S, stride, padding, dtype=torch.bfloat16):
    """The kernel's sums against the sums of its stored output y and of torch's fp32 conv, and BatchNorm
    from them against torch's. Tolerances beside each check; the normalized output is rounded to bf16
    once (2e-2, lesson 06's tolerance)."""
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, dtype)
    y, stats = conv2d_with_channel_stats(x, w, stride, padding)
    # the sums of the values stored, y: up to fp32's rounding in the adds (~log2(count) * 2^-24 of the sum of |y|)
    stored = y.reshape(-1, Co).double()
    assert ((stats[0].double() - stored.sum(0)).abs() <= 1e-5 * stored.abs().sum(0) + 1e-4).all()
    assert ((stats[1].double() - (stored * stored).sum(0)).abs() <= 1e-5 * (stored * stored).sum(0) + 1e-4).all()
    # and of torch's fp32 conv: each y is that rounded to bf16 (2^-9 of |y|; 2^-8 if the order of the adds
    # flips a rounding), its square 2^-7
    flat = common.reference_conv2d_nhwc(x, w, None, stride, padding, out_dtype=torch.float32).reshape(-1, Co).double()
    assert ((stats[0].double() - flat.sum(0)).abs() <= 2**-8 * flat.abs().sum(0) + 1e-3).all()
    assert ((stats[1].double() - (flat * flat).sum(0)).abs() <= 2**-7 * (flat * flat).sum(0) + 1e-3).all()
    gamma, beta = torch.rand(Co, device=x.device) + 0.5, torch.randn(Co, device=x.device)
    expected = torch.nn.functional.batch_norm(y.permute(0, 3, 1, 2).float(), None, None, gamma, beta, training=True)
    common.assert_close_to_reference(batch_norm_from_sums(y, stats, gamma, beta), expected.permute(0, 2, 3, 1),
                                     dtype=dtype, K=1)


@needs_gpu
@pytest.mark.parametrize("case", STATS_CASES)
def test_channel_stats_match_torch(case):
    check_channel_sums(*case)


def run_channel_stats(on_gpu_now):
    if not on_gpu_now:
        return common.show_ptx("08-training-fusions", "aot_conv_with_channel_stats", STATS_PTX,
                               lambda arch, built: f"the forward kernel with channel_stats, {forward.FIXED_CONFIG}")
    for case in STATS_CASES:
        check_channel_sums(*case)
    print(f"\nthe epilogue's channel sums and BatchNorm from them match torch on {len(STATS_CASES)} layers, "
          f"{common.gpu_name()}")


# %%
if __name__ == "__main__":
    run_channel_stats(on_gpu)

# %%
# Measured: it paid. Per layer (H100, 2026-11-26, bf16, batch 128, CUDA graphs, ResNet-50's 23
# distinct convs; `python benchmarks/channel_stats.py`, `results/h100-2026-11-26/channel_stats_one_copy.json`):
# the conv with its sums took 1894 us over the 23 layers against 1706 us for the conv alone (a median
# 1.14x the conv's time, 1.04-1.25x), and beat the conv followed by a separate reduction over its
# output (5674 us) on all 23. In a step: `conv_tutorial.fuse_conv_batchnorm_for_training` routes each
# conv -> BatchNorm pair of a model through it (its `batch_norm_from_sums` then normalizes with the
# sums, in torch ops that Inductor fuses), and ResNet-50's step ran 2.8% faster with it than without
# (5148 -> 5290 images/s under CUDA graphs, torch.compile 5195; H100, 2026-11-26, with the same
# normalization written inline, `results/h100-2026-11-26/training_resnet50_cudagraphs_whole_waves.json`).

# %%
# 3. ReLU's backward in dgrad's epilogue
# --------------------------------------
# In a block z -> x = relu(z) -> conv(x, w), autograd's backward runs dgrad for dX, then ReLU's
# backward, dZ = dX where z > 0, else 0: a pass over two activations that torch.compile fuses into
# the backward of the BatchNorm that produced z, whose kernels then read x as well as dX. dgrad's
# epilogue holds each tile of dX in registers, and the gate can be x itself (x > 0 exactly where
# z > 0), laid out [N, H, W, Ci] as dX is. Lesson 05's epilogue already reads one such tensor in the
# accumulator's layout, the residual; in the operator's copy of the kernel the activation
# "relu_grad" has `apply_epilogue` keep the tile where that tensor is positive instead of adding it::
#
#     if EPILOGUE.activation == "relu_grad":     # the residual gates: dZ = dX where x > 0
#         acc = tl.where(residual > 0, acc, 0.0)
#
# (a constexpr branch: the other builds do not change). It applies where dX is one conv's whole
# output: stride 1 and no crop (padding at most dilation * (R - 1) on each axis; lesson 06). A
# strided dgrad's phases store through an output window, and there the gate runs after, in torch
# (`relu_gated_in_epilogue` says which). In a model, autograd must also skip ReLU's own backward:
# `conv_tutorial.fuse_relu_into_dgrad` calls the conv with the ReLU's input too, and its backward
# hands that input dZ.


def cpu_fprop(dy, w_phase, padding, dilation, groups=1, out_window=None, residual=None, activation="none"):
    # The CPU's stand-in for the forward kernel in dgrad: torch's conv in fp32, then the kernel's epilogue
    out = common.reference_conv2d_nhwc(dy, w_phase, None, 1, padding, dilation, out_dtype=torch.float32,
                                       groups=groups)
    out = common.reference_epilogue(out, residual=residual, activation=activation)
    return out if out_window is None else out_window.write(out)


def gpu_fprop(dy, w_phase, padding, dilation, groups=1, out_window=None, **epilogue):
    return forward.conv2d_fprop_launch(dy, w_phase, padding=padding, dilation=dilation, groups=groups,
                                        out_window=out_window, **epilogue)


RELU_GRAD_CASES = [   # (N, H, W, Ci, Co, R, S, stride, padding, dilation): gated in the epilogue or after
    (2, 9, 11, 24, 40, 3, 3, 1, 1, 1),       # in the epilogue
    (3, 7, 6, 72, 16, 1, 1, 1, 0, 1),        # 1x1, in the epilogue
    (2, 10, 9, 16, 24, 3, 3, 1, 2, 2),       # dilated, in the epilogue
    (2, 11, 9, 16, 24, 3, 3, 2, 1, 1),       # strided: after
    (2, 8, 8, 16, 8, 1, 1, 1, 1, 1),         # a crop (padding 1 > 0 for a 1x1): after
]


def check_dgrad_through_relu(N, H, W, Ci, Co, R, S, stride, padding, dilation, on_gpu_now):
    """dZ through the gate against torch.nn.grad's dX gated by x > 0 (autograd's ReLU backward), in fp32;
    on a GPU also against lesson 06's plain dgrad gated by torch. Returns whether the epilogue gated."""
    x, w, dy, g = lesson06.backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation,
                                           torch.bfloat16 if on_gpu_now else torch.float32,
                                           device_name=None if on_gpu_now else "cpu")
    relu_out = torch.relu(x)
    if on_gpu_now:
        got = dgrad_through_relu(dy, w, relu_out, g, gpu_fprop, conv=side_by_side_launch, in_place=True)
        unfused = lesson06.conv2d_dgrad_launch(dy, w, x.shape, stride, padding, dilation)
        common.assert_close_to_reference(got, torch.where(relu_out > 0, unfused, 0), dtype=got.dtype, K=Co * R * S)
    else:
        got = dgrad_through_relu(dy, w, relu_out, g, cpu_fprop)
    dx, _ = lesson06.reference_gradients(x, w, dy, g)
    common.assert_close_to_reference(got, torch.where(x.float() > 0, dx, 0.0), dtype=got.dtype, K=Co * R * S)
    return relu_gated_in_epilogue(g)


@pytest.mark.parametrize("case", RELU_GRAD_CASES)
def test_dgrad_through_relu_matches_torch_on_cpu(case):
    check_dgrad_through_relu(*case, on_gpu_now=False)


@needs_gpu
@pytest.mark.parametrize("case", RELU_GRAD_CASES)
def test_dgrad_through_relu_matches_torch(case):
    check_dgrad_through_relu(*case, on_gpu_now=True)


# %%
# The build: the gate arrives as the residual does, by global loads in the accumulator's layout (64
# `ld.global` in the sm_90 128 x 128 build's text, 16 in sm_100's: the residual build's counts), and selects where
# that build adds (`selp.b16`: the compiler moves the select past the cast to bf16, where it gives the
# same bits); the tile still leaves through one TMA store.


@pytest.mark.parametrize("arch", ARCHS)
def test_relu_grad_build_reads_the_gate(arch):
    gated, added = (common.aot_compile_or_skip("conv_tutorial.kernels.aot", "fprop_build", arch,
                                               epilogue=[False, False, True, activation])
                    for activation in (common.RELU_GRAD, "none"))
    counts = [common.ptx_instructions(build["ptx"], ["ld.global", "selp"]) for build in (gated, added)]
    assert counts[0]["ld.global"] == counts[1]["ld.global"] > 0
    assert counts[0]["selp"] > counts[1]["selp"] == 0
    assert common.ptx_instructions(gated["ptx"], [common.PTX_TMA_STORE])[common.PTX_TMA_STORE] == 1


def run_dgrad_through_relu(on_gpu_now):
    where = [check_dgrad_through_relu(*case, on_gpu_now=on_gpu_now) for case in RELU_GRAD_CASES]
    print(f"\nReLU's backward through dgrad matches torch on {len(where)} layers ({sum(where)} gated in the "
          f"epilogue, {len(where) - sum(where)} after), " + (common.gpu_name() if on_gpu_now else "the CPU"))


# %%
if __name__ == "__main__":
    run_dgrad_through_relu(on_gpu)

# %%
# Measured: about equal, so not a default. ResNet-50 training at batch 128 under CUDA graphs, with
# section 2's statistics on both sides (H100, 2026-11-26; `results/h100-2026-11-26/training_relugrad.json`,
# the run of section 1): 5280 images/s with the gate in 29 dgrads' epilogues, 5283 without. The
# profile of the same run says why: the epilogue's read of x cost our dgrads 0.41 ms a step (our convs
# in all +0.37 ms) and saved Inductor 0.16 ms (12.17 -> 12.01), because Inductor's fused
# BatchNorm-and-ReLU backward had been reading little for the ReLU. The operator keeps it as an
# opt-in pass. Where it would pay is the form that also takes BatchNorm's backward sums in the same
# epilogue (not built).

# %%
# 4. BatchNorm's apply and ReLU on the next conv's load
# -----------------------------------------------------
# Section 2 leaves BatchNorm's apply, x = relu(y * scale[c] + shift[c]) with scale = gamma /
# sqrt(var + eps) and shift = beta - mean * scale, as a pass of its own: one Inductor kernel that
# reads the previous conv's output y and writes x, 103 MB moved for a 64-channel 56x56 activation at
# batch 128 in bf16 (31 us at the H100's 3.35 TB/s). The next conv reads x anyway, one tile at a
# time, so it could apply the map on the way and x would never be written.
#
# Where in the kernel. TMA copies the im2col box into shared memory as it lies; it does no arithmetic.
# The one place left is between shared memory and the tensor cores. WGMMA (Hopper) takes its A
# operand from shared memory or from registers, B from shared memory only, so the consumer warpgroup
# can load the stage's A tile into registers in WGMMA's A layout (`ldmatrix`), compute
# max(a * scale[c] + shift[c], 0) in fp32, cast back, and issue WGMMA with A from registers.
# tcgen05 (Blackwell) reads A from shared or tensor memory only: there the mapped tile would go back
# through shared memory first (not built). Two details make it right and one makes it slow:
#
# - The padding: TMA fills the pixels in the conv's zero padding with zeros, which is what the conv
#   means (relu(x) padded, not relu of a padded y), but relu(0 * scale + shift) = relu(shift). So the
#   map zeroes the rows whose input pixel, for the k-step's tap, lies outside the image.
# - Channels past the real Ci (TMA's 16-byte padding) get scale = shift = 0.
# - The PTX ISA: the registers an asynchronous `wgmma.mma_async` reads as A must not be written until
#   a `wgmma.wait_group` covers it, and the next k-step's A tile goes into the same registers. So the
#   consumer waits for all its MMAs every k-step (`wait_group 0`, where lesson 05 keeps one in
#   flight), and the tensor cores idle while the next tile is loaded and mapped.
#
# It was built (commit 6f08b22: `Im2colWindow.input_transform` in lesson 05, `InputTransform` in
# common.py, the launcher and its tests in that commit's lesson 06, section 11), checked against torch on an H100
# (10 GPU tests), and first timed with 128 x 128 and 128 x 256 tiles only (H100, 2026-11-26,
# `results/h100-2026-11-26/bn_relu_on_load_timing.json`): 0.81x over eight layers, the fused conv
# against the pass plus the same conv. But on the 64-channel layers those tiles are two to four times
# wider than Co, the plain conv itself ran at 2.2x cuDNN's time there (175 against 78 us on the 56x56
# 64->64 3x3), and the runtime picks 256 x 64 for that layer. So it is measured again, at the tile the
# runtime picks for each layer (`benchmarks/bn_relu_on_load.py`: every 64- and 128-channel conv of
# ResNet-50 whose input is BatchNorm + ReLU of a conv's output; its docstring says how it runs
# 6f08b22's launcher). The runtime's picks, 256 x 64, 128 x 256 and 256 x 128 on 8 warps with no tail,
# are all tiles the fused path runs (one consumer, no tail: a tail's second MMA would read A from
# shared memory, untransformed); their sm_90 builds assemble without a spill (results/notebook.md).
#
# Measured (H100, 2026-11-27, `results/h100-2026-11-27/bn_relu_on_load.json`; CUDA graphs, kernels
# alone, microseconds, bf16, batch 128; the pass is torch.compile's one elementwise kernel)::
#
#     layer                      tile (runtime's)  pass   cuDNN    ours   fused   (ours+pass)/fused
#     RN50 56x56 64->64 3x3      256x64x64, 8w     36.0    78.4    77.0   193.0   0.58x
#     RN50 56x56 64->256 1x1     128x256x64, 8w    35.9    95.6   101.7   100.4   1.34x
#     RN50 56x56 128->128 3x3 s2 256x128x64, 8w    69.9    60.0    69.4   113.6   1.24x
#     RN50 28x28 128->128 3x3    256x128x64, 8w    16.8    54.2    52.0   115.3   0.61x
#     RN50 28x28 128->512 1x1    128x256x64, 8w    17.1    50.2    51.6    54.9   1.27x
#
# Over the five layers the fused convs took 577 us, our conv plus the pass 527 us and cuDNN plus
# the pass 512 us: the fusion loses (0.91x), and it is cut (it stays in commit 6f08b22).
# The table says where it would pay. On the 3x3 stride-1 layers the fused conv takes 2.5x and 2.2x
# the plain one's time: nine taps of k-steps, each waiting for its WGMMA before the next A tile is
# mapped, cost more than the pass saves. On the 1x1 layers (one or two k-steps of 64 channels) and on
# the stride-2 3x3 (whose input, and so the pass, is four times its output) the fused conv is 1.24x
# to 1.34x faster than conv + pass. A per-layer choice could take those; but a training step also
# needs x for wgrad (lesson 07 reads it), so there the pass's output would have to be recomputed, or
# mapped the same way on wgrad's load (not built), before anything is saved.
#
# Two failures met on the way, diagnosed since on ahead-of-time sm_90 builds (results/notebook.md):
#
# - Two sets of A registers (keep the tile a dependency of `warpgroup_mma_wait(1, ...)`, so that one
#   WGMMA stays in flight while the next tile is mapped) computed wrong results on the H100. In the
#   PTX, WGMMA does not read the tile's registers: the lowering copies them, right before each
#   `wgmma.mma_async`, into registers of its own (`mov.b32 %r188, %r189` in the k-loop), and those
#   are the same registers on every iteration. The wait's dependency keeps the tile's registers alive,
#   not the copies, so the next k-step rewrites the A operand of the WGMMA still in flight, which the
#   PTX ISA leaves undefined, and ptxas says nothing. An overlap needs two copies the compiler keeps
#   apart (the loop unrolled by two), not a longer-lived value.
# - A hang of lesson 05's kernel on a one-k-step 1x1 conv, when its window and schedule held the shape
#   as one `gl.tuple` field (commit 5d86784, reverted). Triton compiles an integer argument equal to 1
#   in as a constant (k_steps, here), inside a tuple too, and there even under `do_not_specialize`
#   (which covers a scalar argument only). Held in a tuple field, the constant stayed one, so the
#   consumer's ring counter, `Counter(CONSUMER * k_steps)`, started as a constant; and Gluon does not
#   carry an aggregate's constant field around a loop, silently. The build's TTGIR waits on stage 0 at
#   parity 0 and releases stage 3 on every tile, while the loader's counter advances and, once the four
#   stages are full, waits forever for stage 0. (Held in a field typed `gl.tensor | gl.constexpr`, as
#   before and after that commit, the counter built from it is carried.) Today's kernels start every
#   ring counter from a tensor (`gl.to_tensor(0)`, or the program's id), and their build of that conv
#   carries it.


def run_recorded_bn_relu():
    """The recorded re-measurement (benchmarks/bn_relu_on_load.py's JSON), where the repository has it."""
    recorded = common.announce_recorded("bn_relu_on_load", "BatchNorm's apply and ReLU on the next conv's load")
    if recorded is None:
        return None
    data, _ = recorded
    print(f"   {'layer':<28} {'tile':<28}" + "".join(f"{name:>11}" for name in ("pass", "cudnn", "ours", "fused"))
          + "   (ours+pass)/fused")
    for row in data["rows"]:
        print(f"   {row['layer']:<28} {row['config']:<28}"
              + "".join(f"{row.get(name + '_us', float('nan')):11.1f}" for name in ("pass", "cudnn", "ours", "fused"))
              + (f"   {row['fused_vs_ours_pass']:.2f}x" if "fused_vs_ours_pass" in row
                 else f"   not run: {row.get('fused_refused') or row.get('fused_error')}"))
    return data


# %%
if __name__ == "__main__":
    run_recorded_bn_relu()

# %%
# What this lesson measured, what limits it, and what the operator does with it
# -----------------------------------------------------------------------------
# Measured. The convs of a ResNet-50 training step run at cuDNN's pace: the operator's forward (lesson
# 05's kernel, a config per layer) at 1.042x cuDNN's speed over the network suite's 84 layers
# (`results/h100-2026-11-27/network_suite_replay.json`), the operator's gradients at 1.05x (dgrad)
# and 1.00x (wgrad) over ResNet-50's 23 layers, kernels alone, geometric means
# (`results/h100-2026-11-27/backward_layers_operator_cuda_graphs.json`; H100, 2026-11-27). Of the
# three fusions, BatchNorm's statistics in the forward's epilogue paid (2.8% on the step); the ReLU
# gate in dgrad's epilogue left the step where it was; the BatchNorm apply on the next conv's load
# was cut by section 4's table (0.91x over its five layers). A whole step with every conv ours and
# the statistics fused ran at 1.02x torch.compile's images/s, both under CUDA graphs (5187 against
# 5074; H100, 2026-11-27,
# `results/h100-2026-11-27/training.json`, `python benchmarks/training.py --nets resnet50 --batch 128
# --variants compile-cudagraphs ours-lesson06-bnstats-cudagraphs`; 1.00-1.05x over nine runs the day
# before).
#
# What limits it:
#
# - The passes around the convs. In section 1's profile Inductor's kernels take 12.17 of the step's
#   22.41 ms of GPU time, the convs 9.13 (cuDNN's 9.61). torch.compile's step took 23.44 ms there; a
#   step at 1.2x its images/s would take about 19.5 ms, 2.9 ms less than ours, and the convs are
#   already below cuDNN's: it has to come from those passes, BatchNorm's normalization and its
#   backward (a read and a write of every activation forward, more in the backward), the residual
#   adds, the ReLUs. What would take the next share: BatchNorm's backward sums in dgrad's epilogue
#   beside section 3's gate, and the apply on the load where section 4's table says it pays.
# - The host, without CUDA graphs. The operator's calls check their arguments and look up a plan per
#   shape: 172 us per dgrad and 105 us per wgrad on the host (cuDNN's `convolution_backward`: 41 and
#   45 us; medians over the 23 layers, `host_us` in the 2026-11-27 file above), where a 1x1 layer's
#   kernels take about 40 us. Run eagerly, a step is bound by that: 0.46x torch.compile's images/s
#   (2285 against 4938; H100, 2026-11-25, `results/h100-2026-11-25/training_resnet50_window.json`).
#   Under CUDA graphs it is gone.
#
# What the operator does with all of it. `conv_tutorial` runs lesson 05's forward kernel for a
# model's convs (`conv_tutorial.ops`), takes its conv gradients from lessons 06-07's kernels with
# `conv_tutorial.set_backward("lesson06")` (PyTorch's convolution backward stays the default), and
# offers the fusions as passes over a model: `fuse_conv_batchnorm_for_training` (section 2, which
# paid) and `fuse_relu_into_dgrad` (section 3, opt-in: it does not pay). `benchmarks/training.py`
# runs each as a variant beside torch.compile's, and RESULTS.md, "Training", keeps today's figures.
# This is the series' last lesson: from a direct convolution (lesson 01) to a training step whose
# convs run at cuDNN's pace, and whose time now goes to the passes between them.

# %%
if __name__ == "__main__":
    print("\nlesson 08: all checks passed on " + common.gpu_name() if on_gpu else "\n" + common.cpu_closing_line(
        "08", "the epilogue's sums on a CPU model, the sm_90 and sm_100 builds of the channel sums (the "
        "instructions above), ReLU's backward through dgrad against torch's gradients, the recorded "
        "measurements", "the channel sums and the gated dgrad on the GPU against torch"))
