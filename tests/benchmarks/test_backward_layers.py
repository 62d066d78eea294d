"""benchmarks/backward_layers.py's --operator figures on a CPU, with stand-ins for what needs a GPU: the
operator's gradients are checked against torch before anything is timed, and every path's TFLOPS and
host time land in the row under the names the summary reads."""
import sys
from pathlib import Path

import common

import pytest
import torch

import conv_tutorial
from conv_tutorial import backward, wgrad
from conv_tutorial.core.windows import FlippedFilter
from conv_tutorial.kernels import dgrad as dgrad_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import backward_layers  # noqa: E402
import host_time  # noqa: E402


def test_operator_figures_check_then_time_every_path(monkeypatch):
    lesson06 = common.load_lesson("06-conv-backward")     # its CPU models stand in for the kernels
    timed = []

    def fake_bench(fn, flops, cuda_graph=False):
        timed.append("bench")
        return {"ms": 1.0, "tflops": flops / 1e9, "tflops_p20": 0.0, "tflops_p80": 0.0}

    def wgrad_stand_in(x, dy, w_shape, stride, padding, dilation=1, groups=1):   # torch in the plan's place (no GPU)
        dw = torch.nn.grad.conv2d_weight(x.permute(0, 3, 1, 2).float(), (w_shape[0], w_shape[3], *w_shape[1:3]),
                                         dy.permute(0, 3, 1, 2).float(), stride, padding, dilation, groups)
        return dw.permute(0, 2, 3, 1).to(x.dtype).contiguous()

    monkeypatch.setattr(common, "bench_tflops", fake_bench)
    monkeypatch.setattr(host_time, "median_host_us", lambda call, calls: 7.0)
    monkeypatch.setattr(wgrad, "conv2d_weight_grad", wgrad_stand_in)
    monkeypatch.setattr(backward, "lesson06_reason", lambda *args: None)
    def fprop_stand_in(dy, w_phase, padding, dilation, groups=1, out_window=None):     # torch's conv per phase
        if isinstance(w_phase, FlippedFilter):       # (the weights read in place, on a GPU)
            w_phase = lesson06.gathered_weights(w_phase)
        out = torch.nn.functional.conv2d(dy.permute(0, 3, 1, 2), w_phase.permute(0, 3, 1, 2), None, 1, padding,
                                         dilation, groups).permute(0, 2, 3, 1)
        return out if out_window is None else out_window.write(out)

    monkeypatch.setattr(backward, "_fprop", fprop_stand_in)
    # (the one launch for all phases: lesson 06's CPU model in the kernel's place)
    monkeypatch.setattr(dgrad_kernels, "side_by_side_launch", lesson06.reference_side_by_side)
    before = backward.backward_backend()
    try:
        row = backward_layers.operator_figures(lesson06, ("tiny", 2, 9, 9, 8, 16, 3, 3, 2, 1), cuda_graph=False)
    finally:
        conv_tutorial.set_backward(before)
    assert {"dgrad operator", "wgrad operator", "wgrad plan"} <= row.keys() and timed == ["bench"] * 3
    assert set(row["host_us"]) == {"dgrad operator", "wgrad operator", "wgrad plan", "dgrad", "wgrad", "dgrad cuDNN",
                                   "wgrad cuDNN"}


@pytest.mark.skipif(common.has_tma_mma_gpu(), reason="checks what a machine without the GPU says")
def test_main_says_it_needs_the_gpu():
    with pytest.raises(RuntimeError, match="backward_layers.py needs an NVIDIA GPU"):
        backward_layers.main(["--operator", "--quick"])
