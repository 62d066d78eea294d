"""Lesson 05, section 9: the kernel on e4m3 (fp8) operands, against torch's fp32 conv of the very
values the kernel multiplies (the dequantized operands), on the GPU, with the scales quantized and
folded into the epilogue as the operator does it (conv_tutorial.geometry); the operator's checks of
those scales on any machine.

The tolerance, derived from the formats (not fitted to the results):
- the products of two e4m3 values are exact in fp32, but Hopper's fp8 WGMMA adds each
  instruction's 32 products into its fp32 accumulator keeping only about 13 of its mantissa bits:
  each of the n = K / 32 instructions of a dot product may be off by up to 2^-13 of the
  magnitudes summed so far, which the sum of the products' magnitudes bounds (sum |x| |w|,
  computed as conv(|x|, |w|)). Those roundings go either way and add like a random walk: sqrt(n)
  of them, and we allow four times that (2^-11 sqrt(n) of the magnitude). A linear sum, n of them,
  would allow a whole missing tap on deep layers; a wrong tap, channel or scale is off by far more;
- the output then rounds to bf16 (half an ulp: up to 2^-8 relative) or to e4m3 (2^-4, and
  values below e4m3's smallest normal, 2^-6 x out_scale, to a multiple of its smallest subnormal,
  2^-9 x out_scale).
"""
import random

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch

from conv_tutorial import geometry
from conv_tutorial.kernels import fprop

lesson05 = common.load_lesson("05-warp-specialized-conv")
FIXED_CONFIG, KernelConfig = lesson05.FIXED_CONFIG, lesson05.KernelConfig

needs_gpu = lesson05.needs_gpu
FP8 = common.FP8
ACCUMULATION = 4 * 2.0 ** -13       # per sqrt(instruction); see above
ROUNDING = {torch.bfloat16: 2.0 ** -8, FP8: 2.0 ** -4}


def quantized_layer(N, H, W, Ci, Co, R, S, seed=0, device="cuda"):
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.float32, device_name=device, seed=seed)
    return geometry.quantize_conv_operands(x, w)


