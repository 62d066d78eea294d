"""Tests of the fused epilogue from PyTorch: the BatchNorm folding arithmetic, the torch.fx pass
that turns conv -> BatchNorm -> (+ residual) -> ReLU/SiLU into one operator call, the operator's
new arguments (fake implementation, opcheck, gradients), on the CPU; and on a Hopper/Blackwell
GPU, >= 200 random shapes over every fusion combination against torch."""
import json
import operator
import random
import warnings

import common

import pytest
import torch
import torch.nn.functional as F

from conv_tutorial.kernels import fprop  # noqa: E402
from conv_tutorial import fusion, selection  # noqa: E402

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


def quietly(call, *args, **kwargs):
    """call(*args, **kwargs) with the operator's fallback warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


def random_batchnorm(channels, affine=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    bn = torch.nn.BatchNorm2d(channels, affine=affine, eps=1e-3)
    bn.running_mean.copy_(torch.randn(channels, generator=generator))
    bn.running_var.copy_(torch.rand(channels, generator=generator) * 2 + 0.1)
    if affine:
        bn.weight.data.copy_(torch.randn(channels, generator=generator))
        bn.bias.data.copy_(torch.randn(channels, generator=generator))
    return bn.eval()


# %% Folding arithmetic

@pytest.mark.parametrize("conv_bias, affine", [(False, True), (True, True), (True, False)])
def test_folded_batchnorm_equals_conv_then_batchnorm(conv_bias, affine):
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(5, 12, 3, padding=1, bias=conv_bias).double()
    bn = random_batchnorm(12, affine).double()
    x = torch.randn(2, 5, 9, 7, dtype=torch.float64)
    weight, shift = fusion.fold_batchnorm(conv.weight, conv.bias, bn)
    assert weight.dtype == torch.float64 and shift.dtype == torch.float32
    torch.testing.assert_close(F.conv2d(x, weight, shift.double(), padding=1), bn(conv(x)),
                               rtol=1e-6, atol=1e-5)


def test_folding_a_bf16_model_happens_in_fp32():
    """Folding in bf16 would round g = gamma / sqrt(var + eps) and the shift before they are
    used; in fp32 the folded weight is the fp32 product rounded once."""
    conv = torch.nn.Conv2d(8, 16, 1, bias=False).bfloat16()
    bn = random_batchnorm(16).bfloat16()
    weight, shift = fusion.fold_batchnorm(conv.weight, None, bn)
    g = bn.weight.float() / torch.sqrt(bn.running_var.float() + bn.eps)
    assert torch.equal(weight, (conv.weight.float() * g.view(-1, 1, 1, 1)).bfloat16())
    assert shift.dtype == torch.float32


# %% The fx pass

class Block(torch.nn.Module):
    """A torchvision-style bottleneck: in-place add of the identity, ReLU modules, a downsample."""

    def __init__(self, channels, stride, activation=torch.nn.ReLU):
        super().__init__()
        mid = channels // 2
        self.conv1, self.bn1 = torch.nn.Conv2d(channels, mid, 1, bias=False), torch.nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = torch.nn.Conv2d(mid, mid, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = torch.nn.Conv2d(mid, 2 * channels, 1, bias=False), torch.nn.BatchNorm2d(2 * channels)
        self.act = activation(inplace=True)
        self.downsample = torch.nn.Sequential(torch.nn.Conv2d(channels, 2 * channels, 1, stride, bias=False),
                                              torch.nn.BatchNorm2d(2 * channels))

    def forward(self, x):
        identity = self.downsample(x)
        out = self.act(self.bn1(self.conv1(x)))
        out = self.act(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.act(out)


class SiLUBlock(torch.nn.Module):
    """A UNet-style block: conv with bias -> F.silu, then a conv whose result is added to x."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.silu(self.conv1(x)))


