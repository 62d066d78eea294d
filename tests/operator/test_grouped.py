"""Grouped convs through lesson 05's kernel (section 10): merging small groups into tiles the kernel
can run (exact, checked in fp64 on the CPU), the fx pass and keep_faster_convs on a ResNeXt-style
block, and on a Hopper/Blackwell GPU the operator on random grouped shapes with every epilogue."""
import random
import warnings

import common

import pytest
import torch
import torch.nn.functional as F

from conv_tutorial.kernels import fprop  # noqa: E402
from conv_tutorial import configs, fusion, ops, selection  # noqa: E402

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


# %% Merging groups

@pytest.mark.parametrize("groups, Ci_group, Co_group, P", [
    (32, 4, 4, 16), (32, 8, 8, 8), (8, 16, 16, 4), (6, 3, 5, 3), (4, 48, 48, 4), (4, 2, 6, 2)])
def test_merged_groups_compute_the_same_conv(groups, Ci_group, Co_group, P):
    generator = torch.Generator().manual_seed(groups * P)
    x = torch.randn(2, groups * Ci_group, 7, 6, generator=generator, dtype=torch.float64)
    w = torch.randn(groups * Co_group, Ci_group, 3, 3, generator=generator, dtype=torch.float64)
    merged = fusion.merge_groups(w, groups, P)
    assert merged.shape == (groups * Co_group, P * Ci_group, 3, 3)
    assert (merged != 0).sum() == w.numel()          # the filters, once each, and zeros
    torch.testing.assert_close(F.conv2d(x, merged, padding=1, groups=groups // P), F.conv2d(x, w, padding=1, groups=groups))
    assert torch.equal(fusion.split_groups(merged, groups, P), w)


@pytest.mark.parametrize("groups, Ci_group, Co_group, P", [
    (2, 64, 64, 1),      # a 64-wide group fills a tile as it is
    (32, 4, 4, 16),      # ResNeXt-50 32x4d, stage by stage: 16 groups of 4 make 64 channels
    (32, 8, 8, 8),
    (32, 16, 16, 4),
    (32, 32, 32, 2),
    (4, 48, 48, 4),      # RegNet's groups of 48: four make 192, three tiles of 64
    (9, 48, 48, 9),      # 48 or 144 channels: no tile width divides them; all nine: a plain conv
    (21, 48, 48, None),  # 48, 144 or 336 channels fill no tiles, and 21 groups are too many to merge
    (4, 8, 8, 4),        # all four groups: a plain conv of 32 channels
    (32, 1, 2, None),    # 64 output channels take 32 groups, more than MAX_GROUP_MERGE
])
def test_group_merge_takes_the_fewest_groups_that_fill_whole_tiles(groups, Ci_group, Co_group, P):
    assert fusion.group_merge(groups, Ci_group, Co_group, arch=None) == P


def test_group_merge_asks_the_tiles_of_the_architecture():
    """RegNet's first stage, 2 groups of 48: 96 channels fill a 96-wide tile (64 + a 32-column
    tail) on Hopper; Blackwell has no 96-wide config, so there both groups merge into a plain conv."""
    assert fusion.group_merge(4, 48, 48, arch="sm_90") == 2
    assert fusion.group_merge(4, 48, 48, arch="sm_100") == 4


class ResNeXtBlock(torch.nn.Module):
    """ResNeXt's bottleneck: 1x1 reduce, a grouped 3x3 (`groups` groups of `group_width`), 1x1
    expand, each with BatchNorm; the skip connection added before the last ReLU."""

    def __init__(self, channels, groups, group_width, stride=1):
        super().__init__()
        width = groups * group_width
        self.reduce, self.bn1 = torch.nn.Conv2d(channels, width, 1, bias=False), torch.nn.BatchNorm2d(width)
        self.grouped = torch.nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.expand, self.bn3 = torch.nn.Conv2d(width, channels, 1, bias=False), torch.nn.BatchNorm2d(channels)
        self.skip = torch.nn.Identity() if stride == 1 else torch.nn.AvgPool2d(stride)
        for i, bn in enumerate((self.bn1, self.bn2, self.bn3)):
            generator = torch.Generator().manual_seed(i)
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=generator) * 0.1)
            bn.running_var.copy_(torch.rand(bn.num_features, generator=generator) + 0.5)
            bn.weight.data.copy_(torch.rand(bn.num_features, generator=generator) + 0.5)
            bn.bias.data.copy_(torch.randn(bn.num_features, generator=generator) * 0.1)

    def forward(self, x):
        y = torch.relu(self.bn1(self.reduce(x)))
        y = torch.relu(self.bn2(self.grouped(y)))
        return torch.relu(self.bn3(self.expand(y)) + self.skip(x))


