"""What dgrad and wgrad share: their dtypes and call checks, which grouped convs each runs, the
channels a tile spends per tap, and the stride fold of a strided conv with few input channels (a
network's stem: the stride's phases folded into the channels, so the gradients' kernels see a
stride-1 conv of stride_h * stride_w times the channels; lesson 06 teaches it)."""
from typing import NamedTuple

import torch
import triton

from ..core.geometry import conv_geometry
from . import fprop

BACKWARD_DTYPES = (torch.float16, torch.bfloat16)   # why not e4m3: lesson 07 (e4m3 WGMMA takes no transposed operand)


def check_backward_call(tensors, x_shape, w_shape, stride, padding, dilation, groups):
    """Validate a dgrad or wgrad call: `tensors` maps argument names ("dy_nhwc", "w", "x_nhwc") to
    the tensors given. Errors name the argument, its value and what is allowed; the device is
    checked last, so every other mistake is reported on a machine without a GPU too."""
    if not isinstance(groups, int) or isinstance(groups, bool):
        raise TypeError(f"groups must be an int, got {groups!r}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in BACKWARD_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; allowed: float16, bfloat16")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous ({'[Co, R, S, Ci]' if name == 'w' else 'NHWC'}), "
                             f"got strides {t.stride()} for shape {tuple(t.shape)}")
    first, *others = tensors.items()
    for name, t in others:
        if t.dtype != first[1].dtype or t.device != first[1].device:
            raise TypeError(f"{first[0]} is {first[1].dtype} on {first[1].device} but {name} is {t.dtype} on "
                            f"{t.device}; both must have one dtype and device")
    for name, shape in (("x_shape", x_shape), ("w_shape", w_shape)):
        if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 4 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in shape):
            raise TypeError(f"{name} must be 4 ints ({'[N, H, W, Ci]' if name == 'x_shape' else '[Co, R, S, Ci]'}), "
                            f"got {shape!r}")
    geometry = conv_geometry(tuple(x_shape), tuple(w_shape), stride, padding, dilation, groups)
    reason = backward_groups_reason(geometry, "dgrad" if "w" in tensors else "wgrad")
    if reason is not None:
        raise ValueError(f"groups={groups}: {reason}")
    dy = tensors["dy_nhwc"]
    if tuple(dy.shape) != geometry.output_shape_nhwc:
        raise ValueError(f"dy_nhwc has shape {tuple(dy.shape)}, but the output of {geometry.describe()} "
                         f"has shape {geometry.output_shape_nhwc} [N, out_h, out_w, Co]")
    if dy.device.type != "cuda":
        raise ValueError(f"dy_nhwc is on {dy.device}; this kernel runs on a CUDA GPU, move the tensors with .cuda()")
    return geometry


class StrideFold(NamedTuple):
    geometry: object      # the folded conv: stride 1, padding 0, sh*sw*Ci channels (its Ci: Ci_padded)
    stride: tuple         # (sh, sw), the stride folded
    pads: tuple           # (top, bottom, left, right) rows and columns added to x before folding (< 0: cut)
    Ci_padded: int        # sh*sw*Ci rounded up to 16 bytes (zero channels: x's TMA row)


def folded_cost(R, S, Ci, element_size=2):
    return R * S * channel_box(Ci, element_size)


