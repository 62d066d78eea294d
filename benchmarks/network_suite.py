"""Lesson 05's benchmarks: the ladder of the series on its benchmark shapes, and the network suite,
every distinct conv layer of three real networks, ours next to cuDNN.

    python benchmarks/network_suite.py --ladder [--quick]      # the ladder
    python benchmarks/network_suite.py [--quick]               # the network suite
    python benchmarks/network_suite.py --replay results/h100-2026-11-24/network_suite.json   # its configs again
    python benchmarks/network_suite.py --fp8                   # each layer in e4m3 against bf16

The ladder (`run_ladder`) times, per shape, lesson 02's implicit GEMM, lesson 04, lesson 05
(autotuned, through the runtime) and cuDNN, all in bf16, timed by common.bench_tflops (do_bench:
median, L2 flushed, launch overhead included), lesson 05 and cuDNN in alternating rounds; it writes
05_tflops_per_shape.json and two plots (per shape, and the ladder of the headline shape).

The nine benchmark shapes of lesson 05 were where its configs were tuned; a network brings layers
nobody tuned for. The suite is
- ResNet-50 (torchvision's v1.5: the stride sits on the 3x3 conv) at batch 128, 224x224 input:
  its 23 distinct convs, the 7x7 stem with 3 input channels, the 1x1 reductions and expansions
  and the stride-2 downsamples included;
- the 3x3 convs of the Stable Diffusion (v1) UNet at batch 8, 64x64 latents: 320/640/1280
  channels at 64/32/16/8 pixels, the decoder's concatenated inputs (e.g. 960 -> 320) and the
  stride-2 downsamplers included. (Its conv_in (4 channels in) and conv_out (4 out) are left out:
  together they are well under 1% of the UNet's conv FLOPs.)
- Inception v3 at batch 128, 299x299 input: its 43 distinct convs, read off torchvision's model:
  channel counts that are not multiples of 64 (48, 80, 96, 160, 288), 1x7 and 7x1 filters, 5x5,
  unpadded and stride-2 3x3 convs, the 3-channel stem.
Each layer is checked against torch, then timed as lesson 05's benchmark times: do_bench (median,
L2 flushed before each call, host time included), bf16, ours and cuDNN (channels_last) in
alternating rounds of the same run. Ours is the runtime's call: like the shapes benchmark, each
layer autotuned first (with --heuristic: the heuristic's config, what the PyTorch operator uses
without a tuning file), small-Ci layers folded.

Writes network_suite.json (device, versions, one record per layer: layer, ours_tflops,
cudnn_tflops, ratio, ...) and two plots: the ratio per layer, sorted, and a roofline (arithmetic
intensity against TFLOPS, with the device's datasheet peaks).
"""
import argparse
import json
import math
import statistics
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the lessons' kit, common.py

import common  # noqa: E402
import host_time  # noqa: E402
from layers import BATCH_INCEPTION, HEADLINE, LADDER, QUICK_LABELS, network_suite, quick_suite  # noqa: E402
import torch  # noqa: E402

from conv_tutorial import runtime, selection  # noqa: E402
from conv_tutorial.geometry import quantize_conv_operands  # noqa: E402
from conv_tutorial.configs import KernelConfig  # noqa: E402
from conv_tutorial.kernels import fprop  # noqa: E402

FAMILIES = (("RN50", "ResNet-50 (batch 128)", "#2060c0"), ("SD", "SD UNet 3x3 (batch 8)", "#c06020"),
            ("IncV3", f"Inception v3 (batch {BATCH_INCEPTION})", "#40a040"))


ROUNDS = 3
# the device peaks and the ladder's plot are common.py's (lesson 05 draws the recorded ladder too)
DEVICE_PEAKS, device_peaks, dense_peak, draw_peaks = (common.DEVICE_PEAKS, common.device_peaks, common.dense_peak,
                                                      common.draw_peaks)
POWER_LIMITED_PEAK_TFLOPS, LADDER_SERIES, plot_ladder = (common.POWER_LIMITED_PEAK_TFLOPS, common.LADDER_SERIES,
                                                         common.plot_ladder)


