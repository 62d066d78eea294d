"""What Gluon (Triton 3.9) offers on Hopper for thread-block clusters with TMA multicast: compiled
ahead of time for sm_90 (no GPU needed), and run and checked against torch where a Hopper GPU is.

    python scripts/cluster_probe.py          # compile the four probes for sm_90, show their PTX
    python scripts/cluster_probe.py --run    # and run the runnable ones on this GPU

Lesson 05's bandwidth-bound layers read every A tile once per column of tiles and every weight
tile once per row of tiles, all through L2. In a cluster of two CTAs that share a tile, TMA
multicast loads it once and writes it into both CTAs' shared memory. Gluon describes a cluster as
one program over `num_ctas` CTAs: a shared buffer's `cga_layout` says how its rows are spread
over the CTAs (`[[1, 0]]`: split, each CTA holds half; `[[0, 0]]`: every CTA holds the whole
tile), and `multicast=True` on a load of a shared tile multicasts it. In Triton 3.9 a barrier is
one per CTA (`mbarrier.allocate_mbarrier()`), Triton itself fences its initialisation and syncs
the cluster before the first multicast reaches it, and ends the kernel with a cluster barrier.

Five probes, each a 2-CTA cluster:
- `weights`: each CTA loads its own 128 pixels of A (split) and the pair shares one 128 x 64
  weight tile (multicast), then one WGMMA per CTA: a pair of row tiles sharing B.
- `im2col`: the pair shares one 128-pixel im2col box (multicast) and each CTA multiplies it by its
  own 64 filters: a pair of column tiles sharing A, as cuDNN's 1x2 clusters do, for 3x3 layers
  too. Run at two filter taps (the centre, and a corner that reads the zero padding).
- `pair_barrier`: `arrive(from_cta=0)` on a barrier in each CTA, both waiting: where an arrive
  can go across the pair.
- `im2col_split`: each CTA loads its own half of a 256-pixel im2col box (split, no multicast).
- `pair_arrive_both_ways`: every CTA arrives on both CTAs' barriers (`multicast_cta=1`, the
  arrive Gluon 3.9 offers in its Rubin module), the signal a pipelined pair needs.
What they compile to with Triton 3.9, and do on an H100 (`--run`):
- weights: one `cp.async.bulk.tensor...multicast::cluster` with a CTA mask, issued by rank 0,
  each CTA waiting on its own barrier; both CTAs' products match torch.
- im2col multicast: assembles, the offsets before the CTA mask as the PTX ISA wants (Triton 3.8
  emitted the mask first and ptxas rejected the line: "Vector expected for argument 4"); both CTAs'
  products match torch, at the centre tap and at the corner tap.
- pair barrier: `from_cta=0` is a broadcast: the leader alone arrives, on both CTAs' barriers.
  Gluon 3.9 has no arrive from the second CTA on the leader's barrier (3.8's barrier laid out over
  the pair had one, and is gone), and that is the signal a pipelined pair needs: the leader's loader
  may refill a shared stage only when both CTAs' consumers have released it.
- im2col split: still the wrong pixels: Triton offsets the second CTA's box by 128 in its W
  coordinate, as it would a tiled box's rows; in im2col mode the pixels 128 places further along
  the walk start elsewhere (the next image row, or the next image); run, the load faults. A CTA's
  own pixels must come from its own box.
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
from triton.experimental.gluon.language.nvidia.rubin import mbarrier as rubin_mbarrier  # noqa: E402

CTAS = gl.constexpr(2)
SPLIT_ROWS = gl.constexpr([[1, 0]])   # cga_layout: CTA c holds rows [c * rows / 2, (c + 1) * rows / 2)
SPLIT_COLUMNS = gl.constexpr([[0, 1]])  # cga_layout: CTA c holds columns [c * cols / 2, (c + 1) * cols / 2)
SHARED = gl.constexpr([[0, 0]])       # cga_layout: every CTA holds the whole tile


@gluon.jit
def per_cta_barrier(count: gl.constexpr = 1):
    """One barrier in each CTA of the pair. Triton fences its initialisation for the cluster and
    syncs the pair before a multicast load may reach it."""
    bar = mbarrier.allocate_mbarrier()
    mbarrier.init(bar, count=count)
    return bar


@gluon.jit
def cluster_rank(like):
    """This CTA's rank in its cluster, as a tensor shaped like `like` (Gluon has no builtin for it)."""
    return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r,r", [like], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def weights_probe(a_desc, w_desc, out_desc, num_warps: gl.constexpr):
    PIXELS: gl.constexpr = a_desc.block_type.shape[0]      # over the cluster: 2 x 128
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [PIXELS, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_K], w_desc.layout)
    bar = per_cta_barrier()
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
    """`arrive(from_cta=0)` on a barrier of count 1 in each CTA, then both CTAs wait on their own
    copy and write a 1 to out[rank]: a CTA that writes got the leader's arrive (one that did not
    would wait forever, and the run would report a hang)."""
    bar = per_cta_barrier()
    cluster.barrier()
    mbarrier.arrive(bar, from_cta=0)
    mbarrier.wait(bar, 0)
    one_per_cta: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0], cga_layout=[[1]])
    rank = gl.arange(0, 2, one_per_cta)          # CTA c holds element c: each CTA stores its own
    gl.store(out_ptr + rank, gl.full_like(rank, 1).to(gl.float32))


