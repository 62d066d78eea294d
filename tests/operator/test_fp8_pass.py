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
    # the bias: the scales' fold reads it by address with an e4m3 output, so it is checked as the kernel's
    (dict(out_dtype=FP8, out_scale="one", bias="strided"), ValueError, "bias must be contiguous"),
    (dict(out_dtype=FP8, out_scale="one", bias="short"), ValueError, "bias must have shape"),
    (dict(bias="short"), ValueError, "bias must have shape"),
    (dict(out_dtype=FP8, out_scale="one", bias="int"), TypeError, "bias must be a floating-point tensor"),
])
def test_conv2d_fp8_errors_name_the_argument(change, error, message):
    x_q, x_scale, w_q, w_scale = quantized(1, 16, 8, 8, 32, 3, 3)
    args = dict(input=x_q, input_scale=x_scale, weight=w_q, weight_scale=w_scale, bias=None, padding=1)
    replacements = {"bf16": x_q.to(torch.bfloat16), "shape": torch.ones(16, device=device),
                    "fp8": torch.zeros(1, 32, 8, 8, dtype=FP8, device=device),
                    "one": torch.tensor(1.0, device=device), "strided": torch.arange(64.0, device=device)[::2],
                    "short": torch.ones(3, device=device), "int": torch.ones(32, dtype=torch.int32, device=device)}
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


