"""
Lesson 05: a persistent, pipelined, warp-specialized convolution for Hopper and Blackwell
=======================================================================================

What you will learn:
- why lesson 04 leaves the tensor cores idle, and how a ring of shared-memory stages with
  ready/empty mbarriers lets TMA loads run ahead of the MMAs;
- warp specialization: a one-warp loader partition that only issues TMA, MMA issue, and the
  epilogue, each where the architecture wants them (and why Hopper maps them differently);
- a persistent grid (one program per SM) walking output tiles in a grouped, L2-friendly order;
- overlapping one tile's epilogue with the next tile's main loop (Blackwell: two accumulators in
  tensor memory; Hopper: two consumer warpgroups taking turns, "ping-pong");
- tiles that are not a power of two wide (160 = 128 + 32 columns for Co=320), built from two MMAs;
- host-side engineering: cached plans found at a glance, a small autotuner pruned to the device's
  shared memory (and tensor memory), channel padding, a fused bias, and clear errors;
- measuring it all against cuDNN: `python 05-warp-specialized-conv.py --bench`.

What changed since lesson 04: the same TMA im2col + MMA inner step, now fed by a multi-stage
pipeline from its own warp, in a persistent kernel, with the epilogue overlapped.
Requires: sm_90 (H100/H200) or sm_100 (B200/GB200) for GPU runs. On a CPU: validation, config
pruning, and ahead-of-time compiles for sm_90 and sm_100 whose PTX is checked.
Note: the Blackwell path is compiled and inspected, not run: no Blackwell GPU was available to this
series. All measured numbers in this file come from an H100 (see the bench output and JSON).
Run:  python 05-warp-specialized-conv.py [--bench] [--quick] [--outdir out]
Tests: pytest 05-warp-specialized-conv.py
"""

# %%
import functools
import math
import time
from typing import NamedTuple

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout, allocate_tensor_memory, tcgen05_commit, tcgen05_mma)
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

CONV_DTYPES = (torch.float16, torch.bfloat16)

# %%
# What is wrong with lesson 04
# ----------------------------
# Lesson 04's loop is: wait for the MMA, load A and B, wait for the load, issue the MMA. At any
# moment either the copy engine or the tensor cores work, never both. On an H100 (2026-11-22) it
# ran the headline shape (N=128, 64x64, 384->384, 3x3, bf16) at 487 TFLOPS against cuDNN's 705:
# it only got that far because several of its small programs share an SM and interleave by
# accident. Four changes make the overlap deliberate; a fifth stops computing padding columns.
#
# 1. A ring of NUM_BUFFERS shared-memory stages. Stage i has two mbarriers: ready[i] (the loads
#    into it have landed: TMA arrives on it with the byte count) and empty[i] (the MMA that read
#    it is done: the consumer arrives). The producer waits for empty, the consumer for ready, and
#    the loads of step k+NUM_BUFFERS-1 are in flight while step k multiplies. A counter that runs
#    across all k-steps of all tiles gives the slot (counter % NUM_BUFFERS) and the phase
#    ((counter // NUM_BUFFERS) & 1) each side waits for; the producer starts at the opposite
#    phase, so its first pass over the ring finds every stage empty.
#
# 2. Warp specialization. Issuing TMA takes one thread; doing it from the warps that run the
#    MMAs steals their issue slots and forces the compiler to interleave two instruction streams.
#    `gl.warp_specialize` runs separate functions in separate warps of one program:
#      - Blackwell: three partitions, as CUTLASS does. A 1-warp loader; a 1-warp MMA issuer (a
#        single thread issues tcgen05, and `tcgen05_mma(..., mbarriers=[empty[slot]])` lets the
#        hardware release the stage when the MMA finishes); and the epilogue (4 warps, the
#        default partition), which reads the accumulator from tensor memory. With two TMEM
#        accumulators, the MMA warp starts tile t+1 while the epilogue drains tile t.
#      - Hopper: WGMMA must be issued by whole warpgroups (4 warps), its accumulator lives in the
#        issuing warps' registers, and its completion cannot arrive on an mbarrier. So MMA issue
#        and epilogue are one partition (a "consumer": 4 or 8 warps), which waits with
#        `warpgroup_mma_wait(1)` (the previous MMA is done) and then arrives on that stage's empty
#        barrier itself; the loader is a 1-warp worker with its registers cut to 24 so the MMA
#        warps can keep large accumulators. There may be one consumer or two (point 4).
#
# 3. A persistent grid: one program per SM, each looping over output tiles
#    tile = pid, pid + num_programs, ... No launch cost per tile, and the loader runs ahead into
#    the next tile while the current one finishes. Tiles are numbered in groups of GROUP_M
#    row-tiles (Triton's matmul tutorial order) so that the Co/BLOCK_N tiles sharing one strip of
#    A run close together in time and read it from L2, not HBM.
#
# 4. Overlapping the epilogue. On Blackwell, the double-buffered TMEM accumulator does it. On
#    Hopper, one warpgroup's registers hold one accumulator, so the overlap needs a second
#    warpgroup with an accumulator of its own: the "ping-pong" schedule below, where two consumer
#    partitions take alternate tiles and each one's epilogue runs under the other's main loop.
#    With a single consumer (still a candidate: 256-row tiles need 8 warps), the overlap is only
#    partial: the loader prefetches the next tile's stages during the epilogue, and the TMA store
#    of tile t drains while tile t+1 computes (we wait for it only before reusing the buffer).
#
# 5. Tiles that are not a power of two wide. Triton's tensors (and so its shared buffers and
#    accumulators) have power-of-two shapes, so with BLOCK_N=128 a layer with Co=320 computes
#    three tiles of 128 columns, 384 in all: a sixth of the tensor-core work lands on columns that
#    are thrown away. The hardware has no such rule: a WGMMA's N is any multiple of 8 up to 256,
#    tcgen05's any multiple of 16, and a TMA box any size up to 256. So a tile may carry a *tail*:
#    BLOCK_N_TAIL more columns (32 here, making 160 = 320 / 2) with their own TMA box of weights,
#    their own shared-memory buffer, their own MMA (reading the same A tile) and their own
#    accumulator and store. The loader fills both weight boxes into one stage (one `expect` with
#    the sum of the bytes); the consumer issues two MMAs per k-step and waits for two.
#
# Where the two architectures must differ, the kernel branches on the constexpr IS_BLACKWELL; the
# loader, the tile order and the epilogue store are shared. The Hopper partition drives its MMAs
# through common.HopperWGMMA (lesson 04's abstraction); on Blackwell the MMA warp calls tcgen05
# directly, because there the stage is released by the hardware instead of by a wait.
#
# What did not pay, measured on an H100 (2026-11-22), so you need not try it first:
# - Split-K for layers with too few tiles (ResNet's 7x7: 196 tiles of 128x128 leave the second
#   wave of 132 SMs half empty). Two units per tile, the first publishing an fp32 partial sum
#   for the second to add (release/acquire on a per-tile counter): 481-501 TFLOPS against 557
#   for plain 128x256 tiles; the partial sums' round trip through L2 sits on the critical path
#   and costs more than the idle SMs did. (The code is in this repository's history, commit
#   627d1da.)
# - K steps of 32 instead of 64 with deeper rings (6 stages): 672 against 759 TFLOPS on the
#   headline shape; twice the barrier traffic per FLOP. Only the 160-wide tile below, whose
#   64-deep stages would not fit, keeps BLOCK_K=32.
#
# %%
# The shared pieces: tile order, loader, epilogue store


@gluon.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of a linear tile id, GROUP_M row-tiles at a time (L2-friendly order)."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    rows_in_group = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % tiles_per_group) % rows_in_group
    pid_n = (tile_id % tiles_per_group) // rows_in_group
    return pid_m, pid_n


