"""Depthwise convolution (groups = channels) in Triton: lesson 01's sliding window with a channel axis.

A depthwise conv gives each channel its own R x S filter: out[n, y, x, c] = sum over (r, s) of
x[n, y*stride + r*dil - pad, x*stride + s*dil - pad, c] * w[c, r, s]. There is no sum over
channels, so no matrix product and nothing for tensor cores: 2 R S flops per output value against
about 2 bytes read and 2 written (bf16; the taps' neighbours come from L1/L2). It is memory-bound,
to be judged in GB/s against the GPU's memory bandwidth.

In NHWC a pixel's channels are contiguous, so a program takes BLOCK_P output pixels x BLOCK_C
channels: each tap loads a BLOCK_P x BLOCK_C tile of the input (coalesced along channels) and
one BLOCK_C vector of weights, and the tile accumulates in fp32; then lesson 05's fused
epilogue, act(acc * scale + bias + residual), and one store. Two choices keep it at memory speed:
the filter's rows are a loop the compiler keeps (unrolling all R x S taps of a 7x7 filter would
hoist 49 tile loads and spill them: 50x slower), its columns are unrolled; and C is a constexpr,
so the compiler knows every pixel's row starts 16-byte aligned and loads 8 channels at a time.
This module is the kernel and its launcher; the PyTorch operator (ops.py) sends depthwise calls
here. The epilogue is lesson 05's own `apply_epilogue`.
"""
import torch
import triton
import triton.language as tl

from .geometry import check_epilogue, conv_output_size, pair
from .kernels import fprop
from .launch import compiling_ahead_active

apply_epilogue = fprop.apply_epilogue     # act(acc * scale + bias + residual), per channel, in fp32 (the
                                             # parts a fprop.Epilogue names)

DEPTHWISE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# The sizes are left unspecialized (Triton would build once per batch or image size that is 1, or a multiple of
# 16, or neither): they only index pixels and bound the padding, which a known alignment does not speed up, so a
# new batch or image size reuses the build. The strides and dilations stay specialized (1 folds a multiply in the
# taps' loop), and C is a constexpr (the 16-byte loads along channels).
@triton.jit(do_not_specialize=["N", "H", "W", "out_h", "out_w", "pad_h", "pad_w"])
def depthwise_conv2d_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, residual_ptr, out_ptr,
                            N, H, W, out_h, out_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                            C: tl.constexpr, R: tl.constexpr, S: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_C: tl.constexpr, EPILOGUE: tl.constexpr):
    pixels = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)     # flattened (n, y, x) of the output
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    pixel_ok, channel_ok = pixels < N * out_h * out_w, channels < C
    n, y, x = pixels // (out_h * out_w), (pixels // out_w) % out_h, pixels % out_w
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for r in range(R):                          # a loop: see the module's docstring
        in_y = y * stride_h - pad_h + r * dil_h
        for s in tl.static_range(S):
            in_x = x * stride_w - pad_w + s * dil_w
            inside = pixel_ok & (in_y >= 0) & (in_y < H) & (in_x >= 0) & (in_x < W)   # padding reads 0
            rows = ((n * H + in_y) * W + in_x).to(tl.int64) * C
            tile = tl.load(x_ptr + rows[:, None] + channels[None, :], mask=inside[:, None] & channel_ok[None, :],
                           other=0.0)
            taps = tl.load(w_ptr + channels * (R * S) + (r * S + s), mask=channel_ok, other=0.0)
            acc += tile.to(tl.float32) * taps.to(tl.float32)[None, :]
    offsets = pixels.to(tl.int64)[:, None] * C + channels[None, :]
    mask = pixel_ok[:, None] & channel_ok[None, :]
    residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0) if EPILOGUE.residual else 0.0
    acc = apply_epilogue(acc, channels, C, scale_ptr, bias_ptr, residual, EPILOGUE)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def channel_block(C):
    """Channels per program: of 64, 32 and 16, the one that pads C least (the widest on a tie), or
    C's power of two below 16: 144 channels take 9 blocks of 16, not 3 of 64 with a third idle."""
    if C < 16:
        return triton.next_power_of_2(C)
    return min((64, 32, 16), key=lambda block: (triton.cdiv(C, block) * block, -block))


def depthwise_conv2d(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, scale=None, residual=None,
                     activation="none", block_p=None):
    """Depthwise conv of x_nhwc [N, H, W, C] with w [C, R, S] (or torch's [C, 1, R, S]), then
    act(. * scale + bias + residual) per channel; returns NHWC [N, out_h, out_w, C] in x's dtype."""
    if not isinstance(x_nhwc, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"x_nhwc and w must be torch.Tensors, got {type(x_nhwc).__name__} and {type(w).__name__}")
    if x_nhwc.dim() != 4 or not x_nhwc.is_contiguous():
        raise ValueError(f"x_nhwc must be a contiguous [N, H, W, C] tensor, got shape {tuple(x_nhwc.shape)} "
                         f"and strides {x_nhwc.stride()}")
    N, H, W, C = x_nhwc.shape
    if w.dim() == 4 and w.shape[1] == 1:
        w = w[:, 0]
    if w.dim() != 3 or w.shape[0] != C:
        raise ValueError(f"w must be [C, R, S] or [C, 1, R, S] with C={C} (one filter per channel), got "
                         f"{tuple(w.shape)}")
    if x_nhwc.dtype not in DEPTHWISE_DTYPES or w.dtype != x_nhwc.dtype:
        raise TypeError(f"x_nhwc and w must share one dtype of {DEPTHWISE_DTYPES}, got {x_nhwc.dtype} and {w.dtype}")
    R, S = w.shape[1:]
    (sh, sw), (ph, pw), (dh, dw) = (pair(v, name, low) for v, name, low in
                                    ((stride, "stride", 1), (padding, "padding", 0), (dilation, "dilation", 1)))
    out_h, out_w = conv_output_size(H, R, sh, ph, dh), conv_output_size(W, S, sw, pw, dw)
    if out_h <= 0 or out_w <= 0:
        raise ValueError(f"the filter {R}x{S} (dilation {(dh, dw)}) does not fit the padded input {H}x{W} "
                         f"(padding {(ph, pw)}): output {out_h}x{out_w}")
    out_shape = (N, out_h, out_w, C)
    check_epilogue(C, out_shape, x_nhwc.dtype, x_nhwc.device, scale, residual, activation)
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (C,)):
        raise ValueError(f"bias must be a tensor of shape ({C},), got {getattr(bias, 'shape', bias)}")
    out = torch.empty(out_shape, device=x_nhwc.device, dtype=x_nhwc.dtype)
    if out.numel() == 0:
        return out
    block_c = channel_block(C)
    block_p = block_p or 4096 // block_c        # 4096 values per program: the fastest of 1024-4096 measured
    grid = (triton.cdiv(N * out_h * out_w, block_p), triton.cdiv(C, block_c))
    args = (x_nhwc, w.contiguous(), bias if bias is not None else out, scale if scale is not None else out,
            residual.contiguous() if residual is not None else out, out, N, H, W, out_h, out_w, sh, sw, ph, pw, dh, dw)
    constexprs = dict(C=C, R=R, S=S, BLOCK_P=block_p, BLOCK_C=block_c, enable_fp_fusion=True,
                      EPILOGUE=fprop.Epilogue(bias is not None, scale is not None, residual is not None, activation))
    if compiling_ahead_active():       # launch.compiling_ahead: compile in its pool, run nothing
        depthwise_conv2d_kernel.warmup(*args, grid=grid, **constexprs)
        return out
    depthwise_conv2d_kernel[grid](*args, **constexprs)
    return out
