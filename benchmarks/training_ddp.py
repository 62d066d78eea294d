"""Training steps under DistributedDataParallel, one process per GPU, against one GPU on the same batches.

    torchrun --nproc-per-node N benchmarks/training_ddp.py [--nets resnet50] [--batch-per-gpu 128]
        [--steps 50] [--warmup 5] [--variants compile ours-lesson06-bnstats ...] [--compile-ahead] [--outdir DIR]
        [--bucket-cap-mb MB] [--gradient-as-bucket-view] [--static-graph] [--no-broadcast-buffers]
        [--no-graph-split]                                                                      # DDP's settings
        [--compiled-autograd]             # the backward under compiled autograd, DDP's Python reducer
        [--no-at-once]                                          # leave out the N processes without DDP
        [--breakdown]                     # where a step's time goes: host, GPU, NCCL, the operator's C++ calls
        [--rounds R] [--round-steps K]    # then the N-process runs again, in turns: R rounds of K steps
    python benchmarks/training_ddp.py --smoke [--outdir DIR]    # two CPU processes over gloo: checks the script

Every process runs the same variants as benchmarks/training.py (its `prepared`: eager, torch.compile in
its default mode or with CUDA graphs, the operator's recipe), with DistributedDataParallel wrapped
around the prepared module before torch.compile (DDP's graph breaks at its buckets are torch.compile's
own), over NCCL (gloo for --smoke) with NVLink multicast off (NCCL_NVLS_ENABLE=0, set here unless the
environment sets it). Each step's global batch is N chunks of --batch-per-gpu images (random, chunk c
of step s seeded by (s, c), made on the GPU); rank r trains on chunk r, DDP averages the gradients.

Then rank 0 alone runs the same variant on one GPU over the same global batches, accumulating the N
chunks' gradients before each optimizer step: the same arithmetic as DDP's (BatchNorm's statistics
per chunk, as each GPU computes them; the gradient the mean of the chunks'), summed in another order.
It gives the scaling's baseline and the losses to compare. Between the two (unless --no-at-once), every
rank trains the same variant on its own chunk at the same time without DDP: no gradient crosses between
the GPUs, and the host's cores, memory and PCIe serve N training processes as they do under DDP. It
splits what the scaling loses into DDP's own cost and the cost of N processes sharing one host (a
default-mode step, host-bound, slows when N of them run at once):
- img_s: images per second in all, the global batch over the median step (each step synchronized;
  the slowest rank's time); per GPU: img_s / N.
- scaling: img_s over N times the one-GPU run's img_s (1.0: linear).
- img_s_back_to_back, scaling_back_to_back: the same from windows of steps issued back to back, with no
  synchronization between them (`back_to_back_seconds`; each step's chunks, random images made on the GPU,
  within the window), as a training loop runs: the host issues a step while the GPU runs the one before, so
  host work before a step's first kernel (DDP's buffer broadcast, a graph's replay) hides behind the GPU's,
  where each timed step starts on an idle GPU. After the run's other steps (and the breakdown's); a step that
  failed there: back_to_back_error, and None for both.
- img_s_at_once: the N processes without DDP, images per second in all (the same median of the slowest
  rank's steps); ddp_efficiency: img_s over img_s_at_once, what DDP itself keeps; host_sharing:
  img_s_at_once over N times the one-GPU run's img_s, what sharing the host keeps, and also what an
  optimizer step per chunk costs beside one per N chunks (the one-GPU run's; a few percent of a
  default-mode step). Their product is the scaling. at_once_error: why that run failed, if it did.
- with --breakdown, "breakdown" (and "breakdown_at_once" for the N processes without DDP): a few steps
  more, timed apart (`step_breakdown`): the host's time to issue a step beside the step's, the GPU's time in
  the forward, the backward and the optimizer's step (CUDA events, so under CUDA graphs too), the GPU's busy
  time, NCCL's, kernels a step and the copies and fills among them; and for the operator's variants
  its calls per timed step (per optimizer step: N chunks' calls in the one-GPU run; none under CUDA graphs,
  whose replays skip the dispatcher) served in C++ (`native_served`) and sent to its Python kernel (`native_python`), and why
  those went there (`native_declines`: {reason: calls}, per kernel a call passed, conv_tutorial.native.declines);
  "breakdown_error" where the breakdown failed (the run's other figures stand).
- with --rounds, after every variant's runs, the N-process runs of them all (under DDP, and at once without it)
  take turns, R rounds of K steps each (`interleaved`; R even balances the order), each round timing them all on
  the same host: a default-mode step is host-bound, and a run timed minutes after another can find the host
  faster or slower (RESULTS.md, "Training on several GPUs": two runs of the same command on four GPUs,
  another machine and another variant order, moved the operator's figures by up to 1.7x). Rank 0's N-GPU rows gain
  img_s_interleaved (the global batch over the median step of all rounds) and img_s_rounds (each round's),
  img_s_at_once_interleaved and img_s_at_once_rounds, and ddp_efficiency_interleaved; or rounds_error (a
  step failed, or the run was not kept on every rank). Every variant's N-process runs (models, gradients,
  optimizer state, CUDA graphs) stay alive until the rounds: memory for 2 x the variants' models per GPU.
"native_built": whether the operator's C++ kernels were built before the first run (None: no operator
variant, or a CPU).
- loss_gap: the largest |loss difference| per step between the N-GPU run and the one-GPU run, beside
  `loss_tolerance`: the two runs differ in the order of the gradients' fp32 sums, and through training
  that difference reaches the bf16 rounding of the convs' outputs; the tolerance is two bf16 roundings
  (2 x 2^-8) of the first step's loss.
DDP's settings (the same for every variant; DDP's defaults unless given): --bucket-cap-mb, the size of its
gradient buckets (25 MB); --gradient-as-bucket-view, gradients as views into the buckets (no copy into them);
--static-graph, DDP's static_graph (the same parameters take part in every step: DDP skips looking for unused
ones and settles its buckets once; torch's DDP does not take it with no_sync, pytorch/pytorch#143580);
--no-broadcast-buffers, DDP's broadcast_buffers off (forward_sync_buffers from torch 2.14: `NO_FORWARD_BROADCAST`;
by default DDP broadcasts rank 0's buffers, BatchNorm's running statistics, before every forward: a collective
each step; training's losses do not depend on them); --no-graph-split, torch._dynamo.config.optimize_ddp off: torch.compile keeps
the whole model one graph instead of breaking it at each bucket, so every all-reduce waits for the backward's
end; --compiled-autograd, the compiled variants' backward under compiled autograd (compiled with the forward's
mode) and DDP's Python reducer (torch._dynamo.config.optimize_ddp = "python_reducer", which compiled autograd
needs; whether its all-reduces land in the backward's graph is not checked here), in every run of the variant
(DDP, at once, one GPU); each row gains compiled_autograd_captures, the backward graphs compiled autograd
captured over that run's steps (warm-up included; rank 0's count); refused with eager (the Python reducer is the
whole process's: eager's DDP would lose its buckets).
JSON (training_ddp.json): {"device", "gpus", "torch", "triton", "steps", "warmup", "rounds", "round_steps", "ddp",
"native_built", "rows": [{"net",
"batch_per_gpu", "gpus", "variant", "img_s", "img_s_per_gpu", "scaling", "img_s_back_to_back", "scaling_back_to_back", ["back_to_back_error"],
"img_s_at_once", "ddp_efficiency",
"host_sharing", ["at_once_error"], "loss_50", "loss_last", "losses", "loss_gap", "loss_tolerance",
["compiled_autograd_captures"], ["breakdown", "breakdown_at_once"], [the --rounds fields]}]}; a row per variant for N GPUs and one for the one-GPU run (gpus 1,
scaling 1.0), or {"net", "variant", "gpus", "error"} for a variant that failed.
"""
import argparse
import contextlib
import datetime
import functools
import inspect
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import training  # noqa: E402

