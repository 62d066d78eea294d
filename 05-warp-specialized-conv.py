"""
Lesson 05: a persistent, pipelined, warp-specialized convolution for Hopper and Blackwell
=========================================================================================

What you will learn:

- why lesson 04 leaves the tensor cores idle, and how a ring of shared-memory stages with
  ready/empty mbarriers lets TMA loads run ahead of the MMAs;
- warp specialization: a one-warp loader that only issues TMA, then MMA issue and the epilogue,
  each where the architecture wants them (and why Hopper maps them differently from Blackwell);
- a persistent grid (one program per SM) walking output tiles in a grouped, L2-friendly order,
  and one tile's epilogue overlapped with the next tile's main loop;
- a fused epilogue, act(conv * scale + bias + residual), so that a folded BatchNorm, a ResNet
  block's skip connection and its ReLU cost no pass of their own;
- then what real layers need, one extension at a time: tiles that are not a power of two
  (160 columns, 192 rows), split-K for layers with few tiles, the small-Ci fold of a stem, fp8
  operands and grouped convs.

Builds on: lesson 04 (TMA im2col + one MMA per k-step, its `HopperWGMMA`/`BlackwellTcgen05`)
and lesson 03 (the im2col descriptor). What changed since lesson 04: the same inner step, now fed
by a multi-stage pipeline from its own warp, in a persistent kernel, with the epilogue overlapped.

Requires: sm_90 (H100/H200) or sm_100 (B200/GB200) for GPU runs. On a CPU: input checks and
ahead-of-time compiles for sm_90 and sm_100 whose PTX is checked.

Note: the Blackwell path is compiled and inspected, not run: no Blackwell GPU was available to this
series. All measured numbers in this file come from an H100.

Run:  python 05-warp-specialized-conv.py [--outdir out]
      (its benchmarks, on a GPU: python benchmarks/network_suite.py [--ladder | --fp8])

Tests: pytest 05-warp-specialized-conv.py
"""

# %%
from typing import NamedTuple

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout, allocate_tensor_memory, tcgen05_commit, tcgen05_mma, tensor_memory_descriptor)
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

lesson04 = common.load_lesson("04-implicit-gemm-single-buffer")   # its MMA step, HopperWGMMA

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)    # e4m3: section 9
# A run-time integer in an aggregate: a tensor, or a constexpr where Triton specialized the
# argument (it compiles a value of 1 in as a constant).
Int = gl.tensor | gl.constexpr

# %%
# The lesson runs section by section: each `if __name__ == "__main__"` cell runs the demo of the
# section above it (importing the lesson runs nothing); the GPU parts run where a Hopper or
# Blackwell GPU is present.
if __name__ == "__main__":
    args = common.lesson_args("Lesson 05: warp-specialized persistent conv")
    outdir, on_gpu = common.output_dir(args.outdir), common.has_tma_mma_gpu()

# %%
# What is wrong with lesson 04
# ----------------------------
# Lesson 04's loop is: wait for the MMA, load A and B, wait for the load, issue the MMA. At any
# moment either the copy engine or the tensor cores work, never both. On an H100 (2026-11-22) it
# ran the headline shape (N=128, 64x64, 384->384, 3x3, bf16) at 487 TFLOPS against cuDNN's 705:
# it only got that far because several of its small programs share an SM and interleave by
# accident. Part I builds the kernel that makes the overlap deliberate, one idea per section:
#
# 1. a ring of shared-memory stages, so that loads run ahead of the MMAs;
# 2. warp specialization: a loader warp, and MMA + epilogue warps mapped per architecture;
# 3. a persistent grid walking the tiles in a grouped order;
# 4. the epilogue of one tile overlapped with the main loop of the next;
# 5. a fused epilogue: scale, bias, residual and activation on the tile before it is stored.
#
# Part II adds what real layers need, each with the lines it adds to the same kernel:
#
# 6. tiles that are not a power of two wide or tall (a main MMA and a tail MMA);
# 7. split-K, for layers with fewer tiles than SMs;
# 8. the small-Ci fold, for a network's RGB stem;
# 9. fp8 operands, at twice the tensor-core rate;
# 10. grouped convs: a group is a slice of channels.
#
# The kernel's state travels in a few aggregates (`@gluon.aggregate` classes, Gluon's structs:
# named fields, jit methods, passed by value), so each partition takes the ring, the tile schedule and what it
# writes, and reads like the pseudocode above it.

# %%
# 1. A ring of stages, and the loader that fills it
# -------------------------------------------------
# NUM_BUFFERS shared-memory stages, each holding one A tile (BLOCK_M pixels x BLOCK_K channels,
# the im2col box) and one B tile (BLOCK_N filters x BLOCK_K). Stage i has two mbarriers:
#
# - ready[i]: the loads into it have landed (`mbarrier.expect` announces the byte count and the
#   TMA engine arrives with the bytes);
# - empty[i]: the MMA that read it is done (the consumer arrives).
#
# The producer waits for empty, the consumer for ready, and the loads of step k + NUM_BUFFERS - 1
# are in flight while step k multiplies. Each side counts the k-steps it has passed, across all
# tiles (`common.Counter`, an aggregate of two fields): the count gives the slot
# (count % NUM_BUFFERS) and the phase ((count // NUM_BUFFERS) & 1) to wait for. A fresh barrier
# counts as "phase 1 complete", so the producer waits for the opposite phase and its first pass
# over the ring finds every stage empty. The two sides, side by side::
#
#     loader (1 warp)                                consumer
#     for each tile, for k in its k-steps:           for each tile, for k in its k-steps:
#         wait empty[slot] (phase ^ 1)                   wait ready[slot] (phase)
#         expect ready[slot] (A + B bytes)               acc += A[slot] @ B[slot]^T
#         A[slot] = im2col_load(x, pixel, tap, c0)       arrive empty[slot] once the MMA is done
#         B[slot] = load(w2d, [co0, tap*Ci + c0])    after its last k-step: store the tile (section 2)


@gluon.aggregate
class Ring:
    # The stages and their barriers. The tail buffers belong to section 6; without a tail they are the main buffers
    # again, so one MMA `a_tail_bufs x b_tail_bufs` serves both kinds of tail.
    a_bufs: gl.shared_memory_descriptor       # [NUM_BUFFERS, BLOCK_M, BLOCK_K] pixels
    b_bufs: gl.shared_memory_descriptor       # [NUM_BUFFERS, BLOCK_N, BLOCK_K] filters
    a_tail_bufs: gl.shared_memory_descriptor  # section 6: a row tail's pixels
    b_tail_bufs: gl.shared_memory_descriptor  # section 6: a column tail's filters
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    NUM_BUFFERS: gl.constexpr

    @gluon.jit
    def b(self, slot, TAIL: gl.constexpr = False):
        # B of a stage for the MMA, [BLOCK_K, BLOCK_N]: the filters' rows seen transposed (a view of the same
        # bytes: K-major)
        bufs = self.b_tail_bufs if TAIL else self.b_bufs
        return bufs.index(slot).permute((1, 0))


# %%
# The loader needs, besides the ring and the tile order (section 3), where each k-step's boxes
# start. `Im2colWindow` holds the conv's geometry and answers two questions: where the im2col box
# of output pixels m, m+1, ... starts in the input (its tap-0 corner, lesson 03), and for k-step
# k, which tap (r, s) and which block of channels c0 it loads. The K loop runs taps outer and
# channel blocks inner, so the weights of step k start at column tap * Ci + c0 of w2d. (A grouped
# conv, section 10, reads only its group's Ci_group channels, from the group's first one.)


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
        # The tile of output channels co0, co0+1, ...: its group_channel, and where its weights lie (rows co0, ...
        # of w2d).
        return self.group_channel(co0), co0

    @gluon.jit
    def k_step(self, k, BLOCK_K: gl.constexpr, tile_taps):
        # (the tap's im2col offsets [r*dil_h, s*dil_w], input channel, where in w2d the weights' box starts).
        group_channel, co0 = tile_taps
        tap = k // self.channel_blocks
        c0 = (k % self.channel_blocks) * BLOCK_K
        r, s = tap // self.S, tap % self.S
        offsets = [(r * self.dil_h).to(gl.int16), (s * self.dil_w).to(gl.int16)]
        return offsets, group_channel + c0, [co0, tap * self.Ci_group + c0]


