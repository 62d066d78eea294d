"""benchmarks/training.py on a CPU (--smoke: a tiny network, the operator falling back to torch): the script
runs, every variant trains from the same weights on the same batches, and what it writes has the
fields the training table reads."""
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import training  # noqa: E402


def test_smoke_run_writes_rows_and_plot(tmp_path):
    rows = training.main(["--smoke", "--batch", "4", "--steps", "3", "--warmup", "1", "--variants", "eager", "ours",
                          "--outdir", str(tmp_path)])
    data = json.loads((tmp_path / "training.json").read_text())
    assert {"device", "torch", "triton", "rows"} <= data.keys() and data["steps"] == 3
    assert [r["variant"] for r in data["rows"]] == ["eager", "ours"]
    for row in rows:
        assert {"net", "batch", "variant", "img_s", "loss_50"} <= row.keys() and len(row["losses"]) == 3
        # 3 steps: no 50th step's loss (the field), the last step's beside it
        assert row["loss_50"] is None and row["loss_last"] == row["losses"][-1]
        # the warm-up step's own time (what a user waits for first), apart from the timed steps
        assert len(row["first_steps_s"]) == 1 and row["first_steps_s"][0] > 0 and row["compile_ahead_s"] is None
        assert row["native_built"] is None        # (its C++ kernels serve GPU calls only)
        # bf16 autocast against fp32: each operand rounded to 2^-8 relative, a few percent after
        # several layers; a gradient that is mostly cancellation (BatchNorm's) errs most
        assert row["img_s"] > 0 and row["grad_rel_err_median"] < 0.05 and row["grad_rel_err_max"] < 0.25
    # same weights, same batches: the first step's loss is the same forward in both (bf16 convs)
    assert abs(rows[0]["losses"][0] - rows[1]["losses"][0]) < 1e-2
    assert (tmp_path / "training_loss.png").exists()


def test_rows_count_the_gradients_left_to_torch(tmp_path):
    # on a CPU lesson 06's kernels cover nothing: every conv gradient of "ours-lesson06" is torch's, counted
    rows = training.main(["--smoke", "--batch", "2", "--steps", "2", "--warmup", "1", "--variants", "ours",
                          "ours-lesson06", "--outdir", str(tmp_path)])
    assert rows[0]["backward_fallbacks"] == {}                 # torch's backward chosen: nothing fell back
    (reason, count), = rows[1]["backward_fallbacks"].items()
    assert "cpu" in reason and count > 0


def test_plot_draws_every_variant(tmp_path):
    rows = [{"net": "resnet50", "batch": 8, "variant": variant, "losses": [7.0 + 0.01 * i, 6.9, 6.95]}
            for i, variant in enumerate(training.VARIANTS)]
    training.plot(rows, tmp_path, {"device": "a GPU", "torch": "2", "triton": "3"})
    assert (tmp_path / "training_loss.png").stat().st_size > 0


def test_bnstats_variant_trains_as_ours_and_matches_gradients_by_storage(tmp_path):
    # the fused-statistics variant rebuilds the model (a GraphModule), so its first-step gradients are found
    # by their parameters' storage: they come out in the original model's order, as close to fp32 as "ours"
    rows = training.main(["--smoke", "--batch", "4", "--steps", "3", "--warmup", "1", "--variants", "ours-lesson06",
                          "ours-lesson06-bnstats", "--outdir", str(tmp_path)])
    plain, fused = rows
    assert abs(plain["losses"][0] - fused["losses"][0]) < 1e-2
    assert fused["grad_rel_err_median"] < 0.05 and fused["grad_rel_err_max"] < 0.25


def test_no_gradient_check_leaves_the_errors_out(tmp_path):
    rows = training.main(["--smoke", "--batch", "2", "--steps", "2", "--warmup", "1", "--variants", "eager",
                          "--no-gradient-check", "--outdir", str(tmp_path)])
    assert rows[0]["grad_rel_err_median"] is None and rows[0]["grad_rel_err_max"] is None


def test_kernel_kinds_sort_the_kernels_of_a_step():
    # names as the profiler reports them: ours, cuDNN's and cuBLAS's, Inductor's, the optimizer's
    assert training.kernel_kind("conv2d_fprop_kernel") == "conv forward (ours)"
    assert training.kernel_kind("conv2d_wgrad_kernel") == "wgrad (ours)"
    assert training.kernel_kind("flipped_weights_kernel") == "dgrad weight flip (ours)"
    assert training.kernel_kind("sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc") == "cuDNN dgrad"
    assert training.kernel_kind("sm90_xmma_wgrad_implicit_gemm_indexed_bf16") == "cuDNN wgrad"
    assert training.kernel_kind("triton_red_fused__native_batch_norm_legit_functional_0") == \
        "Inductor (BatchNorm, ReLU, add, pool, loss)"
    assert training.kernel_kind("triton_poi_fused_convolution_backward_relu_threshold_backward_3") == \
        "Inductor (BatchNorm, ReLU, add, pool, loss)"
    assert training.kernel_kind("void at::native::(anonymous namespace)::multi_tensor_apply_kernel") == "optimizer"
    assert training.kernel_kind("Memset (Device)") == "copies and fills"
    assert training.kernel_kind("something_else") == "other"


