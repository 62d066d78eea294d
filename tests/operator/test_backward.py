"""The operator's backward with lesson 06's kernels (conv_tutorial.set_backward("lesson06")): the choice
and its errors, the fallback to torch with one warning per reason (CPU), the layouts handed to the
lesson's launchers (CPU, with launchers computed by torch.nn.grad in their place), and on a GPU the
gradients of the operator against torch's on awkward shapes. Then the package's dgrad plans that the
lesson only names (conv_tutorial/kernels/dgrad.py): all phases of a strided dgrad side by side in one
launch, its tile order, the filter read in place (FlippedFilter), on a CPU against torch (through CPU
models of the kernel's conv and loads, below), in the sm_90 and sm_100 builds, and on a GPU."""
import warnings

import common

import pytest
import torch

import conv_tutorial
from conv_tutorial import backward, wgrad
from conv_tutorial.kernels import dgrad as dgrad_kernels, fprop

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


@pytest.fixture
def lesson06_backend():
    before = backward.backward_backend()
    conv_tutorial.set_backward("lesson06")
    conv_tutorial.reset_backward_fallbacks()
    yield
    conv_tutorial.set_backward(before)


def operator_gradients(x, w, b, stride, padding, dilation=1, activation="none"):
    out = torch.ops.conv_tutorial.conv2d(x, w, b, [stride] * 2, [padding] * 2, [dilation] * 2, 1,
                                         activation=activation)
    out = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    return torch.autograd.grad(out.square().sum(), (x, w, b))


def torch_gradients(x, w, b, stride, padding, dilation=1, activation="none"):
    x, w, b = (t.detach().double().requires_grad_() for t in (x, w, b))
    out = torch.nn.functional.conv2d(x, w, b, stride, padding, dilation)
    out = torch.relu(out) if activation == "relu" else out
    return torch.autograd.grad(out.square().sum(), (x, w, b))


def test_set_backward_names_what_it_takes():
    with pytest.raises(ValueError, match=r"one of \('torch', 'lesson06'\), got 'cudnn'"):
        conv_tutorial.set_backward("cudnn")


