"""The operator's backward on lesson 06's kernels (conv_tutorial.set_backward("lesson06")) against
torch's float64 gradients over 208 random layers on a GPU: odd and non-square sizes from 1 to 40,
Ci = 3 to 160, Co = 1 to 300, filters 1x1 to 7x7 with R and S apart, stride 1 to 3, padding and
dilation per axis, fp16 and bf16, with and without ReLU; and 16 random grouped layers (2-4 groups of
64-256 channels in and out). Every case lies where lesson 06 covers the call (fp16/bf16, groups 1
or groups a tile keeps to, one Hopper or Blackwell GPU), so none may fall back to torch. On a CPU
the GPU cases skip and two tests check what the generators draw.

Cost: Triton specializes each shape integer the kernels take on being 1 or a multiple of 16, so
208 distinct shapes compile about 770 kernel variants (the forward, the dgrad phases' convs and
wgrad; counted on a CPU from the launchers' host-side set-up, not timed on a GPU yet).
CONV_TUTORIAL_SHARD=i/n (conftest.py) spreads the cases over n processes."""
import collections
import random
import warnings

import pytest
import torch

from conv_tutorial import ops
from conv_tutorial.geometry import conv_geometry, conv_output_size
# the sibling module's fixture, GPU marker and float64 reference (pytest imports test files under
# their package-style names, tests.operator.test_backward, in importlib mode: this is that module)
from tests.operator import test_backward as sibling

lesson06_backend, needs_gpu, torch_gradients = sibling.lesson06_backend, sibling.needs_gpu, sibling.torch_gradients

CHANNELS_IN = (3, 8, 16, 24, 40, 64, 96, 128, 160)     # 3: padded to 16 bytes (the forward and wgrad)
FILTER_SIZES = (1, 2, 3, 5, 7)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ACTIVATIONS = ("none", "relu")


class Case(collections.namedtuple("Case", "N H W Ci Co R S stride padding dilation dtype activation")):
    """One layer: sizes, (h, w) pairs of stride, padding and dilation, "bf16"/"fp16", "none"/"relu"."""

    @property
    def id(self):
        pairs = "-".join(f"{name}{a}x{b}" for name, (a, b) in (("s", self.stride), ("p", self.padding),
                                                                ("d", self.dilation)))
        return (f"n{self.N}-{self.H}x{self.W}-ci{self.Ci}-co{self.Co}-k{self.R}x{self.S}-{pairs}-{self.dtype}"
                f"-{self.activation}")


def draw_case(rng):
    """One random layer whose output is not empty: a geometry whose dilated filter does not fit the
    padded input is drawn again (stride, padding and dilation per axis, as the operator takes them)."""
    while True:
        R, S = rng.choice(FILTER_SIZES), rng.choice(FILTER_SIZES)
        H, W = rng.randint(1, 40), rng.randint(1, 40)
        stride = (rng.randint(1, 3), rng.randint(1, 3))
        padding = (rng.randint(0, max(1, R - 1)), rng.randint(0, max(1, S - 1)))   # 1x1: padding past the filter too
        dilation = (rng.randint(1, 2), rng.randint(1, 2))
        sizes = [conv_output_size(*axis) for axis in zip((H, W), (R, S), stride, padding, dilation)]
        if min(sizes) > 0:
            return Case(rng.randint(1, 4), H, W, rng.choice(CHANNELS_IN), rng.randint(1, 300), R, S, stride, padding,
                        dilation, rng.choice(list(DTYPES)), rng.choice(ACTIVATIONS))


def random_cases(count=208, seed=606):
    """`count` distinct layers drawn by random.Random(seed): the same ones in every process."""
    rng, cases = random.Random(seed), []
    while len(cases) < count:
        case = draw_case(rng)
        if case not in cases:
            cases.append(case)
    return cases


CASES = random_cases()


class GroupedCase(collections.namedtuple("GroupedCase", "N H W groups Ci_group Co_group R S stride padding dtype")):
    """A grouped layer whose groups both gradients take (64-256 channels per group)."""

    @property
    def id(self):
        return (f"n{self.N}-{self.H}x{self.W}-g{self.groups}x{self.Ci_group}to{self.Co_group}-k{self.R}x{self.S}"
                f"-s{self.stride[0]}x{self.stride[1]}-p{self.padding[0]}x{self.padding[1]}-{self.dtype}")


