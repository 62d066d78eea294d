"""What Gluon (Triton 3.8) offers on Hopper for thread-block clusters with TMA multicast: compiled
ahead of time for sm_90, no GPU needed.

    python scripts/cluster_probe.py

Lesson 05's bandwidth-bound layers (ResNet-50's 1x1 convs) read every A tile once per column of
tiles and every weight tile once per row of tiles, all through L2. In a cluster of two CTAs that
share a tile, TMA multicast loads it once and writes it into both CTAs' shared memory. Gluon
describes a cluster as one program over `num_ctas` CTAs: a shared buffer's `cga_layout` says how
its rows are spread over the CTAs (`[[1, 0]]`: split, each CTA holds half; `[[0, 0]]`: every CTA
holds the whole tile), and `multicast=True` on a load of a shared tile multicasts it.

Four probes, each a 2-CTA cluster:
- `weights_probe`: each CTA loads its own 128 pixels of A (split) and the cluster shares one
  128 x 64 weight tile (multicast), then one WGMMA per CTA: what sharing B would look like.
- `im2col_probe`: the cluster shares one im2col box of pixels (multicast), what sharing A
  would look like.
- `pair_barrier_probe`: both CTAs arrive on one barrier laid out across the pair
  (`MBarrierLayout.multicta`), then wait on it: how one CTA's consumer would tell the other
  CTA's loader that a stage is free.
- `im2col_probe` again, split: each CTA loads its own half of a 256-pixel im2col box (split, no
  multicast): what each CTA loading its own pixels would look like for a 3x3 layer.
What they compile to:
- weights: compiles. The PTX has `.reqnctapercluster 2`, cluster barriers, and a
  `cp.async.bulk.tensor...multicast::cluster` with a CTA mask, issued by the leader CTA (rank 0).
- im2col multicast: does not. Triton 3.8 emits its CTA mask before the im2col offsets, where the
  PTX ISA puts the offsets first, and ptxas rejects the line ("Vector expected for argument 4").
- pair barrier: a remote arrive exists. The barrier lives in the leader CTA only (initialised
  there), the other CTA's arrive goes to the leader's copy (`mbarrier.arrive.shared::cluster` on
  the leader's address), and only the leader waits: the other CTA skips the wait. The weights
  probe's barrier is of this kind too, so there the second CTA reads its tiles without waiting
  for them: a barrier both CTAs must wait on has to be one per CTA.
- im2col split: compiles, with the wrong pixels. Triton offsets the second CTA's box by 128 in
  its W coordinate, as it would a tiled box's rows; in im2col mode the pixels 128 places further
  along the walk start elsewhere (the next image row, or the next image).
So on sm_90 with this Triton a cluster can share weights and release stages across the pair, but
each CTA's own pixels can only be loaded through tiled descriptors: 1x1 stride-1 layers (pixels
as a matrix), not 3x3 ones. Lesson 05 does not use clusters (RESULTS.md, the network suite's
targets).
"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402  (first: on a machine without a GPU it turns on the Triton interpreter)

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    cluster, fence_async_shared, mbarrier, tma, warpgroup_mma)

CTAS = gl.constexpr(2)
SPLIT_ROWS = gl.constexpr([[1, 0]])   # cga_layout: CTA c holds rows [c * rows / 2, (c + 1) * rows / 2)
SHARED = gl.constexpr([[0, 0]])       # cga_layout: every CTA holds the whole tile


@gluon.jit
def cluster_barrier_init(bar):
    """The probes' barrier, laid out over the pair (it lives in the leader CTA: see
    `pair_barrier_probe`), initialised and made visible to the whole cluster before any TMA (from
    either CTA) may arrive on it."""
    mbarrier.init(bar, count=1)
    mbarrier.fence_init_release_cluster()
    cluster.barrier(relaxed=True)


@gluon.jit
def weights_probe(a_desc, w_desc, out_desc, num_warps: gl.constexpr):
    PIXELS: gl.constexpr = a_desc.block_type.shape[0]      # over the cluster: 2 x 128
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [PIXELS, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_K], w_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout.multicta(CTAS))
    cluster_barrier_init(bar)
    mbarrier.expect(bar, a_desc.nbytes_per_cta + w_desc.nbytes_per_cta)
    tma.async_load(a_desc, [gl.program_id(0) * PIXELS, 0], bar, a_smem)
    tma.async_load(w_desc, [0, 0], bar, w_smem, multicast=True)
    mbarrier.wait(bar, 0)
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16], cga_layout=SPLIT_ROWS)
    acc = warpgroup_mma(a_smem, w_smem.permute((1, 0)), gl.zeros([PIXELS, BLOCK_N], gl.float32, layout))
    out_smem = gl.allocate_shared_memory(gl.bfloat16, [PIXELS, BLOCK_N], out_desc.layout)
    out_smem.store(acc.to(gl.bfloat16))
    fence_async_shared()
    tma.async_store(out_desc, [gl.program_id(0) * PIXELS, 0], out_smem)
    tma.store_wait(0)


@gluon.jit
def pair_barrier_probe(out_ptr, num_warps: gl.constexpr):
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout.multicta(CTAS))
    mbarrier.init(bar, count=1)
    mbarrier.fence_init_release_cluster()
    cluster.barrier(relaxed=True)
    mbarrier.arrive(bar)
    mbarrier.wait(bar, 0)


@gluon.jit
def im2col_probe(in_desc, out_desc, MULTICAST: gl.constexpr, num_warps: gl.constexpr):
    """One im2col box: shared by the pair and multicast (`im2col_probe`), or split over it, each
    CTA loading its own half (the "im2col_split" probe): the descriptor's layout says which."""
    PIXELS: gl.constexpr = in_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [PIXELS, BLOCK_K], in_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout.multicta(CTAS))
    cluster_barrier_init(bar)
    mbarrier.expect(bar, in_desc.nbytes_per_cta)
    tma.async_load_im2col(in_desc, [0, -1, -1, 0], [gl.to_tensor(1).to(gl.int16), gl.to_tensor(1).to(gl.int16)],
                          bar, a_smem, multicast=MULTICAST)
    mbarrier.wait(bar, 0)
    tma.async_store(out_desc, [0, 0], a_smem)
    tma.store_wait(0)


