"""
Lesson 03: Hopper's TMA im2col mode, pixel by pixel
===================================================

What you will learn:

- what TMA im2col does: the Tensor Memory Accelerator (TMA), the copy unit of Hopper (sm_90) and
  data-centre Blackwell (sm_100), gathers a tile of the im2col matrix, padding included, from a
  descriptor; in Gluon (`triton.experimental.gluon`), where a kernel names smem, barriers, copies;
- the asynchronous machinery every later lesson uses: the mbarrier (expect-tx, phase parity,
  invalidate), the async proxy and when it needs a fence, the NVMMA shared layout and its swizzle;
- the descriptor (block shape, pixel-box corners, element strides, padding fill) and five worked
  examples, each printed pixel by pixel and drawn, on an exact reference model of the copy;
- how a convolution maps onto the descriptor: one load per (tile, tap, channel block) rebuilds
  lesson 02's im2col matrix exactly.

What changed since lesson 02: no GEMM runs here; this lesson studies the one instruction that
lesson 04 uses in place of lesson 02's address arithmetic.

Requires: sm_90 (Hopper) or sm_100 (Blackwell) for the hardware loads. On a CPU the reference model
runs every example and draws every plot, and the Gluon kernel is compiled ahead of time for sm_90
and sm_100 to show its instructions; the hardware loads are skipped with a reason.

Further reading: Triton's Gluon tutorials (triton-lang/triton, python/tutorials/gluon/): TMA,
WGMMA, tcgen05, and conv-im2col (13-conv-im2col.py as of 2026-11), whose five examples (tensor,
settings, expected values) are the ones below, here also run on a reference model and drawn.

Run:  python 03-tma-im2col-modes.py [--outdir out] [--verbose]
Tests:  pytest 03-tma-im2col-modes.py tests/lessons/test_03_model.py tests/lessons/test_03_figures.py
"""

# %%
import itertools
import sys

import common  # first: on a machine without a GPU it turns on the Triton interpreter
import lesson_figures  # the figures' drawing code (it teaches nothing about TMA)

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor, TensorDescriptorIm2Col

# For the website (sphinx-gallery): a cell's figures one under another, each as wide as drawn, not side by
# side shrunk to 42% of the page.
# sphinx_gallery_multi_image = "single"

# %%
# Each `if __name__ == "__main__"` cell runs the demo of the section above it.
if __name__ == "__main__":
    args = common.lesson_args("Lesson 03: TMA im2col mode")
    outdir = common.output_dir(args.outdir)


# %%
# Why a TMA mode for convolution
# ------------------------------
# Lesson 02's implicit GEMM decodes its output pixels once per program, but on every tap it adds
# r*dh and s*dw, compares against the image bounds, builds a mask and a 64-bit address per row,
# and on every channel block it adds the channel offset and masks again. That is integer work and
# registers in the warps that feed the tensor cores. Hopper's Tensor Memory Accelerator (TMA) has
# an *im2col* mode that does it in the TMA unit: a descriptor built once on the host encodes
# the tensor, the conv stride and the padding; the kernel says "start at (n, h, w, c), shifted by
# this tap's offsets" and gets a [pixels, channels] tile in shared memory, with pixels outside the
# image filled with the padding value.
#
# Notation: a load's *offsets* are [off_h, off_w]; the convolution's *dilation* is (dh, dw), and
# for tap (r, s) a convolution passes off_h = r*dh, off_w = s*dw.
#
# The descriptor (TensorDescriptorIm2Col) for an NHWC tensor [N, H, W, C]:
#
# - block_shape = [pixels, channels]: one load brings `pixels` pixels, `channels` channels each,
#   as a row-major [pixels, channels] tile: exactly a tile of the im2col matrix A.
# - pixel_box_lower_corner, pixel_box_upper_corner: the access window of every image, relative to
#   the image; with a load's offsets it spans (both bounds inclusive)::
#
#       lower = pixel_box_lower_corner + [off_h, off_w]
#       upper = [H-1, W-1] + pixel_box_upper_corner + [off_h, off_w]
#
#   Negative lower corners reach into padding; negative upper corners stop before the edge.
# - element_strides = [1, sh, sw, 1]: the walk steps sh rows and sw columns at a time.
# - padding = "zero" or "nan": the fill for window pixels outside the real image. The tensor in
#   memory is never padded.
#
# A load gets coord = [n, h, w, c] and offsets = [off_h, off_w] (16-bit). Its first pixel is
# (n, h+off_h, w+off_w); the next ones walk the window row-major (w fastest) and past its end wrap
# into image n+1. Channels c .. c+channels-1 are copied; channels past C are padding too.
#
# One trap, found by this lesson's hardware-vs-model test on an H100 (2026-11-22): the offsets are
# *unsigned* 16-bit (the kernel passes int16 bits). An offset of -1 is 65535: every pixel lands
# outside the image and the whole box is padding. A convolution's offsets r*dh, s*dw are >= 0; put
# a negative shift into the start coordinate (or the lower corner), never into the offsets.
#
# The reference model below is that paragraph as code, the source of the plots and CPU runs; the
# GPU tests check the hardware agrees exactly (tests/lessons/test_03_model.py, random settings).
#
# The model refuses a start coordinate outside the window or off its stride lattice (unmodelled,
# and no convolution makes one); common.validate_im2col_settings checks what the descriptor rejects.

