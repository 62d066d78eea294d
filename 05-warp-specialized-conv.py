"""
Lesson 05: a persistent, pipelined, warp-specialized convolution for Hopper and Blackwell
=========================================================================================

What you will learn:

- how a ring of shared-memory stages with ready/empty mbarriers lets TMA loads run ahead of the MMAs;
- warp specialization: a one-warp loader, then MMA issue and the epilogue where each architecture
  wants them (Hopper and Blackwell differ);
- a persistent grid walking tiles in an L2-friendly order, with one tile's epilogue overlapped with
  the next tile's main loop, and a fused epilogue act(conv * scale + bias + residual);
- (Part II) what real layers add, in the operator's copy of this kernel: tiles that are not a power
  of two, split-K, the small-Ci fold of a stem, fp8 operands and grouped convs.

Builds on: lessons 03 (the im2col descriptor) and 04 (TMA im2col + one MMA per k-step, `HopperWGMMA`).
What changed since lesson 04: the same inner step, fed by a pipeline from its own warp, persistent.

Requires: sm_90 (H100/H200) or sm_100 (B200/GB200) for GPU runs; on a CPU, ahead-of-time builds for
both whose PTX is checked. The Blackwell path is compiled, never run; the numbers come from an H100.

Run:  python 05-warp-specialized-conv.py [--outdir out]   (benchmarks: benchmarks/network_suite.py --ladder)
Tests: pytest 05-warp-specialized-conv.py tests/lessons/test_05_*.py
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
# Host facts this lesson uses and does not teach, from the operator's copy of this kernel (one home each)
from conv_tutorial.kernels.fprop import (FIXED_CONFIG, Epilogue, KernelConfig, block_k_channels, channel_blocks,
                                         check_config, check_groups_fit, stores_by_row_blocks, tile_counts, tile_grid)

lesson04 = common.load_lesson("04-implicit-gemm-single-buffer")   # its MMA step, HopperWGMMA

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)    # e4m3: section 9
# A run-time integer in an aggregate: a tensor, or a constexpr where Triton specialized it (a value of 1).
Int = gl.tensor | gl.constexpr

# %%
# Each `if __name__ == "__main__"` cell runs the demo of the section above (importing runs nothing).
if __name__ == "__main__":
    args = common.lesson_args("Lesson 05: warp-specialized persistent conv")
    outdir, on_gpu = common.output_dir(args.outdir), common.has_tma_mma_gpu()

# %%
# What is wrong with lesson 04
# ----------------------------
# Lesson 04's loop waits for the MMA, loads A and B, waits for the load, issues the MMA: either the
# TMA unit or the tensor cores work, never both. Lesson 04 closed on that: in one run on an H100
# 80GB HBM3 (2026-11-24, results/h100-2026-11-24/05_tflops_per_shape.json) the headline shape
# (N=128, 64x64, 384->384, 3x3, bf16) ran at 478 TFLOPS against cuDNN's 675. Part I overlaps the two:
#
# 1. a ring of shared-memory stages, so that loads run ahead of the MMAs;
# 2. warp specialization: a loader warp, and MMA + epilogue warps mapped per architecture;
# 3. a persistent grid walking the tiles in a grouped order;
# 4. the epilogue of one tile overlapped with the main loop of the next;
# 5. a fused epilogue: scale, bias, residual and activation on the tile before it is stored.
#
# Part II (6-10) tours what real layers add, in the operator's copy; section 10's few lines are
# here, tagged `# §10`. The state travels in aggregates (`@gluon.aggregate`: Gluon's structs, with jit
# methods), so each partition takes the ring, the schedule and its output, and reads like pseudocode.

# %%
# 1. A ring of stages, and the loader that fills it
# -------------------------------------------------
# NUM_BUFFERS shared-memory stages, each holding one A tile (BLOCK_M pixels x BLOCK_K channels,
# the im2col box) and one B tile (BLOCK_N filters x BLOCK_K). Stage i has two mbarriers:
#
# - ready[i]: its loads have landed (`mbarrier.expect` announces the bytes, TMA arrives with them);
# - empty[i]: the MMA that read it is done (the consumer arrives).
#
# The loads of step k + NUM_BUFFERS - 1 are in flight while step k multiplies. Each side counts the
# k-steps it has passed, across all tiles (`common.Counter`): the count gives the slot
# (count % NUM_BUFFERS) and the phase ((count // NUM_BUFFERS) & 1) to wait for. A fresh barrier
# counts as "phase 1 complete", so the producer waits for the opposite phase and its first pass
# over the ring finds every stage empty::
#
#     loader (1 warp)                                consumer
#     for each tile, for k in its k-steps:           for each tile, for k in its k-steps:
#         wait empty[slot] (phase ^ 1)                   wait ready[slot] (phase)
#         expect ready[slot] (A + B bytes)               acc += A[slot] @ B[slot]^T
#         A[slot] = im2col_load(x, pixel, tap, c0)       arrive empty[slot] once the MMA is done
#         B[slot] = load(w2d, [co0, tap*Ci + c0])    after its last k-step: store the tile (section 2)


@gluon.aggregate
class Ring:
    a_bufs: gl.shared_memory_descriptor       # [NUM_BUFFERS, BLOCK_M, BLOCK_K] pixels
    b_bufs: gl.shared_memory_descriptor       # [NUM_BUFFERS, BLOCK_N, BLOCK_K] filters
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    NUM_BUFFERS: gl.constexpr

    @gluon.jit
    def b(self, slot):
        # B of a stage for the MMA, [BLOCK_K, BLOCK_N]: the filters' rows seen transposed (K-major)
        return self.b_bufs.index(slot).permute((1, 0))


# %%
# `Im2colWindow` tells the loader where the im2col box of output pixels m, m+1, ... starts (its
# tap-0 corner, lesson 03), and which tap (r, s) and channels c0 k-step k loads. The K loop runs
# taps outer and channel blocks inner, so the weights of step k start at column tap * Ci + c0 of w2d.


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
    Ci_group: Int          # channels per tap of a weight row: Ci (§10: Ci / groups)
    Co_group: Int          # §10: output channels per group (Co when groups = 1)
    S: Int
    channel_blocks: Int

    @gluon.jit
    def pixel_box_origin(self, m):
        # (n, y, x) in the input where the im2col box of output pixels m, m+1, ... starts (tap 0)
        n = m // (self.out_h * self.out_w)
        oy = (m // self.out_w) % self.out_h
        ox = m % self.out_w
        return n, oy * self.stride_h - self.pad_h, ox * self.stride_w - self.pad_w

    @gluon.jit                                          # §10
    def group_channel(self, co0):                       # §10: the first input channel of co0's group
        return co0 // self.Co_group * self.Ci_group      # §10

    @gluon.jit
    def tile_taps(self, co0):
        # Output channels co0, co0+1, ...: their group's first channel (§10; else 0), their rows of w2d.
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
def loader_partition(in_desc, w_desc, ring, schedule, window):
    # One warp: for every (tile, k-step) of this program (in `schedule`'s order, section 3), wait for a free stage and fill it.
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    stage_bytes: gl.constexpr = in_desc.block_type.nbytes + w_desc.block_type.nbytes    # what lands per stage
    state = common.Counter(gl.to_tensor(0), ring.NUM_BUFFERS)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        # where the tile's im2col box starts, once per tile (integer divisions are slow in one warp)
        n, start_h, start_w = window.pixel_box_origin(work.pid_m * schedule.TILE_M)
        tile_taps = window.tile_taps(work.pid_n * schedule.TILE_N)
        for k in range(work.k_begin, work.k_end):
            tap_offsets, c0, w_at = window.k_step(k, BLOCK_K, tile_taps)
            slot = state.slot()
            # wait until the MMA that last read this stage is done (first pass: returns at once)
            mbarrier.wait(ring.empty.index(slot), state.phase() ^ 1)
            ready = ring.ready.index(slot)      # the stage's ready barrier: its loads arrive on it
            mbarrier.expect(ready, stage_bytes)
            # A = im2col_load(x, [n, oy*sh-ph, ox*sw-pw, c0], offsets=[r*dh, s*dw])
            tma.async_load_im2col(in_desc, [n, start_h, start_w, c0], tap_offsets, ready, ring.a_bufs.index(slot))
            # B = load(w2d, [co0, (r*S + s)*Ci + c0])
            tma.async_load(w_desc, w_at, ready, ring.b_bufs.index(slot))
            state = state.next()


# %%
# 2. Warp specialization: who issues what, per architecture
# ---------------------------------------------------------
# Issuing TMA takes one thread; from the MMA warps it would steal their issue slots. `gl.warp_specialize`
# runs separate functions in separate warps of one program, split as each architecture wants:
#
# - Hopper: WGMMA is issued by whole warpgroups (4 warps), its accumulator lives in their
#   registers, and its completion cannot arrive on an mbarrier. So MMA issue and epilogue are one
#   partition (a "consumer", 4 or 8 warps) that waits with `warpgroup_mma_wait` for the previous
#   step's MMA and then arrives on that stage's empty barrier itself. The loader is a 1-warp worker
#   whose register limit is cut to 24 (`setmaxnreg`): room for ping-pong's two consumers (section 4).
# - Blackwell: as CUTLASS, a 1-warp loader; a 1-warp MMA issuer (`tcgen05_commit(empty[slot])`
#   has the hardware release the stage when the MMAs finish); the epilogue (4 warps, the default
#   partition), which reads the accumulator from tensor memory.
#
# Both end a tile in `TileOutput.store`: the fused epilogue (section 5), a cast, and an asynchronous
# TMA store from a staging buffer that drains while the next tile computes; before the buffer is
# written again, `store_wait` waits until that store has read it (stores finish in order).


@gluon.aggregate
class TileOutput:
    # Where a tile goes: the output's TMA descriptor and staging buffer, the epilogue's operands and switches.
    out_desc: tma.tensor_descriptor
    c_smem: gl.shared_memory_descriptor        # one staging buffer per consumer
    bias_ptr: gl.tensor
    scale_ptr: gl.tensor
    residual_ptr: gl.tensor
    M: Int
    Co: Int
    EPILOGUE: gl.tuple                 # which parts of the epilogue to apply (an `Epilogue`, constexprs)

    @gluon.jit
    def for_consumer(self, i: gl.constexpr):
        # This output with consumer number i's own staging buffer (i: 0, or 1 in ping-pong).
        return gl.aggregate_replace(self, c_smem=self.c_smem.index(i))

    @gluon.jit
    def store(self, acc, m0, co0):
        # y = act(acc * scale[co] + bias[co] + residual[m, co]) in fp32, each part if its switch asks for it;
        # cast, and an asynchronous TMA store of the tile at (m0, co0).
        rows = m0 + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
        cols = co0 + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
        residual = 0.0
        if self.EPILOGUE.residual:
            # the residual tile, read in the accumulator's layout: no shuffle through shared memory
            offsets = gl.expand_dims(rows.to(gl.int64) * self.Co, 1) + gl.expand_dims(cols, 0)
            inside = gl.expand_dims(rows < self.M, 1) & gl.expand_dims(cols < self.Co, 0)
            residual = gl.load(self.residual_ptr + offsets, mask=inside, other=0.0)
        y = apply_epilogue(acc, cols, self.Co, self.scale_ptr, self.bias_ptr, residual, self.EPILOGUE)
        tma.store_wait(pendings=0)      # the previous store from c_smem has read it
        self.c_smem.store(y.to(self.out_desc.dtype))
        fence_async_shared()
        tma.async_store(self.out_desc, [m0, co0], self.c_smem)


# %%
# The Hopper consumer: wait for a stage, issue its MMA, wait until only this MMA is in flight, release
# the previous stage; after the last k-step, release the last one and store. (`turn`: section 4.)


@gluon.jit
def hopper_mma_epilogue_partition(ring, schedule, output, turn, CONSUMER: gl.constexpr,
                                  NUM_CONSUMERS: gl.constexpr):
    BLOCK_M: gl.constexpr = output.out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = output.out_desc.block_type.shape[1]
    state = common.Counter(CONSUMER * schedule.unit_k_steps(gl.program_id(0)), ring.NUM_BUFFERS)  # my first k-step
    local_tile = 0
    for unit in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), schedule.num_units(),
                      NUM_CONSUMERS * gl.num_programs(0)):
        work = schedule.work(unit)
        if NUM_CONSUMERS == 2:
            # my turn: the other consumer has issued the whole main loop of the tile before mine.
            # (A fresh barrier counts as phase 1 complete: consumer 0's first wait returns at once.)
            mbarrier.wait(turn.index(CONSUMER), (local_tile & 1) ^ (1 - CONSUMER))
        # acc = zeros(BLOCK_M, BLOCK_N)
        mma = lesson04.HopperWGMMA.initialize(ring.a_bufs.dtype, BLOCK_M, BLOCK_N, gl.num_warps())
        for k in range(work.k_begin, work.k_end):
            slot = state.slot()
            mbarrier.wait(ring.ready.index(slot), state.phase())
            # acc += A @ B^T, asynchronously
            mma = mma.issue_async_mma(ring.a_bufs.index(slot), ring.b(slot))
            # Only this step's MMA in flight: the one of step k-1 is done, so its stage is free.
            mma = mma.wait_num_outstanding(1)
            mbarrier.arrive(ring.empty.index(state.previous_slot()), pred=k > work.k_begin)
            state = state.next()
        if NUM_CONSUMERS == 2:
            mbarrier.arrive(turn.index(1 - CONSUMER))   # your turn: my MMAs are all issued
        acc, mma = mma.wait_num_outstanding(0).take_result()      # every MMA of the tile done
        mbarrier.arrive(ring.empty.index(state.previous_slot()))
        output.store(acc, work.pid_m * schedule.TILE_M, work.pid_n * schedule.TILE_N)
        # skip the other consumer's tile
        state = state.next((NUM_CONSUMERS - 1) * schedule.unit_k_steps(unit + gl.num_programs(0)))
        local_tile += 1
    tma.store_wait(pendings=0)


# %%
# Blackwell: the MMA warp and the epilogue share a double-buffered accumulator in tensor memory (TMEM),
# a second ring of two slots: the MMA warp waits for acc.empty[buf], runs the tile into it and commits
# acc.ready[buf]; the epilogue loads it into registers and arrives on acc.empty before its store.


@gluon.aggregate
class TmemAccumulators:
    tmem: tensor_memory_descriptor        # [NUM_ACC, BLOCK_M, BLOCK_N] fp32 in TMEM
    tail_tmem: tensor_memory_descriptor   # the operator's column tail (section 6); here, and in 07, tmem again
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
            # acc += A @ B^T
            tcgen05_mma(ring.a_bufs.index(slot), ring.b(slot), acc.tmem.index(buf), use_acc=k > work.k_begin)
            # the hardware arrives on empty[slot] once this MMA (and all earlier ones) is done
            tcgen05_commit(ring.empty.index(slot))
            state = state.next()
        # signal the epilogue once every MMA of the tile has finished
        tcgen05_commit(acc.ready.index(buf))
        acc_state = acc_state.next()


@gluon.jit
def blackwell_epilogue_partition(schedule, acc, output):
    acc_state = common.Counter(gl.to_tensor(0), acc.NUM_ACC)
    for unit in range(gl.program_id(0), schedule.num_units(), gl.num_programs(0)):
        work = schedule.work(unit)
        buf = acc_state.slot()
        mbarrier.wait(acc.ready.index(buf), acc_state.phase())
        tile = acc.tmem.index(buf).load()           # TMEM -> registers
        mbarrier.arrive(acc.empty.index(buf))      # the MMA warp may reuse it now
        co0 = work.pid_n * schedule.TILE_N
        output.store(tile, work.pid_m * schedule.TILE_M, co0)
        acc_state = acc_state.next()
    tma.store_wait(pendings=0)


# %%
# 3. A persistent grid and a grouped tile order
# ---------------------------------------------
# One program per SM, each looping over tiles pid, pid + num_programs, ... (every partition walks the
# same sequence): no launch per tile, and the loader runs ahead into the next tile. Tiles go in groups
# of GROUP_M row-tiles (Triton's matmul tutorial's order), so tiles sharing a strip of A run close in
# time and read it from L2. `TileSchedule.work(unit)` gives a unit's tile and k-steps (section 7 splits).

GROUP_M = gl.constexpr(8)      # row-tiles per group of the tile order


@gluon.aggregate
class WorkUnit:
    pid_m: Int
    pid_n: Int
    k_begin: Int
    k_end: Int


@gluon.aggregate
class TileSchedule:
    num_pid_m: Int
    num_pid_n: Int
    k_steps: Int
    TILE_M: gl.constexpr      # output rows (pixels) and columns (channels) per tile
    TILE_N: gl.constexpr

    @gluon.jit
    def num_units(self):
        return self.num_pid_m * self.num_pid_n

    @gluon.jit
    def unit_k_steps(self, unit):
        # The k-steps of a unit (ping-pong's consumers skip each other's).
        work = self.work(unit)
        return work.k_end - work.k_begin

    @gluon.jit
    def work(self, unit):
        # (pid_m, pid_n) of the linear tile id, GROUP_M row-tiles at a time (the L2-friendly order)
        tiles_per_group = GROUP_M * self.num_pid_n
        first_m = (unit // tiles_per_group) * GROUP_M
        rows_in_group = gl.minimum(self.num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (unit % tiles_per_group) % rows_in_group
        pid_n = (unit % tiles_per_group) // rows_in_group
        return WorkUnit(pid_m, pid_n, 0, self.k_steps)


# %%
# 4. Overlapping the epilogue
# ---------------------------
# On Blackwell the double-buffered TMEM accumulator does it: the MMA warp starts tile t+1 in the
# other buffer while the epilogue drains tile t. On Hopper one warpgroup's registers hold one
# accumulator, so while it stores tile t nobody issues MMAs. CUTLASS's answer is "ping-pong": two
# consumers, each with its own accumulator and staging buffer, take alternate tiles; the loader
# fills the ring as before, and each consumer skips the other's k-steps in its counter. One rule
# needs a barrier: mbarrier waits compare only the parity of the phase, so a consumer two fills
# ahead of a stage would see an old phase with the right parity and read the other's data. So the
# consumers pass a turn: consumer c starts its main loop only after the other has issued every MMA
# of the tile before. The main loops stay in order, each epilogue hidden under the other's loop.
# With one consumer (256-row tiles need its 8 warps) the overlap is partial: the loader prefetches
# during the epilogue, the TMA store drains during the next tile. On the headline that config wins
# (the run below): per FLOP a 256 x 128 tile moves a quarter fewer bytes than a 128 x 128 one (384
# rows per 32768 products against 256 per 16384), which matters more there than a hidden epilogue.
#
# 5. Fused epilogues
# ------------------
# A ResNet block runs BatchNorm, the residual add and ReLU after a conv. As separate passes on
# ResNet-50's 56x56 stage at batch 128 (a 205 MB bf16 output) they move at least 3 x 205 MB, ~0.18 ms
# at the H100's 3.35 TB/s, beside a conv of ~0.1 ms. Our epilogue holds the tile in registers anyway:
# `TileOutput.store` loads, each only if its `Epilogue` switch asks, a per-channel scale, the bias
# (or shift) and the residual tile (in the accumulator's layout), and `apply_epilogue` (plain Triton)
# applies them and ReLU or SiLU before the one store. In eval mode BatchNorm folds into the weights
# and shift (conv_tutorial.fusion.fold_batchnorm), and conv_tutorial.fuse_conv_bn_act finds these
# chains in a model with torch.fx.


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
# Allocate the ring, staging buffers, barriers and (Blackwell) TMEM accumulators, bundle them, and
# split into the partitions. The run-time integers come as one tuple, `shape`, the epilogue's pointers
# as another (the operator's copy's parameters: the two compile to the same PTX), the rest as constexprs.


@gluon.jit
def conv2d_fprop_kernel(in_desc, w_desc, out_desc, epilogue_ptrs, shape,
                        CONFIG: gl.constexpr, EPILOGUE: gl.constexpr, IS_BLACKWELL: gl.constexpr):
    (M, Co, num_pid_m, num_pid_n, out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, Ci_group, Co_group,
     S, k_steps, channel_blocks) = shape
    dtype: gl.constexpr = in_desc.dtype
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    NUM_BUFFERS: gl.constexpr = CONFIG.num_buffers
    NUM_CONSUMERS: gl.constexpr = CONFIG.consumers
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_M, BLOCK_K], in_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_desc.block_type.shape, w_desc.layout)
    # one epilogue staging tile per consumer
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [NUM_CONSUMERS] + out_desc.block_type.shape, out_desc.layout)
    ready, empty = common.allocate_barrier_pairs(NUM_BUFFERS)
    ring = Ring(a_bufs, b_bufs, ready, empty, NUM_BUFFERS)
    schedule = TileSchedule(num_pid_m, num_pid_n, k_steps, BLOCK_M, BLOCK_N)
    window = Im2colWindow(out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, Ci_group, Co_group, S,
                          channel_blocks)
    # the epilogue's pointers; the fourth is split-K's workspace in the operator's copy (section 7), unused here
    bias_ptr, scale_ptr, residual_ptr, workspace_ptr = epilogue_ptrs
    output = TileOutput(out_desc, c_smem, bias_ptr, scale_ptr, residual_ptr, M, Co, EPILOGUE)
    if IS_BLACKWELL:
        NUM_ACC: gl.constexpr = 2
        acc_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N],
                                          TensorMemoryLayout([BLOCK_M, BLOCK_N], col_stride=1))
        acc_ready, acc_empty = common.allocate_barrier_pairs(NUM_ACC)
        acc = TmemAccumulators(acc_tmem, acc_tmem, acc_ready, acc_empty, NUM_ACC)
        gl.warp_specialize([
            (blackwell_epilogue_partition, (schedule, acc, output.for_consumer(0))),
            (blackwell_mma_partition, (ring, schedule, acc)),
            (loader_partition, (in_desc, w_desc, ring, schedule, window)),
        ], [1, 1], [24, 24])
    else:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        if NUM_CONSUMERS == 1:
            gl.warp_specialize([
                (hopper_mma_epilogue_partition, (ring, schedule, output.for_consumer(0), turn, 0, 1)),
                (loader_partition, (in_desc, w_desc, ring, schedule, window)),
            ], [1], [24])
        else:
            # ping-pong: consumer 0 is the default partition, consumer 1 a worker of as many warps.
            # Registers: 2 consumer warpgroups at 240 + the loader's warpgroup at 24 fill the 64K.
            gl.warp_specialize([
                (hopper_mma_epilogue_partition, (ring, schedule, output.for_consumer(0), turn, 0, 2)),
                (hopper_mma_epilogue_partition, (ring, schedule, output.for_consumer(1), turn, 1, 2)),
                (loader_partition, (in_desc, w_desc, ring, schedule, window)),
            ], [gl.num_warps(), 1], [240, 24])


# %%
# The plain launcher
# ------------------
# A `KernelConfig` fixes the tile (BLOCK_M x BLOCK_N x BLOCK_K), the ring depth, the warps of each
# MMA/epilogue partition, the programs per SM and the consumers (section 4); its rules (TMEM's 128
# lanes and 512 columns, ping-pong on Hopper only, ...) and the tile counts are imported from the
# operator's copy: a config the kernel does not implement gets a ValueError, not a hang. The
# launcher builds everything on every call: channels padded to 16 bytes (lesson 04), the TMA
# descriptors (lesson 03), the grid (one program per SM, or per tile if fewer), the constexprs.

# The run-time integers as the kernel unpacks them (Ci_group: padded channels per group; channel_blocks: per tap)
ConvShape = NamedTuple("ConvShape", [(name, int) for name in "M Co num_pid_m num_pid_n out_h out_w stride_h stride_w "
                                    "pad_h pad_w dil_h dil_w Ci_group Co_group S k_steps channel_blocks".split()])


class ConvLaunch(NamedTuple):
    grid: tuple
    in_desc: object                # im2col descriptor of the input
    w_desc: object                 # tiled descriptor of the weights [Co, R*S*Ci]
    out_desc: object               # tiled descriptor of out_2d
    pointers: tuple                # the epilogue's bias, scale and residual pointers, and one unused (the kernel's)
    shape: ConvShape
    out_2d: torch.Tensor           # [M, Co rounded up to 16 bytes], written by the kernel

    def kernel_args(self):         # the kernel's run-time arguments, in its signature's order
        return self.in_desc, self.w_desc, self.out_desc, self.pointers, self.shape


output_nhwc = lesson04.output_nhwc    # out_2d [M, Co rounded up to 16 bytes] as NHWC [N, out_h, out_w, Co]


def kernel_constexprs(config, arch, epilogue=Epilogue()):
    # The kernel's constexprs and launch options, by name.
    config = KernelConfig(*config)
    return dict(CONFIG=config, EPILOGUE=Epilogue(*epilogue), IS_BLACKWELL=arch == "sm_100",
                num_warps=config.num_warps, enable_fp_fusion=True,   # the epilogue's a * scale + bias as one FMA
                **({"maxnreg": 128} if config.programs_per_sm > 1 else {}))


def part_one_config(config):
    # Whether this file's kernel runs `config`: no tail, no row-block stores, no split-K (Part II's).
    c = KernelConfig(*config)
    return c.tile_m == c.block_m and c.tile_n == c.block_n and c.split_k == 1 and not stores_by_row_blocks(c)


def prepare_launch(x_nhwc, w, bias, geometry, config, arch, num_sms, scale=None, residual=None, out_dtype=None):
    # A ConvLaunch for these tensors (CPU tensors work too: the ahead-of-time compile uses them).
    config, g = KernelConfig(*config), geometry
    check_config(config, arch)
    if not part_one_config(config):
        raise ValueError(f"config {config}: its tail, row-block stores or split-K (sections 6, 7) run in the "
                         f"operator's copy of this kernel, conv_tutorial.kernels.fprop.conv2d_fprop_launch")
    check_groups_fit(config, g, x_nhwc.element_size())                     # §10
    x_nhwc, w, Ci_padded = common.pad_channels_for_tma(x_nhwc, w)
    Ci_group = Ci_padded // g.groups
    BLOCK_K = block_k_channels(config, Ci_group, x_nhwc.element_size())    # 128 bytes (§9: 128 e4m3)
    lanes = 16 // (out_dtype or x_nhwc.dtype).itemsize        # output elements per 16 bytes: out_2d's row length
    out_2d = torch.empty(g.M, -(-g.Co // lanes) * lanes, device=x_nhwc.device, dtype=out_dtype or x_nhwc.dtype)
    in_desc, w_desc, out_desc = common.conv_tma_descriptors(x_nhwc, w, out_2d, common.conv_im2col_settings(g),
                                                            config.block_m, config.block_n, BLOCK_K)
    num_pid_m, num_pid_n = tile_grid(config, g.M, g.Co)
    blocks = channel_blocks(config, Ci_group, x_nhwc.element_size())
    # absent epilogue tensors: any pointer will do, the constexprs compile their loads away
    pointers = tuple(t if t is not None else out_2d for t in (bias, scale, residual, None))
    shape = ConvShape(g.M, g.Co, num_pid_m, num_pid_n, g.out_h, g.out_w, *g.stride, *g.padding, *g.dilation,
                      Ci_group, g.Co_group, g.S, g.R * g.S * blocks, blocks)
    return ConvLaunch((tile_counts(config, g.M, g.Co, num_sms)[0], 1, 1), in_desc, w_desc, out_desc, pointers, shape,
                      out_2d)


def conv2d_fprop_launch(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=FIXED_CONFIG,
                        scale=None, residual=None, activation="none", groups=1, out_dtype=None):
    """The warp-specialized conv. x_nhwc [N, H, W, Ci], w [Co, R, S, Ci / groups] (fp16, bf16 or, §9,
    e4m3; CUDA, contiguous); returns NHWC [N, out_h, out_w, Co] in x's dtype (e4m3: bf16, or e4m3 if
    out_dtype asks), act(conv * scale + bias + residual) computed in fp32: bias and scale [Co],
    residual of the output's shape and dtype, activation "none", "relu" or "silu"."""
    geometry = common.check_conv_call(x_nhwc, w, bias, stride, padding, dilation, dtypes=KERNEL_DTYPES, scale=scale,
                                      residual=residual, activation=activation, out_dtype=out_dtype, groups=groups)
    arch, num_sms = common.tma_mma_arch_and_sms("conv2d_fprop_launch")
    launch = prepare_launch(x_nhwc, w, bias, geometry, config, arch, num_sms, scale, residual,
                            common.output_dtype(x_nhwc.dtype, out_dtype))
    epilogue = Epilogue(bias is not None, scale is not None, residual is not None, activation)
    conv2d_fprop_kernel[launch.grid](*launch.kernel_args(), **kernel_constexprs(KernelConfig(*config), arch, epilogue))
    return output_nhwc(geometry, launch.out_2d)


