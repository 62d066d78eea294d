"""The conv's gradients for the operator's backward: torch's (cuDNN), or lesson 06's kernels.

    conv_tutorial.set_backward("lesson06")   # dgrad and wgrad on lesson 06's kernels where they run
    conv_tutorial.set_backward("torch")      # the default: aten.convolution_backward (cuDNN)

The default stays torch's until lesson 06's kernels measure faster: on an H100 (ResNet-50's convs
at batch 128, bf16, 2026-11-25, results/h100-2026-11-25/backward_layers.json) they ran at 0.64x
(dgrad) and 0.19x (wgrad) cuDNN's speed, geometric means, with host time included. With
"lesson06", each gradient a call needs runs on the lesson's launchers where they cover the call
(fp16 or bf16, groups 1, input, weight and gradient on one Hopper or data-centre Blackwell GPU) and
on torch's convolution_backward otherwise, with one warning per reason (dgrad: lesson 06's phases, each a conv through this package's
runtime; wgrad: lesson 06's kernel through its plain launcher). `$CONV_TUTORIAL_BACKWARD`
sets the choice for a process. Lesson 06 is loaded (kernel.lesson06) on the first call that uses it.
"""
import os
import warnings

import torch

from . import runtime, selection
from .geometry import current_arch, nhwc_view
from .kernel import common

BACKENDS = ("torch", "lesson06")
_BACKEND = os.environ.get("CONV_TUTORIAL_BACKWARD", "torch")
_WARNED = set()


def set_backward(backend: str):
    """Which code computes the conv's gradients in the operator's backward: "torch" (the default,
    aten.convolution_backward: cuDNN on a GPU) or "lesson06" (lesson 06's dgrad and wgrad kernels
    where they cover the call, torch elsewhere, with one warning per reason)."""
    global _BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _BACKEND = backend


def backward_backend() -> str:
    if _BACKEND not in BACKENDS:
        raise ValueError(f"$CONV_TUTORIAL_BACKWARD must be one of {BACKENDS}, got {_BACKEND!r}")
    return _BACKEND


def lesson06_reason(grad_output, input, weight, groups):
    """Why lesson 06's kernels cannot compute this call's gradients, or None if they can."""
    if groups != 1:
        return f"groups={groups} (lesson 06's kernels take groups=1)"
    dtypes = {grad_output.dtype, input.dtype, weight.dtype}
    if len(dtypes) != 1 or input.dtype not in (torch.float16, torch.bfloat16):
        return (f"dtypes {grad_output.dtype}/{input.dtype}/{weight.dtype} of grad_output/input/weight (lesson 06's "
                f"kernels take float16 or bfloat16, all three the same)")
    devices = {grad_output.device, input.device, weight.device}
    if len(devices) != 1 or input.device.type != "cuda":
        return f"tensors on {', '.join(sorted(map(str, devices)))} (lesson 06's kernels run on one CUDA GPU)"
    with torch.cuda.device(input.device):
        arch = current_arch()
    if arch is None:
        return (f"GPU {torch.cuda.get_device_name(input.device)} (lesson 06's kernels need Hopper sm_90 or "
                f"data-centre Blackwell sm_100)")
    return None


def _say_once(reason):
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"conv_tutorial::conv2d backward: {reason}; using torch's convolution_backward instead",
                      stacklevel=4)


def _fprop(dy_nhwc, w_phase, padding, dilation):
    """One phase's stride-1 conv for lesson 06's dgrad_by_phases, through the forward's runtime."""
    return runtime.conv2d(dy_nhwc, w_phase, None, 1, padding, dilation, tune=selection.autotune_enabled())


def conv_gradients(grad_conv, input, weight, stride, padding, dilation, groups, needs_input, needs_weight):
    """(grad_input or None, grad_weight or None) of conv2d(input, weight) for the gradient
    grad_conv of its output: NCHW-shaped tensors, results in the inputs' memory format where
    torch computes them and channels_last where lesson 06 does."""
    reason = "the default backend" if backward_backend() == "torch" else lesson06_reason(grad_conv, input, weight,
                                                                                          groups)
    if reason is not None:
        if reason != "the default backend":
            _say_once(reason)
        grad_input, grad_weight, _ = torch.ops.aten.convolution_backward(
            grad_conv, input, weight, None, stride, padding, dilation, False, [0, 0], groups,
            [needs_input, needs_weight, False])
        return grad_input, grad_weight
    from .kernel import lesson06
    dy, w_nhwc = nhwc_view(grad_conv), nhwc_view(weight)     # weight [Co, Ci, R, S] -> [Co, R, S, Ci]
    x_shape = (input.shape[0], input.shape[2], input.shape[3], input.shape[1])
    grad_input = grad_weight = None
    if needs_input:
        # lesson 06's mapping (a stride-1 conv of dY per phase of dX), each conv through the
        # forward's runtime: a plan per shape, the direct launch, the heuristic's (or a tuned) config
        geometry = common.conv_geometry(x_shape, tuple(w_nhwc.shape), stride, padding, dilation)
        grad_input = lesson06.dgrad_by_phases(dy, w_nhwc, geometry, _fprop).permute(0, 3, 1, 2)
    if needs_weight:
        grad_weight = lesson06.conv2d_wgrad_launch(nhwc_view(input), dy, tuple(w_nhwc.shape), stride, padding,
                                                   dilation).permute(0, 3, 1, 2)
    return grad_input, grad_weight