@gluon.jit
def loader_partition(in_desc, w_desc, w_tail_desc, a_bufs, b_bufs, b_tail_bufs, ready, empty,
                     num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                     Ci, S, k_steps, channel_blocks, GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                     TILE_N: gl.constexpr):
    """One warp: for every (tile, k-step) of this program, wait for a free stage and fill it."""
    BLOCK_M: gl.constexpr = in_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_N_TAIL: gl.constexpr = TILE_N - BLOCK_N
    # bytes that land per stage: the A box, and TILE_N rows of weights (main box + tail box)
    stage_bytes: gl.constexpr = in_desc.block_type.nbytes + w_desc.block_type.nbytes * TILE_N // BLOCK_N
    counter = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n = m0 // (out_h * out_w)
        oy = (m0 // out_w) % out_h
        ox = m0 % out_w
        start_h = oy * stride_h - pad_h
        start_w = ox * stride_w - pad_w
        co0 = pid_n * TILE_N
        for k in range(k_steps):
            tap = k // channel_blocks
            c0 = (k % channel_blocks) * BLOCK_K
            slot = counter % NUM_BUFFERS
            # wait until the MMA that last read this stage is done (first pass: returns at once)
            mbarrier.wait(empty.index(slot), ((counter // NUM_BUFFERS) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), stage_bytes)
            # A = im2col_load(x, [n, oy*sh-ph, ox*sw-pw, c0], offsets=[r*dh, s*dw])
            tma.async_load_im2col(in_desc, [n, start_h, start_w, c0],
                                  [((tap // S) * dil_h).to(gl.int16), ((tap % S) * dil_w).to(gl.int16)],
                                  ready.index(slot), a_bufs.index(slot))
            # B = load(w2d, [co0, (r*S + s)*Ci + c0]), and the tail's rows after it
            tma.async_load(w_desc, [co0, tap * Ci + c0], ready.index(slot), b_bufs.index(slot))
            if BLOCK_N_TAIL > 0:
                tma.async_load(w_tail_desc, [co0 + BLOCK_N, tap * Ci + c0], ready.index(slot),
                               b_tail_bufs.index(slot))
            counter += 1


@gluon.jit
def store_output_tile(acc, c_smem, out_desc, bias_ptr, Co, m0, co0, HAS_BIAS: gl.constexpr,
                      STORES_IN_FLIGHT: gl.constexpr = 0):
    """Epilogue: + bias[co] (fp32), cast, and an asynchronous TMA store of the tile.

    The store is not waited for here: it drains while the next tile computes. Before writing the
    staging buffer again we wait for the previous store from it to have read it (stores finish in
    order; STORES_IN_FLIGHT newer ones, from other buffers, may stay in flight)."""
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    if HAS_BIAS:
        cols = co0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
        bias = gl.load(bias_ptr + cols, mask=cols < Co, other=0.0)
        acc = acc + gl.expand_dims(bias.to(gl.float32), 0)
    tma.store_wait(pendings=STORES_IN_FLIGHT)
    c_smem.store(acc.to(out_desc.dtype))
    fence_async_shared()
    tma.async_store(out_desc, [m0, co0], c_smem)


# %%
# Hopper: MMA issue and epilogue in one partition, and two of them taking turns (ping-pong)
#
# One consumer warpgroup holds one accumulator in its registers, so while it converts and stores
# tile t, nobody issues MMAs. The fix CUTLASS calls "ping-pong": two consumer partitions, each
# with its own accumulator and its own epilogue staging buffer, take alternate tiles of the
# program (consumer 0 the 1st, 3rd, ... tile, consumer 1 the 2nd, 4th, ...). The loader does not
# change: it fills the ring tile after tile, and each consumer skips the other's k-steps in its
# counter. While consumer 0 runs its epilogue, consumer 1 runs its main loop, and vice versa.
#
# One rule needs a barrier of its own. A consumer that waits for a stage's `ready` barrier must be
# at most one fill ahead of it: mbarrier waits compare only the parity of the phase, so a consumer
# that ran two fills ahead would see an old phase with the right parity and read a stage that holds
# the other consumer's data. So the consumers pass a turn: consumer c starts its main loop only
# after the other one has issued every MMA of the tile before (arrive on turn[c] after the loop,
# wait for turn[c] before it). This also keeps their main loops in order, which is the point: the
# tensor cores serve one tile at a time, and each epilogue hides under the other consumer's loop.
#
# Measured on an H100: ping-pong with 128x128 tiles reached 585-595 TFLOPS on the headline shape,
# no faster than one 4-warp consumer with the same tile (590-605). The winner there is a single
# 8-warp consumer with 256x128 tiles (700-760): per FLOP it moves a quarter fewer bytes through
# L2 and shared memory, and that matters more than the hidden epilogue (a 256x128 ping-pong would
# need 256 accumulator registers per thread). The autotuner keeps both and picks per shape.


@gluon.jit
def hopper_mma_epilogue_partition(a_bufs, b_bufs, b_tail_bufs, ready, empty, turn, c_smem, c_tail_smem,
                                  out_desc, out_tail_desc, bias_ptr, Co, num_pid_m, num_pid_n, k_steps,
                                  GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                                  HAS_BIAS: gl.constexpr, TILE_N: gl.constexpr,
                                  CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                                  num_warps: gl.constexpr):
    gl.static_assert(NUM_CONSUMERS <= 2, "one consumer, or two taking turns")
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    BLOCK_N_TAIL: gl.constexpr = TILE_N - BLOCK_N
    HAS_TAIL: gl.constexpr = BLOCK_N_TAIL > 0
    MMAS_PER_STEP: gl.constexpr = 2 if HAS_TAIL else 1
    counter = CONSUMER * k_steps      # the ring position of this consumer's first k-step
    local_tile = 0
    for tile_id in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), num_pid_m * num_pid_n,
                         NUM_CONSUMERS * gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        if NUM_CONSUMERS == 2:
            # my turn: the other consumer has issued the whole main loop of the tile before mine.
            # (A fresh barrier counts as phase 1 complete: consumer 0's first wait returns at once.)
            mbarrier.wait(turn.index(CONSUMER), (local_tile & 1) ^ (1 - CONSUMER))
        # acc = zeros(BLOCK_M, BLOCK_N) (+ zeros(BLOCK_M, BLOCK_N_TAIL))
        mma = common.HopperWGMMA.initialize(out_desc.dtype, BLOCK_M, BLOCK_N, num_warps)
        if HAS_TAIL:
            mma_tail = common.HopperWGMMA.initialize(out_desc.dtype, BLOCK_M, BLOCK_N_TAIL, num_warps)
        for k in range(k_steps):
            slot = counter % NUM_BUFFERS
            mbarrier.wait(ready.index(slot), (counter // NUM_BUFFERS) & 1)
            # acc += A @ B^T, asynchronously (and the tail's columns: a second, narrower MMA)
            mma = mma.issue_async_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)))
            if HAS_TAIL:
                mma_tail = mma_tail.issue_async_mma(a_bufs.index(slot),
                                                    b_tail_bufs.index(slot).permute((1, 0)))
                mma_tail = mma_tail.wait_num_outstanding(MMAS_PER_STEP)
            # Only this step's MMAs in flight: the ones of step k-1 are done, so its stage is free.
            mma = mma.wait_num_outstanding(MMAS_PER_STEP)
            mbarrier.arrive(empty.index((counter + NUM_BUFFERS - 1) % NUM_BUFFERS), pred=k > 0)
            counter += 1
        if NUM_CONSUMERS == 2:
            mbarrier.arrive(turn.index(1 - CONSUMER))   # your turn: my MMAs are all issued
        mma = mma.wait_num_outstanding(0)
        if HAS_TAIL:
            mma_tail = mma_tail.wait_num_outstanding(0)
        mbarrier.arrive(empty.index((counter + NUM_BUFFERS - 1) % NUM_BUFFERS))
        acc, mma = mma.take_result()
        store_output_tile(acc, c_smem, out_desc, bias_ptr, Co, pid_m * BLOCK_M,
                          pid_n * TILE_N, HAS_BIAS)
        if HAS_TAIL:
            acc_tail, mma_tail = mma_tail.take_result()
            store_output_tile(acc_tail, c_tail_smem, out_tail_desc, bias_ptr, Co, pid_m * BLOCK_M,
                              pid_n * TILE_N + BLOCK_N, HAS_BIAS, STORES_IN_FLIGHT=1)
        counter += (NUM_CONSUMERS - 1) * k_steps      # skip the other consumer's tile
        local_tile += 1
    tma.store_wait(pendings=0)


# %%
# Blackwell: a one-warp MMA issuer and the epilogue, joined by a double-buffered TMEM accumulator


@gluon.jit
def blackwell_mma_partition(a_bufs, b_bufs, b_tail_bufs, ready, empty, acc_tmem, acc_tail_tmem,
                            acc_ready, acc_empty, num_pid_m, num_pid_n, k_steps,
                            NUM_BUFFERS: gl.constexpr, NUM_ACC: gl.constexpr, TILE_N: gl.constexpr):
    BLOCK_N_TAIL: gl.constexpr = TILE_N - b_bufs.shape[1]
    counter = 0
    tile_count = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        buf = tile_count % NUM_ACC
        # wait until the epilogue has read this accumulator (first pass: returns at once)
        mbarrier.wait(acc_empty.index(buf), ((tile_count // NUM_ACC) & 1) ^ 1)
        for k in range(k_steps):
            slot = counter % NUM_BUFFERS
            mbarrier.wait(ready.index(slot), (counter // NUM_BUFFERS) & 1)
            # acc += A @ B^T (and the tail's columns into their own accumulator)
            tcgen05_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc_tmem.index(buf),
                        use_acc=k > 0)
            if BLOCK_N_TAIL > 0:
                tcgen05_mma(a_bufs.index(slot), b_tail_bufs.index(slot).permute((1, 0)),
                            acc_tail_tmem.index(buf), use_acc=k > 0)
            # the hardware arrives on empty[slot] once these MMAs (and all earlier ones) are done
            tcgen05_commit(empty.index(slot))
            counter += 1
        # signal the epilogue once every MMA of the tile has finished
        tcgen05_commit(acc_ready.index(buf))
        tile_count += 1


@gluon.jit
def blackwell_epilogue_partition(acc_tmem, acc_tail_tmem, acc_ready, acc_empty, c_smem, c_tail_smem,
                                 out_desc, out_tail_desc, bias_ptr, Co, num_pid_m, num_pid_n,
                                 GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr, NUM_ACC: gl.constexpr,
                                 TILE_N: gl.constexpr):
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    BLOCK_N_TAIL: gl.constexpr = TILE_N - BLOCK_N
    tile_count = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        buf = tile_count % NUM_ACC
        mbarrier.wait(acc_ready.index(buf), (tile_count // NUM_ACC) & 1)
        acc = acc_tmem.index(buf).load()           # TMEM -> registers
        if BLOCK_N_TAIL > 0:
            acc_tail = acc_tail_tmem.index(buf).load()
        mbarrier.arrive(acc_empty.index(buf))      # the MMA warp may reuse it now
        co0 = pid_n * TILE_N
        store_output_tile(acc, c_smem, out_desc, bias_ptr, Co, pid_m * BLOCK_M, co0, HAS_BIAS)
        if BLOCK_N_TAIL > 0:
            store_output_tile(acc_tail, c_tail_smem, out_tail_desc, bias_ptr, Co, pid_m * BLOCK_M,
                              co0 + BLOCK_N, HAS_BIAS, STORES_IN_FLIGHT=1)
        tile_count += 1
    tma.store_wait(pendings=0)


# %%
# The kernel: allocate the ring and barriers, then split into partitions


@gluon.jit
def conv2d_fprop_kernel(in_desc, w_desc, w_tail_desc, out_desc, out_tail_desc, bias_ptr, Co,
                        num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w,
                        dil_h, dil_w, Ci, S, k_steps, channel_blocks,
                        IS_BLACKWELL: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                        NUM_BUFFERS: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                        BLOCK_N_TAIL: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = in_desc.dtype
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    TILE_N: gl.constexpr = BLOCK_N + BLOCK_N_TAIL     # output columns per tile
    # (The partitions' argument tuples are written out in each gl.warp_specialize call: a tuple
    # assigned to a variable first would turn its constexprs into run-time tensors in Triton 3.8.)
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + in_desc.block_type.shape, in_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_desc.block_type.shape, w_desc.layout)
    # one epilogue staging tile per consumer
    c_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + out_desc.block_type.shape, out_desc.layout)
    if BLOCK_N_TAIL > 0:
        b_tail_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_tail_desc.block_type.shape,
                                                w_tail_desc.layout)
        c_tail_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + out_tail_desc.block_type.shape,
                                                out_tail_desc.layout)
    else:   # no tail: the main buffers stand in for the unused arguments
        b_tail_bufs = b_bufs
        c_tail_smem = c_smem
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if IS_BLACKWELL:
        NUM_ACC: gl.constexpr = 2
        acc_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N],
                                          TensorMemoryLayout([BLOCK_M, BLOCK_N], col_stride=1))
        if BLOCK_N_TAIL > 0:
            acc_tail_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N_TAIL],
                                                   TensorMemoryLayout([BLOCK_M, BLOCK_N_TAIL], col_stride=1))
        else:
            acc_tail_tmem = acc_tmem
        acc_ready = gl.allocate_shared_memory(gl.int64, [NUM_ACC, 1], mbarrier.MBarrierLayout())
        acc_empty = gl.allocate_shared_memory(gl.int64, [NUM_ACC, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_ACC):
            mbarrier.init(acc_ready.index(i), count=1)
            mbarrier.init(acc_empty.index(i), count=1)
        gl.warp_specialize([
            (blackwell_epilogue_partition, (acc_tmem, acc_tail_tmem, acc_ready, acc_empty,
                                            c_smem.index(0), c_tail_smem.index(0), out_desc,
                                            out_tail_desc, bias_ptr, Co, num_pid_m, num_pid_n,
                                            GROUP_M, HAS_BIAS, NUM_ACC, TILE_N)),
            (blackwell_mma_partition, (a_bufs, b_bufs, b_tail_bufs, ready, empty, acc_tmem,
                                       acc_tail_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n,
                                       k_steps, NUM_BUFFERS, NUM_ACC, TILE_N)),
            (loader_partition, (in_desc, w_desc, w_tail_desc, a_bufs, b_bufs, b_tail_bufs, ready, empty,
                                num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w,
                                dil_h, dil_w, Ci, S, k_steps, channel_blocks, GROUP_M, NUM_BUFFERS,
                                TILE_N)),
        ], [1, 1], [24, 24])
    else:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        if NUM_CONSUMERS == 1:
            gl.warp_specialize([
                (hopper_mma_epilogue_partition, (a_bufs, b_bufs, b_tail_bufs, ready, empty, turn,
                                                 c_smem.index(0), c_tail_smem.index(0), out_desc,
                                                 out_tail_desc, bias_ptr, Co, num_pid_m, num_pid_n,
                                                 k_steps, GROUP_M, NUM_BUFFERS, HAS_BIAS, TILE_N,
                                                 0, 1, num_warps)),
                (loader_partition, (in_desc, w_desc, w_tail_desc, a_bufs, b_bufs, b_tail_bufs, ready, empty,
                                    num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w,
                                    dil_h, dil_w, Ci, S, k_steps, channel_blocks, GROUP_M, NUM_BUFFERS,
                                    TILE_N)),
            ], [1], [24])
        else:
            # ping-pong: consumer 0 is the default partition, consumer 1 a worker of as many warps.
            # Registers: 2 consumer warpgroups at 240 + the loader's warpgroup at 24 fill the 64K.
            gl.warp_specialize([
                (hopper_mma_epilogue_partition, (a_bufs, b_bufs, b_tail_bufs, ready, empty, turn,
                                                 c_smem.index(0), c_tail_smem.index(0), out_desc,
                                                 out_tail_desc, bias_ptr, Co, num_pid_m, num_pid_n,
                                                 k_steps, GROUP_M, NUM_BUFFERS, HAS_BIAS, TILE_N,
                                                 0, 2, num_warps)),
                (hopper_mma_epilogue_partition, (a_bufs, b_bufs, b_tail_bufs, ready, empty, turn,
                                                 c_smem.index(1), c_tail_smem.index(1), out_desc,
                                                 out_tail_desc, bias_ptr, Co, num_pid_m, num_pid_n,
                                                 k_steps, GROUP_M, NUM_BUFFERS, HAS_BIAS, TILE_N,
                                                 1, 2, num_warps)),
                (loader_partition, (in_desc, w_desc, w_tail_desc, a_bufs, b_bufs, b_tail_bufs, ready, empty,
                                    num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w,
                                    dil_h, dil_w, Ci, S, k_steps, channel_blocks, GROUP_M, NUM_BUFFERS,
                                    TILE_N)),
            ], [num_warps, 1], [240, 24])


# %%
# The host side: plans, configs, and the autotuner
# ------------------------------------------------
# A ResNet layer runs in ~50 us, so the Python around the launch matters. Everything that depends
# only on the problem's shape (geometry, descriptor settings, shared layouts, grid, the chosen
# config) is computed once and cached in a `ConvPlan`; a call then looks the plan up by what it
# sees at a glance (shapes, dtypes, devices), checks what can differ between calls (contiguity,
# alignment), puts its pointers into copies of three descriptors, and launches the compiled
# kernel directly. Measured on the H100 host: ~30-35 us per call, of which ~17 us is Triton's
# launcher (it encodes each TMA descriptor into a tensor map on every launch: ~8 us per
# descriptor, which is why a tile without a tail passes None, not a dummy, for the tail's two);
# cuDNN's call measured ~21 us.
#
# A config is a `KernelConfig`: tile sizes, ring depth, warps per consumer, programs per SM and
# consumers per program. Before anything is compiled, candidates are pruned to what fits: shared
# memory (NUM_BUFFERS stages of A and B tiles plus one epilogue staging tile per consumer, against
# the device's per-program limit, and times the programs per SM against the SM's 228 KB), tensor
# memory on Blackwell (two fp32 accumulators of BLOCK_N columns, at most 512), registers on Hopper
# (a 128x256 fp32 accumulator needs 8 warps) and tiles not much wider than Co.
#
# Two ways to hide Hopper's epilogue are offered, and the autotuner picks per shape:
# - ping-pong (consumers=2): two 4-warp consumers in one program, described above, each with up
#   to 240 registers per thread;
# - two programs per SM: while one program converts and stores its tile, the other's MMAs keep
#   the tensor cores busy. Each program gets half the shared memory and at most 128 registers per
#   thread at launch (`maxnreg=128`; setmaxnreg then moves the loader's registers to the MMA
#   warps): no room for a 128x128 accumulator, so it suits small tiles.


class KernelConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_buffers: int        # stages in the shared-memory ring
    num_warps: int          # warps of each MMA/epilogue partition
    programs_per_sm: int = 1
    consumers: int = 1      # 2: Hopper ping-pong
    block_n_tail: int = 0   # extra output columns per tile, in a second MMA (see below)

    @property
    def tile_n(self):
        return self.block_n + self.block_n_tail

    def __str__(self):
        extras = ([f"{self.programs_per_sm}/SM"] if self.programs_per_sm > 1 else []) + \
                 (["ping-pong"] if self.consumers > 1 else [])
        width = f"({self.block_n}+{self.block_n_tail})" if self.block_n_tail else f"{self.block_n}"
        return (f"{self.block_m}x{width}x{self.block_k} {self.num_buffers} stages "
                f"{self.num_warps} warps" + "".join(f", {e}" for e in extras))


HOPPER_CANDIDATES = [
    KernelConfig(128, 128, 64, 4, 4),
    KernelConfig(128, 256, 64, 3, 8),
    KernelConfig(256, 128, 64, 3, 8),
    KernelConfig(128, 128, 64, 6, 8),
    KernelConfig(128, 64, 64, 6, 4),
    KernelConfig(256, 64, 64, 4, 8),
    KernelConfig(128, 128, 64, 4, 4, consumers=2),
    KernelConfig(128, 128, 64, 5, 4, consumers=2),
    KernelConfig(128, 64, 64, 6, 4, consumers=2),
    KernelConfig(64, 128, 64, 6, 4, consumers=2),
    KernelConfig(128, 64, 64, 4, 4, programs_per_sm=2),
    KernelConfig(64, 128, 64, 4, 4, programs_per_sm=2),
    # 160- and 96-wide tiles (Co = 320, 640, 96, 192, ...): a 32-column tail beside the main MMA
    KernelConfig(256, 128, 32, 5, 8, block_n_tail=32),
    KernelConfig(128, 128, 64, 5, 4, block_n_tail=32),
    KernelConfig(128, 128, 64, 4, 4, consumers=2, block_n_tail=32),
    KernelConfig(128, 64, 64, 6, 4, block_n_tail=32),
]
BLACKWELL_CANDIDATES = [
    KernelConfig(128, 128, 64, 4, 4),
    KernelConfig(128, 256, 64, 3, 4),
    KernelConfig(128, 64, 64, 6, 4),
    KernelConfig(128, 128, 64, 4, 4, block_n_tail=32),
]
FIXED_CONFIG = KernelConfig(128, 128, 64, 4, 4)   # the tests' config: valid on both architectures
PINGPONG_CONFIG = KernelConfig(128, 128, 64, 4, 4, consumers=2)   # Hopper only
SMEM_LIMIT_BYTES = {"sm_90": 232448, "sm_100": 232448}   # per program (opt-in maximum)
SMEM_PER_SM_BYTES = 233472                               # 228 KB per SM, 1 KB of it reserved per program


def shared_memory_bytes(config, element_size=2):
    c = KernelConfig(*config)
    ring = c.num_buffers * (c.block_m + c.tile_n) * c.block_k * element_size
    staging = c.consumers * c.block_m * c.tile_n * element_size
    return ring + staging + 2 * c.num_buffers * 8 + 64


def wasted_columns(Co, tile_n):
    """Output columns computed past Co, summed over the row of tiles."""
    return triton.cdiv(Co, tile_n) * tile_n - Co


def prune_configs(candidates, geometry, arch, smem_limit=None):
    """Keep the configs that fit the device and suit the shape (no compilation needed)."""
    smem_limit = smem_limit or SMEM_LIMIT_BYTES[arch]
    kept = []
    for config in map(lambda c: KernelConfig(*c), candidates):
        smem = shared_memory_bytes(config)
        if smem > smem_limit or config.programs_per_sm * (smem + 1024) > SMEM_PER_SM_BYTES:
            continue
        if arch == "sm_100" and (2 * config.tile_n > 512 or config.programs_per_sm > 1
                                 or config.consumers > 1):     # TMEM columns; ping-pong is Hopper's
            continue
        acc_registers = config.block_m * config.tile_n // (32 * config.num_warps)  # fp32 per thread
        if arch == "sm_90" and acc_registers > 160:
            continue
        if config.consumers > 1 and (config.num_warps != 4 or config.programs_per_sm > 1):
            continue                            # 2 consumer warpgroups + the loader's fill the RF
        if config.programs_per_sm > 1 and (config.num_warps != 4 or acc_registers > 64):
            continue                            # 2 x (4 + loader) warps at 128 registers fill the RF
        if config.tile_n > max(64, triton.next_power_of_2(geometry.Co)):  # mostly-empty tiles
            continue
        if config.block_n_tail and (wasted_columns(geometry.Co, config.tile_n)
                                    >= wasted_columns(geometry.Co, config.block_n)):
            continue                            # a tail only where it saves work
        kept.append(config)
    return kept


def adapt_block_k(config, Ci_padded):
    """Small channel counts (a padded Ci of 8 or 16) get a smaller K block: fewer zeros multiplied."""
    config = KernelConfig(*config)
    if Ci_padded < config.block_k:
        config = config._replace(block_k=max(16, triton.next_power_of_2(Ci_padded)))
    return config


def _check_config(config, arch):
    """Combinations the kernel does not implement get a ValueError, not a compile error or a hang."""
    if config.consumers > 2 or (config.consumers > 1 and arch != "sm_90"):
        raise ValueError(f"config {config}: consumers={config.consumers}; ping-pong (2 consumers) "
                         f"is a Hopper schedule, elsewhere consumers must be 1")
    if config.programs_per_sm > 1 and arch != "sm_90":
        raise ValueError(f"config {config}: programs_per_sm > 1 is offered on Hopper only")


class ConvPlan:
    """Everything about one (shape, dtype, config) that does not depend on the tensors' pointers."""

    def __init__(self, geometry, dtype, config, arch, num_sms):
        self.geometry = geometry
        self.arch = arch
        lanes = 16 // torch.empty(0, dtype=dtype).element_size()
        self.Ci_padded = -(-geometry.Ci // lanes) * lanes
        padded = common.conv_geometry((geometry.N, geometry.H, geometry.W, self.Ci_padded),
                                      (geometry.Co, geometry.R, geometry.S, self.Ci_padded),
                                      geometry.stride, geometry.padding, geometry.dilation)
        self.settings = common.conv_im2col_settings(padded)
        self.config = adapt_block_k(config, self.Ci_padded)
        _check_config(self.config, arch)
        BLOCK_M, BLOCK_N, BLOCK_K = self.blocks = self.config[:3]
        self.num_buffers, self.num_warps = self.config.num_buffers, self.config.num_warps
        per_sm = self.config.programs_per_sm
        self.Co_alloc = -(-geometry.Co // lanes) * lanes
        self.num_pid_m = triton.cdiv(geometry.M, BLOCK_M)
        self.tail = self.config.block_n_tail
        self.num_pid_n = triton.cdiv(geometry.Co, self.config.tile_n)
        self.grid = (min(per_sm * num_sms, self.num_pid_m * self.num_pid_n), 1, 1)
        self.launch_options = dict(num_warps=self.num_warps, **({"maxnreg": 128} if per_sm > 1 else {}))
        self.channel_blocks = triton.cdiv(self.Ci_padded, BLOCK_K)
        self.k_steps = geometry.R * geometry.S * self.channel_blocks
        self.layouts = common.conv_tma_layouts(dtype, BLOCK_M, BLOCK_N, BLOCK_K)
        # the tail's weight box [tail, BLOCK_K] and output box [BLOCK_M, tail]
        self.tail_layouts = (common.conv_tma_layouts(dtype, BLOCK_M, self.tail, BLOCK_K)[1:]
                             if self.tail else None)
        g = geometry
        self.scalar_args = (g.Co, self.num_pid_m, self.num_pid_n, g.out_h, g.out_w, *g.stride,
                            *g.padding, *g.dilation, self.Ci_padded, g.S, self.k_steps,
                            self.channel_blocks)
        self.needs_channel_padding = self.Ci_padded != g.Ci
        self.descriptor_templates = None
        self.compiled = {}

    def launch_args(self, x_nhwc, w, bias):
        """(args, output buffer) for this plan and these tensors: the kernel's run-time arguments."""
        if self.needs_channel_padding:
            x_nhwc, w, _ = common.pad_channels_for_tma(x_nhwc, w)
        out_2d = torch.empty(self.geometry.M, self.Co_alloc, device=x_nhwc.device, dtype=x_nhwc.dtype)
        w_2d = w.view(w.shape[0], -1)
        if self.descriptor_templates is None:
            # First call: build (and let Triton validate) the descriptors.
            descriptors = common.conv_tma_descriptors(x_nhwc, w, out_2d, self.settings, *self.blocks,
                                                      layouts=self.layouts)
            if self.tail:
                from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
                BLOCK_M, _, BLOCK_K = self.blocks
                descriptors += (TensorDescriptor.from_tensor(w_2d, [self.tail, BLOCK_K], self.tail_layouts[0]),
                                TensorDescriptor.from_tensor(out_2d, [BLOCK_M, self.tail], self.tail_layouts[1]))
            self.descriptor_templates = descriptors
        else:
            # Later calls: same shapes, strides, boxes and layouts; only the base pointers change.
            # Re-validating all of that costs ~30 us of Python per call, so copy the validated
            # templates and swap the tensors in (checking the one property that can differ).
            tensors = (x_nhwc, w_2d, out_2d, w_2d, out_2d)
            descriptors = tuple(_with_base(template, tensor)
                                for template, tensor in zip(self.descriptor_templates, tensors))
        # Without a tail, the tail descriptors are None: a constexpr to the kernel, which never
        # touches them, and nothing for the launcher to encode (each descriptor is a tensor map
        # the launcher builds on every call).
        in_desc, w_desc, out_desc, w_tail_desc, out_tail_desc = descriptors + (None, None) * (not self.tail)
        args = (in_desc, w_desc, w_tail_desc, out_desc, out_tail_desc,
                bias if bias is not None else out_2d, *self.scalar_args)
        return args, out_2d

    def kernel_kwargs(self, has_bias):
        """The constexprs and launch options of the kernel, by name."""
        return dict(IS_BLACKWELL=self.arch == "sm_100", HAS_BIAS=has_bias, GROUP_M=8,
                    NUM_BUFFERS=self.num_buffers, NUM_CONSUMERS=self.config.consumers,
                    BLOCK_N_TAIL=self.tail, **self.launch_options)

    def constexpr_args(self, has_bias):
        """The constexpr arguments in the kernel's signature order (for the direct launch)."""
        kwargs = self.kernel_kwargs(has_bias)
        return tuple(kwargs[param.name] for param in conv2d_fprop_kernel.params if param.is_constexpr)

    def run(self, x_nhwc, w, bias=None):
        args, out_2d = self.launch_args(x_nhwc, w, bias)
        # The specialization Triton compiled for: bias or not, and whether its pointer is
        # 16-byte aligned (Triton specializes pointer alignment). Everything else is fixed by the plan.
        has_bias = bias is not None
        variant = (has_bias, not has_bias or bias.data_ptr() % 16 == 0)
        compiled = self.compiled.get(variant)
        if compiled is None:
            # First launch of this variant: the generic path (binds, specializes, compiles).
            launched = conv2d_fprop_kernel[self.grid](*args, **self.kernel_kwargs(has_bias))
            self.compiled[variant] = (launched, self.constexpr_args(has_bias))
        else:
            # Later launches: straight to the compiled kernel. Triton's generic launcher re-derives
            # the specialization of all ~25 arguments on every call, which costs tens of
            # microseconds of Python -- as much as a whole ResNet layer. The plan already knows the
            # answer, so it hands the arguments (constexprs included, in signature order) to the
            # compiled kernel's launcher.
            kernel, constexprs = compiled
            kernel[self.grid](*args, *constexprs)
        g = self.geometry
        out = out_2d.view(g.N, g.out_h, g.out_w, self.Co_alloc)
        return out if self.Co_alloc == g.Co else out[..., :g.Co].contiguous()


def _with_base(template, tensor):
    """A copy of a validated descriptor that points at `tensor` (same shape, strides and dtype)."""
    if tensor.data_ptr() % 16:
        raise ValueError(f"TMA needs 16-byte aligned tensors; this one starts at address "
                         f"{tensor.data_ptr():#x} (a view into another tensor?); pass .clone()")
    descriptor = object.__new__(type(template))    # copy.copy, without its ~3 us of generality
    descriptor.__dict__.update(template.__dict__)
    descriptor.base = tensor
    return descriptor


_PLANS = {}          # (key, config) -> ConvPlan
_BEST_CONFIG = {}    # key -> config chosen by the autotuner


@functools.lru_cache(maxsize=None)
def _device_facts_of(device_index):
    cap = common.require_tma_mma_gpu("conv2d_fprop")
    arch = "sm_90" if cap == (9, 0) else "sm_100"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    smem = getattr(props, "shared_memory_per_block_optin", SMEM_LIMIT_BYTES[arch])
    return arch, props.multi_processor_count, smem


def _device_facts():
    """(arch, SM count, shared-memory limit) of the current GPU, looked up once per device."""
    if not common.HAS_CUDA:
        common.require_tma_mma_gpu("conv2d_fprop")
    return _device_facts_of(torch.cuda.current_device())


def _validate(x_nhwc, w, bias, stride, padding, dilation):
    geometry = common.check_conv_inputs(x_nhwc, w, stride, padding, dilation, dtypes=CONV_DTYPES,
                                        bias=bias, need_cuda=True)
    if bias is not None and not bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    return geometry


def _plan_for(geometry, dtype, config):
    arch, num_sms, _ = _device_facts()
    key = (geometry, dtype, config, torch.cuda.current_device())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = ConvPlan(geometry, dtype, config, arch, num_sms)
    return plan


# The entry points look their plan up by what a call can see at a glance (shapes, dtypes,
# devices, hyper-parameters): a dictionary hit skips the full validation, which the first call of
# each key has passed. What can change between calls with the same key (contiguity, alignment)
# is still checked every time.
_FAST_PLANS = {}     # (call key, config or None for autotuned) -> ConvPlan


def _call_key(x_nhwc, w, bias, stride, padding, dilation, config):
    """A hashable key of what a call can see at a glance, or None (then the slow path runs)."""
    if not (isinstance(x_nhwc, torch.Tensor) and isinstance(w, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor))):
        return None
    key = (x_nhwc.shape, w.shape, x_nhwc.dtype, w.dtype, x_nhwc.device, w.device,
           None if bias is None else (bias.shape, bias.dtype, bias.device),
           stride, padding, dilation, config)
    try:
        hash(key)
    except TypeError:                    # list-valued stride/padding: no fast path
        return None
    return key


def _entry(x_nhwc, w, bias, stride, padding, dilation, config):
    key = _call_key(x_nhwc, w, bias, stride, padding, dilation, config)
    plan = _FAST_PLANS.get(key) if key is not None else None
    if plan is None or not (x_nhwc.is_contiguous() and w.is_contiguous()
                            and (bias is None or bias.is_contiguous())):
        # the slow path validates (and explains) everything
        geometry = _validate(x_nhwc, w, bias, stride, padding, dilation)
        if config is None:
            tuned_key = (geometry, x_nhwc.dtype, torch.cuda.current_device())
            chosen = _BEST_CONFIG.get(tuned_key)
            if chosen is None:
                chosen = _BEST_CONFIG[tuned_key] = autotune(geometry, x_nhwc, w, bias)
        else:
            chosen = KernelConfig(*config)
        plan = _plan_for(geometry, x_nhwc.dtype, chosen)
        if key is not None:
            _FAST_PLANS[key] = plan
    return plan.run(x_nhwc, w, bias)


def conv2d_fprop_fixed(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=FIXED_CONFIG):
    """The warp-specialized conv with one given config (the tests use this: no autotuning)."""
    return _entry(x_nhwc, w, bias, stride, padding, dilation, tuple(config))


def conv2d_fprop(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1):
    """Autotuned warp-specialized convolution. x_nhwc [N, H, W, Ci], w [Co, R, S, Ci] (fp16/bf16,
    CUDA, contiguous), optional bias [Co] fused in the epilogue; returns NHWC in x's dtype.

    The first call for a shape times every pruned config on the real tensors and remembers the
    fastest; later calls reuse the cached plan. The key is the whole geometry (N, H, W, Ci, Co, R,
    S, stride, padding, dilation) and dtype: shapes that want different tiles never share one."""
    return _entry(x_nhwc, w, bias, stride, padding, dilation, None)


def autotune(geometry, x_nhwc, w, bias, verbose=False):
    arch, _, smem = _device_facts()
    candidates = prune_configs(HOPPER_CANDIDATES if arch == "sm_90" else BLACKWELL_CANDIDATES,
                               geometry, arch, smem)
    if not candidates:
        raise RuntimeError(f"no kernel config fits {geometry.describe()} on this GPU")
    timings, errors = {}, []
    for config in candidates:
        plan = _plan_for(geometry, x_nhwc.dtype, config)
        try:
            plan.run(x_nhwc, w, bias)   # compile before timing
            # Timed as the benchmark times (do_bench: L2 flushed before each call, as a layer in a
            # network finds its weights: evicted since the last pass). The host time per call
            # (~35 us) hides behind do_bench's cache flush, so this ranks the kernels.
            timings[config] = triton.testing.do_bench(lambda: plan.run(x_nhwc, w, bias), warmup=5, rep=20)
        except Exception as error:  # a config the compiler or the launch refuses: skip it
            errors.append(f"{config}: {type(error).__name__}: {error}")
            if verbose:
                print(f"   config {config} skipped: {type(error).__name__}: {str(error)[:100]}")
    if not timings:
        raise RuntimeError(f"every kernel config failed for {geometry.describe()}; first error: "
                           f"{errors[0] if errors else '?'}")
    best = min(timings, key=timings.get)
    if verbose:
        for config, ms in sorted(timings.items(), key=lambda item: item[1]):
            print(f"   {str(config):<28} {geometry.flops / ms / 1e9:7.1f} TFLOPS"
                  + ("   <- chosen" if config == best else ""))
    return best


# %%
# What the compiler produced (no GPU needed)
# ------------------------------------------
# Compiled ahead of time, the PTX shows the partitions' work: the im2col bulk copies (loader),
# `wgmma.mma_async` (Hopper) or `tcgen05.mma` (Blackwell), `setmaxnreg` (the loader's registers
# handed to the MMA warps) and the TMA store.

EXPECTED_PTX = {
    "sm_90": ["cp.async.bulk.tensor.4d.shared::cta.global.im2col", "wgmma.mma_async", "setmaxnreg",
              "cp.async.bulk.tensor.2d.global.shared::cta"],
    "sm_100": ["cp.async.bulk.tensor.4d.shared::cta.global.im2col", "tcgen05.mma", "setmaxnreg",
               "cp.async.bulk.tensor.2d.global.shared::cta", "tcgen05.ld"],
}


def aot_conv2d_fprop(arch, N=2, H=16, W=16, Ci=64, Co=128, R=3, S=3, stride=1, padding=1,
                     config=FIXED_CONFIG, bias=False):
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16, device_name="cpu")
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
    plan = ConvPlan(geometry, torch.bfloat16, KernelConfig(*config), arch, num_sms=132)
    args, _ = plan.launch_args(x_nhwc, w, torch.zeros(Co, dtype=torch.float32) if bias else None)
    kwargs = plan.kernel_kwargs(has_bias=bias)
    return conv2d_fprop_kernel, args, kwargs


def run_show_ptx():
    return common.show_ptx("05-warp-specialized-conv", "aot_conv2d_fprop", EXPECTED_PTX,
                           lambda arch, compiled: f"conv2d_fprop_kernel, config {FIXED_CONFIG}, "
                                                  f"{compiled['shared']} bytes of shared memory, "
                                                  f"{compiled['num_warps']} warps in all")


@pytest.mark.parametrize("arch", list(EXPECTED_PTX))
def test_kernel_compiles_with_expected_instructions(arch):
    compiled = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch)
    counts = common.ptx_instructions(compiled["ptx"], EXPECTED_PTX[arch])
    missing = [prefix for prefix, count in counts.items() if count == 0]
    assert not missing, f"{arch}: PTX lacks {missing}"
    # The pruning model of shared memory must not under-estimate what the compiler allocates.
    assert compiled["shared"] <= shared_memory_bytes(FIXED_CONFIG) + 1024


@pytest.mark.parametrize("arch, config, mma_shapes", [
    ("sm_90", KernelConfig(256, 128, 32, 5, 8, block_n_tail=32), ["m64n128k16", "m64n32k16"]),
    ("sm_90", KernelConfig(128, 128, 64, 4, 4, consumers=2, block_n_tail=32), ["m64n128k16", "m64n32k16"]),
    ("sm_100", KernelConfig(128, 128, 64, 4, 4, block_n_tail=32), []),
], ids=["sm_90", "sm_90-ping-pong", "sm_100"])
def test_tail_build_issues_a_second_mma(arch, config, mma_shapes):
    tail = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch,
                                      config=list(config), Co=320)
    plain = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch,
                                       config=list(config._replace(block_n_tail=0)), Co=320)
    mma = "wgmma.mma_async" if arch == "sm_90" else "tcgen05.mma"
    count = lambda ptx: common.ptx_instructions(ptx, [mma])[mma]  # noqa: E731
    assert count(tail["ptx"]) == 2 * count(plain["ptx"])        # main + tail MMA per k-step
    for shape in mma_shapes:
        assert f"{mma}.sync.aligned.{shape}" in tail["ptx"]
    # two weight loads per stage (main box + tail box), two stores per tile
    loads = "cp.async.bulk.tensor.2d.shared::cta.global"
    stores = "cp.async.bulk.tensor.2d.global.shared::cta"
    counts = common.ptx_instructions(tail["ptx"], [loads, stores])
    assert counts == {k: 2 * v for k, v in common.ptx_instructions(plain["ptx"], [loads, stores]).items()}
    assert tail["shared"] <= shared_memory_bytes(config) + 1024


def test_unsupported_config_combinations_are_refused():
    geometry = common.conv_geometry((1, 8, 8, 64), (64, 3, 3, 64), 1, 1)
    for config, arch in [(PINGPONG_CONFIG, "sm_100"), (KernelConfig(128, 128, 64, 4, 4, consumers=3), "sm_90"),
                         (KernelConfig(128, 64, 64, 4, 4, programs_per_sm=2), "sm_100")]:
        with pytest.raises(ValueError, match="config"):
            ConvPlan(geometry, torch.bfloat16, config, arch, num_sms=132)


def test_pingpong_build_has_two_consumer_warpgroups():
    compiled = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", "sm_90",
                                          config=list(PINGPONG_CONFIG))
    ptx = compiled["ptx"]
    assert ".reqntid 384" in ptx                          # 2 consumer warpgroups + the loader's
    # registers: 240 for each consumer warpgroup, 24 for the loader
    assert "setmaxnreg.inc.sync.aligned.u32 \t240" in ptx and "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx
    # each consumer issues its own WGMMAs: twice the MMA code of a single consumer
    single = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", "sm_90")
    count = lambda p: common.ptx_instructions(p, ["wgmma.mma_async"])["wgmma.mma_async"]  # noqa: E731
    assert count(ptx) == 2 * count(single["ptx"])
    assert compiled["shared"] <= shared_memory_bytes(PINGPONG_CONFIG) + 1024


@pytest.mark.parametrize("config", HOPPER_CANDIDATES, ids=str)
def test_every_hopper_candidate_compiles_within_budget(config):
    Co = 320 if config.block_n_tail else 256
    geometry = common.conv_geometry((2, 16, 16, 64), (Co, 3, 3, 64), 1, 1)
    if config not in prune_configs([config], geometry, "sm_90"):
        pytest.skip("pruned for this shape")
    compiled = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", "sm_90",
                                          Co=Co, config=list(config), bias=True)
    assert compiled["shared"] <= SMEM_LIMIT_BYTES["sm_90"]
    assert config.programs_per_sm * (compiled["shared"] + 1024) <= SMEM_PER_SM_BYTES
    assert compiled["shared"] <= shared_memory_bytes(config) + 1024    # the pruning model holds
    if config.programs_per_sm > 1:
        assert ".maxnreg 128" in compiled["ptx"]
    assert common.ptx_instructions(compiled["ptx"], ["wgmma.mma_async"])["wgmma.mma_async"] > 0


