"""The ground truth: torch's conv2d in fp32 on NHWC tensors (the CPU fallback and the tests compare with it)."""
import torch

from .geometry import pair
from .tma import canonical_strides


def reference_conv2d_nhwc(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1,
                          out_dtype=None, groups=1):
    """The ground truth of the series: torch.nn.functional.conv2d, computed in fp32.

    Takes NHWC input and a [Co, R, S, Ci / groups] weight, returns NHWC. The math runs in fp32 on the inputs'
    device whatever their dtype, so fp16/bf16 kernels are compared with a more precise answer; the
    result is cast to `out_dtype` (default: the input dtype)."""
    stride, padding, dilation = (pair(stride, "stride", 1), pair(padding, "padding", 0),
                                 pair(dilation, "dilation", 1))
    x_nchw = canonical_strides(x_nhwc.permute(0, 3, 1, 2).float())     # (Ci = 1: see canonical_strides)
    w_kcrs = canonical_strides(w.permute(0, 3, 1, 2).float())
    # cuDNN would use TF32 (10-bit mantissa) for fp32 convolutions by default: not a reference.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        out = torch.nn.functional.conv2d(x_nchw, w_kcrs, None if bias is None else bias.float(),
                                         stride=stride, padding=padding, dilation=dilation, groups=groups)
    return out.permute(0, 2, 3, 1).to(out_dtype or x_nhwc.dtype).contiguous()

