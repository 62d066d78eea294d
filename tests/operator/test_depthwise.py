"""depthwise.depthwise_conv2d against torch.nn.functional.conv2d(groups=C) in fp32 with
common.reference_epilogue: under the Triton interpreter on a CPU, on the GPU where there is one
(including 100 random layers: odd sizes, stride 2, 1x1 to 7x7 filters, dilation, every epilogue)."""
import random

import common
from conv_tutorial import depthwise, ops  # noqa: E402

import pytest
import torch


device = "cuda" if common.HAS_CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not common.HAS_CUDA, reason="needs a CUDA GPU (random layers at full size)")


def check_depthwise(N, H, W, C, R, S, stride, padding, dilation=1, dtype=torch.float32, bias=False, scale=False,
                    residual=False, activation="none", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, W, C, generator=generator).to(device, dtype)
    w = torch.randn(C, 1, R, S, generator=generator).to(device, dtype)
    bias_t = torch.randn(C, generator=generator).to(device) if bias else None
    scale_t = (torch.rand(C, generator=generator) + 0.5).to(device) if scale else None
    conv = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2).float(), w.float(), None, stride, padding, dilation,
                                      groups=C).permute(0, 2, 3, 1)
    residual_t = torch.randn(conv.shape, generator=generator).to(device, dtype) if residual else None
    expected = common.reference_epilogue(conv, bias_t, scale_t, None if residual_t is None else residual_t.float(),
                                         activation)
    out = depthwise.depthwise_conv2d(x, w, bias_t, stride, padding, dilation, scale_t, residual_t, activation)
    assert out.shape == expected.shape and out.dtype == dtype
    # fp32 sums of R*S products, then one rounding to the output's dtype
    rounding = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=2 * rounding, atol=2 * rounding * expected.abs().max().item()
                               + 1e-5)


@pytest.mark.parametrize("N, H, W, C, R, S, stride, padding, dilation", [
    (2, 9, 7, 24, 3, 3, 1, 1, 1), (1, 11, 13, 40, 3, 3, 2, 1, 1), (1, 8, 8, 16, 5, 5, 2, 2, 1),
    (1, 7, 9, 96, 1, 1, 1, 0, 1), (1, 10, 10, 8, 3, 3, 1, 2, 2), (2, 6, 5, 72, 7, 7, 1, 3, 1)])
@pytest.mark.parametrize("epilogue", [dict(), dict(bias=True, scale=True, activation="relu"),
                                      dict(bias=True, residual=True, activation="silu")], ids=str)
def test_depthwise_matches_torch(N, H, W, C, R, S, stride, padding, dilation, epilogue):
    check_depthwise(N, H, W, C, R, S, stride, padding, dilation, **epilogue)


def test_depthwise_in_bf16():
    check_depthwise(2, 9, 9, 48, 3, 3, 2, 1, dtype=torch.bfloat16, bias=True, scale=True, activation="silu")


@pytest.mark.parametrize("call, error, message", [
    (lambda x, w: depthwise.depthwise_conv2d(x, w[:8]), ValueError, "one filter per channel"),
    (lambda x, w: depthwise.depthwise_conv2d(x.permute(0, 2, 1, 3), w), ValueError, "contiguous"),
    (lambda x, w: depthwise.depthwise_conv2d(x, w.double()), TypeError, "share one dtype"),
    (lambda x, w: depthwise.depthwise_conv2d(x, w, activation="gelu"), ValueError, "activation must be"),
    (lambda x, w: depthwise.depthwise_conv2d(x[:, :2, :2].contiguous(), w), ValueError, "does not fit"),
])
def test_depthwise_errors_name_the_argument(call, error, message):
    x, w = torch.randn(1, 6, 6, 16), torch.randn(16, 1, 3, 3)
    with pytest.raises(error, match=message):
        call(x, w)


@needs_cuda
def test_depthwise_on_100_random_layers():
    rng = random.Random(27)
    epilogues = [dict(), dict(bias=True, scale=True, activation="relu"), dict(bias=True, activation="silu"),
                 dict(scale=True, bias=True, residual=True, activation="relu")]
    for case in range(100):
        R = S = rng.choice([1, 3, 5, 7])
        stride, dilation = rng.choice([1, 2]), rng.choice([1, 1, 1, 2])
        H, W = rng.randint(R * dilation, 40), rng.randint(S * dilation, 40)
        check_depthwise(rng.randint(1, 4), H, W, rng.choice([8, 24, 32, 72, 96, 144, 240, 480, 960]), R, S, stride,
                        (R // 2) * dilation, dilation, dtype=rng.choice([torch.bfloat16, torch.float16]),
                        seed=case, **epilogues[case % len(epilogues)])


@pytest.mark.skipif(not common.HAS_CUDA, reason="needs a CUDA GPU (the operator runs depthwise convs there)")
def test_operator_sends_depthwise_convs_to_the_kernel():
    x = torch.randn(4, 96, 17, 15, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(96, 1, 5, 5, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(96, device="cuda")
    out = ops.conv2d_op(x, w, bias, [2, 2], [2, 2], [1, 1], 96, activation="silu")
    expected = torch.nn.functional.silu(torch.nn.functional.conv2d(x.float(), w.float(), bias, 2, 2, groups=96))
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=2 ** -7 * expected.abs().max().item())
