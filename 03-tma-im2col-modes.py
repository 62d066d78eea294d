"""
Lesson 03: Hopper's TMA im2col mode, pixel by pixel
===================================================

What you will learn:

- why the per-tap address arithmetic of lesson 02 belongs in hardware, and what TMA im2col does
  (TMA, the Tensor Memory Accelerator, is the copy engine of NVIDIA's Hopper GPUs, compute
  capability 9.0 or "sm_90", and data-centre Blackwell GPUs, "sm_100");
- Gluon, Triton's lower-level dialect (`triton.experimental.gluon`), where a kernel names the
  hardware's instructions, layouts and shared-memory buffers itself: the TMA loads need it;
- the descriptor: block shape [pixels, channels], the pixel-box corners, element strides, the
  padding fill, and how a load walks its access window row by row and wraps into the next image;
- five worked examples (basic, padded, offset, multi-batch, padded multi-batch), each printed
  pixel by pixel with where it came from, and drawn;
- a pure-PyTorch reference model of the copy engine that agrees with the hardware bit for bit;
- how a convolution maps onto the descriptor, and proof (with the model) that one load per filter
  tap gathers exactly the rows of lesson 02's im2col matrix.

What changed since lesson 02: the A tile of the implicit GEMM is no longer gathered by our own
address arithmetic; one TMA instruction per (tap, channel block) brings it in.

Requires: sm_90 (Hopper) or sm_100 (Blackwell) for the hardware parts. On a CPU the reference model
runs every example and draws every plot, and the Gluon kernel is compiled ahead of time for sm_90
and sm_100 to show the im2col copy instruction; the hardware runs are skipped with a reason.

Run:  python 03-tma-im2col-modes.py [--outdir out]      Tests:  pytest 03-tma-im2col-modes.py
"""

# %%
import itertools
import random

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor, TensorDescriptorIm2Col

# %%
# The lesson runs section by section: each `if __name__ == "__main__"` cell below runs the demo of
# the section above it (importing the lesson runs nothing).
if __name__ == "__main__":
    args = common.lesson_args("Lesson 03: TMA im2col mode")
    outdir = common.output_dir(args.outdir)


# %%
# Why a copy engine mode for convolution
# --------------------------------------
# Lesson 02's implicit GEMM spends, in its innermost loop, integer work on every tap: decode the
# output pixel, add r*dh and s*dw, compare against the image bounds, build a mask, compute a
# 64-bit address per row. That costs registers and issue slots right where the tensor cores
# should be fed. Hopper's Tensor Memory Accelerator (TMA) has an *im2col* mode that does all of it
# in the copy engine: a descriptor built once on the host encodes the tensor, the conv stride and
# the padding; the kernel says "start at (n, h, w, c), shifted by this tap's (dh, dw)" and gets a
# [pixels, channels] tile in shared memory, with out-of-image pixels filled with zeros.
#
# The descriptor (TensorDescriptorIm2Col) for an NHWC tensor [N, H, W, C]:
#
# - block_shape = [pixels, channels]: one load brings `pixels` pixels, `channels` channels each,
#   as a row-major [pixels, channels] tile: exactly a tile of the im2col matrix A.
# - pixel_box_lower_corner = [lo_h, lo_w], pixel_box_upper_corner = [up_h, up_w]: the access window
#   of every image, relative to the image:
#
#       lower = pixel_box_lower_corner + offsets
#       upper = [H-1, W-1] + pixel_box_upper_corner + offsets          (both inclusive)
#
#   Negative lower corners reach into padding; negative upper corners stop before the edge.
# - element_strides = [1, sh, sw, 1]: the walk steps sh rows and sw columns at a time.
# - padding = "zero" (or "nan"): the fill for window pixels that lie outside the real image. The
#   tensor in memory is never padded.
#
# A load gets coord = [n, h, w, c] and offsets = [dh, dw] (16-bit). Its first pixel is
# (n, h+dh, w+dw); the following ones walk the window row-major (w fastest, then h) and, at the
# window's end, wrap into the next image n+1. Channels c .. c+channels-1 of each pixel are copied;
# channels past C are zero-filled too.
#
# One trap, found by this lesson's differential test on an H100 (2026-11-22): the offsets are
# *unsigned* 16-bit numbers. An offset of -1 is 65535, every pixel lands far outside the image, and
# the whole box comes back as padding. Convolution only ever needs offsets r*dh, s*dw >= 0, so put
# any negative shift into the start coordinate (or the lower corner), never into the offsets.
#
# The reference model below is that paragraph as code. It is the single source of truth for the
# plots and for the CPU runs, and the GPU tests check that the hardware agrees with it exactly.

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
# The smallest Gluon program that shows the copy engine at work. One mbarrier tracks the load:
# `expect` tells it how many bytes will land (the whole box, padding included), the load arrives
# on it when they have, and `wait` blocks until then. A TMA store then copies the shared-memory
# tile to a plain [pixels, channels] tensor we can print.