def bench_in_rounds(calls: dict, flops: int, rounds: int) -> dict:
    """Time each of `calls` (name -> function) with bench_tflops in `rounds` alternating rounds:
    every function once per round, in the dict's order.

    Clocks (under the power limit) and cuDNN's own timings drift by several percent within
    minutes; alternating exposes every function to the same drift, where timing one after the
    other would hand the drift to whichever ran last. Returns name -> the median round's
    bench_tflops result, with `rounds`: every round's TFLOPS, in order."""
    results = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            results[name].append(common.bench_tflops(fn, flops))
    return {name: dict(sorted(timed, key=lambda r: r["tflops"])[len(timed) // 2],
                       rounds=[r["tflops"] for r in timed])
            for name, timed in results.items()}


def minimum_bytes(geometry, element_size=2):
    """Bytes a conv must move at least: its input, its weights and its output, once each."""
    g = geometry
    return element_size * (g.N * g.H * g.W * g.Ci + g.Co * g.R * g.S * g.Ci + g.M * g.Co)


def run_network_suite(outdir, quick=False, tune=True, dtype=torch.bfloat16, only=None, keep=None, resume=False,
                      replay=None):
    """Times every layer (or the quick suite's, or those whose labels start with one of `only`,
    e.g. ("IncV3", "RN50 7x7")), writes network_suite.json and the plots. `keep`: an earlier run's
    network_suite.json whose other records are kept, so a long suite can run in parts; with
    `resume`, the layers recorded there are not run again. After each layer the records so far go
    to network_suite.partial.json, which `keep` takes too. `replay`: an earlier run's
    network_suite.json whose config of each layer is used instead of tuning (the same kernels timed
    again, e.g. after a change that must not change them)."""
    import json
    selection.set_autotune(tune)
    records = []
    layers = quick_suite() if quick else network_suite()
    if only:
        layers = [layer for layer in layers if layer[0].startswith(tuple(only))]
    if keep and resume:
        recorded = {r["layer"] for r in json.loads(Path(keep).read_text())["records"]}
        layers = [layer for layer in layers if layer[0] not in recorded]
    partial = Path(outdir) / "network_suite.partial.json"
    replayed = {r["layer"]: r["config"] for r in json.loads(Path(replay).read_text())["records"]} if replay else {}
    if replay:
        layers = [layer for layer in layers if layer[0] in replayed]
    for label, N, H, W, Ci, Co, R, S, stride, padding in layers:
        x_nhwc = torch.randn(N, H, W, Ci, device="cuda", dtype=dtype)
        w = (torch.randn(Co, R, S, Ci, device="cuda", dtype=dtype) / math.sqrt(R * S * Ci)).to(dtype)
        geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
        ours = lambda: runtime.conv2d(x_nhwc, w, None, stride, padding, tune=tune)  # noqa: E731
        cudnn = common.cudnn_conv2d(x_nhwc, w, None, stride, padding)
        fold = runtime.folded_geometry(geometry)
        run_geometry = fold.geometry if fold is not None else geometry
        if replay:
            config = KernelConfig(*replayed[label])
            selection.remember_config(run_geometry, dtype, config)
        elif tune:
            print(f"\n{label}: {geometry.describe()}{' (folded)' if fold else ''}; autotuning:")
            config = selection.tuned_config(run_geometry, *(fold.apply(x_nhwc, w) if fold else (x_nhwc, w)),
                                               None, verbose=True, retune=True)
        else:
            config = selection.known_or_heuristic_config(run_geometry, dtype)
        expected = common.reference_conv2d_nhwc(x_nhwc, w, None, stride, padding)
        common.assert_close_to_reference(ours(), expected, dtype=dtype, K=geometry.K)
        del expected
        timed = bench_in_rounds({"ours": ours, "cudnn": cudnn}, geometry.flops, ROUNDS)
        ours_tflops, cudnn_tflops = (timed[k]["tflops"] for k in ("ours", "cudnn"))
        # the kernels alone (CUDA-graph replay: no host time, L2 not flushed), and our host time
        graph = {name: common.bench_tflops(fn, geometry.flops, cuda_graph=True)["tflops"]
                 for name, fn in (("ours", ours), ("cudnn", cudnn))}
        host_us = sorted(host_time.host_us_per_call(ours, calls=100) for _ in range(5))[2]   # median
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
        partial.write_text(json.dumps({"records": records}, indent=1))
        del x_nhwc, w
        torch.cuda.empty_cache()
    if keep:
        ran = {r["layer"] for r in records}
        kept = [r for r in json.loads(Path(keep).read_text())["records"] if r["layer"] not in ran]
        order = {layer[0]: i for i, layer in enumerate(network_suite())}
        records = sorted(records + kept, key=lambda r: order.get(r["layer"], len(order)))
    info = common.versions()
    data = {**info, "dtype": str(dtype), "configs": f"replayed from {replay}" if replay else
            "autotuned" if tune else "heuristic",
            "geomean_ratio": statistics.geometric_mean([r["ratio"] for r in records]),
            "min_ratio": min(r["ratio"] for r in records), "records": records}
    summarize(data)
    plot_network_suite(data, outdir)
    return data


def summarize(data):
    records = data["records"]
    print(f"\nnetwork suite, {data['device']}, torch {data['torch']}, Triton {data['triton']}, "
          f"cuDNN {data['cudnn']}; configs: {data['configs']}")
    for prefix, name, _ in FAMILIES:
        ratios = [r["ratio"] for r in records if r["layer"].startswith(prefix + " ")]
        if ratios:
            print(f"  {name}: geometric mean of ours/cuDNN {statistics.geometric_mean(ratios):.3f}x over "
                  f"{len(ratios)} layers, lowest {min(ratios):.2f}x")
    print(f"  all {len(records)} layers: geometric mean {data['geomean_ratio']:.3f}x, lowest "
          f"{data['min_ratio']:.2f}x")
    if all("graph_ratio" in r for r in records):
        graph = [r["graph_ratio"] for r in records]
        print(f"  kernels alone (CUDA-graph replay, no host time): geometric mean {statistics.geometric_mean(graph):.3f}x, "
              f"lowest {min(graph):.2f}x")


def show_recorded_suite(outdir, quick=False):
    """Without a GPU: the latest recorded suite, printed (with `quick`, only the quick suite's
    layers) and drawn, marked as recorded."""
    recorded = common.announce_recorded("network_suite", "The network suite")
    if recorded is None:
        return None
    data, info = recorded
    quick_labels = set(QUICK_LABELS)
    for r in data["records"]:
        if quick and r["layer"] not in quick_labels:
            continue
        alone = f"kernels alone {r['graph_ratio']:5.2f}x   " if "graph_ratio" in r else ""
        print(f"  {r['layer']:<30} ours {r['ours_tflops']:6.1f}  cuDNN {r['cudnn_tflops']:6.1f} TFLOPS  "
              f"{r['ratio']:5.2f}x   {alone}{r['config_text']}{' (folded)' if r['folded'] else ''}")
    summarize(data)
    plot_network_suite(data, outdir, recorded=info)
    return data


def plot_network_suite(data, outdir, recorded=None):
    mark = f"RECORDED {recorded['date']} (not measured on this machine): " if recorded else ""
    suffix = "_recorded" if recorded else ""
    versions = (f"{data['device']}, torch {data['torch']}, Triton {data['triton']}, "
                f"cuDNN {common.cudnn_version_text(data['cudnn'])}")
    records = sorted(data["records"], key=lambda r: r["ratio"])
    fig, ax = common.new_figure(figsize=(9, 0.22 * len(records) + 1.8))
    family_color = {prefix: color for prefix, _, color in FAMILIES}
    colors = [family_color[r["layer"].split()[0]] for r in records]
    ax.barh(range(len(records)), [r["ratio"] for r in records], color=colors)
    ax.set_yticks(range(len(records)), [r["layer"] for r in records], fontsize=7)
    ax.set_ylim(-0.7, len(records) - 0.3)
    ax.axvline(1.0, color="black", lw=1)
    ax.axvline(data["geomean_ratio"], color="#2060c0", ls="--", lw=1,
               label=f"geometric mean {data['geomean_ratio']:.2f}x")
    for prefix, name, color in FAMILIES:
        if any(r["layer"].startswith(prefix + " ") for r in records):
            ax.plot([], [], color=color, lw=6, label=f"{name} layer")
    ax.set_xlabel("ours / cuDNN throughput (same run; > 1: ours faster)")
    ax.set_ylabel("conv layer (input size, Ci->Co, filter, stride)")
    whole = {r["layer"] for r in records} >= {layer[0] for layer in network_suite()}
    what = "every conv layer of three networks" if whole else f"{len(records)} layers of the network suite (a part)"
    ax.set_title(f"{mark}Lesson 05 against cuDNN on {what}, bf16\n{versions}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    common.save_figure(fig, outdir, "05_network_suite_ratio" + suffix)
    if not recorded:
        common.save_json(outdir, "network_suite", data)

    fig, ax = common.new_figure(figsize=(8, 6.5))
    intensity = [r["flops"] / r["min_bytes"] for r in data["records"]]
    for x, r in zip(intensity, data["records"]):     # each layer's pair: ours and cuDNN, joined
        ax.plot([x, x], [r["ours_tflops"], r["cudnn_tflops"]], color="#888888", lw=0.8, zorder=1)
    ax.scatter(intensity, [r["cudnn_tflops"] for r in data["records"]], marker="s", s=22,
               color="#40a040", label="cuDNN", zorder=2)
    ax.scatter(intensity, [r["ours_tflops"] for r in data["records"]], marker="o", s=22,
               color="#2060c0", label="ours (lesson 05)", zorder=3)
    # name the layers a reader looks for: the two ends, the stem, and the six where ours trails most
    ends = sorted(range(len(intensity)), key=intensity.__getitem__)
    named = {ends[0], ends[-1]}
    trailing = sorted((i for i, r in enumerate(data["records"]) if r["ratio"] < 1), key=lambda i: data["records"][i]["ratio"])
    named |= set(trailing[:6])
    named |= {i for i, r in enumerate(data["records"]) if "stem" in r["layer"]}
    named = sorted(named, key=intensity.__getitem__)
    peaks = device_peaks(data["device"])
    if peaks:
        compute, bandwidth = peaks
        xs = [min(intensity) / 2, compute / bandwidth, max(intensity) * 2]
        ax.plot(xs, [min(x * bandwidth, compute) for x in xs], color="red", lw=1,
                label=f"roofline: {compute:.0f} TFLOPS dense bf16, {bandwidth} TB/s HBM (datasheet)")
        limited = next((v for k, v in POWER_LIMITED_PEAK_TFLOPS.items() if k in data["device"]), None)
        if limited:
            ax.axhline(limited, color="red", ls=":", lw=1, label=f"peak at the 700 W limit (~1440 MHz, measured): {limited:.0f} TFLOPS")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of input + weights + output, each moved once)")
    ax.set_ylabel("TFLOPS (do_bench median)")
    # the named layers: a number beside each (placed where it hides no point), their names in a key
    number_points(ax, [(intensity[i], min(data["records"][i]["ours_tflops"], data["records"][i]["cudnn_tflops"]))
                       for i in named])
    key = "\n".join(f"{k:>2}  {data['records'][i]['layer']}: {data['records'][i]['ratio']:.2f}x"
                     for k, i in enumerate(named, 1))
    ax.text(1.03, 1.0, f"numbered layers, ours / cuDNN throughput:\n{key}", transform=ax.transAxes, va="top", ha="left",
            fontsize=7.5, family="monospace", linespacing=1.5)
    ax.set_title(f"{mark}\n" * bool(mark) + "Every conv layer of ResNet-50, SD UNet and Inception v3 on the "
                 "roofline, bf16: ours (lesson 05) and cuDNN\n(a grey line joins a layer's two points; numbered: "
                 f"both ends, the stems, the six where ours trails most)\n{versions}", fontsize=8)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2)
    ax.grid(alpha=0.3, which="both")
    common.save_figure(fig, outdir, "05_network_suite_roofline" + suffix)