@gluon.jit
def loader_partition(in_desc, w_desc, w_tail_desc, ring, schedule, window):
    # One warp: for every (tile, k-step) of this program, wait for a free stage and fill it.
    PIXEL_BOX: gl.constexpr = in_desc.block_type.shape[0]     # pixels per im2col load
    BLOCK_M: gl.constexpr = ring.a_bufs.shape[1]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    # bytes that land per stage: TILE_M pixels of A (in boxes of PIXEL_BOX) and TILE_N rows of
    # weights (main box + tail box, section 6)
    stage_bytes: gl.constexpr = (in_desc.block_type.nbytes * schedule.TILE_M // PIXEL_BOX
                                 + w_desc.block_type.nbytes * schedule.TILE_N // BLOCK_N)
    state = common.Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
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
            # B = load(w2d, [co0, (r*S + s)*Ci + c0]), and a column
            # tail's output channels after it
            tma.async_load(w_desc, w_at, ready, ring.b_bufs.index(slot))
            if schedule.TILE_N > BLOCK_N:
                tma.async_load(w_tail_desc, [w_at[0] + BLOCK_N, w_at[1]], ready,
                               ring.b_tail_bufs.index(slot))
            state = state.next()


# %%
# 2. Warp specialization: who issues what, per architecture
# ---------------------------------------------------------
# Issuing TMA takes one thread; doing it from the warps that run the MMAs steals their issue
# slots and forces the compiler to interleave two instruction streams. `gl.warp_specialize` runs
# separate functions in separate warps of one program. The two architectures want different
# splits:
#
# - Hopper: WGMMA must be issued by whole warpgroups (4 warps), its accumulator lives in the
#   issuing warps' registers, and its completion cannot arrive on an mbarrier. So MMA issue and
#   epilogue are one partition (a "consumer": 4 or 8 warps), which waits with
#   `warpgroup_mma_wait` until the previous step's MMA is done and then arrives on that stage's
#   empty barrier itself. The loader is a 1-warp worker whose registers are cut to 24
#   (`setmaxnreg`), so the MMA warps can keep large accumulators.
# - Blackwell: three partitions, as CUTLASS does. A 1-warp loader; a 1-warp MMA issuer (one
#   thread issues tcgen05, and `tcgen05_commit(empty[slot])` lets the hardware release the stage
#   when the MMAs finish); and the epilogue (4 warps, the default partition), which reads the
#   accumulator from tensor memory.
#
# Both end a tile the same way: `TileOutput.store` applies the fused epilogue (section 5), casts,
# and starts an asynchronous TMA store from a staging buffer. The store is not waited for: it
# drains while the next tile computes, and before the staging buffer is written again we wait
# until the previous store from it has read it (stores finish in order; STORES_IN_FLIGHT newer
# ones, from other buffers, may stay in flight).


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
            tma.store_wait(pendings=STORES_IN_FLIGHT)
            c_smem.store(y.to(out_desc.dtype))
            fence_async_shared()
            tma.async_store(out_desc, [m0, co0], c_smem)


# %%
# The Hopper consumer. Read it first with NUM_CONSUMERS=1 and no tail: wait for a stage, issue
# its MMA, wait until only this step's MMA is in flight, release the previous stage, and after
# the last k-step release the last stage and store the tile. The `turn` barrier (section 4), the
# `mma_tail` lines and the row-block stores (section 6) come later.


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
    state = common.Counter(CONSUMER * schedule.unit_k_steps(gl.program_id(0)), ring.NUM_BUFFERS)  # my first k-step
    local_tile = 0
    for unit in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), schedule.num_units(),
                      NUM_CONSUMERS * gl.num_programs(0)):
        work = schedule.work(unit)
        if NUM_CONSUMERS == 2:
            # my turn: the other consumer has issued the whole main loop of the tile before mine.
            # (A fresh barrier counts as phase 1 complete: consumer 0's first wait returns at once.)
            mbarrier.wait(turn.index(CONSUMER), (local_tile & 1) ^ (1 - CONSUMER))
        # acc = zeros(BLOCK_M, BLOCK_N) (+ the tail's)
        mma = lesson04.HopperWGMMA.initialize(ring.a_bufs.dtype, BLOCK_M, BLOCK_N, gl.num_warps())
        if HAS_TAIL:
            mma_tail = lesson04.HopperWGMMA.initialize(ring.a_bufs.dtype, TAIL_M, TAIL_N, gl.num_warps())
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


# %%
# Blackwell: a one-warp MMA issuer and the epilogue, joined by a double-buffered accumulator in
# tensor memory (TMEM). The MMA warp waits until the epilogue has read accumulator `buf`
# (acc.empty), runs the tile's k-steps into it, and commits acc.ready[buf] once every MMA of the
# tile has finished; the epilogue waits for acc.ready, loads the accumulator into registers and
# arrives on acc.empty so the MMA warp can reuse it while the store is still going on. The
# hand-off is a second, two-slot ring, counted the same way.


@gluon.aggregate
class TmemAccumulators:
    tmem: tensor_memory_descriptor        # [NUM_ACC, BLOCK_M, BLOCK_N] fp32 in TMEM
    tail_tmem: tensor_memory_descriptor   # section 6: a column tail's accumulators
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    NUM_ACC: gl.constexpr


@gluon.jit
def blackwell_mma_partition(ring, schedule, acc):
    state = common.Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    acc_state = common.Counter(gl.to_tensor(0), acc.NUM_ACC)
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
    acc_state = common.Counter(gl.to_tensor(0), acc.NUM_ACC)
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


# %%
# 3. A persistent grid and a grouped tile order
# ---------------------------------------------
# One program per SM, each looping over output tiles tile = pid, pid + num_programs, ... (every
# partition above walks this same sequence). No launch cost per tile, and the loader runs ahead
# into the next tile while the current one finishes. Tiles are numbered in groups of GROUP_M
# row-tiles (the order of Triton's matmul tutorial), so the Co/TILE_N tiles that share one strip
# of A run close together in time and read it from L2, not HBM. `TileSchedule` is that order:
# `work(unit)` gives a unit's tile and the k-steps it runs. Without split-K (section 7) a unit is
# a whole tile and its k-steps are all of them.

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

    @gluon.jit
    def num_units(self):
        # How many units the tiles make: whole tiles, plus SPLIT_K slices of each split one.
        num_tiles = self.num_pid_m * self.num_pid_n
        whole_tiles = whole_tile_count(num_tiles, gl.num_programs(0), self.SPLIT_K)
        return whole_tiles + (num_tiles - whole_tiles) * self.SPLIT_K

    @gluon.jit
    def unit_k_steps(self, unit):
        # The k-steps of a unit: k_steps (section 4's ping-pong runs without split-K).
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
        return WorkUnit(pid_m, pid_n, k_begin, k_end, split, partial)


@triton.jit
def whole_tile_count(num_tiles, programs, SPLIT_K: tl.constexpr):
    # How many tiles run whole: with split-K, those of the full waves (the rest are split, section 7). The kernel,
    # the host (`tile_counts`, which the second kernel and the runtime take it from) call this one function.
    return num_tiles // programs * programs if SPLIT_K > 1 else num_tiles