@gluon.jit
def pair_arrive_both_ways_probe(out_ptr, num_warps: gl.constexpr):
    """Each CTA arrives on its own barrier and on its partner's (`multicast_cta=1`), barriers of
    count 2; both wait and write a 1 to out[rank]."""
    bar = per_cta_barrier(count=2)
    cluster.barrier()
    rubin_mbarrier.arrive(bar, multicast_cta=1)
    mbarrier.wait(bar, 0)
    one_per_cta: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0], cga_layout=[[1]])
    rank = gl.arange(0, 2, one_per_cta)
    gl.store(out_ptr + rank, gl.full_like(rank, 1).to(gl.float32))


@gluon.jit
def im2col_probe(in_desc, w_desc, out_desc, tap_r, tap_s, num_warps: gl.constexpr):
    """The pair of column tiles: one im2col box of 128 pixels at filter tap (tap_r, tap_s) of a 3x3
    window, multicast to both CTAs, times each CTA's own 64 filters (one WGMMA per CTA); each CTA
    stores its 64 output columns. A CTA that got wrong pixels writes wrong columns."""
    PIXELS: gl.constexpr = in_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]       # over the cluster: 2 x 64
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [PIXELS, BLOCK_K], in_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_K], w_desc.layout)
    bar = per_cta_barrier()
    mbarrier.expect(bar, in_desc.nbytes_per_cta + w_desc.nbytes_per_cta)
    tma.async_load_im2col(in_desc, [0, -1, -1, 0], [gl.to_tensor(tap_r).to(gl.int16), gl.to_tensor(tap_s).to(gl.int16)],
                          bar, a_smem, multicast=True)
    tma.async_load(w_desc, [0, 0], bar, w_smem)
    mbarrier.wait(bar, 0)
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N // 2, 16], cga_layout=SPLIT_COLUMNS)
    acc = warpgroup_mma(a_smem, w_smem.permute((1, 0)), gl.zeros([PIXELS, BLOCK_N], gl.float32, layout))
    out_smem = gl.allocate_shared_memory(gl.bfloat16, [PIXELS, BLOCK_N], out_desc.layout)
    out_smem.store(acc.to(gl.bfloat16))
    fence_async_shared()
    tma.async_store(out_desc, [0, 0], out_smem)
    tma.store_wait(0)


@gluon.jit
def im2col_split_probe(in_desc, out_ptr, num_warps: gl.constexpr):
    """A 256-pixel im2col box (the window's centre tap) split over the pair, each CTA loading its
    own half and writing it to its rows of `out`."""
    PIXELS: gl.constexpr = in_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = in_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [PIXELS, BLOCK_K], in_desc.layout)
    bar = per_cta_barrier()
    mbarrier.expect(bar, in_desc.nbytes_per_cta)
    tma.async_load_im2col(in_desc, [0, -1, -1, 0], [gl.to_tensor(1).to(gl.int16), gl.to_tensor(1).to(gl.int16)],
                          bar, a_smem)
    mbarrier.wait(bar, 0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0], cga_layout=SPLIT_ROWS)
    rows = gl.arange(0, PIXELS, gl.SliceLayout(1, layout))[:, None]
    offsets = rows * BLOCK_K + gl.arange(0, BLOCK_K, gl.SliceLayout(0, layout))[None, :]
    gl.store(out_ptr + offsets, a_smem.load(layout))


def nvmma_layout(cga_layout):
    return gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=gl.constexpr(cga_layout).value)


