"""Lesson 05's kernel, tested beyond the lesson's own tests: awkward shapes, ping-pong consumers,
the fused epilogue and bad input (through the plain launcher and through the operator's runtime,
which runs the same kernel), the tails of section 6, split-K of section 7 and the grouped convs of
section 10 on the GPU against torch, and the structure of the kernel's sm_90 and sm_100 builds
(their PTX, compiled ahead of time, so these run on a CPU too). Sections 6 and 7 live in the
operator's copy of the kernel (conv_tutorial/kernels/fprop.py), which the lesson tours: their
configs are launched and built there; every other config runs the lesson's own kernel."""
import functools

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch
import triton

lesson05 = common.load_lesson("05-warp-specialized-conv")
from conv_tutorial import configs, runtime  # noqa: E402
from conv_tutorial.configs import KernelConfig, FIXED_CONFIG, PINGPONG_CONFIG, check_config, ring_bytes, \
    stores_by_row_blocks, SHARED_MEMORY_PER_PROGRAM  # noqa: E402
from conv_tutorial.kernels import fprop  # noqa: E402  (Part II's tails and split-K: the operator's copy)
Epilogue, ConvLaunch, needs_gpu = lesson05.Epilogue, fprop.ConvLaunch, lesson05.needs_gpu


def conv2d_fprop_launch(*args, config=FIXED_CONFIG, **kwargs):
    """Lesson 05's plain launcher; a Part II config (a tail, row-block stores, split-K) through the
    plain launcher of the operator's copy of the kernel, where those sections' lines live."""
    entry = lesson05.conv2d_fprop_launch if lesson05.part_one_config(config) else fprop.conv2d_fprop_launch
    return entry(*args, config=config, **kwargs)


def finish_split_k(launch, bias=None, scale=None, residual=None, activation="none"):
    """Split-K's second kernel, launched plainly as the operator's plain launcher does."""
    grid, args, constexprs = fprop.split_k_epilogue_launch(launch, bias, scale, residual, activation)
    fprop.split_k_epilogue_kernel[grid](*args, **constexprs)


def conv2d_fprop_fixed(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=FIXED_CONFIG, **epilogue):
    """The same kernel with one given config, through the operator's runtime (no autotuning)."""
    return runtime.conv2d(x_nhwc, w, bias, stride, padding, dilation, config=tuple(config), **epilogue)


def conv2d_fprop(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, **epilogue):
    """The same kernel through the runtime, its config autotuned per shape."""
    return runtime.conv2d(x_nhwc, w, bias, stride, padding, dilation, config=None, **epilogue)


needs_hopper = pytest.mark.skipif(
    not (common.has_tma_mma_gpu() and common.is_hopper()),
    reason=common.GLUON_SKIP_REASON if not common.has_tma_mma_gpu() else
    "the ping-pong schedule is Hopper's (sm_90); this GPU is not a Hopper")


def run_conv(entry, N, H, W, Ci, Co, R, S, stride, padding, dilation=1, dtype=torch.bfloat16,
             with_bias=False, seed=0):
    return common.check_conv(entry, N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype=dtype,
                             with_bias=with_bias, seed=seed)


AWKWARD_CASES = [
    (16, 32, 32, 5, 96, 3, 3, 1, 1, 1, torch.bfloat16, False),         # Ci=5 padded to 8
    (1, 1, 8, 96, 128, 1, 2, (1, 2), 0, 1, torch.bfloat16, False),     # asymmetric stride
    (4, 56, 56, 3, 64, 7, 7, 2, 3, 1, torch.float16, True),            # ResNet stem
    (2, 32, 32, 64, 64, 3, 3, 1, 2, 2, torch.bfloat16, False),         # dilation 2
    (2, 32, 32, 128, 200, 3, 3, 1, 1, 1, torch.bfloat16, True),        # bias, Co not a multiple of 8*16
    (8, 30, 26, 256, 128, 3, 3, 1, 1, 1, torch.float16, True),         # fp16, non-square
    (3, 17, 23, 40, 48, 3, 5, (2, 1), (1, 2), 1, torch.float16, False),  # odd sizes
    (8, 14, 14, 64, 64, 1, 1, 1, 0, 1, torch.bfloat16, False),         # one k-step: k_steps == 1 arrives as a constant
]


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias", AWKWARD_CASES)
def test_awkward_cases(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias):
    run_conv(conv2d_fprop_launch, N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias)


@needs_hopper
@pytest.mark.parametrize("config", [PINGPONG_CONFIG, KernelConfig(128, 64, 64, 6, 4, consumers=2),
                                    KernelConfig(64, 128, 64, 6, 4, consumers=2)], ids=str)
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias", [
    (128, 64, 64, 384, 384, 3, 3, 1, 1, torch.bfloat16, False),   # ~30 tiles per program: turns cycle
    (128, 64, 64, 416, 416, 5, 5, 2, 0, torch.bfloat16, True),    # long K loop, stride 2, bias
    (64, 32, 32, 64, 200, 1, 1, 1, 0, torch.float16, True),       # 1 k-step < ring depth; Co=200
    (128, 14, 14, 256, 256, 3, 3, 1, 1, torch.bfloat16, False),   # a ResNet-50 layer
    (3, 17, 23, 40, 48, 3, 5, (2, 1), (1, 2), torch.float16, False),  # fewer tiles than programs
])
def test_pingpong_consumers(config, N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias):
    run_conv(functools.partial(conv2d_fprop_launch, config=config), N, H, W, Ci, Co, R, S, stride,
             padding, 1, dtype, with_bias)