def test_cpu_tensors_fall_back_to_torch_with_one_warning(lesson06_backend):
    x = torch.randn(2, 4, 7, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            grads = operator_gradients(x, w, b, 2, 1)
    said = [str(w.message) for w in caught if "backward" in str(w.message)]
    assert len(said) == 1 and "float64" in said[0], said       # the first reason that applies, once
    # ... and counted every time: dX and dW of each of the two calls (the bias's gradient is torch's own sum)
    (reason, count), = conv_tutorial.backward_fallbacks().items()
    assert "float64" in reason and reason in said[0] and count == 4
    conv_tutorial.set_backward("torch")                         # the default backend is no fallback
    operator_gradients(x, w, b, 2, 1)
    assert conv_tutorial.backward_fallbacks() == {reason: 4}
    conv_tutorial.reset_backward_fallbacks()
    assert conv_tutorial.backward_fallbacks() == {}
    for got, want in zip(grads, torch_gradients(x, w, b, 2, 1)):
        torch.testing.assert_close(got, want.to(got.dtype))


@pytest.fixture
def lesson06_stand_ins(lesson06_backend, monkeypatch):
    """The package's dgrad plans (lesson 06's phases) with torch's conv standing in for each phase's kernel, and
    torch standing in for the package's wgrad (wgrad.conv2d_weight_grad, whose plan
    tests/operator/test_wgrad_plan.py tests; same signature: NHWC x and dY, [Co, R, S, Ci] weight
    shape), on a CPU. Yields the list of what they were handed."""
    seen = []

    def phase_fprop(dy, w_phase, padding, dilation, groups=1, out_window=None):
        seen.append(("dgrad phase", dy.shape, w_phase.shape, type(dy)))
        assert dy.is_contiguous() and w_phase.is_contiguous()
        out = torch.nn.functional.conv2d(dy.permute(0, 3, 1, 2), w_phase.permute(0, 3, 1, 2), None, 1, padding,
                                         dilation, groups)
        out = out.permute(0, 2, 3, 1).contiguous()
        return out if out_window is None else out_window.write(out)

    def wgrad_stand_in(x, dy, w_shape, stride, padding, dilation, groups=1):
        seen.append(("wgrad", x.shape, dy.shape, w_shape, type(x)))
        assert x.is_contiguous() and dy.is_contiguous()
        dw = torch.nn.grad.conv2d_weight(x.permute(0, 3, 1, 2), (w_shape[0], w_shape[3], w_shape[1], w_shape[2]),
                                         dy.permute(0, 3, 1, 2), stride, padding, dilation, groups)
        return dw.permute(0, 2, 3, 1).contiguous()

    def side_by_side_stand_in(dy, w_side_by_side, plan, out_window):     # torch's conv for the one launch
        seen.append(("dgrad side by side", dy.shape, w_side_by_side.shape, type(dy)))
        reference_side_by_side(dy, w_side_by_side, plan, out_window)

    monkeypatch.setattr(backward, "_side_by_side_conv", side_by_side_stand_in)
    monkeypatch.setattr(wgrad, "conv2d_weight_grad", wgrad_stand_in)
    monkeypatch.setattr(backward, "_fprop", phase_fprop)
    monkeypatch.setattr(backward, "lesson06_reason", lambda *args: None)
    yield seen


def stand_in_inputs():
    x = torch.randn(2, 5, 9, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, 3, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    return x, w, b


def test_lesson06_path_gets_nhwc_tensors_and_gives_nchw_gradients(lesson06_stand_ins):
    seen = lesson06_stand_ins
    x, w, b = stand_in_inputs()
    grads = operator_gradients(x, w, b, 2, 1, activation="relu")
    assert [s[0] for s in seen] == ["dgrad phase"] * 4 + ["wgrad"]        # stride 2: four phases of dX
    assert all(s[1] == (2, 5, 5, 6) for s in seen[:4])                      # dY, NHWC
    assert seen[4][1:4] == ((2, 9, 8, 5), (2, 5, 5, 6), (6, 3, 2, 5))
    for got, want in zip(grads, torch_gradients(x, w, b, 2, 1, activation="relu")):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want.to(got.dtype))


def test_a_strided_dgrad_runs_its_phases_side_by_side(lesson06_stand_ins):
    """16-byte pixels of dX (8 fp64 channels) at stride 2: the four phases as one conv (the package's one launch, kernels/dgrad.py)."""
    seen = lesson06_stand_ins
    x = torch.randn(2, 8, 9, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 8, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    grads = operator_gradients(x, w, b, 2, 1)
    assert [s[0] for s in seen] == ["dgrad side by side", "wgrad"]
    assert seen[0][2][0] == 4 * 64            # four phases of 64 columns (a tile) for dX's 8 channels
    for got, want in zip(grads, torch_gradients(x, w, b, 2, 1)):
        torch.testing.assert_close(got, want.to(got.dtype))


def test_a_stem_runs_its_dgrad_folded(lesson06_stand_ins):
    """Few channels at a stride: dX is the folded conv's (one stride-1 conv on 2*2*3 channels), unfolded."""
    seen = lesson06_stand_ins
    x = torch.randn(2, 3, 13, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 3, 7, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    grads = operator_gradients(x, w, b, 2, 3)
    assert [s[0] for s in seen] == ["dgrad phase", "wgrad"]
    assert seen[0][2] == (12, 4, 4, 8)        # the folded, flipped weights: 2*2*3 channels (fp64 rows: no padding), 4x4, Co
    for got, want in zip(grads, torch_gradients(x, w, b, 2, 3)):
        torch.testing.assert_close(got, want.to(got.dtype))


def test_under_torch_compile_the_backend_is_chosen_when_a_step_runs(lesson06_stand_ins):
    """torch.compile traces the backward once, with tensors that hold no data, and caches it by the
    forward graph; the gradients are operators of their own that read the backend when they run:
    lesson 06's launchers run at every step on that step's tensors, and set_backward after the
    compile takes effect."""
    torch._dynamo.reset()
    seen = lesson06_stand_ins
    x, w, b = stand_in_inputs()
    step = torch.compile(lambda x, w, b: torch.ops.conv_tutorial.conv2d(x, w, b, [2, 2], [1, 1], [1, 1], 1,
                                                                         activation="relu").square().sum())
    expected = torch_gradients(x, w, b, 2, 1, activation="relu")
    conv_tutorial.set_backward("torch")
    for backend, steps in (("torch", 0), ("lesson06", 1), ("lesson06", 2), ("torch", 2), ("lesson06", 3)):
        conv_tutorial.set_backward(backend)
        grads = torch.autograd.grad(step(x, w, b), (x, w, b))
        assert len(seen) == 5 * steps                               # 4 dgrad phases and a wgrad per step
        assert all(s[-1] is torch.Tensor for s in seen)             # real tensors, not the tracer's
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want.to(got.dtype))


# (N, H, W, Ci, Co, R, S, stride, padding, dilation): Ci=3, Co not a multiple of the tile, stride 2,
# 1x1, non-square, dilation, a stem
GPU_CASES = [(2, 16, 16, 3, 40, 3, 3, 1, 1, 1), (2, 17, 13, 64, 200, 3, 3, 2, 1, 1), (4, 14, 14, 128, 64, 1, 1, 1, 0, 1),
             (2, 15, 19, 32, 48, 3, 5, 1, 2, 2), (2, 28, 28, 64, 128, 1, 1, 2, 0, 1),
             (2, 37, 30, 3, 64, 7, 7, 2, 3, 1)]    # a stem: its stride folded into the channels


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", GPU_CASES)
def test_operator_gradients_on_lesson06_match_torch(lesson06_backend, N, H, W, Ci, Co, R, S, stride, padding,
                                                     dilation):
    gen = torch.Generator().manual_seed(Ci * Co + R)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).cuda()  # noqa: E731
    x = make(N, Ci, H, W).bfloat16().to(memory_format=torch.channels_last).requires_grad_()
    w = make(Co, Ci, R, S, scale=(R * S * Ci) ** -0.5).bfloat16().to(memory_format=torch.channels_last).requires_grad_()
    b = make(Co).float().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = operator_gradients(x, w, b, stride, padding, dilation, activation="relu")
    fell_back = [str(c.message) for c in caught if "backward" in str(c.message)]
    assert not fell_back, fell_back                          # these shapes run on lesson 06's kernels
    expected = torch_gradients(x, w, b, stride, padding, dilation, activation="relu")
    # bf16 operands, fp32 accumulation: the gradient is a sum of K products each rounded to bf16
    # (~4e-3 relative), so its error grows like sqrt(K) times the typical term; relative to the
    # gradient's own scale 3e-2 leaves room (the forward tests use 2e-2 for one rounding).
    for got, want in zip(grads[:2], expected[:2]):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * scale)


