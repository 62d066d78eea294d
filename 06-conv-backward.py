"""
Lesson 06: the backward pass, dgrad and wgrad, on lesson 05's machinery
=======================================================================

What you will learn:

- where a convolution's two gradients come from, and why each is an implicit GEMM again: dgrad
  (the input's gradient: M = N*H*W input pixels, N_GEMM = Ci, K = R*S*Co) and wgrad (the
  filter's: M = Co, N_GEMM = R*S*Ci, K = N*out_h*out_w pixels);
- dgrad as lesson 05's forward kernel run on the output's gradient with the filter flipped and
  its channel axes swapped; at stride > 1 one such conv per phase of dX (its rows and columns
  taken modulo the stride), each storing its tiles straight into those rows and columns of dX,
  and all phases side by side in one launch where they share a window of dY (section 2b); the
  filter read where it lies, an N-major B operand, instead of a flipped copy (section 2c);
- wgrad as a new warp-specialized Gluon kernel built from lesson 05's parts, whose two operands
  reach the tensor cores transposed relative to the forward pass (what WGMMA and tcgen05 allow
  for that, and where the PTX shows it);
- the stride folded into the channels (space-to-depth) where a strided conv has few channels,
  as ResNet-50's stem does; grouped convs where a tile keeps to one group;
- split-K over the pixels with fp32 partial sums, added in a fixed order by a second kernel, so
  that the filter's gradient comes out the same, bit for bit, on every run;
- both mappings in plain PyTorch on a CPU, checked against torch's own gradients;
- for training, BatchNorm's batch statistics summed in the forward kernel's epilogue (section
  10), and what that costs; what folding BatchNorm's apply and the ReLU into the next conv's load
  would take, and why it did not pay (section 11); and ReLU's backward applied in dgrad's epilogue
  (section 12).

Builds on: lesson 05 (its kernel, `Im2colWindow`, `TmemAccumulators`), lesson 04 (`HopperWGMMA`)
and lesson 03 (the im2col descriptor and its model). dgrad runs the operator's copy of lesson 05's
kernel (conv_tutorial/kernels/fprop.py, built to lesson 05's PTX where its switches are off), which
adds the switches this lesson explains: an output window (section 2), which stores the output into a
strided view of a larger tensor, with a strided dgrad's phases as its columns (section 2b: a tile
runs its phase's taps only), weights read in place as an N-major B (section 2c), per-channel sums of
its output (section 10) and its output zeroed where a ReLU's output is not positive (section 12).
The plans this lesson explains run in the operator as they are imported here
(conv_tutorial/kernels/dgrad.py, gradients.py, wgrad.py); the wgrad kernel is this lesson's own.

Requires: sm_90 (H100/H200) or sm_100 (B200/GB200) for the GPU runs. On a CPU: both mappings
against torch.nn.grad, the wgrad kernel's own index arithmetic on lesson 03's model of the TMA
unit, the sm_90 and sm_100 builds of the wgrad kernel with their PTX,
ReLU's backward through dgrad against autograd (section 12), and input checks.

Note: the Blackwell path is compiled and its PTX inspected here; it has not run on a Blackwell GPU.

Run:  python 06-conv-backward.py [--bench] [--outdir out]

Tests: pytest 06-conv-backward.py
"""

# %%
import collections
import dataclasses
import re

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout, allocate_tensor_memory, tcgen05_commit, tcgen05_mma)
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

lesson04 = common.load_lesson("04-implicit-gemm-single-buffer")   # HopperWGMMA
lesson05 = common.load_lesson("05-warp-specialized-conv")         # the parts of the wgrad kernel
# What this lesson builds on from the operator package: the forward kernel with the backward's switches
# (conv_tutorial/kernels/fprop.py: an output window, a dgrad's phases, a filter read in place, channel sums)
# and its host side, and the plans the sections below explain, as the operator runs them
# (conv_tutorial/kernels/dgrad.py, gradients.py, wgrad.py). The wgrad kernel itself is this lesson's own.
from conv_tutorial.kernels import fprop as forward  # noqa: E402
from conv_tutorial.core.batchnorm import batch_stats_from_sums  # noqa: E402
from conv_tutorial.kernels.aot import fprop_build  # noqa: E402
from conv_tutorial.core.windows import (  # noqa: E402
    FlippedFilter, OutputWindow, check_channel_stats, flipped_filter_taps)
from conv_tutorial.kernels.windows import PhaseTiles  # noqa: E402
from conv_tutorial.kernels.dgrad import (  # noqa: E402
    busiest_program, dgrad, dgrad_axis_phase, dgrad_by_phases, dgrad_phases, dgrad_side_by_side,
    dgrad_through_relu, filters_in_place, flipped_weights, flipped_weights_by_torch,
    phase_order, relu_gated_in_epilogue, side_by_side, side_by_side_config,
    side_by_side_in_place, side_by_side_launch, side_by_side_plan, taps_per_tile, untapped_zeros)
from conv_tutorial.kernels.gradients import (  # noqa: E402
    backward_groups_reason, check_backward_call, dgrad_config, fold_input, fold_weight, folded_cost,
    stride_fold, unfold_weight_grad)
from conv_tutorial.kernels.wgrad import (  # noqa: E402
    WgradConfig, check_wgrad_config, choose_split, default_wgrad_config, prepare_wgrad, sum_partials_launch,
    wgrad_config, wgrad_input, wgrad_kernel_options, wgrad_operands, wgrad_problem, wgrad_result, wgrad_split,
    wgrad_tiles, x_reads_tiled)

Int = gl.tensor | gl.constexpr       # a run-time integer, or one Triton specialized to a constant

# %%
# Each `if __name__ == "__main__"` cell runs the demo of the section above it (importing the
# lesson runs nothing); the GPU parts run where a Hopper or Blackwell GPU is present.
if __name__ == "__main__":
    args = common.lesson_args("Lesson 06: dgrad and wgrad")
    outdir, on_gpu = common.output_dir(args.outdir), common.has_tma_mma_gpu()

# %%
# The two gradients
# -----------------
# The forward pass, in common.py's naming key::
#
#     y[n, oy, ox, co] = sum over r, s, ci of x[n, oy*sh - ph + r*dh, ox*sw - pw + s*dw, ci] * w[co, r, s, ci]
#
# Training hands us dY, the loss's gradient with respect to y, and asks for dX and dW. Each
# product in the sum above sends dY[n, oy, ox, co] * w[co, r, s, ci] to dX at the pixel that
# product read, and dY[n, oy, ox, co] * x[that pixel, ci] to dW[co, r, s, ci]::
#
#     dX[n, iy, ix, ci] = sum of dY[n, oy, ox, co] * w[co, r, s, ci]  over co, r, s and the (oy, ox)
#                         with oy*sh - ph + r*dh = iy and ox*sw - pw + s*dw = ix
#     dW[co, r, s, ci]  = sum of dY[n, oy, ox, co] * x[n, oy*sh - ph + r*dh, ox*sw - pw + s*dw, ci]
#                         over n, oy, ox
#
# Both are matrix products with the forward pass's useful FLOPs (2*N*out_h*out_w*Co*Ci*R*S), the
# three tensors in new roles::
#
#     pass    rows (M)               columns (N_GEMM)   reduction (K)          A               B
#     fprop   N*out_h*out_w pixels   Co                 R*S*Ci                 im2col(x)       w
#     dgrad   N*H*W input pixels     Ci                 R*S*Co                 "im2col"(dY)    w flipped
#     wgrad   Co                     R*S*Ci             N*out_h*out_w pixels   dY^T            im2col(x)
#
# dgrad is a convolution again, of dY with the filter turned around, so lesson 05's kernel runs it
# (sections 1-2: the operator's copy of it, conv_tutorial/kernels/fprop.py, which adds the switches
# this lesson explains and builds to lesson 05's PTX without them). wgrad is not: it reduces over
# the pixels, the axis the forward pass tiles, and
# gets a kernel of its own (sections 3-6).
#
# The ground truth throughout is torch's own gradient code, `torch.nn.grad.conv2d_input` and
# `conv2d_weight`, in fp32 on the same (fp16 or bf16) values.


def reference_gradients(x_nhwc, w, dy_nhwc, geometry):
    """(dX [N, H, W, Ci], dW [Co, R, S, Ci]) in fp32 from torch.nn.grad (TF32 off on a GPU)."""
    g = geometry
    x, w_kcrs, dy = (t.permute(0, 3, 1, 2).float() for t in (x_nhwc, w, dy_nhwc))
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        dx = torch.nn.grad.conv2d_input(x.shape, w_kcrs, dy, g.stride, g.padding, g.dilation, g.groups)
        dw = torch.nn.grad.conv2d_weight(x, w_kcrs.shape, dy, g.stride, g.padding, g.dilation, g.groups)
    return dx.permute(0, 2, 3, 1).contiguous(), dw.permute(0, 2, 3, 1).contiguous()


