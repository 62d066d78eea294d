"""The kernel's side of conv_tutorial.core.windows: a strided dgrad's phases (`PhaseTiles`), a filter
read in place (`FlippedTaps`), the store into an output window (`WindowStore`) and the per-channel
sums of BatchNorm (`add_channel_sums`). Each is a constexpr None when a launch does not use it, and then
compiles to nothing."""
from typing import Union

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

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


# Per-channel statistics from the epilogue, for BatchNorm in training



@gluon.jit
def add_channel_sums(stats_ptr, staged, m0, co0, M, Co):
    """Add the per-channel sum and sum of squares of a tile of the output, staged in shared memory
    (`staged`: rows are output pixels m0, m0+1, ... of which those < M count; columns channels co0,
    co0+1, ... of which those < Co count), into rows 0 and 1 of `channel_stats`, fp32 [2, Co],
    zeroed, that every program adds into (lesson 08): atomically (tiles arrive in any
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
