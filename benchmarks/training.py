"""Training steps of torchvision networks: eager cuDNN, torch.compile, and the operator under torch.compile.

    python benchmarks/training.py [--nets resnet50 regnet_y_3_2gf] [--batch 128] [--steps 50] [--max-autotune]
                                  [--no-gradient-check] [--profile STEPS] [--compile-ahead [background|tracing]]
                                  [--first-step-breakdown]
                                  [--variants eager compile ours ours-lesson06] [--outdir DIR]

Each network is torchvision's with its own random initialisation (seed 0), channels_last, trained
with bf16 autocast over fp32 master weights: SGD (lr 0.01, momentum 0.9, weight decay 1e-4) on
cross-entropy, random 224x224 images and labels (seed 1; every variant sees the same batches from
the same initial weights). Variants:
  eager            the model as PyTorch trains it (cuDNN's forward and backward convs)
  compile          torch.compile(model) (Inductor; a conv and its gradients stay aten's, cuDNN)
  compile-max-autotune   torch.compile(mode="max-autotune"), with --max-autotune
  ours             conv_tutorial.convert_conv2d, then torch.compile: forward convs on lesson 05's
                   kernel, their gradients from torch (the default backward)
  ours-lesson06    the same with conv_tutorial.set_backward("lesson06"): dgrad and wgrad on lesson 06
  ours-lesson06-bnstats   the same after conv_tutorial.fuse_conv_batchnorm_for_training: each conv
                   followed by a BatchNorm2d sums its output per channel in its epilogue (lesson 06,
                   section 10), and BatchNorm normalizes with those statistics
  ours-lesson06-bnstats-relugrad   the same after conv_tutorial.fuse_relu_into_dgrad too: a conv whose input
                   is a ReLU's output applies ReLU's backward in dgrad's epilogue (lesson 08)
  ...-cudagraphs   compile, ours, ours-lesson06(-bnstats(-relugrad)) under torch.compile(mode="reduce-overhead"): each
                   compiled forward and backward replayed as a CUDA graph (kernels without host time)
For each: images/s over the timed steps (after warm-up steps that compile; CUDA-synchronized wall
time per step, the median), the loss of each of `--steps` steps, and the first step's gradients'
error against an fp32 reference (the same initial weights and batch, eager fp32, TF32 off):
||error|| / ||reference|| per parameter, its median and largest value over the parameters. At
random initialisation on random data the first step's gradient is ill-conditioned (on a CPU,
ResNet-50 at batch 8, 96x96: a 1e-3 relative change of the input moves it by 80%, median over
the parameters; fp32 against fp64 differ by 2.6%), so every bf16 variant, eager's included, is far
from fp32 there: compare a variant's figure with eager's, and the loss curves. For the variants on
lesson 06's gradients the check that isolates the convs is "conv_grad_err" (conv_gradient_errors):
one more step of the model, run eagerly, in which every conv gradient the operator computes is
compared with torch's fp32 gradient of that call's own inputs, beside cuDNN's of the same inputs;
null for other variants and with --no-gradient-check. Writes training.json ({"device", "torch", "triton",
"steps", "compile_ahead", "rows": [{"net", "batch", "variant", "img_s", "first_steps_s", "compile_ahead_s",
"traced_compile_failures", "first_step", "native_built", "loss_50", "loss_last", "losses", "grad_rel_err_median", "grad_rel_err_max",
"conv_grad_err", "backward_fallbacks"}]}; first_steps_s: the wall seconds of each warm-up step, in which the
variant compiles (in a fresh process: the first steps a user waits for, with the Triton and Inductor caches cold
or warm from an earlier run; the variants run one after another in one process, on the same caches, where
later ones measured faster than alone: compare first steps with one variant per process); native_built: after
their warm-up steps the operator's variants wait for its C++ kernels for repeat calls (conv_tutorial/native.py)
to be built, and this says whether they were (null for the other variants and on a CPU); compile_ahead_s:
with --compile-ahead, the seconds the operator's variants spent in conv_tutorial.compile_kernels_ahead before
their first step (else null; with --compile-ahead background, the pass alone: its compiles go on while the
first step is traced, and the first step's first launches wait for them; with --compile-ahead tracing, no pass:
the seconds of turning conv_tutorial.compile_while_tracing on, the compiles starting as the first step is traced);
traced_compile_failures: with --compile-ahead tracing, the traced calls whose kernels could not be compiled from
stand-ins (conv_tutorial.traced_compiles.hand_over_failures; they compiled at their first launch), else null;
first_step: with --first-step-breakdown, where the first step's seconds went (FirstStepBreakdown: Triton
kernels compiled or loaded from its cache, torch.compile's own seconds, its phases ("torch_compile_phases": the
seconds of each phase that torch.compile times, nested, 0.05 s or more) and cache counters, "main_thread": the
calling thread's CPU seconds against wall, sampled (MainThreadCPU; null without a per-thread clock), and with --compile-ahead
"compile_pool": when the pass's compiles ran and finished against the first step's start and end, `pool_timeline`;
else null); loss_50:
the loss of the 50th step, null in a run of fewer steps (loss_last: its last step's); backward_fallbacks: with
lesson 06's gradients chosen, the conv gradients torch computed instead, by reason, over all of the variant's
steps) and training_loss.png (the loss per step of every variant) to --outdir.
--rounds R (--round-steps K) adds, per row, "img_s_interleaved" and "img_s_rounds": after every variant's run,
the variants take turns, R rounds of K steps each (`interleaved`; R even balances the order), so that each
round times them all on the same host: the batch over the median step of all rounds, and of each round. Every
variant's model, gradients and optimizer state stay alive until the rounds. With --compile-ahead background,
the first step's wait for the compiles still running is not timed in "first_step" (Triton's hooks see
no compile start there): its "compile_pool" says when the last compile finished against the step's end.
--profile STEPS adds, per row, "gpu_ms_by_kind": the GPU time of one step's kernels by what they do
(our forward conv, dgrad, wgrad; cuDNN/cuBLAS; Inductor's kernels; the optimizer; copies and fills),
the mean over STEPS steps profiled by torch.profiler after the timed ones (kernel durations only:
a kernel in a CUDA graph takes as long as launched alone, so the graphs' variants are profiled
as they replay). Each variant runs in this process one after the other; `--smoke` runs a tiny network on a CPU (the
operator falls back to torch there) to check the script itself.
"""
import argparse
import copy
import math
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import torch  # noqa: E402