PADDING = "padding"   # the source of a pixel that was filled, not read


def im2col_walk(x_shape, block_pixels, pixel_box_lower_corner, pixel_box_upper_corner,
                element_strides, coord, offsets):
    """The (n, h, w) each of the block's pixels reads, in load order (possibly outside the tensor).

    The walk happens in window coordinates, before the offsets are added: start at coord, step w
    by the element stride, wrap to the next window row past the upper corner, and past the last
    row wrap to the first row of the next image."""
    N, H, W, C = x_shape
    if element_strides[0] != 1:
        raise ValueError(f"the model walks the batch one image at a time: element_strides[0] must "
                         f"be 1, got {element_strides[0]}")
    stride_h, stride_w = element_strides[1], element_strides[2]
    low_h, low_w = pixel_box_lower_corner
    high_h, high_w = H - 1 + pixel_box_upper_corner[0], W - 1 + pixel_box_upper_corner[1]
    n, h, w, _ = coord
    # The instruction's offsets are unsigned 16-bit: -1 means 65535 (see above).
    offsets = [offset % 2 ** 16 for offset in offsets]
    if high_h < low_h or high_w < low_w:
        raise ValueError(f"empty access window: h in [{low_h}, {high_h}], w in [{low_w}, {high_w}]")
    if not (low_h <= h <= high_h and low_w <= w <= high_w):
        raise ValueError(f"coord (h, w) = ({h}, {w}) lies outside the access window "
                         f"h in [{low_h}, {high_h}], w in [{low_w}, {high_w}]")
    if (h - low_h) % stride_h or (w - low_w) % stride_w:
        raise ValueError(f"coord (h, w) = ({h}, {w}) is not on the window's stride lattice "
                         f"(lower corner ({low_h}, {low_w}), element strides ({stride_h}, {stride_w}))")
    positions = []
    for _ in range(block_pixels):
        positions.append((n, h + offsets[0], w + offsets[1]))
        w += stride_w                      # next pixel: w first,
        if w > high_w:
            w, h = low_w, h + stride_h     # then the next window row,
            if h > high_h:
                h, n = low_h, n + 1        # then the next image.
    return positions