def number_points(ax, points, fontsize=7):
    """Write 1, 2, ... beside `points` (data coordinates; the axes' limits final): each number
    at the first spot, on rings around its point, that overlaps no point drawn on the axes and
    no number placed before it (a leader line where it had to move away)."""
    ax.autoscale_view()
    to_points = 72 / ax.figure.dpi                     # display pixels -> typographic points
    def at(xy):
        x, y = ax.transData.transform(xy)
        return x * to_points, y * to_points
    drawn = [at(xy) for collection in ax.collections for xy in collection.get_offsets()]
    boxes = [(x - 3, y - 3, x + 3, y + 3) for x, y in drawn]            # the markers, ~6 points wide
    rings = [(r * math.cos(a), r * math.sin(a)) for r in (7, 11, 16, 22, 29, 37, 46)
             for a in [k * math.pi / 6 for k in (1, 5, 7, 11, 0, 6, 3, 9, 2, 4, 8, 10)]]
    for number, xy in enumerate(points, 1):
        x, y = at(xy)
        half_w, half_h = 0.32 * fontsize * len(str(number)) + 1, 0.5 * fontsize + 1
        def box(dx, dy):
            return (x + dx - half_w, y + dy - half_h, x + dx + half_w, y + dy + half_h)
        def free(b):
            return all(b[2] < o[0] or o[2] < b[0] or b[3] < o[1] or o[3] < b[1] for o in boxes)
        dx, dy = next(((dx, dy) for dx, dy in rings if free(box(dx, dy))), rings[-1])
        boxes.append(box(dx, dy))
        ax.annotate(str(number), xy, textcoords="offset points", xytext=(dx, dy), ha="center", va="center",
                    fontsize=fontsize, fontweight="bold", color="#202020",
                    arrowprops=dict(arrowstyle="-", color="#606060", lw=0.6, shrinkA=0, shrinkB=3)
                    if math.hypot(dx, dy) > 12 else None)


