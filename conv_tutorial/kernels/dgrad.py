"""dgrad, dX of a conv, on the forward kernel (lesson 06 teaches the mapping): at stride 1 a conv of
dY with the filter flipped; at stride > 1 one conv per output phase of dX, each stored straight into
its rows and columns of dX through an output window, or all phases of a 3x3 stride-2 dgrad side by
side in one launch (the tile order balanced across programs); the forward filter read in place
where it can be (a FlippedFilter), zeros written only where no tap reaches; ReLU's backward gated in
the epilogue. The operator's backward (conv_tutorial.backward) calls `dgrad` and its plans."""
import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..core.device import interpreter_mode, is_hopper, tma_mma_arch_and_sms
from ..core.epilogue import RELU_GRAD
from ..core.geometry import ConvGeometry
from ..core.tma import conv_im2col_settings
from ..core.windows import FlippedFilter, OutputWindow, WindowPhases, window_storable
from . import fprop
from .gradients import dgrad_config, fold_weight, unfold_input_grad

class AxisPhase(NamedTuple):
    # One axis of one phase of dgrad (lesson 06; stride 1 has one phase): dX's rows phase,
    # phase + stride, ... are rows crop, crop + 1, ... of a stride-1 conv of dY with the filter's
    # taps `taps` (a slice of r), flipped, at `dilation`, with `padding` on both sides.
    rows: int            # rows of dX in this phase (0 when the phase lies past the image)
    taps: slice          # the taps that reach these rows (None if none)
    padding: int
    dilation: int
    crop: int


def dgrad_axis_phase(phase, size, out_size, R, stride, padding, dilation):
    """Where dX's rows phase, phase + stride, ... come from, along one axis (lesson 06)."""
    rows = len(range(phase, size, stride))
    hits = [r for r in range(R) if (phase + padding - r * dilation) % stride == 0]
    if rows == 0 or not hits:
        return AxisPhase(rows, None, 0, 1, 0)
    step = stride // math.gcd(stride, dilation)                # every step-th tap: the hits' spacing
    sub_dilation = dilation // math.gcd(stride, dilation)      # and the dY rows they reach, so far apart
    # dY row that dX's row j of this phase reads with tap hits[k]: j + first + (len - 1 - k) * sub_dilation
    first = (phase + padding - hits[-1] * dilation) // stride
    reach = sub_dilation * (len(hits) - 1)
    # padding: none below 0 (lesson 05 takes none), and enough that the conv's output, out_size + 2*pad
    # - reach rows, holds rows first + pad, ..., first + pad + rows - 1; crop where dX's rows start in it
    pad = max(0, -first, rows + first + reach - out_size)
    return AxisPhase(rows, slice(hits[0], hits[-1] + 1, step), pad, sub_dilation, first + pad)


def dgrad_phases(geometry):
    """(py, px, along_h, along_w) of each phase of dX that holds pixels: arithmetic on the shape
    alone, so a caller that meets one shape often (the operator's backward) may keep it."""
    g = geometry
    return [(py, px, along_h, along_w) for py in range(g.stride[0]) for px in range(g.stride[1])
            for along_h in [dgrad_axis_phase(py, g.H, g.out_h, g.R, g.stride[0], g.padding[0], g.dilation[0])]
            for along_w in [dgrad_axis_phase(px, g.W, g.out_w, g.S, g.stride[1], g.padding[1], g.dilation[1])]
            if along_h.rows and along_w.rows]     # (a phase past the image's edge has no rows of dX)


