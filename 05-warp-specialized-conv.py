"""
Lesson 05: a persistent, pipelined, warp-specialized convolution for Hopper and Blackwell
=========================================================================================

What you will learn:

- why lesson 04 leaves the tensor cores idle, and how a ring of shared-memory stages with
  ready/empty mbarriers lets TMA loads run ahead of the MMAs;
- warp specialization: a one-warp loader that only issues TMA, then MMA issue and the epilogue,
  each where the architecture wants them (and why Hopper maps them differently from Blackwell);
- a persistent grid (one program per SM) walking output tiles in a grouped, L2-friendly order;
- overlapping one tile's epilogue with the next tile's main loop (Blackwell: two accumulators in
  tensor memory; Hopper: two consumer warpgroups taking turns, "ping-pong");
- tiles that are not a power of two wide (160 = 128 + 32 columns for Co=320), built from two MMAs;
- split-K for layers with fewer tiles than SMs, and a fused epilogue: act(conv * scale + bias +
  residual), so a folded BatchNorm, a ResNet block's skip connection and its ReLU cost no pass of
  their own;
- what compute-sanitizer says about such a kernel, and how to read its reports;
- what a runtime adds around a plain launcher (conv_runtime.py), and the measured ladder against
  cuDNN: `python 05-warp-specialized-conv.py --bench`; every layer of ResNet-50 and of the Stable
  Diffusion UNet against cuDNN: `--bench --suite networks` (network_suite.py).

Builds on: lesson 04 (TMA im2col + one MMA per k-step, `common.HopperWGMMA`/`BlackwellTcgen05`)
and lesson 03 (the im2col descriptor). What changed since lesson 04: the same inner step, now fed
by a multi-stage pipeline from its own warp, in a persistent kernel, with the epilogue overlapped.

Requires: sm_90 (H100/H200) or sm_100 (B200/GB200) for GPU runs. On a CPU: input checks and
ahead-of-time compiles for sm_90 and sm_100 whose PTX is checked.

Note: the Blackwell path is compiled and inspected, not run: no Blackwell GPU was available to this
series. All measured numbers in this file come from an H100 (see the bench output and JSON).

Run:  python 05-warp-specialized-conv.py [--bench [--suite shapes|networks]] [--quick] [--outdir out]

Tests: pytest 05-warp-specialized-conv.py
"""

# %%
import functools
import math
from typing import NamedTuple

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch
import triton
import triton.language as tl
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
# accident. Four changes make the overlap deliberate, and a fifth stops computing padding
# columns. Each comes next, right before the code that does it:
#   1. a ring of shared-memory stages, so that loads run ahead of the MMAs;
#   2. warp specialization: a loader warp, and MMA + epilogue warps mapped per architecture;
#   3. a persistent grid walking the tiles in a grouped order;
#   4. the epilogue of one tile overlapped with the main loop of the next;
#   5. tiles that are not a power of two wide, from a main MMA and a tail MMA;
#   6. split-K, for layers with fewer tiles than SMs;
#   7. a fused epilogue: scale, bias, residual and activation on the tile before it is stored.

# %%
# 1. A ring of stages, and the loader that fills it
# -------------------------------------------------
# NUM_BUFFERS shared-memory stages, each holding one A tile (BLOCK_M pixels x BLOCK_K channels,
# the im2col box) and one B tile (BLOCK_N filters x BLOCK_K). Stage i has two mbarriers:
#   ready[i]  the loads into it have landed: `mbarrier.expect` announces the byte count and the
#             TMA engine arrives with the bytes;
#   empty[i]  the MMA that read it is done: the consumer arrives.
# The producer waits for empty, the consumer for ready, and the loads of step k + NUM_BUFFERS - 1
# are in flight while step k multiplies. One counter runs across all k-steps of all tiles and
# gives the slot (counter % NUM_BUFFERS) and the phase ((counter // NUM_BUFFERS) & 1) each side
# waits for. A fresh barrier counts as "phase 1 complete", so the producer starts at the opposite
# phase and its first pass over the ring finds every stage empty.
#
# The loader is the producer. It runs in a partition of its own, one warp (section 2), so it
# needs nothing but the descriptors, the ring and the tile order (section 3).