VARIANTS = ("eager", "compile", "compile-max-autotune", "ours", "ours-lesson06", "ours-lesson06-bnstats",
            "ours-lesson06-bnstats-relugrad", "compile-cudagraphs", "ours-cudagraphs", "ours-lesson06-cudagraphs",
            "ours-lesson06-bnstats-cudagraphs", "ours-lesson06-bnstats-relugrad-cudagraphs")


def initial_model(net, seed=0):
    import torchvision
    torch.manual_seed(seed)
    if net == "smoke":        # a tiny ResNet-like network for --smoke (CPU)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
    return getattr(torchvision.models, net)(weights=None)


def batches(steps, batch, size, classes, device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, generator=generator).to(device).contiguous(
                memory_format=torch.channels_last),
             torch.randint(0, classes, (batch,), generator=generator).to(device)) for _ in range(steps)]


def backward_of(variant):
    """The conv gradients' backend a variant trains with (conv_tutorial.set_backward)."""
    return "lesson06" if variant.startswith("ours-lesson06") else "torch"


def prepared(variant, model, wrap=None):
    """The model (and the callable a step runs) of one variant. `wrap`: applied to the prepared module
    before torch.compile (DistributedDataParallel: training_ddp.py); the step then runs the wrapper."""
    import conv_tutorial
    conv_tutorial.set_backward(backward_of(variant))
    if "-bnstats" in variant:      # sharing the model's parameters (first_step_gradients finds them by storage)
        model = conv_tutorial.fuse_conv_batchnorm_for_training(model, inplace=True)
    if "-relugrad" in variant:
        model = conv_tutorial.fuse_relu_into_dgrad(model, inplace=True)
    if variant.startswith("ours"):
        model = conv_tutorial.convert_conv2d(model)
    wrapped = model if wrap is None else wrap(model)
    if variant == "eager":
        return model, wrapped
    return model, torch.compile(wrapped, mode=compile_mode(variant))


def compile_mode(variant):
    """torch.compile's mode of a compiled variant (None: the default mode)."""
    return "reduce-overhead" if variant.endswith("-cudagraphs") else {"compile-max-autotune": "max-autotune"}.get(variant)


