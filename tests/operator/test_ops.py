"""Tests of conv_tutorial/ops.py: the operator torch.ops.conv_tutorial.conv2d, its fake implementation,
argument handling, fallbacks and their warnings, the drop-in module and the converter (CPU), and
on a Hopper/Blackwell GPU the kernel path against torch.nn.functional.conv2d, opcheck, CUDA
graphs, torch.compile and gradients."""
import warnings

import common
from conv_tutorial import ops  # noqa: E402

import pytest
import torch
import torch.nn.functional as F

common.load_lesson("05-warp-specialized-conv")

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


def test_the_operator_is_registered():
    assert hasattr(torch.ops.conv_tutorial, "conv2d")
    schema = str(torch.ops.conv_tutorial.conv2d.default._schema)
    assert "Tensor input, Tensor weight, Tensor? bias" in schema and "groups" in schema


@pytest.mark.parametrize("N, Ci, H, W, Co, R, S, stride, padding, dilation", [
    (2, 3, 17, 23, 40, 7, 7, 2, 3, 1),
    (1, 64, 14, 14, 256, 1, 1, 1, 0, 1),
    (4, 16, 9, 12, 96, 3, 5, (2, 1), (1, 2), (1, 2)),
])
def test_fake_implementation_gives_conv2d_shape_in_channels_last(N, Ci, H, W, Co, R, S, stride, padding, dilation):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(N, Ci, H, W, dtype=torch.bfloat16, device="cuda" if common.HAS_CUDA else "cpu")
        w = torch.empty(Co, Ci, R, S, dtype=torch.bfloat16, device=x.device)
        out = ops.conv2d(x, w, None, stride, padding, dilation)
    expected = torch.nn.functional.conv2d(torch.zeros(N, Ci, H, W), torch.zeros(Co, Ci, R, S), None,
                                          stride, padding, dilation)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("padding, weight_shape, stride, dilation, expected", [
    ("valid", (8, 4, 3, 3), (1, 1), (1, 1), (0, 0)),
    ("same", (8, 4, 3, 5), (1, 1), (1, 1), (1, 2)),
    ("same", (8, 4, 3, 3), (1, 1), (2, 3), (2, 3)),
    ("same", (8, 4, 2, 3), (1, 1), (1, 1), None),          # even filter: asymmetric, falls back
    (1, (8, 4, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((0, 2), (8, 4, 3, 3), (2, 2), (1, 1), (0, 2)),
])
def test_padding_arguments(padding, weight_shape, stride, dilation, expected):
    assert ops.resolve_padding(padding, weight_shape, stride, dilation) == expected


def test_bad_padding_and_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="strided"):
        ops.resolve_padding("same", (8, 4, 3, 3), (2, 2), (1, 1))
    with pytest.raises(ValueError, match="'same' or 'valid'"):
        ops.resolve_padding("full", (8, 4, 3, 3), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="padding must be non-negative"):
        ops.resolve_padding(-1, (8, 4, 3, 3), (1, 1), (1, 1))
    with pytest.raises(ValueError, match=r"input must be \[N, Ci, H, W\]"):
        ops.conv2d(torch.zeros(3, 8, 8), torch.zeros(4, 3, 3, 3))
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        ops.conv2d(torch.zeros(1, 3, 8, 8), "w")


def test_nhwc_view_is_free_in_channels_last_memory():
    x = torch.randn(2, 16, 5, 7)
    free = ops.nhwc_view(x.contiguous(memory_format=torch.channels_last))
    assert free.is_contiguous() and free.shape == (2, 5, 7, 16)
    cl = x.contiguous(memory_format=torch.channels_last)
    assert ops.nhwc_view(cl).data_ptr() == cl.data_ptr()          # no copy
    copied = ops.nhwc_view(x)                                       # NCHW memory: one copy
    assert copied.is_contiguous() and copied.data_ptr() != x.data_ptr()
    torch.testing.assert_close(copied, x.permute(0, 2, 3, 1))


@pytest.mark.skipif(common.has_tma_mma_gpu(), reason="checks the fallbacks of machines without the kernel")
def test_unsupported_calls_fall_back_with_one_warning_per_reason():
    ops._WARNED.clear()
    x, w = torch.randn(2, 6, 9, 9), torch.randn(4, 3, 3, 3)
    with pytest.warns(UserWarning, match="groups=2"):
        out = ops.conv2d(x, w, padding=1, groups=2)
    torch.testing.assert_close(out, torch.nn.functional.conv2d(x, w, padding=1, groups=2))
    assert out.is_contiguous(memory_format=torch.channels_last)
    with pytest.warns(UserWarning, match="float32"):
        ops.conv2d(x[:, :3], w, padding=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # the same reason again: no second warning
        ops.conv2d(x[:, :3], w, padding=1)
    with pytest.warns(UserWarning, match="asymmetric"):
        ops.conv2d(x[:, :3], torch.randn(4, 3, 2, 2), padding="same")


def test_opcheck_on_this_machine():
    # On a machine without the kernel this checks the schema, the fake implementation, the
    # autograd registration and the fallback; on a GPU the kernel path (see the GPU test below).
    device = "cuda" if common.has_tma_mma_gpu() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(2, 8, 10, 12, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(16, 8, 3, 3, device=device, dtype=dtype)
    b = torch.randn(16, device=device, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(torch.ops.conv_tutorial.conv2d.default, (x, w, b, [1, 1], [1, 1], [1, 1], 1))


def test_gradients_match_torch_conv2d():
    x = torch.randn(2, 4, 7, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = ops.conv2d(x, w, b, 2, 1)
    grads = torch.autograd.grad(ours.square().sum(), (x, w, b))
    expected = torch.autograd.grad(torch.nn.functional.conv2d(x, w, b, 2, 1).square().sum(), (x, w, b))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def load_torchvision():
    try:
        import torchvision
        return torchvision
    except Exception as error:   # installed, but built for another torch (a CUDA build next to a CPU one)
        pytest.skip(f"torchvision is installed but cannot load with this torch ({type(error).__name__}: "
                    f"{str(error)[:80]}); the hand-built network test covers the converter")


class Bottleneck(torch.nn.Module):
    def __init__(self, channels, stride):
        super().__init__()
        self.reduce = torch.nn.Conv2d(channels, channels // 4, 1, bias=False)
        self.bn = torch.nn.BatchNorm2d(channels // 4)
        self.spatial = torch.nn.Conv2d(channels // 4, channels // 4, 3, stride, padding=1, groups=2)
        self.expand = torch.nn.Conv2d(channels // 4, 2 * channels, 1)
        self.downsample = torch.nn.Conv2d(channels, 2 * channels, 1, stride)

    def forward(self, x):
        y = self.expand(torch.relu(self.spatial(torch.relu(self.bn(self.reduce(x))))))
        return torch.relu(y + self.downsample(x))


def small_network():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 7, 2, 3), torch.nn.ReLU(), Bottleneck(16, 2),
        torch.nn.Conv2d(32, 32, 3, padding="same", dilation=2),
        torch.nn.Conv2d(32, 32, 3, padding=1, padding_mode="reflect"),     # stays an nn.Conv2d
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)).eval()


def test_converter_on_a_hand_built_network():
    torch.manual_seed(0)
    model, reference = small_network(), small_network()
    reference.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="padding_mode='reflect' stays"):
        ops.convert_conv2d(model)
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("TutorialConv2d") == 6 and kinds.count("Conv2d") == 1
    assert isinstance(model[4], torch.nn.Conv2d) and isinstance(model[2].bn, torch.nn.BatchNorm2d)
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-4)


def test_converter_replaces_every_conv_of_torchvision_resnet():
    torchvision = load_torchvision()
    model = torchvision.models.resnet18(weights=None).eval()
    reference = torchvision.models.resnet18(weights=None).eval()
    reference.load_state_dict(model.state_dict())
    convs = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    others = [type(m) for m in model.modules() if not isinstance(m, torch.nn.Conv2d)]
    ops.convert_conv2d(model)
    assert sum(isinstance(m, ops.TutorialConv2d) for m in model.modules()) == convs == 20
    assert not any(type(m) is torch.nn.Conv2d for m in model.modules())
    assert [type(m) for m in model.modules() if not isinstance(m, ops.TutorialConv2d)] == others
    # weights repacked once: same values, PyTorch's shape, channels_last memory ([Co, R, S, Ci])
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(model.conv1.weight, reference.conv1.weight)
    assert set(model.state_dict()) == set(reference.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-4)


def test_converted_model_traces_with_fullgraph():
    model = ops.convert_conv2d(torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 1))).eval()
    x = torch.randn(1, 3, 16, 16)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(compiled(x), model(x))


# %% On a Hopper or Blackwell GPU: the kernel behind the operator

@needs_gpu
@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("N, Ci, H, W, Co, R, S, stride, padding, dilation, with_bias", [
    (8, 64, 28, 28, 128, 3, 3, 1, 1, 1, True),
    (4, 3, 56, 56, 64, 7, 7, 2, 3, 1, False),            # a stem: Ci=3 padded inside
    (16, 256, 14, 14, 96, 1, 1, 1, 0, 1, True),          # 1x1, Co not a power of two
    (2, 40, 17, 23, 48, 3, 5, (2, 1), (1, 2), (1, 2), False),
])
def test_operator_matches_torch_on_the_gpu(memory_format, N, Ci, H, W, Co, R, S, stride, padding,
                                           dilation, with_bias):
    x_nhwc, w_krsc = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16)
    x = x_nhwc.permute(0, 3, 1, 2).contiguous(memory_format=memory_format)
    w = w_krsc.permute(0, 3, 1, 2).contiguous()
    bias = torch.randn(Co, device=x.device, dtype=torch.bfloat16) if with_bias else None
    out = ops.conv2d(x, w, bias, stride, padding, dilation)
    assert out.is_contiguous(memory_format=torch.channels_last)
    expected = common.reference_conv2d_nhwc(x_nhwc, w_krsc, bias, stride, padding, dilation)
    common.assert_close_to_reference(out.permute(0, 2, 3, 1), expected, dtype=torch.bfloat16, K=Ci * R * S)


@needs_gpu
def test_operator_in_cuda_graphs_and_torch_compile():
    model = ops.convert_conv2d(torch.nn.Sequential(
        torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(128, 64, 1))).cuda().bfloat16().eval()
    x = torch.randn(8, 64, 28, 28, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = model(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(x)
        x.copy_(torch.randn_like(x))
        expected = model(x)
        graph.replay()
        torch.testing.assert_close(captured, expected)
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(x), expected, rtol=2e-2, atol=2e-2)


@needs_gpu
def test_gradients_on_the_gpu_match_torch():
    x = torch.randn(4, 32, 12, 12, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 32, 3, 3, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ours = torch.autograd.grad(ops.conv2d(x, w, None, 1, 1).float().square().sum(), (x, w))
    want = torch.autograd.grad(torch.nn.functional.conv2d(x, w, None, 1, 1).float().square().sum(), (x, w))
    for got, expected in zip(ours, want):
        torch.testing.assert_close(got.float(), expected.float(), rtol=5e-2, atol=5e-1)


# %% The CPU path's own errors and its epilogue --------------------------------------------------

@pytest.mark.parametrize("input_dtype, weight_dtype", [
    (torch.int32, torch.int32), (torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_non_floating_or_mixed_operands_get_the_operators_type_error(input_dtype, weight_dtype):
    x = torch.ones(1, 4, 5, 5).to(input_dtype)
    w = torch.ones(8, 4, 3, 3).to(weight_dtype)
    message = rf"input has dtype {input_dtype} and weight {weight_dtype}"
    with pytest.raises(TypeError, match=message):
        ops.conv2d(x, w)
    with pytest.raises(TypeError, match=message):
        ops.conv2d_op(x, w, None, [1, 1], [0, 0], [1, 1], 1, activation="relu")


def test_cpu_epilogue_computes_only_the_activation_asked_for():
    # torch has no SiLU on int32: computing it on every call made a plain call fail
    conv_out = torch.arange(-6, 6, dtype=torch.int32).reshape(1, 3, 2, 2)
    bias = torch.tensor([1, 0, -1], dtype=torch.int32)
    assert torch.equal(ops.reference_epilogue(conv_out, bias, None, None, "relu"),
                       torch.relu(conv_out + bias.view(1, -1, 1, 1)))
    assert torch.equal(ops.reference_epilogue(conv_out, None, None, conv_out, "none"), 2 * conv_out)
    x = torch.randn(2, 3, 4, 4)
    scale, bias = torch.rand(3) + 0.5, torch.randn(3)
    expected = F.silu(x * scale.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1) + x)
    torch.testing.assert_close(ops.reference_epilogue(x, bias, scale, x, "silu"), expected)


def test_tutorial_conv_under_autocast_computes_in_the_autocast_dtype():
    """Mixed-precision training: under autocast TutorialConv2d casts input and weight as autocast casts
    nn.Conv2d's (CPU autocast here: bf16, torch's conv underneath), and the fp32 parameters get fp32 gradients."""
    conv = torch.nn.Conv2d(8, 16, 3, padding=1, stride=2)
    ours = ops.TutorialConv2d(conv)
    x = torch.randn(2, 8, 9, 11).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, got = conv(x), ours(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    got.float().square().sum().backward()
    assert ours.weight.grad.dtype == torch.float32 and ours.bias.grad.dtype == torch.float32