@gluon.jit
def loader_partition(in_desc, w_desc, w_tail_desc, a_bufs, a_tail_bufs, b_bufs, b_tail_bufs, ready, empty,
                     num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                     Ci, S, k_steps, channel_blocks, GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                     TILE_M: gl.constexpr, TILE_N: gl.constexpr, SPLIT_K: gl.constexpr):
    """One warp: for every (tile, k-step) of this program, wait for a free stage and fill it."""
    PIXEL_BOX: gl.constexpr = in_desc.block_type.shape[0]     # pixels per im2col load
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_M_TAIL: gl.constexpr = TILE_M - BLOCK_M
    BLOCK_N_TAIL: gl.constexpr = TILE_N - BLOCK_N
    # bytes that land per stage: TILE_M pixels of A (in boxes of PIXEL_BOX) and TILE_N rows of
    # weights (main box + tail box)
    stage_bytes: gl.constexpr = (in_desc.block_type.nbytes * TILE_M // PIXEL_BOX
                                 + w_desc.block_type.nbytes * TILE_N // BLOCK_N)
    counter = 0
    num_tiles = num_pid_m * num_pid_n
    for unit in range(gl.program_id(0), num_work_units(num_tiles, SPLIT_K), gl.num_programs(0)):
        tile_id, split, k_begin, k_end, partial = work_unit(unit, num_tiles, k_steps, SPLIT_K)
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * TILE_M
        # where the tile's im2col boxes start: one box for BLOCK_M pixels, or with a row tail
        # (section 5) boxes of the tail's height, each at its own pixel, so its own (n, y, x);
        # worked out once per tile (integer divisions are slow in a loop of one warp)
        n, start_h, start_w = pixel_box_origin(m0, out_h, out_w, stride_h, stride_w, pad_h, pad_w)
        if PIXEL_BOX < BLOCK_M:
            n_1, h_1, w_1 = pixel_box_origin(m0 + PIXEL_BOX, out_h, out_w, stride_h, stride_w, pad_h, pad_w)
        if BLOCK_M_TAIL > 0:
            n_t, h_t, w_t = pixel_box_origin(m0 + BLOCK_M, out_h, out_w, stride_h, stride_w, pad_h, pad_w)
        co0 = pid_n * TILE_N
        for k in range(k_begin, k_end):
            tap = k // channel_blocks
            c0 = (k % channel_blocks) * BLOCK_K
            tap_offsets = [((tap // S) * dil_h).to(gl.int16), ((tap % S) * dil_w).to(gl.int16)]
            slot = counter % NUM_BUFFERS
            # wait until the MMA that last read this stage is done (first pass: returns at once)
            mbarrier.wait(empty.index(slot), ((counter // NUM_BUFFERS) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), stage_bytes)
            # A = im2col_load(x, [n, oy*sh-ph, ox*sw-pw, c0], offsets=[r*dh, s*dw])
            if PIXEL_BOX == BLOCK_M:
                tma.async_load_im2col(in_desc, [n, start_h, start_w, c0], tap_offsets,
                                      ready.index(slot), a_bufs.index(slot))
            else:
                tma.async_load_im2col(in_desc, [n, start_h, start_w, c0], tap_offsets, ready.index(slot),
                                      a_bufs.index(slot).slice(0, PIXEL_BOX))
                tma.async_load_im2col(in_desc, [n_1, h_1, w_1, c0], tap_offsets, ready.index(slot),
                                      a_bufs.index(slot).slice(PIXEL_BOX, PIXEL_BOX))
            if BLOCK_M_TAIL > 0:
                tma.async_load_im2col(in_desc, [n_t, h_t, w_t, c0], tap_offsets, ready.index(slot),
                                      a_tail_bufs.index(slot))
            # B = load(w2d, [co0, (r*S + s)*Ci + c0]), and the tail's rows after it
            tma.async_load(w_desc, [co0, tap * Ci + c0], ready.index(slot), b_bufs.index(slot))
            if BLOCK_N_TAIL > 0:
                tma.async_load(w_tail_desc, [co0 + BLOCK_N, tap * Ci + c0], ready.index(slot),
                               b_tail_bufs.index(slot))
            counter += 1


@gluon.jit
def pixel_box_origin(m, out_h, out_w, stride_h, stride_w, pad_h, pad_w):
    """(n, y, x) in the input where the im2col box of output pixels m, m+1, ... starts (tap 0)."""
    n = m // (out_h * out_w)
    oy = (m // out_w) % out_h
    ox = m % out_w
    return n, oy * stride_h - pad_h, ox * stride_w - pad_w


# %%
# 2. Warp specialization: who issues what, per architecture
# ---------------------------------------------------------
# Issuing TMA takes one thread; doing it from the warps that run the MMAs steals their issue
# slots and forces the compiler to interleave two instruction streams. `gl.warp_specialize` runs
# separate functions in separate warps of one program. The two architectures want different
# splits:
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
# The epilogue store is shared: the fused epilogue of section 7 (bias, and whatever else the
# constexprs ask for), a cast, and an asynchronous TMA store.


@gluon.jit
def store_output_tile(acc, c_smem, out_desc, bias_ptr, scale_ptr, residual_ptr, M, Co, m0, co0,
                      HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                      ACTIVATION: gl.constexpr, STORES_IN_FLIGHT: gl.constexpr = 0):
    """Epilogue: y = act(acc * scale[co] + bias[co] + residual[m, co]) in fp32, each part only
    if its constexpr asks for it; cast, and an asynchronous TMA store of the tile.

    The store is not waited for here: it drains while the next tile computes. Before writing the
    staging buffer again we wait for the previous store from it to have read it (stores finish in
    order; STORES_IN_FLIGHT newer ones, from other buffers, may stay in flight)."""
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    cols = co0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
    if HAS_RESIDUAL:
        # the residual tile, read in the accumulator's own layout: no shuffle through shared memory
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc.type.layout))
        offsets = gl.expand_dims(rows.to(gl.int64) * Co, 1) + gl.expand_dims(cols, 0)
        inside = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < Co, 0)
        residual = gl.load(residual_ptr + offsets, mask=inside, other=0.0)
    if HAS_SCALE:
        scale = gl.load(scale_ptr + cols, mask=cols < Co, other=0.0)
        acc = acc * gl.expand_dims(scale.to(gl.float32), 0)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + cols, mask=cols < Co, other=0.0)
        acc = acc + gl.expand_dims(bias.to(gl.float32), 0)
    if HAS_RESIDUAL:
        acc = acc + residual.to(gl.float32)
    if ACTIVATION == 1:      # ReLU
        acc = gl.maximum(acc, 0.0)
    if ACTIVATION == 2:      # SiLU: x * sigmoid(x)
        acc = acc / (1.0 + gl.exp(-acc))
    tma.store_wait(pendings=STORES_IN_FLIGHT)
    c_smem.store(acc.to(out_desc.dtype))
    fence_async_shared()
    tma.async_store(out_desc, [m0, co0], c_smem)


@gluon.jit
def store_partial_tile(acc, partial_ptr, split, M, Co, m0, co0):
    """Split-K (section 6): this unit's fp32 partial sum of the tile, to partial[split, m, co]."""
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc.type.layout))
    cols = co0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
    offsets = gl.expand_dims((rows + split * M).to(gl.int64) * Co, 1) + gl.expand_dims(cols, 0)
    inside = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < Co, 0)
    gl.store(partial_ptr + offsets, acc, mask=inside)


@gluon.jit
def store_unit(acc, c_smem, out_desc, bias_ptr, scale_ptr, residual_ptr, partial_ptr, partial, split, M, Co,
               m0, co0, HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
               ACTIVATION: gl.constexpr, SPLIT_K: gl.constexpr, STORES_IN_FLIGHT: gl.constexpr = 0):
    """A unit's result: a whole tile through the epilogue, or a slice's partial sum (split-K)."""
    if SPLIT_K > 1:
        if partial:
            store_partial_tile(acc, partial_ptr, split, M, Co, m0, co0)
        else:
            store_output_tile(acc, c_smem, out_desc, bias_ptr, scale_ptr, residual_ptr, M, Co, m0, co0,
                              HAS_BIAS, HAS_SCALE, HAS_RESIDUAL, ACTIVATION, STORES_IN_FLIGHT)
    else:
        store_output_tile(acc, c_smem, out_desc, bias_ptr, scale_ptr, residual_ptr, M, Co, m0, co0,
                          HAS_BIAS, HAS_SCALE, HAS_RESIDUAL, ACTIVATION, STORES_IN_FLIGHT)


@gluon.jit
def split_rows(acc):
    """The top and bottom halves of a tile's rows, as two tiles. Where each warpgroup holds two
    64-row WGMMA blocks of the accumulator (128 rows on 4 warps, 256 on 8), they sit side by side
    in each thread's registers, so the split moves no data."""
    ROWS: gl.constexpr = acc.shape[0]
    COLS: gl.constexpr = acc.shape[1]
    return gl.split(acc.reshape([2, ROWS // 2, COLS]).permute((1, 2, 0)))


# %%
# The Hopper consumer. Read it first with NUM_CONSUMERS=1 and no tail: wait for a stage, issue
# its MMA, wait until only this step's MMA is in flight, release the previous stage, and after
# the last k-step release the last stage and store the tile. The `turn` barrier (section 4) and
# the `mma_tail` lines (section 5) come later.


@gluon.jit
def hopper_mma_epilogue_partition(a_bufs, a_tail_bufs, b_bufs, b_tail_bufs, ready, empty, turn, c_smem,
                                  c_tail_smem, out_desc, out_tail_desc, bias_ptr, scale_ptr, residual_ptr,
                                  partial_ptr, M, Co, num_pid_m, num_pid_n, k_steps,
                                  GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                                  HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr,
                                  HAS_RESIDUAL: gl.constexpr, ACTIVATION: gl.constexpr,
                                  SPLIT_K: gl.constexpr, TILE_M: gl.constexpr, TILE_N: gl.constexpr,
                                  CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                                  STORE_BY_ROW_BLOCKS: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(NUM_CONSUMERS <= 2, "one consumer, or two taking turns")
    gl.static_assert(SPLIT_K == 1 or NUM_CONSUMERS == 1, "split-K runs with one consumer")
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    # The tail (section 5): TILE_N - BLOCK_N more columns, or TILE_M - BLOCK_M more rows. Its MMA
    # reads a_tail x b_tail: the main A with the tail's weights, or the tail's pixels with the
    # main weights (the kernel passes the main buffers for the side without a tail).
    HAS_TAIL: gl.constexpr = TILE_N > BLOCK_N or TILE_M > BLOCK_M
    TAIL_M: gl.constexpr = out_tail_desc.block_type.shape[0] if HAS_TAIL else BLOCK_M
    TAIL_N: gl.constexpr = out_tail_desc.block_type.shape[1] if HAS_TAIL else BLOCK_N
    MMAS_PER_STEP: gl.constexpr = 2 if HAS_TAIL else 1
    counter = CONSUMER * k_steps      # the ring position of this consumer's first k-step
    local_tile = 0
    num_tiles = num_pid_m * num_pid_n
    for unit in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), num_work_units(num_tiles, SPLIT_K),
                      NUM_CONSUMERS * gl.num_programs(0)):
        tile_id, split, k_begin, k_end, partial = work_unit(unit, num_tiles, k_steps, SPLIT_K)
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        if NUM_CONSUMERS == 2:
            # my turn: the other consumer has issued the whole main loop of the tile before mine.
            # (A fresh barrier counts as phase 1 complete: consumer 0's first wait returns at once.)
            mbarrier.wait(turn.index(CONSUMER), (local_tile & 1) ^ (1 - CONSUMER))
        # acc = zeros(BLOCK_M, BLOCK_N) (+ zeros(BLOCK_M, BLOCK_N_TAIL))
        mma = common.HopperWGMMA.initialize(out_desc.dtype, BLOCK_M, BLOCK_N, num_warps)
        if HAS_TAIL:
            mma_tail = common.HopperWGMMA.initialize(out_desc.dtype, TAIL_M, TAIL_N, num_warps)
        for k in range(k_begin, k_end):
            slot = counter % NUM_BUFFERS
            mbarrier.wait(ready.index(slot), (counter // NUM_BUFFERS) & 1)
            # acc += A @ B^T, asynchronously (and the tail's columns or rows: a second, smaller MMA)
            mma = mma.issue_async_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)))
            if HAS_TAIL:
                mma_tail = mma_tail.issue_async_mma(a_tail_bufs.index(slot),
                                                    b_tail_bufs.index(slot).permute((1, 0)))
                mma_tail = mma_tail.wait_num_outstanding(MMAS_PER_STEP)
            # Only this step's MMAs in flight: the ones of step k-1 are done, so its stage is free.
            mma = mma.wait_num_outstanding(MMAS_PER_STEP)
            mbarrier.arrive(empty.index((counter + NUM_BUFFERS - 1) % NUM_BUFFERS), pred=k > k_begin)
            counter += 1
        if NUM_CONSUMERS == 2:
            mbarrier.arrive(turn.index(1 - CONSUMER))   # your turn: my MMAs are all issued
        mma = mma.wait_num_outstanding(0)
        if HAS_TAIL:
            mma_tail = mma_tail.wait_num_outstanding(0)
        mbarrier.arrive(empty.index((counter + NUM_BUFFERS - 1) % NUM_BUFFERS))
        acc, mma = mma.take_result()
        m0, co0 = pid_m * TILE_M, pid_n * TILE_N
        if STORE_BY_ROW_BLOCKS:
            # a ring too deep for a whole-tile staging buffer (section 5): the main block goes out
            # in two halves of its rows through the tail's buffer, a row tail (if any) after them
            top, bottom = split_rows(acc)
            store_unit(top, c_tail_smem, out_tail_desc, bias_ptr, scale_ptr, residual_ptr, partial_ptr,
                       partial, split, M, Co, m0, co0, HAS_BIAS, HAS_SCALE, HAS_RESIDUAL, ACTIVATION, SPLIT_K)
            store_unit(bottom, c_tail_smem, out_tail_desc, bias_ptr, scale_ptr, residual_ptr, partial_ptr,
                       partial, split, M, Co, m0 + BLOCK_M // 2, co0, HAS_BIAS, HAS_SCALE, HAS_RESIDUAL,
                       ACTIVATION, SPLIT_K)
        else:
            store_unit(acc, c_smem, out_desc, bias_ptr, scale_ptr, residual_ptr, partial_ptr, partial, split,
                       M, Co, m0, co0, HAS_BIAS, HAS_SCALE, HAS_RESIDUAL, ACTIVATION, SPLIT_K)
        if HAS_TAIL:
            # the tail's block: after the main block's columns (N tail) or below its rows (M tail)
            acc_tail, mma_tail = mma_tail.take_result()
            store_unit(acc_tail, c_tail_smem, out_tail_desc, bias_ptr, scale_ptr, residual_ptr, partial_ptr,
                       partial, split, M, Co, m0 + TILE_M - TAIL_M, co0 + TILE_N - TAIL_N, HAS_BIAS,
                       HAS_SCALE, HAS_RESIDUAL, ACTIVATION, SPLIT_K,
                       STORES_IN_FLIGHT=0 if STORE_BY_ROW_BLOCKS else 1)
        counter += (NUM_CONSUMERS - 1) * k_steps      # skip the other consumer's tile
        local_tile += 1
    tma.store_wait(pendings=0)


# %%
# Blackwell: a one-warp MMA issuer and the epilogue, joined by a double-buffered accumulator in
# tensor memory (TMEM). The MMA warp waits until the epilogue has read accumulator `buf`
# (acc_empty), runs the tile's k-steps into it, and commits acc_ready[buf] once every MMA of the
# tile has finished; the epilogue waits for acc_ready, loads the accumulator into registers and
# arrives on acc_empty so the MMA warp can reuse it while the store is still going on.


@gluon.jit
def blackwell_mma_partition(a_bufs, b_bufs, b_tail_bufs, ready, empty, acc_tmem, acc_tail_tmem,
                            acc_ready, acc_empty, num_pid_m, num_pid_n, k_steps,
                            NUM_BUFFERS: gl.constexpr, NUM_ACC: gl.constexpr, TILE_N: gl.constexpr,
                            SPLIT_K: gl.constexpr):
    BLOCK_N_TAIL: gl.constexpr = TILE_N - b_bufs.shape[1]
    counter = 0
    tile_count = 0
    num_tiles = num_pid_m * num_pid_n
    for unit in range(gl.program_id(0), num_work_units(num_tiles, SPLIT_K), gl.num_programs(0)):
        tile_id, split, k_begin, k_end, partial = work_unit(unit, num_tiles, k_steps, SPLIT_K)
        buf = tile_count % NUM_ACC
        # wait until the epilogue has read this accumulator (first pass: returns at once)
        mbarrier.wait(acc_empty.index(buf), ((tile_count // NUM_ACC) & 1) ^ 1)
        for k in range(k_begin, k_end):
            slot = counter % NUM_BUFFERS
            mbarrier.wait(ready.index(slot), (counter // NUM_BUFFERS) & 1)
            # acc += A @ B^T (and the tail's columns into their own accumulator)
            tcgen05_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc_tmem.index(buf),
                        use_acc=k > k_begin)
            if BLOCK_N_TAIL > 0:
                tcgen05_mma(a_bufs.index(slot), b_tail_bufs.index(slot).permute((1, 0)),
                            acc_tail_tmem.index(buf), use_acc=k > k_begin)
            # the hardware arrives on empty[slot] once these MMAs (and all earlier ones) are done
            tcgen05_commit(empty.index(slot))
            counter += 1
        # signal the epilogue once every MMA of the tile has finished
        tcgen05_commit(acc_ready.index(buf))
        tile_count += 1


@gluon.jit
def blackwell_epilogue_partition(acc_tmem, acc_tail_tmem, acc_ready, acc_empty, c_smem, c_tail_smem,
                                 out_desc, out_tail_desc, bias_ptr, scale_ptr, residual_ptr, partial_ptr,
                                 M, Co, k_steps, num_pid_m, num_pid_n, GROUP_M: gl.constexpr,
                                 HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr,
                                 HAS_RESIDUAL: gl.constexpr, ACTIVATION: gl.constexpr,
                                 SPLIT_K: gl.constexpr, NUM_ACC: gl.constexpr, TILE_N: gl.constexpr):
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    BLOCK_N_TAIL: gl.constexpr = TILE_N - BLOCK_N
    tile_count = 0
    num_tiles = num_pid_m * num_pid_n
    for unit in range(gl.program_id(0), num_work_units(num_tiles, SPLIT_K), gl.num_programs(0)):
        tile_id, split, k_begin, k_end, partial = work_unit(unit, num_tiles, k_steps, SPLIT_K)
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        buf = tile_count % NUM_ACC
        mbarrier.wait(acc_ready.index(buf), (tile_count // NUM_ACC) & 1)
        acc = acc_tmem.index(buf).load()           # TMEM -> registers
        if BLOCK_N_TAIL > 0:
            acc_tail = acc_tail_tmem.index(buf).load()
        mbarrier.arrive(acc_empty.index(buf))      # the MMA warp may reuse it now
        co0 = pid_n * TILE_N
        store_unit(acc, c_smem, out_desc, bias_ptr, scale_ptr, residual_ptr, partial_ptr, partial, split,
                   M, Co, pid_m * BLOCK_M, co0, HAS_BIAS, HAS_SCALE, HAS_RESIDUAL, ACTIVATION, SPLIT_K)
        if BLOCK_N_TAIL > 0:
            store_unit(acc_tail, c_tail_smem, out_tail_desc, bias_ptr, scale_ptr, residual_ptr, partial_ptr,
                       partial, split, M, Co, pid_m * BLOCK_M, co0 + BLOCK_N, HAS_BIAS, HAS_SCALE,
                       HAS_RESIDUAL, ACTIVATION, SPLIT_K, STORES_IN_FLIGHT=1)
        tile_count += 1
    tma.store_wait(pendings=0)


# %%
# 3. A persistent grid and a grouped tile order
# ---------------------------------------------
# One program per SM, each looping over output tiles tile = pid, pid + num_programs, ... (every
# partition above walks this same sequence). No launch cost per tile, and the loader runs ahead
# into the next tile while the current one finishes. Tiles are numbered in groups of GROUP_M
# row-tiles (the order of Triton's matmul tutorial), so the Co/BLOCK_N tiles that share one strip
# of A run close together in time and read it from L2, not HBM.


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
def work_unit(unit, num_tiles, k_steps, SPLIT_K: gl.constexpr):
    """(tile_id, split, first k-step, end k-step, partial) of a unit of work: a whole tile, or
    with split-K (section 6) one of SPLIT_K slices of a tile's K loop, whose fp32 partial sum
    (partial = 1) split_k_epilogue_kernel finishes. Split-K splits only the tiles past the last
    full wave: the first whole_tiles = num_tiles // P * P tiles (P programs) run whole, the rest in
    slices, the slices of one part of the K loop together, so tiles that run side by side still
    share strips of A and B in L2 as above. (Fewer tiles than programs: all of them are split.)"""
    if SPLIT_K == 1:
        return unit, 0, 0, k_steps, 0
    else:
        whole_tiles = num_tiles // gl.num_programs(0) * gl.num_programs(0)
        partial = (unit >= whole_tiles).to(gl.int32)
        split_unit = gl.maximum(unit - whole_tiles, 0)
        split_tiles = gl.maximum(num_tiles - whole_tiles, 1)
        split = split_unit // split_tiles
        # whole: (unit, 0, 0, k_steps); split: (a tile past whole_tiles, its slice's k-steps)
        tile_id = unit + partial * (whole_tiles + split_unit % split_tiles - unit)
        k_begin = partial * (split * k_steps // SPLIT_K)
        k_end = k_steps + partial * ((split + 1) * k_steps // SPLIT_K - k_steps)
        return tile_id, split, k_begin, k_end, partial


@gluon.jit
def num_work_units(num_tiles, SPLIT_K: gl.constexpr):
    """How many units the tiles make: whole tiles, plus SPLIT_K slices of each split one."""
    if SPLIT_K == 1:
        return num_tiles
    else:
        whole_tiles = num_tiles // gl.num_programs(0) * gl.num_programs(0)
        return whole_tiles + (num_tiles - whole_tiles) * SPLIT_K


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
# drains while tile t+1 computes (we wait for it only before reusing the staging buffer).
# Measured on an H100: ping-pong with 128x128 tiles reached 585-595 TFLOPS on the headline shape,
# no faster than one 4-warp consumer with the same tile (590-605). The winner there is a single
# 8-warp consumer with 256x128 tiles (700-760): per FLOP it moves a quarter fewer bytes through
# L2 and shared memory, and that matters more than the hidden epilogue.
#
# 5. Tiles that are not a power of two wide (or tall)
# ---------------------------------------------------
# Triton's tensors (so its shared buffers and accumulators) have power-of-two shapes, so with
# BLOCK_N=128 a layer with Co=320 computes three tiles of 128 columns, 384 in all: a sixth of the
# tensor-core work lands on columns that are thrown away. The hardware has no such rule: a
# WGMMA's N is any multiple of 8 up to 256, tcgen05's any multiple of 16, a TMA box any size up to
# 256. So a tile may carry a *tail*: BLOCK_N_TAIL more columns (32 here, making 160 = 320 / 2)
# with their own TMA box of weights, shared buffer, MMA (reading the same A tile), accumulator and
# store. The loader fills both weight boxes into one stage (one `expect` with the sum of the
# bytes); the consumer issues two MMAs per k-step and waits for both. On an H100 this took SD
# UNet's 320-channel layer from 530 to 642 TFLOPS.
#
# The same trick works in M, and there it is about waves and bytes rather than wasted columns.
# ResNet-50's 7x7 stage at batch 128 has M = 128 x 49 = 6272 pixels: 49 rows of 128-pixel tiles,
# so with Co = 512 196 tiles for 132 SMs, two waves of which the second is half empty. With 192-pixel tiles
# (a *row tail* of 64 under the main 128) it is 33 x 4 = 132 tiles, one wave. A row tail has its
# own A buffer and MMA (the tail's pixels times the main weights) and its own store; the kernel
# passes the main buffers for the side without a tail, so one tail MMA,
# `a_tail_bufs x b_tail_bufs`, serves both kinds. The pixels come in im2col boxes of the tail's
# height, 64: two for the main rows and one for the tail, each starting at its own output pixel,
# so at its own (n, y, x) (`pixel_box_origin`). Work those out once per tile, not per k-step:
# the first version computed them in the loader's K loop, and a one-warp loader doing nine
# integer divisions per k-step became the bottleneck: on the SD UNet's 64x64 640->640 layer the
# row tail ran at 580 TFLOPS against 733 for the best other config; with the origins worked out
# per tile (and 48 registers for the loader instead of 24), 752 against 718 (autotuner timings).
# A 192 x 128 tile also reads 320 rows per k-step for 24576 products where 128 x 128 reads 256
# for 16384: a fifth fewer bytes per FLOP, which is what won on the layers between memory and
# compute ("What paid, and what did not"). Row tails are a Hopper schedule here (on Blackwell a
# 64-row TMEM accumulator would be next).
#
# How deep the ring can be is a matter of shared memory, and the epilogue's staging buffer takes
# its share: a 192 x 128 tile stages 48 KB on its way out, and four 40 KB stages plus that fill
# 208 of the 227 KB. A fifth stage fits if the tile leaves in blocks of the tail's height through
# one 16 KB buffer: the main accumulator's top 64 rows, its bottom 64 rows, then the tail, each
# TMA store waited for before the next block overwrites the buffer. `stores_by_row_blocks`
# decides it from shared memory alone (the whole tile's buffer does not fit beside the ring), so
# a 256 x 128 tile with four stages leaves in two 128-row halves the same way. The split needs
# no data moved where a warpgroup holds two 64-row WGMMA blocks of the accumulator, side by side
# in each thread's registers (one 4-warp consumer of 128 rows, or 8 warps of 256): then
# `split_rows` is a reshape and a split; `check_config` refuses the rest. The three stores take longer than
# two, so the shallower ring stays a candidate. What the fifth stage buys is latency hidden on
# layers that read their input from HBM: ResNet-50's 7x7 2048->512 1x1 layer (one wave, 32
# k-steps per tile, its 25.7 MB input cold in L2) went from 437 to 471 TFLOPS (cuDNN: 499).
#
# 6. Split-K for layers with too few tiles
# ---------------------------------------
# A layer of a UNet's 8x8 stage (batch 8: M = 512 pixels, Co = 1280) has 40 tiles of 128x128 for
# 132 SMs, each with a K loop of 180 steps: 70% of the GPU idles while 40 SMs grind. Splitting
# the K loop of every tile into SPLIT_K slices makes SPLIT_K times as many units of work; each
# writes its fp32 partial sum to a workspace, partial[split, m, co], instead of storing the
# tile, and a second, plain Triton kernel sums the slices and applies the epilogue
# (`split_k_epilogue_kernel`, below). The price is the workspace's round trip through L2/HBM
# (SPLIT_K x M x Co x 4 bytes, written and read) and a second launch, so the runtime offers
# split-K only where whole tiles would leave the last wave less than 80% full, and the
# autotuner decides. (A serial fix-up within the kernel, each slice adding into the tile of the
# one before, did not pay: see "What paid, and what did not".)
#
# A layer with more tiles than SMs has the same problem in its last wave: ResNet-50's 7x7
# 2048->512 layer at batch 128 has 196 tiles of 128x128 for 132 SMs, two waves of which the
# second is half empty. Splitting every tile would pay the workspace for all 196; instead only
# the tiles past the last full wave are split (`work_unit`): 132 tiles run whole and store
# through the epilogue as usual, the other 64 run as 2 x 64 half-tiles in what was the second
# wave, and the second kernel finishes only those (it works out from the tile order which of
# its elements belong to split tiles, and leaves the rest alone).


@triton.jit
def split_k_epilogue_kernel(partial_ptr, out_ptr, bias_ptr, scale_ptr, residual_ptr, M, Co, out_stride,
                            tile_m, tile_n, num_pid_m, num_pid_n, whole_tiles,
                            SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr, GROUP_M: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[m, co] = act(sum over splits of partial[split, m, co] * scale + bias + residual), where
    (m, co) lies in a split tile: one numbered whole_tiles or later in the conv's grouped order
    (the inverse of grouped_tile, for the tile_m x tile_n tiles of the conv)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_m, pid_n = rows // tile_m, cols // tile_n
    first_m = pid_m // GROUP_M * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    tile_id = (first_m * num_pid_n + pid_m - first_m)[:, None] + pid_n[None, :] * rows_in_group[:, None]
    inside = (rows[:, None] < M) & (cols[None, :] < Co) & (tile_id >= whole_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        offsets = (rows + split * M).to(tl.int64)[:, None] * Co + cols[None, :]
        acc += tl.load(partial_ptr + offsets, mask=inside, other=0.0)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + cols, mask=cols < Co, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cols < Co, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        residual_offsets = rows.to(tl.int64)[:, None] * Co + cols[None, :]
        acc = acc + tl.load(residual_ptr + residual_offsets, mask=inside, other=0.0).to(tl.float32)
    if ACTIVATION == 1:
        acc = tl.maximum(acc, 0.0)
    if ACTIVATION == 2:
        acc = acc / (1.0 + tl.exp(-acc))
    out_offsets = rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=inside)


# %%
# 7. Fused epilogues
# ------------------
# In a ResNet block a conv is followed by BatchNorm, the residual add and ReLU. Run as separate
# passes, each reads a whole activation tensor the conv has just written and writes another: on
# ResNet-50's 56x56 stage at batch 128 the 256-channel output is 205 MB in bf16, so BatchNorm +
# add + ReLU move at least 3 x 205 MB (read the conv's output and the residual, write the result),
# ~0.18 ms at the H100's 3.35 TB/s, on a layer whose conv itself takes ~0.1 ms. Even
# torch.compile, which fuses the three into one kernel, cannot fuse them into a cuDNN call.
#
# Our epilogue holds the tile in registers anyway. `store_output_tile` (section 2) applies, each
# only if its constexpr asks for it so the plain kernel is unchanged: a per-channel fp32 scale,
# the bias (or shift), the residual tile (read straight into the accumulator's register layout),
# and ReLU or SiLU; then the one store. In eval mode BatchNorm is an affine map per channel and
# folds into the conv's weights and shift (conv_torch.fold_batchnorm), so conv -> BatchNorm ->
# add -> ReLU becomes one kernel that reads the residual once and writes the result once.
# conv_torch.fuse_conv_bn_act finds these chains in any model with torch.fx;
# scripts/resnet50.py measures what it does to a whole ResNet-50 (RESULTS.md).
#
# %%
# The kernel
# ----------
# Allocate the ring, the barriers and (Blackwell) the TMEM accumulators, then split into the
# partitions. Where the architectures differ it branches on the constexpr IS_BLACKWELL.


@gluon.jit
def conv2d_fprop_kernel(in_desc, w_desc, w_tail_desc, out_desc, out_tail_desc, bias_ptr, scale_ptr,
                        residual_ptr, partial_ptr, M, Co, num_pid_m, num_pid_n, out_h, out_w, stride_h,
                        stride_w, pad_h, pad_w, dil_h, dil_w, Ci, S, k_steps, channel_blocks,
                        IS_BLACKWELL: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr,
                        HAS_RESIDUAL: gl.constexpr, ACTIVATION: gl.constexpr, SPLIT_K: gl.constexpr,
                        GROUP_M: gl.constexpr,
                        NUM_BUFFERS: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                        BLOCK_M_TAIL: gl.constexpr, BLOCK_N_TAIL: gl.constexpr,
                        STORE_BY_ROW_BLOCKS: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = in_desc.dtype
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    TILE_M: gl.constexpr = BLOCK_M + BLOCK_M_TAIL     # output rows (pixels) per tile
    TILE_N: gl.constexpr = BLOCK_N + BLOCK_N_TAIL     # output columns per tile
    gl.static_assert(BLOCK_M_TAIL == 0 or BLOCK_N_TAIL == 0, "a tail in M or in N, not both")
    gl.static_assert(BLOCK_M_TAIL == 0 or not IS_BLACKWELL, "row tails are a Hopper schedule")
    gl.static_assert(not STORE_BY_ROW_BLOCKS or (out_tail_desc.block_type.shape[0] * 2 == BLOCK_M
                                                and NUM_CONSUMERS == 1 and BLOCK_N_TAIL == 0
                                                and BLOCK_M // (16 * num_warps) >= 2),
                     "storing by row blocks: blocks of half the main rows, one consumer holding "
                     "two 64-row WGMMA blocks per warpgroup, no column tail")
    # (The partitions' argument tuples are written out in each gl.warp_specialize call: a tuple
    # assigned to a variable first would turn its constexprs into run-time tensors in Triton 3.8.)
    # A is BLOCK_M pixels deep even when a row tail makes the im2col box shorter (section 5)
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_M, BLOCK_K], in_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_desc.block_type.shape, w_desc.layout)
    # one epilogue staging tile per consumer, and one for the tail's box; storing by row blocks
    # (section 5), the tail's box (half the main rows) is the only one
    if not STORE_BY_ROW_BLOCKS:
        c_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + out_desc.block_type.shape, out_desc.layout)
    if BLOCK_N_TAIL > 0:
        b_tail_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_tail_desc.block_type.shape,
                                                w_tail_desc.layout)
    elif BLOCK_M_TAIL > 0:
        a_tail_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + in_desc.block_type.shape, in_desc.layout)
    if BLOCK_N_TAIL > 0 or BLOCK_M_TAIL > 0 or STORE_BY_ROW_BLOCKS:
        c_tail_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + out_tail_desc.block_type.shape,
                                                out_tail_desc.layout)
    else:   # no tail: the main buffers stand in for the unused arguments
        c_tail_smem = c_smem
    if STORE_BY_ROW_BLOCKS:
        c_smem = c_tail_smem
    if BLOCK_N_TAIL == 0:
        b_tail_bufs = b_bufs
    if BLOCK_M_TAIL == 0:
        a_tail_bufs = a_bufs
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
                                            out_tail_desc, bias_ptr, scale_ptr, residual_ptr, partial_ptr,
                                            M, Co, k_steps, num_pid_m, num_pid_n, GROUP_M, HAS_BIAS,
                                            HAS_SCALE, HAS_RESIDUAL, ACTIVATION, SPLIT_K, NUM_ACC, TILE_N)),
            (blackwell_mma_partition, (a_bufs, b_bufs, b_tail_bufs, ready, empty, acc_tmem,
                                       acc_tail_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n,
                                       k_steps, NUM_BUFFERS, NUM_ACC, TILE_N, SPLIT_K)),
            (loader_partition, (in_desc, w_desc, w_tail_desc, a_bufs, a_tail_bufs, b_bufs, b_tail_bufs, ready,
                                empty, num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w,
                                dil_h, dil_w, Ci, S, k_steps, channel_blocks, GROUP_M, NUM_BUFFERS,
                                TILE_M, TILE_N, SPLIT_K)),
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
                (hopper_mma_epilogue_partition, (a_bufs, a_tail_bufs, b_bufs, b_tail_bufs, ready, empty, turn,
                                                 c_smem.index(0), c_tail_smem.index(0), out_desc,
                                                 out_tail_desc, bias_ptr, scale_ptr, residual_ptr,
                                                 partial_ptr, M, Co, num_pid_m, num_pid_n, k_steps, GROUP_M,
                                                 NUM_BUFFERS, HAS_BIAS, HAS_SCALE, HAS_RESIDUAL, ACTIVATION,
                                                 SPLIT_K, TILE_M, TILE_N,
                                                 0, 1, STORE_BY_ROW_BLOCKS, num_warps)),
                (loader_partition, (in_desc, w_desc, w_tail_desc, a_bufs, a_tail_bufs, b_bufs, b_tail_bufs,
                                    ready, empty, num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h,
                                    pad_w, dil_h, dil_w, Ci, S, k_steps, channel_blocks, GROUP_M, NUM_BUFFERS,
                                    TILE_M, TILE_N, SPLIT_K)),
            ], [1], [LOADER_REGISTERS])
        else:
            # ping-pong: consumer 0 is the default partition, consumer 1 a worker of as many warps.
            # Registers: 2 consumer warpgroups at 240 + the loader's warpgroup at 24 fill the 64K.
            gl.warp_specialize([
                (hopper_mma_epilogue_partition, (a_bufs, a_tail_bufs, b_bufs, b_tail_bufs, ready, empty, turn,
                                                 c_smem.index(0), c_tail_smem.index(0), out_desc,
                                                 out_tail_desc, bias_ptr, scale_ptr, residual_ptr,
                                                 partial_ptr, M, Co, num_pid_m, num_pid_n, k_steps, GROUP_M,
                                                 NUM_BUFFERS, HAS_BIAS, HAS_SCALE, HAS_RESIDUAL, ACTIVATION,
                                                 SPLIT_K, TILE_M, TILE_N,
                                                 0, 2, STORE_BY_ROW_BLOCKS, num_warps)),
                (hopper_mma_epilogue_partition, (a_bufs, a_tail_bufs, b_bufs, b_tail_bufs, ready, empty, turn,
                                                 c_smem.index(1), c_tail_smem.index(1), out_desc,
                                                 out_tail_desc, bias_ptr, scale_ptr, residual_ptr,
                                                 partial_ptr, M, Co, num_pid_m, num_pid_n, k_steps, GROUP_M,
                                                 NUM_BUFFERS, HAS_BIAS, HAS_SCALE, HAS_RESIDUAL, ACTIVATION,
                                                 SPLIT_K, TILE_M, TILE_N,
                                                 1, 2, STORE_BY_ROW_BLOCKS, num_warps)),
                (loader_partition, (in_desc, w_desc, w_tail_desc, a_bufs, a_tail_bufs, b_bufs, b_tail_bufs,
                                    ready, empty, num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h,
                                    pad_w, dil_h, dil_w, Ci, S, k_steps, channel_blocks, GROUP_M, NUM_BUFFERS,
                                    TILE_M, TILE_N, SPLIT_K)),
            ], [num_warps, 1], [240, min(LOADER_REGISTERS, 32)])


# %%
# Configs
# -------
# A config fixes what the kernel is compiled for: the tile (BLOCK_M x BLOCK_N x BLOCK_K, plus an
# optional tail), the ring depth, the warps of each MMA/epilogue partition, the programs per SM
# and the consumers per program. Some combinations are not implemented, and get a ValueError
# rather than a compile error or a hang.


class KernelConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_buffers: int        # stages in the shared-memory ring
    num_warps: int          # warps of each MMA/epilogue partition
    programs_per_sm: int = 1
    consumers: int = 1      # 2: Hopper ping-pong
    block_n_tail: int = 0   # extra output columns per tile, in a second MMA
    split_k: int = 1        # slices of the K loop, summed by a second kernel (section 6)
    block_m_tail: int = 0   # extra output rows (pixels) per tile, in a second MMA (Hopper)

    @property
    def tile_m(self):
        return self.block_m + self.block_m_tail

    @property
    def tile_n(self):
        return self.block_n + self.block_n_tail

    def __str__(self):
        extras = ([f"{self.programs_per_sm}/SM"] if self.programs_per_sm > 1 else []) + \
                 (["ping-pong"] if self.consumers > 1 else []) + \
                 ([f"split-K {self.split_k}"] if self.split_k > 1 else [])
        width = f"({self.block_n}+{self.block_n_tail})" if self.block_n_tail else f"{self.block_n}"
        height = f"({self.block_m}+{self.block_m_tail})" if self.block_m_tail else f"{self.block_m}"
        return (f"{height}x{width}x{self.block_k} {self.num_buffers} stages "
                f"{self.num_warps} warps" + "".join(f", {e}" for e in extras))


FIXED_CONFIG = KernelConfig(128, 128, 64, 4, 4)   # valid on both architectures; the tests' default
PINGPONG_CONFIG = KernelConfig(128, 128, 64, 4, 4, consumers=2)   # Hopper only


def check_config(config, arch):
    """Combinations the kernel does not implement get a ValueError naming the config."""
    if config.consumers > 2 or (config.consumers > 1 and arch != "sm_90"):
        raise ValueError(f"config {config}: consumers={config.consumers}; ping-pong (2 consumers) "
                         f"is a Hopper schedule, elsewhere consumers must be 1")
    if config.split_k > 1 and config.consumers > 1:
        raise ValueError(f"config {config}: split-K runs with one consumer (consumers=1)")
    if config.split_k < 1:
        raise ValueError(f"config {config}: split_k must be >= 1")
    if config.block_m_tail:
        if arch != "sm_90":
            raise ValueError(f"config {config}: block_m_tail (a row tail) is a Hopper schedule; "
                             f"on Blackwell it must be 0")
        if config.block_n_tail:
            raise ValueError(f"config {config}: a tail in rows or in columns, not both")
        tail = config.block_m_tail
        if tail not in (64, 128) or config.block_m not in (tail, 2 * tail):
            raise ValueError(f"config {config}: block_m_tail must be 64 or 128 (whole WGMMA row "
                             f"blocks) and block_m once or twice that (the pixels are loaded in boxes of "
                             f"the tail's height)")
    if stores_by_row_blocks(config):
        # the staging buffer holds half the main rows: the row tail must be that tall, and the
        # consumer's registers must hold the two halves apart (two 64-row WGMMA blocks per warpgroup)
        if (config.consumers != 1 or config.block_n_tail or config.block_m // (16 * config.num_warps) < 2
                or config.block_m_tail not in (0, config.block_m // 2) or arch != "sm_90"):
            raise ValueError(f"config {config}: {config.num_buffers} stages leave no room for a staging "
                             f"buffer of the whole tile, and storing it by row blocks needs Hopper, one "
                             f"consumer of block_m / 32 warps or fewer, no column tail, and a row tail (if "
                             f"any) of block_m / 2; use fewer stages")
    if config.programs_per_sm > 1 and arch != "sm_90":
        raise ValueError(f"config {config}: programs_per_sm > 1 is offered on Hopper only")
    if arch == "sm_100" and config.block_m not in (64, 128):
        raise ValueError(f"config {config}: on Blackwell block_m must be 64 or 128 (a TMEM "
                         f"accumulator has 128 lanes; 256-row tiles need two CTAs)")
    if arch == "sm_100" and 2 * config.tile_n > 512:
        raise ValueError(f"config {config}: two fp32 accumulators of {config.tile_n} columns "
                         f"exceed the 512 columns of tensor memory")


SHARED_MEMORY_PER_PROGRAM = 232448    # bytes: the opt-in maximum of a program on an H100 or B200


def ring_bytes(config, element_size=2):
    """Shared memory of the ring: per stage, the A rows of a tile and the B rows, BLOCK_K deep."""
    return config.num_buffers * (config.tile_m + config.tile_n) * config.block_k * element_size


def stores_by_row_blocks(config, element_size=2):
    """Whether the epilogue stores each tile in blocks of half its main rows through one staging
    buffer of that height (section 5): where a staging buffer of the whole tile would not fit
    beside the ring. A row tail of 5 stages: three 64-row blocks; a 256 x 128 tile of 4 stages: two
    of 128 rows."""
    whole_tile = config.consumers * config.tile_m * config.tile_n * element_size
    return ring_bytes(config, element_size) + whole_tile > SHARED_MEMORY_PER_PROGRAM


def adapt_block_k(config, Ci_padded):
    """Small channel counts (a padded Ci of 8 or 16) get a smaller K block: fewer zeros multiplied."""
    if Ci_padded < config.block_k:
        config = config._replace(block_k=max(16, triton.next_power_of_2(Ci_padded)))
    return config


# %%
# The plain launcher
# ------------------
# Everything a launch needs, built from scratch on every call: pad the channels to 16 bytes if
# needed (lesson 04), the TMA descriptors (the tail's two only when there is a tail), the grid
# (one program per SM, or fewer when there are fewer tiles), the run-time scalars and the
# constexprs. `conv2d_fprop_launch` is the whole kernel behind one call; the runtime at the end of
# the lesson makes the same launch cheaper on the host.


class ConvLaunch(NamedTuple):
    grid: tuple
    args: tuple          # the kernel's run-time arguments, in signature order
    out_2d: torch.Tensor  # [M, Co rounded up to 16 bytes], written by the kernel
    geometry: common.ConvGeometry
    partial: torch.Tensor = None   # split-K: the fp32 workspace [split_k, M, Co]; else None
    tiles: tuple = None            # split-K: (tile_m, tile_n, num_pid_m, num_pid_n, whole_tiles)

    def result(self):
        """The output as NHWC [N, out_h, out_w, Co]."""
        return output_nhwc(self.geometry, self.out_2d)


def output_nhwc(geometry, out_2d):
    """The kernel's output [M, Co rounded up to 16 bytes] as NHWC [N, out_h, out_w, Co]."""
    g, Co_alloc = geometry, out_2d.shape[1]
    out = out_2d.view(g.N, g.out_h, g.out_w, Co_alloc)
    return out if Co_alloc == g.Co else out[..., :g.Co].contiguous()


class Epilogue(NamedTuple):
    """What the epilogue applies to each tile: act(acc * scale + bias + residual), per part."""
    bias: bool = False          # + bias[co]: a conv bias, or a folded BatchNorm's shift
    scale: bool = False         # * scale[co]: a folded BatchNorm's gamma / sqrt(var + eps)
    residual: bool = False      # + residual[n, y, x, co]: a ResNet block's skip connection
    activation: str = "none"    # "none", "relu" or "silu"


ACTIVATIONS = {"none": 0, "relu": 1, "silu": 2}
GROUP_M = 8      # row-tiles per group of the tile order (section 3)


def kernel_constexprs(config, arch, epilogue=Epilogue()):
    """The kernel's constexprs and launch options, by name."""
    return dict(IS_BLACKWELL=arch == "sm_100", HAS_BIAS=epilogue.bias, HAS_SCALE=epilogue.scale,
                HAS_RESIDUAL=epilogue.residual, ACTIVATION=ACTIVATIONS[epilogue.activation],
                SPLIT_K=config.split_k, GROUP_M=GROUP_M,
                NUM_BUFFERS=config.num_buffers, NUM_CONSUMERS=config.consumers,
                BLOCK_M_TAIL=config.block_m_tail, BLOCK_N_TAIL=config.block_n_tail,
                STORE_BY_ROW_BLOCKS=stores_by_row_blocks(config), num_warps=config.num_warps,
                **({"maxnreg": 128} if config.programs_per_sm > 1 else {}))


def prepare_launch(x_nhwc, w, bias, geometry, config, arch, num_sms, scale=None, residual=None):
    """A ConvLaunch for these tensors (CPU tensors work too: the ahead-of-time compile uses them)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    config = KernelConfig(*config)
    check_config(config, arch)
    x_nhwc, w, Ci_padded = common.pad_channels_for_tma(x_nhwc, w)
    config = adapt_block_k(config, Ci_padded)
    BLOCK_M, BLOCK_N, BLOCK_K = config[:3]
    g = geometry
    settings = common.conv_im2col_settings(
        common.conv_geometry(x_nhwc.shape, w.shape, g.stride, g.padding, g.dilation))
    lanes = 16 // x_nhwc.element_size()
    out_2d = torch.empty(g.M, -(-g.Co // lanes) * lanes, device=x_nhwc.device, dtype=x_nhwc.dtype)
    # a row tail loads the pixels in boxes of the tail's height: two for the main rows, one for the tail
    in_desc, w_desc, out_desc = common.conv_tma_descriptors(x_nhwc, w, out_2d, settings, BLOCK_M, BLOCK_N,
                                                            BLOCK_K, pixel_box=config.block_m_tail or BLOCK_M)
    w_tail_desc = out_tail_desc = None    # a constexpr None: nothing for the launcher to encode
    if config.block_n_tail:
        tail = config.block_n_tail
        w_layout, out_layout = common.conv_tma_layouts(x_nhwc.dtype, BLOCK_M, tail, BLOCK_K)[1:]
        w_tail_desc = TensorDescriptor.from_tensor(w.view(g.Co, -1), [tail, BLOCK_K], w_layout)
        out_tail_desc = TensorDescriptor.from_tensor(out_2d, [BLOCK_M, tail], out_layout)
    if config.block_m_tail or stores_by_row_blocks(config):
        # the tail's rows are stored by a box of their own (which, storing by row blocks, also
        # stores the halves of the main block)
        rows = config.block_m_tail or BLOCK_M // 2
        out_layout = common.conv_tma_layouts(x_nhwc.dtype, rows, BLOCK_N, BLOCK_K)[2]
        out_tail_desc = TensorDescriptor.from_tensor(out_2d, [rows, BLOCK_N], out_layout)
    num_pid_m, num_pid_n = triton.cdiv(g.M, config.tile_m), triton.cdiv(g.Co, config.tile_n)
    channel_blocks = triton.cdiv(Ci_padded, BLOCK_K)
    k_steps = g.R * g.S * channel_blocks
    if config.split_k > k_steps:
        raise ValueError(f"config {config}: split_k={config.split_k} exceeds the {k_steps} k-steps "
                         f"of {g.describe()}")
    partial = (torch.empty(config.split_k, g.M, g.Co, device=x_nhwc.device, dtype=torch.float32)
               if config.split_k > 1 else None)
    # absent epilogue tensors: any pointer will do, the constexprs compile their loads away
    args = (in_desc, w_desc, w_tail_desc, out_desc, out_tail_desc,
            *(t if t is not None else out_2d for t in (bias, scale, residual, partial)),
            g.M, g.Co, num_pid_m, num_pid_n, g.out_h, g.out_w,
            *g.stride, *g.padding, *g.dilation, Ci_padded, g.S, k_steps, channel_blocks)
    num_tiles = num_pid_m * num_pid_n
    grid = (min(config.programs_per_sm * num_sms, num_tiles * config.split_k), 1, 1)
    # split-K splits the tiles past the last full wave (work_unit); all of them if there is none
    tiles = (config.tile_m, config.tile_n, num_pid_m, num_pid_n, num_tiles // grid[0] * grid[0])
    return ConvLaunch(grid, args, out_2d, geometry, partial, tiles if partial is not None else None)


def split_k_epilogue_launch(launch, bias=None, scale=None, residual=None, activation="none"):
    """(grid, args, constexprs) of split-K's second kernel: sum the slices, apply the epilogue."""
    g, out_2d, partial = launch.geometry, launch.out_2d, launch.partial
    grid = (triton.cdiv(g.M, 64), triton.cdiv(g.Co, 64), 1)     # 3-d: the direct launch takes no less
    args = (partial, out_2d, *(t if t is not None else out_2d for t in (bias, scale, residual)), g.M, g.Co,
            out_2d.stride(0), *launch.tiles)
    constexprs = dict(SPLIT_K=partial.shape[0], HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
                      HAS_RESIDUAL=residual is not None, ACTIVATION=ACTIVATIONS[activation],
                      GROUP_M=GROUP_M, BLOCK_M=64, BLOCK_N=64)
    return grid, args, constexprs


def finish_split_k(launch, bias=None, scale=None, residual=None, activation="none"):
    """Split-K's second kernel, launched plainly: the output from the partial sums."""
    grid, args, constexprs = split_k_epilogue_launch(launch, bias, scale, residual, activation)
    split_k_epilogue_kernel[grid](*args, **constexprs)


def check_inputs(x_nhwc, w, bias, stride, padding, dilation, scale=None, residual=None,
                 activation="none"):
    """Validate a call (dtype, layout, shapes, hyper-parameters, epilogue); return its geometry."""
    geometry = common.check_conv_inputs(x_nhwc, w, stride, padding, dilation, dtypes=CONV_DTYPES,
                                        bias=bias)
    if bias is not None and not bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    if scale is not None:
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"scale must be a torch.Tensor or None, got {type(scale).__name__}")
        if tuple(scale.shape) != (geometry.Co,) or not scale.is_floating_point() or not scale.is_contiguous():
            raise ValueError(f"scale must be a contiguous floating-point tensor of shape ({geometry.Co},) "
                             f"(one factor per output channel), got {scale.dtype} {tuple(scale.shape)}")
        if scale.device != x_nhwc.device:
            raise ValueError(f"scale is on {scale.device}, x_nhwc on {x_nhwc.device}")
    if residual is not None:
        expected = (geometry.N, geometry.out_h, geometry.out_w, geometry.Co)
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if tuple(residual.shape) != expected or residual.dtype != x_nhwc.dtype:
            raise ValueError(f"residual must have the output's NHWC shape {expected} and dtype "
                             f"{x_nhwc.dtype}, got {tuple(residual.shape)} {residual.dtype}")
        if not residual.is_contiguous() or residual.device != x_nhwc.device:
            raise ValueError(f"residual must be a contiguous NHWC tensor on {x_nhwc.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    common.check_on_cuda(x_nhwc)   # last: every other mistake is reported on a CPU machine too
    return geometry


def device_arch_and_sms(what):
    """("sm_90" or "sm_100", SM count) of the current GPU, or a clear error naming `what`."""
    capability = common.require_tma_mma_gpu(what)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return ("sm_90" if capability == (9, 0) else "sm_100"), props.multi_processor_count


def conv2d_fprop_launch(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=FIXED_CONFIG,
                        scale=None, residual=None, activation="none"):
    """The warp-specialized conv, launched plainly. x_nhwc [N, H, W, Ci], w [Co, R, S, Ci] (fp16 or
    bf16, CUDA, contiguous); returns NHWC [N, out_h, out_w, Co] in x's dtype. The epilogue
    computes act(conv * scale + bias + residual) in fp32 before the cast: optional bias and scale
    [Co] (fp32 or x's dtype), residual of the output's shape and dtype, activation "none", "relu"
    or "silu"."""
    geometry = check_inputs(x_nhwc, w, bias, stride, padding, dilation, scale, residual, activation)
    arch, num_sms = device_arch_and_sms("conv2d_fprop_launch")
    launch = prepare_launch(x_nhwc, w, bias, geometry, config, arch, num_sms, scale, residual)
    epilogue = Epilogue(bias is not None, scale is not None, residual is not None, activation)
    conv2d_fprop_kernel[launch.grid](*launch.args, **kernel_constexprs(KernelConfig(*config), arch, epilogue))
    if launch.partial is not None:
        finish_split_k(launch, bias, scale, residual, activation)
    return launch.result()


# %%
# Checks against torch (GPU)
# --------------------------
# The upstream Blackwell grid (N in {1, 128}, 64x64 images, Ci=Co in {384, 416}, 3x3/4x4/5x5
# filters, stride 1-2, padding 0-1) through the plain launcher, then awkward cases (Ci=3, dilation,
# Co not a multiple of the tile, odd sizes, fp16), ping-pong and tail tiles. The reference is
# torch's conv2d in fp32; tolerances are explained in common.assert_close_to_reference.

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
needs_hopper = pytest.mark.skipif(
    not (common.has_tma_mma_gpu() and common.is_hopper()),
    reason=common.GLUON_SKIP_REASON if not common.has_tma_mma_gpu() else
    "the ping-pong schedule is Hopper's (sm_90); this GPU is not a Hopper")


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
    run_conv(conv2d_fprop_launch, N, 64, 64, Ci_Co, Ci_Co, R, R, stride, padding)


AWKWARD_CASES = [
    (16, 32, 32, 5, 96, 3, 3, 1, 1, 1, torch.bfloat16, False),         # Ci=5 padded to 8
    (1, 1, 8, 96, 128, 1, 2, (1, 2), 0, 1, torch.bfloat16, False),     # asymmetric stride
    (4, 56, 56, 3, 64, 7, 7, 2, 3, 1, torch.float16, True),            # ResNet stem
    (2, 32, 32, 64, 64, 3, 3, 1, 2, 2, torch.bfloat16, False),         # dilation 2
    (2, 32, 32, 128, 200, 3, 3, 1, 1, 1, torch.bfloat16, True),        # bias, Co not a multiple of 8*16
    (8, 30, 26, 256, 128, 3, 3, 1, 1, 1, torch.float16, True),         # fp16, non-square
    (3, 17, 23, 40, 48, 3, 5, (2, 1), (1, 2), 1, torch.float16, False),  # odd sizes
]


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias", AWKWARD_CASES)
def test_awkward_cases(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias):
    run_conv(conv2d_fprop_launch, N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias)


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
    run_conv(functools.partial(conv2d_fprop_launch, config=config), N, H, W, Ci, Co, R, S, stride,
             padding, 1, dtype, with_bias)


def tail_configs_for_this_machine():
    """The tail configs of the autotuner's candidates, and configs that store by row blocks, that
    this GPU's architecture implements (all of them on a machine without a GPU, where the tests skip)."""
    configs = [KernelConfig(256, 128, 32, 5, 8, block_n_tail=32), KernelConfig(128, 128, 64, 5, 4, block_n_tail=32),
               KernelConfig(128, 128, 64, 4, 4, consumers=2, block_n_tail=32),
               KernelConfig(128, 64, 64, 6, 4, block_n_tail=32),
               # row tails (Hopper): 192-row tiles
               KernelConfig(128, 128, 64, 4, 4, block_m_tail=64), KernelConfig(128, 128, 64, 4, 8, block_m_tail=64),
               KernelConfig(128, 128, 64, 3, 4, consumers=2, block_m_tail=64),
               KernelConfig(128, 128, 64, 5, 4, block_m_tail=64),     # stores by row blocks
               KernelConfig(256, 128, 64, 4, 8)]     # no tail, but stores by row blocks too
    if not common.has_tma_mma_gpu():
        return configs
    arch = "sm_90" if common.is_hopper() else "sm_100"
    kept = []
    for config in configs:
        try:
            check_config(config, arch)
            kept.append(config)
        except ValueError:
            pass
    return kept


@needs_gpu
@pytest.mark.parametrize("config", tail_configs_for_this_machine(), ids=str)
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias", [
    (8, 32, 32, 320, 320, 3, 3, 1, 1, torch.bfloat16, True),      # SD-like: two 160-wide tiles
    (16, 20, 20, 128, 300, 3, 3, 1, 1, torch.float16, False),     # the last tail partly past Co
    (4, 15, 17, 64, 100, 3, 3, 2, 1, torch.bfloat16, True),       # Co below one main block
    (128, 14, 14, 256, 96, 1, 1, 1, 0, torch.bfloat16, False),    # 1x1, Co = 64 + 32
    (128, 7, 7, 512, 512, 1, 1, 1, 0, torch.bfloat16, True),      # M = 6272: 33 tiles of 192, the last 2/3 full
    (3, 9, 13, 96, 130, 3, 3, 1, 1, torch.float16, True),         # M = 351: the last tile's tail rows all past M
    (2, 9, 7, 64, 64, 5, 3, (2, 1), (2, 1), torch.bfloat16, False),  # M = 70 < one main block; strides differ
    (5, 11, 13, 72, 200, 3, 3, 2, 1, torch.bfloat16, True),       # row boxes across image boundaries, stride 2
])
def test_tail_tiles(config, N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias):
    run_conv(functools.partial(conv2d_fprop_launch, config=config), N, H, W, Ci, Co, R, S, stride,
             padding, 1, dtype, with_bias)


SPLIT_K_CONFIGS = [KernelConfig(128, 128, 64, 6, 8, split_k=3), KernelConfig(128, 64, 64, 6, 4, split_k=4),
                   KernelConfig(128, 128, 64, 5, 4, block_n_tail=32, split_k=2)]
if common.is_hopper():          # a row tail with split-K: the slices' partial sums of 192-row tiles
    SPLIT_K_CONFIGS += [KernelConfig(128, 128, 64, 4, 4, split_k=2, block_m_tail=64),
                        KernelConfig(128, 128, 64, 5, 4, split_k=2, block_m_tail=64)]   # by row blocks


@needs_gpu
@pytest.mark.parametrize("entry", ["conv2d_fprop_launch", "conv2d_fprop_fixed"])
@pytest.mark.parametrize("config", SPLIT_K_CONFIGS, ids=str)
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias", [
    (8, 8, 8, 1280, 1280, 3, 3, 1, 1, torch.bfloat16, True),       # SD's 8x8 stage: 40 tiles, 180 k-steps
    (8, 16, 16, 640, 320, 3, 3, 2, 1, torch.bfloat16, False),      # stride 2, Co = 2 x 160
    (2, 7, 7, 2048, 512, 1, 1, 1, 0, torch.float16, True),         # 1x1, M = 98 < one tile
    (4, 15, 17, 64, 100, 3, 3, 2, 1, torch.bfloat16, True),        # 9 k-steps in 2-4 slices, Co tail
    (128, 7, 7, 512, 512, 1, 1, 1, 0, torch.bfloat16, True),      # 196 tiles of 128x128: the last wave split
    (64, 9, 11, 192, 700, 3, 3, 1, 1, torch.float16, False),      # many tiles, some split, Co tail
])
def test_split_k(entry, config, N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias):
    """Plainly launched, and through the runtime (templates and direct launches of both kernels:
    the second call of a plan takes the direct path)."""
    for seed in (0, 1):
        common.check_conv(functools.partial(globals()[entry], config=config), N, H, W, Ci, Co, R, S,
                          stride, padding, 1, dtype=dtype, with_bias=with_bias, seed=seed)


def tile_order(num_pid_m, num_pid_n, group_m=GROUP_M):
    """[(pid_m, pid_n) of tile 0, 1, ...]: grouped_tile's order, written out in Python."""
    order = []
    for first_m in range(0, num_pid_m, group_m):
        rows_in_group = min(num_pid_m - first_m, group_m)
        order += [(first_m + i % rows_in_group, i // rows_in_group) for i in range(rows_in_group * num_pid_n)]
    return order


@pytest.mark.parametrize("M, Co, tile_m, tile_n, whole_tiles, split_k", [
    (1000, 300, 128, 160, 9, 2),      # 8 x 2 tiles in 2 groups, the last 7 split; Co and M tails
    (640, 256, 64, 64, 0, 3),         # every tile split (fewer tiles than programs)
    (2048, 96, 128, 64, 30, 4),       # 16 x 2 tiles, the last 2 split
])
def test_split_k_epilogue_finishes_only_split_tiles(M, Co, tile_m, tile_n, whole_tiles, split_k):
    """The second kernel sums the slices (and applies the epilogue) exactly on the tiles that
    work_unit split, found from the tile order, and leaves the whole tiles' output alone. On a
    CPU it runs in the interpreter."""
    generator = torch.Generator().manual_seed(0)
    num_pid_m, num_pid_n = triton.cdiv(M, tile_m), triton.cdiv(Co, tile_n)
    partial = torch.randn(split_k, M, Co, generator=generator)
    bias = torch.randn(Co, generator=generator)
    out = torch.full((M, Co), 7.0)                     # what the conv kernel stored for whole tiles
    geometry = common.conv_geometry((1, M, 1, 16), (Co, 1, 1, 16))          # M pixels, Co channels
    launch = ConvLaunch((1, 1, 1), (), out.to(common.device()), geometry, partial.to(common.device()),
                        (tile_m, tile_n, num_pid_m, num_pid_n, whole_tiles))
    finish_split_k(launch, bias.to(common.device()), activation="relu")
    expected = out.clone()
    for pid_m, pid_n in tile_order(num_pid_m, num_pid_n)[whole_tiles:]:
        rows, cols = slice(pid_m * tile_m, (pid_m + 1) * tile_m), slice(pid_n * tile_n, (pid_n + 1) * tile_n)
        expected[rows, cols] = (partial[:, rows, cols].sum(0) + bias[cols]).relu()
    torch.testing.assert_close(launch.out_2d.cpu(), expected, rtol=1e-5, atol=1e-5)


@needs_gpu
def test_split_k_last_wave_with_fused_epilogue():
    """Whole tiles store through the epilogue in the kernel, split ones in the second kernel: both
    must apply the same act(acc * scale + bias + residual)."""
    N, H, W, Ci, Co = 128, 7, 7, 256, 512          # 196 tiles of 128x128 on an H100's 132 SMs
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, 1, 1, torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    bias, scale = torch.randn(Co, generator=generator).cuda(), (torch.rand(Co, generator=generator) + 0.5).cuda()
    residual = torch.randn(N, H, W, Co, generator=generator).cuda().to(torch.bfloat16)
    out = conv2d_fprop_launch(x_nhwc, w, bias, config=KernelConfig(128, 128, 64, 6, 8, split_k=2), scale=scale,
                              residual=residual, activation="relu")
    expected = common.reference_conv2d_nhwc(x_nhwc, w, out_dtype=torch.float32) * scale + bias + residual.float()
    common.assert_close_to_reference(out, expected.relu().to(torch.bfloat16), dtype=torch.bfloat16, K=Ci)


def fused_configs_for_this_machine():
    configs = [FIXED_CONFIG, PINGPONG_CONFIG, KernelConfig(256, 128, 32, 5, 8, block_n_tail=32),
               KernelConfig(128, 128, 64, 5, 4, block_n_tail=32), SPLIT_K_CONFIGS[2],
               KernelConfig(128, 128, 64, 4, 4, block_m_tail=64), KernelConfig(128, 128, 64, 5, 4, block_m_tail=64),
               KernelConfig(256, 128, 64, 4, 8)]
    if common.has_tma_mma_gpu() and not common.is_hopper():
        configs = [c for c in configs if c.consumers == 1 and c.block_m <= 128 and not c.block_m_tail]
    return configs


@needs_gpu
@pytest.mark.parametrize("config", fused_configs_for_this_machine(), ids=str)
@pytest.mark.parametrize("epilogue", [Epilogue(True, True, True, "relu"), Epilogue(False, False, True, "none"),
                                      Epilogue(True, False, False, "silu")], ids=str)
def test_fused_epilogue(config, epilogue):
    """act(conv * scale + bias + residual) in every schedule, Co = 300 (tails past Co), stride 2."""
    N, H, W, Ci, Co, R, stride = 4, 30, 26, 96, 300, 3, 2
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, R, torch.bfloat16)
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, 1)
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(Co, generator=generator).cuda() if epilogue.bias else None
    scale = (torch.rand(Co, generator=generator) + 0.5).cuda() if epilogue.scale else None
    residual = (torch.randn(N, geometry.out_h, geometry.out_w, Co, generator=generator).cuda().to(torch.bfloat16)
                if epilogue.residual else None)
    out = conv2d_fprop_launch(x_nhwc, w, bias, stride, 1, config=config, scale=scale, residual=residual,
                              activation=epilogue.activation)
    expected = common.reference_conv2d_nhwc(x_nhwc, w, None, stride, 1, out_dtype=torch.float32)
    expected = expected * (scale if scale is not None else 1) + (bias if bias is not None else 0) \
        + (residual.float() if residual is not None else 0)
    expected = {"none": expected, "relu": expected.relu(), "silu": torch.nn.functional.silu(expected)}[
        epilogue.activation]
    common.assert_close_to_reference(out, expected.to(torch.bfloat16), dtype=torch.bfloat16, K=geometry.K)


BAD_INPUTS = common.bad_conv_inputs(torch.float16) + [
    (lambda x, w: (x, w), {"dilation": (1, 0)}, ValueError, "dilation"),
    (lambda x, w: (x, w), {"bias": "zeros"}, TypeError, "bias"),
    (lambda x, w: (x, w), {"bias": torch.zeros(3)}, ValueError, "bias must have shape"),
    (lambda x, w: (x, w), {"scale": torch.zeros(3)}, ValueError, "scale must be"),
    (lambda x, w: (x, w), {"residual": torch.zeros(1, 6, 6, 16)}, ValueError, "residual must have"),
    (lambda x, w: (x, w), {"activation": "gelu"}, ValueError, "activation must be"),
]


@pytest.mark.parametrize("entry", ["conv2d_fprop_launch", "conv2d_fprop", "conv2d_fprop_fixed"])
@pytest.mark.parametrize("make_args, kwargs, error, message", BAD_INPUTS)
def test_rejects_bad_input(entry, make_args, kwargs, error, message):
    x_nhwc, w = common.random_conv_inputs(1, 8, 8, 8, 16, 3, 3, torch.bfloat16)
    kwargs = {k: v.to(x_nhwc.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=message):
        globals()[entry](*make_args(x_nhwc, w), **kwargs)


# %%
# What the compiler produced (no GPU needed)
# ------------------------------------------
# Compiled ahead of time, the PTX shows each partition's work: the im2col bulk copies (loader),
# `wgmma.mma_async` (Hopper) or `tcgen05.mma` (Blackwell), `setmaxnreg` (the loader's registers
# handed to the MMA warps) and the TMA store. The Blackwell build is checked against what a
# line-by-line review of its synchronization expects (RESULTS.md, "The Blackwell path"), since no
# Blackwell GPU has run it.

IM2COL_LOAD = "cp.async.bulk.tensor.4d.shared::cta.global.im2col"
WEIGHT_LOAD = "cp.async.bulk.tensor.2d.shared::cta.global"
TMA_STORE = "cp.async.bulk.tensor.2d.global.shared::cta"
REGISTERS_GIVEN_BACK = (
    "setmaxnreg moves registers between warpgroups at run time. It acts on whole warpgroups, so the "
    "worker warps are padded to one (the extra warps idle). A worker warpgroup lowers its limit to "
    "24 on entering its partition, one site per partition in Triton's dispatch code")
REGISTERS_TAKEN = ("The other side of the hand-over: the MMA/epilogue warpgroup raises its limit to "
                   "256 once the workers have given theirs back, and workers raise theirs again when "
                   "they leave a partition. Each site retries until the registers are free; the count "
                   "is of sites in the program, not of executions.")
TAUGHT_PTX = {
    "sm_90": [
        (IM2COL_LOAD, "The A tile, in the loader partition's loop: one per k-step, the whole 128-pixel "
                      "x 64-channel box; the two 16-bit values at the end are the tap's offsets."),
        (WEIGHT_LOAD, "The B tile, 128 filters x 64 channels, into the same ring stage."),
        ("wgmma.mma_async", "The consumer's MMAs: m64n128k16, so a 128 x 128 tile with BLOCK_K=64 "
                            "takes 2 row blocks x 4 K steps = 8 per k-step."),
        ("setmaxnreg.dec", REGISTERS_GIVEN_BACK + ": here the one worker partition, the loader."),
        ("setmaxnreg.inc", REGISTERS_TAKEN),
        (TMA_STORE, "The epilogue's TMA store of the 128 x 128 tile from its staging buffer."),
    ],
    "sm_100": [
        (IM2COL_LOAD, "The A tile, in the loader partition's loop, as on sm_90."),
        (WEIGHT_LOAD, "The B tile, as on sm_90."),
        ("tcgen05.mma", "The MMA warp's MMAs: one thread issues 128 x 128 x 16 into tensor memory; "
                        "BLOCK_K=64 takes 4 per k-step."),
        ("tcgen05.commit", "Two: once per k-step (the stage's empty barrier: the hardware arrives when "
                           "the MMAs that read it are done) and once per tile (the accumulator is "
                           "ready for the epilogue)."),
        ("tcgen05.ld", "The epilogue reads the 128 x 128 fp32 accumulator from tensor memory into "
                       "registers."),
        ("setmaxnreg.dec", REGISTERS_GIVEN_BACK + ": here two worker partitions (loader and MMA "
                           "issuer), one site more than on sm_90."),
        ("setmaxnreg.inc", REGISTERS_TAKEN),
        (TMA_STORE, "The epilogue's TMA store, as on sm_90."),
    ],
}
EXPECTED_PTX = {arch: [prefix for prefix, _ in rows] for arch, rows in TAUGHT_PTX.items()}
PARTITION_WARPS = {
    "sm_90": "4 MMA/epilogue warps + the 1-warp loader, padded to a warpgroup",
    "sm_100": "4 epilogue warps + the 1-warp MMA issuer + the 1-warp loader, padded to a warpgroup",
}


def aot_conv2d_fprop(arch, N=2, H=16, W=16, Ci=64, Co=128, R=3, S=3, stride=1, padding=1,
                     config=FIXED_CONFIG, epilogue=Epilogue()):
    """(kernel, args, kwargs) on CPU tensors, for common.aot_compile (`epilogue` as a list too)."""
    epilogue = Epilogue(*epilogue)
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16, device_name="cpu")
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
    per_channel = torch.zeros(Co, dtype=torch.float32)
    residual = torch.zeros(geometry.N, geometry.out_h, geometry.out_w, Co, dtype=torch.bfloat16)
    launch = prepare_launch(x_nhwc, w, per_channel if epilogue.bias else None, geometry, config, arch,
                            132, per_channel if epilogue.scale else None,
                            residual if epilogue.residual else None)
    return conv2d_fprop_kernel, launch.args, kernel_constexprs(KernelConfig(*config), arch, epilogue)


def run_show_ptx():
    return common.show_ptx("05-warp-specialized-conv", "aot_conv2d_fprop", TAUGHT_PTX,
                           lambda arch, compiled: f"conv2d_fprop_kernel, config {FIXED_CONFIG}: "
                                                  f"{compiled['num_warps']} warps in all = "
                                                  f"{PARTITION_WARPS[arch]}")


@pytest.mark.parametrize("arch", list(EXPECTED_PTX))
def test_kernel_compiles_with_expected_instructions(arch):
    compiled = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch)
    counts = common.ptx_instructions(compiled["ptx"], EXPECTED_PTX[arch])
    missing = [prefix for prefix, count in counts.items() if count == 0]
    assert not missing, f"{arch}: PTX lacks {missing}"
    # The runtime's shared-memory model (it prunes configs with it) must not under-estimate.
    import conv_runtime
    assert compiled["shared"] <= conv_runtime.shared_memory_bytes(FIXED_CONFIG) + 1024