def test_conv_gradient_errors_compare_each_call_with_fp32(tmp_path):
    # the smoke network's 2 convs: 3 gradient calls (the first conv's input needs none). On a CPU the operator's
    # gradients are torch's, so ours and cuDNN's column are the same bf16 computation: relative errors of bf16
    # rounding, 2^-8 (3.9e-3) per element at most, less in norm (well under 1e-2)
    rows = training.main(["--smoke", "--batch", "4", "--steps", "2", "--warmup", "1", "--variants", "ours",
                          "ours-lesson06", "--outdir", str(tmp_path)])
    assert rows[0]["conv_grad_err"] is None                     # torch's backward: no operator gradients
    errors = rows[1]["conv_grad_err"]
    assert errors["calls"] == 3
    assert 0 < errors["ours_median"] <= errors["ours_max"] < 1e-2
    assert errors["ours_median"] == errors["cudnn_median"] and errors["ours_max"] == errors["cudnn_max"]


def test_conv_gradient_errors_see_a_wrong_gradient(monkeypatch):
    # the operator's gradients made 10% too large: each call's error against fp32 is ~0.1, cuDNN's stays bf16's
    import conv_tutorial.backward as backward
    right = backward._torch_gradient
    monkeypatch.setattr(backward, "_torch_gradient", lambda *args: right(*args) * 1.1)
    x, y = training.batches(1, 4, 32, 10, "cpu")[0]
    errors = training.conv_gradient_errors("ours-lesson06", training.initial_model("smoke"), x, y, "cpu")
    assert errors["calls"] == 3 and 0.09 < errors["ours_median"] < 0.11 and errors["cudnn_max"] < 1e-2


def test_conv_gradient_errors_refuse_a_step_without_operator_gradients():
    # the eager model calls no conv_tutorial gradient op: the check would measure nothing, so it says so
    import conv_tutorial
    x, y = training.batches(1, 2, 32, 10, "cpu")[0]
    before = conv_tutorial.backward_backend()
    with pytest.raises(RuntimeError, match="no call"):
        training.conv_gradient_errors("eager", training.initial_model("smoke"), x, y, "cpu")
    assert conv_tutorial.backward_backend() == before


def test_relative_error_of_a_zero_reference():
    import torch
    zero = torch.zeros(3)
    assert training.relative_error(zero, zero) == 0.0 and training.relative_error(torch.ones(3), zero) == float("inf")


def test_a_run_leaves_the_gradients_backend_as_it_found_it(tmp_path):
    import conv_tutorial
    before = conv_tutorial.backward_backend()
    training.main(["--smoke", "--batch", "2", "--steps", "2", "--warmup", "1", "--variants", "ours-lesson06",
                   "--no-gradient-check", "--outdir", str(tmp_path)])
    assert conv_tutorial.backward_backend() == before


def test_compile_ahead_is_timed_for_the_operators_variants(tmp_path):
    rows = training.main(["--smoke", "--batch", "4", "--steps", "2", "--warmup", "1", "--variants", "eager", "ours",
                          "--no-gradient-check", "--compile-ahead", "--outdir", str(tmp_path)])
    # (a CPU: nothing to compile, 0 seconds; eager is not the operator's)
    assert [r["compile_ahead_s"] for r in rows] == [None, 0.0]


def test_compile_ahead_in_the_background_is_said_in_the_json(tmp_path):
    import json
    rows = training.main(["--smoke", "--batch", "4", "--steps", "2", "--warmup", "1", "--variants", "ours",
                          "--no-gradient-check", "--compile-ahead", "background", "--outdir", str(tmp_path)])
    assert [r["compile_ahead_s"] for r in rows] == [0.0]
    assert json.loads((tmp_path / "training.json").read_text())["compile_ahead"] == "background"