def check_fp8_conv(x_q, x_scale, w_q, w_scale, stride, padding, config=FIXED_CONFIG, bias=False, scale=False,
                   residual=False, activation="none", out_dtype=torch.bfloat16, seed=0):
    """The fp8 conv with the asked epilogue against torch in fp32 on the dequantized operands."""
    g = common.conv_geometry(x_q.shape, w_q.shape, stride, padding)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    def vector(): return (torch.rand(g.Co, generator=generator) + 0.5).cuda()           # noqa: E704
    bias_t, scale_t = (vector() if bias else None), (vector() if scale else None)
    x, w = geometry.dequantize_conv_operands(x_q, x_scale, w_q, w_scale)
    conv = common.reference_conv2d_nhwc(x, w, None, stride, padding)
    magnitude = common.reference_conv2d_nhwc(x.abs(), w.abs(), None, stride, padding)   # sum |x| |w|
    if scale_t is not None:
        conv, magnitude = conv * scale_t, magnitude * scale_t
    out_scale = residual_t = None
    residual_real = torch.randn(g.output_shape_nhwc, generator=generator).cuda() if residual else None
    if out_dtype == FP8:   # the output's scale as calibration would pick it: its amax (and an eighth more) at 448
        amax = common.reference_epilogue(conv, bias_t, None, residual_real, activation).abs().amax()
        out_scale = (amax * 1.125 / 448).reshape(()).float().contiguous()
    if residual and out_dtype == FP8:      # in e4m3 at the output's scale: what an fp8 conv before it wrote
        residual_t = (residual_real / out_scale).clamp(-448, 448).to(FP8)
        residual_real = residual_t.float() * out_scale
    elif residual:
        residual_t = residual_real.to(out_dtype)
        residual_real = residual_t.float()
    expected = common.reference_epilogue(conv, bias_t, None, residual_real if residual else None, activation)
    geometry.check_fp8_scales(x_scale, w_scale, g.Co, x_q.device, residual=residual_t, activation=activation,
                              out_dtype=out_dtype, out_scale=out_scale)
    epilogue_scale, epilogue_bias = geometry.fp8_epilogue(x_scale, w_scale, scale_t, bias_t, out_scale)
    # (Part II's configs, a tail, row-block stores or split-K, run in the operator's copy of the kernel)
    launch = lesson05.conv2d_fprop_launch if lesson05.part_one_config(config) else fprop.conv2d_fprop_launch
    out = launch(x_q, w_q, epilogue_bias, stride, padding, config=config, scale=epilogue_scale,
                 residual=residual_t, activation=activation, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == expected.shape
    got = out.float() * (out_scale if out_scale is not None else 1.0)
    instructions = -(-g.R * g.S * g.Ci // 32)         # e4m3 WGMMAs along K: 32 one-byte channels each
    tolerance = ACCUMULATION * instructions ** 0.5 * magnitude + ROUNDING[out_dtype] * expected.abs()
    if out_dtype == FP8:
        tolerance = tolerance + 2.0 ** -9 * out_scale
    excess = (got - expected).abs() - tolerance
    worst = excess.flatten().argmax()
    assert excess.max() <= 0, (f"{g.describe()}, {config}: {int((excess > 0).sum())} values off; worst got "
                               f"{got.flatten()[worst]:.5g}, expected {expected.flatten()[worst]:.5g}")


EPILOGUES = [dict(), dict(bias=True, activation="relu"), dict(scale=True, bias=True, residual=True, activation="relu"),
             dict(bias=True, activation="silu"), dict(out_dtype=FP8, activation="relu"),
             dict(out_dtype=FP8, scale=True, bias=True, residual=True, activation="relu")]


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding", [
    (2, 16, 16, 128, 128, 3, 3, 1, 1), (2, 15, 17, 3, 64, 7, 7, 2, 3), (2, 14, 14, 256, 300, 1, 1, 1, 0),
    (1, 9, 13, 96, 80, 3, 3, 2, 1), (2, 8, 8, 512, 256, 3, 3, 1, 1), (2, 16, 12, 48, 192, 1, 7, 1, (0, 3))])
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=str)
def test_fp8_conv_matches_torch_on_the_dequantized_operands(N, H, W, Ci, Co, R, S, stride, padding, epilogue):
    check_fp8_conv(*quantized_layer(N, H, W, Ci, Co, R, S), stride, padding, **epilogue)


@needs_gpu
@pytest.mark.parametrize("config", [KernelConfig(128, 128, 64, 6, 8, split_k=2), KernelConfig(256, 128, 64, 3, 8),
                                    KernelConfig(128, 128, 64, 4, 4, block_n_tail=64),
                                    KernelConfig(128, 128, 64, 4, 4, block_m_tail=64)], ids=str)
@pytest.mark.parametrize("epilogue", EPILOGUES[2:], ids=str)
def test_fp8_with_split_k_wide_tiles_and_tails(config, epilogue):
    if (config.split_k > 1 or config.block_m_tail) and not common.is_hopper():
        pytest.skip("split-K and row tails are Hopper schedules")
    check_fp8_conv(*quantized_layer(2, 8, 8, 512, 300, 3, 3), 1, 1, config=config, **epilogue)


