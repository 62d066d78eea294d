"""A convolution's geometry in the series' naming key (NHWC activations, [Co, R, S, Ci] weights),
and the checks of a call's arguments: each error names the argument, its value and what is allowed."""
import dataclasses
import functools

import torch

from .epilogue import ACTIVATIONS, check_epilogue, output_dtype
from .windows import FlippedFilter

def pair(value, name: str, minimum: int) -> tuple[int, int]:
    """Turn an int or an (h, w) pair into a validated (h, w) tuple of ints >= minimum."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints (h, w), got {value!r}")
    if isinstance(value, int):
        value = (value, value)
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{name} must be an int or a pair of ints (h, w), got {value!r}")
    if min(value) < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name} must be {kind} (each value >= {minimum}), got {tuple(value)}")
    return int(value[0]), int(value[1])


def conv_output_size(size: int, filter_size: int, stride: int, padding: int, dilation: int) -> int:
    """Output length along one axis: floor((size + 2*padding - dilation*(filter-1) - 1) / stride) + 1.

    May be <= 0 for a filter larger than the padded input; callers reject that."""
    return (size + 2 * padding - dilation * (filter_size - 1) - 1) // stride + 1


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """Everything about one convolution's shape, in the series' naming key."""
    N: int
    H: int
    W: int
    Ci: int
    Co: int
    R: int
    S: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    out_h: int
    out_w: int
    groups: int = 1      # a grouped conv: output channel co reads input channels of group co // (Co / groups)

    @property
    def Ci_group(self) -> int:
        """Input channels each output channel reads: Ci, or Ci / groups."""
        return self.Ci // self.groups

    @property
    def Co_group(self) -> int:
        return self.Co // self.groups

    @property
    def M(self) -> int:
        return self.N * self.out_h * self.out_w

    @property
    def N_GEMM(self) -> int:
        return self.Co

    @property
    def K(self) -> int:
        return self.R * self.S * self.Ci_group

    @property
    def output_shape_nhwc(self) -> tuple[int, int, int, int]:
        return (self.N, self.out_h, self.out_w, self.Co)

    @property
    def flops(self) -> int:
        return 2 * self.M * self.Co * self.K

    def describe(self) -> str:
        def hw(p):
            return str(p[0]) if p[0] == p[1] else f"{p[0]}x{p[1]}"
        text = (f"N={self.N} {self.H}x{self.W} Ci={self.Ci} -> Co={self.Co}, {self.R}x{self.S}, "
                f"stride {hw(self.stride)}, pad {hw(self.padding)}")
        return text + (f", dil {hw(self.dilation)}" if self.dilation != (1, 1) else "") \
            + (f", {self.groups} groups" if self.groups > 1 else "")


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def conv_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1) -> ConvGeometry:
    """Validate shapes and hyper-parameters of an NHWC x [Co,R,S,Ci] convolution; return its geometry.
    With groups > 1 the weight is [Co, R, S, Ci / groups], as in torch.nn.functional.conv2d.

    Memoized: a network calls the same few shapes over and over, and this runs on every call."""
    try:
        return _conv_geometry_cached(tuple(x_shape), tuple(w_shape), _hashable(stride),
                                     _hashable(padding), _hashable(dilation), groups)
    except TypeError as error:
        if "unhashable" not in str(error):
            raise
        return _conv_geometry(x_shape, w_shape, stride, padding, dilation, groups)


@functools.lru_cache(maxsize=1024)
def _conv_geometry_cached(x_shape, w_shape, stride, padding, dilation, groups):
    return _conv_geometry(x_shape, w_shape, stride, padding, dilation, groups)


def _conv_geometry(x_shape, w_shape, stride, padding, dilation, groups=1) -> ConvGeometry:
    if len(x_shape) != 4:
        raise ValueError(f"x_nhwc must have rank 4 [N, H, W, Ci], got shape {tuple(x_shape)}")
    if len(w_shape) != 4:
        raise ValueError(f"w must have rank 4 [Co, R, S, Ci], got shape {tuple(w_shape)}")
    N, H, W, Ci = (int(v) for v in x_shape)
    Co, R, S, Ci_w = (int(v) for v in w_shape)
    if not isinstance(groups, int) or isinstance(groups, bool):
        raise TypeError(f"groups must be an int, got {type(groups).__name__}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got groups={groups}")
    if groups > 1:
        if Ci % groups or Co % groups or Ci_w * groups != Ci:
            raise ValueError(f"groups={groups}: x_nhwc's Ci={Ci} and w's Co={Co} must be multiples of groups, "
                             f"and w [Co, R, S, Ci/groups] must have Ci/groups={Ci // groups} channels, got {Ci_w}")
    elif Ci != Ci_w:
        hint = ""
        if R == Ci:   # the shapes fit PyTorch's own [Co, Ci, R, S] weight layout
            hint = (f"; w looks like PyTorch's [Co, Ci, R, S] layout (Co={Co}, Ci={R}, R={S}, "
                    f"S={Ci_w}): w.permute(0, 2, 3, 1).contiguous() gives [Co, R, S, Ci] = "
                    f"[{Co}, {S}, {Ci_w}, {R}]")
        raise ValueError(f"channel mismatch: x_nhwc has Ci={Ci} channels but w [Co, R, S, Ci] "
                         f"has Ci={Ci_w}{hint}")
    for name, value in (("N", N), ("H", H), ("W", W), ("Ci", Ci), ("Co", Co), ("R", R), ("S", S)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {name}={value} "
                             f"(x_nhwc {tuple(x_shape)}, w {tuple(w_shape)})")
    stride = pair(stride, "stride", 1)
    padding = pair(padding, "padding", 0)
    dilation = pair(dilation, "dilation", 1)
    out_h = conv_output_size(H, R, stride[0], padding[0], dilation[0])
    out_w = conv_output_size(W, S, stride[1], padding[1], dilation[1])
    if out_h <= 0 or out_w <= 0:
        raise ValueError(
            f"empty output: out_h={out_h}, out_w={out_w} for an input of {H}x{W} with a {R}x{S} "
            f"filter, stride {stride}, padding {padding}, dilation {dilation}; the dilated filter "
            f"({dilation[0] * (R - 1) + 1}x{dilation[1] * (S - 1) + 1}) must fit in the padded "
            f"input ({H + 2 * padding[0]}x{W + 2 * padding[1]})")
    return ConvGeometry(N, H, W, Ci, Co, R, S, stride, padding, dilation, out_h, out_w, groups)


def has_output(x_shape, w_shape, stride=1, padding=0, dilation=1) -> bool:
    """Does this convolution produce at least one output pixel? (For building test grids that
    only hold shapes a convolution accepts.)"""
    try:
        conv_geometry(x_shape, w_shape, stride, padding, dilation)
        return True
    except ValueError:
        return False


def check_conv_inputs(x_nhwc, w, stride=1, padding=0, dilation=1, *, dtypes, bias=None,
                      need_cuda=False, groups=1) -> ConvGeometry:
    """Validate the tensors of a convolution entry point and return its geometry.

    `dtypes` lists the accepted dtypes. Errors name the argument, the value and what is allowed. (w may
    be a `FlippedFilter`, lesson 06's: the filter it stands for is checked, its own layout later.)"""
    for name, t in (("x_nhwc", x_nhwc), ("w", w.w if isinstance(w, FlippedFilter) else w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x_nhwc.dtype not in dtypes or w.dtype != x_nhwc.dtype:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        if x_nhwc.dtype not in dtypes:
            raise TypeError(f"x_nhwc has dtype {x_nhwc.dtype}; allowed: {allowed}")
        raise TypeError(f"dtype mismatch: x_nhwc is {x_nhwc.dtype} but w is {w.dtype}; "
                        f"both must have the same dtype ({allowed})")
    geometry = conv_geometry(x_nhwc.shape, w.shape, stride, padding, dilation, groups)
    if x_nhwc.device != w.device:
        raise ValueError(f"x_nhwc is on {x_nhwc.device} but w is on {w.device}; use one device")
    if not x_nhwc.is_contiguous():
        raise ValueError(
            f"x_nhwc must be a contiguous NHWC tensor [N, H, W, Ci], got strides {x_nhwc.stride()} "
            f"for shape {tuple(x_nhwc.shape)}; an NCHW tensor x becomes NHWC with "
            f"x.permute(0, 2, 3, 1).contiguous()")
    if not w.is_contiguous():
        raise ValueError(f"w must be a contiguous [Co, R, S, Ci] tensor, got strides {w.stride()} "
                         f"for shape {tuple(w.shape)}; a [Co, Ci, R, S] weight becomes "
                         f"[Co, R, S, Ci] with w.permute(0, 2, 3, 1).contiguous()")
    check_bias(bias, geometry.Co, x_nhwc.device, "x_nhwc")
    if need_cuda:
        check_on_cuda(x_nhwc)
    return geometry


def check_bias(bias, Co, device, input_name, contiguous=False):
    """A conv's bias: None, or a floating-point tensor of shape [Co] on the input's device (the input
    named `input_name` in the error); with `contiguous`, contiguous too (what a kernel reads by address)."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.shape != (Co,):
        raise ValueError(f"bias must have shape [Co]=({Co},), got {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but {input_name} is on {device}")
    if not bias.dtype.is_floating_point:
        raise TypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
    if contiguous and not bias.is_contiguous():
        raise ValueError("bias must be contiguous")


def check_conv_call(x_nhwc, w, bias, stride, padding, dilation, *, dtypes, scale=None, residual=None,
                    activation="none", out_dtype=None, groups=1, activations=ACTIVATIONS) -> ConvGeometry:
    """Validate a call of a conv with the fused epilogue (lesson 05: its launcher, the runtime):
    tensors, hyper-parameters and epilogue, the device last so every other mistake is reported on
    a machine without a GPU too. `out_dtype`: None (x's dtype), or for e4m3 operands bf16 or e4m3;
    `activations`: what the kernel's epilogue applies (check_epilogue). Returns the geometry."""
    geometry = check_conv_inputs(x_nhwc, w, stride, padding, dilation, dtypes=dtypes, bias=bias, groups=groups)
    check_bias(bias, geometry.Co, x_nhwc.device, "x_nhwc", contiguous=True)
    g = geometry
    check_epilogue(g.Co, g.output_shape_nhwc, output_dtype(x_nhwc.dtype, out_dtype), x_nhwc.device, scale,
                   residual, activation, activations)
    if residual is not None and not residual.is_contiguous():
        raise ValueError(f"residual must be a contiguous NHWC tensor, got strides {residual.stride()}")
    check_on_cuda(x_nhwc)
    return geometry



def check_on_cuda(x_nhwc):
    """A kernel's input must be on a CUDA device; say how to get it there."""
    if x_nhwc.device.type != "cuda":
        raise ValueError(f"x_nhwc is on {x_nhwc.device}; this kernel runs on a CUDA GPU, "
                         f"move the tensors with .cuda()")


