"""Tests of the fp8 operator (ops.conv2d_fp8, torch.ops.conv_tutorial.conv2d_fp8) and of the
quantization pass (fp8_pass.quantize_fp8): against torch's fp32 conv of the dequantized
operands, opcheck, the errors, which convs the pass puts in e4m3 and which scales they share (on
any machine: the operator falls back to torch there); on a Hopper/Blackwell GPU the kernel path,
CUDA graphs and torch.compile(fullgraph=True)."""
import copy
import warnings

import common
from conv_tutorial import fp8 as fp8_pass
from conv_tutorial import fusion, geometry, ops  # noqa: E402

import pytest
import torch

common.load_lesson("05-warp-specialized-conv")

FP8 = common.FP8
device = "cuda" if common.has_tma_mma_gpu() else "cpu"
needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


def quantized(N, Ci, H, W, Co, R, S, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, Ci, H, W, generator=generator).to(device).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(Co, Ci, R, S, generator=generator) * torch.rand(Co, 1, 1, 1, generator=generator)).to(device)
    x_q, x_scale, w_q, w_scale = geometry.quantize_conv_operands(x, w)
    return x_q, x_scale, w_q.contiguous(memory_format=torch.channels_last), w_scale


def dequantized_reference(x_q, x_scale, w_q, w_scale, bias, stride, padding, residual=None, activation="none"):
    conv = torch.nn.functional.conv2d(*geometry.dequantize_conv_operands(x_q, x_scale, w_q, w_scale), None,
                                      stride, padding)
    return common.reference_epilogue(conv, bias, None, residual, activation, channel_dim=1)


def quiet(call):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # the fallback's warning on a machine without the kernel
        return call()


@pytest.mark.parametrize("N, Ci, H, W, Co, R, S, stride, padding", [
    (2, 64, 10, 12, 96, 3, 3, 1, 1), (1, 128, 9, 9, 40, 1, 1, 2, 0), (2, 32, 11, 7, 64, 5, 5, 2, 2)])
@pytest.mark.parametrize("out", ["bf16", "fp8"])
def test_conv2d_fp8_matches_torch_on_the_dequantized_operands(N, Ci, H, W, Co, R, S, stride, padding, out):
    x_q, x_scale, w_q, w_scale = quantized(N, Ci, H, W, Co, R, S)
    bias = torch.randn(Co, device=device)
    expected_bf16 = dequantized_reference(x_q, x_scale, w_q, w_scale, bias, stride, padding, activation="relu")
    K = Ci * R * S
    if out == "bf16":
        got = quiet(lambda: ops.conv2d_fp8(x_q, x_scale, w_q, w_scale, bias, stride, padding, activation="relu"))
        assert got.dtype == torch.bfloat16 and got.is_contiguous(memory_format=torch.channels_last)
        common.assert_close_to_reference(got.permute(0, 2, 3, 1), expected_bf16.permute(0, 2, 3, 1),
                                         dtype=torch.bfloat16, K=K)
    else:    # e4m3 out, with a residual at the output's scale: e4m3's 2^-4 plus its subnormal step
        out_scale = (expected_bf16.abs().amax() * 1.5 / 448).reshape(())
        residual = (torch.randn_like(expected_bf16) / out_scale).to(FP8)
        expected = dequantized_reference(x_q, x_scale, w_q, w_scale, bias, stride, padding,
                                         residual.float() * out_scale, "relu")
        got = quiet(lambda: ops.conv2d_fp8(x_q, x_scale, w_q, w_scale, bias, stride, padding,
                                                  residual=residual, activation="relu", out_dtype=FP8,
                                                  out_scale=out_scale))
        assert got.dtype == FP8
        torch.testing.assert_close(got.float() * out_scale, expected, rtol=2.0 ** -4 + 2.0 ** -8,
                                   atol=2.0 ** -9 * out_scale.item() + 1e-3 * expected.abs().max().item())


