"""ResNet-50 end to end with lesson 05's convolution, next to the same model on cuDNN.

    python benchmarks/resnet50.py [--batch 128 1] [--tune] [--freezing] [--outdir out] [--first-call-latency]
    python benchmarks/resnet50.py --fp8 [--batch 128]

torchvision's ResNet-50 (random weights, eval mode, bf16, channels_last). Variants, each measured
with triton.testing.do_bench (median) in one run, per batch size:
  eager-cudnn          the model as PyTorch runs it (cuDNN convs, separate BatchNorm/ReLU/add)
  compile-cudnn        torch.compile (default mode) of that model: Inductor fuses BatchNorm, add
                       and ReLU into its own kernels around the cuDNN calls
  ours                 every nn.Conv2d through torch.ops.conv_tutorial.conv2d (convert_conv2d)
  ours-fused           fusion.fuse_conv_bn_act: BatchNorm folded into the weights, and the
                       residual add and ReLU done in the conv's epilogue: one op call per conv
  ours-fused-compile   torch.compile (default mode) of ours-fused
and, since with 53 convs the host time of a call matters (batch 1 above all), the same two
compiled models with mode="reduce-overhead" (CUDA graphs): compile-cudnn-cudagraphs and
ours-fused-compile-cudagraphs; `--freezing` compiles all of them with Inductor's freezing, the
strongest torch.compile of an inference model. For each: images/s and the logits' error against an fp32 eager run
of the same model and input (max |error| / max |reference| and mean |error| / mean |reference|).
Per layer (batch 128): every distinct fused conv of ours-fused timed alone, next to cuDNN's conv
alone and to cuDNN's conv followed by what the fused op also does (BatchNorm, add, ReLU in eager).
`--first-call-latency` adds the first call of a new layer in a fresh process with a cold Triton
cache: with the heuristic config, with autotuning, and with a tuning file from an earlier process.
Configs: the heuristic (what a user gets by default), or `--tune` to autotune every layer first.
The operator's C++ kernels for repeat calls (conv_tutorial/native.py) are built before any variant is
timed ("native_built" in the JSON: False where they cannot be built, every call then on the Python path).
Writes resnet50.json and resnet50.png into the output folder. Needs a Hopper or Blackwell GPU.

`--fp8`: the model in e4m3 (fp8.quantize_fp8 of ours-fused, calibrated on four batches of
other random images) next to ours-fused in bf16 and cuDNN, all compiled with Inductor's freezing
and CUDA graphs; images/s and the logits' error against the fp32 model and against ours-fused
in bf16. Written as the "resnet50" entries of fp8.json in the output folder (network_suite.py
--fp8 writes its "layers").
"""
import argparse
import json
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
from conv_tutorial import fp8, fusion, native, ops, selection  # noqa: E402
from layers import FIRST_CALL  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402