# %% The ladder of the series on lesson 05's benchmark shapes ----------------------------------------

def run_ladder(outdir, quick=False, dtype=torch.bfloat16):
    """Lesson 05's `--bench`: per shape, lessons 02, 04 and 05 and cuDNN, printed, drawn, saved."""
    conv2d_fprop = runtime.conv2d          # lesson 05's kernel, autotuned per shape, through the runtime
    lesson02 = common.load_lesson("02-im2col-explicit")
    lesson04 = common.load_lesson("04-implicit-gemm-single-buffer")
    shapes = LADDER[:3] if quick else LADDER
    rows = []
    for label, N, H, W, Ci, Co, R, S, stride, padding in shapes:
        x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, dtype)
        geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
        print(f"\n{label}: {geometry.describe()}; autotuning lesson 05:")
        config = selection.tuned_config(geometry, x_nhwc, w, None, verbose=True, retune=True)
        # Correct before timed: the benchmarked output matches the reference.
        expected = common.reference_conv2d_nhwc(x_nhwc, w, None, stride, padding)
        common.assert_close_to_reference(conv2d_fprop(x_nhwc, w, None, stride, padding), expected,
                                         dtype=dtype, K=geometry.K)
        runs = {
            "02 implicit GEMM": lambda: lesson02.conv2d_implicit_gemm(x_nhwc, w, stride, padding),
            "04 single-buffer": lambda: lesson04.conv2d_tma_im2col(x_nhwc, w, stride, padding),
            "05 warp-specialized": lambda: conv2d_fprop(x_nhwc, w, None, stride, padding),
            "cuDNN": common.cudnn_conv2d(x_nhwc, w, None, stride, padding),
        }
        row = {"shape": label, "geometry": geometry.describe(), "flops": geometry.flops, "config_05": config}
        for name in ("02 implicit GEMM", "04 single-buffer"):
            row[name] = common.bench_tflops(runs[name], geometry.flops)
        # Lesson 05 and cuDNN alternate, ROUNDS times each, and the medians are reported:
        # clocks and cuDNN's own timings drift by several percent within minutes, and alternating
        # exposes both to the same drift. Every round is kept in the JSON.
        row.update(bench_in_rounds({name: runs[name] for name in ("05 warp-specialized", "cuDNN")},
                                          geometry.flops, ROUNDS))
        # Kernel time alone, launch overhead removed (CUDA graph replay), for 05 and cuDNN.
        for name in ("05 warp-specialized", "cuDNN"):
            row[name + " graph"] = common.bench_tflops(runs[name], geometry.flops, cuda_graph=True)
        row["ratio_05_cudnn"] = row["05 warp-specialized"]["tflops"] / row["cuDNN"]["tflops"]
        row["host_us_05"] = host_time.host_us_per_call(lambda: conv2d_fprop(x_nhwc, w, None, stride, padding))
        if not rows:
            row["runtime_us"] = host_time.measure_host_time(x_nhwc, w, stride, padding, config)
            print("   host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in row["runtime_us"].items()))
        rows.append(row)
        del x_nhwc, w, expected
        torch.cuda.empty_cache()
    info = common.versions()
    print(f"\nTFLOPS, {str(dtype)[6:]}, {info['device']}, torch {info['torch']}, triton {info['triton']}, "
          f"cuDNN {info.get('cudnn')}")
    names = LADDER_SERIES
    print("  end to end (do_bench: L2 flushed, launch overhead included); 'graph' columns: kernels "
          "alone (CUDA graph replay)")
    print(f"  {'shape':<30}" + "".join(f"{n.split()[0]:>7}" for n in names)
          + "  05/cuDNN  05 graph cuDNN graph  ratio   host us  05 us   config")
    for row in rows:
        graph_ratio = row["05 warp-specialized graph"]["tflops"] / row["cuDNN graph"]["tflops"]
        row["ratio_05_cudnn_graph"] = graph_ratio
        print(f"  {row['shape']:<30}" + "".join(f"{row[n]['tflops']:7.1f}" for n in names)
              + f"  {row['ratio_05_cudnn']:7.2f}x {row['05 warp-specialized graph']['tflops']:8.1f}"
              f" {row['cuDNN graph']['tflops']:11.1f} {graph_ratio:6.2f}x {row['host_us_05']:8.1f}"
              f" {row['05 warp-specialized']['ms'] * 1e3:6.1f}   {row['config_05']}")
    print(f"  the {ROUNDS} alternating rounds behind the 05 and cuDNN medians (TFLOPS):")
    for row in rows:
        print(f"  {row['shape']:<30} 05: " + " ".join(f"{t:6.1f}" for t in row["05 warp-specialized"]["rounds"])
              + "   cuDNN: " + " ".join(f"{t:6.1f}" for t in row["cuDNN"]["rounds"]))
    three_by_three = [r["ratio_05_cudnn"] for r in rows if "3x3" in r["shape"]]
    geomean = statistics.geometric_mean(three_by_three)
    print(f"  geometric mean of 05/cuDNN over the {len(three_by_three)} 3x3 shapes: {geomean:.3f}x")
    data = {"rows": rows, "geomean_3x3_ratio": geomean, "dtype": str(dtype), **info}
    plot_ladder(rows, info, dtype, outdir, data)
    return rows, geomean


# fp8 (lesson 05, section 9): each layer in e4m3 against our bf16 and cuDNN's bf16 -----------------------

FP8_CANDIDATES = [KernelConfig(256, 128, 64, 3, 8), KernelConfig(128, 256, 64, 3, 8),
                  KernelConfig(128, 128, 64, 6, 8), KernelConfig(128, 128, 64, 4, 4), KernelConfig(256, 64, 64, 4, 8)]


def run_fp8_suite(outdir, only=None, keep=None):
    """The headline shape and every suite layer (or those whose labels start with one of `only`)
    in e4m3 (x per tensor, w per output channel, bf16 out) and in bf16, each with the fastest of
    the same FP8_CANDIDATES, and cuDNN in bf16: kernels alone (CUDA-graph replay), and each
    output's largest error against torch's fp32 conv of the unquantized operands, relative to the
    output's largest magnitude. Writes fp8.json (its "layers", and what `keep`, an earlier
    fp8.json, holds of other layers and of ResNet-50) and prints the geometric means."""
    arch = "sm_90" if common.is_hopper() else "sm_100"
    candidates = [c for c in FP8_CANDIDATES if arch == "sm_90" or c.block_m == 128]
    layers = [layer for layer in (HEADLINE,) + tuple(network_suite())
              if not only or layer[0].startswith(tuple(only))]
    kept = json.loads(Path(keep).read_text()) if keep else {}
    records = [r for r in kept.get("layers", []) if r["layer"] not in {layer[0] for layer in layers}]
    for label, N, H, W, Ci, Co, R, S, stride, padding in layers:
        x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16, device_name="cuda")
        x_q, x_scale, w_q, w_scale = quantize_conv_operands(x, w)
        dequantize = x_scale * w_scale        # the epilogue's per-channel scale (lesson 05, section 9)
        flops = common.conv_geometry(x.shape, w.shape, stride, padding).flops
        runs = {"fp8": lambda c: lambda: fprop.conv2d_fprop_launch(x_q, w_q, None, stride, padding, config=c,
                                                                      scale=dequantize),
                "bf16": lambda c: lambda: fprop.conv2d_fprop_launch(x, w, None, stride, padding, config=c)}
        best = {}
        for name, make in runs.items():
            timed = [(common.bench_tflops(make(c), flops, cuda_graph=True)["tflops"], c) for c in candidates]
            best[name] = max(timed, key=lambda t: t[0])
        cudnn = common.bench_tflops(common.cudnn_conv2d(x, w, None, stride, padding), flops, cuda_graph=True)["tflops"]
        exact = common.reference_conv2d_nhwc(x.float(), w.float(), None, stride, padding)
        error = {name: ((make(best[name][1])().float() - exact).abs().max() / exact.abs().max()).item()
                 for name, make in runs.items()}
        records.append({"layer": label, "fp8_tflops": best["fp8"][0], "bf16_tflops": best["bf16"][0],
                        "cudnn_bf16_tflops": cudnn, "max_rel_err": error["fp8"], "bf16_max_rel_err": error["bf16"],
                        "fp8_config": str(best["fp8"][1]), "bf16_config": str(best["bf16"][1])})
        r = records[-1]
        print(f"  {label:<30} fp8 {r['fp8_tflops']:6.1f}  bf16 {r['bf16_tflops']:6.1f}  cuDNN bf16 {cudnn:6.1f} TFLOPS"
              f"  fp8/bf16 {r['fp8_tflops'] / r['bf16_tflops']:4.2f}x  fp8/cuDNN {r['fp8_tflops'] / cudnn:4.2f}x"
              f"  error fp8 {r['max_rel_err']:.1e} bf16 {r['bf16_max_rel_err']:.1e}", flush=True)
        del x, w, x_q, w_q
        torch.cuda.empty_cache()
    info = common.versions()
    order = [layer[0] for layer in (HEADLINE,) + tuple(network_suite())]
    records.sort(key=lambda r: order.index(r["layer"]))
    data = {**kept, **info, "timing": "kernels alone (CUDA-graph replay), each precision the fastest of the same "
                                      "candidate configs", "layers": records}
    suite = [r for r in records if r["layer"] != HEADLINE[0]]
    print(f"\nfp8 over {len(suite)} suite layers, {info['device']}: fp8 / our bf16 geometric mean "
          f"{statistics.geometric_mean([r['fp8_tflops'] / r['bf16_tflops'] for r in suite]):.3f}x, fp8 / cuDNN bf16 "
          f"{statistics.geometric_mean([r['fp8_tflops'] / r['cudnn_bf16_tflops'] for r in suite]):.3f}x")
    common.save_json(outdir, "fp8", data)
    return data


