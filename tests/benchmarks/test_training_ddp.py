"""benchmarks/training_ddp.py on a CPU (--smoke: two processes over gloo, a tiny network, the operator
falling back to torch): every variant trains under DistributedDataParallel and again in one process
over the same global batches, and the two agree step by step; what it writes has the issue's fields."""
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import training_ddp  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_smoke_run_trains_each_variant_on_two_processes_and_one(tmp_path):
    training_ddp.main(["--smoke", "--batch-per-gpu", "4", "--steps", "3", "--warmup", "1", "--variants", "eager",
                       "ours", "--compile-ahead", "--port", str(free_port()), "--outdir", str(tmp_path)])
    data = json.loads((tmp_path / "training_ddp.json").read_text())
    assert {"device", "gpus", "torch", "triton", "rows"} <= data.keys() and data["gpus"] == 2
    assert [(r["variant"], r["gpus"]) for r in data["rows"]] == [("eager", 2), ("eager", 1), ("ours", 2), ("ours", 1)]
    for row in data["rows"]:
        assert {"net", "batch_per_gpu", "gpus", "variant", "img_s", "scaling", "loss_50"} <= row.keys()
        assert row["img_s"] > 0 and len(row["losses"]) == 3 and row["loss_50"] is None
        # the same arithmetic in another order (fp32 sums): far inside the bf16 tolerance
        assert row["loss_gap"] < 1e-5 < row["loss_tolerance"]
    assert [row["scaling"] for row in data["rows"] if row["gpus"] == 1] == [1.0, 1.0]
    assert [row["scaling_back_to_back"] for row in data["rows"] if row["gpus"] == 1] == [1.0, 1.0]
    assert all(row["img_s_back_to_back"] > 0 for row in data["rows"])
    for row in data["rows"]:    # the two processes at once without DDP: DDP's share and the host's of the scaling
        if row["gpus"] == 1:
            assert row["img_s_at_once"] is row["ddp_efficiency"] is row["host_sharing"] is None
        else:
            assert row["img_s_at_once"] > 0
            assert abs(row["ddp_efficiency"] * row["img_s_at_once"] - row["img_s"]) < 1e-6 * row["img_s"]
            assert abs(row["ddp_efficiency"] * row["host_sharing"] - row["scaling"]) < 1e-9


def test_ddps_settings_reach_it_and_the_json(tmp_path):
    """--bucket-cap-mb, --gradient-as-bucket-view, --static-graph, --no-broadcast-buffers and --no-graph-split: the
    two processes train with them and the JSON says them (--no-at-once: no run without DDP, no fields from it).
    (The next test checks the keyword arguments they make; that run_variant hands them to
    DistributedDataParallel is not checked here.)"""
    training_ddp.main(["--smoke", "--batch-per-gpu", "4", "--steps", "2", "--warmup", "1", "--variants", "eager",
                       "--bucket-cap-mb", "1.5", "--gradient-as-bucket-view", "--static-graph", "--no-graph-split",
                       "--no-broadcast-buffers",
                       "--no-at-once", "--port", str(free_port()), "--outdir", str(tmp_path)])
    data = json.loads((tmp_path / "training_ddp.json").read_text())
    assert data["ddp"] == {"bucket_cap_mb": 1.5, "gradient_as_bucket_view": True, "static_graph": True,
                           training_ddp.NO_FORWARD_BROADCAST: False, "graph_split": False}
    assert all(row["img_s"] > 0 and row["img_s_at_once"] is None for row in data["rows"])


def test_ddp_options_from_the_command_line():
    args = training_ddp.parse(["--bucket-cap-mb", "50", "--gradient-as-bucket-view", "--static-graph",
                               "--no-broadcast-buffers"])
    assert training_ddp.ddp_options(args) == {"bucket_cap_mb": 50.0, "gradient_as_bucket_view": True,
                                              "static_graph": True, training_ddp.NO_FORWARD_BROADCAST: False}
    assert training_ddp.ddp_options(training_ddp.parse([])) == {}


