"""
Lesson 02: convolution as a matrix product (im2col), explicit and implicit
==========================================================================

What you will learn:

- how im2col turns a convolution into one GEMM: rows are output pixels, columns are (r, s, ci);
- an explicit im2col in Triton (the A matrix built in memory) followed by a `tl.dot` GEMM;
- what materialising A costs: R*S copies of the input, in bytes and in time;
- implicit GEMM: the same GEMM, but each K-step computes the input addresses of its A tile from
  (batch, out_y, out_x, r, s, ci) in registers, with masks for padding and image edges;
- what `tl.dot` becomes on Hopper: its `wgmma` and `cp.async` instructions in the sm_90 PTX
  (compiled ahead of time, so a CPU shows them too), and what `num_stages` and `num_warps` change;
- how the implicit GEMM compares with cuDNN (TFLOPS, on a GPU).

What changed since lesson 01: NHWC activations and [Co, R, S, Ci] weights (the layout lessons 03-05
use), and one program computes a tile of pixels x output channels with `tl.dot` (tensor cores on a
GPU) instead of one output channel with scalar multiply-adds.

Requires: any CUDA GPU for the GPU run and the benchmark; on a CPU the kernels run in the Triton
interpreter (set automatically by common.py).

Run:  python 02-im2col-explicit.py [--bench] [--outdir out]      Tests:  pytest 02-im2col-explicit.py
"""

# %%
import json

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch
import triton
import triton.language as tl

CONV_DTYPES = (torch.float16, torch.bfloat16)
# A compile-time flag the kernels pass to dot_accumulate (see there why).
INTERPRETED = tl.constexpr(common.interpreter_mode())