class MainThreadCPU:
    """The calling thread's CPU seconds against wall seconds, sampled every SAMPLE_S by a thread of its own
    (Linux: time.pthread_getcpuclockid). A sample where the thread ran for part of its time but not all of it
    (PARTLY, 5-97%) counts as partly off a CPU: mostly a thread with work waiting for a core, as when other
    processes compile beside it. A sample below 5% counts as waiting: for the GPU, for a lock, or for autograd's
    thread, which compiles the backward of a compiled step while the caller waits in backward()."""
    SAMPLE_S = 0.25
    PARTLY = (0.05, 0.97)

    def __init__(self):
        self.samples, self._stop = [], threading.Event()
        try:
            self._clock = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError):         # (no per-thread CPU clock on this platform)
            self._clock = None
        if self._clock is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True, name="first_step_cpu_sampler")
            self._thread.start()

    def _sample(self):
        wall, cpu = time.perf_counter(), time.clock_gettime(self._clock)
        while not self._stop.wait(self.SAMPLE_S):
            now, used = time.perf_counter(), time.clock_gettime(self._clock)
            self.samples.append((now - wall, used - cpu))
            wall, cpu = now, used

    def stop(self):
        """{"wall_s", "cpu_s", "partly_off_cpu_s", "waiting_s"} of the samples, or None without a thread clock."""
        if self._clock is None:
            return None
        self._stop.set()
        self._thread.join()
        low, high = self.PARTLY
        partly = [(w, c) for w, c in self.samples if w > 0 and low < c / w < high]
        return {"wall_s": round(sum(w for w, _ in self.samples), 3), "cpu_s": round(sum(c for _, c in self.samples), 3),
                "partly_off_cpu_s": round(sum(w - c for w, c in partly), 3),
                "waiting_s": round(sum(w - c for w, c in self.samples if w > 0 and c / w <= low), 3)}


class FirstStepBreakdown:
    """Where a first step's seconds go, beside its wall time: the Triton kernels it compiled or loaded
    from Triton's cache (each a call of Triton's JIT hooks, the one after the other timed: a kernel that
    took more than COMPILED_S counts as compiled), torch.compile's own compile time and cache
    counters (torch._dynamo's), and the calling thread's CPU seconds (MainThreadCPU). Triton kernels that
    Inductor launches are not seen here."""
    COMPILED_S = 0.2

    def __enter__(self):
        import triton
        from torch._dynamo.utils import counters
        self.knobs, self.started, self.kernels = triton.knobs.runtime, {}, []
        self.hooks = (self.knobs.jit_cache_hook, self.knobs.jit_post_compile_hook)
        self.counters = {k: dict(counters[k]) for k in ("inductor", "aot_autograd")}
        self.phases_seen = {name: len(times) for name, times in self._compile_metrics().items()}

        def before(*, key, fn, **_):
            self.started[(fn.name, str(key))] = time.perf_counter()
            return False                     # (compile as usual)

        def after(*, key, fn, **_):
            begun = self.started.pop((fn.name, str(key)), None)
            if begun is not None:
                self.kernels.append((fn.name, time.perf_counter() - begun))
        self.knobs.jit_cache_hook, self.knobs.jit_post_compile_hook = before, after
        self.cpu, self.main_thread = MainThreadCPU(), None
        return self

    def __exit__(self, *exc):
        self.knobs.jit_cache_hook, self.knobs.jit_post_compile_hook = self.hooks
        self.main_thread = self.cpu.stop()

    PHASE_MIN_S = 0.05      # phases shorter than this, in all, are left out of "torch_compile_phases"

    @staticmethod
    def _compile_metrics():
        # torch.compile's timed phases: name -> the seconds of each time it ran, in this process
        return getattr(torch._dynamo.utils, "compilation_time_metrics", {})

    def _seconds_since_enter(self):
        # each phase's seconds since __enter__ (the times recorded after the count seen there)
        return {name: sum(times[self.phases_seen.get(name, 0):]) for name, times in self._compile_metrics().items()}

    def _phases(self, phases):
        """torch.compile's phases timed since __enter__ (Dynamo's tracing, AOTAutograd's, Inductor's; nested, so
        they do not add up), the seconds of each name in all, PHASE_MIN_S or more, longest first."""
        return {name: round(seconds, 3) for name, seconds in sorted(phases.items(), key=lambda item: -item[1])
                if seconds >= self.PHASE_MIN_S}

    def summary(self):
        from torch._dynamo.utils import counters
        phases = self._seconds_since_enter()
        compiled = [s for _, s in self.kernels if s > self.COMPILED_S]
        moved = {f"{group}.{name}": value - self.counters[group].get(name, 0)
                 for group in self.counters for name, value in counters[group].items()
                 if "cache" in name and value != self.counters[group].get(name, 0)}
        return {"triton_kernels_compiled": len(compiled), "triton_compile_s": sum(compiled),
                "triton_kernels_from_cache": len(self.kernels) - len(compiled),
                "triton_from_cache_s": sum(s for _, s in self.kernels) - sum(compiled),
                "torch_compile_s": phases.get("_compile.compile_inner", 0.0),
                "torch_compile_phases": self._phases(phases), "torch_compile_caches": moved,
                "main_thread": self.main_thread}


