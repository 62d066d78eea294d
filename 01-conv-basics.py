"""
Lesson 01: the sliding window, and a first Triton convolution
=============================================================

What you will learn:

- what a 2-D convolution computes, on a 3x3 input and a 2x2 filter you can check by hand;
- the general formula with batch, channels, stride, padding and dilation, and the output size;
- a scalar-filter Triton kernel: one program owns a tile of the output, walks the filter taps, and
  for each tap multiplies one filter value by one shifted tile of the input;
- how to extend it to stride, padding and many channels (NCHW);
- what that kernel costs, counted by replaying its loads: one program per output channel, so the
  input is read Co times over, and every loaded element feeds one FMA. A matrix product reuses each
  loaded value across a whole tile of outputs, on tensor cores: lesson 02.

Builds on: nothing; this is the first lesson. `common.py` holds the shared helpers.

Requires: any CUDA GPU for the GPU run; on a CPU the same kernels run in the Triton interpreter
(TRITON_INTERPRET=1, set automatically by common.py).

Run:  python 01-conv-basics.py [--outdir out]      Tests:  pytest 01-conv-basics.py
"""

# %%
import itertools

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch
import triton
import triton.language as tl

# %%
# The sliding window
# ------------------
# A convolution slides a small filter over an image. At each position the filter and the patch
# under it are multiplied element by element and summed: one dot product per output value::
#
#     input (3x3)      filter (2x2)      output (2x2)
#     a b c            w0 w1             y0 y1
#     d e f            w2 w3             y2 y3
#     g h i
#
# There are (3 - 2 + 1) x (3 - 2 + 1) = 2 x 2 positions. `run_sliding_window_example` prints the
# four dot products with numbers, then checks them against PyTorch.


def run_sliding_window_example(verbose=True):
    image = torch.arange(1.0, 10.0).reshape(3, 3)         # a..i = 1..9
    filt = torch.tensor([[1.0, 0.0], [-1.0, 2.0]])         # w0..w3
    names = [["a", "b", "c"], ["d", "e", "f"], ["g", "h", "i"]]
    out = torch.empty(2, 2)
    lines = []
    for out_y, out_x in itertools.product(range(2), range(2)):
        terms, total = [], 0.0
        for r, s in itertools.product(range(2), range(2)):
            pixel = image[out_y + r, out_x + s].item()
            weight = filt[r, s].item()
            terms.append(f"{names[out_y + r][out_x + s]}*w{2 * r + s}")
            total += pixel * weight
        out[out_y, out_x] = total
        lines.append(f"  y{2 * out_y + out_x} = {' + '.join(terms):<27} = {total:g}")
    if verbose:
        print("input (a..i = 1..9):\n", image, "\nfilter (w0..w3):\n", filt)
        print("the four dot products:")
        print("\n".join(lines))
    # The window above multiplies w0 with the top-left pixel: the filter is not flipped, which makes
    # this a cross-correlation (a textbook convolution flips it). Deep-learning libraries call it a
    # convolution all the same, and torch's conv2d computes exactly this, so it must agree exactly.
    expected = torch.nn.functional.conv2d(image[None, None], filt[None, None])[0, 0]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    return out


def test_sliding_window_example():
    out = run_sliding_window_example(verbose=False)
    # y0 = a*1 + b*0 + d*(-1) + e*2 = 1 - 4 + 10 = 7, written out from the definition.
    assert out[0, 0].item() == 1 * 1 + 2 * 0 + 4 * -1 + 5 * 2


# %%
# The general formula
# -------------------
# With a batch of N images, Ci input channels, Co filters, stride (sh, sw), padding (ph, pw) and
# dilation (dh, dw), in NCHW layout::
#
#     y[n, co, oy, ox] = sum over ci < Ci, r < R, s < S of
#                        x[n, ci, oy*sh - ph + r*dh, ox*sw - pw + s*dw] * w[co, ci, r, s]
#
# where x reads as 0 outside the image (that is what padding means). The output size::
#
#     out_h = floor((H + 2*ph - dh*(R-1) - 1) / sh) + 1      (the same for out_w)
#
# `common.conv_output_size` is that formula; `common.conv_geometry` validates a whole convolution.