@needs_gpu
@pytest.mark.parametrize("Ci, Co, groups, stride, runs_ours", [
    (256, 256, 2, 1, True),          # 128 -> 128 per group: both gradients on lesson 06
    (128, 256, 2, 2, True),          # 64 -> 128 per group, stride 2: dgrad's phases as grouped convs
    (72, 72, 3, 1, False),           # RegNetY-3.2GF's 24 per group: torch's, with the warning
])
def test_grouped_convs_take_lesson06_where_their_groups_fit(lesson06_backend, Ci, Co, groups, stride, runs_ours):
    gen = torch.Generator().manual_seed(Ci + Co + groups)
    x = torch.randn(2, Ci, 14, 13, generator=gen).cuda().bfloat16().to(memory_format=torch.channels_last)
    w = (torch.randn(Co, Ci // groups, 3, 3, generator=gen) * (9 * Ci // groups) ** -0.5).cuda().bfloat16()
    x, w = x.requires_grad_(), w.to(memory_format=torch.channels_last).requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.ops.conv_tutorial.conv2d(x, w, None, [stride] * 2, [1, 1], [1, 1], groups)
        grads = torch.autograd.grad(out.float().square().sum(), (x, w))
    fell_back = [str(c.message) for c in caught if "backward" in str(c.message)]
    assert (not fell_back) == runs_ours, fell_back
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    expected = torch.autograd.grad(torch.nn.functional.conv2d(x64, w64, None, stride, 1, 1, groups).square().sum(),
                                   (x64, w64))
    for got, want in zip(grads, expected):           # the tolerance of the test above, for the same reason
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * scale)


def test_a_plan_keeps_one_template_per_filter_read_in_place():
    # Two dgrads whose phases run the same conv with the same taps of filters of other sizes (R = 3 and 4 at stride
    # 2: the phase with taps 2 and 0, or 3 and 1) must not share a plan's template: their weights' descriptors
    # differ in their rows' length (launch.py keeps one per filter shape and taps; built on CPU tensors here)
    from conv_tutorial import launch
    found = []
    for R in (3, 4):
        g = common.conv_geometry((1, 4, 8, 4), (8, R, 4, 4), (2, 1), (0, 1), (1, 2))
        w = torch.randn(8, R, 4, 4).to(torch.bfloat16)
        tapped = [p for p in dgrad_kernels.dgrad_phases(g) if p[2].taps is not None and p[3].taps is not None]
        for (_, _, h, v), flipped in zip(tapped, dgrad_kernels.filters_in_place(w, [(h.taps, v.taps) for _, _, h, v in
                                                                                tapped])):
            if flipped.kernel_args() == (((32, 32),), ((12, 4),)):
                dy = torch.randn(1, g.out_h, g.out_w, 8).to(torch.bfloat16)
                found.append((common.conv_geometry(tuple(dy.shape), flipped.shape, 1, (h.padding, v.padding),
                                                   (h.dilation, v.dilation)), flipped, dy))
    (conv, first, dy_first), (other_conv, second, dy_second) = found
    assert conv == other_conv and first.kernel_args() == second.kernel_args()   # the same plan, the same taps
    plan = launch.ConvPlan(conv, torch.bfloat16, fprop.FIXED_CONFIG._replace(block_n=64), "sm_90", 132)
    plan.launch_for(dy_first, first, None)
    launched = plan.launch_for(dy_second, second, None)
    assert tuple(launched.w_desc.shape) == tuple(second.w.reshape(8, -1).shape) and len(plan.templates) == 2


# The package's dgrad plans (conv_tutorial/kernels/dgrad.py), which lesson 06 names but does not teach.
# Moved from the lesson with them: CPU models of the one launch and of the loads that read w in place.

from conv_tutorial.core.windows import FlippedFilter, OutputWindow, flipped_filter_taps  # noqa: E402
from conv_tutorial.kernels.dgrad import (  # noqa: E402
    busiest_program, dgrad_by_phases, dgrad_phases, dgrad_side_by_side, filters_in_place, flipped_weights,
    flipped_weights_by_torch, phase_order, side_by_side, side_by_side_config, side_by_side_in_place,
    side_by_side_launch, side_by_side_plan, taps_per_tile)
from conv_tutorial.kernels.gradients import backward_groups_reason, dgrad_config, stride_fold  # noqa: E402
from conv_tutorial.kernels.windows import PhaseTiles  # noqa: E402

lesson06 = common.load_lesson("06-conv-dgrad")      # the inputs, torch's gradients, its awkward shapes
backward_inputs, reference_gradients = lesson06.backward_inputs, lesson06.reference_gradients
forward = fprop
HERE = "tests.operator.test_backward"              # this module, for common.aot_compile's builders


def reference_fprop(dy_nhwc, w_phase, padding, dilation, groups=1, out_window=None):
    # torch's conv in fp32 standing in for the forward kernel (into out_window, if given; a FlippedFilter as what
    # its loads read)
    if isinstance(w_phase, FlippedFilter):
        w_phase = gathered_weights(w_phase)
    out = common.reference_conv2d_nhwc(dy_nhwc, w_phase, None, 1, padding, dilation, out_dtype=torch.float32,
                                       groups=groups)
    return out if out_window is None else out_window.write(out)


def run_side_by_side(N=2, H=9, W=10, Ci=5, Co=6, R=3, S=3, stride=2, padding=1, dilation=1, in_place=False):
    """The one launch on a CPU: every phase in one conv (torch's, the window's phases) against torch.nn.grad;
    `in_place`: its weights a FlippedFilter, what the kernel's loads would read of w."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.float32, device_name="cpu")
    plan = side_by_side_plan(g, forward.FIXED_CONFIG._replace(block_n=16))
    dx = dgrad_side_by_side(dy, w, g, plan, reference_side_by_side, in_place)
    expected, _ = reference_gradients(x, w, dy, g)
    torch.testing.assert_close(dx, expected, rtol=1e-4, atol=1e-4)


def package_dgrad_launch(dy_nhwc, w, geometry):
    """dX by the package's dgrad plans launched plainly (what lesson 06's launcher ran before the lesson took the
    per-phase path): the stem folded, a strided dgrad's phases in one launch where the plan applies, w in place."""
    g = geometry

    def conv(dy, w_phase, padding, dilation, groups, out_window=None):
        return forward.conv2d_fprop_launch(dy, w_phase, padding=padding, dilation=dilation, config=config,
                                            groups=groups, out_window=out_window)
    fold = stride_fold(g, dy_nhwc.element_size())
    config = dgrad_config(g if fold is None else fold.geometry)
    return dgrad_kernels.dgrad(dy_nhwc, w, g, conv, fold, conv=side_by_side_launch, in_place=True)