@pytest.mark.parametrize("change, error, message", [
    (dict(input_scale=None), TypeError, "input_scale must be an fp32 torch.Tensor"),
    (dict(weight_scale=None), TypeError, "weight_scale must be an fp32 torch.Tensor"),
    (dict(weight_scale="shape"), ValueError, "weight_scale must be a contiguous fp32 tensor of shape (32,)"),
    (dict(input="bf16"), TypeError, "input has dtype torch.bfloat16; conv2d_fp8 takes torch.float8_e4m3fn"),
    (dict(out_dtype=FP8), ValueError, "needs out_scale"),
    (dict(residual="fp8"), ValueError, "residual must come in the output's dtype torch.bfloat16"),
    (dict(out_dtype=FP8, out_scale="one", residual="bf16"), ValueError,
     "residual must come in the output's dtype torch.float8_e4m3fn"),
    (dict(out_dtype=FP8, out_scale="one", activation="silu"), ValueError, "not for SiLU"),
])
def test_conv2d_fp8_errors_name_the_argument(change, error, message):
    x_q, x_scale, w_q, w_scale = quantized(1, 16, 8, 8, 32, 3, 3)
    args = dict(input=x_q, input_scale=x_scale, weight=w_q, weight_scale=w_scale, bias=None, padding=1)
    replacements = {"bf16": x_q.to(torch.bfloat16), "shape": torch.ones(16, device=device),
                    "fp8": torch.zeros(1, 32, 8, 8, dtype=FP8, device=device),
                    "one": torch.tensor(1.0, device=device)}
    args.update({k: replacements.get(v, v) if isinstance(v, str) and k != "activation" else v
                 for k, v in change.items()})
    if change.get("residual") == "bf16":
        args["residual"] = torch.zeros(1, 32, 8, 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        quiet(lambda: ops.conv2d_fp8(**args))


def test_opcheck_of_the_fp8_operators():
    # test_schema is left out: it compares inputs before and after with torch.allclose, which has
    # no e4m3 kernel; the fake implementation, autograd registration and AOT dispatch are checked.
    x_q, x_scale, w_q, w_scale = quantized(2, 16, 8, 9, 24, 3, 3)
    bias, out_scale = torch.randn(24, device=device), torch.tensor(0.05, device=device)
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    quiet(lambda: torch.library.opcheck(
        ops.conv2d_fp8_op, (x_q, x_scale, w_q, w_scale, bias, [1, 1], [1, 1], [1, 1]),
        dict(activation="relu", out_dtype=FP8, out_scale=out_scale), test_utils=tests))
    quiet(lambda: torch.library.opcheck(
        ops.conv2d_op, (x_q, w_q, bias, [1, 1], [1, 1], [1, 1], 1),
        dict(scale=w_scale * x_scale, out_dtype=torch.bfloat16), test_utils=tests))


def test_fake_fp8_operator_gives_the_output_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x_q = torch.empty(2, 64, 14, 14, dtype=FP8).contiguous(memory_format=torch.channels_last)
        w_q = torch.empty(128, 64, 3, 3, dtype=FP8).contiguous(memory_format=torch.channels_last)
        scales = torch.empty(()), torch.empty(128)
        out = ops.conv2d_fp8(x_q, scales[0], w_q, scales[1], None, 2, 1, out_dtype=FP8,
                                    out_scale=torch.empty(()))
        assert out.shape == (2, 128, 7, 7) and out.dtype == FP8
        assert out.is_contiguous(memory_format=torch.channels_last)


# %% The quantization pass (on the CPU, where the operator is torch's conv of the same e4m3 values:
# what the pass decides does not depend on the device; the GPU test below runs the kernels)

def with_batchnorm_statistics(model):
    """Random BatchNorm statistics that are not the identity (folding them must matter)."""
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_(0, 0.1)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.normal_(0, 0.1)
    return model.eval()


def resnet50_with_batchnorm_statistics(dtype=torch.bfloat16):
    """torchvision's ResNet-50 with random weights and BatchNorm statistics that are not the identity."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = with_batchnorm_statistics(torchvision.models.resnet50())
    return model.to(dtype=dtype, memory_format=torch.channels_last)


def images(n, size=64, seed=1, on="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=generator).to(on, torch.bfloat16).contiguous(
        memory_format=torch.channels_last)


@pytest.fixture(scope="module")
def resnet50_fp8():
    model = resnet50_with_batchnorm_statistics()
    fused = quiet(lambda: fusion.fuse_conv_bn_act(model, example_input=images(2)))
    quantized_model = quiet(lambda: fp8_pass.quantize_fp8(fused, [images(2, seed=s) for s in (2, 3)]))
    return model, fused, quantized_model


def test_pass_puts_every_conv_but_the_stem_in_e4m3(resnet50_fp8):
    _, _, q = resnet50_fp8
    fp8 = {name: m for name, m in q.named_modules() if isinstance(m, fp8_pass.FusedConv2dFp8)}
    bf16 = [name for name, m in q.named_modules() if isinstance(m, fusion.FusedConv2d)]
    assert (q.fp8_convs, q.bf16_convs) == (52, 1) and bf16 == ["fused_conv1"]
    assert len(fp8) == 52 and isinstance(q.fc, torch.nn.Linear)
    # e4m3 outputs from conv to conv, and into the pooling through one conversion
    assert all(m.out_dtype == FP8 for m in fp8.values())
    # one residual chain, one output scale: layer2's block outputs and its downsample's
    chain = [fp8[f"fused_layer2_{b}_conv3_fp8"].out_scale for b in range(4)] + \
        [fp8["fused_layer2_0_downsample_0_fp8"].out_scale]
    assert all(torch.equal(s, chain[0]) for s in chain)
    # a reader of an e4m3 output takes the writer's scale as its input scale
    assert torch.equal(fp8["fused_layer2_1_conv1_fp8"].input_scale, chain[0])
    # one conversion each way: the max-pool's output to e4m3, the last block's to bf16 for the pooling
    conversions = sorted(name for name, m in q.named_modules()
                         if isinstance(m, (fp8_pass.QuantizeFp8, fp8_pass.DequantizeFp8)))
    assert conversions == ["dequantize_fused_layer4_2_conv3", "quantize_maxpool"]


def test_quantized_resnet50_close_to_the_bf16_model(resnet50_fp8):
    model, fused, q = resnet50_fp8
    x = images(2, seed=4)
    with torch.no_grad():
        reference = copy.deepcopy(model).float()(x.float())
        bf16 = quiet(lambda: fused(x)).float()
        fp8 = quiet(lambda: q(x)).float()
    assert fp8.dtype == torch.float32 and torch.isfinite(fp8).all()
    # e4m3 keeps 3 mantissa bits: 2^-4 relative per rounding, some 50 layers deep; the bf16 model
    # is within 2^-5. A wrong scale or a lost channel is off by the logits' whole size.
    error = (fp8 - reference).abs().max() / reference.abs().max()
    assert error < 0.25, f"fp8 logits off by {error:.3f} of their largest magnitude"
    assert (bf16 - reference).abs().max() / reference.abs().max() < 2.0 ** -5


def test_fp8_module_matches_its_definition(resnet50_fp8):
    module = resnet50_fp8[2].get_submodule("fused_layer3_1_conv2_fp8")
    x_q = (torch.randn(2, 256, 4, 4) * 3).clamp(-448, 448).to(FP8).contiguous(
        memory_format=torch.channels_last)
    got = quiet(lambda: module(x_q)).float() * module.out_scale
    expected = dequantized_reference(x_q, module.input_scale, module.weight_q, module.weight_scale, module.bias,
                                     1, 1, activation="relu")
    torch.testing.assert_close(got, expected, rtol=2.0 ** -4 + 2.0 ** -8,
                               atol=2.0 ** -9 * module.out_scale.item() + 1e-3 * expected.abs().max().item())


def test_pass_refuses_what_is_not_a_fused_graph():
    with pytest.raises(TypeError, match="fused_model must be the torch.fx.GraphModule"):
        fp8_pass.quantize_fp8(torch.nn.Conv2d(3, 8, 3), [])


# %% On a Hopper or Blackwell GPU

class TwoBlocks(torch.nn.Module):
    """A stem, a 1x1 conv, two bottleneck blocks with identity residuals, a head conv, pooling and a
    classifier: the 1x1 conv, the blocks' last convs and the head's input form one e4m3 chain."""

    def __init__(self, width=48):
        super().__init__()
        def conv_bn(ci, co, k, stride=1):                                # noqa: E306
            return torch.nn.Sequential(torch.nn.Conv2d(ci, co, k, stride, k // 2, bias=False),
                                       torch.nn.BatchNorm2d(co))
        self.stem, self.entry = conv_bn(3, width, 3, 2), conv_bn(width, width, 1)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleList([conv_bn(width, 32, 1), conv_bn(32, 32, 3),
                                                               conv_bn(32, width, 1)]) for _ in range(2))
        self.head = conv_bn(width, 80, 1)
        self.fc = torch.nn.Linear(80, 10)

    def forward(self, x):
        x = torch.relu(self.entry(torch.relu(self.stem(x))))
        for conv1, conv2, conv3 in self.blocks:
            x = torch.relu(conv3(torch.relu(conv2(torch.relu(conv1(x))))) + x)
        return self.fc(torch.relu(self.head(x)).mean((2, 3)))


@needs_gpu
def test_quantized_model_on_the_kernels_in_cuda_graphs_and_torch_compile():
    model = with_batchnorm_statistics(TwoBlocks()).cuda().to(dtype=torch.bfloat16, memory_format=torch.channels_last)
    x = images(8, size=40, seed=6, on="cuda")
    fused = fusion.fuse_conv_bn_act(model, example_input=x)
    q = fp8_pass.quantize_fp8(fused, [images(8, size=40, seed=s, on="cuda") for s in (7, 8)])
    assert (q.fp8_convs, q.bf16_convs) == (8, 1)
    writes = {name: m.out_dtype for name, m in q.named_modules() if isinstance(m, fp8_pass.FusedConv2dFp8)}
    assert all(dtype == FP8 for dtype in writes.values())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", "conv_tutorial")     # a fallback to torch would be a failure here
        got = q(x).float()
        reference = copy.deepcopy(model).float()(x.float())
        on_cpu = quiet(lambda: copy.deepcopy(q).cpu()(x.cpu())).float().cuda()   # torch on the same e4m3 values
        assert (got - reference).abs().max() < 0.25 * reference.abs().max()
        torch.testing.assert_close(got, on_cpu, rtol=0.05, atol=0.05 * on_cpu.abs().max().item())
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = q(static)
        static.copy_(images(8, size=40, seed=9, on="cuda"))
        graph.replay()
        torch.testing.assert_close(captured.float(), q(static).float())
        compiled = torch.compile(q, fullgraph=True)
        torch.testing.assert_close(compiled(x).float(), got, rtol=0.05, atol=0.05 * got.abs().max().item())
