"""Lesson 06's dgrad on a CPU, beyond the lesson's own tests: the phases (section 3) on a wider grid of
strides, paddings, dilations and groups against torch.nn.grad, zero insertion, the zeros of the phases
no tap reaches, the lesson's phases and rotated copy against the package's (the operator's dgrad starts
from them), the kernel's arithmetic on lesson 03's TMA model (section 4), and the launcher's refusals."""
import re

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import pytest
import torch

lesson06 = common.load_lesson("06-conv-dgrad")
from conv_tutorial.kernels import dgrad as dgrad_kernels  # noqa: E402


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", [
    (2, 9, 10, 5, 6, 3, 3, 2, 1, 1),              # ResNet-50's 3x3 stride 2
    (2, 8, 8, 4, 8, 1, 1, 2, 0, 1),               # 1x1 stride 2: three phases of zeros
    (1, 11, 9, 3, 7, 7, 7, 2, 3, 1),              # a stem: 7x7 stride 2 padding 3
    (2, 10, 9, 4, 6, 3, 3, 2, 0, 1),              # the last input row read by no output
    (1, 13, 12, 3, 5, 4, 4, 3, 1, 1),             # stride 3, an even filter
    (2, 12, 11, 4, 5, 3, 3, 2, 2, 2),             # stride and dilation 2: all taps in the even rows, none in the odd
    (1, 14, 13, 2, 3, 3, 3, 2, 1, 3),             # dilation 3 at stride 2
    (2, 9, 11, 5, 4, 3, 5, (2, 1), (1, 2), (1, 2)),  # different strides, paddings and dilations per axis
    (1, 7, 7, 3, 4, 1, 1, 1, 2, 1),               # padding past the filter at stride 1: padding -2
    (1, 3, 8, 2, 3, 3, 1, 4, 1, 1),               # stride above H: phases past the image
    (1, 9, 9, 2, 2, 5, 5, 4, 0, 2),               # stride 4, dilation 2
    (1, 12, 12, 8, 4, 3, 3, 2, 3, 1),             # padding 3: a window starting inside dY
])
def test_dgrad_phases_match_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation):
    lesson06.run_dgrad_mapping(N, H, W, Ci, Co, R, S, stride, padding, dilation, show=False)


@pytest.mark.parametrize("Ci, Co, groups, stride", [(6, 9, 3, 1), (8, 12, 4, 2), (4, 6, 2, (2, 1))])
def test_grouped_dgrad_swaps_channels_within_each_group(Ci, Co, groups, stride):
    # grouped: dY's group k of Co / groups channels makes dX's group k of Ci / groups, through the
    # turned-around filters of that group alone (a grouped forward conv of dY)
    lesson06.run_dgrad_mapping(2, 9, 8, Ci, Co, 3, 3, stride, 1, 1, show=False, groups=groups)


@pytest.mark.parametrize("stride, padding, dilation", [(2, 1, 1), ((3, 2), (0, 2), (1, 2))])
def test_zero_insertion_matches_torch(stride, padding, dilation):
    x, w, dy, g = lesson06.backward_inputs(2, 11, 10, 4, 6, 3, 3, stride, padding, dilation, torch.float32,
                                           device_name="cpu")
    expected, _ = lesson06.reference_gradients(x, w, dy, g)
    got = lesson06.zero_insertion_dgrad(dy, w, g, lesson06.reference_phase_conv)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("R, S, stride, padding, dilation, H, W, C", [
    (1, 1, 2, 0, 1, 8, 70, 300),   # a 1x1 conv at stride 2: three phases of four; blocks of pixels and of channels
    (1, 1, (2, 3), 0, 1, 7, 11, 24),  # strides differ: whole rows untapped, and two columns of three in the others
    (3, 3, 2, 1, 2, 9, 9, 24),     # dilation 2 at stride 2, padding 1: only the odd rows and columns have taps
    (3, 3, 2, 1, 1, 8, 8, 24),     # every phase has taps: nothing to write
    (1, 1, 63, 0, 1, 70, 5, 16),   # a stride past the kernel's bits: torch's way
])
def test_untapped_zeros_write_exactly_the_phases_no_tap_reaches(R, S, stride, padding, dilation, H, W, C):
    g = common.conv_geometry((2, H, W, C), (8, R, S, C), stride, padding, dilation)
    dx = torch.full((g.N, g.H, g.W, g.Ci), 7.0, device=common.device())
    dgrad_kernels.untapped_zeros(dx, g, lesson06.dgrad_phases(g))
    # a row's phase has taps iff some tap r lands on its rows: (iy + padding - r*dilation) divisible by the stride
    def tapped(i, axis, taps):
        return any((i + g.padding[axis] - r * g.dilation[axis]) % g.stride[axis] == 0 for r in range(taps))
    reached = torch.tensor([[tapped(iy, 0, R) and tapped(ix, 1, S) for ix in range(g.W)] for iy in range(g.H)])
    assert torch.equal(dx.cpu(), torch.where(reached[None, :, :, None], 7.0, 0.0).expand_as(dx))


