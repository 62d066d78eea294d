"""How evenly lesson 06's one-launch strided dgrad (section 2b) loads the programs of lesson 05's
persistent kernel, counted on paper: no GPU needed.

    python tools/phase_balance.py [--sms 132]

For every strided 3x3-like conv of ResNet-50, ResNet-18 and Inception v3 that section 2b's plan
takes (with the config `side_by_side_config` picks on Hopper), the k-steps each program runs when
program p of P takes tiles p, p + P, p + 2P, ... (lesson 05's persistent loop), and a tile of phase
(a, b) runs that phase's taps times the K blocks of dY's channels. Two tile orders:

- "grouped": lesson 05's order, GROUP_M row-tiles at a time, the phases' columns side by side;
- "heaviest first": the phases one after the other, the one with the most taps first, each
  phase's tiles in the grouped order.

Prints, per layer, the mean k-steps per program and the busiest program's, and their ratio: the
share of the kernel's time (its slowest program's) the average program is busy. The kernel's
speed also depends on what a k-step costs, which this does not model.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
import network_suite  # noqa: E402

GROUP_M = 8     # lesson 05's row-tiles per group


def tile_costs(plan, order):
    """The k-steps of each tile of section 2b's conv `plan`, in the order the tiles are numbered."""
    lesson05 = common.load_lesson("05-warp-specialized-conv")
    g, phases, config = plan.geometry, plan.phases, lesson05.KernelConfig(*plan.config)
    num_pid_m, num_pid_n = -(-g.M // config.tile_m), -(-g.Co // config.tile_n)
    per_phase = phases.width // config.tile_n
    channel_blocks = -(-(-(-g.Ci // 8) * 8) // config.block_k)     # dY's channels, padded to 16 bytes

    def k_steps(phase):
        a, b = phase // len(phases.along_w), phase % len(phases.along_w)
        return phases.along_h[a][1] * phases.along_w[b][1] * channel_blocks
    if order == "grouped":
        costs = []
        for tile in range(num_pid_m * num_pid_n):
            per_group = GROUP_M * num_pid_n
            first_m = tile // per_group * GROUP_M
            pid_n = tile % per_group // min(num_pid_m - first_m, GROUP_M)
            costs.append(k_steps(pid_n // per_phase))
        return costs
    by_taps = sorted(range(phases.count), key=lambda p: -k_steps(p))
    return [k_steps(p) for p in by_taps for _ in range(num_pid_m * per_phase)]


def balance(costs, programs):
    """(mean, max) k-steps per program when program p runs tiles p, p + programs, ..."""
    programs = min(programs, len(costs))
    loads = [sum(costs[p::programs]) for p in range(programs)]
    return sum(loads) / programs, max(loads)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132, help="programs of the persistent grid (an H100's SMs)")
    args = parser.parse_args(argv)
    lesson05 = common.load_lesson("05-warp-specialized-conv")
    lesson06 = common.load_lesson("06-conv-backward")
    layers = (network_suite.resnet50_layers(128) + network_suite.torchvision_dense_convs("resnet18", "RN18", 256, 224)
              + network_suite.inception_v3_layers())
    seen = set()
    print(f"{'layer':34s} {'tiles':>6s} {'mean':>7s}  {'grouped: max':>13s}  {'heaviest first: max':>20s}")
    for label, N, H, W, Ci, Co, R, S, stride, padding in layers:
        g = common.conv_geometry((N, H, W, Ci), (Co, R, S, Ci), stride, padding)
        if g in seen or g.stride == (1, 1) or g.Ci <= 8:      # (few channels: the stride is folded instead)
            continue
        seen.add(g)
        # side_by_side_config's choice on Hopper
        config = lesson05.KernelConfig(128, 128, 64, 6, 8) if g.Ci % 128 == 0 else lesson05.KernelConfig(256, 64, 64, 4, 8)
        plan = lesson06.side_by_side_plan(g, config)
        if plan is None:
            continue
        mean, grouped = balance(tile_costs(plan, "grouped"), args.sms)
        _, heaviest = balance(tile_costs(plan, "heaviest first"), args.sms)
        tiles = len(tile_costs(plan, "grouped"))
        print(f"{label:34s} {tiles:6d} {mean:7.1f}  {grouped:6d} ({mean / grouped:4.0%})  "
              f"{heaviest:13d} ({mean / heaviest:4.0%})")


if __name__ == "__main__":
    main()