@triton.jit
def dot_accumulate(a, b, acc, INTERPRETED: tl.constexpr):
    """acc += a @ b with fp32 accumulation (tensor cores on a GPU).

    Under the CPU interpreter of Triton 3.8 and 3.9.0, `tl.dot` misreads bf16 operands (a 16x16
    product came back with errors around 1e10 on 3.9.0), so there the operands are widened to fp32
    first. Both are exact products summed in
    fp32; on a GPU this branch is compiled away."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)

# %%
# im2col by hand
# --------------
# Lesson 01's sum over (ci, r, s) is a dot product between the flattened window under an output
# pixel and the flattened filter. Write every window as a row and every filter as a column and the
# whole convolution is one matrix product::
#
#     A[m, k] = x[n, oy*sh - ph + r*dh, ox*sw - pw + s*dw, ci]    m = (n, oy, ox), k = (r, s, ci)
#     B[k, co] = w[co, r, s, ci]                                   (the weight, viewed as [Co, K])
#     y[m, co] = sum_k A[m, k] * B[k, co]                          y viewed as [M, Co] is NHWC
#
# with M = N*out_h*out_w, K = R*S*Ci. For the 3x3 image and 2x2 filter of lesson 01, A is 4x4:


def run_toy_im2col(verbose=True):
    image = torch.arange(1.0, 10.0).reshape(1, 3, 3, 1)        # a..i = 1..9, NHWC
    filt = torch.tensor([1.0, 0.0, -1.0, 2.0]).reshape(1, 2, 2, 1)
    a_matrix = im2col(image.to(common.device()), 2, 2).cpu()
    out = conv2d_im2col_explicit(image.to(common.device(), torch.float16),
                                 filt.to(common.device(), torch.float16)).cpu()
    if verbose:
        names = "abcdefghi"
        print("A (rows = output pixels y0..y3, columns = taps w0..w3):")
        for m in range(4):
            print("   ", " ".join(names[int(v) - 1] for v in a_matrix[m]), f"  <- y{m}")
        print("A @ [w0 w1 w2 w3]^T =", out.flatten().tolist())
    return a_matrix, out


def test_toy_im2col():
    a_matrix, out = run_toy_im2col(verbose=False)
    # Rows written out from the definition: the 2x2 window under each output pixel, row-major.
    expected = torch.tensor([[1, 2, 4, 5], [2, 3, 5, 6], [4, 5, 7, 8], [5, 6, 8, 9]], dtype=torch.float32)
    torch.testing.assert_close(a_matrix, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.flatten().float(), torch.tensor([7.0, 9.0, 13.0, 15.0]))


# %%
# Explicit im2col in Triton
# -------------------------
# One program fills a [BLOCK_M, BLOCK_K] tile of A. It decodes its rows into (n, oy, ox) and its
# columns into (r, s, ci), gathers x there, and writes zeros where the window hangs over the edge
# (padding). Then a plain tiled GEMM multiplies A by the weight.


@triton.jit
def im2col_kernel(x_ptr, a_ptr, H, W, Ci, out_h, out_w, M, K,
                  stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, S,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    # m -> (n, oy, ox)
    n = offs_m // (out_h * out_w)
    oy = (offs_m // out_w) % out_h
    ox = offs_m % out_w
    # k -> (r, s, ci), ci fastest
    ci = offs_k % Ci
    s = (offs_k // Ci) % S
    r = offs_k // (Ci * S)
    # The input pixel A[m, k] copies.
    in_y = oy[:, None] * stride_h - pad_h + r[None, :] * dil_h
    in_x = ox[:, None] * stride_w - pad_w + s[None, :] * dil_w
    inside = (in_y >= 0) & (in_y < H) & (in_x >= 0) & (in_x < W)
    in_bounds = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    pixel = (n[:, None].to(tl.int64) * H + in_y) * W + in_x
    values = tl.load(x_ptr + pixel * Ci + ci[None, :], mask=in_bounds & inside, other=0.0)
    tl.store(a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], values, mask=in_bounds)


@triton.jit
def gemm_abt_kernel(a_ptr, b_ptr, c_ptr, M, N_GEMM, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[M, N_GEMM] = A[M, K] @ B[N_GEMM, K]^T, fp32 accumulation; all row-major."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        b_t = tl.load(b_ptr + offs_n[None, :] * K + offs_k[:, None],
                      mask=(offs_n[None, :] < N_GEMM) & (offs_k[:, None] < K), other=0.0)
        # acc += A_tile @ B_tile^T
        acc = dot_accumulate(a, b_t, acc, INTERPRETED)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N_GEMM + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N_GEMM))


def _geometry_from(x_nhwc, R, S, stride, padding, dilation):
    return common.conv_geometry(x_nhwc.shape, (1, R, S, x_nhwc.shape[-1]), stride, padding, dilation)


def im2col(x_nhwc, R, S, stride=1, padding=0, dilation=1, BLOCK_M=64, BLOCK_K=32):
    """The explicit im2col matrix A [N*out_h*out_w, R*S*Ci] of an NHWC tensor, columns (r, s, ci)."""
    if not isinstance(x_nhwc, torch.Tensor):
        raise TypeError(f"x_nhwc must be a torch.Tensor, got {type(x_nhwc).__name__}")
    geometry = _geometry_from(x_nhwc, R, S, stride, padding, dilation)
    if not x_nhwc.is_contiguous():
        raise ValueError(f"x_nhwc must be a contiguous NHWC tensor, got strides {x_nhwc.stride()}")
    a_matrix = torch.empty(geometry.M, geometry.K, device=x_nhwc.device, dtype=x_nhwc.dtype)
    grid = (triton.cdiv(geometry.M, BLOCK_M), triton.cdiv(geometry.K, BLOCK_K))
    im2col_kernel[grid](x_nhwc, a_matrix, geometry.H, geometry.W, geometry.Ci, geometry.out_h,
                        geometry.out_w, geometry.M, geometry.K, *geometry.stride, *geometry.padding,
                        *geometry.dilation, geometry.S, BLOCK_M, BLOCK_K)
    return a_matrix


def conv2d_im2col_explicit(x_nhwc, w, stride=1, padding=0, dilation=1):
    """Convolution as im2col (A in memory) + GEMM. NHWC in, [Co, R, S, Ci] weight, NHWC out."""
    geometry = common.check_conv_inputs(x_nhwc, w, stride, padding, dilation, dtypes=CONV_DTYPES)
    a_matrix = im2col(x_nhwc, geometry.R, geometry.S, stride, padding, dilation)
    y = torch.empty(geometry.M, geometry.Co, device=x_nhwc.device, dtype=x_nhwc.dtype)
    BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
    grid = (triton.cdiv(geometry.M, BLOCK_M), triton.cdiv(geometry.Co, BLOCK_N))
    gemm_abt_kernel[grid](a_matrix, w.reshape(geometry.Co, geometry.K), y, geometry.M, geometry.Co,
                          geometry.K, BLOCK_M, BLOCK_N, BLOCK_K)
    return y.view(geometry.N, geometry.out_h, geometry.out_w, geometry.Co)


# %%
# The price of materialising A
# ----------------------------
# Each input pixel appears in A once per filter tap that covers it, so A holds about
# R*S/(sh*sw) times the bytes of the input. It is written once and read back by the GEMM (once per
# tile of output channels, cdiv(Co, BLOCK_N) times): traffic that a convolution does not need. For a 3x3 layer with stride 1 and 'same' padding that is
# exactly 9x the activations.


def materialization_ratio(H, W, Ci, R, S, stride, padding=None):
    """Bytes of A over bytes of the input (same dtype) for one image, from the real A's shape."""
    padding = (R // 2) if padding is None else padding
    geometry = common.conv_geometry((1, H, W, Ci), (1, R, S, Ci), stride, padding)
    return geometry.M * geometry.K / (H * W * Ci)


def run_materialization_cost(outdir=None, bench=False, verbose=True):
    filter_sizes = [1, 3, 5, 7]
    strides = [1, 2, 3]
    ratios = {st: [materialization_ratio(56, 56, 64, f, f, st) for f in filter_sizes] for st in strides}
    if verbose:
        print("bytes(A) / bytes(x) for a 56x56x64 image, 'same' padding:")
        print("  stride " + "".join(f"{f}x{f}".rjust(8) for f in filter_sizes))
        for st in strides:
            print(f"  {st:6d} " + "".join(f"{v:8.2f}" for v in ratios[st]))
    timings = None
    if bench and common.HAS_CUDA:
        timings = time_im2col_vs_direct()
    if outdir is not None:
        ncols = 2 if timings else 1
        fig, axes = common.new_figure(1, ncols, figsize=(6.5 * ncols, 4.5), squeeze=False)
        ax = axes[0][0]
        for st in strides:
            ax.plot(filter_sizes, ratios[st], marker="o", label=f"stride {st}")
        ax.set_xlabel("filter size R = S ('same' padding)")
        ax.set_ylabel("bytes of A / bytes of input")
        ax.set_title("Explicit im2col copies the input ~R*S/stride^2 times\n(56x56x64 input)")
        ax.set_xticks(filter_sizes)
        ax.grid(alpha=0.3)
        ax.legend()
        if timings:
            ax = axes[0][1]
            labels = list(timings["ms"])
            ax.bar(labels, [timings["ms"][k] for k in labels], color=["#888", "#c44", "#e94", "#49c", "#4a4"])
            ax.set_yscale("log")
            ax.set_ylabel("time per convolution (ms, log scale, lower is better)")
            ax.set_title(f"{timings['shape']}, {timings['dtype']}\n{common.gpu_name()}")
            ax.tick_params(axis="x", rotation=20)
        common.save_figure(fig, outdir, "02_im2col_cost",
                           {"bytes_ratio": ratios, "filter_sizes": filter_sizes, "timings": timings,
                            **common.versions()})
    return ratios, timings


def test_materialization_ratio():
    # 3x3, stride 1, 'same' padding: one row of A per pixel, 9*Ci columns: exactly 9x.
    assert materialization_ratio(56, 56, 64, 3, 3, 1) == 9.0
    # 1x1, stride 2: a quarter of the pixels, Ci columns each.
    assert materialization_ratio(56, 56, 64, 1, 1, 2) == 0.25
    # And the real A built by the kernel has that many elements.
    x_nhwc = torch.randn(1, 9, 7, 5, device=common.device())
    assert im2col(x_nhwc, 3, 3, 2, 1).numel() == materialization_ratio(9, 7, 5, 3, 3, 2, 1) * x_nhwc.numel()


def time_im2col_vs_direct(N=16, H=56, W=56, Ci=64, Co=64, R=3, S=3, dtype=torch.float16):
    """GPU timings of one shape: lesson 01's direct conv, im2col alone, im2col + GEMM, implicit, cuDNN."""
    direct = common.load_lesson("01-conv-basics")
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, dtype)
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, 1, 1)
    x_nchw, w_kcrs = x_nhwc.permute(0, 3, 1, 2).contiguous(), w.permute(0, 3, 1, 2).contiguous()
    runs = {
        "direct (lesson 01)": lambda: direct.conv2d_nchw_direct(x_nchw, w_kcrs, 1, 1),
        "im2col only": lambda: im2col(x_nhwc, R, S, 1, 1),
        "im2col + GEMM": lambda: conv2d_im2col_explicit(x_nhwc, w, 1, 1),
        "implicit GEMM": lambda: conv2d_implicit_gemm(x_nhwc, w, 1, 1),
        "cuDNN": common.cudnn_conv2d(x_nhwc, w, None, 1, 1),
    }
    ms = {name: common.bench_tflops(fn, geometry.flops)["ms"] for name, fn in runs.items()}
    print(f"time per convolution, {geometry.describe()}, {str(dtype)[6:]}:")
    for name, value in ms.items():
        print(f"  {name:<20} {value:8.3f} ms")
    return {"shape": geometry.describe(), "dtype": str(dtype)[6:], "ms": ms}