def check_package_dgrad(N, H, W, Ci, Co, R, S, stride, padding, dilation):
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.bfloat16)
    common.assert_close_to_reference(package_dgrad_launch(dy, w, g), reference_gradients(x, w, dy, g)[0],
                                     dtype=torch.bfloat16, K=Co * R * S)


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", lesson06.AWKWARD_SHAPES)
def test_package_dgrad_plans_match_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation):
    check_package_dgrad(N, H, W, Ci, Co, R, S, stride, padding, dilation)


def reference_side_by_side(dy_nhwc, w_side_by_side, plan, out_window):
    """The CPU's model of the one launch's conv, in fp32 (fp64 given fp64): each phase's weights spread over the whole
    window (zeros outside its rectangle), one torch conv of dY padded as the plan says (a negative
    padding crops), stored through the window's phases (OutputWindow.write)."""
    g, phases = plan.geometry, plan.phases
    dtype = torch.promote_types(dy_nhwc.dtype, torch.float32)
    if isinstance(w_side_by_side, FlippedFilter):    # weights in place: what its loads read, zeros elsewhere
        full = gathered_weights(w_side_by_side, phases).to("cpu", dtype)
    else:
        full = torch.zeros(g.Co, g.R, g.S, g.Ci, dtype=dtype)
        for p in range(phases.count):
            (r0, taps_h), (s0, taps_w) = (phases.along_h[p // len(phases.along_w)],
                                          phases.along_w[p % len(phases.along_w)])
            rows = w_side_by_side[p * phases.width:(p + 1) * phases.width, 0, :taps_h * taps_w].to("cpu", dtype)
            full[p * phases.width:(p + 1) * phases.width, r0:r0 + taps_h, s0:s0 + taps_w] = rows.view(
                phases.width, taps_h, taps_w, g.Ci)
    # rows of dY the output reads: from -padding to (out_h - 1) - padding + (R - 1) * dilation
    bottom, right = ((out - 1) + (size - 1) * dil - pad - (dy_size - 1) for out, size, dil, pad, dy_size in
                     ((g.out_h, g.R, g.dilation[0], g.padding[0], g.H),
                      (g.out_w, g.S, g.dilation[1], g.padding[1], g.W)))
    dy = torch.nn.functional.pad(dy_nhwc.to("cpu", dtype), (0, 0, g.padding[1], right, g.padding[0], bottom))
    out = torch.nn.functional.conv2d(dy.permute(0, 3, 1, 2), full.permute(0, 3, 1, 2), dilation=g.dilation)
    out = out.permute(0, 2, 3, 1)
    out_window.write(out.to(out_window.view.device))



@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", [
    (2, 9, 10, 5, 6, 3, 3, 2, 1, 1),              # ResNet-50's 3x3 stride 2, odd rows: phase 1 has one row fewer
    (2, 10, 9, 20, 6, 3, 3, 2, 0, 1),             # padding 0 (Inception's): phases start at different dY rows
    (1, 13, 12, 3, 5, 4, 4, 3, 1, 1),             # stride 3, an even filter: 9 phases
    (1, 11, 9, 3, 7, 7, 7, 2, 3, 1),              # a stem's 7x7
    (1, 14, 13, 2, 3, 5, 3, (3, 2), (2, 1), 1),   # strides 3 and 2
    (2, 9, 11, 5, 4, 3, 5, (2, 1), (1, 2), (1, 1)),  # stride 2 along h only
    (1, 9, 9, 2, 2, 5, 5, 4, 0, 1),               # stride 4: 16 phases of 1 or 2 taps per axis
    (1, 12, 12, 8, 4, 3, 3, 2, 3, 1),             # padding 3: the window starts inside dY (padding -1)
])
@pytest.mark.parametrize("in_place", [False, True])
def test_side_by_side_matches_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation, in_place):
    run_side_by_side(N, H, W, Ci, Co, R, S, stride, padding, dilation, in_place=in_place)