@pytest.mark.parametrize("arch, config, mma_shapes", [
    ("sm_90", KernelConfig(256, 128, 32, 5, 8, block_n_tail=32), ["m64n128k16", "m64n32k16"]),
    ("sm_90", KernelConfig(128, 128, 64, 4, 4, consumers=2, block_n_tail=32), ["m64n128k16", "m64n32k16"]),
    ("sm_100", KernelConfig(128, 128, 64, 4, 4, block_n_tail=32), []),
], ids=["sm_90", "sm_90-ping-pong", "sm_100"])
def test_tail_build_issues_a_second_mma(arch, config, mma_shapes):
    import conv_runtime
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
    assert tail["shared"] <= conv_runtime.shared_memory_bytes(config) + 1024


@pytest.mark.parametrize("config", [KernelConfig(128, 128, 64, 4, 4, block_m_tail=64),
                                    KernelConfig(128, 128, 64, 3, 4, consumers=2, block_m_tail=64)], ids=str)
def test_row_tail_build_loads_three_pixel_boxes(config):
    """A 192-row tile: three 64-pixel im2col boxes per stage (two for the main rows, one for the
    tail), one weight box shared by both MMAs, and a second MMA and store per tile."""
    import conv_runtime
    tail = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", "sm_90",
                                      config=list(config), Co=128)
    plain = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", "sm_90",
                                       config=list(config._replace(block_m_tail=0)), Co=128)
    im2col = "cp.async.bulk.tensor.4d.shared::cta.global.im2col"
    loads, stores = "cp.async.bulk.tensor.2d.shared::cta.global", "cp.async.bulk.tensor.2d.global.shared::cta"
    mma = "wgmma.mma_async"
    counts = common.ptx_instructions(tail["ptx"], [im2col, loads, stores, mma])
    plain_counts = common.ptx_instructions(plain["ptx"], [im2col, loads, stores, mma])
    assert counts[im2col] == 3 and plain_counts[im2col] == 1
    assert counts[loads] == plain_counts[loads]                 # the weights: one box per stage
    assert counts[stores] == 2 * plain_counts[stores]           # main block + tail block
    # per consumer and k-step: 2 x 4 m64n128k16 for the main 128 rows, 1 x 4 for the tail's 64
    assert counts[mma] * 2 == plain_counts[mma] * 3
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in tail["ptx"]
    assert tail["shared"] <= conv_runtime.shared_memory_bytes(config) + 1024


