"""Host time per call of lesson 05's conv, next to cuDNN's, on this machine's GPU and CPU.

A convolution of 30-100 us on the GPU is only as fast as the host can issue it: when a call
spends longer in Python and the driver than the GPU spends on the previous work, the GPU waits.
This script measures, for a few layers of lesson 05's network suite, the host microseconds of:

- `generic`: Triton's generic launcher (binds ~25 arguments, checks the specialization, encodes
  each TMA descriptor into a tensor map, launches);
- `compiled`: the compiled kernel called directly, its descriptors still encoded on every launch;
- `direct`: conv_tutorial.launch's DirectLaunch, tensor maps remembered per (descriptor, address);
- `runtime`: a whole runtime.conv2d call (plan lookup, output allocation, launch);
- `operator`: torch.ops.conv_tutorial.conv2d on NCHW channels_last tensors (conv_tutorial/ops.py);
- `cudnn`: torch.nn.functional.conv2d on the same channels_last tensors.

Each number is the wall time of 500 calls divided by 500, without waiting for the GPU (the GPU
work of those calls is still queued when the clock stops), the median of 5 such runs.

    python benchmarks/host_time.py [--json out/host_time.json] [--profile]

--profile adds a cProfile of 2000 runtime calls of the first layer: where the host time goes.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402  (first: on a machine without a GPU it turns on the Triton interpreter)
import time  # noqa: E402

import torch  # noqa: E402

from conv_tutorial import launch, runtime, selection  # noqa: E402
from conv_tutorial.kernels import fprop  # noqa: E402
from layers import HOST_TIME  # noqa: E402


def host_us_per_call(call, calls=200):
    """Host time of one call in us: Python + launch, without waiting for the GPU."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host_us


def compare_launch_paths(plan, x_nhwc, w, calls=200):
    """Host us per launch of one plan: Triton's generic launcher; the compiled kernel called
    directly (its tensor maps encoded on every launch); the plan's DirectLaunch (maps remembered)."""
    plan.run(x_nhwc, w)
    conv = plan.launch_for(x_nhwc, w, None)
    kwargs = fprop.kernel_constexprs(plan.config, plan.arch)
    direct = plan.launches[("none", None, None, None)]
    w_tail, out_tail = (None if desc is None else desc.base for desc in (conv.w_tail_desc, conv.out_tail_desc))
    raw_args = (conv.in_desc.base, conv.w_desc.base, w_tail, conv.out_2d, out_tail, conv.pointers, conv.shape)
    return {
        "generic": host_us_per_call(lambda: fprop.conv2d_fprop_kernel[conv.grid](*conv.kernel_args(), **kwargs),
                                    calls),
        "compiled": host_us_per_call(lambda: direct.compiled[conv.grid](*conv.kernel_args(), *direct.constexprs),
                                     calls),
        "direct": host_us_per_call(lambda: direct(conv.grid, *raw_args), calls),
    }


def measure_host_time(x_nhwc, w, stride, padding, config):
    """Host us per call: lesson 05's plain launcher against the runtime, and of the launch alone,
    Triton's launcher, the compiled kernel called directly, and DirectLaunch."""
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
    launches = compare_launch_paths(launch.plan_for(geometry, x_nhwc.dtype, config), x_nhwc, w)
    return {
        "plain_launcher_us": host_us_per_call(
            lambda: fprop.conv2d_fprop_launch(x_nhwc, w, None, stride, padding, config=config), calls=50),
        "runtime_us": host_us_per_call(lambda: runtime.conv2d(x_nhwc, w, None, stride, padding, config=config)),
        "generic_launch_us": launches["generic"], "compiled_launch_us": launches["compiled"],
        "direct_launch_us": launches["direct"],
    }


def median_host_us(call, calls=500, runs=5):
    return statistics.median(host_us_per_call(call, calls) for _ in range(runs))


def measure(layer):
    label, N, H, W, Ci, Co, R, S, stride, padding = layer
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16)
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
    config = selection.known_or_heuristic_config(geometry, x_nhwc.dtype)
    plan = launch.plan_for(geometry, x_nhwc.dtype, config)
    row = {"layer": label, "config": str(config)}
    if not config.split_k > 1:            # split-K runs two kernels: its launch paths differ
        row.update(compare_launch_paths(plan, x_nhwc, w, calls=500))
    row["runtime"] = median_host_us(lambda: runtime.conv2d(x_nhwc, w, None, stride, padding, config=config))
    x_nchw, w_oihw = x_nhwc.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)   # channels_last views
    row["operator"] = median_host_us(lambda: torch.ops.conv_tutorial.conv2d(x_nchw, w_oihw, None, [stride] * 2,
                                                                           [padding] * 2, [1, 1], 1))
    row["cudnn"] = median_host_us(lambda: torch.nn.functional.conv2d(x_nchw, w_oihw, None, stride, padding))
    return row


def profile_runtime(layer, calls=2000):
    import cProfile
    import pstats
    label, N, H, W, Ci, Co, R, S, stride, padding = layer
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16)
    runtime.conv2d(x_nhwc, w, None, stride, padding, tune=False)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        runtime.conv2d(x_nhwc, w, None, stride, padding, tune=False)
    profiler.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of {calls} runtime calls, {label} (times include the profiler's own cost):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    parser.add_argument("--profile", action="store_true", help="cProfile the runtime's calls")
    args = parser.parse_args()
    common.require_tma_mma_gpu("benchmarks/host_time.py")
    info = common.versions()
    print(f"{info['device']}, torch {info['torch']}, Triton {info['triton']}: host us per call")
    columns = ["generic", "compiled", "direct", "runtime", "operator", "cudnn"]
    print(f"{'layer':<26}" + "".join(f"{c:>10}" for c in columns) + "   config")
    rows = []
    for layer in HOST_TIME:
        row = measure(layer)
        rows.append(row)
        print(f"{row['layer']:<26}" + "".join(f"{row[c]:10.1f}" if c in row else f"{'-':>10}" for c in columns)
              + f"   {row['config']}")
    if args.profile:
        profile_runtime(HOST_TIME[0])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**info, "rows": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
