"""Lesson 07 (wgrad) beyond the lesson's own tests, on a CPU: more shapes for the mapping in torch and
for the kernel's index arithmetic on lesson 03's TMA model (grouped convs, every tile whole, a tile split
in four), the split-K sum's fixed order bit for bit, the stem's fold through the lesson's reference, and
the closing's recorded table against the run it names."""
import json
import re
import statistics

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch

lesson07 = common.load_lesson("07-conv-wgrad")
from conv_tutorial.kernels.gradients import (  # noqa: E402
    fold_input, fold_weight, folded_cost, stride_fold, unfold_weight_grad)
from conv_tutorial.kernels.wgrad import (  # noqa: E402
    WgradConfig, prepare_wgrad, wgrad_input, wgrad_problem, wgrad_result)
backward_inputs, reference_gradients = lesson07.backward_inputs, lesson07.reference_gradients


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, split_k", [
    (2, 8, 8, 3, 16, 7, 7, 2, 3, 1, 1),                 # a stem
    (1, 6, 6, 7, 9, 1, 1, 2, 0, 1, 2),                  # 1x1 stride 2
    (2, 7, 8, 5, 4, 4, 4, 3, 2, 1, 4),                  # stride 3, an even filter
    (1, 12, 12, 2, 3, 3, 3, 1, 4, 3, 2),                # dilation 3, padding 4
])
def test_wgrad_reference_matches_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation, split_k):
    lesson07.run_wgrad_reference(N, H, W, Ci, Co, R, S, stride, padding, dilation, split_k, show=False)


@pytest.mark.parametrize("Ci, Co, groups, stride, split_k", [(6, 9, 3, 1, 1), (8, 12, 4, 2, 3), (12, 8, 2, (1, 2), 2)])
def test_grouped_wgrad_reference_matches_torch(Ci, Co, groups, stride, split_k):
    lesson07.run_wgrad_reference(2, 9, 8, Ci, Co, 3, 3, stride, 1, 1, split_k, groups=groups, show=False)


def test_split_k_sum_adds_the_slices_in_order():
    """Bit for bit: each split tile of dW is ((p0 + p1) + p2) + p3, rounded once, at the tile's place;
    the whole tiles' parts of dW are left alone."""
    x, _, dy, g = backward_inputs(2, 6, 7, 12, 20, 3, 2, 1, 1, 1, torch.float32, device_name="cpu")
    # 24 tiles of 16 x 8 on 5 programs: 20 run whole, 4 are split in 4 slices
    launch = prepare_wgrad(x, dy, g, WgradConfig(16, 8, 8, num_buffers=2, split_k=4, programs=5), "sm_90", 132)
    s = launch.shape
    assert (s.whole_tiles, s.split_tiles, launch.partial.shape[:2]) == (20, 4, (4, 4))
    partial = torch.randn(launch.partial.shape, generator=torch.Generator().manual_seed(0)) * 100
    launch = launch._replace(partial=partial.to(common.device()))
    in_order = ((partial[0] + partial[1]) + partial[2]) + partial[3]          # [split tiles, 16, 8]
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.full((g.Co, s.taps, g.Ci_group), -7.0)
        for index in range(s.split_tiles):
            co0, tap, c0 = lesson07.wgrad_tile_origin.fn(s.whole_tiles + index, s.num_pid_m, s.ci_blocks, 16, 8)
            rows, cols = min(16, g.Co - co0), min(8, g.Ci_group - c0)
            expected[co0:co0 + rows, tap, c0:c0 + cols] = in_order[index, :rows, :cols]
        dw = lesson07.sum_partials(launch, torch.full((g.Co, s.taps * g.Ci_group), -7.0, dtype=dtype,
                                                      device=common.device()))
        dw, expected = dw.cpu().view(expected.shape), expected.to(dtype)
        if dtype == torch.bfloat16 and common.interpreter_mode():
            # Triton 3.9's interpreter casts fp32 to bf16 towards zero (checked: 231.6 -> 231), the GPU to
            # the nearest value (cvt.rn): on a CPU the cast may land one bf16 step (2^-7 relative) lower
            torch.testing.assert_close(dw, expected, rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(dw, expected)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation, config", [
    (1, 9, 8, 3, 16, 3, 3, 2, 1, 1, None),         # Ci = 3, padded to 4 (fp32); stride 2
    (2, 7, 6, 8, 8, 3, 3, 1, 2, 2, None),          # dilation 2, padding 2
    (2, 5, 9, 16, 12, 1, 3, (2, 1), (0, 1), 1, None),   # different strides, a 1x3 filter
    (2, 5, 7, 12, 20, 1, 1, 1, 0, 1, WgradConfig(16, 8, 8, num_buffers=2, split_k=1)),   # x read tiled, all whole
    (2, 9, 9, 20, 72, 3, 3, 1, 1, 1, WgradConfig(64, 16, 32, split_k=2)),   # a GPU's tile sizes, Co = 72; every
                                                                             # tile split (fewer tiles than programs)
    (2, 6, 7, 12, 20, 3, 2, 1, 1, 1, WgradConfig(16, 8, 8, num_buffers=2, split_k=1)),   # every tile whole
    (1, 6, 5, 12, 20, 3, 3, 1, 1, 1, WgradConfig(16, 8, 8, num_buffers=2, split_k=4, programs=7)),   # 36 tiles: 35
])                                                                                       # whole, 1 in 4 slices
def test_wgrad_kernel_arithmetic_on_the_tma_model(N, H, W, Ci, Co, R, S, stride, padding, dilation, config):
    lesson07.run_wgrad_model(N, H, W, Ci, Co, R, S, stride, padding, dilation, config, show=False)