def nvmma_layout(cga_layout):
    return gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=gl.constexpr(cga_layout).value)


def build_weights_probe():
    """(kernel, args, kwargs) on CPU tensors: 2 x 128 pixels x 64 channels, 128 filters."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    pixels, channels, filters = 2 * 128, 64, 128
    a = torch.zeros(2 * pixels, channels, dtype=torch.bfloat16)
    w = torch.zeros(filters, channels, dtype=torch.bfloat16)
    out = torch.zeros(2 * pixels, filters, dtype=torch.bfloat16)
    descriptors = (TensorDescriptor.from_tensor(a, [pixels, channels], nvmma_layout(SPLIT_ROWS)),
                   TensorDescriptor.from_tensor(w, [filters, channels], nvmma_layout(SHARED)),
                   TensorDescriptor.from_tensor(out, [pixels, filters], nvmma_layout(SPLIT_ROWS)))
    return weights_probe, descriptors, dict(num_warps=4, num_ctas=CTAS.value)


def im2col_box_descriptors(pixels, cga_layout):
    """An im2col box of `pixels` x 64 channels of a 2 x 16 x 16 NHWC input (3x3 window, padding 1),
    and a tiled output of the same box, both laid out over the pair as `cga_layout` says."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor, TensorDescriptorIm2Col
    x = torch.zeros(2, 16, 16, 64, dtype=torch.bfloat16)
    out = torch.zeros(512, 64, dtype=torch.bfloat16)
    in_desc = TensorDescriptorIm2Col.from_tensor(x, [pixels, 64], nvmma_layout(cga_layout), padding="zero",
                                                 element_strides=[1, 1, 1, 1], pixel_box_lower_corner=[-1, -1],
                                                 pixel_box_upper_corner=[-2, -2])
    return in_desc, TensorDescriptor.from_tensor(out, [pixels, 64], nvmma_layout(cga_layout))


