"""Three representative layers of the network suite under Nsight Compute: ours and cuDNN, one call each.

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis python scripts/ncu_layers.py

Each layer runs a few times first (compiles, and with a tuning file takes the tuned config), then
one call of ours and one of cuDNN inside torch.cuda.profiler.start()/stop(), so ncu profiles just
those kernels. The layers: a large 3x3 where ours leads (SD UNet 64x64 320->320), a 1x1 where it
trails (ResNet-50 14x14 1024->256), and a layer with fewer tiles than SMs (SD UNet 16x16
1280->1280). RESULTS.md summarizes what ncu said ("Profiles").
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402

import torch  # noqa: E402

LAYERS = [
    ("SD 64x64 320->320 3x3", 8, 64, 64, 320, 320, 3, 3, 1, 1),
    ("RN50 14x14 1024->256 1x1", 128, 14, 14, 1024, 256, 1, 1, 1, 0),
    ("SD 16x16 1280->1280 3x3", 8, 16, 16, 1280, 1280, 3, 3, 1, 1),
]


def main():
    common.require_tma_mma_gpu("scripts/ncu_layers.py")
    import conv_runtime
    for label, N, H, W, Ci, Co, R, S, stride, padding in LAYERS:
        x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(Co, R, S, Ci, device="cuda") / math.sqrt(R * S * Ci)).to(torch.bfloat16)
        cudnn = common.cudnn_conv2d(x, w, None, stride, padding)
        for _ in range(3):
            conv_runtime.conv2d(x, w, None, stride, padding, tune=False)
            cudnn()
        geometry = common.conv_geometry(x.shape, w.shape, stride, padding)
        print(f"{label}: ours with {conv_runtime.known_or_heuristic_config(geometry, x.dtype)}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        torch.cuda.nvtx.range_push(f"ours {label}")
        conv_runtime.conv2d(x, w, None, stride, padding, tune=False)
        torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_push(f"cuDNN {label}")
        cudnn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