def build_weights_probe(device="cpu"):
    """(kernel, args, kwargs, check): 2 x 128 pixels x 64 channels, 128 filters; `check` compares
    what a run wrote with torch (A @ W^T)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    pixels, channels, filters = 2 * 128, 64, 128
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(pixels, channels, generator=generator).to(device, torch.bfloat16)
    w = torch.randn(filters, channels, generator=generator).to(device, torch.bfloat16)
    out = torch.zeros(pixels, filters, dtype=torch.bfloat16, device=device)
    descriptors = (TensorDescriptor.from_tensor(a, [pixels, channels], nvmma_layout(SPLIT_ROWS)),
                   TensorDescriptor.from_tensor(w, [filters, channels], nvmma_layout(SHARED)),
                   TensorDescriptor.from_tensor(out, [pixels, filters], nvmma_layout(SPLIT_ROWS)))

    def check():
        expected = (a.float() @ w.float().T).to(torch.bfloat16)
        return [f"CTA {cta}: {close_rows(out[128 * cta:128 * (cta + 1)], expected[128 * cta:128 * (cta + 1)])}"
                for cta in range(2)]
    return weights_probe, descriptors, dict(num_warps=4, num_ctas=CTAS.value), check


def close_rows(got, expected):
    """"128 of 128 rows match torch" (bf16 tolerance), as a run reports it."""
    good = torch.isclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2).all(dim=1)
    return f"{int(good.sum())} of {len(good)} rows match torch"


def expected_im2col_box(x, pixels, tap):
    """The box's rows by torch: output pixel p = (h, w) of image 0 reads x[0, h + r - 1, w + s - 1]
    (zero outside the image) for the 3x3 window's tap (r, s), padding 1."""
    padded = torch.nn.functional.pad(x[0].float(), (0, 0, 1, 1, 1, 1))          # H and W padded by 1
    r, s = tap
    return padded[r:r + x.shape[1], s:s + x.shape[2]].reshape(-1, x.shape[3])[:pixels]


def im2col_box_descriptor(x, pixels, cga_layout):
    """An im2col box of `pixels` x 64 channels of an NHWC input for a 3x3 window, padding 1 (lesson
    03's corners: lower -padding, upper (out - 1) * stride - padding - (size - 1) = -1)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptorIm2Col
    return TensorDescriptorIm2Col.from_tensor(x, [pixels, 64], nvmma_layout(cga_layout), padding="zero",
                                              element_strides=[1, 1, 1, 1], pixel_box_lower_corner=[-1, -1],
                                              pixel_box_upper_corner=[-1, -1])


def build_im2col_probe(device="cpu", tap=(1, 1)):
    """(kernel, args, kwargs, check): 128 pixels of a 2 x 16 x 16 x 64 NHWC input multicast to the
    pair, 2 x 64 filters (each CTA its own 64); `check` compares each CTA's columns with torch."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 16, 64, generator=generator).to(device, torch.bfloat16)
    w = torch.randn(128, 64, generator=generator).to(device, torch.bfloat16)
    out = torch.zeros(128, 128, dtype=torch.bfloat16, device=device)
    args = (im2col_box_descriptor(x, 128, SHARED), TensorDescriptor.from_tensor(w, [128, 64], nvmma_layout(SPLIT_ROWS)),
            TensorDescriptor.from_tensor(out, [128, 128], nvmma_layout(SPLIT_COLUMNS)), *tap)

    def check():
        expected = (expected_im2col_box(x.float(), 128, tap) @ w.float().T).to(torch.bfloat16)
        return [f"CTA {cta}: {close_rows(out[:, 64 * cta:64 * (cta + 1)], expected[:, 64 * cta:64 * (cta + 1)])}"
                for cta in range(2)]
    return im2col_probe, args, dict(num_warps=4, num_ctas=CTAS.value), check


def build_pair_barrier_probe(device="cpu"):
    out = torch.zeros(2, device=device)
    return pair_barrier_probe, (out,), dict(num_warps=4, num_ctas=CTAS.value), \
        lambda: [f"CTA {cta} saw the leader's arrive: {bool(out[cta] == 1)}" for cta in range(2)]


def build_pair_arrive_both_ways_probe(device="cpu"):
    out = torch.zeros(2, device=device)
    return pair_arrive_both_ways_probe, (out,), dict(num_warps=4, num_ctas=CTAS.value), \
        lambda: [f"CTA {cta} saw both arrives: {bool(out[cta] == 1)}" for cta in range(2)]


