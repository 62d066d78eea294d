"""tools/phase_balance.py: the programs' k-steps of lesson 06's one-launch strided dgrad, on paper."""
import sys
from pathlib import Path

import common

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import phase_balance  # noqa: E402


def test_the_14x14_layer_loads_some_programs_with_one_phase():
    # ResNet-50's 14x14 512->512 3x3 stride 2 at batch 128: 49 row-tiles x 16 column tiles (4 phases of 4), phases
    # (a, b) of 1, 2, 2 and 4 taps x 8 K blocks. In lesson 05's order program 96 runs tiles 96, 228, ..., 756, six
    # tiles at group positions 96, 100, ..., 116: all in the 4-tap phase, 6 x 32 = 192 k-steps (program 0, six
    # 1-tap tiles: 48); the mean is 14112 / 132, about 107.
    lesson05, lesson06 = (common.load_lesson(name) for name in ("05-warp-specialized-conv", "06-conv-backward"))
    g = common.conv_geometry((128, 14, 14, 512), (512, 3, 3, 512), 2, 1)
    plan = lesson06.side_by_side_plan(g, lesson05.KernelConfig(128, 128, 64, 6, 8))
    grouped = phase_balance.k_steps_per_tile(lesson06, plan)
    assert len(grouped) == 784 and sorted(set(grouped)) == [8, 16, 32]
    assert grouped[0:32] == [8] * 32 and grouped[96:128] == [32] * 32       # a group: 4 phases x 32 tiles
    assert (sum(grouped), lesson06.busiest_program(grouped, 132)) == (196 * (32 + 16 + 16 + 8), 192)
    assert sum(grouped[0::132]) == 6 * 8 and sum(grouped[96::132]) == 6 * 32
    heaviest = phase_balance.k_steps_per_tile(lesson06, plan, plan.phases.heaviest_first())
    assert sorted(heaviest) == sorted(grouped) and heaviest[:196] == [32] * 196
    assert lesson06.busiest_program(heaviest, 132) == 120      # 32 + 32 + 16 + 16 + 16 + 8 for program 0


def test_the_table_says_which_order_each_layer_runs_in(capsys):
    phase_balance.main([])
    rows = {line[:34].strip(): line[34:].split() for line in capsys.readouterr().out.splitlines()[1:]}
    # tiles, mean, grouped max (share), heaviest-first max (share), the order phase_order picks
    assert rows["RN50 14x14 512->512 3x3 s2"] == ["784", "106.9", "192", "(", "56%)", "120", "(", "89%)",
                                                  "heaviest", "first"]
    assert rows["RN50 56x56 128->128 3x3 s2"][-1] == "grouped"