def im2col_reference(x_nhwc, block_pixels, block_channels, pixel_box_lower_corner,
                     pixel_box_upper_corner, element_strides, coord, offsets, padding="zero"):
    """What one TMA im2col load puts in shared memory, computed in plain PyTorch.

    Returns (tile, sources): tile is [block_pixels, block_channels] in x's dtype; sources[i] is the
    (n, h, w) pixel i was read from, or PADDING when it was filled."""
    if not isinstance(x_nhwc, torch.Tensor):
        raise TypeError(f"x_nhwc must be a torch.Tensor, got {type(x_nhwc).__name__}")
    common.validate_im2col_settings(tuple(x_nhwc.shape), x_nhwc.element_size(), block_pixels,
                                    block_channels, pixel_box_lower_corner, pixel_box_upper_corner,
                                    element_strides)
    if padding not in ("zero", "nan"):
        raise ValueError(f"padding must be 'zero' or 'nan', got {padding!r}")
    if len(coord) != 4 or len(offsets) != 2:
        raise ValueError(f"coord must be [n, h, w, c] and offsets [dh, dw], got {coord} and {offsets}")
    if not all(-2 ** 15 <= offset < 2 ** 16 for offset in offsets):
        raise ValueError(f"offsets are 16-bit values, got {offsets}")
    N, H, W, C = x_nhwc.shape
    positions = im2col_walk(x_nhwc.shape, block_pixels, pixel_box_lower_corner,
                            pixel_box_upper_corner, element_strides, coord, offsets)
    fill = 0.0 if padding == "zero" else float("nan")
    tile = torch.full((block_pixels, block_channels), fill, dtype=x_nhwc.dtype)
    x_cpu = x_nhwc.detach().cpu()
    c0 = coord[3]
    # Channels outside [0, C) are filled too, whatever the pixel.
    first, last = max(c0, 0), min(c0 + block_channels, C)
    sources = []
    for pixel, (n, h, w) in enumerate(positions):
        if 0 <= n < N and 0 <= h < H and 0 <= w < W:
            sources.append((n, h, w))
            if first < last:
                tile[pixel, first - c0:last - c0] = x_cpu[n, h, w, first:last]
        else:
            sources.append(PADDING)
    return tile, sources


# %%
# The kernel: one TMA im2col load, then a TMA store
# -------------------------------------------------
# The smallest Gluon program that shows the TMA unit at work. It meets four pieces of Hopper's
# asynchronous machinery, which lessons 04 and 05 use on every K-step.
#
# Shared memory in the NVMMA layout. `gl.allocate_shared_memory` takes a layout, here the
# descriptor's: `NVMMASharedLayout`, the arrangement TMA writes and the tensor cores (wgmma,
# tcgen05) read. Its swizzle permutes the 16-byte chunks of each 128-byte row: chunk j of row i is
# stored at chunk position j XOR (i mod 8), so the same chunk of 8 consecutive rows lies in 8
# different groups of 4 banks (a 16-byte chunk spans 4 of the 32), together all 32, and reading
# down a column does not queue on the same banks. For a [16, 32] fp32 tile
# (128-byte rows) `get_default_for` picks the 128-byte swizzle. The TMA store uses the same layout
# and un-swizzles on the way out, so the tile we print is in plain order.
#
# The mbarrier tracks the load. It is a 64-bit object in shared memory holding a phase bit, the
# arrivals the current phase still expects and a transaction count of bytes still expected:
#
# - `mbarrier.init(bar, count=1)`: one arrival completes a phase. A fresh barrier counts as if
#   phase parity 1 had just completed, so the first phase to wait for has parity 0;
# - `mbarrier.expect(bar, nbytes)` (PTX `mbarrier.arrive.expect_tx`): this thread arrives and
#   announces nbytes more bytes: the whole box, padding included (16 x 32 x 4 = 2048 here);
# - the TMA load counts its bytes off as they land (`mbarrier::complete_tx::bytes`); when no
#   arrival and no byte is outstanding, the phase completes and the phase bit flips;
# - `mbarrier.wait(bar, phase=0)` (PTX `mbarrier.try_wait.parity`) returns once the phase of
#   parity 0 has completed. A barrier reused in a loop is waited on with parity 0, 1, 0, ...:
#   lesson 04 flips that bit after every wait (`phase ^= 1`); lesson 05's ring counter derives it,
#   with the ring slot, from one running count;
# - `mbarrier.invalidate(bar)` (`mbarrier.inval`): the PTX ISA requires it before the barrier's
#   8 bytes are used as anything else. This kernel ends right after, so here it is good form.
#
# The async proxy. TMA reads and writes shared memory through the *async proxy*, a path apart
# from the threads' own loads and stores (the *generic proxy*, which `cp.async` also uses).
# Accesses through different proxies are not ordered: where one writes and the other reads the
# same shared memory, a `fence.proxy.async` (Gluon: `fence_async_shared()`) must sit between them,
# e.g. threads st.shared a tile that a TMA store or a wgmma then reads (lesson 02's PTX has one
# between its `cp.async` copies and its `wgmma`). Here load and store are both TMA: both go
# through the async proxy, and the wait on the load's mbarrier orders the store after the load's
# bytes have landed: no cross-proxy fence between them (nor in Triton's TMA tutorial). The threads'
# own loads may read the tile after that wait: the ISA attaches a proxy fence to the completion.
#
# A TMA store completes through a bulk group: `tma.store_wait(0)` waits until none reads smem.


