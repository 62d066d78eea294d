"""TMA im2col: the descriptor's limits, a convolution's settings (strides, pixel-box corners, tap
offsets), channel padding to 16 bytes, and the TMA descriptors of a conv's operands."""
import dataclasses
import math

import torch
from triton.experimental.gluon import language as gl

from .dtypes import GL_DTYPES  # noqa: F401  (the tiles' dtypes; re-exported)
from .geometry import ConvGeometry
from .windows import FlippedFilter

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


# Shared layouts and TMA descriptors




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

