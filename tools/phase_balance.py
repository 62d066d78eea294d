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
speed also depends on what a k-step costs, which this does not model. Lesson 06's `phase_order`
runs a layer heaviest first where that lightens the busiest program by more than 5%.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
import network_suite  # noqa: E402


def k_steps_per_tile(lesson06, plan, order=None):
    """The k-steps of each tile of section 2b's conv `plan`, in the order the tiles are numbered:
    lesson 06's taps_per_tile times the K blocks of dY's channels (padded to 16 bytes)."""
    g, config = plan.geometry, common.load_lesson("05-warp-specialized-conv").KernelConfig(*plan.config)
    channel_blocks = -(-(-(-g.Ci // 8) * 8) // config.block_k)
    return [taps * channel_blocks for taps in lesson06.taps_per_tile(plan, order)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132, help="programs of the persistent grid (an H100's SMs)")
    args = parser.parse_args(argv)
    lesson05 = common.load_lesson("05-warp-specialized-conv")
    lesson06 = common.load_lesson("06-conv-backward")
    layers = (network_suite.resnet50_layers(128) + network_suite.torchvision_dense_convs("resnet18", "RN18", 256, 224)
              + network_suite.inception_v3_layers())
    seen = set()
    print(f"{'layer':34s} {'tiles':>6s} {'mean':>7s}  {'grouped: max':>13s}  {'heaviest first: max':>20s}  runs")
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
        grouped_costs = k_steps_per_tile(lesson06, plan)
        mean, tiles = sum(grouped_costs) / min(args.sms, len(grouped_costs)), len(grouped_costs)
        grouped = lesson06.busiest_program(grouped_costs, args.sms)
        heaviest = lesson06.busiest_program(k_steps_per_tile(lesson06, plan, plan.phases.heaviest_first()), args.sms)
        programs = lesson05.tile_counts(config, plan.geometry.M, plan.geometry.Co, args.sms)[0]
        runs = "grouped" if lesson06.phase_order(plan, programs) is None else "heaviest first"
        print(f"{label:34s} {tiles:6d} {mean:7.1f}  {grouped:6d} ({mean / grouped:4.0%})  "
              f"{heaviest:13d} ({mean / heaviest:4.0%})  {runs}")

if __name__ == "__main__":
    main()