def backward_inputs(N, H, W, Ci, Co, R, S, stride=1, padding=0, dilation=1, dtype=torch.bfloat16, seed=0,
                    device_name=None, groups=1):
    """Random x, w (lesson 05's scale; [Co, R, S, Ci / groups]) and dY of the conv's output shape, and the
    conv's geometry."""
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, dtype, device_name=device_name, seed=seed)
    w = w[..., :Ci // groups].contiguous() * groups ** 0.5 if groups > 1 else w
    g = common.conv_geometry(x.shape, w.shape, stride, padding, dilation, groups)
    dy = torch.randn(g.output_shape_nhwc, generator=torch.Generator().manual_seed(seed + 1))
    return x, w, dy.to(x.device, dtype), g


# %%
# 1. dgrad at stride 1: the forward conv of dY, with the filter flipped
# ---------------------------------------------------------------------
# Along one axis at stride 1, tap r links input row iy to output row oy = iy + ph - r*dh, so::
#
#     dX[iy] = sum over r of dY[iy + ph - r*dh] * w[r]              (channels: sum over co of dY[., co] * w[co, r, ci])
#
# Put r = R-1-r': dX[iy] = sum over r' of dY[iy - (dh*(R-1) - ph) + dh*r'] * w[R-1-r']. That is lesson
# 01's sum again: a forward conv of dY with padding dh*(R-1) - ph, dilation dh, and the filter
# w'[r'] = w[R-1-r'], flipped. Its input channels are dY's Co and its outputs are dX's Ci, so the
# channel axes swap as well::
#
#     w'[ci, r', s', co] = w[co, R-1-r', S-1-s', ci]          (a copy of the weights, small beside dY)
#
# and its output size is out_h + 2*(dh*(R-1) - ph) - dh*(R-1) = H: dX exactly. So lesson 05's
# `conv2d_fprop_launch` computes dgrad as it is, on dY and w'.
#
# w' is a transpose of each tap's [Co, Ci] matrix, and a transpose is where a copy is easy to make
# slow: read along ci and write along co, and one side of it strides through memory. torch's flip
# and permute take two such passes; on the 7x7 512->512 3x3 layer of ResNet-50 at batch 128 they
# took 24 us, against 39 us for the dgrad conv itself (H200, 2026-11-25, torch.profiler). One small
# Triton kernel does it in one pass (`flipped_weights_kernel`): each program loads a [co, ci] tile
# of one tap along ci and stores it along co, and Triton's coalescing pass moves the tile between
# the two orders through shared memory (it lives with the operator's dgrad plans in
# conv_tutorial/kernels/dgrad.py, as `dgrad_by_phases` does). Section 2 hands it each phase's subset
# of the taps, all
# phases in one launch (each phase's taps and where its w' goes passed as integers), and grouped convs
# (lesson 05, section 10) swap their channels within each group.
#
# One edge needs care: when the forward pass padded more than its filter reaches (a 1x1 conv with
# padding 1), dh*(R-1) - ph is negative, and lesson 05 takes no negative padding. Then dX's first row
# reads dY from row ph - dh*(R-1) on: we run the conv with padding 0, whose output has
# ph - dh*(R-1) rows more than dX at either end, and keep the middle H. Section 2 meets the mirror
# case at the far edge.


def reference_fprop(dy_nhwc, w_phase, padding, dilation, groups=1, out_window=None, residual=None,
                    activation="none"):
    # The CPU's stand-in for lesson 05's kernel: torch's conv in fp32 (into out_window, if given, by a copy; a
    # FlippedFilter, section 2c, as what its loads read), and its epilogue's residual and activation (section 12).
    if isinstance(w_phase, FlippedFilter):
        w_phase = gathered_weights(w_phase)
    out = common.reference_conv2d_nhwc(dy_nhwc, w_phase, None, 1, padding, dilation, out_dtype=torch.float32,
                                       groups=groups)
    out = common.reference_epilogue(out, residual=residual, activation=activation)
    return out if out_window is None else out_window.write(out)


def run_dgrad_mapping(N=2, H=9, W=8, Ci=5, Co=6, R=3, S=3, stride=1, padding=1, dilation=1, show=True, groups=1):
    """dgrad by the phases, each conv computed by torch's forward conv, against torch.nn.grad."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.float32, device_name="cpu",
                                  groups=groups)
    dx = dgrad_by_phases(dy, w, g, reference_fprop)
    expected, _ = reference_gradients(x, w, dy, g)
    error = (dx - expected).abs().max().item()
    if show:
        print(f"\ndgrad of {g.describe()} as {g.stride[0] * g.stride[1]} forward conv(s) of dY: "
              f"largest difference from torch.nn.grad.conv2d_input {error:.1e}")
    torch.testing.assert_close(dx, expected, rtol=1e-4, atol=1e-4)    # fp32, two summation orders
    return dx


@pytest.mark.parametrize("Co, R, S, Ci_group, groups, phase_taps", [
    (6, 3, 3, 5, 1, [(slice(0, 3), slice(0, 3))]),          # all taps: section 1
    (70, 3, 3, 40, 1, [(slice(1, 2), slice(0, 3, 2))]),     # one phase's taps (section 2); tiles past the channels
    (12, 5, 2, 3, 4, [(slice(0, 5, 2), slice(1, 2))]),      # four groups of 3 -> 3 channels
    (64, 1, 1, 33, 2, [(slice(0, 1), slice(0, 1))]),        # a 1x1 filter: only the channels swap
    (40, 3, 3, 24, 1, [(slice(a, 3, 2), slice(b, 3, 2)) for a in (0, 1) for b in (0, 1)]),  # stride 2's four phases
    (9, 5, 4, 6, 3, [(slice(a, 5, 3), slice(b, 4, 2)) for a in (2, 0, 1) for b in (1, 0)]),  # 3 x 2, groups, any order
    (8, 5, 5, 6, 1, [(slice(a, 5, 5), slice(b, 5, 5)) for a in range(5) for b in range(5)]),  # 25 phases: 2 launches
    (8, 3, 3, 6, 1, []),                                    # no phase has taps (a stride larger than the image)
])
def test_flipped_weights_match_torchs_flip_and_permute(Co, R, S, Ci_group, groups, phase_taps):
    w = torch.randn(Co, R, S, Ci_group).to(common.device())       # (a CPU: the kernel runs in the interpreter)
    got = flipped_weights(w, phase_taps, groups)
    assert len(got) == len(phase_taps)
    for w_phase, (taps_h, taps_w) in zip(got, phase_taps):
        assert w_phase.is_contiguous() and torch.equal(w_phase, flipped_weights_by_torch(w, taps_h, taps_w, groups))


@pytest.mark.parametrize("R, S, stride, padding, dilation, H, W, C", [
    (1, 1, 2, 0, 1, 8, 70, 300),   # a 1x1 conv at stride 2: three phases of four; blocks of pixels and of channels
    (1, 1, (2, 3), 0, 1, 7, 11, 24),  # strides differ: whole rows untapped, and two columns of three in the others
    (3, 3, 2, 1, 2, 9, 9, 24),     # dilation 2 at stride 2, padding 1: only the odd rows and columns have taps
    (3, 3, 2, 1, 1, 8, 8, 24),     # every phase has taps: nothing to write
    (1, 1, 63, 0, 1, 70, 5, 16),   # a stride past the kernel's bits: torch's way
])
def test_untapped_zeros_write_exactly_the_phases_no_tap_reaches(R, S, stride, padding, dilation, H, W, C):
    g = common.conv_geometry((2, H, W, C), (8, R, S, C), stride, padding, dilation)
    phases = dgrad_phases(g)
    dx = torch.full((g.N, g.H, g.W, g.Ci), 7.0, device=common.device())
    untapped_zeros(dx, g, phases)
    # a row's phase has taps iff some tap r lands on its rows: (iy + padding - r*dilation) divisible by the stride
    # (rows past the forward's last window still count: the phase's conv writes their zeros); columns alike
    def tapped(i, axis, taps):
        return any((i + g.padding[axis] - r * g.dilation[axis]) % g.stride[axis] == 0 for r in range(taps))
    reached = torch.tensor([[tapped(iy, 0, R) and tapped(ix, 1, S) for ix in range(g.W)] for iy in range(g.H)])
    assert torch.equal(dx.cpu(), torch.where(reached[None, :, :, None], 7.0, 0.0).expand_as(dx))


def test_dgrad_at_stride_1_is_a_flipped_forward_conv():
    run_dgrad_mapping(show=False)


@pytest.mark.parametrize("Ci, Co, groups, stride", [(6, 9, 3, 1), (8, 12, 4, 2), (4, 6, 2, (2, 1))])
def test_grouped_dgrad_swaps_channels_within_each_group(Ci, Co, groups, stride):
    # grouped: dY's group k of Co / groups channels makes dX's group k of Ci / groups, through the
    # flipped filters of that group alone (a grouped forward conv of dY)
    run_dgrad_mapping(2, 9, 8, Ci, Co, 3, 3, stride, 1, 1, show=False, groups=groups)


# %%
if __name__ == "__main__":
    run_dgrad_mapping()

# %%
# What you should see: a difference at the level of fp32 rounding, the same products added in
# the same or another order (the script prints 0.0e+00 here, 2.4e-07 for section 2's strided layer).
#
# 2. Strided dgrad: one stride-1 conv per output phase
# ----------------------------------------------------
# At stride sh, the taps that reach input row iy are those r with iy + ph - r*dh divisible by sh,
# and which those are depends on iy mod sh only: the row's *phase*. The rows of phase p
# (iy = p, p + sh, p + 2*sh, ...) see the taps r with (p + ph - r*dh) mod sh = 0: every t-th tap from the
# first, t = sh / gcd(sh, dh), and consecutive ones reach dY rows dh / gcd(sh, dh) apart. So
# phase p of dX is section 1's conv with fewer taps: a stride-1 conv of dY with the phase's taps,
# flipped, at dilation dh / gcd(sh, dh). With both axes, sh x sw phases, each a launch of lesson
# 05's kernel whose output pixels are dX's pixels of that phase, the strided view
# `dx[:, p::sh, q::sw]`, after a crop of the rows and columns that the phase's padding adds.
#
# Where does the kernel store them? Lesson 05's epilogue stores a tile as one TMA box of a dense
# [pixels, channels] matrix. In the strided view a tile's 128 pixels are not evenly spaced (they
# step by sw*Ci elements along a row of dX and jump further at the row's end), so no box covers
# them; a dense phase output copied into the view afterwards costs a write and a read of that
# output (on ResNet-50's 3x3 stride-2 layers, dropping the copy, together with section 1's one-pass
# weights, cut the dgrad's time by 29-33%: RESULTS.md, "The operator's gradients"). So the forward
# kernel the operator runs (conv_tutorial/kernels/fprop.py, lesson 05's with switches) takes an
# *output window*
# (`OutputWindow`: the view and the crop). With one, `TileOutput.store` stages the tile in
# shared memory as the TMA path does, but skips the TMA store: it reads the tile back in rows of
# 16-byte vectors (`staged_tile_layout`: a warp's lanes cover a pixel's channels, two pixels
# of 128 bf16 channels per instruction) and stores each vector at the address of its pixel
# (n, y, x) in the view, elements outside the view masked off (`WindowStore`). Other warps
# read what a warp wrote, and the next tile overwrites the buffer: Triton puts a `bar.sync` of the
# epilogue's warps between the writes and the reads, and another before the next tile's writes
# (the test's `bar.sync 0, 128` in section 7). That is more instructions than one TMA store (on a
# 128 x 128 tile over 4 warps, 16 `st.global.v4` per thread), but no phase output and no copy.
# Why through shared memory: the accumulator's own layout (sm_90's WGMMA fragment) gives each
# thread two adjacent channels of a pixel, and storing from it took 64 four-byte stores per
# thread, each warp instruction touching 8 pixels. On an H100 the 1-tap phase of ResNet-50's 56x56
# 3x3 stride-2 dgrad (dY read once, a quarter of dX written: 51 MB) moved about 1.3 TB/s that way,
# some 40% of the memory's 3.35 TB/s; through the staging buffer the layer's four phases took 109
# us where they had taken 168 (2026-11-26, torch.profiler; results/notebook.md). On sm_100 the
# tensor-memory load already gave each thread 16-byte pieces of one pixel, but a warp instruction
# spread over 32 pixels; it takes the same path (compiled and checked ahead of time, not run).
# The 16-byte vectors need the compiler to know that Co and the view's strides are multiples of 8
# elements; Triton assumes only multiples of 16 of an integer argument, so where dX had 8 (mod 16)
# channels (24, 40, 72, ...) the build stored 2 bytes at a time. `WindowStore.offsets` writes them
# as `Co // 8 * 8` (bf16), equal to Co where `window_storable` holds, which now also asks for a
# whole number of 16-byte vectors of channels (a test in section 7 checks the 24- and 40-channel
# builds).
# Where dX's pixels are not 16-byte aligned (Ci * element size not a multiple of 16), or the config
# splits K (section 7 of lesson 05: its second kernel stores densely), the phase's output is
# computed densely and copied in. The pixels of the phases that no tap reaches are zeros, written
# by one launch of a small kernel (`untapped_zeros`) that writes them and nothing else. A memset
# of all of dX did it first: 62 us beside the conv's 68 on ResNet-50's 56x56 256->512 1x1 stride
# 2 (H100, 2026-11-26, torch.profiler), where three quarters of dX are zeros, so writing only those
# saves a quarter of the memset's bytes. Filling the phases one by one with torch,
# every stride-th pixel, had been slower still (three strided fills, 136 us, H200, 2026-11-25).
# `dgrad_axis_phase` works out one axis of one phase; `dgrad_by_phases` (conv_tutorial/kernels/dgrad.py)
# runs them.
#
# The far edge now needs care too: a phase's conv must have at least as many output rows as the
# phase has rows of dX, and lesson 05 pads both sides alike; where the last rows read dY past its
# end, the padding grows to cover them and the crop moves with it. A phase no tap reaches (a 1x1
# conv at stride 2 reaches the even rows only) is zeros; a phase past the image (H smaller than the
# stride) has no rows.
#
# The alternative is to insert sh-1 zero rows between dY's rows (and sw-1 columns) and run one
# stride-1 conv with all R*S taps (`zero_insertion_dgrad`): one launch, but sh*sw times the MMA
# work, most of it on zeros (4x at stride 2). The phases do only the products that count, in sh*sw
# launches, each a quarter of the pixels at stride 2.
# Which of the two is faster on a GPU is not measured yet: `python benchmarks/backward_layers.py
# --zero-insertion` times zero insertion beside the phases on ResNet-50's strided layers. (What the
# phases themselves measured is in the closing cell.)


def zero_insertion_dgrad(dy_nhwc, w, geometry, fprop):
    """dX as one stride-1 conv over dY with stride - 1 zeros between its rows and columns."""
    g = geometry
    spread = torch.zeros(g.N, (g.out_h - 1) * g.stride[0] + 1, (g.out_w - 1) * g.stride[1] + 1, g.Co,
                         device=dy_nhwc.device, dtype=dy_nhwc.dtype)
    spread[:, ::g.stride[0], ::g.stride[1]] = dy_nhwc
    at_stride_1 = dataclasses.replace(g, stride=(1, 1), out_h=spread.shape[1], out_w=spread.shape[2])
    return dgrad_by_phases(spread, w, at_stride_1, fprop)


def run_dgrad_phases(R=3, stride=2, padding=1, outdir=None):
    """The phases of a ResNet-50 style strided conv (which taps serve which rows), checked on a CPU."""
    g = common.conv_geometry((1, 8, 8, 1), (1, R, R, 1), stride, padding)
    print(f"\nthe phases of dgrad for a {R}x{R} conv, stride {stride}, padding {padding}:")
    for py, px, along_h, along_w in dgrad_phases(g):
        taps = [(r, s) for r in range(R)[along_h.taps or slice(0)] for s in range(R)[along_w.taps or slice(0)]]
        print(f"   dX rows {py}::{stride}, columns {px}::{stride}: taps (r, s) {taps or 'none: zeros'}; "
              f"padding ({along_h.padding}, {along_w.padding}), crop ({along_h.crop}, {along_w.crop})")
    run_dgrad_mapping(N=2, H=9, W=10, Ci=5, Co=6, R=R, S=R, stride=stride, padding=padding)
    if outdir is not None:
        plot_phases(R, stride, padding, outdir)


def plot_phases(R, stride, padding, outdir):
    # Left: a patch of dX, each pixel coloured by its phase. Right: for each phase, the filter taps it uses.
    colors = ["#4878d0", "#ee854a", "#6acc64", "#d65f5f", "#956cb4", "#8c613c", "#dc7ec0", "#797979", "#d5bb67"]
    fig, axes = common.new_figure(1, 1 + stride * stride, figsize=(3 + 2.2 * stride * stride, 3))
    phase_of = lambda iy, ix: (iy % stride) * stride + ix % stride    # noqa: E731
    for iy in range(2 * stride + 2):
        for ix in range(2 * stride + 2):
            axes[0].add_patch(square(ix, iy, colors[phase_of(iy, ix)]))
    axes[0].set_title(f"dX, phase (iy%{stride}, ix%{stride})\nrows iy down, cols ix across", fontsize=9)
    for py in range(stride):
        for px in range(stride):
            ax = axes[1 + py * stride + px]
            along_h = dgrad_axis_phase(py, 64, 64, R, stride, padding, 1)
            along_w = dgrad_axis_phase(px, 64, 64, R, stride, padding, 1)
            used = {(r, s) for r in range(R)[along_h.taps or slice(0)] for s in range(R)[along_w.taps or slice(0)]}
            for r in range(R):
                for s in range(R):
                    ax.add_patch(square(s, r, colors[py * stride + px] if (r, s) in used else "#eeeeee"))
            ax.set_title(f"phase ({py}, {px}), taps used: {len(used)}\nw[r, s]: r down, s across", fontsize=9)
    for ax in axes:
        ax.set_aspect("equal")
        ax.autoscale_view()
        ax.invert_yaxis()
        ax.axis("off")
    fig.suptitle(f"dgrad of a {R}x{R} conv at stride {stride}, padding {padding}: each phase of dX is a "
                 f"stride-1 conv of dY with the taps shown (flipped)", fontsize=9)
    common.save_figure(fig, outdir, "06_dgrad_phases")


def square(x, y, color):
    import matplotlib.patches
    return matplotlib.patches.Rectangle((x, y), 0.92, 0.92, color=color)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", [
    (2, 9, 10, 5, 6, 3, 3, 2, 1, 1),              # ResNet-50's 3x3 stride 2
    (2, 8, 8, 4, 8, 1, 1, 2, 0, 1),               # 1x1 stride 2: three phases of zeros
    (1, 11, 9, 3, 7, 7, 7, 2, 3, 1),              # a stem: 7x7 stride 2 padding 3
    (2, 10, 9, 4, 6, 3, 3, 2, 0, 1),              # the last input row read by no output
    (1, 13, 12, 3, 5, 4, 4, 3, 1, 1),             # stride 3, an even filter
    (2, 12, 11, 4, 5, 3, 3, 2, 2, 2),             # stride and dilation 2: all taps in the even rows, none in the odd
    (1, 14, 13, 2, 3, 3, 3, 2, 1, 3),             # dilation 3 at stride 2
    (2, 9, 11, 5, 4, 3, 5, (2, 1), (1, 2), (1, 2)),  # different strides, paddings and dilations per axis
    (1, 7, 7, 3, 4, 1, 1, 1, 2, 1),               # padding past the filter at stride 1: a crop
    (1, 3, 8, 2, 3, 3, 1, 4, 1, 1),               # stride above H: phases past the image
    (1, 9, 9, 2, 2, 5, 5, 4, 0, 2),               # stride 4, dilation 2
])
def test_dgrad_phases_match_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation):
    run_dgrad_mapping(N, H, W, Ci, Co, R, S, stride, padding, dilation, show=False)


@pytest.mark.parametrize("stride, padding, dilation", [(2, 1, 1), ((3, 2), (0, 2), (1, 2))])
def test_zero_insertion_matches_torch(stride, padding, dilation):
    x, w, dy, g = backward_inputs(2, 11, 10, 4, 6, 3, 3, stride, padding, dilation, torch.float32, device_name="cpu")
    expected, _ = reference_gradients(x, w, dy, g)
    torch.testing.assert_close(zero_insertion_dgrad(dy, w, g, reference_fprop), expected, rtol=1e-4, atol=1e-4)


# %%
if __name__ == "__main__":
    run_dgrad_phases(outdir=outdir)

# %%
# What you should see::
#
#     the phases of dgrad for a 3x3 conv, stride 2, padding 1:
#        dX rows 0::2, columns 0::2: taps (r, s) [(1, 1)]; padding (0, 0), crop (0, 0)
#        dX rows 0::2, columns 1::2: taps (r, s) [(1, 0), (1, 2)]; padding (0, 1), crop (0, 1)
#        dX rows 1::2, columns 0::2: taps (r, s) [(0, 1), (2, 1)]; padding (1, 0), crop (1, 0)
#        dX rows 1::2, columns 1::2: taps (r, s) [(0, 0), (0, 2), (2, 0), (2, 2)]; padding (1, 1), crop (1, 1)
#
# ResNet-50's 3x3 stride-2 convs: four phases of 1, 2, 2 and 4 taps, nine in all, each used once,
# so together they do the forward pass's MMA work (aside from tile rounding and the rows that a
# phase's padding adds and its crop drops). The odd rows 2j+1 read dY[j] and dY[j + 1]: the last
# of them (row 7 of this 8-row dX) reads dY[4], one past dY's 4 rows, so the phase's conv gets
# padding 1, on both sides as lesson 05 pads, and crop 1 drops its first output row, which would
# read dY[-1]. The even rows 2j read dY[j] with the centre tap alone.
#
# 2b. All the phases in one launch
# --------------------------------
# Four launches cost more than their share. On an H100 (2026-11-26), ResNet-50's 3x3 stride-2
# dgrads ran at 0.70-0.80x cuDNN's speed this way (RESULTS.md, "The operator's gradients"), where
# cuDNN runs one kernel: each launch reads all of dY again, its last wave runs partly empty, and the
# 1-tap phase (2 k-steps of 64 channels on 128-channel layers) is all epilogue. One launch can run
# them all, because the phases of an axis read dY through one window. For a 3x3 filter at stride 2,
# padding 1: the rows 2j read dY[j] (tap r = 1), the rows 2j+1 read dY[j] and dY[j+1] (taps 2 and
# 0, flipped), so both read a 2-row window from dY[j] on. In general phase a's conv reads, for its
# row y, dY rows y + first_a + t * d for its taps t = 0, 1, ..., where first_a is its crop less its
# padding and d is `AxisPhase.dilation` (dh / gcd(sh, dh)); the phases of one axis differ only in
# first_a and in how many taps they have. (At padding 1 above, first is 0 for both residues; at
# padding 0, -1 for the even rows, with taps 2 and 0, and 0 for the odd ones, with tap 1.) So:
#
# - one conv of dY whose window is the union of the phases' windows: it starts at the smallest
#   first_a, origin, and phase a's taps start (first_a - origin) / d taps into it;
# - its padding is -origin, which may be negative (the window starting inside dY). Lesson 05's
#   conv_geometry refuses a negative padding, so `side_by_side_plan` builds the ConvGeometry
#   itself; the kernel only subtracts the padding from a pixel's row, and the im2col descriptor's
#   lower corner (-padding) may be positive. Its rows are phase 0's rows of dX, ceil(H / sh), the
#   most any phase has, with no crop. That is not lesson 05's out_h + 2 * padding - d * (R - 1):
#   where the last rows read past dY's end, the descriptor's upper corner lets the pixel box run
#   there and TMA fills zeros, a padding at the far end alone (where section 2's convs padded both
#   ends and cropped);
# - its output columns are the phases side by side, `width` each (dX's Ci rounded up to a tile):
#   a tile's columns belong to one phase, p = co0 // width;
# - a tile runs only its phase's rectangle of taps (`PhaseTiles`: the first tap and the
#   count along each axis, picked by the phase's residues a = p // sw and b = p % sw):
#   `TileSchedule.work` ends its k-steps there and `Im2colWindow.tile_taps` offsets its taps by
#   the rectangle's corner. So the MMA work is the useful work, but for the columns that round
#   Ci up to a tile and the last row of the phases with fewer rows than phase 0;
# - the weights: each phase's w' in its own rows (`flipped_weights(..., width=)`), its taps first,
#   so a k-step's weight column is its tap's index in the rectangle, as in lesson 05;
# - the epilogue stores column block p at dX's pixel (a + sh*y, b + sw*x) (`WindowStore` with
#   phases; the window's view is the whole of dX), dropping rows and columns past dX's edges;
# - the tiles' order (`phase_order`, `PhaseTiles.tile`). Lesson 05's grouped order over the phases
#   side by side keeps a group's tiles, every phase of the same dY pixels, together, so dY should
#   come from HBM about once (not measured). But where a group holds about as many tiles as there are programs, a
#   program meets the same phase wave after wave (ResNet-50's 14x14 layer: some programs run six
#   4-tap tiles, others six 1-tap ones; `benchmarks/phase_balance.py` counts it). Run the phases one
#   after another instead, heaviest first, each phase's tiles in the grouped order, and the
#   programs' round-robin over the tiles is close to longest-job-first; each phase then reads dY
#   again (from L2 where dY fits there, not where it is as large as half of it), so `phase_order`
#   takes that order only where, counted on paper, it lightens the busiest program by more than 5%.
#
# The operator's forward kernel takes the phases in its output window (`WindowPhases`); without
# them the new lines are constexpr Nones, and it builds to lesson 05's PTX at every config lesson 05
# teaches (tests/kernels/test_equivalence.py, sm_90 and sm_100). The plan applies where every phase has taps and
# rows and the phases' windows line up: on a strided axis only at dilation 1 (a dilated stride-1
# axis is fine). Elsewhere (a 1x1 conv at stride 2: three phases of zeros) the phases run one
# launch each, as above. On the H100 (2026-11-26) the one launch took ResNet-50's three 3x3
# stride-2 dgrads from 0.80x, 0.70x and 0.79x cuDNN's speed to 1.01x, 0.85-0.86x and 0.74-0.76x
# (two runs; RESULTS.md), in lesson 05's order. With section 2c's weights read in place (below),
# heaviest phase first took the 14x14 and 28x28 layers from 0.79x and 0.90x to 1.06x and 0.96x,
# and cost the 56x56 layer, balanced either way, 5% (1.02x to 0.97x; likely its dY, 26 MB, half
# of the H100's L2, read once per phase, where the 14x14 and 28x28 layers' 6.4 and 12.8 MB fit):
# hence the rule (one run each, on one H100, 2026-11-26; results/notebook.md).


def reference_side_by_side(dy_nhwc, w_side_by_side, plan, out_window):
    """The CPU's model of section 2b's conv, in fp32 (fp64 given fp64): each phase's weights spread over the whole
    window (zeros outside its rectangle), one torch conv of dY padded as the plan says (a negative
    padding crops), stored through the window's phases (OutputWindow.write)."""
    g, phases = plan.geometry, plan.phases
    dtype = torch.promote_types(dy_nhwc.dtype, torch.float32)
    if isinstance(w_side_by_side, FlippedFilter):    # section 2c: what its loads read, zeros elsewhere
        full = gathered_weights(w_side_by_side, phases).to("cpu", dtype)
    else:
        full = torch.zeros(g.Co, g.R, g.S, g.Ci, dtype=dtype)
        for p in range(phases.count):
            (r0, taps_h), (s0, taps_w) = (phases.along_h[p // len(phases.along_w)],
                                          phases.along_w[p % len(phases.along_w)])
            rows = w_side_by_side[p * phases.width:(p + 1) * phases.width, 0, :taps_h * taps_w].to("cpu", dtype)
            full[p * phases.width:(p + 1) * phases.width, r0:r0 + taps_h, s0:s0 + taps_w] = rows.view(
                phases.width, taps_h, taps_w, g.Ci)
    # rows of dY the output reads: from -padding to (out_h - 1) - padding + (R - 1) * dilation
    bottom, right = ((out - 1) + (size - 1) * dil - pad - (dy_size - 1) for out, size, dil, pad, dy_size in
                     ((g.out_h, g.R, g.dilation[0], g.padding[0], g.H),
                      (g.out_w, g.S, g.dilation[1], g.padding[1], g.W)))
    dy = torch.nn.functional.pad(dy_nhwc.to("cpu", dtype), (0, 0, g.padding[1], right, g.padding[0], bottom))
    out = torch.nn.functional.conv2d(dy.permute(0, 3, 1, 2), full.permute(0, 3, 1, 2), dilation=g.dilation)
    out = out.permute(0, 2, 3, 1)
    out_window.write(out.to(out_window.view.device))


def run_side_by_side(N=2, H=9, W=10, Ci=5, Co=6, R=3, S=3, stride=2, padding=1, dilation=1, show=True,
                     in_place=False):
    """Section 2b on a CPU: every phase in one conv (torch's, the window's phases) against torch.nn.grad;
    `in_place`: its weights as section 2c's FlippedFilter, what the kernel's loads would read of w."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.float32, device_name="cpu")
    plan = side_by_side_plan(g, forward.FIXED_CONFIG._replace(block_n=16))
    if plan is None:
        raise ValueError(f"{g.describe()}: section 2b does not apply (a phase without taps or rows, windows that "
                         f"do not line up, groups, stride 1 or above 4); run_dgrad_mapping runs its phases one by one")
    dx = dgrad_side_by_side(dy, w, g, plan, reference_side_by_side, in_place)
    expected, _ = reference_gradients(x, w, dy, g)
    if show:
        print(f"\n{g.describe()}: {plan.phases.count} phases as one conv of dY, {plan.geometry.R}x{plan.geometry.S} "
              f"taps from row {-plan.geometry.padding[0]}, column {-plan.geometry.padding[1]} of dY, "
              f"taps per phase along_h {plan.phases.along_h}, along_w {plan.phases.along_w} ((first, count)): "
              f"largest difference from torch.nn.grad.conv2d_input {(dx - expected).abs().max().item():.1e}")
    torch.testing.assert_close(dx, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", [
    (2, 9, 10, 5, 6, 3, 3, 2, 1, 1),              # ResNet-50's 3x3 stride 2, odd rows: phase 1 has one row fewer
    (2, 10, 9, 20, 6, 3, 3, 2, 0, 1),             # padding 0 (Inception's): phases start at different dY rows
    (1, 13, 12, 3, 5, 4, 4, 3, 1, 1),             # stride 3, an even filter: 9 phases
    (1, 11, 9, 3, 7, 7, 7, 2, 3, 1),              # a stem's 7x7
    (1, 14, 13, 2, 3, 5, 3, (3, 2), (2, 1), 1),   # strides 3 and 2
    (2, 9, 11, 5, 4, 3, 5, (2, 1), (1, 2), (1, 1)),  # stride 2 along h only
    (1, 9, 9, 2, 2, 5, 5, 4, 0, 1),               # stride 4: 16 phases of 1 or 2 taps per axis
    (1, 12, 12, 8, 4, 3, 3, 2, 3, 1),             # padding 3: the window starts inside dY (padding -1)
])
@pytest.mark.parametrize("in_place", [False, True])
def test_side_by_side_matches_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation, in_place):
    run_side_by_side(N, H, W, Ci, Co, R, S, stride, padding, dilation, show=False, in_place=in_place)


@pytest.mark.parametrize("R, stride, padding, dilation, why", [
    (1, 2, 0, 1, "three phases without taps"),
    (3, 2, 2, 2, "stride and dilation 2: the odd rows have no taps"),
    (3, 2, 1, 3, "dilation 3 at stride 2: the phases' windows start 1 dY row apart, their taps 3 apart"),
    (5, 5, 2, 1, "a stride above 4 (25 phases of one tap each)"),
    (3, 1, 1, 1, "stride 1: one phase"),
])
def test_side_by_side_plan_declines(R, stride, padding, dilation, why):
    g = common.conv_geometry((1, 12, 12, 8), (8, R, R, 8), stride, padding, dilation)
    assert side_by_side_plan(g) is None, why


def test_side_by_side_refuses_a_plan_of_another_shape_or_split_k():
    x, w, dy, g = backward_inputs(1, 9, 9, 8, 8, 3, 3, 2, 1, 1, torch.float32, device_name="cpu")
    other = common.conv_geometry((1, 11, 11, 8), (8, 3, 3, 8), 2, 1)
    with pytest.raises(ValueError, match="plan must be side_by_side_plan of"):
        dgrad_side_by_side(dy, w, g, side_by_side_plan(other), reference_side_by_side)
    with pytest.raises(ValueError, match="split_k=1"):
        side_by_side_plan(g, forward.FIXED_CONFIG._replace(split_k=2))
    with pytest.raises(ValueError, match="section 2b does not apply"):
        run_side_by_side(R=1, S=1, padding=0, show=False)


def test_phases_run_heaviest_first():
    # ResNet-50's 3x3 stride 2, padding 1: phase (0, 0) has 1 x 1 taps, (0, 1) and (1, 0) 1 x 2 and 2 x 1, (1, 1) 2 x 2
    g = common.conv_geometry((1, 14, 14, 8), (8, 3, 3, 8), 2, 1)
    plan = side_by_side_plan(g, forward.FIXED_CONFIG._replace(block_n=16))
    assert plan.phases.heaviest_first() == ((3,), (1,), (2,), (0,))
    window = OutputWindow(torch.empty(1, 14, 14, 8), phases=plan.phases)
    assert window.kernel_args()[8][4] is None
    ordered = window._replace(phases=plan.phases._replace(order=plan.phases.heaviest_first()))
    assert ordered.kernel_args()[8][4] == ((3,), (1,), (2,), (0,))


@pytest.mark.parametrize("N, H, Ci, busiest, ordered", [
    # ResNet-50's 3x3 stride-2 layers at batch 128 in 128 x 128 tiles, on 132 programs: the busiest program's
    # taps in lesson 05's order and heaviest first
    (128, 14, 512, (24, 15), True),     # 784 tiles: groups of 128 tiles, about the programs; 2 x 4 taps more
    (128, 28, 256, (32, 27), True),
    (128, 56, 128, (54, 54), False),    # balanced either way: lesson 05's order, dY read about once
    (1, 8, 64, (4, 4), False),          # 4 tiles, one program each: nothing to balance
])
def test_phase_order_where_it_lightens_the_busiest_program(N, H, Ci, busiest, ordered):
    g = common.conv_geometry((N, H, H, Ci), (Ci, 3, 3, Ci), 2, 1)
    plan = side_by_side_plan(g, forward.KernelConfig(128, 128, 64, 6, 8))
    grouped, heaviest = taps_per_tile(plan), taps_per_tile(plan, plan.phases.heaviest_first())
    assert sorted(grouped) == sorted(heaviest)      # the same tiles, another order
    assert (busiest_program(grouped, 132), busiest_program(heaviest, 132)) == busiest
    assert phase_order(plan, 132) == (plan.phases.heaviest_first() if ordered else None)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, stride, padding, tile_m, tile_n", [
    (128, 14, 14, 512, 512, 3, 2, 1, 128, 128),    # ResNet-50's 14x14 layer: 49 row-tiles, 4 phases of 4 columns
    (2, 13, 11, 40, 24, 4, 3, 1, 128, 64),         # stride 3: 9 phases, a last group of fewer rows
    (3, 9, 10, 16, 8, 3, (2, 1), 0, 64, 16),       # stride 2 along h only
])
def test_phase_tiles_hand_out_every_tile_once(N, H, W, Ci, Co, R, stride, padding, tile_m, tile_n, monkeypatch):
    # PhaseTiles.tile's own code run as plain Python (pick and gl.minimum in their Python meaning): heaviest first,
    # every (pid_m, pid_n) of section 2b's conv exactly once, each tile's taps what taps_per_tile (phase_order's
    # count) says; without an order, lesson 05's (pid_m, pid_n), as handed in
    import types
    import conv_tutorial.kernels.windows as kernel_windows
    monkeypatch.setattr(kernel_windows, "pick",
                        lambda table, index, field: table[index if index < len(table) else 0][field])
    monkeypatch.setattr(kernel_windows, "gl", types.SimpleNamespace(minimum=min))
    g = common.conv_geometry((N, H, W, Ci), (Co, R, R, Ci), stride, padding)
    plan = side_by_side_plan(g, forward.FIXED_CONFIG._replace(block_m=tile_m, block_n=tile_n))
    order = plan.phases.heaviest_first()
    phases = types.SimpleNamespace(width=plan.phases.width, order=order)
    num_pid_m, num_pid_n = -(-plan.geometry.M // tile_m), plan.geometry.Co // tile_n
    handed = [PhaseTiles.tile.fn(phases, t, num_pid_m, tile_n, 8, -1, -1) for t in range(num_pid_m * num_pid_n)]
    assert sorted(handed) == [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]
    taps = [plan.phases.along_h[n * tile_n // plan.phases.width // len(plan.phases.along_w)][1]
            * plan.phases.along_w[n * tile_n // plan.phases.width % len(plan.phases.along_w)][1] for _, n in handed]
    assert taps == taps_per_tile(plan, order) and taps == sorted(taps, reverse=True)
    unordered = types.SimpleNamespace(width=plan.phases.width, order=None)
    assert PhaseTiles.tile.fn(unordered, 5, num_pid_m, tile_n, 8, 3, 7) == (3, 7)


def test_side_by_side_weights_match_torch():
    # flipped_weights' side-by-side layout (the kernel under the interpreter on a CPU) against torch's
    w = torch.randn(40, 3, 3, 24).to(common.device())
    taps = [(slice(a, 3, 2), slice(b, 3, 2)) for a in (1, 0) for b in (1, 0)]
    got = flipped_weights(w, taps, width=32)
    assert got.shape == (4 * 32, 1, 4, 40)
    expected = side_by_side([flipped_weights_by_torch(w, h, v) for h, v in taps], 32)
    for p, (h, v) in enumerate(taps):       # each phase's own taps and rows, and zeros past its taps: 40 channels
        used = len(range(3)[h]) * len(range(3)[v])   # end inside a K block, whose last k-step reads past them
        torch.testing.assert_close(got[p * 32:(p + 1) * 32, :, :used], expected[p * 32:(p + 1) * 32, :, :used],
                                   rtol=0, atol=0)
        assert not got[p * 32:(p + 1) * 32, :, used:].any()


# %%
if __name__ == "__main__":
    run_side_by_side()

# %%
# What you should see (the phases of the example above, as one conv)::
#
#     N=2 9x10 Ci=5 -> Co=6, 3x3, stride 2, pad 1: 4 phases as one conv of dY, 2x2 taps from row 0,
#     column 0 of dY, taps per phase along_h ((0, 1), (0, 2)), along_w ((0, 1), (0, 2)) ((first,
#     count)): largest difference from torch.nn.grad.conv2d_input 3.0e-07
#
# The even rows run the window's first tap alone (dY[j], with the filter's centre row), the odd
# ones both: dY[j] with the filter's last row and dY[j + 1] with its first (flipped).

# %%
# 2c. The weights where they lie
# ------------------------------
# Every dgrad above starts with a copy: `flipped_weights` writes w' [Ci, R', S', Co] so that lesson
# 05's loader finds, for the tile of dX's channels n0, n0+1, ... and k-step (tap, c0), a box
# [BLOCK_N, BLOCK_K] of w' with K (dY's channels) contiguous, the layout of lesson 05's own filter.
# In training the weights change every step, so the copy runs every step: a launch of its own,
# reading and writing all of w (on the H100, 1.8 to 5.3 us per ResNet-50 layer; RESULTS.md).
#
# The copy is not needed. Seen as w2d [Co, R*S*Ci], w already holds, at rows c0, ..., c0+BLOCK_K-1
# and the columns of tap (R-1-r', S-1-s') from n0 on, exactly the weights k-step (r', s', c0) of
# that tile multiplies: a box [BLOCK_K, BLOCK_N] whose N index (dX's channel) is the contiguous
# one, an *N-major* B, where w' gave a K-major one. So the loader asks TMA for that box at
# (c0, column), and the MMA takes the stage as it lies, [BLOCK_K, BLOCK_N], instead of the
# [BLOCK_N, BLOCK_K] box seen transposed (`Ring.b` in lesson 05; the operator's kernel adds the
# switch, `Ring.B_N_MAJOR`). Rows past Co lie outside w2d and
# arrive as zeros (so no uninitialized weight meets dY's zero-filled channels, which section 2b's
# copy had to zero). Columns past the tap's Ci belong to the next tap (or lie outside w2d) and make
# output columns nobody reads: the TMA store clips them or writes them into out_2d's padding
# columns, which the result leaves out, and a window's store masks them.
#
# Whether the tensor cores read an N-major B is the architecture's call, and section 3 quotes the
# PTX ISA: for fp16 and bf16, yes on both (WGMMA's imm-trans-b, tcgen05's "Transpose B Matrix"
# bit); for fp8 on Hopper, no, which is one reason this lesson runs in fp16 and bf16.
#
# The flip is now arithmetic. `FlippedFilter` names w and, per residue of the phases (one
# residue without phases), the rectangle of the conv's taps and the taps of w it reads, reversed;
# its `kernel_args` turn that into two numbers per residue and axis, a base and a step (along_h[a]
# = (base_h, step_h), along_w[b] = (base_w, step_w)), so that conv tap (r, s) of residue (a, b)
# reads columns
#
#     base_h - r * step_h + base_w - s * step_w + n
#
# (`FlippedTaps`, which the operator's `Im2colWindow.k_step` asks where the box starts). The
# per-phase convs of section 2 get one FlippedFilter each, section 2b's conv one with a residue
# per phase row and column. It applies where w is on the GPU, fp16 or bf16, contiguous, 16-byte
# aligned, its rows whole 16-byte vectors and groups is 1 (`reads_in_place`); elsewhere the copy
# stays. (A dgrad with its stride folded into the channels, section 6, still copies w once to fold
# it, then reads that copy in place.) The launcher and the operator take it; `gathered_weights`
# is the CPU's model of what the loads read. Without a FlippedFilter the kernel builds as
# lesson 05's (the same opcode counts, registers and shared memory at every candidate config, sm_90
# and sm_100: `tools/ptx_fingerprint.py`, tests/kernels/test_equivalence.py). On the H100
# (2026-11-26; RESULTS.md, "The operator's gradients") it took the operator's dgrad over
# ResNet-50's 23 layers to 1.04x cuDNN's speed, kernels alone, geometric mean, from 0.99x in a
# run before it on another H100: every layer gained, from under 1% (the 56x56 stride-2 layer) to
# 11%, the folded stem 15%, and none is below 0.80x.


def gathered_weights(flipped, phases=None):
    """What the kernel's loads read through a FlippedFilter, gathered by torch at its kernel_args' columns:
    w' [N, R', S', Co] (N = Ci; with `phases`, a WindowPhases, phases.width columns per phase, zeros where a
    phase's rectangle has no tap and past its channels). The CPU's model of the loads."""
    Co, _, _, Ci = flipped.w.shape
    w2d = flipped.w.reshape(Co, -1)
    _, R, S, _ = flipped.shape
    along_h, along_w = flipped.kernel_args()
    width = Ci if phases is None else phases.width
    out = flipped.w.new_zeros(width * len(along_h) * len(along_w), R, S, Co)
    for a, ((base_h, step_h), (r0, _, _, taps_h)) in enumerate(zip(along_h, flipped.along_h)):
        for b, ((base_w, step_w), (s0, _, _, taps_w)) in enumerate(zip(along_w, flipped.along_w)):
            p = a * len(along_w) + b
            for r in range(r0, r0 + taps_h):
                for s in range(s0, s0 + taps_w):
                    column = base_h - r * step_h + base_w - s * step_w
                    out[p * width:p * width + Ci, r, s] = w2d[:, column:column + Ci].t()
    return out


@pytest.mark.parametrize("Co, R, S, Ci, phase_taps", [
    (24, 3, 3, 16, [(slice(None), slice(None))]),                                  # stride 1: the whole filter
    (40, 1, 1, 8, [(slice(None), slice(None))]),                                   # 1x1: a transpose
    (16, 3, 2, 24, [(slice(a, None, 2), slice(b, None, 2)) for a in (1, 0) for b in (1, 0)]),   # stride 2
    (8, 5, 5, 8, [(slice(2, None, 3), slice(0, None, 3))]),                        # one phase of stride 3
])
def test_filters_in_place_read_what_flipped_weights_copies(Co, R, S, Ci, phase_taps):
    w = torch.randn(Co, R, S, Ci).to(torch.bfloat16)
    for filt, (taps_h, taps_w) in zip(filters_in_place(w, phase_taps), phase_taps):
        torch.testing.assert_close(gathered_weights(filt.check()), flipped_weights_by_torch(w, taps_h, taps_w),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("R, stride, padding", [(3, 2, 1), (3, 2, 0), (4, 3, 1), (3, (2, 1), 1)])
def test_side_by_side_in_place_reads_what_the_copy_holds(R, stride, padding):
    x, w, dy, g = backward_inputs(1, 13, 12, 24, 16, R, R, stride, padding, 1, torch.bfloat16, device_name="cpu")
    plan = side_by_side_plan(g, forward.FIXED_CONFIG._replace(block_n=32))
    copy = side_by_side([flipped_weights_by_torch(w, h, v) for h, v in plan.taps], plan.phases.width)
    gathered = gathered_weights(side_by_side_in_place(w, plan).check(), plan.phases)       # [P * width, R', S', Co]
    for p in range(plan.phases.count):
        (r0, taps_h), (s0, taps_w) = (plan.phases.along_h[p // len(plan.phases.along_w)],
                                      plan.phases.along_w[p % len(plan.phases.along_w)])
        rows = slice(p * plan.phases.width, (p + 1) * plan.phases.width)
        torch.testing.assert_close(gathered[rows, r0:r0 + taps_h, s0:s0 + taps_w].reshape(plan.phases.width, -1, g.Co),
                                   copy[rows, 0, :taps_h * taps_w], rtol=0, atol=0)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", [
    (2, 9, 8, 16, 8, 3, 3, 1, 1, 1),               # stride 1: one conv, the whole filter reversed
    (1, 10, 9, 8, 24, 1, 1, 2, 0, 1),              # 1x1 stride 2: one phase with a tap, three of zeros
    (1, 9, 11, 8, 16, 3, 5, (2, 1), (1, 2), (1, 2)),  # stride 2 along h, dilation 2 along w
    (1, 13, 12, 8, 8, 4, 4, 3, 1, 1),              # stride 3, an even filter
])
def test_phases_read_in_place_match_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation, monkeypatch):
    # dgrad_by_phases' in_place branch on a CPU (it runs on a GPU only: the gate let through here), each phase's
    # FlippedFilter given to the CPU's conv as what its loads read
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.bfloat16, device_name="cpu")
    import conv_tutorial.kernels.dgrad as dgrad_plans
    monkeypatch.setattr(dgrad_plans, "reads_in_place", lambda w, groups=1: groups == 1)
    handed = []

    def fprop(dy_nhwc, w_phase, **conv):
        handed.append(type(w_phase))
        return reference_fprop(dy_nhwc.float(), gathered_weights(w_phase).float(), **conv)
    dx = dgrad_by_phases(dy, w, g, fprop, in_place=True)
    expected, _ = reference_gradients(x.float(), w.float(), dy.float(), g)
    assert handed and set(handed) == {FlippedFilter}
    torch.testing.assert_close(dx.float(), expected, rtol=2e-2, atol=2e-2)


def test_flipped_filter_refusals():
    w = torch.randn(16, 3, 3, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="must read taps inside"):
        FlippedFilter(w, ((0, 1, 2, 2),), ((0, 0, 1, 3),)).check()
    with pytest.raises(ValueError, match="whole 16-byte vectors"):
        FlippedFilter(torch.randn(16, 1, 1, 3, dtype=torch.bfloat16), ((0, 0, 1, 1),), ((0, 0, 1, 1),)).check()
    g = common.conv_geometry((1, 8, 8, 16), (8, 3, 3, 16), 1, 1)          # dY's conv: 16 -> 8 channels, 3x3
    flipped = FlippedFilter(w, ((0, 0, 1, 3),), ((0, 0, 1, 3),))
    assert flipped_filter_taps(flipped, g, torch.bfloat16) == flipped.kernel_args()
    with pytest.raises(ValueError, match="needs"):
        flipped_filter_taps(flipped, g, torch.float16)
    with pytest.raises(ValueError, match="needs"):
        flipped_filter_taps(FlippedFilter(w, ((0, 0, 1, 2),), ((0, 0, 1, 3),)), g, torch.bfloat16)
    with pytest.raises(ValueError, match="the rectangles"):      # its shape right, a rectangle not the conv's
        flipped_filter_taps(FlippedFilter(w, ((0, 0, 1, 3),), ((1, 0, 1, 2),)), g, torch.bfloat16)


def run_weights_in_place(Co=16, R=3, S=3, Ci=8, show=True):
    """Section 2c on a CPU: a stride-1 dgrad's FlippedFilter, the columns its loads read, what they gather
    against the flipped copy; then section 2b's example with its weights read in place."""
    w = torch.randn(Co, R, S, Ci, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    (flipped,) = filters_in_place(w, [(slice(None), slice(None))])
    (((first_h, per_r),), ((first_w, per_s),)) = flipped.kernel_args()
    same = torch.equal(gathered_weights(flipped), flipped_weights_by_torch(w, slice(None), slice(None)))
    if show:
        print(f"\nw {tuple(w.shape)} read in place as w' {flipped.shape}: conv tap (r, s) reads w2d's columns "
              f"{first_h} - {per_r}*r + {first_w} - {per_s}*s + n, rows c0 ...; what those loads gather "
              f"{'equals' if same else 'DIFFERS from'} the flipped copy")
    run_side_by_side(show=show, in_place=True)
    return same


# %%
if __name__ == "__main__":
    run_weights_in_place()

# %%
# What you should see::
#
#     w (16, 3, 3, 8) read in place as w' (8, 3, 3, 16): conv tap (r, s) reads w2d's columns 48 - 24*r +
#     16 - 8*s + n, rows c0 ...; what those loads gather equals the flipped copy
#
# and section 2b's line again, its weights now a FlippedFilter. Tap (0, 0) of the conv reads
# columns 64 + n, w's tap (2, 2) (tap 8 of 9, 8 channels each): the last, as the flip says; each
# step along r goes back a row of taps (S * Ci = 24 columns), each step along s one tap (Ci = 8).

#
# The dgrad launcher
# ------------------
# `conv2d_dgrad_launch` checks its arguments and runs `dgrad_by_phases` with the forward kernel's plain
# launcher, or, where section 2b's plan applies, one launch of that kernel for all phases
# (`side_by_side_launch`, `side_by_side_config`'s config). The phases' config is lesson 05's fixed
# one, 64 columns wide where dX has 64 channels or fewer; the operator's tuned configs are a later
# step.


def conv2d_dgrad_launch(dy_nhwc, w, x_shape, stride=1, padding=0, dilation=1, groups=1):
    """dX [N, H, W, Ci] of a conv of x (shape `x_shape`, NHWC) with w [Co, R, S, Ci], from dY
    [N, out_h, out_w, Co] (fp16 or bf16, contiguous, on a Hopper or Blackwell GPU): the forward
    kernel (the operator's copy of lesson 05's), once per phase of dX (one launch at stride 1), or
    once for all phases where section 2b
    applies. groups > 1: w is [Co, R, S, Ci / groups], where backward_groups_reason allows it."""
    g = check_backward_call({"dy_nhwc": dy_nhwc, "w": w}, x_shape, getattr(w, "shape", None), stride, padding,
                            dilation, groups)
    common.require_tma_mma_gpu("conv2d_dgrad_launch")
    fold = stride_fold(g, dy_nhwc.element_size())    # few channels at a stride: fold it (end of section 6)
    config = dgrad_config(g if fold is None else fold.geometry)

    def fprop(dy, w_phase, padding, dilation, groups, out_window=None):
        return forward.conv2d_fprop_launch(dy, w_phase, padding=padding, dilation=dilation, config=config,
                                            groups=groups, out_window=out_window)
    return dgrad(dy_nhwc, w, g, fprop, fold, conv=side_by_side_launch, in_place=True)


# %%
# 3. wgrad: a GEMM whose operands arrive transposed
# -------------------------------------------------
# dW[co, (r, s, ci)] = sum over pixels p = (n, oy, ox) of dY[p, co] * im2col(x)[p, (r, s, ci)]:
# dW = dY^T @ im2col(x), with M = Co, N_GEMM = R*S*Ci and K = N*out_h*out_w. A tile of dW is
# BLOCK_M output channels x BLOCK_N input channels of one tap (r, s), and its k-steps walk the
# pixels, BLOCK_K at a time. What a k-step loads is what lesson 05 loads, turned around:
#
# - A: dY, as the 2-D [pixels, Co] tensor an NHWC tensor is, a tiled TMA box [BLOCK_K, BLOCK_M]
#   at (p0, co0). In shared memory its M index (co) is the contiguous one: an *M-major* A, where
#   lesson 05's A (pixels x channels, for the GEMM K contiguous) was K-major.
# - B: the im2col box of x for tap (r, s), lesson 05's descriptor and window at the same offsets
#   (r*dh, s*dw): BLOCK_K output pixels x BLOCK_N channels, started where output pixel p0's window
#   starts. Its N index (ci) is contiguous: an *N-major* B, where lesson 05's B (filters x channels)
#   was K-major.
# - A 1x1 conv at stride 1 without padding needs no im2col: output pixel p reads input pixel p, so
#   x is a 2-D [pixels, Ci] tensor as dY is, and a tiled box at (p0, c0) fills the stage with the
#   same bytes in the same shared layout, without the box origin's three integer divisions per
#   k-step and without the im2col mode (`x_reads_tiled`; the kernel tells the two apart by its x
#   descriptor's rank). On an H100 that was 1% slower at worst and 1-12% faster on Wide
#   ResNet-50-2's eight layers at 28x28 and below, over all 32 such layers of a tuning set (Wide
#   ResNet-50-2 and Inception v3 at batch 128); which of the two savings counts was not measured
#   apart (results/notebook.md, 2026-11-26).
#
# The MMA gets A as `dy_tile.permute((1, 0))`, a [BLOCK_M, BLOCK_K] view of the same bytes, and B
# as the im2col tile as it lies, [BLOCK_K, BLOCK_N]. Whether the tensor cores read operands that
# way is the architecture's call:
#
# - Hopper. `wgmma.mma_async` reads shared-memory operands through matrix descriptors, K-major by
#   default; the immediates imm-trans-a and imm-trans-b ask for the transposed (M- or N-major)
#   layout, and the PTX ISA (wgmma.mma_async) allows that "only for the wgmma.mma_async variants
#   with .f16/.bf16 types on matrices accessed from shared memory using matrix descriptors". The
#   tf32, e4m3/e5m2 and integer forms have no transposed operands: an fp8 wgrad on Hopper would
#   need a transposing copy first. So this kernel runs in fp16 and bf16 (lesson 05's section 9
#   met the same rule from the other side: its fp8 operands are K-major already).
# - Blackwell. `tcgen05.mma` takes a 32-bit instruction descriptor whose bits 15 and 16 are
#   "Transpose A Matrix" and "Transpose B Matrix", defined for .kind::tf32, ::f16, ::f8f6f4 and
#   ::i8 (PTX ISA, tcgen05, "Instruction descriptor").
#
# The compiled kernel shows both (section 7): its WGMMAs end in `1, 1, 1, 1` (imm-scale-a,
# imm-scale-b, imm-trans-a, imm-trans-b) where lesson 05's end in `1, 1, 0, 0` (and section 2c's
# dgrad, its B read in place, in `1, 1, 0, 1`), and on sm_100 the instruction descriptor, an
# immediate that Triton moves into a register once and names in each of a k-step's four
# `tcgen05.mma`, has bits 15 and 16 set.
#
# 4. The wgrad kernel
# -------------------
# Lesson 05's design with new loads and a new store: a persistent grid, a ring of NUM_BUFFERS
# stages with ready/empty barriers (lesson 05, section 1), a one-warp loader, and the MMA and
# epilogue partitions of lesson 05's section 2: on Hopper one consumer warpgroup that issues the
# WGMMAs and stores; on Blackwell a one-warp tcgen05 issuer and an epilogue warpgroup, joined by
# lesson 05's double-buffered accumulator in tensor memory. Reused as they are: `common.Counter` and
# `allocate_barrier_pairs`, lesson 04's `HopperWGMMA`, lesson 05's `Im2colWindow.pixel_box_origin`
# (where the im2col box of output pixels p0, p0+1, ... starts in x) and `TmemAccumulators`.
# One unit of work is a tile of dW and a slice of the pixels (section 5)::
#
#     co0, tap (r, s), c0, k-steps [k_begin, k_end), split = work(unit)
#     acc = zeros(BLOCK_M, BLOCK_N)                                     # fp32
#     for k in range(k_begin, k_end):                                   # BLOCK_K pixels each
#         p0 = k * BLOCK_K;  (n, y, x) = pixel_box_origin(p0)
#         A^T = load(dy2d, [p0, co0])                                   # [BLOCK_K, BLOCK_M], M-major
#         B = im2col_load(x, [n, y, x, c0], offsets=[r*dh, s*dw])       # [BLOCK_K, BLOCK_N], N-major
#             (or B = load(x2d, [p0, c0]) where x_reads_tiled: section 3)
#         acc += A @ B                                                  # A = (A^T)^T, a view
#     if split < 0:   dW[co0:co0+BLOCK_M, tap, c0:c0+BLOCK_N] = acc    # a whole tile
#     else:           partial[split, tile - whole_tiles] = acc          # a slice (section 5), fp32
#     (both stores masked to co < Co and ci < Ci / groups)
#
# The edges take care of themselves. The last pixel block runs past the last pixel: its dY rows
# lie outside the tensor, so TMA fills them with zeros, and whatever the im2col box holds there
# is multiplied by those zeros. Channels past Ci are zeros in x (outside the tensor, or lesson
# 04's channel padding) and are masked in the store, as are rows past Co.

WgradShape = collections.namedtuple(
    "WgradShape",   # the kernel's run-time integers, by name; Im2colWindow reads Ci_group, Co_group, out_h ... pad_w
    "Co Ci_group Co_group taps S num_pid_m num_pid_n ci_blocks k_blocks split_k whole_tiles split_tiles out_h out_w "
    "stride_h stride_w pad_h pad_w dil_h dil_w")


@gluon.aggregate
class WgradRing:
    dy_bufs: gl.shared_memory_descriptor      # [NUM_BUFFERS, BLOCK_K, BLOCK_M]: pixels x output channels
    x_bufs: gl.shared_memory_descriptor       # [NUM_BUFFERS, BLOCK_K, BLOCK_N]: pixels x input channels of a tap
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    NUM_BUFFERS: gl.constexpr


@gluon.aggregate
class WgradUnit:
    co0: Int          # first output channel (row of dW)
    tap: Int          # r * S + s
    c0: Int           # first input channel (within its group: dW's column)
    k_begin: Int      # the unit's pixel blocks, BLOCK_K pixels each
    k_end: Int
    split: Int        # which slice of the pixels (section 5); -1: a tile run whole
    tile: Int         # the tile's number: tiles past whole_tiles have a place in the workspace


@gluon.jit
def wgrad_work_unit(unit, shape):
    # (tile, k_begin, k_end, split) of a unit. Units [0, whole_tiles) are tiles run
    # whole (split -1); after them come split_k slices of each of the other split_tiles tiles (section
    # 5), the units of one slice numbered together, so the programs running side by side read the
    # same pixels of dY and x (from L2). Written without branches, as lesson 05's TileSchedule.work:
    # `sliced` is 1 for a slice, 0 for a whole tile.
    sliced = unit >= shape.whole_tiles
    slice_unit = unit - shape.whole_tiles
    split = (slice_unit // shape.split_tiles + 1) * sliced - 1
    tile = unit + (shape.whole_tiles + slice_unit % shape.split_tiles - unit) * sliced
    k_begin = split * shape.k_blocks // shape.split_k * sliced
    k_end = shape.k_blocks + ((split + 1) * shape.k_blocks // shape.split_k - shape.k_blocks) * sliced
    return tile, k_begin, k_end, split


@triton.jit
def wgrad_tile_origin(tile, num_pid_m, ci_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # (co0, tap, c0) of a tile of dW; the tiles of one tap's channel block, which share an im2col box,
    # are neighbours. The kernel and section 5's sum (a plain Triton kernel) both call it.
    pid_m = tile % num_pid_m
    pid_n = tile // num_pid_m          # (tap, channel block)
    return pid_m * BLOCK_M, pid_n // ci_blocks, pid_n % ci_blocks * BLOCK_N


@gluon.jit
def tap_offsets(tap, shape):
    # the im2col offsets [r*dh, s*dw] of tap r*S + s (16-bit, as the instruction takes them)
    return [((tap // shape.S) * shape.dil_h).to(gl.int16), ((tap % shape.S) * shape.dil_w).to(gl.int16)]


@gluon.aggregate
class WgradSchedule:
    # the WgradShape's fields the partitions read, each its own field: lesson 05's kernel, with its
    # shape tuple held whole in an aggregate, hung on an H100 when Triton passed one of the tuple's
    # integers as a constant (results/notebook.md, 2026-11-25); neither kernel holds one now
    Co: Int
    Ci_group: Int     # input channels per group: Ci (groups = 1)
    taps: Int
    S: Int
    num_pid_m: Int
    num_pid_n: Int
    ci_blocks: Int
    k_blocks: Int
    split_k: Int
    whole_tiles: Int
    split_tiles: Int
    dil_h: Int
    dil_w: Int
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr

    @gluon.jit
    def num_units(self):
        return wgrad_unit_count(self.num_pid_m * self.num_pid_n, self.whole_tiles, self.split_k)

    @gluon.jit
    def work(self, unit):
        tile, k_begin, k_end, split = wgrad_work_unit(unit, self)
        co0, tap, c0 = wgrad_tile_origin(tile, self.num_pid_m, self.ci_blocks, self.BLOCK_M, self.BLOCK_N)
        return WgradUnit(co0, tap, c0, k_begin, k_end, split, tile)


@triton.jit
def wgrad_unit_count(tiles, whole_tiles, split_k):
    # whole tiles, plus split_k slices of each other tile (the kernel and the host call this one function)
    return whole_tiles + (tiles - whole_tiles) * split_k


@gluon.jit
def wgrad_loader_partition(dy_desc, x_desc, ring, schedule, window):
    # One warp: for every (unit, k-step) of this program, wait for a free stage and fill it.
    BLOCK_K: gl.constexpr = dy_desc.block_type.shape[0]
    X_TILED: gl.constexpr = len(x_desc.shape) == 2       # x as [pixels, Ci] (x_reads_tiled), else [N, H, W, Ci]
    stage_bytes: gl.constexpr = dy_desc.block_type.nbytes + x_desc.block_type.nbytes
    state = common.Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        offsets = tap_offsets(work.tap, schedule)
        # the box's first channel: c0, counted from the group's first channel if grouped (section 6)
        x_channel = window.group_channel(work.co0) + work.c0
        for k in range(work.k_begin, work.k_end):
            p0 = k * BLOCK_K
            slot = state.slot()
            mbarrier.wait(ring.empty.index(slot), state.phase() ^ 1)
            mbarrier.expect(ring.ready.index(slot), stage_bytes)
            # A^T = load(dy2d, [p0, co0])
            tma.async_load(dy_desc, [p0, work.co0], ring.ready.index(slot), ring.dy_bufs.index(slot))
            if X_TILED:
                # B = load(x2d, [p0, c0]): output pixel p reads input pixel p (x_reads_tiled)
                tma.async_load(x_desc, [p0, x_channel], ring.ready.index(slot), ring.x_bufs.index(slot))
            else:
                # a new box of pixels every k-step, so its origin every k-step (three integer divisions)
                n, y, x = window.pixel_box_origin(p0)
                # B = im2col_load(x, [n, y, x, c0], offsets=[r*dh, s*dw])
                tma.async_load_im2col(x_desc, [n, y, x, x_channel], offsets, ring.ready.index(slot),
                                      ring.x_bufs.index(slot))
            state = state.next()


@gluon.jit
def store_wgrad_tile(acc, dw_ptr, partial_ptr, shape, work):
    # In the accumulator's own register layout (as lesson 05's split-K store), for co < Co and ci < Ci
    # only. A whole tile: dW[co0:co0+BLOCK_M, tap, c0:c0+BLOCK_N] = acc in dW's dtype. A slice:
    # partial[split, tile - whole_tiles] = acc, an fp32 tile in the workspace.
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc.type.layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
    inside = gl.expand_dims(work.co0 + rows < shape.Co, 1) & gl.expand_dims(work.c0 + cols < shape.Ci_group, 0)
    if work.split < 0:
        row_starts = (work.co0 + rows).to(gl.int64) * (shape.taps * shape.Ci_group)
        offsets = gl.expand_dims(row_starts, 1) + gl.expand_dims(work.tap * shape.Ci_group + work.c0 + cols, 0)
        gl.store(dw_ptr + offsets, acc.to(dw_ptr.dtype.element_ty), mask=inside)
    else:
        tile_start = (work.split * shape.split_tiles + work.tile - shape.whole_tiles).to(gl.int64) * (BLOCK_M * BLOCK_N)
        offsets = tile_start + gl.expand_dims(rows * BLOCK_N, 1) + gl.expand_dims(cols, 0)
        gl.store(partial_ptr + offsets, acc, mask=inside)


@gluon.jit
def wgrad_hopper_partition(ring, schedule, dw_ptr, partial_ptr):
    # Hopper: MMAs and the store in one warpgroup (lesson 05's consumer, one tile at a time). Every
    # unit has at least one k-step (the host keeps split_k <= k_blocks).
    BLOCK_M: gl.constexpr = ring.dy_bufs.shape[2]
    BLOCK_N: gl.constexpr = ring.x_bufs.shape[2]
    state = common.Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        mma = lesson04.HopperWGMMA.initialize(ring.x_bufs.dtype, BLOCK_M, BLOCK_N, gl.num_warps())
        for k in range(work.k_begin, work.k_end):
            slot = state.slot()
            mbarrier.wait(ring.ready.index(slot), state.phase())
            # acc += A @ B: A the dY tile read transposed (M-major), B the im2col tile as it lies (N-major)
            mma = mma.issue_async_mma(ring.dy_bufs.index(slot).permute((1, 0)), ring.x_bufs.index(slot))
            mma = mma.wait_num_outstanding(1)            # the previous step's MMA is done: free its stage
            mbarrier.arrive(ring.empty.index(state.previous_slot()), pred=k > work.k_begin)
            state = state.next()
        mma = mma.wait_num_outstanding(0)
        mbarrier.arrive(ring.empty.index(state.previous_slot()))
        acc, mma = mma.take_result()
        store_wgrad_tile(acc, dw_ptr, partial_ptr, schedule, work)


@gluon.jit
def wgrad_blackwell_mma_partition(ring, schedule, acc):
    # Blackwell: one warp issues tcgen05 MMAs into a TMEM accumulator (lesson 05's MMA partition).
    state = common.Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    acc_state = common.Counter(gl.to_tensor(0), acc.NUM_ACC)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        buf = acc_state.slot()
        mbarrier.wait(acc.empty.index(buf), acc_state.phase() ^ 1)
        for k in range(work.k_begin, work.k_end):
            slot = state.slot()
            mbarrier.wait(ring.ready.index(slot), state.phase())
            # acc += A @ B, A and B as on Hopper: the transposes go into the instruction descriptor
            tcgen05_mma(ring.dy_bufs.index(slot).permute((1, 0)), ring.x_bufs.index(slot), acc.tmem.index(buf),
                        use_acc=k > work.k_begin)
            tcgen05_commit(ring.empty.index(slot))      # the stage is free once these MMAs are done
            state = state.next()
        tcgen05_commit(acc.ready.index(buf))
        acc_state = acc_state.next()


@gluon.jit
def wgrad_blackwell_epilogue_partition(schedule, acc, dw_ptr, partial_ptr):
    acc_state = common.Counter(gl.to_tensor(0), acc.NUM_ACC)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        buf = acc_state.slot()
        mbarrier.wait(acc.ready.index(buf), acc_state.phase())
        tile = acc.tmem.index(buf).load()            # TMEM -> registers
        mbarrier.arrive(acc.empty.index(buf))
        store_wgrad_tile(tile, dw_ptr, partial_ptr, schedule, work)
        acc_state = acc_state.next()


@gluon.jit
def conv2d_wgrad_kernel(dy_desc, x_desc, dw_ptr, partial_ptr, shape, NUM_BUFFERS: gl.constexpr,
                        IS_BLACKWELL: gl.constexpr):
    dtype: gl.constexpr = x_desc.dtype
    BLOCK_K: gl.constexpr = dy_desc.block_type.shape[0]     # pixels per k-step
    BLOCK_M: gl.constexpr = dy_desc.block_type.shape[1]     # output channels per tile
    BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]      # input channels per tile
    dy_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_K, BLOCK_M], dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_K, BLOCK_N], x_desc.layout)
    ready, empty = common.allocate_barrier_pairs(NUM_BUFFERS)
    ring = WgradRing(dy_bufs, x_bufs, ready, empty, NUM_BUFFERS)
    (Co, Ci_group, Co_group, taps, S, num_pid_m, num_pid_n, ci_blocks, k_blocks, split_k, whole_tiles, split_tiles,
     out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w) = shape
    schedule = WgradSchedule(Co, Ci_group, taps, S, num_pid_m, num_pid_n, ci_blocks, k_blocks, split_k, whole_tiles,
                             split_tiles, dil_h, dil_w, BLOCK_M, BLOCK_N)
    # lesson 05's window: its pixel_box_origin, and (grouped convs) its group_channel
    window = lesson05.Im2colWindow(out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, Ci_group, Co_group, S,
                                   ci_blocks)
    if IS_BLACKWELL:
        NUM_ACC: gl.constexpr = 2
        acc_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N],
                                          TensorMemoryLayout([BLOCK_M, BLOCK_N], col_stride=1))
        acc_ready, acc_empty = common.allocate_barrier_pairs(NUM_ACC)
        acc = lesson05.TmemAccumulators(acc_tmem, acc_tmem, acc_ready, acc_empty, NUM_ACC)   # (no tail)
        gl.warp_specialize([
            (wgrad_blackwell_epilogue_partition, (schedule, acc, dw_ptr, partial_ptr)),
            (wgrad_blackwell_mma_partition, (ring, schedule, acc)),
            (wgrad_loader_partition, (dy_desc, x_desc, ring, schedule, window)),
        ], [1, 1], [24, 24])
    else:
        gl.warp_specialize([
            (wgrad_hopper_partition, (ring, schedule, dw_ptr, partial_ptr)),
            (wgrad_loader_partition, (dy_desc, x_desc, ring, schedule, window)),
        ], [1], [24])


# %%
# 5. Split-K, and a sum that gives the same bits on every run
# -----------------------------------------------------------
# wgrad's tiles are few and its K is long. ResNet-50's 3x3 64->64 convs at batch 128 have
# 1 x 9 x 1 = 9 tiles of 64 x 64 (BLOCK_N 64 for 64 channels) for an H100's 132 SMs, each summing
# 128 x 56 x 56 = 401,408 pixels: without a split, 123 SMs would idle. So the pixels of a tile are
# cut into split_k slices, each slice a unit of work; a slice writes its fp32 partial sum to a
# workspace of the split tiles, partial[split, tile - whole_tiles] (BLOCK_M x BLOCK_N each, the
# part inside Co x Ci written), instead of dW, and a second kernel adds the slices, casts, and
# stores the tile into dW.
#
# Which tiles to split is lesson 05's rule (its section 7): with P programs, the tiles of the full
# waves run whole, store straight into dW and need no workspace; only the r tiles past them are
# split (all of them, with fewer tiles than SMs). Splitting every tile instead costs on both sides
# when there are more tiles than SMs: ResNet-50's 7x7 512->512 3x3 has 144 tiles of 128 x 128 for
# 132 SMs and 98 k-steps per tile; cut into 3 slices each, its 432 units ran as 4 waves of 33
# k-steps (the last a third full) and wrote and read back 3 x 9 MiB of fp32 partials. Now 132 tiles
# run whole (98 k-steps) and the other 12 are cut into 7 slices of 14 k-steps, one more short wave,
# whose workspace is 84 partial tiles of 64 KiB.
#
# How many slices (`choose_split`): an estimate of the time, in the time of one SM's k-step, for s
# slices: w * K for the w full waves of whole tiles, ceil(r * s / P) * ceil(K / s) for the slices'
# waves, and for the workspace (none when s = 1) r * s partial tiles at `workspace_k_steps` each: a
# partial tile's 8 bytes per element through HBM against a k-step's 2 * block_k FLOPs per element,
# about 6 / block_k of a k-step at an H100's figures. It tries s from 1 to 64 and keeps the least
# estimate, or within 2% of it the fewest partial tiles. So a long K is cut finely and a short one
# little or not at all: ResNet-50's 3x3 64->64 convs above get 14 slices of 224 k-steps (of 128
# pixels: section 6); 9 tiles of 4 k-steps get 2 slices, 200 tiles of 4 k-steps none.
#
# The estimate is arithmetic on the shape, its constants an H100's. Timed on H100s
# (results/notebook.md, 2026-11-26):
#
# - ResNet-50's 21 layers with fewer tiles than SMs: none of ten other split counts beat an
#   earlier rule's choice (within two slices of this one's) by more than 4%.
# - Its two layers with more tiles than SMs: a wave of whole tiles took the 7x7 and 14x14
#   512-channel 3x3 layers from 0.72-0.73x cuDNN's speed to 0.95-0.97x (two runs)
#   (`benchmarks/backward_layers.py --operator --cuda-graphs`, RESULTS.md).
# - Why the estimate, and not just "as many slices as fill one more wave": that rule leaves r
#   tiles whole when r is over half the SMs (two slices each would need two waves). A Stable
#   Diffusion UNet's 64x64 960->320 3x3 at batch 8 (216 tiles of 512 k-steps) then ran a second
#   wave of 84 whole tiles with 48 SMs idle: 568 us, where every tile in slices had taken 432 us.
#   The estimate cuts the 84 in 3 (two short waves): 402 us (cuDNN: 317-319 us; three runs).
#
# The second kernel adds partial[0] + partial[1] + ... in that order, for every element of a split
# tile. Floating-point addition is not associative, so the order is what makes the result
# reproducible: summing with atomics would add the slices in whatever order they finish, and could
# give other bits on the next run. Here each element's sum is fixed by the shapes and the GPU's SM
# count (which sets the split): the k-steps of a slice in order, the slices in order. On one GPU,
# dW is the same on every run.


@triton.jit
def wgrad_split_k_sum_kernel(partial_ptr, dw_ptr, Co, Ci_group, taps, num_pid_m, ci_blocks, whole_tiles, split_tiles,
                             split_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    # Split tile whole_tiles + program_id(0) of dW: partial[0] + partial[1] + ... + partial[split_k - 1]
    # of that tile, in that order, cast to dW's dtype and stored where the tile lies (co < Co, ci < Ci)
    index = tl.program_id(0)
    co0, tap, c0 = wgrad_tile_origin(whole_tiles + index, num_pid_m, ci_blocks, BLOCK_M, BLOCK_N)
    elements = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)          # of the tile, row by row
    rows, cols = co0 + elements // BLOCK_N, c0 + elements % BLOCK_N
    inside = (rows < Co) & (cols < Ci_group)         # the parts of the tile the slices wrote
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(split_k):
        offsets = (split * split_tiles + index).to(tl.int64) * (BLOCK_M * BLOCK_N) + elements
        acc += tl.load(partial_ptr + offsets, mask=inside, other=0.0)
    offsets = rows.to(tl.int64) * (taps * Ci_group) + tap * Ci_group + cols
    tl.store(dw_ptr + offsets, acc.to(dw_ptr.dtype.element_ty), mask=inside)


def sum_partials(launch, dw):
    """dW's split tiles, in dw [Co, R*S*Ci], from the workspace [split_k, split tiles, BLOCK_M, BLOCK_N]
    (the interpreter on a CPU); the whole tiles' parts of dw are left as they are."""
    grid, args, constexprs = sum_partials_launch(launch, dw)
    wgrad_split_k_sum_kernel[grid](*args, **constexprs)
    return dw


def test_split_k_sum_adds_the_slices_in_order():
    """Bit for bit: each split tile of dW is ((p0 + p1) + p2) + p3, rounded once, at the tile's place;
    the whole tiles' parts of dW are left alone."""
    x, _, dy, g = backward_inputs(2, 6, 7, 12, 20, 3, 2, 1, 1, 1, torch.float32, device_name="cpu")
    # 24 tiles of 16 x 8 on 5 programs: 20 run whole, 4 are split in 4 slices
    launch = prepare_wgrad(x, dy, g, WgradConfig(16, 8, 8, num_buffers=2, split_k=4, programs=5), "sm_90", 132)
    s = launch.shape
    assert (s.whole_tiles, s.split_tiles, launch.partial.shape[:2]) == (20, 4, (4, 4))
    partial = torch.randn(launch.partial.shape, generator=torch.Generator().manual_seed(0)) * 100
    launch = launch._replace(partial=partial.to(common.device()))
    in_order = ((partial[0] + partial[1]) + partial[2]) + partial[3]          # [split tiles, 16, 8]
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.full((g.Co, s.taps, g.Ci_group), -7.0)
        for index in range(s.split_tiles):
            co0, tap, c0 = wgrad_tile_origin.fn(s.whole_tiles + index, s.num_pid_m, s.ci_blocks, 16, 8)
            rows, cols = min(16, g.Co - co0), min(8, g.Ci_group - c0)
            expected[co0:co0 + rows, tap, c0:c0 + cols] = in_order[index, :rows, :cols]
        dw = sum_partials(launch, torch.full((g.Co, s.taps * g.Ci_group), -7.0, dtype=dtype, device=common.device()))
        dw, expected = dw.cpu().view(expected.shape), expected.to(dtype)
        if dtype == torch.bfloat16 and common.interpreter_mode():
            # Triton 3.9's interpreter casts fp32 to bf16 towards zero (checked: 231.6 -> 231), the GPU to
            # the nearest value (cvt.rn): on a CPU the cast may land one bf16 step (2^-7 relative) lower
            torch.testing.assert_close(dw, expected, rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(dw, expected)


# %%
# 6. The wgrad launcher
# ---------------------
# A config fixes the tile (BLOCK_M output channels x BLOCK_N input channels x BLOCK_K pixels), the
# ring's depth and the warps of the MMA/epilogue partition; `wgrad_config` picks 64-row tiles for
# 64 output channels or fewer (else 128), and a channel block of the padded Ci rounded up to a
# power of two, 16 to 128 wide (the stem's 3 channels, padded to 8, would get a 16-channel box;
# the end of this section folds its stride into the channels first). A tile of 128 x 64 or fewer
# elements takes 128 pixels per k-step instead of 64: its MMA per k-step is small next to the
# k-step's fixed costs (two barrier waits, two TMA issues, the box origin's three divisions).
# `default_wgrad_config` then trades rows for tiles where a wave would sit mostly idle: where
# 128-row tiles fill at most half the SMs (every tile split: a workspace, a second kernel) and
# 64-row tiles fill three quarters of them or more, whole, it takes the 64-row tiles; and where x is
# read tiled (a 1x1 conv at stride 1, section 3) and the 64-row tiles' slices fit one wave, it takes
# them too: each program writes a partial tile half the size, so the workspace and the second
# kernel's reads halve, while a k-step keeps its 128 x 128 x 64 multiply-adds. Each rule was tuned on
# layers that are not ResNet-50's and then measured on ResNet-50's (results/notebook.md, "wgrad's
# tile rules", has the timings; RESULTS.md, "The operator's gradients", the result). The rules live
# in the operator (conv_tutorial/kernels/wgrad.py), which this lesson imports.
# `prepare_wgrad` builds what a launch needs (on CPU tensors too: the ahead-of-time compile and the
# CPU model use it): x with its channels padded to 16 bytes (lesson 04) and its im2col descriptor
# (or, where `x_reads_tiled`, x as [pixels, Ci] and a tiled descriptor), dY as a 2-D [pixels, Co]
# tensor and its tiled descriptor (Co padded the same way where needed),
# the split (section 5), the workspace of the split tiles and the persistent grid.
#
# Grouped convs (lesson 05, section 10) take one line more in the kernel. Group k's filters read only x's
# channels k*Ci/groups ... (k+1)*Ci/groups - 1, so dW is groups small wgrads side by side: rows
# co of dW (a tile's M) belong to group co // (Co/groups), and a tile's im2col boxes start at that
# group's first channel, `group_channel(co0)` of lesson 05's window, plus the tile's own c0. A tile
# must not straddle two groups, so Co/groups must be a multiple of the tile's 64 or 128 rows. We
# also ask Ci/groups to be a multiple of 8, so that every box starts on a 16-byte channel boundary:
# a choice, not a TMA rule we know of (TMA's documented alignment concerns the tensor's address,
# its strides and the box's size; the start coordinate may be any integer, negative at a padded
# edge), and the GPU runs so far had only such groups. A channel block wider than Ci/groups reads
# the next group's first channels, which the store masks. dgrad needs no new kernel:
# swapping the channel axes within each group (section 2's `dgrad_by_phases`) makes each phase a
# grouped conv of dY, Co/groups channels in and Ci/groups out, which lesson 05's kernel runs where
# its tiles keep to one group. `backward_groups_reason` says which grouped convs each launcher
# takes; RegNetY-3.2GF's groups of 24 channels fit neither.


def conv2d_wgrad_launch(x_nhwc, dy_nhwc, w_shape, stride=1, padding=0, dilation=1, groups=1, config=None):
    """dW [Co, R, S, Ci] (w_shape) of a conv of x [N, H, W, Ci] from dY [N, out_h, out_w, Co] (fp16
    or bf16, contiguous NHWC, on a Hopper or Blackwell GPU), in x's dtype: the wgrad kernel, then the
    ordered sum of its slices. groups > 1 where backward_groups_reason allows it (w_shape [Co, R, S,
    Ci / groups]); `config` a WgradConfig (default: wgrad_config's), of
    the conv the kernel runs (wgrad_problem: the conv, or folded where it has few channels)."""
    g = check_backward_call({"x_nhwc": x_nhwc, "dy_nhwc": dy_nhwc}, getattr(x_nhwc, "shape", None), w_shape,
                            stride, padding, dilation, groups)
    arch, num_sms = common.tma_mma_arch_and_sms("conv2d_wgrad_launch")
    problem = wgrad_problem(g, x_nhwc.element_size())   # few channels: the conv folded (end of this section)
    g_run = problem.geometry
    launch = prepare_wgrad(wgrad_input(x_nhwc, problem), dy_nhwc, g_run, config, arch, num_sms)
    check_wgrad_config(launch.config, arch)
    dw = torch.empty(g_run.Co, g_run.R * g_run.S * g_run.Ci_group, device=x_nhwc.device, dtype=x_nhwc.dtype)
    conv2d_wgrad_kernel[launch.grid](*launch.kernel_args(dw), **wgrad_kernel_options(launch.config, arch))
    if launch.partial is not None:
        sum_partials(launch, dw)
    return wgrad_result(dw.view(g_run.Co, g_run.R, g_run.S, g_run.Ci_group), g, problem)


def run_split_k_choices(num_sms=132, batch=128):
    """The split each ResNet-50 3x3 layer gets on an H100's 132 SMs (host arithmetic only)."""
    print(f"\nwgrad's slices per tile on {num_sms} SMs (ResNet-50's 3x3 convs, batch {batch}):")
    for label, N, H, W, Ci, Co, R, S, stride, padding in common.RESNET50_3X3_SHAPES:
        g = common.conv_geometry((batch, H, W, Ci), (Co, R, S, Ci), stride, padding)
        config = default_wgrad_config(g, Ci, num_sms)
        _, _, tiles, k_blocks = wgrad_tiles(g, config)
        split_k = choose_split(tiles, k_blocks, num_sms, config.block_k)
        _, whole, split_tiles = wgrad_split(tiles, split_k, num_sms)
        tile = f"{config.block_m}x{config.block_n},"
        print(f"   {label[5:]:<18} {tiles:3d} tiles {tile:<8} {k_blocks:4d} k-steps of {config.block_k}: "
              f"{whole:3d} whole, {split_tiles:2d} in {split_k:2d} slices, "
              f"{wgrad_unit_count.fn(tiles, whole, split_k):3d} units, "
              f"{split_k * split_tiles * config.block_m * config.block_n * 4 / 2**20:4.1f} MiB")


def test_negative_programs_or_slices_are_refused():
    x, _, dy, g = backward_inputs(1, 6, 6, 8, 16, 3, 3, 1, 1, 1, torch.float32, device_name="cpu")
    for bad in (dict(programs=-1), dict(split_k=-2)):
        with pytest.raises(ValueError, match="programs and split_k must be >= 0"):
            prepare_wgrad(x, dy, g, WgradConfig(16, 8, 8, **bad), "sm_90", 132)


@pytest.mark.parametrize("N, H, Ci, Co, R, stride, block_m", [
    (128, 7, 512, 2048, 1, 1, 64),     # 64 tiles of 128 rows, split in 2; 128 of 64 rows: 97% of a wave, whole
    (128, 7, 2048, 512, 1, 1, 64),
    (128, 8, 2048, 448, 1, 1, 64),     # 64 -> 112 tiles (85%)
    (128, 8, 2048, 384, 1, 1, 64),     # 48 -> 96 tiles (73%): x read tiled, the 96 whole in one wave
    (128, 17, 192, 320, 3, 2, 128),    # 54 -> 90 tiles (68%), x through im2col: 128-row tiles
    (128, 14, 1024, 256, 1, 1, 64),    # 16 tiles in 8 slices -> 32 in 4: 128 units, one wave
    (128, 56, 256, 256, 1, 1, 64),     # 4 tiles in 33 slices -> 8 in 16
    (128, 7, 1024, 2048, 1, 1, 128),   # 128 tiles whole; 64-row tiles would need two waves
    (128, 14, 1024, 2048, 1, 2, 128),  # 128 tiles already: a wave whole
    (128, 56, 64, 64, 3, 1, 64),       # 64 output channels: 64 rows anyway
    (128, 56, 64, 256, 1, 1, 128),     # 128 x 64 tiles (64 channels): already 128-pixel k-steps
])
def test_64_row_tiles_where_they_fill_a_wave(N, H, Ci, Co, R, stride, block_m):
    g = common.conv_geometry((N, H, H, Ci), (Co, R, R, Ci), stride, R // 2)
    config = default_wgrad_config(g, Ci, 132)
    assert config.block_m == block_m and config.num_buffers == 4
    check_wgrad_config(config, "sm_90")
    check_wgrad_config(config, "sm_100")


@pytest.mark.parametrize("R, stride, padding, tiled", [(1, 1, 0, True), (1, 2, 0, False), (1, 1, 1, False),
                                                      (3, 1, 1, False), ((1, 3), 1, 0, False)])
def test_x_read_tiled_only_where_pixel_p_reads_pixel_p(R, stride, padding, tiled):
    R, S = (R, R) if isinstance(R, int) else R
    x, _, dy, g = backward_inputs(2, 6, 5, 16, 8, R, S, stride, padding, 1, torch.float32, device_name="cpu")
    assert x_reads_tiled(g) == tiled
    launch = prepare_wgrad(x, dy, g, WgradConfig(16, 16, 8, num_buffers=2), "sm_90", 132)
    assert (type(launch.x_desc).__name__ == "TensorDescriptor") == tiled


def test_split_choices():
    assert choose_split(9, 3136, 132, block_k=128) == 14   # 126 units: one wave, 95% of the SMs
    assert wgrad_split(9, 14, 132) == (126, 0, 9)           # every tile split
    assert choose_split(4, 1, 132) == 1                     # one k-step: nothing to split
    assert choose_split(144, 98, 132) == 7                  # a wave of whole tiles, then 12 in 7 slices
    assert wgrad_split(144, 7, 132) == (132, 132, 12)
    assert choose_split(264, 1000, 132) == 1                # two full waves already
    assert wgrad_split(264, 1, 132) == (132, 264, 0)
    assert choose_split(216, 512, 132) == 3                 # 84 tiles past the wave: 3 slices each, two short waves
    assert choose_split(200, 4, 132) == 1                   # 4 k-steps: nothing to gain


# %%
if __name__ == "__main__":
    run_split_k_choices()

# %%
# What you should see (host arithmetic, the same on any machine)::
#
#     wgrad's slices per tile on 132 SMs (ResNet-50's 3x3 convs, batch 128):
#        56x56 64->64 3x3     9 tiles 64x64,   3136 k-steps of 128:   0 whole,  9 in 14 slices, 126 units,  2.0 MiB
#        28x28 128->128 3x3   9 tiles 128x128, 1568 k-steps of 64:   0 whole,  9 in 14 slices, 126 units,  7.9 MiB
#        14x14 256->256 3x3  36 tiles 128x128,  392 k-steps of 64:   0 whole, 36 in  7 slices, 252 units, 15.8 MiB
#        7x7 512->512 3x3   144 tiles 128x128,   98 k-steps of 64: 132 whole, 12 in  7 slices, 216 units,  5.2 MiB
#
# The 7x7 layer is the one with more tiles than SMs: a wave of whole tiles, then one short wave of
# the 12 left over in slices, where cutting every tile in 3 had made 432 units (4 waves, the last a
# third full) and 27 MiB of workspace.

# %%
# The kernel, run on a CPU
# ------------------------
# No CPU runs a Gluon kernel, but its index arithmetic is plain integer Python: `run_wgrad_model`
# calls the kernel's own `wgrad_work_unit`, `wgrad_tile_origin`, `tap_offsets` and lesson 05's
# `pixel_box_origin` (as lesson 05's tests do, through `.fn`, on `common.PlainInt` values), and
# feeds what they compute to lesson 03's model of the TMA im2col load and to a model of the tiled
# load (a slice of dY, or of x where it is read tiled; zeros outside). Unit by unit, k-step by
# k-step, with the launcher's own descriptor settings and split, it computes acc += A @ B, stores
# a whole tile into dW and a slice into the workspace (masked as the kernel's `store_wgrad_tile`
# masks, its offsets written again in torch), and adds the slices with section 5's kernel:
# torch's conv2d_weight must come out. Its default runs on 5 programs, so that some tiles run
# whole and some in slices.
#
# Beside it, the mapping in a few lines of torch (`wgrad_reference`): im2col(x) built explicitly
# with `unfold`, dY^T @ im2col(x) over slices of the pixels, the partial products added in order.


def wgrad_reference(x_nhwc, dy_nhwc, geometry, split_k=1):
    """dW [Co, R, S, Ci / groups] = dY^T @ im2col(x) (group by group), the pixels in split_k slices,
    partials added in order."""
    g, G = geometry, geometry.groups
    columns = torch.nn.functional.unfold(x_nhwc[..., :g.Ci].permute(0, 3, 1, 2).float(), (g.R, g.S), g.dilation,
                                         g.padding, g.stride)               # [N, Ci*R*S, out_h*out_w], (ci, r, s)
    columns = columns.view(g.N, g.Ci, g.R * g.S, -1).permute(0, 3, 2, 1)   # [N, pixels, (r, s), ci]
    columns = columns.reshape(g.M, g.R * g.S, G, g.Ci_group)               # [pixels, (r, s), group, ci]
    dy_2d = dy_nhwc.reshape(g.M, G, g.Co_group).float()                    # [pixels, group, co]
    bounds = [split * g.M // split_k for split in range(split_k + 1)]
    partials = [torch.einsum("pkc,ptki->kcti", dy_2d[a:b], columns[a:b]) for a, b in zip(bounds, bounds[1:])]
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total.reshape(g.Co, g.R, g.S, g.Ci_group)


def run_wgrad_model(N=2, H=6, W=7, Ci=12, Co=20, R=3, S=2, stride=1, padding=1, dilation=1, config=None,
                    show=True, groups=1):
    im2col_reference = common.load_lesson("03-tma-im2col-modes").im2col_reference
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.float32, device_name="cpu",
                                  groups=groups)
    x, dy = x.round(), dy.round()          # small integers: every sum below is exact, in any order
    # (24 tiles of 16 x 8 on 5 programs: 20 run whole, 4 in 3 slices)
    config = config or WgradConfig(block_m=16, block_n=8, block_k=8, num_buffers=2, split_k=3, programs=5)
    launch = prepare_wgrad(x, dy, g, config, "sm_90", num_sms=132)
    shape, (BM, BN, BK) = launch.shape, launch.config[:3]
    x_padded, dy_2d = wgrad_operands(x, dy, g)
    corners = (launch.settings.pixel_box_lower_corner, launch.settings.pixel_box_upper_corner,
               launch.settings.element_strides)
    dw = torch.full((g.Co, shape.taps, g.Ci_group), float("nan"))
    partial = None if launch.partial is None else torch.full_like(launch.partial, float("nan"))
    P = common.PlainInt
    units = wgrad_unit_count.fn(shape.num_pid_m * shape.num_pid_n, shape.whole_tiles, shape.split_k)
    for unit in range(units):
        tile, k_begin, k_end, split = wgrad_work_unit.fn(P(unit), shape)
        co0, tap, c0 = wgrad_tile_origin.fn(tile, shape.num_pid_m, shape.ci_blocks, BM, BN)
        offsets = tap_offsets.fn(P(tap), shape)
        acc = torch.zeros(BM, BN)
        for k in range(k_begin, k_end):
            n, y, x0 = lesson05.Im2colWindow.pixel_box_origin.fn(shape, P(k * BK))
            a_t = torch.zeros(BK, BM)                         # the tiled load: zeros outside dY
            box = dy_2d[k * BK:(k + 1) * BK, co0:co0 + BM]
            a_t[:box.shape[0], :box.shape[1]] = box
            x_channel = lesson05.Im2colWindow.group_channel.fn(shape, P(co0)) + c0    # the loader's
            if x_padded.dim() == 2:                           # x_reads_tiled: the tiled load, zeros outside x
                b = torch.zeros(BK, BN)
                box = x_padded[k * BK:(k + 1) * BK, x_channel:x_channel + BN]
                b[:box.shape[0], :box.shape[1]] = box
            else:
                b, _ = im2col_reference(x_padded, BK, BN, *corners, [n, y, x0, x_channel], offsets)
            acc += a_t.T @ b
        rows, channels = min(BM, g.Co - co0), min(BN, g.Ci_group - c0)       # the store's mask
        if split < 0:                                         # a whole tile: into dW
            dw[co0:co0 + rows, tap, c0:c0 + channels] = acc[:rows, :channels]
        else:                                                 # a slice: to the workspace
            partial[split, tile - shape.whole_tiles, :rows, :channels] = acc[:rows, :channels]
    if partial is not None:           # (the sum reads only what the slices wrote: the NaNs elsewhere stay unread)
        launch = launch._replace(partial=partial.to(common.device()))
        dw = sum_partials(launch, dw.view(g.Co, -1).to(common.device())).cpu()
    dw = dw.view(w.shape)
    assert not dw.isnan().any(), "some element of dW was never written"
    _, expected = reference_gradients(x, w, dy, g)
    if show:
        print(f"\nwgrad of {g.describe()}, the kernel's arithmetic on lesson 03's TMA model: {shape.num_pid_m} x "
              f"{shape.num_pid_n} tiles of {BM}x{BN}, {shape.k_blocks} k-steps of {BK} pixels; on "
              f"{launch.grid[0]} programs {shape.whole_tiles} tiles run whole and the rest in {shape.split_k} "
              f"slices; largest difference from torch.nn.grad.conv2d_weight: {(dw - expected).abs().max().item():.1e}")
    torch.testing.assert_close(dw.cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(wgrad_reference(x, dy, g, split_k=4), expected, rtol=0, atol=0)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, config", [
    (2, 6, 7, 12, 20, 3, 2, 1, 1, 1, None),        # Ci and Co not multiples of the tile, boxes across images
    (1, 9, 8, 3, 16, 3, 3, 2, 1, 1, None),         # Ci = 3, padded to 4 (fp32); stride 2
    (2, 7, 6, 8, 8, 3, 3, 1, 2, 2, None),          # dilation 2, padding 2
    (2, 5, 9, 16, 12, 1, 3, (2, 1), (0, 1), 1, None),   # different strides, a 1x3 filter
    (2, 5, 7, 12, 20, 1, 1, 1, 0, 1, None),        # 1x1 at stride 1: x read tiled (x_reads_tiled)
    (2, 5, 7, 12, 20, 1, 1, 1, 0, 1, WgradConfig(16, 8, 8, num_buffers=2, split_k=1)),   # ... every tile whole
    (2, 9, 9, 20, 72, 3, 3, 1, 1, 1, WgradConfig(64, 16, 32, split_k=2)),   # a GPU's tile sizes, Co = 72; every
                                                                             # tile split (fewer tiles than programs)
    (2, 6, 7, 12, 20, 3, 2, 1, 1, 1, WgradConfig(16, 8, 8, num_buffers=2, split_k=1)),   # every tile whole
    (1, 6, 5, 12, 20, 3, 3, 1, 1, 1, WgradConfig(16, 8, 8, num_buffers=2, split_k=4, programs=7)),   # 36 tiles: 35
])                                                                                       # whole, 1 in 4 slices
def test_wgrad_kernel_arithmetic_on_the_tma_model(N, H, W, Ci, Co, R, S, stride, padding, dilation, config):
    run_wgrad_model(N, H, W, Ci, Co, R, S, stride, padding, dilation, config, show=False)


@pytest.mark.parametrize("Ci, Co, groups, config", [
    (16, 32, 2, WgradConfig(16, 8, 8, num_buffers=2, split_k=3, programs=5)),   # 8 -> 16 channels per group: one
                                                                                 # row tile each; whole and split
    (24, 64, 4, WgradConfig(16, 8, 8, num_buffers=2, split_k=2)),    # 6 per group: a box reads 2 of the next group's
                                                                     # channels, which the store masks
    (32, 64, 2, WgradConfig(16, 8, 8, num_buffers=2, split_k=2)),    # 16 -> 32 per group: two row tiles and two
])                                                                   # channel blocks in each group
def test_wgrad_kernel_arithmetic_on_grouped_convs(Ci, Co, groups, config):
    run_wgrad_model(2, 6, 7, Ci, Co, 3, 3, 2, 1, 1, config, show=False, groups=groups)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, split_k", [
    (2, 8, 8, 3, 16, 7, 7, 2, 3, 1, 1),                 # a stem
    (3, 9, 7, 6, 5, 3, 3, 2, 1, 1, 5),                  # stride 2, slices of uneven length
    (2, 10, 11, 4, 6, 3, 5, (1, 2), (2, 0), (2, 1), 3),  # per-axis stride, padding, dilation
    (1, 6, 6, 7, 9, 1, 1, 2, 0, 1, 2),                  # 1x1 stride 2
    (2, 7, 8, 5, 4, 4, 4, 3, 2, 1, 4),                  # stride 3, an even filter
    (1, 12, 12, 2, 3, 3, 3, 1, 4, 3, 2),                # dilation 3, padding 4
])
def test_wgrad_reference_matches_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation, split_k):
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.float32, device_name="cpu")
    torch.testing.assert_close(wgrad_reference(x, dy, g, split_k), reference_gradients(x, w, dy, g)[1],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("Ci, Co, groups, stride, split_k", [(6, 9, 3, 1, 1), (8, 12, 4, 2, 3), (12, 8, 2, (1, 2), 2)])
def test_grouped_wgrad_reference_matches_torch(Ci, Co, groups, stride, split_k):
    x, w, dy, g = backward_inputs(2, 9, 8, Ci, Co, 3, 3, stride, 1, 1, torch.float32, device_name="cpu", groups=groups)
    torch.testing.assert_close(wgrad_reference(x, dy, g, split_k), reference_gradients(x, w, dy, g)[1],
                               rtol=1e-4, atol=1e-4)


# %%
if __name__ == "__main__":
    run_wgrad_model()

# %%
# What you should see: a difference of exactly 0 (small integers: every sum is exact, so the
# order of summation cannot show).

# %%
# Few input channels at a stride: the stride folded into the channels
# ---------------------------------------------------------------------
# One layer of ResNet-50 fits these tiles badly: the stem, 7x7 at stride 2 on 3 channels. A
# pixel's channels must span a multiple of 16 bytes for TMA, so 3 bf16 channels travel as 8, and
# a wgrad tile holds 16 of them (the smallest `block_n`, its "channel box"): 49 taps x 16 channels
# for 49 x 3 useful columns of dW, and dY read once per tap. dgrad fares no better: its phases
# (section 2) run 49 taps in four launches, whose convs write 3 channels in tiles 64 columns wide
# (`dgrad_config`): 3 of 64 columns do useful work.
#
# A stride s can be folded into the channels ("space-to-depth"). Pad x by ph rows above and cut
# the rows into groups of s, stacking each group's s rows as channels: row I of the folded input
# holds padded rows s*I ... s*I + s - 1. Then, along one axis, with tap r = s*a + b::
#
#     y[oy] = sum over r of w[r] * x_padded[s*oy + r]
#           = sum over a, b of w[s*a + b] * x_padded[s*(oy + a) + b]  =  sum over a of w'[a] . x'[oy + a]
#
# a stride-1 conv without padding, of R' = ceil(R/s) taps, on s*Ci channels (taps past R get
# weight 0). Its output rows oy = 0 ... out_h - 1 read folded rows up to out_h + R' - 2, so the
# folded input has H' = out_h + R' - 1 rows: s*H' padded rows, ph above x and s*H' - H - ph below
# (a negative count cuts x's last rows, which no output reads). Folded along both axes, the stem
# becomes a 4x4 conv on 2*2*3 = 12 channels: 16 taps of one 16-channel box where there were 49.
# The fold only re-indexes x and adds zeros, so the gradients are the folded conv's, re-indexed
# back: dW' to [Co, R, S, Ci] (dropping the zero taps), dX' to rows and columns (dropping the
# padding's rows; rows the cut removed get 0). Both launchers fold where it at least halves
# `folded_cost`, the columns of MMA work a wgrad tile spends per output channel (taps x the
# channel box): the fold itself costs copies of x (wgrad) and of dX' (dgrad), so a small saving
# is not worth it. The rule is wgrad's; dgrad, whose tiles are wider (64 columns), would gain from
# more folds than it takes (a 7x7 stride-2 conv on 16 channels: 49 -> 16 taps), not measured
# here. ResNet-50 folds its stem only. Dilation stays unfolded: a dilated tap's rows are not
# neighbours.


def run_stride_fold(show=True):
    """The stem's gradients through the fold, on a CPU against torch.nn.grad (fp32)."""
    x, w, dy, g = backward_inputs(2, 20, 18, 3, 8, 7, 7, 2, 3, 1, torch.float32, device_name="cpu")
    fold = stride_fold(g, element_size=2)
    expected_dx, expected_dw = reference_gradients(x, w, dy, g)
    dw = unfold_weight_grad(wgrad_reference(fold_input(x, fold), dy, fold.geometry), g, fold)
    dx = dgrad(dy, w, g, reference_fprop, fold)         # the folded conv's phase, its dX' unfolded
    if show:
        print(f"\n{g.describe()}\n  folds into {fold.geometry.describe()} (pads {fold.pads}); "
              f"MMA columns per output channel: {folded_cost(g.R, g.S, g.Ci)} -> "
              f"{folded_cost(fold.geometry.R, fold.geometry.S, fold.Ci_padded)}")
        print(f"  largest difference from torch.nn.grad: dW {(dw - expected_dw).abs().max():.2e}, "
              f"dX {(dx - expected_dx).abs().max():.2e}")
    torch.testing.assert_close(dw, expected_dw, rtol=1e-4, atol=1e-4)     # fp32, two summation orders
    torch.testing.assert_close(dx, expected_dx, rtol=1e-4, atol=1e-4)
    return dx, dw


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding", [
    (2, 20, 18, 3, 8, 7, 7, 2, 3),            # the stem
    (1, 23, 17, 3, 5, 7, 7, 2, 3),            # the stem, odd sizes: pads (3, 4, 3, 4)
    (1, 11, 13, 2, 5, 4, 3, (2, 3), 0),       # no padding: pads (0, -1, 0, -1), x's last row and column cut
    (2, 11, 12, 3, 4, 3, 3, 2, 1),            # 3x3 stride 2 on an RGB image
    (1, 13, 10, 1, 6, 5, 3, (3, 2), (2, 0)),  # per-axis stride and padding, one channel
    (1, 16, 15, 1, 3, 4, 4, 4, 5),            # stride 4, padding past the filter
    (1, 9, 9, 2, 3, 3, 5, 3, (0, 2)),         # stride 3: nine channel groups
])
def test_folded_gradients_match_torch(N, H, W, Ci, Co, R, S, stride, padding):
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, torch.float32, device_name="cpu")
    fold = stride_fold(g)
    assert fold is not None, g.describe()
    expected_dx, expected_dw = reference_gradients(x, w, dy, g)
    x_folded, w_folded = fold_input(x, fold), fold_weight(w, fold)
    # the folded conv is the same conv: its output is y
    y = common.reference_conv2d_nhwc(x, w, None, g.stride, g.padding, 1, out_dtype=torch.float32)
    torch.testing.assert_close(common.reference_conv2d_nhwc(x_folded, w_folded, None, 1, 0, 1, out_dtype=torch.float32),
                               y, rtol=1e-4, atol=1e-4)
    dw = unfold_weight_grad(wgrad_reference(x_folded, dy, fold.geometry), g, fold)
    dx = dgrad(dy, w, g, reference_fprop, fold)
    torch.testing.assert_close(dw, expected_dw, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dx, expected_dx, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("Ci, R, stride, dilation, folds", [
    (3, 7, 2, 1, True),      # the stem: 49 x 16 columns -> 16 x 16
    (3, 3, 2, 1, True),      # 9 x 16 -> 4 x 16
    (8, 3, 2, 1, False),     # 9 x 16 -> 4 x 32: less, but not half
    (128, 3, 2, 1, False),   # ResNet-50's first 3x3 stride 2: 9 x 128 < 4 x 512
    (3, 1, 2, 1, False),     # 1x1: nothing to fold (1 x 16 either way)
    (3, 7, 1, 1, False),     # stride 1
    (3, 7, 2, 2, False),     # dilation 2
])
def test_stride_fold_where_it_pays(Ci, R, stride, dilation, folds):
    g = common.conv_geometry((2, 32, 32, Ci), (8, R, R, Ci), stride, R // 2, dilation)
    assert (stride_fold(g) is not None) == folds


# %%
# wgrad goes one step further. A tile of the folded stem is still one tap's 16 channels, so the
# kernel reads dY once per tap, 16 times over, for MMAs 16 columns wide. A conv can move its
# column taps (the S taps s of one filter row r) into the channels as well, as the operator's
# forward pass does for the stem (lesson 05, section 8, at any stride and padding). The folded
# conv has stride 1 and no padding, so here it is lesson 02's im2col along one axis with
# `Tensor.unfold`: x''[n, y, x, (s, c)] = x'[n, y, x + s, c], a copy S' times the size of x'. The
# conv of x'' with R' x 1 taps is the same conv, and its dW'' is dW' with the (s, c) axis split in
# two. The folded stem's 4 x 16 channels make one 64-channel tile per row of taps: dY is read 4
# times instead of 16, by MMAs 64 columns wide, for the same MMA columns (4 x 16 = 64). The gain
# is fewer reads of dY and wider MMAs, paid for with the larger copy of x; `wgrad_problem` takes
# the step after a fold only (the case measured) and only where it adds no MMA columns. dgrad does
# not take it: its dX'' would have to be added back into dX' (the windows overlap), where the
# fold's dX' is only moved.


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, taps_in_channels", [
    (2, 20, 18, 3, 8, 7, 7, 2, 3, 4),       # the stem: folded, then 4 column taps of 16 channels in one box of 64
    (2, 11, 12, 3, 4, 3, 3, 2, 1, 2),       # 3x3 stride 2 on RGB: folded to 2x2 taps of 16, then 2 x 16 in one box
    (1, 12, 11, 8, 5, 3, 3, 1, 0, 0),       # not folded: left alone (the step follows a fold only)
    (1, 15, 13, 3, 4, 5, 5, 2, 2, 0),       # 5x5 stride 2 on RGB: folded to 3x3 taps of 16; a row of taps,
                                            # 3 x 16 columns, would take a box of 64: left folded only
])
def test_wgrad_problem_gives_torchs_dw(N, H, W, Ci, Co, R, S, stride, padding, taps_in_channels):
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, torch.float32, device_name="cpu")
    problem = wgrad_problem(g, element_size=2)
    assert problem.taps_in_channels == taps_in_channels
    dw = wgrad_result(wgrad_reference(wgrad_input(x, problem), dy, problem.geometry), g, problem)
    torch.testing.assert_close(dw, reference_gradients(x, w, dy, g)[1], rtol=1e-4, atol=1e-4)