def pool_timeline(pass_started, step_started, step_ended):
    """What the compile-ahead pass's pool did around the first step (conv_tutorial.compile_pool.compile_timeline):
    its compiles by where they ran ("cache": loaded at submit; "worker"; "here": on the pool's thread), their
    summed seconds, and when the first and last finished, the first step started and ended, in seconds since
    the pass began; "unfinished": compiles still running at the step's end; "native_building": whether the C++
    kernels of the repeat calls were still building then."""
    from conv_tutorial import compile_pool, native
    entries = [e for e in compile_pool.compile_timeline() if e["submitted"] >= pass_started]
    done = [e for e in entries if e["finished"] is not None]
    since = lambda t: round(t - pass_started, 3)     # noqa: E731
    thread = native._STATE.get("thread")
    return {"compiles": {where: sum(e["where"] == where for e in entries) for where in ("cache", "worker", "here")},
            "compile_s": round(sum(e["finished"] - e["started"] for e in done if e["where"] != "cache"), 3),
            "load_s": round(sum(e["finished"] - e["started"] for e in done if e["where"] == "cache"), 3),
            "first_finished_s": since(min(e["finished"] for e in done)) if done else None,
            "last_finished_s": since(max(e["finished"] for e in done)) if done else None,
            "first_step_started_s": since(step_started), "first_step_ended_s": since(step_ended),
            "unfinished": len(entries) - len(done),
            "native_building": bool(thread is not None and thread.is_alive())}