def test_pruning():
    geometry = common.conv_geometry((128, 56, 56, 64), (64, 3, 3, 64), 1, 1)
    kept = prune_configs(HOPPER_CANDIDATES, geometry, "sm_90")
    assert kept and all(config[1] <= 64 for config in kept)          # Co=64: no 128-wide tiles
    assert all(shared_memory_bytes(c) <= SMEM_LIMIT_BYTES["sm_90"] for c in kept)
    assert prune_configs([(128, 256, 64, 4, 8, 1)], common.conv_geometry((1, 8, 8, 64), (256, 1, 1, 64)),
                         "sm_90") == []                                 # 4 stages of 128x256: too much smem
    assert prune_configs([(128, 256, 64, 3, 4, 1)], common.conv_geometry((1, 8, 8, 64), (256, 1, 1, 64)),
                         "sm_90") == []                                 # 128x256 fp32 acc on 4 warps
    assert adapt_block_k(FIXED_CONFIG, 8)[2] == 16
    assert prune_configs([(128, 64, 64, 4, 8, 2)], geometry, "sm_90") == []  # 2 x 8+ warps: no registers
    # tails only where they cut the wasted columns: Co=320 keeps the 160-wide tiles, Co=384 does not
    tails = [c for c in HOPPER_CANDIDATES if c.block_n_tail]
    sd = common.conv_geometry((8, 64, 64, 320), (320, 3, 3, 320), 1, 1)
    assert {c.tile_n for c in prune_configs(tails, sd, "sm_90")} == {160}
    assert prune_configs(tails, common.conv_geometry((8, 64, 64, 384), (384, 3, 3, 384), 1, 1), "sm_90") == []
    assert wasted_columns(320, 128) == 64 and wasted_columns(320, 160) == 0


