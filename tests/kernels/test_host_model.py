"""The host's models of the package's kernels, one home per fact: the forward
kernel's tile grid and grouped tile order (`fprop.tile_grid`, `fprop.tile_order`) against the
kernel's own code run as Python and against an independent model; its config rules, shared memory
and register budget as the operator's pruning uses them; wgrad's shared-memory model against its
builds. All on a CPU (the builds ahead of time)."""
import itertools
import types
from collections import namedtuple

import common
import pytest
import torch

from conv_tutorial import configs, selection
from conv_tutorial.kernels import dgrad, fprop, wgrad

GRIDS = [(1, 1), (3, 1), (1, 5), (8, 2), (10, 3), (16, 4), (17, 7), (33, 4), (49, 16), (9, 9)]


def kernel_tile(tile_id, num_pid_m, num_pid_n, programs=132):
    """(pid_m, pid_n) of unit `tile_id` as the kernel computes it: TileSchedule.work's own source,
    run as plain Python on integers (no split-K, no phases). Gluon's builtins it calls become their
    Python counterparts, GROUP_M the value of the kernel module's constexpr."""
    work = fprop.TileSchedule.work.fn
    gl = types.SimpleNamespace(minimum=min, maximum=max, num_programs=lambda axis: programs, int32=None)
    unit = namedtuple("WorkUnit", "pid_m pid_n k_begin k_end split partial")
    run = types.FunctionType(work.__code__, {**work.__globals__, "gl": gl, "WorkUnit": unit,
                                             "GROUP_M": fprop.GROUP_M.value}, work.__name__,
                             work.__defaults__, work.__closure__)
    schedule = types.SimpleNamespace(num_pid_m=num_pid_m, num_pid_n=num_pid_n, k_steps=9, SPLIT_K=1, phases=None)
    result = run(schedule, tile_id)
    return int(result.pid_m), int(result.pid_n)


def grouped_order(num_pid_m, num_pid_n, group_m=8):
    """An independent model of the grouped order: row-tiles in groups of group_m, each group's
    columns left to right, each column top to bottom."""
    order = []
    for first_m in range(0, num_pid_m, group_m):
        rows = range(first_m, min(first_m + group_m, num_pid_m))
        order += [(m, n) for n in range(num_pid_n) for m in rows]
    return order


@pytest.mark.parametrize("num_pid_m, num_pid_n", GRIDS)
def test_tile_order_is_the_kernels(num_pid_m, num_pid_n):
    tiles = num_pid_m * num_pid_n
    host = [fprop.tile_order(t, num_pid_m, num_pid_n) for t in range(tiles)]
    assert host == [kernel_tile(t, num_pid_m, num_pid_n) for t in range(tiles)]
    assert sorted(host) == sorted(itertools.product(range(num_pid_m), range(num_pid_n)))   # every tile once
    assert host == grouped_order(num_pid_m, num_pid_n)


def test_tile_order_of_a_small_grid_by_hand():
    # 10 row-tiles x 3 columns: rows 0-7 down each column, then the last group's two rows
    assert [fprop.tile_order(t, 10, 3) for t in range(30)] == (
        [(m, 0) for m in range(8)] + [(m, 1) for m in range(8)] + [(m, 2) for m in range(8)]
        + [(8, 0), (9, 0), (8, 1), (9, 1), (8, 2), (9, 2)])