def main():
    parser = argparse.ArgumentParser(description="The network suite, in parts: some layers now, the "
                                                 "others' records kept from an earlier run's JSON.")
    parser.add_argument("--only", nargs="+", metavar="PREFIX",
                        help='the layers whose labels start with one of these ("IncV3", "RN50 7x7", ...)')
    parser.add_argument("--keep", help="an earlier network_suite.json: its records of the other layers are kept")
    parser.add_argument("--resume", action="store_true", help="with --keep: only the layers it has no record of")
    parser.add_argument("--heuristic", action="store_true", help="the heuristic's configs instead of autotuning")
    parser.add_argument("--replay", help="an earlier network_suite.json: each of its layers with the config it "
                                         "recorded, no tuning (the same kernels timed again)")
    parser.add_argument("--outdir", default=None)
    parser.add_argument("--fp8", action="store_true", help="each layer in e4m3 against bf16 (ours and cuDNN's)")
    parser.add_argument("--ladder", action="store_true", help="the ladder of lessons 02, 04, 05 and cuDNN on the "
                                                              "benchmark shapes instead of the network suite")
    parser.add_argument("--quick", action="store_true", help="fewer layers, for a fast look")
    args = parser.parse_args()
    common.require_tma_mma_gpu("the network suite")
    if args.ladder:
        return run_ladder(common.output_dir(args.outdir), quick=args.quick)
    if args.fp8:
        return run_fp8_suite(common.output_dir(args.outdir), only=args.only, keep=args.keep)
    run_network_suite(common.output_dir(args.outdir), quick=args.quick, tune=not args.heuristic, only=args.only,
                      keep=args.keep, resume=args.resume, replay=args.replay)


if __name__ == "__main__":
    main()
