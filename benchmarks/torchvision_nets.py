"""Whole torchvision classification networks: lesson 05's fused convs against the strongest torch.compile.

    python benchmarks/torchvision_nets.py [--nets resnet50 ...] [--batch 128 1] [--outdir out] [--merge]
    python benchmarks/torchvision_nets.py --layers [--nets efficientnet_b0 ...] [--batch 128]

Each network is torchvision's (random weights; BatchNorm statistics set as a trained model has them,
not the identity; eval mode; bf16; channels_last; 224x224 random images). Three variants, each in
its own process, at every batch size:
  cudnn-eager               the model as PyTorch runs it: cuDNN convs, BatchNorm and the rest apart
  cudnn-freeze-cudagraphs   torch.compile(mode="reduce-overhead") with Inductor's freezing
                            (torch._inductor.config.freezing = True): BatchNorm folded into cuDNN's
                            convs, what follows them fused by Inductor, CUDA graphs. The strongest
                            model a user can get without leaving PyTorch.
  ours-fused-cudagraphs     fusion.fuse_conv_bn_act, fusion.keep_faster_convs at this
                            batch, then the same torch.compile with freezing: each conv the passes
                            take is one call of lesson 05's kernel (or, for a depthwise conv,
                            conv_tutorial.depthwise's) with BatchNorm, residual add and activation in its
                            epilogue; Inductor does everything else, including the grouped convs
                            none of ours runs and those where cuDNN measured faster.
The three processes of a network compile at the same time; each is then timed with nothing else
on the GPU (ours first decides, alone on the GPU, which convs torch keeps). Images/s are do_bench
medians of a whole forward pass; the logits' error is max |error| / max
|reference| against the fp32 model run eagerly with TF32 off. Writes torchvision_nets.json
({"device", "torch", "triton", "rows": [{"net", "batch", "variant", "img_s", "logits_max_rel_err"}]})
and torchvision_nets.png to the output folder; `--merge` keeps the rows of networks not measured now.

`--layers`: every distinct conv of each network's fused model, timed alone next to cuDNN's conv of
the same weights (F.conv2d, channels_last), both replayed in a CUDA graph as the network runs
them (kernels alone, L2 as the graph leaves it). Depthwise convs are judged in GB/s of their
compulsory traffic (input, weights and output once) against the HBM bandwidth; the others in
TFLOPS. Writes torchvision_layers.json. Needs a Hopper (or data-centre Blackwell) GPU.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from conv_tutorial import fusion  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

# name -> family; dense families are those whose convs all have groups=1
NETS = {"resnet50": "ResNet", "wide_resnet50_2": "wide ResNet", "vgg16_bn": "VGG-BN",
        "resnext50_32x4d": "ResNeXt", "regnet_x_3_2gf": "RegNet", "efficientnet_b0": "EfficientNet",
        "mobilenet_v3_large": "MobileNet", "convnext_tiny": "ConvNeXt"}
DENSE = ("resnet50", "wide_resnet50_2", "vgg16_bn")
VARIANTS = ("cudnn-eager", "cudnn-freeze-cudagraphs", "ours-fused-cudagraphs")


def trained_like_batchnorm(model, seed=0):
    """Give every BatchNorm statistics and affine terms as a trained model has them (fresh ones are
    mean 0, variance 1, weight 1, bias 0: folding them would be a no-op and a weak test)."""
    generator = torch.Generator().manual_seed(seed)
    for bn in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        for tensor, low, high in ((bn.running_mean, -0.2, 0.2), (bn.running_var, 0.5, 2.0),
                                  (bn.weight, 0.5, 1.5), (bn.bias, -0.2, 0.2)):
            tensor.data.copy_(torch.rand(tensor.shape, generator=generator) * (high - low) + low)
    return model


def fp32_model(net):
    """torchvision's `net` with seeded random weights and trained-like BatchNorms, fp32, eval, on the GPU."""
    import torchvision
    torch.manual_seed(0)
    return trained_like_batchnorm(torchvision.models.get_model(net, weights=None)).eval().cuda()