@gluon.jit
def tma_im2col_copy_kernel(in_desc, out_desc, coord_n, coord_h, coord_w, coord_c, offset_h, offset_w):
    tile = gl.allocate_shared_memory(in_desc.dtype, in_desc.block_shape, in_desc.layout)
    loaded = mbarrier.allocate_mbarrier()
    mbarrier.init(loaded, count=1)
    mbarrier.expect(loaded, in_desc.block_type.nbytes)
    # Offsets are 16-bit in the instruction. (to_tensor: an int argument equal to 1 arrives as a
    # compile-time constant, which has no .to().)
    tma.async_load_im2col(in_desc, [coord_n, coord_h, coord_w, coord_c],
                          [gl.to_tensor(offset_h).to(gl.int16), gl.to_tensor(offset_w).to(gl.int16)],
                          loaded, tile)
    mbarrier.wait(loaded, phase=0)
    mbarrier.invalidate(loaded)
    fence_async_shared()
    tma.async_store(out_desc, [0, 0], tile)
    tma.store_wait(pendings=0)


TORCH_TO_GL = {torch.float32: gl.float32, torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def make_im2col_descriptors(x_nhwc, out, block_pixels, block_channels, pixel_box_lower_corner,
                            pixel_box_upper_corner, element_strides, padding="zero"):
    """Host descriptors for the copy kernel: im2col on the input, tiled on the [pixels, channels] output."""
    common.validate_im2col_settings(tuple(x_nhwc.shape), x_nhwc.element_size(), block_pixels,
                                    block_channels, pixel_box_lower_corner, pixel_box_upper_corner,
                                    element_strides)
    block = [block_pixels, block_channels]
    layout = gl.NVMMASharedLayout.get_default_for(block, TORCH_TO_GL[x_nhwc.dtype])
    in_desc = TensorDescriptorIm2Col.from_tensor(
        x_nhwc, block, layout, padding=padding, element_strides=list(element_strides),
        pixel_box_lower_corner=list(pixel_box_lower_corner),
        pixel_box_upper_corner=list(pixel_box_upper_corner))
    out_desc = TensorDescriptor.from_tensor(out, block, layout)
    return in_desc, out_desc


def tma_im2col_load(x_nhwc, block_pixels, block_channels, pixel_box_lower_corner,
                    pixel_box_upper_corner, element_strides, coord, offsets, padding="zero"):
    """Run one TMA im2col load on the GPU and return the [block_pixels, block_channels] tile."""
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
# All use an NHWC tensor whose every pixel holds its 1-based pixel index in all 32 fp32 channels,
# so a loaded value names its source: pixel (n, h, w) holds n*H*W + h*W + w + 1. The block is
# [16 pixels, 32 channels]. Each example lists what it should load, written from the rules above.

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


# The order a reader meets them in: the ones that show a rule first, the trivial one last.
EXAMPLE_ORDER = ["padded", "offset", "multi-batch", "padded multi-batch", "basic"]


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
    where = ("on this GPU's copy engine" if common.has_tma_mma_gpu() else
             "on the reference model (hardware loads need a Hopper or Blackwell GPU; the GPU tests "
             "check that the hardware agrees with the model)")
    print(f"\nFive TMA im2col loads of a 16-pixel x 32-channel box, {where}. The input is NHWC "
          f"[N, 4, 4, 32]; pixel (n, h, w) holds n*16 + h*4 + w + 1, so each loaded value names its "
          f"source; '.' is padding (zero). --verbose lists every pixel's source.")
    for name in EXAMPLE_ORDER:
        run_example(name, verbose="listing" if args.verbose else True)

# %%
# Pictures of the access windows
# ------------------------------
# Each picture shows the image(s) of the example with their pixel values, the access window
# (dashed red: where the walk goes, after the offsets), the padding cells the window covers
# (grey, hatched: filled with zeros, never read), and each loaded pixel numbered in load order.
# In the multi-batch examples the numbering runs off the end of image 0 and carries on in image 1.


def draw_access(axes, x_shape, positions, lower, upper, offsets, values=None, max_labels=64):
    """Draw each image of x_shape, the access window, the padding it covers and the load order.

    `positions` is the walk of the reference model (im2col_walk), so picture and model agree."""
    import matplotlib.patches as patches
    N, H, W, _ = x_shape
    win_top, win_left = lower[0] + offsets[0], lower[1] + offsets[1]
    win_bottom, win_right = H - 1 + upper[0] + offsets[0], W - 1 + upper[1] + offsets[1]
    shifted = tuple(offsets) != (0, 0)      # then also draw where the window was before the offsets
    top, left = min(0, win_top, lower[0] if shifted else 0), min(0, win_left, lower[1] if shifted else 0)
    bottom, right = max(H - 1, win_bottom), max(W - 1, win_right)
    for n, ax in enumerate(axes):
        for h, w in itertools.product(range(top, bottom + 1), range(left, right + 1)):
            inside_image = 0 <= h < H and 0 <= w < W
            in_window = win_top <= h <= win_bottom and win_left <= w <= win_right
            if inside_image:
                ax.add_patch(patches.Rectangle((w - 0.5, h - 0.5), 1, 1, facecolor="white",
                                               edgecolor="black", lw=0.8))
                if values is not None:
                    ax.text(w, h - 0.22, str(values(n, h, w)), ha="center", va="center",
                            fontsize=8, color="#555555")
            elif in_window:
                ax.add_patch(patches.Rectangle((w - 0.5, h - 0.5), 1, 1, facecolor="#e4e4e4",
                                               edgecolor="#999999", hatch="//", lw=0.6))
        ax.add_patch(patches.Rectangle((win_left - 0.5, win_top - 0.5), win_right - win_left + 1,
                                       win_bottom - win_top + 1, fill=False, edgecolor="red", lw=2,
                                       ls="--"))
        if shifted:     # the window the corners alone give, and the offsets' shift to the red one
            base_top, base_left = lower[0], lower[1]
            ax.add_patch(patches.Rectangle((base_left - 0.5, base_top - 0.5), win_right - win_left + 1,
                                           win_bottom - win_top + 1, fill=False, edgecolor="#888888",
                                           lw=1.5, ls=":"))
            ax.annotate("", xy=(win_left - 0.45, win_top - 0.45), xytext=(base_left - 0.45, base_top - 0.45),
                        arrowprops=dict(arrowstyle="->", color="#444444", lw=1.5))
            ax.text(base_left - 0.45, base_top - 0.55, f"window before offsets {list(offsets)}",
                    fontsize=7, color="#444444", va="bottom")
        for order, (pn, ph, pw) in enumerate(positions):
            if pn != n:
                continue
            padded = not (0 <= ph < H and 0 <= pw < W)
            ax.add_patch(patches.Circle((pw, ph + 0.15), 0.27, color="#808080" if padded else "#1f5fbf"))
            if len(positions) <= max_labels:
                ax.text(pw, ph + 0.15, str(order), ha="center", va="center", fontsize=7,
                        color="white", fontweight="bold")
        ax.set_xlim(left - 0.6, right + 0.6)
        ax.set_ylim(bottom + 0.6, top - 0.6)
        ax.set_aspect("equal")
        ax.set_xticks(range(left, right + 1))
        ax.set_yticks(range(top, bottom + 1))
        ax.set_xlabel("w (column)")
        ax.set_ylabel("h (row)")
        ax.set_title(f"image n={n}", fontsize=10)


def plot_example(name, outdir):
    spec = EXAMPLES[name]
    x_nhwc = pixel_index_tensor(spec["N"])
    _, sources = im2col_reference(x_nhwc, 16, 32, spec["lower"], spec["upper"], [1, 1, 1, 1],
                                  spec["coord"], spec["offsets"])
    positions = im2col_walk(x_nhwc.shape, 16, spec["lower"], spec["upper"], [1, 1, 1, 1],
                            spec["coord"], spec["offsets"])
    import textwrap
    fig, axes = common.new_figure(1, spec["N"], figsize=(4.2 * spec["N"] + 1.5, 5.6), squeeze=False,
                                  layout="constrained")     # room for the title above the panels
    draw_access(axes[0], x_nhwc.shape, positions, spec["lower"], spec["upper"], spec["offsets"],
                values=lambda n, h, w: n * 16 + h * 4 + w + 1)
    width = 50 * spec["N"] + 10
    title = [f"TMA im2col example '{name}': corners {spec['lower']}/{spec['upper']}, "
             f"coord {spec['coord']}, offsets {spec['offsets']}", EXAMPLE_NOTES[name],
             "red dashed = access window" + (", grey dotted = the window before the offsets shift it"
                                             if tuple(spec["offsets"]) != (0, 0) else "")
             + ", hatched = padding (filled with 0), circles = loaded pixels in load order"]
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title), fontsize=9)
    return common.save_figure(fig, outdir, "03_example_" + name.replace(" ", "_").replace("-", "_"),
                              {"example": name, **{k: v for k, v in spec.items()},
                               "sources": [s if s != PADDING else "padding" for s in sources]})


