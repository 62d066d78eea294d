"""
Lesson 07: wgrad, the filter's gradient, as a kernel of its own
===============================================================

What you will learn:

- why dW = dY^T @ im2col(x) is an implicit GEMM again (M = Co, N_GEMM = R*S*Ci, K = N*out_h*out_w
  pixels), and why both of its operands reach the tensor cores transposed: what WGMMA and tcgen05
  allow for that (PTX ISA), and where the compiled kernel shows it;
- a warp-specialized Gluon kernel built from lesson 05's parts, with new loads and a new store;
- split-K over the pixels where a layer has few tiles, and a second kernel that adds the slices in
  a fixed order, so that dW comes out the same, bit for bit, on every run;
- the kernel's own index arithmetic run on a CPU against lesson 03's model of the TMA unit;
- how fast it runs next to cuDNN, and what limits it.

Builds on: lesson 06 (the gradients as GEMMs, its reference gradients, inputs and shapes), lesson 05
(`Im2colWindow`, `TmemAccumulators`, the ring), lesson 04 (`HopperWGMMA`), lesson 03 (the im2col
descriptor and its model). What changed since lesson 06: dgrad was lesson 05's kernel on new inputs;
wgrad reduces over the pixels, the axis the forward pass tiles, and needs a kernel of its own.

Requires: sm_90 (H100/H200) or sm_100 (B200/GB200) for the GPU runs. On a CPU: the mapping against
torch.nn.grad, the kernel's index arithmetic on the TMA model with the split-K sum in Triton's
interpreter, the sm_90 and sm_100 builds with their PTX, the input checks. The Blackwell path is
compiled and its PTX inspected here; it has not run on a Blackwell GPU.

Run:   python 07-conv-wgrad.py [--outdir out]     (timing: python benchmarks/backward_layers.py)
Tests: pytest 07-conv-wgrad.py tests/lessons/test_07_*.py
"""

# %%
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
lesson05 = common.load_lesson("05-warp-specialized-conv")         # Im2colWindow, TmemAccumulators
lesson06 = common.load_lesson("06-conv-dgrad")                    # reference gradients, inputs, shapes
# The host side this lesson does not teach comes from the operator package's kernels layer: the
# argument checks, the configs and their tuned rules, and `prepare_wgrad` (descriptors, split, grid).
from conv_tutorial.kernels.gradients import check_backward_call  # noqa: E402
from conv_tutorial.kernels.wgrad import (  # noqa: E402
    WgradConfig, check_wgrad_config, prepare_wgrad, sum_partials_launch, wgrad_config, wgrad_input,
    wgrad_kernel_options, wgrad_operands, wgrad_problem, wgrad_result)

reference_gradients, backward_inputs = lesson06.reference_gradients, lesson06.backward_inputs
Int = gl.tensor | gl.constexpr       # a run-time integer, or one Triton specialized to a constant

# %%
# Each `if __name__ == "__main__"` cell runs the demo of the section above it (importing the
# lesson runs nothing); the GPU parts run where a Hopper or Blackwell GPU is present.
if __name__ == "__main__":
    args = common.lesson_args("Lesson 07: wgrad")
    outdir, on_gpu = common.output_dir(args.outdir), common.has_tma_mma_gpu()