# %%
if __name__ == "__main__":
    run_stride_fold()

# %%
# What you should see: the stem of 3 channels folds into a 4x4 conv of 16 channels (12 of them
# x's), 784 -> 256 MMA columns per output channel, and gradients that match torch.nn.grad to
# fp32 rounding. (`run_stride_fold` checks the fold alone; `test_wgrad_problem_gives_torchs_dw`
# the column taps in the channels after it.)
#
# 7. What the compiler produced (no GPU needed)
# ---------------------------------------------
# The wgrad kernel compiled ahead of time for a ResNet-like layer (N=2, 16x16, 64 -> 128 channels,
# 3x3, bf16; tiles of 128 output x 64 input channels, 128 pixels per k-step (section 6's rule for a
# tile this small), 4 stages, 2 slices).
# Counts are instructions in the program text, not executions. The heading counts warps as lesson
# 05 does: the 4 of the MMA/epilogue partition and the 1-warp workers (Hopper: the loader;
# Blackwell: loader and MMA issuer), padded to a whole warpgroup, 8. `setmaxnreg` works on whole
# warpgroups, so its `dec` (to 24 registers) belongs to that padded worker warpgroup, in two places
# of its code; the 4 MMA warps raise their limit with `setmaxnreg.inc`, which the PTX holds too.