def stride_fold(geometry, element_size=2):
    """The folded conv (a StrideFold) where folding the stride into the channels at least halves
    folded_cost, else None. Arithmetic on the shape alone."""
    g = geometry
    (sh, sw), (ph, pw) = g.stride, g.padding
    if g.groups != 1 or g.dilation != (1, 1) or g.stride == (1, 1):
        return None
    R2, S2 = -(-g.R // sh), -(-g.S // sw)
    if 2 * folded_cost(R2, S2, sh * sw * g.Ci, element_size) > folded_cost(g.R, g.S, g.Ci, element_size):
        return None
    H2, W2 = g.out_h + R2 - 1, g.out_w + S2 - 1            # the folded input's rows and columns
    lanes = 16 // element_size
    Ci_padded = -(-sh * sw * g.Ci // lanes) * lanes
    folded = conv_geometry((g.N, H2, W2, Ci_padded), (g.Co, R2, S2, Ci_padded), 1, 0, 1)
    return StrideFold(folded, g.stride, (ph, sh * H2 - g.H - ph, pw, sw * W2 - g.W - pw), Ci_padded)


def fold_input(x_nhwc, fold):
    """x [N, H, W, Ci] -> x' [N, H', W', sh*sw*Ci padded]: padded, rows and columns grouped by the stride."""
    top, bottom, left, right = fold.pads
    g = fold.geometry
    x_padded = torch.nn.functional.pad(x_nhwc, (0, 0, left, right, top, bottom))   # (negative pads cut)
    N, _, _, Ci = x_padded.shape
    sh, sw = fold.stride
    folded = x_nhwc.new_zeros(N, g.H, g.W, fold.Ci_padded)
    folded[..., :sh * sw * Ci].view(N, g.H, g.W, sh, sw, Ci).copy_(
        x_padded.view(N, g.H, sh, g.W, sw, Ci).permute(0, 1, 3, 2, 4, 5))
    return folded


def fold_weight(w, fold):
    """w [Co, R, S, Ci] -> w' [Co, R', S', sh*sw*Ci padded]: tap (r, s) = (sh*a + b, sw*a' + b')
    goes to tap (a, a'), channels (b, b', ci); taps past R and S are zeros."""
    Co, R, S, Ci = w.shape
    (sh, sw), g = fold.stride, fold.geometry
    w_padded = torch.nn.functional.pad(w, (0, 0, 0, sw * g.S - S, 0, sh * g.R - R))
    folded = w_padded.view(Co, g.R, sh, g.S, sw, Ci).permute(0, 1, 3, 2, 4, 5).reshape(Co, g.R, g.S, sh * sw * Ci)
    return torch.nn.functional.pad(folded, (0, fold.Ci_padded - sh * sw * Ci)).contiguous()


def unfold_weight_grad(dw_folded, geometry, fold):
    """dW' of the folded conv -> dW [Co, R, S, Ci] of the conv `geometry`."""
    g, (sh, sw), f = geometry, geometry.stride, fold.geometry
    dw = dw_folded[..., :sh * sw * g.Ci].reshape(g.Co, f.R, f.S, sh, sw, g.Ci).permute(0, 1, 3, 2, 4, 5)
    return dw.reshape(g.Co, f.R * sh, f.S * sw, g.Ci)[:, :g.R, :g.S].contiguous()


def unfold_input_grad(dx_folded, geometry, fold):
    """dX' of the folded conv -> dX [N, H, W, Ci] of the conv `geometry` (the padding's rows dropped;
    rows the cut removed, which no output reads, get 0)."""
    g, (sh, sw), f = geometry, geometry.stride, fold.geometry
    top, bottom, left, right = fold.pads
    dx = dx_folded[..., :sh * sw * g.Ci].reshape(g.N, f.H, f.W, sh, sw, g.Ci).permute(0, 1, 3, 2, 4, 5)
    dx = dx.reshape(g.N, f.H * sh, f.W * sw, g.Ci)
    return torch.nn.functional.pad(dx, (0, 0, -left, -right, -top, -bottom)).contiguous()


def channel_box(Ci, element_size=2):
    # the channels a tile spends per tap: Ci padded to 16 bytes, rounded up to a power of two, 16 at least
    return max(16, triton.next_power_of_2(-(-Ci * element_size // 16) * 16 // element_size))


def dgrad_config(geometry):
    # lesson 05's fixed config, 64 columns wide where dX has 64 channels (per group) or fewer
    return fprop.FIXED_CONFIG._replace(block_n=64) if geometry.Ci_group <= 64 else fprop.FIXED_CONFIG


def backward_groups_reason(geometry, kind):
    """Why lesson 06's `kind` ("dgrad" or "wgrad") does not run this grouped conv, or None. Both keep a
    tile inside one group: dgrad as lesson 05's grouped conv of dY (section 10 there: Co / groups
    channels in, Ci / groups out), wgrad with a tile's rows in one group's output channels."""
    g = geometry
    if g.groups == 1:
        return None
    if kind == "wgrad" and (g.Co_group % 64 or g.Ci_group % 8):
        return (f"wgrad takes a grouped conv whose groups hold a multiple of 64 output channels (a tile's rows "
                f"in one group) and of 8 input channels (lesson 07's wgrad tiles); got {g.Co_group} and {g.Ci_group} per group")
    if kind == "dgrad" and not fprop.groups_fit(dgrad_config(g), g.Co_group, g.Ci_group):
        return (f"dgrad runs as lesson 05's grouped conv of dY, {g.Co_group} -> {g.Ci_group} channels per group, "
                f"whose tiles must stay in one group (lesson 05, section 10: K blocks dividing {g.Co_group}, "
                f"tiles of {dgrad_config(g).tile_n} columns dividing {g.Ci_group})")
    return None