def grouped_cases(count=16, seed=607):
    """`count` distinct grouped layers: 2-4 groups of 64, 128 or 256 channels in and out, 1x1 to 3x3,
    stride 1-2 per axis, odd sizes."""
    rng, cases = random.Random(seed), []
    while len(cases) < count:
        R, S = rng.choice((1, 3)), rng.choice((1, 3))
        case = GroupedCase(rng.randint(1, 2), rng.randint(3, 17), rng.randint(3, 17), rng.randint(2, 4),
                           rng.choice((64, 128, 256)), rng.choice((64, 128, 256)), R, S,
                           (rng.randint(1, 2), rng.randint(1, 2)), (rng.randint(0, R // 2), rng.randint(0, S // 2)),
                           rng.choice(list(DTYPES)))
        if case not in cases:
            cases.append(case)
    return cases


GROUPED_CASES = grouped_cases()


def test_random_cases_are_many_distinct_and_cover_the_awkward_shapes():
    """Runs on a CPU: what the GPU test below is given."""
    assert len(CASES) >= 200 and len(set(CASES)) == len(CASES) == len({case.id for case in CASES})
    for case in CASES:        # the forward's shape checks take every case (a non-empty output among them)
        conv_geometry((case.N, case.H, case.W, case.Ci), (case.Co, case.R, case.S, case.Ci), case.stride,
                      case.padding, case.dilation)
    wanted = {
        "Ci=3": lambda c: c.Ci == 3,
        "Co not a multiple of 64": lambda c: c.Co % 64 != 0,
        "Co not a multiple of 8": lambda c: c.Co % 8 != 0,
        "stride 2": lambda c: 2 in c.stride,
        "stride 3": lambda c: 3 in c.stride,
        "stride differing per axis": lambda c: c.stride[0] != c.stride[1],
        "1x1": lambda c: c.R == c.S == 1,
        "1x1 padded past the filter": lambda c: c.R == c.S == 1 and max(c.padding) > 0,
        "H != W": lambda c: c.H != c.W,
        "R != S": lambda c: c.R != c.S,
        "dilation 2": lambda c: 2 in c.dilation,
        "N=1": lambda c: c.N == 1,
        "a 1-pixel-wide input": lambda c: min(c.H, c.W) == 1,
        "bf16": lambda c: c.dtype == "bf16",
        "fp16": lambda c: c.dtype == "fp16",
        "ReLU": lambda c: c.activation == "relu",
        "no activation": lambda c: c.activation == "none",
    }
    counts = {name: sum(map(test, CASES)) for name, test in wanted.items()}
    assert min(counts.values()) >= 3, counts


# Tolerance, per gradient G (dX, dW, db) against the float64 reference on the same rounded inputs.
# u is the dtype's unit roundoff: 2^-8 for bf16 (8 significant bits), 2^-11 for fp16 (11).
# The operator's y = act(conv + b) is accumulated in fp32 and rounded once to the dtype, so its
# dY = 2y (the loss is sum(y^2)) is off by at most u|dY| per element (rounding to nearest keeps
# the sign, so ReLU's mask only differs where fp32's own error flips it). Each gradient is a sum
# of K products of two dtype values (dX: K = Co*R*S terms dY*w; dW: K = N*P*Q terms x*dY; db: the
# N*P*Q values of dY), exact in the fp32 accumulator, summed in fp32 and rounded once more to the
# dtype (dX and dW; db stays fp32). Per element:
#     |G_op - G| <= u|G| + (u + K * 2^-24) * sum_k |a_k b_k|
# The worst case of the second term, every rounding of dY pushing the same way, is about sqrt(K)
# times the gradient (up to 120x here): no use as a tolerance. But the roundings of different dY
# elements are independent, each within +-u, so the term is a random sum with a standard
# deviation of at most u/sqrt(3) * sqrt(sum_k (a_k b_k)^2), about 0.6u * rms(G) (the products
# have random signs, so G's own size is sqrt(sum_k (a_k b_k)^2)); over the up to 2*10^6 elements
# of a tensor that stays within ~5 deviations, 3u * max|G|. fp32's part is K * 2^-24 < 1e-3 at
# worst (K <= 14,700) and ~sqrt(K) * 2^-24 in fact, and the kernels' summation order differs from
# torch's by as little. Hence, relative to the reference's largest value:
#     rtol = 2u, atol = 4u * max|G|:   bf16 rtol 7.8e-3, atol 1.6e-2 * max|G|
#                                      fp16 rtol 9.8e-4, atol 2.0e-3 * max|G|
# A CPU model of exactly these roundings (fp32 convs of the rounded values, results rounded where
# the kernels round them) over the 208 cases erred by at most 1.3u * max|G| (dX 1.3u, dW 1.1u,
# db 0.5u), and beyond rtol = 2u by at most 0.6u * max|G|: 4u leaves a factor of 6.
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
RTOL_UNITS, ATOL_UNITS = 2, 4


@needs_gpu
@pytest.mark.parametrize("seed, case", [pytest.param(seed, case, id=case.id) for seed, case in enumerate(CASES)])
def test_random_layers_gradients_on_lesson06_match_torch(lesson06_backend, monkeypatch, seed, case):
    monkeypatch.setattr(ops, "_WARNED", set())          # a forward falling back warns again too
    dtype, cl = DTYPES[case.dtype], torch.channels_last
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.N, case.Ci, case.H, case.W, generator=gen).cuda().to(dtype, memory_format=cl)
    w = torch.randn(case.Co, case.Ci, case.R, case.S, generator=gen) * (case.R * case.S * case.Ci) ** -0.5
    w = w.cuda().to(dtype, memory_format=cl)
    b = torch.randn(case.Co, generator=gen).cuda()
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.ops.conv_tutorial.conv2d(x, w, b, list(case.stride), list(case.padding), list(case.dilation), 1,
                                             activation=case.activation)
        grads = torch.autograd.grad(out.float().square().sum(), (x, w, b))
    fell_back = [str(c.message) for c in caught if "conv_tutorial::conv2d" in str(c.message)]
    assert not fell_back, fell_back                      # forward and backward ran on the lessons' kernels
    assert grads[0].dtype == grads[1].dtype == dtype and grads[2].dtype == torch.float32
    expected = torch_gradients(x, w, b, case.stride, case.padding, case.dilation, activation=case.activation)
    u = UNIT_ROUNDOFF[case.dtype]
    for name, got, want in zip(("dX", "dW", "db"), grads, expected):
        assert got.shape == want.shape, (name, got.shape, want.shape)
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=RTOL_UNITS * u, atol=ATOL_UNITS * u * scale,
                                   msg=lambda text, name=name, scale=scale: f"{name} (max |ref| {scale:.3g}): {text}")


