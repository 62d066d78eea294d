"""Lesson 06's backward on ResNet-50's convs: dgrad and wgrad per layer, ours against cuDNN.

    python benchmarks/backward_layers.py [--outdir out] [--batch 128] [--quick] [--layers TEXT ...]
                                         [--zero-insertion] [--cuda-graphs]
                                         [--cudnn-benchmark] [--operator]

For every distinct conv of ResNet-50 (layers.resnet50_layers: torchvision's v1.5, the stem,
the 1x1s and the stride-2 layers included) at batch 128 in bf16, lesson 06's `bench_backward`:
dgrad (conv2d_dgrad_launch: lesson 05's kernel per output phase) and wgrad (conv2d_wgrad_launch)
are each checked against torch.nn.grad first, then timed next to cuDNN (aten.convolution_backward,
as autograd calls it, on the channels_last tensors of the same dtype) with common.bench_tflops: do_bench's
median, L2 flushed before every call, launch and host time included. TFLOPS count the forward
pass's useful FLOPs, 2*N*out_h*out_w*Co*Ci*R*S, for both gradients. --zero-insertion also times
the strided layers' dgrad as one stride-1 conv over dY with zeros inserted (lesson 06, section 2).
--quick: lesson 06's three --bench layers only (layers.BACKWARD_QUICK); --layers: those whose label
holds a given text. --cudnn-benchmark: cuDNN picks its algorithms by
timing them (torch.backends.cudnn.benchmark; off by default, as network_suite.py times cuDNN).
--operator: also the operator's gradients as training calls them (conv_tutorial.set_backward("lesson06"):
torch.ops.conv_tutorial.conv2d_input_grad, dgrad's phases through the forward's runtime, and
conv2d_weight_grad, wgrad through its per-shape plan, conv_tutorial/wgrad.py), checked against torch, timed
the same way, and the host microseconds per call of every path (host_time.py's median_host_us: calls
issued without waiting for the GPU), the plain launchers' and cuDNN's beside them.

Prints one line per layer and the geometric mean of ours / cuDNN for each gradient; writes
backward_layers.json (device, versions, one record per layer) to --outdir (default ./out).
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the lessons' kit, common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from layers import BACKWARD_QUICK, resnet50_layers  # noqa: E402
import torch  # noqa: E402

HOST_CALLS = 20      # calls per host-time sample: few enough that the GPU's launch queue never fills


def operator_figures(lesson06, layer, cuda_graph, dtype=torch.bfloat16):
    """The operator's dgrad and wgrad on one layer: checked against torch.nn.grad, TFLOPS, and host
    microseconds per call of each path (the plain launchers' and cuDNN's too)."""
    import conv_tutorial
    import host_time
    from conv_tutorial import wgrad
    label, N, H, W, Ci, Co, R, S, stride, padding = layer
    x, w, dy, g = lesson06.backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, dtype)
    x_nchw, w_kcrs, dy_nchw = (t.permute(0, 3, 1, 2) for t in (x, w, dy))      # channels_last, as autograd has them
    args = (dy_nchw, x_nchw, w_kcrs, list(g.stride), list(g.padding), list(g.dilation), 1)
    calls = {"dgrad operator": lambda: torch.ops.conv_tutorial.conv2d_input_grad(*args),
             "wgrad operator": lambda: torch.ops.conv_tutorial.conv2d_weight_grad(*args),
             "wgrad plan": lambda: wgrad.conv2d_weight_grad(x, dy, w.shape, stride, padding)}
    conv_tutorial.set_backward("lesson06")
    expected_dx, expected_dw = lesson06.reference_gradients(x, w, dy, g)
    for name, expected, K in (("dgrad operator", expected_dx, Co * R * S), ("wgrad operator", expected_dw, g.M),
                              ("wgrad plan", expected_dw, g.M)):
        got = calls[name]()
        common.assert_close_to_reference(got if name == "wgrad plan" else got.permute(0, 2, 3, 1), expected,
                                         dtype=dtype, K=K)
    row = {name: common.bench_tflops(call, g.flops, cuda_graph=cuda_graph) for name, call in calls.items()}
    def cudnn(mask):     # as lesson 06's bench_backward calls it, as autograd does
        return torch.ops.aten.convolution_backward(dy_nchw, x_nchw, w_kcrs, None, g.stride, g.padding, g.dilation,
                                                   False, [0, 0], 1, mask)
    host_calls = {**calls, "dgrad": lambda: lesson06.conv2d_dgrad_launch(dy, w, x.shape, stride, padding),
                  "wgrad": lambda: lesson06.conv2d_wgrad_launch(x, dy, w.shape, stride, padding),
                  "dgrad cuDNN": lambda: cudnn((True, False, False)),
                  "wgrad cuDNN": lambda: cudnn((False, True, False))}
    row["host_us"] = {name: host_time.median_host_us(call, calls=HOST_CALLS) for name, call in host_calls.items()}
    print(f"   {label:<28}" + "".join(f"  {name} {row[name]['tflops']:6.1f}" for name in calls) + "  host us: "
          + ", ".join(f"{name} {us:.0f}" for name, us in row["host_us"].items()))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outdir", default=None, help="folder for backward_layers.json (default ./out)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="lesson 06's three --bench layers only")
    parser.add_argument("--layers", nargs="+", metavar="TEXT",
                        help="only the layers whose label contains one of these texts (e.g. 'stem' 's2')")
    parser.add_argument("--zero-insertion", action="store_true",
                        help="also time dgrad of the strided layers as one conv over zero-inserted dY")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay each call in a CUDA graph (common.bench_tflops(cuda_graph=True)): kernels "
                             "alone, no host time, L2 not flushed")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its algorithms per shape (torch.backends.cudnn.benchmark) first")
    parser.add_argument("--operator", action="store_true",
                        help="also the operator's gradients (set_backward('lesson06'): wgrad through its per-shape "
                             "plan), and every path's host microseconds per call")
    args = parser.parse_args(argv)
    common.require_tma_mma_gpu("benchmarks/backward_layers.py")
    lesson06 = common.load_lesson("06-conv-backward")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    layers = BACKWARD_QUICK if args.quick else resnet50_layers(args.batch)
    if args.layers:
        layers = [layer for layer in layers if any(text in layer[0] for text in args.layers)]
        if not layers:
            raise SystemExit(f"--layers {args.layers}: no layer's label contains any of them")
    how = "do_bench_cudagraph medians, kernels alone" if args.cuda_graphs else "do_bench medians, host time included"
    print(f"dgrad and wgrad, bf16, {common.gpu_name()}, TFLOPS of useful FLOPs ({how}):")
    rows = [lesson06.bench_backward(*layer, zero_insertion=args.zero_insertion, cuda_graph=args.cuda_graphs)
            for layer in layers]
    if args.operator:
        print(f"the operator's gradients (conv_tutorial, set_backward('lesson06')), TFLOPS ({how}), host us per call:")
        for row, layer in zip(rows, layers):
            row.update(operator_figures(lesson06, layer, args.cuda_graphs))
    kinds = ("dgrad", "wgrad") + (("dgrad operator", "wgrad operator", "wgrad plan") if args.operator else ())
    summary = {kind: statistics.geometric_mean([row[kind]["tflops"] / row[f"{kind.split()[0]} cuDNN"]["tflops"]
                                                for row in rows])
               for kind in kinds}
    print("geometric mean over the layers, ours / cuDNN: " + ", ".join(f"{k} {v:.2f}x" for k, v in summary.items()))
    common.save_json(common.output_dir(args.outdir), "backward_layers",
                     {**common.versions(), "dtype": "bfloat16", "batch": args.batch, "summary": summary,
                      "cudnn_benchmark": args.cudnn_benchmark, "cuda_graphs": args.cuda_graphs,
                      "operator": args.operator, "rows": rows})


if __name__ == "__main__":
    main()