BAD_INPUTS = common.bad_conv_inputs(torch.float16) + [
    (lambda x, w: (x, w), {"dilation": (1, 0)}, ValueError, "dilation"),
    (lambda x, w: (x, w), {"bias": "zeros"}, TypeError, "bias"),
    (lambda x, w: (x, w), {"bias": torch.zeros(3)}, ValueError, "bias must have shape"),
]


@pytest.mark.parametrize("entry", ["conv2d_fprop", "conv2d_fprop_fixed"])
@pytest.mark.parametrize("make_args, kwargs, error, message", BAD_INPUTS)
def test_rejects_bad_input(entry, make_args, kwargs, error, message):
    x_nhwc, w = common.random_conv_inputs(1, 8, 8, 8, 16, 3, 3, torch.bfloat16)
    if "bias" in kwargs and isinstance(kwargs["bias"], torch.Tensor):
        kwargs = dict(kwargs, bias=kwargs["bias"].to(x_nhwc.device))
    with pytest.raises(error, match=message):
        globals()[entry](*make_args(x_nhwc, w), **kwargs)


# %%
# Correctness on the GPU
# ----------------------
# The upstream Blackwell grid (N in {1, 128}, 64x64 images, Ci=Co in {384, 416}, 3x3/4x4/5x5
# filters, stride 1-2, padding 0-1) with the fixed config, then the awkward cases, then the
# autotuned entry point. Tolerances: common.assert_close_to_reference.

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