# %%
# Implicit GEMM
# -------------
# Why write A at all? The GEMM only ever needs one [BLOCK_M, BLOCK_K] tile of it at a time, and
# the im2col kernel shows how to compute any tile's addresses. So the GEMM's K loop builds the
# addresses itself. Ordering K as (r, s, ci-block) keeps the arithmetic small: the pixel a row
# reads depends only on (r, s), and within a tap the channels are contiguous in NHWC, so the tile
# is BLOCK_M rows of BLOCK_K consecutive elements: coalesced loads. As pseudocode::
#
#     for each output tile (rows m, columns co), in parallel:
#         (n, oy, ox) = decode(m)                      # once per program
#         acc = zeros(BLOCK_M, BLOCK_N)                # fp32
#         for r in range(R): for s in range(S):
#             iy, ix = oy*sh - ph + r*dh, ox*sw - pw + s*dw
#             valid = 0 <= iy < H and 0 <= ix < W      # padding and edges: masked to zero
#             for c0 in range(0, Ci, BLOCK_K):
#                 A = x[n, iy, ix, c0:c0+BLOCK_K]       # addresses computed in registers
#                 B = w[co, r, s, c0:c0+BLOCK_K]
#                 acc += A @ B^T
#         y[m, co] = acc
#
# Programs are ordered in groups of GROUP_M row-tiles (as in Triton's matmul tutorial): the
# programs that run at the same time cover GROUP_M row-tiles x several column-tiles. Every
# column-tile re-reads the same activation rows, so grouped, those re-reads come soon after the
# first and find the rows in L2. That pays against a column-major order (every row-tile of
# column-tile 0, then of column-tile 1, ...), where a row's second read comes a whole pass over the
# 400 MB of activations later. Against a row-major order (one row-tile's column-tiles back to back)
# it gains little here: that order re-reads a row-tile at once too, and grouping's other gain in a
# matmul, B reused across row-tiles, is not needed: the headline layer's weights are 2.65 MB
# (384 x 3 x 3 x 384 bf16), small beside the L2 (50 MB on an H100). No run of this series compared
# the orders. With Co <= BLOCK_N there is one column-tile and grouping changes nothing.


