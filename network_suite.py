"""Lesson 05's network suite: every distinct conv layer of two real networks, ours next to cuDNN.

    python 05-warp-specialized-conv.py --bench --suite networks [--quick]

The nine benchmark shapes of lesson 05 were where its configs were tuned; a network brings layers
nobody tuned for. The suite is
- ResNet-50 (torchvision's v1.5: the stride sits on the 3x3 conv) at batch 128, 224x224 input:
  its 23 distinct convs, the 7x7 stem with 3 input channels, the 1x1 reductions and expansions
  and the stride-2 downsamples included;
- the 3x3 convs of the Stable Diffusion (v1) UNet at batch 8, 64x64 latents: 320/640/1280
  channels at 64/32/16/8 pixels, the decoder's concatenated inputs (e.g. 960 -> 320) and the
  stride-2 downsamplers included. (Its conv_in (4 channels in) and conv_out (4 out) are left out:
  together they are well under 1% of the UNet's conv FLOPs.)
Each layer is checked against torch, then timed as lesson 05's benchmark times: do_bench (median,
L2 flushed before each call, host time included), bf16, ours and cuDNN (channels_last) in
alternating rounds of the same run. Ours is the runtime's call: like the shapes benchmark, each
layer autotuned first (with --heuristic: the heuristic's config, what the PyTorch operator uses
without a tuning file), small-Ci layers folded.

Writes network_suite.json (device, versions, one record per layer: layer, ours_tflops,
cudnn_tflops, ratio, ...) and two plots: the ratio per layer, sorted, and a roofline (arithmetic
intensity against TFLOPS, with the device's datasheet peaks).
"""
import math

import common

import torch

BATCH_RESNET, BATCH_UNET = 128, 8