@pytest.mark.parametrize("epilogue", [Epilogue(), Epilogue(bias=True, scale=True, residual=True, activation="relu")],
                         ids=["plain", "fused"])
@pytest.mark.parametrize("config, blocks", [(KernelConfig(128, 128, 64, 5, 4, block_m_tail=64), 3),
                                            (KernelConfig(256, 128, 64, 4, 8), 2)], ids=str)
def test_deep_ring_build_stores_by_row_blocks(config, blocks, epilogue):
    """Where a staging buffer of the whole tile does not fit beside the ring, the tile leaves in
    blocks of half its main rows through one buffer of that height: a 192-row tile with 5 stages
    in three 64-row TMA stores (16 KB of staging instead of 48), a 256-row tile with 4 stages in
    two of 128 rows. Splitting the accumulator's rows moves no data through shared memory."""
    import conv_runtime
    shallow_config = config._replace(num_buffers=config.num_buffers - 1)
    deep = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", "sm_90",
                                      config=list(config), Co=128, epilogue=list(epilogue))
    shallow = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", "sm_90",
                                         config=list(shallow_config), Co=128, epilogue=list(epilogue))
    stores = "cp.async.bulk.tensor.2d.global.shared::cta"
    assert stores_by_row_blocks(config) and not stores_by_row_blocks(shallow_config)
    assert common.ptx_instructions(deep["ptx"], [stores])[stores] == blocks
    assert common.ptx_instructions(shallow["ptx"], [stores])[stores] == (2 if config.block_m_tail else 1)
    for generic in ("st.shared", "ld.shared"):        # no extra round trip for the split
        assert deep["ptx"].count(generic) <= shallow["ptx"].count(generic)
    ring = ring_bytes(config)
    assert ring + config.block_m // 2 * config.tile_n * 2 <= deep["shared"]
    assert deep["shared"] <= min(conv_runtime.shared_memory_bytes(config) + 1024, SHARED_MEMORY_PER_PROGRAM)
    assert ring + config.tile_m * config.tile_n * 2 > SHARED_MEMORY_PER_PROGRAM   # what it avoids