@needs_gpu
def test_fp8_on_200_random_layers():
    """Random layers: odd sizes, Co off the tile, stride 1 or 2, 1x1 to 7x7, every epilogue."""
    rng = random.Random(8)
    for case in range(200):
        R, S = rng.choice([(1, 1), (3, 3), (5, 5), (7, 7), (1, 7), (3, 1)])
        stride = rng.choice([1, 2])
        H, W = rng.randint(max(R, 3), 20), rng.randint(max(S, 3), 20)
        Ci, Co = rng.choice([3, 16, 32, 48, 64, 80, 128, 192, 256]), rng.randint(1, 40) * 8
        layer = quantized_layer(rng.randint(1, 3), H, W, Ci, Co, R, S, seed=case)
        check_fp8_conv(*layer, stride, (R // 2, S // 2), seed=case, **EPILOGUES[case % len(EPILOGUES)])


def cpu_layer():
    return quantized_layer(1, 8, 8, 64, 32, 3, 3, device="cpu")


@pytest.mark.parametrize("change, error, message", [
    (dict(input_scale=None), TypeError, "input_scale must be an fp32 torch.Tensor"),
    (dict(weight_scale=torch.ones(16)), ValueError, "weight_scale must be a contiguous fp32 tensor of shape (32,)"),
    (dict(weight_scale=torch.ones(32, dtype=torch.bfloat16)), ValueError, "weight_scale must be a contiguous fp32"),
    (dict(input="bf16"), TypeError, "input has dtype torch.bfloat16; conv2d_fp8 takes torch.float8_e4m3fn"),
    (dict(out_dtype=FP8), ValueError, "needs out_scale"),
    (dict(out_dtype=torch.float16), ValueError, "out_dtype must be torch.bfloat16 or torch.float8_e4m3fn"),
    (dict(out_scale=torch.tensor(1.0)), ValueError, "out_scale is only for out_dtype=torch.float8_e4m3fn"),
    (dict(out_dtype=FP8, out_scale=torch.tensor(1.0), activation="silu"), ValueError, "not for SiLU"),
    (dict(residual="fp8"), ValueError, "residual must come in the output's dtype torch.bfloat16"),
    (dict(out_dtype=FP8, out_scale=torch.tensor(1.0), residual="bf16"), ValueError,
     "residual must come in the output's dtype torch.float8_e4m3fn"),
])
def test_fp8_call_errors_name_the_argument(change, error, message):
    """The operator's fp8 entry (conv_tutorial.conv2d_fp8, NCHW) checks the scales before any work."""
    import conv_tutorial
    x_q, x_scale, w_q, w_scale = cpu_layer()
    args = dict(input=x_q.permute(0, 3, 1, 2), input_scale=x_scale, weight=w_q.permute(0, 3, 1, 2),
                weight_scale=w_scale, padding=1)
    args.update(change)
    if args["input"] == "bf16":
        args["input"] = x_q.permute(0, 3, 1, 2).to(torch.bfloat16)
    out_shape = (1, 32, 8, 8)
    if args.get("residual") == "fp8":
        args["residual"] = torch.zeros(out_shape, dtype=FP8)
    elif args.get("residual") == "bf16":
        args["residual"] = torch.zeros(out_shape, dtype=torch.bfloat16)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        conv_tutorial.conv2d_fp8(**args)


def test_quantize_tensor_maps_amax_to_448_per_tensor_and_per_channel():
    w = torch.randn(8, 3, 3, 16) * torch.arange(1, 9).view(-1, 1, 1, 1)
    q, scale = geometry.quantize_tensor(w, channel_dim=0)
    assert q.dtype == FP8 and scale.shape == (8,)
    assert torch.equal(q.float().abs().amax(dim=(1, 2, 3)), torch.full((8,), 448.0))
    torch.testing.assert_close(q.float() * scale.view(-1, 1, 1, 1), w, rtol=2.0 ** -4, atol=2.0 ** -9 * scale.max())
    q, scale = geometry.quantize_tensor(w)
    assert scale.shape == () and q.float().abs().max() == 448.0


def test_grouped_e4m3_is_refused():
    """Section 10's grouped tiles are checked in fp16/bf16 only: e4m3 operands of a grouped conv get a
    ValueError from the launch's config check, not an untested kernel path."""
    geometry = common.conv_geometry((1, 8, 8, 64), (64, 3, 3, 32), 1, 1, 1, groups=2)
    with pytest.raises(ValueError, match="grouped convs run in fp16 or bf16"):
        lesson05.check_groups_fit(FIXED_CONFIG, geometry, element_size=1)


@pytest.mark.parametrize("arch", list(lesson05.TAUGHT_PTX_FP8))
def test_fp8_kernel_compiles_to_e4m3_mmas(arch):
    """Moved from the lesson: its fp8 build holds the e4m3 instructions its table explains."""
    common.assert_ptx_teaches("05-warp-specialized-conv", "aot_conv2d_fprop", arch, lesson05.TAUGHT_PTX_FP8,
                              **lesson05.FP8_BUILD)