FUSED_EPILOGUES = [Epilogue(True, True, True, "relu"), Epilogue(False, False, True, "none"),
                   Epilogue(True, False, False, "silu")]


@needs_gpu
@pytest.mark.parametrize("epilogue", FUSED_EPILOGUES, ids=str)
def test_fused_epilogue(epilogue):
    """act(conv * scale + bias + residual) against torch: Co = 300 (a tile past Co), stride 2."""
    common.check_conv(conv2d_fprop_launch, 4, 30, 26, 96, 300, 3, 3, 2, 1, dtype=torch.bfloat16,
                      with_bias=epilogue.bias, scale=epilogue.scale, residual=epilogue.residual,
                      activation=epilogue.activation)


BAD_INPUTS = common.bad_conv_inputs(torch.float16) + [
    (lambda x, w: (x, w), {"dilation": (1, 0)}, ValueError, "dilation"),
    (lambda x, w: (x, w), {"bias": "zeros"}, TypeError, "bias"),
    (lambda x, w: (x, w), {"bias": torch.zeros(3)}, ValueError, "bias must have shape"),
    (lambda x, w: (x, w), {"scale": torch.zeros(3)}, ValueError, "scale must have shape"),
    (lambda x, w: (x, w), {"residual": torch.zeros(1, 6, 6, 16)}, ValueError, "residual must have"),
    (lambda x, w: (x, w), {"activation": "gelu"}, ValueError, "activation must be"),
]