@gluon.jit
def tma_im2col_copy_kernel(in_desc, out_desc, coord_n, coord_h, coord_w, coord_c, offset_h, offset_w):
    tile = gl.allocate_shared_memory(in_desc.dtype, in_desc.block_shape, in_desc.layout)
    loaded = mbarrier.allocate_mbarrier()
    mbarrier.init(loaded, count=1)
    # arrive, and expect the box's bytes
    mbarrier.expect(loaded, in_desc.block_type.nbytes)
    # Offsets are 16-bit (to_tensor: an int argument equal to 1 arrives as a constexpr, without .to()).
    tma.async_load_im2col(in_desc, [coord_n, coord_h, coord_w, coord_c],
                          [gl.to_tensor(offset_h).to(gl.int16), gl.to_tensor(offset_w).to(gl.int16)],
                          loaded, tile)
    # wait for phase 0: the arrival and all the bytes
    mbarrier.wait(loaded, phase=0)
    mbarrier.invalidate(loaded)
    # TMA load and TMA store are both async proxy: no fence between them
    tma.async_store(out_desc, [0, 0], tile)
    tma.store_wait(pendings=0)


def make_im2col_descriptors(x_nhwc, out, block_pixels, block_channels, pixel_box_lower_corner,
                            pixel_box_upper_corner, element_strides, padding="zero"):
    """Host descriptors for the copy kernel: im2col on the input, tiled on the [pixels, channels] output."""
    common.validate_im2col_settings(tuple(x_nhwc.shape), x_nhwc.element_size(), block_pixels,
                                    block_channels, pixel_box_lower_corner, pixel_box_upper_corner,
                                    element_strides)
    block = [block_pixels, block_channels]
    layout = gl.NVMMASharedLayout.get_default_for(block, common.GL_DTYPES[x_nhwc.dtype])
    in_desc = TensorDescriptorIm2Col.from_tensor(
        x_nhwc, block, layout, padding=padding, element_strides=list(element_strides),
        pixel_box_lower_corner=list(pixel_box_lower_corner),
        pixel_box_upper_corner=list(pixel_box_upper_corner))
    out_desc = TensorDescriptor.from_tensor(out, block, layout)
    return in_desc, out_desc


def tma_im2col_load(x_nhwc, block_pixels, block_channels, pixel_box_lower_corner,
                    pixel_box_upper_corner, element_strides, coord, offsets, padding="zero"):
    """One TMA im2col load on the GPU: the [block_pixels, block_channels] tile."""
    common.require_tma_mma_gpu("tma_im2col_load")
    out = torch.full((block_pixels, block_channels), -1.0, device=x_nhwc.device, dtype=x_nhwc.dtype)
    in_desc, out_desc = make_im2col_descriptors(x_nhwc, out, block_pixels, block_channels,
                                                pixel_box_lower_corner, pixel_box_upper_corner,
                                                element_strides, padding)
    tma_im2col_copy_kernel[(1,)](in_desc, out_desc, *coord, *offsets, num_warps=1)
    torch.cuda.synchronize()
    return out


def aot_tma_im2col_copy(arch):
    """Launch arguments of the copy kernel on CPU tensors, for common.aot_compile."""
    x_nhwc = torch.zeros(1, 4, 4, 32)
    out = torch.zeros(16, 32)
    in_desc, out_desc = make_im2col_descriptors(x_nhwc, out, 16, 32, [-1, -1], [-1, -1], [1, 1, 1, 1])
    return tma_im2col_copy_kernel, (in_desc, out_desc, 0, -1, -1, 0, 1, 1), {"num_warps": 1}


# %%
# The five examples
# -----------------
# Triton's conv-im2col tutorial's five examples, basic first. All use an NHWC tensor whose every
# pixel holds its 1-based pixel index in all 32 fp32 channels, so a loaded value names its source:
# pixel (n, h, w) holds n*H*W + h*W + w + 1. The block is [16 pixels, 32 channels]. Each example
# lists what it should load, written from the rules above.

