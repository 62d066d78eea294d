"""What lesson 05's kernel can be compiled for: its configs, the combinations it implements, and
the shared-memory arithmetic that the kernel, its launcher and the runtime share.

    from conv_config import KernelConfig, check_config
    check_config(KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4), "sm_90")

A config fixes what the kernel is compiled for: the tile (BLOCK_M x BLOCK_N x BLOCK_K, plus an
optional tail, lesson 05 section 6), the ring depth, the warps of each MMA/epilogue partition, the
programs per SM, the consumers per program (section 4) and the K slices (section 7). Combinations
the kernel does not implement get a ValueError rather than a compile error or a hang.
"""
from typing import NamedTuple

import triton
from triton.experimental import gluon


class KernelConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_buffers: int        # stages in the shared-memory ring
    num_warps: int          # warps of each MMA/epilogue partition
    programs_per_sm: int = 1
    consumers: int = 1      # 2: Hopper ping-pong (section 4)
    block_n_tail: int = 0   # section 6: extra output columns per tile, in a second MMA
    split_k: int = 1        # section 7: slices of the K loop, summed by a second kernel
    block_m_tail: int = 0   # section 6: extra output rows (pixels) per tile, in a second MMA (Hopper)

    @property
    def tile_m(self):
        return self.block_m + self.block_m_tail

    @property
    def tile_n(self):
        return self.block_n + self.block_n_tail

    def __str__(self):
        extras = ([f"{self.programs_per_sm}/SM"] if self.programs_per_sm > 1 else []) + \
                 (["ping-pong"] if self.consumers > 1 else []) + \
                 ([f"split-K {self.split_k}"] if self.split_k > 1 else [])
        width = f"({self.block_n}+{self.block_n_tail})" if self.block_n_tail else f"{self.block_n}"
        height = f"({self.block_m}+{self.block_m_tail})" if self.block_m_tail else f"{self.block_m}"
        return (f"{height}x{width}x{self.block_k} {self.num_buffers} stages "
                f"{self.num_warps} warps" + "".join(f", {e}" for e in extras))


FIXED_CONFIG = KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4)  # both archs
PINGPONG_CONFIG = FIXED_CONFIG._replace(consumers=2)   # Hopper only


def check_config(config, arch):
    """Combinations the kernel does not implement get a ValueError naming the config."""
    def refuse(why):
        raise ValueError(f"config {config}: {why}")
    if config.consumers > 2 or (config.consumers > 1 and arch != "sm_90"):
        refuse(f"consumers={config.consumers}; ping-pong (2 consumers) is a Hopper schedule, elsewhere 1")
    if config.programs_per_sm > 1 and arch != "sm_90":
        refuse("programs_per_sm > 1 is offered on Hopper only")
    if arch == "sm_100" and config.block_m not in (64, 128):
        refuse("on Blackwell block_m must be 64 or 128 (a TMEM accumulator has 128 lanes)")
    if arch == "sm_100" and 2 * config.tile_n > 512:
        refuse(f"two fp32 accumulators of {config.tile_n} columns exceed the 512 columns of tensor memory")
    if config.split_k < 1 or (config.split_k > 1 and config.consumers > 1):
        refuse("split_k must be >= 1, and split-K runs with one consumer (section 7)")
    if config.block_m_tail:                                                  # section 6
        if arch != "sm_90" or config.block_n_tail:
            refuse("a row tail (block_m_tail) is a Hopper schedule, and a tile has a tail in rows or "
                   "in columns, not both")
        if config.block_m_tail not in (64, 128) or config.block_m not in (config.block_m_tail, 2 * config.block_m_tail):
            refuse("block_m_tail must be 64 or 128 (whole WGMMA row blocks) and block_m once or twice "
                   "that (the pixels are loaded in boxes of the tail's height)")
    if stores_by_row_blocks(config) and (
            config.consumers != 1 or config.block_n_tail or config.block_m // (16 * config.num_warps) < 2
            or config.block_m_tail not in (0, config.block_m // 2) or arch != "sm_90"):
        refuse(f"{config.num_buffers} stages leave no room for a staging buffer of the whole tile, and "
               f"storing it by row blocks (section 6) needs Hopper, one consumer of block_m / 32 warps or "
               f"fewer, no column tail, and a row tail (if any) of block_m / 2; use fewer stages")


SHARED_MEMORY_PER_PROGRAM = 232448    # bytes: the opt-in maximum of a program on an H100 or B200


@gluon.constexpr_function
def ring_bytes(config, element_size=2):
    """Shared memory of the ring: per stage, the A rows of a tile and the B rows, BLOCK_K deep."""
    config = KernelConfig(*config)    # (a constexpr function's argument arrives as a plain tuple)
    return config.num_buffers * (config.tile_m + config.tile_n) * config.block_k * element_size


@gluon.constexpr_function
def stores_by_row_blocks(config, element_size=2):
    """Section 6: whether the epilogue stores each tile in blocks of half its main rows through one
    staging buffer of that height, where a staging buffer of the whole tile would not fit beside
    the ring. (A constexpr function: the host and the kernel ask the same question.)"""
    config = KernelConfig(*config)
    whole_tile = config.consumers * config.tile_m * config.tile_n * element_size
    return ring_bytes(config, element_size) + whole_tile > SHARED_MEMORY_PER_PROGRAM


def adapt_block_k(config, Ci_padded):
    """Small channel counts (a padded Ci of 8 or 16) get a smaller K block: fewer zeros multiplied."""
    if Ci_padded < config.block_k:
        config = config._replace(block_k=max(16, triton.next_power_of_2(Ci_padded)))
    return config


def block_k_channels(config, Ci_padded, element_size):
    """The K block in channels of the operand's dtype. A config's BLOCK_K counts 2-byte channels
    (64 of them: 128 bytes), so 1-byte e4m3 takes twice as many (lesson 05, section 9); fewer for
    small channel counts (adapt_block_k), never below an MMA's K of 32 bytes."""
    block_k = adapt_block_k(config._replace(block_k=config.block_k * 2 // element_size), Ci_padded).block_k
    return max(block_k, 32 // element_size)


def groups_fit(config, Ci_group, Co_group, element_size=2):
    """Whether a grouped conv's tiles stay inside one group (lesson 05, section 10): each tile's
    columns in one group's Co_group output channels, each K block in its Ci_group input channels."""
    return Ci_group % block_k_channels(config, Ci_group, element_size) == 0 and Co_group % config.tile_n == 0


def check_groups_fit(config, geometry, element_size=2):
    if geometry.groups > 1 and not groups_fit(config, geometry.Ci_group, geometry.Co_group, element_size):
        raise ValueError(f"config {config}: {geometry.describe()} has {geometry.Ci_group} input and "
                         f"{geometry.Co_group} output channels per group; a tile must stay in one group, so "
                         f"they must be multiples of the K block "
                         f"({block_k_channels(config, geometry.Ci_group, element_size)}) and of the tile's "
                         f"{config.tile_n} columns")


def tile_counts(config, M, Co, num_sms):
    """(programs, tiles, whole tiles) of a launch: the persistent grid, the conv's output tiles,
    and how many of them run whole (section 7 splits those past the last full wave)."""
    tiles = triton.cdiv(M, config.tile_m) * triton.cdiv(Co, config.tile_n)
    programs = min(config.programs_per_sm * num_sms, tiles * config.split_k)
    return programs, tiles, (tiles // programs * programs if config.split_k > 1 else tiles)