@pytest.mark.parametrize("entry", ["conv2d_fprop_launch", "conv2d_fprop", "conv2d_fprop_fixed"])
@pytest.mark.parametrize("make_args, kwargs, error, message", BAD_INPUTS)
def test_rejects_bad_input(entry, make_args, kwargs, error, message):
    x_nhwc, w = common.random_conv_inputs(1, 8, 8, 8, 16, 3, 3, torch.bfloat16)
    kwargs = {k: v.to(x_nhwc.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=message):
        globals()[entry](*make_args(x_nhwc, w), **kwargs)


def test_unsupported_config_combinations_are_refused():
    for config, arch in [(PINGPONG_CONFIG, "sm_100"), (KernelConfig(128, 128, 64, 4, 4, consumers=3), "sm_90"),
                         (KernelConfig(128, 64, 64, 4, 4, programs_per_sm=2), "sm_100"),
                         (KernelConfig(256, 128, 64, 3, 8), "sm_100"),
                         (KernelConfig(128, 256, 64, 3, 4, block_n_tail=32), "sm_100"),
                         (KernelConfig(128, 128, 64, 4, 4, block_m_tail=64), "sm_100"),
                         (KernelConfig(128, 128, 64, 4, 4, block_n_tail=32, block_m_tail=64), "sm_90"),
                         (KernelConfig(128, 128, 64, 4, 4, block_m_tail=32), "sm_90"),
                         (KernelConfig(128, 128, 64, 5, 8, block_m_tail=64), "sm_90"),
                         (KernelConfig(128, 128, 64, 5, 4, consumers=2, block_m_tail=64), "sm_90"),
                         (KernelConfig(128, 128, 64, 4, 4, consumers=2, split_k=2), "sm_90")]:
        with pytest.raises(ValueError, match="config"):
            check_config(config, arch)


IM2COL_LOAD, WEIGHT_LOAD, TMA_STORE = common.PTX_IM2COL_LOAD, common.PTX_TILED_LOAD, common.PTX_TMA_STORE
GROUP_M = lesson05.GROUP_M.value
ENTRIES = {"conv2d_fprop_launch": conv2d_fprop_launch, "conv2d_fprop_fixed": conv2d_fprop_fixed}


def configs_for_this_machine(configs):
    """The configs this GPU's architecture implements (all of them on a machine without a GPU,
    where the GPU tests skip)."""
    if not common.has_tma_mma_gpu():
        return configs
    arch = "sm_90" if common.is_hopper() else "sm_100"
    kept = []
    for config in configs:
        try:
            check_config(config, arch)
            kept.append(config)
        except ValueError:
            pass
    return kept


def check_fused_epilogue(config, epilogue):
    """act(conv * scale + bias + residual) with `config` against torch: Co = 300, stride 2."""
    common.check_conv(functools.partial(conv2d_fprop_launch, config=config), 4, 30, 26, 96, 300, 3, 3, 2, 1,
                      dtype=torch.bfloat16, with_bias=epilogue.bias, scale=epilogue.scale,
                      residual=epilogue.residual, activation=epilogue.activation)


@needs_gpu
@pytest.mark.parametrize("config", configs_for_this_machine([PINGPONG_CONFIG]), ids=str)
@pytest.mark.parametrize("epilogue", FUSED_EPILOGUES, ids=str)
def test_pingpong_with_fused_epilogue(config, epilogue):
    check_fused_epilogue(config, epilogue)


def aot_ptx(arch, config=FIXED_CONFIG, **params):
    """The PTX of one build, for the tests below (skipped where this Triton cannot target `arch`):
    lesson 05's kernel, or for a Part II config the operator's copy (the same PTX where both build)."""
    stem, builder = (("05-warp-specialized-conv", "aot_conv2d_fprop") if lesson05.part_one_config(config)
                     else ("conv_tutorial.kernels.aot", "fprop_build"))
    return common.aot_compile_or_skip(stem, builder, arch, config=list(config), **params)


def test_pingpong_build_has_two_consumer_warpgroups():
    compiled = aot_ptx("sm_90", PINGPONG_CONFIG)
    ptx = compiled["ptx"]
    assert ".reqntid 384" in ptx                          # 2 consumer warpgroups + the loader's
    # registers: 240 for each consumer warpgroup, 24 for the loader
    assert "setmaxnreg.inc.sync.aligned.u32 \t240" in ptx and "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx
    # each consumer issues its own WGMMAs: twice the MMA code of a single consumer
    count = lambda p: common.ptx_instructions(p, ["wgmma.mma_async"])["wgmma.mma_async"]  # noqa: E731
    assert count(ptx) == 2 * count(aot_ptx("sm_90")["ptx"])
    assert compiled["shared"] <= configs.shared_memory_bytes(PINGPONG_CONFIG) + 1024


@pytest.mark.parametrize("arch, config", [
    ("sm_90", FIXED_CONFIG), ("sm_90", KernelConfig(128, 128, 64, 4, 4, consumers=2, block_n_tail=32)),
    ("sm_90", KernelConfig(256, 128, 32, 5, 8, block_n_tail=32)),
    ("sm_100", KernelConfig(128, 128, 64, 4, 4, block_n_tail=32)),
], ids=["sm_90", "sm_90-ping-pong-tail", "sm_90-256-tail", "sm_100-tail"])
def test_fused_epilogue_compiles_only_what_is_asked(arch, config):
    """The plain build reads nothing with plain loads (TMA does all its reading); each epilogue
    part adds its own instructions, in every schedule: the residual's and scale's loads, the
    ReLU's max, the SiLU's exponential."""
    build = lambda *epilogue: aot_ptx(arch, config, Co=320, epilogue=list(epilogue))["ptx"]  # noqa: E731
    count = lambda ptx, what: common.ptx_instructions(ptx, [what])[what]  # noqa: E731
    plain, relu = build(), build(False, False, False, "relu")
    fused, silu = build(True, True, True, "relu"), build(False, False, False, "silu")
    assert count(plain, "ld.global") == 0 and count(plain, "max.f32") == 0
    assert count(relu, "ld.global") == 0 and count(relu, "max.f32") > 0
    assert count(fused, "ld.global") > 0 and count(fused, "max.f32") > 0
    assert count(silu, "ex2.approx") > 0 and count(plain, "ex2.approx") == 0


@pytest.mark.parametrize("config, tmem_columns", [
    (FIXED_CONFIG, 256),                                        # 2 accumulators x 128 columns
    (KernelConfig(128, 128, 64, 4, 4, block_n_tail=32), 512),   # 2 x (128 + 32) = 320, allocated as 512
    (KernelConfig(128, 256, 64, 3, 4), 512),                    # 2 x 256: the whole tensor memory
    (KernelConfig(128, 64, 64, 6, 4), 128),
], ids=str)
def test_blackwell_build_synchronizes_as_reviewed(config, tmem_columns):
    """What the review of the Blackwell path (RESULTS.md) expects, checked in the sm_100 PTX."""
    compiled = aot_ptx("sm_100", config, Co=320 if config.block_n_tail else config.block_n)
    ptx = compiled["ptx"]
    counts = common.ptx_instructions(ptx, ["tcgen05.alloc", "tcgen05.commit", "tcgen05.mma",
                                           "mbarrier.init", "mbarrier.arrive.expect_tx",
                                           "mbarrier.arrive", "fence.proxy.async", TMA_STORE])
    # one TMEM allocation, a power of two of at least 2 * tile_n columns and at most 512
    assert counts["tcgen05.alloc"] == 1 and compiled["tmem_size"] == tmem_columns
    assert "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r" in ptx and f"], {tmem_columns};" in ptx
    # the MMA warp commits twice: once per k-step (releases the stage, after both MMAs of a tail
    # tile) and once per tile (hands the accumulator to the epilogue); no other tcgen05.commit
    assert counts["tcgen05.commit"] == 2
    # BLOCK_K=64 in k16 instructions: 4 tcgen05.mma per accumulator per k-step
    assert counts["tcgen05.mma"] == 4 * (2 if config.block_n_tail else 1)
    # barriers: ready + empty per stage, acc_ready + acc_empty per accumulator (no ping-pong turns)
    assert counts["mbarrier.init"] == 2 * config.num_buffers + 2 * 2
    # arrivals by software: the loader's expect (its arrival) and the epilogue's acc_empty arrive
    assert counts["mbarrier.arrive.expect_tx"] == 1 and counts["mbarrier.arrive"] == 2
    # each TMA store is preceded by a fence of the generic-proxy writes to its staging buffer
    stores = counts[TMA_STORE]
    assert stores == (2 if config.block_n_tail else 1) and counts["fence.proxy.async"] == stores


TAIL_CONFIGS = [KernelConfig(256, 128, 32, 5, 8, block_n_tail=32), KernelConfig(128, 128, 64, 5, 4, block_n_tail=32),
                KernelConfig(128, 128, 64, 4, 4, consumers=2, block_n_tail=32),
                KernelConfig(128, 64, 64, 6, 4, block_n_tail=32),
                KernelConfig(128, 128, 32, 6, 8, block_n_tail=64),    # 192-wide tiles, 32-deep K blocks
                KernelConfig(128, 128, 64, 4, 8, block_n_tail=64),
                # row tails (Hopper): 192-row tiles
                KernelConfig(128, 128, 64, 4, 4, block_m_tail=64), KernelConfig(128, 128, 64, 4, 8, block_m_tail=64),
                KernelConfig(128, 128, 64, 3, 4, consumers=2, block_m_tail=64),
                KernelConfig(128, 128, 64, 5, 4, block_m_tail=64),     # stores by row blocks
                KernelConfig(256, 128, 64, 4, 8)]                      # no tail, but stores by row blocks too


@needs_gpu
@pytest.mark.parametrize("config", configs_for_this_machine(TAIL_CONFIGS), ids=str)
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias", [
    (8, 32, 32, 320, 320, 3, 3, 1, 1, torch.bfloat16, True),      # SD-like: two 160-wide tiles
    (16, 20, 20, 128, 300, 3, 3, 1, 1, torch.float16, False),     # the last tail partly past Co
    (4, 15, 17, 64, 100, 3, 3, 2, 1, torch.bfloat16, True),       # Co below one main block
    (128, 14, 14, 256, 96, 1, 1, 1, 0, torch.bfloat16, False),    # 1x1, Co = 64 + 32
    (128, 7, 7, 512, 512, 1, 1, 1, 0, torch.bfloat16, True),      # M = 6272: 33 tiles of 192, the last 2/3 full
    (3, 9, 13, 96, 130, 3, 3, 1, 1, torch.float16, True),         # M = 351: the last tile's tail rows all past M
    (2, 9, 7, 64, 64, 5, 3, (2, 1), (2, 1), torch.bfloat16, False),  # M = 70 < one main block; strides differ
    (5, 11, 13, 72, 200, 3, 3, 2, 1, torch.bfloat16, True),       # row boxes across image boundaries, stride 2
    (4, 13, 11, 80, 192, 3, 3, 1, 0, torch.bfloat16, True),       # Ci = 80 (K blocks part zeros), Co = 192, unpadded
    (2, 17, 17, 160, 192, 1, 7, 1, (0, 3), torch.float16, False),  # Inception's 1x7
])
def test_tail_tiles(config, N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias):
    run_conv(functools.partial(conv2d_fprop_launch, config=config), N, H, W, Ci, Co, R, S, stride,
             padding, 1, dtype, with_bias)