def run_conv(entry, N, H, W, Ci, Co, R, S, stride, padding, dilation=1, dtype=torch.bfloat16,
             with_bias=False, seed=0):
    return common.check_conv(entry, N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype=dtype,
                             with_bias=with_bias, seed=seed)


@needs_gpu
@pytest.mark.parametrize("N", [1, 128])
@pytest.mark.parametrize("Ci_Co", [384, 416])
@pytest.mark.parametrize("R", [3, 4, 5])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", [0, 1])
def test_fixed_config_grid(N, Ci_Co, R, stride, padding):
    run_conv(conv2d_fprop_fixed, N, 64, 64, Ci_Co, Ci_Co, R, R, stride, padding)


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias", [
    (1, 1, 8, 96, 128, 1, 2, (1, 2), 0, 1, torch.bfloat16, False),     # asymmetric stride
    (16, 32, 32, 5, 96, 3, 3, 1, 1, 1, torch.bfloat16, False),         # Ci=5, padded to 8
    (4, 64, 64, 3, 64, 7, 7, 2, 3, 1, torch.bfloat16, False),          # ResNet stem
    (2, 32, 32, 64, 64, 3, 3, 1, 2, 2, torch.bfloat16, False),         # dilation 2
    (2, 32, 32, 128, 200, 3, 3, 1, 1, 1, torch.bfloat16, True),        # bias, Co not a multiple of 8*16
    (8, 30, 26, 256, 128, 3, 3, 1, 1, 1, torch.float16, True),         # fp16, non-square
    (3, 17, 23, 40, 48, 3, 5, (2, 1), (1, 2), 1, torch.float16, False),  # odd sizes
])
def test_awkward_cases(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias):
    run_conv(conv2d_fprop_fixed, N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias)


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding", [
    (32, 28, 28, 128, 128, 3, 3, 1, 1),
    (32, 56, 56, 256, 64, 1, 1, 1, 0),
    (8, 16, 16, 320, 320, 3, 3, 2, 1),
])
def test_autotuned_entry_point(N, H, W, Ci, Co, R, S, stride, padding):
    run_conv(conv2d_fprop, N, H, W, Ci, Co, R, S, stride, padding, with_bias=True)


