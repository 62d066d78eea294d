"""Lesson 05's convolution for PyTorch users: an operator, a drop-in module, a converter.

    import conv_torch                                    # registers torch.ops.conv_tutorial.conv2d
    model = conv_torch.convert_conv2d(model)             # every nn.Conv2d -> TutorialConv2d
    y = model(x.to(memory_format=torch.channels_last))   # NCHW shapes, channels_last memory

- `torch.ops.conv_tutorial.conv2d(input, weight, bias, stride, padding, dilation, groups)` is a
  `torch.library.custom_op` with the arguments of `torch.nn.functional.conv2d` (padding as ints;
  `conv2d` below also takes "same" and "valid"). It takes NCHW-shaped tensors; in channels_last
  memory their NHWC view is contiguous and nothing is copied, otherwise it copies once. It returns
  the NCHW-shaped result in channels_last memory. A fake implementation gives shapes and strides
  to `torch.compile` (fullgraph traces it) and the op runs inside CUDA graphs once warmed up.
  Backward uses PyTorch's convolution backward, so a converted model can be fine-tuned.
- What the kernel does not cover goes to `torch.nn.functional.conv2d`, with one warning per
  reason: groups > 1, dtypes other than fp16/bf16, CPU tensors, GPUs other than Hopper (sm_90)
  and data-centre Blackwell (sm_100), and "same" padding that would need to be asymmetric.
- Configs: a shape seen for the first time gets a heuristic config at once (no timing on the
  critical path); `CONV_TUTORIAL_AUTOTUNE=1` (or `conv_runtime.set_autotune(True)`) times the
  candidates instead, and tuned choices are kept in a JSON file that later processes reuse
  (conv_runtime.tuning_cache_path(): ~/.cache/conv_tutorial/tuning.json, or
  $CONV_TUTORIAL_TUNING_CACHE).
"""
import functools
import warnings
from typing import List, Optional

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import torch

import conv_runtime

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_WARNED = set()