@needs_gpu
@pytest.mark.parametrize("config", configs_for_this_machine(TAIL_CONFIGS[1::2]), ids=str)
@pytest.mark.parametrize("epilogue", FUSED_EPILOGUES, ids=str)
def test_tail_tiles_with_fused_epilogue(config, epilogue):
    check_fused_epilogue(config, epilogue)


@pytest.mark.parametrize("arch, config, mma_shapes", [
    ("sm_90", KernelConfig(256, 128, 32, 5, 8, block_n_tail=32), ["m64n128k16", "m64n32k16"]),
    ("sm_90", KernelConfig(128, 128, 64, 4, 4, consumers=2, block_n_tail=32), ["m64n128k16", "m64n32k16"]),
    ("sm_100", KernelConfig(128, 128, 64, 4, 4, block_n_tail=32), []),
], ids=["sm_90", "sm_90-ping-pong", "sm_100"])
def test_tail_build_issues_a_second_mma(arch, config, mma_shapes):
    tail, plain = aot_ptx(arch, config, Co=320), aot_ptx(arch, config._replace(block_n_tail=0), Co=320)
    mma = "wgmma.mma_async" if arch == "sm_90" else "tcgen05.mma"
    count = lambda ptx: common.ptx_instructions(ptx, [mma])[mma]  # noqa: E731
    assert count(tail["ptx"]) == 2 * count(plain["ptx"])        # main + tail MMA per k-step
    for shape in mma_shapes:
        assert f"{mma}.sync.aligned.{shape}" in tail["ptx"]
    # two weight loads per stage (main box + tail box), two stores per tile
    counts = common.ptx_instructions(tail["ptx"], [WEIGHT_LOAD, TMA_STORE])
    assert counts == {k: 2 * v for k, v in common.ptx_instructions(plain["ptx"], [WEIGHT_LOAD, TMA_STORE]).items()}
    assert tail["shared"] <= configs.shared_memory_bytes(config) + 1024


