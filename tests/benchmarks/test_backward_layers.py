"""benchmarks/backward_layers.py on a CPU, with stand-ins for what needs a GPU: every path is checked
against torch before anything is timed (the zero-insertion dgrad's spread-out dY included), and its
TFLOPS and host time land in the row under the names the summary reads."""
import sys
from pathlib import Path

import common

import pytest
import torch

import conv_tutorial
from conv_tutorial import backward, wgrad
from conv_tutorial.kernels import dgrad as dgrad_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import backward_layers  # noqa: E402
import host_time  # noqa: E402

lesson06, lesson07 = common.load_lesson("06-conv-dgrad"), common.load_lesson("07-conv-wgrad")


def dgrad_stand_in(dy, w, x_shape, stride=1, padding=0, dilation=1, groups=1):      # torch in a launcher's place
    dx = torch.nn.grad.conv2d_input((x_shape[0], x_shape[3], *x_shape[1:3]), w.permute(0, 3, 1, 2).float(),
                                    dy.permute(0, 3, 1, 2).float(), stride, padding, dilation, groups)
    return dx.permute(0, 2, 3, 1).to(dy.dtype).contiguous()


def wgrad_stand_in(x, dy, w_shape, stride=1, padding=0, dilation=1, groups=1, config=None):
    dw = torch.nn.grad.conv2d_weight(x.permute(0, 3, 1, 2).float(), (w_shape[0], w_shape[3], *w_shape[1:3]),
                                     dy.permute(0, 3, 1, 2).float(), stride, padding, dilation, groups)
    return dw.permute(0, 2, 3, 1).to(x.dtype).contiguous()


@pytest.fixture
def timed(monkeypatch):
    names = []

    def fake_bench(fn, flops, cuda_graph=False):
        names.append("bench")
        return {"ms": 1.0, "tflops": flops / 1e9, "tflops_p20": 0.0, "tflops_p80": 0.0}
    monkeypatch.setattr(common, "bench_tflops", fake_bench)
    monkeypatch.setattr(host_time, "median_host_us", lambda call, calls: 7.0)
    return names


def test_bench_backward_checks_then_times_every_path(timed, monkeypatch):
    monkeypatch.setattr(lesson06, "conv2d_dgrad_launch", dgrad_stand_in)
    monkeypatch.setattr(lesson07, "conv2d_wgrad_launch", wgrad_stand_in)
    monkeypatch.setattr(common, "tma_mma_arch_and_sms", lambda who: ("sm_90", 132))
    row = backward_layers.bench_backward(lesson06, lesson07, "tiny", 2, 9, 10, 8, 16, 3, 3, 2, 1,
                                         zero_insertion=True)
    assert {"dgrad", "dgrad cuDNN", "wgrad", "wgrad cuDNN", "dgrad zero-insertion"} <= row.keys()
    assert timed == ["bench"] * 5 and row["wgrad_split_k"] >= 1


def test_zero_insertion_is_dgrad(monkeypatch):
    """dY spread out with zeros, through a stride-1 dgrad, gives the strided conv's dX (stride 2 and 3)."""
    monkeypatch.setattr(lesson06, "conv2d_dgrad_launch", dgrad_stand_in)
    for stride, padding in ((2, 1), ((3, 2), (0, 2))):
        x, w, dy, g = lesson06.backward_inputs(2, 11, 10, 4, 6, 3, 3, stride, padding, 1, torch.float32,
                                               device_name="cpu")
        dx = backward_layers.zero_insertion_dgrad(lesson06, dy, w, x.shape, g)
        torch.testing.assert_close(dx, lesson06.reference_gradients(x, w, dy, g)[0], rtol=1e-4, atol=1e-4)


def test_operator_figures_check_then_time_every_path(timed, monkeypatch):
    monkeypatch.setattr(wgrad, "conv2d_weight_grad", wgrad_stand_in)
    monkeypatch.setattr(backward, "lesson06_reason", lambda *args: None)

    def dgrad_phases_stand_in(dy, w, geometry, fprop, **options):     # the operator's dgrad: torch's, on a CPU
        g = geometry
        return dgrad_stand_in(dy, w, (g.N, g.H, g.W, g.Ci), g.stride, g.padding, g.dilation, g.groups)
    monkeypatch.setattr(dgrad_kernels, "dgrad", dgrad_phases_stand_in)
    before = backward.backward_backend()
    try:
        row = backward_layers.operator_figures(lesson06, lesson07, ("tiny", 2, 9, 9, 8, 16, 3, 3, 2, 1),
                                               cuda_graph=False)
    finally:
        conv_tutorial.set_backward(before)
    assert {"dgrad operator", "wgrad operator", "wgrad plan"} <= row.keys() and timed == ["bench"] * 3
    assert set(row["host_us"]) == {"dgrad operator", "wgrad operator", "wgrad plan", "dgrad", "wgrad", "dgrad cuDNN",
                                   "wgrad cuDNN"}


@pytest.mark.skipif(common.has_tma_mma_gpu(), reason="checks what a machine without the GPU says")
def test_main_says_it_needs_the_gpu():
    with pytest.raises(RuntimeError, match="backward_layers.py needs an NVIDIA GPU"):
        backward_layers.main(["--operator", "--quick"])


def test_operator_against_cudnn_checks_each_call_then_times_both(timed, monkeypatch):
    monkeypatch.setattr(wgrad, "conv2d_weight_grad", wgrad_stand_in)
    monkeypatch.setattr(backward, "lesson06_reason", lambda *args: None)
    calls = []

    def dgrad_phases_stand_in(dy, w, geometry, fprop, **options):     # the operator's dgrad: torch's, on a CPU
        calls.append("dgrad")
        g = geometry
        return dgrad_stand_in(dy, w, (g.N, g.H, g.W, g.Ci), g.stride, g.padding, g.dilation, g.groups)
    monkeypatch.setattr(dgrad_kernels, "dgrad", dgrad_phases_stand_in)
    before = backward.backward_backend()
    try:
        row = backward_layers.operator_against_cudnn(lesson06, ("tiny", 2, 9, 9, 8, 16, 3, 3, 2, 1), cuda_graph=False)
    finally:
        conv_tutorial.set_backward(before)
    assert calls == ["dgrad"] * 3                       # checked on three calls before any timing
    assert {"dgrad operator", "dgrad cuDNN", "wgrad operator", "wgrad cuDNN"} <= row.keys() and timed == ["bench"] * 4


def test_every_net_lists_distinct_dense_convs():
    for net, layers in backward_layers.NETS.items():
        found = layers(8)
        assert found and len({layer.label for layer in found}) == len(found), net
        assert all(layer.N == 8 for layer in found), net
