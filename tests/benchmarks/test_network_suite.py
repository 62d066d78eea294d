"""benchmarks/network_suite.py's timing protocol, with a stand-in timer (no GPU needed)."""
import sys
from pathlib import Path

import common

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import network_suite  # noqa: E402


def test_bench_in_rounds_alternates_and_reports_the_median_round(monkeypatch):
    """Each round times every function once, in order; the reported round is the median one."""
    order, tflops = [], iter([500.0, 610.0, 480.0, 600.0, 520.0, 590.0])
    def fake_bench(fn, flops):
        order.append(fn())
        value = next(tflops)
        return {"ms": flops / value / 1e9, "tflops": value, "tflops_p20": value - 1, "tflops_p80": value + 1}
    monkeypatch.setattr(common, "bench_tflops", fake_bench)
    timed = network_suite.bench_in_rounds({"ours": lambda: "ours", "cuDNN": lambda: "cuDNN"}, 2e12, 3)
    assert order == ["ours", "cuDNN"] * 3
    assert timed["ours"]["rounds"] == [500.0, 480.0, 520.0] and timed["ours"]["tflops"] == 500.0
    assert timed["cuDNN"]["rounds"] == [610.0, 600.0, 590.0] and timed["cuDNN"]["tflops"] == 600.0
    assert timed["cuDNN"]["ms"] == 2e12 / 600.0 / 1e9 and timed["cuDNN"]["tflops_p80"] == 601.0
