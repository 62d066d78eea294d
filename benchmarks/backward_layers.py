"""Lessons 06 and 07's backward on ResNet-50's convs: dgrad and wgrad per layer, ours against cuDNN.

    python benchmarks/backward_layers.py [--outdir out] [--batch 128] [--quick] [--layers TEXT ...]
                                         [--zero-insertion] [--cuda-graphs]
                                         [--cudnn-benchmark] [--operator]
    python benchmarks/backward_layers.py --operator-only [--nets resnet50 inception_v3 vgg11 densenet121]

For every distinct conv of ResNet-50 (layers.resnet50_layers: torchvision's v1.5, the stem,
the 1x1s and the stride-2 layers included) at batch 128 in bf16, `bench_backward`: dgrad (lesson
06's conv2d_dgrad_launch: lesson 05's kernel per output phase) and wgrad (lesson 07's
conv2d_wgrad_launch) are each checked against torch.nn.grad first, then timed next to cuDNN
(aten.convolution_backward, as autograd calls it, on the channels_last tensors of the same dtype)
with common.bench_tflops: do_bench's median, L2 flushed before every call, launch and host time
included. TFLOPS count the forward pass's useful FLOPs, 2*N*out_h*out_w*Co*Ci*R*S, for both
gradients. --zero-insertion also times the strided layers' dgrad as one stride-1 conv over dY with
stride - 1 zeros between its rows and columns (and zero rows and columns after them, up to the
stride-1 conv's output size), through lesson 06's launcher. --quick: three layers only
(layers.BACKWARD_QUICK); --layers: those whose label holds a given text. --cudnn-benchmark: cuDNN
picks its algorithms by timing them (torch.backends.cudnn.benchmark; off by default, as network_suite.py times cuDNN).
--operator: also the operator's gradients as training calls them (conv_tutorial.set_backward("lesson06"):
torch.ops.conv_tutorial.conv2d_input_grad, dgrad's phases through the forward's runtime, and
conv2d_weight_grad, wgrad through its per-shape plan, conv_tutorial/wgrad.py), checked against torch, timed
the same way, and the host microseconds per call of every path (host_time.py's median_host_us: calls
issued without waiting for the GPU), the plain launchers' and cuDNN's beside them.

Prints one line per layer and the geometric mean of ours / cuDNN for each gradient; writes
backward_layers.json (device, versions, one record per layer) to --outdir (default ./out).
--operator-only: the operator's gradients alone against cuDNN's, on every distinct dense conv of each
network of --nets (torchvision's, layers.torchvision_dense_convs), each checked on its first three
calls (planned, then replayed); the geometric mean and the lowest ratio per gradient and network, in
backward_layers_operator.json ({"device", ..., "nets": {net: {"summary", "rows"}}}).
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the lessons' kit, common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from layers import BACKWARD_QUICK, resnet50_layers, torchvision_dense_convs  # noqa: E402
import torch  # noqa: E402
from conv_tutorial.kernels.wgrad import prepare_wgrad, wgrad_input, wgrad_problem  # noqa: E402

HOST_CALLS = 20      # calls per host-time sample: few enough that the GPU's launch queue never fills


def zero_insertion_dgrad(lesson06, dy_nhwc, w, x_shape, geometry):
    """dX as one stride-1 conv (lesson 06's launcher) over dY spread out with zeros: dY's pixel (oy, ox) at
    (oy*sh, ox*sw) of a tensor of the stride-1 conv's output size, zeros everywhere else."""
    g = geometry
    at_stride_1 = common.conv_geometry(tuple(x_shape), tuple(w.shape), 1, g.padding, g.dilation)
    spread = dy_nhwc.new_zeros(at_stride_1.output_shape_nhwc)
    spread[:, ::g.stride[0], ::g.stride[1]][:, :g.out_h, :g.out_w] = dy_nhwc
    return lesson06.conv2d_dgrad_launch(spread, w, x_shape, 1, g.padding, g.dilation)


def bench_backward(lesson06, lesson07, label, N, H, W, Ci, Co, R, S, stride, padding, dtype=torch.bfloat16,
                   zero_insertion=False, cuda_graph=False):
    """TFLOPS of dgrad and wgrad, ours (lessons 06 and 07's launchers) and cuDNN's, on one layer, each
    checked against torch.nn.grad first; with cuda_graph, each call replayed in a CUDA graph: the
    kernels' time without the host's."""
    x, w, dy, g = lesson06.backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, dtype)
    x_nchw, w_kcrs, dy_nchw = x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), dy.permute(0, 3, 1, 2)  # channels_last
    expected_dx, expected_dw = lesson06.reference_gradients(x, w, dy, g)
    calls = {
        "dgrad": lambda: lesson06.conv2d_dgrad_launch(dy, w, x.shape, stride, padding),
        # cuDNN as autograd calls it in training: convolution_backward on the real channels_last tensors
        "dgrad cuDNN": lambda: torch.ops.aten.convolution_backward(
            dy_nchw, x_nchw, w_kcrs, None, g.stride, g.padding, g.dilation, False, [0, 0], 1, (True, False, False))[0],
        "wgrad": lambda: lesson07.conv2d_wgrad_launch(x, dy, w.shape, stride, padding),
        "wgrad cuDNN": lambda: torch.ops.aten.convolution_backward(
            dy_nchw, x_nchw, w_kcrs, None, g.stride, g.padding, g.dilation, False, [0, 0], 1, (False, True, False))[1],
    }
    if zero_insertion and max(g.stride) > 1:
        calls["dgrad zero-insertion"] = lambda: zero_insertion_dgrad(lesson06, dy, w, x.shape, g)
    for name in [name for name in calls if "cuDNN" not in name]:    # ours, each checked first (K: the length
        dx_like = name.startswith("dgrad")                           # of each output's sum, as lesson 07 says)
        common.assert_close_to_reference(calls[name](), expected_dx if dx_like else expected_dw, dtype=dtype,
                                         K=Co * R * S if dx_like else g.M)
    problem = wgrad_problem(g, x.element_size())       # the conv the wgrad kernel runs, and its split
    wgrad_launch = prepare_wgrad(wgrad_input(x, problem), dy, problem.geometry, None,
                                 *common.tma_mma_arch_and_sms("bench"))
    row = {"layer": label, "geometry": g.describe(), "wgrad_split_k": wgrad_launch.config.split_k,
           "wgrad_whole_tiles": wgrad_launch.shape.whole_tiles}
    row.update({name: common.bench_tflops(call, g.flops, cuda_graph=cuda_graph) for name, call in calls.items()})
    print(f"   {label:<28}" + "".join(f"  {name} {row[name]['tflops']:6.1f}" for name in calls)
          + f"  (wgrad: {row['wgrad_whole_tiles']} tiles whole, the others in {row['wgrad_split_k']} slices)")
    return row