@pytest.mark.parametrize("config", [KernelConfig(128, 128, 64, 4, 4, block_m_tail=64),
                                    KernelConfig(128, 128, 64, 3, 4, consumers=2, block_m_tail=64)], ids=str)
def test_row_tail_build_loads_three_pixel_boxes(config):
    """A 192-row tile: three 64-pixel im2col boxes per stage (two for the main rows, one for the
    tail), one weight box shared by both MMAs, and a second MMA and store per tile."""
    tail = aot_ptx("sm_90", config, Co=128)
    plain = aot_ptx("sm_90", config._replace(block_m_tail=0), Co=128)
    what = [IM2COL_LOAD, WEIGHT_LOAD, TMA_STORE, "wgmma.mma_async"]
    counts, plain_counts = common.ptx_instructions(tail["ptx"], what), common.ptx_instructions(plain["ptx"], what)
    assert counts[IM2COL_LOAD] == 3 and plain_counts[IM2COL_LOAD] == 1
    assert counts[WEIGHT_LOAD] == plain_counts[WEIGHT_LOAD]     # the weights: one box per stage
    assert counts[TMA_STORE] == 2 * plain_counts[TMA_STORE]     # main block + tail block
    # per consumer and k-step: 2 x 4 m64n128k16 for the main 128 rows, 1 x 4 for the tail's 64
    assert counts["wgmma.mma_async"] * 2 == plain_counts["wgmma.mma_async"] * 3
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in tail["ptx"]
    assert tail["shared"] <= configs.shared_memory_bytes(config) + 1024


@pytest.mark.parametrize("epilogue", [Epilogue(), Epilogue(bias=True, scale=True, residual=True, activation="relu")],
                         ids=["plain", "fused"])
@pytest.mark.parametrize("config, blocks", [(KernelConfig(128, 128, 64, 5, 4, block_m_tail=64), 3),
                                            (KernelConfig(256, 128, 64, 4, 8), 2)], ids=str)
def test_deep_ring_build_stores_by_row_blocks(config, blocks, epilogue):
    """Where a staging buffer of the whole tile does not fit beside the ring, the tile leaves in
    blocks of half its main rows through one buffer of that height: a 192-row tile with 5 stages
    in three 64-row TMA stores (16 KB of staging instead of 48), a 256-row tile with 4 stages in
    two of 128 rows. Splitting the accumulator's rows moves no data through shared memory."""
    shallow_config = config._replace(num_buffers=config.num_buffers - 1)
    deep = aot_ptx("sm_90", config, Co=128, epilogue=list(epilogue))
    shallow = aot_ptx("sm_90", shallow_config, Co=128, epilogue=list(epilogue))
    assert stores_by_row_blocks(config) and not stores_by_row_blocks(shallow_config)
    assert common.ptx_instructions(deep["ptx"], [TMA_STORE])[TMA_STORE] == blocks
    assert common.ptx_instructions(shallow["ptx"], [TMA_STORE])[TMA_STORE] == (2 if config.block_m_tail else 1)
    for generic in ("st.shared", "ld.shared"):        # no extra round trip for the split
        assert deep["ptx"].count(generic) <= shallow["ptx"].count(generic)
    ring = ring_bytes(config)
    assert ring + config.block_m // 2 * config.tile_n * 2 <= deep["shared"]
    assert deep["shared"] <= min(configs.shared_memory_bytes(config) + 1024, SHARED_MEMORY_PER_PROGRAM)
    assert ring + config.tile_m * config.tile_n * 2 > SHARED_MEMORY_PER_PROGRAM   # what it avoids


SPLIT_K_CONFIGS = [KernelConfig(128, 128, 64, 6, 8, split_k=3), KernelConfig(128, 64, 64, 6, 4, split_k=4),
                   KernelConfig(128, 128, 64, 5, 4, block_n_tail=32, split_k=2),
                   # a row tail with split-K: the slices' partial sums of 192-row tiles (Hopper)
                   KernelConfig(128, 128, 64, 4, 4, split_k=2, block_m_tail=64),
                   KernelConfig(128, 128, 64, 5, 4, split_k=2, block_m_tail=64)]   # by row blocks