def first_call_child():
    """Run in a fresh process: time one conv layer's first call (compile and config choice included)."""
    _, N, H, W, Ci, Co, R, S, stride, padding = FIRST_CALL
    x = torch.randn(N, Ci, H, W, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(Co, Ci, R, S, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    torch.cuda.synchronize()
    start = time.perf_counter()
    ops.conv2d(x, w, None, stride, padding)
    torch.cuda.synchronize()
    print(f"FIRST-CALL-SECONDS {time.perf_counter() - start:.3f}")


def profile_host_path(calls=300):
    """Where a conv call's host time goes (cProfile of the module call on a small layer)."""
    import cProfile
    import pstats
    conv = ops.TutorialConv2d(torch.nn.Conv2d(256, 64, 1, bias=False)).cuda().bfloat16()
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
    """Seconds to the first result of layers.FIRST_CALL in fresh processes, cold Triton cache each."""
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


def build_models(batch):
    """The fp32 reference, the bf16 cuDNN model, ours (converted) and ours fused, same weights."""
    import torchvision
    torch.manual_seed(0)
    fp32 = torchvision.models.resnet50(weights=None).eval().cuda()
    # BatchNorm statistics as a trained model has them (fresh ones are 0 and 1: folding would be
    # a no-op and the test of it weak)
    for bn in (m for m in fp32.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.2, 0.2)
    x32 = torch.randn(batch, 3, 224, 224, device="cuda")
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        torch.backends.cuda.matmul.allow_tf32 = False
        reference = fp32(x32).float()
    bf16 = dict(dtype=torch.bfloat16, memory_format=torch.channels_last)
    copy = lambda: torchvision.models.resnet50(weights=None).eval().cuda().to(**bf16)  # noqa: E731
    cudnn_model, ours_model = copy(), copy()
    cudnn_model.load_state_dict(fp32.state_dict())
    ours_model.load_state_dict(fp32.state_dict())
    ops.convert_conv2d(ours_model)
    x = x32.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    # folded from the fp32 model (the arithmetic in fp32), then cast: as a user would deploy it
    fused_model = fusion.fuse_conv_bn_act(fp32, example_input=x32[:1]).to(**bf16)
    return reference, cudnn_model, ours_model, fused_model, x


def check_no_fallback(model, x):
    """Run once (compiles what it needs); a fallback would be a cuDNN call measured as ours."""
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        model(x)
        torch.cuda.synchronize()
    fallbacks = [str(w.message) for w in caught if "conv_tutorial::conv2d" in str(w.message)]
    if fallbacks:
        raise RuntimeError(f"some convs fell back to cuDNN: {fallbacks}")
    return time.perf_counter() - start


def time_variants(models, x, reference, batch):
    rows = []
    for name, model in models.items():
        with torch.no_grad():
            start = time.perf_counter()
            out = model(x)                   # compiles (torch.compile variants) before timing
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            for _ in range(3):               # CUDA-graph variants record on their first calls
                out = model(x).clone()
            ms = triton.testing.do_bench(lambda: model(x), warmup=50, rep=500 if batch > 8 else 200)
        max_err, mean_err = relative_errors(out, reference)
        rows.append({"variant": name, "batch": batch, "img_s": batch / ms * 1e3, "ms": ms,
                     "first_call_s": first, "logits_max_rel_err": max_err, "logits_mean_rel_err": mean_err})
        print(f"   {name:<30} {rows[-1]['img_s']:8.0f} images/s  ({ms:.3f} ms per batch; first call "
              f"{first:.1f} s)  logits vs fp32: max {max_err:.2e}, mean {mean_err:.2e}")
    return rows


def fused_layer_table(fused_model, x):
    """Every distinct fused conv alone, next to cuDNN doing the same work unfused (eager)."""
    layers = {}
    for _, module, inputs in fusion.module_calls(fused_model, x, fusion.FusedConv2d):
        key = (tuple(inputs[0].shape), tuple(module.weight.shape), tuple(module._op_args[0]),
               module.takes_residual, module.activation)
        layers.setdefault(key, [module, inputs, 0])[2] += 1
    rows = []
    for (shape, w_shape, stride, residual, activation), (module, inputs, count) in layers.items():
        _, padding, dilation, _ = module._op_args
        xi = inputs[0]
        res = inputs[1] if residual else None
        shift = module.bias.to(torch.bfloat16)

        def cudnn_unfused():
            y = torch.nn.functional.conv2d(xi, module.weight, None, stride, padding, dilation)
            y = y + shift.view(1, -1, 1, 1)      # what the BatchNorm does once folded
            if res is not None:
                y = y + res
            return torch.relu(y) if activation == "relu" else y
        cudnn_conv = lambda: torch.nn.functional.conv2d(xi, module.weight, None, stride, padding, dilation)  # noqa: E731
        with torch.no_grad():
            out = module(*inputs)
            out_elems = out.numel()
            ours_ms = triton.testing.do_bench(lambda: module(*inputs))
            conv_ms = triton.testing.do_bench(cudnn_conv)
            unfused_ms = triton.testing.do_bench(cudnn_unfused)
            ours_graph_ms = triton.testing.do_bench_cudagraph(lambda: module(*inputs))
            conv_graph_ms = triton.testing.do_bench_cudagraph(cudnn_conv)
        flops = 2 * out_elems * w_shape[1] * w_shape[2] * w_shape[3]
        label = (f"{shape[2]}x{shape[3]} {w_shape[1]}->{w_shape[0]} {w_shape[2]}x{w_shape[3]}"
                 + (f" s{stride[0]}" if stride[0] > 1 else "") + (" +res" if residual else "")
                 + (f" {activation}" if activation != "none" else ""))
        rows.append({"layer": label, "count": count, "ours_fused_ms": ours_ms, "cudnn_conv_ms": conv_ms,
                     "cudnn_conv_epilogue_eager_ms": unfused_ms, "ours_fused_graph_ms": ours_graph_ms,
                     "cudnn_conv_graph_ms": conv_graph_ms, "ours_tflops": flops / ours_ms / 1e9,
                     "cudnn_tflops": flops / conv_ms / 1e9})
    print("\n   fused model, each distinct fused conv alone (do_bench; graph = kernels alone):")
    print(f"   {'layer':<36} {'count':>5} {'ours fused':>10} {'cuDNN conv':>10} {'cuDNN+epi':>10}"
          f" {'ours graph':>10} {'cuDNN graph':>11}  (ms)")
    for r in sorted(rows, key=lambda r: -r["ours_fused_ms"] * r["count"]):
        print(f"   {r['layer']:<36} {r['count']:5d} {r['ours_fused_ms']:10.3f} {r['cudnn_conv_ms']:10.3f}"
              f" {r['cudnn_conv_epilogue_eager_ms']:10.3f} {r['ours_fused_graph_ms']:10.3f}"
              f" {r['cudnn_conv_graph_ms']:11.3f}")
    totals = {k: sum(r[k] * r["count"] for r in rows) for k in
              ("ours_fused_ms", "cudnn_conv_ms", "cudnn_conv_epilogue_eager_ms", "ours_fused_graph_ms",
               "cudnn_conv_graph_ms")}
    print("   summed over the forward pass: " + ", ".join(f"{k} {v:.2f}" for k, v in totals.items()))
    return rows, totals


def fp8_comparison(batch, outdir):
    """ResNet-50 in e4m3 against ours-fused in bf16 and cuDNN, each frozen and in CUDA graphs."""
    import torch._inductor.config
    torch._inductor.config.freezing = True
    reference, cudnn_model, _, fused_model, x = build_models(batch)
    generator = torch.Generator(device="cuda").manual_seed(7)
    calibration = [torch.randn(x.shape, device="cuda", generator=generator).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last) for _ in range(4)]
    fp8_model = fp8.quantize_fp8(fused_model, calibration)
    print(f"\nResNet-50, batch {batch}, {common.gpu_name()}: {fp8_model.fp8_convs} convs in e4m3, "
          f"{fp8_model.bf16_convs} in bf16; calibrated on {len(calibration)} batches of other random images")
    check_no_fallback(fp8_model, x)
    models = {"cudnn-freeze-cudagraphs": torch.compile(cudnn_model, mode="reduce-overhead"),
              "ours-bf16-fused": torch.compile(fused_model, mode="reduce-overhead"),
              "ours-fp8-fused": torch.compile(fp8_model, mode="reduce-overhead")}
    rows = time_variants(models, x, reference, batch)
    with torch.no_grad():
        bf16_logits = models["ours-bf16-fused"](x).float().clone()
        fp8_logits = models["ours-fp8-fused"](x).float().clone()
    for row in rows:
        row["compile"] = "torch.compile(mode='reduce-overhead'), Inductor freezing"
    rows[-1]["logits_max_rel_err_vs_bf16"] = relative_errors(fp8_logits, bf16_logits)[0]
    by = {r["variant"]: r for r in rows}
    print(f"\nours-fp8-fused / ours-bf16-fused: {by['ours-fp8-fused']['img_s'] / by['ours-bf16-fused']['img_s']:.3f}x; "
          f"/ cudnn-freeze-cudagraphs: {by['ours-fp8-fused']['img_s'] / by['cudnn-freeze-cudagraphs']['img_s']:.3f}x; "
          f"fp8 logits vs bf16 model: max {rows[-1]['logits_max_rel_err_vs_bf16']:.2e}")
    path = Path(outdir) / "fp8.json"
    data = json.loads(path.read_text()) if path.exists() else common.versions()
    data["resnet50"] = rows
    data["resnet50_note"] = ("torchvision ResNet-50 with random weights and BatchNorm statistics that are not "
                             "the identity (pretrained weights are not downloaded); inputs random images")
    common.save_json(outdir, "fp8", data)
    return data


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 1])
    parser.add_argument("--tune", action="store_true", help="autotune every conv layer first")
    parser.add_argument("--outdir", default=None)
    parser.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--first-call-latency", action="store_true",
                        help="also time a new layer's first call in fresh processes (~30 s)")
    parser.add_argument("--profile", action="store_true", help="profile the host path of one conv call")
    parser.add_argument("--fp8", action="store_true", help="ResNet-50 in e4m3 against bf16 (fp8.json)")
    parser.add_argument("--freezing", action="store_true",
                        help="compile with Inductor's freezing (weights as constants: BatchNorm folded, "
                             "layouts fixed ahead), for both models")
    args = parser.parse_args()
    if args.freezing:
        import torch._inductor.config
        torch._inductor.config.freezing = True
    if args.first_call:
        return first_call_child()
    common.require_tma_mma_gpu("benchmarks/resnet50.py")
    if args.profile:
        return profile_host_path()
    outdir = common.output_dir(args.outdir)
    if args.fp8:
        return [fp8_comparison(batch, outdir) for batch in args.batch][-1]
    torch.backends.cudnn.benchmark = True
    selection.set_autotune(args.tune)
    tuned = len(selection._load_tuning_file())
    configs = ("autotuned" if args.tune else f"a tuning file of {tuned} shapes, else the heuristic"
               if tuned else "heuristic (no tuning file)")
    print(f"tuning file: {selection.tuning_cache_path()} ({tuned} shapes)")
    rows, layers, totals, native_built = [], [], None, None
    for batch in args.batch:
        reference, cudnn_model, ours_model, fused_model, x = build_models(batch)
        print(f"\nResNet-50, batch {batch}, bf16, channels_last, {common.gpu_name()}; configs: {configs}; "
              f"{fused_model.fused_convs} convs fused")
        for model in (ours_model, fused_model):
            print(f"   first forward of {'ours-fused' if model is fused_model else 'ours'} "
                  f"(compiles what it needs): {check_no_fallback(model, x):.1f} s")
        # (the operator's repeat calls in C++ once built, in the background from the first repeat call: wait for
        # it, so that no variant is timed while it builds, nor some on the Python path and others not)
        if native_built is None:
            native_built = native.ensure()
            print(f"   the operator's C++ kernels: {'built' if native_built else 'not built here: the Python path'}")
        models = {"eager-cudnn": cudnn_model, "compile-cudnn": torch.compile(cudnn_model),
                  "ours": ours_model, "ours-fused": fused_model,
                  "ours-fused-compile": torch.compile(fused_model),
                  "compile-cudnn-cudagraphs": torch.compile(cudnn_model, mode="reduce-overhead"),
                  "ours-fused-compile-cudagraphs": torch.compile(fused_model, mode="reduce-overhead")}
        rows += time_variants(models, x, reference, batch)
        if batch == max(args.batch):
            layers, totals = fused_layer_table(fused_model, x)
        del models, cudnn_model, ours_model, fused_model, x
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    info = common.versions()
    data = {**info, "configs": configs, "freezing": args.freezing, "native_built": native_built, "rows": rows,
            "fused_layers": layers, "fused_layer_totals_ms": totals}
    for batch in args.batch:
        by = {r["variant"]: r for r in rows if r["batch"] == batch}
        best = max(("ours-fused", "ours-fused-compile", "ours-fused-compile-cudagraphs"), key=lambda v: by[v]["img_s"])
        print(f"\nbatch {batch}: best of ours fused = {best} {by[best]['img_s']:.0f} images/s = "
              f"{by[best]['img_s'] / by['compile-cudnn']['img_s']:.2f}x compile-cudnn, "
              f"{by[best]['img_s'] / by['compile-cudnn-cudagraphs']['img_s']:.2f}x compile-cudnn-cudagraphs; "
              f"logits max error {by[best]['logits_max_rel_err']:.2e} against eager-cudnn's "
              f"{by['eager-cudnn']['logits_max_rel_err']:.2e}")
    if args.first_call_latency:
        print("\nfirst call of a new layer (1x1, 14x14, 1024->256, batch 128):")
        data["first_call_latency_s"] = first_call_latencies()
    plot(data, outdir)
    return data


def plot(data, outdir):
    batches = sorted({r["batch"] for r in data["rows"]}, reverse=True)
    fig, axes = common.new_figure(1, len(batches), figsize=(7 * len(batches), 5.5), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = [r for r in data["rows"] if r["batch"] == batch]
        names = [r["variant"] for r in rows]
        bars = ax.bar(range(len(rows)), [r["img_s"] for r in rows],
                      color=["#2060c0" if name.startswith("ours") else "#40a040" for name in names])
        for bar, row in zip(bars, rows):
            ax.text(bar.get_x() + bar.get_width() / 2, row["img_s"], f"{row['img_s']:.0f}",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("images per second (higher is better)")
        ax.set_xlabel("model variant (green: cuDNN convs; blue: lesson 05's)")
        ax.set_title(f"ResNet-50 inference, batch {batch}, bf16", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{data['device']}, torch {data['torch']}, Triton {data['triton']}, cuDNN {data['cudnn']}\n"
                 f"configs: {data['configs']}" + ("; compiled with Inductor's freezing" if data.get("freezing") else ""),
                 fontsize=9)     # (two lines: a one-batch figure is narrow)
    common.save_figure(fig, outdir, "resnet50", data)


if __name__ == "__main__":
    main()
