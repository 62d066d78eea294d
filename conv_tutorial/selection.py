"""Choosing a config per shape: pruning the candidates to what fits the device and suits the shape,
a heuristic that needs no timing, an autotuner that times, and the tuning file that remembers.

- `prune_configs`: candidates that the kernel cannot run (`check_config`), that do not fit the
  device (shared memory per program and per SM, accumulator registers on Hopper) or do not suit
  the shape (tiles much wider than Co, tails that neither save columns nor fill SMs) are dropped
  before anything is compiled.
- `heuristic_config`: a config from the shape alone, for callers that must not spend a second
  timing candidates on a shape's first call (the PyTorch operator, unless autotuning is asked
  for): the config with the shortest expected time, from its throughput as measured over lesson
  05's network suite, the share of useful work it does on this shape, and split-K's costs
  (benchmarks/fit_heuristic.py refits the numbers).
- `autotune`: times each pruned candidate briefly, with the call's epilogue, then the three fastest
  and the heuristic's config again as the benchmark times a layer (core.bench_tflops: do_bench's
  median, L2 flushed) in alternating rounds, and keeps the fastest, the heuristic's on a tie: a
  tuned config is never slower than the heuristic's by that measure. The choice is kept per shape
  and epilogue (`epilogue_tag`) in this process and in a JSON tuning file, with the heuristic's
  config and TFLOPS beside the tuned ones (`tuning_cache_path()`: $CONV_TUTORIAL_TUNING_CACHE or
  ~/.cache/conv_tutorial/tuning.json; entries carry a `version`, older ones are tuned again)
  that later processes read.
"""
import functools
import json
import os
import warnings
from pathlib import Path

import torch
import triton

from .configs import (CANDIDATES, SMEM_LIMIT_BYTES, SMEM_PER_SM_BYTES, KernelConfig, accumulator_registers,  # noqa: F401
                      check_config, fits_shared_memory, fitted_to_epilogue, groups_fit, k_share, k_steps_of,
                      register_budget, split_k_workspace_bytes, split_tiles, tail_pays, useful_share, wave_efficiency)
from . import native
from .geometry import device_facts
from .core import timing
from .launch import compiling_ahead_active, plan_for

_BEST_CONFIG = {}    # (geometry, dtype, device, epilogue tag) -> config chosen by the autotuner


def prune_configs(candidates, geometry, arch, smem_limit=None, num_sms=132):
    """Keep the configs that the kernel runs on this device and that suit the shape (no compilation
    needed). The kernel's own limits are check_config's; the device's are its shared memory and
    register file (the kernel's models of them: fits_shared_memory, register_budget); the rest
    are the shape's."""
    smem_limit = smem_limit or SMEM_LIMIT_BYTES[arch]
    kept, runnable = [], []     # suited to the shape; able to run it at all (a grouped conv's last resort)
    for config in _device_fit(tuple(map(tuple, candidates)), arch, smem_limit):
        if geometry.groups > 1 and not groups_fit(config, geometry.Ci_group, geometry.Co_group):
            continue                            # a grouped conv's tiles in one group each (lesson 05, section 10)
        runnable.append(config)
        if config.tile_n > max(64, triton.next_power_of_2(geometry.Co)):  # mostly-empty tiles
            continue
        if config.block_k < 64 and k_share(config, geometry) <= k_share(config._replace(block_k=64), geometry) \
                and config.tile_m * config.tile_n < 256 * 160:
            continue                            # a narrow K block where it saves zeros (or smem: 256 x 160)
        if config.block_n_tail and not tail_pays(config, geometry, num_sms):
            continue                            # a tail only where it saves work or fills SMs
        if config.split_k > 1:
            tiles = split_tiles(config, geometry, num_sms)[1]
            if wave_efficiency(tiles, num_sms) >= 0.8 or k_steps_of(config, geometry) < 3 * config.split_k:
                continue                        # split-K only where whole tiles leave SMs idle
        kept.append(config)
    # a grouped conv may fit only configs the shape rules would drop: it takes those
    return runnable if not kept and geometry.groups > 1 else kept