@pytest.mark.parametrize("H, R, stride, padding, dilation", [
    (9, 3, 2, 1, 1), (10, 3, 2, 0, 1), (12, 3, 2, 3, 1), (13, 4, 3, 1, 1), (14, 3, 2, 1, 3), (7, 1, 1, 2, 1),
    (12, 3, 2, 2, 2), (3, 3, 4, 1, 1), (9, 5, 4, 0, 2), (16, 7, 2, 3, 1), (8, 1, 2, 0, 1), (11, 5, 3, 2, 2)])
def test_the_lessons_phases_are_the_packages_without_the_crop(H, R, stride, padding, dilation):
    # the operator's dgrad (conv_tutorial/kernels/dgrad.py) pads both ends alike and crops; the lesson pads by
    # where the window starts, possibly negative: the same taps, rows and dilation, padding = its padding - crop
    g = common.conv_geometry((1, H, H, 8), (8, R, R, 8), stride, padding, dilation)
    ours = [(py, px, h, w) for py, px, h, w in lesson06.dgrad_phases(g)]
    theirs = dgrad_kernels.dgrad_phases(g)
    assert [p[:2] for p in ours] == [p[:2] for p in theirs]
    for (_, _, *axes), (_, _, *package_axes) in zip(ours, theirs):
        for ours_axis, package_axis in zip(axes, package_axes):
            assert (ours_axis.rows, ours_axis.taps) == (package_axis.rows, package_axis.taps)
            if ours_axis.taps is not None:
                assert ours_axis.dilation == package_axis.dilation
                assert ours_axis.padding == package_axis.padding - package_axis.crop


@pytest.mark.parametrize("R, S, padding, dilation", [(3, 3, 1, 1), (1, 1, 1, 1), (3, 5, (3, 1), (1, 2)), (4, 2, 0, 1)])
def test_stride_1_is_the_one_phase(R, S, padding, dilation):
    # section 2's conv is section 3's only phase at stride 1: all taps, padding d*(R-1) - p, dX's size
    g = common.conv_geometry((2, 9, 8, 16), (8, R, S, 16), 1, padding, dilation)
    (py, px, along_h, along_w), = lesson06.dgrad_phases(g)
    assert (py, px, along_h.taps, along_w.taps) == (0, 0, slice(0, R, 1), slice(0, S, 1))
    assert lesson06.phase_geometry(g, along_h, along_w) == lesson06.stride_1_geometry(g)