# %%
# 1. wgrad: a GEMM whose operands arrive transposed
# -------------------------------------------------
# Lesson 06 wrote the filter's gradient as a sum over the output pixels p = (n, oy, ox)::
#
#     dW[co, r, s, ci] = sum over p of dY[p, co] * x[n, oy*sh - ph + r*dh, ox*sw - pw + s*dw, ci]
#                      = sum over p of dY[p, co] * im2col(x)[p, (r, s, ci)]
#
# that is dW = dY^T @ im2col(x), with M = Co, N_GEMM = R*S*Ci and K = N*out_h*out_w. A tile of dW is
# BLOCK_M output channels x BLOCK_N input channels of one tap (r, s); its k-steps walk the pixels,
# BLOCK_K at a time. What a k-step loads is what lesson 05 loads, turned around:
#
# - A: dY, the 2-D [pixels, Co] matrix an NHWC tensor is, a tiled TMA box [BLOCK_K, BLOCK_M] at
#   (p0, co0). In shared memory its M index (co) is the contiguous one: an *M-major* A, where
#   lesson 05's A (pixels x channels, the GEMM's K contiguous) was K-major.
# - B: x's im2col box for tap (r, s), lesson 05's descriptor and window at the offsets (r*dh, s*dw):
#   BLOCK_K output pixels x BLOCK_N channels. Its N index (ci) is contiguous: an *N-major* B, where
#   lesson 05's B (filters x channels) was K-major.
# - A 1x1 conv at stride 1 without padding needs no im2col (`x_reads_tiled`): pixel p reads pixel
#   p, so a tiled box of x as [pixels, Ci] fills the stage with the same bytes, without the box
#   origin's three integer divisions per k-step (the kernel reads it from its x descriptor's rank).
#
# The MMA gets A as `dy_tile.permute((1, 0))`, a [BLOCK_M, BLOCK_K] view of the same bytes, and B
# as the im2col tile as it lies, [BLOCK_K, BLOCK_N]. Whether the tensor cores read operands that
# way is the architecture's call:
#
# - Hopper. `wgmma.mma_async` reads shared-memory operands through matrix descriptors, K-major by
#   default; its immediates imm-trans-a and imm-trans-b ask for the transposed (M- or N-major)
#   layout, and the PTX ISA (wgmma.mma_async) allows that "only for the wgmma.mma_async variants
#   with .f16/.bf16 types on matrices accessed from shared memory using matrix descriptors". The
#   tf32, e4m3/e5m2 and integer forms have no transposed operands: an fp8 wgrad on Hopper would need
#   a transposing copy first. So this kernel runs in fp16 and bf16.
# - Blackwell. `tcgen05.mma` takes a 32-bit instruction descriptor whose bits 15 and 16 are
#   "Transpose A Matrix" and "Transpose B Matrix", defined for .kind::tf32, ::f16, ::f8f6f4 and ::i8
#   (PTX ISA, tcgen05, "Instruction descriptor").
#
# Section 5 finds both in the compiled kernel. First the mapping itself, in a few lines of torch
# (`wgrad_reference`): im2col(x) built explicitly with `unfold`, dY^T @ im2col(x) group by group,
# over slices of the pixels whose partial products are added in order (section 3's split).


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
    for partial in partials[1:]:       # dW = dY[slice 0]^T @ im2col(x)[slice 0] + dY[slice 1]^T @ ... in order
        total = total + partial
    return total.reshape(g.Co, g.R, g.S, g.Ci_group)


def run_wgrad_reference(N=2, H=10, W=11, Ci=4, Co=6, R=3, S=5, stride=(1, 2), padding=(2, 0), dilation=(2, 1),
                        split_k=3, groups=1, show=True):
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.float32, device_name="cpu",
                                  groups=groups)
    dw, expected = wgrad_reference(x, dy, g, split_k), reference_gradients(x, w, dy, g)[1]
    if show:
        print(f"\ndY^T @ im2col(x) for {g.describe()}, in {split_k} slices of the {g.M} pixels: largest difference "
              f"from torch.nn.grad.conv2d_weight {(dw - expected).abs().max().item():.1e}")
    torch.testing.assert_close(dw, expected, rtol=1e-4, atol=1e-4)      # fp32, two summation orders


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, split_k", [
    (3, 9, 7, 6, 5, 3, 3, 2, 1, 1, 5),                   # stride 2, slices of uneven length
    (2, 10, 11, 4, 6, 3, 5, (1, 2), (2, 0), (2, 1), 3),  # per-axis stride, padding, dilation
])
def test_wgrad_reference_matches_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation, split_k):
    run_wgrad_reference(N, H, W, Ci, Co, R, S, stride, padding, dilation, split_k, show=False)


# %%
if __name__ == "__main__":
    run_wgrad_reference()