needs_hopper = pytest.mark.skipif(
    not (common.has_tma_mma_gpu() and common.is_hopper()),
    reason=common.GLUON_SKIP_REASON if not common.has_tma_mma_gpu() else
    "the ping-pong schedule is Hopper's (sm_90); this GPU is not a Hopper")


@needs_hopper
@pytest.mark.parametrize("config", [PINGPONG_CONFIG, KernelConfig(128, 64, 64, 6, 4, consumers=2),
                                    KernelConfig(64, 128, 64, 6, 4, consumers=2)], ids=str)
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias", [
    (128, 64, 64, 384, 384, 3, 3, 1, 1, torch.bfloat16, False),   # ~30 tiles per program: turns cycle
    (128, 64, 64, 416, 416, 5, 5, 2, 0, torch.bfloat16, True),    # long K loop, stride 2, bias
    (64, 32, 32, 64, 200, 1, 1, 1, 0, torch.float16, True),       # 1 k-step < ring depth; Co=200
    (128, 14, 14, 256, 256, 3, 3, 1, 1, torch.bfloat16, False),   # a ResNet-50 layer
    (3, 17, 23, 40, 48, 3, 5, (2, 1), (1, 2), torch.float16, False),  # fewer tiles than programs
])
def test_pingpong_consumers(config, N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias):
    run_conv(functools.partial(conv2d_fprop_fixed, config=config), N, H, W, Ci, Co, R, S, stride,
             padding, 1, dtype, with_bias)