IM2COL_LOAD, TILED_LOAD = common.PTX_IM2COL_LOAD, common.PTX_TILED_LOAD
TAUGHT_PTX = {
    "sm_90": [
        (TILED_LOAD, "A, dY as [pixels, Co]: a tiled box of 128 pixels x 128 output channels, as two messages "
                     "of 64 channels (the 128-byte swizzle's width, 64 bf16)."),
        (IM2COL_LOAD, "B, x's im2col box for the unit's tap: 128 pixels x 64 channels, lesson 05's instruction "
                      "with the tap's offsets last, now on the GEMM's B side."),
        ("wgmma.mma_async", "m64n64k16, 2 row blocks x 8 K steps = 16 per k-step. The last four values are "
                            "imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b: 1, 1, 1, 1, both operands read "
                            "transposed (MN-major). Lesson 05's forward WGMMAs end in 1, 1, 0, 0."),
        ("setmaxnreg.dec", "The loader's warpgroup gives registers back to the MMA warpgroup, as in lesson 05."),
    ],
    "sm_100": [
        (TILED_LOAD, "A, dY's tiled box, as on sm_90."),
        (IM2COL_LOAD, "B, the im2col box, as on sm_90."),
        ("tcgen05.mma", "One thread issues 128 x 64 x 16: 8 per k-step. Its fourth operand is the instruction "
                        "descriptor, moved into a register before it (decoded below)."),
        ("tcgen05.commit", "Per k-step (the stage is free) and per unit (the accumulator is ready)."),
        ("tcgen05.ld", "The epilogue reads the fp32 accumulator from tensor memory before the partial store."),
    ],
}


