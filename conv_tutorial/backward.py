"""The conv's gradients for the operator's backward: torch's (cuDNN), or the package's kernels.

    conv_tutorial.set_backward("lesson06")   # dgrad and wgrad on the kernels lessons 06 and 07 teach, where they run
    conv_tutorial.set_backward("torch")      # the default: aten.convolution_backward (cuDNN)

The default stays torch's: with the package's kernels a training step runs at torch.compile's pace with and
without CUDA graphs, but its first steps do not (each kernel compiles at its first call unless
`compile_kernels_ahead` ran, and even then the warm first steps take longer; RESULTS.md, "Training", "Where the
first step's compile goes"), so the kernels are a choice made with the training recipe. With "lesson06", each gradient
a call needs runs on the lessons' kernels where they cover the call (fp16 or bf16; groups 1, or
groups whose channels the kernels' tiles keep to; input, weight and gradient on one Hopper or
data-centre Blackwell GPU): dgrad as lesson 06's phases (or, with few channels at a stride, its
folded conv), each a conv through this package's runtime that stores into its phase's pixels of
dX (an output window), or, where every phase has taps (a 3x3 stride-2 conv), all of them as one
conv (kernels/dgrad.py: one launch of the forward kernel), the weights read where they lie
(a core.FlippedFilter, no flipped copy) where their rows are whole 16-byte vectors;
wgrad as lesson 07's kernel
(kernels/wgrad.py) through a plan per shape (wgrad.py). Elsewhere torch's convolution_backward computes it, with one
warning per reason, and `backward_fallbacks()` counts every such gradient: what a model's backward
left to torch, and why. `$CONV_TUTORIAL_BACKWARD` sets the choice for a process.
"""
import os
import warnings
from typing import List

import torch

from . import hostpath, native, runtime, selection, wgrad
from .configs import grouped_conv_fits
from .geometry import current_arch, device_facts, nhwc_view
from .launch import SmallLaunches, compiling_ahead_active, plan_for, record_breaks
from .traced_compiles import compiles_when_traced
from . import core
from .kernels import dgrad as dgrad_kernels, fprop, gradients

BACKENDS = ("torch", "lesson06")
_BACKEND = os.environ.get("CONV_TUTORIAL_BACKWARD", "torch")
_FALLBACKS = {}        # reason -> gradients torch computed for that reason, with "lesson06" chosen
_DGRAD_PLANS = {}      # geometry -> (kernels.gradients.stride_fold, kernels.dgrad.dgrad_phases): shape arithmetic only


def set_backward(backend: str):
    """Which code computes the conv's gradients in the operator's backward: "torch" (the default,
    aten.convolution_backward: cuDNN on a GPU) or "lesson06" (the dgrad and wgrad kernels of lessons 06 and 07
    where they cover the call, torch elsewhere, with one warning per reason)."""
    global _BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _BACKEND = backend
    native.invalidate()     # (the gradients' path depends on it: the native programs of the other are stale)


def backward_backend() -> str:
    if _BACKEND not in BACKENDS:
        raise ValueError(f"$CONV_TUTORIAL_BACKWARD must be one of {BACKENDS}, got {_BACKEND!r}")
    return _BACKEND


