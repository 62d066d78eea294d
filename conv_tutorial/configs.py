"""Configs of lesson 05's kernel and all the tile and shared-memory accounting the operator does
with them: the candidates it chooses among per architecture, the shared memory and registers a
config needs, and the share of useful work it does on a shape.

What the kernel itself must know (`KernelConfig`, the combinations it implements, its shared memory
and register budget, its tile grid and split tiles) is defined beside the kernel, in kernels/fprop.py,
and named here: one home per fact.
"""
import functools

import triton

from .kernels import fprop

KernelConfig, FIXED_CONFIG, check_config = fprop.KernelConfig, fprop.FIXED_CONFIG, fprop.check_config
PINGPONG_CONFIG = FIXED_CONFIG._replace(consumers=2)   # lesson 05, section 4: Hopper's ping-pong
SHARED_MEMORY_PER_PROGRAM, ring_bytes, stores_by_row_blocks, tile_counts = (
    fprop.SHARED_MEMORY_PER_PROGRAM, fprop.ring_bytes, fprop.stores_by_row_blocks, fprop.tile_counts)
shared_memory_bytes, fits_shared_memory, register_budget = (
    fprop.shared_memory_bytes, fprop.fits_shared_memory, fprop.register_budget)
block_k_channels, groups_fit, check_groups_fit = (
    fprop.block_k_channels, fprop.groups_fit, fprop.check_groups_fit)


def _candidates():
    C = KernelConfig
    hopper = [
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4),
        C(block_m=128, block_n=256, block_k=64, num_buffers=3, num_warps=8),
        C(block_m=256, block_n=128, block_k=64, num_buffers=3, num_warps=8),
        C(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8),
        C(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4),
        C(block_m=256, block_n=64, block_k=64, num_buffers=4, num_warps=8),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, consumers=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, consumers=2),
        C(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4, consumers=2),
        C(block_m=64, block_n=128, block_k=64, num_buffers=6, num_warps=4, consumers=2),
        C(block_m=128, block_n=64, block_k=64, num_buffers=4, num_warps=4, programs_per_sm=2),
        C(block_m=64, block_n=128, block_k=64, num_buffers=4, num_warps=4, programs_per_sm=2),
        # 160- and 96-wide tiles (Co = 320, 640, 96, 192, ...): a 32-column tail beside the main MMA
        C(block_m=256, block_n=128, block_k=32, num_buffers=5, num_warps=8, block_n_tail=32),
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_n_tail=32),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, consumers=2, block_n_tail=32),
        C(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4, block_n_tail=32),
        # 32-deep K blocks, for channel counts that are not a multiple of 64 (Ci = 96, 160, 288: none
        # wasted; 80: 17% instead of 38%): half the bytes per stage, so twice the stages
        C(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4),
        C(block_m=128, block_n=256, block_k=32, num_buffers=6, num_warps=8),
        C(block_m=256, block_n=128, block_k=32, num_buffers=6, num_warps=8),
        C(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4, consumers=2),
        C(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4, block_n_tail=32),
        C(block_m=128, block_n=64, block_k=32, num_buffers=10, num_warps=4, block_n_tail=32),
        # 192-wide tiles (Co = 192, 384, 576: none wasted), 8 warps for the 192 x 128 accumulator
        C(block_m=128, block_n=128, block_k=32, num_buffers=6, num_warps=8, block_n_tail=64),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=8, block_n_tail=64),
        # split-K, for layers with fewer tiles than SMs (lesson 05, section 7)
        C(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8, split_k=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8, split_k=3),
        C(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8, split_k=4),
        # 8 slices: batch 1's 7x7 layers (ResNet-50's 512->512 3x3: 4 tiles, 72 k-steps)
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, split_k=8),
        C(block_m=128, block_n=256, block_k=64, num_buffers=3, num_warps=8, split_k=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_n_tail=32, split_k=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_n_tail=32, split_k=4),
        # 192-row tiles: a 64-row tail below the main MMA (ResNet-50's 7x7 layers at batch 128:
        # M = 6272 = 32.7 x 192, so Co=512 makes 33 x 4 = 132 tiles, one per SM of an H100)
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, block_m_tail=64),
        # stores by row blocks: a 5th stage fits
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_m_tail=64),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=8, block_m_tail=64),
        C(block_m=128, block_n=128, block_k=64, num_buffers=3, num_warps=4, consumers=2, block_m_tail=64),
    ]
    blackwell = [
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4),
        C(block_m=128, block_n=256, block_k=64, num_buffers=3, num_warps=4),
        C(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, block_n_tail=32),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, split_k=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, split_k=4),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, block_n_tail=32, split_k=2),
    ]
    return hopper, blackwell


HOPPER_CANDIDATES, BLACKWELL_CANDIDATES = _candidates()
CANDIDATES = {"sm_90": HOPPER_CANDIDATES, "sm_100": BLACKWELL_CANDIDATES}
SMEM_LIMIT_BYTES = {arch: SHARED_MEMORY_PER_PROGRAM for arch in ("sm_90", "sm_100")}
SMEM_PER_SM_BYTES = fprop.SHARED_MEMORY_PER_SM          # 228 KB per SM, 1 KB of it reserved per program


