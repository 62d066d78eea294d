"""The operator's backward with lesson 06's kernels (conv_tutorial.set_backward("lesson06")): the choice
and its errors, the fallback to torch with one warning per reason (CPU), the layouts handed to the
lesson's launchers (CPU, with launchers computed by torch.nn.grad in their place), and on a GPU the
gradients of the operator against torch's on awkward shapes."""
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

    lesson06 = common.load_lesson("06-conv-backward")

    def side_by_side_stand_in(dy, w_side_by_side, plan, out_window):     # torch's conv for section 2b's one launch
        seen.append(("dgrad side by side", dy.shape, w_side_by_side.shape, type(dy)))
        lesson06.reference_side_by_side(dy, w_side_by_side, plan, out_window)

    monkeypatch.setattr(dgrad_kernels, "side_by_side_launch", side_by_side_stand_in)
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
    """16-byte pixels of dX (8 fp64 channels) at stride 2: the four phases as one conv (lesson 06, section 2b)."""
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