@functools.lru_cache(maxsize=None)
def _device_fit(candidates, arch, smem_limit):
    """The candidates (a tuple of config tuples) that the kernel runs on `arch` with `smem_limit` bytes of shared
    memory per program, whatever the shape: once per device, not per shape (the kernel's models answer through
    its constexpr functions, which cost tens of microseconds a call from the host)."""
    fit = []
    for config in map(lambda c: KernelConfig(*c), candidates):
        try:
            check_config(config, arch)   # what the kernel does not run on the arch (ping-pong, TMEM columns,
        except ValueError:               # row tails on Blackwell, warps that overfill the register file, ...)
            continue
        if not fits_shared_memory(config, smem_limit):
            continue                            # per program, and its programs per SM
        if arch == "sm_90" and accumulator_registers(config) > register_budget(config, arch):
            continue                            # accumulators that would spill
        fit.append(config)
    return tuple(fit)


# %% Choosing a config: the heuristic, the autotuner, and the tuning file ----------------------

# Each Hopper config's throughput on a layer it fills (TFLOPS with every SM busy in every wave and
# no columns, rows or channels past the layer): the median over the 84 layers of lesson 05's
# network suite (ResNet-50, the SD UNet, Inception v3) of its measured TFLOPS divided by its share
# of useful work (`useful_share`). Split-K adds its workspace's round trip (SPLIT_K x M x Co fp32
# values, written and read), at the effective bandwidth fitted the same way. Fitted on an H100 from
# the autotuner's timings in the suite's run (benchmarks/fit_heuristic.py refits both from the
# suite's logs); how well it picks, checked leave-one-out: RESULTS.md, "The network suite".
HOPPER_CONFIG_TFLOPS = {   # split_k left at 1: split-K's cost is modelled apart
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_n_tail=32): 679,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, consumers=2, block_n_tail=32): 653,
    KernelConfig(block_m=256, block_n=128, block_k=32, num_buffers=5, num_warps=8, block_n_tail=32): 613,
    KernelConfig(block_m=128, block_n=256, block_k=64, num_buffers=3, num_warps=8): 527,
    KernelConfig(block_m=256, block_n=128, block_k=64, num_buffers=3, num_warps=8): 520,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=8, block_n_tail=64): 502,
    KernelConfig(block_m=256, block_n=128, block_k=32, num_buffers=6, num_warps=8): 501,
    KernelConfig(block_m=128, block_n=256, block_k=32, num_buffers=6, num_warps=8): 500,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, block_m_tail=64): 481,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_m_tail=64): 477,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=8, block_m_tail=64): 474,
    KernelConfig(block_m=128, block_n=128, block_k=32, num_buffers=6, num_warps=8, block_n_tail=64): 473,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=3, num_warps=4, consumers=2, block_m_tail=64): 471,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8): 468,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, consumers=2): 467,
    KernelConfig(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4, block_n_tail=32): 463,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4): 456,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, consumers=2): 453,
    KernelConfig(block_m=64, block_n=128, block_k=64, num_buffers=4, num_warps=4, programs_per_sm=2): 405,
    KernelConfig(block_m=256, block_n=64, block_k=64, num_buffers=4, num_warps=8): 390,
    KernelConfig(block_m=128, block_n=64, block_k=64, num_buffers=4, num_warps=4, programs_per_sm=2): 373,
    KernelConfig(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4): 368,
    KernelConfig(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4, consumers=2): 367,
    KernelConfig(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4, consumers=2): 359,
    KernelConfig(block_m=128, block_n=64, block_k=32, num_buffers=10, num_warps=4, block_n_tail=32): 359,
    KernelConfig(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4): 352,
    KernelConfig(block_m=64, block_n=128, block_k=64, num_buffers=6, num_warps=4, consumers=2): 339,
    KernelConfig(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4, block_n_tail=32): 320,
}
SPLIT_K_WORKSPACE_BYTES_PER_S = 2.05e12   # fitted with the table (mostly L2: the slices meet there)
# What split-K costs however little its workspace moves: the second kernel's start behind the first.
# Measured apart, on ResNet-50's batch-1 layers (results/notebook.md, split-K's fixed cost); without
# it the heuristic split layers with a few short tiles, which ran slower than whole ones.
SPLIT_K_SECONDS = 3.5e-6


def config_tflops(config, arch):
    """A config's throughput on a layer it fills, split-K aside: measured (HOPPER_CONFIG_TFLOPS),
    or where there is no measurement (Blackwell; new candidates) estimated from the bytes a tile
    moves per FLOP: a BLOCK_M x TILE_N tile reads BLOCK_M + TILE_N rows per k-step for
    BLOCK_M * TILE_N products."""
    measured = HOPPER_CONFIG_TFLOPS.get(config._replace(split_k=1)) if arch == "sm_90" else None
    if measured is None:
        reuse = config.tile_m * config.tile_n / (config.tile_m + config.tile_n)
        measured = 700 * reuse / (reuse + 30)
    return measured