def train(variant, fp32_model, data, warmup, device, profile=0, compile_ahead=None, breakdown=False, keep=False):
    """One variant trained from the same weights: {"losses": every step's, "seconds": each step's (the first
    `warmup` compile; for the operator's variants on a GPU, the steps after them wait for its C++ kernels to be
    built: "native_built" says whether they were, None elsewhere), "by_kind": with `profile` steps the GPU ms
    per step by kind of kernel (else None), "compile_ahead_s": the seconds of
    conv_tutorial.compile_kernels_ahead (with `compile_ahead`, "wait" or "background", the operator's variants,
    before the first step; with "tracing", those of turning conv_tutorial.compile_while_tracing on, which is
    turned off after the steps; else None), "first_step": with `breakdown`, FirstStepBreakdown's summary of the first
    step (else None)}; with `keep`, also "step": the step function (x, y) -> loss, which goes on training the
    same model (`interleaved`)."""
    model, step_model = prepared(variant, copy.deepcopy(fp32_model).to(device).to(memory_format=torch.channels_last))
    model.train()
    ahead_s = first_step = None
    pass_started = time.perf_counter()
    tracing = compile_ahead == "tracing" and variant.startswith("ours")
    if compile_ahead and variant.startswith("ours"):
        import conv_tutorial
        if tracing:        # (no pass: torch.compile's tracing of the first step hands the compiles over)
            conv_tutorial.compile_while_tracing()
            ahead_s = time.perf_counter() - pass_started
        else:
            ahead_s = conv_tutorial.compile_kernels_ahead(model, data[0][0], autocast_dtype=torch.bfloat16,
                                                          wait=compile_ahead != "background")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    losses, seconds, native_built = [], [], None
    autocast = dict(device_type=device, dtype=torch.bfloat16)

    def step(x, y):
        with torch.autocast(**autocast):
            loss = torch.nn.functional.cross_entropy(step_model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss
    for i, (x, y) in enumerate(data):
        start = time.perf_counter()
        if i == 0 and breakdown:
            with FirstStepBreakdown() as watch:
                loss = step(x, y)
                if device == "cuda":
                    torch.cuda.synchronize()
            first_step = watch.summary()
            if ahead_s is not None:
                first_step["compile_pool"] = pool_timeline(pass_started, start, time.perf_counter())
        else:
            loss = step(x, y)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        if i == warmup - 1 and device == "cuda" and variant.startswith("ours"):
            # (the operator's C++ kernels for repeat calls build in the background from its first repeat call:
            # the timed steps wait for them, as a long run's steps have them; the first steps, as a user's, do not)
            from conv_tutorial import native
            native_built = native.ensure()
    traced_failures = None
    if tracing:
        from conv_tutorial import traced_compiles
        traced_failures = traced_compiles.hand_over_failures()
        conv_tutorial.compile_while_tracing(False)
    by_kind = profile_steps(lambda: step(*data[-1]), profile) if profile and device == "cuda" else None
    return {"losses": losses, "seconds": seconds, "by_kind": by_kind, "compile_ahead_s": ahead_s,
            "traced_compile_failures": traced_failures,
            "first_step": first_step, "native_built": native_built, **({"step": step} if keep else {})}


def compiled_side_by_side(models):
    """torch._dynamo's settings while `models` compiled models take turns: a compiled version kept per
    model (the recompile limit raised to their number), and an error rather than a silent eager run
    past it."""
    config = torch._dynamo.config
    return config.patch(**{name: value for name, value in (("recompile_limit", max(8, models + 2)),
                                                           ("fail_on_recompile_limit_hit", True))
                           if hasattr(config, name)})


def take_turns(order, run, rounds, round_steps):
    """The turns both training benchmarks time their runs in (`interleaved`, training_ddp.py's): each key of
    `order` first takes two untimed steps (its code compiles again, from the caches its run filled), then
    `rounds` rounds, in each every key takes one untimed step (the switch's own cost) and `round_steps`
    timed ones; the order is given, then reversed, round after round (A B, B A, A B, ...: each key as often
    first as last over an even number of rounds). `run(key, i)` runs key's step on step index i (0 for the
    untimed first steps) and returns its seconds, its backend chosen. Returns {key: [each round's step
    seconds]}."""
    seconds = {key: [] for key in order}
    for key in order:
        run(key, 0)
        run(key, 0)
    for r in range(rounds):
        for key in (order if r % 2 == 0 else order[::-1]):
            run(key, r * round_steps)
            seconds[key].append([run(key, r * round_steps + i) for i in range(round_steps)])
    return seconds


def interleaved(steps, data, rounds, round_steps, device):
    """Seconds of each variant's steps timed in turns (`take_turns`; `steps`: {variant: its step function},
    step index i on data[i % len(data)]). Variants timed one after another in a run move apart when the
    host does (a default-mode step is host-bound); in turns, each round sees the same host.
    torch._dynamo.reset() between the variants' runs dropped their compiled code, which compiles again
    in the first untimed steps; torch.compile may keep a compiled version per variant (its recompile
    limit raised to their number), and raises rather than run one eagerly. Returns {variant: [each
    round's step seconds]}."""
    import conv_tutorial

    def run(variant, i):
        conv_tutorial.set_backward(backward_of(variant))
        start = time.perf_counter()
        steps[variant](*data[i % len(data)])
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with compiled_side_by_side(len(steps)):
        return take_turns(list(steps), run, rounds, round_steps)


# kernel name fragment -> what the kernel does (the first match wins; lower-case)
KERNEL_KINDS = (("conv2d_fprop_kernel", "conv forward (ours)"), ("split_k_epilogue", "conv forward (ours)"),
                ("flipped_weights", "dgrad weight flip (ours)"),
                ("untapped_zeros", "copies and fills"), ("fold_columns", "copies and fills"),  # (stem's, wgrad's)
                ("conv2d_wgrad", "wgrad (ours)"), ("wgrad_split_k_sum", "wgrad (ours)"),
                ("triton_", "Inductor (BatchNorm, ReLU, add, pool, loss)"), ("dgrad", "cuDNN dgrad"), ("wgrad", "cuDNN wgrad"), ("fprop", "cuDNN forward"),
                ("xmma", "cuDNN/cuBLAS other"), ("cudnn", "cuDNN/cuBLAS other"), ("cutlass", "cuDNN/cuBLAS other"),
                ("nvjet", "cuDNN/cuBLAS other"), ("gemm", "cuDNN/cuBLAS other"), ("conv", "cuDNN/cuBLAS other"),
                ("multi_tensor", "optimizer"),
                ("foreach", "optimizer"), ("memset", "copies and fills"), ("memcpy", "copies and fills"),
                ("copy", "copies and fills"), ("fill", "copies and fills"))


def kernel_kind(name):
    lowered = name.lower()
    return next((kind for fragment, kind in KERNEL_KINDS if fragment in lowered), "other")


def profile_steps(step, steps):
    """{kind: GPU milliseconds per step} of the kernels `step()` runs, the mean over `steps` calls."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(event.name)
            totals[kind] = totals.get(kind, 0.0) + event.device_time / 1000 / steps
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def first_step_gradients(variant, fp32_model, x, y, device):
    """Every parameter's gradient after one step of `variant` on (x, y) (bf16 autocast), or of the
    fp32 reference (variant None: eager fp32, TF32 off), in the order of fp32_model.parameters()
    (a variant's module holds the same storage: matched by address)."""
    model = copy.deepcopy(fp32_model).to(device).to(memory_format=torch.channels_last)
    order = [p.data_ptr() for p in model.parameters()]
    trained, step_model = (model, model) if variant is None else prepared(variant, model)
    trained.train()
    if variant is None:
        loss = torch.nn.functional.cross_entropy(step_model(x), y)
    else:
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(step_model(x), y)
    loss.backward()
    grads = {p.data_ptr(): p.grad.detach().float() for p in trained.parameters()}
    return [grads[address] for address in order]


CONV_GRADIENT_OPS = {"conv_tutorial::conv2d_input_grad": "input", "conv_tutorial::conv2d_input_grad_relu": "input",
                     "conv_tutorial::conv2d_weight_grad": "weight"}


def relative_error(value, reference):
    # ||value - reference|| / ||reference||; against a zero reference, 0 if the value is zero too, else inf
    if reference.norm() == 0:
        return 0.0 if value.float().norm() == 0 else math.inf
    return ((value.float() - reference).norm() / reference.norm()).item()


def conv_gradient_errors(variant, fp32_model, x, y, device):
    """Every conv gradient the operator computes in one step of `variant` (its model run eagerly, not
    compiled, bf16 autocast, on x, y), each against torch's fp32 gradient of that call's own inputs
    (aten.convolution_backward on them cast to fp32, TF32 off), beside cuDNN's gradient of the same
    inputs in their own dtype: {"calls", "ours_median", "ours_max", "cudnn_median", "cudnn_max"},
    relative errors ||g - fp32|| / ||fp32||, the median and largest over the calls. Unlike the whole
    step's gradients, each call is compared on identical inputs, so the conv's own rounding is measured.
    (Calls that lesson 06 leaves to torch, `backward_fallbacks`, compare cuDNN with itself.) Raises
    RuntimeError if no call of the operator's gradient ops was seen; the gradients' backend is
    restored afterwards."""
    from torch.utils._python_dispatch import TorchDispatchMode
    ours, cudnn = [], []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            which = CONV_GRADIENT_OPS.get(func._schema.name)
            if which is not None:            # (inside __torch_dispatch__ the mode is off: no recursion)
                grad_output, input, weight, stride, padding, dilation, groups = args
                mask = [which == "input", which == "weight", False]

                def gradient(*tensors):
                    grads = torch.ops.aten.convolution_backward(*tensors[:3], None, stride, padding, dilation, False,
                                                                [0, 0], groups, mask)
                    g = grads[0 if which == "input" else 1]
                    if func._schema.name.endswith("_relu"):     # ReLU's backward, taken from its output
                        g = torch.where(input > 0, g, torch.zeros((), dtype=g.dtype, device=g.device))
                    return g
                with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
                    reference = gradient(*(t.float() for t in (grad_output, input, weight)))
                ours.append(relative_error(out, reference))
                cudnn.append(relative_error(gradient(grad_output, input, weight), reference))
            return out
    import conv_tutorial
    backend = conv_tutorial.backward_backend()
    try:
        model = copy.deepcopy(fp32_model).to(device).to(memory_format=torch.channels_last)
        model = prepared(variant, model)[0]        # the module itself, not its compiled step
        model.train()
        with Recorder():
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
    finally:
        conv_tutorial.set_backward(backend)
    if not ours:
        raise RuntimeError(f"{variant}: no call of the operator's conv gradient ops ({', '.join(CONV_GRADIENT_OPS)}) "
                           "was seen in a step: the check would measure nothing")
    return {"calls": len(ours), "ours_median": statistics.median(ours), "ours_max": max(ours),
            "cudnn_median": statistics.median(cudnn), "cudnn_max": max(cudnn)}


def gradient_error(grads, reference):
    """(median, largest) over the parameters of ||gradient - reference|| / ||reference|| (L2 norms;
    parameters whose reference gradient is exactly zero are left out)."""
    errors = sorted(((g - r).norm() / r.norm()).item() for g, r in zip(grads, reference) if r.norm() > 0)
    return statistics.median(errors), errors[-1]


def plot(rows, outdir, info):
    """The loss per step of every variant, and its difference from the first variant's; `info`
    names the device and versions the rows were measured on (common.versions())."""
    nets = sorted({row["net"] for row in rows})
    fig, axes = common.new_figure(2, len(nets), figsize=(6 * len(nets), 7), squeeze=False, sharex="col")
    styles = ["-", "--", ":", "-.", (0, (5, 1))]
    for column, net in enumerate(nets):
        mine = [r for r in rows if r["net"] == net]
        first = mine[0]
        for i, row in enumerate(mine):
            style = styles[i % len(styles)]
            steps = range(1, len(row["losses"]) + 1)
            axes[0][column].plot(steps, row["losses"], linestyle=style, label=row["variant"], linewidth=1.4)
            axes[1][column].plot(steps, [a - b for a, b in zip(row["losses"], first["losses"])],
                                 linestyle=style, label=row["variant"], linewidth=1.4)
        axes[0][column].set(ylabel="cross-entropy loss", title=f"{net}, batch {first['batch']}")
        axes[1][column].set(xlabel="training step", ylabel=f"loss minus {first['variant']}'s")
        for ax in axes[:, column]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"The loss per step of each variant from the same weights and batches (bf16 autocast, SGD)\n"
                 f"{info['device']}, torch {info['torch']}, Triton {info['triton']}", fontsize=10)
    fig.tight_layout()
    common.save_figure(fig, outdir, "training_loss")


def main(argv=None):
    """Runs the benchmark (the command line's arguments, or `argv`); returns its rows. The conv
    gradients' backend, which each variant sets, is left as it was found."""
    import conv_tutorial
    backend = conv_tutorial.backward_backend()
    try:
        return run(argv)
    finally:
        conv_tutorial.set_backward(backend)


def run(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=["resnet50", "regnet_y_3_2gf"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (compiles)")
    parser.add_argument("--variants", nargs="+", default=["eager", "compile", "ours", "ours-lesson06"],
                        choices=VARIANTS)
    parser.add_argument("--max-autotune", action="store_true", help="also torch.compile(mode='max-autotune')")
    parser.add_argument("--compile-ahead", nargs="?", const="wait", choices=["wait", "background", "tracing"],
                        default=None,
                        help="the operator's variants: conv_tutorial.compile_kernels_ahead before the first step "
                             "(background: wait=False, the compiles going on during the first step; tracing: no "
                             "pass, conv_tutorial.compile_while_tracing on for the steps instead)")
    parser.add_argument("--first-step-breakdown", action="store_true",
                        help="where each variant's first step goes (first_step in the rows)")
    parser.add_argument("--no-gradient-check", action="store_true",
                        help="skip the first step's gradients against fp32 (each variant compiles once less)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also profile STEPS steps: each row's GPU time per step by kind of kernel")
    parser.add_argument("--rounds", type=int, default=0,
                        help="then time the variants in turns: ROUNDS rounds of --round-steps steps each "
                             "(img_s_interleaved, img_s_rounds in the rows)")
    parser.add_argument("--round-steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="a tiny network on the CPU: checks the script")
    parser.add_argument("--outdir", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 0 or args.round_steps < 1:
        raise ValueError(f"--rounds must be >= 0 and --round-steps >= 1, got {args.rounds} and {args.round_steps}")
    variants = list(args.variants) + (["compile-max-autotune"] if args.max_autotune else [])
    if args.smoke:
        nets, device, size, classes = ["smoke"], "cpu", 32, 10
    else:
        common.require_tma_mma_gpu("benchmarks/training.py")
        nets, device, size, classes = args.nets, "cuda", 224, 1000
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False   # the fp32 reference
    if args.steps <= args.warmup:
        raise ValueError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): no step would be timed")
    import conv_tutorial
    rows = []
    for net in nets:
        kept = {}
        fp32_model = initial_model(net)
        data = batches(args.steps, args.batch, size, classes, device)
        reference = None if args.no_gradient_check else first_step_gradients(None, fp32_model, *data[0], device)
        for variant in variants:
            conv_tutorial.reset_backward_fallbacks()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch._dynamo.reset()
                trained = train(variant, fp32_model, data, args.warmup, device, args.profile, args.compile_ahead,
                                args.first_step_breakdown, keep=args.rounds > 0)
                if args.rounds:
                    kept[variant] = trained["step"]
                losses, all_seconds, by_kind, ahead_s = (trained[k] for k in ("losses", "seconds", "by_kind",
                                                                              "compile_ahead_s"))
                seconds = all_seconds[args.warmup:]
                error = (None, None) if reference is None else gradient_error(
                    first_step_gradients(variant, fp32_model, *data[0], device), reference)
            row = {"net": net, "batch": args.batch, "variant": variant,
                   "img_s": args.batch / statistics.median(seconds),
                   "first_steps_s": all_seconds[:args.warmup], "compile_ahead_s": ahead_s,
                   "traced_compile_failures": trained["traced_compile_failures"], "first_step": trained["first_step"],
                   "native_built": trained["native_built"],
                   "loss_50": losses[49] if len(losses) >= 50 else None, "loss_last": losses[-1], "losses": losses,
                   "grad_rel_err_median": error[0], "grad_rel_err_max": error[1], "conv_grad_err": None,
                   "backward_fallbacks": conv_tutorial.backward_fallbacks()}
            if by_kind is not None:
                row["gpu_ms_by_kind"] = by_kind
            if reference is not None and variant.startswith("ours-lesson06"):    # after the fallbacks' count
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    row["conv_grad_err"] = conv_gradient_errors(variant, fp32_model, *data[0], device)
            rows.append(row)
            print(f"  {net:<16} {variant:<22} {row['img_s']:8.0f} img/s   first {args.warmup} steps "
                  f"{sum(row['first_steps_s']):.1f} s" + ("" if ahead_s is None else f" after {ahead_s:.1f} s compiling ahead")
                  + f"   loss after {len(losses)} steps "
                  f"{losses[-1]:.4f}" + ("" if reference is None else f"   first step's gradients: rel. error median "
                                         f"{error[0]:.1e}, largest {error[1]:.1e}"), flush=True)
            per_conv = row["conv_grad_err"]
            if per_conv:
                print(f"  {net} {variant}: each conv gradient of one step against fp32 on the same inputs "
                      f"({per_conv['calls']} calls): ours rel. error median {per_conv['ours_median']:.1e}, "
                      f"largest {per_conv['ours_max']:.1e}; cuDNN's {per_conv['cudnn_median']:.1e}, "
                      f"{per_conv['cudnn_max']:.1e}", flush=True)
            if by_kind is not None:
                print(f"  {net} {variant}: GPU ms per step by kind ({sum(by_kind.values()):.2f} in all): "
                      + ", ".join(f"{kind} {ms:.2f}" for kind, ms in by_kind.items()), flush=True)
            if row["backward_fallbacks"]:
                print(f"  {net} {variant}: conv gradients left to torch, by reason: {row['backward_fallbacks']}",
                      flush=True)
            if not all(math.isfinite(v) for v in losses):
                print(f"  {net} {variant}: the loss is not finite", flush=True)
        if args.rounds:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                timed = interleaved(kept, data, args.rounds, args.round_steps, device)
            kept.clear()
            net_rows = {row["variant"]: row for row in rows if row["net"] == net}
            first = variants[0]
            for variant, per_round in timed.items():
                row = net_rows[variant]
                row["img_s_interleaved"] = args.batch / statistics.median([t for times in per_round for t in times])
                row["img_s_rounds"] = [args.batch / statistics.median(times) for times in per_round]
                ratios = [a / b for a, b in zip(row["img_s_rounds"], net_rows[first]["img_s_rounds"])]
                print(f"  {net:<16} {variant:<22} {row['img_s_interleaved']:8.0f} img/s in {args.rounds} rounds of "
                      f"{args.round_steps} steps in turns; against {first} round by round: median "
                      f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)", flush=True)
    outdir = common.output_dir(args.outdir)
    info = common.versions()
    common.save_json(outdir, "training", {**info, "steps": args.steps, "compile_ahead": args.compile_ahead,
                                          "rows": rows})
    plot(rows, outdir, info)
    return rows


if __name__ == "__main__":
    main()