@triton.jit
def conv2d_implicit_gemm_kernel(x_ptr, w_ptr, y_ptr, H, W, Ci, Co, out_h, out_w, M, K,
                                stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                                R: tl.constexpr, S: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr):
    # Grouped program order: GROUP_M row-tiles sweep all column-tiles before moving on.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(Co, BLOCK_N)
    group_size = GROUP_M * tiles_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    # (n, oy, ox) = decode(m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = offs_m // (out_h * out_w)
    oy = (offs_m // out_w) % out_h
    ox = offs_m % out_w
    row_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < Co
    channels = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(R):
        iy = oy * stride_h - pad_h + r * dil_h
        for s in range(S):
            ix = ox * stride_w - pad_w + s * dil_w
            # valid = inside the image (else: padding, read as zero)
            valid = row_ok & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)
            pixel_base = ((n.to(tl.int64) * H + iy) * W + ix) * Ci
            w_base = offs_n * K + (r * S + s) * Ci
            for c0 in range(0, Ci, BLOCK_K):
                ci = c0 + channels
                # A = x[n, iy, ix, c0:c0+BLOCK_K]
                a = tl.load(x_ptr + pixel_base[:, None] + ci[None, :],
                            mask=valid[:, None] & (ci[None, :] < Ci), other=0.0)
                # B = w[co, r, s, c0:c0+BLOCK_K], loaded transposed as [BLOCK_K, BLOCK_N]
                b_t = tl.load(w_ptr + w_base[None, :] + ci[:, None],
                              mask=col_ok[None, :] & (ci[:, None] < Ci), other=0.0)
                # acc += A @ B^T
                acc = dot_accumulate(a, b_t, acc, INTERPRETED)
    # y[m, co] = acc   (y as [M, Co] is the NHWC output)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * Co + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def implicit_gemm_config(geometry):
    """Tile sizes and launch options for a shape (a small hand-made heuristic, no autotuning)."""
    BLOCK_K = 64 if geometry.Ci >= 64 else max(16, triton.next_power_of_2(geometry.Ci))
    BLOCK_N = 128 if geometry.Co >= 128 else max(16, triton.next_power_of_2(geometry.Co))
    BLOCK_M = 128
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=8,
                num_warps=8 if BLOCK_N >= 128 else 4, num_stages=3)


def conv2d_implicit_gemm(x_nhwc, w, stride=1, padding=0, dilation=1):
    """Implicit-GEMM convolution. x_nhwc [N, H, W, Ci], w [Co, R, S, Ci] (fp16/bf16) -> NHWC output."""
    geometry = common.check_conv_inputs(x_nhwc, w, stride, padding, dilation, dtypes=CONV_DTYPES)
    y = torch.empty(geometry.N, geometry.out_h, geometry.out_w, geometry.Co,
                    device=x_nhwc.device, dtype=x_nhwc.dtype)
    config = implicit_gemm_config(geometry)
    grid = (triton.cdiv(geometry.M, config["BLOCK_M"]) * triton.cdiv(geometry.Co, config["BLOCK_N"]),)
    conv2d_implicit_gemm_kernel[grid](
        x_nhwc, w, y, geometry.H, geometry.W, geometry.Ci, geometry.Co, geometry.out_h,
        geometry.out_w, geometry.M, geometry.K, *geometry.stride, *geometry.padding,
        *geometry.dilation, geometry.R, geometry.S, **config)
    return y


