"""How evenly the one-launch strided dgrad (the package's one launch, kernels/dgrad.py) loads the programs of the forward
kernel's persistent grid, counted on paper: no GPU needed.

    python benchmarks/phase_balance.py [--sms 132]

For every strided 3x3-like conv of ResNet-50, ResNet-18 and Inception v3 that the one-launch plan
takes (with the config `side_by_side_config` picks on Hopper), the k-steps each program runs when
program p of P takes tiles p, p + P, p + 2P, ... (the persistent loop), and a tile of phase (a, b)
runs that phase's taps times the K blocks of dY's channels. Two tile orders:

- "grouped": the forward kernel's order, GROUP_M row-tiles at a time, the phases' columns side by side;
- "heaviest first": the phases one after the other, the one with the most taps first, each
  phase's tiles in the grouped order.

Prints, per layer, the mean k-steps per program and the busiest program's, and their ratio: the
share of the kernel's time (its slowest program's) the average program is busy. The kernel's
speed also depends on what a k-step costs, which this does not model. `phase_order` runs a layer
heaviest first where that lightens the busiest program enough; the last column says which.
The rules counted here (the config, the tile order, phase_order) are the package's own, called.
"""
import argparse
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the lessons' kit, common.py, and the package

import common  # noqa: E402
from conv_tutorial.kernels.dgrad import (busiest_program, phase_order, side_by_side_config,  # noqa: E402
                                         side_by_side_plan, taps_per_tile)
from conv_tutorial.kernels.fprop import channel_blocks, tile_counts  # noqa: E402
from layers import inception_v3_layers, resnet18_layers, resnet50_layers  # noqa: E402

NETWORKS = (resnet50_layers, resnet18_layers, inception_v3_layers)
ARCH = "sm_90"          # side_by_side_config's choice on Hopper, whatever this machine is


def k_steps_per_tile(plan, order=None):
    """The k-steps of each tile of the one-launch conv `plan`, in the order the kernel numbers the tiles
    (`order`: as taps_per_tile's): the tile's taps times the K blocks of dY's channels."""
    g, config = plan.geometry, plan.config
    padded = -(-g.Ci_group // 8) * 8               # bf16 channels in whole 16-byte pixels, as TMA loads them
    blocks = channel_blocks(config, padded, 2)     # the launch's K blocks per tap
    return [taps * blocks for taps in taps_per_tile(plan, order)]


class Balance(NamedTuple):
    """One layer's dgrad in one launch: its tiles, their k-steps in all, the programs of the grid, the
    busiest program's k-steps in the grouped order and heaviest phase first, and the order phase_order
    picks ("grouped" or "heaviest first")."""
    label: str
    tiles: int
    k_steps: int
    programs: int
    grouped: int
    heaviest_first: int
    runs: str

    @property
    def mean(self):
        """k-steps per program, on average."""
        return self.k_steps / self.programs


def balance(label, geometry, sms):
    """The Balance of `geometry`'s dgrad on a grid of `sms` SMs, or None where the one-launch plan does
    not take it."""
    plan = side_by_side_plan(geometry, side_by_side_config(geometry, ARCH))
    if plan is None:
        return None
    programs = tile_counts(plan.config, plan.geometry.M, plan.geometry.Co, sms)[0]
    grouped, heaviest = k_steps_per_tile(plan), k_steps_per_tile(plan, plan.phases.heaviest_first())
    runs = "grouped" if phase_order(plan, programs) is None else "heaviest first"
    return Balance(label, len(grouped), sum(grouped), programs, busiest_program(grouped, programs),
                   busiest_program(heaviest, programs), runs)


def balances(layers, sms):
    """The Balance of each distinct strided conv of `layers` whose dgrad the one-launch plan takes (a conv
    of few input channels is left out: the operator folds its stride instead)."""
    seen, rows = set(), []
    for label, N, H, W, Ci, Co, R, S, stride, padding in layers:
        g = common.conv_geometry((N, H, W, Ci), (Co, R, S, Ci), stride, padding)
        if g in seen or g.stride == (1, 1) or g.Ci <= 8:
            continue
        seen.add(g)
        row = balance(label, g, sms)
        if row is not None:
            rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132, help="programs of the persistent grid (an H100's SMs)")
    args = parser.parse_args(argv)
    rows = balances([layer for network in NETWORKS for layer in network()], args.sms)
    print(f"{'layer':34s} {'tiles':>6s} {'mean':>7s}  {'grouped: max':>13s}  {'heaviest first: max':>20s}  runs")
    for row in rows:
        print(f"{row.label:34s} {row.tiles:6d} {row.mean:7.1f}  {row.grouped:6d} ({row.mean / row.grouped:4.0%})  "
              f"{row.heaviest_first:13d} ({row.mean / row.heaviest_first:4.0%})  {row.runs}")
    return rows


if __name__ == "__main__":
    main()
