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
    python benchmarks/host_time.py --paths [--json results/<device>-<date>/host_time.json]

--profile adds a cProfile of 2000 runtime calls of the first layer: where the host time goes.

--paths measures every path a model's conv takes through the operator, each beside cuDNN's call for
the same work, as autograd and F.conv2d make it: the forward (a plain layer, and the stem through
the stride fold), dgrad (stride 1; a 3x3 stride 2 in one launch; a 1x1 stride 2, one tapped phase
and zeros), wgrad (whole tiles; split-K with its ordered sum) and the fp8 forward (against cuDNN's
bf16 conv: cuDNN has no e4m3 conv). For each it also profiles the operator's calls with cProfile and
sorts the time into where it went (`CATEGORIES`: the torch.library dispatch, the package's Python,
its argument checks, plans, descriptor encoding, Triton's launcher, allocations, extra kernels).
cProfile's own cost inflates every share alike: read the shares as where, the medians as how much.
A repeat call is served by the operators' C++ kernels where they are built (native.py; `native`: whether
they served the path's calls); `ours_python_us` is the same call on the Python path (native kernels off),
`ours_python_launch_us` that path with its launches through Triton's launcher (packed launches off too),
and `where` profiles the Python path.
JSON: {"device", "torch", "triton", "rows": [{"path", "layer", "ours_us", "cudnn_us", "native", "ours_python_us",
"ours_python_launch_us", "where"}]}.
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

from conv_tutorial import hostpath, launch, native, packed, runtime, selection  # noqa: E402
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
    direct = plan.replays[("none", None, None, None)].direct
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


# %% Every path of the operator, and where its host time goes (--paths) --------------------------

# (path, layer of ResNet-50 at batch 128): what a training or inference step calls, one row each
PATHS = [("forward", "RN50 14x14 256->256 3x3"), ("forward", "RN50 56x56 64->256 1x1"),
         ("forward, stem folded", "RN50 stem 224 3->64 7x7 s2"),
         ("dgrad, stride 1", "RN50 14x14 256->256 3x3"),
         ("dgrad, 3x3 stride 2 in one launch", "RN50 28x28 256->256 3x3 s2"),
         ("dgrad, 1x1 stride 2: one phase and zeros", "RN50 56x56 256->512 1x1 s2"),
         ("wgrad, whole tiles", "RN50 14x14 256->256 3x3"), ("wgrad, split-K", "RN50 7x7 2048->512 1x1"),
         ("fp8 forward (cuDNN: bf16)", "RN50 14x14 256->256 3x3")]

# Where a profiled function's own time goes: the first category whose test its (file, line, name) passes.
CATEGORIES = [
    ("Triton's launcher", lambda file, name: ("triton" in file and ("driver" in file or "jit.py" in file
                                                                    or "compiler" in file))
                                             or (file == "~" and "launch" in name)),
    ("descriptor encoding", lambda file, name: any(word in name.lower() for word in ("descriptor", "tensormap",
                                                                                    "tensor_map"))),
    ("argument checks", lambda file, name: "conv_tutorial" in file and (name.startswith("check") or "validate" in name
                                                                         or "reason" in name)),
    ("plans and keys", lambda file, name: "conv_tutorial" in file and ("plan" in name or "key" in name
                                                                        or "lookup" in name)),
    ("the package's launch path", lambda file, name: file.endswith(("conv_tutorial/launch.py",
                                                                     "conv_tutorial/kernels/fprop.py"))),
    ("allocations", lambda file, name: name.split(" ")[-1].rstrip(">").split(".")[-1] in (
        "empty", "zeros", "empty_like", "zeros_like", "full", "new_empty", "new_zeros", "empty_strided")),
    ("torch.library dispatch", lambda file, name: "torch/_ops.py" in file or "torch/_library" in file
                                                  or "torch/library.py" in file or "torch._ops." in name),
    ("the package's other Python", lambda file, name: "conv_tutorial" in file),
    ("torch, other", lambda file, name: "torch" in file or "torch" in name or name.startswith("<method")),
    ("other", lambda file, name: True),
]


def where_time_goes(stats, calls):
    """{category: us per call} from a pstats.Stats' own times (tottime), by CATEGORIES."""
    shares = {name: 0.0 for name, _ in CATEGORIES}
    for (file, _, name), (_, _, tottime, _, _) in stats.stats.items():
        category = next(label for label, test in CATEGORIES if test(file, name))
        shares[category] += tottime / calls * 1e6
    return {name: round(us, 1) for name, us in shares.items() if us >= 0.05}


def path_calls(path, layer, device="cuda"):
    """(ours, cuDNN's): two calls that do the same work, the operator's and torch's, for one path."""
    import conv_tutorial
    import conv_tutorial.ops  # noqa: F401  (registers torch.ops.conv_tutorial.*)
    label, N, H, W, Ci, Co, R, S, stride, padding = layer
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16, device_name=device)
    x_nchw, w_oihw = x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)       # channels_last, as a model holds them
    g = common.conv_geometry(x.shape, w.shape, stride, padding)
    dy_nchw = torch.randn(N, Co, g.out_h, g.out_w, dtype=torch.bfloat16, device=device).to(
        memory_format=torch.channels_last)
    sizes, ones = [stride] * 2, [1, 1]
    if path.startswith(("dgrad", "wgrad")):
        conv_tutorial.set_backward("lesson06")
        op = torch.ops.conv_tutorial.conv2d_input_grad if path.startswith("dgrad") else \
            torch.ops.conv_tutorial.conv2d_weight_grad
        mask = (True, False, False) if path.startswith("dgrad") else (False, True, False)
        return (lambda: op(dy_nchw, x_nchw, w_oihw, sizes, [padding] * 2, ones, 1),
                lambda: torch.ops.aten.convolution_backward(dy_nchw, x_nchw, w_oihw, None, sizes, [padding] * 2,
                                                            ones, False, [0, 0], 1, mask))
    cudnn = lambda: torch.nn.functional.conv2d(x_nchw, w_oihw, None, stride, padding)  # noqa: E731
    if path.startswith("fp8"):
        x8, w8 = x_nchw.to(torch.float8_e4m3fn), w_oihw.to(torch.float8_e4m3fn)
        x_scale, w_scale = torch.tensor(1.0, device=device), torch.ones(Co, device=device)
        return (lambda: torch.ops.conv_tutorial.conv2d_fp8(x8, x_scale, w8, w_scale, None, sizes, [padding] * 2,
                                                          ones), cudnn)
    return lambda: torch.ops.conv_tutorial.conv2d(x_nchw, w_oihw, None, sizes, [padding] * 2, ones, 1), cudnn