def images(batch, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(batch, 3, 224, 224, device="cuda", generator=generator)


def fp32_reference(model, x32):
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        torch.backends.cuda.matmul.allow_tf32 = False
        return model(x32).float()


BF16 = dict(dtype=torch.bfloat16, memory_format=torch.channels_last)


def variant_model(variant, fp32, x32):
    """The model `variant` runs (compiled lazily by its first call); for ours, also the passes' counts."""
    import copy
    if variant == "ours-fused-cudagraphs":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")        # the kept convs' warning: counted below instead
            # folded from the fp32 model (the arithmetic in fp32), then cast: as a user would deploy it
            fused = fusion.fuse_conv_bn_act(fp32, example_input=x32[:1]).to(**BF16)
        # each fused conv timed at this batch against cuDNN + an elementwise pass: torch keeps the faster
        fused = fusion.keep_faster_convs(fused, x32.to(**BF16))
        info = {"fused_convs": fused.fused_convs - fused.torch_convs, "kept_convs": fused.kept_convs,
                "given_back_convs": fused.torch_convs}
        return torch.compile(fused, mode="reduce-overhead", dynamic=False), info
    model = copy.deepcopy(fp32).to(**BF16)
    if variant == "cudnn-eager":
        return model, {}
    return torch.compile(model, mode="reduce-overhead", dynamic=False), {}


def child(net, variant, batches, json_path):
    """One network in one variant, every batch size, in this (fresh) process, in three steps the
    parent paces through stdin/stdout so that nothing else runs on the GPU while it is timed:
    ours decides which convs torch keeps (keep_faster_convs times layers: DECIDED), every variant
    compiles and records its CUDA graphs (READY; the processes of one network do this at the same
    time), then on GO each process in turn times its forward passes."""
    import torch._inductor.config
    torch._inductor.config.freezing = True
    fp32, prepared = fp32_model(net), []
    for batch in batches:
        x32 = images(batch)
        prepared.append((batch, fp32_reference(fp32, x32), *variant_model(variant, fp32, x32), x32.to(**BF16)))
    print("DECIDED", flush=True)
    warmed = []
    for batch, reference, model, info, x in prepared:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            out = model(x)                       # compiles, for the compiled variants
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - start
            for _ in range(3):                   # CUDA graphs record on their first calls
                out = model(x).clone()
        fallbacks = sorted({str(w.message) for w in caught if "conv_tutorial::conv2d" in str(w.message)})
        if fallbacks:                            # a conv sent to torch would be cuDNN measured as ours
            raise RuntimeError(f"{net}: convs fell back to torch: {fallbacks}")
        error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
        warmed.append((batch, model, info, x, error, first_call_s))
    print("READY", flush=True)
    sys.stdin.readline()                         # GO: the GPU is ours alone
    rows = []
    for batch, model, info, x, error, first_call_s in warmed:
        with torch.no_grad():
            ms = triton.testing.do_bench(lambda: model(x), warmup=25, rep=300 if batch >= 32 else 150)
        rows.append({"net": net, "batch": batch, "variant": variant, "img_s": batch / ms * 1e3, "ms": ms,
                     "logits_max_rel_err": error, "first_call_s": first_call_s, **info})
        print(f"{net:<20} batch {batch:<4} {variant:<24} {rows[-1]['img_s']:9.0f} images/s "
              f"({ms:.3f} ms; first call {first_call_s:.0f} s) logits max rel. err {error:.1e}"
              + (f"; convs ours {info['fused_convs']}, kept for torch {info['kept_convs']} (grouped) + "
                 f"{info['given_back_convs']} (torch faster)" if info else ""), flush=True)
    Path(json_path).write_text(json.dumps(rows))


def expect(proc, word):
    """Read the child's stdout up to the line `word` (printing what comes before); False if it died."""
    for line in proc.stdout:
        if line.strip() == word:
            return True
        print(line, end="", flush=True)
    return False


def measure_network(net, batches, folder):
    """The three variants of one network: rows, failures."""
    procs = {}

    def start(variant):     # (stderr to a file: a full pipe would stall the child)
        procs[variant] = subprocess.Popen(
            [sys.executable, __file__, "--child", net, variant, "--json", str(Path(folder) / f"{net}-{variant}.json"),
             "--batch", *map(str, batches)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(Path(folder) / f"{net}-{variant}.err", "w"), text=True)
    start("ours-fused-cudagraphs")               # its per-layer timings run alone on the GPU
    alive = {"ours-fused-cudagraphs": expect(procs["ours-fused-cudagraphs"], "DECIDED")}
    for variant in VARIANTS[:2]:
        start(variant)
    for variant in VARIANTS:                     # all compile at once
        alive[variant] = alive.get(variant, True) and expect(procs[variant], "READY")
    rows, failures = [], []
    for variant in VARIANTS:                     # then each times its passes alone
        proc = procs[variant]
        if alive[variant]:
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        out = proc.communicate(timeout=900)[0]
        print(out, end="", flush=True)
        err = (Path(folder) / f"{net}-{variant}.err").read_text()
        json_path = Path(folder) / f"{net}-{variant}.json"
        if proc.returncode != 0 or not json_path.exists():
            print(f"{net} {variant} failed:\n{err[-2000:]}", flush=True)
            failures.append({"net": net, "variant": variant, "error": err[-2000:]})
        else:
            rows += json.loads(json_path.read_text())
    return rows, failures


def measure_networks(nets, batches, outdir, merge):
    path = Path(outdir) / "torchvision_nets.json"
    data = {**common.versions(), "rows": [], "failures": []}
    if merge and path.exists():
        kept = json.loads(path.read_text())
        data["rows"] = [r for r in kept["rows"] if r["net"] not in nets]
        data["failures"] = [f for f in kept.get("failures", []) if f["net"] not in nets]
    data["settings"] = ("torchvision models, random weights, trained-like BatchNorm statistics, eval, bf16, "
                        "channels_last, 224x224; Inductor freezing on for both compiled variants; "
                        "torch.compile(mode='reduce-overhead', dynamic=False); do_bench median, each "
                        "process timed alone on the GPU")
    with tempfile.TemporaryDirectory() as folder:
        for net in nets:
            rows, failures = measure_network(net, batches, folder)
            data["rows"] += rows
            data["failures"] += failures
            data["ratios"] = ratios(data["rows"])
            common.save_json(outdir, "torchvision_nets", data)     # after each network: a long run keeps what it has
    summary = data["ratios"] = ratios(data["rows"])
    print("\nours-fused-cudagraphs / cudnn-freeze-cudagraphs (images/s):")
    for row in summary:
        print(f"   {row['net']:<20} batch {row['batch']:<4} {row['ratio']:.3f}x   (/ cudnn-eager "
              f"{row['ratio_to_eager']:.2f}x)")
    plot(data, outdir)
    return data


def ratios(rows):
    by = {(r["net"], r["batch"], r["variant"]): r["img_s"] for r in rows}
    return [{"net": net, "batch": batch, "ratio": by[(net, batch, "ours-fused-cudagraphs")] / by[(net, batch, v)],
             "ratio_to_eager": by[(net, batch, "ours-fused-cudagraphs")] / by[(net, batch, "cudnn-eager")]}
            for (net, batch, v) in sorted(by) if v == "cudnn-freeze-cudagraphs"
            and (net, batch, "ours-fused-cudagraphs") in by and (net, batch, "cudnn-eager") in by]


def plot(data, outdir):
    summary = data["ratios"]
    batches = sorted({r["batch"] for r in summary}, reverse=True)
    nets = [n for n in NETS if any(r["net"] == n for r in summary)]
    if not nets:
        return
    fig, ax = common.new_figure(figsize=(11, 5))
    width = 0.8 / len(batches)
    for i, batch in enumerate(batches):
        by = {r["net"]: r["ratio"] for r in summary if r["batch"] == batch}
        xs = [k + (i - (len(batches) - 1) / 2) * width for k, net in enumerate(nets) if net in by]
        values = [by[net] for net in nets if net in by]
        bars = ax.bar(xs, values, width, label=f"batch {batch}")
        for bar, value in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.3, color="gray", linewidth=0.8, linestyle="--", label="1.3x (the dense families' target)")
    ax.set_xticks(range(len(nets)), [f"{net}\n({NETS[net]})" for net in nets], fontsize=8)
    ax.set_ylabel("images/s of ours / images/s of torch.compile\n(freezing + CUDA graphs, cuDNN convs)")
    ax.set_xlabel("torchvision network (family)")
    ax.set_title("Whole-network inference, bf16: lesson 05's fused convs against the strongest torch.compile "
                 "(above 1: ours faster)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{data['device']}, torch {data['torch']}, Triton {data['triton']}, cuDNN {data.get('cudnn')}",
                 fontsize=9)
    common.save_figure(fig, outdir, "torchvision_nets")


def layer_table(net, batch):
    """Every distinct conv of `net`'s fused model alone, ours (or torch's, if kept) next to cuDNN's."""
    fp32 = fp32_model(net)
    x32 = images(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = fusion.fuse_conv_bn_act(fp32, example_input=x32[:1]).to(**BF16)
    layers = {}
    for _, module, inputs in fusion.module_calls(fused, x32.to(**BF16), (fusion.FusedConv2d, torch.nn.Conv2d)):
        if isinstance(module, fusion.FusedConv2d):   # (the conv as torch runs it: merged groups apart)
            stride, padding, dilation, groups = fusion.TorchConvEpilogue(module)._op_args
            extra = (module.takes_residual, module.activation)
        else:
            stride, padding, dilation, groups = module.stride, module.padding, module.dilation, module.groups
            extra = ("kept",)
        key = (tuple(inputs[0].shape), (module.weight.shape[0], inputs[0].shape[1] // groups, *module.weight.shape[2:]),
               tuple(stride), tuple(padding), groups, *extra)
        layers.setdefault(key, [module, inputs, 0])[2] += 1
    rows = []
    for (shape, w_shape, stride, padding, groups, *extra), (module, inputs, count) in layers.items():
        ours = isinstance(module, fusion.FusedConv2d)
        weight = (fusion.TorchConvEpilogue(module) if ours else module).weight.detach()
        dilation = module._op_args[2] if ours else module.dilation
        with torch.no_grad():
            out = module(*inputs)
            ours_ms = triton.testing.do_bench_cudagraph(lambda: module(*inputs))
            cudnn_ms = triton.testing.do_bench_cudagraph(
                lambda: torch.nn.functional.conv2d(inputs[0], weight, None, stride, padding, dilation, groups))
        depthwise = groups == shape[1] == w_shape[0] and w_shape[1] == 1
        kind = "depthwise" if depthwise else "kept (torch)" if extra == ["kept"] else "grouped" if groups > 1 \
            else "dense"
        traffic = inputs[0].numel() * 2 + weight.numel() * 2 + out.numel() * 2
        flops = 2 * out.numel() * w_shape[1] * w_shape[2] * w_shape[3]
        label = (f"{shape[2]}x{shape[3]} {shape[1]}->{w_shape[0]} {w_shape[2]}x{w_shape[3]}"
                 + (f" s{stride[0]}" if stride[0] > 1 else "") + (f" g{groups}" if groups > 1 else ""))
        rows.append({"net": net, "batch": batch, "layer": label, "kind": kind, "count": count,
                     "ours_ms": ours_ms, "cudnn_ms": cudnn_ms, "ratio": cudnn_ms / ours_ms,
                     "ours_gb_s": traffic / ours_ms / 1e6, "cudnn_gb_s": traffic / cudnn_ms / 1e6,
                     "ours_tflops": flops / ours_ms / 1e9, "cudnn_tflops": flops / cudnn_ms / 1e9})
    return rows


def measure_layers(nets, batches, outdir):
    import network_suite
    peaks = network_suite.device_peaks(common.gpu_name())     # (TFLOPS, TB/s) from the datasheet
    hbm = peaks[1] * 1e12 if peaks else None
    data = {**common.versions(), "hbm_bytes_per_s": hbm, "rows": []}
    for net in nets:
        for batch in batches:
            rows = layer_table(net, batch)
            data["rows"] += rows
            print(f"\n{net}, batch {batch}: each distinct conv alone, CUDA-graph replay (ms; ratio = cuDNN / ours)")
            print(f"   {'layer':<30} {'kind':<12} {'count':>5} {'ours':>8} {'cuDNN':>8} {'ratio':>6} "
                  f"{'ours GB/s':>9} {'cuDNN GB/s':>10} {'ours TF':>8} {'cuDNN TF':>8}")
            for r in sorted(rows, key=lambda r: -r["ours_ms"] * r["count"]):
                print(f"   {r['layer']:<30} {r['kind']:<12} {r['count']:5d} {r['ours_ms']:8.4f} {r['cudnn_ms']:8.4f} "
                      f"{r['ratio']:6.2f} {r['ours_gb_s']:9.0f} {r['cudnn_gb_s']:10.0f} {r['ours_tflops']:8.1f} "
                      f"{r['cudnn_tflops']:8.1f}")
            for kind in sorted({r["kind"] for r in rows}):
                sel = [r for r in rows if r["kind"] == kind]
                ours, cudnn = (sum(r[k] * r["count"] for r in sel) for k in ("ours_ms", "cudnn_ms"))
                print(f"   {kind}: {len(sel)} distinct, summed over the pass ours {ours:.3f} ms, cuDNN {cudnn:.3f} ms "
                      f"= {cudnn / ours:.2f}x")
    if hbm:
        print(f"\nHBM bandwidth of this GPU: {hbm / 1e9:.0f} GB/s")
    common.save_json(outdir, "torchvision_layers", data)
    return data


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nets", nargs="+", default=list(NETS), choices=list(NETS), metavar="NET",
                        help=f"networks to measure, of {list(NETS)} (default: all)")
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 1])
    parser.add_argument("--outdir", default=None)
    parser.add_argument("--merge", action="store_true", help="keep the rows of other networks already in the JSON")
    parser.add_argument("--layers", action="store_true", help="per-layer table instead of whole networks")
    parser.add_argument("--child", nargs=2, metavar=("NET", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    common.require_tma_mma_gpu("benchmarks/torchvision_nets.py")
    if args.child:
        return child(*args.child, args.batch, args.json)
    outdir = common.output_dir(args.outdir)
    if args.layers:
        return measure_layers(args.nets, args.batch, outdir)
    return measure_networks(args.nets, args.batch, outdir, args.merge)


if __name__ == "__main__":
    main()
