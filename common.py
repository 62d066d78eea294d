"""Shared machinery for the convolution tutorial series.

Every lesson imports this module plainly (``import common``). It holds what more than one lesson
needs, so no lesson copies a helper from another.

Naming key, used everywhere in the series
-----------------------------------------
- Activations are NHWC: ``[N, H, W, Ci]`` (batch, height, width, input channels).
- Weights are ``[Co, R, S, Ci]``: output channels, filter height R, filter width S, input channels.
- The output is NHWC ``[N, out_h, out_w, Co]``.
- stride, padding and dilation are ``(h, w)`` pairs; an int means the same value for both.
- The GEMM view of a convolution: ``M = N * out_h * out_w`` rows (one per output pixel),
  ``N_GEMM = Co`` columns, and a reduction of ``K = R * S * Ci``, ordered (r, s, ci) with ci fastest.
- FLOPs of one convolution: ``2 * N * out_h * out_w * Co * Ci * R * S``.

What is in here
---------------
- Environment: CUDA present, exact GPU generation (Hopper = sm_90, Blackwell = sm_100/sm_103),
  interpreter mode. Importing this module on a machine without a CUDA GPU turns on the Triton
  interpreter (``TRITON_INTERPRET=1``) before Triton is imported, so plain Triton kernels run on the CPU.
- Convolution geometry and input validation with clear errors.
- A reference convolution for NHWC tensors (``torch.nn.functional.conv2d`` in fp32).
- A TFLOPS benchmark helper on ``triton.testing.do_bench`` and a cuDNN baseline.
- A plot helper (matplotlib, Agg backend, one output folder).
- An ahead-of-time compiler: builds a Gluon or Triton kernel for sm_90 or sm_100 on a machine with
  no GPU and returns its PTX, so CPU tests can check the instructions a GPU lesson relies on.
- A loader for the numbered lesson files (their names start with digits and hold dashes).
- (Lessons 03-05) the TMA im2col descriptor settings of a convolution and the MMA abstraction.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple, Union

import torch

REPO_ROOT = Path(__file__).resolve().parent

# %% Environment ---------------------------------------------------------------------------------
# The lessons' process set-up, done here because it must come before Triton is imported:
# - without a CUDA GPU, plain Triton kernels run in Triton's interpreter (`triton.jit` reads
#   TRITON_INTERPRET when a kernel is decorated); the ahead-of-time compiler's child process sets
#   CONV_TUTORIAL_AOT=1 to keep real, compilable kernels although it has no GPU;
# - floating-point fusion (a * b + c as one FMA) on, as the series was measured: Triton 3.9 warns
#   when a program leaves it to its default, which 3.10 turns off.
# The package conv_tutorial loads this module with PROCESS_SETUP = False set beforehand: a program
# that imports the operator keeps its environment as it was (the package asks for fusion in its
# own launches).
PROCESS_SETUP = globals().get("PROCESS_SETUP", True)
HAS_CUDA = torch.cuda.is_available()
if PROCESS_SETUP:
    if not HAS_CUDA and os.environ.get("CONV_TUTORIAL_AOT") != "1":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402  (must come after the interpreter decision above)

TRITON_SERIES = (3, 9)     # the Triton minor release the series is written for (requirements.txt)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


TRITON_VERSION = _version_tuple(triton.__version__)
if TRITON_VERSION[:2] != TRITON_SERIES:
    _wanted = f"{TRITON_SERIES[0]}.{TRITON_SERIES[1]}"
    _why = (f"this series is written for Triton {_wanted}: Gluon, the language of lessons 04-05, is "
            f"experimental and its API moves between releases (3.9 changed its cluster barriers), and "
            f"TMA im2col needs 3.8 or newer; Triton {triton.__version__} is installed.")
    if TRITON_VERSION[:2] < TRITON_SERIES:
        raise ImportError(f"{_why} Run the README's commands, which install Triton {_wanted}, or "
                          f"`pip install 'triton>={_wanted},<{TRITON_SERIES[0]}.{TRITON_SERIES[1] + 1}'`.")
    warnings.warn(f"{_why} Lessons 01-03 should run; Gluon code may not compile.", stacklevel=2)


def quiet_teardown():
    """Triton 3.9's compiler library reports "nanobind: leaked N instances" on stderr as the
    interpreter shuts down, after every program that compiled a kernel: a known report of its own
    bindings (Triton silences it the same way in its compile workers). A lesson run (lesson_args)
    and the test run ask for this: at exit, once everything the program printed (and any
    traceback) is out, stderr goes to /dev/null. CONV_TUTORIAL_SHOW_TEARDOWN=1 keeps it."""
    if os.environ.get("CONV_TUTORIAL_SHOW_TEARDOWN") == "1":
        return

    def silence():
        sys.stderr.flush()
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 2)
        os.close(quiet)
    import atexit
    atexit.register(silence)


def interpreter_mode() -> bool:
    """True when plain Triton kernels run on the CPU through the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device() -> str:
    """Where lessons put their tensors: "cuda" on a GPU machine, "cpu" under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


def capability() -> tuple[int, int] | None:
    """The CUDA compute capability of the current GPU, or None without one."""
    return torch.cuda.get_device_capability() if HAS_CUDA else None


def is_hopper() -> bool:
    """Exactly sm_90 (H100, H200): WGMMA and TMA. Not a `>= 9` test: sm_120 is not Hopper."""
    return capability() == (9, 0)


def is_blackwell() -> bool:
    """Data-centre Blackwell (sm_100, sm_103): tcgen05 and tensor memory. Consumer sm_120 has neither."""
    cap = capability()
    return cap is not None and cap[0] == 10


def is_tma_mma_capability(cap) -> bool:
    """Does a GPU of compute capability `cap` run the Gluon lessons: Hopper (9, 0) or
    data-centre Blackwell (10, x)?"""
    return cap is not None and (tuple(cap) == (9, 0) or cap[0] == 10)


def has_tma_mma_gpu() -> bool:
    """A GPU the Gluon lessons (03-05) run on: Hopper or data-centre Blackwell."""
    return is_tma_mma_capability(capability())


def gpu_name() -> str:
    return torch.cuda.get_device_name() if HAS_CUDA else "no GPU"


GLUON_SKIP_REASON = (
    "needs an NVIDIA Hopper (sm_90) or data-centre Blackwell (sm_100) GPU; this machine has "
    + ("a GPU of capability %s" % (capability(),) if HAS_CUDA else "no CUDA GPU"))


def require_tma_mma_gpu(what: str) -> tuple[int, int]:
    """Raise a clear error unless a Hopper or Blackwell GPU is present; return its capability."""
    cap = capability()
    if cap is None:
        raise RuntimeError(f"{what} needs an NVIDIA GPU of capability 9.0 (Hopper) or 10.x "
                           f"(Blackwell); no CUDA GPU is present")
    if not has_tma_mma_gpu():
        raise RuntimeError(f"{what} needs an NVIDIA GPU of capability 9.0 (Hopper) or 10.x "
                           f"(data-centre Blackwell); this GPU ({gpu_name()}) has capability "
                           f"{cap[0]}.{cap[1]}")
    return cap


def versions() -> dict:
    """Versions and device for data files and plot titles."""
    info = {"device": gpu_name(), "torch": torch.__version__, "triton": triton.__version__}
    if HAS_CUDA:
        info["capability"] = "%d.%d" % capability()
        info["cudnn"] = torch.backends.cudnn.version()
        info["cuda"] = torch.version.cuda
    return info


def cudnn_version_text(version) -> str:
    """cuDNN's version for titles and labels: torch.backends.cudnn.version()'s int (91900, as the
    data files record it) as "9.19.0"; anything else (None, a string) as it is."""
    if isinstance(version, int) and not isinstance(version, bool) and version > 0:
        major = version // 10000 if version >= 10000 else version // 1000   # cuDNN 9: 9*10000 + minor*100 + patch
        return f"{major}.{version // 100 % (100 if version >= 10000 else 10)}.{version % 100}"   # cuDNN 8: 8*1000 + ...
    return str(version)


# %% Convolution geometry and validation ---------------------------------------------------------


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
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (geometry.Co,):
            raise ValueError(f"bias must have shape [Co]=({geometry.Co},), got {tuple(bias.shape)}")
        if bias.device != x_nhwc.device:
            raise ValueError(f"bias is on {bias.device} but x_nhwc is on {x_nhwc.device}")
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
    if need_cuda:
        check_on_cuda(x_nhwc)
    return geometry


def check_conv_call(x_nhwc, w, bias, stride, padding, dilation, *, dtypes, scale=None, residual=None,
                    activation="none", out_dtype=None, groups=1) -> ConvGeometry:
    """Validate a call of a conv with the fused epilogue (lesson 05: its launcher, the runtime):
    tensors, hyper-parameters and epilogue, the device last so every other mistake is reported on
    a machine without a GPU too. `out_dtype`: None (x's dtype), or for e4m3 operands bf16 or e4m3.
    Returns the geometry."""
    geometry = check_conv_inputs(x_nhwc, w, stride, padding, dilation, dtypes=dtypes, bias=bias, groups=groups)
    if bias is not None and not bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    g = geometry
    check_epilogue(g.Co, g.output_shape_nhwc, output_dtype(x_nhwc.dtype, out_dtype), x_nhwc.device, scale,
                   residual, activation)
    if residual is not None and not residual.is_contiguous():
        raise ValueError(f"residual must be a contiguous NHWC tensor, got strides {residual.stride()}")
    check_on_cuda(x_nhwc)
    return geometry


def tma_mma_arch_and_sms(what: str) -> tuple[str, int]:
    """("sm_90" or "sm_100", SM count) of the current GPU, or a clear error naming `what`."""
    capability = require_tma_mma_gpu(what)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return ("sm_90" if capability == (9, 0) else "sm_100"), props.multi_processor_count


def check_on_cuda(x_nhwc):
    """A kernel's input must be on a CUDA device; say how to get it there."""
    if x_nhwc.device.type != "cuda":
        raise ValueError(f"x_nhwc is on {x_nhwc.device}; this kernel runs on a CUDA GPU, "
                         f"move the tensors with .cuda()")


# %% The fused epilogue: act(conv * scale + bias + residual), per output channel ----------------------

ACTIVATIONS = ("none", "relu", "silu")     # what the fused epilogue applies last: nothing, ReLU, SiLU
# lesson 06's dgrad: ReLU's backward, the tile kept where the residual operand (the ReLU's output, which is the
# conv's input) is positive, else 0; the residual is not added
RELU_GRAD = "relu_grad"


def check_epilogue(Co, out_shape, dtype, device, scale=None, residual=None, activation="none"):
    """Validate the fused epilogue's arguments of a conv with Co output channels whose output has
    `out_shape`, `dtype` and `device` (the bias is checked with the conv's tensors)."""
    if activation not in ACTIVATIONS + (RELU_GRAD,):
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
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


# %% e4m3 operands (lesson 05, section 9): the output dtype they give ------------------------------

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
    if activation == RELU_GRAD:     # (lesson 06: the residual gates, it is not added)
        return torch.where(residual > 0, out, torch.zeros((), dtype=out.dtype, device=out.device))
    if residual is not None:
        out = out + residual.to(conv_out.dtype)
    if activation == "relu":
        return torch.relu(out)
    return torch.nn.functional.silu(out) if activation == "silu" else out


# %% Reference convolution ------------------------------------------------------------------------


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


def random_conv_inputs(N, H, W, Ci, Co, R, S, dtype=torch.float16, device_name=None, seed=0):
    """Random NHWC input and [Co, R, S, Ci] weight, scaled so outputs stay near unit size."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(N, H, W, Ci, generator=generator)
    w = torch.randn(Co, R, S, Ci, generator=generator) / math.sqrt(R * S * Ci)
    target = device_name or device()
    return x.to(target, dtype), w.to(target, dtype)


def assert_close_to_reference(out, expected, *, dtype, K):
    """Compare a kernel's NHWC output with the fp32 reference, with a tolerance that says why.

    fp32 inputs on the CPU interpreter are exact up to summation order: 1e-4. fp16 keeps 11 bits of
    mantissa: each product is exact in the fp32 accumulator, and the final rounding to fp16 costs
    half an ulp (~5e-4 relative), so 2e-3 leaves room. bf16 keeps 8 bits (~4e-3 relative per
    rounding): 2e-2. The absolute part scales with sqrt(K), the growth of a random sum."""
    rtol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    atol = rtol * max(1.0, math.sqrt(K) / 8)
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


def check_conv(entry, N, H, W, Ci, Co, R, S, stride=1, padding=0, dilation=1, dtype=torch.float16,
               with_bias=False, seed=0, scale=False, residual=False, activation="none", groups=1, **kwargs):
    """Run a lesson's conv entry point on random inputs and compare it with the fp32 reference.

    `entry(x_nhwc, w, stride=, padding=, dilation=[, bias=][, scale=, residual=, activation=]
    [, groups=], **kwargs)` returns NHWC. `with_bias`, `scale` and `residual` ask for random epilogue
    operands (scale in [0.5, 1.5)), checked against reference_epilogue. Returns the output."""
    x_nhwc, w = random_conv_inputs(N, H, W, Ci, Co, R, S, dtype, seed=seed)
    if groups > 1:        # [Co, R, S, Ci / groups], at the scale of a filter that deep
        w = (w[..., :Ci // groups].float() * math.sqrt(groups)).to(dtype).contiguous()
        kwargs["groups"] = groups
    geometry = conv_geometry(x_nhwc.shape, w.shape, stride, padding, dilation, groups)
    generator = torch.Generator().manual_seed(seed + 1)
    operands = {"bias": torch.randn(Co, generator=generator) if with_bias else None,
                "scale": torch.rand(Co, generator=generator) + 0.5 if scale else None,
                "residual": torch.randn(geometry.N, geometry.out_h, geometry.out_w, Co,
                                        generator=generator).to(dtype) if residual else None}
    operands = {name: t.to(x_nhwc.device) for name, t in operands.items() if t is not None}
    if activation != "none":
        kwargs["activation"] = activation
    out = entry(x_nhwc, w, stride=stride, padding=padding, dilation=dilation, **operands, **kwargs)
    expected = reference_conv2d_nhwc(x_nhwc, w, None, stride, padding, dilation, out_dtype=torch.float32,
                                     groups=groups)
    expected = reference_epilogue(expected, operands.get("bias"), operands.get("scale"),
                                  operands.get("residual"), activation).to(dtype)
    if out.shape != expected.shape or out.dtype != dtype:
        raise AssertionError(f"got {tuple(out.shape)} {out.dtype}, expected {tuple(expected.shape)} {dtype}")
    assert_close_to_reference(out, expected, dtype=dtype, K=geometry.K)
    return out


class PlainInt(int):
    """An int whose arithmetic stays a PlainInt and which ignores `.to(dtype)`: a Gluon kernel's
    index arithmetic, casts included, run as plain Python (`SomeAggregate.method.fn(...)`) by the
    tests that check it against a model (lesson 05)."""
    def to(self, dtype):
        return self


for _name in ("__add__", "__radd__", "__sub__", "__mul__", "__rmul__", "__floordiv__", "__mod__"):
    setattr(PlainInt, _name, lambda self, other, _op=getattr(int, _name): PlainInt(_op(self, other)))


# %% Benchmarks -------------------------------------------------------------------------------------


def bench_tflops(fn, flops: int, warmup_ms: int = 25, rep_ms: int = 100, cuda_graph=False) -> dict:
    """Median TFLOPS of `fn` (with 20th/80th percentiles) from triton.testing.do_bench.

    do_bench times with CUDA events, clears the L2 cache before every call (so each run reads its
    operands from HBM) and includes the launch overhead of whatever `fn` launches: the end-to-end
    number a user sees. With cuda_graph=True, do_bench_cudagraph replays `fn` captured in a CUDA
    graph instead: host overhead disappears and the kernels' own speed remains (L2 not flushed)."""
    if cuda_graph:
        ms_median, ms_p20, ms_p80 = triton.testing.do_bench_cudagraph(fn, rep=rep_ms,
                                                                      quantiles=[0.5, 0.2, 0.8])
    else:
        ms_median, ms_p20, ms_p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                                            quantiles=[0.5, 0.2, 0.8])
    to_tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    return {"ms": ms_median, "tflops": to_tflops(ms_median),
            # a shorter time is a higher rate: the 20th percentile of time is the 80th of TFLOPS
            "tflops_p80": to_tflops(ms_p20), "tflops_p20": to_tflops(ms_p80)}