def _served():
    return sum(hits for hits, _, _ in native.counts().values())


def measure_paths(paths=PATHS, profile_calls=300):
    import cProfile
    import pstats
    from layers import resnet50_layers
    if not native.ensure():
        print("the native kernels (conv_tutorial/native.py) are not built here: every call takes the Python path")
    layers = {layer.label: layer for layer in resnet50_layers()}
    rows = []
    for path, label in paths:
        try:
            ours, cudnn = path_calls(path, layers[label])
            for _ in range(3):                               # compile, plan and record outside the clock
                ours(), cudnn()
        except Exception as error:                           # noqa: BLE001  (recorded: the other paths still run)
            rows.append({"path": path, "layer": label, "error": f"{type(error).__name__}: {error}"[:300]})
            print(f"{path:<42} {label:<28} failed: {rows[-1]['error']}")
            continue
        torch.cuda.synchronize()
        served = _served()
        row = {"path": path, "layer": label, "ours_us": round(median_host_us(ours, calls=200), 1),
               "cudnn_us": round(median_host_us(cudnn, calls=200), 1)}
        row["native"] = _served() > served     # (served by the C++ kernels: native.py)
        # the same calls on the Python path (native kernels off), then with its launches through Triton's
        # launcher (packed launches off too: packed.py); the profile below is the Python path's
        previous_native = native.set_enabled(False)
        try:
            row["ours_python_us"] = round(median_host_us(ours, calls=200), 1)
            previous = packed.set_enabled(False)
            hostpath.clear()
            try:
                for _ in range(3):
                    ours()
                row["ours_python_launch_us"] = round(median_host_us(ours, calls=200), 1)
            finally:
                packed.set_enabled(previous)
                hostpath.clear()
            for _ in range(3):
                ours()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(profile_calls):
                ours()
            profiler.disable()
        finally:
            native.set_enabled(previous_native)
        torch.cuda.synchronize()
        row["where"] = where_time_goes(pstats.Stats(profiler), profile_calls)
        rows.append(row)
        top = sorted(row["where"].items(), key=lambda item: -item[1])[:4]
        print(f"{path:<42} {label:<28} ours {row['ours_us']:7.1f} us ({'C++' if row['native'] else 'Python'}; the "
              f"Python path {row['ours_python_us']:.1f}, with Python launches {row['ours_python_launch_us']:.1f})  "
              f"cuDNN {row['cudnn_us']:6.1f} us  "
              f"{row['ours_us'] / row['cudnn_us']:5.2f}x   profiled: " + ", ".join(f"{k} {v:.0f}" for k, v in top))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    parser.add_argument("--profile", action="store_true", help="cProfile the runtime's calls")
    parser.add_argument("--paths", action="store_true", help="every path of the operator against cuDNN's")
    parser.add_argument("--dry-run", action="store_true", help="with --paths: list the paths and layers only")
    args = parser.parse_args()
    if args.paths and args.dry_run:
        from layers import resnet50_layers
        labels = {layer.label for layer in resnet50_layers()}
        for path, label in PATHS:
            print(f"{path:<42} {label}" + ("" if label in labels else "   (no such layer)"))
        return
    common.require_tma_mma_gpu("benchmarks/host_time.py")
    if args.paths:
        info = common.versions()
        print(f"{info['device']}, torch {info['torch']}, Triton {info['triton']}: host us per call, "
              f"the median of 5 runs of 200 calls, the GPU not waited for")
        rows = measure_paths()
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"device": info["device"], "torch": info["torch"],
                                             "triton": info["triton"], "rows": rows}, indent=1))
            print(f"wrote {args.json}")
        return
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