TAIL_CONFIGS = [c for c in dict.fromkeys(HOPPER_CANDIDATES + BLACKWELL_CANDIDATES) if c.block_n_tail]


@needs_gpu
@pytest.mark.parametrize("config", TAIL_CONFIGS, ids=str)
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias", [
    (8, 32, 32, 320, 320, 3, 3, 1, 1, torch.bfloat16, True),      # SD-like: two 160-wide tiles
    (16, 20, 20, 128, 300, 3, 3, 1, 1, torch.float16, False),     # the last tail partly past Co
    (4, 15, 17, 64, 100, 3, 3, 2, 1, torch.bfloat16, True),       # Co below one main block
    (128, 14, 14, 256, 96, 1, 1, 1, 0, torch.bfloat16, False),    # 1x1, Co = 64 + 32
])
def test_tail_tiles(config, N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias):
    arch_candidates = HOPPER_CANDIDATES if common.is_hopper() else BLACKWELL_CANDIDATES
    if config not in arch_candidates:
        pytest.skip(f"{config} is not a candidate on this architecture")
    run_conv(functools.partial(conv2d_fprop_fixed, config=config), N, H, W, Ci, Co, R, S, stride,
             padding, 1, dtype, with_bias)


@needs_gpu
def test_fast_path_still_checks_each_call():
    # A call with a cached plan skips the full validation; what a same-shaped tensor can still get
    # wrong (layout, alignment) must be caught on every call.
    x_nhwc, w = common.random_conv_inputs(2, 12, 12, 64, 96, 3, 3, torch.bfloat16)
    conv2d_fprop_fixed(x_nhwc, w, padding=1)
    not_contiguous = x_nhwc.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous NHWC"):
        conv2d_fprop_fixed(not_contiguous, w, padding=1)
    storage = torch.empty(x_nhwc.numel() + 1, dtype=x_nhwc.dtype, device=x_nhwc.device)
    misaligned = storage[1:].view(x_nhwc.shape)       # contiguous, same shape, 2 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        conv2d_fprop_fixed(misaligned, w, padding=1)
    # list-valued hyper-parameters are unhashable: they take the slow path and still work
    run_conv(conv2d_fprop_fixed, 2, 12, 12, 64, 96, 3, 3, [1, 1], [1, 1])


@needs_gpu
def test_direct_launch_path_on_new_data():
    # The second call of a plan skips Triton's generic launcher: it must see the new tensors.
    for seed in (1, 2, 3):
        run_conv(conv2d_fprop_fixed, 2, 12, 12, 64, 96, 3, 3, 1, 1, with_bias=seed != 2, seed=seed)


@needs_gpu
def test_every_hopper_candidate_is_correct():
    if not common.is_hopper():
        pytest.skip("Hopper candidates")
    for config in HOPPER_CANDIDATES:
        run_conv(functools.partial(conv2d_fprop_fixed, config=config), 4, 20, 20, 136, 200, 3, 3, 1, 1,
                 with_bias=True)


# %%
# Benchmark (GPU): the series' ladder, next to cuDNN
# --------------------------------------------------
# One run measures, per shape, lesson 02's implicit GEMM, lesson 04, this lesson (autotuned) and
# cuDNN, all in bf16, all timed by common.bench_tflops (do_bench: median, L2 flushed, launch
# overhead included). Lesson 05 and cuDNN are timed in alternating rounds (medians reported).

BENCH_SHAPES = [
    common.HEADLINE_SHAPE,
    *common.RESNET50_3X3_SHAPES,
    ("RN50 56x56 128->128 3x3 s2", 128, 56, 56, 128, 128, 3, 3, 2, 1),
    ("RN50 56x56 256->64 1x1", 128, 56, 56, 256, 64, 1, 1, 1, 0),
    ("RN50 14x14 1024->256 1x1", 128, 14, 14, 1024, 256, 1, 1, 1, 0),
    ("SD UNet 64x64 320->320 3x3", 8, 64, 64, 320, 320, 3, 3, 1, 1),
]
BENCH_ROUNDS = 3
DENSE_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0}   # bf16 dense, datasheets


def dense_peak(device_name):
    return next((peak for name, peak in DENSE_PEAK_TFLOPS.items() if name in device_name), None)


def measure_host_overhead(x_nhwc, w, stride, padding, calls=200):
    """Host time per call of conv2d_fprop, in us: Python + launch, without waiting for the GPU."""
    conv2d_fprop(x_nhwc, w, None, stride, padding)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        conv2d_fprop(x_nhwc, w, None, stride, padding)
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host_us


