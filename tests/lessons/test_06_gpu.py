"""Lesson 06's dgrad on the GPU beyond the lesson's own check: grouped convs, fp16, and the output
window of lesson 05's kernel (section 3) storing a cropped conv into every few rows and columns of a
larger tensor, and nothing else. Skipped without a Hopper or Blackwell GPU."""
import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch

lesson06 = common.load_lesson("06-conv-dgrad")
from conv_tutorial.core.windows import OutputWindow  # noqa: E402
from conv_tutorial.kernels import fprop as forward  # noqa: E402

needs_gpu = lesson06.needs_gpu


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, groups", [
    (2, 14, 14, 256, 256, 3, 3, 1, 1, 2),          # 128 channels per group
    (2, 15, 13, 128, 256, 3, 3, 2, 1, 2),          # 64 -> 128 per group, stride 2: four phases
    (2, 9, 10, 256, 512, 1, 1, 1, 0, 4),           # 1x1, four groups of 64 -> 128
    (2, 8, 8, 512, 512, 3, 3, 1, 1, 2),            # 256 per group: two tiles along each group's rows and columns
])
def test_grouped_dgrad_matches_torch(N, H, W, Ci, Co, R, S, stride, padding, groups):
    lesson06.check_dgrad(N, H, W, Ci, Co, R, S, stride, padding, groups=groups)


@needs_gpu
@pytest.mark.parametrize("stride", [1, 2])
def test_fp16_dgrad_matches_torch(stride):
    # a ResNet-50 3x3 layer at batch 8
    lesson06.check_dgrad(8, 28, 28, 128, 128, 3, 3, stride, 1, dtype=torch.float16)


@needs_gpu
@pytest.mark.parametrize("config", [forward.FIXED_CONFIG, forward.FIXED_CONFIG._replace(block_n=64)], ids=str)
@pytest.mark.parametrize("crop", [(0, 0), (1, 2)])
def test_phase_conv_stores_into_its_rows_and_columns_of_dx(config, crop):
    # section 3's output window: lesson 05's kernel stores a conv's output, cropped, into every second row and
    # third column of a larger tensor (Co = 72: a tile's columns past the channels), and nothing else
    N, H, W, Ci, Co = 3, 13, 11, 64, 72
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, 3, 3, torch.bfloat16)
    rows, cols = H - crop[0] - 1, W - crop[1]
    dx = torch.full((N, 2 * rows + 1, 3 * cols, Co), float("nan"), dtype=x.dtype, device=x.device)
    phase = dx[:, 1::2, ::3][:, :rows, :cols]
    out = forward.conv2d_fprop_launch(x, w, padding=1, config=config, out_window=OutputWindow(phase, *crop))
    expected = common.reference_conv2d_nhwc(x, w, None, 1, 1)[:, crop[0]:crop[0] + rows, crop[1]:crop[1] + cols]
    assert out is phase
    common.assert_close_to_reference(phase, expected, dtype=x.dtype, K=Ci * 9)
    phase.fill_(0.0)
    assert dx.nan_to_num(0.0).eq(0).all() and dx.isnan().sum() == dx.numel() - phase.numel()
