"""wgrad, dW of a conv, as its own warp-specialized kernel (lesson 07 teaches it): dW = dY^T @ im2col(x),
with dY and x read as transposed (MN-major) operands, K the pixels, and split-K over the pixels
summed in a fixed order by a second kernel, so every run gives the same bits; its configs, the
tuned tile and split rules, and the launcher's preparation (`prepare_wgrad`)."""
import collections
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout, allocate_tensor_memory, tcgen05_commit, tcgen05_mma)
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ..core.device import MMA_FLAVOUR
from ..core.geometry import conv_geometry
from ..core.tma import GL_DTYPES, canonical_strides, conv_im2col_settings
from . import fprop
from .blocks import Counter, HopperWGMMA, allocate_barrier_pairs
from .gradients import StrideFold, channel_box, fold_input, stride_fold, unfold_weight_grad

Int = gl.tensor | gl.constexpr       # a run-time integer, or one Triton specialized to a constant


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
    split: Int        # which slice of the pixels (lesson 07's split-K); -1: a tile run whole
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
    # are neighbours. The kernel and the split-K sum (a plain Triton kernel) both call it.
    pid_m = tile % num_pid_m
    pid_n = tile // num_pid_m          # (tap, channel block)
    return pid_m * BLOCK_M, pid_n // ci_blocks, pid_n % ci_blocks * BLOCK_N