@needs_gpu
@pytest.mark.parametrize("entry", ["conv2d_fprop_launch", "conv2d_fprop_fixed"])
@pytest.mark.parametrize("config", configs_for_this_machine(SPLIT_K_CONFIGS), ids=str)
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias", [
    (8, 8, 8, 1280, 1280, 3, 3, 1, 1, torch.bfloat16, True),       # SD's 8x8 stage: 40 tiles, 180 k-steps
    (8, 16, 16, 640, 320, 3, 3, 2, 1, torch.bfloat16, False),      # stride 2, Co = 2 x 160
    (2, 7, 7, 2048, 512, 1, 1, 1, 0, torch.float16, True),         # 1x1, M = 98 < one tile
    (4, 15, 17, 64, 100, 3, 3, 2, 1, torch.bfloat16, True),        # 9 k-steps in 2-4 slices, Co tail
    (128, 7, 7, 512, 512, 1, 1, 1, 0, torch.bfloat16, True),      # 196 tiles of 128x128: the last wave split
    (64, 9, 11, 192, 700, 3, 3, 1, 1, torch.float16, False),      # many tiles, some split, Co tail
])
def test_split_k(entry, config, N, H, W, Ci, Co, R, S, stride, padding, dtype, with_bias):
    """Plainly launched, and through the runtime (templates and direct launches of both kernels:
    the second call of a plan takes the direct path)."""
    for seed in (0, 1):
        common.check_conv(functools.partial(ENTRIES[entry], config=config), N, H, W, Ci, Co, R, S,
                          stride, padding, 1, dtype=dtype, with_bias=with_bias, seed=seed)


@needs_gpu
@pytest.mark.parametrize("epilogue", FUSED_EPILOGUES, ids=str)
def test_split_k_last_wave_with_fused_epilogue(epilogue):
    """Whole tiles store through the epilogue in the kernel, split ones in the second kernel: both
    must apply the same act(acc * scale + bias + residual)."""
    check_fused_epilogue(SPLIT_K_CONFIGS[2], epilogue)


def tile_order(num_pid_m, num_pid_n, group_m=GROUP_M):
    """[(pid_m, pid_n) of tile 0, 1, ...]: the grouped order, written out in plain Python as the
    tests' independent model of TileSchedule.work (grouped tile order)."""
    order = []
    for first_m in range(0, num_pid_m, group_m):
        rows_in_group = min(num_pid_m - first_m, group_m)
        order += [(first_m + i % rows_in_group, i // rows_in_group) for i in range(rows_in_group * num_pid_n)]
    return order


@pytest.mark.parametrize("M, Co, tile_m, tile_n, whole_tiles, split_k", [
    (1000, 300, 128, 160, 9, 2),      # 8 x 2 tiles in 2 groups, the last 7 split; Co and M tails
    (640, 256, 64, 64, 0, 3),         # every tile split (fewer tiles than programs)
    (2048, 96, 128, 64, 30, 4),       # 16 x 2 tiles, the last 2 split
])
def test_split_k_epilogue_finishes_only_split_tiles(M, Co, tile_m, tile_n, whole_tiles, split_k):
    """The second kernel sums the slices (and applies the epilogue) exactly on the tiles that
    TileSchedule.work split, found from the tile order, and leaves the whole tiles' output alone. On a
    CPU it runs in the interpreter."""
    generator = torch.Generator().manual_seed(0)
    num_pid_m, num_pid_n = triton.cdiv(M, tile_m), triton.cdiv(Co, tile_n)
    partial = torch.randn(split_k, M, Co, generator=generator)
    bias = torch.randn(Co, generator=generator)
    out = torch.full((M, Co), 7.0)                     # what the conv kernel stored for whole tiles
    launch = ConvLaunch((1, 1, 1), None, None, None, None, None, None, None, out.to(common.device()),
                        partial.to(common.device()), (tile_m, tile_n, num_pid_m, num_pid_n, whole_tiles))
    finish_split_k(launch, bias.to(common.device()), activation="relu")
    expected = out.clone()
    for pid_m, pid_n in tile_order(num_pid_m, num_pid_n)[whole_tiles:]:
        rows, cols = slice(pid_m * tile_m, (pid_m + 1) * tile_m), slice(pid_n * tile_n, (pid_n + 1) * tile_n)
        expected[rows, cols] = (partial[:, rows, cols].sum(0) + bias[cols]).relu()
    torch.testing.assert_close(launch.out_2d.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, config", [
    ("sm_90", KernelConfig(128, 128, 64, 6, 8, split_k=3)),
    ("sm_90", KernelConfig(128, 128, 64, 5, 4, block_n_tail=32, split_k=2)),
    ("sm_100", KernelConfig(128, 128, 64, 4, 4, block_n_tail=32, split_k=2)),
], ids=["sm_90", "sm_90-tail", "sm_100-tail"])
def test_split_k_build_stores_partial_sums_instead_of_tiles(arch, config):
    """With split-K the epilogue writes a split tile's fp32 partial sums with plain stores
    (st.global), and a whole tile (before the last wave) with the TMA store as without split-K;
    the loop is the same."""
    split, plain = aot_ptx(arch, config, Co=320)["ptx"], aot_ptx(arch, config._replace(split_k=1), Co=320)["ptx"]
    counts = lambda ptx: common.ptx_instructions(ptx, [TMA_STORE, "st.global", IM2COL_LOAD])  # noqa: E731
    assert counts(plain)[TMA_STORE] > 0 and counts(plain)["st.global"] == 0
    assert counts(split)[TMA_STORE] == counts(plain)[TMA_STORE] and counts(split)["st.global"] > 0
    assert counts(split)[IM2COL_LOAD] == counts(plain)[IM2COL_LOAD]



@needs_gpu
@pytest.mark.parametrize("N, H, W, groups, Ci_group, Co_group, R, stride, padding, config", [
    (4, 14, 14, 8, 64, 64, 3, 1, 1, FIXED_CONFIG._replace(block_n=64)),
    (3, 9, 11, 2, 128, 128, 3, 2, 1, FIXED_CONFIG),                            # stride 2, odd sizes
    (2, 7, 7, 4, 32, 64, 3, 1, 1, FIXED_CONFIG._replace(block_n=64, block_k=32)),
    (2, 10, 10, 4, 16, 64, 1, 1, 0, FIXED_CONFIG._replace(block_n=64)),       # 1x1, K block of 16
    (1, 28, 28, 2, 192, 192, 3, 1, 1, FIXED_CONFIG._replace(block_n=64)),     # three tiles per group
])
def test_grouped_conv_matches_torch(N, H, W, groups, Ci_group, Co_group, R, stride, padding, config):
    """Section 10 on the GPU: grouped convs through the plain launcher, each tile inside one group."""
    common.check_conv(functools.partial(conv2d_fprop_launch, config=config), N, H, W, groups * Ci_group,
                      groups * Co_group, R, R, stride, padding, dtype=torch.bfloat16, with_bias=True, groups=groups)


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding", [
    (32, 28, 28, 128, 128, 3, 3, 1, 1),
    (32, 56, 56, 256, 64, 1, 1, 1, 0),
    (8, 16, 16, 320, 320, 3, 3, 2, 1),
])
def test_autotuned_entry_point(N, H, W, Ci, Co, R, S, stride, padding):
    run_conv(conv2d_fprop, N, H, W, Ci, Co, R, S, stride, padding, with_bias=True)


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias", AWKWARD_CASES)
def test_runtime_matches_on_awkward_cases(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias):
    run_conv(conv2d_fprop_fixed, N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, with_bias)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_operator_shared_memory_model_covers_the_build(arch):
    """The operator prunes configs by configs.shared_memory_bytes: it must not under-estimate what
    the compiled kernel asks for."""
    compiled = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch)
    assert compiled["shared"] <= configs.shared_memory_bytes(FIXED_CONFIG) + 1024