def test_plots_are_written(tmp_path):
    for name in EXAMPLES:
        assert plot_example(name, tmp_path).stat().st_size > 10_000
    assert plot_conv_k_loop(tmp_path).stat().st_size > 10_000


# %%
if __name__ == "__main__":
    for name in EXAMPLE_ORDER:
        plot_example(name, outdir)

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
# TMA im2col has no dilation field; a dilated tap is just a larger offset. A tile that runs past
# the last output pixel of an image continues with the next image, as the rows of A do, and past
# the last image it reads padding (zeros), which the kernel never stores.
#
# `gather_im2col_with_tma_model` builds A one (tile, tap, channel block) load at a time from the
# model; the test compares it with lesson 02's explicit im2col kernel on a grid of shapes.


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
        print(f"  {geometry.M // 16 + (geometry.M % 16 > 0)} tiles x {R * S} taps x "
              f"{-(-Ci // 8)} channel blocks of modelled TMA loads rebuild lesson 02's A "
              f"[{geometry.M} x {geometry.K}] exactly")
    return a_model


CONV_MAPPING_CASES = [  # every combination below that has an output
    (N, H, W, Ci, R, S, stride, padding, dilation)
    for N, H, W, Ci in [(1, 6, 6, 8), (2, 7, 5, 12), (3, 4, 9, 4)]
    for R, S, stride, padding, dilation in [
        (3, 3, 1, 1, 1), (3, 3, 2, 0, 1), (3, 2, 3, 2, 1), (3, 3, 1, 2, 2), (1, 1, (2, 1), 0, 1),
        (2, 3, (1, 2), (0, 1), (2, 1))]
    if common.has_output((N, H, W, Ci), (1, R, S, Ci), stride, padding, dilation)]