@pytest.mark.filterwarnings("ignore")     # the operator's fallback warnings (this test checks values)
def test_fx_pass_runs_grouped_convs_with_merged_groups_and_keeps_the_output():
    torch.manual_seed(0)
    model, x = ResNeXtBlock(64, groups=8, group_width=8).eval(), torch.randn(2, 64, 9, 7)
    fused = fusion.fuse_conv_bn_act(model, example_input=x)
    assert (fused.fused_convs, fused.kept_convs) == (3, 0)
    grouped = [m for m in fused.modules() if isinstance(m, fusion.FusedConv2d)][1]
    assert grouped.group_merge == 8 and grouped._op_args[3] == 1 and not grouped.weight.requires_grad
    assert "groups=8 (merged 8 by 8)" in repr(grouped)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-4, atol=1e-4)
        # keep_faster_convs' torch side runs the 8 groups as they were, without the merge's zeros
        back = fusion.TorchConvEpilogue(grouped)
        assert back._op_args[3] == 8 and back.weight.shape == (64, 8, 3, 3)
        y = torch.randn(2, 64, 9, 7)
        torch.testing.assert_close(grouped(y), back(y), rtol=1e-4, atol=1e-4)


# %% On the GPU

def random_grouped_cases(count=40, seed=27):
    """Grouped shapes the kernel runs (channels per group filling whole tiles, possibly after a
    merge), with random sizes, strides, filters and epilogues."""
    rng = random.Random(seed)
    per_group = [(64, 64), (128, 128), (32, 64), (16, 64), (64, 128), (192, 192), (256, 256), (64, 192)]
    cases = []
    for _ in range(count):
        Ci_group, Co_group = rng.choice(per_group)
        groups = rng.choice([2, 3, 4, 8])
        R = rng.choice([1, 3, 3, 5])
        cases.append((rng.randint(1, 4), groups, Ci_group, Co_group, rng.randint(R, 20), rng.randint(R, 20), R,
                      rng.choice([1, 2]), rng.choice([0, R // 2]), rng.choice(["none", "relu", "silu"]),
                      rng.random() < 0.5, rng.random() < 0.5))
    return cases


@needs_gpu
@pytest.mark.parametrize("N, groups, Ci_group, Co_group, H, W, R, stride, padding, activation, scale, residual",
                         random_grouped_cases())
def test_random_grouped_convs_through_the_operator_match_torch(N, groups, Ci_group, Co_group, H, W, R, stride,
                                                               padding, activation, scale, residual):
    generator = torch.Generator().manual_seed(N * H * W + groups)
    x = torch.randn(N, groups * Ci_group, H, W, generator=generator)
    w = torch.randn(groups * Co_group, Ci_group, R, R, generator=generator) / (R * R * Ci_group) ** 0.5
    bias = torch.randn(groups * Co_group, generator=generator)
    scale_t = torch.rand(groups * Co_group, generator=generator) + 0.5 if scale else None
    expected = F.conv2d(x.double(), w.double(), None, stride, padding, 1, groups)
    residual_t = torch.randn(expected.shape, generator=generator) if residual else None
    expected = common.reference_epilogue(expected, bias.double(), None if scale_t is None else scale_t.double(),
                                         None if residual_t is None else residual_t.double(), activation,
                                         channel_dim=1)
    cuda = [None if t is None else t.cuda().bfloat16().contiguous(memory_format=torch.channels_last)
            if t.dim() == 4 else t.cuda() for t in (x, w, bias, scale_t, residual_t)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a fallback to torch would warn: the kernel must run it
        out = ops.conv2d_op(cuda[0], cuda[1], cuda[2], [stride] * 2, [padding] * 2, [1, 1], groups,
                                   cuda[3], cuda[4], activation)
    common.assert_close_to_reference(out.cpu().permute(0, 2, 3, 1), expected.float().permute(0, 2, 3, 1),
                                     dtype=torch.bfloat16, K=R * R * Ci_group)


@needs_gpu
@pytest.mark.parametrize("group_width", [4, 8, 16, 32])
def test_fused_resnext_blocks_on_the_gpu_match_the_original(group_width):
    """ResNeXt-50's four stages' grouped convs (32 groups of 4 to 32 channels, merged 16 to 2 at a time)."""
    torch.manual_seed(0)
    model = ResNeXtBlock(256, groups=32, group_width=group_width).eval().cuda().bfloat16()
    x = torch.randn(4, 256, 14, 14, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    fused = fusion.fuse_conv_bn_act(model, example_input=x)
    assert fused.kept_convs == 0
    with torch.no_grad():
        expected, out = model.float()(x.float()), fused(x).float()
    assert (out - expected).abs().max() <= 2 ** -6 * expected.abs().max() + 1e-2


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_every_grouped_conv_the_kernel_accepts_gets_a_config_that_fits_it(arch):
    """grouped_conv_fits (what the operator asks) and the runtime's pruning agree: wherever a
    group's channels fit some config, the heuristic picks one that keeps each tile in one group."""
    accepted = 0
    for Ci_group, Co_group in [(16, 64), (32, 64), (64, 64), (96, 96), (48, 96), (128, 128), (192, 192), (64, 320),
                               (48, 48), (32, 32), (256, 512)]:
        if not configs.grouped_conv_fits(Ci_group, Co_group, arch):
            continue
        accepted += 1
        for N, H, groups, stride, R in [(128, 56, 2, 2, 3), (1, 7, 8, 1, 3), (32, 14, 4, 1, 1)]:
            g = common.conv_geometry((N, H, H, groups * Ci_group), (groups * Co_group, R, R, Ci_group), stride,
                                     R // 2, 1, groups)
            config = selection.heuristic_config(g, arch, 132)
            assert configs.groups_fit(config, Ci_group, Co_group), (g.describe(), config)
    assert accepted >= 6
