"""Training fusions (conv_tutorial/training.py): conv2d_channel_stats, ConvBatchNorm2d and the fx
pass against torch's Conv2d -> BatchNorm2d in training and eval mode: outputs, running statistics,
gradients. On a CPU the operator falls back to torch's conv and torch's sums (the module's own
arithmetic, its gradient through the statistics and the pass are what is checked, in fp64); on a
GPU the kernel's epilogue sums, through every Hopper candidate config of the runtime."""
import copy
import importlib
import warnings

import common

import pytest
import torch

import conv_tutorial
from conv_tutorial import configs, runtime
from conv_tutorial.training import ConvBatchNorm2d, fuse_conv_batchnorm_for_training, torch_channel_stats

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
needs_hopper = pytest.mark.skipif(not common.has_tma_mma_gpu() or torch.cuda.get_device_capability()[0] != 9,
                                  reason="needs an NVIDIA Hopper (sm_90) GPU: the candidates are Hopper's")

LAYERS = [  # (Ci, Co, kernel, stride, padding, bias, input H x W): Ci=3, odd Co, 1x1, stride 2, non-square
    (3, 10, 7, 2, 3, False, (19, 14)),
    (8, 5, 1, 1, 0, True, (6, 9)),
    (6, 12, (3, 1), (2, 1), (1, 0), False, (11, 7)),
]


def pair(layer, momentum=0.1, affine=True, track=True, dtype=torch.float64, device="cpu"):
    Ci, Co, k, stride, padding, bias, _ = layer
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(Ci, Co, k, stride, padding, bias=bias)
    bn = torch.nn.BatchNorm2d(Co, momentum=momentum, affine=affine, track_running_stats=track)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
    reference = torch.nn.Sequential(conv, bn).to(device, dtype).to(memory_format=torch.channels_last)
    fused = ConvBatchNorm2d(*copy.deepcopy(reference))
    return reference, fused