def test_a_bucket_size_must_be_positive():
    import pytest
    with pytest.raises(ValueError, match="--bucket-cap-mb must be positive"):
        training_ddp.parse(["--bucket-cap-mb", "0"])


def test_gradients_taken_out_of_the_graphs_sum_as_accumulation_does():
    """The one-GPU run under CUDA graphs adds each chunk's gradients into sums of its own (a graph's next replay
    overwrites the gradients it output): the sums equal what AccumulateGrad gives without graphs, bit for
    bit, also for a parameter that gets its first gradient in a later chunk."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    late = torch.nn.Linear(5, 3)
    chunks = [torch.randn(6, 5) for _ in range(3)]

    def loss(i, x):
        out = model(x).square().mean()
        return out + late(x).sum() if i > 0 else out
    for i, x in enumerate(chunks):
        loss(i, x).backward()
    reference = [p.grad.clone() for p in [*model.parameters(), *late.parameters()]]
    for p in [*model.parameters(), *late.parameters()]:
        p.grad = None

    both = torch.nn.ModuleList([model, late])
    summed = None
    for i, x in enumerate(chunks):
        loss(i, x).backward()
        summed = training_ddp.gradients_out_of_the_graphs(both, summed)
        assert all(p.grad is None for p in both.parameters())
    assert all(torch.equal(summed[p], r) for p, r in zip(both.parameters(), reference))


def test_a_breakdown_says_where_a_steps_time_goes(tmp_path):
    """--breakdown: each run's row gains the host's and the step's time of a few more steps (the slowest rank's),
    and for the operator's variants its calls served in C++ and in Python a step (none in C++ on a CPU: its
    kernels are installed on a GPU only); the GPU's figures are None on a CPU."""
    training_ddp.main(["--smoke", "--batch-per-gpu", "4", "--steps", "3", "--warmup", "1", "--variants", "eager",
                       "ours", "--breakdown", "--port", str(free_port()), "--outdir", str(tmp_path)])
    rows = json.loads((tmp_path / "training_ddp.json").read_text())["rows"]
    for row in rows:
        parts = [row["breakdown"]] + ([row["breakdown_at_once"]] if row["gpus"] == 2 else [])
        assert "breakdown_at_once" in row or row["gpus"] == 1
        for figures in parts:
            assert 0 < figures["host_ms"] <= figures["step_ms"]
            assert figures["gpu_busy_ms"] is figures["nccl_ms"] is figures["kernels"] is None
            assert figures["gpu_forward_ms"] is figures["gpu_backward_ms"] is figures["gpu_optimizer_ms"] is None
            if row["variant"] == "ours":
                assert figures["native_served"] == 0 and figures["native_python"] == 0
                assert figures["native_declines"] == {}
            else:
                assert figures["native_served"] is figures["native_python"] is figures["native_declines"] is None


class Mark:
    """A stand-in for a recorded CUDA event at `at` milliseconds."""
    def __init__(self, at):
        self.at = at

    def elapsed_time(self, later):
        return later.at - self.at


def test_a_steps_phases_split_at_its_marks():
    """One chunk: start 0, forward to 5, backward to 12, optimizer to 13. Two chunks (the one-GPU run): the
    forwards 0-4 and 9-12, the backwards 4-9 and 12-20, then the optimizer 20-21."""
    assert training_ddp.phase_times([Mark(t) for t in (0, 5, 12, 13)]) == (5, 7, 1)
    assert training_ddp.phase_times([Mark(t) for t in (0, 4, 9, 12, 20, 21)]) == (7, 13, 1)


