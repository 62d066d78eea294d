"""A 1x1 conv as a persistent GEMM on pairs of CTAs that share a tile: does it pay?

    python scripts/cluster_gemm_probe.py [--rounds 3] [--layer LABEL]      (Hopper GPU)

A 1x1 conv of stride 1 without padding is the GEMM out[M, Co] = x[M, Ci] @ w[Co, Ci]^T on the
NHWC input viewed as a matrix. ResNet-50's 1x1 layers are where lesson 05 trails cuDNN, whose
kernels for them (cuBLAS's nvjet) run on pairs of CTAs that load a shared tile once (TMA
multicast). scripts/cluster_probe.py says what Gluon 3.8 can express on Hopper: per-CTA tiles
through tiled loads, a tile multicast to the pair, per-CTA barriers, and a barrier of the pair
that only the leader CTA waits on. This kernel uses exactly those, in two forms:
- pairs of row tiles sharing their weights: each CTA loads its own BLOCK_M x BLOCK_K pixels (a
  split box), the leader multicasts the BLOCK_N x BLOCK_K weights to both;
- pairs of column tiles sharing their pixels (SHARE_PIXELS, cuDNN's 1x2 clusters): the leader
  multicasts the BLOCK_M x BLOCK_K pixels, each CTA loads its own BLOCK_N rows of weights.
ready[s] is per CTA (each waits for its own tile and its copy of the shared one); a stage is free
again when both CTAs' consumers are done with it: each arrives on its own empty[s] (its loader
reuses its own slot) and on the pair's shared[s], which the leader's loader waits on before it
multicasts into both CTAs. The ring, the warp specialization and the persistent tile walk are
lesson 05's, cut down to what this needs: one consumer, no tails, no split-K, no epilogue but
the cast. Each form is checked against torch, then timed next to cuDNN and lesson 05 (tuned) in
alternating rounds three ways: the kernels alone from a cold L2 (a sleep kernel ahead of them
so that no launch waits on the host), warm, and end to end as the network suite times
(do_bench, L2 flushed). Descriptors and output are made once per layer: made per call (the
first version of this probe), the host time of a call outran do_bench's flush and the rounds
went bimodal. Not part of the lesson: a measurement.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    cluster, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

CTAS = 2
SPLIT_ROWS = gl.constexpr([[1, 0]])     # cga_layout: CTA c holds rows [c * rows / 2, (c + 1) * rows / 2)
SPLIT_COLS = gl.constexpr([[0, 1]])     # cga_layout: CTA c holds columns [c * cols / 2, (c + 1) * cols / 2)
SHARED = gl.constexpr([[0, 0]])         # cga_layout: every CTA holds the whole tile
GROUP_M = 8


@gluon.jit
def pair_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of a tile in grouped order (lesson 05, section 3); pid_m counts row pairs."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile_id // per_group) * GROUP_M
    group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % per_group) % group_m, (tile_id % per_group) // group_m


@gluon.jit
def pair_loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, shared, num_pid_m, num_pid_n, k_steps,
                NUM_BUFFERS: gl.constexpr, GROUP_M: gl.constexpr, SHARE_PIXELS: gl.constexpr):
    A_ROWS: gl.constexpr = a_desc.block_type.shape[0]      # the pair's pixel rows
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    W_ROWS: gl.constexpr = w_desc.block_type.shape[0]      # the pair's weight rows (output columns)
    counter = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = pair_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        for k in range(k_steps):
            slot = counter % NUM_BUFFERS
            phase = ((counter // NUM_BUFFERS) & 1) ^ 1
            mbarrier.wait(empty.index(slot), phase)       # my consumer is done with my slot
            mbarrier.wait(shared.index(slot), phase)      # (the leader) both consumers are done
            mbarrier.expect(ready.index(slot), a_desc.nbytes_per_cta + w_desc.nbytes_per_cta)
            tma.async_load(a_desc, [pid_m * A_ROWS, k * BLOCK_K], ready.index(slot), a_bufs.index(slot),
                           multicast=SHARE_PIXELS)
            tma.async_load(w_desc, [pid_n * W_ROWS, k * BLOCK_K], ready.index(slot), w_bufs.index(slot),
                           multicast=not SHARE_PIXELS)
            counter += 1


@gluon.jit
def pair_consumer(a_bufs, w_bufs, ready, empty, shared, c_smem, out_desc, num_pid_m, num_pid_n, k_steps,
                  NUM_BUFFERS: gl.constexpr, GROUP_M: gl.constexpr, SHARE_PIXELS: gl.constexpr,
                  num_warps: gl.constexpr):
    PAIR_M: gl.constexpr = c_smem.shape[0]
    BLOCK_N: gl.constexpr = c_smem.shape[1]
    CTA_N: gl.constexpr = BLOCK_N // 2 if SHARE_PIXELS else BLOCK_N     # one CTA's columns
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, CTA_N, 16],
                                                     cga_layout=SPLIT_COLS if SHARE_PIXELS else SPLIT_ROWS)
    counter = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = pair_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros([PAIR_M, BLOCK_N], gl.float32, layout)
        for k in range(k_steps):
            slot = counter % NUM_BUFFERS
            mbarrier.wait(ready.index(slot), (counter // NUM_BUFFERS) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            previous = (counter + NUM_BUFFERS - 1) % NUM_BUFFERS
            mbarrier.arrive(empty.index(previous), pred=k > 0)
            mbarrier.arrive(shared.index(previous), pred=k > 0)
            counter += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        last = (counter + NUM_BUFFERS - 1) % NUM_BUFFERS
        mbarrier.arrive(empty.index(last))
        mbarrier.arrive(shared.index(last))
        tma.store_wait(0)                                 # the previous tile's store has read c_smem
        c_smem.store(acc.to(out_desc.dtype))
        fence_async_shared()
        tma.async_store(out_desc, [pid_m * PAIR_M, pid_n * BLOCK_N], c_smem)
    tma.store_wait(0)


@gluon.jit
def pair_gemm_kernel(a_desc, w_desc, out_desc, num_pid_m, num_pid_n, k_steps, NUM_BUFFERS: gl.constexpr,
                     GROUP_M: gl.constexpr, SHARE_PIXELS: gl.constexpr, num_warps: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUFFERS] + w_desc.block_type.shape, w_desc.layout)
    c_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=NUM_BUFFERS)                 # one per CTA
    empty = mbarrier.allocate_mbarrier(batch=NUM_BUFFERS)                 # one per CTA
    shared = mbarrier.allocate_mbarrier(batch=NUM_BUFFERS, two_ctas=True)  # the pair's, in the leader
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(shared.index(i), count=1)
    mbarrier.fence_init_release_cluster()
    cluster.barrier(relaxed=True)
    gl.warp_specialize([
        (pair_consumer, (a_bufs, w_bufs, ready, empty, shared, c_smem, out_desc, num_pid_m, num_pid_n, k_steps,
                         NUM_BUFFERS, GROUP_M, SHARE_PIXELS, num_warps)),
        (pair_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, shared, num_pid_m, num_pid_n, k_steps,
                       NUM_BUFFERS, GROUP_M, SHARE_PIXELS)),
    ], [1], [24])
    # neither CTA may exit while the other can still arrive on its barriers or multicast into it
    cluster.barrier()


def pair_gemm_prepare(x_2d, w_2d, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, NUM_BUFFERS=5, num_sms=None,
                      share_pixels=False, num_warps=4):
    """A call computing x_2d @ w_2d.T on pairs of CTAs, each CTA a BLOCK_M x BLOCK_N tile: pairs of
    row tiles sharing their weights (the leader multicasts them), or with share_pixels pairs of
    column tiles sharing their pixels. Descriptors and output are made once: the call is only the
    launch."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    M, K = x_2d.shape
    N = w_2d.shape[0]
    out = torch.empty(M, N, device=x_2d.device, dtype=x_2d.dtype)
    layout = lambda shape, cga: gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=cga.value)  # noqa: E731
    if share_pixels:
        a_block, a_cga, w_block, w_cga = [BLOCK_M, BLOCK_K], SHARED, [CTAS * BLOCK_N, BLOCK_K], SPLIT_ROWS
        out_block, out_cga = [BLOCK_M, CTAS * BLOCK_N], SPLIT_COLS
    else:
        a_block, a_cga, w_block, w_cga = [CTAS * BLOCK_M, BLOCK_K], SPLIT_ROWS, [BLOCK_N, BLOCK_K], SHARED
        out_block, out_cga = [CTAS * BLOCK_M, BLOCK_N], SPLIT_ROWS
    a_desc = TensorDescriptor.from_tensor(x_2d, a_block, layout(a_block, a_cga))
    w_desc = TensorDescriptor.from_tensor(w_2d, w_block, layout(w_block, w_cga))
    out_desc = TensorDescriptor.from_tensor(out, out_block, layout(out_block, out_cga))
    num_pid_m, num_pid_n = triton.cdiv(M, out_block[0]), triton.cdiv(N, out_block[1])
    num_sms = num_sms or torch.cuda.get_device_properties(x_2d.device).multi_processor_count
    clusters = int(os.environ.get("PAIR_CLUSTERS", num_sms // CTAS))     # pairs launched
    grid = (min(clusters, num_pid_m * num_pid_n),)
    k_steps = triton.cdiv(K, BLOCK_K)

    def call():
        pair_gemm_kernel[grid](a_desc, w_desc, out_desc, num_pid_m, num_pid_n, k_steps,
                               NUM_BUFFERS=NUM_BUFFERS, GROUP_M=GROUP_M, SHARE_PIXELS=share_pixels,
                               num_warps=num_warps, num_ctas=CTAS)
        return out
    return call


def kernel_ms(fn, cold, reps=40):
    """Median GPU time of fn's kernels without host time: a sleep kernel keeps the GPU busy while
    the host queues every rep (cold: a 256 MB memset first, as do_bench's flush), so no launch
    waits on the host. Returns milliseconds."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(60_000_000)          # ~30 ms of GPU time to queue behind
    for start, end in zip(starts, ends):
        if cold:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in zip(starts, ends))
    return times[len(times) // 2]


def host_us(fn, calls=50):
    """Host time per call, the GPU kept busy so that no call waits for it."""
    import time
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


LAYERS = [
    ("RN50 14x14 1024->512 1x1", 128, 14, 14, 1024, 512),
    ("RN50 14x14 1024->256 1x1", 128, 14, 14, 1024, 256),
    ("RN50 7x7 2048->512 1x1", 128, 7, 7, 2048, 512),
    ("RN50 28x28 512->256 1x1", 128, 28, 28, 512, 256),
    ("RN50 7x7 512->2048 1x1", 128, 7, 7, 512, 2048),
    ("RN50 14x14 256->1024 1x1", 128, 14, 14, 256, 1024),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layer", default=None)
    parser.add_argument("--config", action="append", default=[])
    args = parser.parse_args()
    import conv_runtime
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {common.versions()}")
    for label, N, H, W, Ci, Co in LAYERS:
        if args.layer and args.layer != label:
            continue
        x, w = common.random_conv_inputs(N, H, W, Ci, Co, 1, 1, torch.bfloat16)
        geometry = common.conv_geometry(x.shape, w.shape, 1, 0)
        expected = common.reference_conv2d_nhwc(x, w, None, 1, 0)
        x_2d, w_2d = x.view(-1, Ci), w.view(Co, Ci)
        calls = {"cuDNN": common.cudnn_conv2d(x, w, None, 1, 0),
                 "lesson 05 (tuned)": lambda: conv_runtime.conv2d(x, w, None, 1, 0)}
        variants = {"pairs sharing weights, 128x128x64, 6 stages": dict(NUM_BUFFERS=6),
                    "pairs sharing pixels, 128x128x64, 6 stages": dict(NUM_BUFFERS=6, share_pixels=True),
                    "pairs sharing pixels, 256x128x64, 3 stages": dict(BLOCK_M=256, NUM_BUFFERS=3,
                                                                       share_pixels=True, num_warps=8)}
        for name, options in variants.items():
            call = pair_gemm_prepare(x_2d, w_2d, **options)
            common.assert_close_to_reference(call().view(expected.shape), expected, dtype=torch.bfloat16,
                                             K=geometry.K)
            calls[name] = call
        common.assert_close_to_reference(calls["lesson 05 (tuned)"](), expected, dtype=torch.bfloat16, K=geometry.K)
        KernelConfig = conv_runtime._lesson().KernelConfig
        for text in args.config:
            config = KernelConfig(*map(int, text.split(",")))
            calls[f"lesson 05 {config}"] = (lambda c: lambda: conv_runtime.conv2d(x, w, None, 1, 0, config=c))(config)
        tflops = lambda ms: geometry.flops / (ms * 1e-3) / 1e12  # noqa: E731
        results = {name: {"cold": [], "warm": [], "do_bench": []} for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                results[name]["cold"].append(tflops(kernel_ms(call, cold=True)))
                results[name]["warm"].append(tflops(kernel_ms(call, cold=False)))
                results[name]["do_bench"].append(common.bench_tflops(call, geometry.flops)["tflops"])
        median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
        print(f"\n{label}: {geometry.describe()}   TFLOPS: kernel cold (no host time) | kernel warm | "
              f"do_bench end to end; host us per call")
        for name, r in results.items():
            print(f"   {name:<34} cold {median(r['cold']):6.1f} ({' '.join(f'{v:.0f}' for v in r['cold'])})  "
                  f"warm {median(r['warm']):6.1f}  do_bench {median(r['do_bench']):6.1f} "
                  f"({' '.join(f'{v:.0f}' for v in r['do_bench'])})  host {host_us(calls[name]):5.0f} us",
                  flush=True)


if __name__ == "__main__":
    main()
