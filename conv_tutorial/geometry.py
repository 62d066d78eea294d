"""The operator's geometry and argument checks, fp8 quantization of a tensor, and the GPU it runs on.

The rules a conv's arguments follow live in the package's core (conv_tutorial/core: the geometry,
the input and epilogue checks, the output dtype of e4m3 operands; the lessons' kit names the same
ones); this module names them for the runtime and adds what only the operator asks:
which dtypes its kernel takes, the scales of e4m3 tensors (quantizing one, checking them, folding
them into the epilogue), and which GPU the current device is (looked up once per device).
"""
import functools

import torch

from . import core
from .kernels import fprop

ConvGeometry, conv_geometry, conv_output_size, pair = (
    core.ConvGeometry, core.conv_geometry, core.conv_output_size, core.pair)
check_conv_call, check_epilogue, output_dtype, ACTIVATIONS = (
    core.check_conv_call, core.check_epilogue, core.output_dtype, core.ACTIVATIONS)
FP8, FP8_OUT_DTYPES = core.FP8, core.FP8_OUT_DTYPES
FP8_MAX = 448.0                                  # e4m3's largest finite value
KERNEL_DTYPES = fprop.KERNEL_DTYPES           # fp16, bf16, and e4m3 (lesson 05, section 9)


# %% fp8: quantizing a tensor, and the scales of an e4m3 conv ------------------------------------