def test_steps_back_to_back_are_timed_in_windows_and_a_failure_is_said():
    """Every step of every window runs, each window gives seconds a step; a step that raises ends the timing with
    its error (a string), which the row carries instead of the figure."""
    issued = []
    windows = training_ddp.back_to_back_seconds(issued.append, "cpu", several=False)
    assert issued == list(range(training_ddp.BACK_TO_BACK_WINDOWS * training_ddp.BACK_TO_BACK_STEPS))
    assert len(windows) == training_ddp.BACK_TO_BACK_WINDOWS and all(w >= 0 for w in windows)

    def fails_in_the_second_window(i):
        if i == training_ddp.BACK_TO_BACK_STEPS + 1:
            raise RuntimeError("out of memory")
    assert training_ddp.back_to_back_seconds(fails_in_the_second_window, "cpu", several=False) == \
        "RuntimeError: out of memory"


def test_the_gpus_busy_time_counts_overlapping_kernels_once():
    assert training_ddp.union_length([]) == 0
    assert training_ddp.union_length([(0, 4), (2, 6), (10, 11), (3, 5)]) == 7     # [0, 6] and [10, 11]
    assert training_ddp.union_length([(5, 6), (0, 10)]) == 10                   # one inside another
    assert training_ddp.union_length([(0, 1), (1, 2)]) == 2                     # touching


def test_a_steps_device_figures_tell_nccl_and_copies_apart():
    """Two steps' GPU events (us): NCCL's kernels are summed apart from the busy time; copies and fills are
    counted among the events and on their own."""
    events = [("conv2d_fprop_kernel", 0, 1000), ("Memcpy DtoD (Device -> Device)", 500, 700),
              ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 800, 5800), ("triton_poi_fused_relu_0", 2000, 2500),
              ("Memset (Device)", 3000, 3100), ("conv2d_wgrad_kernel", 4000, 6000)]
    figures = training_ddp.device_figures(events, 2)
    assert figures["gpu_busy_ms"] == (1000 + 500 + 100 + 2000) / 1e3 / 2
    assert figures["nccl_ms"] == 5000 / 1e3 / 2
    assert figures["kernels"] == 3 and figures["copies"] == 1
    assert figures["copies_ms"] == (200 + 100) / 1e3 / 2


def test_rounds_in_turns_time_every_kept_run_again(tmp_path):
    """--rounds: after the variants' runs, their two-process runs (under DDP and at once without it) take turns;
    each N-process row gains each round's images/s and their medians, and DDP's share of them."""
    training_ddp.main(["--smoke", "--batch-per-gpu", "4", "--steps", "2", "--warmup", "1", "--variants", "eager",
                       "ours", "--rounds", "2", "--round-steps", "2", "--port", str(free_port()),
                       "--outdir", str(tmp_path)])
    rows = json.loads((tmp_path / "training_ddp.json").read_text())["rows"]
    for row in rows:
        if row["gpus"] == 1:
            assert "img_s_interleaved" not in row and "img_s_rounds" not in row
            continue
        assert "rounds_error" not in row
        for name in ("img_s", "img_s_at_once"):
            assert len(row[f"{name}_rounds"]) == 2 and all(v > 0 for v in row[f"{name}_rounds"])
            rounds = row[f"{name}_rounds"]
            assert min(rounds) * 0.999 <= row[f"{name}_interleaved"] <= max(rounds) * 1.001
        assert abs(row["ddp_efficiency_interleaved"] * row["img_s_at_once_interleaved"]
                   - row["img_s_interleaved"]) < 1e-6 * row["img_s_interleaved"]


def test_rounds_must_be_counted_and_steps_positive_and_variants_named_once():
    import pytest
    with pytest.raises(ValueError, match="--rounds must be >= 0 and --round-steps >= 1"):
        training_ddp.parse(["--rounds", "-1"])
    with pytest.raises(ValueError, match="--round-steps >= 1, got 2 and 0"):
        training_ddp.parse(["--rounds", "2", "--round-steps", "0"])
    with pytest.raises(ValueError, match="names a variant twice"):
        training_ddp.parse(["--variants", "eager", "ours", "eager"])