@pytest.mark.parametrize("Ci, Co, groups, config", [
    (16, 32, 2, WgradConfig(16, 8, 8, num_buffers=2, split_k=3, programs=5)),   # 8 -> 16 channels per group: one
                                                                                 # row tile each; whole and split
    (32, 64, 2, WgradConfig(16, 8, 8, num_buffers=2, split_k=2)),    # 16 -> 32 per group: two row tiles and two
])                                                                   # channel blocks in each group
def test_wgrad_kernel_arithmetic_on_grouped_convs(Ci, Co, groups, config):
    lesson07.run_wgrad_model(2, 6, 7, Ci, Co, 3, 3, 2, 1, 1, config, show=False, groups=groups)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding", [
    (2, 20, 18, 3, 8, 7, 7, 2, 3),            # the stem
    (1, 23, 17, 3, 5, 7, 7, 2, 3),            # the stem, odd sizes: pads (3, 4, 3, 4)
    (1, 11, 13, 2, 5, 4, 3, (2, 3), 0),       # no padding: pads (0, -1, 0, -1), x's last row and column cut
    (2, 11, 12, 3, 4, 3, 3, 2, 1),            # 3x3 stride 2 on an RGB image
    (1, 13, 10, 1, 6, 5, 3, (3, 2), (2, 0)),  # per-axis stride and padding, one channel
    (1, 16, 15, 1, 3, 4, 4, 4, 5),            # stride 4, padding past the filter
    (1, 9, 9, 2, 3, 3, 5, 3, (0, 2)),         # stride 3: nine channel groups
])
def test_folded_wgrad_matches_torch(N, H, W, Ci, Co, R, S, stride, padding):
    """The stem's fold (the launcher's, the package's stride_fold): the folded conv is the same conv, and
    its dW, by the lesson's dY^T @ im2col(x), unfolds to torch's. (dgrad's half: lesson 06's tests.)"""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, torch.float32, device_name="cpu")
    fold = stride_fold(g)
    assert fold is not None, g.describe()
    x_folded = fold_input(x, fold)       # the folded conv is the same conv: its output is y
    y = common.reference_conv2d_nhwc(x, w, None, g.stride, g.padding, 1, out_dtype=torch.float32)
    torch.testing.assert_close(common.reference_conv2d_nhwc(x_folded, fold_weight(w, fold), None, 1, 0, 1,
                                                            out_dtype=torch.float32), y, rtol=1e-4, atol=1e-4)
    dw = unfold_weight_grad(lesson07.wgrad_reference(x_folded, dy, fold.geometry), g, fold)
    torch.testing.assert_close(dw, reference_gradients(x, w, dy, g)[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("Ci, R, stride, dilation, folds", [
    (3, 7, 2, 1, True),      # the stem: 49 x 16 columns -> 16 x 16
    (3, 3, 2, 1, True),      # 9 x 16 -> 4 x 16
    (8, 3, 2, 1, False),     # 9 x 16 -> 4 x 32: less, but not half
    (128, 3, 2, 1, False),   # ResNet-50's first 3x3 stride 2: 9 x 128 < 4 x 512
    (3, 1, 2, 1, False),     # 1x1: nothing to fold (1 x 16 either way)
    (3, 7, 1, 1, False),     # stride 1
    (3, 7, 2, 2, False),     # dilation 2
])
def test_stride_fold_where_it_pays(Ci, R, stride, dilation, folds):
    g = common.conv_geometry((2, 32, 32, Ci), (8, R, R, Ci), stride, R // 2, dilation)
    assert (stride_fold(g) is not None) == folds
    if folds:       # the cost it halves at least: taps x channel box, the MMA columns per output channel
        f = stride_fold(g)
        assert 2 * folded_cost(f.geometry.R, f.geometry.S, f.Ci_padded) <= folded_cost(R, R, Ci)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, taps_in_channels", [
    (2, 20, 18, 3, 8, 7, 7, 2, 3, 4),       # the stem: folded, then 4 column taps of 16 channels in one box of 64
    (2, 11, 12, 3, 4, 3, 3, 2, 1, 2),       # 3x3 stride 2 on RGB: folded to 2x2 taps of 16, then 2 x 16 in one box
    (1, 12, 11, 8, 5, 3, 3, 1, 0, 0),       # not folded: left alone (the step follows a fold only)
    (1, 15, 13, 3, 4, 5, 5, 2, 2, 0),       # 5x5 stride 2 on RGB: folded to 3x3 taps of 16; a row of taps,
                                            # 3 x 16 columns, would take a box of 64: left folded only
])
def test_wgrad_problem_gives_torchs_dw(N, H, W, Ci, Co, R, S, stride, padding, taps_in_channels):
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, torch.float32, device_name="cpu")
    problem = wgrad_problem(g, element_size=2)
    assert problem.taps_in_channels == taps_in_channels
    dw = wgrad_result(lesson07.wgrad_reference(wgrad_input(x, problem), dy, problem.geometry), g, problem)
    torch.testing.assert_close(dw, reference_gradients(x, w, dy, g)[1], rtol=1e-4, atol=1e-4)