def quantize_tensor(t, channel_dim=None):
    """(q, scale) with t ~ q.float() * scale: q in e4m3, scale fp32, one per tensor (shape ()) or one
    per index of `channel_dim` (e.g. 0 for a weight's output channels), amax mapped to 448.

    Every scale is positive and finite: an all-zero tensor (or channel) gets scale 1, since its zeros
    are exact at any scale and a scale of 0 would make 0 / 0 of them. A tensor holding inf or NaN
    has no scale that represents it: ValueError (reading that answer back costs one device
    synchronization on a GPU, which quantizing, a preparation step, can afford)."""
    dims = [d for d in range(t.dim()) if d != channel_dim]
    amax = t.detach().abs().float().amax(dim=dims) if channel_dim is not None else t.detach().abs().float().amax()
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"quantize_tensor: the tensor of shape {tuple(t.shape)} holds inf or NaN; e4m3 has "
                         f"no scale for them (amax {amax.max().item()})")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).clamp(min=torch.finfo(torch.float32).tiny)
    shape = [-1 if d == channel_dim else 1 for d in range(t.dim())]
    return (t.float() / scale.view(shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_conv_operands(x, w):
    """(x_q, x_scale, w_q, w_scale) of a conv in e4m3: the input per tensor, the weights per output
    channel (dim 0), as the fp8 operator takes them."""
    (x_q, x_scale), (w_q, w_scale) = quantize_tensor(x), quantize_tensor(w, channel_dim=0)
    return x_q, x_scale, w_q, w_scale


def dequantize_conv_operands(x_q, x_scale, w_q, w_scale):
    """(x, w) in fp32: the very values an fp8 conv multiplies, for a reference conv."""
    return x_q.float() * x_scale, w_q.float() * w_scale.view(-1, *[1] * (w_q.dim() - 1))


def _readable_on_host(t):
    """A plain tensor in CPU memory, outside torch.compile's tracing: its values can be read without a device
    synchronization or a break in the traced graph (a fake tensor, a tensor Dynamo traces, or a CUDA tensor,
    cannot be read for free)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and not torch.compiler.is_compiling())


def _check_fp8_scale(name, value, shape, device):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an fp32 torch.Tensor of shape {shape}, got {type(value).__name__}")
    if value.dtype != torch.float32 or tuple(value.shape) != shape or not value.is_contiguous():
        raise ValueError(f"{name} must be a contiguous fp32 tensor of shape {shape}, got {value.dtype} "
                         f"{tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}, the input on {device}")
    if _readable_on_host(value):
        bad = ~(torch.isfinite(value) & (value > 0))
        if bool(bad.any()):
            first = value.reshape(-1)[bad.reshape(-1)][0].item()
            where = "" if not shape else f" (at index {int(bad.reshape(-1).nonzero()[0])})"
            raise ValueError(f"{name} must be positive and finite, got {first}{where}: a scale is the size of one "
                             f"e4m3 unit (conv_tutorial.quantize_tensor makes one)")


def check_fp8_dtypes(caller, **operands):
    """Each named operand (a tensor) must be e4m3; the error names it and what `caller` takes."""
    for name, value in operands.items():
        if isinstance(value, torch.Tensor) and value.dtype != FP8:
            raise TypeError(f"{name} has dtype {value.dtype}; {caller} takes torch.float8_e4m3fn "
                            f"(conv_tutorial.quantize_tensor makes it, with its scale)")


def fp8_epilogue(x_scale, w_scale, scale=None, bias=None, out_scale=None):
    """(scale, bias) of the fused epilogue that dequantizes an e4m3 conv (lesson 05, section 9):
    x_scale * w_scale[co] times the layer's own scale, and for an e4m3 output both divided by
    out_scale (relu(z) / s = relu(z / s))."""
    scale = x_scale * w_scale if scale is None else x_scale * w_scale * scale.float()
    if out_scale is not None:
        scale, bias = scale / out_scale, (bias.float() / out_scale if bias is not None else None)
    return scale.contiguous(), bias


def check_fp8_scales(x_scale, w_scale, Co, device, *, residual=None, activation="none", out_dtype=torch.bfloat16,
                     out_scale=None):
    """The fp8 conv's own arguments (named as conv2d_fp8 names them): input_scale one fp32 value
    (shape ()), weight_scale one per output channel, the output in bf16 or in e4m3 with its own
    out_scale (ReLU or none: the scale folds into the epilogue's), a residual in the output's dtype
    (in e4m3, at the output's scale).

    Scales must be positive and finite. On CPU tensors their values are checked (ValueError; not while
    torch.compile traces, which cannot branch on a value); on a GPU they are not, because reading a
    value back would synchronize the device on every call (and break CUDA-graph capture). There a bad
    scale is not detected: it is folded into the epilogue's per-channel factor, so a NaN or infinite
    scale makes the affected outputs NaN or inf, a zero
    input or weight scale makes them zero (plus the bias), a negative one flips their sign (before the
    activation), and a zero out_scale divides by zero: outputs saturate at +-448 or become NaN.
    `conv_tutorial.quantize_tensor` and the fp8 pass only make valid scales."""
    _check_fp8_scale("input_scale", x_scale, (), device)
    _check_fp8_scale("weight_scale", w_scale, (Co,), device)
    if out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {out_dtype}")
    if out_dtype == FP8:
        if out_scale is None:
            raise ValueError("out_dtype=torch.float8_e4m3fn needs out_scale (the output's fp32 scale, shape ())")
        _check_fp8_scale("out_scale", out_scale, (), device)
        if activation == "silu":
            raise ValueError("activation 'silu' with an e4m3 output is not supported: the output scale is folded "
                             "into the epilogue's scale and bias, which holds for ReLU (relu(x)/s = relu(x/s)) "
                             "but not for SiLU; use out_dtype=torch.bfloat16")
    elif out_scale is not None:
        raise ValueError("out_scale is only for out_dtype=torch.float8_e4m3fn")
    if isinstance(residual, torch.Tensor) and residual.dtype != out_dtype:
        raise ValueError(f"residual must come in the output's dtype {out_dtype} (in e4m3, at the output's scale), "
                         f"got {residual.dtype}")




@functools.lru_cache(maxsize=None)
def _device_facts_of(device_index):
    arch, num_sms = core.tma_mma_arch_and_sms("conv2d_fprop")
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", core.SHARED_MEMORY_PER_PROGRAM)   # (the table's, else)
    return arch, num_sms, smem


def device_facts():
    """(arch, SM count, shared-memory limit per program) of the current GPU, looked up once per device;
    a clear error where it is no Hopper or data-centre Blackwell GPU."""
    if not core.HAS_CUDA:
        core.require_tma_mma_gpu("conv2d_fprop")
    return _device_facts_of(torch.cuda.current_device())


def current_arch(device=None):
    """"sm_90" or "sm_100" where the current GPU (or `device`, a torch.device) is the kernel's,
    else None (looked up once per device)."""
    if not core.HAS_CUDA or (device is not None and device.type != "cuda"):
        return None
    return _arch_of_device(torch.cuda.current_device() if device is None or device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _arch_of_device(device_index):
    if device_index is None or not core.is_tma_mma_capability(torch.cuda.get_device_capability(device_index)):
        return None
    return _device_facts_of(device_index)[0]


def nhwc_view(t):
    """The NHWC view of an NCHW-shaped tensor: free in channels_last memory, else one copy."""
    view = t.permute(0, 2, 3, 1)
    return view if view.is_contiguous() else view.contiguous()


def call_key(tensors, *arguments):
    """A hashable key of what a call shows at a glance, for a dictionary of plans: each tensor's
    shape, dtype and device (None for an optional tensor that is absent) and the other arguments.
    None where an argument that should be a tensor is not one, or one is unhashable (a list-valued
    stride, say): then the caller takes its full path, which checks and explains everything."""
    key = []
    for tensor in tensors:
        if isinstance(tensor, core.FlippedFilter):     # lesson 06's dgrad weights, read in place: its taps too
            key.append((tensor.w.shape, tensor.dtype, tensor.device, tensor.along_h, tensor.along_w))
            continue
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            return None
        key.append(None if tensor is None else (tensor.shape, tensor.dtype, tensor.device))
    key = (*key, *arguments)
    try:
        hash(key)
    except TypeError:
        return None
    return key