def test_compile_ahead_while_tracing_is_turned_on_for_the_steps_and_off_after(tmp_path, monkeypatch):
    import conv_tutorial
    seen = []
    monkeypatch.setattr(conv_tutorial, "compile_while_tracing", lambda enabled=True, workers=None: seen.append(enabled))
    rows = training.main(["--smoke", "--batch", "4", "--steps", "2", "--warmup", "1", "--variants", "eager", "ours",
                          "--no-gradient-check", "--compile-ahead", "tracing", "--outdir", str(tmp_path)])
    # the operator's variant alone: on before its first step, off after its steps; a time, not a pass's None
    assert seen == [True, False]
    assert rows[0]["compile_ahead_s"] is None and 0 <= rows[1]["compile_ahead_s"] < 1
    assert rows[0]["traced_compile_failures"] is None and rows[1]["traced_compile_failures"] == 0
    assert json.loads((tmp_path / "training.json").read_text())["compile_ahead"] == "tracing"


def test_first_step_breakdown_is_recorded_and_leaves_tritons_hooks(tmp_path):
    import triton
    hooks = (triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook)
    rows = training.main(["--smoke", "--batch", "4", "--steps", "2", "--warmup", "1", "--variants", "eager", "ours",
                          "--no-gradient-check", "--first-step-breakdown", "--outdir", str(tmp_path)])
    for row in rows:
        first = row["first_step"]
        # (a CPU: the operator runs torch's conv, no Triton kernel of its own; torch.compile compiles "ours")
        assert first["triton_kernels_compiled"] == 0 and first["triton_compile_s"] == 0
        assert first["torch_compile_s"] >= 0 and isinstance(first["torch_compile_caches"], dict)
    assert rows[1]["first_step"]["torch_compile_s"] > rows[0]["first_step"]["torch_compile_s"] == 0
    # torch.compile's phases: none for eager; for the compiled variant, Dynamo's whole compile of the forward
    # (the figure above) and phases inside it, each at least PHASE_MIN_S
    assert rows[0]["first_step"]["torch_compile_phases"] == {}
    phases = rows[1]["first_step"]["torch_compile_phases"]
    assert phases["_compile.compile_inner"] == pytest.approx(rows[1]["first_step"]["torch_compile_s"], abs=2e-3)
    assert len(phases) > 1 and min(phases.values()) >= training.FirstStepBreakdown.PHASE_MIN_S
    assert (triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook) == hooks


def test_first_step_breakdown_sorts_kernels_compiled_from_loaded(monkeypatch):
    """Triton's JIT hooks as Triton calls them around a kernel's compile (none runs on a CPU): one kernel
    that took longer than COMPILED_S counts as compiled, one that did not as loaded from the cache."""
    import types
    import triton
    monkeypatch.setattr(training.FirstStepBreakdown, "COMPILED_S", 0.02)
    with training.FirstStepBreakdown() as watch:
        knobs = triton.knobs.runtime
        for name, seconds in (("slow_kernel", 0.05), ("cached_kernel", 0.0)):
            fn = types.SimpleNamespace(name=name)
            assert knobs.jit_cache_hook(key=(name,), fn=fn, repr=name, compile={}, is_manual_warmup=False,
                                        already_compiled=False) is False
            time.sleep(seconds)
            knobs.jit_post_compile_hook(key=(name,), fn=fn, repr=name, compile={}, is_manual_warmup=False,
                                        already_compiled=False)
    summary = watch.summary()
    assert summary["triton_kernels_compiled"] == 1 and summary["triton_compile_s"] >= 0.05
    assert summary["triton_kernels_from_cache"] == 1 and summary["triton_from_cache_s"] < 0.02


def test_first_step_breakdown_counts_only_the_phases_of_its_own_step():
    """Two watched compiles one after the other in one process: each breakdown's phases are its own compile's, not
    the process's running totals (torch.compile keeps every phase's times since the process began)."""
    import torch
    import torch._dynamo

    torch._dynamo.reset()
    seen = []
    for scale in (2.0, 3.0):
        # (a new function each time: a compile of its own, whatever Dynamo's caches hold)
        step = torch.compile(lambda x, scale=scale: (x * scale).relu().sum(), backend="aot_eager")
        with training.FirstStepBreakdown() as watch:
            step(torch.randn(8))
        seen.append(watch.summary())
    for summary in seen:
        phases = summary["torch_compile_phases"]
        assert summary["torch_compile_s"] > 0
        # (phases under PHASE_MIN_S are left out: the whole compile is in only where it lasted that long)
        assert phases.get("_compile.compile_inner", summary["torch_compile_s"]) == \
            pytest.approx(summary["torch_compile_s"], abs=2e-3)
        assert all(seconds <= summary["torch_compile_s"] + 2e-3 for seconds in phases.values())