# %%
# What you should see: a difference of a few 1e-6, fp32 sums of 80 products taken in two orders.
#
# 2. The wgrad kernel
# -------------------
# Lesson 05's design with new loads and a new store: a persistent grid, a ring of NUM_BUFFERS
# stages with ready/empty barriers (lesson 05, section 1), a one-warp loader, and lesson 05's MMA
# and epilogue partitions: on Hopper one warpgroup that issues the WGMMAs and stores; on Blackwell
# a one-warp tcgen05 issuer and an epilogue warpgroup, joined by lesson 05's double-buffered
# accumulator in tensor memory. Reused as they are: `common.Counter` and `allocate_barrier_pairs`,
# lesson 04's `HopperWGMMA`, lesson 05's `Im2colWindow.pixel_box_origin` (where the im2col box of
# output pixels p0, p0+1, ... starts in x) and `TmemAccumulators`. One unit of work is a tile of dW
# and a slice of the pixels (section 3)::
#
#     co0, tap (r, s), c0, k-steps [k_begin, k_end), split = work(unit)
#     acc = zeros(BLOCK_M, BLOCK_N)                                     # fp32
#     for k in range(k_begin, k_end):                                   # BLOCK_K pixels each
#         p0 = k * BLOCK_K;  (n, y, x) = pixel_box_origin(p0)
#         A^T = load(dy2d, [p0, co0])                                   # [BLOCK_K, BLOCK_M], M-major
#         B = im2col_load(x, [n, y, x, c0], offsets=[r*dh, s*dw])       # [BLOCK_K, BLOCK_N], N-major
#             (or B = load(x2d, [p0, c0]) where x_reads_tiled)
#         acc += A @ B                                                  # A = (A^T)^T, a view
#     if split < 0:   dW[co0:co0+BLOCK_M, tap, c0:c0+BLOCK_N] = acc    # a whole tile
#     else:           partial[split, tile - whole_tiles] = acc          # a slice (section 3), fp32
#     (both stores masked to co < Co and ci < Ci / groups)
#
# The edges take care of themselves. The last pixel block runs past the last pixel: its dY rows
# lie outside the tensor, so TMA fills them with zeros, and whatever the im2col box holds there is
# multiplied by those zeros. Channels past Ci are zeros in x (outside the tensor, or lesson 04's
# channel padding) and are masked in the store, as are rows past Co. A grouped conv (lesson 05,
# section 10) is `groups` small wgrads side by side: a tile's rows belong to group co0 // (Co /
# groups), so its boxes start at that group's first channel (`group_channel`) plus its own c0.


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
    split: Int        # which slice of the pixels (section 3); -1: a tile run whole
    tile: Int         # the tile's number: tiles past whole_tiles have a place in the workspace


@gluon.jit
def wgrad_work_unit(unit, shape):
    # (tile, k_begin, k_end, split) of a unit. Units [0, whole_tiles) are tiles run whole (split -1); then
    # split_k slices of each other tile (section 3), one slice's units numbered together, so programs side by
    # side read the same pixels of dY and x (from L2). Without branches: `sliced` is 1 for a slice, else 0.
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
    # are neighbours. The kernel and section 3's sum (a plain Triton kernel) both call it.
    pid_m = tile % num_pid_m
    pid_n = tile // num_pid_m          # (tap, channel block)
    return pid_m * BLOCK_M, pid_n // ci_blocks, pid_n % ci_blocks * BLOCK_N


