"""The first call of a fused model: kernels compiled ahead in a pool (conv_tutorial.launch.compiling_ahead),
and keep_faster_convs' own timer. On a GPU: calls after the compile-ahead block run right (split-K's second
kernel and an epilogue variant included), the autotuner refuses to time inside it, and the timer ranks a
kernel twice as long as twice as long. On a CPU: a compile that fails in the pool is reported when the block
ends, unless the block itself failed (its error is the one raised)."""
import common

import pytest
import torch

from conv_tutorial.kernels import fprop  # noqa: E402
from conv_tutorial import fusion, runtime, selection  # noqa: E402
from conv_tutorial import launch as plans  # noqa: E402

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, stride, config, epilogue", [
    (2, 13, 11, 40, 72, 3, 2, None, dict(activation="relu")),                      # the heuristic's config
    (1, 7, 7, 512, 512, 3, 1, fprop.KernelConfig(128, 128, 64, 4, 4, split_k=4),  # split-K: two kernels
     dict(activation="silu")),
])
def test_calls_after_compiling_ahead_compute_the_conv(N, H, W, Ci, Co, R, stride, config, epilogue):
    x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, R, torch.bfloat16)
    bias = torch.randn(Co, device="cuda", dtype=torch.float32)
    kwargs = dict(stride=stride, padding=R // 2, config=config, tune=False, **epilogue)
    with plans.compiling_ahead(workers=2):
        unwritten = runtime.conv2d(x, w, bias, **kwargs)      # compiles, launches nothing
    assert unwritten.shape[0] == N
    out = runtime.conv2d(x, w, bias, **kwargs)
    conv = common.reference_conv2d_nhwc(x, w, stride=stride, padding=R // 2, out_dtype=torch.float32)
    expected = common.reference_epilogue(conv, bias, None, None, epilogue["activation"])
    common.assert_close_to_reference(out, expected, dtype=torch.bfloat16, K=R * R * Ci)


@needs_gpu
def test_autotune_refuses_to_time_inside_compiling_ahead():
    x, w = common.random_conv_inputs(1, 9, 9, 64, 64, 3, 3, torch.bfloat16)
    geometry = common.conv_geometry(x.shape, w.shape, 1, 1)
    with pytest.raises(RuntimeError, match="compiling_ahead"), plans.compiling_ahead(workers=1):
        selection.autotune(geometry, x, w, None)


@needs_gpu
def test_graph_replay_timer_ranks_twice_the_work_as_slower():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    once = fusion._graph_replay_ms(lambda: a @ a)
    twice = fusion._graph_replay_ms(lambda: (a @ a, a @ a))
    assert 1.6 < twice / once < 2.4, (once, twice)


@needs_gpu
def test_depthwise_calls_after_compiling_ahead_compute_the_conv():
    from conv_tutorial import depthwise_conv2d
    x = torch.randn(2, 15, 13, 48, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(48, 3, 3, device="cuda", dtype=torch.bfloat16)
    with plans.compiling_ahead(workers=2):
        depthwise_conv2d(x, w, stride=2, padding=1, activation="relu")      # compiles, runs nothing
    out = depthwise_conv2d(x, w, stride=2, padding=1, activation="relu")
    expected = torch.relu(torch.nn.functional.conv2d(x.permute(0, 3, 1, 2).float(), w.float().unsqueeze(1), stride=2,
                                                     padding=1, groups=48)).permute(0, 2, 3, 1)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * 3)


def _submit_failing_compile():
    # what a kernel's warmup hands Triton's pool inside compiling_ahead, with a compile that fails
    from triton.runtime._async_compile import active_mode

    def compile_fails():
        raise RuntimeError("the compile failed")
    active_mode.get().submit("a key", compile_fails, lambda kernel: None, lambda future: None)


def test_a_failed_compile_is_reported_when_compiling_ahead_ends():
    with pytest.raises(RuntimeError, match="the compile failed"), plans.compiling_ahead(workers=1):
        _submit_failing_compile()


def test_an_error_inside_compiling_ahead_is_the_one_raised():
    """The block's own error, not a compile that failed beside it (which would hide where the block failed)."""
    with pytest.raises(ValueError, match="the block's error"), plans.compiling_ahead(workers=1):
        _submit_failing_compile()
        raise ValueError("the block's error")


def test_without_waiting_the_block_exits_before_its_compiles_and_a_launch_waits_for_its_own():
    """compiling_ahead(wait=False): the block ends while a compile is still running; Triton's cache entry (the
    FutureKernel) gives the compiled kernel once the compile ends, and the compile-only mode is off after it."""
    import threading
    from triton.runtime._async_compile import active_mode
    release, finalized = threading.Event(), []

    def compile_waits():
        release.wait(timeout=30)
        return "the compiled kernel"
    with plans.compiling_ahead(workers=1, wait=False):
        future_kernel = active_mode.get().submit("a key", compile_waits, finalized.append, lambda future: None)
    assert active_mode.get() is None and not plans.compiling_ahead_active()
    assert not future_kernel.future.done() and not finalized
    release.set()
    assert future_kernel.result() == "the compiled kernel" and finalized == ["the compiled kernel"]


def test_without_waiting_a_failed_compile_is_raised_where_its_kernel_is_first_used():
    from triton.runtime._async_compile import active_mode

    def compile_fails():
        raise RuntimeError("the compile failed")
    with plans.compiling_ahead(workers=1, wait=False):      # (no error at the block's exit)
        future_kernel = active_mode.get().submit("a key", compile_fails, lambda kernel: None, lambda future: None)
    with pytest.raises(RuntimeError, match="the compile failed"):
        future_kernel.result()


def test_compiling_ahead_refuses_a_wait_that_is_not_a_bool():
    with pytest.raises(TypeError, match="wait must be a bool"), plans.compiling_ahead(workers=1, wait="no"):
        pass