@pytest.mark.parametrize("N, H, W, R, S, stride, padding", [
    (3, 7, 7, 1, 1, 1, 0),           # ResNet-50's 7x7 stage: 192-pixel tiles span images
    (2, 9, 13, 3, 3, (2, 1), 1),     # stride 2 in H only, padding
    (4, 5, 6, 3, 5, 2, (1, 2)),      # small images: a 64-pixel box covers several of them
])
def test_row_tail_boxes_read_what_one_tall_box_would(N, H, W, R, S, stride, padding):
    """The loader's 64-pixel boxes, each started at its own pixel_box_origin (the kernel's own
    function, run here as plain Python), read exactly the pixels of one 192-pixel im2col box
    started at the tile's first pixel: checked with lesson 03's model of the TMA im2col walk, for
    every tile and tap, the last tile's rows past M included."""
    walk = common.load_lesson("03-tma-im2col-modes").im2col_walk
    geometry = common.conv_geometry((N, H, W, 8), (8, R, S, 8), stride, padding)
    settings = common.conv_im2col_settings(geometry)
    window = (settings.pixel_box_lower_corner, settings.pixel_box_upper_corner, settings.element_strides)
    shape, g = (N, H, W, 8), geometry
    for m0 in range(0, g.M, 192):
        for r in range(R):
            for s in range(S):
                offsets = settings.tap_offsets(r, s)
                tall = walk(shape, 192, *window, settings.start_coord(m0), offsets)
                boxes = []
                for box in range(3):
                    n, y, x = pixel_box_origin.fn(m0 + 64 * box, g.out_h, g.out_w, *g.stride, *g.padding)
                    boxes += walk(shape, 64, *window, (n, y, x, 0), offsets)
                assert boxes == tall, (m0, r, s)