def resnet50_layers(batch=BATCH_RESNET):
    """(label, N, H, W, Ci, Co, R, S, stride, padding) of every distinct conv of ResNet-50, in
    the order the forward pass meets them."""
    layers = [("RN50 stem 224 3->64 7x7 s2", batch, 224, 224, 3, 64, 7, 7, 2, 3)]
    size, channels = 56, 64                     # after the stem and the 3x3/2 max-pool
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            out = size // stride

            def conv(hw, ci, co, k, s):
                label = f"RN50 {hw}x{hw} {ci}->{co} {k}x{k}" + (f" s{s}" if s > 1 else "")
                return (label, batch, hw, hw, ci, co, k, k, s, k // 2)
            layers += [conv(size, channels, width, 1, 1), conv(size, width, width, 3, stride),
                       conv(out, width, 4 * width, 1, 1)]
            if block == 0:
                layers.append(conv(size, channels, 4 * width, 1, stride))      # the downsample
            channels, size = 4 * width, out
    distinct = {}
    for layer in layers:
        distinct.setdefault(layer[1:], layer)
    return list(distinct.values())


def unet_3x3_layers(batch=BATCH_UNET):
    """The distinct 3x3 convs of the SD v1 UNet's resnet blocks and resamplers (64x64 latents)."""
    shapes = [  # (size, Ci, Co, stride)
        (64, 320, 320, 1), (64, 320, 320, 2), (64, 640, 320, 1), (64, 960, 320, 1), (64, 640, 640, 1),
        (32, 320, 640, 1), (32, 640, 640, 1), (32, 640, 640, 2), (32, 960, 640, 1), (32, 1280, 640, 1),
        (32, 1280, 1280, 1),
        (16, 640, 1280, 1), (16, 1280, 1280, 1), (16, 1280, 1280, 2), (16, 1920, 1280, 1),
        (16, 2560, 1280, 1),
        (8, 1280, 1280, 1), (8, 2560, 1280, 1),
    ]
    return [(f"SD {hw}x{hw} {ci}->{co} 3x3" + (" s2" if s > 1 else ""), batch, hw, hw, ci, co, 3, 3, s, 1)
            for hw, ci, co, s in shapes]


NETWORK_SUITE = resnet50_layers() + unet_3x3_layers()
QUICK_SUITE = [layer for layer in NETWORK_SUITE if layer[0] in (
    "RN50 stem 224 3->64 7x7 s2", "RN50 14x14 256->256 3x3", "RN50 7x7 2048->512 1x1",
    "SD 8x8 1280->1280 3x3")]
# datasheet peaks: dense bf16 TFLOPS and HBM TB/s (SXM parts)
DEVICE_PEAKS = {"H100": (989.4, 3.35), "H200": (989.4, 4.8), "B200": (2250.0, 8.0)}
ROUNDS = 3


def device_peaks(device_name):
    return next((peaks for name, peaks in DEVICE_PEAKS.items() if name in device_name), None)


def minimum_bytes(geometry, element_size=2):
    """Bytes a conv must move at least: its input, its weights and its output, once each."""
    g = geometry
    return element_size * (g.N * g.H * g.W * g.Ci + g.Co * g.R * g.S * g.Ci + g.M * g.Co)


def geometric_mean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def run_network_suite(outdir, quick=False, tune=True, dtype=torch.bfloat16):
    import conv_runtime
    conv_runtime.set_autotune(tune)
    records = []
    for label, N, H, W, Ci, Co, R, S, stride, padding in (QUICK_SUITE if quick else NETWORK_SUITE):
        x_nhwc = torch.randn(N, H, W, Ci, device="cuda", dtype=dtype)
        w = (torch.randn(Co, R, S, Ci, device="cuda", dtype=dtype) / math.sqrt(R * S * Ci)).to(dtype)
        geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
        ours = lambda: conv_runtime.conv2d(x_nhwc, w, None, stride, padding, tune=tune)  # noqa: E731
        cudnn = common.cudnn_conv2d(x_nhwc, w, None, stride, padding)
        fold = conv_runtime.folded_geometry(geometry)
        run_geometry = fold.geometry if fold is not None else geometry
        if tune:
            print(f"\n{label}: {geometry.describe()}{' (folded)' if fold else ''}; autotuning:")
            config = conv_runtime.tuned_config(run_geometry, *(fold.apply(x_nhwc, w) if fold else (x_nhwc, w)),
                                               None, verbose=True, retune=True)
        else:
            config = conv_runtime.known_or_heuristic_config(run_geometry, dtype)
        expected = common.reference_conv2d_nhwc(x_nhwc, w, None, stride, padding)
        common.assert_close_to_reference(ours(), expected, dtype=dtype, K=geometry.K)
        del expected
        timed = common.bench_in_rounds({"ours": ours, "cudnn": cudnn}, geometry.flops, ROUNDS)
        ours_tflops, cudnn_tflops = (timed[k]["tflops"] for k in ("ours", "cudnn"))
        # the kernels alone (CUDA-graph replay: no host time, L2 not flushed), and our host time
        graph = {name: common.bench_tflops(fn, geometry.flops, cuda_graph=True)["tflops"]
                 for name, fn in (("ours", ours), ("cudnn", cudnn))}
        host_us = sorted(conv_runtime.host_us_per_call(ours, calls=100) for _ in range(5))[2]   # median
        records.append({
            "layer": label, "geometry": geometry.describe(), "flops": geometry.flops,
            "min_bytes": minimum_bytes(geometry), "ours_tflops": ours_tflops, "cudnn_tflops": cudnn_tflops,
            "ratio": ours_tflops / cudnn_tflops,
            "ours_rounds": timed["ours"]["rounds"], "cudnn_rounds": timed["cudnn"]["rounds"],
            "config": list(config), "config_text": str(config), "folded": fold is not None,
            "ours_graph_tflops": graph["ours"], "cudnn_graph_tflops": graph["cudnn"],
            "graph_ratio": graph["ours"] / graph["cudnn"], "ours_host_us": host_us,
            "ours_ms": geometry.flops / ours_tflops / 1e9})
        print(f"  {label:<30} ours {ours_tflops:6.1f}  cuDNN {cudnn_tflops:6.1f} TFLOPS  "
              f"{records[-1]['ratio']:5.2f}x   kernels alone {records[-1]['graph_ratio']:5.2f}x   "
              f"host {host_us:4.0f} us   {config}{' (folded)' if fold else ''}")
        del x_nhwc, w
        torch.cuda.empty_cache()
    info = common.versions()
    data = {**info, "dtype": str(dtype), "configs": "autotuned" if tune else "heuristic",
            "geomean_ratio": geometric_mean([r["ratio"] for r in records]),
            "min_ratio": min(r["ratio"] for r in records), "records": records}
    summarize(data)
    plot_network_suite(data, outdir)
    return data


def summarize(data):
    records = data["records"]
    print(f"\nnetwork suite, {data['device']}, torch {data['torch']}, Triton {data['triton']}, "
          f"cuDNN {data['cudnn']}; configs: {data['configs']}")
    for prefix, name in (("RN50", "ResNet-50 (batch 128)"), ("SD", "SD UNet 3x3 (batch 8)")):
        ratios = [r["ratio"] for r in records if r["layer"].startswith(prefix)]
        if ratios:
            print(f"  {name}: geometric mean of ours/cuDNN {geometric_mean(ratios):.3f}x over "
                  f"{len(ratios)} layers, lowest {min(ratios):.2f}x")
    print(f"  all {len(records)} layers: geometric mean {data['geomean_ratio']:.3f}x, lowest "
          f"{data['min_ratio']:.2f}x")
    if all("graph_ratio" in r for r in records):
        graph = [r["graph_ratio"] for r in records]
        print(f"  kernels alone (CUDA-graph replay, no host time): geometric mean {geometric_mean(graph):.3f}x, "
              f"lowest {min(graph):.2f}x")


def show_recorded_suite(outdir):
    """Without a GPU: the latest recorded suite, printed and drawn, marked as recorded."""
    recorded = common.announce_recorded("network_suite", "The network suite")
    if recorded is None:
        return None
    data, info = recorded
    for r in data["records"]:
        alone = f"kernels alone {r['graph_ratio']:5.2f}x   " if "graph_ratio" in r else ""
        print(f"  {r['layer']:<30} ours {r['ours_tflops']:6.1f}  cuDNN {r['cudnn_tflops']:6.1f} TFLOPS  "
              f"{r['ratio']:5.2f}x   {alone}{r['config_text']}{' (folded)' if r['folded'] else ''}")
    summarize(data)
    plot_network_suite(data, outdir, recorded=info)
    return data


def plot_network_suite(data, outdir, recorded=None):
    mark = f"RECORDED {recorded['date']} (not measured on this machine): " if recorded else ""
    suffix = "_recorded" if recorded else ""
    versions = f"{data['device']}, torch {data['torch']}, Triton {data['triton']}, cuDNN {data['cudnn']}"
    records = sorted(data["records"], key=lambda r: r["ratio"])
    fig, ax = common.new_figure(figsize=(9, 0.22 * len(records) + 1.8))
    colors = ["#2060c0" if r["layer"].startswith("RN50") else "#c06020" for r in records]
    ax.barh(range(len(records)), [r["ratio"] for r in records], color=colors)
    ax.set_yticks(range(len(records)), [r["layer"] for r in records], fontsize=7)
    ax.axvline(1.0, color="black", lw=1)
    ax.axvline(data["geomean_ratio"], color="#2060c0", ls="--", lw=1,
               label=f"geometric mean {data['geomean_ratio']:.2f}x")
    ax.plot([], [], color="#2060c0", lw=6, label="ResNet-50 layer (batch 128)")
    ax.plot([], [], color="#c06020", lw=6, label="SD UNet 3x3 layer (batch 8)")
    ax.set_xlabel("ours / cuDNN throughput (same run; > 1: ours faster)")
    ax.set_ylabel("conv layer (input size, Ci->Co, filter, stride)")
    ax.set_title(f"{mark}Lesson 05 against cuDNN on every layer of two networks, bf16\n{versions}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    common.save_figure(fig, outdir, "05_network_suite_ratio" + suffix)
    if not recorded:
        common.save_json(outdir, "network_suite", data)

    fig, ax = common.new_figure(figsize=(8, 5.5))
    intensity = [r["flops"] / r["min_bytes"] for r in data["records"]]
    ax.scatter(intensity, [r["cudnn_tflops"] for r in data["records"]], marker="s", s=22,
               color="#40a040", label="cuDNN")
    ax.scatter(intensity, [r["ours_tflops"] for r in data["records"]], marker="o", s=22,
               color="#2060c0", label="ours (lesson 05)")
    peaks = device_peaks(data["device"])
    if peaks:
        compute, bandwidth = peaks
        xs = [min(intensity) / 2, compute / bandwidth, max(intensity) * 2]
        ax.plot(xs, [min(x * bandwidth, compute) for x in xs], color="red", lw=1,
                label=f"roofline: {compute:.0f} TFLOPS dense bf16, {bandwidth} TB/s HBM (datasheet)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of input + weights + output)")
    ax.set_ylabel("TFLOPS (do_bench median)")
    ax.set_title(f"{mark}Network suite on the roofline, bf16\n{versions}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    common.save_figure(fig, outdir, "05_network_suite_roofline" + suffix)
