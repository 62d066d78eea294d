"""What clock the GPU runs a layer at, ours and cuDNN's, and how close each gets to the peak at it.

    python benchmarks/clocks_under_load.py "headline 64x64 384->384 3x3" [--config 256,128,64,3,8]

A tensor-core kernel that keeps every SM busy draws the GPU to its power limit, and the driver
then lowers the SM clock until the board fits under it. The dense bf16 peak is a number per clock
(4096 FLOPs per SM per cycle on Hopper: four tensor cores of 512 FMAs), so what a kernel can reach
is that peak at the clock it actually runs at, not at the boost clock of the data sheet.

For each kernel the script times the layer two ways while `nvidia-smi` samples the SM clock, the
board power and the reasons the clock is held down:
- as the benchmarks do (do_bench, L2 flushed before every call), round after round for a few
  seconds;
- sustained: the calls back to back for a few seconds, as in training, timed with CUDA events.
Without --config, ours runs the runtime's tuned choice (autotuned first, as `--bench` does)."""
import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from conv_tutorial import runtime, selection  # noqa: E402
from layers import chosen_on_command_line  # noqa: E402

import torch  # noqa: E402

from conv_tutorial.core.device import FLOPS_PER_SM_PER_CYCLE  # noqa: E402  (dense bf16/fp16 MMA per SM per clock)
SW_POWER_CAP = 0x4                           # NVML clock-event reasons, as nvidia-smi prints them
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
FIELDS = "clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,{reasons}.active"


def query_fields():
    """The fields to ask nvidia-smi for: drivers before 535 call the clock-event reasons
    "clocks_throttle_reasons"."""
    listing = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True).stdout
    return FIELDS.format(reasons="clocks_event_reasons" if "clocks_event_reasons" in listing
                         else "clocks_throttle_reasons")


class ClockSampler:
    """nvidia-smi's readings every `period_ms`, collected in a thread while a block runs."""

    def __init__(self, period_ms=20):
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        self.command = ["nvidia-smi", f"--query-gpu={query_fields()}", "--format=csv,noheader,nounits",
                        "-lms", str(period_ms), "-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"]
        self.samples = []

    def __enter__(self):
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        time.sleep(0.3)             # nvidia-smi's own start-up
        self.samples.clear()
        return self

    def _read(self):
        for line in self.process.stdout:
            values = [v.strip() for v in line.split(",")]
            try:
                self.samples.append({"sm_mhz": float(values[0]), "max_sm_mhz": float(values[1]),
                                     "watts": float(values[2]), "limit_watts": float(values[3]),
                                     "celsius": float(values[4]), "reasons": int(values[5], 16)})
            except (ValueError, IndexError):
                pass                # a line nvidia-smi could not fill ("[N/A]")

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait()
        self.reader.join(timeout=2)

    def summary(self):
        busy = [s for s in self.samples if s["watts"] > 0.5 * s["limit_watts"]] or self.samples
        if not busy:
            return None
        share = lambda bit: sum(1 for s in busy if s["reasons"] & bit) / len(busy)  # noqa: E731
        return {"samples": len(busy), "sm_mhz": statistics.median(s["sm_mhz"] for s in busy),
                "sm_mhz_min": min(s["sm_mhz"] for s in busy), "sm_mhz_max": max(s["sm_mhz"] for s in busy),
                "max_sm_mhz": busy[0]["max_sm_mhz"], "watts": statistics.median(s["watts"] for s in busy),
                "limit_watts": busy[0]["limit_watts"], "celsius": max(s["celsius"] for s in busy),
                "power_capped": share(SW_POWER_CAP), "hw_slowdown": share(HW_SLOWDOWN),
                "thermal": share(SW_THERMAL)}


def peak_tflops(num_sms, flops_per_sm_per_cycle, sm_mhz):
    """The dense MMA peak at a given SM clock."""
    return num_sms * flops_per_sm_per_cycle * sm_mhz * 1e6 / 1e12


def flushed_rounds(call, flops, seconds):
    """do_bench rounds (L2 flushed before each call) for about `seconds`: their median TFLOPS."""
    rounds, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        rounds.append(common.bench_tflops(call, flops)["tflops"])
    return statistics.median(rounds)


def sustained(call, flops, seconds):
    """Calls back to back for about `seconds` (no flush), timed with CUDA events: TFLOPS."""
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            call()
        calls += 20
        torch.cuda.synchronize()    # keep the host from queueing far ahead of the clock samples
    end.record()
    end.synchronize()
    return flops * calls / (begin.elapsed_time(end) * 1e-3) / 1e12


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layers", nargs="+", help="labels of the network suite or the ladder (benchmarks/layers.py)")
    parser.add_argument("--config", help="ours: KernelConfig fields, e.g. 256,128,64,3,8 (default: tuned)")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each timed block")
    args = parser.parse_args()
    chosen = chosen_on_command_line(args.layers)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    per_cycle = FLOPS_PER_SM_PER_CYCLE.get((props.major, props.minor))
    if per_cycle is None:
        raise SystemExit(f"no dense bf16 rate per cycle known for sm_{props.major}{props.minor}")
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, {common.versions()}")
    print(f"dense bf16 peak = {props.multi_processor_count} SMs x {per_cycle} FLOPs/cycle x SM clock")
    for label, N, H, W, Ci, Co, R, S, stride, padding in chosen:
        x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16)
        geometry = common.conv_geometry(x.shape, w.shape, stride, padding)
        config = (runtime.KernelConfig(*map(int, args.config.split(","))) if args.config
                  else selection.tuned_config(geometry, x, w, None))
        expected = common.reference_conv2d_nhwc(x, w, None, stride, padding)
        ours = lambda: runtime.conv2d(x, w, None, stride, padding, config=config)  # noqa: E731
        common.assert_close_to_reference(ours(), expected, dtype=torch.bfloat16, K=geometry.K)
        print(f"\n{label}: {geometry.describe()}; ours: {config}")
        for name, call in (("ours", ours), ("cuDNN", common.cudnn_conv2d(x, w, None, stride, padding))):
            for mode, timer in (("flushed", flushed_rounds), ("sustained", sustained)):
                with ClockSampler() as sampler:
                    tflops = timer(call, geometry.flops, args.seconds)
                s = sampler.summary()
                if s is None:
                    print(f"   {name:<6} {mode:<9} {tflops:6.1f} TFLOPS   (no clock samples)")
                    continue
                peak = peak_tflops(props.multi_processor_count, per_cycle, s["sm_mhz"])
                print(f"   {name:<6} {mode:<9} {tflops:6.1f} TFLOPS  SM clock {s['sm_mhz']:.0f} MHz "
                      f"({s['sm_mhz_min']:.0f}-{s['sm_mhz_max']:.0f}, max {s['max_sm_mhz']:.0f})  "
                      f"{s['watts']:.0f} of {s['limit_watts']:.0f} W  {s['celsius']:.0f} C  "
                      f"power-capped {100 * s['power_capped']:.0f}% of {s['samples']} samples  "
                      f"peak at that clock {peak:.0f} TFLOPS: {100 * tflops / peak:.0f}% of it")


if __name__ == "__main__":
    main()