@pytest.mark.parametrize("config, tmem_columns", [
    (FIXED_CONFIG, 256),                                        # 2 accumulators x 128 columns
    (KernelConfig(128, 128, 64, 4, 4, block_n_tail=32), 512),   # 2 x (128 + 32) = 320, allocated as 512
    (KernelConfig(128, 256, 64, 3, 4), 512),                    # 2 x 256: the whole tensor memory
    (KernelConfig(128, 64, 64, 6, 4), 128),
], ids=str)
def test_blackwell_build_synchronizes_as_reviewed(config, tmem_columns):
    """What the review of the Blackwell path (RESULTS.md) expects, checked in the sm_100 PTX."""
    Co = 320 if config.block_n_tail else config.block_n
    compiled = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", "sm_100",
                                          config=list(config), Co=Co)
    ptx = compiled["ptx"]
    counts = common.ptx_instructions(ptx, ["tcgen05.alloc", "tcgen05.commit", "tcgen05.mma",
                                           "mbarrier.init", "mbarrier.arrive.expect_tx",
                                           "mbarrier.arrive", "fence.proxy.async",
                                           "cp.async.bulk.tensor.2d.global.shared::cta"])
    # one TMEM allocation, a power of two of at least 2 * tile_n columns and at most 512
    assert counts["tcgen05.alloc"] == 1 and compiled["tmem_size"] == tmem_columns
    assert "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r" in ptx and f"], {tmem_columns};" in ptx
    # the MMA warp commits twice: once per k-step (releases the stage, after both MMAs of a tail
    # tile) and once per tile (hands the accumulator to the epilogue); no other tcgen05.commit
    assert counts["tcgen05.commit"] == 2
    # BLOCK_K=64 in k16 instructions: 4 tcgen05.mma per accumulator per k-step
    assert counts["tcgen05.mma"] == 4 * (2 if config.block_n_tail else 1)
    # barriers: ready + empty per stage, acc_ready + acc_empty per accumulator (no ping-pong turns)
    assert counts["mbarrier.init"] == 2 * config.num_buffers + 2 * 2
    # arrivals by software: the loader's expect (its arrival) and the epilogue's acc_empty arrive
    assert counts["mbarrier.arrive.expect_tx"] == 1 and counts["mbarrier.arrive"] == 2
    # each TMA store is preceded by a fence of the generic-proxy writes to its staging buffer
    stores = counts["cp.async.bulk.tensor.2d.global.shared::cta"]
    assert stores == (2 if config.block_n_tail else 1) and counts["fence.proxy.async"] == stores


@pytest.mark.parametrize("arch, config", [
    ("sm_90", FIXED_CONFIG), ("sm_90", KernelConfig(128, 128, 64, 4, 4, consumers=2, block_n_tail=32)),
    ("sm_90", KernelConfig(256, 128, 32, 5, 8, block_n_tail=32)),
    ("sm_100", KernelConfig(128, 128, 64, 4, 4, block_n_tail=32)),
], ids=["sm_90", "sm_90-ping-pong-tail", "sm_90-256-tail", "sm_100-tail"])
def test_fused_epilogue_compiles_only_what_is_asked(arch, config):
    """The plain build reads nothing with plain loads (TMA does all its reading); each epilogue
    part adds its own instructions, in every schedule: the residual's and scale's loads, the
    ReLU's max, the SiLU's exponential."""
    build = lambda *epilogue: common.aot_compile_or_skip(  # noqa: E731
        "05-warp-specialized-conv", "aot_conv2d_fprop", arch, config=list(config), Co=320,
        epilogue=list(epilogue))["ptx"]
    count = lambda ptx, what: common.ptx_instructions(ptx, [what])[what]  # noqa: E731
    plain, relu = build(), build(False, False, False, "relu")
    fused, silu = build(True, True, True, "relu"), build(False, False, False, "silu")
    assert count(plain, "ld.global") == 0 and count(plain, "max.f32") == 0
    assert count(relu, "ld.global") == 0 and count(relu, "max.f32") > 0
    assert count(fused, "ld.global") > 0 and count(fused, "max.f32") > 0
    assert count(silu, "ex2.approx") > 0 and count(plain, "ex2.approx") == 0


