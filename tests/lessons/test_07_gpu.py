"""Lesson 07's wgrad on a Hopper or Blackwell GPU beyond the lesson's own checks: grouped convs, fp16,
and configs that force one slice, uneven slices and a mix of whole and split tiles, each against
torch.nn.grad (the lesson's check_wgrad, its tolerance)."""
import common

import pytest
import torch

lesson07 = common.load_lesson("07-conv-wgrad")
WgradConfig, needs_gpu = lesson07.WgradConfig, lesson07.needs_gpu


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, groups", [
    (2, 14, 14, 256, 256, 3, 3, 1, 1, 2),          # 128 channels per group
    (2, 15, 13, 128, 256, 3, 3, 2, 1, 2),          # 64 -> 128 per group, stride 2
    (2, 9, 10, 256, 512, 1, 1, 1, 0, 4),           # 1x1, four groups of 64 -> 128
    (2, 8, 8, 512, 512, 3, 3, 1, 1, 2),            # 256 per group: two tiles along each group's rows and columns
])
def test_grouped_wgrad_matches_torch(N, H, W, Ci, Co, R, S, stride, padding, groups):
    lesson07.check_wgrad(N, H, W, Ci, Co, R, S, stride, padding, groups=groups)


@needs_gpu
@pytest.mark.parametrize("dtype, config", [
    (torch.float16, None),
    (torch.bfloat16, WgradConfig(128, 128, split_k=1)),     # one slice: a whole K loop per tile
    (torch.bfloat16, WgradConfig(128, 64, split_k=7)),      # slices of uneven length
    (torch.bfloat16, WgradConfig(128, 64, split_k=5, programs=4)),   # 18 tiles: 16 whole, 2 in 5 slices
    (torch.float16, WgradConfig(64, 64, 128, split_k=3, programs=7)),    # 36 tiles: 35 whole, 1 in 3
])
def test_wgrad_dtypes_and_splits(dtype, config):
    # a ResNet-50 3x3 layer at batch 8: K = 8 x 28 x 28 = 6272 pixels
    lesson07.check_wgrad(8, 28, 28, 128, 128, 3, 3, 1, 1, dtype=dtype, config=config)
