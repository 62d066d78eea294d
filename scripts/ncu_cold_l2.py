"""The two layers furthest behind cuDNN, under Nsight Compute as do_bench runs them: right after
a 256 MB memset (do_bench's L2 flush, which leaves the L2 full of dirty lines), then again warm.

    ncu --cache-control none --replay-mode application --profile-from-start off \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        -k regex:"conv2d_fprop|nvjet|xmma|cutlass|implicit" python scripts/ncu_cold_l2.py

`--cache-control none` keeps the L2 as the memset left it (ncu's default flushes and invalidates
it, a clean cold L2 that no benchmark sees); application replay reruns the script once per pass,
so every pass starts from the same state. Per layer, in this order: ours cold, cuDNN cold, ours
warm (right after ours), cuDNN warm. The configs are the tuning file's when
CONV_TUTORIAL_TUNING_CACHE names one (e.g. results/h100-2026-11-22/network_suite_tuning.json).
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402

import torch  # noqa: E402

LAYERS = [
    ("RN50 7x7 2048->512 1x1", 128, 7, 7, 2048, 512, 1, 1, 1, 0),
    ("RN50 14x14 1024->512 1x1", 128, 14, 14, 1024, 512, 1, 1, 1, 0),
]


def main():
    common.require_tma_mma_gpu("scripts/ncu_cold_l2.py")
    import conv_runtime
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")   # do_bench's
    for label, N, H, W, Ci, Co, R, S, stride, padding in LAYERS:
        torch.manual_seed(0)
        x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(Co, R, S, Ci, device="cuda") / math.sqrt(R * S * Ci)).to(torch.bfloat16)
        ours = lambda: conv_runtime.conv2d(x, w, None, stride, padding, tune=False)  # noqa: E731
        cudnn = common.cudnn_conv2d(x, w, None, stride, padding)
        for _ in range(3):
            ours()
            cudnn()
        geometry = common.conv_geometry(x.shape, w.shape, stride, padding)
        print(f"{label}: ours with {conv_runtime.known_or_heuristic_config(geometry, x.dtype)}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for name, call in (("ours cold", ours), ("cuDNN cold", cudnn)):
            flush.zero_()
            torch.cuda.nvtx.range_push(f"{name} {label}")
            call()
            torch.cuda.nvtx.range_pop()
        for name, call in (("ours warm", ours), ("cuDNN warm", cudnn)):
            call()
            torch.cuda.nvtx.range_push(f"{name} {label}")
            call()
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