def test_closing_table_is_the_recorded_runs():
    """The closing's table, rebuilt from the JSON of the run it names, stands in the lesson as printed here."""
    source = (common.REPO_ROOT / "07-conv-wgrad.py").read_text()
    path = common.RESULTS_DIR / "h100-2026-11-27" / "backward_layers_operator_cuda_graphs.json"
    assert "# " + str(path.relative_to(common.REPO_ROOT)) + " (" in source
    data = json.loads(path.read_text())
    rows = {row["layer"]: row for row in data["rows"]}
    table = [line[6:] for line in source.splitlines() if line.startswith("#     RN50 ")
             and line.rstrip().endswith(tuple("0123456789"))]
    assert len(table) >= 5
    for line in table:
        label = re.match(r"(RN50 .*?)\s{2,}", line).group(1)
        row = rows[label]
        ours, theirs = row["wgrad"]["tflops"], row["wgrad cuDNN"]["tflops"]
        assert line.rstrip() == (f"{label:<30} {ours:6.1f} {theirs:6.1f}  {ours / theirs:4.2f}x  "
                                 f"{row['wgrad_whole_tiles']:4d}, {row['wgrad_split_k']:2d}"), line
    ratios = [row["wgrad"]["tflops"] / row["wgrad cuDNN"]["tflops"] for row in data["rows"]]
    assert f"Over the {len(ratios)} layers: {data['summary']['wgrad']:.2f}x cuDNN" in source
    assert f"{sum(ratio >= 1 for ratio in ratios)} layers at or above its speed" in source
    assert min(ratios) == rows["RN50 7x7 512->2048 1x1"]["wgrad"]["tflops"] / rows["RN50 7x7 512->2048 1x1"][
        "wgrad cuDNN"]["tflops"]
    low = rows["RN50 7x7 512->2048 1x1"]
    assert f"{low['wgrad']['ms'] * 1e3:.1f} us against {low['wgrad cuDNN']['ms'] * 1e3:.1f}" in source
    host = {name: statistics.median(row["host_us"][name] for row in data["rows"])
            for name in ("wgrad", "wgrad cuDNN", "wgrad operator")}
    kernels = [row["wgrad"]["ms"] * 1e3 for row in data["rows"]]
    prose = " ".join(line.lstrip("# ") for line in source.splitlines())
    assert (f"a median of {host['wgrad']:.0f} us per call over the {len(ratios)} layers in the same run against "
            f"cuDNN's {host['wgrad cuDNN']:.0f} us, where the kernels take {min(kernels):.0f}-{max(kernels):.0f} us"
            in prose)
    assert f"plan per shape ({host['wgrad operator']:.0f} us)" in prose
    assert (f"the operator's dgrad at {data['summary']['dgrad operator']:.2f}x and wgrad at "
            f"{data['summary']['wgrad operator']:.2f}x in the same run" in prose)