# Moved from the lesson (section 6's row tails, section 7's second kernel, section 10's groups).

@pytest.mark.parametrize("N, H, W, R, S, stride, padding", [
    (3, 7, 7, 1, 1, 1, 0),           # ResNet-50's 7x7 stage: 192-pixel tiles span images
    (2, 9, 13, 3, 3, (2, 1), 1),     # stride 2 in H only, padding
    (4, 5, 6, 3, 5, 2, (1, 2)),      # small images: a 64-pixel box covers several of them
])
def test_row_tail_boxes_read_what_one_tall_box_would(N, H, W, R, S, stride, padding):
    """The row tail's 64-pixel boxes, each started at Im2colWindow.pixel_box_origin (the kernel's own
    method, run here as plain Python), read exactly the pixels of one 192-pixel im2col box started at
    the tile's first pixel: checked with lesson 03's model of the TMA im2col walk, for every tile and
    tap, the last tile's rows past M included."""
    import types
    walk = common.load_lesson("03-tma-im2col-modes").im2col_walk
    geometry = common.conv_geometry((N, H, W, 8), (8, R, S, 8), stride, padding)
    settings = common.conv_im2col_settings(geometry)
    window = (settings.pixel_box_lower_corner, settings.pixel_box_upper_corner, settings.element_strides)
    shape, g = (N, H, W, 8), geometry
    kernel_window = types.SimpleNamespace(out_h=g.out_h, out_w=g.out_w, stride_h=g.stride[0], stride_w=g.stride[1],
                                          pad_h=g.padding[0], pad_w=g.padding[1])
    for m0 in range(0, g.M, 192):
        for r in range(R):
            for s in range(S):
                offsets = settings.tap_offsets(r, s)
                tall = walk(shape, 192, *window, settings.start_coord(m0), offsets)
                boxes = []
                for box in range(3):
                    n, y, x = lesson05.Im2colWindow.pixel_box_origin.fn(kernel_window, m0 + 64 * box)
                    boxes += walk(shape, 64, *window, (n, y, x, 0), offsets)
                assert boxes == tall, (m0, r, s)


@pytest.mark.parametrize("split_k, epilogue", [(2, Epilogue()), (3, Epilogue(True, True, True, "relu")),
                                               (4, Epilogue(True, False, False, "silu"))])
def test_split_k_epilogue_kernel_against_torch(split_k, epilogue):
    """The second kernel of split-K, on the CPU interpreter or a GPU: the slices' sum and the epilogue."""
    M, Co = 77, 100
    generator = torch.Generator().manual_seed(split_k)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(common.device())  # noqa: E731
    partial, bias, scale, residual = rand(split_k, M, Co), rand(Co), rand(Co), rand(M, Co)
    bias, scale, residual = (t if on else None for t, on in zip((bias, scale, residual), epilogue[:3]))
    out_2d = torch.full((M, 104), float("nan"), device=partial.device)
    launch = ConvLaunch(None, None, None, None, None, None, None, None, out_2d, partial,
                        (64, 64, 2, 2, 0))    # every tile split
    finish_split_k(launch, bias, scale, residual, epilogue.activation)
    expected = common.reference_epilogue(partial.sum(0), bias, scale, residual, epilogue.activation)
    torch.testing.assert_close(out_2d[:, :Co], expected, rtol=1e-5, atol=1e-5)
    assert out_2d[:, Co:].isnan().all()          # the row padding is not written


