"""The operator's entry point on NHWC tensors, `conv2d`: lesson 05's convolution behind a fast
host path.

A call looks its plan up by what it can see at a glance (shapes, dtypes, devices,
hyper-parameters); a dictionary hit skips the full validation that the first call of that key
passed, while contiguity and alignment are still checked on every call. A miss validates
everything (geometry.check_conv_call), picks a config (selection.py: given, tuned or heuristic)
and a plan (launch.py). e4m3 operands (lesson 05, section 9) take the same plans, with a bf16 or
e4m3 output; their scales arrive folded into the epilogue's (ops.conv2d_fp8 folds them, on a GPU
by one launch: `fold_fp8_scales`).

Small channel counts (`FoldedConv`): a layer whose Ci is 8 or less (an RGB stem) is run as an
R x 1 convolution over S*Ci folded channels, 7 k-steps instead of 49 for ResNet-50's stem.
What a call costs on the host: benchmarks/host_time.py measures it (figures in RESULTS.md).
"""
import torch
import triton
import triton.language as tl

from .configs import KernelConfig, grouped_conv_fits
from .geometry import FP8, KERNEL_DTYPES, call_key, check_conv_call, conv_geometry, device_facts
from . import core
from .kernels import fprop
from .launch import SmallLaunches, plan_for, record_breaks
from .selection import epilogue_tag, known_or_heuristic_config, tuned_config


_FAST_PLANS = {}     # call key -> (ConvPlan, FoldedConv or None)


def conv2d(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=None, tune=True,
           scale=None, residual=None, activation="none", out_dtype=None, groups=1, out_window=None,
           channel_stats=None):
    """Lesson 05's convolution through the runtime. Same arguments and result as the plain
    launcher `conv2d_fprop_launch` (epilogue included: act(conv * scale + bias + residual)).
    e4m3 operands (lesson 05, section 9) come already scaled: `scale` carries their dequantizing
    factors, and `out_dtype` is bf16 (None) or e4m3 (any output scale folded into scale and bias).
    `config`: a KernelConfig (or its tuple) to use that config; None to choose one per shape: a
    tuned choice (this process's, or the tuning file's) if there is one, else autotune now when
    `tune`, else the heuristic (no timing). Channel counts so small that one tap's channels fill
    a fraction of a K step (a network's RGB stem) take the folded path (`FoldedConv`).
    groups > 1: w is [Co, R, S, Ci / groups], and a group's channel counts must fit a config's
    tiles (`grouped_conv_fits`; lesson 05, section 10). out_window (a core.OutputWindow: lesson
    06's dgrad phases): the output's pixels go into its view, which is returned; a config with
    split-K stores densely and the window takes a copy. channel_stats (a zeroed fp32 [2, Co] tensor:
    lesson 08's BatchNorm statistics): each output channel's sum (row 0) and sum of squares (row 1)
    are added into it, by the epilogue, or, after a config with split-K, by torch from the output.
    w may be a core.FlippedFilter (lesson 06's dgrad: the forward's filter, read in place)."""
    key = call_key((x_nhwc, w, bias, scale, residual), stride, padding, dilation,
                   config if config is not None else tune, activation, out_dtype, groups)
    entry = _FAST_PLANS.get(key) if key is not None else None
    if entry is None or not (x_nhwc.is_contiguous() and w.is_contiguous()
                             and all(t is None or t.is_contiguous() for t in (bias, scale, residual))):
        # the slow path validates (and explains) everything
        geometry = check_conv_call(x_nhwc, w, bias, stride, padding, dilation, dtypes=KERNEL_DTYPES,
                                          scale=scale, residual=residual, activation=activation, out_dtype=out_dtype,
                                          groups=groups, activations=fprop.EPILOGUE_ACTIVATIONS)
        if groups > 1 and (x_nhwc.dtype == FP8 or (config is None and not grouped_conv_fits(
                geometry.Ci_group, geometry.Co_group, device_facts()[0]))):
            raise ValueError(f"{geometry.describe()}: the kernel runs a grouped conv in fp16 or bf16, with whole "
                             f"tiles per group: output channels per group a multiple of a tile's width (64, 96, "
                             f"128, ...), input channels per group of its K block (16, 32 or 64); got "
                             f"{geometry.Ci_group} -> {geometry.Co_group} per group in {x_nhwc.dtype}")
        # (a FlippedFilter, lesson 06's dgrad weights read in place, is never folded)
        fold = folded_geometry(geometry) if config is None and x_nhwc.dtype != FP8 and isinstance(
            w, torch.Tensor) else None
        run_geometry = fold.geometry if fold is not None else geometry
        if config is not None:
            chosen = KernelConfig(*config)
        elif tune:
            # timed with this call's epilogue: a residual's loads and registers change the ranking
            folded_x, folded_w = fold.apply(x_nhwc, w) if fold is not None else (x_nhwc, w)
            chosen = tuned_config(run_geometry, folded_x, folded_w, bias, scale=scale, residual=residual,
                                  activation=activation, out_dtype=out_dtype)
        else:
            chosen = known_or_heuristic_config(run_geometry, x_nhwc.dtype,
                                               epilogue_tag(scale, residual, activation))
        entry = (plan_for(run_geometry, x_nhwc.dtype, chosen, out_dtype), fold)
        if key is not None:
            _FAST_PLANS[key] = entry
    plan, fold = entry
    if fold is not None:
        x_nhwc, w = fold.apply(x_nhwc, w)
    if out_window is None and channel_stats is None:
        return plan.run(x_nhwc, w, bias, scale, residual, activation)
    # (a fold keeps the output's shape: the plan's geometry checks the destinations)
    core.check_epilogue_destinations(out_window, channel_stats, plan.geometry, plan.out_dtype, x_nhwc.device)
    if plan.config.split_k > 1:
        # split-K's second kernel stores densely, and its slices are partial sums: the window takes a copy of
        # the output, and the statistics come from the output (torch's work: a replay would not repeat it)
        record_breaks()
        out = plan.run(x_nhwc, w, bias, scale, residual, activation)
        if channel_stats is not None:
            channel_stats += channel_sums(out)
        return out if out_window is None else out_window.write(out)
    return plan.run(x_nhwc, w, bias, scale, residual, activation, out_window, channel_stats)