# %%
# Checking both against PyTorch
# -----------------------------
# The grid includes the awkward cases: Ci=3 (smaller than any BLOCK_K), Ci not a multiple of
# BLOCK_K, Co not a multiple of BLOCK_N, stride 2, dilation 2, different (h, w) stride and padding,
# 1x1 filters and batches. Tolerances come from `common.assert_close_to_reference`.

CONV_CASES = [
    # N, H,  W,  Ci, Co, R, S, stride,  padding, dilation
    (1, 8, 8, 3, 8, 3, 3, 1, 1, 1),            # Ci=3, a stem-like layer
    (2, 9, 7, 20, 24, 3, 3, 1, 1, 1),          # Ci not a multiple of BLOCK_K, Co not of BLOCK_N
    (1, 11, 10, 16, 17, 3, 3, 2, 1, 1),        # stride 2, odd Co
    (1, 12, 12, 8, 16, 3, 3, 1, 2, 2),         # dilation 2
    (2, 10, 13, 12, 16, 3, 2, (1, 2), (2, 0), 1),  # asymmetric stride/padding, non-square filter
    (3, 6, 5, 32, 40, 1, 1, 1, 0, 1),          # 1x1, batch 3
    (1, 9, 9, 72, 20, 5, 5, 2, 2, 1),          # Ci > BLOCK_K, 5x5
]


def run_conv_case(fn, case, dtype, seed=0):
    return common.check_conv(fn, *case, dtype=dtype, seed=seed)


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("dtype", CONV_DTYPES)
def test_im2col_explicit(case, dtype):
    run_conv_case(conv2d_im2col_explicit, case, dtype)


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("dtype", CONV_DTYPES)
def test_implicit_gemm(case, dtype):
    run_conv_case(conv2d_implicit_gemm, case, dtype)


def test_im2col_matches_unfold():
    # torch's unfold is im2col in NCHW with columns (ci, r, s); reorder to our (r, s, ci).
    x_nhwc = torch.randn(2, 7, 6, 5, device=common.device())
    ours = im2col(x_nhwc, 3, 2, stride=(2, 1), padding=(1, 0), dilation=(1, 2))
    cols = torch.nn.functional.unfold(x_nhwc.permute(0, 3, 1, 2), (3, 2), dilation=(1, 2),
                                      padding=(1, 0), stride=(2, 1))          # [N, Ci*R*S, L]
    cols = cols.view(2, 5, 3, 2, -1).permute(0, 4, 2, 3, 1).reshape(ours.shape)
    torch.testing.assert_close(ours, cols, rtol=0, atol=0)


