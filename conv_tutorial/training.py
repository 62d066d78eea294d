"""Training fusions: BatchNorm's batch statistics from the forward conv's epilogue, and ReLU's
backward in dgrad's epilogue (opt-in; measured not to pay, below).

    model = conv_tutorial.fuse_conv_batchnorm_for_training(model)   # conv -> BatchNorm2d pairs fused
    model = conv_tutorial.convert_conv2d(model)                      # the other convs on the kernel
    step = torch.compile(model)                                      # train as usual

In training, BatchNorm normalizes a conv's output with the batch's own mean and variance: a
reduction over N, H and W per channel, which torch.compile computes in a kernel of its own that
reads the whole output once more before the pass that normalizes it. Here lesson 05's epilogue
adds each output channel's sum and sum of squares into fp32 sums as it stores the tile (every
program into one [2, Co] tensor: lesson 08, "Training: BatchNorm's statistics from the
forward's epilogue"), and the module below computes mean = sum / count and var = sum_sq / count -
mean^2 from them: that read of the output is gone.
The normalization and its gradient are two operators of the package (batch_norm_from_sums and its
backward, which Inductor decomposes and fuses), the running statistics torch's.

Measured before kept (RESULTS.md, "Training fusions: BatchNorm's statistics ..."): a ResNet-50
training step under CUDA graphs ran faster with this pass than without. The pass is opt-in: it changes a
model's modules, and nothing else in the package uses it.

- `torch.ops.conv_tutorial.conv2d_channel_stats(input, weight, bias, stride, padding, dilation,
  groups) -> (out, stats)`: conv2d(input, weight, bias) in channels_last memory, and stats fp32
  [2, Co] (fp64 for fp64 operands): each output channel's sum (row 0) and sum of squares (row 1)
  over N, H, W of the output as stored, summed in fp32. Its backward adds what the
  statistics contribute (d sum / d out = 1, d sum_sq / d out = 2 out) to the output's gradient,
  then takes the conv's gradients (backward.conv_gradients: torch's or lessons 06 and 07's). Where the
  kernel does not run the conv (ops.unsupported_reason, depthwise, CPU tensors), torch computes
  both, with the forward operator's warning. The kernel adds the statistics with atomics: their
  last bits vary from run to run (tiles arrive in any order).
- `torch.ops.conv_tutorial.batch_norm_from_sums(y, stats, weight, bias, count, eps, stats_from_y=False)
  -> (out, mean, var)`: BatchNorm's output in training, and its batch mean and biased variance, from
  y's per-channel sums. Its gradient reaches y and stats (whatever made the sums takes theirs on);
  with `stats_from_y=True`, which says that stats are y's own sums, as ConvBatchNorm2d passes them,
  y takes BatchNorm's whole gradient and stats none: the same gradient in fewer ops.
- `ConvBatchNorm2d(conv, bn)`: a conv and the BatchNorm2d that follows it, as PyTorch computes
  them in train and eval mode (batch statistics, running statistics with BatchNorm's momentum or
  cumulative average and the unbiased variance, affine or not, track_running_stats or not).
- `fuse_conv_batchnorm_for_training(model)`: a torch.fx pass that replaces every nn.Conv2d whose
  only user is a BatchNorm2d over its channels, and which the kernel runs (`stats_kernel_runs`), by
  a ConvBatchNorm2d.

ReLU's backward in dgrad's epilogue (lesson 08), measured and not a default (RESULTS.md,
"Training fusions: BatchNorm's apply and ReLU ..."): a ResNet-50 step ran no faster with it, since
the dgrad epilogue's read of the ReLU's output cost about as much GPU time as Inductor's fused
BatchNorm-and-ReLU backward saved.

- `fuse_relu_into_dgrad(model)`: a torch.fx pass; where a ReLU's output has one user, a conv whose
  dgrad gates in its epilogue (stride 1, no crop), the conv is called with the ReLU's input too
  (`ConvAfterReLU`, or `ConvBatchNorm2d`'s `relu_input`), and the ReLU's backward is skipped.
- `torch.ops.conv_tutorial.conv2d_after_relu(input, relu_input, weight, bias, stride, padding,
  dilation, groups)`: conv2d(input, weight, bias) where input = relu(relu_input); its backward
  gives relu_input the input's gradient through the ReLU (backward.conv2d_input_grad_relu: lesson
  06's dgrad with the gate in its epilogue, or torch's dgrad and the gate), and input none. The
  caller guarantees input = relu(relu_input) and that input has no other user: the pass does.

E[y^2] - E[y]^2 in fp32 loses digits where a channel's mean is large against its spread (a
relative error of about 2^-24 * (mean / std)^2 in the variance per rounding); BatchNorm's inputs
in a network at work have means of the order of their spread.
"""
import copy
import functools
import warnings
from typing import List, Optional, Tuple