AGREEING_RANKS = """
import datetime, os, sys, time
sys.path.insert(0, {benchmarks!r})
import torch, torch.distributed as dist, torch.multiprocessing as mp
import training_ddp

def proc(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    step = lambda s: (torch.zeros(()), time.perf_counter())
    # rank 0 kept a run that rank 1 did not, and rank 1 one that rank 0 did not, in another order
    kept = ({{("a", 2): step, ("a", "at once"): step, ("c", 2): step}} if rank == 0 else
            {{("b", 2): step, ("c", 2): step, ("a", 2): step}})
    out = training_ddp.interleaved(kept, 2, 3, "cpu")
    line = f"RANK{{rank}}: {{[(key, [len(r) for r in rounds]) for key, rounds in out.items()]}}\\n"
    os.write(1, line.encode())     # (one write: the two processes share the pipe)
    dist.barrier()                 # (neither leaves while the other's last collective runs)
    dist.destroy_process_group()
    os._exit(0)                    # (gloo sometimes aborts in a process's own teardown: leave without it)

if __name__ == "__main__":
    mp.spawn(proc, args=(int(sys.argv[1]),), nprocs=2, join=True)
"""


def test_the_ranks_take_turns_with_the_runs_they_all_kept(tmp_path):
    """The rounds' collectives pair up only if every rank times the same runs in the same order: a run kept on
    one rank only (its set-up failed on another) is left out on every rank, and the rest go in rank 0's order."""
    import subprocess
    script = tmp_path / "agreeing_ranks.py"
    script.write_text(AGREEING_RANKS.format(benchmarks=str(Path(training_ddp.__file__).parent)))
    proc = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RANK"))
    expected = "[(('a', 2), [3, 3]), (('c', 2), [3, 3])]"
    assert lines == [f"RANK0: {expected}", f"RANK1: {expected}"], proc.stdout


def test_compiled_autograd_trains_under_ddp_and_the_json_says_so(tmp_path):
    """--compiled-autograd: the operator's variant trains on two processes with its backward under compiled autograd
    and DDP's Python reducer, step by step as one process does, and each row counts the backward graphs captured."""
    training_ddp.main(["--smoke", "--batch-per-gpu", "4", "--steps", "2", "--warmup", "1", "--variants", "ours",
                       "--compiled-autograd", "--no-at-once", "--port", str(free_port()), "--outdir", str(tmp_path)])
    data = json.loads((tmp_path / "training_ddp.json").read_text())
    assert data["ddp"] == {"graph_split": False, "compiled_autograd": True}
    assert [(r["variant"], r["gpus"]) for r in data["rows"]] == [("ours", 2), ("ours", 1)]
    assert all(r["img_s"] > 0 and r["loss_gap"] < 1e-5 for r in data["rows"])
    # (every run's backward went through compiled autograd: its capture counted in the run's own row)
    assert all(r["compiled_autograd_captures"] >= 1 for r in data["rows"]), data["rows"]


def test_compiled_backward_runs_the_backward_through_compiled_autograd():
    """The context of --compiled-autograd: a compiled variant's backward is captured by compiled autograd (its
    counter moves) and gives autograd's gradients; eager's backward stays eager."""
    import torch
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    x = torch.randn(6, 5)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    for variant, captured in (("eager", 0), ("compile", 1)):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        before = counters["compiled_autograd"]["captures"]
        with training_ddp.compiled_backward(variant):
            model(x).square().sum().backward()
        assert counters["compiled_autograd"]["captures"] - before == captured, variant
        for p, g in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, g)


def test_compiled_autograd_and_no_graph_split_are_refused_together():
    import pytest
    with pytest.raises(ValueError, match="--compiled-autograd and --no-graph-split"):
        training_ddp.parse(["--compiled-autograd", "--no-graph-split"])
    with pytest.raises(ValueError, match="leave 'eager' out"):
        training_ddp.parse(["--compiled-autograd", "--variants", "eager", "ours"])