EXAMPLES = {
    # name: (N, corners lower/upper, coord, offsets, expected values of the 16 pixels)
    "basic": dict(N=1, lower=[0, 0], upper=[0, 0], coord=[0, 0, 0, 0], offsets=[0, 0],
                  expected=list(range(1, 17))),
    "padded": dict(N=1, lower=[-1, -1], upper=[-1, -1], coord=[0, -1, -1, 0], offsets=[0, 0],
                   expected=[0, 0, 0, 0, 0, 1, 2, 3, 0, 5, 6, 7, 0, 9, 10, 11]),
    "offset": dict(N=1, lower=[-1, -1], upper=[-1, -1], coord=[0, -1, -1, 0], offsets=[1, 1],
                   expected=list(range(1, 17))),
    "multi-batch": dict(N=2, lower=[0, 0], upper=[0, 0], coord=[0, 1, 3, 0], offsets=[0, 0],
                        expected=list(range(8, 24))),
    "padded multi-batch": dict(N=2, lower=[-1, -1], upper=[-1, -1], coord=[0, 1, 2, 0], offsets=[0, 0],
                               expected=[7, 0, 9, 10, 11, 0, 0, 0, 0, 0, 17, 18, 19, 0, 21, 22]),
}
EXAMPLE_NOTES = {
    "basic": "window = the image, so the 16 pixels come out in memory order",
    "padded": "window h, w in [-1, 2]: row -1 and column -1 are outside the image, filled with 0",
    "offset": "same window, shifted by offsets (+1, +1) onto the image itself",
    "multi-batch": "starts at (0, 1, 3), runs to the end of image 0 and wraps into image 1",
    "padded multi-batch": "padded window of both images; the walk wraps from image 0 into image 1's padding",
}


def pixel_index_tensor(N, H=4, W=4, C=32, dtype=torch.float32, device_name="cpu"):
    """NHWC tensor whose pixel (n, h, w) holds its 1-based index n*H*W + h*W + w + 1 in every channel."""
    index = torch.arange(1, N * H * W + 1, dtype=torch.float32).reshape(N, H, W, 1)
    return index.expand(N, H, W, C).contiguous().to(device_name, dtype)


def run_example(name, on_hardware=None, verbose=True):
    spec = EXAMPLES[name]
    x_nhwc = pixel_index_tensor(spec["N"])
    settings = dict(block_pixels=16, block_channels=32, pixel_box_lower_corner=spec["lower"],
                    pixel_box_upper_corner=spec["upper"], element_strides=[1, 1, 1, 1],
                    coord=spec["coord"], offsets=spec["offsets"])
    model_tile, sources = im2col_reference(x_nhwc, **settings)
    on_hardware = common.has_tma_mma_gpu() if on_hardware is None else on_hardware
    tile = tma_im2col_load(x_nhwc.cuda(), **settings).cpu() if on_hardware else model_tile
    values = [int(v) for v in tile[:, 0].tolist()]
    if verbose:
        print(f"  {name:<19} corners {str(spec['lower']):>8}/{str(spec['upper']):<8} coord "
              f"{str(spec['coord']):<13} offsets {str(spec['offsets']):<7} -> "
              + " ".join(f"{v:2d}" if s != PADDING else " ." for v, s in zip(values, sources)))
        print(f"  {'':<19} {EXAMPLE_NOTES[name]}")
    if verbose == "listing":
        for i, (value, source) in enumerate(zip(values, sources)):
            origin = "padding" if source == PADDING else "(n=%d, h=%d, w=%d)" % source
            print(f"      pixel {i:2d}: {value:3d}  <- {origin}")
    # Exact: this is data movement, every channel of every pixel must match.
    assert values == spec["expected"], f"{name}: loaded {values}, expected {spec['expected']}"
    torch.testing.assert_close(tile, model_tile, rtol=0, atol=0)
    return tile, sources


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_reference_model(name):
    run_example(name, on_hardware=False, verbose=False)


@pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_hardware(name):
    run_example(name, on_hardware=True, verbose=False)


# %%
if __name__ == "__main__":
    where = ("on this GPU's TMA unit" if common.has_tma_mma_gpu() else "on the reference model "
             "(hardware loads need a Hopper or Blackwell GPU)")
    print(f"\nFive TMA im2col loads of a 16-pixel x 32-channel box, {where}. The input is NHWC "
          f"[N, 4, 4, 32]; pixel (n, h, w) holds n*16 + h*4 + w + 1, so each loaded value names its "
          f"source; '.' is padding (zero). --verbose lists every pixel's source.")
    for name in EXAMPLES:
        run_example(name, verbose="listing" if args.verbose else True)