def cudnn_conv2d(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1):
    """Return a closure running cuDNN on the same data, in channels_last memory format.

    An NHWC tensor permuted to NCHW *is* a channels_last tensor: no copy is made, and cuDNN sees
    exactly the bytes our kernels read."""
    x_nchw = x_nhwc.permute(0, 3, 1, 2)
    w_kcrs = w.permute(0, 3, 1, 2)
    if not x_nchw.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"x_nhwc must be a contiguous NHWC tensor, got strides {x_nhwc.stride()}")
    stride, padding, dilation = (pair(stride, "stride", 1), pair(padding, "padding", 0),
                                 pair(dilation, "dilation", 1))
    return lambda: torch.nn.functional.conv2d(x_nchw, w_kcrs, bias, stride, padding, dilation)


def bad_conv_inputs(mismatched_dtype):
    """Bad-input cases every conv entry point must refuse, as pytest parameters
    (make_args(x, w) -> (x, w), kwargs, error type, message pattern). `mismatched_dtype` is a
    supported dtype other than the test tensors'. Lessons add their own cases."""
    return [
        (lambda x, w: (x.float(), w.float()), {}, TypeError, "dtype"),
        (lambda x, w: (x, w.to(mismatched_dtype)), {}, TypeError, "mismatch"),
        (lambda x, w: (x[0], w), {}, ValueError, "rank 4"),
        (lambda x, w: (x, w[..., :4]), {}, ValueError, "channel mismatch"),
        (lambda x, w: (x, w), {"stride": 0}, ValueError, "stride"),
        (lambda x, w: (x[:, :2, :2], w), {}, ValueError, "empty output"),
        (lambda x, w: (x.transpose(1, 2), w), {}, ValueError, "contiguous NHWC"),
    ]


# Shapes used by the benchmarks of lessons 02 and 05: (label, N, H, W, Ci, Co, R, S, stride, padding)
HEADLINE_SHAPE = ("headline 64x64 384->384 3x3", 128, 64, 64, 384, 384, 3, 3, 1, 1)
RESNET50_3X3_SHAPES = [
    ("RN50 56x56 64->64 3x3", 128, 56, 56, 64, 64, 3, 3, 1, 1),
    ("RN50 28x28 128->128 3x3", 128, 28, 28, 128, 128, 3, 3, 1, 1),
    ("RN50 14x14 256->256 3x3", 128, 14, 14, 256, 256, 3, 3, 1, 1),
    ("RN50 7x7 512->512 3x3", 128, 7, 7, 512, 512, 3, 3, 1, 1),
]


# %% Plots and output folder --------------------------------------------------------------------------


def output_dir(path=None, announce=True) -> Path:
    """The one folder where the series writes plots and data: --outdir, $CONV_TUTORIAL_OUT or the
    repository's out/. Inside the current folder, or with both inside the repository, it is
    returned (and printed) relative to the current folder, so that the lines naming it and its
    plots show no machine's absolute path (the site's pages print what a run prints)."""
    folder = Path(path or os.environ.get("CONV_TUTORIAL_OUT") or REPO_ROOT / "out").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    here = Path.cwd().resolve()
    if folder.is_relative_to(here) or (folder.is_relative_to(REPO_ROOT) and here.is_relative_to(REPO_ROOT)):
        try:
            folder = Path(os.path.relpath(folder, here))
        except ValueError:            # another drive (Windows): keep it absolute
            pass
    if announce:
        print(f"[output] plots and data go to {folder}")
    return folder