def expected_seconds(config, geometry, arch, num_sms):
    """The heuristic's model of a config's time on a layer: its FLOPs at the config's throughput
    times its useful share, plus split-K's cost: its second kernel's start and its workspace's
    round trip."""
    seconds = geometry.flops / (config_tflops(config, arch) * 1e12 * useful_share(config, geometry, num_sms))
    if config.split_k > 1 and split_tiles(config, geometry, num_sms)[2]:
        seconds += SPLIT_K_SECONDS + split_k_workspace_bytes(config, geometry, num_sms) / SPLIT_K_WORKSPACE_BYTES_PER_S
    return seconds


def heuristic_config(geometry, arch, num_sms, smem_limit=None):
    """A config from the shape alone, in microseconds: the pruned candidate with the shortest
    expected time (`expected_seconds`); the deeper ring breaks ties."""
    candidates = prune_configs(CANDIDATES[arch], geometry, arch, smem_limit, num_sms)
    if not candidates:
        raise RuntimeError(f"no kernel config fits {geometry.describe()} on this GPU")
    return min(candidates, key=lambda c: (round(expected_seconds(c, geometry, arch, num_sms) * 1e7),
                                          -c.num_buffers))


def epilogue_tag(scale=None, residual=None, activation="none"):
    """What an epilogue adds to the conv, as the tuner keys it: "" for a plain conv (a bias alone
    counts as plain: one add per column, nothing measurable), else e.g. "scale+residual+relu".
    Choices are tuned per tag: with a residual the epilogue loads a tile as large as the output
    and holds it in registers, and the fastest config can change (ResNet-50's 28x28 128->512 1x1
    + residual: 0.147 ms with the plain conv's choice; results/notebook.md)."""
    parts = (["scale"] if scale is not None else []) + (["residual"] if residual is not None else []) \
        + ([activation] if activation != "none" else [])
    return "+".join(parts)


def known_or_heuristic_config(geometry, dtype, tag=""):
    """The tuned choice for this shape and epilogue if one is known (this process or the tuning
    file); else the plain conv's tuned choice, fitted to the epilogue; else the heuristic's, fitted.
    Never times anything."""
    remembered = _remembered_config(geometry, dtype, tag)
    if remembered is not None:
        return remembered
    remembered = _remembered_config(geometry, dtype) if tag else None
    if remembered is None:
        arch, num_sms, smem = device_facts()
        remembered = heuristic_config(geometry, arch, num_sms, smem)
    return fitted_to_epilogue(remembered, "residual" in tag.split("+"), device_facts()[0])


def _remembered_config(geometry, dtype, tag=""):
    """The tuned choice for this shape and epilogue from this process or, failing that, the
    tuning file; None."""
    key = (geometry, dtype, torch.cuda.current_device(), tag)
    if key not in _BEST_CONFIG:
        saved = _load_tuning_file().get(_tuning_file_key(geometry, dtype, tag))
        # (an entry of version 1 was chosen without timing the heuristic's config beside it: tuned again)
        if saved is not None and saved.get("version", 1) >= TUNING_FILE_VERSION:
            _BEST_CONFIG[key] = KernelConfig(*saved["config"])
    return _BEST_CONFIG.get(key)


def tuned_config(geometry, x_nhwc, w, bias, verbose=False, retune=False, scale=None, residual=None,
                 activation="none", out_dtype=None):
    """The autotuner's choice for this shape, dtype and epilogue (`epilogue_tag`): from this
    process, the tuning file, or (first time, or `retune`) timed now, with the epilogue, and saved
    to the tuning file."""
    tag = epilogue_tag(scale, residual, activation)
    key = (geometry, x_nhwc.dtype, torch.cuda.current_device(), tag)
    if retune or _remembered_config(geometry, x_nhwc.dtype, tag) is None:
        best, tflops, heuristic, heuristic_tflops = autotune(geometry, x_nhwc, w, bias, verbose, scale, residual,
                                                             activation, out_dtype, details=True)
        _BEST_CONFIG[key] = best
        _save_tuning(geometry, x_nhwc.dtype, best, tflops, tag, heuristic, heuristic_tflops)
    return _BEST_CONFIG[key]