@pytest.mark.parametrize("R, stride, padding, dilation, why", [
    (1, 2, 0, 1, "three phases without taps"),
    (3, 2, 2, 2, "stride and dilation 2: the odd rows have no taps"),
    (3, 2, 1, 3, "dilation 3 at stride 2: the phases' windows start 1 dY row apart, their taps 3 apart"),
    (5, 5, 2, 1, "a stride above 4 (25 phases of one tap each)"),
    (3, 1, 1, 1, "stride 1: one phase"),
])
def test_side_by_side_plan_declines(R, stride, padding, dilation, why):
    g = common.conv_geometry((1, 12, 12, 8), (8, R, R, 8), stride, padding, dilation)
    assert side_by_side_plan(g) is None, why


def test_side_by_side_refuses_a_plan_of_another_shape_or_split_k():
    x, w, dy, g = backward_inputs(1, 9, 9, 8, 8, 3, 3, 2, 1, 1, torch.float32, device_name="cpu")
    other = common.conv_geometry((1, 11, 11, 8), (8, 3, 3, 8), 2, 1)
    with pytest.raises(ValueError, match="plan must be side_by_side_plan of"):
        dgrad_side_by_side(dy, w, g, side_by_side_plan(other), reference_side_by_side)
    with pytest.raises(ValueError, match="split_k=1"):
        side_by_side_plan(g, forward.FIXED_CONFIG._replace(split_k=2))
    assert side_by_side_plan(common.conv_geometry((1, 9, 9, 8), (8, 1, 1, 8), 2, 0)) is None


def test_phases_run_heaviest_first():
    # ResNet-50's 3x3 stride 2, padding 1: phase (0, 0) has 1 x 1 taps, (0, 1) and (1, 0) 1 x 2 and 2 x 1, (1, 1) 2 x 2
    g = common.conv_geometry((1, 14, 14, 8), (8, 3, 3, 8), 2, 1)
    plan = side_by_side_plan(g, forward.FIXED_CONFIG._replace(block_n=16))
    assert plan.phases.heaviest_first() == ((3,), (1,), (2,), (0,))
    window = OutputWindow(torch.empty(1, 14, 14, 8), phases=plan.phases)
    assert window.kernel_args()[8][4] is None
    ordered = window._replace(phases=plan.phases._replace(order=plan.phases.heaviest_first()))
    assert ordered.kernel_args()[8][4] == ((3,), (1,), (2,), (0,))