# %%
# A first Triton kernel: one scalar filter, one output tile per program
# ----------------------------------------------------------------------
# Pseudocode, for one single-channel image and one filter, stride 1, no padding::
#
#     for each output tile T (BLOCK_H x BLOCK_W), in parallel:   # one Triton program
#         acc = zeros(BLOCK_H, BLOCK_W)                          # fp32
#         for r in range(R): for s in range(S):                  # the filter taps
#             w_rs = w[r, s]                                     # one scalar
#             acc += w_rs * x[T.rows + r, T.cols + s]            # one shifted input tile
#         y[T] = acc
#
# Each tap is a whole-tile multiply-add, so the program does R*S vector operations and never
# reorganises data. The masks keep the last tiles inside the image.


@triton.jit
def conv2d_scalar_filter_kernel(x_ptr, w_ptr, y_ptr, H, W, out_h, out_w,
                                R: tl.constexpr, S: tl.constexpr,
                                BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    # for each output tile T, in parallel:
    tile_y, tile_x = tl.program_id(0), tl.program_id(1)
    out_rows = tile_y * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    out_cols = tile_x * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    inside = (out_rows < out_h) & (out_cols < out_w)
    # acc = zeros(BLOCK_H, BLOCK_W)
    acc = tl.zeros((BLOCK_H, BLOCK_W), dtype=tl.float32)
    # for r in range(R): for s in range(S):
    for r in tl.static_range(R):
        for s in tl.static_range(S):
            # w_rs = w[r, s]
            w_rs = tl.load(w_ptr + r * S + s).to(tl.float32)
            # acc += w_rs * x[T.rows + r, T.cols + s]
            x_tile = tl.load(x_ptr + (out_rows + r) * W + (out_cols + s), mask=inside, other=0.0)
            acc += w_rs * x_tile.to(tl.float32)
    # y[T] = acc
    tl.store(y_ptr + out_rows * out_w + out_cols, acc.to(y_ptr.dtype.element_ty), mask=inside)


def conv2d_scalar_filter(x_hw, w_rs, block=(16, 16)):
    """Single-channel 'valid' convolution (stride 1, no padding) of an [H, W] image by an [R, S] filter."""
    if not isinstance(x_hw, torch.Tensor) or not isinstance(w_rs, torch.Tensor):
        raise TypeError("x_hw and w_rs must be torch.Tensors")
    if x_hw.dim() != 2 or w_rs.dim() != 2:
        raise ValueError(f"x_hw must be [H, W] and w_rs [R, S], got shapes {tuple(x_hw.shape)} and "
                         f"{tuple(w_rs.shape)}")
    geometry = common.conv_geometry((1, *x_hw.shape, 1), (1, *w_rs.shape, 1))
    x_hw, w_rs = x_hw.contiguous(), w_rs.contiguous()
    y = torch.empty(geometry.out_h, geometry.out_w, device=x_hw.device, dtype=x_hw.dtype)
    grid = (triton.cdiv(geometry.out_h, block[0]), triton.cdiv(geometry.out_w, block[1]))
    conv2d_scalar_filter_kernel[grid](x_hw, w_rs, y, geometry.H, geometry.W, geometry.out_h,
                                      geometry.out_w, geometry.R, geometry.S, block[0], block[1])
    return y


def run_scalar_filter(H=37, W=29, R=3, S=3, dtype=torch.float32, verbose=True):
    x_hw = torch.randn(H, W).to(common.device(), dtype)
    w_rs = torch.randn(R, S).to(common.device(), dtype)
    y = conv2d_scalar_filter(x_hw, w_rs)
    expected = common.reference_conv2d_nhwc(x_hw[None, :, :, None], w_rs[None, :, :, None])[0, :, :, 0]
    common.assert_close_to_reference(y, expected, dtype=dtype, K=R * S)
    if verbose:
        print(f"scalar-filter conv of a {H}x{W} image by a {R}x{S} filter -> {tuple(y.shape)}: "
              f"matches torch.nn.functional.conv2d")
    return y


@pytest.mark.parametrize("H, W, R, S", [(37, 29, 3, 3), (8, 8, 1, 1), (5, 9, 5, 2), (16, 16, 7, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scalar_filter(H, W, R, S, dtype):
    run_scalar_filter(H, W, R, S, dtype, verbose=False)


# %%
# Growing the kernel: stride, padding, dilation, channels and a batch
# -------------------------------------------------------------------
# Three changes turn the toy into a real (if slow) convolution, in NCHW layout:
#
# 1. Stride and dilation change *where* a tap reads: output pixel (oy, ox) and tap (r, s) read
#    input row oy*sh - ph + r*dh and column ox*sw - pw + s*dw. The tile of inputs one tap touches
#    is now strided, but it is still one `tl.load` of a tile (in the compiled kernel, mostly one
#    load per element: the section on the compiled kernel below counts them).
# 2. Padding means those rows and columns may fall outside the image. Rather than padding the
#    tensor in memory, the load's mask is false there and `other=0.0` supplies the zero.
# 3. Channels: output channel co sums over every input channel ci. The grid gets two more axes,
#    one program per (tile, co, n), and the tap loop gains an outer loop over ci.
#
# The kernel, as pseudocode::
#
#     for each (output tile T, co, n), in parallel:
#         acc = zeros(BLOCK_H, BLOCK_W)
#         for ci in range(Ci): for r in range(R): for s in range(S):
#             acc += w[co, ci, r, s] * x[n, ci, T.rows*sh - ph + r*dh, T.cols*sw - pw + s*dw]
#         y[n, co, T] = acc


@triton.jit
def conv2d_nchw_direct_kernel(x_ptr, w_ptr, y_ptr, Ci, H, W, Co, out_h, out_w,
                              stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                              R: tl.constexpr, S: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    # for each (output tile T, co, n), in parallel:
    tile_id, co, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tiles_w = tl.cdiv(out_w, BLOCK_W)
    out_rows = (tile_id // tiles_w) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    out_cols = (tile_id % tiles_w) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    inside = (out_rows < out_h) & (out_cols < out_w)
    # Top-left input pixel each output pixel's window starts from.
    in_row0 = out_rows * stride_h - pad_h
    in_col0 = out_cols * stride_w - pad_w
    acc = tl.zeros((BLOCK_H, BLOCK_W), dtype=tl.float32)
    # Offsets in int64: N*Ci*H*W can pass 2**31 for big batches.
    x_image = x_ptr + n.to(tl.int64) * Ci * H * W
    # for ci in range(Ci): for r in range(R): for s in range(S):
    for ci in range(Ci):
        x_channel = x_image + ci * H * W
        w_channel = w_ptr + (co * Ci + ci) * R * S
        for r in tl.static_range(R):
            in_rows = in_row0 + r * dil_h
            rows_ok = (in_rows >= 0) & (in_rows < H)
            for s in tl.static_range(S):
                in_cols = in_col0 + s * dil_w
                # Padding: outside the image the mask is off and the load yields 0.
                valid = inside & rows_ok & (in_cols >= 0) & (in_cols < W)
                x_tile = tl.load(x_channel + in_rows * W + in_cols, mask=valid, other=0.0)
                # acc += w[co, ci, r, s] * x[n, ci, ...]
                acc += tl.load(w_channel + r * S + s).to(tl.float32) * x_tile.to(tl.float32)
    y_plane = y_ptr + (n.to(tl.int64) * Co + co) * out_h * out_w
    tl.store(y_plane + out_rows * out_w + out_cols, acc.to(y_ptr.dtype.element_ty), mask=inside)


def conv2d_nchw_direct(x_nchw, w_kcrs, stride=1, padding=0, dilation=1, block=(16, 16)):
    """Direct convolution of an NCHW batch by [Co, Ci, R, S] filters; returns NCHW.

    The layout of this lesson is PyTorch's default (NCHW); from lesson 02 on the series uses NHWC."""
    for name, t in (("x_nchw", x_nchw), ("w_kcrs", w_kcrs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4, got shape {tuple(t.shape)}")
    if x_nchw.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x_nchw has dtype {x_nchw.dtype}; allowed: float32, float16, bfloat16")
    if w_kcrs.dtype != x_nchw.dtype:
        raise TypeError(f"dtype mismatch: x_nchw is {x_nchw.dtype} but w_kcrs is {w_kcrs.dtype}")
    N, Ci, H, W = x_nchw.shape
    Co, Ci_w, R, S = w_kcrs.shape
    geometry = common.conv_geometry((N, H, W, Ci), (Co, R, S, Ci_w), stride, padding, dilation)
    x_nchw, w_kcrs = x_nchw.contiguous(), w_kcrs.contiguous()
    y = torch.empty(N, Co, geometry.out_h, geometry.out_w, device=x_nchw.device, dtype=x_nchw.dtype)
    tiles = triton.cdiv(geometry.out_h, block[0]) * triton.cdiv(geometry.out_w, block[1])
    conv2d_nchw_direct_kernel[(tiles, Co, N)](
        x_nchw, w_kcrs, y, Ci, H, W, Co, geometry.out_h, geometry.out_w,
        *geometry.stride, *geometry.padding, *geometry.dilation, R, S, block[0], block[1])
    return y


def run_direct_conv(N=2, Ci=3, H=13, W=11, Co=4, R=3, S=3, stride=1, padding=1, dilation=1,
                    dtype=torch.float32, verbose=True):
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, dtype)
    y = conv2d_nchw_direct(x_nhwc.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), stride, padding, dilation)
    expected = common.reference_conv2d_nhwc(x_nhwc, w, None, stride, padding, dilation)
    common.assert_close_to_reference(y.permute(0, 2, 3, 1), expected, dtype=dtype, K=Ci * R * S)
    if verbose:
        geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding, dilation)
        print(f"direct NCHW conv, {geometry.describe()}: matches torch.nn.functional.conv2d")
    return y


DIRECT_CONV_CASES = [  # every combination below that has an output (a 7x7 filter does not fit 7x10 unpadded)
    (N, Ci, H, W, Co, R, S, stride, padding)
    for N, Ci, H, W, Co in [(1, 1, 9, 9, 1), (2, 3, 13, 11, 4), (1, 5, 7, 10, 2)]
    for R, S in [(1, 1), (3, 3), (5, 2), (7, 7)]
    for stride, padding in [(1, 0), (2, 1), (3, 2), ((1, 2), (2, 0))]
    if common.has_output((N, H, W, Ci), (Co, R, S, Ci), stride, padding)]


@pytest.mark.parametrize("N, Ci, H, W, Co, R, S, stride, padding", DIRECT_CONV_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_direct_conv(N, Ci, H, W, Co, R, S, stride, padding, dtype):
    run_direct_conv(N, Ci, H, W, Co, R, S, stride, padding, 1, dtype, verbose=False)


def test_direct_conv_dilation():
    run_direct_conv(N=1, Ci=2, H=12, W=9, Co=3, R=3, S=2, stride=1, padding=(2, 1), dilation=(2, 3),
                    verbose=False)


@pytest.mark.parametrize("bad_call, error, message", [
    (lambda x, w: conv2d_nchw_direct(x.double(), w.double()), TypeError, "dtype"),
    (lambda x, w: conv2d_nchw_direct(x, w.half()), TypeError, "mismatch"),
    (lambda x, w: conv2d_nchw_direct(x[0], w), ValueError, "rank 4"),
    (lambda x, w: conv2d_nchw_direct(x, w[:, :2]), ValueError, "channel mismatch"),
    (lambda x, w: conv2d_nchw_direct(x, w, stride=0), ValueError, "stride"),
    (lambda x, w: conv2d_nchw_direct(x, w, padding=-1), ValueError, "padding"),
    (lambda x, w: conv2d_nchw_direct(x[:, :, :2, :2], w), ValueError, "empty output"),
])
def test_direct_conv_rejects_bad_input(bad_call, error, message):
    x = torch.randn(1, 3, 8, 8, device=common.device())
    w = torch.randn(4, 3, 3, 3, device=common.device())
    with pytest.raises(error, match=message):
        bad_call(x, w)


# %%
# What the direct kernel loads, and what it does with each load
# --------------------------------------------------------------
# The grid has one program per (tile, co, n), and the addresses a program loads do not depend on
# co: every output channel's program reads the same input tiles again. So each input element is
# loaded once per output channel, times once per filter tap that touches it: Co*R*S times for an
# interior pixel at stride 1. And each loaded input element feeds exactly one FMA (`acc += w * x`),
# besides one weight load per tap.
#
# The tap overlap inside one program is not what a matrix product removes: lesson 02's implicit
# GEMM also loads each pixel once per tap, and neighbouring taps read neighbouring addresses that
# caches can serve. The factor Co is. A GEMM program computes a
# BLOCK_M x BLOCK_N tile of outputs (pixels x output channels) from one A tile (BLOCK_M x BLOCK_K)
# and one B tile (BLOCK_N x BLOCK_K) per K-step: each A value is reused across BLOCK_N output
# channels and each B value across BLOCK_M pixels, BLOCK_M*BLOCK_N/(BLOCK_M+BLOCK_N) FMAs per loaded
# element (64 for a 128 x 128 tile), and the FMAs run on tensor cores instead of the FMA pipes.
#
# `replay_direct_conv_loads` walks the kernel's loop nest on the host, with its masks, and counts
# how often each input element is loaded; the test checks it against counts written by hand.
#
# The sliding window comes back at the end of the series. A *depthwise* convolution (groups =
# channels: MobileNet, EfficientNet, ConvNeXt) gives each channel its own filter, so there is no
# sum over channels and no matrix product to hand to tensor cores: it stays this kernel, with the
# channel axis innermost (NHWC, so that a tap loads a tile of pixels x channels in one coalesced
# sweep) and lesson 05's fused epilogue. `conv_tutorial/depthwise.py` is that kernel; it is
# memory-bound, and judged in GB/s.


def replay_direct_conv_loads(N, Ci, H, W, Co, R, S, stride=1, padding=0, dilation=1):
    """Replay conv2d_nchw_direct_kernel's loads: (times each input element was loaded, useful FMAs).

    Walks every program (n, co) and every (ci, r, s) of its loop, over all output pixels (the
    tiles cover each once), with the kernel's masks: a load happens where the tap lands inside
    the image. The first result has x's shape [N, Ci, H, W]."""
    geometry = common.conv_geometry((N, H, W, Ci), (Co, R, S, Ci), stride, padding, dilation)
    (sh, sw), (ph, pw), (dh, dw) = geometry.stride, geometry.padding, geometry.dilation
    oy = torch.arange(geometry.out_h)[:, None]
    ox = torch.arange(geometry.out_w)[None, :]
    loads = torch.zeros(N, Ci, H, W, dtype=torch.int64)
    fmas = 0
    for n, co, ci, r, s in itertools.product(range(N), range(Co), range(Ci), range(R), range(S)):
        in_rows = (oy * sh - ph + r * dh).expand(geometry.out_h, geometry.out_w)
        in_cols = (ox * sw - pw + s * dw).expand(geometry.out_h, geometry.out_w)
        valid = (in_rows >= 0) & (in_rows < H) & (in_cols >= 0) & (in_cols < W)
        loads[n, ci].index_put_((in_rows[valid], in_cols[valid]), torch.tensor(1), accumulate=True)
        fmas += geometry.out_h * geometry.out_w       # acc += w * x on every output pixel
    return loads, fmas


def gemm_fmas_per_load(BLOCK_M, BLOCK_N):
    """FMAs per loaded element of one GEMM K-step: BLOCK_M*BLOCK_N*BLOCK_K over (BLOCK_M+BLOCK_N)*BLOCK_K."""
    return BLOCK_M * BLOCK_N / (BLOCK_M + BLOCK_N)


def run_load_count(outdir=None, verbose=True, Ci=4, H=12, W=12, R=3, S=3):
    counts = {}
    for Co in (1, 4, 16, 64):
        loads, fmas = replay_direct_conv_loads(1, Ci, H, W, Co, R, S, 1, 1)
        counts[Co] = {"interior": int(loads[0, 0, H // 2, W // 2]), "loads": int(loads.sum()), "fmas": fmas}
    if verbose:
        print(f"direct kernel, {Ci}->Co channels, {H}x{W} image, {R}x{S} filter, padding 1 (replayed loads):")
        for Co, c in counts.items():
            print(f"  Co={Co:3d}: an interior input element is loaded {c['interior']:4d} times "
                  f"(Co x R*S); {c['loads']} loads for {c['fmas']} FMAs = "
                  f"{c['fmas'] / c['loads']:.2f} FMA per load")
        print("  (above 1 only because a padding tap multiplies a 0 it never loaded)")
        print(f"  a 128 x 128 GEMM tile: {gemm_fmas_per_load(128, 128):.0f} FMAs per loaded element, "
              f"on tensor cores (lesson 02)")
    if outdir is not None:
        fig, ax = common.new_figure(figsize=(7, 4.5))
        channels = list(counts)
        ax.plot(channels, [counts[Co]["interior"] for Co in channels], marker="o",
                label="direct kernel (lesson 01), replayed")
        ax.plot(channels, [-(-Co // 128) * R * S for Co in channels], marker="s",
                label="GEMM with BLOCK_N = 128: once per tap per column tile (from its loop nest)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("output channels Co")
        ax.set_ylabel("loads of one interior input element")
        ax.set_title(f"The direct kernel reads the input once per output channel\n"
                     f"({R}x{S} filter, stride 1, {H}x{W}x{Ci} input)")
        ax.set_xticks(channels, [str(Co) for Co in channels])
        ax.set_yticks([counts[Co]["interior"] for Co in channels],
                      [str(counts[Co]["interior"]) for Co in channels])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        common.save_figure(fig, outdir, "01_input_loads", {"R": R, "S": S, "Ci": Ci, "H": H, "W": W,
                                                            "counts_by_Co": counts})
    return counts


@pytest.mark.parametrize("Co", [1, 3])
def test_replayed_loads(Co):
    # 3x3, stride 1, padding 1 on 5x6: an interior pixel is under all 9 taps of each of Co programs;
    # the corner (0, 0) under 4 (output pixels (0..1, 0..1), each with one tap on it).
    loads, fmas = replay_direct_conv_loads(2, 2, 5, 6, Co, 3, 3, 1, 1)
    assert loads[1, 1, 2, 3] == Co * 9 and loads[0, 0, 0, 0] == Co * 4
    assert fmas == 2 * Co * 2 * 9 * 5 * 6            # N * Co * Ci * R * S * out_h * out_w
    assert loads.sum() < fmas                        # padding taps: an FMA (with 0) but no load
    # No padding: every FMA has its own load, one each.
    loads, fmas = replay_direct_conv_loads(1, 2, 6, 6, Co, 3, 3)
    assert loads.sum() == fmas
    # Dilation 2 on 9x9 (out 5x5): the centre is under all 9 taps, the corner only under tap (0, 0).
    loads, _ = replay_direct_conv_loads(1, 1, 9, 9, Co, 3, 3, dilation=2)
    assert loads[0, 0, 4, 4] == Co * 9 and loads[0, 0, 0, 0] == Co
    # Stride 2, 1x1 filter: even rows and columns are read once per program, the others never.
    loads, _ = replay_direct_conv_loads(1, 1, 6, 6, Co, 1, 1, stride=2)
    assert loads[0, 0, ::2, ::2].eq(Co).all() and loads[0, 0, 1::2].eq(0).all()


def test_load_count_plot(tmp_path):
    counts = run_load_count(tmp_path, verbose=False)
    assert [c["interior"] for c in counts.values()] == [9, 36, 144, 576]
    assert (tmp_path / "01_input_loads.png").stat().st_size > 10_000
    assert gemm_fmas_per_load(128, 128) == 64


# %%
# What the compiled kernel issues (no GPU needed)
# -----------------------------------------------
# Compiled ahead of time for sm_90 (this works on a CPU), the direct kernel's loop body over ci holds
# every tap unrolled: 4 warps share the 16 x 16 tile, 2 outputs per thread, so per input channel a
# thread issues 9 weight loads, 18 input loads and 18 FMAs. Whether a tap's two input loads become
# one wider load is decided by what the compiler can prove about the addresses: that neighbouring
# outputs read neighbouring elements (stride 1, known at compile time because Triton specializes
# an integer argument equal to 1), that a pair starts aligned to the wider width, and that the
# bounds mask keeps or drops a pair whole (out_w a multiple of 16, which Triton also records: with
# W = 32 and padding 0, out_w = 30 and the loads stay scalar). With the demo's width W = 11 no row starts
# aligned, so every load stays one element wide, 32-bit in fp32 and 16-bit in fp16: the width
# follows the dtype, the count follows alignment. With W = 32 (a multiple of 16, which Triton
# records at compile time, so every row starts aligned) and padding 1, the three taps of column
# offset s = 1 read aligned pairs, and each becomes one 2-wide load.

LOAD_BUILDS = {"fp32, W=11": dict(dtype="float32", W=11), "fp16, W=11": dict(dtype="float16", W=11),
               "fp32, W=32": dict(dtype="float32", W=32)}


def aot_direct_conv(arch, dtype="float32", W=11, H=13, Ci=3, Co=4, stride=1, padding=1):
    """Launch arguments of conv2d_nchw_direct_kernel (3x3, 16x16 tiles) on CPU tensors, for common.aot_compile."""
    x_nchw = torch.zeros(2, Ci, H, W, dtype=getattr(torch, dtype))
    w_kcrs = torch.zeros(Co, Ci, 3, 3, dtype=x_nchw.dtype)
    geometry = common.conv_geometry((2, H, W, Ci), (Co, 3, 3, Ci), stride, padding)
    y = torch.zeros(2, Co, geometry.out_h, geometry.out_w, dtype=x_nchw.dtype)
    return conv2d_nchw_direct_kernel, (x_nchw, w_kcrs, y, Ci, H, W, Co, geometry.out_h, geometry.out_w,
                                       *geometry.stride, *geometry.padding, *geometry.dilation, 3, 3, 16, 16), {}


def loads_and_fmas(ptx):
    """{opcode: count} of the PTX's global loads (ld.global.b32, ld.global.v2.b32, ...) and fp32 FMAs."""
    counts = {}
    for line in ptx.splitlines():
        words = line.split()
        if words and words[0].startswith("@"):           # a predicated instruction: "@%p1 ld.global..."
            words = words[1:]
        if words and (words[0].startswith("ld.global") or words[0] == "fma.rn.f32"):
            counts[words[0]] = counts.get(words[0], 0) + 1
    return counts


def run_show_loads(verbose=True):
    table = {}
    for name, params in LOAD_BUILDS.items():
        compiled = common.aot_compile_or_say_why("01-conv-basics", "aot_direct_conv", "sm_90", **params)
        if compiled is None:
            return table
        table[name] = loads_and_fmas(compiled["ptx"])
    if verbose:
        print("\nconv2d_nchw_direct_kernel, sm_90 PTX (3x3, padding 1, 16x16 tile, 4 warps), per input channel:")
        for name, counts in table.items():
            loads = " + ".join(f"{n} x {op}" for op, n in counts.items() if op.startswith("ld.global"))
            print(f"  {name}: {loads}; {counts.get('fma.rn.f32', 0)} x fma.rn.f32")
    return table


def test_compiled_loads():
    common.aot_compile_or_skip("01-conv-basics", "aot_direct_conv", "sm_90")   # skips without an assembler
    table = run_show_loads(verbose=False)
    assert table["fp32, W=11"] == {"ld.global.b32": 27, "fma.rn.f32": 18}   # 9 weights + 9 taps x 2 outputs
    assert table["fp16, W=11"] == {"ld.global.b16": 27, "fma.rn.f32": 18}   # same count, half as wide
    assert table["fp32, W=32"] == {"ld.global.b32": 21, "ld.global.v2.b32": 3, "fma.rn.f32": 18}


# %%
# What lesson 01 measured, what limits it, what comes next
# --------------------------------------------------------
# Checked and counted (not timed): the kernels match torch.nn.functional.conv2d (in the
# interpreter on a CPU, compiled on a GPU), and the replay above counts Co*R*S loads of each
# interior input element and one FMA per input load. That is the limit we expect: load
# instructions and memory traffic, not arithmetic (its sm_90 PTX, as `run_show_loads` prints it,
# issues 27 one-element loads, 18 of the input and 9 of weights, for 18 FMAs per thread and input
# channel), and its FMAs run on the general-purpose pipes, never on tensor cores. Lesson 02 rewrites
# the same sum as a matrix product (im2col), so that one program computes many output channels from
# each load and `tl.dot` hands the products to tensor cores.


# %%
if __name__ == "__main__":
    args = common.lesson_args("Lesson 01: the sliding window and a scalar-filter Triton conv")
    outdir = common.output_dir(args.outdir)
    print(f"device: {common.gpu_name()}, Triton {triton.__version__}, "
          f"interpreter: {common.interpreter_mode()}")
    run_sliding_window_example()
    run_scalar_filter()
    run_direct_conv()
    run_direct_conv(N=2, Ci=3, H=20, W=17, Co=5, R=5, S=5, stride=2, padding=2, dtype=torch.float16)
    run_load_count(outdir)
    run_show_loads()
    if args.bench:
        print("\n--bench: lesson 01 has no benchmark (a scalar sliding window is for reading, not for "
              "speed); lesson 02's --bench times its implicit GEMM against cuDNN")
    if common.interpreter_mode():
        print("\nlesson 01, on this machine (no GPU): all checks passed, every kernel in the Triton interpreter; "
              "on a CUDA GPU the same kernels run compiled")
    else:
        print(f"\nlesson 01: all checks passed on {common.gpu_name()}")