@gluon.jit
def tap_offsets(tap, shape):
    # the im2col offsets [r*dh, s*dw] of tap r*S + s (16-bit, as the instruction takes them)
    return [((tap // shape.S) * shape.dil_h).to(gl.int16), ((tap % shape.S) * shape.dil_w).to(gl.int16)]


@gluon.aggregate
class WgradSchedule:
    # the WgradShape's fields the partitions read, each its own field: a shape tuple held whole in an
    # aggregate hangs where Triton passes one of the tuple's integers as a constant (results/notebook.md)
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
    state = Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        offsets = tap_offsets(work.tap, schedule)
        # the box's first channel: c0, counted from the group's first channel if grouped
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
    state = Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        mma = HopperWGMMA.initialize(ring.x_bufs.dtype, BLOCK_M, BLOCK_N, gl.num_warps())
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
    state = Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    acc_state = Counter(gl.to_tensor(0), acc.NUM_ACC)
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
    acc_state = Counter(gl.to_tensor(0), acc.NUM_ACC)
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
    ready, empty = allocate_barrier_pairs(NUM_BUFFERS)
    ring = WgradRing(dy_bufs, x_bufs, ready, empty, NUM_BUFFERS)
    (Co, Ci_group, Co_group, taps, S, num_pid_m, num_pid_n, ci_blocks, k_blocks, split_k, whole_tiles, split_tiles,
     out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w) = shape
    schedule = WgradSchedule(Co, Ci_group, taps, S, num_pid_m, num_pid_n, ci_blocks, k_blocks, split_k, whole_tiles,
                             split_tiles, dil_h, dil_w, BLOCK_M, BLOCK_N)
    # lesson 05's window: its pixel_box_origin, and (grouped convs) its group_channel
    window = fprop.Im2colWindow(out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, Ci_group, Co_group, S,
                                   ci_blocks, None, None)
    if IS_BLACKWELL:
        NUM_ACC: gl.constexpr = 2
        acc_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N],
                                          TensorMemoryLayout([BLOCK_M, BLOCK_N], col_stride=1))
        acc_ready, acc_empty = allocate_barrier_pairs(NUM_ACC)
        acc = fprop.TmemAccumulators(acc_tmem, acc_tmem, acc_ready, acc_empty, NUM_ACC)   # (no tail)
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


def workspace_k_steps(block_k):
    # What writing and reading back one slice's fp32 partial tile costs, in the time of one SM's k-step:
    # 8 bytes per element through HBM (an H100's 3.35 TB/s, for the whole GPU) against a k-step's
    # 2 * block_k FLOPs per element at one SM's share of ~600 TFLOPS (lesson 05's kernel on an H100):
    # 8 * 600/132 / (3.35 * 2 * block_k) = 5.4 / block_k, rounded up to err toward fewer slices
    return 6 / block_k


def choose_split(tiles, k_blocks, num_sms, block_k=64):
    """Slices per split tile, the tiles of the full waves running whole: the least estimated time, in
    k-steps of one SM, over 1 to 64 slices; within 2% of the least, the fewest partial tiles.
    Arithmetic on the shape."""
    waves, rest = divmod(tiles, num_sms)
    options = []
    for split_k in range(1, min(64, k_blocks) + 1) if rest else (1,):
        partial_tiles = rest * split_k if split_k > 1 else 0
        steps = (waves * k_blocks + -(-rest * split_k // num_sms) * -(-k_blocks // split_k)
                 + partial_tiles * workspace_k_steps(block_k))
        options.append((partial_tiles, steps, split_k))
    least = min(option[1] for option in options)
    return min(option for option in options if option[1] <= 1.02 * least)[2]


def wgrad_split(tiles, split_k, num_sms):
    """(programs, whole tiles, split tiles) of a launch: the persistent grid, and lesson 05's rule for
    which tiles run whole (those of the full waves; all of them without a split)."""
    programs = min(num_sms, tiles * split_k)
    whole_tiles = fprop.whole_tile_count.fn(tiles, programs, split_k)
    return programs, whole_tiles, tiles - whole_tiles


# Triton compiles a kernel once per specialization of its integer arguments (each one equal to 1, or divisible
# by 16, or neither): the counts below only steer each program's scalar arithmetic, so they are left
# unspecialized, and one program serves every layer whose tile, dtypes and Co, Ci_group alignments it shares
# (fewer compiles in a network's first step: RESULTS.md, "Compiled while torch.compile traces"). Co and
# Ci_group stay specialized: they place dW's rows and mask its columns, which 16-byte vector stores need aligned.
@triton.jit(do_not_specialize=["taps", "num_pid_m", "ci_blocks", "whole_tiles", "split_tiles", "split_k"])
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


def sum_partials_launch(launch, dw):
    """(grid, args, constexprs) of the second kernel: the workspace's slices added into dw's split tiles."""
    s, (block_m, block_n) = launch.shape, launch.config[:2]
    # 256 values per program, so that a few split tiles still spread over many SMs (not timed against other sizes)
    block = min(256, block_m * block_n)
    grid = (launch.partial.shape[1], block_m * block_n // block)
    args = (launch.partial, dw, s.Co, s.Ci_group, s.taps, s.num_pid_m, s.ci_blocks, s.whole_tiles, s.split_tiles,
            s.split_k)
    return grid, args, dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK=block, enable_fp_fusion=True)


class WgradConfig(NamedTuple):
    block_m: int            # output channels per tile (the GEMM's M)
    block_n: int            # input channels per tile, within one tap (its N)
    block_k: int = 64       # pixels per k-step (its K)
    num_buffers: int = 4    # stages in the ring
    num_warps: int = 4      # warps of the MMA/epilogue partition
    split_k: int = 0        # slices of the pixels of a split tile; 0: choose_split's choice
    programs: int = 0       # persistent programs; 0: one per SM (tests set fewer to have whole and split tiles)


def wgrad_config(Co, Ci_padded, groups=1):
    # grouped (Co / groups a multiple of 64: check_backward_call), a tile's rows stay in one group
    Co_group = Co // groups
    block_m = 64 if Co_group <= 64 or (groups > 1 and Co_group % 128) else 128
    block_n = min(128, channel_box(Ci_padded // groups))
    return WgradConfig(block_m, block_n, pixels_per_k_step(block_m, block_n))


def pixels_per_k_step(block_m, block_n):
    # 128 pixels a k-step for a tile of 128 x 64 elements or fewer, whose MMAs per k-step are small next to the
    # k-step's fixed costs; else 64
    return 128 if block_m * block_n <= 128 * 64 else 64


# A tile's MMA rate against a 128 x 128 tile's, by its rows and by its columns (a 64 x 64 tile: 0.9 x 0.9),
# and the 10% margin least_padded_config asks: chosen from a few such sets on the wgrad kernel alone over
# the dense convs of Inception v3 and GoogLeNet, with a margin because the set fastest there lost on small
# layers of MobileNet v2; judged on DenseNet-121, EfficientNet-B0 and MobileNet v2 (RESULTS.md, "The
# backward", "Narrower tiles where the channels pad the widest"). A 32-column tile is slow: its k-step's
# MMAs are small next to the k-step's fixed costs.
ROW_TILE_RATE = {128: 1.0, 64: 0.9}
COLUMN_TILE_RATE = {128: 1.0, 64: 0.9, 32: 0.5, 16: 0.2}


def least_padded_config(Co, Ci_padded, groups=1):
    """wgrad_config's tile, or a narrower one where the channels fill its tiles so badly that the narrower
    tile's MMA work (Co and Ci rounded up to its whole tiles), over its rate, is under 90% of
    wgrad_config's: 160 input channels in 3 tiles of 64 columns (192) instead of 2 of 128 (256, 62%
    useful), 192 output channels in 3 tiles of 64 rows instead of 2 of 128. Arithmetic on the channels
    alone; a narrower tile takes 128-pixel k-steps where it has 128 x 64 elements or fewer, as
    wgrad_config's do."""
    widest = wgrad_config(Co, Ci_padded, groups)
    Co_group, Ci_group = Co // groups, Ci_padded // groups

    def work(block_m, block_n):
        padded = -(-Co_group // block_m) * block_m * -(-Ci_group // block_n) * block_n
        return padded / (ROW_TILE_RATE[block_m] * COLUMN_TILE_RATE[block_n])

    tiles = [(m, n) for m in ROW_TILE_RATE if m <= widest.block_m for n in COLUMN_TILE_RATE if n <= widest.block_n]
    block_m, block_n = min(tiles, key=lambda tile: work(*tile))       # (ties: the first, the widest)
    if work(block_m, block_n) > 0.9 * work(widest.block_m, widest.block_n):
        return widest
    return WgradConfig(block_m, block_n, pixels_per_k_step(block_m, block_n))


def default_wgrad_config(geometry, Ci_padded, num_sms):
    """least_padded_config's narrower tile where the channels pad wgrad_config's badly; else
    wgrad_config's tile, or 64-row tiles (128-pixel k-steps) where 128-row ones leave a wave mostly
    idle: where 128-row tiles fill at most half the SMs and 64-row ones three quarters or more,
    whole; or, for a conv whose x is read tiled and whose tiles are 128 channels wide, where the
    128-row tiles are fewer than the SMs and the 64-row tiles' slices fit one wave."""
    config = wgrad_config(geometry.Co, Ci_padded, geometry.groups)
    narrower = least_padded_config(geometry.Co, Ci_padded, geometry.groups)
    if narrower != config or config.block_m == 64:
        return narrower
    narrow = config._replace(block_m=64, block_k=128)            # (64 x 128 elements or fewer: 128 pixels)
    tiles = wgrad_tiles(geometry, config)[2]
    _, _, narrow_tiles, narrow_k_blocks = wgrad_tiles(geometry, narrow)
    if 2 * tiles <= num_sms and 3 * num_sms <= 4 * narrow_tiles <= 4 * num_sms:
        return narrow
    if config.block_n == 128 and x_reads_tiled(geometry) and tiles < num_sms:
        narrow_units = narrow_tiles * choose_split(narrow_tiles, narrow_k_blocks, num_sms, narrow.block_k)
        if narrow_units <= num_sms:
            return narrow
    return config


def check_wgrad_config(config, arch):
    def refuse(why):
        raise ValueError(f"wgrad config {config}: {why}")
    if config.block_m not in (64, 128):
        refuse("block_m must be 64 or 128 (whole WGMMA row blocks; a TMEM accumulator's 64 or 128 lanes)")
    if config.block_n not in (16, 32, 64, 128, 256) or config.block_k not in (32, 64, 128):
        refuse("block_n must be a power of two in [16, 256] (an im2col box's channels) and block_k 32, 64 or 128")
    if arch == "sm_90" and config.block_m * config.block_n > 128 * 32 * config.num_warps:
        refuse(f"a {config.block_m} x {config.block_n} fp32 accumulator takes over 128 registers per thread "
               f"of {config.num_warps} warps; use more warps or a smaller tile")
    if shared_memory_bytes(config) + fprop.BUILD_MARGIN_BYTES > fprop.SHARED_MEMORY_PER_PROGRAM:
        refuse(f"the ring and its barriers need {shared_memory_bytes(config)} bytes of shared memory (and a build "
               f"up to {fprop.BUILD_MARGIN_BYTES} more), more than a program has; use fewer stages")


def shared_memory_bytes(config, element_size=2):
    """The shared memory a build of the wgrad kernel allocates, to within fprop.BUILD_MARGIN_BYTES: the ring's stages, each a BLOCK_K-pixel
    box of dY (BLOCK_M channels) and one of x (BLOCK_N channels), and the barriers by the forward
    kernel's rule (fprop.barrier_bytes: the ring's pairs, and Blackwell's accumulator pairs among
    the others). The tile goes from registers or tensor memory straight to global memory: no staging."""
    ring = config.num_buffers * config.block_k * (config.block_m + config.block_n) * element_size
    return ring + fprop.barrier_bytes(config.num_buffers)


class WgradLaunch(NamedTuple):
    grid: tuple
    dy_desc: object          # tiled descriptor of dY as [pixels, Co]
    x_desc: object           # im2col descriptor of x; tiled, of x as [pixels, Ci], where x_reads_tiled
    partial: torch.Tensor    # the fp32 workspace [split_k, split tiles, BLOCK_M, BLOCK_N]; None if no tile is split
    shape: WgradShape
    config: WgradConfig
    settings: object         # the im2col settings (ConvIm2ColSettings) of the conv (x_desc's, if im2col)

    def kernel_args(self, dw):
        # dw: dW [Co, R*S*Ci] in x's dtype; where no tile is split, the workspace's pointer is dw's (never written)
        return self.dy_desc, self.x_desc, dw, dw if self.partial is None else self.partial, self.shape


def padded_to_16_bytes(t):
    # t with its last dimension zero-padded to a multiple of 16 bytes, lesson 04's rule for TMA rows
    extra = -t.shape[-1] % (16 // t.element_size())
    return torch.nn.functional.pad(t, (0, extra)).contiguous() if extra else canonical_strides(t)


def wgrad_tiles(geometry, config):
    """(tiles along Co, channel blocks per tap, tiles in all, k-steps along the pixels) of dW's GEMM,
    Co x R*S*Ci: wgrad's own grid (BLOCK_N channels of one tap per tile, its taps side by side), the
    one home of it for the launch, the config rule and the split rule."""
    g = geometry
    num_pid_m, ci_blocks = triton.cdiv(g.Co, config.block_m), triton.cdiv(g.Ci_group, config.block_n)
    return num_pid_m, ci_blocks, num_pid_m * g.R * g.S * ci_blocks, triton.cdiv(g.M, config.block_k)


def x_reads_tiled(geometry):
    """A 1x1 conv at stride 1 without padding: output pixel p reads input pixel p, so x is a plain
    [pixels, Ci] matrix, loaded by tiled TMA (lesson 07: the transposed operands)."""
    g = geometry
    return (g.R, g.S, tuple(g.stride), tuple(g.padding)) == (1, 1, (1, 1), (0, 0))


def wgrad_operands(x_nhwc, dy_nhwc, geometry):
    # (x, dY as [pixels, Co]), each padded to 16-byte rows where it needs it: what the descriptors point
    # at; x as [pixels, Ci] where x_reads_tiled
    x_padded = padded_to_16_bytes(x_nhwc)
    if x_reads_tiled(geometry):
        x_padded = x_padded.view(geometry.M, x_padded.shape[-1])
    return x_padded, padded_to_16_bytes(dy_nhwc.reshape(geometry.M, geometry.Co))


def wgrad_kernel_options(config, arch):
    # the kernel's constexprs and its launch options, for a launch or an ahead-of-time compile (floating-point
    # fusion asked for, as Triton 3.9 defaults to: a program's environment does not decide it)
    return dict(NUM_BUFFERS=config.num_buffers, IS_BLACKWELL=MMA_FLAVOUR[arch] == "tcgen05", num_warps=config.num_warps,
                enable_fp_fusion=True)


def prepare_wgrad(x_nhwc, dy_nhwc, geometry, config, arch, num_sms):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor, TensorDescriptorIm2Col
    g = geometry
    x_operand, dy_2d = wgrad_operands(x_nhwc, dy_nhwc, g)
    Ci_padded = x_operand.shape[-1]
    config = config or default_wgrad_config(g, Ci_padded, num_sms)
    gl_dtype = GL_DTYPES[x_nhwc.dtype]
    settings = conv_im2col_settings(conv_geometry(
        (g.N, g.H, g.W, Ci_padded), (g.Co, g.R, g.S, Ci_padded), g.stride, g.padding, g.dilation))
    x_box, dy_box = [config.block_k, config.block_n], [config.block_k, config.block_m]
    x_layout = gl.NVMMASharedLayout.get_default_for(x_box, gl_dtype)
    if x_operand.dim() == 2:        # x_reads_tiled: the same box and shared layout, tiled
        x_desc = TensorDescriptor.from_tensor(x_operand, x_box, x_layout)
    else:
        x_desc = TensorDescriptorIm2Col.from_tensor(
            x_operand, x_box, x_layout, padding="zero", element_strides=list(settings.element_strides),
            pixel_box_lower_corner=list(settings.pixel_box_lower_corner),
            pixel_box_upper_corner=list(settings.pixel_box_upper_corner))
    dy_desc = TensorDescriptor.from_tensor(dy_2d, dy_box, gl.NVMMASharedLayout.get_default_for(dy_box, gl_dtype))
    num_pid_m, ci_blocks, tiles, k_blocks = wgrad_tiles(g, config)
    if config.programs < 0 or config.split_k < 0:
        raise ValueError(f"wgrad config {config}: programs and split_k must be >= 0 (0: the launcher's choice)")
    num_sms = config.programs or num_sms
    split_k = config.split_k or choose_split(tiles, k_blocks, num_sms, config.block_k)
    if not 1 <= split_k <= k_blocks:
        raise ValueError(f"split_k={split_k}: must lie in [1, {k_blocks}], the k-steps of {g.describe()}")
    programs, whole_tiles, split_tiles = wgrad_split(tiles, split_k, num_sms)
    partial = (torch.empty(split_k, split_tiles, config.block_m, config.block_n, device=x_nhwc.device,
                           dtype=torch.float32) if split_tiles else None)
    shape = WgradShape(g.Co, g.Ci_group, g.Co_group, g.R * g.S, g.S, num_pid_m, tiles // num_pid_m, ci_blocks,
                       k_blocks, split_k, whole_tiles, max(split_tiles, 1),     # (1 if none: a divisor in the kernel)
                       g.out_h, g.out_w, *g.stride, *g.padding, *g.dilation)
    return WgradLaunch((programs,), dy_desc, x_desc, partial, shape, config._replace(split_k=split_k), settings)


class WgradProblem(NamedTuple):
    # the conv wgrad's kernel runs for a conv: the conv itself, or folded, its column taps maybe in the channels
    geometry: object       # the conv the kernel runs
    fold: StrideFold       # the stride folded into the channels, or None
    taps_in_channels: int  # the S column taps moved into the channels (0: none)


def wgrad_problem(geometry, element_size=2):
    """What conv wgrad's kernel runs for the conv `geometry`: folded where stride_fold says so; then,
    after a fold, its column taps in the channels where that adds no MMA columns (S boxes of the
    folded channels hold at least one box of S times as many) and a row of taps fits a box of 128.
    Arithmetic on the shape alone."""
    fold = stride_fold(geometry, element_size)
    g = geometry if fold is None else fold.geometry
    box = functools.partial(channel_box, element_size=element_size)
    if fold is None or g.S == 1 or box(g.S * g.Ci) > min(128, g.S * box(g.Ci)):
        return WgradProblem(g, fold, 0)
    widened = conv_geometry((g.N, g.H, g.W - g.S + 1, g.S * g.Ci), (g.Co, g.R, 1, g.S * g.Ci), 1, 0, 1)
    return WgradProblem(widened, fold, g.S)


def wgrad_input(x_nhwc, problem):
    """x as the problem's conv reads it: x itself, folded, and/or with its column taps in the channels."""
    if problem.fold is not None:
        x_nhwc = fold_input(x_nhwc, problem.fold)
    if problem.taps_in_channels:
        N, H, W, C = x_nhwc.shape
        S = problem.taps_in_channels          # unfold: [N, H, W - S + 1, C, S], window s last
        x_nhwc = x_nhwc.unfold(2, S, 1).permute(0, 1, 2, 4, 3).contiguous().view(N, H, W - S + 1, S * C)
    return x_nhwc


def wgrad_result(dw_run, geometry, problem):
    """The problem's dW [Co, R', S', C'] -> the conv's dW [Co, R, S, Ci]."""
    if problem.taps_in_channels:
        Co, R, _, SC = dw_run.shape
        dw_run = dw_run.view(Co, R, problem.taps_in_channels, SC // problem.taps_in_channels)
    return dw_run if problem.fold is None else unfold_weight_grad(dw_run, geometry, problem.fold)
