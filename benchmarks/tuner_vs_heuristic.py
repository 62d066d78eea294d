"""The operator's two ways to choose a config, side by side: the autotuner's and the heuristic's.

    python benchmarks/tuner_vs_heuristic.py

For each layer: autotune (selection.autotune, which times the heuristic's config among its
finalists), then time the tuned config, the heuristic's and cuDNN in alternating rounds, as the
network suite times a layer (network_suite.bench_in_rounds: do_bench medians, L2 flushed, host time
included). The tuner must never lose to the heuristic. The layers are those on which an earlier
tuner lost (the headline shape; a 33x47 67->100 3x3 layer; a 4x4 stride-4 stem with 3 channels,
which the runtime folds) and two of ResNet-50's.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import network_suite  # noqa: E402
from layers import TUNER_VS_HEURISTIC  # noqa: E402
from conv_tutorial import launch, runtime, selection  # noqa: E402

import torch  # noqa: E402


def main():
    common.require_tma_mma_gpu("benchmarks/tuner_vs_heuristic.py")
    print(f"tuned vs heuristic configs, bf16, {common.gpu_name()}, do_bench medians of 3 alternating rounds:")
    rows = []
    for label, N, H, W, Ci, Co, R, S, stride, padding in TUNER_VS_HEURISTIC:
        x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(Co, R, S, Ci, device="cuda", dtype=torch.bfloat16) / (R * S * Ci) ** 0.5
        geometry = common.conv_geometry(x.shape, w.shape, stride, padding)
        fold, run_geometry, xr, wr = runtime.run_operands(geometry, x, w)
        tuned, _, heuristic, _ = selection.autotune(run_geometry, xr, wr, None, details=True)
        expected = common.reference_conv2d_nhwc(x, w, None, stride, padding)
        calls = {}
        for name, config in (("tuned", tuned), ("heuristic", heuristic)):
            plan = launch.plan_for(run_geometry, torch.bfloat16, config, None)
            # the layer as the runtime runs it: the stem's fold (a copy) included, each call
            call = (lambda p: lambda: p.run(*(fold.apply(x, w) if fold else (x, w)), None))(plan)
            out = call()
            common.assert_close_to_reference(out, expected, dtype=torch.bfloat16, K=geometry.K)
            calls[name] = call
        calls["cudnn"] = common.cudnn_conv2d(x, w, None, stride, padding)
        timed = network_suite.bench_in_rounds(calls, geometry.flops, 3)
        row = {"layer": label, "geometry": geometry.describe(), "tuned_config": str(tuned),
               "heuristic_config": str(heuristic), **{f"{k}_tflops": v["tflops"] for k, v in timed.items()}}
        rows.append(row)
        print(f"  {label:<28} tuned {row['tuned_tflops']:6.1f} ({row['tuned_tflops'] / row['cudnn_tflops']:.2f}x cuDNN)"
              f"  heuristic {row['heuristic_tflops']:6.1f} ({row['heuristic_tflops'] / row['cudnn_tflops']:.2f}x)"
              f"  cuDNN {row['cudnn_tflops']:6.1f}   tuned {tuned}; heuristic {heuristic}")
    common.save_json(common.output_dir(), "tuner_vs_heuristic", {**common.versions(), "rows": rows})


if __name__ == "__main__":
    main()
