"""conv_tutorial: lesson 05's warp-specialized convolution (Hopper and data-centre Blackwell) as
PyTorch operators, a torch.fx fusion pass and an fp8 pass.

    import conv_tutorial                     # registers torch.ops.conv_tutorial.conv2d and conv2d_fp8
    x = x.cuda().bfloat16().contiguous(memory_format=torch.channels_last)          # a batch as deployed
    model = conv_tutorial.fuse_conv_bn_act(model.eval(), example_input=x.float().cpu())
    model = model.cuda().bfloat16().to(memory_format=torch.channels_last)
    model = conv_tutorial.keep_faster_convs(model, x)    # cuDNN keeps the convs it runs faster
    y = torch.compile(model, mode="reduce-overhead")(x)

The kernel itself is the one lesson 05 teaches, loaded from that file (kernel.py). Modules, each
importing only those above it: kernel (the lesson), geometry (arguments, device), configs
(candidates, tile and shared-memory accounting), launch (plans, direct launch), selection
(pruning, heuristic, autotuner, tuning file), runtime (`conv2d` on NHWC tensors), depthwise,
backward (the conv's gradients: torch's, or lesson 06's kernels), ops (torch.library operators),
fusion (the fx pass), fp8 (the e4m3 pass), training (BatchNorm's batch statistics from the
forward's epilogue, ReLU's backward in dgrad's epilogue, and their fx passes).

Importing the package registers its operators (conv2d, conv2d_fp8, the backward's
conv2d_input_grad, conv2d_input_grad_relu and conv2d_weight_grad, and training's conv2d_channel_stats and
conv2d_after_relu) and changes
nothing else: no environment variable, no Triton mode, no stream redirected.
"""
from .backward import backward_backend, backward_fallbacks, reset_backward_fallbacks, set_backward
from .configs import CANDIDATES, FIXED_CONFIG, KernelConfig
from .depthwise import depthwise_conv2d
from .fp8 import quantize_fp8
from .fusion import FusedConv2d, TorchConvEpilogue, fuse_conv_bn_act, keep_faster_convs
from .geometry import quantize_tensor
from .ops import TutorialConv2d, conv2d, conv2d_fp8, convert_conv2d
from .runtime import conv2d as conv2d_nhwc
from .selection import autotune_enabled, set_autotune, tuning_cache_path
from .training import ConvAfterReLU, ConvBatchNorm2d, fuse_conv_batchnorm_for_training, fuse_relu_into_dgrad

__all__ = ["CANDIDATES", "ConvAfterReLU", "ConvBatchNorm2d", "FIXED_CONFIG", "FusedConv2d", "KernelConfig", "TorchConvEpilogue",
           "TutorialConv2d", "autotune_enabled", "backward_backend", "backward_fallbacks", "conv2d", "conv2d_fp8",
           "conv2d_nhwc", "convert_conv2d", "depthwise_conv2d", "fuse_conv_batchnorm_for_training", "fuse_conv_bn_act", "fuse_relu_into_dgrad",
           "keep_faster_convs", "quantize_fp8", "quantize_tensor", "reset_backward_fallbacks", "set_autotune",
           "set_backward", "tuning_cache_path"]