# %%
# Checks against torch (GPU)
# --------------------------
# Against torch's conv2d in fp32 (tolerances: common.assert_close_to_reference): one layer in the
# demo, the upstream Blackwell grid in the test. Awkward shapes, ping-pong, the fused epilogue and
# Part II are checked in tests/lessons/test_05_*.py.

def run_core_kernel():
    common.check_conv(conv2d_fprop_launch, 4, 32, 32, 384, 384, 3, 3, 1, 1, dtype=torch.bfloat16)
    print(f"\nconv2d_fprop_launch ({FIXED_CONFIG}) matches torch.nn.functional.conv2d on {common.gpu_name()}")


needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


@needs_gpu
@pytest.mark.parametrize("N", [1, 128])
@pytest.mark.parametrize("Ci_Co", [384, 416])
@pytest.mark.parametrize("R", [3, 4, 5])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", [0, 1])
def test_fixed_config_grid(N, Ci_Co, R, stride, padding):
    common.check_conv(conv2d_fprop_launch, N, 64, 64, Ci_Co, Ci_Co, R, R, stride, padding, dtype=torch.bfloat16)


# %%
if __name__ == "__main__" and on_gpu:
    run_core_kernel()

# %%
# What the compiler produced (no GPU needed)
# ------------------------------------------
# Compiled ahead of time, the PTX shows each partition's work; counts are instructions in the program
# text, not executions (the sm_100 build's synchronization is checked against a review, RESULTS.md
# "The Blackwell path", in tests/lessons/test_05_extensions.py). The `setmaxnreg` counts are how
# Triton 3.9 lowers `gl.warp_specialize`: "the same setmaxnreg instruction must be executed by all
# warps in a warpgroup" (PTX ISA), so the workers are padded to whole warpgroups with idle warps (on
# sm_90 the loader and 3 idle warps; on sm_100 the loader, the MMA issuer and 2 idle warps). Each
# worker's code, the idle warps' too, starts with a `.dec` to 24 and ends with an `.inc` back; the
# workers' dispatch loop raises the limit at its top, and the default warpgroup sets its own on
# entering the kernel, entering its partition and leaving it. Every `.inc` here is to 256, which 256
# threads may hold anyway; the hand-over counts with more threads (ping-pong: 2 x 128 at 240 + 128 at 24).

