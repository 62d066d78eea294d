"""The forward kernel (lesson 05's) as PyTorch operators (torch.library), a drop-in module, a converter.

    import conv_tutorial.ops                             # registers torch.ops.conv_tutorial.conv2d
    model = conv_tutorial.convert_conv2d(model)          # every nn.Conv2d -> TutorialConv2d
    y = model(x.to(memory_format=torch.channels_last))   # NCHW shapes, channels_last memory

- `torch.ops.conv_tutorial.conv2d(input, weight, bias, stride, padding, dilation, groups,
  scale=None, residual=None, activation="none")` is a PyTorch operator (torch.library) computing
  act(conv * scale + bias + residual) per output channel in the kernel's epilogue, with the
  arguments of `torch.nn.functional.conv2d` first (padding as ints;
  `conv2d` below also takes "same" and "valid"). It takes NCHW-shaped tensors; in channels_last
  memory their NHWC view is contiguous and nothing is copied, otherwise it copies once. It returns
  the NCHW-shaped result in channels_last memory. A fake implementation gives shapes and strides
  to `torch.compile` (fullgraph traces it) and the op runs inside CUDA graphs once warmed up.
  Backward: the epilogue's chain rule by hand, and the conv's gradients from PyTorch's
  convolution backward, or from lesson 06's kernels with `set_backward("lesson06")`
  (backward.py), so a converted model can be fine-tuned.
- `torch.ops.conv_tutorial.conv2d_fp8(input, input_scale, weight, weight_scale, bias, stride,
  padding, dilation, residual=None, activation="none", out_dtype=None, out_scale=None)` is the
  same kernel on e4m3 operands (lesson 05, section 9): a per-tensor input scale, per-output-channel
  weight scales, a bf16 output or an e4m3 one at out_scale (`conv2d_fp8` below takes
  F.conv2d's conventions; fp8.py quantizes a whole fused model).
- Depthwise convs (groups = channels) run in depthwise.py; other grouped convs in the same
  kernel where a group's channels fill whole tiles (lesson 05, section 10: 64, 96, 128, ...
  output channels per group); fusion.FusedConv2d merges small groups until they do.
- What the kernel does not cover goes to `torch.nn.functional.conv2d`, with one warning per
  reason: grouped convs whose groups do not fill tiles, dtypes other than fp16/bf16, CPU tensors,
  GPUs other than Hopper (sm_90) and data-centre Blackwell (sm_100), and "same" padding that
  would need to be asymmetric.
- Configs: a shape seen for the first time gets a heuristic config at once (no timing on the
  critical path); `CONV_TUTORIAL_AUTOTUNE=1` (or `conv_tutorial.set_autotune(True)`) times the
  candidates instead, and tuned choices are kept in a JSON file that later processes reuse
  (selection.tuning_cache_path(): ~/.cache/conv_tutorial/tuning.json, or
  $CONV_TUTORIAL_TUNING_CACHE).
"""
import functools
import warnings
from typing import List, Optional

import torch

from . import backward, depthwise, runtime, selection
from . import hostpath
from .hostpath import register_autograd, replay_key
from .configs import grouped_conv_fits
from .launch import compiling_ahead_active, record_breaks
from .traced_compiles import compiles_when_traced
from .geometry import (FP8, FP8_MAX, KERNEL_DTYPES, check_epilogue, check_fp8_dtypes, check_fp8_scales,
                       conv_output_size, current_arch, fp8_epilogue, nhwc_view, output_dtype, pair)
from . import core

_WARNED = set()


def _fall_back(reason):
    """Say once per reason that calls go to torch.nn.functional.conv2d (a pass that compiles ahead says
    nothing: its calls are not the model's, whose own call says it)."""
    if reason not in _WARNED and not compiling_ahead_active():
        _WARNED.add(reason)
        warnings.warn(f"conv_tutorial::conv2d: {reason}; using torch.nn.functional.conv2d instead",
                      stacklevel=4)