@gluon.jit
def tap_offsets(tap, shape):
    # the im2col offsets [r*dh, s*dw] of tap r*S + s (16-bit, as the instruction takes them)
    return [((tap // shape.S) * shape.dil_h).to(gl.int16), ((tap % shape.S) * shape.dil_w).to(gl.int16)]


@gluon.aggregate
class WgradSchedule:
    # the shape's integers, each a field of its own: a tuple held whole in an aggregate hung lesson 05's kernel
    # where Triton passed one of its integers as a constant (diagnosed in lesson 08: a ring counter built from it
    # was not carried around the loop)
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
        x_channel = window.group_channel(work.co0) + work.c0     # the box's first channel (the group's + c0)
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
# 3. Split-K, and a sum that gives the same bits on every run
# -----------------------------------------------------------
# wgrad's tiles are few and its K is long. ResNet-50's 3x3 64->64 convs at batch 128 have 9 tiles
# of 64 x 64 for an H100's 132 SMs, each summing 128 x 56 x 56 = 401,408 pixels: without a split,
# 123 SMs would idle. So a tile's pixels are cut into split_k slices, each a unit of work that
# writes its fp32 partial sum to a workspace, partial[split, tile - whole_tiles], and a second
# kernel adds the slices, casts, and stores the tile into dW.
#
# Which tiles to split is lesson 05's rule (its section 7): with P programs, the tiles of the full
# waves run whole and store straight into dW; only the r tiles of the last, partial wave are cut,
# so that their slices fill one more wave (all of them, where there are fewer tiles than SMs).
# ResNet-50's 7x7 512->512 3x3 has 144 tiles of 128 x 128 for 132 SMs: 132 run whole and the other
# 12 go in 7 slices, 216 units; cutting every tile in 3 would make 432 units (four waves, the last
# 36 units on 132 SMs) and 27 MiB of partial tiles to write and read back. How many slices comes
# from an estimate of the time on the shape's arithmetic (`choose_split`, in
# conv_tutorial/kernels/wgrad.py, with an H100's constants; the timings that chose it are in
# results/notebook.md, "wgrad's tile rules"): the 3x3 64->64 layer above gets 14 slices.
#
# The second kernel adds partial[0] + partial[1] + ... in that order, for every element of a split
# tile. Floating-point addition is not associative, so the order is what makes the result
# reproducible: atomics would add the slices in whatever order they finish, and could give other
# bits on the next run. Here each element's sum is fixed by the shapes and the GPU's SM count (which
# sets the split): on one GPU, dW is the same on every run.


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


# %%
# The launcher
# ------------
# `conv2d_wgrad_launch` checks its arguments (`check_backward_call`; grouped convs where a tile keeps
# to one group: Co/groups a multiple of 64, Ci/groups of 8), lets the package's `prepare_wgrad`
# build the launch (x padded to 16-byte pixels as in lesson 04, its descriptor, dY's,
# `default_wgrad_config`'s tile, the split, the workspace, the grid), runs the kernel, then the sum.
# The tile is 64 or 128 output channels by up to 128 input channels of one tap, narrower where the
# channels fill wide tiles badly: 160 channels take 2 x 128 columns (62% used) or 3 x 64 (83%), and
# `least_padded_config` weighs that against the narrower tile's lower rate.
#
# One layer fits these tiles badly: ResNet-50's stem, 7x7 at stride 2 on 3 channels read in
# 16-channel boxes, 49 taps x 16 columns of MMA work for 49 x 3 useful ones. The launcher runs it
# folded (`wgrad_problem`): the stride goes into the channels (space-to-depth), which makes the stem
# a stride-1 4x4 conv on 12 channels, and a row of its taps then goes into the channels too: 4 taps
# of one 64-channel box. The fold only re-indexes x and adds zero taps, so dW is the folded conv's,
# re-indexed back (`wgrad_result`). The derivation and its tests live in the package
# (conv_tutorial/kernels/gradients.py, `stride_fold`; wgrad.py, `wgrad_problem`).


def conv2d_wgrad_launch(x_nhwc, dy_nhwc, w_shape, stride=1, padding=0, dilation=1, groups=1, config=None):
    """dW [Co, R, S, Ci / groups] (w_shape) of a conv of x [N, H, W, Ci] from dY [N, out_h, out_w, Co]
    (fp16 or bf16, contiguous NHWC, on a Hopper or Blackwell GPU), in x's dtype: the wgrad kernel,
    then the ordered sum of its slices. `config`: a WgradConfig of the conv the kernel runs."""
    g = check_backward_call({"x_nhwc": x_nhwc, "dy_nhwc": dy_nhwc}, getattr(x_nhwc, "shape", None), w_shape,
                            stride, padding, dilation, groups)
    arch, num_sms = common.tma_mma_arch_and_sms("conv2d_wgrad_launch")
    problem = wgrad_problem(g, x_nhwc.element_size())   # the stem: folded (above)
    g_run = problem.geometry
    launch = prepare_wgrad(wgrad_input(x_nhwc, problem), dy_nhwc, g_run, config, arch, num_sms)
    check_wgrad_config(launch.config, arch)
    dw = torch.empty(g_run.Co, g_run.R * g_run.S * g_run.Ci_group, device=x_nhwc.device, dtype=x_nhwc.dtype)
    conv2d_wgrad_kernel[launch.grid](*launch.kernel_args(dw), **wgrad_kernel_options(launch.config, arch))
    if launch.partial is not None:
        sum_partials(launch, dw)
    return wgrad_result(dw.view(g_run.Co, g_run.R, g_run.S, g_run.Ci_group), g, problem)


# %%
# 4. The kernel, run on a CPU
# ---------------------------
# No CPU runs a Gluon kernel, but its index arithmetic is plain integer Python: `run_wgrad_model`
# calls the kernel's own `wgrad_work_unit`, `wgrad_tile_origin`, `tap_offsets` and lesson 05's
# `pixel_box_origin` and `group_channel` (through `.fn`, on `common.PlainInt` values) and feeds what
# they compute to lesson 03's model of the im2col load and to a model of the tiled load (zeros
# outside the tensor). Unit by unit, k-step by k-step, with the launcher's descriptor settings and
# split, it computes acc += A @ B, stores a whole tile into dW and a slice into the workspace, and
# adds the slices with section 3's kernel (on 5 programs: some tiles whole, some in slices).


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
    for unit in range(wgrad_unit_count.fn(shape.num_pid_m * shape.num_pid_n, shape.whole_tiles, shape.split_k)):
        tile, k_begin, k_end, split = wgrad_work_unit.fn(P(unit), shape)
        co0, tap, c0 = wgrad_tile_origin.fn(tile, shape.num_pid_m, shape.ci_blocks, BM, BN)
        offsets = tap_offsets.fn(P(tap), shape)
        x_channel = lesson05.Im2colWindow.group_channel.fn(shape, P(co0)) + c0    # the loader's
        acc = torch.zeros(BM, BN)
        for k in range(k_begin, k_end):
            a_t = torch.zeros(BK, BM)                         # the tiled load of dY: zeros outside
            box = dy_2d[k * BK:(k + 1) * BK, co0:co0 + BM]
            a_t[:box.shape[0], :box.shape[1]] = box
            if x_padded.dim() == 2:                           # x_reads_tiled: the tiled load, zeros outside x
                b = torch.zeros(BK, BN)
                box = x_padded[k * BK:(k + 1) * BK, x_channel:x_channel + BN]
                b[:box.shape[0], :box.shape[1]] = box
            else:
                n, y, x0 = lesson05.Im2colWindow.pixel_box_origin.fn(shape, P(k * BK))
                b, _ = im2col_reference(x_padded, BK, BN, *corners, [n, y, x0, x_channel], offsets)
            acc += a_t.T @ b                                  # acc += A @ B
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
    torch.testing.assert_close(dw, expected, rtol=0, atol=0)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, config, groups", [
    (2, 6, 7, 12, 20, 3, 2, 1, 1, 1, None, 1),       # Ci, Co not multiples of the tile; boxes across images
    (2, 5, 7, 12, 20, 1, 1, 1, 0, 1, None, 1),       # 1x1 at stride 1: x read tiled (x_reads_tiled)
    (2, 6, 7, 24, 64, 3, 3, 2, 1, 1, WgradConfig(16, 8, 8, num_buffers=2, split_k=2), 4),   # 6 channels a group:
])                                                   # a box reads 2 of the next group's, which the store masks
def test_wgrad_kernel_arithmetic_on_the_tma_model(N, H, W, Ci, Co, R, S, stride, padding, dilation, config, groups):
    run_wgrad_model(N, H, W, Ci, Co, R, S, stride, padding, dilation, config, show=False, groups=groups)


# %%
if __name__ == "__main__":
    run_wgrad_model()

# %%
# What you should see: 2 x 12 tiles of 16x8, 12 k-steps of 8 pixels, 20 tiles whole and the rest in 3
# slices, and a difference of exactly 0.0e+00: small integers make every sum exact, in any order.
#
# 5. What the compiler produced (no GPU needed)
# ---------------------------------------------
# The kernel built ahead of time for a ResNet-like layer (N=2, 16x16, 64 -> 128 channels, 3x3, bf16)
# with `wgrad_config`'s tile: 128 output x 64 input channels and 128 pixels per k-step (a tile this
# small takes 128, so its MMAs are not small next to a k-step's fixed costs), 4 stages, 2 slices.
# Counts are instructions in the program text; the k-step loop's body appears once, so a count in
# it is per k-step. Warps as lesson 05 counts them: 4 MMA/epilogue warps and the 1-warp workers
# padded to a warpgroup, 8.

TAUGHT_PTX = {
    "sm_90": [
        (common.PTX_TILED_LOAD, "A, dY as [pixels, Co]: a tiled box of 128 pixels x 128 output channels, as two "
                                "messages of 64 channels (the 128-byte swizzle's width, 64 bf16)."),
        (common.PTX_IM2COL_LOAD, "B, x's im2col box for the unit's tap: 128 pixels x 64 channels, lesson 05's "
                                 "instruction with the tap's offsets last, now on the GEMM's B side."),
        ("wgmma.mma_async", "m64n64k16: 2 row blocks of 64 x 8 steps of 16 pixels = 16 per k-step. The last four "
                            "values are imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b: 1, 1, 1, 1, both "
                            "operands read transposed (MN-major). Lesson 05's forward WGMMAs end in 1, 1, 0, 0."),
    ],
    "sm_100": [
        (common.PTX_TILED_LOAD, "A, dY's tiled box, as on sm_90."),
        (common.PTX_IM2COL_LOAD, "B, the im2col box, as on sm_90."),
        ("tcgen05.mma", "One thread issues M=128, N=64, K=16 each: 128 pixels / 16 = 8 per k-step. Its fourth "
                        "operand is the instruction descriptor, moved into a register before it (decoded below)."),
        ("tcgen05.commit", "Per k-step (the stage is free) and per unit (the accumulator is ready)."),
        ("tcgen05.ld", "The epilogue reads the fp32 accumulator from tensor memory before the store."),
    ],
}


def aot_conv2d_wgrad(arch, N=2, H=16, W=16, Ci=64, Co=128, R=3, S=3, stride=1, padding=1, split_k=2,
                     default_config=False):
    """(kernel, args, kwargs) on CPU tensors, for common.aot_compile (default_config: the launcher's
    config for an H100's 132 SMs instead of wgrad_config's tile in split_k slices)."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, torch.bfloat16, device_name="cpu")
    config = None if default_config else wgrad_config(Co, Ci)._replace(split_k=split_k)
    launch = prepare_wgrad(x, dy, g, config, arch, 132)
    dw = torch.empty(Co, R * S * Ci, dtype=x.dtype)
    return conv2d_wgrad_kernel, launch.kernel_args(dw), wgrad_kernel_options(launch.config, arch)


def run_show_ptx():
    report = common.show_ptx("07-conv-wgrad", "aot_conv2d_wgrad", TAUGHT_PTX,
                             lambda arch, compiled: f"conv2d_wgrad_kernel, 128x64x128 tiles, 4 stages: "
                                                    f"{compiled['num_warps']} warps in all")
    for arch in report:
        ours = common.aot_compile("07-conv-wgrad", "aot_conv2d_wgrad", arch)["ptx"]
        (a, b), (fa, fb) = (common.transposed_operands(ptx, arch) for ptx in (ours, common.aot_compile(
            "05-warp-specialized-conv", "aot_conv2d_fprop", arch)["ptx"]))
        where = "imm-trans-a, imm-trans-b" if arch == "sm_90" else "instruction descriptor bits 15, 16"
        print(f"\n{arch}: operands transposed ({where}): wgrad A={a}, B={b}; lesson 05's fprop A={fa}, B={fb}")
        if arch == "sm_100":
            d = common.tcgen05_instruction_descriptor(ours)
            print(f"   descriptor {d} = {d:#x}: D type {d >> 4 & 3} (f32), A and B types {d >> 7 & 7}, "
                  f"{d >> 10 & 7} (bf16), transpose A {d >> 15 & 1}, B {d >> 16 & 1}, N = 8 x {d >> 17 & 63}, "
                  f"M = 16 x {d >> 24 & 31}")


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
def test_kernel_compiles_with_expected_instructions(arch):
    compiled = common.assert_ptx_teaches("07-conv-wgrad", "aot_conv2d_wgrad", arch, TAUGHT_PTX)
    assert common.transposed_operands(compiled["ptx"], arch) == (1, 1)
    mma, other_mma = ("wgmma.mma_async", "tcgen05.mma") if arch == "sm_90" else ("tcgen05.mma", "wgmma.mma_async")
    counts = common.ptx_instructions(compiled["ptx"], [mma, other_mma])
    # per k-step: 128 pixels in steps of 16, times 2 row blocks of 64 on Hopper (one 128-row MMA on Blackwell)
    assert counts == {mma: 16 if arch == "sm_90" else 8, other_mma: 0}


# %%
if __name__ == "__main__":
    run_show_ptx()

# %%
# What you should see, after the two tables (16 WGMMAs ending in 1, 1, 1, 1; 8 tcgen05.mma)::
#
#     sm_90: operands transposed (imm-trans-a, imm-trans-b): wgrad A=1, B=1; lesson 05's fprop A=0, B=0
#     sm_100: operands transposed (instruction descriptor bits 15, 16): wgrad A=1, B=1; lesson 05's fprop A=0, B=0
#        descriptor 135365776 = 0x8118490: D type 1 (f32), A and B types 1, 1 (bf16), transpose A 1, B 1,
#        N = 8 x 8, M = 16 x 8
#
# Both builds read both operands transposed, where lesson 05's forward kernel reads neither. On
# sm_100 the descriptor says more than the two bits: an fp32 accumulator (D type 1), bf16 operands
# (types 1), and the MMA's shape, N = 64 and M = 128, the tile.
#
# 6. Input checks
# ---------------
# The launcher refuses what it does not run with an error that names the argument: other dtypes, a
# dY whose shape is not the conv's output, grouped convs whose groups a tile cannot keep to,
# non-contiguous tensors, tensors off the GPU (checked last).

BAD_CALLS = [   # (arguments changed from a valid call: a function of (x, w, dy), error, message)
    (lambda x, w, dy: {"groups": 2, "w_shape": (16, 3, 3, 4)}, ValueError, "groups=2: wgrad takes"),
    (lambda x, w, dy: {"x_nhwc": x.half()}, TypeError, "x_nhwc is torch.float16"),
    (lambda x, w, dy: {"dy_nhwc": dy[:, :, :7]}, ValueError, "contiguous"),
    (lambda x, w, dy: {"w_shape": (16, 3, 3)}, TypeError, "w_shape must be 4 ints"),
    (lambda x, w, dy: {}, ValueError, "CUDA GPU"),         # CPU tensors: refused last
]


@pytest.mark.parametrize("changes, error, message", BAD_CALLS)
def test_rejects_bad_calls(changes, error, message):
    x, w, dy, _ = backward_inputs(1, 8, 8, 8, 16, 3, 3, 1, 1, 1, torch.bfloat16, device_name="cpu")
    valid = dict(x_nhwc=x, dy_nhwc=dy, w_shape=w.shape, padding=1)
    with pytest.raises(error, match=re.escape(message)):
        conv2d_wgrad_launch(**{**valid, **changes(x, w, dy)})


# %%
# 7. Checks against torch (GPU)
# -----------------------------
# wgrad on the GPU against torch.nn.grad's fp32 dW of the same fp16/bf16 values, over lesson 06's
# awkward shapes (Ci = 3, Co not a multiple of the tile or of 8, strides 2 and 3, dilation, padding
# past the filter, non-square). The tolerance is common.assert_close_to_reference's,
# with K = N*out_h*out_w, the length of each element's sum: every product of two fp16/bf16 values is
# exact in the fp32 accumulator, the fp32 sums differ from torch's by fp32 rounding only, and the
# one rounding to bf16 at the end costs at most 2^-8 = 0.4% of the value (bf16 keeps 8 significant
# bits; fp16 11: 0.05%), so rtol 2e-2 (fp16 2e-3) holds with room to spare. An element that cancels
# towards zero keeps an error of the size of its terms: a sum of K random products is about sqrt(K)
# products large, so the absolute tolerance grows as rtol * sqrt(K) / 8. The slices are added in a
# fixed order, so a second run must give the same bits.


def check_wgrad(N, H, W, Ci, Co, R, S, stride=1, padding=0, dilation=1, dtype=torch.bfloat16, config=None, seed=0,
                groups=1):
    """Run conv2d_wgrad_launch and compare its dW with torch.nn.grad's."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, seed, groups=groups)
    out = conv2d_wgrad_launch(x, dy, w.shape, stride, padding, dilation, groups, config=config)
    expected = reference_gradients(x, w, dy, g)[1]
    assert out.shape == expected.shape and out.dtype == dtype, (out.shape, out.dtype)
    common.assert_close_to_reference(out, expected, dtype=dtype, K=g.M)
    return out


needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", lesson06.AWKWARD_SHAPES)
def test_wgrad_matches_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation):
    check_wgrad(N, H, W, Ci, Co, R, S, stride, padding, dilation)