@triton.jit
def flipped_weights_kernel(w_ptr, out_ptr, phases, Co, R, S, Ci_group, Co_group,
                           BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr):
    """Every phase's w' at once. Entry i of `phases` (ints: first, r0, r_step, R2, s0, s_step, S2, at, pitch)
    is a phase whose taps r0 + a*r_step (a < R2) and s0 + b*s_step (b < S2) are programs first, first + 1,
    ... along axis 0, and whose w' [Ci, R2, S2, Co_group] starts at out_ptr + at, its rows `pitch` taps apart
    (R2 * S2: w' on its own; more where the phases sit side by side in one launch):
    out[at + ((k*Ci_group + ci) * pitch + r' * S2 + s') * Co_group + co]
        = w[k*Co_group + co, r0 + (R2-1-r')*r_step, s0 + (S2-1-s')*s_step, ci]     for group k.
    Axes 1 and 2: [BLOCK_CO, BLOCK_CI] tiles of w's channels. The tuple's length is fixed when the
    kernel compiles (the loop below unrolls over it); its entries are run-time integers."""
    t = tl.program_id(0)
    r = t * 0       # (a tensor: every tl.where of the unrolled loop below then yields the same type)
    s, at, r_out, s_out, S2, pitch = r, r.to(tl.int64), r, r, r, r
    for i in tl.static_range(len(phases)):      # which phase program t's tap belongs to
        first, r0, r_step, R2_i, s0, s_step, S2_i, at_i, pitch_i = phases[i]
        local = t - first
        mine = (local >= 0) & (local < R2_i * S2_i)
        r_out = tl.where(mine, local // S2_i, r_out)
        s_out = tl.where(mine, local % S2_i, s_out)
        r = tl.where(mine, r0 + (R2_i - 1 - local // S2_i) * r_step, r)    # the tap it reads, flipped
        s = tl.where(mine, s0 + (S2_i - 1 - local % S2_i) * s_step, s)
        S2, pitch = tl.where(mine, S2_i, S2), tl.where(mine, pitch_i, pitch)
        at = tl.where(mine, at_i, at)
    co = tl.program_id(1) * BLOCK_CO + tl.arange(0, BLOCK_CO)      # w's output channel (dY's channel)
    ci = tl.program_id(2) * BLOCK_CI + tl.arange(0, BLOCK_CI)      # w's input channel, within its group
    inside = (co[:, None] < Co) & (ci[None, :] < Ci_group)
    tile = tl.load(w_ptr + ((co[:, None] * R + r) * S + s) * Ci_group + ci[None, :], mask=inside)
    group, co_in_group = co // Co_group, co % Co_group
    out_row = group[:, None] * Ci_group + ci[None, :]               # dX's channel: the conv's output channel
    tl.store(out_ptr + at + (out_row * pitch + r_out * S2 + s_out) * Co_group + co_in_group[:, None], tile,
             mask=inside)


def flipped_weights_by_torch(w, taps_h, taps_w, groups=1):
    # What flipped_weights computes for one phase, in torch's flip and permute (two passes); where Triton cannot
    # run it (CPU tensors on a machine with a GPU: no interpreter there)
    w_phase = w[:, taps_h, taps_w].flip((1, 2))
    Co, R2, S2, Ci_group = w_phase.shape
    return w_phase.reshape(groups, Co // groups, R2, S2, Ci_group).permute(0, 4, 2, 3, 1).reshape(
        groups * Ci_group, R2, S2, Co // groups).contiguous()


def flipped_weights(w, phase_taps, groups=1, width=None):
    """[w' of each phase]: for each (taps_h, taps_w) of `phase_taps` (slices of w's r and s), w'
    [Ci, R2, S2, Co / groups] of w [Co, R, S, Ci / groups] for the taps w[:, taps_h, taps_w], flipped,
    channel axes swapped within each group. Up to 16 phases per flipped_weights_kernel launch (a
    stride of 2 in both axes has 4), into one buffer (each w' a contiguous piece of it). The phases
    go to the kernel as integers, not as a table in GPU memory: a tensor made once and kept here
    would outlive the CUDA graph (a training step's) that allocated it.
    With `width` (groups = 1; the phases in one launch): one tensor [phases * width, 1, taps, Co], the phases side by
    side, rows p * width + ci of phase p holding its w'[ci] (its R2 * S2 taps first; `taps`: the
    most any phase has), rows past Ci zeros. Past a phase's own taps only a K block that straddles its last
    tap's end reads: zeros there where Co is not a multiple of 128 channels, else never read."""
    Co, R, S, Ci_group = w.shape
    if w.device.type != "cuda" and not interpreter_mode():
        phases = [flipped_weights_by_torch(w, taps_h, taps_w, groups) for taps_h, taps_w in phase_taps]
        return phases if width is None else side_by_side(phases, width)
    phases, shapes, size = [], [], 0
    pitch = max((len(range(R)[h]) * len(range(S)[v]) for h, v in phase_taps), default=0)
    for p, (taps_h, taps_w) in enumerate(phase_taps):
        rows, cols = range(R)[taps_h], range(S)[taps_w]
        at, row_pitch = (size, len(rows) * len(cols)) if width is None else (p * width * pitch * Co, pitch)
        phases.append((rows.start, rows.step, len(rows), cols.start, cols.step, len(cols), at, row_pitch))
        shapes.append((groups * Ci_group, len(rows), len(cols), Co // groups))
        size += math.prod(shapes[-1])
    if width is None:
        out = w.new_empty(size)
    elif Co % 128:
        # dY's channels end inside a K block (of up to 128): a phase's last k-step reads weight columns past its
        # last tap, against dY's zero-filled channels; zeros there (garbage could be NaN, and 0 * NaN is NaN)
        out = w.new_zeros(len(phases), width, 1, pitch, Co)
    else:
        out = w.new_empty(len(phases), width, 1, pitch, Co)
        out[:, Ci_group:].zero_()   # rows past Ci: columns the conv computes and does not store (zeros: no NaN there)
    BLOCK = 32
    for chunk in range(0, len(phases), 16):     # (the kernel unrolls a loop over its phases: a few per launch)
        launch, taps = [], 0
        for r0, r_step, R2, s0, s_step, S2, at, row_pitch in phases[chunk:chunk + 16]:
            launch.append((taps, r0, r_step, R2, s0, s_step, S2, at, row_pitch))
            taps += R2 * S2
        grid = (taps, triton.cdiv(Co, BLOCK), triton.cdiv(Ci_group, BLOCK))
        flipped_weights_kernel[grid](w.contiguous(), out, tuple(launch), Co, R, S, Ci_group, Co // groups,
                                     BLOCK_CO=BLOCK, BLOCK_CI=BLOCK, enable_fp_fusion=True)
    if width is not None:
        return out.view(len(phases) * width, 1, pitch, Co)
    return [out[phase[6]:phase[6] + math.prod(shape)].view(shape) for phase, shape in zip(phases, shapes)]


def side_by_side(w_phases, width):
    # flipped_weights' side-by-side layout, from each phase's w' [Ci, R2, S2, Co]: torch's way
    Ci, Co = w_phases[0].shape[0], w_phases[0].shape[-1]
    pitch = max(w_phase.shape[1] * w_phase.shape[2] for w_phase in w_phases)
    out = w_phases[0].new_zeros(len(w_phases), width, 1, pitch, Co)
    for p, w_phase in enumerate(w_phases):
        out[p, :Ci, 0, :w_phase.shape[1] * w_phase.shape[2]] = w_phase.reshape(Ci, -1, Co)
    return out.view(len(w_phases) * width, 1, pitch, Co)


@triton.jit
def untapped_zeros_kernel(dx_ptr, H, W, C, stride_h, stride_w, rows_tapped, cols_tapped,
                          BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zeros into the pixels of dX [N, H, W, C] that no tap reaches: pixel (iy, ix) is reached where
    bit iy % stride_h of `rows_tapped` and bit ix % stride_w of `cols_tapped` are both set. One
    program per row of dX and BLOCK_P of its pixels; every other pixel is left as it is."""
    row = tl.program_id(0)                                  # n * H + iy
    row_reached = (rows_tapped >> (row % H % stride_h)) & 1
    ix = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    reached = (cols_tapped >> (ix % stride_w)) & row_reached          # 1 where the pixel's phase has taps
    zero = (ix < W) & (reached == 0)
    pixel = (row.to(tl.int64) * W + ix) * C
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        tl.store(dx_ptr + pixel[:, None] + c[None, :], tl.zeros([BLOCK_P, BLOCK_C], dx_ptr.dtype.element_ty),
                 mask=zero[:, None] & (c[None, :] < C))


def untapped_zeros(dx, geometry, phases, launch=None):
    """Write zeros into the pixels of dX that none of `phases` (dgrad_phases) has taps for, and no others.
    `launch(kernel, grid, args, kwargs)`: how to launch the kernel (default: Triton's launcher)."""
    g = geometry
    # phase (py, px) has taps where both of its axes have: bit py of `rows`, bit px of `cols`
    rows = sum({1 << py for py, _, along_h, _ in phases if along_h.taps is not None})
    cols = sum({1 << px for _, px, _, along_w in phases if along_w.taps is not None})
    # (each phase a bit of an int64 argument: larger strides take torch's way)
    if (dx.device.type != "cuda" and not interpreter_mode()) or max(g.stride) > 62:
        reached = torch.zeros(g.H, g.W, dtype=torch.bool, device=dx.device)
        for py, px, along_h, along_w in phases:
            if along_h.taps is not None and along_w.taps is not None:
                reached[py::g.stride[0], px::g.stride[1]] = True
        return dx.masked_fill_(~reached[None, :, :, None], 0)
    BLOCK_P = 32
    grid = (g.N * g.H, triton.cdiv(g.W, BLOCK_P))
    args = (dx, g.H, g.W, g.Ci, g.stride[0], g.stride[1], rows, cols)
    kwargs = dict(BLOCK_P=BLOCK_P, BLOCK_C=min(128, triton.next_power_of_2(g.Ci)), enable_fp_fusion=True)
    if launch is None:
        untapped_zeros_kernel[grid](*args, **kwargs)
    else:
        launch(untapped_zeros_kernel, grid, args, kwargs)
    return dx


def dgrad_by_phases(dy_nhwc, w, geometry, fprop, phases=None, conv=None, in_place=False, zeros=None):
    """dX of the conv `geometry` from dY: per phase of dX a stride-1 conv `fprop(dy, w_phase,
    padding=, dilation=, groups=)` (lesson 05's kernel on a GPU, torch's conv on a CPU) of dY with
    that phase's taps, flipped and channel-swapped (within each group), its output cropped into
    the phase's rows and columns of dX: stored there by the conv itself, handed the phase as
    `out_window=` (a OutputWindow), where the stride is > 1 and dX's pixels are 16-byte
    aligned; else copied (the only phase at stride 1 is the whole of dX unless a crop is needed).
    `phases`: dgrad_phases(geometry), if the caller keeps it. `conv`: the one-launch conv of all phases (e.g.
    side_by_side_launch); with one, every phase runs in one conv where `side_by_side_plan` applies and
    dX's pixels are 16-byte aligned. `in_place`: hand fprop and conv w' as FlippedFilters (w read in place) where
    w can be read in place (`reads_in_place`), not as copies (fprop and conv must take them). `zeros`:
    untapped_zeros' `launch`."""
    g = geometry
    in_place = in_place and reads_in_place(w, g.groups)
    plan = side_by_side_plan(g) if conv is not None and g.Ci * dy_nhwc.element_size() % 16 == 0 else None
    if plan is not None:
        return dgrad_side_by_side(dy_nhwc, w, g, plan, conv, in_place)
    G = g.groups
    strided = g.stride != (1, 1)
    phases = dgrad_phases(g) if phases is None else phases
    tapped = [phase for phase in phases if phase[2].taps is not None and phase[3].taps is not None]
    dx = None
    if strided:
        dx = torch.empty(g.N, g.H, g.W, g.Ci, device=dy_nhwc.device, dtype=dy_nhwc.dtype)
        if len(tapped) < len(phases):
            # pixels no tap reaches have a gradient of 0 (a 1x1 conv at stride 2: three phases of four): one
            # launch writes them, and only them
            untapped_zeros(dx, g, phases, zeros)
    # w'[ci, r', s', co] = w[co, the phase's taps reversed, ci]; grouped (section 10 of lesson 05), group k's
    # filters swap their channels among themselves: w' is [Ci, r', s', Co / groups]. Every phase's in one launch,
    # or (in place) none: the kernel reads w where it lies.
    phase_taps = [(along_h.taps, along_w.taps) for _, _, along_h, along_w in tapped]
    w_phases = filters_in_place(w, phase_taps) if in_place else flipped_weights(w, phase_taps, G)
    for (py, px, along_h, along_w), w_phase in zip(tapped, w_phases):
        conv = dict(padding=(along_h.padding, along_w.padding), dilation=(along_h.dilation, along_w.dilation),
                    groups=G)
        out = None
        if not strided:                           # one phase: the conv's output is dX, unless cropped
            out = fprop(dy_nhwc, w_phase, **conv)
            if out.shape[1:3] == (g.H, g.W):
                return out
            dx = torch.empty(g.N, g.H, g.W, g.Ci, device=dy_nhwc.device, dtype=dy_nhwc.dtype)
        window = OutputWindow(dx[:, py::g.stride[0], px::g.stride[1]], along_h.crop, along_w.crop)
        if out is None and window_storable(window.view):
            fprop(dy_nhwc, w_phase, **conv, out_window=window)    # the conv stores into dX's phase itself
        else:
            # a crop at stride 1, or pixels not 16-byte aligned in dX: the phase's output is copied in
            window.write(fprop(dy_nhwc, w_phase, **conv) if out is None else out)
    return dx


class SideBySide(NamedTuple):
    # Section 2b: every phase of a strided dgrad as one conv of dY.
    source: ConvGeometry       # the forward conv whose dX this computes
    geometry: ConvGeometry     # that conv: dY in, the phases' columns out, the union of their windows
    phases: WindowPhases       # where each phase's columns go and which taps they run
    taps: tuple                       # each phase's (taps along r, taps along s) of w: slices, for flipped_weights
    config: tuple                     # lesson 05's config


def side_by_side_config(geometry, arch=None):
    """Lesson 05's config for the one-launch conv, picked among its candidates without tails or split-K.
    Tuned over ResNet-18's and Inception v3's strided 3x3 dgrads (results/notebook.md): 128 x 128 x 64 tiles, 6 stages, 8 warps where dX's channels come in
    whole 128-column tiles, else 256 x 64 x 64 tiles, 4 stages, 8 warps (less padding of the
    phases' width). (On ResNet-50's own layers ping-pong or 128 x 256 tiles were as fast or faster;
    they are not the tuning set.) Elsewhere dgrad_config's. `arch`: the build's ("sm_90" or
    "sm_100"); None: this machine's GPU (none: dgrad_config's)."""
    if not (is_hopper() if arch is None else arch == "sm_90"):
        return dgrad_config(geometry)
    if geometry.Ci % 128 == 0:
        return fprop.KernelConfig(128, 128, 64, 6, 8)
    return fprop.KernelConfig(256, 64, 64, 4, 8)


def axis_window(along):
    """(first row, dilation, taps, ((first tap, taps) per residue)) of the union of one axis's phases'
    windows (`along`: AxisPhase per residue 0, 1, ...), or None where they do not line up."""
    dilation = along[0].dilation
    firsts = [phase.crop - phase.padding for phase in along]      # the dY row a phase's row 0 reads first
    origin = min(firsts)
    if any((first - origin) % dilation for first in firsts):
        return None
    rectangle = tuple(((first - origin) // dilation, len(range(phase.taps.start, phase.taps.stop, phase.taps.step)))
                      for first, phase in zip(firsts, along))
    return origin, dilation, max(start + taps for start, taps in rectangle), rectangle


def side_by_side_plan(geometry, config=None):
    """Section 2b's plan for the dgrad of `geometry`, or None where it does not apply: groups, stride
    1, a stride above 4 (the kernel picks a phase's taps by an unrolled loop over the residues), a
    phase without taps or rows, windows that do not line up, or corners a TMA im2col descriptor
    cannot encode. Arithmetic on the shape alone: kept per shape and config. `config`: lesson 05's
    (default side_by_side_config's), without split-K (the window stores whole tiles)."""
    config = fprop.KernelConfig(*(config or side_by_side_config(geometry)))
    if config.split_k != 1:
        raise ValueError(f"config {config}: the one-launch conv stores through an output window, whole tiles: split_k=1")
    return _side_by_side_plan(geometry, config)


@functools.lru_cache(maxsize=256)
def _side_by_side_plan(geometry, config):
    g = geometry
    sh, sw = g.stride
    phases = dgrad_phases(g)
    if g.groups != 1 or (sh, sw) == (1, 1) or max(sh, sw) > 4 or len(phases) != sh * sw or any(
            along_h.taps is None or along_w.taps is None for _, _, along_h, along_w in phases):
        return None
    windows = [axis_window([phases[p][2] for p in range(0, sh * sw, sw)]),     # residues along h, then w
               axis_window([phases[p][3] for p in range(sw)])]
    if None in windows:
        return None
    (first_h, dil_h, R, along_h), (first_w, dil_w, S, along_w) = windows
    width = -(-g.Ci // config.tile_n) * config.tile_n
    conv = ConvGeometry(g.N, g.out_h, g.out_w, g.Co, sh * sw * width, R, S, (1, 1), (-first_h, -first_w),
                               (dil_h, dil_w), -(-g.H // sh), -(-g.W // sw))
    try:
        conv_im2col_settings(conv)
    except ValueError:
        return None
    taps = tuple((along_h.taps, along_w.taps) for _, _, along_h, along_w in phases)
    return SideBySide(g, conv, WindowPhases(width, g.Ci, along_h, along_w), taps, config)


def dgrad_side_by_side(dy_nhwc, w, geometry, plan, conv, in_place=False):
    """dX in one launch: `plan` (side_by_side_plan of `geometry`) run by conv(dy, w_side_by_side, plan,
    out_window), lesson 05's kernel on a GPU (`side_by_side_launch`), torch on a CPU
    (`reference_side_by_side`). `in_place`: w_side_by_side is a FlippedFilter of w (read in place), not a copy."""
    g = geometry
    if plan is None or plan.source != g:
        raise ValueError(f"plan must be side_by_side_plan of {g.describe()}, got "
                         f"{'None' if plan is None else 'the plan of ' + plan.source.describe()}")
    if tuple(dy_nhwc.shape) != g.output_shape_nhwc or tuple(w.shape) != (g.Co, g.R, g.S, g.Ci):
        raise ValueError(f"dy_nhwc {tuple(dy_nhwc.shape)} and w {tuple(w.shape)}: {g.describe()} needs "
                         f"{g.output_shape_nhwc} and {(g.Co, g.R, g.S, g.Ci)}")
    dx = torch.empty(g.N, g.H, g.W, g.Ci, device=dy_nhwc.device, dtype=dy_nhwc.dtype)
    weights = side_by_side_in_place(w, plan) if in_place else flipped_weights(w, plan.taps, width=plan.phases.width)
    conv(dy_nhwc, weights, plan, OutputWindow(dx, phases=plan.phases))
    return dx


def side_by_side_launch(dy_nhwc, w_side_by_side, plan, out_window):
    # Lesson 05's kernel, launched plainly, on the one-launch conv, its tiles in phase_order's order.
    if out_window.phases is None:
        raise ValueError("out_window must carry the plan's phases (OutputWindow(dx, phases=plan.phases))")
    arch, num_sms = tma_mma_arch_and_sms("side_by_side_launch")
    order = phase_order(plan, fprop.tile_counts(plan.config, plan.geometry.M, plan.geometry.Co, num_sms)[0])
    out_window = out_window._replace(phases=out_window.phases._replace(order=order))
    launch = fprop.prepare_launch(dy_nhwc, w_side_by_side, None, plan.geometry, plan.config, arch, num_sms,
                                     out_window=out_window)
    fprop.conv2d_fprop_kernel[launch.grid](*launch.kernel_args(), **fprop.kernel_constexprs(plan.config, arch))


def taps_per_tile(plan, order=None):
    """The taps each tile of the one-launch conv runs (its k-steps, over dY's channel blocks), in the order the
    kernel numbers the tiles: lesson 05's grouped order over the phases side by side (`order` None), or
    the phases one after another in `order` (WindowPhases.order), each phase's tiles in that order."""
    phases, config = plan.phases, fprop.KernelConfig(*plan.config)
    num_pid_m, num_pid_n = fprop.tile_grid(config, plan.geometry.M, plan.geometry.Co)
    per_phase = phases.width // config.tile_n
    taps = [phases.along_h[p // len(phases.along_w)][1] * phases.along_w[p % len(phases.along_w)][1]
            for p in range(phases.count)]
    if order is None:   # the forward kernel's order (fprop.tile_order): the phase of tile t's columns
        return [taps[fprop.tile_order(t, num_pid_m, num_pid_n)[1] // per_phase] for t in range(num_pid_m * num_pid_n)]
    return [taps[p] for (p,) in order for _ in range(num_pid_m * per_phase)]


def busiest_program(costs, programs):
    """The most any of `programs` persistent programs runs when program p takes tiles p, p + programs, ..."""
    return max(sum(costs[p::programs]) for p in range(min(programs, len(costs))))


def phase_order(plan, programs):
    """WindowPhases.heaviest_first() where, on `programs` programs, it lightens the busiest program by more
    than 5% against lesson 05's order; else None (lesson 05's order, which reads dY about once). Arithmetic
    on the shape alone: kept per shape, config and programs."""
    return _phase_order(plan.source, plan.config, programs)


@functools.lru_cache(maxsize=256)
def _phase_order(source, config, programs):
    plan = side_by_side_plan(source, config)
    heaviest = plan.phases.heaviest_first()
    if busiest_program(taps_per_tile(plan, heaviest), programs) < 0.95 * busiest_program(taps_per_tile(plan), programs):
        return heaviest
    return None


def reads_in_place(w, groups=1):
    """Whether lesson 05's kernel reads w [Co, R, S, Ci] in place as a dgrad's weights (lesson 06's weights read in place): on a
    GPU, fp16 or bf16, groups 1, w contiguous and 16-byte aligned, its rows of R*S*Ci elements whole
    16-byte vectors (`FlippedFilter.readable`)."""
    return w.is_cuda and groups == 1 and FlippedFilter.readable(w)


def taps_read(taps, size):
    # (first, step, count) of a slice of range(size): the taps of w a phase reads
    picked = range(size)[taps]
    return picked.start, picked.step, len(picked)


def filters_in_place(w, phase_taps):
    """[FlippedFilter of each phase]: flipped_weights(w, phase_taps)'s w', read from w where it lies."""
    _, R, S, _ = w.shape
    return [FlippedFilter(w, ((0, *taps_read(taps_h, R)),), ((0, *taps_read(taps_w, S)),))
            for taps_h, taps_w in phase_taps]


def side_by_side_in_place(w, plan):
    """Section 2b's weights as one FlippedFilter: residue a along h runs the conv's taps from
    plan.phases.along_h[a][0] on, reading the taps of w its phases have (plan.taps), reversed; so along w."""
    _, R, S, _ = w.shape
    sw = len(plan.phases.along_w)
    return FlippedFilter(
        w, tuple((r0, *taps_read(plan.taps[a * sw][0], R)) for a, (r0, _) in enumerate(plan.phases.along_h)),
        tuple((s0, *taps_read(plan.taps[b][1], S)) for b, (s0, _) in enumerate(plan.phases.along_w)))


def dgrad(dy_nhwc, w, geometry, fprop, fold=None, phases=None, conv=None, in_place=False, zeros=None):
    """dX by `dgrad_by_phases`: of the conv `geometry`, or, given its `stride_fold`, of the folded
    conv, unfolded (kernels/gradients.py's stride fold). `phases`: dgrad_phases of the conv the phases run; `conv`:
    the one-launch conv, where all phases may run as one; `in_place`: the weights read in place; `zeros`:
    how to launch untapped_zeros' kernel."""
    if fold is None:
        return dgrad_by_phases(dy_nhwc, w, geometry, fprop, phases, conv, in_place, zeros)
    dx_folded = dgrad_by_phases(dy_nhwc, fold_weight(w, fold), fold.geometry, fprop, phases, conv, in_place, zeros)
    return unfold_input_grad(dx_folded, geometry, fold)


def relu_gated_in_epilogue(geometry, fold=None):
    """Whether dgrad's epilogue can apply ReLU's backward: dX is one conv's whole output (no fold,
    stride 1, padding <= dilation * (R - 1) on each axis)."""
    g = geometry
    return fold is None and epilogue_gates(g.stride, g.padding, g.dilation, (g.R, g.S))


def epilogue_gates(stride, padding, dilation, kernel_size):
    # relu_gated_in_epilogue's test on the conv's hyper-parameters alone ((h, w) pairs; a fold needs a stride)
    return tuple(stride) == (1, 1) and all(p <= d * (k - 1) for p, d, k in zip(padding, dilation, kernel_size))


def dgrad_through_relu(dy_nhwc, w, relu_out, geometry, fprop, **options):
    """dZ of z -> relu_out = relu(z) -> conv(relu_out, w) from dY: dX where relu_out > 0, else 0.
    Where relu_gated_in_epilogue, `fprop` is called with relu_out as its residual and activation
    "relu_grad" (lesson 05's epilogue gates the tile); else the gate is applied to dgrad's dX.
    `options`: dgrad's (fold, phases, conv, in_place, zeros)."""
    if relu_gated_in_epilogue(geometry, options.get("fold")):
        def gated(dy, w_phase, **conv):
            return fprop(dy, w_phase, **conv, residual=relu_out, activation=RELU_GRAD)
        return dgrad(dy_nhwc, w, geometry, gated, **options)
    dx = dgrad(dy_nhwc, w, geometry, fprop, **options)
    return torch.where(relu_out > 0, dx, torch.zeros((), dtype=dx.dtype, device=dx.device))
