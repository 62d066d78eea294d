"""The fused epilogue's facts: what it applies (act(conv * scale + bias + residual), per output
channel), the checks of its operands, the output dtype of e4m3 operands, and torch's reference of it."""
import torch

ACTIVATIONS = ("none", "relu", "silu")     # what the fused epilogue applies last: nothing, ReLU, SiLU
# lesson 08's gate in dgrad: ReLU's backward, the tile kept where the residual operand (the ReLU's output, which is the
# conv's input) is positive, else 0; the residual is not added
RELU_GRAD = "relu_grad"


def check_epilogue(Co, out_shape, dtype, device, scale=None, residual=None, activation="none",
                   activations=ACTIVATIONS):
    """Validate the fused epilogue's arguments of a conv with Co output channels whose output has
    `out_shape`, `dtype` and `device` (the bias is checked with the conv's tensors). `activations`:
    what the kernel behind the call applies (the operator's forward kernel adds RELU_GRAD)."""
    if activation not in activations:
        raise ValueError(f"activation must be one of {activations}, got {activation!r}")
    if activation == RELU_GRAD and residual is None:
        raise ValueError(f"activation {RELU_GRAD!r} keeps the output where the residual tensor (a ReLU's output) is "
                         f"positive: pass residual")
    if scale is not None:
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"scale must be a torch.Tensor or None, got {type(scale).__name__}")
        if tuple(scale.shape) != (Co,) or not scale.is_floating_point() or not scale.is_contiguous():
            raise ValueError(f"scale must have shape ({Co},) (one factor per output channel) and be a "
                             f"contiguous floating-point tensor, got {scale.dtype} {tuple(scale.shape)}")
        if scale.device != device:
            raise ValueError(f"scale is on {scale.device}, the input on {device}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if tuple(residual.shape) != tuple(out_shape) or residual.dtype != dtype:
            raise ValueError(f"residual must have the output's shape {tuple(out_shape)} and dtype "
                             f"{dtype}, got {tuple(residual.shape)} {residual.dtype}")
        if residual.device != device:
            raise ValueError(f"residual is on {residual.device}, the input on {device}")


# e4m3 operands: the output dtype they give

FP8 = torch.float8_e4m3fn
FP8_OUT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def output_dtype(in_dtype, out_dtype=None):
    """The output dtype of a conv on `in_dtype` operands asked for `out_dtype`: fp16/bf16 operands
    give their own dtype; e4m3 operands give bf16 (the default) or e4m3."""
    if in_dtype == FP8:
        if out_dtype not in (None,) + FP8_OUT_DTYPES:
            raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {out_dtype}")
        return out_dtype or torch.bfloat16
    if out_dtype not in (None, in_dtype):
        raise ValueError(f"out_dtype must be None or the input's dtype {in_dtype} for {in_dtype} operands, "
                         f"got {out_dtype}")
    return in_dtype


def reference_epilogue(conv_out, bias=None, scale=None, residual=None, activation="none", channel_dim=-1):
    """act(conv_out * scale + bias + residual) in torch, per output channel (the last dimension of
    NHWC, or `channel_dim=1` for NCHW), in conv_out's dtype; RELU_GRAD: conv_out * scale + bias where
    residual > 0, else 0."""
    shape = [1] * conv_out.dim()
    shape[channel_dim] = -1
    out = conv_out if scale is None else conv_out * scale.to(conv_out.dtype).view(shape)
    if bias is not None:
        out = out + bias.to(conv_out.dtype).view(shape)
    if activation == RELU_GRAD:     # (lesson 08: the residual gates, it is not added)
        return torch.where(residual > 0, out, torch.zeros((), dtype=out.dtype, device=out.device))
    if residual is not None:
        out = out + residual.to(conv_out.dtype)
    if activation == "relu":
        return torch.relu(out)
    return torch.nn.functional.silu(out) if activation == "silu" else out
