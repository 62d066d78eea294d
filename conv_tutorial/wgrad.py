"""dW through a per-shape plan: lesson 07's wgrad kernel behind the forward's cheap host path.

Why: lesson 07's plain launcher, `conv2d_wgrad_launch`, does on every call what depends only on
the shape: it validates, chooses the split, builds two TMA descriptors (Triton validates each,
tens of microseconds of Python) and launches the kernel and the split-K sum through Triton's generic
launcher (binding and re-specializing their arguments each time): whole calls ran far slower than
the kernels (RESULTS.md, "The operator's gradients"). The forward solved
the same problem with plans (launch.py); this module does the same for wgrad:

- `WgradPlan`, one per (geometry, dtype, device): the first call runs lesson 07's own
  `prepare_wgrad` (config, split-K, grid, shared layouts, validated descriptors) and launches both
  kernels through Triton's launcher (compiling them); the plan keeps that launch without its
  tensors (launch.py's `_tensorless`) and a `DirectLaunch` of each compiled kernel.
- A conv with few channels (ResNet-50's stem) runs as lesson 07's launcher runs it
  (`wgrad_problem`): the stride folded into the channels, the column taps too, x folded on each
  call, dW unfolded.
- Any other conv whose channels fit the tiles badly (80, 144, 160 or 3 of them in boxes of 128 or 16
  per tap) runs with its S column taps in the channels (runtime.FoldedConv, the forward's fold:
  x_fold[n, h, ox, s*Ci + c], one launch) where that saves more MMA columns than the copy costs
  (`column_fold`): an R x 1 conv over S*Ci channels, whose dW [Co, R, 1, S*Ci] is the conv's (a
  view of it where S*Ci fills whole 16-byte rows, else copied out by torch). Lesson 07's launcher
  does not fold columns: such a conv runs other tiles and splits than the lesson's (its bits are
  the lesson launcher's on the folded conv), and x_fold, S/stride_w times x's size, is a workspace
  of the call (304 MiB for Inception v3's 73x73 80-channel layer at batch 128).
- A conv the fold leaves as it is, and a folded one, take lesson 07's `default_wgrad_config`, which
  gives channels that pad its widest tiles badly narrower tiles (`least_padded_config`: 160 channels
  in 3 x 64 columns). The fold is decided against the widest tiles: on the four layers of the
  probed networks it folds, the narrower tiles without the fold measured slower than the fold
  (RESULTS.md, "Narrower tiles where the channels pad the widest").
- Later calls pad x's channels and dY's Co to 16-byte rows where the shape needs it (lesson 07's
  `wgrad_operands`), allocate dW and, where some tiles are split, the fp32 workspace, and launch
  the kernel and (where some tiles are split) the sum directly: the
  descriptors are the templates re-based on this call's tensors (DirectLaunch encodes a tensor
  map per new address from the validated template), pointers are passed as addresses.
- The workspace is allocated per call, not kept by the plan: PyTorch's caching allocator hands it
  out on the current stream in a few microseconds, so two streams, or a CUDA graph captured while
  another replays, never share one; a kept workspace would need a stream and graph discipline of
  its own, and would hold up to 16 MB per layer (ResNet-50's 14x14 256->256 3x3) between calls.
- `conv2d_weight_grad` finds a call's plan by what it shows at a glance (shapes, dtypes, devices,
  hyper-parameters), as runtime.conv2d does: a hit skips `check_backward_call`, which
  the first call of that key passed; contiguity is checked on every call.

What a call costs with and without the plan: RESULTS.md, "Host time";
tests/operator/test_wgrad_plan.py checks it on a GPU bit for bit against the plain launcher and on
a CPU with stand-ins for the compiled kernels. Calls launch on the current device's current
stream, as Triton's launcher does (autograd runs a backward with its tensors' device current).
"""
import functools

import torch

from .geometry import call_key, device_facts
from .launch import (DirectLaunch, _check_tma_aligned, _descriptors, _new_like, _tensorless, compiling_ahead_active,
                     record_breaks, record_scratch, record_step)