IM2COL_LOAD, WEIGHT_LOAD, TMA_STORE = common.PTX_IM2COL_LOAD, common.PTX_TILED_LOAD, common.PTX_TMA_STORE
TAUGHT_PTX = {
    "sm_90": [
        (IM2COL_LOAD, "The A tile, one per k-step, the whole 128 x 64 box; the last two values: the tap's offsets."),
        (WEIGHT_LOAD, "The B tile, 128 filters x 64 channels, into the same ring stage."),
        ("wgmma.mma_async", "The consumer's MMAs: m64n128k16, so a 128 x 128 tile with BLOCK_K=64 "
                            "takes 2 row blocks x 4 K steps = 8 per k-step."),
        ("setmaxnreg.dec", "2 places: the loader's code and its warpgroup's 3 idle warps' code lower the limit to 24."),
        ("setmaxnreg.inc", "6: those two exits, the dispatch loop's top, and the consumer warpgroup's kernel "
                           "entry, partition entry and partition exit."),
        (TMA_STORE, "The epilogue's TMA store of the 128 x 128 tile from its staging buffer."),
    ],
    "sm_100": [
        (IM2COL_LOAD, "The A tile, in the loader partition's loop, as on sm_90."),
        (WEIGHT_LOAD, "The B tile, as on sm_90."),
        ("tcgen05.mma", "One thread issues 128 x 128 x 16 into tensor memory; BLOCK_K=64 takes 4 per k-step."),
        ("tcgen05.commit", "Two: once per k-step (the hardware arrives on the stage's empty barrier when the MMAs "
                           "that read it are done) and once per tile (the accumulator is ready for the epilogue)."),
        ("tcgen05.ld", "The epilogue reads the 128 x 128 fp32 accumulator from tensor memory."),
        ("setmaxnreg.dec", "3 places: the loader's, the MMA issuer's and the 2 idle warps' code."),
        ("setmaxnreg.inc", "6, as on sm_90: the loader's and the MMA issuer's identical exits are one block."),
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
    compiled = common.assert_ptx_teaches("05-warp-specialized-conv", "aot_conv2d_fprop", arch, TAUGHT_PTX)
    counts = common.ptx_instructions(compiled["ptx"], ["setmaxnreg.dec", "setmaxnreg.inc"])
    assert counts == {"setmaxnreg.dec": 2 if arch == "sm_90" else 3, "setmaxnreg.inc": 6}     # as the table says


def run_show_ptx():
    return common.show_ptx("05-warp-specialized-conv", "aot_conv2d_fprop", TAUGHT_PTX, lambda arch, compiled: (
        f"conv2d_fprop_kernel, {FIXED_CONFIG}; {compiled['num_warps']} warps in all, padded to whole warpgroups"))


# %%
if __name__ == "__main__":
    run_show_ptx()

# %%
# Part II: what real layers need
# ------------------------------
# What makes the kernel fast on layers that do not suit its tile lives in the operator's copy,
# conv_tutorial/kernels/fprop.py: this kernel plus constexpr switches that compile to nothing when
# off. Read it beside this file: below, where each addition sits and why (checks: tests/lessons/
# test_05_*.py; before/after timings: results/notebook.md).
#
# 6. Tails: tiles that are not a power of two wide (or tall)
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Triton's tensors have power-of-two shapes, so with BLOCK_N=128 a layer with Co=320 computes three
# tiles of 128 columns: a sixth of the tensor-core work is thrown away. The hardware has no such
# rule (a WGMMA's N is any multiple of 8 up to 256, tcgen05's of 16, a TMA box up to 256), so a tile
# may carry a *tail*: `block_n_tail` more columns (32: 160 = 320 / 2), with their own weight box and
# buffer (`Ring.b_tail_bufs`), MMA on the same A tile (`mma_tail`; on Blackwell a second
# `tcgen05_mma` into `TmemAccumulators.tail_tmem`) and store, both weight boxes under one `expect`.
# Likewise in M (`block_m_tail`, Hopper): ResNet-50's 7x7 stage at batch 128 (M = 6272, Co = 512)
# has 196 tiles of 128 x 128 for 132 SMs, but 33 x 4 = 132 of 192 x 128, one wave; the tail's
# pixels come in boxes of its height, each at its own (n, y, x). Per k-step a 192 x 128 tile reads
# 320 rows for 24576 products, a 128 x 128 tile 256 for 16384: a sixth fewer bytes per FLOP. Its
# 48 KB staging tile and four 40 KB stages fill 208 of the 227 KB; a fifth stage fits if the tile
# leaves in 64-row blocks through one 16 KB buffer (`stores_by_row_blocks`), a reshape of the
# accumulator that moves no data where a warpgroup holds two 64-row WGMMA blocks.
#
# 7. Split-K for layers with too few tiles
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A UNet layer at 8x8, batch 8 (M = 512, Co = 1280) has 40 tiles of 128 x 128 for 132 SMs, each a K
# loop of 180 steps: 70% of the GPU idles. With `split_k`, `TileSchedule.work` hands out slices of a
# tile's K loop; a slice stores its fp32 sum to a workspace partial[split, m, co] (`TileOutput.store`,
# the fourth epilogue pointer), and `split_k_epilogue_kernel`, plain Triton, sums the slices in a
# fixed order and applies the same epilogue: a round trip and a second launch of a few microseconds.
# Only tiles past the last full wave are split: ResNet-50's 7x7 2048->512 layer (196 tiles) runs 132
# whole and 64 as 2 x 64 half-tiles.

# %%
# Section 8, small channel counts: the RGB stem (Ci=3 padded to 8, 7x7 stride 2) runs 49 k-steps of
# 16 channels (the smallest K block), 3 real; `conv_tutorial.runtime.FoldedConv` folds the filter's
# columns into the channels: a 7x1 conv over 24 (21 real), 7 k-steps of this kernel. No kernel lines.
#
# 9. fp8: twice the tensor-core rate
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# WGMMA and tcgen05 (`kind::f8f6f4`) multiply e4m3 (largest value 448) at twice bf16's rate, with
# no kernel line changed: a stage holds 128 bytes of K either way, so BLOCK_K=64 bf16 is 128 e4m3
# (`block_k_channels`), and the instruction's K is 32 bytes too (k32 against k16); fp8 WGMMA takes
# no transposed shared operand, and ours are K-major. Dequantizing (x_scale per tensor, w_scale per
# output channel) is the epilogue's per-channel scale. Measured on an H100 80GB HBM3 (2026-11-24,
# results/h100-2026-11-24/fp8.json, kernels alone): the headline at 1254 TFLOPS in e4m3 against 706
# in bf16 (1.78x); over the network suite's 84 layers, 1.38x.

TAUGHT_PTX_FP8 = {
    "sm_90": [("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
               "e4m3 x e4m3 into fp32, K = 32 per instruction: 2 row blocks x 4 = 8 per k-step of 128 channels."),
              ("cvt.rn.bf16x2.f32", "The epilogue's cast of the dequantized tile to bf16, two values at a time.")],
    "sm_100": [("tcgen05.mma.cta_group::1.kind::f8f6f4", "One thread issues 128 x 128 x 32 in e4m3: 4 per k-step."),
               ("cvt.rn.bf16x2.f32", "The cast to bf16, as on sm_90.")],
}
FP8_BUILD = dict(Ci=128, epilogue=[False, True, False, "none"], dtype="float8_e4m3fn")   # a bf16 output


def run_fp8_demo():
    # What the fp8 build compiles to, no GPU needed (its checks on a GPU: tests/lessons/test_05_fp8.py).
    return common.show_ptx("05-warp-specialized-conv", "aot_conv2d_fprop", TAUGHT_PTX_FP8,
                           lambda arch, compiled: "conv2d_fprop_kernel on e4m3 operands, bf16 output", **FP8_BUILD)


# %%
if __name__ == "__main__":
    run_fp8_demo()

# %%
# Section 10, grouped convs: output channel co reads only the Ci / groups input channels of its group,
# and w is [Co, R, S, Ci / groups]. A tile whose columns lie in one group changes in one place (the §10
# lines): its im2col boxes start at the group's first channel; w as [Co, R * S * Ci / groups] already
# holds the group's filters in the tile's rows. A tile must not straddle groups (`check_groups_fit`);
# groups narrower than a tile (ResNeXt-50's) are merged by `conv_tutorial.FusedConv2d` into one with
# a block-diagonal filter: exact, with tensor-core work to spare on layers that thin.
#
# Around the kernel. `python tools/sanitize.py` runs compute-sanitizer's four tools over lesson 04's
# kernel, this kernel at every Hopper candidate config (in the operator's copy) and the backward
# lessons' cases; RESULTS.md ("Sanitizers") says why none of its reports is a bug, and what it cannot
# see (the async proxy). `torch.ops.conv_tutorial.conv2d` runs the operator's copy behind a runtime
# that plans per shape, launches the compiled kernel directly and picks a config per shape (README.md);
# tests/kernels/test_equivalence.py checks that, its extra switches off, it builds to this file's PTX
# line for line and writes the same bits.

# %%
# What this lesson measured, what limits it, what comes next
# ----------------------------------------------------------
# Measured on an H100 80GB HBM3 (2026-11-24, bf16, batch 128, Triton 3.8.0; results/h100-2026-11-24/
# 05_tflops_per_shape.json, written by this lesson's `--bench` then, `python benchmarks/network_suite.py
# --ladder` now: 02, 04 timed once, this kernel (the operator's copy, a config per layer, Part II's
# tails included) and cuDNN in rounds; do_bench's median, L2 flushed, launch included), in TFLOPS:
#
# ===========================  ===  ===  ===  =====  ========  ================================
# layer                         02   04   05  cuDNN  05/cuDNN  this kernel's config
# ===========================  ===  ===  ===  =====  ========  ================================
# headline 64x64 384->384 3x3  445  478  712    675     1.05x  256x128x64 3 stages 8 warps
# RN50 7x7 512->512 3x3        322  208  690    582     1.19x  (128+64)x128x64 5 stages 4 warps
# RN50 56x56 128->128 3x3 s2   241  134  441    466     0.95x  128x128x64 6 stages 8 warps
# RN50 14x14 1024->256 1x1     310  115  376    405     0.93x  128x128x64 6 stages 8 warps
# ===========================  ===  ===  ===  =====  ========  ================================
#
# (its nine layers are printed below; over its seven 3x3 layers, 1.065x cuDNN). The pipelined,
# persistent kernel took the headline from lesson 04's 478 TFLOPS to 712.
#
# What limits it: on the headline, the power. In one run of `python benchmarks/clocks_under_load.py`
# (H100, 2026-11-23, results/h100-2026-11-23/clocks-headline.log) both kernels held the board at its
# 700 W limit, where the SM clock falls from 1980 to about 1440 MHz and the dense bf16 peak to about
# 780 TFLOPS: ours ran 688 TFLOPS (88% of that), cuDNN 690 (89%), a tie where the run above gave
# 1.05x; the headline swings by 5-10% between runs and machines for both kernels (RESULTS.md). The
# 1x1 and stride-2 layers below 1.0x are bound by memory, read from a cold L2. A 2-CTA cluster could
# load shared pixels or weights once, but pipelining a pair needs the second CTA to arrive on the
# leader's barrier, and Gluon 3.9 on Hopper has only the leader's broadcast (results/notebook.md).
#
# Next: lesson 06 (06-conv-dgrad.py). Training also runs the backward pass, which needs the
# gradients of the loss with respect to the weights and to the input. Can this forward kernel
# compute the input gradient dX of training's backward pass?

# %%
if __name__ == "__main__":
    if args.bench:      # the ladder's timings live in the benchmark, which runs this kernel's operator copy
        print("\n--bench: this lesson times nothing itself: python benchmarks/network_suite.py --ladder does")
    common.show_recorded_ladder(outdir, lambda fields: str(KernelConfig(*fields)))
    print(f"\nlesson 05: all checks passed on {common.gpu_name()}" if on_gpu else "\n" + common.cpu_closing_line(
        "05", "the fixed config's rules and that the sm_90 and sm_100 builds compile, printing their instructions "
        "and the recorded ladder (pytest asserts the builds and the input checks)", "running the kernel and comparing it "
        "with torch, the benchmark (benchmarks/network_suite.py), the sanitizers (tools/sanitize.py)"))
