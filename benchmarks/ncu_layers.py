"""Layers of the network suite under Nsight Compute: ours and cuDNN, one call each.

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis python benchmarks/ncu_layers.py

Each layer runs a few times first (compiles, and with a tuning file takes the tuned config), then
one call of ours and one of cuDNN inside torch.cuda.profiler.start()/stop(), so ncu profiles just
those kernels. The layers: a large 3x3 where ours leads (SD UNet 64x64 320->320), a 1x1 where it
trails (ResNet-50 14x14 1024->256), and a layer with fewer tiles than SMs (SD UNet 16x16
1280->1280). RESULTS.md summarizes what ncu said ("Profiles").

With --cold-l2, the two ResNet-50 1x1 layers that were furthest behind cuDNN, as do_bench runs
them: right after a 256 MB memset (do_bench's L2 flush, which leaves the L2 full of dirty
lines), then again warm, in this order: ours cold, cuDNN cold, ours warm (its second call in a
row), cuDNN warm (likewise). ncu must then leave the L2 alone and replay the whole script:

    ncu --cache-control none --replay-mode application --profile-from-start off \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        -k regex:"conv2d_fprop|nvjet|xmma|cutlass|implicit|gemm" python benchmarks/ncu_layers.py --cold-l2

(ncu's default cache control flushes and invalidates the L2 before each kernel: a clean cold L2
that no benchmark sees.) The configs are the tuning file's when CONV_TUTORIAL_TUNING_CACHE names
one (e.g. results/h100-2026-11-22/network_suite_tuning.json), else the heuristic's.
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from conv_tutorial import runtime, selection  # noqa: E402
from layers import NCU, NCU_COLD_L2  # noqa: E402

import torch  # noqa: E402


def in_range(name, call):
    """One call inside an NVTX range (ncu's --nvtx filters can pick it out)."""
    torch.cuda.nvtx.range_push(name)
    call()
    torch.cuda.nvtx.range_pop()


def main():
    common.require_tma_mma_gpu("benchmarks/ncu_layers.py")
    cold_l2 = "--cold-l2" in sys.argv[1:]
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda") if cold_l2 else None
    for label, N, H, W, Ci, Co, R, S, stride, padding in (NCU_COLD_L2 if cold_l2 else NCU):
        torch.manual_seed(0)          # application replay: every pass the same tensors
        x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(Co, R, S, Ci, device="cuda") / math.sqrt(R * S * Ci)).to(torch.bfloat16)
        ours = lambda: runtime.conv2d(x, w, None, stride, padding, tune=False)  # noqa: E731
        cudnn = common.cudnn_conv2d(x, w, None, stride, padding)
        for _ in range(3):
            ours()
            cudnn()
        geometry = common.conv_geometry(x.shape, w.shape, stride, padding)
        print(f"{label}: ours with {selection.known_or_heuristic_config(geometry, x.dtype)}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        if cold_l2:
            for name, call in (("ours cold", ours), ("cuDNN cold", cudnn)):
                flush.zero_()
                in_range(f"{name} {label}", call)
            for name, call in (("ours warm", ours), ("cuDNN warm", cudnn)):
                call()
                in_range(f"{name} {label}", call)
        else:
            in_range(f"ours {label}", ours)
            in_range(f"cuDNN {label}", cudnn)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