def test_grouped_cases_fit_both_gradients():
    """Runs on a CPU: every grouped case is one lesson 06 takes (so none may fall back below)."""
    from conv_tutorial.kernels.gradients import backward_groups_reason
    assert len(set(GROUPED_CASES)) == len(GROUPED_CASES) == 16
    for case in GROUPED_CASES:
        g = conv_geometry((case.N, case.H, case.W, case.groups * case.Ci_group),
                          (case.groups * case.Co_group, case.R, case.S, case.Ci_group), case.stride, case.padding, 1,
                          case.groups)
        assert backward_groups_reason(g, "wgrad") is None
        assert backward_groups_reason(g, "dgrad") is None
    assert {case.stride for case in GROUPED_CASES} >= {(1, 1), (2, 2)}
    assert {case.groups for case in GROUPED_CASES} >= {2, 3, 4}


@needs_gpu
@pytest.mark.parametrize("seed, case", [pytest.param(seed, case, id=case.id)
                                        for seed, case in enumerate(GROUPED_CASES)])
def test_random_grouped_layers_gradients_on_lesson06_match_torch(lesson06_backend, monkeypatch, seed, case):
    """As above, grouped, without bias or activation: the tolerance above holds (K = Co/groups*R*S for
    dX, N*P*Q for dW)."""
    monkeypatch.setattr(ops, "_WARNED", set())
    dtype, cl = DTYPES[case.dtype], torch.channels_last
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(case.N, case.groups * case.Ci_group, case.H, case.W, generator=gen)
    x = x.cuda().to(dtype, memory_format=cl)
    w = torch.randn(case.groups * case.Co_group, case.Ci_group, case.R, case.S, generator=gen)
    w = (w * (case.R * case.S * case.Ci_group) ** -0.5).cuda().to(dtype, memory_format=cl)
    x, w = x.requires_grad_(), w.requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.ops.conv_tutorial.conv2d(x, w, None, list(case.stride), list(case.padding), [1, 1], case.groups)
        grads = torch.autograd.grad(out.float().square().sum(), (x, w))
    fell_back = [str(c.message) for c in caught if "conv_tutorial::conv2d" in str(c.message)]
    assert not fell_back, fell_back
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    reference = torch.nn.functional.conv2d(x64, w64, None, case.stride, case.padding, 1, case.groups)
    expected = torch.autograd.grad(reference.square().sum(), (x64, w64))
    u = UNIT_ROUNDOFF[case.dtype]
    for name, got, want in zip(("dX", "dW"), grads, expected):
        assert got.shape == want.shape and got.dtype == dtype, (name, got.shape, got.dtype)
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=RTOL_UNITS * u, atol=ATOL_UNITS * u * scale,
                                   msg=lambda text, name=name, scale=scale: f"{name} (max |ref| {scale:.3g}): {text}")