def conv_bn(ci, co, k, stride=1):
    """A conv without bias and its BatchNorm: what fuse_conv_bn_act folds into one call."""
    return torch.nn.Sequential(torch.nn.Conv2d(ci, co, k, stride, k // 2, bias=False), torch.nn.BatchNorm2d(co))


class TwoBlocks(torch.nn.Module):
    """A stem, a 1x1 conv, two bottleneck blocks with identity residuals, a head conv, pooling and a
    classifier: the 1x1 conv, the blocks' last convs and the head's input form one e4m3 chain."""

    def __init__(self, width=48):
        super().__init__()
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


# %% Deep residual chains: activations that grow block by block ---------------------------

class DeepChain(torch.nn.Module):
    """A stem, then `blocks` bottleneck blocks with identity residuals on one chain (a ResNet-101
    stage has 23), pooling and a classifier. Each block's last BatchNorm has its gains multiplied
    by `growth`, so the chain's activations grow block by block, as in a deep stage with trained
    (or random, non-trivial) statistics: the last block's amax is thousands of times the first's."""

    def __init__(self, blocks=24, width=32, growth=40.0):
        super().__init__()
        self.stem, self.entry = conv_bn(3, width, 3, 2), conv_bn(width, width, 1)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleList([conv_bn(width, 16, 1), conv_bn(16, 16, 3),
                                                               conv_bn(16, width, 1)]) for _ in range(blocks))
        self.fc = torch.nn.Linear(width, 10)
        with_batchnorm_statistics(self)
        for _, _, conv3 in self.blocks:
            conv3[1].weight.data *= growth

    def forward(self, x):
        x = torch.relu(self.entry(torch.relu(self.stem(x))))
        for conv1, conv2, conv3 in self.blocks:
            x = torch.relu(conv3(torch.relu(conv2(torch.relu(conv1(x))))) + x)
        return self.fc(x.mean((2, 3)))


def fp32_images(n, size=32, seed=1, on="cpu"):
    return images(n, size, seed, on).float()


def logits_error(model, q, x):
    """The measure RESULTS.md quotes: max |fp8 logits - fp32 logits| / max |fp32 logits|."""
    with torch.no_grad():
        reference = copy.deepcopy(model).float()(x.float())
        got = quiet(lambda: q(x)).float()
    return ((got - reference).abs().max() / reference.abs().max()).item()


@pytest.fixture(scope="module")
def deep_chain():
    torch.manual_seed(0)
    model = DeepChain().eval()
    fused = quiet(lambda: fusion.fuse_conv_bn_act(model, example_input=fp32_images(2)))
    return model, fused, [fp32_images(2, seed=s) for s in (2, 3)]


def test_one_scale_per_chain_zeroes_a_deep_chain_and_segments_do_not(deep_chain):
    # Measured on CPU (fp32 model, the operator's fallback: torch's fp32 conv of the same e4m3
    # values, saturated e4m3 outputs, as the kernel computes): one scale for the whole chain
    # 1.000 (the early blocks' outputs all zero in e4m3), segments 0.052 (6 boundaries); the bf16
    # model 0.043. With one scale and the layer check, 26 convs stay bf16 and the error is 0.043.
    model, fused, batches = deep_chain
    shared = quiet(lambda: fp8_pass.quantize_fp8(fused, batches, max_chain_range=1e30, layer_tolerance=1e30))
    split = quiet(lambda: fp8_pass.quantize_fp8(fused, batches))
    x = fp32_images(2, seed=4)
    assert not any(isinstance(m, fp8_pass.RequantizeFp8) for m in shared.modules())
    assert logits_error(model, shared, x) > 0.5                    # the failure one shared scale per chain caused
    assert split.fp8_convs == 73 and split.kept_bf16 == []
    assert logits_error(model, split, x) <= 0.15
    assert split.output_error <= 0.15
    # the chain is split where its amaxes spread past max_chain_range, with one conversion per boundary
    scales = sorted({m.out_scale.item() for name, m in split.named_modules()
                     if isinstance(m, fp8_pass.FusedConv2dFp8) and m.takes_residual})
    requantized = [m for m in split.modules() if isinstance(m, fp8_pass.RequantizeFp8)]
    assert len(scales) >= 2 and len(requantized) == len(scales) - 1
    for m in requantized:                                        # from a finer scale to a coarser one
        assert 0 < m.ratio.item() < 1


def test_segments_convert_the_residual_to_the_consumers_scale(deep_chain):
    q = quiet(lambda: fp8_pass.quantize_fp8(deep_chain[1], deep_chain[2]))
    assert any(isinstance(m, fp8_pass.RequantizeFp8) for m in q.modules())
    for node in q.graph.nodes:
        if node.op == "call_module" and isinstance(q.get_submodule(node.target), fp8_pass.RequantizeFp8):
            conversion, (consumer,) = q.get_submodule(node.target), node.users
            producer = q.get_submodule(node.args[0].target)
            ratio = producer.out_scale / q.get_submodule(consumer.target).out_scale
            assert torch.allclose(conversion.ratio, ratio)
            x_q = torch.tensor([448.0, -3.0, 0.5, 2.0 ** -9]).to(FP8)
            expected = (x_q.float() * ratio).clamp(-448, 448).to(FP8)
            assert torch.equal(conversion(x_q).view(torch.uint8), expected.view(torch.uint8))


def test_layer_check_keeps_the_layers_one_scale_breaks_in_bf16_with_one_warning(deep_chain):
    model, fused, batches = deep_chain
    with pytest.warns(UserWarning, match="stay bf16") as record:
        q = fp8_pass.quantize_fp8(fused, batches, max_chain_range=1e30)
    said = [str(w.message) for w in record if "stay bf16" in str(w.message)]
    assert len(said) == 1 and q.kept_bf16 and all(name in said[0] for name in q.kept_bf16)
    assert all(q.layer_errors[name] > fp8_pass.LAYER_TOLERANCE for name in q.kept_bf16)
    assert q.bf16_convs == 1 + len(q.kept_bf16)
    assert set(q.kept_bf16) <= {name for name, m in q.named_modules() if isinstance(m, fusion.FusedConv2d)}
    assert logits_error(model, q, fp32_images(2, seed=4)) <= 0.15


def test_model_check_warns_or_raises_when_asked(deep_chain):
    _, fused, batches = deep_chain
    with pytest.warns(UserWarning, match="past model_tolerance=1e-06"):
        fp8_pass.quantize_fp8(fused, batches, model_tolerance=1e-6)
    with pytest.raises(RuntimeError, match="past model_tolerance=1e-06"):
        quiet(lambda: fp8_pass.quantize_fp8(fused, batches, model_tolerance=1e-6, strict=True))


@pytest.mark.parametrize("argument, value", [("max_chain_range", 0.5), ("layer_tolerance", 0),
                                             ("model_tolerance", float("nan"))])
def test_pass_refuses_bad_tolerances(deep_chain, argument, value):
    with pytest.raises(ValueError, match=argument):
        fp8_pass.quantize_fp8(deep_chain[1], deep_chain[2], **{argument: value})


def test_pass_takes_an_fp32_model_with_basic_blocks():
    # ResNet-18's basic blocks: the first stage's first block takes the max-pool's fp32 output as
    # its residual (this once failed: "residual must come in the output's dtype torch.bfloat16 ... got
    # torch.float32"); it is quantized at that block's output scale now.
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = with_batchnorm_statistics(torchvision.models.resnet18()).to(memory_format=torch.channels_last)
    x = fp32_images(2, size=64, seed=4)
    fused = quiet(lambda: fusion.fuse_conv_bn_act(model, example_input=x))
    q = quiet(lambda: fp8_pass.quantize_fp8(fused, [fp32_images(2, size=64, seed=s) for s in (2, 3)]))
    assert (q.fp8_convs, q.bf16_convs) == (19, 1)
    assert isinstance(q.get_submodule("residual_of_fused_layer1_0_conv2"), fp8_pass.QuantizeFp8)
    with torch.no_grad():
        out = quiet(lambda: q(x))
    assert out.dtype == torch.float32
    assert logits_error(model, q, x) <= 0.15


# %% Scales: never zero, negative or non-finite ----------------------------------------

def test_quantize_tensor_gives_zero_tensors_scale_one_and_refuses_non_finite():
    q, scale = geometry.quantize_tensor(torch.zeros(2, 3, 4, 4))
    assert scale.item() == 1.0 and torch.equal(q.float(), torch.zeros(2, 3, 4, 4))
    w = torch.randn(4, 3, 3, 3)
    w[2] = 0
    w_q, w_scale = geometry.quantize_tensor(w, channel_dim=0)
    assert w_scale[2].item() == 1.0 and (w_scale > 0).all() and torch.isfinite(w_scale).all()
    torch.testing.assert_close(w_q.float() * w_scale.view(-1, 1, 1, 1), w, rtol=2.0 ** -4, atol=0)
    for bad in (float("inf"), float("nan")):
        t = torch.ones(3, 3)
        t[1, 1] = bad
        with pytest.raises(ValueError, match="holds inf or NaN"):
            geometry.quantize_tensor(t)


def test_pass_makes_positive_finite_scales_from_an_all_zero_calibration(deep_chain):
    _, fused, _ = deep_chain
    q = quiet(lambda: fp8_pass.quantize_fp8(fused, [torch.zeros(2, 3, 32, 32)]))
    scales = [t for name, t in q.named_buffers() if name.endswith(("scale", "ratio"))]
    assert scales and all(torch.isfinite(s).all() and (s > 0).all() for s in scales)
    with torch.no_grad():
        assert torch.isfinite(quiet(lambda: q(fp32_images(2)))).all()


def test_pass_refuses_a_calibration_that_makes_inf(deep_chain):
    _, fused, _ = deep_chain
    with pytest.raises(ValueError, match="calibration made inf or NaN in the input of"):
        quiet(lambda: fp8_pass.quantize_fp8(fused, [torch.full((2, 3, 32, 32), float("inf"))]))


@pytest.mark.parametrize("argument", ["input_scale", "weight_scale", "out_scale"])
@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_conv2d_fp8_refuses_a_bad_scale_on_cpu(argument, bad):
    x_q, x_scale, w_q, w_scale = quantized(1, 16, 6, 6, 24, 3, 3)
    args = dict(input=x_q.cpu(), input_scale=x_scale.cpu(), weight=w_q.cpu(), weight_scale=w_scale.cpu(), padding=1,
                out_dtype=FP8, out_scale=torch.tensor(0.1))
    if argument == "weight_scale":
        args[argument] = args[argument].clone()
        args[argument][5] = bad
    else:
        args[argument] = torch.tensor(bad)
    with pytest.raises(ValueError, match=rf"{argument} must be positive and finite, got {bad}"):
        quiet(lambda: ops.conv2d_fp8(**args))
    with pytest.raises(ValueError, match=argument):
        geometry.check_fp8_scales(args["input_scale"], args["weight_scale"], 24, torch.device("cpu"),
                                  out_dtype=FP8, out_scale=args["out_scale"])


@needs_gpu
def test_deep_chain_on_the_kernels_stays_close_to_the_fp32_model():
    torch.manual_seed(0)
    model = DeepChain().eval()
    deployed = copy.deepcopy(model).cuda().to(dtype=torch.bfloat16, memory_format=torch.channels_last)
    x = images(8, size=32, seed=4, on="cuda")
    fused = fusion.fuse_conv_bn_act(deployed, example_input=x)
    q = fp8_pass.quantize_fp8(fused, [images(8, size=32, seed=s, on="cuda") for s in (2, 3)])
    assert q.fp8_convs >= 70
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "conv_tutorial")     # a fallback to torch would be a failure here
        error = logits_error(model.cuda(), q, x)
    assert error <= 0.15, f"logits off by {error:.3f}"


