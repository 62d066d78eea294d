"""Where a conv's output goes and where its filter is read, on the host: an output window (the
tile stored into part of a larger tensor), a strided dgrad's phases side by side, a forward filter read
in place as a dgrad's weights, per-channel sums for BatchNorm; and their checks. The kernel's side is
conv_tutorial.kernels.windows."""
from typing import NamedTuple

import torch
from triton.experimental.gluon import language as gl

from .dtypes import GL_DTYPES

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
    rectangle of residue a (one residue without phases; one per residue of a `WindowPhases`, the
    phases in one launch) starts at the conv's tap r0, and its conv taps r0, r0+1, ... read w's taps
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
        raise TypeError(f"out_window must be a conv_tutorial.core.windows.OutputWindow of a tensor view, got {type(window).__name__}")
    view, crop, phases = window.view, (window.crop_h, window.crop_w), window.phases
    channels, steps = g.Co, (1, 1)
    if phases is not None:
        if not isinstance(phases, WindowPhases):
            raise TypeError(f"out_window.phases must be a conv_tutorial.core.windows.WindowPhases or None, got {type(phases).__name__}")
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