@needs_gpu
def test_wgrad_gives_the_same_bits_every_run():
    x, w, dy, g = backward_inputs(8, 28, 28, 64, 64, 3, 3, 1, 1)      # 9 tiles, every one split
    first = conv2d_wgrad_launch(x, dy, w.shape, 1, 1)
    assert all(torch.equal(first, conv2d_wgrad_launch(x, dy, w.shape, 1, 1)) for _ in range(3))


def run_wgrad_checks():
    check_wgrad(4, 28, 28, 128, 128, 3, 3, 2, 1)
    check_wgrad(2, 20, 18, 3, 64, 7, 7, 2, 3)          # the stem, folded
    print(f"\nconv2d_wgrad_launch matches torch.nn.grad on {common.gpu_name()}")


# %%
if __name__ == "__main__" and on_gpu:
    run_wgrad_checks()

# %%
# What this lesson measured, what limits it, what comes next
# ----------------------------------------------------------
# Measured on an H100 80GB HBM3 on 2026-11-27, the run lesson 06 quotes:
# results/h100-2026-11-27/backward_layers_operator_cuda_graphs.json (`python
# benchmarks/backward_layers.py --operator --cuda-graphs`: bf16, batch 128, every distinct conv of
# ResNet-50, each call replayed in a CUDA graph, the kernels without the host). This lesson's
# launcher against cuDNN's convolution_backward, TFLOPS of useful FLOPs, a few of the 23 layers::
#
#     layer                            ours  cuDNN  ratio   tiles whole, slices
#     RN50 stem 224 3->64 7x7 s2       54.8   50.1  1.09x     0, 33
#     RN50 56x56 64->64 3x3           383.6  380.7  1.01x     0, 14
#     RN50 28x28 128->128 3x3         576.9  499.2  1.16x     0, 14
#     RN50 14x14 256->256 3x3         506.4  512.8  0.99x     0,  7
#     RN50 7x7 512->512 3x3           566.7  560.8  1.01x   132,  7
#     RN50 7x7 512->2048 1x1          493.2  584.2  0.84x   128,  1
#     RN50 14x14 1024->2048 1x1 s2    533.5  593.9  0.90x   128,  1
#     RN50 7x7 2048->512 1x1          591.3  537.4  1.10x   128,  1
#
# Over the 23 layers: 1.01x cuDNN (geometric mean), 14 layers at or above its speed. What limits it:
#
# - The 1x1 layers with few pixels, where cuDNN runs clusters. The 7x7 512->2048 is the lowest,
#   0.84x: 128 tiles of 64 x 128, whole, in one wave, 26.7 us against 22.5. Nsight Compute put
#   cuDNN's kernel for it at 128 x 64 tiles in 2-CTA clusters with busier tensor pipes than ours
#   (results/notebook.md, "What limits wgrad's 1x1 layers", where other tiles and splits of ours lost too).
# - Clusters are what Gluon 3.9 cannot pipeline on Hopper. A pair of CTAs can load a shared tile
#   once (TMA multicast runs), but before the leader refills a shared stage the other CTA's consumer
#   must arrive on the leader's barrier, and `mbarrier.arrive(from_cta=...)` keeps a mask of CTA-ID
#   bits: 0 sends CTA 0's arrive to every CTA; no value sends CTA 1's to CTA 0 (results/notebook.md,
#   "Clusters with TMA multicast"). So this kernel, like lesson 05's, runs one CTA per tile.
# - The host, in a plain call: the launcher checks, chooses a split and builds descriptors and a
#   workspace on every call, a median of 433 us per call over the 23 layers in the same run against
#   cuDNN's 45 us, where the kernels take 22-551 us. The operator keeps a plan per shape (105 us);
#   a training step replayed in a CUDA graph pays none of it.
#
# Next: lesson 08 (08-training-fusions.py). With both gradients at cuDNN's pace (the operator's dgrad
# at 1.05x and wgrad at 1.00x in the same run), what limits a training step is the passes around the convs:
# BatchNorm, ReLU, the residual adds, and which of them a conv's epilogue or load can take over.

# %%
if __name__ == "__main__":
    print("\nlesson 07: all checks passed on " + common.gpu_name() if on_gpu else "\n" + common.cpu_closing_line(
        "07", "the mapping against torch.nn.grad, the wgrad kernel's arithmetic on the TMA model with the split "
        "sum in the interpreter, the sm_90 and sm_100 builds (the instructions above)",
        "running wgrad on the GPU against torch (timing: benchmarks/backward_layers.py)"))
