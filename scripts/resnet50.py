"""ResNet-50 end to end with lesson 05's convolution, next to the same model on cuDNN.

    python scripts/resnet50.py [--batch 128] [--tune] [--outdir out]

torchvision's ResNet-50 (random weights, eval mode, bf16, channels_last). Every nn.Conv2d is
converted with conv_torch.convert_conv2d (the operator torch.ops.conv_tutorial.conv2d); the rest
of the model is PyTorch's. Measured side by side in one run, each with triton.testing.do_bench
(median): eager and torch.compile, on cuDNN and on ours; the logits' error against an fp32 eager
run of the same model and input (max |error| / max |reference| and mean |error| / mean
|reference|); the time of each distinct conv layer alone, ours and cuDNN's, and its share of the
forward pass; and the first call of a new layer in a fresh process with a cold Triton cache:
with the heuristic config, with autotuning, and with a tuning file from an earlier process.
Configs: the heuristic (what a user gets by default), or `--tune` to autotune every layer first.
Writes resnet50.json and resnet50.png into the output folder. Needs a Hopper or Blackwell GPU.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

FIRST_CALL_LAYER = (128, 1024, 14, 14, 256, 1, 1, 1, 0)   # N, Ci, H, W, Co, R, S, stride, padding


def first_call_child():
    """Run in a fresh process: time one conv layer's first call (compile and config choice included)."""
    import conv_torch
    N, Ci, H, W, Co, R, S, stride, padding = FIRST_CALL_LAYER
    x = torch.randn(N, Ci, H, W, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(Co, Ci, R, S, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    torch.cuda.synchronize()
    start = time.perf_counter()
    conv_torch.conv2d(x, w, None, stride, padding)
    torch.cuda.synchronize()
    print(f"FIRST-CALL-SECONDS {time.perf_counter() - start:.3f}")


def profile_host_path(calls=300):
    """Where a conv call's host time goes (cProfile of the module call on a small layer)."""
    import cProfile
    import pstats
    import conv_torch
    conv = conv_torch.TutorialConv2d(torch.nn.Conv2d(256, 64, 1, bias=False)).cuda().bfloat16()
    x = torch.randn(32, 256, 14, 14, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        conv(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            conv(x)
        print(f"host us per call: {(time.perf_counter() - start) / calls * 1e6:.1f}")
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            conv(x)
        profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(18)


def first_call_latencies():
    """Seconds to the first result of FIRST_CALL_LAYER in fresh processes, cold Triton cache each."""
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        tuning_file = Path(folder) / "tuning.json"
        for name, autotune, use_file in (("heuristic, no tuning file", "0", False),
                                         ("autotune, no tuning file", "1", True),
                                         ("tuning file from the run before", "0", True)):
            env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(dir=folder),
                       CONV_TUTORIAL_AUTOTUNE=autotune,
                       CONV_TUTORIAL_TUNING_CACHE=str(tuning_file if use_file else Path(folder) / "none.json"))
            proc = subprocess.run([sys.executable, __file__, "--first-call"], env=env, capture_output=True,
                                  text=True, timeout=600)
            line = next((row for row in proc.stdout.splitlines() if row.startswith("FIRST-CALL-SECONDS")), None)
            results[name] = float(line.split()[1]) if line else f"failed: {proc.stderr[-300:]}"
            print(f"   first call, fresh process, cold Triton cache, {name}: {results[name]} s")
    return results


def relative_errors(out, reference):
    error = (out.float() - reference).abs()
    return (error.max() / reference.abs().max()).item(), (error.mean() / reference.abs().mean()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--tune", action="store_true", help="autotune every conv layer first")
    parser.add_argument("--outdir", default=None)
    parser.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help="profile the host path of one conv call")
    args = parser.parse_args()
    if args.first_call:
        return first_call_child()
    common.require_tma_mma_gpu("scripts/resnet50.py")
    if args.profile:
        return profile_host_path()
    import torchvision
    import conv_runtime
    import conv_torch
    outdir = common.output_dir(args.outdir)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    fp32 = torchvision.models.resnet50(weights=None).eval().cuda()
    x32 = torch.randn(args.batch, 3, 224, 224, device="cuda")
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        torch.backends.cuda.matmul.allow_tf32 = False
        reference = fp32(x32).float()
    cudnn_model = torchvision.models.resnet50(weights=None).eval()
    cudnn_model.load_state_dict(fp32.state_dict())
    cudnn_model = cudnn_model.cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)
    ours_model = torchvision.models.resnet50(weights=None).eval()
    ours_model.load_state_dict(fp32.state_dict())
    ours_model = conv_torch.convert_conv2d(ours_model).cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)
    x = x32.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    convs = [m for m in ours_model.modules() if isinstance(m, conv_torch.TutorialConv2d)]
    conv_runtime.set_autotune(args.tune)
    print(f"ResNet-50, batch {args.batch}, bf16, channels_last, {common.gpu_name()}; {len(convs)} convs "
          f"converted; configs: {'autotuned' if args.tune else 'heuristic (no tuning)'}")

    # Per layer: record each conv's input shape once, then time each distinct layer alone.
    shapes = []
    hooks = [m.register_forward_hook(lambda m, inp, out: shapes.append((m, tuple(inp[0].shape)))) for m in convs]
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        ours_model(x)
        torch.cuda.synchronize()
        warm_seconds = time.perf_counter() - start
    fallbacks = [str(w.message) for w in caught if "conv_tutorial::conv2d" in str(w.message)]
    if fallbacks:                      # a fallback would be a cuDNN call measured as ours: stop
        raise RuntimeError(f"some convs fell back to cuDNN: {fallbacks}")
    for hook in hooks:
        hook.remove()
    print(f"   first forward (compiles the kernels it needs): {warm_seconds:.1f} s")
    layers = {}
    for module, shape in shapes:
        key = (shape, tuple(module.weight.shape), module.stride, module.padding)
        layers.setdefault(key, [module, 0])[1] += 1
    layer_rows = []
    for (shape, w_shape, stride, padding), (module, count) in layers.items():
        xi = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        flops = 2 * shape[0] * w_shape[0] * w_shape[1] * w_shape[2] * w_shape[3] * \
            ((shape[2] + 2 * padding[0] - w_shape[2]) // stride[0] + 1) * ((shape[3] + 2 * padding[1] - w_shape[3]) // stride[1] + 1)
        cudnn_call = lambda: torch.nn.functional.conv2d(xi, module.weight, module.bias, stride, padding)  # noqa: E731
        with torch.no_grad():
            ours_ms = triton.testing.do_bench(lambda: module(xi))
            cudnn_ms = triton.testing.do_bench(cudnn_call)
            # kernels alone (CUDA graph replay): what a host-free schedule would see
            ours_graph_ms = triton.testing.do_bench_cudagraph(lambda: module(xi))
            cudnn_graph_ms = triton.testing.do_bench_cudagraph(cudnn_call)
        label = f"{shape[2]}x{shape[3]} {w_shape[1]}->{w_shape[0]} {w_shape[2]}x{w_shape[3]}" + \
            (f" s{stride[0]}" if stride[0] > 1 else "")
        layer_rows.append({"layer": label, "count": count, "ours_ms": ours_ms, "cudnn_ms": cudnn_ms,
                           "ours_graph_ms": ours_graph_ms, "cudnn_graph_ms": cudnn_graph_ms,
                           "ours_tflops": flops / ours_ms / 1e9, "cudnn_tflops": flops / cudnn_ms / 1e9,
                           "ratio": cudnn_ms / ours_ms})

    rows = []
    variants = {"eager-cudnn": cudnn_model, "ours": ours_model,
                "compile-cudnn": torch.compile(cudnn_model), "ours-compile": torch.compile(ours_model),
                # the same, with torch.compile's CUDA graphs: no host time per layer
                "compile-cudnn-cudagraphs": torch.compile(cudnn_model, mode="reduce-overhead"),
                "ours-compile-cudagraphs": torch.compile(ours_model, mode="reduce-overhead")}
    for name, model in variants.items():
        with torch.no_grad():
            start = time.perf_counter()
            out = model(x)                   # compiles (torch.compile variants) before timing
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            for _ in range(3):               # CUDA-graph variants record on their first calls
                out = model(x).clone()
            ms = triton.testing.do_bench(lambda: model(x), warmup=50, rep=500)
        max_err, mean_err = relative_errors(out, reference)
        rows.append({"variant": name, "batch": args.batch, "img_s": args.batch / ms * 1e3, "ms": ms,
                     "first_call_s": first, "logits_max_rel_err": max_err, "logits_mean_rel_err": mean_err})
        print(f"   {name:<14} {rows[-1]['img_s']:8.0f} images/s  ({ms:.2f} ms per batch; first call "
              f"{first:.1f} s)  logits vs fp32: max {max_err:.2e}, mean {mean_err:.2e}")
    forward_ms = next(r["ms"] for r in rows if r["variant"] == "ours")
    total_ours = sum(r["ours_ms"] * r["count"] for r in layer_rows)
    total_cudnn = sum(r["cudnn_ms"] * r["count"] for r in layer_rows)
    print(f"\n   conv layers alone, summed over the forward pass: ours {total_ours:.2f} ms, cuDNN "
          f"{total_cudnn:.2f} ms ({total_cudnn / total_ours:.2f}x); ours is {100 * total_ours / forward_ms:.0f}% "
          f"of our eager forward ({forward_ms:.2f} ms)")
    graph_ours = sum(r["ours_graph_ms"] * r["count"] for r in layer_rows)
    graph_cudnn = sum(r["cudnn_graph_ms"] * r["count"] for r in layer_rows)
    print(f"   kernels alone (CUDA graph replay), summed: ours {graph_ours:.2f} ms, cuDNN {graph_cudnn:.2f} ms "
          f"({graph_cudnn / graph_ours:.2f}x)")
    print(f"   {'layer':<26} {'count':>5} {'ours ms':>8} {'cuDNN ms':>8} {'cuDNN/ours':>10} {'share':>6}"
          f"   graph: {'ours ms':>8} {'cuDNN ms':>8} {'cuDNN/ours':>10}")
    for r in sorted(layer_rows, key=lambda r: -r["ours_ms"] * r["count"]):
        r["share_of_forward"] = r["ours_ms"] * r["count"] / forward_ms
        print(f"   {r['layer']:<26} {r['count']:5d} {r['ours_ms']:8.3f} {r['cudnn_ms']:8.3f} "
              f"{r['ratio']:10.2f} {100 * r['share_of_forward']:5.1f}%          {r['ours_graph_ms']:8.3f} "
              f"{r['cudnn_graph_ms']:8.3f} {r['cudnn_graph_ms'] / r['ours_graph_ms']:10.2f}")
    print("\nfirst call of a new layer (1x1, 14x14, 1024->256, batch 128):")
    latencies = first_call_latencies()
    info = common.versions()
    data = {**info, "batch": args.batch, "configs": "autotuned" if args.tune else "heuristic",
            "rows": rows, "layers": layer_rows, "first_call_latency_s": latencies}
    plot(data, outdir)
    return data


def plot(data, outdir):
    fig, (left, right) = common.new_figure(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1, 2]})
    names = [r["variant"] for r in data["rows"]]
    bars = left.bar(range(len(names)), [r["img_s"] for r in data["rows"]],
                    color=["#2060c0" if name.startswith("ours") else "#40a040" for name in names])
    left.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    for bar, row in zip(bars, data["rows"]):
        left.text(bar.get_x() + bar.get_width() / 2, row["img_s"], f"{row['img_s']:.0f}", ha="center", va="bottom")
    left.set_ylabel("images per second (higher is better)")
    left.set_xlabel("model variant")
    left.set_title(f"ResNet-50, batch {data['batch']}, bf16, {data['device']}", fontsize=10)
    layers = sorted(data["layers"], key=lambda r: -r["ours_ms"] * r["count"])
    xs = range(len(layers))
    right.bar([x - 0.3 for x in xs], [r["ours_ms"] * r["count"] for r in layers], 0.2, color="#2060c0",
              label="ours, one call (do_bench)")
    right.bar([x - 0.1 for x in xs], [r["cudnn_ms"] * r["count"] for r in layers], 0.2, color="#40a040",
              label="cuDNN, one call")
    right.bar([x + 0.1 for x in xs], [r["ours_graph_ms"] * r["count"] for r in layers], 0.2, color="#90b0e8",
              label="ours, kernel alone (CUDA graph)")
    right.bar([x + 0.3 for x in xs], [r["cudnn_graph_ms"] * r["count"] for r in layers], 0.2, color="#a0d0a0",
              label="cuDNN, kernel alone")
    right.set_xticks(list(xs), [f"{r['layer']} (x{r['count']})" for r in layers], rotation=60, ha="right", fontsize=7)
    right.set_ylabel("ms per forward pass (layer time x count)")
    right.set_xlabel("conv layer (input HxW, Ci->Co, filter, stride)")
    right.set_title(f"Each distinct conv layer timed alone; configs: {data['configs']}\n"
                    f"torch {data['torch']}, Triton {data['triton']}, cuDNN {data['cudnn']}", fontsize=10)
    right.legend()
    right.grid(axis="y", alpha=0.3)
    common.save_figure(fig, outdir, "resnet50", data)


if __name__ == "__main__":
    main()