def test_the_launch_takes_its_grid_and_k_loop_from_the_host_model():
    """prepare_launch (CPU tensors) passes the kernel tile_grid's grid and channel_blocks' K blocks,
    and tile_counts counts the same tiles."""
    for config, (Ci, Co) in [(fprop.FIXED_CONFIG, (64, 320)), (fprop.KernelConfig(128, 128, 64, 4, 4, block_m_tail=64),
                                                                (24, 128)),
                             (fprop.KernelConfig(128, 128, 64, 5, 4, block_n_tail=32), (160, 320))]:
        x, w = torch.zeros(2, 15, 17, Ci, dtype=torch.bfloat16), torch.zeros(Co, 3, 3, Ci, dtype=torch.bfloat16)
        g = common.conv_geometry(x.shape, w.shape, 1, 1)
        launch = fprop.prepare_launch(x, w, None, g, config, "sm_90", 132)
        assert (launch.shape.num_pid_m, launch.shape.num_pid_n) == fprop.tile_grid(config, g.M, g.Co)
        assert launch.shape.num_pid_m == -(-g.M // config.tile_m) and launch.shape.num_pid_n == -(-Co // config.tile_n)
        assert fprop.tile_counts(config, g.M, g.Co, 132)[1] == launch.shape.num_pid_m * launch.shape.num_pid_n
        padded = -(-Ci // 8) * 8
        assert launch.shape.channel_blocks == fprop.channel_blocks(config, padded, 2)
        assert launch.shape.k_steps == 9 * launch.shape.channel_blocks


def test_dgrads_taps_per_tile_follows_the_kernels_order():
    """taps_per_tile in the grouped order: each tile's phase is the phase of its columns, in the
    kernel's order (checked against the kernel's own code above)."""
    g = common.conv_geometry((4, 14, 14, 128), (128, 3, 3, 128), 2, 1)
    plan = dgrad.side_by_side_plan(g, dgrad.side_by_side_config(g, "sm_90"))
    phases, config = plan.phases, plan.config
    num_pid_m, num_pid_n = fprop.tile_grid(config, plan.geometry.M, plan.geometry.Co)
    taps = [phases.along_h[p // len(phases.along_w)][1] * phases.along_w[p % len(phases.along_w)][1]
            for p in range(phases.count)]
    per_phase = phases.width // config.tile_n
    expected = [taps[kernel_tile(t, num_pid_m, num_pid_n)[1] // per_phase] for t in range(num_pid_m * num_pid_n)]
    assert dgrad.taps_per_tile(plan) == expected and len(set(expected)) > 1


KERNEL_LIMITS = [   # (config, arch, words of the rule)
    (fprop.KernelConfig(128, 128, 64, 4, 8, consumers=2), "sm_90", "ping-pong runs 4-warp consumers"),
    (fprop.KernelConfig(128, 64, 64, 4, 4, programs_per_sm=2, consumers=2), "sm_90", "ping-pong runs 4-warp"),
    (fprop.KernelConfig(128, 64, 64, 4, 8, programs_per_sm=2), "sm_90", "programs_per_sm > 1 runs 4 warps"),
    (fprop.KernelConfig(128, 128, 64, 4, 4, consumers=2), "sm_100", "is a Hopper schedule"),
]


@pytest.mark.parametrize("config, arch, rule", KERNEL_LIMITS, ids=lambda v: str(v))
def test_check_config_names_the_kernels_limits(config, arch, rule):
    with pytest.raises(ValueError, match=rule):
        fprop.check_config(config, arch)
    g = common.conv_geometry((8, 28, 28, 256), (256, 3, 3, 256), 1, 1)
    assert selection.prune_configs([config], g, arch) == []


def test_every_candidate_passes_check_config_on_its_arch():
    for arch, candidates in configs.CANDIDATES.items():
        for config in candidates:
            fprop.check_config(config, arch)


def test_pruning_and_the_residual_rule_share_one_register_budget():
    """register_budget: accumulators alone (pruning) and with a residual (residual_fits_in_registers)."""
    assert fprop.register_budget(fprop.FIXED_CONFIG, "sm_100") is None
    row_tail = fprop.KernelConfig(128, 128, 64, 4, 4, block_m_tail=64)                 # 192 accumulators
    for config in (row_tail, row_tail._replace(consumers=2, num_buffers=3)):
        assert configs.accumulator_registers(config) == 192 == fprop.register_budget(config, "sm_90")
    assert fprop.register_budget(row_tail._replace(consumers=2), "sm_90", residual=True) == 160
    assert fprop.register_budget(row_tail._replace(num_warps=8), "sm_90", residual=True) == 160
    two_per_sm = fprop.KernelConfig(128, 64, 64, 4, 4, programs_per_sm=2)
    assert fprop.register_budget(two_per_sm, "sm_90") == 96 and configs.residual_fits_in_registers(two_per_sm)
    g = common.conv_geometry((8, 28, 28, 256), (256, 3, 3, 256), 1, 1)
    wide = fprop.KernelConfig(128, 256, 64, 3, 4)                                     # 256 accumulators
    assert selection.prune_configs([wide], g, "sm_90") == [] and selection.prune_configs([wide], g, "sm_100")


def test_shared_memory_model_of_both_kernels_shares_its_barrier_rule():
    c = fprop.KernelConfig(128, 128, 64, 4, 4)
    assert fprop.barrier_bytes(4) == 4 * 2 * 8 + fprop.OTHER_BARRIER_BYTES
    assert fprop.shared_memory_bytes(c) == 4 * 256 * 64 * 2 + 128 * 128 * 2 + fprop.barrier_bytes(4)
    assert configs.shared_memory_bytes is fprop.shared_memory_bytes
    wc = wgrad.WgradConfig(128, 64, 64, 4, 4)
    assert wgrad.shared_memory_bytes(wc) == 4 * 64 * (128 + 64) * 2 + fprop.barrier_bytes(4)
    deep = wc._replace(num_buffers=10)           # 10 x 48 KB: more than a program has
    with pytest.raises(ValueError, match="shared memory"):
        wgrad.check_wgrad_config(deep, "sm_90")
    two_per_sm = fprop.KernelConfig(128, 64, 64, 4, 4, programs_per_sm=2)
    assert fprop.fits_shared_memory(two_per_sm) and not fprop.fits_shared_memory(two_per_sm._replace(num_buffers=6))


WGRAD_BUILDS = [("sm_90", dict()), ("sm_90", dict(N=8, H=14, W=14, Ci=256, Co=512, R=1, S=1, padding=0,
                                                  default_config=True)), ("sm_100", dict()),
                # least_padded_config's 64 x 64 tiles (160 channels each side): 128-pixel k-steps
                ("sm_90", dict(N=8, H=14, W=14, Ci=160, Co=160, default_config=True)),
                ("sm_100", dict(N=8, H=14, W=14, Ci=160, Co=160, default_config=True))]


@pytest.mark.parametrize("arch, params", WGRAD_BUILDS, ids=lambda v: str(v))
def test_wgrad_shared_memory_model_holds_for_its_builds(arch, params):
    """wgrad.shared_memory_bytes against the compiled build's shared memory: within the margin the
    models leave for alignment and scratch (fprop.BUILD_MARGIN_BYTES), and no more than it."""
    compiled = common.aot_compile_or_skip("conv_tutorial.kernels.aot", "wgrad_build", arch, **params)
    p = dict(N=2, H=16, W=16, Ci=64, Co=128, R=3, S=3, stride=1, padding=1) | params
    g = common.conv_geometry((p["N"], p["H"], p["W"], p["Ci"]), (p["Co"], p["R"], p["S"], p["Ci"]), p["stride"],
                             p["padding"])
    config = (wgrad.default_wgrad_config(g, p["Ci"], 132) if p.get("default_config")
              else wgrad.wgrad_config(p["Co"], p["Ci"]))
    if p["Ci"] == 160:       # (the build this entry is for: least_padded_config's 64 x 64 tile)
        assert tuple(config[:2]) == (64, 64)
    model = wgrad.shared_memory_bytes(config)
    assert model <= compiled["shared"] <= model + fprop.BUILD_MARGIN_BYTES, (compiled["shared"], model)
