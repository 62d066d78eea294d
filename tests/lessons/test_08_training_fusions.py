"""Lesson 08's cases that do not teach: the channel sums' refusals and their adding onto what the tensor holds,
the ReLU gate's input check. They call the lesson's functions (common.load_lesson)."""
import re

import pytest
import torch

import common
from conv_tutorial.core.windows import OutputWindow, check_channel_stats
from conv_tutorial.kernels import fprop as forward

lesson08 = common.load_lesson("08-training-fusions")


def test_channel_stats_are_refused_where_they_would_be_wrong():
    g = common.conv_geometry((2, 8, 8, 16), (32, 3, 3, 16), 1, 1)
    good = torch.zeros(2, 32)
    check_channel_stats(good, 32, good.device)
    for bad, words in [(torch.zeros(2, 32, dtype=torch.float16), "torch.float32"),
                       (torch.zeros(32, 2).t(), "contiguous"), (torch.zeros(2, 16), "(2, 32)"),
                       (torch.zeros(1, 2, 32), "(2, 32)"), (torch.zeros(1, 1, 2, 32), "(2, 32)")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            check_channel_stats(bad, 32, bad.device)
    # one tensor for all programs: a copy of the sums per SM ([copies, 2, Co]) is refused, by its shape
    with pytest.raises(ValueError, match=r"channel_stats is torch\.float32 \(132, 2, 32\).*shape \(2, 32\)"):
        check_channel_stats(torch.zeros(132, 2, 32), 32, good.device)
    with pytest.raises(TypeError, match="channel_stats must be a torch.Tensor"):
        check_channel_stats([0.0] * 64, 32, good.device)
    with pytest.raises(ValueError, match="without split-K"):
        check_channel_stats(good, 32, good.device, split_k=2)
    with pytest.raises(ValueError, match="out_window"):
        check_channel_stats(good, 32, good.device, out_window=OutputWindow(torch.zeros(*g.output_shape_nhwc)))


@pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
def test_channel_stats_add_to_what_the_tensor_holds():
    # every program adds into the one [2, Co] tensor, onto what it holds (so it starts zeroed): a second conv
    # into the same tensor doubles the sums, up to fp32's rounding in the adds (as in check_channel_sums)
    N, H, W, Ci, Co, R, S, stride, padding = lesson08.STATS_CASES[2]
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16)
    y, stats = lesson08.conv2d_with_channel_stats(x, w, stride, padding)
    twice = stats.clone()
    forward.conv2d_fprop_launch(x, w, None, stride, padding, channel_stats=twice)
    stored = y.reshape(-1, Co).double()
    scale = torch.stack((stored.abs().sum(0), (stored * stored).sum(0)))
    assert ((twice.double() - 2 * stats.double()).abs() <= 2e-5 * scale + 1e-4).all()


def test_relu_grad_needs_its_gate():
    with pytest.raises(ValueError, match="pass residual"):
        common.check_epilogue(8, (2, 4, 4, 8), torch.bfloat16, torch.device("cpu"), activation=common.RELU_GRAD,
                              activations=forward.EPILOGUE_ACTIVATIONS)