@pytest.mark.parametrize("Co, R, S, Ci_group, groups, phase_taps", [
    (6, 3, 3, 5, 1, [(slice(0, 3), slice(0, 3))]),          # all taps: stride 1
    (70, 3, 3, 40, 1, [(slice(1, 2), slice(0, 3, 2))]),     # one phase's taps; tiles past the channels
    (12, 5, 2, 3, 4, [(slice(0, 5, 2), slice(1, 2))]),      # four groups of 3 -> 3 channels
    (64, 1, 1, 33, 2, [(slice(0, 1), slice(0, 1))]),        # a 1x1 filter: only the channels swap
    (40, 3, 3, 24, 1, [(slice(a, 3, 2), slice(b, 3, 2)) for a in (0, 1) for b in (0, 1)]),  # stride 2's four phases
    (9, 5, 4, 6, 3, [(slice(a, 5, 3), slice(b, 4, 2)) for a in (2, 0, 1) for b in (1, 0)]),  # 3 x 2, groups, any order
    (8, 5, 5, 6, 1, [(slice(a, 5, 5), slice(b, 5, 5)) for a in range(5) for b in range(5)]),  # 25 phases: 2 launches
    (8, 3, 3, 6, 1, []),                                    # no phase has taps (a stride larger than the image)
])
def test_package_flipped_weights_are_slices_of_the_lessons_rotated_copy(Co, R, S, Ci_group, groups, phase_taps):
    # the package's one-pass Triton kernel (flipped_weights; the interpreter on a CPU) against the lesson's
    # rotated copy, indexed by stride arithmetic
    w = torch.randn(Co, R, S, Ci_group).to(common.device())
    rotated = lesson06.rotated_weights(w, groups)
    got = dgrad_kernels.flipped_weights(w, phase_taps, groups)
    assert len(got) == len(phase_taps)
    for w_phase, (taps_h, taps_w) in zip(got, phase_taps):
        expected = rotated[:, lesson06.rotated_taps(taps_h, R), lesson06.rotated_taps(taps_w, S)]
        assert w_phase.is_contiguous() and torch.equal(w_phase, expected)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", [
    (2, 9, 10, 16, 24, 3, 3, 2, 1, 1),              # ResNet-50's 3x3 stride 2
    (2, 9, 8, 8, 16, 3, 3, 1, 1, 1),                # stride 1: one conv, the whole filter turned around
    (1, 10, 9, 8, 24, 1, 1, 2, 0, 1),               # 1x1 stride 2: one phase with a tap, three of zeros
    (1, 9, 11, 8, 16, 3, 5, (2, 1), (1, 2), (1, 2)),  # stride 2 along h, dilation 2 along w
    (1, 13, 12, 8, 8, 4, 4, 3, 1, 1),               # stride 3, an even filter
    (1, 7, 7, 8, 8, 1, 1, 1, 2, 1),                 # padding past the filter: padding -2, the window inside dY
])
def test_kernel_arithmetic_on_the_tma_model(N, H, W, Ci, Co, R, S, stride, padding, dilation):
    lesson06.run_dgrad_model(N, H, W, Ci, Co, R, S, stride, padding, dilation, show=False)


BAD_CALLS = [   # (arguments changed from a valid call: a function of (x, w, dy), error, message)
    (lambda x, w, dy: {"groups": 2, "w": w[..., :4].contiguous()}, ValueError, "groups=2: dgrad runs"),
    (lambda x, w, dy: {"dy_nhwc": dy.float()}, TypeError, "dy_nhwc has dtype torch.float32"),
    (lambda x, w, dy: {"padding": 0}, ValueError, "dy_nhwc has shape"),
    (lambda x, w, dy: {"w": w.transpose(1, 2)}, ValueError, "w must be contiguous"),
    (lambda x, w, dy: {"x_shape": 8}, TypeError, "x_shape must be 4 ints"),
    (lambda x, w, dy: {"x_shape": (1, 8, 8, 4)}, ValueError, "channel mismatch"),
    (lambda x, w, dy: {}, ValueError, "CUDA GPU"),         # CPU tensors: refused last
]


@pytest.mark.parametrize("changes, error, message", BAD_CALLS)
def test_rejects_bad_calls(changes, error, message):
    x, w, dy, _ = lesson06.backward_inputs(1, 8, 8, 8, 16, 3, 3, 1, 1, 1, torch.bfloat16, device_name="cpu")
    valid = dict(dy_nhwc=dy, w=w, x_shape=x.shape, padding=1)
    with pytest.raises(error, match=re.escape(message)):
        lesson06.conv2d_dgrad_launch(**{**valid, **changes(x, w, dy)})