def channel_sums(out_nhwc, dtype=torch.float32):
    """[2, C] in `dtype`: each channel's sum and sum of squares of an NHWC-shaped tensor, by torch
    (what a `channel_stats` call's epilogue adds, where the kernel cannot)."""
    # two passes that read the output as it is and add in `dtype` (no widened copy of it)
    rows = tuple(range(out_nhwc.dim() - 1))
    sums = torch.sum(out_nhwc, dim=rows, dtype=dtype)
    return torch.stack((sums, torch.linalg.vector_norm(out_nhwc, 2, dim=rows, dtype=dtype).square()))


# %% Small channel counts: fold the filter's columns into the channels ---------------------------
# A stem layer (Ci=3, 7x7, stride 2) gives the kernel 49 taps of 3 channels, padded to 8 for TMA
# and to 16 for the MMA: 49 k-steps that are 81% zeros, each a 128-pixel x 32-byte TMA box. Here
# the S columns of the filter are folded into the channels instead: x_fold[n, h, ox, s*Ci + c] =
# x[n, h, ox*stride_w + s*dil_w - pad_w, c] (zero outside), a copy of S*Ci/stride_w times the input's
# size, and the conv becomes R x 1 with stride (stride_h, 1) over S*Ci channels: 7 k-steps of
# 21 channels (padded to 24, a 32-deep K step) for the stem. Only the rows of the filter remain
# as taps, read through the same im2col TMA as every other layer. The fold is one small Triton
# kernel (`fold_columns_kernel`); three torch copies doing the same took more than half the
# stem's time.

