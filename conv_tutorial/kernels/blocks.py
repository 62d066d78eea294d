"""Gluon building blocks of the kernels: the ring counter, barrier pairs, and the MMA step of each
architecture (WGMMA on Hopper; tcgen05 is issued inline by the Blackwell partitions)."""
from typing import Union

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, warpgroup_mma, warpgroup_mma_accumulator, warpgroup_mma_wait)

@gluon.aggregate
class Counter:
    """How far one side of a ring of NUM_BUFFERS stages has gone: `count` steps, across all tiles.
    It gives the slot to use (count % NUM_BUFFERS) and the phase of that slot's barrier to wait for
    ((count // NUM_BUFFERS) & 1). `next()` returns the advanced counter (aggregates are values)."""
    count: Union[gl.tensor, gl.constexpr]
    NUM_BUFFERS: gl.constexpr

    @gluon.jit
    def slot(self):
        return self.count % self.NUM_BUFFERS

    @gluon.jit
    def phase(self):
        return (self.count // self.NUM_BUFFERS) & 1

    @gluon.jit
    def previous_slot(self):
        return (self.count + self.NUM_BUFFERS - 1) % self.NUM_BUFFERS

    @gluon.must_use_result
    @gluon.jit
    def next(self, steps=1):
        return Counter(self.count + steps, self.NUM_BUFFERS)


@gluon.jit
def allocate_barrier_pairs(COUNT: gl.constexpr):
    """(ready, empty): COUNT pairs of mbarriers in shared memory, each initialized for one arrival
    (a ring's ready/empty barriers, or an accumulator hand-off's)."""
    ready = gl.allocate_shared_memory(gl.int64, [COUNT, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [COUNT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(COUNT):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.constexpr_function
def wgmma_accumulator_layout(dtype, BLOCK_M, BLOCK_N, num_warps):
    """Register layout of a WGMMA accumulator: warps stack along M first (16 rows per warp of a
    64-row warpgroup instruction), the instruction's N is the widest multiple of 8 up to
    BLOCK_N / (warps along N) that divides BLOCK_N, and its K
    covers 32 bytes of the operand type (16 for fp16/bf16)."""
    warps_per_cta = [4, 1]
    while warps_per_cta[0] * warps_per_cta[1] < num_warps:
        if BLOCK_M > 16 * warps_per_cta[0]:
            warps_per_cta[0] *= 2
        else:
            warps_per_cta[1] *= 2
    instr_n = min(256, BLOCK_N // warps_per_cta[1])
    while BLOCK_N % instr_n:
        instr_n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps_per_cta,
                                     instr_shape=[16, instr_n, 256 // dtype.primitive_bitwidth])


@gluon.aggregate
class HopperWGMMA:
    """WGMMA: accumulator in the issuing warps' registers; completion by warpgroup_mma_wait."""
    acc: Union[warpgroup_mma_accumulator, gl.tensor]
    use_acc: gl.tensor

    @gluon.constexpr_function
    def __init__(self, acc, use_acc):
        self.acc = acc
        self.use_acc = use_acc

    @gluon.jit
    def initialize(dtype: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   num_warps: gl.constexpr):
        layout: gl.constexpr = wgmma_accumulator_layout(dtype, BLOCK_M, BLOCK_N, num_warps)
        return HopperWGMMA(gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout), gl.to_tensor(False))

    @gluon.jit
    def issue_async_mma(self, a, b):
        # The first MMA of a tile ignores the old accumulator (use_acc=False): no zeroing needed.
        acc = warpgroup_mma(a, b, self.acc, is_async=True, use_acc=self.use_acc)
        return HopperWGMMA(acc, gl.to_tensor(True))

    @gluon.jit
    def wait_num_outstanding(self, num_outstanding: gl.constexpr):
        return HopperWGMMA(warpgroup_mma_wait(num_outstanding, (self.acc,)), self.use_acc)

    @gluon.jit
    def take_result(self):
        return self.acc, HopperWGMMA(self.acc, gl.to_tensor(False))