def operator_figures(lesson06, lesson07, layer, cuda_graph, dtype=torch.bfloat16):
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
    def cudnn(mask):     # as bench_backward calls it, as autograd does
        return torch.ops.aten.convolution_backward(dy_nchw, x_nchw, w_kcrs, None, g.stride, g.padding, g.dilation,
                                                   False, [0, 0], 1, mask)
    host_calls = {**calls, "dgrad": lambda: lesson06.conv2d_dgrad_launch(dy, w, x.shape, stride, padding),
                  "wgrad": lambda: lesson07.conv2d_wgrad_launch(x, dy, w.shape, stride, padding),
                  "dgrad cuDNN": lambda: cudnn((True, False, False)),
                  "wgrad cuDNN": lambda: cudnn((False, True, False))}
    row["host_us"] = {name: host_time.median_host_us(call, calls=HOST_CALLS) for name, call in host_calls.items()}
    print(f"   {label:<28}" + "".join(f"  {name} {row[name]['tflops']:6.1f}" for name in calls) + "  host us: "
          + ", ".join(f"{name} {us:.0f}" for name, us in row["host_us"].items()))
    return row


NETS = {   # --nets: a torchvision network's distinct dense convs (layers.torchvision_dense_convs), at --batch
    "resnet50": lambda batch: resnet50_layers(batch),
    "resnet18": lambda batch: torchvision_dense_convs("resnet18", "RN18", batch, 224),
    "inception_v3": lambda batch: torchvision_dense_convs("inception_v3", "IncV3", batch, 299, aux_logits=False,
                                                          init_weights=False),
    "vgg11": lambda batch: torchvision_dense_convs("vgg11", "VGG11", batch, 224),
    "densenet121": lambda batch: torchvision_dense_convs("densenet121", "DN121", batch, 224),
    "squeezenet1_1": lambda batch: torchvision_dense_convs("squeezenet1_1", "SQZ", batch, 224),
    "googlenet": lambda batch: torchvision_dense_convs("googlenet", "GLN", batch, 224, aux_logits=False,
                                                       init_weights=False),
}


