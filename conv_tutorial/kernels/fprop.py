"""The operator's forward kernel: lesson 05's persistent, warp-specialized TMA-im2col convolution for
Hopper (WGMMA, ping-pong consumers) and data-centre Blackwell (tcgen05, a double TMEM accumulator),
with every feature the operator runs: tiles with a row or column tail, split-K with its second
kernel, e4m3 operands, grouped convs, and the backward's switches (an output window and a strided
dgrad's phases, a filter read in place, per-channel sums for BatchNorm, ReLU's backward in the
epilogue). Each switch is a constexpr (None, 0 or False) that compiles to nothing when off, so at
the configs lesson 05 teaches, with the switches off, this kernel builds to the lesson's PTX
(tests/kernels/test_equivalence.py checks it).

Sections named below ("section 6") are lesson 05's, where each part is explained.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout, allocate_tensor_memory, tcgen05_commit, tcgen05_mma, tensor_memory_descriptor)
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ..core.device import (MMA_FLAVOUR, MBARRIER_BYTES, SHARED_MEMORY_PER_PROGRAM, SHARED_MEMORY_PER_SM,
                           SHARED_MEMORY_RESERVED_PER_PROGRAM, tma_mma_arch_and_sms)
from ..core.epilogue import ACTIVATIONS, RELU_GRAD, output_dtype
from ..core.geometry import check_conv_call
from ..core.tma import conv_im2col_settings, conv_tma_descriptors, pad_channels_for_tma
from ..core.windows import check_epilogue_destinations, flipped_filter_taps
from .blocks import Counter, HopperWGMMA, allocate_barrier_pairs
from .windows import (FlippedTaps, PhaseTiles, WindowStore, add_channel_sums, flipped_taps, weights_at, weights_tile,
                      window_store)

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
EPILOGUE_ACTIVATIONS = ACTIVATIONS + (RELU_GRAD,)    # the backward's ReLU gate besides the forward's activations
# A run-time integer in an aggregate: a tensor, or a constexpr where Triton specialized the
# argument (it compiles a value of 1 in as a constant).
Int = gl.tensor | gl.constexpr


@gluon.aggregate
class Ring:
    # The stages and their barriers. The tail buffers belong to section 6; without a tail they are the main buffers
    # again, so one MMA `a_tail_bufs x b_tail_bufs` serves both kinds of tail.
    a_bufs: gl.shared_memory_descriptor       # [NUM_BUFFERS, BLOCK_M, BLOCK_K] pixels
    b_bufs: gl.shared_memory_descriptor       # [NUM_BUFFERS, BLOCK_N, BLOCK_K] filters (B_N_MAJOR: BLOCK_K, BLOCK_N)
    a_tail_bufs: gl.shared_memory_descriptor  # section 6: a row tail's pixels
    b_tail_bufs: gl.shared_memory_descriptor  # section 6: a column tail's filters
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    NUM_BUFFERS: gl.constexpr
    B_N_MAJOR: gl.constexpr      # the backward: b_bufs hold [BLOCK_K, BLOCK_N] boxes of weights read in place

    @gluon.jit
    def b(self, slot, TAIL: gl.constexpr = False):
        # B of a stage for the MMA, [BLOCK_K, BLOCK_N]: the filters' rows seen transposed (a view of the same
        # bytes: K-major), or (the backward) the box as it lies (N-major)
        bufs = self.b_tail_bufs if TAIL else self.b_bufs
        return bufs.index(slot) if self.B_N_MAJOR else bufs.index(slot).permute((1, 0))


@gluon.aggregate
class Im2colWindow:
    out_h: Int
    out_w: Int
    stride_h: Int
    stride_w: Int
    pad_h: Int
    pad_w: Int
    dil_h: Int
    dil_w: Int
    Ci_group: Int          # channels per tap of a weight row: Ci (section 10: Ci / groups)
    Co_group: Int          # section 10: output channels per group (Co when groups = 1)
    S: Int
    channel_blocks: Int
    phases: PhaseTiles | gl.constexpr      # the backward's: a strided dgrad's phases side by side; else None
    flipped: FlippedTaps | gl.constexpr    # the backward's: a dgrad's weights read in place; else None

    @gluon.jit
    def pixel_box_origin(self, m):
        # (n, y, x) in the input where the im2col box of output pixels m, m+1, ... starts (tap 0)
        n = m // (self.out_h * self.out_w)
        oy = (m // self.out_w) % self.out_h
        ox = m % self.out_w
        return n, oy * self.stride_h - self.pad_h, ox * self.stride_w - self.pad_w

    @gluon.jit
    def group_channel(self, co0):
        # section 10: the first input channel of the group of output channels co0, co0+1, ... (0 if groups = 1)
        return co0 // self.Co_group * self.Ci_group

    @gluon.jit
    def tile_taps(self, co0):
        # The tile of output channels co0, co0+1, ...: its group_channel, the taps it runs as (first r, first s,
        # taps per row): all of them, or (the backward) its phase's; and where its weights lie: rows co0, ... of w2d,
        # or (the backward) a filter read in place (weights_tile).
        r0, s0, taps_w = 0, 0, self.S
        if self.phases is not None:
            r0, _, s0, taps_w = self.phases.taps(co0)
        return self.group_channel(co0), r0, s0, taps_w, weights_tile(self.flipped, co0)

    @gluon.jit
    def k_step(self, k, BLOCK_K: gl.constexpr, tile_taps):
        # (the tap's im2col offsets [r*dil_h, s*dil_w], input channel, where in w2d the weights' box starts).
        group_channel, r0, s0, taps_w, w_tile = tile_taps
        tap = k // self.channel_blocks
        c0 = (k % self.channel_blocks) * BLOCK_K
        r, s = r0 + tap // taps_w, s0 + tap % taps_w
        offsets = [(r * self.dil_h).to(gl.int16), (s * self.dil_w).to(gl.int16)]
        return offsets, group_channel + c0, weights_at(self.flipped, w_tile, tap * self.Ci_group + c0, r, s, c0)


@gluon.jit
def loader_partition(in_desc, w_desc, w_tail_desc, ring, schedule, window):
    # One warp: for every (tile, k-step) of this program, wait for a free stage and fill it.
    PIXEL_BOX: gl.constexpr = in_desc.block_type.shape[0]     # pixels per im2col load
    BLOCK_M: gl.constexpr = ring.a_bufs.shape[1]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    N_AXIS: gl.constexpr = 1 if ring.B_N_MAJOR else 0        # the weights box's output-channel axis
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[N_AXIS]
    # bytes that land per stage: TILE_M pixels of A (in boxes of PIXEL_BOX) and TILE_N rows of
    # weights (main box + tail box, section 6)
    stage_bytes: gl.constexpr = (in_desc.block_type.nbytes * schedule.TILE_M // PIXEL_BOX
                                 + w_desc.block_type.nbytes * schedule.TILE_N // BLOCK_N)
    state = Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        m0 = work.pid_m * schedule.TILE_M
        # where the tile's im2col boxes start, worked out once per tile (integer divisions are
        # slow in a loop of one warp): one box of BLOCK_M pixels, or with a row tail (section 6)
        # boxes of the tail's height, each at its own pixel, so its own (n, y, x)
        n, start_h, start_w = window.pixel_box_origin(m0)
        if PIXEL_BOX < BLOCK_M:
            n_1, h_1, w_1 = window.pixel_box_origin(m0 + PIXEL_BOX)
        if schedule.TILE_M > BLOCK_M:
            n_t, h_t, w_t = window.pixel_box_origin(m0 + BLOCK_M)
        co0 = work.pid_n * schedule.TILE_N
        tile_taps = window.tile_taps(co0)
        for k in range(work.k_begin, work.k_end):
            tap_offsets, c0, w_at = window.k_step(k, BLOCK_K, tile_taps)
            slot = state.slot()
            # wait until the MMA that last read this stage is done (first pass: returns at once)
            mbarrier.wait(ring.empty.index(slot), state.phase() ^ 1)
            ready = ring.ready.index(slot)      # the stage's ready barrier: its loads arrive on it
            mbarrier.expect(ready, stage_bytes)
            # A = im2col_load(x, [n, oy*sh-ph, ox*sw-pw, c0], offsets=[r*dh, s*dw])
            tma.async_load_im2col(in_desc, [n, start_h, start_w, c0], tap_offsets, ready,
                                  ring.a_bufs.index(slot).slice(0, PIXEL_BOX))
            if PIXEL_BOX < BLOCK_M:
                tma.async_load_im2col(in_desc, [n_1, h_1, w_1, c0], tap_offsets, ready,
                                      ring.a_bufs.index(slot).slice(PIXEL_BOX, PIXEL_BOX))
            if schedule.TILE_M > BLOCK_M:
                tma.async_load_im2col(in_desc, [n_t, h_t, w_t, c0], tap_offsets, ready, ring.a_tail_bufs.index(slot))
            # B = load(w2d, [co0, (r*S + s)*Ci + c0]) (the backward's in place: [c0, its column]), and a column
            # tail's output channels after it
            tma.async_load(w_desc, w_at, ready, ring.b_bufs.index(slot))
            if schedule.TILE_N > BLOCK_N:
                tma.async_load(w_tail_desc, [w_at[0] + BLOCK_N * (1 - N_AXIS), w_at[1] + BLOCK_N * N_AXIS], ready,
                               ring.b_tail_bufs.index(slot))
            state = state.next()


@gluon.aggregate
class TileOutput:
    # Where a tile goes: the output's TMA descriptors and staging buffers, and the fused epilogue's operands and
    # switches (section 5). The tail descriptor and buffer serve section 6; the partial sums, section 7.
    out_desc: tma.tensor_descriptor | gl.constexpr        # the main box's (the aggregate takes either type, as
    out_tail_desc: tma.tensor_descriptor | gl.constexpr   # this field, a constexpr None without a tail, needs)
    c_smem: gl.shared_memory_descriptor        # one staging buffer per consumer
    c_tail_smem: gl.shared_memory_descriptor
    bias_ptr: gl.tensor
    scale_ptr: gl.tensor
    residual_ptr: gl.tensor
    partial_ptr: gl.tensor
    M: Int
    Co: Int
    EPILOGUE: gl.tuple                 # which parts of the epilogue to apply (an `Epilogue`, constexprs)
    STORE_BY_ROW_BLOCKS: gl.constexpr
    out_window: WindowStore | gl.constexpr    # the backward's: into a window of a larger tensor; else None
    channel_stats: gl.tensor | gl.constexpr          # the backward's: fp32 [2, Co] sums for BatchNorm; else None

    @gluon.jit
    def for_consumer(self, i: gl.constexpr):
        # This output with consumer number i's own staging buffers (i: 0, or 1 in ping-pong).
        return gl.aggregate_replace(self, c_smem=self.c_smem.index(i), c_tail_smem=self.c_tail_smem.index(i))

    @gluon.jit
    def store(self, acc, work, m0, co0, TAIL: gl.constexpr, STORES_IN_FLIGHT: gl.constexpr = 0):
        # A unit's result at (m0, co0): through the tail's box and buffer if TAIL (section 6), as an fp32 partial sum
        # if the unit is a split-K slice (section 7), else the whole tile. (Without split-K `work.partial` is a
        # constexpr 0: the branch is decided at compile time.)
        if work.partial:
            # this unit's fp32 partial sum of the tile, to partial[split, m, co] (section 7): the box's rows and
            # columns (acc.type.shape) in the accumulator's layout, and which of them lie inside the output
            rows = m0 + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
            cols = co0 + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
            offsets = gl.expand_dims((rows + work.split * self.M).to(gl.int64) * self.Co, 1) + gl.expand_dims(cols, 0)
            inside = gl.expand_dims(rows < self.M, 1) & gl.expand_dims(cols < self.Co, 0)
            gl.store(self.partial_ptr + offsets, acc, mask=inside)
        else:
            # y = act(acc * scale[co] + bias[co] + residual[m, co]) in fp32 (section 5), each part only if its
            # switch asks for it; cast, and an asynchronous TMA store of the tile.
            c_smem = self.c_tail_smem if TAIL else self.c_smem
            out_desc = self.out_tail_desc if TAIL else self.out_desc
            rows = m0 + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
            cols = co0 + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
            residual = 0.0
            if self.EPILOGUE.residual:
                # the residual tile, read in the accumulator's own layout: no shuffle through shared memory
                offsets = gl.expand_dims(rows.to(gl.int64) * self.Co, 1) + gl.expand_dims(cols, 0)
                inside = gl.expand_dims(rows < self.M, 1) & gl.expand_dims(cols < self.Co, 0)
                residual = gl.load(self.residual_ptr + offsets, mask=inside, other=0.0)
            y = apply_epilogue(acc, cols, self.Co, self.scale_ptr, self.bias_ptr, residual, self.EPILOGUE)
            if self.out_window is not None:     # the backward: via c_smem, pixel by pixel into a window of a larger tensor
                self.out_window.store(y, c_smem, m0, co0, self.M, self.Co)
            else:
                tma.store_wait(pendings=STORES_IN_FLIGHT)
                c_smem.store(y.to(out_desc.dtype))
                fence_async_shared()
                tma.async_store(out_desc, [m0, co0], c_smem)
                if self.channel_stats is not None:  # the backward: each channel's sums for BatchNorm, from the staged tile
                    add_channel_sums(self.channel_stats, c_smem, m0, co0, self.M, self.Co)


@gluon.jit
def hopper_mma_epilogue_partition(ring, schedule, output, turn, CONSUMER: gl.constexpr,
                                  NUM_CONSUMERS: gl.constexpr):
    BLOCK_M: gl.constexpr = output.out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = output.out_desc.block_type.shape[1]
    # The tail (section 6): TILE_N - BLOCK_N more columns, or TILE_M - BLOCK_M more rows. Its MMA
    # reads a_tail x b_tail: the main A with the tail's weights, or the tail's pixels with the
    # main weights.
    HAS_TAIL: gl.constexpr = schedule.TILE_N > BLOCK_N or schedule.TILE_M > BLOCK_M
    TAIL_M: gl.constexpr = output.out_tail_desc.block_type.shape[0] if HAS_TAIL else BLOCK_M
    TAIL_N: gl.constexpr = output.out_tail_desc.block_type.shape[1] if HAS_TAIL else BLOCK_N
    MMAS_PER_STEP: gl.constexpr = 2 if HAS_TAIL else 1
    state = Counter(CONSUMER * schedule.unit_k_steps(gl.program_id(0)), ring.NUM_BUFFERS)  # my first k-step
    local_tile = 0
    for unit in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), schedule.num_units(),
                      NUM_CONSUMERS * gl.num_programs(0)):
        work = schedule.work(unit)
        if NUM_CONSUMERS == 2:
            # my turn: the other consumer has issued the whole main loop of the tile before mine.
            # (A fresh barrier counts as phase 1 complete: consumer 0's first wait returns at once.)
            mbarrier.wait(turn.index(CONSUMER), (local_tile & 1) ^ (1 - CONSUMER))
        # acc = zeros(BLOCK_M, BLOCK_N) (+ the tail's)
        mma = HopperWGMMA.initialize(ring.a_bufs.dtype, BLOCK_M, BLOCK_N, gl.num_warps())
        if HAS_TAIL:
            mma_tail = HopperWGMMA.initialize(ring.a_bufs.dtype, TAIL_M, TAIL_N, gl.num_warps())
        for k in range(work.k_begin, work.k_end):
            slot = state.slot()
            mbarrier.wait(ring.ready.index(slot), state.phase())
            # acc += A @ B^T, asynchronously (and the tail's columns or rows: a second, smaller MMA)
            mma = mma.issue_async_mma(ring.a_bufs.index(slot), ring.b(slot))
            if HAS_TAIL:
                mma_tail = mma_tail.issue_async_mma(ring.a_tail_bufs.index(slot), ring.b(slot, TAIL=True))
                mma_tail = mma_tail.wait_num_outstanding(MMAS_PER_STEP)
            # Only this step's MMAs in flight: the ones of step k-1 are done, so its stage is free.
            mma = mma.wait_num_outstanding(MMAS_PER_STEP)
            mbarrier.arrive(ring.empty.index(state.previous_slot()), pred=k > work.k_begin)
            state = state.next()
        if NUM_CONSUMERS == 2:
            mbarrier.arrive(turn.index(1 - CONSUMER))   # your turn: my MMAs are all issued
        acc, mma = mma.wait_num_outstanding(0).take_result()      # every MMA of the tile done
        if HAS_TAIL:
            acc_tail, mma_tail = mma_tail.wait_num_outstanding(0).take_result()
        mbarrier.arrive(ring.empty.index(state.previous_slot()))
        m0, co0 = work.pid_m * schedule.TILE_M, work.pid_n * schedule.TILE_N
        if output.STORE_BY_ROW_BLOCKS:
            # section 6: the main block leaves in two halves of its rows through the tail's buffer (no data
            # moves where each warpgroup holds two 64-row WGMMA blocks: 128 rows on 4 warps, 256 on 8)
            top, bottom = gl.split(acc.reshape([2, BLOCK_M // 2, BLOCK_N]).permute((1, 2, 0)))
            output.store(top, work, m0, co0, True)
            output.store(bottom, work, m0 + BLOCK_M // 2, co0, True)
        else:
            output.store(acc, work, m0, co0, False)
        if HAS_TAIL:
            # the tail's block: after the main block's columns (N tail) or below its rows (M tail)
            output.store(acc_tail, work, m0 + schedule.TILE_M - TAIL_M, co0 + schedule.TILE_N - TAIL_N, True,
                         STORES_IN_FLIGHT=0 if output.STORE_BY_ROW_BLOCKS else 1)
        # skip the other consumer's tile
        state = state.next((NUM_CONSUMERS - 1) * schedule.unit_k_steps(unit + gl.num_programs(0)))
        local_tile += 1
    tma.store_wait(pendings=0)


@gluon.aggregate
class TmemAccumulators:
    tmem: tensor_memory_descriptor        # [NUM_ACC, BLOCK_M, BLOCK_N] fp32 in TMEM
    tail_tmem: tensor_memory_descriptor   # section 6: a column tail's accumulators
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    NUM_ACC: gl.constexpr


@gluon.jit
def blackwell_mma_partition(ring, schedule, acc):
    state = Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    acc_state = Counter(gl.to_tensor(0), acc.NUM_ACC)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        buf = acc_state.slot()
        # wait until the epilogue has read this accumulator (first pass: returns at once)
        mbarrier.wait(acc.empty.index(buf), acc_state.phase() ^ 1)
        for k in range(work.k_begin, work.k_end):
            slot = state.slot()
            mbarrier.wait(ring.ready.index(slot), state.phase())
            # acc += A @ B^T (and a column tail's into its own accumulator, section 6)
            tcgen05_mma(ring.a_bufs.index(slot), ring.b(slot), acc.tmem.index(buf), use_acc=k > work.k_begin)
            if schedule.TILE_N > acc.tmem.shape[2]:      # a column tail: wider than the main accumulator
                tcgen05_mma(ring.a_bufs.index(slot), ring.b(slot, TAIL=True), acc.tail_tmem.index(buf),
                            use_acc=k > work.k_begin)
            # the hardware arrives on empty[slot] once these MMAs (and all earlier ones) are done
            tcgen05_commit(ring.empty.index(slot))
            state = state.next()
        # signal the epilogue once every MMA of the tile has finished
        tcgen05_commit(acc.ready.index(buf))
        acc_state = acc_state.next()


@gluon.jit
def blackwell_epilogue_partition(schedule, acc, output):
    BLOCK_N: gl.constexpr = output.out_desc.block_type.shape[1]  # the main box's columns (rows: TILE_M, no row tail)
    acc_state = Counter(gl.to_tensor(0), acc.NUM_ACC)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        buf = acc_state.slot()
        mbarrier.wait(acc.ready.index(buf), acc_state.phase())
        tile = acc.tmem.index(buf).load()           # TMEM -> registers
        if schedule.TILE_N > BLOCK_N:
            tile_tail = acc.tail_tmem.index(buf).load()
        mbarrier.arrive(acc.empty.index(buf))      # the MMA warp may reuse it now
        co0 = work.pid_n * schedule.TILE_N
        output.store(tile, work, work.pid_m * schedule.TILE_M, co0, False)
        if schedule.TILE_N > BLOCK_N:
            output.store(tile_tail, work, work.pid_m * schedule.TILE_M, co0 + BLOCK_N, True, STORES_IN_FLIGHT=1)
        acc_state = acc_state.next()
    tma.store_wait(pendings=0)


GROUP_M = gl.constexpr(8)      # row-tiles per group of the tile order


@gluon.aggregate
class WorkUnit:
    pid_m: Int
    pid_n: Int
    k_begin: Int
    k_end: Int
    split: Int            # section 7: which slice of the K loop, and whether it is a partial sum
    partial: Int


@gluon.aggregate
class TileSchedule:
    num_pid_m: Int
    num_pid_n: Int
    k_steps: Int
    TILE_M: gl.constexpr      # output rows (pixels) and columns (channels) per tile
    TILE_N: gl.constexpr
    SPLIT_K: gl.constexpr
    phases: PhaseTiles | gl.constexpr      # the backward's: a strided dgrad's phases side by side; else None

    @gluon.jit
    def num_units(self):
        # How many units the tiles make: whole tiles, plus SPLIT_K slices of each split one.
        num_tiles = self.num_pid_m * self.num_pid_n
        whole_tiles = whole_tile_count(num_tiles, gl.num_programs(0), self.SPLIT_K)
        return whole_tiles + (num_tiles - whole_tiles) * self.SPLIT_K

    @gluon.jit
    def unit_k_steps(self, unit):
        # The k-steps of a unit: k_steps (section 4's ping-pong runs without split-K), or (the backward) its phase's.
        work = self.work(unit)
        return work.k_end - work.k_begin

    @gluon.jit
    def work(self, unit):
        # A unit of work: a whole tile, or (section 7) one of SPLIT_K slices of a tile's K loop (partial = 1). The
        # first whole_tiles = num_tiles // P * P tiles (P programs) run whole, the rest in slices, the slices of one
        # part of the K loop together, so tiles that run side by side still share strips of A and B in L2.
        tile_id, split, k_begin, k_end, partial = unit, 0, 0, self.k_steps, 0
        if self.SPLIT_K > 1:
            num_tiles = self.num_pid_m * self.num_pid_n
            whole_tiles = whole_tile_count(num_tiles, gl.num_programs(0), self.SPLIT_K)
            partial = (unit >= whole_tiles).to(gl.int32)
            split_unit = gl.maximum(unit - whole_tiles, 0)
            split_tiles = gl.maximum(num_tiles - whole_tiles, 1)
            split = split_unit // split_tiles
            # whole: (unit, 0, 0, k_steps); split: (a tile past whole_tiles, its slice's k-steps)
            tile_id = unit + partial * (whole_tiles + split_unit % split_tiles - unit)
            k_begin = partial * (split * self.k_steps // self.SPLIT_K)
            k_end = self.k_steps + partial * ((split + 1) * self.k_steps // self.SPLIT_K - self.k_steps)
        # (pid_m, pid_n) of the linear tile id, GROUP_M row-tiles at a time (the L2-friendly order)
        tiles_per_group = GROUP_M * self.num_pid_n
        first_m = (tile_id // tiles_per_group) * GROUP_M
        rows_in_group = gl.minimum(self.num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile_id % tiles_per_group) % rows_in_group
        pid_n = (tile_id % tiles_per_group) // rows_in_group
        if self.phases is not None:       # the backward: the phases perhaps in another order; a tile runs its phase's taps
            pid_m, pid_n, k_end = self.phases.work(tile_id, self.num_pid_m, self.TILE_N, GROUP_M, pid_m, pid_n)
        return WorkUnit(pid_m, pid_n, k_begin, k_end, split, partial)


@triton.jit
def whole_tile_count(num_tiles, programs, SPLIT_K: tl.constexpr):
    # How many tiles run whole: with split-K, those of the full waves (the rest are split, section 7). The kernel,
    # the host (`tile_counts`, which the second kernel and the runtime take it from) call this one function.
    return num_tiles // programs * programs if SPLIT_K > 1 else num_tiles


@triton.jit
def apply_epilogue(acc, cols, Co, scale_ptr, bias_ptr, residual, EPILOGUE: tl.constexpr):
    # act(acc * scale[cols] + bias[cols] + residual) in fp32: the scale and bias loaded here for the tile's columns
    # `cols`, the residual tile loaded by the caller in the accumulator's layout.
    if EPILOGUE.scale:
        scale = tl.load(scale_ptr + cols, mask=cols < Co, other=0.0)
        acc = acc * tl.expand_dims(scale.to(tl.float32), 0)
    if EPILOGUE.bias:
        bias = tl.load(bias_ptr + cols, mask=cols < Co, other=0.0)
        acc = acc + tl.expand_dims(bias.to(tl.float32), 0)
    if EPILOGUE.residual and EPILOGUE.activation != "relu_grad":
        acc = acc + residual.to(tl.float32)
    if EPILOGUE.activation == "relu_grad":     # the backward: ReLU's backward, gated by its output (the residual)
        acc = tl.where(residual > 0, acc, 0.0)
    if EPILOGUE.activation == "relu":
        acc = tl.maximum(acc, 0.0)
    if EPILOGUE.activation == "silu":      # x * sigmoid(x)
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@gluon.jit
def conv2d_fprop_kernel(in_desc, w_desc, w_tail_desc, out_desc, out_tail_desc, epilogue_ptrs, shape, out_window,
                        channel_stats, CONFIG: gl.constexpr, EPILOGUE: gl.constexpr,
                        IS_BLACKWELL: gl.constexpr):
    (M, Co, num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, Ci_group, Co_group,
     S, k_steps, channel_blocks, w_taps) = shape
    dtype: gl.constexpr = in_desc.dtype
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    NUM_BUFFERS: gl.constexpr = CONFIG.num_buffers
    NUM_CONSUMERS: gl.constexpr = CONFIG.consumers
    BLOCK_M_TAIL: gl.constexpr = CONFIG.block_m_tail                  # section 6
    BLOCK_N_TAIL: gl.constexpr = CONFIG.block_n_tail                  # section 6
    STORE_BY_ROW_BLOCKS: gl.constexpr = stores_by_row_blocks(CONFIG)  # section 6
    # A is BLOCK_M pixels deep even when a row tail makes the im2col box shorter (section 6)
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_M, BLOCK_K], in_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_desc.block_type.shape, w_desc.layout)
    # one epilogue staging tile per consumer (section 6: and one for the tail's box; storing by row
    # blocks, the tail's box of half the main rows is the only one)
    if not STORE_BY_ROW_BLOCKS:
        c_smem = gl.allocate_shared_memory(out_desc.dtype, [NUM_CONSUMERS] + out_desc.block_type.shape, out_desc.layout)
    a_tail_bufs, b_tail_bufs = a_bufs, b_bufs      # without a tail the main buffers stand in
    if BLOCK_N_TAIL > 0:
        b_tail_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_tail_desc.block_type.shape, w_tail_desc.layout)
    elif BLOCK_M_TAIL > 0:
        a_tail_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + in_desc.block_type.shape, in_desc.layout)
    if BLOCK_N_TAIL > 0 or BLOCK_M_TAIL > 0 or STORE_BY_ROW_BLOCKS:
        c_tail_smem = gl.allocate_shared_memory(out_desc.dtype, [NUM_CONSUMERS] + out_tail_desc.block_type.shape,
                                                out_tail_desc.layout)
    else:   # no tail: the main buffers stand in
        c_tail_smem = c_smem
    # (a constexpr condition: only the branch taken is compiled, so c_smem needs no value when storing by row blocks)
    c_smem = c_tail_smem if STORE_BY_ROW_BLOCKS else c_smem
    ready, empty = allocate_barrier_pairs(NUM_BUFFERS)
    ring = Ring(a_bufs, b_bufs, a_tail_bufs, b_tail_bufs, ready, empty, NUM_BUFFERS, w_taps is not None)
    # (epilogue_ptrs: the bias, scale, residual and partial-sum pointers, in TileOutput's order)
    # out_window: None, or (the backward) an OutputWindow's kernel_args, for a WindowStore, and with it perhaps a
    # strided dgrad's phases; channel_stats: None, or (the backward) the zeroed fp32 [2, Co] tensor that the epilogue
    # adds each channel's sums into
    out_window, phases = window_store(out_window, out_h, out_w, channel_blocks)
    schedule = TileSchedule(num_pid_m, num_pid_n, k_steps, BLOCK_M + BLOCK_M_TAIL, BLOCK_N + BLOCK_N_TAIL,
                            CONFIG.split_k, phases)
    window = Im2colWindow(out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, Ci_group, Co_group, S,
                          channel_blocks, phases, flipped_taps(w_taps, phases))   # (w_taps: the backward's)
    output = TileOutput(out_desc, out_tail_desc, c_smem, c_tail_smem, *epilogue_ptrs, M, Co, EPILOGUE,
                        STORE_BY_ROW_BLOCKS, out_window, channel_stats)
    if IS_BLACKWELL:
        NUM_ACC: gl.constexpr = 2
        acc_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N],
                                          TensorMemoryLayout([BLOCK_M, BLOCK_N], col_stride=1))
        acc_tail_tmem = acc_tmem
        if BLOCK_N_TAIL > 0:
            acc_tail_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N_TAIL],
                                                   TensorMemoryLayout([BLOCK_M, BLOCK_N_TAIL], col_stride=1))
        acc_ready, acc_empty = allocate_barrier_pairs(NUM_ACC)
        acc = TmemAccumulators(acc_tmem, acc_tail_tmem, acc_ready, acc_empty, NUM_ACC)
        gl.warp_specialize([
            (blackwell_epilogue_partition, (schedule, acc, output.for_consumer(0))),
            (blackwell_mma_partition, (ring, schedule, acc)),
            (loader_partition, (in_desc, w_desc, w_tail_desc, ring, schedule, window)),
        ], [1, 1], [24, 24])
    else:
        # The loader's registers: 24, or with a row tail 48 for the boxes' origins (with one
        # consumer warpgroup the register file has room; ping-pong leaves the loader 32)
        LOADER_REGISTERS: gl.constexpr = 48 if BLOCK_M_TAIL > 0 else 24
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        if NUM_CONSUMERS == 1:
            gl.warp_specialize([
                (hopper_mma_epilogue_partition, (ring, schedule, output.for_consumer(0), turn, 0, 1)),
                (loader_partition, (in_desc, w_desc, w_tail_desc, ring, schedule, window)),
            ], [1], [LOADER_REGISTERS])
        else:
            # ping-pong: consumer 0 is the default partition, consumer 1 a worker of as many warps.
            # Registers: 2 consumer warpgroups at 240 + the loader's warpgroup at 24 fill the 64K.
            gl.warp_specialize([
                (hopper_mma_epilogue_partition, (ring, schedule, output.for_consumer(0), turn, 0, 2)),
                (hopper_mma_epilogue_partition, (ring, schedule, output.for_consumer(1), turn, 1, 2)),
                (loader_partition, (in_desc, w_desc, w_tail_desc, ring, schedule, window)),
            ], [gl.num_warps(), 1], [240, min(LOADER_REGISTERS, 32)])


class KernelConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_buffers: int        # stages in the shared-memory ring
    num_warps: int          # warps of each MMA/epilogue partition
    programs_per_sm: int = 1
    consumers: int = 1      # 2: Hopper ping-pong (section 4)
    block_n_tail: int = 0   # section 6: extra output columns per tile, in a second MMA
    split_k: int = 1        # section 7: slices of the K loop, summed by a second kernel
    block_m_tail: int = 0   # section 6: extra output rows (pixels) per tile, in a second MMA (Hopper)

    @property
    def tile_m(self):
        return self.block_m + self.block_m_tail

    @property
    def tile_n(self):
        return self.block_n + self.block_n_tail

    def __str__(self):
        # e.g. "(128+64)x128x64 5 stages 4 warps, ping-pong" (benchmarks/fit_heuristic.py parses it back)
        height = f"({self.block_m}+{self.block_m_tail})" if self.block_m_tail else f"{self.block_m}"
        width = f"({self.block_n}+{self.block_n_tail})" if self.block_n_tail else f"{self.block_n}"
        extras = {f"{self.programs_per_sm}/SM": self.programs_per_sm > 1, "ping-pong": self.consumers > 1,
                  f"split-K {self.split_k}": self.split_k > 1}
        return f"{height}x{width}x{self.block_k} {self.num_buffers} stages {self.num_warps} warps" + "".join(
            f", {extra}" for extra, applies in extras.items() if applies)


FIXED_CONFIG = KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4)  # both archs


def check_config(config, arch):
    """Combinations the kernel does not implement, or cannot run on `arch` whatever the shape, get a
    ValueError naming the config and the rule. (What does not suit a shape, or spills registers, is
    the operator's pruning: selection.prune_configs.)"""
    c, hopper = config, arch == "sm_90"
    rules = [   # (broken, the rule)
        (c.consumers > 2 or (c.consumers > 1 and not hopper),
         f"consumers={c.consumers}; ping-pong (2 consumers) is a Hopper schedule, elsewhere 1"),
        (c.programs_per_sm > 1 and not hopper, "programs_per_sm > 1 is offered on Hopper only"),
        (c.consumers > 1 and (c.num_warps != 4 or c.programs_per_sm > 1),    # the kernel's warp_specialize
         "ping-pong runs 4-warp consumers, one program per SM: its 2 consumer warpgroups at 240 registers and "
         "the loader's warp fill the register file"),
        (c.programs_per_sm > 1 and c.num_warps != 4,      # kernel_constexprs: maxnreg 128 at 2 programs per SM
         "programs_per_sm > 1 runs 4 warps: 2 x (4 + the loader's) warps at 128 registers fill the register file"),
        (not hopper and c.block_m not in (64, 128), "on Blackwell block_m must be 64 or 128 (TMEM has 128 lanes)"),
        (not hopper and 2 * c.tile_n > 512, f"two fp32 accumulators of {c.tile_n} columns exceed TMEM's 512 columns"),
        (c.split_k < 1 or (c.split_k > 1 and c.consumers > 1),
         "split_k must be >= 1, and split-K runs with one consumer (section 7)"),
        (c.block_m_tail and (not hopper or c.block_n_tail),      # section 6
         "a row tail (block_m_tail) is a Hopper schedule, and a tile has a tail in rows or in columns, not both"),
        (c.block_m_tail and (c.block_m_tail not in (64, 128) or c.block_m not in (c.block_m_tail, 2 * c.block_m_tail)),
         "block_m_tail must be 64 or 128 (whole WGMMA row blocks) and block_m once or twice that (the pixels are "
         "loaded in boxes of the tail's height)"),
        (stores_by_row_blocks(c) and (c.consumers != 1 or c.block_n_tail or c.block_m // (16 * c.num_warps) < 2
                                      or c.block_m_tail not in (0, c.block_m // 2) or not hopper),
         f"{c.num_buffers} stages leave no room for a staging buffer of the whole tile, and storing it by row "
         f"blocks (section 6) needs Hopper, one consumer of block_m / 32 warps or fewer, no column tail, and a "
         f"row tail (if any) of block_m / 2; use fewer stages")]
    for broken, rule in rules:
        if broken:
            raise ValueError(f"config {config}: {rule}")




@gluon.constexpr_function
def ring_bytes(config, element_size=2):
    """Shared memory of the ring: per stage, the A rows of a tile and the B rows, BLOCK_K deep."""
    config = KernelConfig(*config)    # (a constexpr function's argument arrives as a plain tuple)
    return config.num_buffers * (config.tile_m + config.tile_n) * config.block_k * element_size


@gluon.constexpr_function
def stores_by_row_blocks(config, element_size=2):
    """Section 6: whether the epilogue stores each tile in blocks of half its main rows through one
    staging buffer of that height, where a staging buffer of the whole tile would not fit beside
    the ring. (A constexpr function: the host and the kernel ask the same question.)"""
    config = KernelConfig(*config)
    whole_tile = config.consumers * config.tile_m * config.tile_n * element_size
    return ring_bytes(config, element_size) + whole_tile > SHARED_MEMORY_PER_PROGRAM


# The barriers beside the ring's ready/empty pairs: ping-pong's turn pair (Hopper) or the two accumulator
# pairs (Blackwell), at most 48 bytes, with room for their alignment. Both kernels' models use it.
OTHER_BARRIER_BYTES = 64
# What a build allocates beyond the models' count (shared_memory_bytes here and in wgrad.py): the
# barriers' alignment and the warp specialization's own scratch. A few hundred bytes; the builds are
# checked to stay within it (tests/operator/test_runtime.py, tests/kernels/test_host_model.py).
BUILD_MARGIN_BYTES = 1024


def barrier_bytes(num_buffers):
    """Shared memory of a kernel's mbarriers: a ready and an empty barrier per ring stage, and the
    others (OTHER_BARRIER_BYTES)."""
    return 2 * num_buffers * MBARRIER_BYTES + OTHER_BARRIER_BYTES


def shared_memory_bytes(config, element_size=2):
    """The shared memory a build of this config allocates, to within BUILD_MARGIN_BYTES (the one
    model of it; the builds of every candidate are checked against it): the ring's A and B stages,
    one staging tile per consumer (half the main rows where it stores by row blocks, section 6), and
    the barriers."""
    c = KernelConfig(*config)
    staging_rows = c.block_m // 2 if stores_by_row_blocks(c) else c.tile_m    # (the kernel asks it at 2 bytes)
    staging = c.consumers * staging_rows * c.tile_n * element_size
    return ring_bytes(c, element_size) + staging + barrier_bytes(c.num_buffers)


def fits_shared_memory(config, limit=SHARED_MEMORY_PER_PROGRAM, element_size=2):
    """Whether a config's shared memory fits a program (`limit`: the device's opt-in maximum) and its
    programs_per_sm programs fit one SM, each with the driver's reserve beside it."""
    smem = shared_memory_bytes(config, element_size)
    return smem <= limit and \
        KernelConfig(*config).programs_per_sm * (smem + SHARED_MEMORY_RESERVED_PER_PROGRAM) <= SHARED_MEMORY_PER_SM


def register_budget(config, arch, residual=False):
    """How many fp32 values of its tile one thread of a consumer holds in registers without spilling:
    the accumulators and, with a residual epilogue (`residual`), the residual values of the rows it
    stores at once. None on Blackwell: its accumulators live in tensor memory.

    Why these numbers: the register file (64K per SM) is split by the kernel's warp_specialize among
    the consumers and the loader. One 4-warp consumer may use up to 256 registers per thread and holds
    192 values (the rest: addresses, loop state, the epilogue's offsets); ping-pong's warpgroups get
    240 and hold 192 accumulators too, but beside a residual's loads only 160, as do 8-warp consumers
    (about 232). Two programs per SM run at 128 registers (kernel_constexprs' maxnreg) and hold 96.
    The builds of every Hopper candidate are checked against this (tests/operator/test_runtime.py)."""
    if arch != "sm_90":
        return None
    c = KernelConfig(*config)
    if c.programs_per_sm > 1:
        return 96
    if c.num_warps == 4 and (c.consumers == 1 or not residual):
        return 192
    return 160


def block_k_channels(config, Ci_padded, element_size):
    """The K block in channels of the operand's dtype. A config's BLOCK_K counts 2-byte channels
    (64 of them: 128 bytes), so 1-byte e4m3 takes twice as many (section 9). Small channel counts
    (a padded Ci of 8 or 16) get a smaller K block, so fewer zeros are multiplied, never below an
    MMA's K of 32 bytes."""
    block_k = config.block_k * 2 // element_size
    if Ci_padded < block_k:
        block_k = max(16, triton.next_power_of_2(Ci_padded))
    return max(block_k, 32 // element_size)


def channel_blocks(config, Ci_group, element_size):
    """The K blocks of one filter tap: Ci_group (the channels per group, padded to whole 16-byte
    pixels as TMA loads them) in K blocks of block_k_channels. A tap's share of the K loop."""
    return triton.cdiv(Ci_group, block_k_channels(config, Ci_group, element_size))


def groups_fit(config, Ci_group, Co_group, element_size=2):
    """Whether a grouped conv's tiles stay inside one group (lesson 05, section 10): each tile's
    columns in one group's Co_group output channels, each K block in its Ci_group input channels."""
    return Ci_group % block_k_channels(config, Ci_group, element_size) == 0 and Co_group % config.tile_n == 0


def check_groups_fit(config, geometry, element_size=2):
    if geometry.groups > 1 and element_size == 1:
        raise ValueError(f"{geometry.describe()}: grouped convs run in fp16 or bf16 (section 10), not e4m3")
    if geometry.groups > 1 and not groups_fit(config, geometry.Ci_group, geometry.Co_group, element_size):
        block_k = block_k_channels(config, geometry.Ci_group, element_size)
        raise ValueError(f"config {config}: {geometry.describe()}: a tile must stay in one group, so the K block "
                         f"({block_k}) must divide Ci / groups and the tile's width ({config.tile_n}) Co / groups")


def tile_grid(config, M, Co):
    """(num_pid_m, num_pid_n): the output tiles of a launch along the rows (M pixels, tile_m at a time)
    and the columns (Co channels, tile_n at a time). The one home of the grid: the launch passes it to
    the kernel (ConvShape), and every host count of tiles starts here."""
    config = KernelConfig(*config)
    return triton.cdiv(M, config.tile_m), triton.cdiv(Co, config.tile_n)


def tile_order(tile_id, num_pid_m, num_pid_n, group_m=GROUP_M.value):
    """(pid_m, pid_n) of linear tile `tile_id`: the host twin of TileSchedule.work's grouped order,
    group_m row-tiles at a time down a group, then the next column (so tiles that run side by side
    share strips of A and B in L2). The same integer arithmetic as the kernel's (a test runs both);
    for host models of which program runs which tile (the backward's phase balance)."""
    tiles_per_group = group_m * num_pid_n
    first_m = tile_id // tiles_per_group * group_m
    rows_in_group = min(num_pid_m - first_m, group_m)
    return first_m + tile_id % tiles_per_group % rows_in_group, tile_id % tiles_per_group // rows_in_group


def tile_counts(config, M, Co, num_sms):
    """(programs, tiles, whole tiles) of a launch: the persistent grid, the conv's output tiles,
    and how many of them run whole (section 7 splits those past the last full wave)."""
    config = KernelConfig(*config)
    num_pid_m, num_pid_n = tile_grid(config, M, Co)
    tiles = num_pid_m * num_pid_n
    programs = min(config.programs_per_sm * num_sms, tiles * config.split_k)
    return programs, tiles, whole_tile_count.fn(tiles, programs, config.split_k)


class Epilogue(NamedTuple):
    # What the epilogue applies to each tile: act(acc * scale + bias + residual), per part.
    bias: bool = False          # + bias[co]: a conv bias, or a folded BatchNorm's shift
    scale: bool = False         # * scale[co]: a folded BatchNorm's gamma / sqrt(var + eps)
    residual: bool = False      # + residual[n, y, x, co]: a ResNet block's skip connection
    activation: str = "none"    # one of conv_tutorial.core.epilogue.ACTIVATIONS: "none", "relu", "silu" (the backward: "relu_grad")


# The conv's run-time integers, named, in the order the kernel's first line unpacks them (section 10:
# Ci_group, the input channels per group padded to 16 bytes; channel_blocks: BLOCK_K blocks per tap).
ConvShape = NamedTuple("ConvShape", [(name, int) for name in "M Co num_pid_m num_pid_n out_h out_w stride_h stride_w "
                                    "pad_h pad_w dil_h dil_w Ci_group Co_group S k_steps channel_blocks".split()]
                       + [("w_taps", tuple)])      # the backward: a FlippedFilter's kernel_args; else None


DESCRIPTORS = ("in_desc", "w_desc", "w_tail_desc", "out_desc", "out_tail_desc")   # the kernel's first parameters


class ConvLaunch(NamedTuple):
    grid: tuple
    in_desc: object                # im2col descriptor of the input
    w_desc: object                 # tiled descriptor of the weights [Co, R*S*Ci]
    w_tail_desc: object            # section 6: a column tail's weights; else None
    out_desc: object               # tiled descriptor of out_2d
    out_tail_desc: object          # section 6: a tail's (or a row block's) output box; else None
    pointers: tuple                # the epilogue's bias, scale, residual and (section 7) partial-sum pointers
    shape: ConvShape
    out_2d: torch.Tensor           # [M, Co rounded up to 16 bytes], written by the kernel
    partial: torch.Tensor = None   # section 7: the fp32 workspace [split_k, M, Co]; else None
    tiles: tuple = None            # section 7: (tile_m, tile_n, num_pid_m, num_pid_n, whole_tiles)
    out_window: tuple = None       # the backward: an OutputWindow's kernel_args (the output stored there); else None
    channel_stats: torch.Tensor = None   # the backward: fp32 [2, Co], zeroed, for the per-channel sums; else None

    def kernel_args(self):
        # The kernel's run-time arguments, in its signature's order.
        return tuple(getattr(self, name) for name in DESCRIPTORS) + (self.pointers, self.shape, self.out_window,
                                                                     self.channel_stats)


def output_nhwc(geometry, out_2d):
    """The kernel's output, the [M, Co rounded up to 16 bytes] matrix, as NHWC [N, out_h, out_w, Co]."""
    out = out_2d.view(geometry.N, geometry.out_h, geometry.out_w, out_2d.shape[1])
    return out if out_2d.shape[1] == geometry.Co else out[..., :geometry.Co].contiguous()


def kernel_constexprs(config, arch, epilogue=Epilogue()):
    # The kernel's constexprs and launch options, by name.
    config = KernelConfig(*config)
    return dict(CONFIG=config, EPILOGUE=Epilogue(*epilogue), IS_BLACKWELL=MMA_FLAVOUR[arch] == "tcgen05",
                num_warps=config.num_warps, enable_fp_fusion=True,   # the epilogue's a * scale + bias as one FMA
                **({"maxnreg": 128} if config.programs_per_sm > 1 else {}))


def prepare_launch(x_nhwc, w, bias, geometry, config, arch, num_sms, scale=None, residual=None, out_dtype=None,
                   out_window=None, channel_stats=None):
    # A ConvLaunch for these tensors (CPU tensors work too: the ahead-of-time compile uses them). out_window: a
    # core.windows.OutputWindow (the backward) to store the output into, pixel by pixel, instead of out_2d; channel_stats
    # (the backward): a zeroed fp32 [2, Co] tensor that the epilogue adds the output's per-channel sums into
    # (core.windows.check_channel_stats).
    config = KernelConfig(*config)
    check_config(config, arch)
    g = geometry
    destinations = check_epilogue_destinations(out_window, channel_stats, g, out_dtype or x_nhwc.dtype,
                                                      x_nhwc.device, config.split_k, config.tile_n)
    check_groups_fit(config, g, x_nhwc.element_size())                     # section 10
    w_taps = flipped_filter_taps(w, g, x_nhwc.dtype, out_window)    # the backward: w read in place; else None
    x_nhwc, w, Ci_padded = pad_channels_for_tma(x_nhwc, w)
    Ci_group = Ci_padded // g.groups
    BLOCK_K = block_k_channels(config, Ci_group, x_nhwc.element_size())    # 128 bytes: 128 e4m3 (section 9)
    settings = conv_im2col_settings(g)      # (padded channels move no pixel)
    lanes = 16 // (out_dtype or x_nhwc.dtype).itemsize        # output elements per 16 bytes: out_2d's row length
    out_2d = torch.empty(g.M if out_window is None else 1, -(-g.Co // lanes) * lanes, device=x_nhwc.device,
                         dtype=out_dtype or x_nhwc.dtype)     # (with a window, only its descriptor's shape is used)

    def descriptors(rows, columns, pixel_box=0):    # of x, w and out_2d, for output boxes of rows x columns
        return conv_tma_descriptors(x_nhwc, w, out_2d, settings, rows, columns, BLOCK_K, pixel_box=pixel_box)
    # section 6: a row tail loads the pixels in boxes of the tail's height (two for the main rows; without
    # a row tail, block_m_tail = 0, one box of block_m)
    in_desc, w_desc, out_desc = descriptors(config.block_m, config.block_n, pixel_box=config.block_m_tail)
    # section 6: the tail's boxes are the main boxes of a tile block_n_tail wide (the column tail's weights
    # and output) or block_m_tail tall (its output; stored by row blocks, half the main rows)
    w_tail_desc = out_tail_desc = None    # a constexpr None: nothing for the launcher to encode
    if config.block_n_tail:
        _, w_tail_desc, out_tail_desc = descriptors(config.block_m, config.block_n_tail)
    if config.block_m_tail or stores_by_row_blocks(config):
        out_tail_desc = descriptors(config.block_m_tail or config.block_m // 2, config.block_n)[2]
    num_pid_m, num_pid_n = tile_grid(config, g.M, g.Co)
    blocks = channel_blocks(config, Ci_group, x_nhwc.element_size())
    k_steps = g.R * g.S * blocks
    if config.split_k > k_steps:
        raise ValueError(f"config {config}: split_k={config.split_k} exceeds the {k_steps} k-steps of {g.describe()}")
    # section 7: the fp32 workspace partial[split, m, co], on the output's device
    partial = out_2d.new_empty(config.split_k, g.M, g.Co, dtype=torch.float32) if config.split_k > 1 else None
    # absent epilogue tensors: any pointer will do, the constexprs compile their loads away
    pointers = tuple(t if t is not None else out_2d for t in (bias, scale, residual, partial))
    shape = ConvShape(g.M, g.Co, num_pid_m, num_pid_n, g.out_h, g.out_w, *g.stride, *g.padding, *g.dilation,
                      Ci_group, g.Co_group, g.S, k_steps, blocks, w_taps)
    programs, _, whole_tiles = tile_counts(config, g.M, g.Co, num_sms)
    tiles = (config.tile_m, config.tile_n, num_pid_m, num_pid_n, whole_tiles) if partial is not None else None
    return ConvLaunch((programs, 1, 1), in_desc, w_desc, w_tail_desc, out_desc, out_tail_desc, pointers, shape,
                      out_2d, partial, tiles, *destinations)


def conv2d_fprop_launch(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=FIXED_CONFIG,
                        scale=None, residual=None, activation="none", groups=1, out_dtype=None, out_window=None,
                        channel_stats=None):
    """The warp-specialized conv, launched plainly. x_nhwc [N, H, W, Ci], w [Co, R, S, Ci] (fp16,
    bf16 or, section 9, e4m3; CUDA, contiguous); returns NHWC [N, out_h, out_w, Co] in x's dtype
    (e4m3 operands: bf16, or e4m3 if out_dtype asks). The epilogue computes act(conv * scale + bias
    + residual) in fp32 before the cast: optional bias and scale [Co] (fp32 or x's dtype), residual
    of the output's shape and dtype, activation "none", "relu" or "silu". groups > 1 (section 10):
    w is [Co, R, S, Ci / groups]. out_window (the backward): store into its view instead, and return that.
    channel_stats (the backward): a zeroed fp32 [2, Co] tensor; the epilogue adds each output channel's sum and
    sum of squares (of the output as stored, summed in fp32) into it, every program into the same tensor."""
    geometry = check_conv_call(x_nhwc, w, bias, stride, padding, dilation, dtypes=KERNEL_DTYPES, scale=scale,
                               residual=residual, activation=activation, out_dtype=out_dtype, groups=groups,
                               activations=EPILOGUE_ACTIVATIONS)
    arch, num_sms = tma_mma_arch_and_sms("conv2d_fprop_launch")
    launch = prepare_launch(x_nhwc, w, bias, geometry, config, arch, num_sms, scale, residual,
                            output_dtype(x_nhwc.dtype, out_dtype), out_window, channel_stats)
    epilogue = Epilogue(bias is not None, scale is not None, residual is not None, activation)
    conv2d_fprop_kernel[launch.grid](*launch.kernel_args(), **kernel_constexprs(KernelConfig(*config), arch, epilogue))
    if launch.partial is not None:                 # split-K's second kernel (section 7): sum the slices
        grid, args, constexprs = split_k_epilogue_launch(launch, bias, scale, residual, activation)
        split_k_epilogue_kernel[grid](*args, **constexprs)
    return output_nhwc(geometry, launch.out_2d) if out_window is None else out_window.view


@triton.jit
def split_k_epilogue_kernel(partial_ptr, out_ptr, epilogue_ptrs, M, Co, out_stride, tiles, SPLIT_K: tl.constexpr,
                            EPILOGUE: tl.constexpr, BLOCK: tl.constexpr):
    # out[m, co] = act(sum over splits of partial[split, m, co] * scale + bias + residual), where
    # (m, co) lies in a split tile: one numbered whole_tiles or later in the conv's grouped order
    # (the inverse of TileSchedule's order, for the tile_m x tile_n tiles of the conv)
    bias_ptr, scale_ptr, residual_ptr = epilogue_ptrs
    tile_m, tile_n, num_pid_m, num_pid_n, whole_tiles = tiles
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pid_m, pid_n = rows // tile_m, cols // tile_n
    first_m = pid_m // GROUP_M * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    tile_id = (first_m * num_pid_n + pid_m - first_m)[:, None] + pid_n[None, :] * rows_in_group[:, None]
    inside = (rows[:, None] < M) & (cols[None, :] < Co) & (tile_id >= whole_tiles)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        offsets = (rows + split * M).to(tl.int64)[:, None] * Co + cols[None, :]
        acc += tl.load(partial_ptr + offsets, mask=inside, other=0.0)
    residual_offsets = rows.to(tl.int64)[:, None] * Co + cols[None, :]
    residual = tl.load(residual_ptr + residual_offsets, mask=inside, other=0.0) if EPILOGUE.residual else 0.0
    acc = apply_epilogue(acc, cols, Co, scale_ptr, bias_ptr, residual, EPILOGUE)
    out_offsets = rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=inside)


def split_k_epilogue_launch(launch, bias=None, scale=None, residual=None, activation="none"):
    # (grid, args, constexprs) of split-K's second kernel: sum the slices, apply the epilogue
    (split_k, M, Co), out_2d = launch.partial.shape, launch.out_2d     # the workspace: partial[split, m, co]
    grid = (triton.cdiv(M, 64), triton.cdiv(Co, 64))
    pointers = tuple(t if t is not None else out_2d for t in (bias, scale, residual))
    args = (launch.partial, out_2d, pointers, M, Co, out_2d.stride(0), launch.tiles)
    epilogue = Epilogue(bias is not None, scale is not None, residual is not None, activation)
    return grid, args, dict(SPLIT_K=split_k, EPILOGUE=epilogue, BLOCK=64, enable_fp_fusion=True)