def compare_launch_paths(x_nhwc, w, stride, padding, calls=200):
    """Host us per launch through Triton's generic launcher vs the plan's direct call (same args)."""
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
    plan = _plan_for(geometry, x_nhwc.dtype, _BEST_CONFIG[(geometry, x_nhwc.dtype, torch.cuda.current_device())])
    args, _ = plan.launch_args(x_nhwc, w, None)
    kwargs = plan.kernel_kwargs(has_bias=False)
    compiled, constexprs = plan.compiled[(False, True)]
    timings = {}
    for name, launch in (("generic", lambda: conv2d_fprop_kernel[plan.grid](*args, **kwargs)),
                         ("direct", lambda: compiled[plan.grid](*args, *constexprs))):
        launch()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            launch()
        timings[name] = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    return timings


def run_bench(outdir, quick=False, dtype=torch.bfloat16):
    lesson02 = common.load_lesson("02-im2col-explicit")
    lesson04 = common.load_lesson("04-implicit-gemm-single-buffer")
    shapes = BENCH_SHAPES[:3] if quick else BENCH_SHAPES
    rows = []
    for label, N, H, W, Ci, Co, R, S, stride, padding in shapes:
        x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, dtype)
        geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
        print(f"\n{label}: {geometry.describe()}; autotuning lesson 05:")
        _BEST_CONFIG[(geometry, dtype, torch.cuda.current_device())] = autotune(
            geometry, x_nhwc, w, None, verbose=True)
        # Correct before timed: the benchmarked output matches the reference.
        expected = common.reference_conv2d_nhwc(x_nhwc, w, None, stride, padding)
        common.assert_close_to_reference(conv2d_fprop(x_nhwc, w, None, stride, padding), expected,
                                         dtype=dtype, K=geometry.K)
        runs = {
            "02 implicit GEMM": lambda: lesson02.conv2d_implicit_gemm(x_nhwc, w, stride, padding),
            "04 single-buffer": lambda: lesson04.conv2d_tma_im2col(x_nhwc, w, stride, padding),
            "05 warp-specialized": lambda: conv2d_fprop(x_nhwc, w, None, stride, padding),
            "cuDNN": common.cudnn_conv2d(x_nhwc, w, None, stride, padding),
        }
        row = {"shape": label, "geometry": geometry.describe(), "flops": geometry.flops,
               "config_05": _BEST_CONFIG[(geometry, dtype, torch.cuda.current_device())]}
        for name in ("02 implicit GEMM", "04 single-buffer"):
            row[name] = common.bench_tflops(runs[name], geometry.flops)
        # Lesson 05 and cuDNN alternate, BENCH_ROUNDS times each, and the medians are reported:
        # clocks and cuDNN's own timings drift by several percent within minutes, and alternating
        # exposes both to the same drift. Every round is kept in the JSON.
        rounds = {"05 warp-specialized": [], "cuDNN": []}
        for _ in range(BENCH_ROUNDS):
            for name in rounds:
                rounds[name].append(common.bench_tflops(runs[name], geometry.flops))
        for name, results in rounds.items():
            row[name] = dict(sorted(results, key=lambda r: r["tflops"])[len(results) // 2],
                             rounds=[r["tflops"] for r in results])
        # Kernel time alone, launch overhead removed (CUDA graph replay), for 05 and cuDNN.
        for name in ("05 warp-specialized", "cuDNN"):
            row[name + " graph"] = common.bench_tflops(runs[name], geometry.flops, cuda_graph=True)
        row["ratio_05_cudnn"] = row["05 warp-specialized"]["tflops"] / row["cuDNN"]["tflops"]
        row["host_us_05"] = measure_host_overhead(x_nhwc, w, stride, padding)
        if not rows:
            row["launch_us"] = compare_launch_paths(x_nhwc, w, stride, padding)
            print(f"   host time of the launch alone: generic Triton launcher "
                  f"{row['launch_us']['generic']:.1f} us, direct call {row['launch_us']['direct']:.1f} us; "
                  f"whole conv2d_fprop call {row['host_us_05']:.1f} us")
        rows.append(row)
        del x_nhwc, w, expected
        torch.cuda.empty_cache()
    info = common.versions()
    print(f"\nTFLOPS, {str(dtype)[6:]}, {info['device']}, torch {info['torch']}, triton {info['triton']}, "
          f"cuDNN {info.get('cudnn')}")
    names = ["02 implicit GEMM", "04 single-buffer", "05 warp-specialized", "cuDNN"]
    print("  end to end (do_bench: L2 flushed, launch overhead included); 'graph' columns: kernels "
          "alone (CUDA graph replay)")
    print(f"  {'shape':<30}" + "".join(f"{n.split()[0]:>7}" for n in names)
          + "  05/cuDNN  05 graph cuDNN graph  ratio   host us  05 us   config")
    for row in rows:
        graph_ratio = row["05 warp-specialized graph"]["tflops"] / row["cuDNN graph"]["tflops"]
        row["ratio_05_cudnn_graph"] = graph_ratio
        print(f"  {row['shape']:<30}" + "".join(f"{row[n]['tflops']:7.1f}" for n in names)
              + f"  {row['ratio_05_cudnn']:7.2f}x {row['05 warp-specialized graph']['tflops']:8.1f}"
              f" {row['cuDNN graph']['tflops']:11.1f} {graph_ratio:6.2f}x {row['host_us_05']:8.1f}"
              f" {row['05 warp-specialized']['ms'] * 1e3:6.1f}   {row['config_05']}")
    print(f"  the {BENCH_ROUNDS} alternating rounds behind the 05 and cuDNN medians (TFLOPS):")
    for row in rows:
        print(f"  {row['shape']:<30} 05: " + " ".join(f"{t:6.1f}" for t in row["05 warp-specialized"]["rounds"])
              + "   cuDNN: " + " ".join(f"{t:6.1f}" for t in row["cuDNN"]["rounds"]))
    three_by_three = [r["ratio_05_cudnn"] for r in rows if "3x3" in r["shape"]]
    geomean = math.exp(sum(math.log(r) for r in three_by_three) / len(three_by_three))
    print(f"  geometric mean of 05/cuDNN over the {len(three_by_three)} 3x3 shapes: {geomean:.3f}x")
    data = {"rows": rows, "geomean_3x3_ratio": geomean, "dtype": str(dtype), **info}
    plot_bench(rows, info, dtype, outdir, data)
    return rows, geomean


def plot_bench(rows, info, dtype, outdir, data):
    names = ["02 implicit GEMM", "04 single-buffer", "05 warp-specialized", "cuDNN"]
    colors = ["#999999", "#d08040", "#2060c0", "#40a040"]
    fig, ax = common.new_figure(figsize=(12, 5))
    width = 0.2
    for i, name in enumerate(names):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ax.bar(xs, [r[name]["tflops"] for r in rows], width, label=name, color=colors[i])
    peak = dense_peak(info["device"])
    if peak:
        ax.axhline(peak, color="red", ls="--", lw=1, label=f"dense bf16 peak ({peak:.0f}, datasheet)")
    ax.set_xticks(range(len(rows)), [r["shape"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_xlabel("layer (batch 128; SD UNet at batch 8)")
    ax.set_ylabel("TFLOPS (higher is better)")
    ax.set_title(f"Convolution throughput per shape, {str(dtype)[6:]}, {info['device']}\n"
                 f"Triton {info['triton']}, torch {info['torch']}, cuDNN {info.get('cudnn')}")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    common.save_figure(fig, outdir, "05_tflops_per_shape", data)

    headline = rows[0]
    fig, ax = common.new_figure(figsize=(7, 4.5))
    values = [headline[n]["tflops"] for n in names]
    bars = ax.bar(["lesson 02\nimplicit GEMM", "lesson 04\nTMA + MMA", "lesson 05\nwarp-specialized",
                   "cuDNN"], values, color=colors)
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom")
    if peak:
        ax.axhline(peak, color="red", ls="--", lw=1, label=f"dense bf16 peak ({peak:.0f})")
        ax.legend(fontsize=8)
    ax.set_ylabel("TFLOPS (higher is better)")
    ax.set_title(f"The ladder of the series on {headline['geometry']}\n{str(dtype)[6:]}, {info['device']}",
                 fontsize=9)
    common.save_figure(fig, outdir, "05_ladder")


# %%
if __name__ == "__main__":
    args = common.lesson_args("Lesson 05: warp-specialized persistent conv")
    outdir = common.output_dir(args.outdir)
    run_show_ptx()
    if common.has_tma_mma_gpu():
        run_conv(conv2d_fprop_fixed, 4, 32, 32, 384, 384, 3, 3, 1, 1)
        run_conv(conv2d_fprop, 8, 28, 28, 128, 128, 3, 3, 1, 1, with_bias=True)
        print(f"\nconv2d_fprop matches torch.nn.functional.conv2d on {common.gpu_name()}")
        if args.bench:
            run_bench(outdir, quick=args.quick)
    else:
        print(f"\n[skip] GPU runs and the benchmark: {common.GLUON_SKIP_REASON}")
    print("lesson 05: all checks passed")