def new_figure(*args, **kwargs):
    """A matplotlib figure drawn with the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)


def save_figure(fig, outdir, name: str, data=None) -> Path:
    """Save `fig` as outdir/name.png (and `data` as name.json beside it); print and return the path."""
    import matplotlib.pyplot as plt
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    if os.environ.get("CONV_TUTORIAL_KEEP_FIGURES") != "1":   # the site's builder collects open figures
        plt.close(fig)
    if data is not None:
        save_json(outdir, name, data)
    print(f"[plot] {path}")
    return path


def save_json(outdir, name: str, data) -> Path:
    """Write `data` as outdir/name.json (what recorded_results reads back from results/)."""
    path = Path(outdir) / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def lesson_args(description: str, argv=None):
    """The small command line every lesson shares: --bench, --outdir, --quick, --verbose."""
    import argparse
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bench", action="store_true", help="run the GPU benchmark (needs a GPU)")
    parser.add_argument("--outdir", default=None, help="folder for plots and data (default ./out)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, for a fast look")
    parser.add_argument("--verbose", action="store_true",
                        help="print everything (e.g. lesson 03's pixel-by-pixel listings)")
    quiet_teardown()
    return parser.parse_args(argv)


# %% Loading lessons -------------------------------------------------------------------------------


_LESSONS = {}   # stem -> module


def load_lesson(stem: str):
    """Import a numbered lesson (e.g. "02-im2col-explicit") as a module, once per process.

    Lesson files start with digits and hold dashes, so `import` cannot name them. Importing a lesson
    has no side effects beyond defining its kernels and functions."""
    if stem in _LESSONS:
        return _LESSONS[stem]
    path = REPO_ROOT / f"{stem}.py"
    if not path.exists():
        raise FileNotFoundError(f"no lesson file {path}")
    # Already imported (as __main__, or by pytest under its own name)? Use that module: a second
    # copy would have kernels of its own. (Comparing paths over sys.modules takes ~40 ms.)
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) and Path(module.__file__).resolve() == path:
            _LESSONS[stem] = module
            return module
    module_name = "lesson_" + stem.replace("-", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    _LESSONS[stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:          # a lesson that failed to import is not kept half-made
        del _LESSONS[stem], sys.modules[module_name]
        raise
    return module


# %% Ahead-of-time compilation for a GPU target on a machine without one --------------------------

# The GPU targets of lessons 03-05, by the name Triton and the PTX use: their compute capability.
ARCH_CAPABILITY = {"sm_90": (9, 0), "sm_100": (10, 0)}


def compile_kernel_for_target(kernel, args, kwargs, arch: str):
    """Compile `kernel` (Gluon or Triton) for `arch` ("sm_90" or "sm_100") without a GPU.

    `args`/`kwargs` are what a launch would get (CPU tensors and host TensorDescriptor objects are
    fine; launch options like num_warps go in kwargs). Returns the CompiledKernel, whose
    `.asm["ptx"]` holds the PTX and `.metadata.shared` the shared memory a launch needs.
    These are Triton-internal APIs: keep every use behind this one function."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    if arch not in ARCH_CAPABILITY:
        raise ValueError(f"arch must be one of {sorted(ARCH_CAPABILITY)}, got {arch!r}")
    major, minor = ARCH_CAPABILITY[arch]
    target = GPUTarget("cuda", 10 * major + minor, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args,
                                                              specialization, options)
    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
        is_gluon = isinstance(kernel, GluonJITFunction)
    except ImportError:  # pragma: no cover - Triton without Gluon
        is_gluon = False
    source_cls = GluonASTSource if is_gluon else ASTSource
    return triton.compile(source_cls(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _aot_child(stem: str, builder: str, arch: str, params_json: str) -> None:
    """Runs in the subprocess: build the kernel's launch arguments and print PTX + metadata as JSON."""
    module = load_lesson(stem) if stem != "common" else sys.modules[__name__]
    kernel, args, kwargs = getattr(module, builder)(arch=arch, **json.loads(params_json))
    compiled = compile_kernel_for_target(kernel, args, kwargs, arch)
    meta = compiled.metadata
    print("AOT-JSON:" + json.dumps({"ptx": compiled.asm["ptx"], "shared": meta.shared,
                                    "tmem_size": getattr(meta, "tmem_size", 0),
                                    "num_warps": meta.num_warps,
                                    **cubin_resources(compiled.asm.get("cubin"))}))


def cubin_resources(cubin: bytes) -> dict:
    """{"registers": per thread, "stack": bytes of stack frame per thread} of a compiled kernel,
    read from its cubin with cuobjdump (shipped with Triton); None each where no cuobjdump is at
    hand. A stack frame in a Triton kernel is where registers spill to."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if not cubin or not tool:
        return {"registers": None, "stack": None}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([tool, "-res-usage", file.name], capture_output=True, text=True).stdout
    found = {name: re.search(rf"{key}:(\d+)", usage) for name, key in (("registers", "REG"), ("stack", "STACK"))}
    return {name: int(match.group(1)) if match else None for name, match in found.items()}


class AotToolMissing(RuntimeError):
    """The installed Triton lacks the assembler for a target, so it cannot be compiled here."""


SHOW_PROGRESS = None     # text -> None, where a test run shows what a slow step is doing (conftest.py)


@functools.lru_cache(maxsize=None)
def _aot_cached(stem, builder, arch, params_json):
    env = dict(os.environ, CONV_TUTORIAL_AOT="1", TRITON_INTERPRET="0",
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    code = (f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); import common; "
            f"common._aot_child({stem!r}, {builder!r}, {arch!r}, {params_json!r})")
    if SHOW_PROGRESS is not None:      # a build takes seconds to a minute: say so (conftest.py sets it)
        SHOW_PROGRESS(f" [compiling {stem} for {arch}]")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("AOT-JSON:"):
            return json.loads(line[len("AOT-JSON:"):])
    if "Cannot find ptxas" in proc.stderr:
        raise AotToolMissing(f"this Triton install has no assembler for {arch} (ptxas"
                             f"{'-blackwell' if arch == 'sm_100' else ''} is missing from "
                             f"triton/backends/nvidia/bin), so {arch} builds cannot be checked here; "
                             f"a complete `pip install triton` has it")
    raise RuntimeError(f"ahead-of-time compile of {stem}.{builder} for {arch} failed "
                       f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def aot_compile(stem: str, builder: str, arch: str, **params) -> dict:
    """Compile a lesson's kernel for `arch` in a fresh subprocess; return {"ptx", "shared", ...}.

    `builder` names a function of the lesson, `builder(arch=..., **params)`, that returns
    `(kernel, args, kwargs)` built from CPU tensors. A subprocess, because a kernel built for the wrong
    architecture aborts the whole Python process (an LLVM error, not an exception). Results are
    cached per process."""
    return _aot_cached(stem, builder, arch, json.dumps(params, sort_keys=True))


def aot_compile_or_say_why(stem: str, builder: str, arch: str, **params):
    """aot_compile for a lesson's demo: None (and one printed line) where Triton cannot target `arch`."""
    try:
        return aot_compile(stem, builder, arch, **params)
    except AotToolMissing as missing:
        print(f"\n[skip] {arch} PTX: {missing}")
        return None


def aot_compile_or_skip(stem: str, builder: str, arch: str, **params) -> dict:
    """aot_compile for tests: skip (with the reason) where the Triton install cannot target `arch`."""
    import pytest
    try:
        return aot_compile(stem, builder, arch, **params)
    except AotToolMissing as missing:
        pytest.skip(str(missing))


# The TMA instructions lessons 04 and 05 teach, as their PTX lines begin
PTX_IM2COL_LOAD = "cp.async.bulk.tensor.4d.shared::cta.global.im2col"
PTX_TILED_LOAD = "cp.async.bulk.tensor.2d.shared::cta.global"
PTX_TMA_STORE = "cp.async.bulk.tensor.2d.global.shared::cta"


def ptx_instructions(ptx: str, prefixes) -> dict:
    """Count the PTX lines that start with each prefix (e.g. "wgmma.mma_async")."""
    counts = {prefix: 0 for prefix in prefixes}
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith("@"):  # predicated instruction: "@%p1 cp.async..."
            stripped = stripped.split(None, 1)[-1] if " " in stripped else stripped
        for prefix in prefixes:
            if stripped.startswith(prefix):
                counts[prefix] += 1
    return counts


def show_ptx(stem: str, builder: str, taught: dict, heading, **params) -> dict:
    """A lesson demo's PTX report, for readers without a GPU: what the compiler made of the kernel.

    `taught` is {arch: [(instruction prefix, why it is there and why that many), ...]}. For each
    arch, compile `builder`'s kernel (ahead of time), print `heading(arch, compiled)`, its
    resources (shared memory, registers per thread, tensor memory), then per taught instruction
    its count in the program text, one whole instruction as the PTX has it, and the explanation.
    Archs this Triton cannot target get one line saying why. `params` go to the builder. Returns
    {arch: counts}."""
    import textwrap
    report = {}
    for arch, rows in taught.items():
        compiled = aot_compile_or_say_why(stem, builder, arch, **params)
        if compiled is None:
            continue
        counts = report[arch] = ptx_instructions(compiled["ptx"], [prefix for prefix, _ in rows])
        print(f"\n{arch}: {heading(arch, compiled)}")
        resources = [f"{compiled['shared']} bytes of shared memory"]
        if compiled.get("registers"):
            resources.append(f"{compiled['registers']} registers per thread")
        if arch == "sm_100":
            resources.append(f"{compiled.get('tmem_size', 0)} columns of tensor memory")
        print("   resources: " + ", ".join(resources))
        for prefix, why in rows:
            example = first_ptx_instruction(compiled["ptx"], prefix)
            print(f"   {counts[prefix]} x {prefix}")
            print(f"      {example}")          # one whole instruction, as the PTX has it
            for chunk in textwrap.wrap(why, 92):
                print(f"      | {chunk}")
    return report


def assert_ptx_teaches(stem: str, builder: str, arch: str, taught: dict, **params) -> dict:
    """A lesson's test that its kernel's `arch` build (`params` to the builder) holds every
    instruction its table `taught` explains (skipped where this Triton cannot target `arch`);
    returns the compiled build."""
    compiled = aot_compile_or_skip(stem, builder, arch, **params)
    counts = ptx_instructions(compiled["ptx"], [prefix for prefix, _ in taught[arch]])
    missing = [prefix for prefix, count in counts.items() if count == 0]
    assert not missing, f"{arch}: PTX lacks {missing}"
    return compiled


def first_ptx_instruction(ptx: str, prefix: str) -> str:
    """The first instruction that contains `prefix`, whole: PTX may spread one instruction over
    several lines (a wgmma's register list), and it ends at the semicolon."""
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        if prefix in line and not line.strip().startswith("//"):
            parts = [line.strip()]
            while not parts[-1].endswith(";") and i + len(parts) < len(lines):
                parts.append(lines[i + len(parts)].strip())
            return " ".join(parts)
    return "(none)"


def cpu_closing_line(lesson: str, checked: str, needs_gpu: str, gpu: str = "a Hopper or Blackwell GPU") -> str:
    """The last line of a lesson run without a suitable GPU: what was checked, what was not."""
    return (f"lesson {lesson}, on this machine ({gpu_name()}): checked {checked}; "
            f"needs {gpu}: {needs_gpu}")


# %% Recorded GPU results ---------------------------------------------------------------------------
# Readers without a GPU (and the series' web pages) see what a GPU run printed and drew, from the
# JSON files that the benchmarks write and the repository keeps under results/<device>-<date>/.

RESULTS_DIR = REPO_ROOT / "results"


def recorded_results(name: str):
    """The newest recorded `name`.json under results/ as (data, info), or None.

    info has "device", "torch", "triton", "cudnn" (from the file, where recorded), "date" and
    "folder" (from the folder name, <device>-<YYYY-MM-DD>), and "label": one line for titles."""
    def date(path):      # the folder's <YYYY-MM-DD>, wherever it stands ("h100-2026-11-24-package")
        found = re.search(r"\d{4}-\d{2}-\d{2}", path.parent.name)
        return found.group(0) if found else ""
    found = sorted(RESULTS_DIR.glob(f"*-*/{name}.json"), key=lambda path: (date(path), path.parent.name))
    if not found:
        return None
    path = found[-1]
    data = json.loads(path.read_text())
    info = {key: data.get(key) for key in ("device", "torch", "triton", "cudnn")}
    info.update(date=date(path), folder=str(path.parent.relative_to(REPO_ROOT)))
    info["label"] = (f"recorded {info['date']} on {info['device']}, torch {info['torch']}, "
                     f"Triton {info['triton']}, cuDNN {cudnn_version_text(info['cudnn'])} ({info['folder']})")
    return data, info


def announce_recorded(name: str, what: str):
    """For a lesson run where a step needs a GPU: recorded_results(name), announced with one line
    that says what it is, that it was not measured here, and where and when it was; None (and one
    line saying so) when the repository holds no such record."""
    recorded = recorded_results(name)
    if recorded is None:
        print(f"[skip] {what}: needs a GPU, and no recorded results are under results/")
        return None
    print(f"\n{what} as measured on a GPU (RECORDED, not measured here; {recorded[1]['label']}):")
    return recorded

# %% The ladder's plot (lesson 05 draws the recorded one; benchmarks/network_suite.py a measured one) --
# What each lesson's kernel and cuDNN ran per benchmark shape, beside the GPU's peaks.

# datasheet peaks: dense bf16 TFLOPS and HBM TB/s (SXM parts)
DEVICE_PEAKS = {"H100": (989.4, 3.35), "H200": (989.4, 4.8), "B200": (2250.0, 8.0)}


def device_peaks(device_name):
    return next((peaks for name, peaks in DEVICE_PEAKS.items() if name in device_name), None)


LADDER_SERIES = ["02 implicit GEMM", "04 single-buffer", "05 warp-specialized", "cuDNN"]


# The dense bf16 peak the H100 can hold at its 700 W board limit on a compute-bound conv: the SM
# clock falls to ~1440 MHz there (benchmarks/clocks_under_load.py), so 132 SMs x 4096 FLOP/cycle x
# 1.44 GHz. Measured on an H100 SXM; other boards differ.
POWER_LIMITED_PEAK_TFLOPS = {"H100": 779.0}


def dense_peak(device_name):
    return (device_peaks(device_name) or (None,))[0]


def draw_peaks(ax, device_name, horizontal=True):
    """The data sheet's dense bf16 peak and, where measured, the peak at the board's power limit."""
    for peak, style, label in ((dense_peak(device_name), "--", "dense bf16 peak, data sheet"),
                               (next((v for k, v in POWER_LIMITED_PEAK_TFLOPS.items() if k in device_name), None),
                                ":", "peak at the 700 W limit (~1440 MHz, measured)")):
        if peak:
            ax.axhline(peak, color="red", ls=style, lw=1, label=f"{label}: {peak:.0f}")


def plot_ladder(rows, info, dtype, outdir, data, recorded=None):
    """The per-shape bars and the ladder of the headline shape. `recorded` (the info of
    recorded_results) marks plots drawn from a recorded run: titled so, saved as *_recorded."""
    colors = ["#999999", "#d08040", "#2060c0", "#40a040"]
    mark = f"RECORDED {recorded['date']} (not measured on this machine): " if recorded else ""
    suffix = "_recorded" if recorded else ""
    dtype = str(dtype).replace("torch.", "")
    fig, ax = new_figure(figsize=(12, 5))
    width = 0.2
    for i, name in enumerate(LADDER_SERIES):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ax.bar(xs, [r[name]["tflops"] for r in rows], width, label=name, color=colors[i])
    draw_peaks(ax, info["device"])
    tallest = max([dense_peak(info["device"]) or 0] + [r[n]["tflops"] for r in rows for n in LADDER_SERIES])
    ax.set_ylim(0, 1.1 * tallest)
    ax.set_xticks(range(len(rows)), [r["shape"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_xlabel("layer: input size, Ci->Co, filter, stride (batch 128; SD UNet at batch 8)")
    ax.set_ylabel("TFLOPS (higher is better)")
    ax.set_title(f"{mark}Forward convolution throughput per layer: lessons 02, 04, 05 and cuDNN, {dtype}\n"
                 f"{info['device']}, Triton {info['triton']}, torch {info['torch']}, "
                 f"cuDNN {cudnn_version_text(info.get('cudnn'))}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)   # below: no line hidden
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, outdir, "05_tflops_per_shape" + suffix, data)

    headline = rows[0]
    fig, ax = new_figure(figsize=(7, 4.5))
    values = [headline[n]["tflops"] for n in LADDER_SERIES]
    bars = ax.bar(["lesson 02\nimplicit GEMM", "lesson 04\nTMA + MMA", "lesson 05\nwarp-specialized",
                   "cuDNN"], values, color=colors)
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom")
    draw_peaks(ax, info["device"])
    ax.set_ylim(0, 1.25 * max([dense_peak(info["device"]) or 0] + values))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax.set_ylabel("TFLOPS (higher is better)")
    ax.set_title(f"{mark + chr(10) if mark else ''}Each lesson's kernel and cuDNN on the headline layer, {dtype}\n"
                 f"{headline['geometry']}\n{info['device']}, Triton {info['triton']}, torch {info['torch']}, "
                 f"cuDNN {cudnn_version_text(info.get('cudnn'))}", fontsize=9)
    save_figure(fig, outdir, "05_ladder" + suffix)


def show_recorded_ladder(outdir, describe_config=str):
    """The ladder as a GPU recorded it (benchmarks/network_suite.py --ladder), printed and drawn,
    marked RECORDED with its device and date; None where no record exists.
    `describe_config` turns a row's recorded lesson-05 config (a list of its fields) into text."""
    recorded = announce_recorded("05_tflops_per_shape", "The ladder (TFLOPS, bf16)")
    if recorded is None:
        return None
    data, info = recorded
    print(f"  {'shape':<30}{'02':>7}{'04':>7}{'05':>7}{'cuDNN':>7}  05/cuDNN  05 config")
    for row in data["rows"]:
        print(f"  {row['shape']:<30}" + "".join(f"{row[n]['tflops']:7.1f}" for n in LADDER_SERIES)
              + f"  {row['ratio_05_cudnn']:7.2f}x  {describe_config(row['config_05'])}")
    print(f"  geometric mean of 05/cuDNN over the 3x3 shapes: {data['geomean_3x3_ratio']:.3f}x")
    plot_ladder(data["rows"], info, data["dtype"], outdir, None, recorded=info)
    return data


# %% TMA im2col: descriptor limits and the settings of a convolution (lessons 03-05) ---------------

# Limits of an NHWC (rank-4) im2col tensor map, as cuTensorMapEncodeIm2col and Triton's host
# descriptor check them: corners are signed 8-bit for rank 4, traversal strides are 1..8, the box
# has at most 1024 pixels and 256 channels, and every row of the tensor must be 16-byte aligned.
IM2COL_CORNER_RANGE = (-128, 127)
IM2COL_MAX_ELEMENT_STRIDE = 8
IM2COL_MAX_PIXELS = 1024
IM2COL_MAX_CHANNELS = 256


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def validate_im2col_settings(shape, element_size, block_pixels, block_channels,
                             pixel_box_lower_corner, pixel_box_upper_corner, element_strides):
    """Raise a clear ValueError for settings the descriptor rejects (cuTensorMapEncodeIm2col, or Triton's host
    descriptor before it): what a kernel launch would fail on, checked before any kernel runs."""
    if len(shape) != 4:
        raise ValueError(f"the im2col tensor must be NHWC of rank 4, got shape {tuple(shape)} "
                         f"(rank {len(shape)})")
    channels = shape[-1]
    if channels * element_size % 16:
        raise ValueError(
            f"misaligned channel stride: each pixel holds Ci={channels} channels of {element_size} "
            f"bytes = {channels * element_size} bytes, but TMA needs a multiple of 16 bytes "
            f"(pad Ci to a multiple of {16 // math.gcd(16, element_size)})")
    if not _is_power_of_two(block_pixels) or block_pixels > IM2COL_MAX_PIXELS:
        raise ValueError(f"block_pixels must be a power of two <= {IM2COL_MAX_PIXELS}, got {block_pixels}")
    if not _is_power_of_two(block_channels) or block_channels > IM2COL_MAX_CHANNELS:
        raise ValueError(f"block_channels must be a power of two <= {IM2COL_MAX_CHANNELS}, "
                         f"got {block_channels}")
    if block_channels * element_size % 16:
        raise ValueError(f"block_channels * element size must be a multiple of 16 bytes, got "
                         f"{block_channels} x {element_size} bytes")
    for name, corner in (("pixel_box_lower_corner", pixel_box_lower_corner),
                         ("pixel_box_upper_corner", pixel_box_upper_corner)):
        if len(corner) != 2:
            raise ValueError(f"{name} must have 2 entries [h, w] for an NHWC tensor, got {list(corner)}")
        low, high = IM2COL_CORNER_RANGE
        if not all(low <= v <= high for v in corner):
            raise ValueError(f"{name} entries must lie in [{low}, {high}] for a rank-4 tensor, "
                             f"got {list(corner)}")
    if len(element_strides) != 4 or element_strides[-1] != 1 or not all(
            1 <= v <= IM2COL_MAX_ELEMENT_STRIDE for v in element_strides):
        raise ValueError(f"element_strides must be 4 values in [1, {IM2COL_MAX_ELEMENT_STRIDE}] "
                         f"with the last (channels) equal to 1, got {list(element_strides)}")


@dataclasses.dataclass(frozen=True)
class ConvIm2ColSettings:
    """How a convolution maps onto TMA im2col: one descriptor, a start coordinate per M-tile, and
    one offset pair per filter tap.

    - element_strides = [1, sh, sw, 1]: consecutive pixels of a tile are one conv stride apart.
    - pixel_box_lower_corner = [-ph, -pw]: the window starts in the padding.
    - pixel_box_upper_corner = [(out_h-1)*sh - ph - (H-1), ...]: the window's last row/column is
      the top-left tap of the last output pixel, so each image's window holds exactly out_h x out_w
      pixels and the walk moves on to the next image right after.
    - a tile starting at output row m0 = (n, oy, ox) starts at [n, oy*sh - ph, ox*sw - pw, c0];
    - tap (r, s) adds offsets [r*dh, s*dw]: the same window, shifted onto that tap's pixels."""
    geometry: ConvGeometry
    element_strides: tuple
    pixel_box_lower_corner: tuple
    pixel_box_upper_corner: tuple

    def start_coord(self, m0: int, c0: int = 0):
        g = self.geometry
        n, rest = divmod(m0, g.out_h * g.out_w)
        oy, ox = divmod(rest, g.out_w)
        return [n, oy * g.stride[0] - g.padding[0], ox * g.stride[1] - g.padding[1], c0]

    def tap_offsets(self, r: int, s: int):
        return [r * self.geometry.dilation[0], s * self.geometry.dilation[1]]


def conv_im2col_settings(geometry: ConvGeometry) -> ConvIm2ColSettings:
    """The TMA im2col descriptor settings of a convolution, checked against the descriptor limits."""
    g = geometry
    upper = tuple((o - 1) * st - p - (size - 1)
                  for o, st, p, size in ((g.out_h, g.stride[0], g.padding[0], g.H),
                                         (g.out_w, g.stride[1], g.padding[1], g.W)))
    lower = (-g.padding[0], -g.padding[1])
    low, high = IM2COL_CORNER_RANGE
    for name, corner in (("padding", lower), ("image and filter size", upper)):
        if not all(low <= v <= high for v in corner):
            raise ValueError(f"this convolution ({g.describe()}) needs pixel-box corners {list(corner)} "
                             f"(from its {name}), outside the [{low}, {high}] a rank-4 TMA im2col "
                             f"descriptor can encode")
    if max(g.stride) > IM2COL_MAX_ELEMENT_STRIDE:
        raise ValueError(f"stride {g.stride} exceeds the TMA im2col traversal stride limit of "
                         f"{IM2COL_MAX_ELEMENT_STRIDE}")
    max_offset = max(g.dilation[0] * (g.R - 1), g.dilation[1] * (g.S - 1))
    if max_offset > 2 ** 15 - 1:
        raise ValueError(f"filter taps reach offset {max_offset}; im2col offsets are 16-bit")
    return ConvIm2ColSettings(g, (1, g.stride[0], g.stride[1], 1), lower, upper)


def canonical_strides(t):
    """t itself, or, where a dimension of size 1 carries an odd stride, the same elements with a
    contiguous tensor's strides (a view: no copy). PyTorch lets a size-1 dimension hold any stride
    and still calls the tensor contiguous, so `.contiguous()` keeps it (an NCHW [N, C, 1, 1] tensor
    seen as NHWC has strides (C, 1, 1, 1)). A TMA descriptor checks every stride for 16-byte
    alignment, though a size-1 dimension's is never used; and torch 2.14's CPU conv2d returned
    garbage for an NHWC input of 1 channel seen as NCHW (strides (54, 1, 6, 1) for [1, 1, 9, 6])."""
    if not t.is_contiguous():
        return t
    strides = [1] * t.dim()
    for i in range(t.dim() - 2, -1, -1):
        strides[i] = strides[i + 1] * t.shape[i + 1]
    return t if list(t.stride()) == strides else t.as_strided(t.shape, strides)


def pad_channels_for_tma(x_nhwc, w):
    """Zero-pad Ci so each pixel's channels span a multiple of 16 bytes, as TMA requires.

    Returns (x_nhwc, w, Ci_padded). Zero channels add zero products, so the convolution is unchanged;
    the copy costs one pass over the input and happens only when Ci is misaligned (e.g. Ci=3).
    Aligned tensors come back as `canonical_strides`s of themselves (no copy)."""
    lanes = 16 // x_nhwc.element_size()
    Ci = x_nhwc.shape[-1]
    Ci_padded = -(-Ci // lanes) * lanes
    in_place = isinstance(w, FlippedFilter)     # (lesson 06: w's rows are x's channels; past them TMA reads zeros)
    if Ci_padded == Ci:
        return canonical_strides(x_nhwc), w if in_place else canonical_strides(w), Ci
    pad = (0, Ci_padded - Ci)
    return (torch.nn.functional.pad(x_nhwc, pad).contiguous(),
            w if in_place else torch.nn.functional.pad(w, pad).contiguous(), Ci_padded)


# %% Gluon building blocks of lessons 04-05: shared layouts, TMA descriptors, the ring counter ------------

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier  # noqa: E402

GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
             torch.float8_e4m3fn: gl.float8e4nv}


def conv_tma_layouts(dtype, BLOCK_M, BLOCK_N, BLOCK_K):
    """The shared-memory layouts of the A, B and output tiles (worth caching: ~10 us each to build)."""
    gl_dtype = GL_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl_dtype))


def conv_tma_descriptors(x_nhwc, w, out_2d, settings: ConvIm2ColSettings, BLOCK_M, BLOCK_N, BLOCK_K,
                         layouts=None, pixel_box=None):
    """The three TMA descriptors of a TMA-im2col convolution (lessons 04-05).

    - input: im2col descriptor on x [N, H, W, Ci], box [pixel_box (0 or None: BLOCK_M) pixels, BLOCK_K
      channels] (lesson 05's row tails load a tile's pixels in several shorter boxes);
    - weight: tiled descriptor on w viewed as [Co, R*S*Ci], box [BLOCK_N, BLOCK_K] (a `FlippedFilter`,
      lesson 06: on the forward filter's [Co_forward, R*S*Ci_forward], box [BLOCK_K, BLOCK_N]);
    - output: tiled descriptor on out_2d [M, Co_alloc], box [BLOCK_M, BLOCK_N] (TMA clips the edges).
    All shared-memory tiles use the default NVMMA swizzle for their shape, which both TMA and the
    tensor cores understand."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor, TensorDescriptorIm2Col
    Co = w.shape[0]     # (a FlippedFilter's: the conv's output channels)
    a_layout, b_layout, c_layout = layouts or conv_tma_layouts(x_nhwc.dtype, BLOCK_M, BLOCK_N, BLOCK_K)
    if out_2d.dtype != x_nhwc.dtype:      # fp8 operands, a bf16 output (lesson 05)
        c_layout = conv_tma_layouts(out_2d.dtype, BLOCK_M, BLOCK_N, BLOCK_K)[2]
    pixel_box = pixel_box or BLOCK_M
    if pixel_box != BLOCK_M:
        a_layout = conv_tma_layouts(x_nhwc.dtype, pixel_box, BLOCK_N, BLOCK_K)[0]
    in_desc = TensorDescriptorIm2Col.from_tensor(
        x_nhwc, [pixel_box, BLOCK_K], a_layout, padding="zero",
        element_strides=list(settings.element_strides),
        pixel_box_lower_corner=list(settings.pixel_box_lower_corner),
        pixel_box_upper_corner=list(settings.pixel_box_upper_corner))
    if isinstance(w, FlippedFilter):        # lesson 06: the forward filter read in place, an N-major B
        w_desc = w.descriptor(BLOCK_N, BLOCK_K)
    else:
        w_desc = TensorDescriptor.from_tensor(w.reshape(Co, -1), [BLOCK_N, BLOCK_K], b_layout)
    out_desc = TensorDescriptor.from_tensor(out_2d, [BLOCK_M, BLOCK_N], c_layout)
    return in_desc, w_desc, out_desc


# %% The ring counter (lesson 05) -----------------------------------------------------------------

@gluon.aggregate
class Counter:
    """How far one side of a ring of NUM_BUFFERS stages has gone: `count` steps, across all tiles.
    It gives the slot to use (count % NUM_BUFFERS) and the phase of that slot's barrier to wait for
    ((count // NUM_BUFFERS) & 1). `next()` returns the advanced counter (aggregates are values)."""
    count: Union[gl.tensor, gl.constexpr]
    NUM_BUFFERS: gl.constexpr

    @gluon.jit
    def slot(self):
        return self.count % self.NUM_BUFFERS

    @gluon.jit
    def phase(self):
        return (self.count // self.NUM_BUFFERS) & 1

    @gluon.jit
    def previous_slot(self):
        return (self.count + self.NUM_BUFFERS - 1) % self.NUM_BUFFERS

    @gluon.must_use_result
    @gluon.jit
    def next(self, steps=1):
        return Counter(self.count + steps, self.NUM_BUFFERS)


@gluon.jit
def allocate_barrier_pairs(COUNT: gl.constexpr):
    """(ready, empty): COUNT pairs of mbarriers in shared memory, each initialized for one arrival
    (a ring's ready/empty barriers, or an accumulator hand-off's)."""
    ready = gl.allocate_shared_memory(gl.int64, [COUNT, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [COUNT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(COUNT):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


# %% An output window (lesson 05's epilogue, for lesson 06's strided dgrad) ----------------------

class WindowPhases(NamedTuple):
    """Lesson 06's strided dgrad in one launch: the conv's output columns are the phases of dX side
    by side, `width` columns each (dX's `channels`, rounded up to whole tiles). Phase p = (a, b),
    a = p // stride_w, b = p % stride_w, holds dX's pixels (a + stride_h * y, b + stride_w * x) and
    runs a rectangle of the conv's taps (the taps of the union of the phases' windows, not w's):
    along_h[a] = (its first tap along the rows, its taps), along_w[b] = (first tap along the columns,
    taps). The stride is the tuples' lengths. A tile of the conv must lie in one phase: `width` a
    multiple of the config's tile_n (lesson 05's prepare_launch checks it)."""
    width: int
    channels: int
    along_h: tuple
    along_w: tuple
    order: tuple = None     # the phases one after another in this order (PhaseTiles.tile); None: lesson 05's order

    @property
    def count(self):
        return len(self.along_h) * len(self.along_w)

    def heaviest_first(self):
        """The phases by their taps, most first (ties in phase order), each as a 1-tuple: an `order` for
        the kernel to run their tiles in (`PhaseTiles.tile`)."""
        taps = [self.along_h[p // len(self.along_w)][1] * self.along_w[p % len(self.along_w)][1]
                for p in range(self.count)]
        return tuple((p,) for p in sorted(range(self.count), key=lambda p: -taps[p]))


class FlippedFilter(NamedTuple):
    """Lesson 06's dgrad weights w'[ci, r', s', co] = w[co, R-1-r', S-1-s', ci] (or a phase's taps of
    w, reversed), read where w lies instead of copied. A dgrad conv's K is dY's channels, w's rows,
    and its N is dX's channels, contiguous within each of w's taps: seen as w2d [Co, R*S*Ci], the
    weights of a k-step are a box [BLOCK_K rows, BLOCK_N columns] at (c0, its tap's column + n0),
    N-major, where the conv's own filter is K-major. along_h[a] = (r0, first, step, taps): the
    rectangle of residue a (one residue without phases; one per residue of a `WindowPhases`, lesson
    06's section 2b) starts at the conv's tap r0, and its conv taps r0, r0+1, ... read w's taps
    first + (taps-1)*step, ..., first (reversed); along_w likewise for s."""
    w: torch.Tensor           # the forward conv's filter [Co, R, S, Ci]: contiguous, fp16 or bf16
    along_h: tuple
    along_w: tuple

    @property
    def shape(self):
        """[Ci, R', S', Co]: the shape of the conv's filter w' this stands for (its taps: those the
        residues' rectangles reach)."""
        Co, _, _, Ci = self.w.shape
        return (Ci, max(r0 + taps for r0, _, _, taps in self.along_h),
                max(s0 + taps for s0, _, _, taps in self.along_w), Co)

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def device(self):
        return self.w.device

    def is_contiguous(self):
        return self.w.is_contiguous()

    @staticmethod
    def readable(w):
        """Whether the kernel can read the filter w [Co, R, S, Ci] in place: fp16 or bf16, contiguous,
        16-byte aligned, its rows of R*S*Ci elements whole 16-byte vectors."""
        _, R, S, Ci = w.shape
        return (w.dtype in (torch.float16, torch.bfloat16) and w.is_contiguous() and w.data_ptr() % 16 == 0
                and R * S * Ci * w.element_size() % 16 == 0)

    def check(self):
        """ValueError unless the kernel can read w in place (`readable`), every tap of every residue
        inside w."""
        w = self.w
        Co, R, S, Ci = w.shape
        if not self.readable(w):
            raise ValueError(f"FlippedFilter: w must be a contiguous, 16-byte aligned fp16 or bf16 [Co, R, S, Ci] "
                             f"whose rows of R*S*Ci elements are whole 16-byte vectors; got {w.dtype} "
                             f"{tuple(w.shape)}, strides {w.stride()}")
        for name, along, size in (("along_h", self.along_h, R), ("along_w", self.along_w, S)):
            if not along or any(taps < 1 or step < 1 or first < 0 or first + (taps - 1) * step >= size or r0 < 0
                                for r0, first, step, taps in along):
                raise ValueError(f"FlippedFilter.{name} = {along}: each residue's (conv tap r0, first, step, taps) "
                                 f"must read taps inside w's {size}")
        return self

    def kernel_args(self):
        """The kernel's w_taps: per residue along h, (the column where its conv tap 0 would read, an
        extrapolation where r0 > 0; columns per conv tap), and along w: conv tap (r, s) of residue
        (a, b) reads w2d's columns
        along_h[a][0] - r * along_h[a][1] + along_w[b][0] - s * along_w[b][1] + n, n = dX's channel."""
        _, _, S, Ci = self.w.shape
        return tuple(tuple(((first + (taps - 1 + r0) * step) * pitch, step * pitch)
                           for r0, first, step, taps in along)
                     for along, pitch in ((self.along_h, S * Ci), (self.along_w, Ci)))

    def descriptor(self, BLOCK_N, BLOCK_K):
        """The TMA descriptor of w2d [Co, R*S*Ci], box [BLOCK_K, BLOCK_N] (rows past Co: zeros)."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        layout = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], GL_DTYPES[self.w.dtype])
        return TensorDescriptor.from_tensor(self.w.reshape(self.w.shape[0], -1), [BLOCK_K, BLOCK_N], layout)



def flipped_filter_taps(w, geometry, dtype, out_window=None):
    """Lesson 05's w_taps argument: None for a conv's own filter, a FlippedFilter's kernel_args once it
    is checked against the conv `geometry` (dY in, x's `dtype`), whose columns are dX's channels (or,
    with `out_window`'s phases, those phases side by side, each its residues' taps)."""
    if not isinstance(w, FlippedFilter):
        return None
    g, phases = geometry, None if out_window is None else out_window.phases
    w.check()
    # each residue's rectangle (first conv tap, taps): the phases', or without them all the conv's taps
    rectangles = (((0, g.R),), ((0, g.S),)) if phases is None else (phases.along_h, phases.along_w)
    channels = g.Co if phases is None else phases.channels
    own = tuple(tuple((r0, taps) for r0, _, _, taps in along) for along in (w.along_h, w.along_w))
    if w.dtype != dtype or w.shape != (channels, g.R, g.S, g.Ci) or own != tuple(map(tuple, rectangles)) or (
            g.groups != 1):
        raise ValueError(f"FlippedFilter of shape {w.shape} ({w.dtype}, rectangles (first tap, taps) {own}): the "
                         f"conv {g.describe()} ({dtype}) needs {(channels, g.R, g.S, g.Ci)}, the rectangles "
                         f"{tuple(map(tuple, rectangles))} and groups=1")
    return w.kernel_args()


class OutputWindow(NamedTuple):
    """A conv's output stored into part of a larger NHWC tensor, not a tensor of its own: pixel
    (n, y, x) of the output goes to view[n, y - crop_h, x - crop_w], and pixels that fall outside
    `view` are dropped. `view` is a 4-d view with contiguous channels, e.g. dX[:, p::sh, q::sw]:
    lesson 06's strided dgrad, whose phases store their pixels straight into dX's rows and columns.
    With `phases` (a WindowPhases) the output's columns are those phases side by side and `view` is
    the whole of dX: phase (a, b)'s pixel (n, y, x) goes to view[n, a + sh*(y - crop_h), b + sw*(x - crop_w)]."""
    view: torch.Tensor
    crop_h: int = 0
    crop_w: int = 0
    phases: WindowPhases = None

    def write(self, out_nhwc):
        """torch's way to the same result (a CPU's, or a kernel that stores densely): crop, then copy.
        Returns the view, as a kernel that stores into the window does."""
        if self.phases is None:
            rows, cols = self.view.shape[1:3]
            return self.view.copy_(out_nhwc[:, self.crop_h:self.crop_h + rows, self.crop_w:self.crop_w + cols])
        sh, sw = len(self.phases.along_h), len(self.phases.along_w)
        for p in range(self.phases.count):
            phase = self.view[:, p // sw::sh, p % sw::sw]
            columns = slice(p * self.phases.width, p * self.phases.width + self.phases.channels)
            OutputWindow(phase, self.crop_h, self.crop_w).write(out_nhwc[..., columns])
        return self.view

    def kernel_args(self):
        """The kernel's `out_window` tuple: (view, its n, y and x strides in elements, its rows and
        columns, crop_h, crop_w, and the phases' (width, channels, along_h, along_w, order) or None)."""
        view = self.view
        phases = None if self.phases is None else tuple(self.phases)
        return (view, *view.stride()[:3], view.shape[1], view.shape[2], self.crop_h, self.crop_w, phases)


def window_storable(view):
    """Whether a kernel can store into `view` pixel by pixel in 16-byte vectors: channels contiguous,
    every pixel 16-byte aligned, and a whole number of 16-byte vectors of channels."""
    lanes = 16 // view.element_size()
    return view.stride(-1) == 1 and not any(s % lanes for s in view.stride()[:-1]) and view.data_ptr() % 16 == 0 \
        and view.shape[-1] % lanes == 0


def check_output_window(window, geometry, dtype, device, split_k=1, tile_n=None):
    """ValueError/TypeError unless `window` can take the output of the conv `geometry` in `dtype`
    on `device`: a view [N, rows, cols, Co] with contiguous channels and 16-byte aligned pixels,
    rows and columns that the output covers from (crop_h, crop_w) on; a kernel config without
    split-K (lesson 05's split-K sums its slices in a second kernel, which stores densely). With
    phases: a view [N, H, W, channels], an output of `count` phases of `width` columns, each phase's
    rows and columns covered, and (given the config's `tile_n`) a width of whole tiles."""
    g = geometry
    if split_k > 1:
        raise ValueError(f"an out_window takes a config without split-K (split_k=1), got split_k={split_k}")
    if not isinstance(window, OutputWindow) or not isinstance(window.view, torch.Tensor):
        raise TypeError(f"out_window must be a common.OutputWindow of a tensor view, got {type(window).__name__}")
    view, crop, phases = window.view, (window.crop_h, window.crop_w), window.phases
    channels, steps = g.Co, (1, 1)
    if phases is not None:
        if not isinstance(phases, WindowPhases):
            raise TypeError(f"out_window.phases must be a common.WindowPhases or None, got {type(phases).__name__}")
        channels, steps = phases.channels, (len(phases.along_h), len(phases.along_w))
        if phases.width < phases.channels or phases.width * phases.count != g.Co or (tile_n and phases.width % tile_n):
            raise ValueError(f"out_window.phases: {phases.count} phases of {phases.width} columns for "
                             f"{phases.channels} channels need an output of {phases.width * phases.count} "
                             f"channels (got {g.Co}), a width of at least the channels and, a tile lying in one "
                             f"phase, of whole tiles of {tile_n} columns")
    if view.dim() != 4 or view.shape[0] != g.N or view.shape[3] != channels:
        raise ValueError(f"out_window.view has shape {tuple(view.shape)}; the output of {g.describe()} needs "
                         f"[{g.N}, rows, cols, {channels}]")
    if view.dtype != dtype or view.device != device:
        raise ValueError(f"out_window.view is {view.dtype} on {view.device}; the output is {dtype} on {device}")
    if not window_storable(view):
        raise ValueError(f"out_window.view has shape {tuple(view.shape)} and strides {view.stride()} at address "
                         f"{view.data_ptr():#x}: its channels must be contiguous, its pixels 16-byte aligned and "
                         f"its channels a whole number of 16-byte vectors")
    rows, cols = (-(-size // step) for size, step in zip(view.shape[1:3], steps))    # (phase 0's, the most)
    if min(crop) < 0 or crop[0] + rows > g.out_h or crop[1] + cols > g.out_w:
        raise ValueError(f"out_window crops ({crop[0]}, {crop[1]}) and {rows} x {cols} pixels "
                         f"from an output of {g.out_h} x {g.out_w}; they must lie inside it")


@gluon.jit
def pick(table, index, field: gl.constexpr):
    """table[index][field] for a run-time `index` into a tuple of tuples of run-time integers (an
    index past the table gives row 0's: lesson 05's ping-pong asks for a unit past the last one, whose
    answer it never uses)."""
    picked = table[0][field]
    for i in gl.static_range(1, len(table)):
        picked = gl.where(index == i, table[i][field], picked)
    return picked


@gluon.aggregate
class PhaseTiles:
    """The kernel's side of a `WindowPhases` (lesson 06): which phase a tile of output columns co0,
    co0+1, ... belongs to, which taps it runs and how many k-steps that makes."""
    width: Union[gl.tensor, gl.constexpr]
    channels: Union[gl.tensor, gl.constexpr]
    along_h: gl.tuple
    along_w: gl.tuple
    order: Union[gl.tuple, gl.constexpr]     # WindowPhases.order: the phases in run order, or None
    channel_blocks: Union[gl.tensor, gl.constexpr]

    @gluon.jit
    def tile(self, tile_id, num_pid_m, TILE_N: gl.constexpr, GROUP_M: gl.constexpr, pid_m, pid_n):
        """(pid_m, pid_n) of tile `tile_id`: lesson 05's (pid_m, pid_n) where there is no `order`, else the
        phases' tiles one phase after another in `order`, each phase's in lesson 05's grouped order
        (GROUP_M row-tiles at a time). Lesson 05's order over the phases side by side can hand a program
        the same phase wave after wave, where a group's tiles are about as many as the programs
        (ResNet-50's 14x14 stride-2 layer: one program six 4-tap tiles, another six 1-tap ones); heaviest
        phase first, the programs' round-robin over the tiles is close to longest-job-first."""
        if self.order is not None:
            per_phase = self.width // TILE_N                 # column tiles per phase
            tiles_per_phase = num_pid_m * per_phase
            p = pick(self.order, tile_id // tiles_per_phase, 0)
            local = tile_id % tiles_per_phase
            tiles_per_group = GROUP_M * per_phase
            first_m = (local // tiles_per_group) * GROUP_M
            rows_in_group = gl.minimum(num_pid_m - first_m, GROUP_M)
            pid_m = first_m + (local % tiles_per_group) % rows_in_group
            pid_n = p * per_phase + (local % tiles_per_group) // rows_in_group
        return pid_m, pid_n

    @gluon.jit
    def work(self, tile_id, num_pid_m, TILE_N: gl.constexpr, GROUP_M: gl.constexpr, pid_m, pid_n):
        """(pid_m, pid_n, k_end) of lesson 05's tile `tile_id`, whose (pid_m, pid_n) in its own order are given:
        the tile in the phases' order (`tile`), and the k-steps of its phase's taps."""
        pid_m, pid_n = self.tile(tile_id, num_pid_m, TILE_N, GROUP_M, pid_m, pid_n)
        return pid_m, pid_n, self.k_steps(pid_n * TILE_N)

    @gluon.jit
    def phase(self, co0):
        """(a, b) of the phase whose columns start at co0."""
        p = co0 // self.width
        return p // len(self.along_w), p % len(self.along_w)

    @gluon.jit
    def taps(self, co0):
        """(first r, taps along r, first s, taps along s): the rectangle of taps the phase runs."""
        a, b = self.phase(co0)
        return pick(self.along_h, a, 0), pick(self.along_h, a, 1), pick(self.along_w, b, 0), pick(self.along_w, b, 1)

    @gluon.jit
    def k_steps(self, co0):
        _, taps_h, _, taps_w = self.taps(co0)
        return taps_h * taps_w * self.channel_blocks


@gluon.aggregate
class FlippedTaps:
    """The kernel's side of a `FlippedFilter` (lesson 06): where in w2d a tile's weights start."""
    along_h: gl.tuple     # per residue: (the column where conv tap 0 would read, columns per conv tap)
    along_w: gl.tuple
    phases: Union[PhaseTiles, gl.constexpr]     # the output's columns are phases side by side; else None

    @gluon.jit
    def tile(self, co0):
        """(column of conv tap (0, 0), columns per tap along r, along s) of the tile of dX's channels co0,
        co0+1, ...: its residue's, plus its first channel."""
        a, b, n0 = 0, 0, co0
        if self.phases is not None:
            a, b = self.phases.phase(co0)
            n0 = co0 % self.phases.width
        return (pick(self.along_h, a, 0) + pick(self.along_w, b, 0) + n0, pick(self.along_h, a, 1),
                pick(self.along_w, b, 1))

    @gluon.jit
    def at(self, tile, r, s, c0):
        """[row, column] of w2d where the box of conv tap (r, s), dY's channels c0, ... starts."""
        first, per_r, per_s = tile
        return [c0, first - r * per_r - s * per_s]


@gluon.aggregate
class WindowStore:
    """The kernel's side of an `OutputWindow`: where each element of an output tile goes."""
    ptr: gl.tensor
    out_h: Union[gl.tensor, gl.constexpr]      # the conv's output size: a tile's rows are its pixels
    out_w: Union[gl.tensor, gl.constexpr]
    stride_n: Union[gl.tensor, gl.constexpr]   # the view's strides and size, in elements and pixels
    stride_h: Union[gl.tensor, gl.constexpr]
    stride_w: Union[gl.tensor, gl.constexpr]
    rows: Union[gl.tensor, gl.constexpr]
    cols: Union[gl.tensor, gl.constexpr]
    crop_h: Union[gl.tensor, gl.constexpr]
    crop_w: Union[gl.tensor, gl.constexpr]
    phases: Union[PhaseTiles, gl.constexpr]    # the output's columns are phases side by side; else None

    @gluon.jit
    def offsets(self, pixels, channels, M, Co, co0):
        """(offsets into the view, inside) of the elements (pixels[i], channels[j]) of a tile: output
        pixels m = (n * out_h + y) * out_w + x (m < M) along its rows, channels (< Co) along its columns,
        the first co0; with phases, columns of one phase, whose first `channels` are stored."""
        y = pixels // self.out_w % self.out_h - self.crop_h
        x = pixels % self.out_w - self.crop_w
        n = pixels // (self.out_w * self.out_h)
        if self.phases is not None:        # phase (a, b): dX's pixel (a + sh * y, b + sw * x), its channel
            a, b = self.phases.phase(co0)
            y = y * len(self.phases.along_h) + a
            x = x * len(self.phases.along_w) + b
            channels = channels - co0 // self.phases.width * self.phases.width
            Co = self.phases.channels
        # The strides and Co are multiples of a 16-byte vector's elements (`window_storable`); written so, the
        # compiler knows it too, and stores 16-byte vectors where it would otherwise know only a multiple of 16
        # elements (Triton's assumption for an integer argument) and store element by element.
        VECTOR: gl.constexpr = 128 // self.ptr.dtype.element_ty.primitive_bitwidth
        at = (n.to(gl.int64) * (self.stride_n // VECTOR * VECTOR)
              + y.to(gl.int64) * (self.stride_h // VECTOR * VECTOR)
              + x.to(gl.int64) * (self.stride_w // VECTOR * VECTOR))
        kept = (pixels < M) & (y >= 0) & (y < self.rows) & (x >= 0) & (x < self.cols)
        return (gl.expand_dims(at, 1) + gl.expand_dims(channels, 0),
                gl.expand_dims(kept, 1) & gl.expand_dims(channels < Co // VECTOR * VECTOR, 0))

    @gluon.jit
    def store(self, tile, staging, m0, co0, M, Co):
        """Store a tile (rows: output pixels m0, m0+1, ...; columns: channels co0, co0+1, ...) where
        the window puts it. Its pixels make no TMA box, so it goes through the TMA store's `staging`
        buffer all the same: written there in its own layout, read back in `staged_tile_layout`'s
        rows of 16-byte vectors and stored a pixel's channels at a time."""
        staging.store(tile.to(staging.dtype))
        layout: gl.constexpr = staged_tile_layout(staging.shape[0], staging.shape[1],
                                                  staging.dtype.primitive_bitwidth // 8, gl.num_warps(), False)
        values = staging.load(layout)
        pixels = m0 + gl.arange(0, staging.shape[0], layout=gl.SliceLayout(1, layout))
        channels = co0 + gl.arange(0, staging.shape[1], layout=gl.SliceLayout(0, layout))
        offsets, inside = self.offsets(pixels, channels, M, Co, co0)
        gl.store(self.ptr + offsets, values, mask=inside)


@gluon.jit
def window_store(out_window, out_h, out_w, channel_blocks):
    """(WindowStore, PhaseTiles) of lesson 05's `out_window` argument (an OutputWindow's kernel_args):
    each a constexpr None where there is no window, or a window without phases."""
    store, phases = None, None
    if out_window is not None:
        if out_window[8] is not None:
            phases = PhaseTiles(*out_window[8], channel_blocks)
        store = WindowStore(out_window[0], out_h, out_w, *out_window[1:8], phases)
    return store, phases


@gluon.jit
def weights_tile(flipped, co0):
    """Where the weights of lesson 05's tile of output channels co0, co0+1, ... lie: rows co0, ... of the
    conv's own w2d, or (lesson 06: `flipped`, a FlippedTaps) FlippedTaps.tile's columns."""
    w_tile = co0
    if flipped is not None:
        w_tile = flipped.tile(co0)
    return w_tile


@gluon.jit
def weights_at(flipped, w_tile, column, r, s, c0):
    """[row, column] of w2d where a k-step's box of weights starts: the tile's rows at `column` (its tap's
    and channel block's) of the conv's own filter, or (lesson 06) FlippedTaps.at's, for tap (r, s)."""
    w_at = [w_tile, column]
    if flipped is not None:
        w_at = flipped.at(w_tile, r, s, c0)
    return w_at


@gluon.jit
def flipped_taps(w_taps, phases):
    """The FlippedTaps of lesson 05's `w_taps` argument (a FlippedFilter's kernel_args), or a constexpr
    None where the conv reads its own filter."""
    taps = None
    if w_taps is not None:
        taps = FlippedTaps(w_taps[0], w_taps[1], phases)
    return taps


@gluon.constexpr_function
def staged_tile_layout(rows, columns, element_size, num_warps, split_columns):
    """A register layout for reading a staged [rows, columns] tile back from shared memory: each
    thread holds 16-byte vectors of a row (shorter where the tile is too small to give every thread
    one: no element is held twice), and a warp's lanes take the columns, then the rows. The warps
    take rows (`split_columns` False: to store the tile row by row, `WindowStore`; 128 bf16
    channels are 16 lanes, two rows per instruction), or split the columns among themselves (True:
    for sums down the columns that cross no warp where there are columns enough, `add_channel_sums`)."""
    if rows & (rows - 1) or columns & (columns - 1):
        raise ValueError(f"staged_tile_layout takes a tile of powers of two, got {rows} x {columns}")
    vector = 16 // element_size
    while vector > 1 and rows * columns < vector * 32 * num_warps:
        vector //= 2
    warps_across = min(num_warps, max(1, columns // vector)) if split_columns else 1
    lanes_across = min(32, max(1, columns // warps_across // vector))
    lanes_down, warps_down = 32 // lanes_across, num_warps // warps_across
    return gl.BlockedLayout([max(1, rows // (lanes_down * warps_down)), vector], [lanes_down, lanes_across],
                            [warps_down, warps_across], [1, 0])


# %% Per-channel statistics from the epilogue (lesson 05's epilogue, for lesson 06's BatchNorm) ---

def check_channel_stats(stats, Co, device, split_k=1, out_window=None):
    """ValueError/TypeError unless `stats` can take a conv's per-channel sums: an fp32 tensor of shape
    [2, Co], contiguous, on the output's device, that the epilogue adds each output channel's sum
    (row 0) and sum of squares (row 1) into, every program of the kernel into the same two rows
    (`add_channel_sums`). A config without split-K (its slices are partial sums: the squares of a whole
    sum are not the sum of their squares) and no out_window (a window drops the pixels it crops,
    which the statistics would still count)."""
    if not isinstance(stats, torch.Tensor):
        raise TypeError(f"channel_stats must be a torch.Tensor (torch.float32, shape (2, {Co})), got "
                        f"{type(stats).__name__}")
    if stats.dtype != torch.float32 or tuple(stats.shape) != (2, Co) or not stats.is_contiguous():
        raise ValueError(f"channel_stats is {stats.dtype} {tuple(stats.shape)} with strides {stats.stride()}; the "
                         f"conv's {Co} output channels need a contiguous torch.float32 tensor of shape (2, {Co}): "
                         f"each channel's sum, then its sum of squares")
    if stats.device != device:
        raise ValueError(f"channel_stats is on {stats.device}; the output is on {device}")
    if split_k > 1:
        raise ValueError(f"channel_stats takes a config without split-K (split_k=1), got split_k={split_k}")
    if out_window is not None:
        raise ValueError("channel_stats and an out_window together: a window's crop drops pixels that the "
                         "statistics would count; pass one of them")


def check_epilogue_destinations(out_window, channel_stats, geometry, dtype, device, split_k=1, tile_n=None):
    """Lesson 06's two optional destinations of lesson 05's epilogue, each checked where given: an
    out_window (check_output_window) and channel_stats (check_channel_stats). Returns the kernel's
    arguments for them: (out_window.kernel_args() or None, the channel_stats tensor or None)."""
    if out_window is not None:
        check_output_window(out_window, geometry, dtype, device, split_k, tile_n)
    if channel_stats is not None:
        check_channel_stats(channel_stats, geometry.Co, device, split_k, out_window)
    return None if out_window is None else out_window.kernel_args(), channel_stats


@gluon.jit
def add_channel_sums(stats_ptr, staged, m0, co0, M, Co):
    """Add the per-channel sum and sum of squares of a tile of the output, staged in shared memory
    (`staged`: rows are output pixels m0, m0+1, ... of which those < M count; columns channels co0,
    co0+1, ... of which those < Co count), into rows 0 and 1 of `channel_stats`, fp32 [2, Co],
    zeroed, that every program adds into (lesson 06, section 10): atomically (tiles arrive in any
    order, so the last bits vary run to run). Read back in `staged_tile_layout` with the columns
    split among the warps, each thread sums its rows, then a warp's lanes, seldom warps."""
    ROWS: gl.constexpr = staged.shape[0]
    COLUMNS: gl.constexpr = staged.shape[1]
    layout: gl.constexpr = staged_tile_layout(ROWS, COLUMNS, staged.dtype.primitive_bitwidth // 8, gl.num_warps(),
                                              True)
    values = staged.load(layout).to(gl.float32)
    pixels = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    channels = co0 + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
    counted = gl.where(gl.expand_dims(pixels < M, 1), values, 0.0)
    inside = channels < Co
    # (relaxed: nothing else is ordered by these adds; one thread adds each channel's value, Triton masks the
    # threads that hold copies of it)
    gl.atomic_add(stats_ptr + channels, gl.sum(counted, axis=0), mask=inside, sem="relaxed")
    gl.atomic_add(stats_ptr + Co + channels, gl.sum(counted * counted, axis=0), mask=inside, sem="relaxed")


# %% BatchNorm's apply and ReLU on a conv's input (lesson 05's Hopper consumer, for lesson 06's section 11) ---

@gluon.aggregate
class InputTransform:
    """The kernel's side of lesson 06's `check_input_transform`: the conv reads relu(x * scale[c] + shift[c])."""
    scale_ptr: gl.tensor        # fp32 [Ci]
    shift_ptr: gl.tensor
    H: Union[gl.tensor, gl.constexpr]     # the input's height and width: the padding test
    W: Union[gl.tensor, gl.constexpr]
    Ci: Union[gl.tensor, gl.constexpr]    # real channels: the channels past them are padding

    @gluon.jit
    def operand(self, a_smem, acc_layout: gl.constexpr, window, work, schedule, k):
        """A stage's im2col tile a_smem [BLOCK_M pixels, BLOCK_K channels] of k-step k of lesson 05's unit `work`
        (its TileSchedule `schedule`), as the A operand of a WGMMA in registers (acc_layout: its accumulator's):
        relu(a * scale[c] + shift[c]) in fp32, cast back; zero where the tap's pixel lies in the padding (TMA
        wrote zeros there, but relu(0 * scale + shift) need not be 0) and in padded channels."""
        m0, co0 = work.pid_m * schedule.TILE_M, work.pid_n * schedule.TILE_N
        BLOCK_M: gl.constexpr = a_smem.shape[0]
        BLOCK_K: gl.constexpr = a_smem.shape[1]
        # WGMMA's A layout in registers: k_width elements of a row per 32-bit register (2 for fp16/bf16)
        layout: gl.constexpr = gl.DotOperandLayout(0, acc_layout, 32 // a_smem.dtype.primitive_bitwidth)
        a = a_smem.load(layout)                      # shared -> registers (ldmatrix)
        tap_offsets, c0, _ = window.k_step(k, BLOCK_K, window.tile_taps(co0))
        inside = self.pixels_inside(window, m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)), tap_offsets)
        channels = c0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        real = channels < self.Ci
        scale = gl.load(self.scale_ptr + channels, mask=real, other=0.0)
        shift = gl.load(self.shift_ptr + channels, mask=real, other=0.0)
        # a = max(a * scale[c] + shift[c], 0): one FMA and one max per element, in fp32
        a = gl.maximum(a.to(gl.float32) * gl.expand_dims(scale, 0) + gl.expand_dims(shift, 0), 0.0)
        a = gl.where(gl.expand_dims(inside, 1) & gl.expand_dims(real, 0), a, 0.0)
        return a.to(a_smem.dtype)

    @gluon.jit
    def pixels_inside(self, window, pixels, tap_offsets):
        """Whether the input pixel that each output pixel of `pixels` reads at the tap of `tap_offsets` (lesson 05's
        Im2colWindow.k_step's [r * dil_h, s * dil_w]) lies in the image, not in its zero padding: the im2col box's
        own arithmetic (Im2colWindow.pixel_box_origin), plus the tap."""
        n, y, x = window.pixel_box_origin(pixels)
        y = y + tap_offsets[0].to(gl.int32)
        x = x + tap_offsets[1].to(gl.int32)
        return (y >= 0) & (y < self.H) & (x >= 0) & (x < self.W)


@gluon.jit
def input_transform(args):
    """The InputTransform of lesson 05's `input_transform` argument (lesson 06's check_input_transform's tuple), or a
    constexpr None where the conv reads its input as it is."""
    transform = None
    if args is not None:
        transform = InputTransform(*args)
    return transform