@pytest.mark.parametrize("arch, config", [
    ("sm_90", KernelConfig(128, 128, 64, 6, 8, split_k=3)),
    ("sm_90", KernelConfig(128, 128, 64, 5, 4, block_n_tail=32, split_k=2)),
    ("sm_100", KernelConfig(128, 128, 64, 4, 4, block_n_tail=32, split_k=2)),
], ids=["sm_90", "sm_90-tail", "sm_100-tail"])
def test_split_k_build_stores_partial_sums_instead_of_tiles(arch, config):
    """With split-K the epilogue writes a split tile's fp32 partial sums with plain stores
    (st.global.v2.f32: two adjacent accumulator columns per store), and a whole tile (before the
    last wave) with the TMA store as without split-K; the loop is the same."""
    build = lambda c: common.aot_compile_or_skip(  # noqa: E731
        "05-warp-specialized-conv", "aot_conv2d_fprop", arch, config=list(c), Co=320)["ptx"]
    split, plain = build(config), build(config._replace(split_k=1))
    tma_store = "cp.async.bulk.tensor.2d.global.shared::cta"
    counts = lambda ptx: common.ptx_instructions(ptx, [tma_store, "st.global", IM2COL_LOAD])  # noqa: E731
    assert counts(plain)[tma_store] > 0 and counts(plain)["st.global"] == 0
    assert counts(split)[tma_store] == counts(plain)[tma_store] and counts(split)["st.global"] > 0
    assert counts(split)[IM2COL_LOAD] == counts(plain)[IM2COL_LOAD]


@pytest.mark.parametrize("split_k, epilogue", [(2, Epilogue()), (3, Epilogue(True, True, True, "relu")),
                                               (4, Epilogue(True, False, False, "silu"))])
def test_split_k_epilogue_kernel_against_torch(split_k, epilogue):
    """The second kernel of split-K, on the CPU interpreter or a GPU: the slices' sum and the epilogue."""
    M, Co = 77, 100
    generator = torch.Generator().manual_seed(split_k)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(common.device())  # noqa: E731
    partial, bias, scale, residual = rand(split_k, M, Co), rand(Co), rand(Co), rand(M, Co)
    out_2d = torch.full((M, 104), float("nan"), device=partial.device)
    geometry = common.conv_geometry((1, 7, 11, 8), (Co, 1, 1, 8))
    launch = ConvLaunch(None, None, out_2d, geometry, partial, (64, 64, 2, 2, 0))    # every tile split
    finish_split_k(launch, bias if epilogue.bias else None, scale if epilogue.scale else None,
                   residual if epilogue.residual else None, epilogue.activation)
    expected = partial.sum(0) * (scale if epilogue.scale else 1) + (bias if epilogue.bias else 0) \
        + (residual if epilogue.residual else 0)
    expected = {"none": expected, "relu": expected.relu(), "silu": torch.nn.functional.silu(expected)}[
        epilogue.activation]
    torch.testing.assert_close(out_2d[:, :Co], expected, rtol=1e-5, atol=1e-5)
    assert out_2d[:, Co:].isnan().all()          # the row padding is not written


def test_unsupported_config_combinations_are_refused():
    for config, arch in [(PINGPONG_CONFIG, "sm_100"), (KernelConfig(128, 128, 64, 4, 4, consumers=3), "sm_90"),
                         (KernelConfig(128, 64, 64, 4, 4, programs_per_sm=2), "sm_100"),
                         (KernelConfig(256, 128, 64, 3, 8), "sm_100"),
                         (KernelConfig(128, 256, 64, 3, 4, block_n_tail=32), "sm_100"),
                         (KernelConfig(128, 128, 64, 4, 4, block_m_tail=64), "sm_100"),
                         (KernelConfig(128, 128, 64, 4, 4, block_n_tail=32, block_m_tail=64), "sm_90"),
                         (KernelConfig(128, 128, 64, 4, 4, block_m_tail=32), "sm_90"),
                         (KernelConfig(128, 128, 64, 5, 8, block_m_tail=64), "sm_90"),
                         (KernelConfig(128, 128, 64, 5, 4, consumers=2, block_m_tail=64), "sm_90")]:
        with pytest.raises(ValueError, match="config"):
            check_config(config, arch)


def test_pingpong_build_has_two_consumer_warpgroups():
    import conv_runtime
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
    assert compiled["shared"] <= conv_runtime.shared_memory_bytes(PINGPONG_CONFIG) + 1024


# %%
# What compute-sanitizer says
# ---------------------------
# Random shapes cannot show that a warp-specialized kernel has no race; the CUDA toolkit's
# compute-sanitizer checks a run as it happens. `python scripts/sanitize.py` runs its four tools
# (memcheck, racecheck, synccheck, initcheck) over lessons 04 and 05 on small shapes, for every
# Hopper candidate config, on two programs so that every program walks several tiles. Measured on
# an H100 (2026-11-22): synccheck reports nothing. The other three report things that are not
# bugs of this kernel, and each is worth knowing if you write your own:
# - racecheck reports a read-after-write "hazard" in every lesson 05 config, between two
#   instructions that are not ours: `gl.warp_specialize` starts its worker warps by having the
#   default warpgroup write each worker warp's partition number into a word of shared memory, then
#   meeting all warps at a block-wide named barrier (`barrier.sync 1`); the workers read their
#   byte after that barrier, and at the end the default warpgroup writes "exit" the same way. The
#   barrier orders every write before every read (PTX ISA, barrier: memory accesses requested by
#   the participating threads before the barrier are performed relative to all of them). The
#   report appears once the default warpgroup also syncs its own 128 threads with
#   `bar.sync 0, 128`, as ours does around its mbarrier arrives: scripts/racecheck_probe.cu
#   models the protocol in 60 lines of CUDA, and racecheck calls it clean without that line and
#   "hazardous" with it. A Gluon kernel that only warp-specializes is clean too. So the report is
#   the tool losing track of barrier 1, and the script lists it as explained only where both
#   accesses are that dispatch code (identified in the SASS), never elsewhere.
# - memcheck reports one CUDA API error per process: Triton's loader first asks the driver for
#   "oversized" shared memory, is refused (CUDA_ERROR_INVALID_VALUE from cuFuncSetAttribute), and
#   falls back to the classic attribute. Lesson 04's kernel needs less than 48 KB and never asks.
# - initcheck reports the whole output as uninitialized when it is copied to the host: the kernel
#   writes it with TMA stores, which initcheck does not count as writes. Every element was
#   compared with torch's result first, so it was written.
# Racecheck is also blind to what matters most here: TMA and the tensor cores read and write
# shared memory through the async proxy, which it does not track. The ordering between those
# accesses and ours (fence_async_shared before a TMA store, waits on ready/empty barriers before
# an MMA or a refill) is the review's job, and the tests' (RESULTS.md, "Sanitizers").



# %%
# The runtime: the same kernel, cheaper to call
# ---------------------------------------------
# `conv2d_fprop_launch` builds everything on every call, and the host time adds up: on an H100
# host a call of it costs several times the 30-60 us a ResNet-50 layer runs on the GPU.
# conv_runtime.py (read its docstring) keeps what depends only on the shape in a plan, reuses
# validated descriptors, launches the compiled kernel directly, and picks a config per shape with
# a small autotuner pruned to what fits the device. The lesson's two entry points go through it:
# `conv2d_fprop_fixed` with one given config, `conv2d_fprop` autotuned. `measure_runtime` prints
# what the runtime saves on this machine. To use the kernel in a PyTorch model (NCHW tensors in
# channels_last memory, nn.Conv2d, torch.compile, CUDA graphs), see conv_torch.py and
# scripts/resnet50.py.


def conv2d_fprop_fixed(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=FIXED_CONFIG,
                       **epilogue):
    """The warp-specialized conv with one given config, through the runtime (no autotuning);
    `epilogue`: scale, residual, activation as for conv2d_fprop_launch."""
    import conv_runtime   # it wraps this lesson's kernel, so it is imported on first use
    return conv_runtime.conv2d(x_nhwc, w, bias, stride, padding, dilation, config=tuple(config), **epilogue)


def conv2d_fprop(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, **epilogue):
    """Autotuned warp-specialized convolution. x_nhwc [N, H, W, Ci], w [Co, R, S, Ci] (fp16/bf16,
    CUDA, contiguous), optional bias [Co] and the rest of the epilogue (scale, residual,
    activation, as for conv2d_fprop_launch); returns NHWC in x's dtype.

    The first call for a shape times the pruned configs on the real tensors, with the call's
    epilogue, and remembers the fastest, in this process and in the runtime's tuning file
    (conv_runtime.tuning_cache_path()), so later processes skip the timing. The key is the whole
    geometry (N, H, W, Ci, Co, R, S, stride, padding, dilation), the dtype, the epilogue
    (conv_runtime.epilogue_tag: a residual changes which config is fastest), the GPU model and the
    Triton version."""
    import conv_runtime
    return conv_runtime.conv2d(x_nhwc, w, bias, stride, padding, dilation, config=None, **epilogue)


def measure_runtime(x_nhwc, w, stride, padding, config):
    """Host us per call: the plain launcher vs the runtime, and Triton's launcher vs a direct call."""
    import conv_runtime
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
    plan = conv_runtime.plan_for(geometry, x_nhwc.dtype, config)
    launches = conv_runtime.compare_launch_paths(plan, x_nhwc, w)
    return {
        "plain_launcher_us": conv_runtime.host_us_per_call(
            lambda: conv2d_fprop_launch(x_nhwc, w, None, stride, padding, config=config), calls=50),
        "runtime_us": conv_runtime.host_us_per_call(
            lambda: conv2d_fprop_fixed(x_nhwc, w, None, stride, padding, config=config)),
        "generic_launch_us": launches["generic"], "compiled_launch_us": launches["compiled"],
        "direct_launch_us": launches["direct"],
    }


def run_runtime_demo():
    x_nhwc, w = common.random_conv_inputs(32, 28, 28, 128, 128, 3, 3, torch.bfloat16)
    run_conv(conv2d_fprop, 8, 28, 28, 128, 128, 3, 3, 1, 1, with_bias=True)
    us = measure_runtime(x_nhwc, w, 1, 1, FIXED_CONFIG)
    print(f"\nhost time per call on this machine (N=32, 28x28, 128->128, 3x3): plain launcher "
          f"{us['plain_launcher_us']:.0f} us, runtime {us['runtime_us']:.0f} us; of which the launch: "
          f"Triton's launcher {us['generic_launch_us']:.0f} us, the compiled kernel called directly "
          f"{us['compiled_launch_us']:.0f} us, the runtime's DirectLaunch {us['direct_launch_us']:.0f} us")


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding", [
    (32, 28, 28, 128, 128, 3, 3, 1, 1),
    (32, 56, 56, 256, 64, 1, 1, 1, 0),
    (8, 16, 16, 320, 320, 3, 3, 2, 1),
])
def test_autotuned_entry_point(N, H, W, Ci, Co, R, S, stride, padding):
    run_conv(conv2d_fprop, N, H, W, Ci, Co, R, S, stride, padding, with_bias=True)


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias", AWKWARD_CASES)
def test_runtime_matches_on_awkward_cases(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias):
    run_conv(conv2d_fprop_fixed, N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias)