from .kernels import gradients, wgrad as wgrad_kernels
from .runtime import FoldedConv

DESCRIPTORS = ("dy_desc", "x_desc")     # lesson 07's WgradLaunch fields, in conv2d_wgrad_kernel's order

# MMA FLOPs worth one byte copied: the wgrad kernel's ~600 TFLOPS on an H100 over its 3.35 TB/s, as
# kernels/wgrad.py's workspace_k_steps counts a workspace's bytes
FLOPS_PER_BYTE = 180


def mma_columns(Co, taps, channels):
    """The MMA columns wgrad's tiles spend on `taps` taps of `channels` channels each: the channels
    rounded up to whole tiles of wgrad_config's width."""
    block_n = wgrad_kernels.wgrad_config(Co, channels).block_n
    return taps * -(-channels // block_n) * block_n


def column_fold(geometry, element_size=2):
    """The runtime.FoldedConv whose R x 1 conv wgrad runs for `geometry`, where folding the S column
    taps into the channels makes dW cheaper, else None. The folded conv, over S*Ci channels (16-byte
    padded), spends R * mma_columns(S*Ci) columns against R * S * mma_columns(Ci), for a copy of x
    (read once, written S/stride_w times as large). It pays where the columns it saves, at
    FLOPS_PER_BYTE, outweigh the copy by 10%: 144 channels at 3x3 (3 x 2 x 128 columns a row of taps,
    folded 432 in 4 x 128), 80 (3 x 128, folded 240 in 256), 3 (3 x 16, folded 9 in 16); not 64
    (3 x 64, folded 192 in 2 x 128) or 128 (3 x 128, folded 384 in 3 x 128). Arithmetic on the shape
    alone, at an H100's FLOPS_PER_BYTE whatever the GPU, and with wgrad_config's rows (not the narrow
    tiles default_wgrad_config may pick); grouped convs are left as they are."""
    g = geometry
    if g.groups != 1 or g.S == 1:
        return None
    fold = FoldedConv(g)
    block_m = wgrad_kernels.wgrad_config(g.Co, g.Ci).block_m
    rows = -(-g.Co // block_m) * block_m                           # output channels, in whole tiles
    flops_per_column = 2 * g.M * rows
    now = flops_per_column * mma_columns(g.Co, g.R * g.S, g.Ci)
    folded = flops_per_column * mma_columns(g.Co, g.R, fold.channels_padded)
    copy_bytes = element_size * g.N * g.H * (g.W * g.Ci + g.out_w * fold.channels_padded)
    return fold if folded + FLOPS_PER_BYTE * copy_bytes <= 0.9 * now else None


class WgradPlan:
    """Everything about one wgrad (geometry, dtype, device) that does not depend on the tensors."""

    def __init__(self, geometry, dtype, arch, num_sms):
        self.geometry, self.dtype, self.arch, self.num_sms = geometry, dtype, arch, num_sms
        # few channels (the stem): the conv lesson 07's launcher runs for it, folded (lesson 07's wgrad_problem)
        self.problem = wgrad_kernels.wgrad_problem(geometry, dtype.itemsize)
        # else, channels that fit the tiles badly: the column taps in the channels, where that pays
        self.column_fold = column_fold(geometry, dtype.itemsize) if self.problem.fold is None else None
        self.run_geometry = self.column_fold.geometry if self.column_fold else self.problem.geometry
        # dW is the kernel's output itself, or a view of it; else torch copies it out of the kernel's (a "finish")
        self.dw_is_kernels = self.problem.fold is None and (
            self.column_fold is None or self.column_fold.channels == self.column_fold.channels_padded)
        self.template = None      # the first call's WgradLaunch without its tensors: descriptors, grid, shape, split
        self.kernel = None        # DirectLaunch of conv2d_wgrad_kernel
        self.sum = None           # DirectLaunch of wgrad_split_k_sum_kernel (split-K's ordered sum); None if
                                  # no tile is split (lesson 07's split-K)
        self.sum_grid = self.sum_scalars = None    # the sum's grid and its integer arguments: fixed by the plan

    def run(self, x_nhwc, dy_nhwc):
        """dW [Co, R, S, Ci] in the plan's dtype of x [N, H, W, Ci] and dY [N, out_h, out_w, Co]:
        contiguous, of the plan's shapes, dtype and device (the caller has checked)."""
        x_given = x_nhwc
        if self.column_fold is not None:        # (a launch: a replay repeats it, no "derive" step)
            x_given = x_nhwc = self.column_fold.fold_input(x_nhwc)
        else:
            x_nhwc = wgrad_kernels.wgrad_input(x_nhwc, self.problem)       # x itself, unless folded
        g = self.run_geometry
        dw = torch.empty(g.Co, g.R * g.S * g.Ci_group, device=x_nhwc.device, dtype=self.dtype)
        if self.kernel is None:
            record_breaks()
            if compiling_ahead_active():          # launch.compiling_ahead: compile in its pool, run nothing
                self._compile_only(x_nhwc, dy_nhwc, dw)
            else:
                self._first_launch(x_nhwc, dy_nhwc, dw)
        else:
            x_run = x_nhwc
            x_nhwc, dy_2d = wgrad_kernels.wgrad_operands(x_nhwc, dy_nhwc, g)
            _check_tma_aligned(x_nhwc)
            _check_tma_aligned(dy_2d)
            template = self.template
            partial = _new_like(template.partial, x_nhwc.device)
            # the kernel's arguments in its order: dy_desc, x_desc (tensors: DirectLaunch re-bases
            # the templates on them), dw_ptr, partial_ptr (dw's where no tile is split), shape
            partial_ptr = dw.data_ptr() if partial is None else partial.data_ptr()
            self.kernel(template.grid, dy_2d, x_nhwc, dw.data_ptr(), partial_ptr, template.shape)
            if self.sum is not None:
                self.sum(self.sum_grid, partial_ptr, dw.data_ptr(), *self.sum_scalars)
            # (for a replay of the operator's call: launch.Recording; the stem's folded x, and a dW unfolded or
            # copied out of a workspace, are remade by torch on each replay; a column fold's x is its launch,
            # recorded as it ran)
            if x_run is not x_given:
                record_step(("derive", functools.partial(wgrad_kernels.wgrad_input, problem=self.problem),
                             x_given.data_ptr(), (x_run.data_ptr(), x_run.nbytes)), (x_run,))
            if not self.dw_is_kernels:
                record_scratch(dw)
            record_scratch(partial)
            record_step(("launch", self.kernel, template.grid, (dy_2d.data_ptr(), x_nhwc.data_ptr(), dw.data_ptr(),
                                                                partial_ptr, template.shape), (0, 1, 2, 3)),
                        (dy_2d, x_nhwc, dw))
            if self.sum is not None:
                record_step(("launch", self.sum, self.sum_grid, (partial_ptr, dw.data_ptr(), *self.sum_scalars), (0, 1)))
        result = self._result(dw)
        if self.kernel is not None and not self.dw_is_kernels:
            record_step(("finish", self._result, dw.data_ptr(), (result.data_ptr(), result.nbytes)), (result,))
        return result

    def _result(self, dw):
        # the conv's dW [Co, R, S, Ci] from the kernel's [Co, R' * S' * Ci'] (unfolded where the problem folds)
        g = self.run_geometry
        if self.column_fold is not None:        # [Co, R, 1, S*Ci padded]: the padding channels dropped
            o = self.geometry
            kept = dw.view(o.Co, o.R, g.Ci)[..., :self.column_fold.channels]
            # (a view where no channel is padding; else a contiguous copy, as callers and a replay's finish take it)
            return (kept if self.dw_is_kernels else kept.contiguous()).view(o.Co, o.R, o.S, o.Ci)
        return wgrad_kernels.wgrad_result(dw.view(g.Co, g.R, g.S, g.Ci_group), self.geometry, self.problem)

    def _prepared(self, x_nhwc, dy_nhwc):
        # lesson 07's launch of this call (config, split, grid, descriptors), its config checked
        launch = wgrad_kernels.prepare_wgrad(x_nhwc, dy_nhwc, self.run_geometry, None, self.arch, self.num_sms)
        wgrad_kernels.check_wgrad_config(launch.config, self.arch)
        return launch

    def _first_launch(self, x_nhwc, dy_nhwc, dw):
        """The kernels' first launch, through Triton's launcher (which compiles); keeps its template and a
        DirectLaunch of each kernel for the calls after it."""
        launch = self._prepared(x_nhwc, dy_nhwc)
        template = _tensorless(launch, DESCRIPTORS, buffers=("partial",), cleared=())
        kernel = DirectLaunch.first_launch(wgrad_kernels.conv2d_wgrad_kernel, launch.grid, launch.kernel_args(dw),
                                           wgrad_kernels.wgrad_kernel_options(launch.config, self.arch),
                                           _descriptors(template, DESCRIPTORS))
        if launch.partial is not None:
            grid, args, constexprs = wgrad_kernels.sum_partials_launch(launch, dw)
            self.sum = DirectLaunch.first_launch(wgrad_kernels.wgrad_split_k_sum_kernel, grid, args, constexprs)
            self.sum_grid, self.sum_scalars = grid, args[2:]
        self.template, self.kernel = template, kernel

    def _compile_only(self, x_nhwc, dy_nhwc, dw):
        """Inside `launch.compiling_ahead`: hand both kernels' compiles to its pool and launch nothing (dW
        comes back unwritten). The specialization, and so Triton's cache key, is the one `_first_launch`
        computes for these tensors, which the first real call then finds compiled."""
        launch = self._prepared(x_nhwc, dy_nhwc)
        wgrad_kernels.conv2d_wgrad_kernel.warmup(*launch.kernel_args(dw), grid=launch.grid,
                                                 **wgrad_kernels.wgrad_kernel_options(launch.config, self.arch))
        if launch.partial is not None:
            grid, args, constexprs = wgrad_kernels.sum_partials_launch(launch, dw)
            wgrad_kernels.wgrad_split_k_sum_kernel.warmup(*args, grid=grid, **constexprs)


_PLANS = {}          # (geometry, dtype, device) -> WgradPlan
_FAST_PLANS = {}     # call key -> WgradPlan


def plan_for(geometry, dtype, device):
    """The plan of a checked call, built on the first call of its (geometry, dtype, device)."""
    key = (geometry, dtype, device)
    plan = _PLANS.get(key)
    if plan is None:
        arch, num_sms, _ = device_facts()
        plan = _PLANS[key] = WgradPlan(geometry, dtype, arch, num_sms)
    return plan


def conv2d_weight_grad(x_nhwc, dy_nhwc, w_shape, stride=1, padding=0, dilation=1, groups=1):
    """dW [Co, R, S, Ci] (w_shape) of a conv of x [N, H, W, Ci] from dY [N, out_h, out_w, Co] (fp16
    or bf16, contiguous NHWC, on a Hopper or Blackwell GPU), in x's dtype: lesson 07's
    `conv2d_wgrad_launch` with its default config, the same arguments, errors and result, through a
    plan per shape; where the plan folds a conv's columns (`column_fold`), the lesson launcher's
    result on the folded conv, and an x the fold reads without TMA need not be 16-byte aligned.
    groups > 1 where the package's backward_groups_reason allows it."""
    key = call_key((x_nhwc, dy_nhwc), w_shape, stride, padding, dilation, type(groups), groups)
    plan = _FAST_PLANS.get(key) if key is not None else None
    if plan is None or not (x_nhwc.is_contiguous() and dy_nhwc.is_contiguous()):
        geometry = gradients.check_backward_call({"x_nhwc": x_nhwc, "dy_nhwc": dy_nhwc}, getattr(x_nhwc, "shape", None),
                                                w_shape, stride, padding, dilation, groups)
        plan = plan_for(geometry, x_nhwc.dtype, x_nhwc.device)
        if key is not None:
            _FAST_PLANS[key] = plan
    return plan.run(x_nhwc, dy_nhwc)