def operator_against_cudnn(lesson06, layer, cuda_graph, dtype=torch.bfloat16):
    """The operator's dgrad and wgrad (set_backward("lesson06")) on one layer, as a training step calls them,
    each checked against torch.nn.grad, then timed beside cuDNN's (aten.convolution_backward, as
    autograd calls it) with common.bench_tflops: host time included unless cuda_graph."""
    import conv_tutorial
    label, N, H, W, Ci, Co, R, S, stride, padding = layer
    x, w, dy, g = lesson06.backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, 1, dtype)
    x_nchw, w_kcrs, dy_nchw = (t.permute(0, 3, 1, 2) for t in (x, w, dy))      # channels_last, as autograd has them
    args = (dy_nchw, x_nchw, w_kcrs, list(g.stride), list(g.padding), list(g.dilation), 1)
    conv_tutorial.set_backward("lesson06")

    def cudnn(mask):
        return torch.ops.aten.convolution_backward(dy_nchw, x_nchw, w_kcrs, None, g.stride, g.padding, g.dilation,
                                                   False, [0, 0], 1, mask)
    calls = {"dgrad operator": lambda: torch.ops.conv_tutorial.conv2d_input_grad(*args),
             "dgrad cuDNN": lambda: cudnn((True, False, False))[0],
             "wgrad operator": lambda: torch.ops.conv_tutorial.conv2d_weight_grad(*args),
             "wgrad cuDNN": lambda: cudnn((False, True, False))[1]}
    expected_dx, expected_dw = lesson06.reference_gradients(x, w, dy, g)
    for _ in range(3):     # (the first calls plan, compile and record; later ones replay: each checked)
        common.assert_close_to_reference(calls["dgrad operator"]().permute(0, 2, 3, 1), expected_dx, dtype=dtype,
                                         K=Co * R * S)
        common.assert_close_to_reference(calls["wgrad operator"]().permute(0, 2, 3, 1), expected_dw, dtype=dtype,
                                         K=g.M)
    row = {"layer": label, "geometry": g.describe()}
    row.update({name: common.bench_tflops(call, g.flops, cuda_graph=cuda_graph) for name, call in calls.items()})
    print(f"   {label:<30}" + "".join(f"  {name} {row[name]['tflops']:6.1f}" for name in calls)
          + f"  dgrad {row['dgrad operator']['tflops'] / row['dgrad cuDNN']['tflops']:.2f}x"
          + f"  wgrad {row['wgrad operator']['tflops'] / row['wgrad cuDNN']['tflops']:.2f}x")
    return row


def operator_only(args, lesson06):
    """--operator-only: per network of --nets, the operator's gradients against cuDNN on each layer, the
    geometric mean and the lowest ratio of each gradient."""
    how = "do_bench_cudagraph medians, kernels alone" if args.cuda_graphs else "do_bench medians, host time included"
    nets = {}
    for net in args.nets:
        layers = NETS[net](args.batch)
        if args.layers:
            layers = [layer for layer in layers if any(text in layer[0] for text in args.layers)]
        print(f"{net}: the operator's dgrad and wgrad against cuDNN, bf16, {common.gpu_name()}, TFLOPS ({how}):")
        rows = [operator_against_cudnn(lesson06, layer, args.cuda_graphs) for layer in layers]
        ratios = {kind: [row[f"{kind} operator"]["tflops"] / row[f"{kind} cuDNN"]["tflops"] for row in rows]
                  for kind in ("dgrad", "wgrad")}
        summary = {kind: {"geomean": statistics.geometric_mean(r), "lowest": min(r), "layers": len(r)}
                   for kind, r in ratios.items()}
        print(f"{net}: ours / cuDNN, geometric mean (lowest) over {len(rows)} layers: "
              + ", ".join(f"{k} {v['geomean']:.2f}x ({v['lowest']:.2f}x)" for k, v in summary.items()))
        nets[net] = {"summary": summary, "rows": rows}
    common.save_json(common.output_dir(args.outdir), "backward_layers_operator",
                     {**common.versions(), "dtype": "bfloat16", "batch": args.batch, "cuda_graphs": args.cuda_graphs,
                      "nets": nets})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outdir", default=None, help="folder for backward_layers.json (default ./out)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="three layers only (layers.BACKWARD_QUICK)")
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
    parser.add_argument("--operator-only", action="store_true",
                        help="only the operator's gradients against cuDNN, on every layer of each of --nets "
                             "(backward_layers_operator.json)")
    parser.add_argument("--nets", nargs="+", default=["resnet50"], choices=sorted(NETS),
                        help="with --operator-only: the networks whose layers to time (default resnet50)")
    args = parser.parse_args(argv)
    common.require_tma_mma_gpu("benchmarks/backward_layers.py")
    lesson06, lesson07 = common.load_lesson("06-conv-dgrad"), common.load_lesson("07-conv-wgrad")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    if args.operator or args.operator_only:
        # (the operator's repeat calls in C++ once built: wait for the build, so that no layer is timed while it
        # runs, nor on the Python path before it)
        from conv_tutorial import native
        if not native.ensure():
            print("the native kernels (conv_tutorial/native.py) are not built here: every call takes the Python path")
    if args.operator_only:
        return operator_only(args, lesson06)
    layers = BACKWARD_QUICK if args.quick else resnet50_layers(args.batch)
    if args.layers:
        layers = [layer for layer in layers if any(text in layer[0] for text in args.layers)]
        if not layers:
            raise SystemExit(f"--layers {args.layers}: no layer's label contains any of them")
    how = "do_bench_cudagraph medians, kernels alone" if args.cuda_graphs else "do_bench medians, host time included"
    print(f"dgrad and wgrad, bf16, {common.gpu_name()}, TFLOPS of useful FLOPs ({how}):")
    rows = [bench_backward(lesson06, lesson07, *layer, zero_insertion=args.zero_insertion,
                           cuda_graph=args.cuda_graphs) for layer in layers]
    if args.operator:
        print(f"the operator's gradients (conv_tutorial, set_backward('lesson06')), TFLOPS ({how}), host us per call:")
        for row, layer in zip(rows, layers):
            row.update(operator_figures(lesson06, lesson07, layer, args.cuda_graphs))
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
