"""cuDNN's own fused conv + scale + bias + ReLU, next to lesson 05's fused epilogue, on three layers.

    python scripts/cudnn_fused_peer.py [--outdir out]

cuDNN can fuse pointwise work into a convolution too, through its graph API; PyTorch does not
use that for nn.Conv2d -> BatchNorm -> ReLU, but a user who writes the graph can. This script
builds, with the `nvidia-cudnn-frontend` Python package (`import cudnn`), the graph
conv_fprop -> mul(scale) -> bias -> ReLU in bf16 (fp32 inside) for three ResNet-50 layers at
batch 128, checks it and lesson 05's fused call against torch, and times both and the unfused
cuDNN path (conv, then the epilogue as PyTorch ops) with triton.testing.do_bench (median, L2
flushed, host time included), in alternating rounds. Writes cudnn_fused_peer.json. Needs a
Hopper GPU and the package (`pip install nvidia-cudnn-frontend`).
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

LAYERS = [  # label, N, H, W, Ci, Co, R, S, stride, padding
    ("RN50 56x56 64->64 3x3", 128, 56, 56, 64, 64, 3, 3, 1, 1),
    ("RN50 28x28 128->128 3x3", 128, 28, 28, 128, 128, 3, 3, 1, 1),
    ("RN50 14x14 1024->256 1x1", 128, 14, 14, 1024, 256, 1, 1, 1, 0),
]
ROUNDS = 3


def cudnn_fused_graph(x_nchw, w_kcrs, scale, bias, out, stride, padding):
    """A cuDNN frontend graph for relu(conv(x, w) * scale + bias); returns a callable."""
    import cudnn
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tensor = lambda name, t, dtype: graph.tensor(name=name, dim=list(t.size()), stride=list(t.stride()),  # noqa: E731
                                                 data_type=dtype)
    X = tensor("X", x_nchw, cudnn.data_type.BFLOAT16)
    W = tensor("W", w_kcrs, cudnn.data_type.BFLOAT16)
    S = tensor("scale", scale, cudnn.data_type.FLOAT)
    B = tensor("bias", bias, cudnn.data_type.FLOAT)
    conv = graph.conv_fprop(image=X, weight=W, padding=list(padding), stride=list(stride), dilation=[1, 1])
    Y = graph.relu(name="relu", input=graph.bias(name="bias", input=graph.mul(a=conv, b=S), bias=B))
    Y.set_output(True).set_data_type(cudnn.data_type.BFLOAT16)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
    variant_pack = {X: x_nchw, W: w_kcrs, S: scale, B: bias, Y: out}
    return lambda: graph.execute(variant_pack, workspace, handle=handle)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outdir", default=None)
    args = parser.parse_args()
    common.require_tma_mma_gpu("scripts/cudnn_fused_peer.py")
    import cudnn
    import conv_runtime
    outdir = common.output_dir(args.outdir)
    rows = []
    for label, N, H, W, Ci, Co, R, S, stride, padding in LAYERS:
        x_nhwc = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(Co, R, S, Ci, device="cuda") / math.sqrt(R * S * Ci)).to(torch.bfloat16)
        scale = torch.rand(Co, device="cuda") + 0.5
        bias = torch.randn(Co, device="cuda") * 0.1
        geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
        x_nchw, w_kcrs = x_nhwc.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)     # channels_last views
        out = torch.empty(N, geometry.out_h, geometry.out_w, Co, device="cuda", dtype=torch.bfloat16)
        cudnn_fused = cudnn_fused_graph(x_nchw, w_kcrs, scale.view(1, Co, 1, 1), bias.view(1, Co, 1, 1),
                                        out.permute(0, 3, 1, 2), (stride, stride), (padding, padding))
        ours = lambda: conv_runtime.conv2d(x_nhwc, w, bias, stride, padding, tune=False, scale=scale,  # noqa: E731
                                           activation="relu")
        conv = common.cudnn_conv2d(x_nhwc, w, None, stride, padding)
        cudnn_unfused = lambda: torch.relu(conv() * scale.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1))  # noqa: E731
        expected = torch.relu(common.reference_conv2d_nhwc(x_nhwc, w, None, stride, padding, out_dtype=torch.float32)
                              * scale + bias).to(torch.bfloat16)
        cudnn_fused()
        common.assert_close_to_reference(out, expected, dtype=torch.bfloat16, K=geometry.K)
        common.assert_close_to_reference(ours(), expected, dtype=torch.bfloat16, K=geometry.K)
        rounds = {"ours fused": [], "cuDNN fused graph": [], "cuDNN conv + eager epilogue": []}
        for _ in range(ROUNDS):
            for name, fn in zip(rounds, (ours, cudnn_fused, cudnn_unfused)):
                rounds[name].append(triton.testing.do_bench(fn))
        row = {"layer": label, "geometry": geometry.describe(), "flops": geometry.flops}
        for name, ms in rounds.items():
            row[name] = {"ms": sorted(ms)[ROUNDS // 2], "rounds_ms": ms,
                         "tflops": geometry.flops / sorted(ms)[ROUNDS // 2] / 1e9}
        row["ours_vs_cudnn_fused"] = row["cuDNN fused graph"]["ms"] / row["ours fused"]["ms"]
        rows.append(row)
        print(f"{label:<28} " + "  ".join(f"{name} {row[name]['tflops']:6.1f}" for name in rounds)
              + f" TFLOPS; ours / cuDNN fused {row['ours_vs_cudnn_fused']:.2f}x", flush=True)
    data = {**common.versions(), "cudnn_frontend": getattr(cudnn, "__version__", "?"),
            "backend_cudnn": cudnn.backend_version(), "rows": rows}
    common.save_json(outdir, "cudnn_fused_peer", data)
    print(f"[data] {outdir / 'cudnn_fused_peer.json'}")


if __name__ == "__main__":
    main()