def lesson06_reason(grad_output, input, weight, groups, kind="input", stride=1, padding=0, dilation=1):
    """Why the lessons' kernels cannot compute this call's gradient `kind` ("input": dX, "weight": dW),
    or None if they can."""
    dtypes = {grad_output.dtype, input.dtype, weight.dtype}
    if len(dtypes) != 1 or input.dtype not in (torch.float16, torch.bfloat16):
        return (f"dtypes {grad_output.dtype}/{input.dtype}/{weight.dtype} of grad_output/input/weight (the backward "
                f"kernels take float16 or bfloat16, all three the same)")
    devices = {grad_output.device, input.device, weight.device}
    if len(devices) != 1 or input.device.type != "cuda":
        return f"tensors on {', '.join(sorted(map(str, devices)))} (the lessons' kernels run on one CUDA GPU)"
    arch = current_arch(input.device)
    if arch is None:
        return (f"GPU {torch.cuda.get_device_name(input.device)} (the lessons' kernels need Hopper sm_90 or "
                f"data-centre Blackwell sm_100)")
    if groups != 1:
        N, Ci, H, W = input.shape
        g = core.conv_geometry((N, H, W, Ci), (weight.shape[0], *weight.shape[2:], weight.shape[1]), stride,
                                 padding, dilation, groups)
        if kind == "input" and not grouped_conv_fits(g.Co_group, g.Ci_group, arch):
            return ("a grouped conv whose dX, a grouped conv of dY (Co / groups channels in, Ci / groups out), the "
                    "forward's kernel does not run (its tiles must keep to one group: lesson 05, section 10)")
        if kind == "weight" and gradients.backward_groups_reason(g, "wgrad") is not None:
            return ("a grouped conv whose groups lesson 07's wgrad tiles cannot keep to (it takes a multiple of 64 "
                    "output and of 8 input channels per group)")
    return None


def backward_fallbacks() -> dict:
    """{reason: how many gradients (dX or dW, one per call) torch's convolution_backward computed
    for that reason} since the process started or the last reset, with "lesson06" chosen: what
    the lessons' kernels did not cover in a model (grouped convs, fp32, CPU tensors, ...). The
    warning comes once per reason; this counts every call."""
    return dict(_FALLBACKS)


def reset_backward_fallbacks():
    """Start the count (and the once-per-reason warnings) afresh: before a model's first step, say."""
    _FALLBACKS.clear()


def _count_fallback(reason):
    if compiling_ahead_active():     # (a pass that compiles ahead, on stand-ins or garbage: not the model's gradients)
        return
    if reason not in _FALLBACKS:
        warnings.warn(f"conv_tutorial::conv2d backward: {reason}; using torch's convolution_backward instead "
                      f"(said once; conv_tutorial.backward_fallbacks() counts every such gradient)", stacklevel=4)
    _FALLBACKS[reason] = _FALLBACKS.get(reason, 0) + 1


def _fprop(dy_nhwc, w_phase, padding, dilation, groups=1, out_window=None, residual=None, activation="none"):
    """One phase's stride-1 conv for kernels.dgrad's dgrad_by_phases, through the forward's runtime
    (into dX's phase itself, given its out_window; with the epilogue's residual and activation, as
    kernels.dgrad's dgrad_through_relu gates dX)."""
    return runtime.conv2d(dy_nhwc, w_phase, None, 1, padding, dilation, tune=selection.autotune_enabled(),
                          groups=groups, out_window=out_window, residual=residual, activation=activation)


def conv_gradients(grad_conv, input, weight, stride, padding, dilation, groups, needs_input, needs_weight,
                   relu_gated=False):
    """(grad_input or None, grad_weight or None) of conv2d(input, weight) for the gradient
    grad_conv of its output: NCHW-shaped tensors in channels_last memory (a layout fixed ahead of
    the call, as the operators' fake implementations must promise one).

    Each gradient is an operator of its own (torch.ops.conv_tutorial.conv2d_input_grad and
    conv2d_weight_grad, below) that reads the backend when it runs. torch.compile traces this
    function once, with tensors that hold no data, and keeps what it traced in its caches, in
    memory and on disk, keyed by the forward graph: with the choice made here, a model compiled
    under one backend would keep it after set_backward. Recorded as operators, the choice and the
    launches happen at every call, on the real tensors. relu_gated: `input` is a ReLU's output, and
    grad_input is the gradient of that ReLU's input (conv2d_input_grad_relu)."""
    args = (grad_conv, input, weight, list(stride), list(padding), list(dilation), groups)
    input_grad = torch.ops.conv_tutorial.conv2d_input_grad_relu if relu_gated else \
        torch.ops.conv_tutorial.conv2d_input_grad
    grad_input = input_grad(*args) if needs_input else None
    grad_weight = torch.ops.conv_tutorial.conv2d_weight_grad(*args) if needs_weight else None
    return grad_input, grad_weight