FOLD_MAX_CHANNELS = 8       # a padded Ci of 8 or less: one tap fills at most half of a 16-deep K step


@triton.jit
def fold_columns_kernel(x_ptr, out_ptr, rows, W, out_w, Ci, stride_w, pad_w, dil_w, channels,
                        channels_padded, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[row, ox, s*Ci + c] = x[row, ox*stride_w + s*dil_w - pad_w, c] (0 outside, and in the
    padding channels), row = n*H + h: one pass that reads each input pixel from cache S/stride_w
    times and writes the folded tensor once. Programs along axis 1 take BLOCK_C folded channels
    each (a wgrad fold has up to S*Ci of them: 480 for a 3x3 filter on 160 channels)."""
    pixels = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)      # (row, ox), linearized
    folded = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)       # s*Ci + c
    row, ox = pixels // out_w, pixels % out_w
    s, c = folded // Ci, folded % Ci
    ix = ox[:, None] * stride_w + s[None, :] * dil_w - pad_w
    in_range = pixels[:, None] < rows * out_w
    valid = in_range & (folded[None, :] < channels) & (ix >= 0) & (ix < W)
    source = (row[:, None].to(tl.int64) * W + ix) * Ci + c[None, :]
    values = tl.load(x_ptr + source, mask=valid, other=0.0)
    target = pixels[:, None].to(tl.int64) * channels_padded + folded[None, :]
    tl.store(out_ptr + target, values, mask=in_range & (folded[None, :] < channels_padded))


class FoldedConv:
    """The R x 1 convolution over folded channels that computes a small-Ci convolution (the forward's,
    `folded_geometry`), or whose dW costs fewer MMA columns folded (wgrad.py, `column_fold`)."""

    def __init__(self, geometry):
        if geometry.groups != 1:
            raise ValueError(f"FoldedConv folds ungrouped convs only, not groups={geometry.groups}")
        g = self.original = geometry
        self.channels = g.S * g.Ci
        self.channels_padded = -(-self.channels // 8) * 8       # 16-byte pixels for TMA
        self.geometry = conv_geometry(
            (g.N, g.H, g.out_w, self.channels_padded), (g.Co, g.R, 1, self.channels_padded),
            (g.stride[0], 1), (g.padding[0], 0), (g.dilation[0], 1))

    def apply(self, x_nhwc, w):
        """(x_fold [N, H, out_w, channels_padded], w_fold [Co, R, 1, channels_padded]): two launches of
        fold_columns_kernel. The weight [Co, R, S, Ci] folds as an input of Co*R rows of S columns does
        into one output column (stride 1, no padding): w_fold[co, r, 0, s*Ci + c] = w[co, r, s, c], zeros
        past S*Ci. (Both are launches, so a replay of the call, launch.Replay, repeats them as it does
        the conv's.)"""
        g = self.original
        x_fold = self.fold_input(x_nhwc)
        w_fold = w.new_empty(g.Co, g.R, 1, self.channels_padded)
        self._copy(w, w_fold, (g.Co * g.R, g.S, 1, g.Ci, 1, 0, 1))
        return x_fold, w_fold

    def fold_input(self, x_nhwc):
        """x_fold [N, H, out_w, channels_padded]: one launch of fold_columns_kernel."""
        g = self.original
        x_fold = x_nhwc.new_empty(g.N, g.H, g.out_w, self.channels_padded)
        self._copy(x_nhwc, x_fold, (g.N * g.H, g.W, g.out_w, g.Ci, g.stride[1], g.padding[1], g.dilation[1]))
        return x_fold

    def _copy(self, source, folded, scalars):
        """Fold `source` ([rows, W, Ci] as rows of pixels) into `folded` with fold_columns_kernel's
        `scalars` (rows, W, out_w, Ci, stride_w, pad_w, dil_w), a launch a replay repeats."""
        if not source.is_contiguous():
            record_breaks()             # (a copy the replay would not make)
            source = source.contiguous()
        rows, out_w = scalars[0], scalars[2]
        block_p, block_c = 64, min(128, triton.next_power_of_2(self.channels_padded))
        kwargs = dict(BLOCK_P=block_p, BLOCK_C=block_c, enable_fp_fusion=True)
        _FOLD_COLUMNS((triton.cdiv(rows * out_w, block_p), triton.cdiv(self.channels_padded, block_c)),
                      (source, folded, *scalars, self.channels, self.channels_padded), kwargs, allocated=(folded,))


_FOLD_COLUMNS = SmallLaunches(fold_columns_kernel)


def folded_geometry(geometry):
    """A FoldedConv for a convolution whose channels are too few for a K step, else None."""
    if geometry.Ci > FOLD_MAX_CHANNELS or geometry.S == 1 or geometry.S * geometry.Ci > 256 or geometry.groups > 1:
        return None
    return FoldedConv(geometry)


def run_operands(geometry, x_nhwc, w):
    """(fold, the geometry the kernel runs, its input, its weight): a small-Ci conv folded (fold a
    FoldedConv), any other as it is (fold None). What the autotuner times, and the runtime runs."""
    fold = folded_geometry(geometry)
    return (fold, fold.geometry, *fold.apply(x_nhwc, w)) if fold is not None else (None, geometry, x_nhwc, w)


# %% fp8: the scales folded into the epilogue's, on the GPU -------------------------------------------

@triton.jit
def fold_fp8_scales_kernel(x_scale_ptr, w_scale_ptr, bias_ptr, out_scale_ptr, scale_ptr, shift_ptr, Co,
                           E4M3_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """geometry.fp8_epilogue on the GPU, the same fp32 operations in the same order: scale[co] =
    x_scale * w_scale[co], and for an e4m3 output scale[co] / out_scale and shift[co] = bias[co] /
    out_scale (round-to-nearest divisions, as torch's)."""
    co = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = co < Co
    scale = tl.load(x_scale_ptr) * tl.load(w_scale_ptr + co, mask=inside, other=1.0)
    if E4M3_OUT:
        out_scale = tl.load(out_scale_ptr)
        scale = tl.div_rn(scale, out_scale)
        if HAS_BIAS:
            shift = tl.div_rn(tl.load(bias_ptr + co, mask=inside, other=0.0).to(tl.float32), out_scale)
            tl.store(shift_ptr + co, shift, mask=inside)
    tl.store(scale_ptr + co, scale, mask=inside)


_FOLD_FP8_SCALES = SmallLaunches(fold_fp8_scales_kernel)


def fold_fp8_scales(x_scale, w_scale, bias, out_scale):
    """(scale, bias) as geometry.fp8_epilogue(x_scale, w_scale, None, bias, out_scale) computes them, by one
    launch of fold_fp8_scales_kernel (a launch a replay repeats, where torch's ops would keep the call in
    Python): CUDA tensors on one device, checked by ops.conv2d_fp8 (geometry.check_fp8_scales, core.check_bias).
    The bias comes back as it is without out_scale, else in fp32 divided by it."""
    Co, e4m3_out = w_scale.shape[0], out_scale is not None
    has_bias = e4m3_out and bias is not None
    scale = torch.empty(Co, dtype=torch.float32, device=w_scale.device)
    shift = torch.empty(Co, dtype=torch.float32, device=w_scale.device) if has_bias else bias
    block = 256
    grid = (triton.cdiv(Co, block),)
    # absent pointers: the scale's (not read)
    pointers = (x_scale, w_scale, bias if has_bias else x_scale, out_scale if e4m3_out else x_scale, scale,
                shift if has_bias else scale)
    _FOLD_FP8_SCALES(grid, (*pointers, Co), dict(E4M3_OUT=e4m3_out, HAS_BIAS=has_bias, BLOCK=block),
                     allocated=(scale, shift) if has_bias else (scale,))
    return scale, shift