def build_im2col_split_probe(device="cpu"):
    """(kernel, args, kwargs, check): a 256-pixel im2col box over the pair, 128 pixels per CTA."""
    x = torch.randn(2, 16, 16, 64, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    out = torch.zeros(256, 64, dtype=torch.bfloat16, device=device)

    def check():
        expected = expected_im2col_box(x, 256, (1, 1))
        return [f"CTA {cta}'s half: {close_rows(out[128 * cta:128 * (cta + 1)], expected[128 * cta:128 * (cta + 1)])}"
                for cta in range(2)]
    return im2col_split_probe, (im2col_box_descriptor(x, 256, SPLIT_ROWS), out), \
        dict(num_warps=4, num_ctas=CTAS.value), check


def _compile_here(name):
    """Runs in the subprocess: compile one probe for sm_90 and print the outcome as JSON. On a ptxas
    error Triton prints a report with the whole PTX; it is captured, and only the rejected line kept."""
    kernel, args, kwargs, _ = PROBES[name]()
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


def _run_here(name, options_json):
    """Runs in the subprocess: one probe on this GPU (one cluster of two CTAs), its check's lines as JSON."""
    options = {key: tuple(value) if isinstance(value, list) else value for key, value in json.loads(options_json).items()}
    kernel, args, kwargs, check = PROBES[name]("cuda", **options)
    kernel[(1,)](*args, **kwargs)
    torch.cuda.synchronize()
    print("PROBE-JSON:" + json.dumps(check()))


def run_probe(name, timeout=60, **options):
    """Runs one probe on this GPU and returns its check's lines, in a fresh process with a time
    limit: a cluster whose barriers never complete hangs, and must not hang the caller."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--run-one", name, json.dumps(options)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"hung: no result after {timeout} s"]
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-JSON:"):
            return json.loads(line[len("PROBE-JSON:"):])
    return [f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"]


def run_probes():
    common.require_tma_mma_gpu("the cluster probes")
    runs = (("weights", {}, "weights multicast, then one WGMMA per CTA"),
            ("im2col", dict(tap=(1, 1)), "pixels (im2col) multicast, each CTA its own 64 filters; the centre tap"),
            ("im2col", dict(tap=(0, 0)), "the same at the corner tap (reads the zero padding)"),
            ("pair_barrier", {}, "the leader's arrive(from_cta=0) on a barrier in each CTA"),
            ("im2col_split", {}, "each CTA its own half of a 256-pixel im2col box"))
    for name, options, title in runs:
        print(f"{title}:")
        for line in run_probe(name, **options):
            print("   " + line)


PROBES = {"weights": build_weights_probe, "im2col": build_im2col_probe,
          "pair_barrier": build_pair_barrier_probe, "im2col_split": build_im2col_split_probe,
          "pair_arrive_both_ways": build_pair_arrive_both_ways_probe}


def main():
    if sys.argv[1:2] == ["--compile"]:
        return _compile_here(sys.argv[2])
    titles = (("weights", "weights (tiled) multicast"), ("im2col", "pixels (im2col) multicast"),
              ("pair_barrier", "arrive(from_cta=0): the leader's arrive on both CTAs' barriers"),
              ("im2col_split", "each CTA its own half of an im2col box"),
              ("pair_arrive_both_ways", "every CTA's arrive on both CTAs' barriers (multicast_cta=1)"))
    if sys.argv[1:2] == ["--run-one"]:
        return _run_here(sys.argv[2], sys.argv[3])
    if sys.argv[1:2] == ["--run"]:
        return run_probes()
    for name, title in titles:
        outcome = compile_probe(name)
        print(f"\n{title}, 2-CTA cluster, sm_90:")
        if outcome["error"]:
            print(f"   does not compile: {outcome['error'].split(':', 1)[0]}")
            for line in outcome["error"].splitlines():
                if "error" in line and "ptxas" in line:
                    print("   " + line.split("; ", 1)[-1].strip())
            if outcome["rejected"]:
                print(f"   the line ptxas rejects:\n   {outcome['rejected']}")
            continue
        rank_read = False
        for line in outcome["ptx"].splitlines():
            text = line.strip()
            if "%cluster_ctarank" in text:        # the probe's own rank reads repeat per register
                if rank_read:
                    continue
                rank_read = True
            if (text.startswith(".reqnctapercluster") or "multicast::cluster" in text or "barrier.cluster" in text
                    or "mbarrier.init" in text or "mbarrier.arrive" in text or "skipWait" in text
                    or "cluster_ctarank" in text or "cp.async.bulk.tensor" in text
                    or (name == "im2col_split" and text.startswith(("shl.b32", "add.s32", "and.b32")))):
                print("   " + text[:140])


if __name__ == "__main__":
    main()