# %%
# What paid, and what did not
# ---------------------------
# Measured on an H100 (2026-11-22 and 23) with the network suite (network_suite.py: every conv of
# ResNet-50 at batch 128 and the 3x3 convs of the SD UNet at batch 8, each autotuned, ours and
# cuDNN in alternating rounds of one run; RESULTS.md has the table). So you need not try them first:
#
# - Paid: folding the filter's columns into the channels for small Ci (conv_runtime.FoldedConv).
#   ResNet-50's stem (Ci=3, 7x7, stride 2) went from 0.62x cuDNN to 1.28x: 7 k-steps of 24 real
#   channels instead of 49 of 3. Done by three torch copies, the fold took more than half of the
#   layer's 0.71 ms; as one Triton kernel (fold_columns_kernel) the stem runs at 1.75x cuDNN.
# - Paid: split-K (section 6) where tiles are fewer than SMs: the SD UNet's 8x8 layer (40 tiles)
#   from 320 to 411 TFLOPS with 3 slices (cuDNN: 372), its 16x16 stride-2 layer from 315 to 401.
#   Autotuning decides per layer; 4 slices never won.
# - Paid: the fused epilogue (section 7): in a whole ResNet-50 the convs with BatchNorm folded
#   and residual + ReLU fused take 4.28 ms per batch of 128 (kernels alone), cuDNN's convs alone
#   3.59 ms; the compiled cuDNN model spends another 2.47 ms per forward outside its convs,
#   mostly in Inductor's BatchNorm/add/ReLU kernels, which the fused model does not run.
# - Did not pay: split-K by serial fix-up within the kernel (two units per tile, the first
#   publishing an fp32 partial sum for the second to add, release/acquire on a per-tile
#   counter): on ResNet's 7x7 3x3 layer 481-501 TFLOPS against 557 for plain 128x256 tiles; the
#   round trip through L2 sat on the critical path. (Repository history, commit 627d1da.)
# - Did not pay: K steps of 32 instead of 64 with deeper rings (6 stages): 672 against 759 TFLOPS
#   on the headline shape; twice the barrier traffic per FLOP. Only the 160-wide tile, whose
#   64-deep stages would not fit, keeps BLOCK_K=32.
# - Did not pay: ping-pong on its own (section 4): no faster than one consumer with the same tile.
# - Paid: calling the compiled kernel through the CUDA launch itself (conv_runtime.DirectLaunch:
#   arguments pre-expanded, pointers as addresses, each TMA tensor map encoded once per address).
#   A call through the runtime went from a median of 71 to 33 us of host time (cuDNN's: ~20-30),
#   and the suite from 1.007x to 1.055x cuDNN end to end: layers of 30-100 us that were ahead as
#   kernels had been losing to the host (SD UNet's 32x32 stride-2 layer 0.71x -> 1.14x). Only
#   memoizing the tensor maps, inside Triton's launcher, did not pay (24 us per launch against
#   18.5 without): the driver's encoding is a small part of a descriptor's cost, the Python around
#   it the rest. scripts/host_time.py shows the pieces.
# - Paid: a tail where it fills SMs, not only where it saves columns. Co = 1280 on a 16x16 map is
#   160 tiles of 128x128 for 132 SMs (1.2 waves) or 128 of 128x160 (one wave): the SD UNet's 16x16
#   layers went from 0.74-0.87x cuDNN to 1.02-1.18x (kernels alone).
# - Did not pay (for the layer it was for): splitting only the last wave's tiles (section 6).
#   ResNet-50's 7x7 2048->512 layer has 196 tiles of 128x128 for 132 SMs; splitting the 64 of the
#   second wave in two took split-K from 315 to 374 TFLOPS there, but whole tiles run at 409 and
#   cuDNN at ~505: on a 30 us layer the workspace and the second launch cost what the half-empty
#   wave does. (Row tails, below, fill that wave without a workspace: 0.78x -> 0.86x.)
# - Paid: row tails, 192-pixel tiles (section 5). Not for the reason they were built: ResNet-50's
#   7x7 2048->512 layer fits one wave of 132 tiles with them, but it stays behind cuDNN (0.86x,
#   from 0.78x): one wave of 192-row tiles ran only 8% faster than two of 128x128 (445 against
#   411 TFLOPS), where the idle half-wave predicts 30%; the layer waited on HBM (the next item
#   is what reached it). Where
#   they paid is the layers between memory and compute: per k-step a 192 x 128 tile reads 320
#   rows for 24576 products, a 128 x 128 one 256 rows for 16384, so a fifth fewer bytes per FLOP
#   through L2 and shared memory, on one 4-warp consumer. ResNet-50's 7x7 512->512 3x3 went from
#   0.97x to 1.18x cuDNN, the 14x14 512->512 stride-2 layer from 1.01x to 1.18x, the 14x14
#   256->256 3x3 from 0.95x to 1.02x; ResNet-50 as a whole from 1.006x to 1.032x.
# - Paid: a fifth stage for row tails, by storing the tile in 64-row blocks through one 16 KB
#   staging buffer (section 5). Nsight Compute on ResNet-50's 7x7 2048->512 1x1 layer, run the
#   way do_bench runs it (right after a 256 MB memset): ours and cuDNN's kernel (cuBLAS's nvjet,
#   the same 192 x 128 tiles, 132 of them, in 2-CTA clusters by its name) read the same 27.8 MB and
#   write the same ~21 MB of evicted lines to HBM, but cuDNN's took 27.3 us against our 29.9 (warm: 24.8
#   against 25.3). The gap was hiding HBM latency, not bytes: the row tail measured 381, 435 and
#   471 TFLOPS with 3, 4 and 5 stages. ResNet-50's 7x7 2048->512 went from 0.86x to 0.93x cuDNN,
#   14x14 1024->512 from 0.89x to 0.92x, 14x14 512->512 stride 2 from 1.17x to 1.24x (suite
#   runs before and after). It costs where K is short (a third store per tile on 4 k-steps:
#   14x14 256->1024 403 -> 372 TFLOPS), so it is one more candidate, chosen on 7 of ResNet-50's
#   23 layers.
# - Did not pay, on the headline: the same store for 256x128 tiles (two 128-row blocks), which
#   makes room for a 4th stage: 693 against 730 TFLOPS with 3. It won on layers where other
#   tiles win by more, so it is a config, not a candidate. Nor does it help ResNet-50's 14x14
#   1024->512 1x1, where cuDNN runs that very tile: 551 TFLOPS, as the row tail, against cuDNN's
#   608. cuDNN runs it in pairs of CTAs that load their shared tile once (below).
# - Out of reach of any schedule: much more on the headline shape. Both kernels hold the H100
#   at its 700 W limit there, and the driver lowers the SM clock from 1980 to ~1440 MHz to stay
#   under it (scripts/clocks_under_load.py samples nvidia-smi while each kernel runs). The dense
#   bf16 peak is 132 SMs x 4096 FLOPs per cycle x the clock: ~779 TFLOPS at 1440 MHz. Ours ran
#   688 (88% of it), cuDNN 690 (89%). A kernel that did more per cycle would draw more power and
#   lower the clock. A memory-bound layer such as 14x14 1024->512 1x1 runs below the limit, at
#   the full 1980 MHz.
# - Did not pay: 128-channel K steps (BLOCK_K=128, half the barrier round trips per FLOP). The
#   deeper stages leave room for 3 (2 with a row tail), and every layer tried lost: 592 against
#   693 TFLOPS on the headline shape, 361 against 443 on ResNet-50's 7x7 2048->512.
# - Not adopted: TMA L2 promotion of 256 bytes instead of Triton's fixed 128 (a miss then also
#   brings the next k-step's 64 channels). scripts/l2_promotion_probe.py re-encodes the tensor
#   maps through the driver: +3% on the 4-stage row tail of 7x7 2048->512, -7% on 128x256 tiles
#   of 14x14 1024->512, within 1-2% elsewhere. Mixed, and Triton has no option for it.
# - Not built: thread-block clusters with TMA multicast, which would load a tile shared by two
#   SMs once. Gluon 3.8 compiles a 2-CTA cluster and multicasts a tiled load (the weights), but
#   not an im2col load (the pixels): it emits the CTA mask before the im2col offsets and ptxas
#   rejects the instruction. A barrier across the pair is reachable from both CTAs, but only the
#   leader waits on it, and an im2col box split over the pair gets the wrong pixels for its second
#   half; so each CTA's own pixels could be loaded only as a matrix, in 1x1 layers
#   (scripts/cluster_probe.py shows all four). Such a kernel for 1x1 layers, pairs of row tiles
#   sharing their weight tile (a quarter fewer bytes through L2), matched torch and ran no faster
#   than the same tile without a cluster on any of six layers (RESULTS.md, commit ddc363e).
#   Pairs of column tiles sharing their pixels, as cuDNN's kernels do, took ResNet-50's 14x14
#   1024->256 from 375 to 403 TFLOPS (cuDNN: 406), and no other of the six layers; a probe, not
#   a second, cluster form of this kernel (commit 39deca2).
# - Did not pay: the loader prefetching each tile's whole input into L2 before its first load
#   (32 bulk prefetches, one contiguous range of NHWC rows): slower on all ten layers tried, 5-30%;
#   asked for at once, a tile's input crowds out the loads the MMAs wait on. (Commit 5788410.)
#   Nor did prefetching line by line a few k-steps ahead (one line per pixel, 4 or 8 k-steps
#   before its TMA load, so that L2 holds more stages than shared memory): 0-22% slower on seven
#   layers; the loader warp's extra work delays the loads the MMAs wait on. (Commit 9c55641.)
# - Did not pay: reading a 1x1 layer's pixels with plain tiled TMA loads. A 1x1 conv of stride 1
#   without padding has the input itself, viewed as [N*H*W, Ci], for its im2col matrix; if im2col
#   loads were the slower TMA path, this is where ResNet-50's 1x1 layers would lose to cuBLAS's
#   GEMMs. Tiled against im2col loads, same configs, eight 1x1 layers: within noise on every one
#   (e.g. 14x14 1024->512 552 against 551 TFLOPS). The TMA mode is not what those layers lack; a
#   cold L2 is (kernels alone, with the L2 warm, the suite is at 1.10x cuDNN; end to end 1.07x).
#   (Repository history, commit 41ac7a4.)
# - Paid, for networks: tuning each layer with its epilogue (conv_runtime.epilogue_tag). A
#   residual tile adds loads and registers, and changes which config is fastest: in the fused
#   ResNet-50, 28x28 128->512 + residual went from 0.147 to 0.095 ms with its own choice, and the
#   forward with CUDA graphs from 1.52x to 1.59x torch.compile on cuDNN.
# - Paid: split-K's second launch from the plan (its grid and scalars fixed per shape, only the
#   pointers per call): a split-K call's host time went from 75-80 to 33-38 us, and the SD UNet's
#   8x8 and 16x16 stride-2 layers, 30-40 us on the GPU, stopped losing to their own host time
#   (0.92x -> 1.08x and 1.04x -> 1.26x in runs a few minutes apart).
# - Paid, for PyTorch users: defining the operator (conv_torch.py) with torch.library's
#   define/impl instead of the @custom_op decorator, whose checks on every call cost more host
#   time than the runtime's whole call. A fused ResNet-50 at batch 128 in eager mode went from
#   13108 to 28757 images/s, 1.42x torch.compile on cuDNN (RESULTS.md; eager numbers follow the
#   host: the final code measured 1.30x on a fast host and 0.79x on a slow one, 1.53x with CUDA
#   graphs on both).
#
# %%
# The measured ladder (GPU): the series next to cuDNN
# ----------------------------------------------------
# One run measures, per shape, lesson 02's implicit GEMM, lesson 04, this lesson (autotuned,
# through the runtime) and cuDNN, all in bf16, all timed by common.bench_tflops (do_bench: median,
# L2 flushed, launch overhead included). Lesson 05 and cuDNN are timed in alternating rounds.

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


def run_bench(outdir, quick=False, dtype=torch.bfloat16):
    import conv_runtime
    lesson02 = common.load_lesson("02-im2col-explicit")
    lesson04 = common.load_lesson("04-implicit-gemm-single-buffer")
    shapes = BENCH_SHAPES[:3] if quick else BENCH_SHAPES
    rows = []
    for label, N, H, W, Ci, Co, R, S, stride, padding in shapes:
        x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, dtype)
        geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
        print(f"\n{label}: {geometry.describe()}; autotuning lesson 05:")
        config = conv_runtime.tuned_config(geometry, x_nhwc, w, None, verbose=True, retune=True)
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
        row = {"shape": label, "geometry": geometry.describe(), "flops": geometry.flops, "config_05": config}
        for name in ("02 implicit GEMM", "04 single-buffer"):
            row[name] = common.bench_tflops(runs[name], geometry.flops)
        # Lesson 05 and cuDNN alternate, BENCH_ROUNDS times each, and the medians are reported:
        # clocks and cuDNN's own timings drift by several percent within minutes, and alternating
        # exposes both to the same drift. Every round is kept in the JSON.
        row.update(common.bench_in_rounds({name: runs[name] for name in ("05 warp-specialized", "cuDNN")},
                                          geometry.flops, BENCH_ROUNDS))
        # Kernel time alone, launch overhead removed (CUDA graph replay), for 05 and cuDNN.
        for name in ("05 warp-specialized", "cuDNN"):
            row[name + " graph"] = common.bench_tflops(runs[name], geometry.flops, cuda_graph=True)
        row["ratio_05_cudnn"] = row["05 warp-specialized"]["tflops"] / row["cuDNN"]["tflops"]
        row["host_us_05"] = conv_runtime.host_us_per_call(lambda: conv2d_fprop(x_nhwc, w, None, stride, padding))
        if not rows:
            row["runtime_us"] = measure_runtime(x_nhwc, w, stride, padding, config)
            print("   host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in row["runtime_us"].items()))
        rows.append(row)
        del x_nhwc, w, expected
        torch.cuda.empty_cache()
    info = common.versions()
    print(f"\nTFLOPS, {str(dtype)[6:]}, {info['device']}, torch {info['torch']}, triton {info['triton']}, "
          f"cuDNN {info.get('cudnn')}")
    names = BENCH_SERIES
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


def show_recorded_bench(outdir):
    """Without a GPU: the latest recorded benchmark, printed and drawn, marked as recorded."""
    recorded = common.announce_recorded("05_tflops_per_shape", "The ladder")
    if recorded is None:
        return None
    data, info = recorded
    print(f"  {'shape':<30}{'02':>7}{'04':>7}{'05':>7}{'cuDNN':>7}  05/cuDNN  05 config")
    for row in data["rows"]:
        print(f"  {row['shape']:<30}" + "".join(f"{row[n]['tflops']:7.1f}" for n in BENCH_SERIES)
              + f"  {row['ratio_05_cudnn']:7.2f}x  {KernelConfig(*row['config_05'])}")
    print(f"  geometric mean of 05/cuDNN over the 3x3 shapes: {data['geomean_3x3_ratio']:.3f}x")
    plot_bench(data["rows"], info, data["dtype"], outdir, None, recorded=info)
    return data


BENCH_SERIES = ["02 implicit GEMM", "04 single-buffer", "05 warp-specialized", "cuDNN"]


def plot_bench(rows, info, dtype, outdir, data, recorded=None):
    """The per-shape bars and the ladder of the headline shape. `recorded` (the info of
    common.recorded_results) marks plots drawn from a recorded run: titled so, saved as *_recorded."""
    colors = ["#999999", "#d08040", "#2060c0", "#40a040"]
    mark = f"RECORDED {recorded['date']} (not measured on this machine): " if recorded else ""
    suffix = "_recorded" if recorded else ""
    dtype = str(dtype).replace("torch.", "")
    fig, ax = common.new_figure(figsize=(12, 5))
    width = 0.2
    for i, name in enumerate(BENCH_SERIES):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ax.bar(xs, [r[name]["tflops"] for r in rows], width, label=name, color=colors[i])
    peak = dense_peak(info["device"])
    if peak:
        ax.axhline(peak, color="red", ls="--", lw=1, label=f"dense bf16 peak ({peak:.0f}, datasheet)")
    ax.set_xticks(range(len(rows)), [r["shape"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_xlabel("layer (batch 128; SD UNet at batch 8)")
    ax.set_ylabel("TFLOPS (higher is better)")
    ax.set_title(f"{mark}Convolution throughput per shape, {dtype}, {info['device']}\n"
                 f"Triton {info['triton']}, torch {info['torch']}, cuDNN {info.get('cudnn')}")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    common.save_figure(fig, outdir, "05_tflops_per_shape" + suffix, data)

    headline = rows[0]
    fig, ax = common.new_figure(figsize=(7, 4.5))
    values = [headline[n]["tflops"] for n in BENCH_SERIES]
    bars = ax.bar(["lesson 02\nimplicit GEMM", "lesson 04\nTMA + MMA", "lesson 05\nwarp-specialized",
                   "cuDNN"], values, color=colors)
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom")
    if peak:
        ax.axhline(peak, color="red", ls="--", lw=1, label=f"dense bf16 peak ({peak:.0f})")
        ax.legend(fontsize=8)
    ax.set_ylabel("TFLOPS (higher is better)")
    ax.set_title(f"{mark}\nThe ladder of the series on {headline['geometry']}\n{dtype}, {info['device']}"
                 if recorded else f"The ladder of the series on {headline['geometry']}\n{dtype}, {info['device']}",
                 fontsize=9)
    common.save_figure(fig, outdir, "05_ladder" + suffix)


# %%
if __name__ == "__main__":
    args = common.lesson_args("Lesson 05: warp-specialized persistent conv", suites=["shapes", "networks"])
    outdir = common.output_dir(args.outdir)
    run_show_ptx()
    import network_suite   # every distinct layer of ResNet-50 and the SD UNet (network_suite.py)
    if common.has_tma_mma_gpu():
        run_conv(conv2d_fprop_launch, 4, 32, 32, 384, 384, 3, 3, 1, 1)
        print(f"\nconv2d_fprop_launch matches torch.nn.functional.conv2d on {common.gpu_name()}")
        run_runtime_demo()
        if args.bench and args.suite == "networks":
            network_suite.run_network_suite(outdir, quick=args.quick, tune=not args.heuristic)
        elif args.bench:
            run_bench(outdir, quick=args.quick)
        print("lesson 05: all checks passed")
    else:
        show_recorded_bench(outdir)
        network_suite.show_recorded_suite(outdir)
        print("\n" + common.cpu_closing_line(
            "05", "input validation, config rules, and the sm_90 and sm_100 builds of the kernel "
            "(the instructions above)", "running the kernel and the runtime, comparing them with "
            "torch, the benchmark, the sanitizers (scripts/sanitize.py)"))