BAD_INPUTS = common.bad_conv_inputs(torch.bfloat16) + [
    (lambda x, w: (x, w), {"stride": (1, -1)}, ValueError, "stride"),
    (lambda x, w: (x, w), {"padding": -1}, ValueError, "padding"),
    (lambda x, w: (x, w), {"stride": 1.5}, TypeError, "stride"),
    (lambda x, w: (x.tolist(), w), {}, TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize("fn_name", ["conv2d_im2col_explicit", "conv2d_implicit_gemm"])
@pytest.mark.parametrize("make_args, kwargs, error, message", BAD_INPUTS)
def test_rejects_bad_input(fn_name, make_args, kwargs, error, message):
    x_nhwc, w = common.random_conv_inputs(1, 8, 8, 8, 4, 3, 3, torch.float16)
    with pytest.raises(error, match=message):
        globals()[fn_name](*make_args(x_nhwc, w), **kwargs)


# %%
# What `tl.dot` becomes on Hopper (no GPU needed)
# -----------------------------------------------
# `tl.dot` is one line of Python; the compiler turns it into a whole pipeline. Compiled ahead of
# time for sm_90 (H100) with the headline layer's config (128 x 128 x 64 tile, bf16, 8 warps,
# 3 stages), the PTX holds:
#
# - `wgmma.mma_async` (warpgroup MMA): 8 warps are 2 warpgroups of 128 threads, each computing a
#   64 x 128 half of the tile, 16 channels per instruction (m64n128k16), so 4 per BLOCK_K = 64
#   step. Both operands are read from shared memory; the fp32 accumulator lives in registers.
#   The MMA is asynchronous: `wgmma.commit_group` closes a batch, and `wgmma.wait_group 1` lets
#   one batch run on the tensor cores while the warps issue the copies of the step two ahead
#   (into the stage the MMA before it has just released).
# - `cp.async.cg.shared.global`: 16-byte copies from global to shared memory that do not pass
#   through registers. A step's A and B tiles are 16 KB each, 64 bytes per thread per tile, so 8
#   copies per thread per step. `num_stages = 3` gives 3 shared-memory buffers per operand
#   (3 x 32 KB = 96 KB): while the tensor cores work on step i, the copies of steps i+1 and i+2
#   are in flight. `cp.async.commit_group` closes a group of copies (one per operand per step),
#   and `cp.async.wait_group 2` waits until at most 2 groups, the next step's A and B, are still
#   pending. With `num_stages = 1` there is no `cp.async` at all: plain loads to registers,
#   stored to shared memory, then the MMA.
# - `fence.proxy.async.shared::cta` before the MMA: `cp.async` writes shared memory as ordinary
#   (generic-proxy) stores, while `wgmma` reads it through the async proxy; the fence orders the
#   two. (A *proxy* is a path by which shared memory is accessed: the threads' own loads and stores
#   and `cp.async` go through the generic proxy, the tensor cores and TMA through the async proxy;
#   accesses through different proxies are ordered only by such a fence. Lesson 03 says more.)
# - `wgmma.fence.sync.aligned` just before each step's wgmmas: the same word, another ordering.
#   It orders *registers*, not memory: the PTX ISA requires it, issued by all warps of the
#   warpgroup, before the first `wgmma.mma_async` and between any access of a thread to registers
#   a `wgmma.mma_async` uses (the accumulator, or an A operand held in registers) and that
#   wgmma; back-to-back wgmmas of one shape into the same accumulator are ordered without it.
#   The MMA reads and writes those registers asynchronously: without the fence the ISA does not
#   promise that it sees what the warps last wrote to them. Triton puts one before each step's
#   batch of 4 (lesson 04's PTX has the same).
#
# `num_warps` sets how many warps share the tile: 8 warps split it between 2 warpgroups; 4 warps
# are one warpgroup, which computes all 128 rows (8 MMAs per step instead of 4), issues twice the
# copies per thread and holds twice the accumulator per thread (Triton 3.9.0's build: 255
# registers, the most a thread can have, and a 120-byte stack frame: the accumulator spills; the
# 8-warp build has 165 registers and no stack).
#
# And what the compiler cannot do: it pipelines only the innermost loop, the channel blocks of one
# tap (384 / 64 = 6 steps for the headline layer). At the end of every tap the PTX waits for all
# copies and all MMAs (`cp.async.wait_group 0`, `wgmma.wait_group 0`): the pipeline drains and
# refills R*S times per tile. And every step still computes its addresses and masks in
# registers. Lessons 03-04 hand the addresses to the TMA unit and take over the pipeline.

IMPLICIT_GEMM_TAUGHT = {"sm_90": [
    ("wgmma.mma_async", "warpgroup MMA from shared memory; BLOCK_K / 16 per step and warpgroup"),
    ("wgmma.wait_group.sync.aligned 1", "in the loop: one MMA batch stays in flight"),
    ("wgmma.wait_group.sync.aligned 0", "after the last channel block of a tap: the pipeline drains"),
    ("cp.async.cg.shared.global", "16-byte global -> shared copies; the prologue's 2 stages and the loop's"),
    ("cp.async.wait_group \t2", "in the loop: wait until only the next step's 2 groups (A, B) are pending"),
    ("cp.async.wait_group \t0", "after the last channel block of a tap: every copy landed (the drain)"),
    ("fence.proxy.async.shared::cta", "generic-proxy cp.async writes, async-proxy wgmma reads"),
    ("wgmma.fence.sync.aligned", "once per step: the warps' register accesses before the wgmmas' own"),
]}


def aot_implicit_gemm(arch, num_stages=3, num_warps=8):
    """Launch arguments of the implicit-GEMM kernel with the headline layer's channels and config
    (bf16; a small image, which only changes runtime values), for common.aot_compile."""
    x_nhwc = torch.zeros(2, 8, 8, 384, dtype=torch.bfloat16)
    w = torch.zeros(384, 3, 3, 384, dtype=torch.bfloat16)
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, 1, 1)
    y = torch.zeros(geometry.output_shape_nhwc, dtype=torch.bfloat16)
    config = dict(implicit_gemm_config(geometry), num_stages=num_stages, num_warps=num_warps)
    args = (x_nhwc, w, y, geometry.H, geometry.W, geometry.Ci, geometry.Co, geometry.out_h,
            geometry.out_w, geometry.M, geometry.K, *geometry.stride, *geometry.padding,
            *geometry.dilation, geometry.R, geometry.S)
    return conv2d_implicit_gemm_kernel, args, config


def run_show_ptx(verbose=True):
    """The sm_90 PTX of the headline config, then what num_stages and num_warps change."""
    common.show_ptx("02-im2col-explicit", "aot_implicit_gemm", IMPLICIT_GEMM_TAUGHT,
                    lambda arch, compiled: "what tl.dot became (128x128x64 tile, bf16, 8 warps, 3 stages)")
    rows = {}
    for num_stages, num_warps in [(3, 8), (1, 8), (3, 4)]:
        compiled = common.aot_compile_or_say_why("02-im2col-explicit", "aot_implicit_gemm", "sm_90",
                                                 num_stages=num_stages, num_warps=num_warps)
        if compiled is None:
            return rows
        counts = common.ptx_instructions(compiled["ptx"], ["cp.async.cg", "wgmma.mma_async"])
        rows[num_stages, num_warps] = dict(counts, shared=compiled["shared"], registers=compiled["registers"],
                                           wgmma=common.first_ptx_instruction(compiled["ptx"], "wgmma.mma_async").split()[0])
    if verbose:
        print("\n   num_stages num_warps  shared memory  registers  cp.async copies  wgmma in the text")
        for (num_stages, num_warps), row in rows.items():
            print(f"   {num_stages:10d} {num_warps:9d} {row['shared']:10d} B {row['registers']!s:>10} "
                  f"{row['cp.async.cg']:16d}  {row['wgmma.mma_async']} x {row['wgmma']}")
    return rows


def test_dot_compiles_to_wgmma_and_cp_async():
    compiled = common.assert_ptx_teaches("02-im2col-explicit", "aot_implicit_gemm", "sm_90", IMPLICIT_GEMM_TAUGHT)
    counts = common.ptx_instructions(compiled["ptx"], ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                                                       "cp.async.cg.shared.global"])
    # 2 warpgroups x 64 rows = the 128-row tile; 64 / 16 = 4 MMAs per step per warpgroup.
    assert counts["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"] == 4
    # 8 copies per thread per step (two 16 KB tiles over 256 threads, 16 B each), for 3 steps.
    assert counts["cp.async.cg.shared.global"] == 3 * 8
    # one register fence per step, before its 4 wgmmas (in the text: once, in the loop body)
    assert common.ptx_instructions(compiled["ptx"], ["wgmma.fence"])["wgmma.fence"] == 1
    assert compiled["shared"] >= 3 * 2 * 128 * 64 * 2        # 3 stages of A and B tiles, bf16
    single = common.aot_compile_or_skip("02-im2col-explicit", "aot_implicit_gemm", "sm_90", num_stages=1)
    assert common.ptx_instructions(single["ptx"], ["cp.async"])["cp.async"] == 0
    assert single["shared"] < compiled["shared"]