def wasted_columns(Co, tile_n):
    """Output columns computed past Co, summed over the row of tiles."""
    return triton.cdiv(Co, tile_n) * tile_n - Co


def wave_efficiency(units, num_sms):
    """The share of SM slots busy over the waves of `units` equal units of work."""
    return units / (triton.cdiv(units, num_sms) * num_sms)


def k_share(config, geometry):
    """The share of each filter tap's K blocks that holds channels, not the zeros TMA fills in past
    Ci: Ci = 80 in 64-deep blocks is 80 / 128; in 32-deep ones 80 / 96."""
    block_k = block_k_channels(config, geometry.Ci_group, 2)      # the K block the launch will use (bf16)
    return geometry.Ci_group / (triton.cdiv(geometry.Ci_group, block_k) * block_k)


def k_steps_of(config, geometry):
    """The K loop's length for this config (about: small Ci gets a smaller K block)."""
    return geometry.R * geometry.S * triton.cdiv(geometry.Ci_group, config.block_k)


def tail_pays(config, geometry, num_sms):
    """A tile widened by a tail saves work where it computes fewer columns past Co (Co=320: 2 x 160
    instead of 3 x 128), or fills the SMs better at no extra columns (Co=1280 on a 16x16 map:
    16 x 8 = 128 tiles of 160 on 132 SMs instead of 160 tiles of 128, 1.2 waves)."""
    plain = config._replace(block_n_tail=0)
    wasted, wasted_plain = wasted_columns(geometry.Co, config.tile_n), wasted_columns(geometry.Co, plain.tile_n)
    if wasted != wasted_plain:
        return wasted < wasted_plain
    return useful_share(config, geometry, num_sms) > useful_share(plain, geometry, num_sms)



@functools.lru_cache(maxsize=None)
def grouped_conv_fits(Ci_group, Co_group, arch=None):
    """Whether candidate configs of `arch` ("sm_90", "sm_100"; None: of both) run a grouped conv of
    these channels per group (fp16/bf16), each tile inside one group (lesson 05, section 10)."""
    return all(any(groups_fit(KernelConfig(*c), Ci_group, Co_group) for c in CANDIDATES[a])
               for a in ([arch] if arch else CANDIDATES))




def residual_fits_in_registers(config, arch="sm_90"):
    """Whether a config's build with a residual epilogue keeps its tile in registers (Hopper; on
    Blackwell the accumulator lives in tensor memory). The consumer holds TILE_M x TILE_N fp32
    accumulators spread over its threads, and beside them the residual of the rows it stores at
    once, bf16 (half a register per value): the whole tile, or where the tile is stored by row
    blocks (lesson 05, section 6) half the main rows; against the kernel's register_budget with a
    residual (tests check this against the stack frame of every candidate's build)."""
    if arch != "sm_90":
        return True
    accumulators = accumulator_registers(config)
    stored_rows = config.block_m // 2 if stores_by_row_blocks(config) else config.tile_m
    residual = accumulators * stored_rows // (2 * config.tile_m)
    return accumulators + residual <= register_budget(config, arch, residual=True)


def accumulator_registers(config):
    """The fp32 accumulators of a tile per thread of a consumer (on Hopper, where they live in registers)."""
    return config.tile_m * config.tile_n // (32 * config.num_warps)


def fitted_to_epilogue(config, has_residual, arch="sm_90"):
    """How to run, given the epilogue, a config chosen without it (the heuristic's, or a plain
    conv's tuned choice); the autotuner times its candidates this way too when the call has a
    residual. A residual tile adds registers, and a row tail on 4-warp consumers has no room for
    them: its build spills, so it moves to one 8-warp consumer, the same tile with half the registers
    per thread, which measured faster. Other builds that spill a little are kept: letting the
    heuristic pick one with room instead measured slower (results/notebook.md, the epilogue's
    tuning)."""
    if has_residual and config.block_m_tail and not residual_fits_in_registers(config, arch):
        return config._replace(num_warps=8, consumers=1, num_buffers=4)
    return config



def split_tiles(config, geometry, num_sms):
    """(programs, tiles, tiles split by split-K), as the forward kernel's launch counts them (tile_counts)."""
    programs, tiles, whole = tile_counts(config, geometry.M, geometry.Co, num_sms)
    return programs, tiles, tiles - whole


def useful_share(config, geometry, num_sms):
    """The share of the work a config does that is useful: columns past Co, rows past M and
    channels past Ci (k_share) are wasted, and so are the SM slots idle in the last wave (of tiles,
    or of split-K's slices)."""
    programs, tiles, split = split_tiles(config, geometry, num_sms)
    useful = geometry.M * geometry.Co / (tiles * config.tile_m * config.tile_n)
    # time in tile-lengths: the waves of whole tiles, then the slices' waves, 1/split_k long each
    time = triton.cdiv(tiles - split, programs) + triton.cdiv(split * config.split_k, programs) / config.split_k
    return useful * k_share(config, geometry) * tiles / (num_sms * config.programs_per_sm * time)


def split_k_workspace_bytes(config, geometry, num_sms):
    """Bytes split-K moves through its fp32 workspace: each slice of a split tile, written and read."""
    return 2 * config.split_k * split_tiles(config, geometry, num_sms)[2] * config.tile_m * config.tile_n * 4