def build_im2col_probe():
    """(kernel, args, kwargs): one 128-pixel im2col box, shared by the pair."""
    return im2col_probe, im2col_box_descriptors(128, SHARED), dict(MULTICAST=True, num_warps=4, num_ctas=CTAS.value)


def build_pair_barrier_probe():
    return pair_barrier_probe, (torch.zeros(4),), dict(num_warps=4, num_ctas=CTAS.value)


def build_im2col_split_probe():
    """(kernel, args, kwargs): a 256-pixel im2col box over the pair, 128 pixels per CTA."""
    return im2col_probe, im2col_box_descriptors(256, SPLIT_ROWS), dict(MULTICAST=False, num_warps=4,
                                                                        num_ctas=CTAS.value)


def _compile_here(name):
    """Runs in the subprocess: compile one probe for sm_90 and print the outcome as JSON. On a ptxas
    error Triton prints a report with the whole PTX; it is captured, and only the rejected line kept."""
    kernel, args, kwargs = PROBES[name]()
    outcome = {"ptx": None, "error": None, "rejected": None}
    report = io.StringIO()
    try:
        with contextlib.redirect_stdout(report):
            outcome["ptx"] = common.compile_kernel_for_target(kernel, args, kwargs, "sm_90").asm["ptx"]
    except Exception as error:       # ptxas rejecting the PTX arrives as triton's PTXASError
        outcome["error"] = f"{type(error).__name__}: {error}"
        found = re.search(r"\.ptx, line (\d+);", str(error))
        ptx = report.getvalue()
        ptx = ptx[ptx.find("//\n// Generated by LLVM"):].splitlines()
        if found and len(ptx) >= int(found.group(1)):
            outcome["rejected"] = ptx[int(found.group(1)) - 1].strip()
    print("PROBE-JSON:" + json.dumps(outcome))


def compile_probe(name):
    """{"ptx", "error", "rejected"} of one probe compiled for sm_90, in a fresh process (as
    common.aot_compile does: the Triton interpreter a CPU machine runs the lessons with must not
    be active, and a compiler abort must not take the caller down)."""
    env = dict(os.environ, CONV_TUTORIAL_AOT="1", TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, __file__, "--compile", name], env=env, capture_output=True,
                          text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-JSON:"):
            return json.loads(line[len("PROBE-JSON:"):])
    raise RuntimeError(f"cluster probe {name!r} did not report (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


PROBES = {"weights": build_weights_probe, "im2col": build_im2col_probe,
          "pair_barrier": build_pair_barrier_probe, "im2col_split": build_im2col_split_probe}


def main():
    if sys.argv[1:2] == ["--compile"]:
        return _compile_here(sys.argv[2])
    titles = (("weights", "weights (tiled) multicast"), ("im2col", "pixels (im2col) multicast"),
              ("pair_barrier", "one barrier across the pair: arrive from both, wait"),
              ("im2col_split", "each CTA its own half of an im2col box"))
    for name, title in titles:
        outcome = compile_probe(name)
        print(f"\n{title}, 2-CTA cluster, sm_90:")
        if outcome["error"]:
            print(f"   does not compile: {outcome['error'].split(':', 1)[0]}")
            for line in outcome["error"].splitlines():
                if "error" in line and "ptxas" in line:
                    print("   " + line.split("; ", 1)[-1].strip())
            if outcome["rejected"]:
                print("   the line ptxas rejects (its CTA mask comes before the im2col offsets; the PTX ISA "
                      f"wants the offsets first):\n   {outcome['rejected']}")
            continue
        for line in outcome["ptx"].splitlines():
            text = line.strip()
            if (text.startswith(".reqnctapercluster") or "multicast::cluster" in text or "barrier.cluster" in text
                    or "mbarrier.init" in text or "mbarrier.arrive" in text or "skipWait" in text
                    or "cluster_ctarank" in text or "cp.async.bulk.tensor" in text
                    or (name == "im2col_split" and text.startswith(("shl.b32", "add.s32", "and.b32")))):
                print("   " + text[:140])


if __name__ == "__main__":
    main()