def _fall_back(reason):
    """Say once per reason that calls go to torch.nn.functional.conv2d."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"conv_tutorial::conv2d: {reason}; using torch.nn.functional.conv2d instead",
                      stacklevel=4)


def unsupported_reason(input, weight, groups):
    """Why the tutorial kernel cannot run this call, or None if it can."""
    if groups != 1:
        return f"groups={groups} (the kernel computes groups=1 only)"
    if input.dtype not in KERNEL_DTYPES or weight.dtype != input.dtype:
        return f"dtype {input.dtype}/{weight.dtype} (the kernel takes float16 or bfloat16, both the same)"
    if input.device.type != "cuda":
        return f"tensors on {input.device} (the kernel runs on a CUDA GPU)"
    return _gpu_reason(input.device.index if input.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_reason(device_index):
    """Why this GPU cannot run the kernel, or None (asked once per device: it is on every call's path)."""
    capability = torch.cuda.get_device_capability(device_index)
    if common.is_tma_mma_capability(capability):
        return None
    return (f"GPU {torch.cuda.get_device_name(device_index)} of capability {capability} (the kernel "
            f"needs Hopper sm_90 or data-centre Blackwell sm_100)")


def nhwc_view(t):
    """The NHWC view of an NCHW-shaped tensor: free in channels_last memory, else one copy."""
    view = t.permute(0, 2, 3, 1)
    return view if view.is_contiguous() else view.contiguous()


@torch.library.custom_op("conv_tutorial::conv2d", mutates_args=())
def conv2d_op(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              stride: List[int], padding: List[int], dilation: List[int], groups: int) -> torch.Tensor:
    reason = unsupported_reason(input, weight, groups)
    if reason is not None:
        _fall_back(reason)
        out = torch.nn.functional.conv2d(input, weight, bias, stride, padding, dilation, groups)
        return out.contiguous(memory_format=torch.channels_last)
    out_nhwc = conv_runtime.conv2d(nhwc_view(input), nhwc_view(weight), bias, tuple(stride),
                                   tuple(padding), tuple(dilation), config=None,
                                   tune=conv_runtime.autotune_enabled())
    return out_nhwc.permute(0, 3, 1, 2)          # NCHW shape, channels_last memory


@conv2d_op.register_fake
def _(input, weight, bias, stride, padding, dilation, groups):
    N, _, H, W = input.shape
    Co, _, R, S = weight.shape
    out_h = (H + 2 * padding[0] - dilation[0] * (R - 1) - 1) // stride[0] + 1
    out_w = (W + 2 * padding[1] - dilation[1] * (S - 1) - 1) // stride[1] + 1
    return input.new_empty((N, Co, out_h, out_w)).contiguous(memory_format=torch.channels_last)


def _setup_backward(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(input, weight)
    ctx.conv_args = (stride, padding, dilation, groups, bias is not None)


def _backward(ctx, grad_output):
    input, weight = ctx.saved_tensors
    stride, padding, dilation, groups, has_bias = ctx.conv_args
    grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
        grad_output, input, weight, [weight.shape[0]] if has_bias else None, stride, padding, dilation,
        False, [0, 0], groups, [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias])
    return grad_input, grad_weight, grad_bias if has_bias else None, None, None, None, None


conv2d_op.register_autograd(_backward, setup_context=_setup_backward)


def resolve_padding(padding, weight_shape, stride, dilation):
    """(pad_h, pad_w) for an int, a pair, "valid" or "same"; None where "same" needs asymmetric
    padding (an even dilated filter), which the kernel does not do."""
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        if stride != (1, 1):
            raise ValueError(f"padding='same' is not supported for strided convolutions "
                             f"(stride={stride}), as in torch.nn.functional.conv2d")
        total = [d * (k - 1) for d, k in zip(dilation, weight_shape[2:])]
        if any(t % 2 for t in total):
            return None
        return (total[0] // 2, total[1] // 2)
    if isinstance(padding, str):
        raise ValueError(f"padding must be an int, a pair of ints, 'same' or 'valid'; got {padding!r}")
    return common.pair(padding, "padding", 0)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d's signature, computed by the tutorial's kernel where it can."""
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"input must be [N, Ci, H, W] and weight [Co, Ci/groups, R, S]; got shapes "
                         f"{tuple(input.shape)} and {tuple(weight.shape)}")
    stride, dilation = common.pair(stride, "stride", 1), common.pair(dilation, "dilation", 1)
    pads = resolve_padding(padding, weight.shape, stride, dilation)
    if pads is None:
        _fall_back(f"padding='same' with an even dilated filter {tuple(weight.shape[2:])} needs "
                   f"asymmetric padding")
        return torch.nn.functional.conv2d(input, weight, bias, stride, padding, dilation, groups)
    return conv2d_op(input, weight, bias, list(stride), list(pads), list(dilation), groups)


class TutorialConv2d(torch.nn.Module):
    """A drop-in for nn.Conv2d that calls the tutorial's operator. The weight keeps PyTorch's
    [Co, Ci, R, S] shape (state_dict stays compatible) but is stored in channels_last memory,
    i.e. physically [Co, R, S, Ci], so the kernel reads it without a copy."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        if conv.padding_mode != "zeros":
            raise ValueError(f"padding_mode={conv.padding_mode!r}: the kernel pads with zeros only")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups
        self.weight = torch.nn.Parameter(conv.weight.detach().contiguous(memory_format=torch.channels_last),
                                         requires_grad=conv.weight.requires_grad)
        self.bias = None if conv.bias is None else torch.nn.Parameter(conv.bias.detach(),
                                                                      requires_grad=conv.bias.requires_grad)
        # the operator's arguments, resolved once (a forward call is on the critical path)
        pads = resolve_padding(self.padding, self.weight.shape, tuple(self.stride), tuple(self.dilation))
        self._op_args = None if pads is None else (list(self.stride), list(pads), list(self.dilation),
                                                   self.groups)

    def forward(self, x):
        if self._op_args is None:          # "same" that needs asymmetric padding: the general path
            return conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return conv2d_op(x, self.weight, self.bias, *self._op_args)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"groups={self.groups}, bias={self.bias is not None}")


def convert_conv2d(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every nn.Conv2d of `model` (in place) by a TutorialConv2d with the same weights;
    everything else stays. Convs with a padding mode other than zeros are left alone (with a
    warning). Returns the model."""
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Conv2d):
            if child.padding_mode != "zeros":
                warnings.warn(f"{name}: padding_mode={child.padding_mode!r} stays an nn.Conv2d")
                continue
            setattr(model, name, TutorialConv2d(child))
        else:
            convert_conv2d(child)
    return model
