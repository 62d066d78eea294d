"""BatchNorm's batch statistics from the forward conv's epilogue, per layer: what the fusion saves.

    python benchmarks/channel_stats.py [--outdir out] [--batch 128] [--layers TEXT ...]

For every distinct conv of ResNet-50 (layers.resnet50_layers) at batch 128 in bf16, four
ways to a conv's output and its per-channel sum and sum of squares (what BatchNorm's training
mode needs), each replayed in a CUDA graph (common.bench_tflops with cuda_graph=True: kernels
alone, no host time), all in one run:
  ours           the operator's runtime (lesson 05's kernel), no statistics: the floor
  ours+stats     the same kernel with channel_stats: the epilogue adds the sums (lesson 08)
                 into one fp32 [2, Co] tensor, zeroed before each call (timed)
  ours+reduce    ours, then the sums by a torch.compile'd reduction over the output (what Inductor
                 does in a training graph without the fusion)
  cuDNN+reduce   F.conv2d on channels_last (cuDNN), then the same reduction
The fusion pays where ours+stats is faster than ours+reduce. The sums are checked against torch
first. Writes channel_stats.json (device, versions, one record per layer, microseconds) to --outdir.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from layers import resnet50_layers  # noqa: E402
import torch  # noqa: E402

WAYS = ("ours", "ours+stats", "ours+reduce", "cuDNN+reduce")


def layer_times(layer, reduce):
    from conv_tutorial import runtime
    label, N, H, W, Ci, Co, R, S, stride, padding = layer
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16)
    sums = torch.zeros(2, Co, device=x.device)

    def ours():
        return runtime.conv2d(x, w, None, stride, padding, tune=False)

    def ours_stats():
        sums.zero_()
        return runtime.conv2d(x, w, None, stride, padding, tune=False, channel_stats=sums), sums
    cudnn = common.cudnn_conv2d(x, w, None, stride, padding)
    _, stats = ours_stats()
    y = ours().reshape(-1, Co).float()
    expected = runtime.channel_sums(y)
    # the epilogue sums the output as stored, torch the same output: fp32's rounding in the adds, far under
    # 2^-8 of each |y|
    if not ((stats - expected).abs() <= 1e-2 * torch.stack((y.abs().sum(0), expected[1]))).all():
        raise AssertionError(f"{label}: the epilogue's sums differ from torch's")
    calls = {"ours": ours, "ours+stats": ours_stats, "ours+reduce": lambda: reduce(ours()),
             "cuDNN+reduce": lambda: reduce(cudnn().permute(0, 2, 3, 1))}
    flops = common.conv_geometry(x.shape, w.shape, stride, padding).flops
    row = {"layer": label, **{name: common.bench_tflops(call, flops, cuda_graph=True)["ms"] * 1e3
                              for name, call in calls.items()}}
    print(f"   {label:<28}" + "".join(f"  {name} {row[name]:7.1f} us" for name in WAYS)
          + f"   saved {row['ours+reduce'] - row['ours+stats']:6.1f} us", flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outdir", default=None)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--layers", nargs="+", default=None, help="only layers whose label holds one of these")
    args = parser.parse_args(argv)
    common.require_tma_mma_gpu("benchmarks/channel_stats.py")
    layers = resnet50_layers(args.batch)
    if args.layers:
        layers = [layer for layer in layers if any(text in layer[0] for text in args.layers)]
    from conv_tutorial import runtime
    reduce = torch.compile(runtime.channel_sums)
    print(f"microseconds per call (CUDA graphs), bf16, batch {args.batch}, {common.gpu_name()}:")
    rows = [layer_times(layer, reduce) for layer in layers]
    total = {name: sum(row[name] for row in rows) for name in WAYS}
    ratio = statistics.geometric_mean([row["ours+reduce"] / row["ours+stats"] for row in rows])
    print(f"   total over the layers: " + ", ".join(f"{name} {us:.0f} us" for name, us in total.items())
          + f"; ours+reduce / ours+stats, geometric mean {ratio:.3f}")
    common.save_json(common.output_dir(args.outdir), "channel_stats",
                     {**common.versions(), "batch": args.batch, "unit": "us", "rows": rows, "total_us": total,
                      "reduce_over_fused_geomean": ratio})
    return rows


if __name__ == "__main__":
    main()
