"""The timer of the autotuner and of `keep_faster_convs`: triton.testing.do_bench, as TFLOPS."""
import triton
import triton.testing

def bench_tflops(fn, flops: int, warmup_ms: int = 25, rep_ms: int = 100, cuda_graph=False) -> dict:
    """Median TFLOPS of `fn` (with 20th/80th percentiles) from triton.testing.do_bench.

    do_bench times with CUDA events, clears the L2 cache before every call (so each run reads its
    operands from HBM) and includes the launch overhead of whatever `fn` launches: the end-to-end
    number a user sees. With cuda_graph=True, do_bench_cudagraph replays `fn` captured in a CUDA
    graph instead: host overhead disappears and the kernels' own speed remains (L2 not flushed)."""
    if cuda_graph:
        ms_median, ms_p20, ms_p80 = triton.testing.do_bench_cudagraph(fn, rep=rep_ms,
                                                                      quantiles=[0.5, 0.2, 0.8])
    else:
        ms_median, ms_p20, ms_p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                                            quantiles=[0.5, 0.2, 0.8])
    to_tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    return {"ms": ms_median, "tflops": to_tflops(ms_median),
            # a shorter time is a higher rate: the 20th percentile of time is the 80th of TFLOPS
            "tflops_p80": to_tflops(ms_p20), "tflops_p20": to_tflops(ms_p80)}