import torch

from . import backward, hostpath, ops, runtime, selection
from .configs import grouped_conv_fits
from .fusion import _activation_of, _single_user, install_module
from .geometry import FP8, current_arch, nhwc_view
from .ops import _wide
from .core.batchnorm import batch_stats_from_sums
from .kernels import dgrad as dgrad_kernels
from .launch import record_breaks
from .traced_compiles import compiles_when_traced

_LIBRARY = torch.library.Library("conv_tutorial", "FRAGMENT")


def stats_dtype(dtype):
    """The statistics' dtype: fp32, or fp64 for fp64 operands (torch's fallback runs those)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def torch_channel_stats(out):
    """[2, Co] (stats_dtype): each channel's sum and sum of squares of an NCHW-shaped `out` over N, H, W."""
    return runtime.channel_sums(out.permute(0, 2, 3, 1), stats_dtype(out.dtype))


def _kernel_runs(input, weight, groups):
    # (a depthwise conv, or groups that miss the tiles, have a reason too: stats_kernel_runs' shape test)
    return ops.unsupported_reason(input, weight, groups) is None and input.dtype != FP8


def _conv2d_channel_stats(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          stride: List[int], padding: List[int], dilation: List[int],
                          groups: int, relu_input: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(conv2d(input, weight, bias), its per-channel sum and sum of squares, fp32 [2, Co]).
    relu_input: where `input` is relu(relu_input) (fuse_relu_into_dgrad), the ReLU's input, which
    the forward does not read: the backward gives it the gradient, and `input` none."""
    if input.is_cuda:       # a call of a key seen before: its replay (ops.replay_key), the stats zeroed as below
        key = hostpath.replay_key((input, weight, bias), "conv2d_channel_stats", *stride, *padding, *dilation,
                                  groups)
        tensors = {"input": input, "weight": weight, "bias": bias}
        return hostpath.call("conv_tutorial::conv2d_channel_stats", key, input.device, tensors, lambda: _channel_stats_full_path(
            input, weight, bias, stride, padding, dilation, groups), ("output", "stats"), zeroed=("stats",))
    return _channel_stats_full_path(input, weight, bias, stride, padding, dilation, groups)


def _channel_stats_full_path(input, weight, bias, stride, padding, dilation, groups):
    ops.check_operand_dtypes(input, weight)
    if not _kernel_runs(input, weight, groups):    # torch's conv (or depthwise.py), then torch's sums
        record_breaks()                            # (torch's sums: no replay repeats them)
        out = ops._conv2d_with_epilogue(input, weight, bias, stride, padding, dilation, groups)
        return out, torch_channel_stats(out)
    stats = torch.zeros(2, weight.shape[0], device=input.device, dtype=torch.float32)   # the epilogue adds into it
    out_nhwc = runtime.conv2d(nhwc_view(input), nhwc_view(weight), bias, tuple(stride), tuple(padding),
                              tuple(dilation), tune=selection.autotune_enabled(), groups=groups,
                              channel_stats=stats)
    return out_nhwc.permute(0, 3, 1, 2), stats


_LIBRARY.define("conv2d_channel_stats" + torch.library.infer_schema(_conv2d_channel_stats, mutates_args=()),
                tags=(torch.Tag.pt2_compliant_tag,))
_LIBRARY.impl("conv2d_channel_stats", _conv2d_channel_stats, "CompositeExplicitAutograd")
conv2d_channel_stats_op = torch.ops.conv_tutorial.conv2d_channel_stats.default


@torch.library.register_fake("conv_tutorial::conv2d_channel_stats")
@compiles_when_traced(_conv2d_channel_stats)
def _(input, weight, bias, stride, padding, dilation, groups, relu_input=None):
    ops.check_operand_dtypes(input, weight)
    out = input.new_empty(ops._out_shape(input, weight, stride, padding, dilation))
    return (out.contiguous(memory_format=torch.channels_last),
            input.new_empty(2, weight.shape[0], dtype=stats_dtype(input.dtype)))


def _setup(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups, relu_input = inputs
    if input.dtype == FP8:
        raise NotImplementedError("conv_tutorial::conv2d_channel_stats has no backward for e4m3 operands")
    ctx.save_for_backward(input, weight, output[0])
    ctx.conv_args, ctx.has_bias = (stride, padding, dilation, groups), bias is not None
    ctx.relu_gated = relu_input is not None
    ctx.set_materialize_grads(False)     # (no zeros for the statistics where nothing differentiates them)


def _backward(ctx, grad_out, grad_stats):
    """The output's gradient plus what the statistics add, if anything differentiates them (d sum = 1,
    d sum_sq = 2 out per element; ConvBatchNorm2d's batch_norm_from_sums does not: stats_from_y),
    then the conv's gradients and the bias's (with relu_input, the input's goes to it: _relu_routed)."""
    input, weight, out = ctx.saved_tensors
    needs = _relu_routed(ctx)
    if grad_out is None and grad_stats is None:      # (called with neither: nothing reaches the conv)
        return _routed_to_relu_input(ctx, None, None, None, 4)
    grad = grad_out
    if grad_stats is not None:
        wide = _wide(grad_out) if grad_out is not None else 0.0
        grad = (wide + _per_channel(grad_stats[0]) + 2 * _wide(out) * _per_channel(grad_stats[1]))
    grad = grad.to(out.dtype).contiguous(memory_format=torch.channels_last)      # (the gradient ops' layout)
    grad_input, grad_weight = backward.conv_gradients(grad, input, weight, *ctx.conv_args, needs[0], needs[1],
                                                      relu_gated=ctx.relu_gated)
    grad_bias = _wide(grad).sum((0, 2, 3)) if ctx.has_bias and needs[2] else None
    return _routed_to_relu_input(ctx, grad_input, grad_weight, grad_bias, 4)


def _relu_routed(ctx):
    """needs_input_grad with the input's entry taken from relu_input's (the last argument) where the
    input is relu(relu_input): its gradient, computed for the input, goes there."""
    needs = list(ctx.needs_input_grad)
    if ctx.relu_gated:
        needs[0] = needs[-1]
    return needs


def _routed_to_relu_input(ctx, grad_input, grad_weight, grad_bias, others):
    # (grad of input, weight, bias, `others` Nones, grad of relu_input): with relu_input, the input gets none
    if ctx.relu_gated:
        return (None, grad_weight, grad_bias) + (None,) * others + (grad_input,)
    return (grad_input, grad_weight, grad_bias) + (None,) * others + (None,)


hostpath.register_autograd(_LIBRARY, "conv2d_channel_stats", _conv2d_channel_stats, _backward, _setup, (0, 1, 2, 7))


def _conv2d_after_relu(input: torch.Tensor, relu_input: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor], stride: List[int], padding: List[int], dilation: List[int],
                       groups: int) -> torch.Tensor:
    """conv2d(input, weight, bias) (the forward operator's), where input is relu(relu_input): the
    forward does not read relu_input; the backward gives it the input's gradient through the ReLU
    (backward.conv2d_input_grad_relu: on lesson 06's dgrad kernel, in dgrad's epilogue), and input none."""
    return ops._conv2d_with_epilogue(input, weight, bias, stride, padding, dilation, groups)   # (below autograd already)


_LIBRARY.define("conv2d_after_relu" + torch.library.infer_schema(_conv2d_after_relu, mutates_args=()),
                tags=(torch.Tag.pt2_compliant_tag,))
_LIBRARY.impl("conv2d_after_relu", _conv2d_after_relu, "CompositeExplicitAutograd")
conv2d_after_relu_op = torch.ops.conv_tutorial.conv2d_after_relu.default


@torch.library.register_fake("conv_tutorial::conv2d_after_relu")
@compiles_when_traced(_conv2d_after_relu)
def _(input, relu_input, weight, bias, stride, padding, dilation, groups):
    ops.check_operand_dtypes(input, weight)
    out = input.new_empty(ops._out_shape(input, weight, stride, padding, dilation))
    return out.contiguous(memory_format=torch.channels_last)


def _setup_after_relu(ctx, inputs, output):
    input, relu_input, weight, bias, stride, padding, dilation, groups = inputs
    if input.dtype == FP8:
        raise NotImplementedError("conv_tutorial::conv2d_after_relu has no backward for e4m3 operands")
    ctx.save_for_backward(input, weight)
    ctx.conv_args, ctx.has_bias = (stride, padding, dilation, groups), bias is not None


def _backward_after_relu(ctx, grad_out):
    input, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad_relu_input, grad_weight = backward.conv_gradients(grad_out, input, weight, *ctx.conv_args, needs[1],
                                                           needs[2], relu_gated=True)
    grad_bias = _wide(grad_out).sum((0, 2, 3)) if ctx.has_bias and needs[3] else None
    return None, grad_relu_input, grad_weight, grad_bias, None, None, None, None


hostpath.register_autograd(_LIBRARY, "conv2d_after_relu", _conv2d_after_relu, _backward_after_relu, _setup_after_relu,
                      (0, 1, 2, 3), serve_natively=False)     # (its calls replay as conv2d's, served natively there)


class ConvBatchNorm2d(torch.nn.Module):
    """conv -> BatchNorm2d as one module: in training (batch statistics), the conv's epilogue sums
    its output per channel (conv2d_channel_stats) and batch_norm_from_sums normalizes; in eval (running
    statistics), the conv and F.batch_norm. Holds the conv's weight and bias (channels_last, as
    TutorialConv2d) and the BatchNorm2d module itself (its parameters, buffers and settings)."""

    def __init__(self, conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d):
        super().__init__()
        if not isinstance(conv, torch.nn.Conv2d) or not isinstance(bn, torch.nn.BatchNorm2d):
            raise TypeError(f"ConvBatchNorm2d takes an nn.Conv2d and an nn.BatchNorm2d, got "
                            f"{type(conv).__name__} and {type(bn).__name__}")
        if bn.num_features != conv.out_channels:
            raise ValueError(f"the BatchNorm2d has {bn.num_features} features; the conv has {conv.out_channels} "
                             f"output channels")
        self.conv = ops.TutorialConv2d(conv)      # its weight, bias and resolved arguments
        self.bn = bn
        _inductor_decomposes()

    def __setstate__(self, state):      # (a module unpickled, torch.load's: no __init__, so register here too)
        super().__setstate__(state)
        _inductor_decomposes()

    def forward(self, x, relu_input=None):
        """relu_input: given where x = relu(relu_input) (fuse_relu_into_dgrad): the backward routes
        x's gradient to it through the ReLU, in dgrad's epilogue."""
        conv, bn = self.conv, self.bn
        if not (bn.training or bn.running_mean is None) or conv._op_args is None:
            # running statistics (eval), or "same" padding the kernel does not do: the conv, then the module
            return bn(conv(x))
        x, weight = conv.operands(x)                    # (as nn.Conv2d's under autocast)
        if relu_input is not None:
            relu_input = relu_input.to(x.dtype)
        y, stats = conv2d_channel_stats_op(x, weight, conv.bias, *conv._op_args, relu_input)
        count = y.numel() // y.shape[1]
        if count <= 1:
            raise ValueError(f"BatchNorm2d in training needs more than 1 value per channel, got an output of "
                             f"shape {tuple(y.shape)}")
        # In as few ops as the math allows: torch.compile traces each op of this forward (53 times in ResNet-50),
        # and its first step's compile grows with them (RESULTS.md, "Training", "Where the first step's compile goes"):
        # the normalization is one operator, with its gradient one operator too (batch_norm_from_sums).
        out, mean, var = batch_norm_from_sums_op(y, stats, bn.weight if bn.affine else None,
                                                 bn.bias if bn.affine else None, count, bn.eps, True)
        if bn.training and bn.track_running_stats:
            # As BatchNorm2d's forward: the steps counted where it has the buffer, the running statistics updated
            # where it has them. (No torch.no_grad() around it: mean and var carry no gradient, the operator marks
            # them so, and no_grad()'s enter and exit would be two more nodes per layer for torch.compile to trace.)
            if bn.num_batches_tracked is not None:
                bn.num_batches_tracked.add_(1)
            if bn.running_mean is not None and bn.running_var is not None:
                # BatchNorm's factor: its momentum, or 1 / steps seen (momentum=None: a cumulative average; 0.0
                # without a count, as BatchNorm2d's)
                momentum = bn.momentum if bn.momentum is not None else (
                    1.0 / bn.num_batches_tracked.to(mean.dtype) if bn.num_batches_tracked is not None else 0.0)
                bn.running_mean.lerp_(_as(mean, bn.running_mean.dtype), momentum)
                bn.running_var.lerp_(_as(var * (count / (count - 1)), bn.running_var.dtype), momentum)
        return out


def _batch_norm_from_sums(y: torch.Tensor, stats: torch.Tensor, weight: Optional[torch.Tensor],
                          bias: Optional[torch.Tensor], count: int, eps: float,
                          stats_from_y: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(BatchNorm's output, mean, biased variance) of y (N, C, H, W) from its per-channel sums over `count`
    values each, `stats` = (sum y, sum y^2), fp32 [2, C] (fp64 for fp64 y): y * scale + shift in the
    statistics' dtype, returned in y's dtype. `weight` and `bias`: BatchNorm's affine parameters [C], both or
    neither. The gradient reaches y directly and `stats` through the sums (which the caller passes on to what
    made them); `stats_from_y=True` says that stats are y's own sums (conv2d_channel_stats returns them with y,
    and ConvBatchNorm2d passes them on untouched): the sums' share then goes to y too, BatchNorm's whole
    gradient in fewer ops, and stats get none. With other sums (a transformed y's, sums all-reduced across
    processes) that would be wrong: keep the default there."""
    if y.dim() != 4:
        raise ValueError(f"batch_norm_from_sums: y must be 4-D (N, C, H, W), got shape {tuple(y.shape)}")
    if tuple(stats.shape) != (2, y.shape[1]):
        raise ValueError(f"batch_norm_from_sums: stats must be [2, C] = [2, {y.shape[1]}] (each channel's sum and sum "
                         f"of squares), got shape {tuple(stats.shape)}")
    if (weight is None) != (bias is None):
        raise ValueError("batch_norm_from_sums: weight and bias are BatchNorm's affine parameters: give both or "
                         "neither")
    if weight is not None and (tuple(weight.shape) != (y.shape[1],) or tuple(bias.shape) != (y.shape[1],)):
        raise ValueError(f"batch_norm_from_sums: weight and bias must be [C] = [{y.shape[1]}], got "
                         f"{tuple(weight.shape)} and {tuple(bias.shape)}")
    if count < 2:
        raise ValueError(f"batch_norm_from_sums: count (values per channel) must be at least 2, got {count}")
    mean, var = batch_stats_from_sums(stats, count)
    _, scale = _inverse_std_and_scale(var, weight, eps)
    shift = torch.addcmul(bias, mean, scale, value=-1) if bias is not None else -mean * scale
    return torch.addcmul(_per_channel(shift), y, _per_channel(scale)).to(y.dtype), mean, var


def _batch_norm_from_sums_backward(grad: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                                   weight: Optional[torch.Tensor], count: int, eps: float,
                                   stats_from_y: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """batch_norm_from_sums' gradient from its output's, `grad`: (y's, in y's dtype, channels_last where y is,
    else contiguous; stats', [2, C], or empty with `stats_from_y`; weight's; bias's). With a = weight /
    sqrt(var + eps) and b = bias - mean * a, by the chain rule through a and b, from two sums over the pixels,
    sum(grad) and sum(grad * y), then through the sums that mean and var come from: stats' gradient, or with
    `stats_from_y` (stats are y's own sums: d sum y = 1, d sum y^2 = 2y per value) y's, which is then
    BatchNorm's whole gradient. No gradient passes where the variance was clamped at 0. Without weight (no
    affine parameters), weight's and bias's are empty."""
    inv_std, a = _inverse_std_and_scale(var, weight, eps)
    wide = _wide(grad)
    grad_b = wide.sum((0, 2, 3))                                   # dL/db; dL/da less b's share through a:
    grad_a = (wide * y).sum((0, 2, 3)) - grad_b * mean
    grad_inv_std = grad_a * weight if weight is not None else grad_a
    grad_var = torch.where(var > 0, grad_inv_std * -0.5 * inv_std ** 3, 0.0)
    per_sum = (-grad_b * a - 2 * mean * grad_var) / count         # dL/d(sum y): through mean and var
    per_square = grad_var / count                                  # dL/d(sum y^2)
    if stats_from_y:      # (the sums' share, d sum y = 1 and d sum y^2 = 2y, added to y's here)
        grad_y = torch.addcmul(wide * _per_channel(a) + _per_channel(per_sum), _wide(y),
                               2 * _per_channel(per_square))
        grad_stats = mean.new_empty(0)
    else:
        grad_y, grad_stats = wide * _per_channel(a), torch.stack((per_sum, per_square))
    grad_y = grad_y.to(y.dtype).contiguous(memory_format=_memory_format(y))
    if weight is None:
        return grad_y, grad_stats, mean.new_empty(0), mean.new_empty(0)
    return grad_y, grad_stats, grad_a * inv_std, grad_b


def _per_channel(values):
    # ([C] -> [C, 1, 1], to broadcast over (N, C, H, W): unsqueezes, not a view to (1, C, 1, 1), whose
    # `aten.view` nodes Inductor's joint-graph pattern pass tries every multi-output pattern at (RESULTS.md,
    # "Where the first step's compile goes"))
    return values.unsqueeze(-1).unsqueeze(-1)


def _memory_format(y):
    # (y's layout, which its gradient keeps: channels_last where y is stored so, else contiguous)
    return (torch.channels_last if y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
            else torch.contiguous_format)


def _inverse_std_and_scale(var, weight, eps):
    # (1 / sqrt(var + eps), and the scale a = weight / sqrt(var + eps): the forward's and its gradient's)
    inv_std = (var + eps).rsqrt()
    return inv_std, (inv_std * weight if weight is not None else inv_std)


# Two operators, as torch's own BatchNorm is built (native_batch_norm and its backward): Dynamo traces one node and
# AOTAutograd one op for the gradient, where the ops above, traced one by one with their own gradients, cost the
# first step's compile (RESULTS.md, "Training", "Where the first step's compile goes"). Inductor decomposes both
# into the ops above and fuses them as before (_inductor_decomposes); elsewhere they run as Python functions.
for _name, _function in (("batch_norm_from_sums", _batch_norm_from_sums),
                         ("batch_norm_from_sums_backward", _batch_norm_from_sums_backward)):
    _LIBRARY.define(_name + torch.library.infer_schema(_function, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
    _LIBRARY.impl(_name, _function, "CompositeExplicitAutograd")
batch_norm_from_sums_op = torch.ops.conv_tutorial.batch_norm_from_sums.default
batch_norm_from_sums_backward_op = torch.ops.conv_tutorial.batch_norm_from_sums_backward.default


@torch.library.register_fake("conv_tutorial::batch_norm_from_sums")
def _(y, stats, weight, bias, count, eps, stats_from_y=False):
    return torch.empty_like(y), stats.new_empty(y.shape[1]), stats.new_empty(y.shape[1])


@torch.library.register_fake("conv_tutorial::batch_norm_from_sums_backward")
def _(grad, y, mean, var, weight, count, eps, stats_from_y):
    affine = y.shape[1] if weight is not None else 0
    return (torch.empty(y.shape, dtype=y.dtype, device=y.device, memory_format=_memory_format(y)),
            mean.new_empty(0) if stats_from_y else mean.new_empty(2, y.shape[1]), mean.new_empty(affine),
            mean.new_empty(affine))


def _batch_norm_setup(ctx, inputs, output):
    y, stats, weight, bias, count, eps, *given = inputs
    ctx.mark_non_differentiable(output[1], output[2])      # (mean and var: the running statistics' inputs)
    ctx.save_for_backward(y, output[1], output[2], weight)
    ctx.count, ctx.eps, ctx.affine = count, eps, weight is not None
    ctx.stats_from_y = bool(given[0]) if given else False
    ctx.set_materialize_grads(False)


def _batch_norm_backward(ctx, grad, _mean_grad, _var_grad):
    if grad is None:           # (only the statistics used, which carry no gradient)
        return None, None, None, None, None, None, None
    y, mean, var, weight = ctx.saved_tensors
    grad_y, grad_stats, grad_weight, grad_bias = batch_norm_from_sums_backward_op(grad, y, mean, var, weight, ctx.count,
                                                                                  ctx.eps, ctx.stats_from_y)
    # (with stats_from_y, the sums' share is in y's: stats get none)
    return (grad_y, None if ctx.stats_from_y else grad_stats, grad_weight if ctx.affine else None,
            grad_bias if ctx.affine else None, None, None, None)


torch.library.register_autograd("conv_tutorial::batch_norm_from_sums", _batch_norm_backward,
                                setup_context=_batch_norm_setup)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("conv_tutorial::batch_norm_from_sums has no second derivative (its backward "
                              "operator, batch_norm_from_sums_backward, has no gradient of its own)")


torch.library.register_autograd("conv_tutorial::batch_norm_from_sums_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)


@functools.cache
def _inductor_decomposes():
    """Register both operators' functions as their decompositions in Inductor's table, once (ConvBatchNorm2d
    calls it): Inductor then fuses their ops with the BatchNorm's neighbours; without it, it would call them
    as opaque kernels. Where this torch's Inductor has no such table, a warning says so."""
    try:
        import torch._inductor.lowering  # noqa: F401  (imported before the decomposition table, as Inductor does)
        from torch._inductor import decomposition
        for op, function in ((batch_norm_from_sums_op, _batch_norm_from_sums),
                             (batch_norm_from_sums_backward_op, _batch_norm_from_sums_backward)):
            if op not in decomposition.decompositions:
                decomposition.register_decomposition(op)(function)
        cached = getattr(decomposition, "fast_random_decomps", None)
        if hasattr(cached, "cache_clear"):          # (a cached copy of the table, made at the first compile)
            cached.cache_clear()
        # AOTAutograd's cache keys a graph by its ops, not by their decompositions: the functions' source goes
        # into the key, so that a cached graph built with other decompositions (or none) is not taken
        marked = getattr(torch._inductor.config, "unsafe_marked_cacheable_functions", None)
        if isinstance(marked, dict):
            import hashlib
            import inspect
            source = "".join(inspect.getsource(f) for f in (_batch_norm_from_sums, _batch_norm_from_sums_backward,
                                                           _inverse_std_and_scale, _memory_format, _wide,
                                                           batch_stats_from_sums))
            digest = hashlib.sha256(source.encode()).hexdigest()
            for op in ("batch_norm_from_sums", "batch_norm_from_sums_backward"):
                marked[f"conv_tutorial.{op}"] = digest
    except (ImportError, AttributeError, TypeError) as error:
        warnings.warn(f"conv_tutorial: Inductor's decomposition table could not take batch_norm_from_sums "
                      f"({type(error).__name__}: {error}); torch.compile calls it unfused")


def _as(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)


def stats_kernel_runs(conv: torch.nn.Conv2d) -> bool:
    """Whether conv2d_channel_stats runs `conv` on lesson 05's kernel (on a Hopper or Blackwell GPU,
    fp16/bf16 operands): groups 1, or groups whose channels fill the kernel's tiles (on this GPU's
    architecture; on a machine without one, on both). Elsewhere (a depthwise conv, groups of 24
    channels) torch would compute the conv and then the sums in a pass of its own over the output,
    slower than leaving the pair to Inductor, which folds the sums into its BatchNorm: measured on
    RegNetY-3.2GF (RESULTS.md, "Training fusions: BatchNorm's statistics ...")."""
    # (a depthwise conv's groups of one channel fill no tile)
    return conv.groups == 1 or grouped_conv_fits(conv.in_channels // conv.groups, conv.out_channels // conv.groups,
                                                 current_arch())


def fuse_conv_batchnorm_for_training(model: torch.nn.Module, inplace: bool = False) -> torch.fx.GraphModule:
    """A torch.fx pass: every nn.Conv2d (zero padding, one the kernel runs: stats_kernel_runs) whose
    only user is a BatchNorm2d over its channels becomes a ConvBatchNorm2d; `fused_pairs` on the
    returned GraphModule counts them. It shares no module with `model` (a copy is traced), or,
    inplace=True, traces `model` itself: then it shares its parameters (the convs' weights in
    channels_last memory share their storage) and BatchNorms, and `model` is left unchanged."""
    graph_module = torch.fx.symbolic_trace(model if inplace else copy.deepcopy(model))
    modules = dict(graph_module.named_modules())
    graph, count = graph_module.graph, 0
    for node in list(graph.nodes):
        conv = modules.get(node.target) if node.op == "call_module" else None
        if not isinstance(conv, torch.nn.Conv2d) or conv.padding_mode != "zeros" or not stats_kernel_runs(conv):
            continue
        user = _single_user(node)
        bn = modules.get(user.target) if user is not None and user.op == "call_module" else None
        if not isinstance(bn, torch.nn.BatchNorm2d) or bn.num_features != conv.out_channels:
            continue
        try:
            fused = ConvBatchNorm2d(conv, bn)
        except ValueError as error:
            warnings.warn(f"{node.target}: {error}; left as it is")
            continue
        name = install_module(graph_module, modules, "conv_bn", node.target, fused)
        with graph.inserting_after(user):
            new_node = graph.call_module(name, node.args, node.kwargs)
        user.replace_all_uses_with(new_node)
        graph.erase_node(user)
        graph.erase_node(node)
        count += 1
    return _rebuilt(graph_module, fused_pairs=count)


class ConvAfterReLU(torch.nn.Module):
    """A conv whose input is a ReLU's output, called with the ReLU's input too (fuse_relu_into_dgrad):
    conv2d_after_relu in training, the plain operator where no gradient is taken. Holds the conv as
    a TutorialConv2d (its weight, bias and resolved arguments)."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv if isinstance(conv, ops.TutorialConv2d) else ops.TutorialConv2d(conv)

    def forward(self, x, relu_input):
        conv = self.conv
        if conv._op_args is None or not torch.is_grad_enabled():
            return conv(x)
        x, weight = conv.operands(x)
        return conv2d_after_relu_op(x, relu_input.to(x.dtype), weight, conv.bias, *conv._op_args)


class _KeepFused(torch.fx.Tracer):
    # the package's conv modules stay whole nodes when a model holding them is traced
    def is_leaf_module(self, module, qualified_name):
        return isinstance(module, (ConvBatchNorm2d, ConvAfterReLU, ops.TutorialConv2d)) or \
            super().is_leaf_module(module, qualified_name)


def _is_inplace(node, modules):
    if node.op == "call_module":
        return getattr(modules[node.target], "inplace", False)
    return node.kwargs.get("inplace", False) or node.target in (torch.relu_, "relu_")


def _gated_in_epilogue(conv):
    # lesson 08's test of where dgrad's epilogue gates dX, on the module's hyper-parameters ("same"/"valid" resolved)
    pads = ops.resolve_padding(conv.padding, conv.weight.shape, tuple(conv.stride), tuple(conv.dilation))
    return pads is not None and dgrad_kernels.epilogue_gates(conv.stride, pads, conv.dilation, conv.weight.shape[2:])


def fuse_relu_into_dgrad(model: torch.nn.Module, inplace: bool = False) -> torch.fx.GraphModule:
    """A torch.fx pass: where a ReLU's output has one user, a conv that takes it as its input (an
    nn.Conv2d with zero padding, a TutorialConv2d or a ConvBatchNorm2d) and whose dX dgrad's
    epilogue can gate (lesson 08: stride 1, no crop), the conv is called with the
    ReLU's input too, and its backward applies ReLU's backward to dX itself (dgrad's epilogue, on
    lesson 06's dgrad kernel: backward.conv2d_input_grad_relu); the ReLU's own backward never runs. The
    ReLU becomes out of place (torch.relu), so an in-place ReLU is taken only where its input has no
    other user. `fused_relus` on the result counts them. `model`: a GraphModule (as
    fuse_conv_batchnorm_for_training returns) or any traceable model; a copy unless inplace=True
    (which shares the parameters and modules, as fuse_conv_batchnorm_for_training's does)."""
    if not isinstance(model, torch.fx.GraphModule):
        root = model if inplace else copy.deepcopy(model)
        graph_module = torch.fx.GraphModule(root, _KeepFused().trace(root))
    else:
        graph_module = model if inplace else copy.deepcopy(model)
    modules = dict(graph_module.named_modules())
    graph, count = graph_module.graph, 0
    for node in list(graph.nodes):
        if node.op not in ("call_module", "call_function", "call_method") or _activation_of(node, modules) != "relu":
            continue
        conv_node, relu_input = _single_user(node), node.args[0]
        if conv_node is None or conv_node.op != "call_module" or len(conv_node.args) != 1 or conv_node.kwargs \
                or conv_node.args[0] is not node or not isinstance(relu_input, torch.fx.Node):
            continue
        conv = modules[conv_node.target]
        inner = conv.conv if isinstance(conv, (ConvBatchNorm2d, ConvAfterReLU)) else conv
        if not isinstance(inner, (torch.nn.Conv2d, ops.TutorialConv2d)) or not _gated_in_epilogue(inner):
            continue          # (where dgrad cannot gate, the gate would be a pass of its own: Inductor's is cheaper)
        if isinstance(conv, torch.nn.Conv2d):
            if conv.padding_mode != "zeros":
                continue
            name = install_module(graph_module, modules, "conv_after_relu", conv_node.target, ConvAfterReLU(conv))
        elif isinstance(conv, ops.TutorialConv2d):
            name = install_module(graph_module, modules, "conv_after_relu", conv_node.target, ConvAfterReLU(conv))
        elif isinstance(conv, ConvBatchNorm2d):
            name = conv_node.target
        else:
            continue
        if _is_inplace(node, modules) and len(relu_input.users) > 1:
            continue          # other users of the ReLU's input see it changed in place
        with graph.inserting_before(node):
            relu = graph.call_function(torch.relu, (relu_input,))
        with graph.inserting_before(conv_node):
            fused = graph.call_module(name, (relu, relu_input))
        conv_node.replace_all_uses_with(fused)
        graph.erase_node(conv_node)
        graph.erase_node(node)
        count += 1
    return _rebuilt(graph_module, fused_relus=count)


def _rebuilt(graph_module, **counts):
    # a pass's graph checked, its modules no node calls dropped, its code regenerated, and its counts set on it
    graph_module.graph.lint()
    graph_module.delete_all_unused_submodules()
    graph_module.recompile()
    for name, count in counts.items():
        setattr(graph_module, name, count)
    return graph_module