# %%
# 4. Overlapping the epilogue
# ---------------------------
# On Blackwell the double-buffered TMEM accumulator does it: the MMA warp starts tile t+1 in
# the other buffer while the epilogue drains tile t.
#
# On Hopper one warpgroup's registers hold one accumulator, so while it converts and stores tile
# t, nobody issues MMAs. CUTLASS's answer is "ping-pong": two consumer partitions, each with its
# own accumulator and staging buffer, take alternate tiles of the program (consumer 0 the 1st,
# 3rd, ... tile; consumer 1 the 2nd, 4th, ...). The loader does not change: it fills the ring tile
# after tile, and each consumer skips the other's k-steps in its counter.
#
# One rule needs a barrier of its own. A consumer waiting for a stage's `ready` barrier must be at
# most one fill ahead of it: mbarrier waits compare only the parity of the phase, so a consumer
# two fills ahead would see an old phase with the right parity and read a stage that holds the
# other consumer's data. So the consumers pass a turn: consumer c starts its main loop only after
# the other one has issued every MMA of the tile before (arrive on turn[c] after the loop, wait
# for turn[c] before it). This also keeps the main loops in order, which is the point: the tensor
# cores serve one tile at a time, and each epilogue hides under the other consumer's loop.
#
# With a single consumer (still a candidate: 256-row tiles need 8 warps) the overlap is partial:
# the loader prefetches the next tile's stages during the epilogue, and the TMA store of tile t
# drains while tile t+1 computes. Measured on an H100: ping-pong with 128x128 tiles reached
# 585-595 TFLOPS on the headline shape, no faster than one 4-warp consumer with the same tile
# (590-605). The winner there is a single 8-warp consumer with 256x128 tiles (700-760): per FLOP
# it moves a quarter fewer bytes through L2 and shared memory, and that matters more than the
# hidden epilogue.
#
# 5. Fused epilogues
# ------------------
# In a ResNet block a conv is followed by BatchNorm, the residual add and ReLU. Run as separate
# passes, each reads a whole activation tensor the conv has just written and writes another: on
# ResNet-50's 56x56 stage at batch 128 the 256-channel output is 205 MB in bf16, so BatchNorm +
# add + ReLU move at least 3 x 205 MB (read the conv's output and the residual, write the result),
# ~0.18 ms at the H100's 3.35 TB/s, on a layer whose conv itself takes ~0.1 ms. Even
# torch.compile, which fuses the three into one kernel, cannot fuse them into a cuDNN call.
#
# Our epilogue holds the tile in registers anyway. `TileOutput.store` (section 2) loads, each only
# if its switch asks for it so the plain kernel is unchanged, a per-channel fp32 scale, the bias
# (or shift) and the residual tile (read straight into the accumulator's register layout), and
# `apply_epilogue` combines them with the tile and applies ReLU or SiLU before the one store. It is
# a plain `@triton.jit` function (elementwise math needs no layouts), so split-K's second kernel
# (section 7) applies the very same epilogue. In eval mode BatchNorm is an affine map per channel
# and folds into the conv's weights and shift (conv_tutorial.fusion.fold_batchnorm), so conv -> BatchNorm ->
# add -> ReLU becomes one kernel that reads the residual once and writes the result once.
# conv_tutorial.fuse_conv_bn_act finds these chains in any model with torch.fx; benchmarks/resnet50.py
# measures what it does to a whole ResNet-50 (RESULTS.md).


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
    if EPILOGUE.residual:
        acc = acc + residual.to(tl.float32)
    if EPILOGUE.activation == "relu":
        acc = tl.maximum(acc, 0.0)
    if EPILOGUE.activation == "silu":      # x * sigmoid(x)
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


# %%
# The kernel
# ----------
# Allocate the ring, the staging buffers, the barriers and (Blackwell) the TMEM accumulators,
# bundle them, and split into the partitions. The host passes the conv's run-time integers as one
# tuple, `shape` (the first line names them), the epilogue's four pointers as another, and the
# config and the epilogue as constexprs. Where the architectures differ the kernel branches on
# the constexpr IS_BLACKWELL. The lines marked "section 6" are the tails' (Part II).


@gluon.jit
def conv2d_fprop_kernel(in_desc, w_desc, w_tail_desc, out_desc, out_tail_desc, epilogue_ptrs, shape,
                        CONFIG: gl.constexpr, EPILOGUE: gl.constexpr,
                        IS_BLACKWELL: gl.constexpr):
    (M, Co, num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, Ci_group, Co_group,
     S, k_steps, channel_blocks) = shape
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
    ready, empty = common.allocate_barrier_pairs(NUM_BUFFERS)
    ring = Ring(a_bufs, b_bufs, a_tail_bufs, b_tail_bufs, ready, empty, NUM_BUFFERS)
    # (epilogue_ptrs: the bias, scale, residual and partial-sum pointers, in TileOutput's order)
    schedule = TileSchedule(num_pid_m, num_pid_n, k_steps, BLOCK_M + BLOCK_M_TAIL, BLOCK_N + BLOCK_N_TAIL,
                            CONFIG.split_k)
    window = Im2colWindow(out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, Ci_group, Co_group, S,
                          channel_blocks)
    output = TileOutput(out_desc, out_tail_desc, c_smem, c_tail_smem, *epilogue_ptrs, M, Co, EPILOGUE,
                        STORE_BY_ROW_BLOCKS)
    if IS_BLACKWELL:
        NUM_ACC: gl.constexpr = 2
        acc_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N],
                                          TensorMemoryLayout([BLOCK_M, BLOCK_N], col_stride=1))
        acc_tail_tmem = acc_tmem
        if BLOCK_N_TAIL > 0:
            acc_tail_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N_TAIL],
                                                   TensorMemoryLayout([BLOCK_M, BLOCK_N_TAIL], col_stride=1))
        acc_ready, acc_empty = common.allocate_barrier_pairs(NUM_ACC)
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


# %%
# Configs
# -------
# A config fixes what the kernel is compiled for: the tile (BLOCK_M x BLOCK_N x BLOCK_K, plus an
# optional tail, section 6), the ring depth, the warps of each MMA/epilogue partition, the
# programs per SM, the consumers per program and the K slices (section 7). Some combinations are
# not implemented, and get a ValueError rather than a compile error or a hang.