def aot_conv2d_wgrad(arch, N=2, H=16, W=16, Ci=64, Co=128, R=3, S=3, stride=1, padding=1, split_k=2,
                     default_config=False):
    """(kernel, args, kwargs) on CPU tensors, for common.aot_compile (default_config: the launcher's
    config for an H100's 132 SMs, default_wgrad_config's, instead of wgrad_config's tile in split_k)."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, torch.bfloat16, device_name="cpu")
    config = None if default_config else wgrad_config(Co, Ci)._replace(split_k=split_k)
    launch = prepare_wgrad(x, dy, g, config, arch, 132)
    dw = torch.empty(Co, R * S * Ci, dtype=x.dtype)
    return conv2d_wgrad_kernel, launch.kernel_args(dw), wgrad_kernel_options(launch.config, arch)


def transposed_operands(ptx, arch):
    """(A transposed, B transposed) of a build's first MMA: on sm_90 the WGMMA's imm-trans-a and
    imm-trans-b; on sm_100 bits 15 and 16 of the tcgen05 instruction descriptor, an immediate
    that the PTX moves into the register the MMA names."""
    if arch == "sm_90":
        trans_a, trans_b = re.search(r"wgmma\.mma_async[^;]*, (\d), (\d);", ptx).groups()
        return int(trans_a), int(trans_b)
    register = re.search(r"tcgen05\.mma\.[^;]*, (%r\d+), %p\d+;", ptx).group(1)
    descriptor = int(re.search(rf"mov\.b32\s+{re.escape(register)}, (\d+);", ptx).group(1))
    return descriptor >> 15 & 1, descriptor >> 16 & 1


def run_show_ptx():
    report = common.show_ptx("06-conv-backward", "aot_conv2d_wgrad", TAUGHT_PTX,
                             lambda arch, compiled: f"conv2d_wgrad_kernel, 128x64x128 tiles, 4 stages: "
                                                    f"{compiled['num_warps']} warps in all")
    for arch in report:
        ours = transposed_operands(common.aot_compile("06-conv-backward", "aot_conv2d_wgrad", arch)["ptx"], arch)
        fprop_ops = transposed_operands(common.aot_compile("05-warp-specialized-conv", "aot_conv2d_fprop", arch)["ptx"],
                                        arch)
        in_place = transposed_operands(common.aot_compile("06-conv-backward", "aot_dgrad_in_place", arch)["ptx"],
                                       arch)
        where = "imm-trans-a, imm-trans-b" if arch == "sm_90" else "instruction descriptor bits 15, 16"
        print(f"\n{arch}: operands transposed ({where}): wgrad A={ours[0]}, B={ours[1]}; "
              f"lesson 05's fprop A={fprop_ops[0]}, B={fprop_ops[1]}; "
              f"section 2c's dgrad A={in_place[0]}, B={in_place[1]}")


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
def test_kernel_compiles_with_expected_instructions(arch):
    compiled = common.assert_ptx_teaches("06-conv-backward", "aot_conv2d_wgrad", arch, TAUGHT_PTX)
    assert transposed_operands(compiled["ptx"], arch) == (1, 1)
    other_mma = "tcgen05.mma" if arch == "sm_90" else "wgmma.mma_async"
    assert common.ptx_instructions(compiled["ptx"], [other_mma])[other_mma] == 0


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
def test_1x1_wgrad_loads_x_tiled(arch):
    """A 1x1 stride-1 build has no im2col load: x's load is a tiled one (section 3), the rest alike."""
    loads = [common.PTX_IM2COL_LOAD, common.PTX_TILED_LOAD]
    im2col = common.ptx_instructions(common.aot_compile_or_skip("06-conv-backward", "aot_conv2d_wgrad", arch)["ptx"],
                                     loads)
    tiled = common.ptx_instructions(common.aot_compile_or_skip("06-conv-backward", "aot_conv2d_wgrad", arch, R=1, S=1,
                                                               padding=0)["ptx"], loads)
    assert im2col[common.PTX_IM2COL_LOAD] > 0 and tiled[common.PTX_IM2COL_LOAD] == 0
    assert tiled[common.PTX_TILED_LOAD] == im2col[common.PTX_TILED_LOAD] + im2col[common.PTX_IM2COL_LOAD]


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
@pytest.mark.parametrize("Ci, Co, R, ring", [(128, 256, 3, (128, 128, 64, 4)), (256, 512, 1, (64, 128, 128, 4))])
def test_default_wgrad_configs_fit_shared_memory(arch, Ci, Co, R, ring):
    """default_wgrad_config's 128 x 128 x 64 tiles and its 64 x 128 x 128 tiles (x read tiled) build, and
    the build asks for no more shared memory than a program may have."""
    params = dict(N=8, H=14, W=14, Ci=Ci, Co=Co, R=R, S=R, padding=R // 2, default_config=True)
    g = common.conv_geometry((8, 14, 14, Ci), (Co, R, R, Ci), 1, R // 2)
    assert tuple(default_wgrad_config(g, Ci, 132)[:4]) == ring
    built = common.aot_compile_or_skip("06-conv-backward", "aot_conv2d_wgrad", arch, **params)
    assert 0 < built["shared"] <= forward.SHARED_MEMORY_PER_PROGRAM


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
def test_forward_kernel_reads_its_operands_untransposed(arch):
    compiled = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch)
    assert transposed_operands(compiled["ptx"], arch) == (0, 0)


def aot_phase_conv(arch, N=2, H=16, W=16, Ci=64, Co=128):
    """(kernel, args, kwargs) of the forward kernel (the operator's) with section 2's out_window, on CPU
    tensors: a 3x3 conv stored into every second row and column of a larger tensor, from its output's
    second row on."""
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, 3, 3, torch.bfloat16, device_name="cpu")
    dx = torch.empty(N, 2 * H, 2 * W, Co, dtype=torch.bfloat16)
    window = OutputWindow(dx[:, ::2, ::2][:, :H - 1], crop_h=1)
    return fprop_build(arch, N, H, W, Ci, Co, out_window=window)


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
@pytest.mark.parametrize("Co", [24, 40])
def test_phase_build_stores_16_byte_vectors_with_8_mod_16_channels(arch, Co):
    # WindowStore.offsets tells the compiler Co and the strides are multiples of 8 elements: 16-byte stores
    built = common.aot_compile_or_skip("06-conv-backward", "aot_phase_conv", arch, Co=Co)
    assert common.ptx_instructions(built["ptx"], ["st.global", "st.global.v4"]) == {"st.global": 16, "st.global.v4": 16}


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
def test_phase_build_stores_its_pixels_without_tma(arch):
    # section 2: with an out_window, the forward kernel's epilogue stages the tile in shared memory as for the
    # TMA store,
    # reads it back in 16-byte vectors along its rows and stores those with st.global.v4: a 128 x 128 bf16 tile
    # over the epilogue partition's 4 warps (128 threads: its `bar.sync 0, 128`), 16 stores of 16 bytes each; no
    # TMA store
    built = common.aot_compile_or_skip("06-conv-backward", "aot_phase_conv", arch)
    windowed = built["ptx"]
    dense = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch)["ptx"]
    stores = [common.PTX_TMA_STORE, "st.global"]
    assert "bar.sync \t0, 128;" in windowed
    per_thread = 128 * 128 * 2 // (128 * 16)
    assert common.ptx_instructions(windowed, stores) == {common.PTX_TMA_STORE: 0, "st.global": per_thread}
    assert common.ptx_instructions(dense, stores) == {common.PTX_TMA_STORE: 1, "st.global": 0}
    assert "st.global.v4.b32 " in common.first_ptx_instruction(windowed, "st.global")     # (predicated: masked)
    assert "ld.shared.v4.b32" in windowed and built["stack"] == 0