# %%
# How fast is it? (GPU only)
# --------------------------
# On a GPU the lesson measures the implicit GEMM against cuDNN (torch.nn.functional.conv2d on the
# same bytes, channels_last) on the headline shape and ResNet-50's four 3x3 layers at batch 128
# (unless `--quick`; `--bench` also times the explicit im2col's cost).


def bench_implicit_vs_cudnn(outdir, quick=False, dtype=torch.bfloat16):
    shapes = [common.HEADLINE_SHAPE] + common.RESNET50_3X3_SHAPES
    if quick:
        shapes = shapes[:2]
    rows = []
    for label, N, H, W, Ci, Co, R, S, stride, padding in shapes:
        x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, dtype)
        geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
        ours = common.bench_tflops(lambda: conv2d_implicit_gemm(x_nhwc, w, stride, padding), geometry.flops)
        cudnn = common.bench_tflops(common.cudnn_conv2d(x_nhwc, w, None, stride, padding), geometry.flops)
        rows.append({"shape": label, "implicit_gemm_tflops": ours["tflops"], "cudnn_tflops": cudnn["tflops"],
                     "ratio": ours["tflops"] / cudnn["tflops"]})
    info = common.versions()
    print(f"\nimplicit GEMM vs cuDNN, {str(dtype)[6:]}, {info['device']}, triton {info['triton']}, "
          f"torch {info['torch']}, cuDNN {common.cudnn_version_text(info.get('cudnn'))}")
    plot_implicit_vs_cudnn(rows, info, str(dtype), outdir, {"rows": rows, "dtype": str(dtype), **info})
    return rows