@pytest.mark.parametrize("N, H, Ci, busiest, ordered", [
    # ResNet-50's 3x3 stride-2 layers at batch 128 in 128 x 128 tiles, on 132 programs: the busiest program's
    # taps in lesson 05's order and heaviest first
    (128, 14, 512, (24, 15), True),     # 784 tiles: groups of 128 tiles, about the programs; 2 x 4 taps more
    (128, 28, 256, (32, 27), True),
    (128, 56, 128, (54, 54), False),    # balanced either way: lesson 05's order, dY read about once
    (1, 8, 64, (4, 4), False),          # 4 tiles, one program each: nothing to balance
])
def test_phase_order_where_it_lightens_the_busiest_program(N, H, Ci, busiest, ordered):
    g = common.conv_geometry((N, H, H, Ci), (Ci, 3, 3, Ci), 2, 1)
    plan = side_by_side_plan(g, forward.KernelConfig(128, 128, 64, 6, 8))
    grouped, heaviest = taps_per_tile(plan), taps_per_tile(plan, plan.phases.heaviest_first())
    assert sorted(grouped) == sorted(heaviest)      # the same tiles, another order
    assert (busiest_program(grouped, 132), busiest_program(heaviest, 132)) == busiest
    assert phase_order(plan, 132) == (plan.phases.heaviest_first() if ordered else None)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, stride, padding, tile_m, tile_n", [
    (128, 14, 14, 512, 512, 3, 2, 1, 128, 128),    # ResNet-50's 14x14 layer: 49 row-tiles, 4 phases of 4 columns
    (2, 13, 11, 40, 24, 4, 3, 1, 128, 64),         # stride 3: 9 phases, a last group of fewer rows
    (3, 9, 10, 16, 8, 3, (2, 1), 0, 64, 16),       # stride 2 along h only
])
def test_phase_tiles_hand_out_every_tile_once(N, H, W, Ci, Co, R, stride, padding, tile_m, tile_n, monkeypatch):
    # PhaseTiles.tile's own code run as plain Python (pick and gl.minimum in their Python meaning): heaviest first,
    # every (pid_m, pid_n) of the one launch's conv exactly once, each tile's taps what taps_per_tile (phase_order's
    # count) says; without an order, lesson 05's (pid_m, pid_n), as handed in
    import types
    import conv_tutorial.kernels.windows as kernel_windows
    monkeypatch.setattr(kernel_windows, "pick",
                        lambda table, index, field: table[index if index < len(table) else 0][field])
    monkeypatch.setattr(kernel_windows, "gl", types.SimpleNamespace(minimum=min))
    g = common.conv_geometry((N, H, W, Ci), (Co, R, R, Ci), stride, padding)
    plan = side_by_side_plan(g, forward.FIXED_CONFIG._replace(block_m=tile_m, block_n=tile_n))
    order = plan.phases.heaviest_first()
    phases = types.SimpleNamespace(width=plan.phases.width, order=order)
    num_pid_m, num_pid_n = -(-plan.geometry.M // tile_m), plan.geometry.Co // tile_n
    handed = [PhaseTiles.tile.fn(phases, t, num_pid_m, tile_n, 8, -1, -1) for t in range(num_pid_m * num_pid_n)]
    assert sorted(handed) == [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]
    taps = [plan.phases.along_h[n * tile_n // plan.phases.width // len(plan.phases.along_w)][1]
            * plan.phases.along_w[n * tile_n // plan.phases.width % len(plan.phases.along_w)][1] for _, n in handed]
    assert taps == taps_per_tile(plan, order) and taps == sorted(taps, reverse=True)
    unordered = types.SimpleNamespace(width=plan.phases.width, order=None)
    assert PhaseTiles.tile.fn(unordered, 5, num_pid_m, tile_n, 8, 3, 7) == (3, 7)


def test_side_by_side_weights_match_torch():
    # flipped_weights' side-by-side layout (the kernel under the interpreter on a CPU) against torch's
    w = torch.randn(40, 3, 3, 24).to(common.device())
    taps = [(slice(a, 3, 2), slice(b, 3, 2)) for a in (1, 0) for b in (1, 0)]
    got = flipped_weights(w, taps, width=32)
    assert got.shape == (4 * 32, 1, 4, 40)
    expected = side_by_side([flipped_weights_by_torch(w, h, v) for h, v in taps], 32)
    for p, (h, v) in enumerate(taps):       # each phase's own taps and rows, and zeros past its taps: 40 channels
        used = len(range(3)[h]) * len(range(3)[v])   # end inside a K block, whose last k-step reads past them
        torch.testing.assert_close(got[p * 32:(p + 1) * 32, :, :used], expected[p * 32:(p + 1) * 32, :, :used],
                                   rtol=0, atol=0)
        assert not got[p * 32:(p + 1) * 32, :, used:].any()


def gathered_weights(flipped, phases=None):
    """What the kernel's loads read through a FlippedFilter, gathered by torch at its kernel_args' columns:
    w' [N, R', S', Co] (N = Ci; with `phases`, a WindowPhases, phases.width columns per phase, zeros where a
    phase's rectangle has no tap and past its channels). The CPU's model of the loads."""
    Co, _, _, Ci = flipped.w.shape
    w2d = flipped.w.reshape(Co, -1)
    _, R, S, _ = flipped.shape
    along_h, along_w = flipped.kernel_args()
    width = Ci if phases is None else phases.width
    out = flipped.w.new_zeros(width * len(along_h) * len(along_w), R, S, Co)
    for a, ((base_h, step_h), (r0, _, _, taps_h)) in enumerate(zip(along_h, flipped.along_h)):
        for b, ((base_w, step_w), (s0, _, _, taps_w)) in enumerate(zip(along_w, flipped.along_w)):
            p = a * len(along_w) + b
            for r in range(r0, r0 + taps_h):
                for s in range(s0, s0 + taps_w):
                    column = base_h - r * step_h + base_w - s * step_w
                    out[p * width:p * width + Ci, r, s] = w2d[:, column:column + Ci].t()
    return out


@pytest.mark.parametrize("Co, R, S, Ci, phase_taps", [
    (24, 3, 3, 16, [(slice(None), slice(None))]),                                  # stride 1: the whole filter
    (40, 1, 1, 8, [(slice(None), slice(None))]),                                   # 1x1: a transpose
    (16, 3, 2, 24, [(slice(a, None, 2), slice(b, None, 2)) for a in (1, 0) for b in (1, 0)]),   # stride 2
    (8, 5, 5, 8, [(slice(2, None, 3), slice(0, None, 3))]),                        # one phase of stride 3
])
def test_filters_in_place_read_what_flipped_weights_copies(Co, R, S, Ci, phase_taps):
    w = torch.randn(Co, R, S, Ci).to(torch.bfloat16)
    for filt, (taps_h, taps_w) in zip(filters_in_place(w, phase_taps), phase_taps):
        torch.testing.assert_close(gathered_weights(filt.check()), flipped_weights_by_torch(w, taps_h, taps_w),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("R, stride, padding", [(3, 2, 1), (3, 2, 0), (4, 3, 1), (3, (2, 1), 1)])
def test_side_by_side_in_place_reads_what_the_copy_holds(R, stride, padding):
    x, w, dy, g = backward_inputs(1, 13, 12, 24, 16, R, R, stride, padding, 1, torch.bfloat16, device_name="cpu")
    plan = side_by_side_plan(g, forward.FIXED_CONFIG._replace(block_n=32))
    copy = side_by_side([flipped_weights_by_torch(w, h, v) for h, v in plan.taps], plan.phases.width)
    gathered = gathered_weights(side_by_side_in_place(w, plan).check(), plan.phases)       # [P * width, R', S', Co]
    for p in range(plan.phases.count):
        (r0, taps_h), (s0, taps_w) = (plan.phases.along_h[p // len(plan.phases.along_w)],
                                      plan.phases.along_w[p % len(plan.phases.along_w)])
        rows = slice(p * plan.phases.width, (p + 1) * plan.phases.width)
        torch.testing.assert_close(gathered[rows, r0:r0 + taps_h, s0:s0 + taps_w].reshape(plan.phases.width, -1, g.Co),
                                   copy[rows, 0, :taps_h * taps_w], rtol=0, atol=0)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", [
    (2, 9, 8, 16, 8, 3, 3, 1, 1, 1),               # stride 1: one conv, the whole filter reversed
    (1, 10, 9, 8, 24, 1, 1, 2, 0, 1),              # 1x1 stride 2: one phase with a tap, three of zeros
    (1, 9, 11, 8, 16, 3, 5, (2, 1), (1, 2), (1, 2)),  # stride 2 along h, dilation 2 along w
    (1, 13, 12, 8, 8, 4, 4, 3, 1, 1),              # stride 3, an even filter
])
def test_phases_read_in_place_match_torch(N, H, W, Ci, Co, R, S, stride, padding, dilation, monkeypatch):
    # dgrad_by_phases' in_place branch on a CPU (it runs on a GPU only: the gate let through here), each phase's
    # FlippedFilter given to the CPU's conv as what its loads read
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.bfloat16, device_name="cpu")
    import conv_tutorial.kernels.dgrad as dgrad_plans
    monkeypatch.setattr(dgrad_plans, "reads_in_place", lambda w, groups=1: groups == 1)
    handed = []

    def fprop(dy_nhwc, w_phase, **conv):
        handed.append(type(w_phase))
        return reference_fprop(dy_nhwc.float(), gathered_weights(w_phase).float(), **conv)
    dx = dgrad_by_phases(dy, w, g, fprop, in_place=True)
    expected, _ = reference_gradients(x.float(), w.float(), dy.float(), g)
    assert handed and set(handed) == {FlippedFilter}
    torch.testing.assert_close(dx.float(), expected, rtol=2e-2, atol=2e-2)


def test_flipped_filter_refusals():
    w = torch.randn(16, 3, 3, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="must read taps inside"):
        FlippedFilter(w, ((0, 1, 2, 2),), ((0, 0, 1, 3),)).check()
    with pytest.raises(ValueError, match="whole 16-byte vectors"):
        FlippedFilter(torch.randn(16, 1, 1, 3, dtype=torch.bfloat16), ((0, 0, 1, 1),), ((0, 0, 1, 1),)).check()
    g = common.conv_geometry((1, 8, 8, 16), (8, 3, 3, 16), 1, 1)          # dY's conv: 16 -> 8 channels, 3x3
    flipped = FlippedFilter(w, ((0, 0, 1, 3),), ((0, 0, 1, 3),))
    assert flipped_filter_taps(flipped, g, torch.bfloat16) == flipped.kernel_args()
    with pytest.raises(ValueError, match="needs"):
        flipped_filter_taps(flipped, g, torch.float16)
    with pytest.raises(ValueError, match="needs"):
        flipped_filter_taps(FlippedFilter(w, ((0, 0, 1, 2),), ((0, 0, 1, 3),)), g, torch.bfloat16)
    with pytest.raises(ValueError, match="the rectangles"):      # its shape right, a rectangle not the conv's
        flipped_filter_taps(FlippedFilter(w, ((0, 0, 1, 3),), ((1, 0, 1, 2),)), g, torch.bfloat16)



def aot_side_by_side(arch, N=2, H=16, W=16, Ci=128, Co=64, R=3, stride=2, padding=1, config=None, in_place=False,
                     heaviest_first=False):
    """(kernel, args, kwargs) of the one launch's conv, on CPU tensors: the dgrad of a 3x3 stride-2 conv, Ci -> Co,
    every phase in one launch of the forward kernel (`in_place`: its weights read from w, weights in place;
    `heaviest_first`: its tiles in that order)."""
    x, w, dy, g = backward_inputs(N, H, W, Ci, Co, R, R, stride, padding, 1, torch.bfloat16, device_name="cpu")
    # (the config of a build for `arch`, whatever GPU this machine has, if any)
    plan = side_by_side_plan(g, forward.KernelConfig(*(config or side_by_side_config(g, arch))))
    dx = torch.empty(N, H, W, Ci, dtype=torch.bfloat16)
    w_side_by_side = side_by_side_in_place(w, plan) if in_place else flipped_weights(
        w, [(h.taps, v.taps) for _, _, h, v in dgrad_phases(g)], width=plan.phases.width)
    phases = plan.phases._replace(order=plan.phases.heaviest_first() if heaviest_first else None)
    launch = forward.prepare_launch(dy, w_side_by_side, None, plan.geometry, plan.config, arch, 132,
                                     out_window=OutputWindow(dx, phases=phases))
    return forward.conv2d_fprop_kernel, launch.kernel_args(), forward.kernel_constexprs(plan.config, arch)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("heaviest_first", [False, True])
def test_side_by_side_build(arch, heaviest_first):
    # the one launch: the phases' build loads and stores as section 2's (im2col and tiled loads, the tile in 16-byte
    # st.global.v4, 8 bf16 each, per thread: 16 of them with 4 warps on 128 x 128, 8 with Hopper's 8 warps), with no
    # stack: the loader picks its tile's taps in the registers it has, either tile order
    built = common.aot_compile_or_skip(HERE, "aot_side_by_side", arch, heaviest_first=heaviest_first)
    config = side_by_side_config(common.conv_geometry((2, 16, 16, 128), (64, 3, 3, 128), 2, 1), arch)
    stores = config.block_m * config.block_n // (config.num_warps * 32 * 8)
    assert common.ptx_instructions(built["ptx"], ["st.global", "st.global.v4", common.PTX_TMA_STORE]) == {
        "st.global": stores, "st.global.v4": stores, common.PTX_TMA_STORE: 0}
    assert common.PTX_IM2COL_LOAD in built["ptx"] and built["stack"] == 0



@pytest.mark.parametrize("Ci, Co, groups, dgrad_runs, wgrad_runs", [
    (256, 256, 2, True, True),       # 128 -> 128 per group
    (128, 512, 4, False, True),      # 32 -> 128: wgrad's 128-row tiles fit; dgrad's conv writes 32 per group,
                                     # less than a tile's 64 columns
    (72, 72, 3, False, False),       # RegNetY-3.2GF's 24 per group
    (512, 128, 2, True, True),       # 256 -> 64: dgrad's conv reads 64 per group (one K block), writes 256
])
def test_which_grouped_convs_the_backward_runs(Ci, Co, groups, dgrad_runs, wgrad_runs):
    g = common.conv_geometry((2, 8, 8, Ci), (Co, 3, 3, Ci // groups), 1, 1, 1, groups)
    assert (backward_groups_reason(g, "dgrad") is None) == dgrad_runs
    assert (backward_groups_reason(g, "wgrad") is None) == wgrad_runs


@needs_gpu
@pytest.mark.parametrize("heaviest_first", [False, True], ids=["lesson 05's order", "heaviest first"])
@pytest.mark.parametrize("N, H, W, Ci, Co, R, stride", [
    (8, 56, 56, 128, 64, 3, 2),      # 196 tiles of 128 x 128 (Hopper's config) on 132 programs: some run two
    (2, 17, 17, 32, 48, 4, 3),       # stride 3, an even filter: 9 phases of 1 to 4 taps
])
def test_side_by_side_runs_either_tile_order(heaviest_first, N, H, W, Ci, Co, R, stride, monkeypatch):
    # the one launch on the GPU with its tiles in each order, forced (phase_order picks one per layer): dX
    # against torch's
    orders = []

    def forced(plan, programs):
        orders.append(plan.phases.heaviest_first() if heaviest_first else None)
        return orders[-1]
    import conv_tutorial.kernels.dgrad as dgrad_plans
    monkeypatch.setattr(dgrad_plans, "phase_order", forced)
    check_package_dgrad(N, H, W, Ci, Co, R, R, stride, 1, 1)
    assert len(orders) == 1 and (orders[0] is not None) == heaviest_first


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_one_launch_reads_w_in_place_as_an_n_major_b(arch):
    # the MMAs read B as it lies (WGMMA's imm-trans-b, tcgen05's bit 16), A as lesson 05 does
    built = common.aot_compile_or_skip(HERE, "aot_side_by_side", arch, in_place=True)
    assert common.transposed_operands(built["ptx"], arch) == (0, 1) and built["stack"] == 0