@needs_gpu
def test_a_bad_scale_on_the_gpu_is_not_checked_and_shows_in_the_output():
    # documented behaviour: no device synchronization per call, so no check; a NaN scale gives NaN
    x_q, x_scale, w_q, w_scale = quantized(1, 16, 6, 6, 24, 3, 3)
    out = ops.conv2d_fp8(x_q, torch.tensor(float("nan"), device="cuda"), w_q, w_scale, None, 1, 1)
    assert torch.isnan(out.float()).all()


def test_the_fp8_operator_has_no_backward():
    """e4m3 operands are for inference: a call that needs a gradient (a scale that requires one) is an error
    that says so, not a gradient that silently skips the scales."""
    x_q, x_scale, w_q, w_scale = quantized(1, 16, 6, 6, 24, 3, 3)
    with pytest.raises(NotImplementedError, match="conv2d_fp8 has no backward"):
        quiet(lambda: ops.conv2d_fp8(x_q, x_scale.clone().requires_grad_(), w_q, w_scale, None, 1, 1))


@needs_gpu
@pytest.mark.parametrize("Co", [40, 48])
@pytest.mark.parametrize("out", ["bf16", "bf16-bias", "fp8", "fp8-bias-residual"])
def test_the_fp8_operator_gives_its_decompositions_bits_and_repeats_in_cpp(out, Co):
    """The op folds its scales with one launch (runtime.fold_fp8_scales), so its repeat calls replay and
    the C++ kernels serve them (native.py); torch.compile traces the decomposition (torch's ops fold the
    scales). Both: the same bits, on new tensors call after call. (An output whose pixels are not whole
    16-byte rows, 40 channels of e4m3, is stored through a wider buffer: such calls keep the full path.)"""
    from conv_tutorial import hostpath, native
    assert native.ensure(), "the native kernels could not be built here"
    hostpath.clear()
    x_q, x_scale, w_q, w_scale = quantized(2, 32, 9, 11, Co, 3, 3)
    bias = torch.randn(Co, device="cuda") if "bias" in out else None
    out_dtype, out_scale = (FP8, torch.tensor(0.07, device="cuda")) if out.startswith("fp8") else (None, None)
    residual = torch.randn(2, Co, 9, 11, device="cuda").to(FP8).contiguous(
        memory_format=torch.channels_last) if "residual" in out else None
    args = (x_q, x_scale, w_q, w_scale, bias, [1, 1], [1, 1], [1, 1], residual, "relu", out_dtype, out_scale)
    before = native.counts().get("conv_tutorial::conv2d_fp8", (0,))[0]
    for call in range(5):
        fresh = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)   # (new addresses)
        got = ops.conv2d_fp8_op(*fresh)
        want = ops._conv2d_fp8_decomposed(*fresh)
        assert got.dtype == want.dtype and got.stride() == want.stride()
        bits = torch.uint8 if got.dtype == FP8 else torch.int16      # (bit patterns: a NaN equals itself)
        assert torch.equal(got.view(bits), want.view(bits)), f"call {call}"
    if Co * got.element_size() % 16 == 0:
        assert native.counts()["conv_tutorial::conv2d_fp8"][0] - before >= 2, native.counts()


