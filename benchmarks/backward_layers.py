"""Lesson 06's backward on ResNet-50's convs: dgrad and wgrad per layer, ours against cuDNN.

    python benchmarks/backward_layers.py [--outdir out] [--batch 128] [--quick] [--zero-insertion] [--cuda-graphs]
                                         [--cudnn-benchmark]

For every distinct conv of ResNet-50 (network_suite.resnet50_layers: torchvision's v1.5, the stem,
the 1x1s and the stride-2 layers included) at batch 128 in bf16, lesson 06's `bench_backward`:
dgrad (conv2d_dgrad_launch: lesson 05's kernel per output phase) and wgrad (conv2d_wgrad_launch)
are each checked against torch.nn.grad first, then timed next to cuDNN (aten.convolution_backward,
as autograd calls it, on the channels_last tensors of the same dtype) with common.bench_tflops: do_bench's
median, L2 flushed before every call, launch and host time included. TFLOPS count the forward
pass's useful FLOPs, 2*N*out_h*out_w*Co*Ci*R*S, for both gradients. --zero-insertion also times
the strided layers' dgrad as one stride-1 conv over dY with zeros inserted (lesson 06, section 2).
--quick: lesson 06's three --bench layers only. --cudnn-benchmark: cuDNN picks its algorithms by
timing them (torch.backends.cudnn.benchmark; off by default, as network_suite.py times cuDNN).

Prints one line per layer and the geometric mean of ours / cuDNN for each gradient; writes
backward_layers.json (device, versions, one record per layer) to --outdir (default ./out).
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the lessons' kit, common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import network_suite  # noqa: E402
import torch  # noqa: E402


def geometric_mean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outdir", default=None, help="folder for backward_layers.json (default ./out)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="lesson 06's three --bench layers only")
    parser.add_argument("--zero-insertion", action="store_true",
                        help="also time dgrad of the strided layers as one conv over zero-inserted dY")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay each call in a CUDA graph (common.bench_tflops(cuda_graph=True)): kernels "
                             "alone, no host time, L2 not flushed")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its algorithms per shape (torch.backends.cudnn.benchmark) first")
    args = parser.parse_args(argv)
    common.require_tma_mma_gpu("benchmarks/backward_layers.py")
    lesson06 = common.load_lesson("06-conv-backward")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    layers = lesson06.BENCH_LAYERS if args.quick else network_suite.resnet50_layers(args.batch)
    how = "do_bench_cudagraph medians, kernels alone" if args.cuda_graphs else "do_bench medians, host time included"
    print(f"dgrad and wgrad, bf16, {common.gpu_name()}, TFLOPS of useful FLOPs ({how}):")
    rows = [lesson06.bench_backward(*layer, zero_insertion=args.zero_insertion, cuda_graph=args.cuda_graphs)
            for layer in layers]
    summary = {kind: geometric_mean([row[kind]["tflops"] / row[f"{kind} cuDNN"]["tflops"] for row in rows])
               for kind in ("dgrad", "wgrad")}
    print("geometric mean over the layers, ours / cuDNN: " + ", ".join(f"{k} {v:.2f}x" for k, v in summary.items()))
    common.save_json(common.output_dir(args.outdir), "backward_layers",
                     {**common.versions(), "dtype": "bfloat16", "batch": args.batch, "summary": summary,
                      "cudnn_benchmark": args.cudnn_benchmark, "cuda_graphs": args.cuda_graphs, "rows": rows})


if __name__ == "__main__":
    main()