_AUTOTUNE = os.environ.get("CONV_TUTORIAL_AUTOTUNE", "0") == "1"


def set_autotune(enabled: bool):
    """Whether the PyTorch operator (conv_tutorial.ops) times the candidates of a new shape (True) or
    takes the heuristic's config (False, the default; $CONV_TUTORIAL_AUTOTUNE=1 sets it)."""
    global _AUTOTUNE
    _AUTOTUNE = bool(enabled)
    native.invalidate()     # (a call's path depends on it: the native programs of the other setting are stale)


def autotune_enabled() -> bool:
    return _AUTOTUNE


def tuning_cache_path() -> Path:
    """Where tuned choices are kept: $CONV_TUTORIAL_TUNING_CACHE, or ~/.cache/conv_tutorial/tuning.json."""
    return Path(os.environ.get("CONV_TUTORIAL_TUNING_CACHE")
                or Path.home() / ".cache" / "conv_tutorial" / "tuning.json")


def _tuning_file_key(geometry, dtype, tag=""):
    """One GPU model, one Triton, one shape, dtype and epilogue: a choice made elsewhere is not
    trusted."""
    return (f"{torch.cuda.get_device_name()} | triton {triton.__version__} | {geometry.describe()} | "
            f"{str(dtype).replace('torch.', '')}" + (f" | epilogue {tag}" if tag else ""))


_TUNING_FILE = None    # its contents, read once per process


def _load_tuning_file():
    global _TUNING_FILE
    if _TUNING_FILE is None:
        try:
            _TUNING_FILE = json.loads(tuning_cache_path().read_text())
        except (OSError, ValueError):
            _TUNING_FILE = {}
    return _TUNING_FILE


TUNING_FILE_VERSION = 2   # 2 adds the heuristic's config and TFLOPS; readers of 1 read "config" alone


def _save_tuning(geometry, dtype, config, tflops, tag="", heuristic=None, heuristic_tflops=None):
    """Keep a tuned choice: its config and TFLOPS, and beside them the heuristic's config and its
    TFLOPS from the same timing, so the file shows what tuning gained on each shape. Entries of
    version 1 (config and TFLOPS alone) are read the same way: only "config" is ever read back."""
    entries = _load_tuning_file()
    entry = {"config": list(config), "tflops": round(tflops, 1), "version": TUNING_FILE_VERSION}
    if heuristic is not None:
        entry["heuristic_config"] = list(heuristic)
        entry["heuristic_tflops"] = None if heuristic_tflops is None else round(heuristic_tflops, 1)
    entries[_tuning_file_key(geometry, dtype, tag)] = entry
    _write_tuning_file(entries)


def remembered_decision(key):
    """A decision kept in the tuning file under `key` (a string that names the GPU, Triton and torch
    it was measured with), or None."""
    return _load_tuning_file().get(key)


def remember_decision(key, decision: dict):
    """Keep `decision` (JSON) in the tuning file under `key`: keep_faster_convs' timings, so a second
    process with the same model, batch, GPU and versions does not time again."""
    entries = _load_tuning_file()
    entries[key] = decision
    _write_tuning_file(entries)


def _write_tuning_file(entries):
    path = tuning_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(partial, path)           # atomic: a reader never sees half a file
    except OSError as error:
        warnings.warn(f"could not save the tuning file {path}: {error}")


FINALISTS = 3        # the fastest of the first pass timed again, plus the heuristic's pick
FINAL_ROUNDS = 3


def _benchmark_ms(fn):
    """A finalist's time as benchmarks/network_suite.py times a layer: core.bench_tflops, i.e.
    do_bench's median (L2 flushed before each call, launch overhead included; warmup 25 ms, 100 ms
    of calls)."""
    return timing.bench_tflops(fn, 1)["ms"]