@pytest.mark.parametrize("N, H, W, groups, Ci_group, Co_group, R, stride, padding, BLOCK_K, TILE_N", [
    (2, 6, 5, 4, 16, 16, 3, 1, 1, 16, 16),     # 4 groups, a tile per group
    (1, 7, 7, 2, 32, 64, 3, 2, 1, 16, 32),     # two K blocks and two tiles per group, stride 2
    (2, 5, 6, 3, 16, 48, 1, 1, 0, 16, 16),     # 1x1, three tiles per group
])
def test_grouped_tiles_read_their_groups(N, H, W, groups, Ci_group, Co_group, R, stride, padding, BLOCK_K, TILE_N):
    """The loader's own arithmetic (Im2colWindow's pixel_box_origin, tile_taps and k_step, run
    as plain Python) with lesson 03's model of TMA im2col loads, and weight boxes cut from w2d,
    computes torch's grouped conv2d: every tile, every k-step."""
    import types
    Im2colWindow = lesson05.Im2colWindow
    reference = common.load_lesson("03-tma-im2col-modes").im2col_reference
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (N, H, W, groups * Ci_group), generator=generator).float()
    w = torch.randint(-3, 4, (groups * Co_group, R, R, Ci_group), generator=generator).float()
    g = common.conv_geometry(x.shape, w.shape, stride, padding, 1, groups)
    settings = common.conv_im2col_settings(g)
    corners = (settings.pixel_box_lower_corner, settings.pixel_box_upper_corner, settings.element_strides)
    window = types.SimpleNamespace(out_h=g.out_h, out_w=g.out_w, stride_h=g.stride[0], stride_w=g.stride[1],
                                   pad_h=g.padding[0], pad_w=g.padding[1], dil_h=common.PlainInt(1),
                                   dil_w=common.PlainInt(1), Ci_group=Ci_group, Co_group=Co_group, S=R,
                                   channel_blocks=Ci_group // BLOCK_K)
    window.group_channel = lambda co0: Im2colWindow.group_channel.fn(window, co0)
    w2d, BLOCK_M, out = w.reshape(g.Co, -1), 32, torch.zeros(g.M, g.Co)
    for m0 in range(0, g.M, BLOCK_M):
        n, y, x0 = Im2colWindow.pixel_box_origin.fn(window, m0)
        for co0 in range(0, g.Co, TILE_N):
            tile_taps = Im2colWindow.tile_taps.fn(window, co0)
            for k in range(R * R * window.channel_blocks):
                offsets, c, (row, column) = Im2colWindow.k_step.fn(window, common.PlainInt(k), BLOCK_K, tile_taps)
                a, _ = reference(x, BLOCK_M, BLOCK_K, *corners, [n, y, x0, c], offsets)
                rows = min(BLOCK_M, g.M - m0)
                out[m0:m0 + rows, co0:co0 + TILE_N] += (a @ w2d[row:row + TILE_N, column:column + BLOCK_K].T)[:rows]
    expected = common.reference_conv2d_nhwc(x, w, None, stride, padding, groups=groups)
    torch.testing.assert_close(out.view(expected.shape), expected)


def test_grouped_configs_that_straddle_groups_are_refused():
    x, w = common.random_conv_inputs(1, 8, 8, 128, 128, 3, 3, torch.bfloat16, device_name="cpu")
    w = w[..., :64].contiguous()                     # 2 groups of 64 -> 64: a 128-wide tile holds both
    geometry = common.conv_geometry(x.shape, w.shape, 1, 1, 1, groups=2)
    with pytest.raises(ValueError, match="a tile must stay in one group"):
        lesson05.prepare_launch(x, w, None, geometry, FIXED_CONFIG, "sm_90", 132)
    lesson05.prepare_launch(x, w, None, geometry, FIXED_CONFIG._replace(block_n=64), "sm_90", 132)   # 64 wide: fits


def test_part_two_configs_are_refused_by_the_lessons_launcher():
    """The lesson's kernel is Part I's: a tail, row-block stores or split-K get a ValueError naming
    the operator's launcher, where sections 6 and 7 live."""
    x, w = common.random_conv_inputs(1, 8, 8, 64, 128, 3, 3, torch.bfloat16, device_name="cpu")
    geometry = common.conv_geometry(x.shape, w.shape, 1, 1)
    for config in (KernelConfig(128, 128, 64, 4, 4, block_n_tail=32), KernelConfig(128, 128, 64, 4, 4, split_k=2),
                   KernelConfig(256, 128, 64, 4, 8)):
        with pytest.raises(ValueError, match="conv_tutorial.kernels.fprop.conv2d_fprop_launch"):
            lesson05.prepare_launch(x, w, None, geometry, config, "sm_90", 132)
