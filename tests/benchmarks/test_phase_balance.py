"""benchmarks/phase_balance.py: the k-steps the programs of the one-launch strided dgrad run, counted on
paper (no GPU needed), against counts worked out by hand from the plan's phases and the tile order."""
import sys
from pathlib import Path

import common

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import phase_balance  # noqa: E402
from layers import by_label, resnet50_layers  # noqa: E402

from conv_tutorial.kernels.dgrad import busiest_program, side_by_side_config, side_by_side_plan  # noqa: E402

STRIDED_3X3 = ["RN50 56x56 128->128 3x3 s2", "RN50 28x28 256->256 3x3 s2", "RN50 14x14 512->512 3x3 s2"]


def test_the_14x14_layer_loads_some_programs_with_one_phase():
    # ResNet-50's 14x14 512->512 3x3 stride 2 at batch 128: 49 row-tiles x 16 column tiles (4 phases of 4), phases
    # (a, b) of 1, 2, 2 and 4 taps x 8 K blocks. In the grouped order program 96 runs tiles 96, 228, ..., 756, six
    # tiles at group positions 96, 100, ..., 116: all in the 4-tap phase, 6 x 32 = 192 k-steps (program 0, six
    # 1-tap tiles: 48).
    _, N, H, W, Ci, Co, R, S, stride, padding = by_label(STRIDED_3X3[2:], resnet50_layers())[0]
    g = common.conv_geometry((N, H, W, Ci), (Co, R, S, Ci), stride, padding)
    plan = side_by_side_plan(g, side_by_side_config(g, phase_balance.ARCH))
    grouped = phase_balance.k_steps_per_tile(plan)
    assert len(grouped) == 784 and sorted(set(grouped)) == [8, 16, 32]
    assert grouped[0:32] == [8] * 32 and grouped[96:128] == [32] * 32       # a group: 4 phases x 32 tiles
    assert (sum(grouped), busiest_program(grouped, 132)) == (196 * (32 + 16 + 16 + 8), 192)
    assert sum(grouped[0::132]) == 6 * 8 and sum(grouped[96::132]) == 6 * 32
    heaviest = phase_balance.k_steps_per_tile(plan, plan.phases.heaviest_first())
    assert sorted(heaviest) == sorted(grouped) and heaviest[:196] == [32] * 196
    assert busiest_program(heaviest, 132) == 120      # 32 + 32 + 16 + 16 + 16 + 8 for program 0


def test_resnet50s_strided_3x3s_balance_as_counted():
    # The three do the same work (14112 k-steps, a mean of about 107 per program of 132); the busiest program's
    # k-steps in the grouped order and heaviest phase first, and the order phase_order picks for each.
    rows = phase_balance.balances(by_label(STRIDED_3X3, resnet50_layers()), sms=132)
    assert [(row.label, row.tiles, row.k_steps, row.programs, row.grouped, row.heaviest_first, row.runs)
            for row in rows] == [(STRIDED_3X3[0], 3136, 14112, 132, 108, 108, "grouped"),
                                 (STRIDED_3X3[1], 1568, 14112, 132, 128, 108, "heaviest first"),
                                 (STRIDED_3X3[2], 784, 14112, 132, 192, 120, "heaviest first")]
    assert round(rows[2].mean / rows[2].grouped, 2) == 0.56 and round(rows[2].mean / rows[2].heaviest_first, 2) == 0.89


def test_only_strided_convs_with_more_than_8_channels_are_counted():
    # ResNet-50 has 23 distinct convs; its stem (3 channels: folded instead) and the stride-1 ones are left out,
    # and of its strided 1x1 downsamples none has every phase with taps (three of four phases are zeros).
    labels = [row.label for row in phase_balance.balances(resnet50_layers(), sms=132)]
    assert labels == STRIDED_3X3


def test_main_returns_what_it_prints(capsys):
    rows = phase_balance.main(["--sms", "132"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(rows) and {row.label for row in rows} >= set(STRIDED_3X3)
    assert all(row.grouped >= row.mean and row.heaviest_first >= row.mean for row in rows)