BF16_ROUNDING = 2.0 ** -8


def chunk(step, index, batch, size, classes, device):
    """Chunk `index` of step `step`'s global batch: the same images wherever it is made."""
    generator = torch.Generator(device=device).manual_seed(1_000_003 * step + index + 1)
    x = torch.randn(batch, 3, size, size, generator=generator, device=device)
    y = torch.randint(0, classes, (batch,), generator=generator, device=device)
    return x.contiguous(memory_format=torch.channels_last), y


def run_variant(variant, net, fp32_model, chunks, steps, warmup, device, ddp, autocast, compile_ahead=False,
                ddp_options=None, own_chunk=False, breakdown=False, keep=None, compiled_autograd=False):
    """(losses per step, seconds per timed step, breakdown, captures, back-to-back seconds) of one variant: with `ddp` this rank's chunk of each
    step under DistributedDataParallel, with `own_chunk` (every rank at once) this rank's chunk without DDP,
    else every chunk of each step accumulated before the optimizer's step. Under `ddp` or `own_chunk` a
    step's seconds are the slowest rank's and its loss the mean of the ranks' (under `ddp`, what DDP's
    gradient is of), and a step that fails on one rank raises on every rank. `compile_ahead`: the
    operator's variants compile their kernels side by side first (conv_tutorial.compile_kernels_ahead,
    on the module DDP wraps: its pass reaches no DDP hook).
    `ddp_options`: DistributedDataParallel's keyword arguments beyond its devices (`ddp_settings`).
    `breakdown`: after the steps, `step_breakdown`'s figures of a few more (else None).
    Then the steps back to back: `back_to_back_seconds`' (after the breakdown's steps, if any, and the count of
    captures).
    `compiled_autograd`: each backward under `compiled_backward(variant)`; captures, the backward graphs compiled
    autograd captured on this rank over the run's steps (torch._dynamo's counter; None without it)."""
    import copy
    import conv_tutorial
    torch._dynamo.reset()
    conv_tutorial.reset_backward_fallbacks()
    model = copy.deepcopy(fp32_model).to(device).to(memory_format=torch.channels_last)
    wrap = None
    if ddp:
        wrap = lambda module: torch.nn.parallel.DistributedDataParallel(  # noqa: E731
            module, device_ids=[torch.cuda.current_device()] if device == "cuda" else None, **(ddp_options or {}))
    model, step_model = training.prepared(variant, model, wrap)
    model.train()
    if compile_ahead and variant.startswith("ours"):
        conv_tutorial.compile_kernels_ahead(model, chunks(0, 0)[0], autocast_dtype=torch.bfloat16 if autocast else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    graphs_output_grads = variant.endswith("-cudagraphs") and device == "cuda"
    several = ddp or own_chunk

    def one_step(s, marks=None):
        """Step `s` on its chunks (made first), its loss (a tensor) and the second its work was issued at.
        `marks` (a list; CUDA only): gains a CUDA event recorded at the step's start, after each chunk's
        forward and after its backward, and after the optimizer's step (`phase_times`)."""
        parts = [chunks(s, dist.get_rank())] if several else [chunks(s, c) for c in range(dist.get_world_size())]
        start = time.perf_counter()
        mark = (lambda: None) if marks is None else (lambda: marks.append(recorded_event()))
        mark()
        optimizer.zero_grad(set_to_none=True)
        total, summed = 0.0, None
        for x, y in parts:
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(step_model(x), y) / len(parts)
            mark()
            with compiled_backward(variant) if compiled_autograd else contextlib.nullcontext():
                loss.backward()
            mark()
            total = total + loss.detach()
            if graphs_output_grads and len(parts) > 1:
                summed = gradients_out_of_the_graphs(model, summed)
        if summed is not None:
            for parameter, grad in summed.items():
                parameter.grad = grad
        optimizer.step()
        mark()
        return total, start

    losses, seconds = [], []
    native_before = None
    captures_before = compiled_autograd_captures() if compiled_autograd else None
    for s in range(steps):
        if s == warmup:
            native_before = native_calls()
        failure = None
        try:
            total, start = one_step(s)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as error:     # noqa: BLE001  (raised below, on every rank at once)
            if not several:
                raise
            failure, total, start = error, 0.0, time.perf_counter()
        elapsed = time.perf_counter() - start
        if several:     # (a failure on one rank under DDP may leave the others in DDP's own all-reduce)
            both = torch.tensor([elapsed, float(total), float(failure is not None)], dtype=torch.float64,
                                device=device)
            slowest = both[:1].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(both[1:], op=dist.ReduceOp.SUM)
            if failure is not None:
                raise failure
            if float(both[2]):
                raise RuntimeError(f"step {s} failed on another rank")
            elapsed, total = float(slowest), float(both[1]) / dist.get_world_size()
        if s >= warmup:
            seconds.append(elapsed)
        losses.append(float(total))
    figures = None
    if breakdown:
        native_after = native_calls()
        timed = steps - warmup
        figures = {"native_served": None, "native_python": None, "native_declines": None}
        if variant.startswith("ours"):
            figures = {"native_served": (native_after["native_served"] - native_before["native_served"]) / timed,
                       "native_python": (native_after["native_python"] - native_before["native_python"]) / timed,
                       "native_declines": {why: (n - native_before["native_declines"].get(why, 0)) / timed
                                           for why, n in native_after["native_declines"].items()
                                           if n > native_before["native_declines"].get(why, 0)}}
        try:
            figures.update(step_breakdown(lambda i, marks=None: one_step(steps + i, marks), device, several,
                                          profiled=not variant.endswith("-cudagraphs")))
        except Exception as error:    # noqa: BLE001  (the run's own figures stand without it)
            figures["breakdown_error"] = f"{type(error).__name__}: {error}"[:400]
    captures = None if captures_before is None else compiled_autograd_captures() - captures_before
    back_to_back = back_to_back_seconds(lambda i: one_step(steps + 2 * BREAKDOWN_STEPS + i), device, several)
    if keep is not None:      # (its model, gradients and optimizer state stay alive for the rounds)
        keep(one_step)
    return losses, seconds, figures, captures, back_to_back


BACK_TO_BACK_WINDOWS, BACK_TO_BACK_STEPS = 3, 8


def back_to_back_seconds(one_step, device, several):
    """Seconds a step, in BACK_TO_BACK_WINDOWS windows of BACK_TO_BACK_STEPS steps issued one after another with
    no synchronization between them (`one_step(i)` issues step i, its chunks made within the window: random
    images on the GPU), as a training loop runs: the host issues a step while the GPU still runs the one before,
    where the timed steps each start on an idle GPU. Each window starts together on every rank (a barrier) and
    ends when the GPU finished; across ranks the slowest's. A step that fails (on any rank, every rank says it)
    gives its error instead, a string: the run's other figures stand."""
    windows = []
    for w in range(BACK_TO_BACK_WINDOWS):
        if several:
            dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        begin, failure = time.perf_counter(), None
        try:
            for i in range(BACK_TO_BACK_STEPS):
                one_step(w * BACK_TO_BACK_STEPS + i)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as error:     # noqa: BLE001  (said on every rank at once, as the timed steps' failures)
            failure = error
        elapsed = (time.perf_counter() - begin) / BACK_TO_BACK_STEPS
        failed_anywhere = failure is not None
        if several:
            both = torch.tensor([elapsed, float(failed_anywhere)], dtype=torch.float64, device=device)
            slowest = both[:1].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(both[1:], op=dist.ReduceOp.SUM)
            elapsed, failed_anywhere = float(slowest), bool(float(both[1]))
        if failed_anywhere:
            return (f"{type(failure).__name__}: {failure}"[:400] if failure is not None
                    else "a step failed on another rank")
        windows.append(elapsed)
    return windows


def native_calls():
    """{"native_served", "native_python", "native_declines"}: the operator's calls so far, over all its
    operators, served in C++ and sent to its Python kernel, and why those went there ({reason: calls};
    conv_tutorial.native.counts() and .declines(); zeros before its kernels are installed)."""
    from conv_tutorial import native
    counts = native.counts().values()
    declines = {}
    for reasons in native.declines().values():
        for why, n in reasons.items():
            declines[why] = declines.get(why, 0) + n
    return {"native_served": sum(c[0] for c in counts), "native_python": sum(c[1] for c in counts),
            "native_declines": declines}


BREAKDOWN_STEPS = 3


def union_length(intervals):
    """The length of the union of (start, end) intervals: the time at least one of them covers."""
    length, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            length, end = length + (b - a), b
        elif b > end:
            length, end = length + (b - end), b
    return length


PHASES = ("gpu_forward_ms", "gpu_backward_ms", "gpu_optimizer_ms")


def recorded_event():
    """A CUDA event recorded now on the current stream (timed)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def phase_times(marks):
    """(forward, backward, optimizer) GPU milliseconds of one step from its `marks` (one_step's events, the
    GPU finished with them): the chunks' forwards summed (from the step's start or the last backward's end:
    zero_grad and, under DDP, its buffer broadcast before the forward, included; in the one-GPU run under
    CUDA graphs, the previous chunk's gradients taken into their sums too), their backwards summed (under DDP,
    the wait for the last bucket's all-reduce included), then the optimizer's step (in that run, after the
    last chunk's gradient sums)."""
    forward = sum(marks[k].elapsed_time(marks[k + 1]) for k in range(0, len(marks) - 2, 2))
    backward = sum(marks[k].elapsed_time(marks[k + 1]) for k in range(1, len(marks) - 2, 2))
    return forward, backward, marks[-2].elapsed_time(marks[-1])


def step_breakdown(one_step, device, several, profiled=True):
    """Where a step's time goes, from BREAKDOWN_STEPS more steps (`one_step(i, marks)` issues step i, its
    chunks made first, and records its phases' CUDA events into `marks`, a list, unless None):
    - host_ms: the host's time to issue a step (from its start until it returns, the GPU idle before
      it), the median; across ranks the slowest's;
    - step_ms: the same steps' time until the GPU finished them;
    - gpu_forward_ms, gpu_backward_ms, gpu_optimizer_ms: the same steps' GPU time between CUDA events at the
      phases' ends (`phase_times`; idle time between kernels included, so under CUDA graphs too), the median;
      across ranks the slowest's; None on a CPU;
    - with `profiled` (not for CUDA graphs: profiling replays of graphs captured before the profiler
      first started is unreliable), from torch.profiler over as many steps more, each rank's own,
      rank 0's kept: gpu_busy_ms, the time a step keeps the GPU busy with kernels other than NCCL's
      (their intervals' union; the chunks' random images and copies included); nccl_ms, the time
      NCCL's kernels ran (waiting for the other ranks included); kernels, the kernels, copies and
      fills a step; copies and copies_ms, the copies and fills among them (`device_figures`). None on a
      CPU or without `profiled`.
    A step whose step_ms is near its host_ms and well above its gpu_busy_ms waits on the host. A
    profiler that fails to start on one rank skips the profile on every rank (its steps have DDP's
    collectives)."""
    host, whole, phases = [], [], []
    for i in range(BREAKDOWN_STEPS):
        marks = [] if device == "cuda" else None
        if device == "cuda":
            torch.cuda.synchronize()
        _, start = one_step(i, marks)
        issued = time.perf_counter()
        if device == "cuda":
            torch.cuda.synchronize()
            phases.append(phase_times(marks))
        host.append(issued - start)
        whole.append(time.perf_counter() - start)
    figures = {"host_ms": 1e3 * statistics.median(host), "step_ms": 1e3 * statistics.median(whole),
               **{name: statistics.median(step[k] for step in phases) if phases else None
                  for k, name in enumerate(PHASES)}}
    if several:
        kept = [name for name in ("host_ms", "step_ms", *PHASES) if figures[name] is not None]
        slowest = torch.tensor([figures[name] for name in kept], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        figures.update(zip(kept, map(float, slowest)))
    figures.update(gpu_busy_ms=None, nccl_ms=None, kernels=None, copies=None, copies_ms=None)
    if device != "cuda" or not profiled:
        return figures
    from torch.profiler import ProfilerActivity, profile
    prof, started = profile(activities=[ProfilerActivity.CUDA]), True
    try:
        prof.__enter__()
    except Exception as error:     # noqa: BLE001
        started, figures["profile_error"] = False, f"{type(error).__name__}: {error}"[:400]
    everyone = torch.tensor([float(started)], device=device)
    if several:
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if not float(everyone):
        if started:
            prof.__exit__(None, None, None)
        return figures
    try:
        for i in range(BREAKDOWN_STEPS):
            one_step(BREAKDOWN_STEPS + i)
        torch.cuda.synchronize()
    finally:
        prof.__exit__(None, None, None)
    figures.update(device_figures([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                                   if e.device_type == torch.autograd.DeviceType.CUDA], BREAKDOWN_STEPS))
    return figures


def device_figures(events, steps):
    """From the profiler's GPU events of `steps` steps ((name, start us, end us)), per step: gpu_busy_ms, the
    union of the intervals of every event but NCCL's (copies and fills included); nccl_ms, NCCL's kernels'
    summed time; kernels, the events in all (copies and fills included, as before `copies` was counted);
    copies, the copies and fills among them (the profiler names them Memcpy and Memset), and copies_ms,
    their summed time."""
    nccl = [(a, b) for name, a, b in events if "nccl" in name.lower()]
    copies = [(a, b) for name, a, b in events if name.startswith(("Memcpy", "Memset"))]
    return {"gpu_busy_ms": union_length([(a, b) for name, a, b in events if "nccl" not in name.lower()]) / 1e3 / steps,
            "nccl_ms": sum(b - a for a, b in nccl) / 1e3 / steps, "kernels": len(events) / steps,
            "copies": len(copies) / steps, "copies_ms": sum(b - a for a, b in copies) / 1e3 / steps}


def gradients_out_of_the_graphs(model, summed):
    """Accumulating chunks under CUDA graphs (reduce-overhead): each parameter's gradient after a chunk's
    backward is that graph's output (AccumulateGrad keeps the tensor it is given), which the next chunk's
    replay overwrites; so the gradients are added into `summed` ({parameter: fp32 sum}, made on the
    first chunk) and taken off the parameters: one foreach call a chunk (two where a parameter gets its
    first gradient after the first chunk); the caller sets the sums as the gradients before the
    optimizer's step."""
    summed = {} if summed is None else summed
    parameters = [p for p in model.parameters() if p.grad is not None]
    seen = [p for p in parameters if p in summed]
    new = [p for p in parameters if p not in summed]
    if seen:
        torch._foreach_add_([summed[p] for p in seen], [p.grad for p in seen])
    if new:
        summed.update(zip(new, torch._foreach_mul([p.grad for p in new], 1.0)))
    for parameter in parameters:
        parameter.grad = None
    return summed


def measure(args, device, size, classes, nets):
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for net in nets:
        fp32_model = training.initial_model(net)
        chunks = lambda s, c: chunk(s, c, args.batch_per_gpu, size, classes, device)  # noqa: E731
        kept = {}
        for variant in args.variants:
            row = {"net": net, "batch_per_gpu": args.batch_per_gpu, "variant": variant}
            results = {}
            runs = (world, "at once", 1) if args.at_once and world > 1 else (world, 1)
            for gpus in runs:
                try:
                    if gpus != 1 or rank == 0:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            results[gpus] = run_variant(variant, net, fp32_model, chunks, args.steps, args.warmup,
                                                        device, gpus == world and world > 1, device == "cuda",
                                                        args.compile_ahead, ddp_options(args),
                                                        own_chunk=gpus == "at once", breakdown=args.breakdown,
                                                        keep=None if not args.rounds or gpus == 1 else
                                                        (lambda step, key=(variant, gpus): kept.update({key: step})),
                                                        compiled_autograd=args.compiled_autograd)
                except Exception as error:            # noqa: BLE001  (recorded: the other variants still run)
                    results[gpus] = f"{type(error).__name__}: {error}"[:400]
                dist.barrier()
            if isinstance(results.get(world), str):     # (no DDP figures to set the at-once run's beside)
                kept.pop((variant, "at once"), None)
            if rank != 0:
                continue
            global_batch = args.batch_per_gpu * world
            one = results[1]
            unit = "GPU(s)" if device == "cuda" else "process(es)"
            at_once = results.get("at once")
            at_once_img_s = None if at_once is None or isinstance(at_once, str) else \
                global_batch / statistics.median(at_once[1])
            if isinstance(at_once, str):
                print(f"  {net:<12} {variant:<34} {world} {unit} at once without DDP: failed: {at_once}", flush=True)
            for gpus in (world, 1):
                got = results[gpus]
                if isinstance(got, str):
                    rows.append({**row, "gpus": gpus, "error": got})
                    print(f"  {net:<12} {variant:<34} {gpus} {unit}: failed: {got}", flush=True)
                    continue
                losses, seconds, figures, captures, windows = got
                img_s = global_batch / statistics.median(seconds)
                one_img_s = None if isinstance(one, str) else global_batch / statistics.median(one[1])
                img_s_b2b = None if isinstance(windows, str) else global_batch / statistics.median(windows)
                one_b2b = None if isinstance(one, str) or isinstance(one[4], str) else \
                    global_batch / statistics.median(one[4])
                gap = None if isinstance(one, str) else max(abs(a - b) for a, b in zip(losses, one[0]))
                shared = gpus > 1 and at_once_img_s is not None
                rows.append({**row, "gpus": gpus, "img_s": img_s, "img_s_per_gpu": img_s / gpus,
                             "scaling": None if one_img_s is None else img_s / (gpus * one_img_s),
                             "img_s_back_to_back": img_s_b2b,
                             "scaling_back_to_back": None if one_b2b is None or img_s_b2b is None
                             else img_s_b2b / (gpus * one_b2b),
                             **({"back_to_back_error": windows} if isinstance(windows, str) else {}),
                             "img_s_at_once": at_once_img_s if shared else None,
                             "ddp_efficiency": img_s / at_once_img_s if shared else None,
                             "host_sharing": (at_once_img_s / (gpus * one_img_s)
                                              if shared and one_img_s is not None else None),
                             **({"at_once_error": at_once} if gpus > 1 and isinstance(at_once, str) else {}),
                             "loss_50": losses[49] if len(losses) >= 50 else None, "loss_last": losses[-1],
                             "losses": losses, "loss_gap": gap,
                             "loss_tolerance": 2 * BF16_ROUNDING * abs(losses[0]),
                             **({"compiled_autograd_captures": captures} if args.compiled_autograd else {})})
                if args.breakdown:
                    rows[-1]["breakdown"] = figures
                    if gpus > 1:
                        rows[-1]["breakdown_at_once"] = None if at_once is None or isinstance(at_once, str) \
                            else at_once[2]
                r = rows[-1]
                print(f"  {net:<12} {variant:<34} {gpus} {unit}: {img_s:8.0f} img/s ({r['img_s_per_gpu']:.0f} each)"
                      + ("" if r["scaling"] is None else f", scaling {r['scaling']:.2f}")
                      + (f"; back to back: failed: {windows}" if img_s_b2b is None
                         else f"; back to back {img_s_b2b:.0f} img/s")
                      + ("" if r["scaling_back_to_back"] is None else f", scaling {r['scaling_back_to_back']:.2f}")
                      + ("" if r["ddp_efficiency"] is None else
                         f" (at once without DDP {at_once_img_s:.0f} img/s: DDP keeps {r['ddp_efficiency']:.2f}"
                         + ("" if r["host_sharing"] is None else f", the shared host {r['host_sharing']:.2f}") + ")")
                      + ("" if gap is None else f", largest loss gap to one GPU {gap:.4f} "
                                                f"(tolerance {r['loss_tolerance']:.4f})")
                      + ("" if all(math.isfinite(v) for v in losses) else ", loss not finite"), flush=True)
                if args.breakdown:
                    for label, f in (("", figures), (" at once", r.get("breakdown_at_once"))):
                        if f:
                            print(f"      {label or ' ' + str(gpus) + ' ' + unit}: " + ", ".join(
                                f"{k} {v:.1f}" if isinstance(v, (int, float)) else f"{k} {v}"
                                for k, v in f.items() if v is not None), flush=True)
        if args.rounds and world > 1:      # (on every rank, whatever it kept: the ranks agree on the runs first)
            in_turns(args, [row for row in rows if row["net"] == net], kept, device)
            kept.clear()
    return rows


def in_turns(args, net_rows, kept, device):
    """The N-process runs kept (`kept`: {(variant, N or "at once"): its step}) timed again in turns
    (`interleaved`), their figures added to rank 0's rows of the N-GPU runs: img_s_interleaved and
    img_s_rounds (each round's), img_s_at_once_interleaved and img_s_at_once_rounds, ddp_efficiency_interleaved;
    or rounds_error, if a step failed or a run was not kept on every rank."""
    world = dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timed = interleaved(kept, args.rounds, args.round_steps, device)
    if dist.get_rank() != 0:
        return
    by_variant = {row["variant"]: row for row in net_rows if row["gpus"] == world and "img_s" in row}
    for variant, run in kept:
        if not isinstance(timed, str) and (variant, run) not in timed and variant in by_variant:
            by_variant[variant]["rounds_error"] = f"the run {run!r} was not kept on every rank"
    if isinstance(timed, str):
        for row in by_variant.values():
            row["rounds_error"] = timed
        print(f"  the rounds in turns failed: {timed}", flush=True)
        return
    global_batch = args.batch_per_gpu * world
    for (variant, run), per_round in timed.items():
        row = by_variant.get(variant)
        if row is None:
            continue
        name = "img_s" if run == world else "img_s_at_once"
        row[f"{name}_interleaved"] = global_batch / statistics.median([t for times in per_round for t in times])
        row[f"{name}_rounds"] = [global_batch / statistics.median(times) for times in per_round]
    first = by_variant.get(args.variants[0])
    for variant, row in by_variant.items():
        if "img_s_interleaved" not in row:
            continue
        if "img_s_at_once_interleaved" in row:
            row["ddp_efficiency_interleaved"] = row["img_s_interleaved"] / row["img_s_at_once_interleaved"]
        unit = "GPU(s)" if device == "cuda" else "process(es)"
        line = (f"  {row['net']:<12} {variant:<34} {world} {unit}: {row['img_s_interleaved']:8.0f} img/s in "
                f"{args.rounds} rounds of {args.round_steps} steps in turns")
        if "ddp_efficiency_interleaved" in row:
            line += (f"; at once without DDP {row['img_s_at_once_interleaved']:.0f} img/s: DDP keeps "
                     f"{row['ddp_efficiency_interleaved']:.2f}")
        if first is not None and "img_s_rounds" in first and variant != args.variants[0]:
            ratios = [a / b for a, b in zip(row["img_s_rounds"], first["img_s_rounds"])]
            line += (f"; against {args.variants[0]} round by round: median {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f}x)")
        print(line, flush=True)


def interleaved(kept, rounds, round_steps, device):
    """Seconds of each kept run's steps timed in turns (training.py's `take_turns`, as its `interleaved`
    times its variants): the ranks first agree on the runs every one of them kept (a run set up on some
    ranks only is left out), in rank 0's order; torch._dynamo.reset() on every rank (the ranks' caches
    alike: rank 0's one-GPU runs reset its own), so the turns' first untimed steps compile every run again
    from the caches the runs filled. Runs timed one after another move apart when the host does; in
    turns, each round sees the same host. Every rank takes the same turns (DDP's collectives); a step's
    seconds are the slowest rank's. Returns {key: [each round's step seconds]} for the agreed runs, or the
    error's text if a step failed on every rank, or on one before DDP's all-reduces (every rank stops at that
    step). A step that fails on one rank inside DDP's all-reduces leaves the others waiting in them: the job
    ends at NCCL's time-out, as in the runs themselves."""
    import conv_tutorial
    mine = [repr(key) for key in kept]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    order = sorted((key for key in kept if all(repr(key) in other for other in everyone)),
                   key=lambda key: everyone[0].index(repr(key)))
    if not order:
        return {}
    torch._dynamo.reset()
    step_numbers = iter(range(10 ** 6, 10 ** 7))      # (chunks past the runs' own steps)

    def run(key, _):
        conv_tutorial.set_backward(training.backward_of(key[0]))
        failure, start = None, time.perf_counter()
        try:
            _, start = kept[key](next(step_numbers))
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as error:     # noqa: BLE001  (raised below on every rank at once)
            failure = error
        both = torch.tensor([time.perf_counter() - start, float(failure is not None)], dtype=torch.float64,
                            device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if float(both[1]):
            raise RuntimeError("a step failed on another rank")
        return float(both[0])

    try:
        with training.compiled_side_by_side(len(order)):
            return training.take_turns(order, run, rounds, round_steps)
    except Exception as error:     # noqa: BLE001  (the runs' own figures stand)
        return f"{type(error).__name__}: {error}"[:400]


def compiled_autograd_captures():
    """The backward graphs compiled autograd has captured in this process so far (torch._dynamo's counter)."""
    from torch._dynamo.utils import counters
    return counters["compiled_autograd"]["captures"]


def compiled_backward(variant):
    """The context a backward runs in under --compiled-autograd: compiled autograd, compiling the backward's graph
    with torch.compile in the variant's mode (eager's backward stays eager)."""
    if variant == "eager":
        return contextlib.nullcontext()
    from torch._dynamo import compiled_autograd
    return compiled_autograd._enable(_backward_compiler(training.compile_mode(variant)))


@functools.cache
def _backward_compiler(mode):
    """One compiler per mode for compiled autograd's graphs (a new one every step would be a new compile)."""
    return torch.compile(mode=mode)


# DDP's keyword that turns off the broadcast of buffers before each forward: torch 2.14 named it
# forward_sync_buffers and deprecated broadcast_buffers (which also skips the broadcast at construction).
NO_FORWARD_BROADCAST = ("forward_sync_buffers" if "forward_sync_buffers" in
                        inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters else "broadcast_buffers")


def ddp_options(args):
    """DistributedDataParallel's keyword arguments from the command line (none: DDP's defaults)."""
    options = {}
    if args.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = args.bucket_cap_mb
    if args.gradient_as_bucket_view:
        options["gradient_as_bucket_view"] = True
    if args.static_graph:
        options["static_graph"] = True
    if not args.broadcast_buffers:
        options[NO_FORWARD_BROADCAST] = False
    return options


def worker(args):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")        # NVLink multicast off, as the GPU machines require
    if args.no_graph_split or args.compiled_autograd:
        from torch._dynamo import config as dynamo_config     # (an `import torch...` here would make torch local)
        # (set before any DistributedDataParallel is made: compiled autograd refuses DDP's C++ reducer)
        dynamo_config.optimize_ddp = "python_reducer" if args.compiled_autograd else False
    smoke = args.smoke
    if smoke:
        dist.init_process_group("gloo")
        device, size, classes, nets = "cpu", 32, 10, ["smoke"]
    else:
        common.require_tma_mma_gpu("benchmarks/training_ddp.py")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # (the other ranks wait in a barrier while rank 0 runs a variant on one GPU, its compiles included)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
        device, size, classes, nets = "cuda", 224, 1000, args.nets
    import conv_tutorial
    native_built = None
    if device == "cuda" and any(v.startswith("ours") for v in args.variants):
        # (the operator's repeat calls in C++ once built: wait for the build, so that no run is timed while
        # it builds, nor on the Python path before it while the runs after it take the C++ path)
        from conv_tutorial import native
        native_built = native.ensure()
        if not native_built and dist.get_rank() == 0:
            print("the native kernels (conv_tutorial/native.py) are not built here: every call takes the Python path")
    backend = conv_tutorial.backward_backend()
    try:
        rows = measure(args, device, size, classes, nets)
    finally:
        conv_tutorial.set_backward(backend)
    if dist.get_rank() == 0:
        info = common.versions()
        common.save_json(common.output_dir(args.outdir), "training_ddp",
                         {"device": info["device"], "gpus": dist.get_world_size(), "torch": info["torch"],
                          "triton": info["triton"], "steps": args.steps, "warmup": args.warmup,
                          "rounds": args.rounds, "round_steps": args.round_steps,
                          # (the Python reducer leaves the graph whole: Dynamo splits it in "ddp_optimizer" mode only)
                          "ddp": {**ddp_options(args),
                                  "graph_split": not (args.no_graph_split or args.compiled_autograd),
                                  **({"compiled_autograd": True} if args.compiled_autograd else {})},
                          "native_built": native_built, "rows": rows})
    dist.destroy_process_group()
    return rows


def _spawned(rank, argv, init_file, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    args = parse(argv)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    worker(args)
    # Done: the group destroyed and rank 0's JSON written. gloo sometimes aborts in a CPU process's own teardown
    # after that ("terminate called without an active exception"), which mp.spawn would report as a failure:
    # leave without it. (A failure in worker raises before this line, and mp.spawn reports it.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=["resnet50"])
    parser.add_argument("--batch-per-gpu", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (compiles)")
    parser.add_argument("--compile-ahead", action="store_true",
                        help="the operator's variants: conv_tutorial.compile_kernels_ahead before the first step")
    parser.add_argument("--variants", nargs="+", choices=training.VARIANTS,
                        default=["compile", "ours-lesson06-bnstats", "compile-cudagraphs",
                                 "ours-lesson06-bnstats-cudagraphs"])
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny network on two CPU processes over gloo (started here unless under torchrun)")
    parser.add_argument("--port", type=int, default=29517, help="--smoke without torchrun: the rendezvous port")
    parser.add_argument("--outdir", default=None)
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket size in MB (default: DDP's own, 25)")
    parser.add_argument("--static-graph", action="store_true",
                        help="DDP's static_graph: the same parameters used every step (less bookkeeping a step)")
    parser.add_argument("--no-broadcast-buffers", dest="broadcast_buffers", action="store_false",
                        help="DDP's broadcast_buffers off: no broadcast of rank 0's buffers (BatchNorm's running "
                             "statistics) before each forward; each rank keeps its own")
    parser.add_argument("--gradient-as-bucket-view", action="store_true",
                        help="DDP's gradients as views into its buckets")
    parser.add_argument("--breakdown", action="store_true",
                        help="after each run's steps, where a step's time goes (host, GPU, NCCL; the operator's "
                             "calls in C++ and in Python): `breakdown` in each row")
    parser.add_argument("--no-at-once", dest="at_once", action="store_false",
                        help="leave out the run of every rank at once without DDP (img_s_at_once)")
    parser.add_argument("--no-graph-split", action="store_true",
                        help="torch._dynamo.config.optimize_ddp off: one graph, not one per bucket")
    parser.add_argument("--compiled-autograd", action="store_true",
                        help="the compiled variants' backward under compiled autograd, with DDP's Python reducer "
                             "(torch._dynamo.config.optimize_ddp='python_reducer')")
    parser.add_argument("--rounds", type=int, default=0,
                        help="then time the N-process runs in turns: ROUNDS rounds of --round-steps steps each "
                             "(img_s_interleaved, img_s_rounds, ... in the rows)")
    parser.add_argument("--round-steps", type=int, default=10)
    args = parser.parse_args(argv)
    if len(set(args.variants)) != len(args.variants):
        raise ValueError(f"--variants names a variant twice: {args.variants}")
    if args.rounds < 0 or args.round_steps < 1:
        raise ValueError(f"--rounds must be >= 0 and --round-steps >= 1, got {args.rounds} and {args.round_steps}")
    if args.compiled_autograd and "eager" in args.variants:
        raise ValueError("--compiled-autograd sets DDP's Python reducer for the whole process, eager's DDP too "
                         "(no buckets): leave 'eager' out of --variants")
    if args.compiled_autograd and args.no_graph_split:
        raise ValueError("--compiled-autograd and --no-graph-split both set torch._dynamo.config.optimize_ddp: "
                         "give one of them")
    if args.bucket_cap_mb is not None and not args.bucket_cap_mb > 0:
        raise ValueError(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    if args.steps <= args.warmup:
        raise ValueError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): no step would be timed")
    return args


def main(argv=None):
    args = parse(argv)
    if args.smoke and "RANK" not in os.environ:          # two CPU processes, started here
        import torch.multiprocessing as mp
        mp.spawn(_spawned, args=(argv if argv is not None else sys.argv[1:], None, 2), nprocs=2, join=True)
        return None
    return worker(args)


if __name__ == "__main__":
    main()