def plot_implicit_vs_cudnn(rows, info, dtype, outdir, data=None, recorded=None):
    """Print the table and draw the bars; `recorded` (common.recorded_results' info) marks a
    recorded run: titled so and saved as *_recorded."""
    dtype = dtype.replace("torch.", "")
    print(f"  {'shape':<30} {'implicit':>9} {'cuDNN':>9} {'ratio':>6}   (TFLOPS)")
    for row in rows:
        print(f"  {row['shape']:<30} {row['implicit_gemm_tflops']:9.1f} {row['cudnn_tflops']:9.1f} "
              f"{row['ratio']:6.2f}")
    fig, ax = common.new_figure(figsize=(9, 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["implicit_gemm_tflops"] for r in rows], 0.4, label="implicit GEMM (Triton, lesson 02)")
    ax.bar([x + 0.2 for x in xs], [r["cudnn_tflops"] for r in rows], 0.4, label="cuDNN (channels_last)")
    ax.set_xticks(list(xs), [r["shape"] for r in rows], rotation=15, ha="right")
    ax.set_xlabel("layer (batch 128)")
    ax.set_ylabel("TFLOPS (higher is better)")
    mark = f"RECORDED {recorded['date']} (not measured on this machine): " if recorded else ""
    ax.set_title(f"{mark}Lesson 02 implicit GEMM vs cuDNN, batch 128, {dtype}\n"
                 f"{info['device']}, Triton {info['triton']}, torch {info['torch']}, "
                 f"cuDNN {common.cudnn_version_text(info.get('cudnn'))}")
    ax.set_ylim(0, 1.3 * max(max(r["implicit_gemm_tflops"], r["cudnn_tflops"]) for r in rows))
    ax.legend(loc="upper right", ncol=2)        # in the headroom above the bars
    ax.grid(axis="y", alpha=0.3)
    common.save_figure(fig, outdir, "02_implicit_gemm_vs_cudnn" + ("_recorded" if recorded else ""), data)


QUOTED_RUN = "h100-2026-11-24"     # the ladder's run the closing cell quotes (lesson 04 quotes it too)


def show_recorded_bench(outdir):
    """Without a GPU: these layers' implicit GEMM and cuDNN figures from the quoted run of the
    ladder (which times lesson 02's kernel too), printed and drawn."""
    path = common.RESULTS_DIR / QUOTED_RUN / "05_tflops_per_shape.json"
    data = json.loads(path.read_text())
    info = {key: data.get(key) for key in ("device", "torch", "triton", "cudnn")}
    info.update(date=QUOTED_RUN[-10:])
    print(f"\nImplicit GEMM vs cuDNN as measured on a GPU (RECORDED, not measured here; "
          f"{path.relative_to(common.REPO_ROOT)}):")
    labels = [shape[0] for shape in [common.HEADLINE_SHAPE] + common.RESNET50_3X3_SHAPES]
    rows = [{"shape": r["shape"], "implicit_gemm_tflops": r["02 implicit GEMM"]["tflops"],
             "cudnn_tflops": r["cuDNN"]["tflops"], "ratio": r["02 implicit GEMM"]["tflops"] / r["cuDNN"]["tflops"]}
            for r in data["rows"] if r["shape"] in labels]
    plot_implicit_vs_cudnn(rows, info, data["dtype"], outdir, recorded=info)
    return rows


# %%
# What lesson 02 measured, what limits it, what comes next
# --------------------------------------------------------
# Measured: explicit and implicit GEMM match torch.nn.functional.conv2d; explicit im2col writes
# and reads back R*S/(sh*sw) times the input; `tl.dot` compiles to warpgroup MMAs fed by a
# 3-stage `cp.async` pipeline. On an H100 (80GB HBM3, bf16, Triton 3.8.0, 2026-11-24; the ladder's
# run `results/h100-2026-11-24/05_tflops_per_shape.json`, which lesson 04 quotes too) the implicit
# GEMM ran the headline layer at 445 TFLOPS (timed once), cuDNN at 675 (in rounds).
#
# What limits it: the compiler owns the schedule. It pipelines only the channel blocks of one tap
# and drains at every tap, and each step's addresses, masks and 64-bit pointers are integer work
# and registers in the same warps that feed the tensor cores.
#
# Next: lesson 03 studies Hopper's TMA im2col mode, a hardware copy unit that computes a tile's addresses
# and padding from a descriptor; lesson 04 builds the implicit GEMM on it in Gluon and writes the
# pipeline (barriers, stages, MMA waits) itself.


# %%
if __name__ == "__main__":
    args = common.lesson_args("Lesson 02: im2col, explicit and implicit")
    outdir = common.output_dir(args.outdir)
    run_toy_im2col()
    for case in CONV_CASES[:3]:
        run_conv_case(conv2d_im2col_explicit, case, torch.float16)
        run_conv_case(conv2d_implicit_gemm, case, torch.bfloat16)
    print("explicit im2col + GEMM and implicit GEMM match torch.nn.functional.conv2d")
    run_materialization_cost(outdir, bench=args.bench)
    run_show_ptx()
    if common.HAS_CUDA and (args.bench or not args.quick):
        bench_implicit_vs_cudnn(outdir, quick=args.quick)
    elif not common.HAS_CUDA:
        print("[skip] GPU timings and the cuDNN comparison: no CUDA GPU on this machine")
        show_recorded_bench(outdir)
    if common.HAS_CUDA:
        print(f"\nlesson 02: all checks passed on {common.gpu_name()}")
    else:
        print("\n" + common.cpu_closing_line(
            "02", "the im2col, GEMM and implicit-GEMM kernels against torch, in the Triton interpreter",
            "timings and the cuDNN comparison", gpu="a CUDA GPU"))
