"""benchmarks/clocks_under_load.py: reading nvidia-smi's samples and the peak at a clock (no GPU needed).
RESULTS.md's statement that the headline shape runs at the power limit comes from this script."""
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import clocks_under_load  # noqa: E402


class _Lines:
    def __init__(self, lines):
        self.stdout = iter(lines)


def _sampler_fed(lines):
    sampler = clocks_under_load.ClockSampler.__new__(clocks_under_load.ClockSampler)
    sampler.samples = []
    sampler.process = _Lines(lines)
    sampler._read()
    return sampler


def test_samples_are_read_from_nvidia_smi_csv_lines():
    # nvidia-smi --format=csv,noheader,nounits, fields in the order of FIELDS; "[N/A]" lines are skipped
    sampler = _sampler_fed(["1440, 1980, 696.12, 700.00, 56, 0x0000000000000004\n",
                            "[N/A], 1980, 80.00, 700.00, 40, 0x0000000000000001\n",
                            "1980, 1980, 533.40, 700.00, 54, 0x0000000000000000\n"])
    assert sampler.samples == [
        {"sm_mhz": 1440.0, "max_sm_mhz": 1980.0, "watts": 696.12, "limit_watts": 700.0, "celsius": 56.0,
         "reasons": 0x4},
        {"sm_mhz": 1980.0, "max_sm_mhz": 1980.0, "watts": 533.4, "limit_watts": 700.0, "celsius": 54.0,
         "reasons": 0x0}]


def test_summary_leaves_out_idle_samples_and_counts_the_power_cap():
    sampler = _sampler_fed([
        "1410, 1980, 698, 700, 60, 0x4\n",
        "1440, 1980, 695, 700, 61, 0x4\n",
        "1755, 1980, 650, 700, 62, 0x0\n",
        "1980, 1980, 90, 700, 45, 0x1\n",     # idle between blocks: under half the limit, left out
    ])
    summary = sampler.summary()
    assert summary["samples"] == 3
    assert summary["sm_mhz"] == 1440 and summary["sm_mhz_min"] == 1410 and summary["sm_mhz_max"] == 1755
    assert abs(summary["power_capped"] - 2 / 3) < 1e-9 and summary["hw_slowdown"] == 0
    assert summary["celsius"] == 62 and summary["limit_watts"] == 700


def test_summary_of_no_samples_is_none():
    assert _sampler_fed([]).summary() is None


def test_the_rate_per_cycle_gives_the_data_sheets_peak():
    """NVIDIA's H100 SXM data sheet: 989.4 dense bf16 TFLOPS, 132 SMs at a 1830 MHz boost clock."""
    per_cycle = clocks_under_load.FLOPS_PER_SM_PER_CYCLE[(9, 0)]
    assert abs(clocks_under_load.peak_tflops(132, per_cycle, 1830) - 989.4) < 0.5


def test_older_drivers_get_the_older_field_name(monkeypatch):
    def listing(text):
        return lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=text, stderr="")
    monkeypatch.setattr(clocks_under_load.subprocess, "run", listing('"clocks_event_reasons.active"\n'))
    assert clocks_under_load.query_fields().endswith("clocks_event_reasons.active")
    monkeypatch.setattr(clocks_under_load.subprocess, "run", listing('"clocks_throttle_reasons.active"\n'))
    assert clocks_under_load.query_fields().endswith("clocks_throttle_reasons.active")