def network():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(inplace=True),
        torch.nn.MaxPool2d(3, 2, 1), Block(16, 1), Block(32, 2), SiLUBlock(64),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    for i, module in enumerate(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        module.load_state_dict(random_batchnorm(module.num_features, seed=i).state_dict())
    return model.eval()


def fused_modules(graph_module):
    return [m for m in graph_module.modules() if isinstance(m, fusion.FusedConv2d)]


def test_fx_pass_fuses_a_resnet_like_network_and_keeps_its_output():
    torch.manual_seed(0)
    model, x = network(), torch.randn(2, 3, 48, 40)
    fused = fusion.fuse_conv_bn_act(model, example_input=x)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert fused.fused_convs == len(convs) == 11
    # every conv, BatchNorm, residual add and ReLU/SiLU is gone from the graph
    assert not any(isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.ReLU))
                   for m in fused.modules())
    targets = [n.target for n in fused.graph.nodes]
    assert not any(t in (operator.add, operator.iadd, F.silu) for t in targets)
    described = sorted((m.folded_batchnorm, m.takes_residual, m.activation) for m in fused_modules(fused))
    assert described == sorted(
        [(True, False, "relu")]                                           # the stem
        + 2 * [(True, False, "relu"), (True, False, "relu"),              # conv1, conv2 of a block
               (True, True, "relu"), (True, False, "none")]               # conv3 + identity, downsample
        + [(False, False, "silu"), (False, True, "none")])                # the SiLU block
    with torch.no_grad():
        torch.testing.assert_close(quietly(fused, x), model(x), rtol=1e-4, atol=1e-4)
    assert isinstance(model[1], torch.nn.BatchNorm2d)                     # the original is untouched


def test_without_an_example_input_residual_adds_are_not_fused():
    model, x = network(), torch.randn(1, 3, 32, 32)
    fused = fusion.fuse_conv_bn_act(model)
    assert not any(m.takes_residual for m in fused_modules(fused))
    assert sum(n.target in (operator.add, operator.iadd) for n in fused.graph.nodes) == 3
    with torch.no_grad():
        torch.testing.assert_close(quietly(fused, x), model(x), rtol=1e-4, atol=1e-4)


class Unfusable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8).train()
        self.conv3 = torch.nn.Conv2d(8, 8, 1)
        self.bias = torch.nn.Parameter(torch.randn(8, 1, 1))

    def forward(self, x):
        y = self.conv1(x)
        z = self.bn1(y) + y                   # the conv's output has two users: the BN stays
        z = self.bn2(self.conv2(z))           # a training-mode BN is not folded
        return torch.relu(self.conv3(z) + self.bias)    # a broadcasting add is not a residual


def test_fx_pass_leaves_what_it_cannot_fuse():
    model = Unfusable()
    model.bn1.eval()
    model.bn1.load_state_dict(random_batchnorm(8).state_dict())
    x = torch.randn(2, 4, 10, 10)
    fused = fusion.fuse_conv_bn_act(model, example_input=x)
    described = [(m.folded_batchnorm, m.takes_residual, m.activation) for m in fused_modules(fused)]
    assert described == [(False, False, "none")] * 3
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in fused.modules()) == 2
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(quietly(fused, x), expected, rtol=1e-4, atol=1e-4)


class DepthwiseBlock(torch.nn.Module):
    """A MobileNet-style block: 1x1 expand, depthwise 3x3, grouped 3x3 (32 groups of 1 -> 2 channels: too
    narrow for the kernel's tiles, even merged), each with BatchNorm and an activation."""

    def __init__(self):
        super().__init__()
        self.expand, self.bn1 = torch.nn.Conv2d(8, 32, 1, bias=False), torch.nn.BatchNorm2d(32)
        self.depthwise, self.bn2 = torch.nn.Conv2d(32, 32, 3, 2, 1, groups=32, bias=False), torch.nn.BatchNorm2d(32)
        self.grouped, self.bn3 = torch.nn.Conv2d(32, 64, 3, 1, 1, groups=32, bias=False), torch.nn.BatchNorm2d(64)

    def forward(self, x):
        x = F.silu(self.bn1(self.expand(x)))
        x = torch.relu(self.bn2(self.depthwise(x)))
        return torch.relu(self.bn3(self.grouped(x)))


def test_fx_pass_fuses_depthwise_convs_and_leaves_grouped_ones_for_torch_compile():
    model = DepthwiseBlock()
    for i, bn in enumerate((model.bn1, model.bn2, model.bn3)):
        bn.load_state_dict(random_batchnorm(bn.num_features, seed=i).state_dict())
    model, x = model.eval(), torch.randn(2, 8, 12, 10)
    with pytest.warns(UserWarning, match="1 grouped convs left as they were"):
        fused = fusion.fuse_conv_bn_act(model, example_input=x)
    assert (fused.fused_convs, fused.kept_convs) == (2, 1)
    depthwise = [m for m in fused.modules() if isinstance(m, fusion.FusedConv2d)][1]
    assert depthwise._op_args[3] == 32 and depthwise.folded_batchnorm and depthwise.activation == "relu"
    kept = [m for m in fused.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d))]
    assert [type(m).__name__ for m in kept] == ["Conv2d", "BatchNorm2d"] and kept[0].groups == 32
    with torch.no_grad():
        torch.testing.assert_close(quietly(fused, x), model(x), rtol=1e-4, atol=1e-4)