def inputs(layer, N=3, dtype=torch.float64, device="cpu", seed=1):
    H, W = layer[-1]
    x = torch.randn(N, layer[0], H, W, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.to(device, dtype).contiguous(memory_format=torch.channels_last).requires_grad_()


def named_grads(module):
    """Gradients by the role of each parameter: conv weight and bias, BatchNorm's weight and bias."""
    if isinstance(module, ConvBatchNorm2d):
        conv, bn = module.conv, module.bn
    else:
        conv, bn = module[0], module[1]
    return {name: None if p is None or p.grad is None else p.grad
            for name, p in (("weight", conv.weight), ("bias", conv.bias), ("gamma", bn.weight), ("beta", bn.bias))}


@pytest.mark.parametrize("layer", LAYERS, ids=str)
@pytest.mark.parametrize("momentum, affine, track", [(0.1, True, True), (None, True, True), (0.3, False, True),
                                                     (0.1, True, False)])
def test_module_trains_as_conv_then_batchnorm(layer, momentum, affine, track):
    """Three training steps then eval, fp64 on a CPU: outputs, every gradient (through the batch
    statistics), running mean and unbiased variance, steps counted."""
    reference, fused = pair(layer, momentum, affine, track)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # the operator's "using torch" warning on a CPU
        for step in range(3):
            x_ref, x = inputs(layer, seed=step), inputs(layer, seed=step)
            for module in (reference, fused):
                module.zero_grad()
            out_ref, out = reference(x_ref), fused(x)
            upstream = torch.randn(out_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-10)
            (out_ref * upstream).sum().backward()
            (out * upstream).sum().backward()
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-9, atol=1e-9)
            for name, grad in named_grads(fused).items():
                expected = named_grads(reference)[name]
                assert (grad is None) == (expected is None), name
                if grad is not None:
                    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-9, msg=name)
            if track:
                bn_ref, bn = reference[1], fused.bn
                torch.testing.assert_close(bn.running_mean, bn_ref.running_mean, rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(bn.running_var, bn_ref.running_var, rtol=1e-10, atol=1e-12)
                assert bn.num_batches_tracked.item() == bn_ref.num_batches_tracked.item() == step + 1
                assert not (bn.running_mean.requires_grad or bn.running_var.requires_grad)     # (buffers, as torch's)
        reference.eval()
        fused.eval()
        x = inputs(layer, seed=7)
        torch.testing.assert_close(fused(x), reference(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_module_without_running_buffers_trains_as_batchnorm(momentum):
    """A BatchNorm2d that tracks running statistics but whose buffers were set to None (as some code does to
    train on batch statistics alone): BatchNorm2d normalizes with the batch's and updates nothing but its step
    count; so does the fused module, with the same output and gradients."""
    layer = LAYERS[1]
    reference, fused = pair(layer, momentum)
    for bn in (reference[1], fused.bn):
        bn.running_mean = bn.running_var = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # the operator's "using torch" warning on a CPU
        x_ref, x = inputs(layer), inputs(layer)
        out_ref, out = reference(x_ref), fused(x)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-10)
    out_ref.square().sum().backward()
    out.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-9, atol=1e-9)
    assert fused.bn.running_mean is None and fused.bn.running_var is None
    assert fused.bn.num_batches_tracked.item() == reference[1].num_batches_tracked.item() == 1


def test_op_falls_back_to_torch_with_its_sums():
    layer = LAYERS[0]
    x = inputs(layer).detach()
    w = torch.randn(10, 3, 7, 7, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, stats = torch.ops.conv_tutorial.conv2d_channel_stats(x, w, None, [2, 2], [3, 3], [1, 1], 1)
    expected = torch.nn.functional.conv2d(x, w, None, 2, 3)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(stats, torch.stack((expected.sum((0, 2, 3)), (expected ** 2).sum((0, 2, 3)))))
    assert stats.dtype == torch.float64 and stats.shape == (2, 10)       # fp32, or fp64 for fp64 operands
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, stats32 = torch.ops.conv_tutorial.conv2d_channel_stats(x.float(), w.float(), None, [2, 2], [3, 3], [1, 1], 1)
    assert stats32.dtype == torch.float32


def test_op_passes_opcheck():
    """torch.library's checks of the schema, fake implementation and autograd registration (CPU)."""
    x = torch.randn(2, 4, 7, 6).contiguous(memory_format=torch.channels_last)
    w = torch.randn(6, 4, 3, 3).contiguous(memory_format=torch.channels_last).requires_grad_()
    b = torch.randn(6, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(torch.ops.conv_tutorial.conv2d_channel_stats.default,
                              (x.requires_grad_(), w, b, [1, 2], [1, 0], [1, 1], 1))


def test_module_refuses_what_it_cannot_be():
    conv = torch.nn.Conv2d(4, 8, 3)
    with pytest.raises(ValueError, match="BatchNorm2d has 6 features; the conv has 8 output channels"):
        ConvBatchNorm2d(conv, torch.nn.BatchNorm2d(6))
    with pytest.raises(TypeError, match="takes an nn.Conv2d and an nn.BatchNorm2d, got Conv2d and BatchNorm1d"):
        ConvBatchNorm2d(conv, torch.nn.BatchNorm1d(8))
    fused = ConvBatchNorm2d(torch.nn.Conv2d(4, 8, 1), torch.nn.BatchNorm2d(8))
    with pytest.raises(ValueError, match="more than 1 value per channel"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused(torch.randn(1, 4, 1, 1))


class Net(torch.nn.Module):
    """conv -> bn pairs the pass fuses, and three it must not: a conv with two users, a conv whose
    BatchNorm follows a ReLU, a BatchNorm of a conv's output added to something first."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, 2, 1, bias=False), torch.nn.BatchNorm2d(8)
        self.c2, self.b2 = torch.nn.Conv2d(8, 8, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(8)   # two users
        self.c3, self.b3 = torch.nn.Conv2d(8, 8, 1, bias=True), torch.nn.BatchNorm2d(8)          # ReLU between
        self.c4, self.b4 = torch.nn.Conv2d(8, 8, 1, bias=False), torch.nn.BatchNorm2d(8)

    def forward(self, x):
        a = torch.relu(self.b1(self.c1(x)))
        y = self.c2(a)
        b = self.b2(y) + y
        c = self.b3(torch.relu(self.c3(b)))
        return self.b4(self.c4(c))


def test_pass_fuses_only_conv_then_its_batchnorm():
    torch.manual_seed(0)
    model = Net().double().to(memory_format=torch.channels_last)
    fused = fuse_conv_batchnorm_for_training(model)
    assert fused.fused_pairs == 2
    kinds = [type(m).__name__ for m in fused.children()]
    assert kinds.count("ConvBatchNorm2d") == 2 and kinds.count("Conv2d") == 2 and kinds.count("BatchNorm2d") == 2
    x = torch.randn(2, 3, 10, 12, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, expected = fused(x), model(x)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
        out.square().sum().backward()
        expected.square().sum().backward()
    grads = {name: p.grad for name, p in fused.named_parameters()}
    assert torch.allclose(grads["conv_bn_c1.conv.weight"], model.c1.weight.grad, rtol=1e-9, atol=1e-9)
    assert torch.allclose(grads["conv_bn_c4.bn.weight"], model.b4.weight.grad, rtol=1e-9, atol=1e-9)
    assert model.c1.weight.grad is not None and fused.conv_bn_c1.conv.weight is not model.c1.weight   # a copy


def test_pass_leaves_convs_the_kernel_would_not_run():
    # a depthwise conv and groups of 24 channels (RegNetY's) would leave the sums to a pass of torch's over the
    # output: the pass keeps them as they are; groups of 128 channels fill the kernel's tiles and are fused
    class Grouped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.plain, self.b0 = torch.nn.Conv2d(3, 48, 3, padding=1, bias=False), torch.nn.BatchNorm2d(48)
            self.by_24, self.b1 = torch.nn.Conv2d(48, 48, 3, padding=1, groups=2, bias=False), torch.nn.BatchNorm2d(48)
            self.depthwise, self.b2 = torch.nn.Conv2d(48, 48, 3, padding=1, groups=48), torch.nn.BatchNorm2d(48)
            self.widen = torch.nn.Conv2d(48, 256, 1, bias=False)
            self.by_128, self.b3 = torch.nn.Conv2d(256, 256, 1, groups=2, bias=False), torch.nn.BatchNorm2d(256)

        def forward(self, x):
            x = self.b2(self.depthwise(self.b1(self.by_24(self.b0(self.plain(x))))))
            return self.b3(self.by_128(self.widen(x)))
    model = Grouped().double()
    fused = fuse_conv_batchnorm_for_training(model)
    assert fused.fused_pairs == 2
    assert isinstance(fused.by_24, torch.nn.Conv2d) and isinstance(fused.depthwise, torch.nn.Conv2d)
    assert {"conv_bn_plain", "conv_bn_by_128"} <= dict(fused.named_children()).keys()
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(fused(x), model(x), rtol=1e-10, atol=1e-10)


def test_pass_in_place_shares_parameters_and_buffers():
    model = Net().to(memory_format=torch.channels_last)
    fused = fuse_conv_batchnorm_for_training(model, inplace=True)
    assert fused.conv_bn_c1.bn is model.b1
    assert fused.conv_bn_c1.conv.weight.data_ptr() == model.c1.weight.data_ptr()
    assert type(model.c1) is torch.nn.Conv2d       # the model itself is not changed


def test_fused_model_traces_whole_under_torch_compile():
    """torch.compile captures the fused module in one graph, forward and backward (aot_eager: no
    code generation), and computes what eager does."""
    torch.manual_seed(0)
    model = fuse_conv_batchnorm_for_training(Net().to(memory_format=torch.channels_last))
    x = torch.randn(2, 3, 10, 12).contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = copy.deepcopy(model)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        out = compiled(x)
        out.sum().backward()
        expected = eager(x)
        expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.conv_bn_c1.conv.weight.grad, eager.conv_bn_c1.conv.weight.grad,
                               rtol=1e-4, atol=1e-4)


def test_normalization_op_is_torchs_batchnorm_and_passes_opcheck():
    """batch_norm_from_sums against torch's BatchNorm in training (fp64, CPU): the same output, and the same
    gradients for y, weight and bias with the sums' path included (the sums computed from y by torch ops), for an
    affine and a plain BatchNorm; then torch.library's checks of its schema and registration."""
    torch.manual_seed(0)
    y = torch.randn(3, 5, 4, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    for affine in (True, False):
        bn = torch.nn.BatchNorm2d(5, eps=1e-3, affine=affine).double()
        if affine:
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
        for stats_from_y in (False, True):      # (the sums' share through stats, or folded into y's)
            ours_y, ref_y = y.clone().requires_grad_(), y.clone().requires_grad_()
            stats = torch_channel_stats(ours_y)
            out, mean, var = torch.ops.conv_tutorial.batch_norm_from_sums(ours_y, stats, bn.weight, bn.bias,
                                                                         3 * 4 * 6, bn.eps, stats_from_y)
            expected = bn(ref_y)
            torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(mean, ref_y.mean((0, 2, 3)), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(var, ref_y.var((0, 2, 3), unbiased=False), rtol=1e-12, atol=1e-12)
            upstream = torch.randn_like(y)
            parameters = [bn.weight, bn.bias] if affine else []
            ours = torch.autograd.grad((out * upstream).sum(), [ours_y] + parameters)
            expected_grads = torch.autograd.grad((expected * upstream).sum(), [ref_y] + parameters)
            for got, want in zip(ours, expected_grads):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weight, bias = torch.rand(5, dtype=torch.float64) + 0.5, torch.randn(5, dtype=torch.float64)
    for stats_from_y in (False, True):
        torch.library.opcheck(torch.ops.conv_tutorial.batch_norm_from_sums.default,
                              (y, torch_channel_stats(y), weight, bias, 72, 1e-5, stats_from_y))
        torch.library.opcheck(torch.ops.conv_tutorial.batch_norm_from_sums.default,
                              (y.bfloat16(), torch_channel_stats(y.bfloat16()), None, None, 72, 1e-5, stats_from_y))
    grad, mean, var = torch.randn_like(y), torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64)
    for affine_weight in (weight, None):
        # (grad in y's layout, and in another: grad_y's layout is y's)
        for upstream in (grad, grad.contiguous()):
            for stats_from_y in (False, True):
                torch.library.opcheck(torch.ops.conv_tutorial.batch_norm_from_sums_backward.default,
                                      (upstream, y, mean, var, affine_weight, 72, 1e-5, stats_from_y))


def test_normalization_op_statistics_carry_no_gradient_and_no_second_derivative():
    """mean and var feed the running statistics only: they carry no gradient (autograd refuses to differentiate
    through them rather than give a wrong one); the sums get theirs, or with stats_from_y none (their share is in
    y's); a second derivative raises rather than come out wrong."""
    y = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    stats = torch_channel_stats(y.detach()).requires_grad_()
    op = torch.ops.conv_tutorial.batch_norm_from_sums
    assert torch.autograd.grad(op(y, stats, None, None, 32, 1e-5, True)[0].pow(3).sum(), stats,
                               allow_unused=True) == (None,)
    (grad_stats,) = torch.autograd.grad(op(y, stats, None, None, 32, 1e-5)[0].pow(3).sum(), stats)
    assert grad_stats.shape == (2, 3) and grad_stats.abs().max() > 0
    out, mean, var = op(y, stats, None, None, 32, 1e-5)
    assert out.requires_grad and not mean.requires_grad and not var.requires_grad
    (grad_y,) = torch.autograd.grad((out ** 2).sum(), y, create_graph=True)
    with pytest.raises(NotImplementedError, match="no second derivative"):
        torch.autograd.grad(grad_y.sum(), y)


def test_unpickled_fused_layer_registers_inductors_decompositions(monkeypatch):
    """torch.load builds modules without __init__: ConvBatchNorm2d registers its operators' decompositions in
    Inductor's table when unpickled too."""
    import io
    from conv_tutorial import training
    layer = fuse_conv_batchnorm_for_training(torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, bias=False),
                                                                 torch.nn.BatchNorm2d(8)))
    calls = []
    monkeypatch.setattr(training, "_inductor_decomposes", lambda: calls.append(True))
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded.conv_bn_0, ConvBatchNorm2d) and calls


def test_channel_stats_backward_with_no_gradient_reaching_it():
    """A backward that gives the fused pair's output no gradient (a custom Function's None) still calls the
    conv's node, with neither of its outputs' gradients: it passes nothing on, and the rest of the graph's
    gradients come out."""
    from conv_tutorial.training import conv2d_channel_stats_op

    class Blocked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            return None
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    y, stats = conv2d_channel_stats_op(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    out = torch.ops.conv_tutorial.batch_norm_from_sums(y, stats, None, None, 72, 1e-5, True)[0]
    grad_x, grad_w = torch.autograd.grad(Blocked.apply(out).sum() + (w ** 2).sum(), (x, w), allow_unused=True)
    assert grad_x is None
    torch.testing.assert_close(grad_w, 2 * w)


@pytest.mark.parametrize("stats_from_y", [False, True])
def test_normalization_gradient_is_autograds_of_its_ops_where_the_variance_clamps(stats_from_y):
    """The operator's gradient formula (batch_norm_from_sums_backward) against autograd through the ops of its
    forward (the function itself, fp64), with one channel constant, whose variance is 0 and clamped: no
    gradient passes through it there, as through clamp_min; and a channel whose sums make the variance
    negative, clamped too. The sums are given (their gradient compared too), or with stats_from_y computed
    from y by torch ops, autograd's reference going through them to y (with a constant offset, which the
    negative variance needs: d sums / d y is the same with it)."""
    from conv_tutorial import training
    torch.manual_seed(2)
    y = torch.randn(2, 4, 3, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    y[:, 0] = 2.0                                        # (mean 2, E[y^2] 4: variance exactly 0)
    weight, bias = torch.rand(4, dtype=torch.float64) + 0.5, torch.randn(4, dtype=torch.float64)
    sums = torch_channel_stats(y)
    offset = torch.zeros(2, 4, dtype=torch.float64)
    offset[1, 1] = sums[0, 1] ** 2 / 30 - 1e-9 - sums[1, 1]     # (the variance slightly negative, clamped)
    upstream = torch.randn_like(y)
    op = torch.ops.conv_tutorial.batch_norm_from_sums
    if stats_from_y:
        inputs = [t.clone().requires_grad_() for t in (y, weight, bias)]
        reference = [t.clone().requires_grad_() for t in (y, weight, bias)]
        out = op(inputs[0], torch_channel_stats(inputs[0].detach()) + offset, *inputs[1:], 30, 1e-5, True)[0]
        expected = training._batch_norm_from_sums(reference[0], torch_channel_stats(reference[0]) + offset,
                                                  *reference[1:], 30, 1e-5)[0]
        names = ("y", "weight", "bias")
    else:
        inputs = [t.clone().requires_grad_() for t in (y, sums + offset, weight, bias)]
        reference = [t.clone().requires_grad_() for t in (y, sums + offset, weight, bias)]
        out = op(*inputs, 30, 1e-5)[0]
        expected = training._batch_norm_from_sums(*reference, 30, 1e-5)[0]
        names = ("y", "stats", "weight", "bias")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    got = torch.autograd.grad((out * upstream).sum(), inputs)
    want = torch.autograd.grad((expected * upstream).sum(), reference)
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalization_op_in_half_precision_computes_in_fp32_and_returns_ys_dtype(dtype):
    """As under autocast in training: y in bf16/fp16, its sums and BatchNorm's parameters in fp32. The output is
    y's dtype, channels_last as y, and equals fp32 BatchNorm of the same (rounded) y, rounded once to y's dtype;
    mean and variance stay fp32."""
    torch.manual_seed(1)
    y = (torch.randn(4, 6, 5, 3) * 3 + 1).to(dtype).contiguous(memory_format=torch.channels_last)
    weight, bias = torch.rand(6) + 0.5, torch.randn(6)
    out, mean, var = torch.ops.conv_tutorial.batch_norm_from_sums(y, torch_channel_stats(y), weight, bias, 60, 1e-5)
    assert out.dtype == dtype and mean.dtype == var.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    expected = torch.nn.functional.batch_norm(y.float(), None, None, weight, bias, training=True, eps=1e-5)
    torch.testing.assert_close(out, expected.to(dtype), rtol=0, atol=float(expected.abs().max()) * 2 ** -7)
    torch.testing.assert_close(mean, y.float().mean((0, 2, 3)), rtol=1e-5, atol=1e-6)


def test_normalization_op_refuses_what_is_not_batchnorm():
    y, stats = torch.randn(2, 3, 4, 4), torch.zeros(2, 3)
    op = torch.ops.conv_tutorial.batch_norm_from_sums
    cases = [((y[0], stats, None, None, 32, 1e-5), "4-D"),
             ((y, torch.zeros(3, 3), None, None, 32, 1e-5), r"\[2, C\]"),
             ((y, stats, torch.ones(3), None, 32, 1e-5), "both or neither"),
             ((y, stats, torch.ones(4), torch.zeros(4), 32, 1e-5), r"\[C\] = \[3\]"),
             ((y, stats, None, None, 1, 1e-5), "at least 2, got 1")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            op(*args)


def test_fused_layer_gives_torch_compile_few_ops_to_trace():
    """torch.compile traces each op of ConvBatchNorm2d's forward, in every fused layer, and the first step's
    compile grows with them (RESULTS.md, "Training", "Where the first step's compile goes"): one fused layer in
    training, affine and tracking its running statistics, is at most 13 ops in Dynamo's graph (the conv and its
    sums, the normalization from them as one operator, the running statistics' updates), and Inductor's own
    graph computes the normalization: no operator of the package but the conv is left for it to call."""
    counted = []

    def counting(graph_module, example_inputs):
        counted.append(sum(node.op in ("call_function", "call_method") for node in graph_module.graph.nodes))
        return graph_module.forward
    layer = fuse_conv_batchnorm_for_training(torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1, bias=False),
                                                                 torch.nn.BatchNorm2d(16)))
    assert layer.fused_pairs == 1
    torch._dynamo.reset()
    torch.compile(layer, backend=counting, fullgraph=True)(torch.randn(2, 8, 6, 6))
    assert len(counted) == 1 and counted[0] <= 13, counted

    # (AOTAutograd with Inductor's decompositions, as torch.compile's default backend traces it)
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    importlib.import_module("torch._inductor.lowering")      # (before select_decomp_table, which needs it)
    from torch._inductor.decomposition import select_decomp_table
    targets = []

    def traced(graph_module, example_inputs):
        def keep(graph, inputs):
            targets.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
            return make_boxed_func(graph)
        return aot_module_simplified(graph_module, example_inputs, fw_compiler=keep, bw_compiler=keep,
                                     decompositions=select_decomp_table())
    torch._dynamo.reset()
    torch.compile(layer, backend=traced, fullgraph=True)(torch.randn(2, 8, 6, 6)).sum().backward()
    ours = {t for t in targets if t.startswith("conv_tutorial.")}
    assert ours == {"conv_tutorial.conv2d_channel_stats.default", "conv_tutorial.conv2d_weight_grad.default"}, ours
    assert any("rsqrt" in t for t in targets)
    # No reshape to (1, C, 1, 1): Inductor's joint-graph pattern pass tries each aten.view node against some 70
    # multi-output patterns, 0.9 s of a ResNet-50's cold first step on an H200 with five views per conv
    # (RESULTS.md, "Where the first step's compile goes"); the per-channel factors broadcast as [C, 1, 1] instead.
    assert "aten.view.default" not in targets, targets.count("aten.view.default")


# ---------------------------------------------------------------------------------------------- GPU

def stats_case(N=3, H=13, W=11, Ci=64, Co=200, R=3, stride=1, dtype=torch.bfloat16):
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, R, dtype)
    reference = common.reference_conv2d_nhwc(x, w, None, stride, R // 2, out_dtype=torch.float32)
    return x, w, reference.reshape(-1, Co).double()


def assert_stats_close(stats, reference_2d):
    """Kernel sums against fp64 sums of torch's fp32 conv: each y is off by fp32 accumulation order
    (far below 1e-4 of itself), and split-K's path sums the bf16-rounded output (2^-8 of each value,
    random in sign: well below 1e-2 of the sum of |y| over >= 400 pixels)."""
    sums = torch.stack((reference_2d.sum(0), (reference_2d ** 2).sum(0)))
    scale = torch.stack((reference_2d.abs().sum(0), (reference_2d ** 2).sum(0)))
    assert ((stats.double() - sums).abs() <= 1e-2 * scale).all()


@needs_hopper
@pytest.mark.parametrize("config", configs.HOPPER_CANDIDATES, ids=str)
def test_every_hopper_candidate_adds_channel_stats(config):
    """The runtime's sums through every candidate's epilogue (tails, row blocks, ping-pong; split-K's
    through torch), twice (Triton's launcher, then the direct launch, on new data)."""
    for seed in (0, 1):
        x, w, reference = stats_case(Ci=64 + 64 * seed)
        stats = torch.zeros(2, w.shape[0], device=x.device)
        out = runtime.conv2d(x, w, None, 1, 1, config=tuple(config), channel_stats=stats)
        common.assert_close_to_reference(out, reference.float().reshape(out.shape), dtype=x.dtype, K=w[0].numel())
        assert_stats_close(stats, reference)


@needs_gpu
@pytest.mark.parametrize("shape", [(2, 20, 18, 3, 100, 7, 2), (4, 28, 28, 128, 128, 3, 2), (3, 9, 17, 32, 72, 1, 1)],
                         ids=str)
def test_heuristic_plans_add_channel_stats(shape):
    """The runtime's own choice (a folded stem with Ci=3, stride 2, Co not a multiple of a tile)."""
    N, H, W, Ci, Co, R, stride = shape
    x, w, reference = stats_case(N, H, W, Ci, Co, R, stride)
    stats = torch.zeros(2, Co, device=x.device)
    runtime.conv2d(x, w, None, stride, R // 2, tune=False, channel_stats=stats)
    assert_stats_close(stats, reference)


@needs_gpu
def test_runtime_refuses_bad_channel_stats():
    x, w, _ = stats_case()
    with pytest.raises(ValueError, match=r"shape \(2, 200\)"):
        runtime.conv2d(x, w, None, 1, 1, tune=False, channel_stats=torch.zeros(2, 100, device=x.device))
    with pytest.raises(ValueError, match="torch.float32"):
        runtime.conv2d(x, w, None, 1, 1, tune=False, channel_stats=torch.zeros(2, 200, device=x.device).half())


@needs_gpu
@pytest.mark.parametrize("backend", ["torch", "lesson06"])
@pytest.mark.parametrize("layer", [(64, 128, 3, 1, 1, False, (28, 20)), (3, 64, 7, 2, 3, False, (56, 56)),
                                   (256, 72, 1, 2, 0, True, (14, 15))], ids=str)
def test_module_on_the_kernel_trains_as_torch(layer, backend):
    """bf16 autocast, as training runs it: the fused module against Conv2d -> BatchNorm2d (cuDNN),
    outputs, the input's and parameters' gradients, running statistics. Both round to bf16 in
    different places (the conv's output, the normalized output, the gradients), so the tolerance is
    bf16's (2e-2 relative) on values of unit size."""
    before = conv_tutorial.backward_backend()
    conv_tutorial.set_backward(backend)
    try:
        reference, fused = pair(layer, dtype=torch.float32, device="cuda")
        x_ref, x = inputs(layer, N=8, dtype=torch.float32, device="cuda"), inputs(layer, N=8, dtype=torch.float32,
                                                                                 device="cuda")
        with torch.autocast("cuda", torch.bfloat16):
            out_ref, out = reference(x_ref), fused(x)
        upstream = torch.randn_like(out_ref.float())
        (out_ref.float() * upstream).sum().backward()
        (out.float() * upstream).sum().backward()
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=5e-2)
        ours, torchs = named_grads(fused), named_grads(reference)
        for got, expected in [(x.grad, x_ref.grad)] + [(ours[k], torchs[k]) for k in ("weight", "gamma", "beta")]:
            scale = expected.abs().max().item()
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=3e-2 * scale)
        if torchs["bias"] is not None:
            # BatchNorm subtracts the batch mean, so the conv bias's true gradient is 0: both are rounding
            # noise of sums over bf16 gradients, small against the gradient of BatchNorm's own shift
            bound = 5e-2 * torchs["beta"].abs().max().item()
            assert ours["bias"].abs().max().item() < bound and torchs["bias"].abs().max().item() < bound
        torch.testing.assert_close(fused.bn.running_mean, reference[1].running_mean, rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(fused.bn.running_var, reference[1].running_var, rtol=2e-2, atol=2e-3)
    finally:
        conv_tutorial.set_backward(before)


@needs_gpu
def test_fused_resnet_block_compiles_and_matches_eager():
    """A torchvision BasicBlock through the pass and torch.compile (Inductor): one training step's
    output and gradients against the same block unfused, in bf16 autocast."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    block = torchvision.models.resnet.BasicBlock(64, 64).cuda().to(memory_format=torch.channels_last)
    fused = conv_tutorial.fuse_conv_batchnorm_for_training(block)
    assert fused.fused_pairs == 2
    x = torch.randn(16, 64, 28, 28, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", torch.bfloat16):
        out = torch.compile(fused)(x)
        expected = block(x)
    out.float().sum().backward()
    expected.float().sum().backward()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=5e-2)
    got, want = fused.conv_bn_conv1.conv.weight.grad, block.conv1.weight.grad
    torch.testing.assert_close(got, want, rtol=2e-2, atol=3e-2 * want.abs().max().item())


# ReLU's backward in dgrad's epilogue (fuse_relu_into_dgrad, conv2d_after_relu, conv2d_input_grad_relu) ---------

def _gradients_by_storage(model):
    return {p.data_ptr(): p.grad for p in model.parameters()}


@pytest.mark.parametrize("net, fused_relus", [("resnet18", 8), ("resnet50", 29), ("vgg11", 3)])
def test_relu_pass_gives_torchs_gradients(net, fused_relus):
    """fp64 on a CPU: a torchvision net after both passes against the net itself, the input's and every
    parameter's gradient (the ReLU's backward now comes from the conv's; ResNet's ReLUs in place, VGG's
    without BatchNorm). Parameters whose true gradient is 0 (a conv bias before BatchNorm) are left out.
    ResNet-50: 16 blocks' conv2 and conv3 less the three stride-2 conv2s, whose dgrad cannot gate.
    VGG-11's classifier keeps its layers (Linear, in-place ReLU, Dropout: ReLUs the pass must leave, no
    conv after them) at 64 features instead of 4096: its 120 of VGG-11's 129 million parameters, in fp64
    and held four times (the net, its copy, both sets of gradients), took this test to 5.8 GiB of RAM
    (the three cases in one process: 1.8 GiB now)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, net)(num_classes=10)
    if net == "vgg11":
        model.classifier = torch.nn.Sequential(
            torch.nn.Linear(512 * 7 * 7, 64), torch.nn.ReLU(inplace=True), torch.nn.Dropout(),
            torch.nn.Linear(64, 64), torch.nn.ReLU(inplace=True), torch.nn.Dropout(), torch.nn.Linear(64, 10))
    model = model.double().train().to(memory_format=torch.channels_last)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    reference = copy.deepcopy(model)
    order = [p.data_ptr() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = conv_tutorial.fuse_relu_into_dgrad(conv_tutorial.fuse_conv_batchnorm_for_training(model, inplace=True),
                                                   inplace=True)
        assert fused.fused_relus == fused_relus
        x = torch.randn(2, 3, 64, 64, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        weights = torch.arange(10, dtype=torch.float64)
        (fused(x) * weights).sum().backward()
        (reference(x_ref) * weights).sum().backward()
    # fp64 stays (the memory was VGG's classifier, not the dtype): the two paths sum the same products in
    # different orders, ~1e-12 of a gradient's norm apart, so the 1e-9 bound leaves room for rounding alone;
    # a wrong gate, even at one element, moves a gradient by far more. In fp32 that noise would be ~10^8 times
    # larger (2^-24 against 2^-53 per rounding), near 1e-3 of a norm, where a gate wrong at a few elements
    # could hide; fp64 costs little once the classifier is small.
    assert (x.grad - x_ref.grad).norm() <= 1e-9 * x_ref.grad.norm()
    grads = _gradients_by_storage(fused)
    for address, p in zip(order, reference.parameters()):
        if p.grad.norm() > 1e-10:
            assert (grads[address] - p.grad).norm() <= 1e-9 * p.grad.norm()


def test_relu_pass_takes_only_a_relu_whose_output_and_input_it_may_take():
    """Fused: relu -> conv (the conv's input, the ReLU's only user). Left: a ReLU with two users, an in-place
    ReLU whose input has another user, a ReLU feeding a pool, a ReLU feeding a stride-2 conv (its dgrad's
    phases cannot gate) and one feeding a conv padded past its filter (a crop)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (torch.nn.Conv2d(4, 4, 3, padding=1) for _ in range(4))
            self.strided, self.cropped = torch.nn.Conv2d(4, 4, 3, 2, 1), torch.nn.Conv2d(4, 4, 1, padding=1)
            self.inplace = torch.nn.ReLU(inplace=True)

        def forward(self, x):
            y = torch.relu(x)
            out = self.a(y) + y                      # two users: left
            z = self.b(out)
            out = self.c(self.inplace(z)) + z        # in place, its input used again: left
            out = self.d(torch.nn.functional.relu(out)) + torch.nn.functional.max_pool2d(torch.relu(out), 1)
            return self.strided(torch.relu(out)).sum() + self.cropped(torch.relu(out)).sum()
    net = Net().double()
    fused = conv_tutorial.fuse_relu_into_dgrad(net)
    assert fused.fused_relus == 1
    x = torch.randn(2, 4, 6, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused(x).sum().backward()
    net(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("stride, padding", [(1, 1), (2, 1), (1, 2)])
def test_masked_input_grad_is_torchs_relu_backward(stride, padding):
    # on a CPU (torch's dgrad, then the gate): dX where the conv's input is positive
    torch.manual_seed(0)
    x = torch.relu(torch.randn(2, 6, 9, 8, dtype=torch.float64)).contiguous(memory_format=torch.channels_last)
    w = torch.randn(5, 6, 3, 3, dtype=torch.float64)
    out = torch.nn.functional.conv2d(x, w, None, stride, padding)
    dy = torch.randn_like(out).contiguous(memory_format=torch.channels_last)
    args = (dy, x, w, [stride] * 2, [padding] * 2, [1, 1], 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.ops.conv_tutorial.conv2d_input_grad_relu(*args)
        plain = torch.ops.conv_tutorial.conv2d_input_grad(*args)
    torch.testing.assert_close(got, torch.where(x > 0, plain, 0.0))


def test_after_relu_op_passes_opcheck():
    x = torch.relu(torch.randn(2, 4, 7, 6)).contiguous(memory_format=torch.channels_last).requires_grad_()
    z = torch.randn(2, 4, 7, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(6, 4, 3, 3).contiguous(memory_format=torch.channels_last).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (its gradient is not the forward's own: z gets x's, so autograd's numerical check is not asked)
        torch.library.opcheck(torch.ops.conv_tutorial.conv2d_after_relu.default, (x, z, w, None, [1, 1], [1, 1],
                              [1, 1], 1), test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_forward_operator_refuses_the_backwards_epilogue():
    x = torch.randn(1, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 4, 1, 1)
    for call in (torch.ops.conv_tutorial.conv2d, conv_tutorial.ops._conv2d_with_epilogue):
        with pytest.raises(ValueError, match="relu_grad.*backward's epilogue"):
            call(x, w, None, [1, 1], [0, 0], [1, 1], 1, None, torch.relu(x), "relu_grad")


@needs_gpu
@pytest.mark.parametrize("shape", [  # (N, H, W, Ci, Co, R, stride, padding, dilation, groups): gated in the epilogue
    (4, 28, 20, 64, 128, 3, 1, 1, 1, 1), (8, 14, 14, 256, 64, 1, 1, 0, 1, 1), (2, 17, 9, 48, 40, 3, 1, 2, 2, 1),
    (2, 9, 10, 16, 24, 3, 1, 1, 1, 1), (2, 12, 12, 128, 128, 3, 1, 1, 1, 2),
    # ... or after it: stride 2, a crop (padding 1 on a 1x1), few channels at a stride (the fold)
    (4, 28, 28, 64, 128, 3, 2, 1, 1, 1), (2, 8, 8, 16, 8, 1, 1, 1, 1, 1), (2, 32, 30, 3, 64, 7, 2, 3, 1, 1)], ids=str)
def test_masked_input_grad_on_lesson06_matches_torch(shape):
    """bf16 on the GPU: conv2d_input_grad_relu with lesson 06's kernels against torch's dgrad (cuDNN) and
    the gate, each rounded to bf16 once: the tolerance of test_backward (bf16's 2^-8 relative, K terms)."""
    N, H, W, Ci, Co, R, stride, padding, dilation, groups = shape
    torch.manual_seed(0)
    x = torch.relu(torch.randn(N, Ci, H, W, device="cuda")).bfloat16().contiguous(memory_format=torch.channels_last)
    w = torch.randn(Co, Ci // groups, R, R, device="cuda").bfloat16().contiguous(memory_format=torch.channels_last)
    out = torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, groups)
    dy = torch.randn_like(out).contiguous(memory_format=torch.channels_last)
    args = (dy, x, w, [stride] * 2, [padding] * 2, [dilation] * 2, groups)
    before = conv_tutorial.backward_backend()
    conv_tutorial.set_backward("lesson06")
    try:
        got = torch.ops.conv_tutorial.conv2d_input_grad_relu(*args)
    finally:
        conv_tutorial.set_backward(before)
    expected = torch.where(x > 0, torch.ops.aten.convolution_backward(
        dy, x, w, None, [stride] * 2, [padding] * 2, [dilation] * 2, False, [0, 0], groups, [True, False, False])[0], 0)
    common.assert_close_to_reference(got.permute(0, 2, 3, 1), expected.float().permute(0, 2, 3, 1),
                                     dtype=torch.bfloat16, K=Co // groups * R * R)
    assert (got[x <= 0] == 0).all()


@needs_gpu
def test_relu_pass_on_a_bottleneck_compiles_and_matches_eager():
    """A torchvision Bottleneck through both passes and torch.compile with lesson 06's gradients, bf16
    autocast, against the same block through the statistics pass alone (the ReLU's backward by
    Inductor) and against the block unfused (cuDNN). The gate changes no value: dgrad's fp32 tile
    gated and then rounded equals the rounded tile gated; what differs between the two passes' runs is
    the order of the statistics' atomic adds. Against eager, bf16's rounding in other places: the
    relative norms below (of the input's and conv1's weight's gradients, through three convs and
    three BatchNorms at batch 16)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    block = torchvision.models.resnet.Bottleneck(256, 64).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(16, 256, 28, 28, device="cuda").contiguous(memory_format=torch.channels_last)
    before = conv_tutorial.backward_backend()
    conv_tutorial.set_backward("lesson06")
    results = {}
    try:
        for name in ("relu", "stats", "eager"):
            model = copy.deepcopy(block)
            if name != "eager":
                model = conv_tutorial.fuse_conv_batchnorm_for_training(model)
                if name == "relu":
                    model = conv_tutorial.fuse_relu_into_dgrad(model)
                    assert model.fused_relus == 2
                conv1 = model.conv_bn_conv1.conv
            else:
                conv1 = model.conv1
            x_run = x.clone().requires_grad_()
            with torch.autocast("cuda", torch.bfloat16):
                out = (model if name == "eager" else torch.compile(model))(x_run)
            out.float().sum().backward()
            results[name] = (out.float(), x_run.grad.float(), conv1.weight.grad.float())
    finally:
        conv_tutorial.set_backward(before)

    def relative(a, b):
        return [((p - q).norm() / q.norm()).item() for p, q in zip(a, b)]
    against_stats, against_eager = relative(results["relu"], results["stats"]), relative(results["relu"],
                                                                                          results["eager"])
    print(f"relative norms (out, dx, dw1): against the statistics pass alone {against_stats}, against eager "
          f"{against_eager} (the statistics pass alone against eager: {relative(results['stats'], results['eager'])})")
    assert max(against_stats) < 1e-2 and max(against_eager) < 5e-2