def _why_torch(kind, grad_output, input, weight, stride, padding, dilation, groups):
    if backward_backend() == "torch":
        return "the default backend"
    reason = lesson06_reason(grad_output, input, weight, groups, kind, stride, padding, dilation)
    if reason is not None:
        _count_fallback(reason)
    return reason


def _torch_gradient(which, grad_conv, input, weight, stride, padding, dilation, groups):
    mask = [which == "input", which == "weight", False]
    grads = torch.ops.aten.convolution_backward(grad_conv, input, weight, None, stride, padding, dilation, False,
                                                [0, 0], groups, mask)
    return grads[0 if which == "input" else 1]


def _input_grad(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, stride: List[int],
                padding: List[int], dilation: List[int], groups: int) -> torch.Tensor:
    """dX: lesson 06's mapping (a stride-1 conv of dY per phase of dX; with few channels at a
    stride, of the conv with the stride folded into the channels), each conv through the forward's
    runtime (a plan per shape, the heuristic's or a tuned config), or torch's. The phases' and the
    fold's arithmetic depends on the shape alone and is kept per shape; the flipped weights of each
    phase are the weights' values, computed on every call."""
    return _dgrad(grad_output, input, weight, stride, padding, dilation, groups, False)


def _input_grad_relu(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, stride: List[int],
                     padding: List[int], dilation: List[int], groups: int) -> torch.Tensor:
    """dX where input > 0, else 0: the gradient that reaches a ReLU's input when `input` is that
    ReLU's output (ReLU's backward, taken from its output). On the lessons' kernels, dgrad's epilogue
    applies it where dX is one conv's whole output (lesson 08: the forward kernel reads
    `input` in the tile's own layout, as it reads a residual); elsewhere torch applies it to dX."""
    return _dgrad(grad_output, input, weight, stride, padding, dilation, groups, True)


def _dgrad(grad_output, input, weight, stride, padding, dilation, groups, relu_gated):
    if grad_output.is_cuda:     # a call of a key seen before: its replay (hostpath.py)
        key = hostpath.replay_key((grad_output, input, weight), "conv2d_input_grad", *stride, *padding, *dilation,
                                  groups, relu_gated, backward_backend())
        tensors = {"grad_output": grad_output, "input": input, "weight": weight}
        op = "conv_tutorial::conv2d_input_grad_relu" if relu_gated else "conv_tutorial::conv2d_input_grad"
        return hostpath.call(op, key, grad_output.device, tensors, lambda: _dgrad_full_path(
            grad_output, input, weight, stride, padding, dilation, groups, relu_gated), ("grad_input",))
    return _dgrad_full_path(grad_output, input, weight, stride, padding, dilation, groups, relu_gated)


def _dgrad_full_path(grad_output, input, weight, stride, padding, dilation, groups, relu_gated):
    if _why_torch("input", grad_output, input, weight, stride, padding, dilation, groups):
        dx = _torch_gradient("input", grad_output, input, weight, stride, padding, dilation, groups)
        if relu_gated:
            dx = torch.where(input > 0, dx, torch.zeros((), dtype=dx.dtype, device=dx.device))
    else:
        w_nhwc = nhwc_view(weight)                       # weight [Co, Ci, R, S] -> [Co, R, S, Ci]
        x_shape = (input.shape[0], input.shape[2], input.shape[3], input.shape[1])
        geometry = core.conv_geometry(x_shape, tuple(w_nhwc.shape), stride, padding, dilation, groups)
        plan = _DGRAD_PLANS.get(geometry)
        if plan is None:
            fold = gradients.stride_fold(geometry, input.element_size())
            phases = dgrad_kernels.dgrad_phases(geometry if fold is None else fold.geometry)
            plan = _DGRAD_PLANS[geometry] = (fold, phases)
        options = dict(fold=plan[0], phases=plan[1], conv=_side_by_side_conv, in_place=True, zeros=_launch_zeros)
        if max(stride) > 62:
            record_breaks()     # (kernels.dgrad's untapped_zeros then fills dX with torch, which no replay repeats)
        dy_nhwc = nhwc_view(grad_output)
        dx = (dgrad_kernels.dgrad_through_relu(dy_nhwc, w_nhwc, nhwc_view(input), geometry, _fprop, **options)
              if relu_gated
              else dgrad_kernels.dgrad(dy_nhwc, w_nhwc, geometry, _fprop, **options)).permute(0, 3, 1, 2)
    return dx.contiguous(memory_format=torch.channels_last)            # the layout the fake promises