@pytest.mark.parametrize("Co", [1, 40, 64, 300])
def test_the_fp8_scale_fold_computes_torchs_scales(Co):
    """runtime.fold_fp8_scales against geometry.fp8_epilogue (torch's ops) on awkward scales, bit for bit; on a
    machine without the GPU, its kernel launched alone in Triton's interpreter."""
    import triton
    from conv_tutorial import runtime

    def fold(x_scale, w_scale, bias, out_scale):
        if device == "cuda":
            return runtime.fold_fp8_scales(x_scale, w_scale, bias, out_scale)
        e4m3_out = out_scale is not None
        has_bias = e4m3_out and bias is not None
        scale, shift = torch.empty(Co), torch.empty(Co) if has_bias else bias
        runtime.fold_fp8_scales_kernel[(triton.cdiv(Co, 256),)](
            x_scale, w_scale, bias if has_bias else x_scale, out_scale if e4m3_out else x_scale, scale,
            shift if has_bias else scale, Co, E4M3_OUT=e4m3_out, HAS_BIAS=has_bias, BLOCK=256)
        return scale, shift

    generator = torch.Generator().manual_seed(Co)
    x_scale = (torch.rand((), generator=generator) / 3 + 0.01).to(device)
    mantissas = torch.rand(Co, generator=generator)
    w_scale = (mantissas * 10.0 ** torch.randint(-20, 20, (Co,), generator=generator)).to(device)
    for bias in (None, torch.randn(Co, generator=generator).to(device),
                 torch.randn(Co, generator=generator).to(device, torch.bfloat16)):
        for out_scale in (None, torch.tensor(0.013, device=device), torch.tensor(3.0e-7, device=device)):
            got = fold(x_scale, w_scale, bias, out_scale)
            want = geometry.fp8_epilogue(x_scale, w_scale, None, bias, out_scale)
            for g, w in zip(got, want):
                assert (g is None) == (w is None) and (g is None or (g.dtype == w.dtype and torch.equal(g, w)))


def test_the_fp8_operator_compiles_to_one_graph_on_a_cpu():
    """torch.compile(fullgraph=True) traces the op's decomposition (ops.call_conv2d_fp8): on CPU tensors too,
    whose scales the eager call checks by value, which tracing cannot (a data-dependent branch)."""
    x_q, x_scale, w_q, w_scale = (t.cpu() for t in quantized(1, 16, 6, 6, 24, 3, 3))
    bias, out_scale = torch.randn(24), torch.tensor(0.05)

    def f(x_q, x_scale, w_q, w_scale, bias, out_scale):
        return ops.conv2d_fp8(x_q, x_scale, w_q, w_scale, bias, 1, 1, activation="relu", out_dtype=FP8,
                              out_scale=out_scale)
    args = (x_q, x_scale, w_q, w_scale, bias, out_scale)
    want = quiet(lambda: f(*args))
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        got = quiet(lambda: torch.compile(f, backend=backend, fullgraph=True)(*args))
        assert got.dtype == FP8 and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), backend
