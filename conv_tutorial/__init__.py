"""conv_tutorial: a persistent, warp-specialized convolution for Hopper and data-centre Blackwell
as PyTorch operators, with a torch.fx fusion pass, an fp8 pass and its own backward kernels.

    import conv_tutorial                     # the operators register on first use of the API below
    x = x.cuda().bfloat16().contiguous(memory_format=torch.channels_last)          # a batch as deployed
    model = conv_tutorial.fuse_conv_bn_act(model.eval(), example_input=x.float().cpu())
    model = model.cuda().bfloat16().to(memory_format=torch.channels_last)
    model = conv_tutorial.keep_faster_convs(model, x)    # cuDNN keeps the convs it runs faster
    y = torch.compile(model, mode="reduce-overhead")(x)

Layers, each importing only those below it:
- core: the facts, free of side effects (device table, geometry and checks, epilogue, TMA settings,
  output windows, BatchNorm from sums, the fp32 reference, the TFLOPS timer);
- kernels: the device code and plain launchers (fprop: the forward kernel; dgrad: the backward's
  plans on it; wgrad: the weight-gradient kernel; blocks, windows: their parts);
- the runtime: geometry (the operator's checks, fp8 scales, the device), configs (candidates),
  launch (plans, direct launch), traced_compiles (kernels compiled from torch.compile's tracing, opt-in),
  selection (pruning, heuristic, autotuner, tuning file),
  runtime (`conv2d` on NHWC tensors), depthwise, wgrad (dW through a plan per shape), backward (the
  conv's gradients);
- the torch layer: ops (torch.library operators), fusion (the fx pass), fp8 (the e4m3 pass),
  training (BatchNorm's batch statistics from the forward's epilogue, ReLU's backward in dgrad's
  epilogue, and their fx passes).

`import conv_tutorial` loads nothing but this file: `conv_tutorial.core` and `conv_tutorial.kernels`
can be imported without the torch layer. The first use of a name below (or `import conv_tutorial.training`,
which imports `conv_tutorial.ops`; that alone registers all but training's operators) loads the torch
layer, which registers the operators (torch.ops.conv_tutorial: conv2d, conv2d_fp8, the backward's
conv2d_input_grad, conv2d_input_grad_relu and conv2d_weight_grad, and training's conv2d_channel_stats,
batch_norm_from_sums with its backward, and conv2d_after_relu) and changes nothing else: no environment
variable, no Triton mode, no stream redirected. (A training.ConvBatchNorm2d, when built, adds its operators'
decompositions to Inductor's table: training.py.)
"""
import importlib

# public name -> the module that defines it
_API = {
    **dict.fromkeys(["backward_backend", "backward_fallbacks", "reset_backward_fallbacks", "set_backward"], "backward"),
    **dict.fromkeys(["CANDIDATES", "FIXED_CONFIG", "KernelConfig"], "configs"),
    "compile_kernels_ahead": "compile_ahead",
    "compile_while_tracing": "traced_compiles",
    "depthwise_conv2d": "depthwise",
    "quantize_fp8": "fp8",
    **dict.fromkeys(["FusedConv2d", "TorchConvEpilogue", "fuse_conv_bn_act", "keep_faster_convs"], "fusion"),
    "quantize_tensor": "geometry",
    **dict.fromkeys(["TutorialConv2d", "conv2d", "conv2d_fp8", "convert_conv2d"], "ops"),
    **dict.fromkeys(["autotune_enabled", "set_autotune", "tuning_cache_path"], "selection"),
    **dict.fromkeys(["ConvAfterReLU", "ConvBatchNorm2d", "fuse_conv_batchnorm_for_training", "fuse_relu_into_dgrad"],
                    "training"),
}
__all__ = sorted(_API) + ["conv2d_nhwc"]


def _torch_layer():
    """Import the torch layer: every module that registers an operator."""
    for module in ("ops", "training"):
        importlib.import_module(f"{__name__}.{module}")


def __getattr__(name):
    if name == "conv2d_nhwc":           # the runtime's conv2d on NHWC tensors
        _torch_layer()
        value = importlib.import_module(f"{__name__}.runtime").conv2d
    elif name in _API:
        _torch_layer()
        value = getattr(importlib.import_module(f"{__name__}.{_API[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