@pytest.mark.parametrize("N, H, W, Ci, R, S, stride, padding, dilation", CONV_MAPPING_CASES)
def test_conv_mapping_rebuilds_lesson02_im2col(N, H, W, Ci, R, S, stride, padding, dilation):
    run_conv_mapping(N, H, W, Ci, R, S, stride, padding, dilation, verbose=False)


def plot_conv_k_loop(outdir, H=5, W=6, R=3, S=3, padding=1, block_pixels=16):
    """One M-tile of a 3x3 conv: the same window, shifted by each tap's offsets."""
    geometry = common.conv_geometry((1, H, W, 4), (1, R, S, 4), 1, padding)
    settings = common.conv_im2col_settings(geometry)
    fig, axes = common.new_figure(R, S, figsize=(3.3 * S, 3.1 * R), squeeze=False)
    for r, s in itertools.product(range(R), range(S)):
        offsets = settings.tap_offsets(r, s)
        positions = im2col_walk((1, H, W, 4), block_pixels, settings.pixel_box_lower_corner,
                                settings.pixel_box_upper_corner, settings.element_strides,
                                settings.start_coord(0), offsets)
        draw_access([axes[r][s]], (1, H, W, 4), positions, settings.pixel_box_lower_corner,
                    settings.pixel_box_upper_corner, offsets)
        axes[r][s].set_title(f"tap (r={r}, s={s}): offsets {offsets}", fontsize=9)
    fig.suptitle(f"One tile of A ({block_pixels} output pixels) for a {R}x{S} conv, pad {padding}, "
                 f"on a {H}x{W} image: one TMA im2col load per tap\n"
                 f"corners {list(settings.pixel_box_lower_corner)}/{list(settings.pixel_box_upper_corner)}, "
                 f"coord {settings.start_coord(0)}; circle k = row k of the tile (grey = padding, loaded as 0)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return common.save_figure(fig, outdir, "03_conv_k_loop")


# %%
if __name__ == "__main__":
    run_conv_mapping()
    plot_conv_k_loop(outdir)

# %%
# Settings the copy engine rejects
# --------------------------------
# The model checks what the hardware (and Triton's host descriptor) would refuse, with errors
# that say which setting and what is allowed.


@pytest.mark.parametrize("change, message", [
    (dict(x_shape=(4, 4, 32)), "rank 4"),
    (dict(block_pixels=2048), "block_pixels must be a power of two <= 1024"),
    (dict(block_pixels=24), "block_pixels"),
    (dict(block_channels=512), "block_channels"),
    (dict(x_shape=(1, 4, 4, 3)), "misaligned channel stride"),
    (dict(lower=[-200, 0]), r"\[-128, 127\]"),
    (dict(element_strides=[1, 9, 1, 1]), "element_strides"),
    (dict(element_strides=[1, 1, 1, 2]), "element_strides"),
    (dict(coord=[0, 1, 0, 0], element_strides=[1, 2, 1, 1]), "stride lattice"),
    (dict(coord=[0, 7, 0, 0]), "outside the access window"),
])
def test_reference_model_rejects_bad_settings(change, message):
    settings = dict(x_shape=(1, 4, 4, 32), block_pixels=16, block_channels=32, lower=[0, 0],
                    upper=[0, 0], element_strides=[1, 1, 1, 1], coord=[0, 0, 0, 0])
    settings.update(change)
    x_nhwc = torch.zeros(settings["x_shape"])
    with pytest.raises(ValueError, match=message):
        im2col_reference(x_nhwc, settings["block_pixels"], settings["block_channels"], settings["lower"],
                         settings["upper"], settings["element_strides"], settings["coord"], [0, 0])


def test_negative_offsets_read_only_padding():
    # Measured on an H100 (see the prose above): offsets are unsigned, -1 reads 65535 pixels away.
    x_nhwc = pixel_index_tensor(1)
    tile, sources = im2col_reference(x_nhwc, 16, 32, [-1, -1], [-1, -1], [1, 1, 1, 1],
                                     [0, 0, 0, 0], [1, -1])
    assert sources == [PADDING] * 16 and not tile.any()


def test_conv_settings_reject_out_of_range_padding():
    geometry = common.conv_geometry((1, 300, 300, 8), (8, 3, 3, 8), 1, 130)
    with pytest.raises(ValueError, match="pixel-box corners"):
        common.conv_im2col_settings(geometry)


# %%
# What the compiler makes of it (no GPU needed)
# ---------------------------------------------
# The kernel compiles ahead of time for sm_90 and sm_100 on any machine. Its PTX holds one
# `cp.async.bulk.tensor.4d...im2col` instruction: the whole gather, padding included, is that one
# line; and a `cp.async.bulk.tensor.2d` for the TMA store.

IM2COL_COPY = "cp.async.bulk.tensor.4d.shared::cta.global.im2col"
TMA_STORE = "cp.async.bulk.tensor.2d.global.shared::cta"


def run_show_ptx(verbose=True):
    found = {}
    for arch in common.ARCH_CAPABILITY:
        compiled = common.aot_compile_or_say_why("03-tma-im2col-modes", "aot_tma_im2col_copy", arch)
        if compiled is None:
            continue
        ptx = compiled["ptx"]
        lines = [line.strip() for line in ptx.splitlines() if "cp.async.bulk.tensor" in line]
        found[arch] = lines
        if verbose:
            print(f"\n{arch}: the TMA instructions of tma_im2col_copy_kernel")
            for line in lines:
                print("   ", line)
    return found


@pytest.mark.parametrize("arch", list(common.ARCH_CAPABILITY))
def test_kernel_compiles_to_im2col_copy(arch):
    ptx = common.aot_compile_or_skip("03-tma-im2col-modes", "aot_tma_im2col_copy", arch)["ptx"]
    counts = common.ptx_instructions(ptx, [IM2COL_COPY, TMA_STORE])
    assert counts[IM2COL_COPY] >= 1, "no TMA im2col load in the PTX"
    assert counts[TMA_STORE] >= 1, "no TMA store in the PTX"


# %%
if __name__ == "__main__":
    run_show_ptx()

# %%
# Hardware versus model, at random (GPU only)
# -------------------------------------------
# The five examples check a handful of settings. The differential test draws hundreds of random
# ones (shapes, corners, element strides, start coordinates, offsets, channel offsets, fp32, fp16
# and bf16, zero and NaN fill) and runs each through the copy engine and the model. Every element
# must match exactly; any mismatch is printed with its settings.


def random_im2col_case(rng):
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    element_size = torch.empty(0, dtype=dtype).element_size()
    lanes = 16 // element_size                     # channels per 16 bytes
    N, H, W = rng.randint(1, 3), rng.randint(1, 9), rng.randint(1, 9)
    C = lanes * rng.randint(1, 6)
    block_channels = lanes * rng.choice([1, 2, 4])
    block_pixels = rng.choice([16, 32, 64, 128])
    element_strides = [1, rng.randint(1, 3), rng.randint(1, 3), 1]
    while True:
        lower = [rng.randint(-3, 0), rng.randint(-3, 0)]
        upper = [rng.randint(-2, 2), rng.randint(-2, 2)]
        if H - 1 + upper[0] >= lower[0] and W - 1 + upper[1] >= lower[1]:
            break
    lattice_h = list(range(lower[0], H + upper[0], element_strides[1]))
    lattice_w = list(range(lower[1], W + upper[1], element_strides[2]))
    coord = [rng.randint(0, N - 1), rng.choice(lattice_h), rng.choice(lattice_w),
             lanes * rng.randint(0, C // lanes - 1)]
    # Mostly the offsets a convolution uses (>= 0); sometimes a negative one, which the hardware
    # reads as a huge unsigned offset.
    offsets = [rng.randint(0, 3), rng.randint(0, 3)]
    if rng.random() < 0.1:
        offsets[rng.randint(0, 1)] = -rng.randint(1, 2)
    padding = "nan" if rng.random() < 0.15 else "zero"
    return dict(dtype=dtype, shape=(N, H, W, C), block_pixels=block_pixels,
                block_channels=block_channels, pixel_box_lower_corner=lower,
                pixel_box_upper_corner=upper, element_strides=element_strides, coord=coord,
                offsets=offsets, padding=padding)


def run_differential(count=256, seed=0, verbose=True):
    rng = random.Random(seed)
    mismatches = []
    for index in range(count):
        case = random_im2col_case(rng)
        dtype, shape = case.pop("dtype"), case.pop("shape")
        x_nhwc = (torch.randn(shape) * 8).round().to(dtype).cuda()
        hardware = tma_im2col_load(x_nhwc, **case).cpu()
        model, _ = im2col_reference(x_nhwc, **case)
        same = torch.equal(torch.nan_to_num(hardware, nan=12345.0), torch.nan_to_num(model, nan=12345.0))
        if not same:
            mismatches.append((index, str(dtype), shape, case))
    if verbose:
        print(f"\ndifferential test: {count} random TMA im2col loads, {len(mismatches)} mismatches "
              f"between hardware and model")
        for mismatch in mismatches[:10]:
            print("   mismatch:", mismatch)
    return mismatches


@pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
def test_hardware_matches_model_on_random_settings():
    mismatches = run_differential(count=256, verbose=False)
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"


# %%
if __name__ == "__main__":
    if common.has_tma_mma_gpu():
        mismatches = run_differential()
        assert not mismatches
        print(f"\nlesson 03: all checks passed on {common.gpu_name()}")
    else:
        print("\n" + common.cpu_closing_line(
            "03", "the five examples and the conv mapping on the reference model, and the kernel's "
            "sm_90 and sm_100 builds", "the copy engine's own loads and the hardware-vs-model test"))