def _first_pass_ms(fn):
    """A brief timing that only ranks the candidates: the 20th percentile of do_bench's calls (a
    stall of the host process can only add time, and made a median of short runs look 3-5x slow)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=[0.2])


def choose_among(first_pass, heuristic, final_ms, finalists=FINALISTS, rounds=FINAL_ROUNDS):
    """The tuner's decision, apart from any GPU: `first_pass` {config: ms} ranks the candidates;
    the `finalists` fastest and the heuristic's config are timed again by `final_ms(config) -> ms`
    in `rounds` alternating rounds (clock drift falls on all of them alike), each keeping its median
    round. The heuristic's config wins ties and is kept unless another measures faster: the tuner is
    never slower than the heuristic by its own measure. Returns (best, {finalist: median ms})."""
    chosen = sorted(first_pass, key=first_pass.get)[:finalists]
    if heuristic is not None and heuristic not in chosen:
        chosen.append(heuristic)
    times = {config: [] for config in chosen}
    for _ in range(rounds):
        for config in chosen:
            times[config].append(final_ms(config))
    medians = {config: sorted(ms)[len(ms) // 2] for config, ms in times.items()}
    best = min(medians, key=lambda c: (medians[c], c != heuristic))
    return best, medians


def autotune(geometry, x_nhwc, w, bias, verbose=False, scale=None, residual=None, activation="none",
             out_dtype=None, details=False):
    """Time the pruned candidates on the real tensors, with the call's epilogue; return (best
    config, its TFLOPS), or with `details` also (the heuristic's config, its TFLOPS).

    A first pass times each candidate briefly (`_first_pass_ms`). The three fastest and the
    heuristic's config (the one the operator runs untuned) are then timed as the benchmark times a
    layer (`_benchmark_ms`) in three alternating rounds, and the median round decides
    (`choose_among`): so a tuned choice is one that the benchmark, too, measures at least as fast as
    the heuristic's. (A first pass's ranking alone, from runs of ~20 ms at a different percentile,
    picked configs that the benchmark then measured up to 1.7x slower than the heuristic's.)"""
    if compiling_ahead_active():
        raise RuntimeError("autotune times real launches, and inside launch.compiling_ahead nothing launches: "
                           "tune before or after it")
    arch, num_sms, smem = device_facts()
    candidates = prune_configs(CANDIDATES[arch], geometry, arch, smem, num_sms)
    # with a residual, each candidate as the runtime would run it (row tails move to 8 warps)
    candidates = list(dict.fromkeys(fitted_to_epilogue(c, residual is not None, arch) for c in candidates))
    if not candidates:
        raise RuntimeError(f"no kernel config fits {geometry.describe()} on this GPU")
    heuristic = fitted_to_epilogue(heuristic_config(geometry, arch, num_sms, smem), residual is not None, arch)
    if heuristic not in candidates:
        candidates.append(heuristic)
    epilogue = dict(scale=scale, residual=residual, activation=activation)
    timed = lambda plan: lambda: plan.run(x_nhwc, w, bias, **epilogue)  # noqa: E731
    timings, errors = {}, []
    for config in candidates:
        plan = plan_for(geometry, x_nhwc.dtype, config, out_dtype)
        try:
            plan.run(x_nhwc, w, bias, **epilogue)   # compile before timing
            timings[config] = _first_pass_ms(timed(plan))
        except Exception as error:  # a config the compiler or the launch refuses: skip it
            errors.append(f"{config}: {type(error).__name__}: {error}")
            if verbose:
                print(f"   config {config} skipped: {type(error).__name__}: {str(error)[:100]}")
    if not timings:
        raise RuntimeError(f"every kernel config failed for {geometry.describe()}; first error: "
                           f"{errors[0] if errors else '?'}")
    best, medians = choose_among(timings, heuristic if heuristic in timings else None,
                                 lambda config: _benchmark_ms(timed(plan_for(geometry, x_nhwc.dtype, config,
                                                                             out_dtype))))
    to_tflops = lambda ms: geometry.flops / ms / 1e9  # noqa: E731
    if verbose:
        for config, ms in sorted(timings.items(), key=lambda item: item[1]):
            final = f"   final median {to_tflops(medians[config]):7.1f}" if config in medians else ""
            print(f"   {str(config):<40} {to_tflops(ms):7.1f} TFLOPS{final}" + ("   <- chosen" if config == best else "")
                  + ("   (heuristic)" if config == heuristic else ""))
    if not details:
        return best, to_tflops(medians[best])
    return best, to_tflops(medians[best]), heuristic, (to_tflops(medians[heuristic]) if heuristic in medians else None)


def remember_config(geometry, dtype, config, tag=""):
    """Use `config` for this shape, dtype and epilogue from now on in this process, as if tuned here
    (a benchmark that replays an earlier run's choices: `network_suite.py --replay`)."""
    _BEST_CONFIG[(geometry, dtype, torch.cuda.current_device(), tag)] = KernelConfig(*config)