def _side_by_side_conv(dy_nhwc, w_side_by_side, plan, out_window):
    """kernels.dgrad's one-launch conv (`side_by_side_launch`'s work) through the forward's plan of its
    shape and config (launch.py): the tiles in phase_order's order, the window storing every phase."""
    _, num_sms, _ = device_facts()
    order = dgrad_kernels.phase_order(plan, fprop.tile_counts(plan.config, plan.geometry.M, plan.geometry.Co,
                                                              num_sms)[0])
    out_window = out_window._replace(phases=out_window.phases._replace(order=order))
    plan_for(plan.geometry, dy_nhwc.dtype, plan.config).run(dy_nhwc, w_side_by_side, out_window=out_window)


_ZEROS = SmallLaunches(dgrad_kernels.untapped_zeros_kernel)


def _launch_zeros(kernel, grid, args, kwargs):
    """untapped_zeros' launch, a launch a replay repeats (launch.SmallLaunches)."""
    if kernel is not _ZEROS.kernel:
        raise ValueError(f"_launch_zeros launches {_ZEROS.kernel.fn.__name__}, got {kernel}")
    _ZEROS(grid, args, kwargs)


def _weight_grad(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, stride: List[int],
                 padding: List[int], dilation: List[int], groups: int) -> torch.Tensor:
    """dW: lesson 07's wgrad kernel through a plan per shape (wgrad.py), or torch's."""
    if grad_output.is_cuda:     # a call of a key seen before: its replay (hostpath.py)
        key = hostpath.replay_key((grad_output, input, weight), "conv2d_weight_grad", *stride, *padding, *dilation,
                                  groups, backward_backend())
        tensors = {"grad_output": grad_output, "input": input}
        return hostpath.call("conv_tutorial::conv2d_weight_grad", key, grad_output.device, tensors, lambda: _weight_grad_full_path(
            grad_output, input, weight, stride, padding, dilation, groups), ("grad_weight",))
    return _weight_grad_full_path(grad_output, input, weight, stride, padding, dilation, groups)


def _weight_grad_full_path(grad_output, input, weight, stride, padding, dilation, groups):
    if _why_torch("weight", grad_output, input, weight, stride, padding, dilation, groups):
        dw = _torch_gradient("weight", grad_output, input, weight, stride, padding, dilation, groups)
    else:
        w_shape = (weight.shape[0], weight.shape[2], weight.shape[3], weight.shape[1])
        dw = wgrad.conv2d_weight_grad(nhwc_view(input), nhwc_view(grad_output), w_shape, tuple(stride),
                                      tuple(padding), tuple(dilation), groups).permute(0, 3, 1, 2)
    return dw.contiguous(memory_format=torch.channels_last)


_LIBRARY = torch.library.Library("conv_tutorial", "FRAGMENT")
for _name, _function, _like in (("conv2d_input_grad", _input_grad, "input"),
                                ("conv2d_input_grad_relu", _input_grad_relu, "input"),
                                ("conv2d_weight_grad", _weight_grad, "weight")):
    _LIBRARY.define(_name + torch.library.infer_schema(_function, mutates_args=()),
                    tags=(torch.Tag.pt2_compliant_tag,))
    _LIBRARY.impl(_name, _function, "CompositeExplicitAutograd")
    native.register(_LIBRARY, _name, _function)     # (no autograd kernel: the CUDA key's alone)

    def _fake(grad_output, input, weight, stride, padding, dilation, groups, _like=_like):
        like = input if _like == "input" else weight
        return torch.empty(like.shape, dtype=like.dtype, device=like.device, memory_format=torch.channels_last)
    # (handed over while traced where the lessons' kernels compute the gradients; torch's have nothing to compile)
    torch.library.register_fake("conv_tutorial::" + _name,
                                compiles_when_traced(_function, when=lambda: _BACKEND != "torch")(_fake))