# `KernelConfig`'s fields name the sections they belong to. Beside it, the shared-memory arithmetic
# the kernel and its launcher share, such as `stores_by_row_blocks` (section 6), a constexpr function
# the kernel calls too. (The operator's copy of the kernel keeps the same rules beside it, in
# conv_tutorial/kernels/fprop.py; its candidates, and what it prunes them by, are in
# conv_tutorial/configs.py.)


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
    """Combinations the kernel does not implement get a ValueError naming the config and the rule."""
    c, hopper = config, arch == "sm_90"
    rules = [   # (broken, the rule)
        (c.consumers > 2 or (c.consumers > 1 and not hopper),
         f"consumers={c.consumers}; ping-pong (2 consumers) is a Hopper schedule, elsewhere 1"),
        (c.programs_per_sm > 1 and not hopper, "programs_per_sm > 1 is offered on Hopper only"),
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


SHARED_MEMORY_PER_PROGRAM = common.SHARED_MEMORY_PER_PROGRAM    # bytes: a program's opt-in maximum (H100, B200)


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


def block_k_channels(config, Ci_padded, element_size):
    """The K block in channels of the operand's dtype. A config's BLOCK_K counts 2-byte channels
    (64 of them: 128 bytes), so 1-byte e4m3 takes twice as many (section 9). Small channel counts
    (a padded Ci of 8 or 16) get a smaller K block, so fewer zeros are multiplied, never below an
    MMA's K of 32 bytes."""
    block_k = config.block_k * 2 // element_size
    if Ci_padded < block_k:
        block_k = max(16, triton.next_power_of_2(Ci_padded))
    return max(block_k, 32 // element_size)


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


def tile_counts(config, M, Co, num_sms):
    """(programs, tiles, whole tiles) of a launch: the persistent grid, the conv's output tiles,
    and how many of them run whole (section 7 splits those past the last full wave)."""
    tiles = triton.cdiv(M, config.tile_m) * triton.cdiv(Co, config.tile_n)
    programs = min(config.programs_per_sm * num_sms, tiles * config.split_k)
    return programs, tiles, whole_tile_count.fn(tiles, programs, config.split_k)


# %%
# The plain launcher
# ------------------
# Everything a launch needs, built from scratch on every call: pad the channels to 16 bytes if
# needed (lesson 04), the TMA descriptors (the tail's two only when there is a tail), the grid (one
# program per SM, or fewer when there are fewer tiles), the run-time integers and the constexprs.
# `conv2d_fprop_launch` is the whole kernel behind one call; the runtime (after Part II) makes the
# same launch cheaper on the host.


class Epilogue(NamedTuple):
    # What the epilogue applies to each tile: act(acc * scale + bias + residual), per part.
    bias: bool = False          # + bias[co]: a conv bias, or a folded BatchNorm's shift
    scale: bool = False         # * scale[co]: a folded BatchNorm's gamma / sqrt(var + eps)
    residual: bool = False      # + residual[n, y, x, co]: a ResNet block's skip connection
    activation: str = "none"    # one of common.ACTIVATIONS: "none", "relu", "silu"


# The conv's run-time integers, named, in the order the kernel's first line unpacks them (section 10:
# Ci_group, the input channels per group padded to 16 bytes; channel_blocks: BLOCK_K blocks per tap).
ConvShape = NamedTuple("ConvShape", [(name, int) for name in "M Co num_pid_m num_pid_n out_h out_w stride_h stride_w "
                                    "pad_h pad_w dil_h dil_w Ci_group Co_group S k_steps channel_blocks".split()])


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

    def kernel_args(self):
        # The kernel's run-time arguments, in its signature's order.
        return tuple(getattr(self, name) for name in DESCRIPTORS) + (self.pointers, self.shape)


output_nhwc = lesson04.output_nhwc    # the kernel's output [M, Co rounded up to 16 bytes] as NHWC [N, out_h, out_w, Co]


def kernel_constexprs(config, arch, epilogue=Epilogue()):
    # The kernel's constexprs and launch options, by name.
    config = KernelConfig(*config)
    return dict(CONFIG=config, EPILOGUE=Epilogue(*epilogue), IS_BLACKWELL=arch == "sm_100",
                num_warps=config.num_warps, enable_fp_fusion=True,   # the epilogue's a * scale + bias as one FMA
                **({"maxnreg": 128} if config.programs_per_sm > 1 else {}))


def prepare_launch(x_nhwc, w, bias, geometry, config, arch, num_sms, scale=None, residual=None, out_dtype=None):
    # A ConvLaunch for these tensors (CPU tensors work too: the ahead-of-time compile uses them).
    config = KernelConfig(*config)
    check_config(config, arch)
    g = geometry
    check_groups_fit(config, g, x_nhwc.element_size())                     # section 10
    x_nhwc, w, Ci_padded = common.pad_channels_for_tma(x_nhwc, w)
    Ci_group = Ci_padded // g.groups
    BLOCK_K = block_k_channels(config, Ci_group, x_nhwc.element_size())    # 128 bytes: 128 e4m3 (section 9)
    settings = common.conv_im2col_settings(g)      # (padded channels move no pixel)
    lanes = 16 // (out_dtype or x_nhwc.dtype).itemsize        # output elements per 16 bytes: out_2d's row length
    out_2d = torch.empty(g.M, -(-g.Co // lanes) * lanes, device=x_nhwc.device, dtype=out_dtype or x_nhwc.dtype)

    def descriptors(rows, columns, pixel_box=0):    # of x, w and out_2d, for output boxes of rows x columns
        return common.conv_tma_descriptors(x_nhwc, w, out_2d, settings, rows, columns, BLOCK_K, pixel_box=pixel_box)
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
    num_pid_m, num_pid_n = triton.cdiv(g.M, config.tile_m), triton.cdiv(g.Co, config.tile_n)
    channel_blocks = triton.cdiv(Ci_group, BLOCK_K)
    k_steps = g.R * g.S * channel_blocks
    if config.split_k > k_steps:
        raise ValueError(f"config {config}: split_k={config.split_k} exceeds the {k_steps} k-steps of {g.describe()}")
    # section 7: the fp32 workspace partial[split, m, co], on the output's device
    partial = out_2d.new_empty(config.split_k, g.M, g.Co, dtype=torch.float32) if config.split_k > 1 else None
    # absent epilogue tensors: any pointer will do, the constexprs compile their loads away
    pointers = tuple(t if t is not None else out_2d for t in (bias, scale, residual, partial))
    shape = ConvShape(g.M, g.Co, num_pid_m, num_pid_n, g.out_h, g.out_w, *g.stride, *g.padding, *g.dilation,
                      Ci_group, g.Co_group, g.S, k_steps, channel_blocks)
    programs, _, whole_tiles = tile_counts(config, g.M, g.Co, num_sms)
    tiles = (config.tile_m, config.tile_n, num_pid_m, num_pid_n, whole_tiles) if partial is not None else None
    return ConvLaunch((programs, 1, 1), in_desc, w_desc, w_tail_desc, out_desc, out_tail_desc, pointers, shape,
                      out_2d, partial, tiles)


def conv2d_fprop_launch(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=FIXED_CONFIG,
                        scale=None, residual=None, activation="none", groups=1, out_dtype=None):
    """The warp-specialized conv, launched plainly. x_nhwc [N, H, W, Ci], w [Co, R, S, Ci] (fp16,
    bf16 or, section 9, e4m3; CUDA, contiguous); returns NHWC [N, out_h, out_w, Co] in x's dtype
    (e4m3 operands: bf16, or e4m3 if out_dtype asks). The epilogue computes act(conv * scale + bias
    + residual) in fp32 before the cast: optional bias and scale [Co] (fp32 or x's dtype), residual
    of the output's shape and dtype, activation "none", "relu" or "silu". groups > 1 (section 10):
    w is [Co, R, S, Ci / groups]."""
    geometry = common.check_conv_call(x_nhwc, w, bias, stride, padding, dilation, dtypes=KERNEL_DTYPES, scale=scale,
                                      residual=residual, activation=activation, out_dtype=out_dtype, groups=groups)
    arch, num_sms = common.tma_mma_arch_and_sms("conv2d_fprop_launch")
    launch = prepare_launch(x_nhwc, w, bias, geometry, config, arch, num_sms, scale, residual,
                            common.output_dtype(x_nhwc.dtype, out_dtype))
    epilogue = Epilogue(bias is not None, scale is not None, residual is not None, activation)
    conv2d_fprop_kernel[launch.grid](*launch.kernel_args(), **kernel_constexprs(KernelConfig(*config), arch, epilogue))
    if launch.partial is not None:                 # split-K's second kernel (section 7): sum the slices
        grid, args, constexprs = split_k_epilogue_launch(launch, bias, scale, residual, activation)
        split_k_epilogue_kernel[grid](*args, **constexprs)
    return output_nhwc(geometry, launch.out_2d)


def run_core_kernel():
    # Part I's kernel on one layer, launched plainly and compared with torch.
    common.check_conv(conv2d_fprop_launch, 4, 32, 32, 384, 384, 3, 3, 1, 1, dtype=torch.bfloat16)
    print(f"\nconv2d_fprop_launch ({FIXED_CONFIG}) matches torch.nn.functional.conv2d on {common.gpu_name()}")


# %%
if __name__ == "__main__" and on_gpu:
    run_core_kernel()

# %%
# Checks against torch (GPU)
# --------------------------
# The upstream Blackwell grid (N in {1, 128}, 64x64 images, Ci=Co in {384, 416}, 3x3/4x4/5x5
# filters, stride 1-2, padding 0-1) through the plain launcher, then awkward cases (Ci=3, dilation,
# Co not a multiple of the tile, odd sizes, fp16), ping-pong, and the fused epilogue. The reference
# is torch's conv2d in fp32 (and common.reference_epilogue for the epilogue); tolerances are
# explained in common.assert_close_to_reference.

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
@needs_gpu
@pytest.mark.parametrize("N", [1, 128])
@pytest.mark.parametrize("Ci_Co", [384, 416])
@pytest.mark.parametrize("R", [3, 4, 5])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", [0, 1])
def test_fixed_config_grid(N, Ci_Co, R, stride, padding):
    common.check_conv(conv2d_fprop_launch, N, 64, 64, Ci_Co, Ci_Co, R, R, stride, padding,
                      dtype=torch.bfloat16)



# %%
# What the compiler produced (no GPU needed)
# ------------------------------------------
# Compiled ahead of time, the PTX shows each partition's work: the im2col bulk copies (loader),
# `wgmma.mma_async` (Hopper) or `tcgen05.mma` (Blackwell), `setmaxnreg` (the loader's registers
# handed to the MMA warps) and the TMA store. The counts are instructions in the program text, not
# executions. The Blackwell build is checked against what a line-by-line review of its
# synchronization expects (RESULTS.md, "The Blackwell path"), since no Blackwell GPU has run it.
# The warps it reports: on sm_90 the 4 MMA/epilogue warps and the 1-warp loader, padded to a
# warpgroup; on sm_100 the 4 epilogue warps, the 1-warp MMA issuer and the 1-warp loader, padded.

IM2COL_LOAD, WEIGHT_LOAD, TMA_STORE = common.PTX_IM2COL_LOAD, common.PTX_TILED_LOAD, common.PTX_TMA_STORE
REGISTERS_GIVEN_BACK = "setmaxnreg moves registers between whole warpgroups: a worker lowers its limit to 24"
TAUGHT_PTX = {
    "sm_90": [
        (IM2COL_LOAD, "The A tile, one per k-step, the whole 128 x 64 box; the last two values: the tap's offsets."),
        (WEIGHT_LOAD, "The B tile, 128 filters x 64 channels, into the same ring stage."),
        ("wgmma.mma_async", "The consumer's MMAs: m64n128k16, so a 128 x 128 tile with BLOCK_K=64 "
                            "takes 2 row blocks x 4 K steps = 8 per k-step."),
        ("setmaxnreg.dec", REGISTERS_GIVEN_BACK + ": here the one worker partition, the loader."),
        ("setmaxnreg.inc", "The consumer's side: it raises its limit once the loader has given its registers back."),
        (TMA_STORE, "The epilogue's TMA store of the 128 x 128 tile from its staging buffer."),
    ],
    "sm_100": [
        (IM2COL_LOAD, "The A tile, in the loader partition's loop, as on sm_90."),
        (WEIGHT_LOAD, "The B tile, as on sm_90."),
        ("tcgen05.mma", "One thread issues 128 x 128 x 16 into tensor memory; BLOCK_K=64 takes 4 per k-step."),
        ("tcgen05.commit", "Two: once per k-step (the hardware arrives on the stage's empty barrier when the MMAs "
                           "that read it are done) and once per tile (the accumulator is ready for the epilogue)."),
        ("tcgen05.ld", "The epilogue reads the 128 x 128 fp32 accumulator from tensor memory."),
        ("setmaxnreg.dec", REGISTERS_GIVEN_BACK + ": here two (loader and MMA issuer)."),
        ("setmaxnreg.inc", "The epilogue warpgroup's side of the hand-over, as on sm_90."),
        (TMA_STORE, "The epilogue's TMA store, as on sm_90."),
    ],
}


def aot_conv2d_fprop(arch, N=2, H=16, W=16, Ci=64, Co=128, R=3, S=3, stride=1, padding=1,
                     config=FIXED_CONFIG, epilogue=Epilogue(), dtype="bfloat16"):
    # (kernel, args, kwargs) on CPU tensors, for common.aot_compile (`epilogue` as a list too;
    # dtype "float8_e4m3fn": the fp8 build of section 9, bf16 out).
    epilogue = Epilogue(*epilogue)
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, getattr(torch, dtype), device_name="cpu")
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
    per_channel, residual = torch.zeros(Co), torch.zeros(*geometry.output_shape_nhwc, dtype=torch.bfloat16)
    bias, scale, residual = (t if on else None for t, on in zip((per_channel, per_channel, residual), epilogue[:3]))
    launch = prepare_launch(x_nhwc, w, bias, geometry, config, arch, 132, scale, residual, torch.bfloat16)
    return conv2d_fprop_kernel, launch.kernel_args(), kernel_constexprs(config, arch, epilogue)


@pytest.mark.parametrize("arch", list(TAUGHT_PTX))
def test_kernel_compiles_with_expected_instructions(arch):
    common.assert_ptx_teaches("05-warp-specialized-conv", "aot_conv2d_fprop", arch, TAUGHT_PTX)


def run_show_ptx():
    return common.show_ptx("05-warp-specialized-conv", "aot_conv2d_fprop", TAUGHT_PTX, lambda arch, compiled: (
        f"conv2d_fprop_kernel, {FIXED_CONFIG}; {compiled['num_warps']} warps in all, padded to whole warpgroups"))


# %%
if __name__ == "__main__":
    run_show_ptx()

# %%
# Part II: what real layers need
# ==============================
# The kernel above runs any conv; these sections make it fast on layers whose sizes do not suit a
# 128 x 128 tile. Each one is a constexpr switch of the same kernel, off in Part I's configs.
#
# 6. Tiles that are not a power of two wide (or tall)
# ---------------------------------------------------
# Lines it adds: the `Ring`'s tail buffers and `TileOutput`'s tail box; in the loader, a third
# pixel box or a second weight box per stage; in each consumer, a second MMA (`mma_tail`) and a
# second store; in the kernel, the tail's buffers and `STORE_BY_ROW_BLOCKS`.
#
# Triton's tensors (so its shared buffers and accumulators) have power-of-two shapes, so with
# BLOCK_N=128 a layer with Co=320 computes three tiles of 128 columns, 384 in all: a sixth of the
# tensor-core work lands on columns that are thrown away. The hardware has no such rule: a
# WGMMA's N is any multiple of 8 up to 256, tcgen05's any multiple of 16, a TMA box any size up to
# 256. So a tile may carry a *tail*: BLOCK_N_TAIL more columns (32 here, making 160 = 320 / 2)
# with their own TMA box of weights, shared buffer, MMA (reading the same A tile), accumulator and
# store. The loader fills both weight boxes into one stage (one `expect` with the sum of the
# bytes); the consumer issues two MMAs per k-step and waits for both. Measured on an H100: the SD
# UNet's 320-channel layer went from 530 to 642 TFLOPS. A tail also pays where it fills SMs:
# Co = 1280 on a 16x16 map is 160 tiles of 128 for 132 SMs, or 128 of 160 (one wave).
#
# The same trick works in M. ResNet-50's 7x7 stage at batch 128 has M = 6272 pixels: 49 rows of
# 128-pixel tiles, so with Co = 512 196 tiles for 132 SMs. With 192-pixel tiles (a *row tail* of
# 64 under the main 128) it is 33 x 4 = 132 tiles, one wave. The pixels come in im2col boxes of
# the tail's height, each starting at its own output pixel, so at its own (n, y, x): the loader
# works those out once per tile, not per k-step (nine integer divisions per k-step made the
# one-warp loader the bottleneck: 580 against 752 TFLOPS on the SD UNet's 64x64 640->640). Where row
# tails paid most is the layers between memory and compute: per k-step a 192 x 128 tile reads 320
# rows for 24576 products, a 128 x 128 one 256 rows for 16384, a fifth fewer bytes per FLOP.
# ResNet-50's 7x7 512->512 3x3 went from 0.97x to 1.18x cuDNN. Row tails are a Hopper schedule
# here (on Blackwell a 64-row TMEM accumulator would be next).
#
# How deep the ring can be is a matter of shared memory, and the epilogue's staging buffer takes
# its share: a 192 x 128 tile stages 48 KB on its way out, and four 40 KB stages plus that fill
# 208 of the 227 KB. A fifth stage fits if the tile leaves in blocks of the tail's height through
# one 16 KB buffer: the main accumulator's top 64 rows, its bottom 64 rows, then the tail, each
# TMA store waited for before the next block overwrites the buffer (`stores_by_row_blocks`
# decides it from shared memory alone). Where a warpgroup holds two 64-row WGMMA blocks of the
# accumulator, side by side in each thread's registers, the split moves no data: it is a reshape
# and a split. The fifth stage hides HBM latency on layers that read a cold input:
# ResNet-50's 7x7 2048->512 1x1 went from 437 to 471 TFLOPS (cuDNN: 499).


@pytest.mark.parametrize("N, H, W, R, S, stride, padding", [
    (3, 7, 7, 1, 1, 1, 0),           # ResNet-50's 7x7 stage: 192-pixel tiles span images
    (2, 9, 13, 3, 3, (2, 1), 1),     # stride 2 in H only, padding
    (4, 5, 6, 3, 5, 2, (1, 2)),      # small images: a 64-pixel box covers several of them
])
def test_row_tail_boxes_read_what_one_tall_box_would(N, H, W, R, S, stride, padding):
    """The loader's 64-pixel boxes, each started at its own Im2colWindow.pixel_box_origin (the
    kernel's own method, run here as plain Python), read exactly the pixels of one 192-pixel im2col box
    started at the tile's first pixel: checked with lesson 03's model of the TMA im2col walk, for
    every tile and tap, the last tile's rows past M included."""
    import types
    walk = common.load_lesson("03-tma-im2col-modes").im2col_walk
    geometry = common.conv_geometry((N, H, W, 8), (8, R, S, 8), stride, padding)
    settings = common.conv_im2col_settings(geometry)
    window = (settings.pixel_box_lower_corner, settings.pixel_box_upper_corner, settings.element_strides)
    shape, g = (N, H, W, 8), geometry
    kernel_window = types.SimpleNamespace(out_h=g.out_h, out_w=g.out_w, stride_h=g.stride[0], stride_w=g.stride[1],
                                          pad_h=g.padding[0], pad_w=g.padding[1])
    for m0 in range(0, g.M, 192):
        for r in range(R):
            for s in range(S):
                offsets = settings.tap_offsets(r, s)
                tall = walk(shape, 192, *window, settings.start_coord(m0), offsets)
                boxes = []
                for box in range(3):
                    n, y, x = Im2colWindow.pixel_box_origin.fn(kernel_window, m0 + 64 * box)
                    boxes += walk(shape, 64, *window, (n, y, x, 0), offsets)
                assert boxes == tall, (m0, r, s)


# %%
# 7. Split-K for layers with too few tiles
# ----------------------------------------
# Lines it adds: the split branches of `TileSchedule.work` and `num_units` (section 3, where the tile
# order lives), the partial-sum branch of `TileOutput.store`, and a second, plain Triton kernel.
#
# A layer of a UNet's 8x8 stage (batch 8: M = 512 pixels, Co = 1280) has 40 tiles of 128x128 for
# 132 SMs, each with a K loop of 180 steps: 70% of the GPU idles while 40 SMs grind. Splitting
# the K loop of every tile into SPLIT_K slices makes SPLIT_K times as many units of work; each
# writes its fp32 partial sum to a workspace, partial[split, m, co], instead of storing the
# tile, and `split_k_epilogue_kernel` sums the slices and applies the same `apply_epilogue`. The
# price is the workspace's round trip (SPLIT_K x M x Co x 4 bytes, written and read) and a second
# launch, so the runtime offers split-K only where whole tiles would leave the last wave less
# than 80% full, and the autotuner decides. Measured on an H100: the SD UNet's 8x8 layer went
# from 320 to 411 TFLOPS with 3 slices (cuDNN: 372); at batch 1, ResNet-50's 7x7 512->512 3x3
# layer (4 tiles of 72 k-steps) from 23.6 us to 10.0 with 8 slices (cuDNN: 11.2). The second
# launch costs a few microseconds, so a short K loop stays whole.
#
# A layer with more tiles than SMs has the same problem in its last wave: ResNet-50's 7x7
# 2048->512 layer at batch 128 has 196 tiles of 128x128 for 132 SMs. Splitting every tile would
# pay the workspace for all 196; instead only the tiles past the last full wave are split
# (`TileSchedule.work`): 132 tiles run whole and store through the epilogue as usual, the other
# 64 run as 2 x 64 half-tiles in what was the second wave, and the second kernel finishes only
# those (it works out from the tile order which of its elements belong to split tiles).


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


@pytest.mark.parametrize("split_k, epilogue", [(2, Epilogue()), (3, Epilogue(True, True, True, "relu")),
                                               (4, Epilogue(True, False, False, "silu"))])
def test_split_k_epilogue_kernel_against_torch(split_k, epilogue):
    """The second kernel of split-K, on the CPU interpreter or a GPU: the slices' sum and the epilogue."""
    M, Co = 77, 100
    generator = torch.Generator().manual_seed(split_k)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(common.device())  # noqa: E731
    partial, bias, scale, residual = rand(split_k, M, Co), rand(Co), rand(Co), rand(M, Co)
    bias, scale, residual = (t if on else None for t, on in zip((bias, scale, residual), epilogue[:3]))
    out_2d = torch.full((M, 104), float("nan"), device=partial.device)
    launch = ConvLaunch(None, None, None, None, None, None, None, None, out_2d, partial,
                        (64, 64, 2, 2, 0))    # every tile split
    grid, args, constexprs = split_k_epilogue_launch(launch, bias, scale, residual, epilogue.activation)
    split_k_epilogue_kernel[grid](*args, **constexprs)
    expected = common.reference_epilogue(partial.sum(0), bias, scale, residual, epilogue.activation)
    torch.testing.assert_close(out_2d[:, :Co], expected, rtol=1e-5, atol=1e-5)
    assert out_2d[:, Co:].isnan().all()          # the row padding is not written


# %%
# 8. Small channel counts: folding the filter's columns into the channels
# -----------------------------------------------------------------------
# Lines it adds to the kernel: none. A network's RGB stem (Ci=3, padded to 8, 7x7 stride 2) gives
# the K loop 49 k-steps of 8 channels, 5 of them real. `conv_tutorial.runtime.FoldedConv` runs it as an
# R x 1 convolution over S * Ci folded channels instead: one small Triton kernel copies each
# pixel's row of S taps into its channels, and the same kernel then runs 7 k-steps of 24 real
# channels. Measured on an H100: ResNet-50's stem went from 0.62x cuDNN to 1.75x.


# %%
# 9. fp8: the same kernel at twice the tensor-core rate
# -----------------------------------------------------
# Hopper's WGMMA multiplies e4m3 (fp8: 4 exponent bits, 3 mantissa bits, largest value 448) at
# twice bf16's rate, and Blackwell's tcgen05 does the same (`kind::f8f6f4`). Lines it adds to the
# kernel: none. What changes is around it:
#
# - BLOCK_K counts bytes. A stage holds 128 bytes of K per row either way (the 128-byte swizzle
#   TMA and the tensor cores share), so a config's BLOCK_K of 64 bf16 channels is 128 e4m3 ones
#   (`prepare_launch`), and the stage's bytes, the ring and the shared memory are the same.
# - The instruction's K is 32 bytes too: m64nNk32 for e4m3 against k16 for bf16
#   (lesson 04's `wgmma_accumulator_layout` reads it off the operand type), so a k-step issues as many
#   MMAs as before, each doing twice the work.
# - Both operands K-major. fp8 WGMMA takes no transposed operand from shared memory; ours are
#   K-major already (pixels x channels, and filters x channels read as B^T).
# - The scales. fp8 needs them to use its range: x ~ x_q * x_scale (one per tensor, as the
#   activations arrive) and w[co] ~ w_q[co] * w_scale[co] (one per output channel). The sum over K
#   of x_q * w_q comes out of the MMA in fp32, and multiplying it by x_scale * w_scale[co] is the
#   dequantization: the fused epilogue's per-channel scale (section 5) does it at no cost, with a
#   folded BatchNorm's scale in the same vector.
# - The output: bf16, or e4m3 again (`out_dtype`), so that activations stay in fp8 from one conv to
#   the next. An e4m3 output needs a scale of its own, out_scale; dividing by it folds into the
#   same scale and bias for ReLU (relu(z) / s = relu(z / s)), not for SiLU, and a residual added in
#   e4m3 must be at the output's scale. The cast to e4m3 saturates at 448.
#
# So the launcher needs no fp8 entry of its own: `conv2d_fprop_launch` takes e4m3 operands, and the
# caller passes scale = x_scale * w_scale (the operator, conv_tutorial.conv2d_fp8, checks the scales
# and folds out_scale and a layer's own scale in).
#
# Measured on an H100 (results/h100-2026-11-24/fp8.json, kernels alone, each precision with the
# fastest of the same five configs): the headline shape runs at 1254 TFLOPS in e4m3 against 706
# in bf16 (1.78x); over the network suite's 84 layers e4m3 is 1.38x bf16, up to 1.9-2.0x on the
# SD UNet's wide 3x3 layers and no faster where the tensor cores are not the limit (the stem,
# 1x1 layers with few channels, Ci below 128 bytes: a 5x5 layer of 48 channels ran 0.77x, its
# k-steps half as long). A whole ResNet-50 in e4m3, a torch.fx pass away (conv_tutorial/fp8.py), runs 1.32x
# our bf16 one.


# On a CPU, a run of this file shows the fp8 build's e4m3 instructions (`run_fp8_demo`).
# The counts per k-step are the bf16 build's: 128 e4m3 channels are 128 bytes, k32 per MMA.
TAUGHT_PTX_FP8 = {
    "sm_90": [("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
               "e4m3 x e4m3 into fp32, K = 32 per instruction: 2 row blocks x 4 = 8 per k-step of 128 channels."),
              ("cvt.rn.bf16x2.f32", "The epilogue's cast of the dequantized tile to bf16, two values at a time.")],
    "sm_100": [("tcgen05.mma.cta_group::1.kind::f8f6f4", "One thread issues 128 x 128 x 32 in e4m3: 4 per k-step."),
               ("cvt.rn.bf16x2.f32", "The cast to bf16, as on sm_90.")],
}


# The fp8 build: 128 e4m3 channels, the dequantizing scale in the epilogue, a bf16 output.
FP8_BUILD = dict(Ci=128, epilogue=[False, True, False, "none"], dtype="float8_e4m3fn")


@pytest.mark.parametrize("arch", list(TAUGHT_PTX_FP8))
def test_fp8_kernel_compiles_to_e4m3_mmas(arch):
    common.assert_ptx_teaches("05-warp-specialized-conv", "aot_conv2d_fprop", arch, TAUGHT_PTX_FP8, **FP8_BUILD)


def run_fp8_demo():
    # On a GPU: a ResNet-50 3x3 layer in e4m3 against torch on the dequantized operands (network_suite.py --fp8
    # times it); on a CPU: what the fp8 build compiles to.
    if not on_gpu:
        return common.show_ptx("05-warp-specialized-conv", "aot_conv2d_fprop", TAUGHT_PTX_FP8,
                               lambda arch, compiled: "conv2d_fprop_kernel on e4m3 operands, bf16 output", **FP8_BUILD)
    x, w = common.random_conv_inputs(128, 14, 14, 256, 256, 3, 3, torch.float32)
    x_scale, w_scale = x.abs().amax() / 448, w.abs().amax(dim=(1, 2, 3)) / 448    # amax -> e4m3's largest value
    x_q, w_q = (x / x_scale).to(torch.float8_e4m3fn), (w / w_scale.view(-1, 1, 1, 1)).to(torch.float8_e4m3fn)
    out = conv2d_fprop_launch(x_q, w_q, padding=1, scale=x_scale * w_scale)     # dequantized by the epilogue
    exact = common.reference_conv2d_nhwc(x_q.float() * x_scale, w_q.float() * w_scale.view(-1, 1, 1, 1), padding=1)
    error = (out.float() - exact).norm() / exact.norm()
    print(f"\nfp8 on 128 x 14x14 256->256 3x3: relative error {error:.1e} against torch on the dequantized operands")


# %%
if __name__ == "__main__":
    run_fp8_demo()


# %%
# 10. Grouped convs: a group is a slice of channels
# -------------------------------------------------
# Lines it adds to the kernel: two fields of `Im2colWindow`, its `group_channel`, and one line of
# the loader. A grouped conv (ResNeXt's and RegNet's 3x3 layers) cuts the channels into `groups`
# slices: output channel co reads only the Ci / groups input channels of its group
# g = co // (Co / groups), and its filter holds only those (w is [Co, R, S, Ci / groups]). As a
# GEMM it is `groups` small GEMMs side by side, each R * S * Ci / groups deep. A tile whose
# columns lie in one group changes in one place: its im2col boxes start at the group's first
# channel, g * Ci / groups, instead of channel 0. Its weights change in none: w viewed as
# [Co, R * S * Ci / groups] holds the group's filters in the tile's rows, and a tap's columns are
# Ci / groups apart. So the loader works out the group's first channel once per tile and the K
# loop is section 1's, shorter. With groups = 1 the one group is all of Co, its first channel 0.
#
# A tile must not straddle groups: its columns in one group (output channels per group a multiple
# of TILE_N), its K blocks in one group's channels (input channels per group a multiple of
# BLOCK_K), or a box would read the next group's channels against this group's filters.
# `check_groups_fit` refuses other configs, and the runtime tunes among those that fit.
#
# ResNeXt-50's groups are narrower than any tile: 32 groups of 4, 8, 16 or 32 channels. The
# PyTorch module (`conv_tutorial.FusedConv2d`) merges P neighbouring groups into one, P = 16, 8, 4, 2,
# until a group is 64 channels wide: a merged group's filter is block-diagonal, each output
# channel's own filter at its old group's place among the P groups' channels, zeros elsewhere.
# Exact (the zeros multiply the other groups' channels), and P times the tensor-core work, which
# the tensor cores have to spare in layers this thin: the bytes, not the MMAs, set their time.
# Measured on an H100 (RESULTS.md), batch 128: ResNeXt-50's grouped 3x3s ran 0.97-1.26x cuDNN,
# merging twice as many groups 0.71-1.01x; the whole network went from 1.31x to 1.46x the frozen
# torch.compile. (Where even merged groups fill no tile, as RegNet's 21 groups of 48, torch keeps
# the conv.)


@pytest.mark.parametrize("N, H, W, groups, Ci_group, Co_group, R, stride, padding, BLOCK_K, TILE_N", [
    (2, 6, 5, 4, 16, 16, 3, 1, 1, 16, 16),     # 4 groups, a tile per group
    (1, 7, 7, 2, 32, 64, 3, 2, 1, 16, 32),     # two K blocks and two tiles per group, stride 2
    (2, 5, 6, 3, 16, 48, 1, 1, 0, 16, 16),     # 1x1, three tiles per group
])
def test_grouped_tiles_read_their_groups(N, H, W, groups, Ci_group, Co_group, R, stride, padding, BLOCK_K, TILE_N):
    """The loader's own arithmetic (Im2colWindow's pixel_box_origin, tile_taps and k_step, run
    as plain Python) with lesson 03's model of TMA im2col loads, and weight boxes cut from w2d,
    computes torch's grouped conv2d: every tile, every k-step."""
    import types
    reference = common.load_lesson("03-tma-im2col-modes").im2col_reference
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (N, H, W, groups * Ci_group), generator=generator).float()
    w = torch.randint(-3, 4, (groups * Co_group, R, R, Ci_group), generator=generator).float()
    g = common.conv_geometry(x.shape, w.shape, stride, padding, 1, groups)
    settings = common.conv_im2col_settings(g)
    corners = (settings.pixel_box_lower_corner, settings.pixel_box_upper_corner, settings.element_strides)
    window = types.SimpleNamespace(out_h=g.out_h, out_w=g.out_w, stride_h=g.stride[0], stride_w=g.stride[1],
                                   pad_h=g.padding[0], pad_w=g.padding[1], dil_h=common.PlainInt(1),
                                   dil_w=common.PlainInt(1), Ci_group=Ci_group, Co_group=Co_group, S=R,
                                   channel_blocks=Ci_group // BLOCK_K)
    window.group_channel = lambda co0: Im2colWindow.group_channel.fn(window, co0)
    w2d, BLOCK_M, out = w.reshape(g.Co, -1), 32, torch.zeros(g.M, g.Co)
    for m0 in range(0, g.M, BLOCK_M):
        n, y, x0 = Im2colWindow.pixel_box_origin.fn(window, m0)
        for co0 in range(0, g.Co, TILE_N):
            tile_taps = Im2colWindow.tile_taps.fn(window, co0)
            for k in range(R * R * window.channel_blocks):
                offsets, c, (row, column) = Im2colWindow.k_step.fn(window, common.PlainInt(k), BLOCK_K, tile_taps)
                a, _ = reference(x, BLOCK_M, BLOCK_K, *corners, [n, y, x0, c], offsets)
                rows = min(BLOCK_M, g.M - m0)
                out[m0:m0 + rows, co0:co0 + TILE_N] += (a @ w2d[row:row + TILE_N, column:column + BLOCK_K].T)[:rows]
    expected = common.reference_conv2d_nhwc(x, w, None, stride, padding, groups=groups)
    torch.testing.assert_close(out.view(expected.shape), expected)


def test_grouped_configs_that_straddle_groups_are_refused():
    x, w = common.random_conv_inputs(1, 8, 8, 128, 128, 3, 3, torch.bfloat16, device_name="cpu")
    w = w[..., :64].contiguous()                     # 2 groups of 64 -> 64: a 128-wide tile holds both
    geometry = common.conv_geometry(x.shape, w.shape, 1, 1, 1, groups=2)
    with pytest.raises(ValueError, match="a tile must stay in one group"):
        prepare_launch(x, w, None, geometry, FIXED_CONFIG, "sm_90", 132)
    prepare_launch(x, w, None, geometry, FIXED_CONFIG._replace(block_n=64), "sm_90", 132)   # 64 wide: fits


# %%
# Part III: around the kernel
# ===========================
# What compute-sanitizer says
# ---------------------------
# Random shapes cannot show that a warp-specialized kernel has no race; the CUDA toolkit's
# compute-sanitizer checks a run as it happens. `python tools/sanitize.py` runs its four tools
# (memcheck, racecheck, synccheck, initcheck) over lessons 04 and 05 on small shapes, for every
# Hopper candidate config. Measured on an H100: synccheck reports nothing, and the three reports
# of the others are not bugs of this kernel, each worth knowing if you write your own:
#
# - racecheck: a read-after-write "hazard" between two instructions that are not ours, in the
#   code with which `gl.warp_specialize` starts its workers (a word of shared memory per worker,
#   ordered by a block-wide named barrier). tools/racecheck_probe.cu models that protocol in 60
#   lines of CUDA: racecheck calls it clean, and "hazardous" once the default warpgroup also syncs
#   its own 128 threads (`bar.sync 0, 128`), as ours does around its mbarrier arrives.
# - memcheck: one CUDA API error per process, Triton's loader asking the driver for "oversized"
#   shared memory, being refused, and falling back to the classic attribute.
# - initcheck: the output reported uninitialized when copied to the host, because TMA stores are
#   not counted as writes (every element was compared with torch's result first).
#
# Racecheck is also blind to what matters most here: TMA and the tensor cores access shared memory
# through the async proxy, which it does not track. The ordering of those accesses is the review's
# job, and the tests' (RESULTS.md, "Sanitizers").
#
# The operator: the same kernel, cheaper to call, in PyTorch
# -----------------------------------------------------------
# `conv2d_fprop_launch` builds everything on every call, and on an H100 host that costs several
# times the 30-60 us a ResNet-50 layer runs on the GPU. The package beside the lessons,
# `conv_tutorial`, runs this kernel behind a host runtime that keeps what depends only on the shape
# in a plan, reuses validated descriptors, launches the compiled kernel directly and picks a config
# per shape (conv_tutorial/runtime.py and selection.py say how); `torch.ops.conv_tutorial.conv2d` is
# that conv as a PyTorch operator, under torch.compile and CUDA graphs, and
# `conv_tutorial.fuse_conv_bn_act` puts it into a model (README.md). Its copy of the kernel,
# conv_tutorial/kernels/fprop.py, adds the switches the backward needs (an output window, a strided
# dgrad's phases, a filter read in place, BatchNorm's channel sums, ReLU's backward); with them off it
# builds to this file's PTX, instruction for instruction, at every config this lesson teaches, and on a
# GPU it writes the same bits (tests/kernels/test_equivalence.py).

# %%
# What paid, and what did not
# ---------------------------
# Measured on an H100 with the network suite (every conv of ResNet-50 and Inception v3 at batch
# 128 and the 3x3 convs of the SD UNet at batch 8, ours and cuDNN in alternating rounds of one run). RESULTS.md
# has each row's details and logs, so you need not try them first.
#
#
# ==============================================  ========================================  =========
# attempt                                         measured effect                           kept
# ==============================================  ========================================  =========
# 160-wide tiles (column tail, section 6)         SD 320-ch layer 530 -> 642 TFLOPS         yes
# 192-row tiles (row tail, section 6)             RN50 7x7 512->512 0.97x -> 1.18x cuDNN    yes
# a 5th stage, stored by row blocks (section 6)   RN50 7x7 2048->512 437 -> 471 TFLOPS      yes
# split-K, last wave only (section 7)             SD 8x8 layer 320 -> 411 TFLOPS            yes
# folded stem (section 8)                         RN50 stem 0.62x -> 1.75x cuDNN            yes
# fused epilogue (section 5)                      ResNet-50 1.4x torch.compile              yes
# direct launch of the compiled kernel (runtime)  host time 71 -> 33 us per call            yes
# tuning per epilogue (runtime)                   RN50 28x28 128->512+res 0.147->0.095 ms   yes
# ping-pong consumers alone (section 4)           no faster than one consumer               candidate
# split-K by serial fix-up in the kernel          481-501 vs 557 TFLOPS                     no
# split-K summed in the kernel (L2 atomics)       RN50 b1 7x7 512->512: 12.9 vs 10.3 us     no
# BLOCK_K = 32 with 6 stages                      672 vs 759 TFLOPS (headline)              no
# BLOCK_K = 32 where Ci is not a multiple of 64   IncV3 160->160 7x1: 350 vs 336 TFLOPS     yes
# 192-wide tiles (128 + a 64-column tail)         IncV3 73x73 80->192: 249 -> 339 TFLOPS    yes
# BLOCK_K = 128                                   592 vs 693 TFLOPS (headline)              no
# L2 prefetch (whole tile, or k-steps ahead)      5-30% slower                              no
# tiled loads for 1x1 layers                      within noise                              no
# 2-CTA clusters (TMA multicast)                  im2col multicast runs in 3.9 (probe)      not built
# ==============================================  ========================================  =========
#
# Clusters. A pair of CTAs sharing its pixels (or its weights) loads them once with TMA multicast:
# on Triton 3.9 that load assembles and runs correctly (a probe kernel; results/notebook.md,
# 2026-11-24). What a pipelined pair lacks is the way back: before the leader refills a shared
# stage, the second CTA's consumer must arrive on the leader's barrier, and Gluon 3.9 on Hopper has
# only the leader's broadcast (the both-ways arrive exists for Blackwell and later). So this kernel
# is not clustered.
#
# What no schedule reaches: much more on the headline shape. Both kernels hold the H100 at its
# 700 W limit there, where the SM clock drops to ~1440 MHz and the dense bf16 peak to ~780 TFLOPS;
# ours ran 88% of that, cuDNN 89% (benchmarks/clocks_under_load.py).
#
# The measured ladder (GPU)
# -------------------------
# `python benchmarks/network_suite.py --ladder` measures, per shape, lesson 02's implicit GEMM,
# lesson 04, this lesson's kernel (autotuned, through the operator's runtime) and cuDNN, all in
# bf16, timed by common.bench_tflops (do_bench: median, L2 flushed, launch overhead included),
# this lesson and cuDNN in alternating rounds; without `--ladder` every layer of ResNet-50, the
# SD UNet and Inception v3. What it recorded on an H100:


# %%
if __name__ == "__main__":
    common.show_recorded_ladder(outdir, lambda fields: str(KernelConfig(*fields)))
    print(f"\nlesson 05: all checks passed on {common.gpu_name()}" if on_gpu else "\n" + common.cpu_closing_line(
        "05", "input validation, config rules, and the sm_90 and sm_100 builds of the kernel (the "
        "instructions above)", "running the kernel and comparing it with torch, the benchmark "
        "(benchmarks/network_suite.py), the sanitizers (tools/sanitize.py)"))