# %%
# Pictures of the access windows
# ------------------------------
# One figure per example, its images stacked: the pixel values, the access window (dashed red,
# after the offsets; grey dotted before them, where they are not zero), the padding cells it covers
# (grey, hatched: filled, never read), each loaded pixel numbered in load order (in the multi-batch
# examples the numbering runs off the end of image 0 into image 1).

if __name__ == "__main__":
    for name in EXAMPLES:
        lesson_figures.plot_example(sys.modules[__name__], name, outdir)

# %%
# From the descriptor to a convolution
# ------------------------------------
# Lesson 02's A matrix has one row per output pixel m = (n, oy, ox) and one column per
# k = (r, s, ci). Its rows m0 .. m0+BLOCK_M-1, restricted to tap (r, s), are the input pixels
# (n, oy*sh - ph + r*dh, ox*sw - pw + s*dw) for consecutive output pixels. One descriptor gives
# all of them (common.conv_im2col_settings does this arithmetic)::
#
#     element_strides        = [1, sh, sw, 1]             consecutive outputs are a stride apart
#     pixel_box_lower_corner = [-ph, -pw]                 the window starts in the padding
#     pixel_box_upper_corner = [(out_h-1)*sh - ph - (H-1), (out_w-1)*sw - pw - (W-1)]
#                                                         ... and ends at the last output's top-left tap,
#                                                         so each image contributes out_h*out_w pixels
#     coord   = [n, oy*sh - ph, ox*sw - pw, c0]           where tile m0 = (n, oy, ox) starts
#     offsets = [r*dh, s*dw]                              the same walk, shifted onto tap (r, s)
#
# TMA im2col has no dilation field: a dilated tap is a larger offset. A tile running past an image's
# last output pixel continues in the next image, as A's rows do; past the last image it reads
# padding (zeros), which the kernel never stores.
#
# `gather_im2col_with_tma_model` builds A one (tile, tap, channel block) load at a time from the
# model; tests/lessons/test_03_model.py compares it with lesson 02's explicit im2col on a grid of
# strides, paddings, dilations and shapes.


def gather_im2col_with_tma_model(x_nhwc, R, S, stride=1, padding=0, dilation=1, BLOCK_M=16, BLOCK_K=8):
    """Lesson 02's im2col matrix, assembled from modelled TMA im2col loads (one per tile, tap, block)."""
    geometry = common.conv_geometry(x_nhwc.shape, (1, R, S, x_nhwc.shape[-1]), stride, padding, dilation)
    settings = common.conv_im2col_settings(geometry)
    Ci = geometry.Ci
    a_matrix = torch.full((geometry.M, geometry.K), float("nan"), dtype=x_nhwc.dtype)
    for m0 in range(0, geometry.M, BLOCK_M):
        rows = min(BLOCK_M, geometry.M - m0)
        for r, s in itertools.product(range(R), range(S)):
            for c0 in range(0, Ci, BLOCK_K):
                tile, _ = im2col_reference(x_nhwc, BLOCK_M, BLOCK_K, settings.pixel_box_lower_corner,
                                           settings.pixel_box_upper_corner, settings.element_strides,
                                           settings.start_coord(m0, c0), settings.tap_offsets(r, s))
                cols = min(BLOCK_K, Ci - c0)
                column = (r * S + s) * Ci + c0
                a_matrix[m0:m0 + rows, column:column + cols] = tile[:rows, :cols]
                # What the kernel will multiply but never store: rows past the last image and
                # channels past Ci must be zeros, or they would pollute the dot products.
                assert not tile[rows:].any() and not tile[:, cols:].any()
    return a_matrix