def unsupported_reason(input, weight, groups):
    """Why the tutorial kernel cannot run this call, or None if it can."""
    if groups != 1:
        if not grouped_conv_fits(weight.shape[1], weight.shape[0] // groups, current_arch()):
            return (f"groups={groups} of {weight.shape[1]} -> {weight.shape[0] // groups} channels (a group must "
                    f"fill whole tiles of the kernel: lesson 05, section 10)")
        if input.dtype == FP8:
            return f"groups={groups} in float8_e4m3fn (the kernel runs grouped convs in fp16 and bf16)"
    if input.dtype not in KERNEL_DTYPES or weight.dtype != input.dtype:
        return f"dtype {input.dtype}/{weight.dtype} (the kernel takes float16, bfloat16 or float8_e4m3fn, both the same)"
    if input.device.type != "cuda":
        return f"tensors on {input.device} (the kernel runs on a CUDA GPU)"
    return _gpu_reason(input.device.index if input.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_reason(device_index):
    """Why this GPU cannot run the kernel, or None (asked once per device: it is on every call's path)."""
    capability = torch.cuda.get_device_capability(device_index)
    if core.is_tma_mma_capability(capability):
        return None
    return (f"GPU {torch.cuda.get_device_name(device_index)} of capability {capability} (the kernel "
            f"needs Hopper sm_90 or data-centre Blackwell sm_100)")


def is_depthwise(groups, in_channels, out_channels, weight_shape):
    """One filter per channel: groups = in = out channels (depthwise.py runs it)."""
    return groups > 1 and groups == in_channels == out_channels and weight_shape[1] == 1


def reference_epilogue(conv_out, bias, scale, residual, activation):
    """act(conv_out * scale + bias + residual) in torch, per output channel of NCHW conv_out, in
    conv_out's dtype (the lessons' reference epilogue, core.reference_epilogue, which computes
    only the activation asked for: torch has no SiLU for every dtype it convolves)."""
    return core.reference_epilogue(conv_out, bias, scale, residual, activation, channel_dim=1)


def check_operand_dtypes(input, weight):
    """The operator convolves floating-point operands of one dtype (fp16/bf16/e4m3 in the kernel,
    any other floating dtype in torch's fallback); anything else gets a TypeError naming both,
    before torch's own message from deep inside its conv."""
    if not (input.is_floating_point() and weight.is_floating_point()) or input.dtype != weight.dtype:
        raise TypeError(f"conv_tutorial::conv2d: input has dtype {input.dtype} and weight {weight.dtype}; the "
                        f"operator takes floating-point operands of one dtype (the kernel: float16, bfloat16 or "
                        f"float8_e4m3fn; other floating dtypes go to torch)")


def _out_shape(input, weight, stride, padding, dilation):
    """The NCHW output shape of conv2d(input, weight) (conv_output_size per axis)."""
    sizes = [conv_output_size(input.shape[2 + i], weight.shape[2 + i], stride[i], padding[i], dilation[i])
             for i in range(2)]
    return (input.shape[0], weight.shape[0], *sizes)


def _check_forward_activation(activation):
    if activation == core.RELU_GRAD:
        raise ValueError(f"activation {activation!r} is the backward's epilogue (conv2d_input_grad_relu), not one "
                         f"of the forward operator's; use one of {core.ACTIVATIONS}")


def _conv2d_with_epilogue(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          stride: List[int], padding: List[int], dilation: List[int], groups: int,
                          scale: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                          activation: str = "none", out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """conv2d(input, weight, bias) followed by the fused epilogue act(. * scale + residual): per
    output channel, out = act(conv * scale + bias + residual) computed in fp32 on the tile, cast to
    out_dtype (None: the input's; e4m3 operands: bf16 or e4m3, see conv2d_fp8).
    A call of a key seen before is replayed (`replay_key`, launch.Replay): the same launches, nothing else."""
    if not input.is_cuda:
        return _conv2d_full_path(input, weight, bias, stride, padding, dilation, groups, scale, residual,
                                 activation, out_dtype)
    key = replay_key((input, weight, bias, scale, residual), "conv2d", *stride, *padding, *dilation, groups,
                     activation, out_dtype)
    tensors = {"input": input, "weight": weight, "bias": bias, "scale": scale, "residual": residual}
    return hostpath.call("conv_tutorial::conv2d", key, input.device, tensors, lambda: _conv2d_full_path(
        input, weight, bias, stride, padding, dilation, groups, scale, residual, activation, out_dtype), ("output",))


def _conv2d_full_path(input, weight, bias, stride, padding, dilation, groups, scale, residual, activation,
                      out_dtype):
    # every check, the fallbacks, the runtime's plans
    check_operand_dtypes(input, weight)
    out_dtype = output_dtype(input.dtype, out_dtype)
    _check_forward_activation(activation)
    if scale is not None or residual is not None or activation != "none":   # (a plain call skips this)
        check_epilogue(weight.shape[0], _out_shape(input, weight, stride, padding, dilation),
                              out_dtype, input.device, scale, residual, activation)
    if is_depthwise(groups, input.shape[1], weight.shape[0], weight.shape) and input.is_cuda and input.dtype in (torch.float16, torch.bfloat16) and weight.dtype == input.dtype:
        out_nhwc = depthwise.depthwise_conv2d(        # depthwise: one filter per channel, in Triton
            nhwc_view(input), weight[:, 0], bias, tuple(stride), tuple(padding), tuple(dilation), scale,
            None if residual is None else nhwc_view(residual), activation)
        return out_nhwc.permute(0, 3, 1, 2)
    reason = unsupported_reason(input, weight, groups)
    if reason is not None:
        _fall_back(reason)
        record_breaks()     # (torch's conv: a replay of the call's other launches would leave the output unwritten)
        wide = input.dtype == FP8          # torch has no e4m3 conv: its exact fp32 values instead
        conv_out = torch.nn.functional.conv2d(input.float() if wide else input, weight.float() if wide else weight,
                                              None, stride, padding, dilation, groups)
        out = reference_epilogue(conv_out, bias, scale, None if residual is None else residual.float(), activation)
        if out_dtype == FP8:               # saturate, as the kernel's cast does (e4m3fn has no inf)
            out = out.clamp(-FP8_MAX, FP8_MAX)
        return out.to(out_dtype).contiguous(memory_format=torch.channels_last)
    out_nhwc = runtime.conv2d(nhwc_view(input), nhwc_view(weight), bias, tuple(stride),
                                   tuple(padding), tuple(dilation), config=None,
                                   tune=selection.autotune_enabled(), scale=scale,
                                   residual=None if residual is None else nhwc_view(residual),
                                   activation=activation, out_dtype=out_dtype, groups=groups)
    return out_nhwc.permute(0, 3, 1, 2)          # NCHW shape, channels_last memory


# The operator is defined with torch.library's define/impl, its schema inferred from the
# function's annotations. (The @torch.library.custom_op decorator does the same plus checks on
# every call, in Python, that cost more host time than the whole runtime call: RESULTS.md,
# "Host time".) One implementation serves every device: it sends what the kernel cannot
# run to torch itself.
_LIBRARY = torch.library.Library("conv_tutorial", "DEF")
_LIBRARY.define("conv2d" + torch.library.infer_schema(_conv2d_with_epilogue, mutates_args=()),
                tags=(torch.Tag.pt2_compliant_tag,))      # opcheck passes: safe for torch.compile
_LIBRARY.impl("conv2d", _conv2d_with_epilogue, "CompositeExplicitAutograd")
conv2d_op = torch.ops.conv_tutorial.conv2d.default


@torch.library.register_fake("conv_tutorial::conv2d")
@compiles_when_traced(_conv2d_with_epilogue)     # (with compile_while_tracing on: traced_compiles.py)
def _(input, weight, bias, stride, padding, dilation, groups, scale=None, residual=None, activation="none",
      out_dtype=None):
    check_operand_dtypes(input, weight)
    _check_forward_activation(activation)
    out_shape, out_dtype = _out_shape(input, weight, stride, padding, dilation), output_dtype(input.dtype, out_dtype)
    check_epilogue(weight.shape[0], out_shape, out_dtype, input.device, scale, residual, activation)
    return input.new_empty(out_shape, dtype=out_dtype).contiguous(memory_format=torch.channels_last)


def _setup_backward(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups, scale, residual, activation, out_dtype = inputs
    if input.dtype == FP8:
        raise NotImplementedError("conv_tutorial::conv2d has no backward for e4m3 operands (inference only)")
    ctx.save_for_backward(input, weight, bias, scale, residual, output)
    ctx.conv_args = (stride, padding, dilation, groups)
    ctx.activation = activation


def _wide(t):
    """fp16/bf16 widened to fp32 for sums and the SiLU derivative; fp32/fp64 as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _backward(ctx, grad_output):
    """Gradients of out = act(conv(input, weight) * scale + bias + residual): torch's convolution
    backward for the conv, the chain rule by hand for the epilogue."""
    input, weight, bias, scale, residual, output = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv_args
    needs = ctx.needs_input_grad
    conv_out = None
    if ctx.activation == "silu" or (scale is not None and needs[7]):     # recompute what is needed
        conv_out = torch.nn.functional.conv2d(input, weight, None, stride, padding, dilation, groups)
    grad = grad_output
    if ctx.activation == "relu":
        grad = grad * (output > 0)
    elif ctx.activation == "silu":
        pre = reference_epilogue(conv_out, bias, scale, residual, "none")
        sigmoid = torch.sigmoid(_wide(pre))
        grad = (_wide(grad) * sigmoid * (1 + _wide(pre) * (1 - sigmoid))).to(grad_output.dtype)
    grad_conv = grad if scale is None else grad * scale.to(grad.dtype).view(1, -1, 1, 1)
    grad_input, grad_weight = backward.conv_gradients(grad_conv, input, weight, stride, padding, dilation, groups,
                                                      needs[0], needs[1])
    grad_bias = _wide(grad).sum((0, 2, 3)).to(bias.dtype) if bias is not None and needs[2] else None
    grad_scale = ((_wide(grad) * _wide(conv_out)).sum((0, 2, 3)).to(scale.dtype)
                  if scale is not None and needs[7] else None)
    grad_residual = grad if residual is not None and needs[8] else None
    return grad_input, grad_weight, grad_bias, None, None, None, None, grad_scale, grad_residual, None, None


register_autograd(_LIBRARY, "conv2d", _conv2d_with_epilogue, _backward, _setup_backward, (0, 1, 2, 7, 8))


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
    return pair(padding, "padding", 0)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d's signature, computed by the tutorial's kernel where it can."""
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"input must be [N, Ci, H, W] and weight [Co, Ci/groups, R, S]; got shapes "
                         f"{tuple(input.shape)} and {tuple(weight.shape)}")
    stride, dilation = pair(stride, "stride", 1), pair(dilation, "dilation", 1)
    pads = resolve_padding(padding, weight.shape, stride, dilation)
    if pads is None:
        _fall_back(f"padding='same' with an even dilated filter {tuple(weight.shape[2:])} needs "
                   f"asymmetric padding")
        return torch.nn.functional.conv2d(input, weight, bias, stride, padding, dilation, groups)
    return conv2d_op(input, weight, bias, list(stride), list(pads), list(dilation), groups)


# %% fp8 (e4m3) operands: lesson 05, section 9, as an operator -------------------------------------
# The kernel op above takes e4m3 operands as they are (its `scale` then dequantizes, `out_dtype`
# picks bf16 or e4m3). conv2d_fp8 speaks in the quantities a user has: the input's scale (one per
# tensor), the weight's (one per output channel), the output's (for an e4m3 output), and folds
# them into the epilogue's scale and shift (geometry.fp8_epilogue). On a GPU the folding is one
# small launch (runtime.fold_fp8_scales), so that a repeat call is the replay of two launches,
# which the C++ kernels serve (native.py). Under torch.compile, `call_conv2d_fp8` (what conv2d_fp8
# and fp8.py's modules call) traces the decomposition instead: the folding is three small torch
# ops that Inductor's freezing computes once.

def _conv2d_fp8_decomposed(input: torch.Tensor, input_scale: torch.Tensor, weight: torch.Tensor,
                           weight_scale: torch.Tensor, bias: Optional[torch.Tensor], stride: List[int],
                           padding: List[int], dilation: List[int], residual: Optional[torch.Tensor] = None,
                           activation: str = "none", out_dtype: Optional[torch.dtype] = None,
                           out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(conv2d(input * input_scale, weight * weight_scale) + bias + residual) in bf16 (out_dtype
    None or bf16), or that divided by out_scale in e4m3 (out_dtype float8_e4m3fn): the scales folded by
    torch's ops, the conv by the kernel op."""
    out_dtype = _check_fp8_call(input, input_scale, weight, weight_scale, bias, residual, activation, out_dtype,
                                out_scale)
    scale, bias = fp8_epilogue(input_scale, weight_scale, None, bias, out_scale)
    return conv2d_op(input, weight, bias, stride, padding, dilation, 1, scale, residual, activation, out_dtype)


def _check_fp8_call(input, input_scale, weight, weight_scale, bias, residual, activation, out_dtype, out_scale):
    # the fp8 op's own checks, and the bias's, which the scales' fold reads by address (the kernel op checks the
    # rest); returns the output's dtype
    check_fp8_dtypes("conv2d_fp8", input=input, weight=weight)
    out_dtype = out_dtype or torch.bfloat16
    check_fp8_scales(input_scale, weight_scale, weight.shape[0], input.device, residual=residual,
                     activation=activation, out_dtype=out_dtype, out_scale=out_scale)
    core.check_bias(bias, weight.shape[0], input.device, "input", contiguous=True)
    return out_dtype


def _conv2d_fp8(input, input_scale, weight, weight_scale, bias, stride, padding, dilation, residual=None,
                activation="none", out_dtype=None, out_scale=None):
    """The op's implementation: on a GPU, a repeat call of a key is replayed (launch.Replay); on a CPU, the
    decomposition."""
    if not input.is_cuda:
        return _conv2d_fp8_decomposed(input, input_scale, weight, weight_scale, bias, stride, padding, dilation,
                                      residual, activation, out_dtype, out_scale)
    key = replay_key((input, input_scale, weight, weight_scale, bias, residual, out_scale), "conv2d_fp8", *stride,
                     *padding, *dilation, activation, out_dtype)
    tensors = {"input": input, "input_scale": input_scale, "weight": weight, "weight_scale": weight_scale,
               "bias": bias, "residual": residual, "out_scale": out_scale}
    return hostpath.call("conv_tutorial::conv2d_fp8", key, input.device, tensors, lambda: _conv2d_fp8_full_path(
        input, input_scale, weight, weight_scale, bias, stride, padding, dilation, residual, activation, out_dtype,
        out_scale), ("output",))


def _conv2d_fp8_full_path(input, input_scale, weight, weight_scale, bias, stride, padding, dilation, residual,
                          activation, out_dtype, out_scale):
    # every check; the scales folded by one launch, the conv by the kernel op's full path (not the op: a call of
    # an operator inside this one's recording would break it). A GPU the kernel does not run on: the
    # decomposition, torch's ops and torch's conv (its op call inside this recording breaks it: no replay)
    out_dtype = _check_fp8_call(input, input_scale, weight, weight_scale, bias, residual, activation, out_dtype,
                                out_scale)
    if unsupported_reason(input, weight, 1) is not None:
        return _conv2d_fp8_decomposed(input, input_scale, weight, weight_scale, bias, stride, padding, dilation,
                                      residual, activation, out_dtype, out_scale)
    scale, bias = runtime.fold_fp8_scales(input_scale, weight_scale, bias, out_scale)
    return _conv2d_full_path(input, weight, bias, stride, padding, dilation, 1, scale, residual, activation,
                             out_dtype)


_LIBRARY.define("conv2d_fp8" + torch.library.infer_schema(_conv2d_fp8_decomposed, mutates_args=()),
                tags=(torch.Tag.pt2_compliant_tag,))
_LIBRARY.impl("conv2d_fp8", _conv2d_fp8, "CompositeExplicitAutograd")
conv2d_fp8_op = torch.ops.conv_tutorial.conv2d_fp8.default
torch.library.register_fake("conv_tutorial::conv2d_fp8")(_conv2d_fp8_decomposed)    # (shapes: the kernel op's fake)


def _no_fp8_backward(*_):
    # (the setup of a call that needs a gradient: it fails there, before any backward)
    raise NotImplementedError("conv_tutorial::conv2d_fp8 has no backward (e4m3 operands: inference only)")


register_autograd(_LIBRARY, "conv2d_fp8", _conv2d_fp8, _no_fp8_backward, _no_fp8_backward, (0, 1, 2, 3, 4, 8, 11))


def call_conv2d_fp8(*args):
    """conv2d_fp8_op(*args), or under torch.compile its decomposition, whose folded scales Inductor's
    freezing computes once (the op would fold them on every call)."""
    if torch.compiler.is_compiling():
        return _conv2d_fp8_decomposed(*args)
    return conv2d_fp8_op(*args)


def conv2d_fp8(input, input_scale, weight, weight_scale, bias=None, stride=1, padding=0, dilation=1,
               residual=None, activation="none", out_dtype=torch.bfloat16, out_scale=None):
    """The fp8 conv with torch.nn.functional.conv2d's conventions: input [N, Ci, H, W] and weight
    [Co, Ci, R, S] in e4m3 (channels_last memory avoids copies) with their fp32 scales, input_scale
    of shape () and weight_scale [Co] (conv_tutorial.quantize_tensor(t) and quantize_tensor(w, channel_dim=0)
    make both); the output in bf16, or in e4m3 with out_scale (shape ()); a residual comes in the
    output's dtype (in e4m3, at out_scale).

    Scales must be positive and finite: checked on CPU tensors (ValueError); on a GPU a check would
    synchronize the device on every call, so a bad scale there gives NaN, inf, zeros or flipped signs
    instead (geometry.check_fp8_scales says which)."""
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise TypeError(f"{name} must be a 4-d torch.Tensor, got {type(t).__name__}"
                            + (f" of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else ""))
    for name, t in (("input_scale", input_scale), ("weight_scale", weight_scale), ("out_scale", out_scale)):
        if not isinstance(t, torch.Tensor) and not (t is None and name == "out_scale"):
            raise TypeError(f"{name} must be an fp32 torch.Tensor, got {type(t).__name__}: an e4m3 tensor means "
                            f"nothing without its scale")
    stride, dilation = pair(stride, "stride", 1), pair(dilation, "dilation", 1)
    pads = resolve_padding(padding, weight.shape, stride, dilation)
    if pads is None:
        raise ValueError(f"padding={padding!r} needs asymmetric padding, which the kernel does not do")
    return call_conv2d_fp8(input, input_scale, weight, weight_scale, bias, list(stride), list(pads), list(dilation),
                           residual, activation, out_dtype, out_scale)


class TutorialConv2d(torch.nn.Module):
    """A drop-in for nn.Conv2d that calls the tutorial's operator. The weight keeps PyTorch's
    [Co, Ci, R, S] shape (state_dict stays compatible) but is stored in channels_last memory,
    i.e. physically [Co, R, S, Ci], so the kernel reads it without a copy. channels_last_weight=False
    keeps it in PyTorch's contiguous layout instead, as torch.distributed.fsdp.fully_shard requires
    (it shards contiguous parameters only); each call then copies it into the kernel's layout, and
    takes the operator's full host path (a copy is not replayed: hostpath.py)."""

    def __init__(self, conv: torch.nn.Conv2d, channels_last_weight: bool = True):
        super().__init__()
        if conv.padding_mode != "zeros":
            raise ValueError(f"padding_mode={conv.padding_mode!r}: the kernel pads with zeros only")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups
        layout = torch.channels_last if channels_last_weight else torch.contiguous_format
        self.weight = torch.nn.Parameter(conv.weight.detach().contiguous(memory_format=layout),
                                         requires_grad=conv.weight.requires_grad)
        self.bias = None if conv.bias is None else torch.nn.Parameter(conv.bias.detach(),
                                                                      requires_grad=conv.bias.requires_grad)
        # the operator's arguments, resolved once (a forward call is on the critical path)
        pads = resolve_padding(self.padding, self.weight.shape, tuple(self.stride), tuple(self.dilation))
        self._op_args = None if pads is None else (list(self.stride), list(pads), list(self.dilation),
                                                   self.groups)

    def operands(self, x):
        """(x, weight) as the operator takes them: under autocast (mixed-precision training), what
        autocast does to nn.Conv2d's, both in its lower precision (the bias may stay fp32 in the
        epilogue)."""
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            # (x mostly arrives in it already, from the layer before: no cast for torch.compile to trace then)
            return x if x.dtype == dtype else x.to(dtype), self.weight.to(dtype)
        return x, self.weight

    def forward(self, x):
        x, weight = self.operands(x)
        if self._op_args is None:          # "same" that needs asymmetric padding: the general path
            return conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return conv2d_op(x, weight, self.bias, *self._op_args)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"groups={self.groups}, bias={self.bias is not None}")


def convert_conv2d(model: torch.nn.Module, channels_last_weight: bool = True) -> torch.nn.Module:
    """Replace every nn.Conv2d of `model` (in place) by a TutorialConv2d with the same weights;
    everything else stays. Convs with a padding mode other than zeros are left alone (with a
    warning). channels_last_weight: TutorialConv2d's (False for torch.distributed.fsdp.fully_shard).
    Returns the model."""
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Conv2d):
            if child.padding_mode != "zeros":
                warnings.warn(f"{name}: padding_mode={child.padding_mode!r} stays an nn.Conv2d")
                continue
            setattr(model, name, TutorialConv2d(child, channels_last_weight))
        else:
            convert_conv2d(child, channels_last_weight)
    return model