def aot_side_by_side(arch, N=2, H=16, W=16, Ci=128, Co=64, R=3, stride=2, padding=1, config=None, in_place=False,
                     heaviest_first=False):
    """(kernel, args, kwargs) of section 2b's conv, on CPU tensors: the dgrad of a 3x3 stride-2 conv, Ci -> Co,
    every phase in one launch of the forward kernel (`in_place`: its weights read from w, section 2c;
    `heaviest_first`: its tiles in that order)."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, R, stride, padding, 1, torch.bfloat16, device_name="cpu")
    # (the config of a build for `arch`, whatever GPU this machine has, if any)
    plan = side_by_side_plan(g, forward.KernelConfig(*(config or side_by_side_config(g, arch))))
    dx = torch.empty(N, H, W, Ci, dtype=torch.bfloat16)
    w_side_by_side = side_by_side_in_place(w, plan) if in_place else flipped_weights(
        w, [(h.taps, v.taps) for _, _, h, v in dgrad_phases(g)], width=plan.phases.width)
    phases = plan.phases._replace(order=plan.phases.heaviest_first() if heaviest_first else None)
    launch = forward.prepare_launch(dy, w_side_by_side, None, plan.geometry, plan.config, arch, 132,
                                     out_window=OutputWindow(dx, phases=phases))
    return forward.conv2d_fprop_kernel, launch.kernel_args(), forward.kernel_constexprs(plan.config, arch)


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
@pytest.mark.parametrize("heaviest_first", [False, True])
def test_side_by_side_build(arch, heaviest_first):
    # section 2b: the phases' build loads and stores as section 2's (im2col and tiled loads, the tile in 16-byte
    # st.global.v4, 8 bf16 each, per thread: 16 of them with 4 warps on 128 x 128, 8 with Hopper's 8 warps), with no
    # stack: the loader picks its tile's taps in the registers it has, either tile order
    built = common.aot_compile_or_skip("06-conv-backward", "aot_side_by_side", arch, heaviest_first=heaviest_first)
    config = side_by_side_config(common.conv_geometry((2, 16, 16, 128), (64, 3, 3, 128), 2, 1), arch)
    stores = config.block_m * config.block_n // (config.num_warps * 32 * 8)
    assert common.ptx_instructions(built["ptx"], ["st.global", "st.global.v4", common.PTX_TMA_STORE]) == {
        "st.global": stores, "st.global.v4": stores, common.PTX_TMA_STORE: 0}
    assert common.PTX_IM2COL_LOAD in built["ptx"] and built["stack"] == 0


def aot_dgrad_in_place(arch, N=2, H=16, W=16, Ci=192, Co=64, R=3, config=(128, 128, 64, 4, 4, 1, 1, 64)):
    """(kernel, args, kwargs) of a stride-1 dgrad, Ci -> Co, by the forward kernel reading w in place (section
    2c), on CPU tensors; the default config has a column tail (lesson 05's section 6), whose box lies
    BLOCK_N columns further along w2d's rows."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, R, 1, R // 2, 1, torch.bfloat16, device_name="cpu")
    (flipped,) = filters_in_place(w, [(slice(None), slice(None))])
    conv = common.conv_geometry(tuple(dy.shape), flipped.shape, 1, R // 2)
    launch = forward.prepare_launch(dy, flipped, None, conv, config, arch, 132)
    return forward.conv2d_fprop_kernel, launch.kernel_args(), forward.kernel_constexprs(config, arch)


@pytest.mark.parametrize("arch, builder, config", [
    (arch, builder, None) for arch in TAUGHT_PTX for builder in ("aot_dgrad_in_place", "aot_side_by_side")] + [
    ("sm_90", "aot_dgrad_in_place", (128, 128, 64, 4, 4, 1, 2, 32, 1, 0)),   # ping-pong, a column tail
    ("sm_90", "aot_dgrad_in_place", (128, 64, 64, 4, 4, 2, 1, 0, 1, 0)),     # two programs per SM
    ("sm_90", "aot_dgrad_in_place", (128, 128, 64, 4, 4, 1, 1, 0, 1, 64)),   # a row tail
    ("sm_90", "aot_dgrad_in_place", (128, 128, 64, 6, 8, 1, 1, 0, 2, 0)),    # split-K
    ("sm_100", "aot_dgrad_in_place", (128, 128, 64, 4, 4, 1, 1, 32, 2, 0)),  # a column tail and split-K
])
def test_weights_in_place_are_an_n_major_b(arch, builder, config):
    # section 2c: the MMAs read B as it lies (WGMMA's imm-trans-b, tcgen05's bit 16), A as lesson 05 does; the
    # operator's runtime may pick any candidate config for a phase's conv, a few kinds of them here
    params = {"in_place": True} if builder == "aot_side_by_side" else {}
    if config is not None:
        params["config"] = config
    built = common.aot_compile_or_skip("06-conv-backward", builder, arch, **params)
    assert transposed_operands(built["ptx"], arch) == (0, 1) and built["stack"] == 0


def test_kernel_compiles_for_small_channels_and_strides():
    # Ci = 3 (padded to 8, a 16-channel box), Co = 48 (64-row tiles), a 7x7 stride-2 stem, 4 k-steps (of 128 pixels:
    # a small tile's) in 3 slices
    compiled = common.aot_compile_or_skip("06-conv-backward", "aot_conv2d_wgrad", "sm_90", H=32, W=32, Ci=3, Co=48,
                                          R=7, S=7, stride=2, padding=3, split_k=3)
    assert "m64n16k16" in common.first_ptx_instruction(compiled["ptx"], "wgmma.mma_async")


# %%
if __name__ == "__main__":
    run_show_ptx()

# %%
# Input checks
# ------------
# Both launchers refuse what they do not run with an error that names the argument: other dtypes,
# a dY whose shape is not the conv's output, grouped convs whose groups a tile cannot keep to,
# non-contiguous tensors, tensors off the GPU (checked last).


BAD_CALLS = [   # (launcher, arguments changed from a valid call: a function of (x, w, dy), error, message)
    ("dgrad", lambda x, w, dy: {"groups": 2, "w": w[..., :4].contiguous()}, ValueError, "groups=2: dgrad runs"),
    ("wgrad", lambda x, w, dy: {"groups": 2, "w_shape": (16, 3, 3, 4)}, ValueError, "groups=2: wgrad takes"),
    ("dgrad", lambda x, w, dy: {"dy_nhwc": dy.float()}, TypeError, "dy_nhwc has dtype torch.float32"),
    ("wgrad", lambda x, w, dy: {"x_nhwc": x.half()}, TypeError, "x_nhwc is torch.float16"),
    ("dgrad", lambda x, w, dy: {"padding": 0}, ValueError, "dy_nhwc has shape"),
    ("wgrad", lambda x, w, dy: {"dy_nhwc": dy[:, :, :7]}, ValueError, "contiguous"),
    ("wgrad", lambda x, w, dy: {"w_shape": (16, 3, 3)}, TypeError, "w_shape must be 4 ints"),
    ("dgrad", lambda x, w, dy: {"x_shape": 8}, TypeError, "x_shape must be 4 ints"),
    ("dgrad", lambda x, w, dy: {"x_shape": (1, 8, 8, 4)}, ValueError, "channel mismatch"),
    ("dgrad", lambda x, w, dy: {}, ValueError, "CUDA GPU"),         # CPU tensors: refused last
    ("wgrad", lambda x, w, dy: {}, ValueError, "CUDA GPU"),
]


@pytest.mark.parametrize("Ci, Co, groups, dgrad_runs, wgrad_runs", [
    (256, 256, 2, True, True),       # 128 -> 128 per group
    (128, 512, 4, False, True),      # 32 -> 128: wgrad's 128-row tiles fit; dgrad's conv writes 32 per group,
                                     # less than a tile's 64 columns
    (72, 72, 3, False, False),       # RegNetY-3.2GF's 24 per group
    (512, 128, 2, True, True),       # 256 -> 64: dgrad's conv reads 64 per group (one K block), writes 256
])
def test_which_grouped_convs_the_backward_runs(Ci, Co, groups, dgrad_runs, wgrad_runs):
    g = common.conv_geometry((2, 8, 8, Ci), (Co, 3, 3, Ci // groups), 1, 1, 1, groups)
    assert (backward_groups_reason(g, "dgrad") is None) == dgrad_runs
    assert (backward_groups_reason(g, "wgrad") is None) == wgrad_runs


@pytest.mark.parametrize("launcher, changes, error, message", BAD_CALLS)
def test_rejects_bad_calls(launcher, changes, error, message):
    x, w, dy, _ = backward_inputs(1, 8, 8, 8, 16, 3, 3, 1, 1, 1, torch.bfloat16, device_name="cpu")
    if launcher == "dgrad":
        entry, valid = conv2d_dgrad_launch, dict(dy_nhwc=dy, w=w, x_shape=x.shape, padding=1)
    else:
        entry, valid = conv2d_wgrad_launch, dict(x_nhwc=x, dy_nhwc=dy, w_shape=w.shape, padding=1)
    with pytest.raises(error, match=re.escape(message)):
        entry(**{**valid, **changes(x, w, dy)})


# %%
# 8. Checks against torch (GPU)
# -----------------------------
# dgrad and wgrad on the GPU against torch.nn.grad's fp32 gradients of the same fp16/bf16 values,
# over shapes that include the awkward ones (Ci = 3, Co not a multiple of the tile or of 8, stride
# 2 and 3, dilation, padding past the filter, non-square everything). The tolerance is
# common.assert_close_to_reference's, with K the length of each output's sum (Co*R*S for dX, the
# N*out_h*out_w pixels for dW): every product of two fp16/bf16 values is exact in the fp32
# accumulator, the fp32 sums differ from torch's by fp32 rounding only, and the one rounding to
# bf16 at the end costs at most 2^-8 = 0.4% of the value (bf16 keeps 8 significant bits; fp16 11:
# 0.05%); so rtol 2e-2 (fp16 2e-3) holds with room to spare. Elements that cancel towards zero keep
# an error of the size of the terms, not of the result: the sum of K random products has a typical
# size of sqrt(K) times one product, so the absolute tolerance grows as rtol * sqrt(K) / 8.


def check_backward(kind, N, H, W, Ci, Co, R, S, stride=1, padding=0, dilation=1, dtype=torch.bfloat16,
                   config=None, seed=0, groups=1):
    """Run conv2d_dgrad_launch (kind "dgrad") or conv2d_wgrad_launch ("wgrad") and compare it with torch."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, seed, groups=groups)
    expected_dx, expected_dw = reference_gradients(x, w, dy, g)
    # K: the length of each output's sum, which sets the tolerance (see above)
    if kind == "dgrad":
        out = conv2d_dgrad_launch(dy, w, x.shape, stride, padding, dilation, groups)
        expected, K = expected_dx, g.Co_group * R * S
    else:
        out = conv2d_wgrad_launch(x, dy, w.shape, stride, padding, dilation, groups, config=config)
        expected, K = expected_dw, g.M
    assert out.shape == expected.shape and out.dtype == dtype, (out.shape, out.dtype)
    common.assert_close_to_reference(out, expected, dtype=dtype, K=K)
    return out


needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
AWKWARD_SHAPES = [    # N, H, W, Ci, Co, R, S, stride, padding, dilation
    (2, 16, 16, 64, 64, 3, 3, 1, 1, 1),           # stride 1: one launch of lesson 05's kernel
    (2, 15, 17, 32, 48, 3, 3, 2, 1, 1),           # ResNet-50's 3x3 stride 2, odd sizes
    (2, 14, 14, 64, 256, 1, 1, 2, 0, 1),          # a 1x1 downsample: three phases of zeros
    (2, 20, 18, 3, 64, 7, 7, 2, 3, 1),            # the stem: Ci = 3
    (2, 16, 16, 40, 36, 3, 3, 1, 2, 2),           # dilation 2, Co = 36 (not a multiple of 8)
    (2, 13, 11, 24, 200, 3, 5, (2, 1), (1, 2), (1, 2)),  # per-axis stride, padding, dilation; Co = 200
    (1, 9, 9, 16, 16, 1, 1, 1, 1, 1),             # padding past the filter
    (2, 17, 17, 16, 32, 4, 4, 3, 1, 1),           # stride 3, an even filter
    (2, 12, 12, 16, 40, 3, 3, 2, 3, 1),           # section 2b's window starting inside dY; Co = 40: a K block past it
]


@needs_gpu
@pytest.mark.parametrize("kind", ["dgrad", "wgrad"])
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", AWKWARD_SHAPES)
def test_backward_matches_torch(kind, N, H, W, Ci, Co, R, S, stride, padding, dilation):
    check_backward(kind, N, H, W, Ci, Co, R, S, stride, padding, dilation)


@needs_gpu
@pytest.mark.parametrize("heaviest_first", [False, True], ids=["lesson 05's order", "heaviest first"])
@pytest.mark.parametrize("N, H, W, Ci, Co, R, stride", [
    (8, 56, 56, 128, 64, 3, 2),      # 196 tiles of 128 x 128 (Hopper's config) on 132 programs: some run two
    (2, 17, 17, 32, 48, 4, 3),       # stride 3, an even filter: 9 phases of 1 to 4 taps
])
def test_side_by_side_runs_either_tile_order(heaviest_first, N, H, W, Ci, Co, R, stride, monkeypatch):
    # section 2b's conv on the GPU with its tiles in each order, forced (phase_order picks one per layer): dX
    # against torch's
    orders = []

    def forced(plan, programs):
        orders.append(plan.phases.heaviest_first() if heaviest_first else None)
        return orders[-1]
    import conv_tutorial.kernels.dgrad as dgrad_plans
    monkeypatch.setattr(dgrad_plans, "phase_order", forced)
    check_backward("dgrad", N, H, W, Ci, Co, R, R, stride, 1, 1)
    assert len(orders) == 1 and (orders[0] is not None) == heaviest_first


@needs_gpu
@pytest.mark.parametrize("kind", ["dgrad", "wgrad"])
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, groups", [
    (2, 14, 14, 256, 256, 3, 3, 1, 1, 2),          # 128 channels per group
    (2, 15, 13, 128, 256, 3, 3, 2, 1, 2),          # 64 -> 128 per group, stride 2: four phases
    (2, 9, 10, 256, 512, 1, 1, 1, 0, 4),           # 1x1, four groups of 64 -> 128
    (2, 8, 8, 512, 512, 3, 3, 1, 1, 2),            # 256 per group: two tiles along each group's rows and columns
])
def test_grouped_backward_matches_torch(kind, N, H, W, Ci, Co, R, S, stride, padding, groups):
    check_backward(kind, N, H, W, Ci, Co, R, S, stride, padding, groups=groups)


@needs_gpu
@pytest.mark.parametrize("kind, dtype, config", [
    ("dgrad", torch.float16, None),
    ("wgrad", torch.float16, None),
    ("wgrad", torch.bfloat16, WgradConfig(128, 128, split_k=1)),     # one slice: a whole K loop per tile
    ("wgrad", torch.bfloat16, WgradConfig(128, 64, split_k=7)),      # slices of uneven length
    ("wgrad", torch.bfloat16, WgradConfig(128, 64, split_k=5, programs=4)),   # 18 tiles: 16 whole, 2 in 5 slices
    ("wgrad", torch.float16, WgradConfig(64, 64, 128, split_k=3, programs=7)),    # 36 tiles: 35 whole, 1 in 3
])
def test_backward_dtypes_and_splits(kind, dtype, config):
    # a ResNet-50 3x3 layer at batch 8: K = 8 x 28 x 28 = 6272 pixels for wgrad
    check_backward(kind, 8, 28, 28, 128, 128, 3, 3, 1, 1, dtype=dtype, config=config)


@needs_gpu
@pytest.mark.parametrize("config", [forward.FIXED_CONFIG, forward.FIXED_CONFIG._replace(block_n=64)], ids=str)
@pytest.mark.parametrize("crop", [(0, 0), (1, 2)])
def test_phase_conv_stores_into_its_rows_and_columns_of_dx(config, crop):
    # section 2's out_window: lesson 05's kernel stores a conv's output, cropped, into every second row and
    # third column of a larger tensor (Co = 72: a tile's columns past the channels), and nothing else
    N, H, W, Ci, Co = 3, 13, 11, 64, 72
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, 3, 3, torch.bfloat16)
    rows, cols = H - crop[0] - 1, W - crop[1]
    dx = torch.full((N, 2 * rows + 1, 3 * cols, Co), float("nan"), dtype=x.dtype, device=x.device)
    phase = dx[:, 1::2, ::3][:, :rows, :cols]
    out = forward.conv2d_fprop_launch(x, w, padding=1, config=config, out_window=OutputWindow(phase, *crop))
    expected = common.reference_conv2d_nhwc(x, w, None, 1, 1)[:, crop[0]:crop[0] + rows, crop[1]:crop[1] + cols]
    assert out is phase
    common.assert_close_to_reference(phase, expected, dtype=x.dtype, K=Ci * 9)
    phase.fill_(0.0)
    assert dx.nan_to_num(0.0).eq(0).all() and dx.isnan().sum() == dx.numel() - phase.numel()


@needs_gpu
def test_wgrad_gives_the_same_bits_every_run():
    x, w, dy, g = backward_inputs(8, 28, 28, 64, 64, 3, 3, 1, 1)
    first = conv2d_wgrad_launch(x, dy, w.shape, 1, 1)
    assert all(torch.equal(first, conv2d_wgrad_launch(x, dy, w.shape, 1, 1)) for _ in range(3))


def run_backward_checks():
    for kind in ("dgrad", "wgrad"):
        check_backward(kind, 4, 28, 28, 128, 128, 3, 3, 2, 1)
        check_backward(kind, 2, 20, 18, 3, 64, 7, 7, 2, 3)
    print(f"\nconv2d_dgrad_launch and conv2d_wgrad_launch match torch.nn.grad on {common.gpu_name()}")


# %%
if __name__ == "__main__" and on_gpu:
    run_backward_checks()

# %%
# 9. Timing against cuDNN (GPU, --bench)
# --------------------------------------
# `bench_backward` times both gradients of one layer, ours and cuDNN's (`aten.convolution_backward`,
# the call autograd makes for a conv in training, on the channels_last x, w and dY themselves, which
# runs cuDNN's backward kernels; cuDNN picks its algorithm by its own heuristics,
# torch.backends.cudnn.benchmark being off, torch's default), with
# common.bench_tflops: do_bench's median, L2 flushed before each call, host time included (our
# launchers build their descriptors on every call). FLOPs are the forward pass's, useful products
# only. `--bench` here times three layers that way. `python benchmarks/backward_layers.py` runs it
# over every distinct conv of ResNet-50 at batch 128 (`--quick`: the same three), and that script's
# `--cuda-graphs` replays each call in a CUDA graph (do_bench_cudagraph, L2 not flushed), which times
# the kernels without the host's Python. What the script recorded for those three on an H100 SXM
# (2026-11-25, bf16, TFLOPS; results/h100-2026-11-25/backward_layers_cuda_graphs.json and
# backward_layers.json)::
#
#                                  kernels alone (CUDA graph)       host time included
#     layer                        dgrad  cuDNN  wgrad  cuDNN     dgrad  cuDNN  wgrad  cuDNN
#     RN50 14x14 256->256 3x3      531.8  612.1  530.1  519.4      46.7  661.1   75.0  498.6
#     RN50 56x56 128->128 3x3 s2   112.5  331.2  486.8  442.7      22.6  323.0  220.3  386.5
#     RN50 56x56 64->256 1x1       142.8  141.7  141.4  141.7      48.7  133.5   95.0  125.2

BENCH_LAYERS = [   # (label, N, H, W, Ci, Co, R, S, stride, padding), ResNet-50 at batch 128
    ("RN50 14x14 256->256 3x3", 128, 14, 14, 256, 256, 3, 3, 1, 1),
    ("RN50 56x56 128->128 3x3 s2", 128, 56, 56, 128, 128, 3, 3, 2, 1),
    ("RN50 56x56 64->256 1x1", 128, 56, 56, 64, 256, 1, 1, 1, 0),
]


def bench_backward(label, N, H, W, Ci, Co, R, S, stride, padding, dtype=torch.bfloat16, zero_insertion=False,
                   cuda_graph=False):
    """TFLOPS of dgrad and wgrad, ours and cuDNN's, on one layer (each checked against torch first);
    with cuda_graph, each call replayed in a CUDA graph: the kernels' time without the host's."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, dtype)
    check_backward("dgrad", N, H, W, Ci, Co, R, S, stride, padding, dtype=dtype)
    check_backward("wgrad", N, H, W, Ci, Co, R, S, stride, padding, dtype=dtype)
    x_nchw, w_kcrs, dy_nchw = x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), dy.permute(0, 3, 1, 2)  # channels_last
    calls = {
        "dgrad": lambda: conv2d_dgrad_launch(dy, w, x.shape, stride, padding),
        # cuDNN as autograd calls it in training: convolution_backward on the real channels_last tensors
        "dgrad cuDNN": lambda: torch.ops.aten.convolution_backward(
            dy_nchw, x_nchw, w_kcrs, None, g.stride, g.padding, g.dilation, False, [0, 0], 1, (True, False, False))[0],
        "wgrad": lambda: conv2d_wgrad_launch(x, dy, w.shape, stride, padding),
        "wgrad cuDNN": lambda: torch.ops.aten.convolution_backward(
            dy_nchw, x_nchw, w_kcrs, None, g.stride, g.padding, g.dilation, False, [0, 0], 1, (False, True, False))[1],
    }
    if zero_insertion and max(g.stride) > 1:
        fprop = lambda spread, w_flipped, **conv: forward.conv2d_fprop_launch(  # noqa: E731
            spread, w_flipped, config=dgrad_config(g), **conv)
        expected, _ = reference_gradients(x, w, dy, g)
        common.assert_close_to_reference(zero_insertion_dgrad(dy, w, g, fprop), expected, dtype=dtype, K=Co * R * S)
        calls["dgrad zero-insertion"] = lambda: zero_insertion_dgrad(dy, w, g, fprop)
    problem = wgrad_problem(g, x.element_size())       # the conv the wgrad kernel runs, and its split
    wgrad_launch = prepare_wgrad(wgrad_input(x, problem), dy, problem.geometry, None,
                                 *common.tma_mma_arch_and_sms("bench"))
    row = {"layer": label, "geometry": g.describe(), "wgrad_split_k": wgrad_launch.config.split_k,
           "wgrad_whole_tiles": wgrad_launch.shape.whole_tiles}
    row.update({name: common.bench_tflops(call, g.flops, cuda_graph=cuda_graph) for name, call in calls.items()})
    print(f"   {label:<28}" + "".join(f"  {name} {row[name]['tflops']:6.1f}" for name in calls)
          + f"  (wgrad: {row['wgrad_whole_tiles']} tiles whole, the others in {row['wgrad_split_k']} slices)")
    return row


def run_bench(outdir, layers=BENCH_LAYERS):
    print(f"\nTFLOPS (useful FLOPs), bf16, {common.gpu_name()}:")
    rows = [bench_backward(*layer) for layer in layers]
    common.save_json(outdir, "06_backward_tflops", {"rows": rows, "dtype": "bfloat16", **common.versions()})
    return rows


# %%
if __name__ == "__main__" and on_gpu and args.bench:
    run_bench(outdir)

# %%
# 10. Training: BatchNorm's statistics from the forward's epilogue
# ----------------------------------------------------------------
# In training, the BatchNorm after a conv cannot be folded into its weights (lesson 05, section
# 5): it normalizes with the batch's own mean and variance per channel, a reduction over N, H and
# W of the conv's output. torch.compile computes that reduction in a kernel of its own, which
# reads the whole output once more before the kernel that normalizes it reads it again. The
# forward kernel already holds each tile of the output on chip in its epilogue, so it can sum
# there. The operator's forward kernel has one more field in its `TileOutput` for it, `channel_stats`: None, or a zeroed
# fp32 tensor of shape [2, Co], into whose rows 0 and 1 `add_channel_sums` adds a tile's
# column sums of y and of y^2. Rows past the last pixel (a partial tile) are masked out. From the
# two sums::
#
#     mean = sum / count        var = sum_sq / count - mean^2        (count = N * out_h * out_w)
#
# Where to sum. The obvious place is the accumulator's registers, before the cast; summed there,
# the kernel ran up to 4x slower (measured below). The accumulator's layout is the MMA's: on
# Hopper a thread holds two rows of the tile, so a column's 128 values sit in 64 threads of eight
# warps, and `gl.sum(axis=0)` reduces them in rounds of shuffles and then across warps through
# shared memory: on the sm_90 128 x 256 tile, 770 shuffles and 63 more `bar.sync` barriers in the
# build, and with the fp32 tile live beside the partial sums, 456 bytes of registers spilled per thread
# (8 bytes when the sums come after the tile's store, as the tile's registers then free up as
# they are summed). Even without the spill, Nsight Compute counted 63 million instructions for
# the kernel on ResNet-50's 56x56 64->256 1x1 layer, against 5.8 million without the sums (H200;
# results/notebook.md has these counts).
#
# The epilogue already writes the tile, cast to the output's dtype, into a staging buffer for its
# TMA store. So the sums read the tile back from there, in a layout of their own
# (`staged_tile_layout`, columns split): each thread loads vectors of one row (16 bytes on
# sm_90; the sm_100 build reads 4 at a time), the warps split the columns among themselves, and a warp's
# lanes take a few columns and the rows. A thread sums its rows in registers, log2(lanes per
# column) shuffle rounds sum a warp's lanes (3 on the 128 x 256 tile of eight warps, 5 on a
# 32-column tail), and no sum crosses a warp, except in a column tail too narrow for the warps to
# split (32 columns among eight warps: that build's `bar.sync` count goes from 7 to 14). The
# sm_90 128 x 256 build has the plain build's `bar.sync` count and about 50 shuffles instead of
# 770, and no candidate config spills, on sm_90 or sm_100 (each compiled ahead of time; not a
# test). Two
# hazards, both covered by barriers the plain kernel has already: the TMA store waits for every
# thread's writes to the buffer (a `bar.sync` before it is issued), and these reads come after
# that; the next tile writes the buffer only after `tma.store_wait` and a `bar.sync` of the
# epilogue's warps, so after every warp's reads. What gets summed is the output as stored: the
# values BatchNorm itself would read from it.
#
# How the sums leave. Of the lanes that share a channel, one adds its sums into global memory
# with `red.global.gpu.relaxed.add`, four channels per instruction (`.v4.f32`) where Co is a
# multiple of 16 (Triton then knows the addresses are aligned), else one: an atomic add that
# returns nothing, with relaxed ordering, because nothing waits on the sums before the kernel
# ends, and everything after it on the stream sees them. Every program adds into the same
# [2, Co] tensor. A copy of the sums per SM (program p adding into copy p % copies, the copies
# added up after the kernel) was tried and measured slower overall: the idea was that thousands of
# tiles adding into the same few hundred addresses would queue on them, and zeroing 132 copies
# and adding them up cost more than any queueing saved. On an H100 (2026-11-26, bf16, batch 128,
# CUDA graphs, ResNet-50's 23 distinct convs; results/notebook.md, 2026-11-26), one tensor took
# 1894 us over the 23 layers against 1944 us with 132 copies, and was faster on 21 of them (by
# 4.8%, geometric mean), most on the 7x7 layers (31.1 -> 25.6 us on 7x7 2048->512 1x1), whose
# kernels are short enough for the copies' zeroing and reduction to be a large share; slower on
# the 56x56 64->256 1x1 (109.1 -> 116.1 us), not explained. With one tensor the conv with its sums
# took a median 1.14x the conv alone (1.04-1.25x). Tiles add in
# whatever order they finish, so the sums' last bits vary from run to run, and so do those of a
# BatchNorm computed from them.
#
# The limits. A split-K config (section 7 of lesson 05) holds partial sums in its epilogue, and
# the squares of partial sums do not add up to the square of the whole: `prepare_launch` refuses
# the combination (the operator's runtime sums such an output with torch instead, after the
# conv). An output window (section 2) is refused too: its crop drops pixels the sums would count.
# The configs are chosen for the conv without sums (the heuristic's or the tuner's), and a
# config's tails pay more for them (more shuffle rounds, a cross-warp exchange). And E[y^2] -
# E[y]^2 in fp32 loses digits when a channel's mean is large against its spread, a relative error
# of about 2^-24 * (mean / std)^2 in the variance per rounding
# (`test_variance_from_sums_loses_digits_with_large_means` shows it): negligible for the
# activations BatchNorm sees, whose means are of the order of their spread, and the reason
# Welford's update exists where they are not.
#
# The operator (`conv_tutorial.fuse_conv_batchnorm_for_training`) puts this into a model. Measured on
# an H200 (2026-11-25, bf16, batch 128; RESULTS.md, "Training fusions: BatchNorm's statistics ..."):
# summed from the staging buffer (into a copy per SM, as it then was), the conv with its sums, their zeroing and the
# copies' reduction took a median 1.18x the conv's time (1.09-1.52x; from registers it was 1.48x,
# up to 4.1x: results/h200-2026-11-25/channel_stats_first_build.json), beat the conv plus a
# separate reduction over the output on all 23 of ResNet-50's distinct convs, and a ResNet-50
# training step ran 3.9% faster with them than without; on an H100 (2026-11-26, one tensor) 2.8%
# (5148 -> 5290 images/s under CUDA graphs, torch.compile 5195).


def conv2d_with_channel_stats(x_nhwc, w, stride=1, padding=0, dilation=1, config=forward.FIXED_CONFIG):
    """(y NHWC, stats): lesson 05's conv, its epilogue adding each output channel's sum (stats[0]) and
    sum of squares (stats[1]), fp32 [2, Co], as it stores y: every program into the same zeroed tensor."""
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
    mean, var = stats[0] / y.shape[0], stats[1] / y.shape[0] - (stats[0] / y.shape[0]) ** 2
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


def test_channel_stats_are_refused_where_they_would_be_wrong():
    g = common.conv_geometry((2, 8, 8, 16), (32, 3, 3, 16), 1, 1)
    good = torch.zeros(2, 32)
    check_channel_stats(good, 32, good.device)
    for bad, words in [(torch.zeros(2, 32, dtype=torch.float16), "torch.float32"),
                       (torch.zeros(32, 2).t(), "contiguous"), (torch.zeros(2, 16), "(2, 32)"),
                       (torch.zeros(1, 2, 32), "(2, 32)"), (torch.zeros(1, 1, 2, 32), "(2, 32)")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            check_channel_stats(bad, 32, bad.device)
    # one tensor for all programs: a copy of the sums per SM ([copies, 2, Co]) is refused, by its shape
    with pytest.raises(ValueError, match=r"channel_stats is torch\.float32 \(132, 2, 32\).*shape \(2, 32\)"):
        check_channel_stats(torch.zeros(132, 2, 32), 32, good.device)
    with pytest.raises(TypeError, match="channel_stats must be a torch.Tensor"):
        check_channel_stats([0.0] * 64, 32, good.device)
    with pytest.raises(ValueError, match="without split-K"):
        check_channel_stats(good, 32, good.device, split_k=2)
    with pytest.raises(ValueError, match="out_window"):
        check_channel_stats(good, 32, good.device, out_window=OutputWindow(torch.zeros(*g.output_shape_nhwc)))


def aot_conv_with_channel_stats(arch):
    """(kernel, args, kwargs) of the forward kernel (the operator's) with channel_stats, on CPU tensors."""
    return fprop_build(arch, channel_stats=torch.zeros(2, 128))


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
def test_stats_build_adds_with_relaxed_reductions(arch):
    # the sums leave through red.global (an atomic add without a return value, relaxed ordering), four channels
    # at a time; the tile itself still leaves through one TMA store; the plain build has no reduction at all. The
    # staged tile is read back (sm_90: in 16-byte vectors), and the sums cross no warp: not one barrier more
    built = common.aot_compile_or_skip("06-conv-backward", "aot_conv_with_channel_stats", arch)
    plain = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch)
    counts = common.ptx_instructions(built["ptx"], ["red.global", common.PTX_TMA_STORE, "ld.shared", "bar.sync"])
    assert counts[common.PTX_TMA_STORE] == 1 and counts["red.global"] > 0
    assert common.ptx_instructions(plain["ptx"], ["red.global"])["red.global"] == 0
    assert counts["ld.shared"] > common.ptx_instructions(plain["ptx"], ["ld.shared"])["ld.shared"]
    if arch == "sm_90":
        assert common.ptx_instructions(built["ptx"], ["ld.shared.v4"])["ld.shared.v4"] > 0
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
    once (2e-2, as in section 8)."""
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


@needs_gpu
def test_channel_stats_add_to_what_the_tensor_holds():
    # every program adds into the one [2, Co] tensor, onto what it holds (so it starts zeroed): a second conv
    # into the same tensor doubles the sums, up to fp32's rounding in the adds (as in check_channel_sums)
    N, H, W, Ci, Co, R, S, stride, padding = STATS_CASES[2]
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16)
    y, stats = conv2d_with_channel_stats(x, w, stride, padding)
    twice = stats.clone()
    forward.conv2d_fprop_launch(x, w, None, stride, padding, channel_stats=twice)
    stored = y.reshape(-1, Co).double()
    scale = torch.stack((stored.abs().sum(0), (stored * stored).sum(0)))
    assert ((twice.double() - 2 * stats.double()).abs() <= 2e-5 * scale + 1e-4).all()


def run_channel_stats():
    for case in STATS_CASES:
        check_channel_sums(*case)
    print(f"\nthe epilogue's channel sums and BatchNorm from them match torch on {len(STATS_CASES)} layers, "
          f"{common.gpu_name()}")


# %%
if __name__ == "__main__" and on_gpu:
    run_channel_stats()

# %%
# 11. What else was tried: BatchNorm's apply and ReLU in the next conv's load
# -----------------------------------------------------------------------------
# Section 10 leaves BatchNorm's apply, relu(y * scale + shift), as a pass of its own. That map can run
# in the next conv's load instead: on Hopper the A tile taken through registers, mapped, and fed to
# WGMMA from there, with zeros where the padding lies. It was built, checked against torch and
# measured, and it did not pay: the k-steps that read A through registers no longer overlap, and the
# conv lost more than the pass it saved (results/notebook.md, "BatchNorm and ReLU on the next conv's
# load", names the commit that holds the code). The operator does not use it.

# %%
# 12. Training: ReLU's backward in dgrad's epilogue
# -------------------------------------------------
# In a block z -> x = relu(z) -> conv(x, w), autograd's backward runs dgrad for dX, then ReLU's
# backward, dZ = dX where x > 0, else 0: a pass over two activations that torch.compile fuses into
# the backward of the BatchNorm that produced z, whose kernels then read x as well as dX. dgrad's
# epilogue holds each tile of dX in registers, and the gate is x itself, the conv's own input,
# laid out [N, H, W, Ci] as dX is. So the epilogue can store dZ, and that pass need not read x:
# one activation read per such conv, about 0.6 GB or 0.2 ms of a ResNet-50 step at batch 128 by a
# count of bytes (under 1%; results/notebook.md), if the epilogue's own read of x costs less.
# Lesson 05's epilogue already reads one such tensor in the accumulator's layout, the residual
# (its section 5); in the operator's copy of the kernel the activation "relu_grad" (`common.RELU_GRAD`)
# has `apply_epilogue` keep the tile where that tensor is positive instead of adding it. (x > 0 exactly
# where z > 0, so the
# gate needs only x; the plain builds do not change: a constexpr branch.)
#
# It applies where dX is one conv's whole output: stride 1, no fold, and no crop (padding at most
# dilation * (R - 1) on each axis, section 2). A strided dgrad's phases store through an output
# window, and there the gate is applied after, in torch. In a model, autograd must also skip ReLU's
# own backward: the operator's `conv_tutorial.fuse_relu_into_dgrad` calls the conv with the ReLU's
# input too, and its backward gives that input dZ (and x nothing).
#
# Measured (H100, 2026-11-26, ResNet-50 training at batch 128 under CUDA graphs, with section 10's
# statistics on both sides; `results/h100-2026-11-26/training_relugrad.json`): 5280 images/s with
# the gate in 29 dgrads' epilogues, 5283 without; a profile of the step (3 steps) put our dgrads
# (counted with the forward kernels) at +0.41 ms, our convs in all at +0.37, and Inductor's
# kernels at -0.16 ms: 22.61 against 22.41 ms of GPU time. The epilogue's read of x cost more than
# Inductor saved: its fused BatchNorm-and-ReLU backward was reading little for the ReLU. A first
# version that also routed the three stride-2 convs (their gate a pass of its own after dgrad) lost
# 2-5% in two runs (5163 against 5253, 5115 against 5399). Not used by default; where it would pay
# is the form that also takes BatchNorm's backward sums in the same epilogue (results/notebook.md),
# not built.


def relu_grad_reference(x_nhwc, w, dy_nhwc, geometry):
    """torch's dZ for z -> relu -> conv, by autograd (fp32), with z = x: the ReLU's output is relu(x)."""
    g = geometry
    z = x_nhwc.permute(0, 3, 1, 2).float().requires_grad_()
    out = torch.nn.functional.conv2d(torch.relu(z), w.permute(0, 3, 1, 2).float(), None, g.stride, g.padding,
                                     g.dilation, g.groups)
    out.backward(dy_nhwc.permute(0, 3, 1, 2).float())
    return z.grad.permute(0, 2, 3, 1)


RELU_GRAD_CASES = [   # (N, H, W, Ci, Co, R, S, stride, padding, dilation): gated in the epilogue or after
    (2, 9, 11, 24, 40, 3, 3, 1, 1, 1),       # in the epilogue
    (3, 7, 6, 72, 16, 1, 1, 1, 0, 1),        # 1x1, in the epilogue
    (2, 10, 9, 16, 24, 3, 3, 1, 2, 2),       # dilated, in the epilogue
    (2, 11, 9, 16, 24, 3, 3, 2, 1, 1),       # strided: after
    (2, 8, 8, 16, 8, 1, 1, 1, 1, 1),         # a crop (padding 1 > 0 for a 1x1): after
]


def check_dgrad_through_relu(N, H, W, Ci, Co, R, S, stride, padding, dilation, on_gpu_now):
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation,
                                  torch.bfloat16 if on_gpu_now else torch.float32,
                                  device_name=None if on_gpu_now else "cpu")
    relu_out = torch.relu(x)
    if on_gpu_now:
        def fprop(dy, w_phase, padding, dilation, groups, out_window=None, **epilogue):
            return forward.conv2d_fprop_launch(dy, w_phase, padding=padding, dilation=dilation, groups=groups,
                                                out_window=out_window, **epilogue)
        got = dgrad_through_relu(dy, w, relu_out, g, fprop, conv=side_by_side_launch, in_place=True)
    else:
        got = dgrad_through_relu(dy, w, relu_out, g, reference_fprop)
    expected = relu_grad_reference(x, w, dy, g)
    common.assert_close_to_reference(got, expected, dtype=got.dtype, K=Co * R * S)
    return relu_gated_in_epilogue(g)


@pytest.mark.parametrize("case", RELU_GRAD_CASES)
def test_dgrad_through_relu_matches_autograd_on_cpu(case):
    check_dgrad_through_relu(*case, on_gpu_now=False)


@needs_gpu
@pytest.mark.parametrize("case", RELU_GRAD_CASES)
def test_dgrad_through_relu_matches_autograd(case):
    check_dgrad_through_relu(*case, on_gpu_now=True)


def test_relu_grad_needs_its_gate():
    with pytest.raises(ValueError, match="pass residual"):
        common.check_epilogue(8, (2, 4, 4, 8), torch.bfloat16, torch.device("cpu"), activation=common.RELU_GRAD,
                              activations=forward.EPILOGUE_ACTIVATIONS)


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
def test_relu_grad_build_reads_the_gate(arch):
    # the gate arrives as the residual does, by loads in the accumulator's layout, and selects instead of adding:
    # the forward kernel's gated build has the residual build's global loads, selects where that build adds, and
    # still leaves through one TMA store
    gated, added = (common.aot_compile_or_skip("conv_tutorial.kernels.aot", "fprop_build", arch,
                                               epilogue=[False, False, True, activation])
                    for activation in (common.RELU_GRAD, "none"))
    counts = [common.ptx_instructions(build["ptx"], ["ld.global", "selp"]) for build in (gated, added)]
    assert counts[0]["ld.global"] == counts[1]["ld.global"] > 0
    assert counts[0]["selp"] > counts[1]["selp"]
    assert common.ptx_instructions(gated["ptx"], [common.PTX_TMA_STORE])[common.PTX_TMA_STORE] == 1


def run_dgrad_through_relu(on_gpu_now):
    where = [check_dgrad_through_relu(*case, on_gpu_now=on_gpu_now) for case in RELU_GRAD_CASES]
    print(f"\nReLU's backward through dgrad matches autograd on {len(where)} layers ({sum(where)} gated in the "
          f"epilogue, {len(where) - sum(where)} after), " + (common.gpu_name() if on_gpu_now else "the CPU"))


# %%
if __name__ == "__main__":
    run_dgrad_through_relu(on_gpu)

# %%
# What this lesson measured, what limits it, what comes next
# ----------------------------------------------------------
# Measured on an H100 on 2026-11-26 (`python benchmarks/backward_layers.py --operator --cuda-graphs`:
# bf16, batch 128, every distinct conv of ResNet-50; RESULTS.md, "The backward", "The operator's
# gradients" and "wgrad: x read tiled ..."): both gradients matched torch.nn.grad on every layer.
# Against cuDNN's convolution_backward, as geometric means over the 23 layers, kernels alone, this
# lesson's launchers ran at 1.01x (dgrad) and 1.01x (wgrad), and the operator's gradients
# (`conv_tutorial`, below) at **1.05x** (none below 0.92x) and **1.00x** (0.87-1.11x;
# `results/h100-2026-11-26/backward_layers_operator_cuda_graphs_wgrad_x_tiled.json`). wgrad's 1.00x
# has no margin. One layer lifts that run: cuDNN's time for the 14x14 1024->2048 stride 2 was 15-20%
# longer than in the day's other runs, and at that layer's usual 0.88x the mean is 0.997x; a
# second run of the same code gave 0.998x (lowest 0.86x). The same kernels measured 0.985-1.021x
# across runs, devices and launch paths.
#
# - The host is most of the gap in a plain call. The launchers above check their arguments, choose
#   a split, build descriptors and a workspace on every call, and dgrad runs lesson 05's plain
#   launcher once per phase, or once for all of them where section 2b applies: 454 us per dgrad
#   and 340 us per wgrad (medians over the layers in `..._phase_order.json`; cuDNN's: 38 and 39 us;
#   host times moved by up to 40% between runs), where a 1x1 layer's kernels take ~40 us. The operator's backward pays
#   less: a plan per shape for each phase's conv (the forward's runtime) and for wgrad
#   (conv_tutorial/wgrad.py), 161 us per dgrad and 88 us per wgrad; 346-624 us for the 3x3
#   stride-2 dgrads, whose one conv still goes through lesson 05's plain launcher. A training
#   step under CUDA graphs pays none of it: ResNet-50 training with these kernels ran at 1.00x
#   torch.compile's images/s with CUDA graphs on both sides (5197 against 5196, H100,
#   2026-11-26, weights read in place), 1.00-1.05x with section 10's statistics over nine runs
#   as the kernels changed (1.04-1.05x with the final ones, torch.compile's own figure moving
#   between 5093 and 5250 images/s), 0.46x without graphs (2026-11-25); RegNetY-3.2GF ran
#   at 0.96x with graphs and the final kernels, its grouped convs' gradients torch's (RESULTS.md,
#   "Training").
# - wgrad through the operator is at or above cuDNN's speed on 11 of 23 layers (up to 1.11x), its
#   lowest the 7x7 512->2048 1x1 at 0.87x (0.79-0.91x over the day's runs, our kernel the same,
#   cuDNN's between 556 and 625 TFLOPS). What moved it there:
#
#   - Section 5's split took the two 512-channel 3x3 layers with 144 tiles from 0.72-0.73x to
#     0.95-0.97x (a wave of whole tiles, then 12 tiles in slices, where every tile had been cut in
#     3), and 14x14 1024->2048 stride 2 from 0.84x to 0.96x (no split: no workspace, no second
#     kernel).
#   - Section 6's 128-pixel k-steps took the 56x56 64->64 3x3 from 0.67x to 1.00x.
#   - The stem was its worst once, 0.25x (3 input channels padded to a 16-channel box); folded as
#     section 6 ends, it runs at 1.09x, and its dgrad at 2.42x (its folded weights read in place,
#     section 2c).
#   - The 7x7 1x1 layers, 0.67-0.84x in 2 slices and a second kernel, run 64-row tiles whole.
#   - Section 3's tiled load of x and section 6's 64-row tiles for split 1x1 layers took six of the
#     seven 1x1 layers at 56x56 to 14x14 with 64-row tiles from 0.89-1.02x to 0.91-1.07x (the 14x14
#     1024->512 went from 0.94x to 0.93x), and the mean from 0.98x to 0.998-1.005x (two runs).
#
#   What did not pay:
#
#   - Summing the split tiles in the kernel (the last slice to finish adds the others' partials in
#     order): 0.73x against the second kernel's 0.98x in one run. The 1x1 layers cut into 32-63
#     slices a tile fell to 0.45-0.68x: one program reads all of a tile's partials, where the
#     second kernel spreads the sum over every SM (results/notebook.md).
#   - The sum launched early by programmatic dependent launch, a deeper ring, and cuDNN's 128 x 64
#     tile without its cluster: none beyond the runs' spread, or slower (RESULTS.md).
#
#   On the 7x7 512->2048 and 2048->512 layers Nsight Compute put our tensor pipes at 58% busy
#   against cuDNN's 72%, L2 at 51-61% of its peak for ours and 62-71% for cuDNN's, whose kernel
#   runs 128 x 64 tiles in 2-CTA clusters (RESULTS.md).
# - dgrad: section 1's one-pass flipped weights and section 2's phases stored in place moved the
#   operator's dgrad from 0.75x to 0.90x (H100, 2026-11-25), then the window store through the
#   staging buffer, all phases' weights in one launch and zeros only where no tap reaches to
#   **0.97x** (H100, 2026-11-26, `results/h100-2026-11-26/backward_layers_operator_cuda_graphs.json`;
#   0.98x in a later run, its kernels unchanged), section 2b's one launch for all phases to
#   **0.99x** (two runs), section 2c's weights read in place to **1.04x** (1 to 11% on every
#   layer, the flipped copy's 1.8-5.3 us gone), and section 2b's tile order per layer to
#   **1.05x** (1.01x without the stem). At stride 1 it runs at 0.92-1.18x of cuDNN, the 1x1
#   stride-2 layers at 1.02-1.12x, the 3x3 stride-2 layers at 1.02x (56x56), 0.93x (28x28) and
#   1.06x (14x14), where four launches had run them at 0.80x, 0.70x and 0.79x. The 14x14 layer
#   had been at 0.79x in lesson 05's tile order (72.1 us against cuDNN's 57.2, an earlier run):
#   counted on paper (`benchmarks/phase_balance.py`), some of its programs ran six 4-tap tiles (192
#   k-steps), others six 1-tap ones (48), against a mean of 107; heaviest phase first the busiest
#   runs 120, and the layer took 54.5 us (cuDNN 57.7).
# - Section 10's BatchNorm statistics: on an H200 (2026-11-25) a ResNet-50 training step ran 3.9%
#   faster with them (5969 -> 6199 images/s under CUDA graphs, torch.compile 6188), RegNetY-3.2GF
#   0.9% (its grouped convs left unfused); on an H100 (2026-11-26, the sums in one tensor) ResNet-50
#   ran 2.8% faster, 5148 -> 5290 images/s, torch.compile 5195 (its max-autotune mode ran 1.02x
#   its default in a run of its own, where it compiled in under five minutes). A profile of the
#   step (H100, 2026-11-26; RESULTS.md, "Training fusions: BatchNorm's apply and ReLU ...") shows
#   where the rest of the time goes: the convs, forward and backward, take less than cuDNN's (9.13
#   against 9.61 ms of GPU time per step), and Inductor's BatchNorm, ReLU, residual, pooling and
#   loss kernels 12.2 of 22.4 ms. So a faster step needs those passes gone. The other two fusions
#   were built and measured: neither paid (section 11's conv lost on six of the eight layers timed,
#   and left the lesson; section 12's gate left the step's speed unchanged), and neither is in the
#   operator's training path.
# - Grouped convs only where a tile keeps to one group (64 or more output channels per group for
#   wgrad; section 6), no depthwise convs, no fp8 (section 3). The grouped gradients match torch on
#   an H100 (four layers, both gradients, and the operator's on 16 random grouped layers); not timed.
#
# Next: the operator (`conv_tutorial`) takes its conv gradients from these launchers with
# `conv_tutorial.set_backward("lesson06")` (NHWC views of its channels_last tensors, torch for what
# they do not cover); it keeps PyTorch's convolution backward by default, because the figures above
# say it does not pay yet: the convs' gradients run at cuDNN's pace, and the step's time is
# mostly BatchNorm's and ReLU's. What they point to first: section 12's epilogue taking
# BatchNorm's backward sums with the gate; wgrad's 7x7 and 14x14 1x1 layers (2-CTA clusters, which
# cuDNN's kernel for the 7x7 512->2048 layer uses and lesson 05's Gluon kernel cannot yet pipeline);
# and the host time of a strided dgrad.

# %%
if __name__ == "__main__":
    print("\nlesson 06: all checks passed on " + common.gpu_name() if on_gpu else "\n" + common.cpu_closing_line(
        "06", "both mappings against torch.nn.grad, the wgrad kernel's arithmetic on the TMA model, input "
        "checks, the sm_90 and sm_100 builds of the wgrad kernel (the instructions above), ReLU's backward "
        "through dgrad against autograd (section 12)", "running dgrad, wgrad and section 12's gated dgrad on the "
        "GPU against torch, timing them (--bench, benchmarks/backward_layers.py)"))