def fused_network_on_the_gpu():
    """network() in bf16 on the GPU, a channels_last batch, and its fused model."""
    torch.manual_seed(0)
    model = network().cuda().bfloat16()
    x = torch.randn(4, 3, 64, 64, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    return model, x, fusion.fuse_conv_bn_act(model, example_input=x)


# %% Keeping the faster of ours and torch, per conv

def timer_that_favours(favoured):
    """A stand-in for the CUDA-graph timer: runs the call once and says it took 1 ms if it ran
    `favoured` ("ours": a FusedConv2d; "torch": anything else), 10 ms otherwise."""
    def timer(fn):
        ran_ours = []
        hooks = [m.register_forward_pre_hook(lambda *args: ran_ours.append(True))
                 for m in timer.model.modules() if isinstance(m, fusion.FusedConv2d)]
        quietly(fn)
        for hook in hooks:
            hook.remove()
        return 1.0 if bool(ran_ours) == (favoured == "ours") else 10.0
    return timer


@pytest.mark.parametrize("favoured", ["ours", "torch"])
def test_keep_faster_convs_gives_slower_convs_back_to_torch_with_the_same_output(favoured):
    torch.manual_seed(0)
    model, x = network(), torch.randn(2, 3, 48, 40)
    fused = fusion.fuse_conv_bn_act(model, example_input=x)
    timer = timer_that_favours(favoured)
    timer.model = fused
    kept = quietly(fusion.keep_faster_convs, fused, x, timer=timer)
    torch_modules = [m for m in kept.modules() if isinstance(m, fusion.TorchConvEpilogue)]
    # torch's side costs a conv (+ an elementwise pass where there is an epilogue): 1 or 2 ms
    # against ours at 10 when torch is favoured; 10 or 20 against 1 otherwise
    assert kept.torch_convs == len(torch_modules) == (11 if favoured == "torch" else 0)
    assert len(fused_modules(kept)) == 11 - kept.torch_convs
    with torch.no_grad():
        torch.testing.assert_close(quietly(kept, x), model(x), rtol=1e-4, atol=1e-4)


def test_keep_faster_convs_remembers_its_decisions_in_the_tuning_file(tmp_path, monkeypatch):
    """A second process deploying the same model reads the decisions instead of timing again: the
    timer runs for the first model, not for the second, and both give the same convs to torch."""
    monkeypatch.setenv("CONV_TUTORIAL_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(selection, "_TUNING_FILE", None)
    torch.manual_seed(0)
    model, x = network(), torch.randn(2, 3, 48, 40)
    timer = timer_that_favours("torch")
    first = quietly(fusion.fuse_conv_bn_act, model, example_input=x)
    timer.model, timed = first, []
    counting = lambda fn: (timed.append(1), timer(fn))[1]      # noqa: E731
    first = quietly(fusion.keep_faster_convs, first, x, timer=counting, remember=True)
    assert first.torch_convs == 11 and timed
    saved = json.loads((tmp_path / "tuning.json").read_text())
    decisions = {k: v for k, v in saved.items() if k.startswith("keep_faster_convs | cpu | ")}
    assert decisions and all(v["torch_faster"] and v["ours_ms"] == 10.0 for v in decisions.values())
    monkeypatch.setattr(selection, "_TUNING_FILE", None)        # as a new process reads it
    second = quietly(fusion.fuse_conv_bn_act, model, example_input=x)
    timed.clear()
    second = quietly(fusion.keep_faster_convs, second, x, timer=counting, remember=True)
    assert not timed and second.torch_convs == 11
    # a stand-in timer's decisions are not kept unless asked
    (tmp_path / "tuning.json").unlink()
    monkeypatch.setattr(selection, "_TUNING_FILE", None)
    quietly(fusion.keep_faster_convs, quietly(fusion.fuse_conv_bn_act, model, example_input=x), x, timer=counting)
    assert not (tmp_path / "tuning.json").exists()


def test_keep_faster_convs_without_a_gpu_returns_the_model_unchanged_with_one_warning():
    # the default timer replays CUDA graphs, which raised a CUDA driver error without a GPU
    torch.manual_seed(0)
    model, x = network(), torch.randn(2, 3, 48, 40)
    fused = quietly(fusion.fuse_conv_bn_act, model, example_input=x)
    modules_before = [type(m) for m in fused.modules()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = fusion.keep_faster_convs(fused, x)               # the input on the CPU: nothing to time
    said = [w for w in caught if "keep_faster_convs" in str(w.message)]
    assert len(said) == 1 and "returned unchanged" in str(said[0].message)
    assert kept is fused and kept.torch_convs == 0 and [type(m) for m in kept.modules()] == modules_before
    with torch.no_grad():
        torch.testing.assert_close(quietly(kept, x), model(x), rtol=1e-4, atol=1e-4)


@needs_gpu
def test_keep_faster_convs_on_the_gpu_keeps_the_output():
    model, x, fused = fused_network_on_the_gpu()
    with torch.no_grad():
        before = fused(x).float()
        kept = fusion.keep_faster_convs(fused, x)      # measured: which convs go back depends on the GPU
        after = kept(x).float()
    assert 0 <= kept.torch_convs <= 11
    assert (after - before).abs().max() <= 2 ** -6 * before.abs().max()


def test_fused_model_traces_with_fullgraph():
    model, x = network(), torch.randn(1, 3, 32, 32)
    fused = fusion.fuse_conv_bn_act(model, example_input=x)
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(quietly(compiled, x), quietly(fused, x))


# %% The operator's epilogue arguments

def epilogue_reference(x, w, bias, scale, residual, activation, stride=1, padding=1):
    out = F.conv2d(x, w, None, stride, padding)
    if scale is not None:
        out = out * scale.view(1, -1, 1, 1).to(out.dtype)
    if bias is not None:
        out = out + bias.view(1, -1, 1, 1).to(out.dtype)
    if residual is not None:
        out = out + residual
    return {"none": out, "relu": torch.relu(out), "silu": F.silu(out)}[activation]


@pytest.mark.parametrize("activation", ["none", "relu", "silu"])
@pytest.mark.parametrize("with_scale, with_residual", [(False, False), (True, False), (True, True)])
def test_fused_operator_gradients_match_torch(activation, with_scale, with_residual):
    torch.manual_seed(2)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    x, w, bias = torch.randn(2, 3, 6, 5, **f64), torch.randn(4, 3, 3, 3, **f64), torch.randn(4, **f64)
    scale = torch.randn(4, **f64) if with_scale else None
    residual = torch.randn(2, 4, 6, 5, **f64) if with_residual else None
    inputs = [t for t in (x, w, bias, scale, residual) if t is not None]
    ours = quietly(torch.ops.conv_tutorial.conv2d, x, w, bias, [1, 1], [1, 1], [1, 1], 1,
                   scale=scale, residual=residual, activation=activation)
    want = epilogue_reference(x, w, bias, scale, residual, activation)
    torch.testing.assert_close(ours, want)
    weights = torch.randn_like(want)
    got = torch.autograd.grad((ours * weights).sum(), inputs)
    expected = torch.autograd.grad((want * weights).sum(), inputs)
    for name, a, b in zip("x w bias scale residual".split(), got, expected):
        torch.testing.assert_close(a, b, msg=lambda m: f"gradient of {name}: {m}")


def test_opcheck_with_the_epilogue():
    device = "cuda" if common.has_tma_mma_gpu() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cl = dict(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 10, 12, device=device, dtype=dtype).contiguous(**cl)
    w = torch.randn(16, 8, 3, 3, device=device, dtype=dtype)
    shift, scale = torch.randn(16, device=device), torch.randn(16, device=device)
    residual = torch.randn(2, 16, 10, 12, device=device, dtype=dtype).contiguous(**cl)
    quietly(torch.library.opcheck, torch.ops.conv_tutorial.conv2d.default,
            (x, w, shift, [1, 1], [1, 1], [1, 1], 1),
            {"scale": scale, "residual": residual, "activation": "relu"})


def test_bad_epilogue_arguments_raise_clear_errors():
    x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    op = torch.ops.conv_tutorial.conv2d
    with pytest.raises(ValueError, match="activation must be"):
        op(x, w, None, [1, 1], [1, 1], [1, 1], 1, activation="gelu")
    with pytest.raises(ValueError, match=r"scale must have shape \(4,\)"):
        op(x, w, None, [1, 1], [1, 1], [1, 1], 1, scale=torch.ones(3))
    with pytest.raises(ValueError, match=r"residual must have the output's shape \(1, 4, 8, 8\)"):
        op(x, w, None, [1, 1], [1, 1], [1, 1], 1, residual=torch.ones(1, 4, 4, 4))
    with pytest.raises(ValueError, match="takes no residual"):
        fusion.FusedConv2d(torch.nn.Conv2d(3, 4, 3))(x, torch.ones(1, 4, 6, 6))


# %% On a Hopper or Blackwell GPU: random shapes over every fusion combination

EPILOGUES = [(scale, shift, residual, activation) for scale, shift in [(False, False), (False, True), (True, True)]
             for residual in (False, True) for activation in ("none", "relu", "silu")]


def random_cases(count=216, seed=2026):
    """Random layers, each epilogue combination equally often; a third stride 2, a third with Co
    not a multiple of 64, some 1x1 and some with Ci < 8 (the folded path)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        scale, shift, residual, activation = EPILOGUES[i % len(EPILOGUES)]
        R = rng.choice([1, 3, 3, 5, 7])
        Ci = rng.choice([3, 4, 16, 40, 64, 96, 128, 256])
        Co = rng.choice([8, 24, 64, 96, 100, 128, 160, 200, 256, 320])
        stride = rng.choice([1, 1, 2])
        N, H, W = rng.choice([1, 2, 4, 8]), rng.randint(max(R, 5), 36), rng.randint(max(R, 5), 36)
        dtype = rng.choice([torch.bfloat16, torch.float16])
        cases.append((N, Ci, H, W, Co, R, stride, R // 2, dtype, scale, shift, residual, activation))
    return cases


@needs_gpu
@pytest.mark.parametrize("N, Ci, H, W, Co, R, stride, padding, dtype, scale, shift, residual, activation",
                         random_cases())
def test_random_fused_layers_match_torch(N, Ci, H, W, Co, R, stride, padding, dtype, scale, shift,
                                         residual, activation):
    torch.manual_seed(N * 1000 + Ci * 10 + Co)
    cl = dict(memory_format=torch.channels_last)
    x = torch.randn(N, Ci, H, W, device="cuda", dtype=dtype).contiguous(**cl)
    w = torch.randn(Co, Ci, R, R, device="cuda", dtype=dtype) / (Ci * R * R) ** 0.5
    out_h, out_w = (H + 2 * padding - R) // stride + 1, (W + 2 * padding - R) // stride + 1
    shift_t = torch.randn(Co, device="cuda") if shift else None
    scale_t = torch.rand(Co, device="cuda") + 0.5 if scale else None
    residual_t = torch.randn(N, Co, out_h, out_w, device="cuda", dtype=dtype).contiguous(**cl) if residual else None
    out = torch.ops.conv_tutorial.conv2d(x, w, shift_t, [stride] * 2, [padding] * 2, [1, 1], 1,
                                         scale=scale_t, residual=residual_t, activation=activation)
    expected = epilogue_reference(x.float(), w.float(), shift_t, scale_t,
                                  None if residual_t is None else residual_t.float(), activation,
                                  stride, padding)
    common.assert_close_to_reference(out.permute(0, 2, 3, 1), expected.permute(0, 2, 3, 1),
                                     dtype=dtype, K=Ci * R * R)


@needs_gpu
def test_fused_network_on_the_gpu_matches_the_original():
    model, x, fused = fused_network_on_the_gpu()
    with torch.no_grad():
        reference = network().cuda().eval()(x.float())
        ours, theirs = fused(x).float(), model(x).float()
    # ours is no further from the fp32 model than the bf16 cuDNN model is, up to 1.5x
    assert (ours - reference).abs().max() <= 1.5 * (theirs - reference).abs().max() + 1e-3


@needs_gpu
def test_fused_operator_gradients_on_the_gpu():
    """Gradients of act(conv + bias + residual) with ReLU against torch's autograd. Where the
    pre-activation is near zero, bf16 rounding can put ours and torch's on different sides of the
    ReLU, so torch's side is given our mask (a fixed 0/1 factor): the same function elsewhere."""
    torch.manual_seed(3)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x, w = torch.randn(4, 32, 12, 12, **bf16), torch.randn(64, 32, 3, 3, **bf16)
    bias = torch.randn(64, device="cuda", requires_grad=True)
    residual = torch.randn(4, 64, 12, 12, **bf16)
    ours = torch.ops.conv_tutorial.conv2d(x, w, bias, [1, 1], [1, 1], [1, 1], 1, residual=residual,
                                          activation="relu")
    mask = (ours > 0).detach()
    want = epilogue_reference(x, w, bias, None, residual, "none") * mask
    got = torch.autograd.grad(ours.float().square().sum(), (x, w, bias, residual))
    expected = torch.autograd.grad(want.float().square().sum(), (x, w, bias, residual))
    for name, a, b in zip(("x", "w", "bias", "residual"), got, expected):
        scale = b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=2e-2 * scale,
                                   msg=lambda m: f"gradient of {name}: {m}")


def test_the_fused_model_shares_no_module_with_the_original():
    """Casting or moving the result (as deployment does) must leave the original model as it was."""
    model, x = network(), torch.randn(1, 3, 32, 32)
    fused = fusion.fuse_conv_bn_act(model, example_input=x).to(torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        model(x)                                   # the fp32 model still runs on fp32 input