def test_main_thread_cpu_tells_running_from_waiting():
    """MainThreadCPU on this thread: a busy loop is CPU seconds, a sleep is waiting; its samples add up to the
    wall time it watched. (On a loaded machine the busy loop may lose a core now and then: the bounds allow it.)"""
    import threading
    if not hasattr(time, "pthread_getcpuclockid"):
        assert training.MainThreadCPU().stop() is None
        return
    watch = training.MainThreadCPU()
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        pass
    time.sleep(1.0)
    result = watch.stop()
    assert 1.5 < result["wall_s"] <= 2.3
    assert 0.5 < result["cpu_s"] <= result["wall_s"]
    assert 0.5 < result["waiting_s"] and result["partly_off_cpu_s"] + result["waiting_s"] <= result["wall_s"] - 0.4
    assert not any(t.name == "first_step_cpu_sampler" for t in threading.enumerate())     # (stopped)


def test_rounds_time_the_variants_in_turns(tmp_path):
    rows = training.main(["--smoke", "--batch", "4", "--steps", "2", "--warmup", "1", "--variants", "eager", "ours",
                          "--no-gradient-check", "--rounds", "3", "--round-steps", "2", "--outdir", str(tmp_path)])
    for row in rows:
        assert len(row["img_s_rounds"]) == 3 and all(v > 0 for v in row["img_s_rounds"])
        assert row["img_s_interleaved"] > 0


def test_interleaved_alternates_the_order_and_sets_each_variants_backward():
    import conv_tutorial
    seen = []

    def step_of(variant):
        return lambda x, y: seen.append((variant, conv_tutorial.backward_backend()))
    before = conv_tutorial.backward_backend()
    try:
        seconds = training.interleaved({"compile": step_of("compile"), "ours-lesson06": step_of("ours-lesson06")},
                                       [(0, 0)], 2, 1, "cpu")
    finally:
        conv_tutorial.set_backward(before)
    assert {v: len(s) for v, s in seconds.items()} == {"compile": 2, "ours-lesson06": 2}
    # two untimed steps each; then round 0 in the given order and round 1 reversed, each turn an untimed step
    # and the timed one
    assert [v for v, _ in seen] == ["compile"] * 2 + ["ours-lesson06"] * 2 + [
        "compile"] * 2 + ["ours-lesson06"] * 4 + ["compile"] * 2
    assert all(backend == ("lesson06" if v == "ours-lesson06" else "torch") for v, backend in seen)


def test_rounds_must_be_counted_sensibly(tmp_path):
    with pytest.raises(ValueError, match="--round-steps"):
        training.main(["--smoke", "--rounds", "2", "--round-steps", "0", "--outdir", str(tmp_path)])


def test_the_pools_timeline_around_the_first_step(monkeypatch):
    """pool_timeline from compile_pool's timeline, entries made by hand (no compile runs on a CPU): the compiles
    of the pass (those submitted before it began are not), by where they ran, their seconds apart from the
    cache's loads, when the first and last finished and the step ran, relative to the pass's start, and one
    still running."""
    import collections
    from conv_tutorial import compile_pool
    entry = lambda where, submitted, started, finished: dict(kernel="k", where=where, submitted=submitted,  # noqa: E731
                                                             started=started, finished=finished)
    monkeypatch.setattr(compile_pool, "_TIMELINE", collections.deque([
        entry("worker", 5.0, 5.0, 9.0),           # (before the pass)
        entry("cache", 100.0, 100.0, 100.5), entry("worker", 100.1, 100.2, 103.2),
        entry("here", 100.2, 103.2, 110.0), entry("worker", 100.3, 104.0, None)]))
    summary = training.pool_timeline(100.0, 101.0, 120.0)
    assert summary["compiles"] == {"cache": 1, "worker": 2, "here": 1} and summary["unfinished"] == 1
    assert abs(summary["compile_s"] - 9.8) < 1e-9 and abs(summary["load_s"] - 0.5) < 1e-9
    assert (summary["first_finished_s"], summary["last_finished_s"]) == (0.5, 10.0)
    assert (summary["first_step_started_s"], summary["first_step_ended_s"]) == (1.0, 20.0)
    assert summary["native_building"] in (True, False)


def test_the_pools_timeline_is_in_the_first_step_of_the_operators_variants_compiled_ahead(tmp_path):
    rows = training.main(["--smoke", "--batch", "4", "--steps", "2", "--warmup", "1", "--variants", "eager", "ours",
                          "--no-gradient-check", "--compile-ahead", "--first-step-breakdown", "--outdir", str(tmp_path)])
    assert "compile_pool" not in rows[0]["first_step"]
    pool = rows[1]["first_step"]["compile_pool"]       # (a CPU: nothing compiled ahead)
    assert pool["compiles"] == {"cache": 0, "worker": 0, "here": 0} and pool["last_finished_s"] is None
    assert 0 <= pool["first_step_started_s"] < pool["first_step_ended_s"]