def run_conv_mapping(N=2, H=7, W=6, Ci=12, R=3, S=3, stride=(2, 1), padding=1, dilation=1, verbose=True):
    lesson02 = common.load_lesson("02-im2col-explicit")
    x_nhwc = torch.randn(N, H, W, Ci)
    a_model = gather_im2col_with_tma_model(x_nhwc, R, S, stride, padding, dilation)
    a_lesson02 = lesson02.im2col(x_nhwc.to(common.device()), R, S, stride, padding, dilation).cpu()
    torch.testing.assert_close(a_model, a_lesson02, rtol=0, atol=0)
    if verbose:
        geometry = common.conv_geometry(x_nhwc.shape, (1, R, S, Ci), stride, padding, dilation)
        settings = common.conv_im2col_settings(geometry)
        print(f"\nconv {geometry.describe()}: descriptor element_strides {list(settings.element_strides)}, "
              f"corners {list(settings.pixel_box_lower_corner)}/{list(settings.pixel_box_upper_corner)}")
        print(f"  {-(-geometry.M // 16)} tiles x {R * S} taps x {-(-Ci // 8)} channel blocks of "
              f"modelled TMA loads rebuild lesson 02's A [{geometry.M} x {geometry.K}] exactly")
    return a_model


# %%
if __name__ == "__main__":
    run_conv_mapping()
    lesson_figures.plot_conv_k_loop(sys.modules[__name__], outdir)

# %%
# What the compiler makes of it (no GPU needed)
# ---------------------------------------------
# The kernel compiles ahead of time for sm_90 and sm_100 on any machine. The whole gather, padding
# included, is one `cp.async.bulk.tensor.4d...im2col`; around it, the barrier's life and the store.

TAUGHT = {arch: [
    ("mbarrier.init", "one arrival completes a phase (count=1)"),
    ("mbarrier.arrive.expect_tx", "expect: arrive, and announce the box's bytes"),
    (common.PTX_IM2COL_LOAD, "the im2col load: descriptor, [n, h, w, c], the two 16-bit offsets, the barrier"),
    ("mbarrier.try_wait.parity", "wait: loops until the phase of parity 0 has completed"),
    ("mbarrier.inval", "invalidate: the barrier's memory may be reused"),
    (common.PTX_TMA_STORE, "the TMA store of the tile (async proxy, like the load: no fence before it)"),
    ("cp.async.bulk.wait_group", "store_wait(0): no bulk store still reading shared memory"),
] for arch in common.ARCH_CAPABILITY}


def run_show_ptx():
    return common.show_ptx("03-tma-im2col-modes", "aot_tma_im2col_copy", TAUGHT,
                           lambda arch, compiled: "the instructions of tma_im2col_copy_kernel")


@pytest.mark.parametrize("arch", list(common.ARCH_CAPABILITY))
def test_kernel_compiles_to_im2col_copy(arch):
    compiled = common.assert_ptx_teaches("03-tma-im2col-modes", "aot_tma_im2col_copy", arch, TAUGHT)
    counts = common.ptx_instructions(compiled["ptx"], [common.PTX_IM2COL_LOAD, "fence.proxy.async"])
    assert counts[common.PTX_IM2COL_LOAD] == 1, "one load, one im2col instruction"
    assert counts["fence.proxy.async"] == 0, "no cross-proxy fence: load and store are both async proxy"


# %%
if __name__ == "__main__":
    run_show_ptx()

# %%
# What lesson 03 measured, what limits it, what comes next
# --------------------------------------------------------
# Measured: the five examples and a convolution's every (tile, tap, channel block) load agree with
# the reference model, which rebuilds lesson 02's im2col matrix exactly; on a Hopper or Blackwell
# GPU the TMA unit agrees with the model bit for bit; the PTX holds one instruction per gather.
#
# What limits it: nothing here computes. Corners fit in signed 8 bits, strides go up to 8, Ci x
# element size must be a multiple of 16 bytes (`common.pad_channels_for_tma` pads Ci=3), and the
# copy is asynchronous: a kernel that uses it schedules the barriers itself.
#
# Next: lesson 04 puts this load in the K loop of an implicit GEMM, beside a tiled TMA load of the
# weights, and feeds the tiles to the tensor cores (wgmma on Hopper, tcgen05 on Blackwell) with
# the mbarrier rules taught here.

# %%
if __name__ == "__main__":
    if common.has_tma_mma_gpu():
        print(f"\nlesson 03: all checks passed on {common.gpu_name()} (pytest "
              f"tests/lessons/test_03_model.py runs the random hardware-vs-model test)")
    else:
        print("\n" + common.cpu_closing_line(
            "03", "the five examples and the conv mapping on the reference model, and the kernel's "
            "sm_90 and sm_100 builds", "the TMA unit's own loads and the hardware-vs-model test"))
