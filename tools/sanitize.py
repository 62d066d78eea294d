"""Run NVIDIA compute-sanitizer's four tools over lessons 04 to 08 on small shapes.

    python tools/sanitize.py                 # every tool x every case, one summary line each
    python tools/sanitize.py --tools racecheck --only "05 128x128x64 4 stages 4 warps"   # a subset
    python tools/sanitize.py --case NAME     # run one case once, unsanitized (what each tool wraps)

Needs a Hopper GPU and the CUDA toolkit's `compute-sanitizer` (on PATH, in $CUDA_HOME/bin or in
/usr/local/cuda/bin). The cases cover lesson 04's kernel and every Hopper candidate config of
lesson 05 (one consumer, ping-pong, tail tiles, 2 programs per SM), with and without bias. Each
lesson 05 case runs on only two programs, so that every program walks several tiles: the ring
wraps, the barrier phases flip, ping-pong turns alternate and TMA stores overlap the next tile,
which is where a race would live. Split-K cases run on 64 programs (every tile split), and one
on 3 (whole tiles, then the last wave's tiles in slices). The backward lessons' cases run the
gradients (lesson 06's dgrad: the forward kernel on dY, one launch per phase, with the zero-fill
kernel; lesson 07's wgrad: its own kernel on a few programs, with split tiles and the ordered sum
of their slices) and lesson 08's channel sums in the forward kernel's epilogue.
Inputs are made and checked on the CPU (torch's reference conv and gradients), so the GPU runs
only the kernels under test and a few copies.

What each tool checks, and how a report is judged (details in RESULTS.md, "Sanitizers"):
- memcheck: out-of-bounds and misaligned accesses (PyTorch's caching allocator is turned off so
  that every tensor is its own allocation and an overrun is seen);
- racecheck: shared-memory hazards between threads. One kind of report is explained and
  listed as such: the accesses of Triton's warp-specialization dispatch (the default warpgroup
  writes each worker warp's partition number into shared memory; the workers read it past a
  block-wide barrier). Both instructions are identified in the kernel's SASS; anything else
  counts as unexplained;
- synccheck: invalid uses of barriers;
- initcheck: reads of uninitialized global memory.
The last line says how many reports are unexplained; the exit code is 1 if any are.
"""
import argparse
import concurrent.futures
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402  (first: it picks the Triton interpreter on machines without a GPU)
from conv_tutorial import configs, launch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
SHAPE = dict(N=2, H=16, W=16, Ci=64, R=3, S=3, stride=1, padding=1)   # 512 output pixels, 9 k-steps
RUN_TIMEOUT_S = 300   # one sanitized process
PROGRAMS = 2          # lesson 05 cases run on two programs: each one walks several tiles


def lesson05_cases():
    """(name, config, Co, epilogue) for every Hopper candidate (split-K included), plus the bias on
    three schedules and the whole fused epilogue (scale, bias, residual, ReLU) on four; epilogue is
    None, "bias" or "fused"."""
    lesson05 = _lesson("05-warp-specialized-conv")
    cases = []
    for config in configs.HOPPER_CANDIDATES:
        Co = 320 if config.block_n_tail else 256          # tails: two 160-wide tiles
        cases.append((f"05 {config}", config, Co, None))
    for config in (lesson05.FIXED_CONFIG, configs.PINGPONG_CONFIG,
                   next(c for c in configs.HOPPER_CANDIDATES if c.block_n_tail)):
        Co = 320 if config.block_n_tail else 200            # 200: the last tile is partly past Co
        cases.append((f"05 {config}, bias, Co={Co}", config, Co, "bias"))
    for config in (lesson05.FIXED_CONFIG, configs.PINGPONG_CONFIG,
                   next(c for c in configs.HOPPER_CANDIDATES if c.block_n_tail),
                   next(c for c in configs.HOPPER_CANDIDATES if c.split_k > 1)):
        Co = 320 if config.block_n_tail else 200
        cases.append((f"05 {config}, fused epilogue, Co={Co}", config, Co, "fused"))
    split = next(c for c in configs.HOPPER_CANDIDATES if c.split_k > 1)
    cases.append((f"05 {split}, fused epilogue, Co=200, last wave split", split, 200, "fused"))
    # a row tail with the residual runs on one 8-warp consumer (configs.fitted_to_epilogue)
    row_tail = next(c for c in configs.HOPPER_CANDIDATES if c.block_m_tail and c.num_warps == 8)
    cases.append((f"05 {row_tail}, fused epilogue, Co=200", row_tail, 200, "fused"))
    # a row tail on 5 stages stores its tile by 64-row blocks through one staging buffer
    row_blocks = next(c for c in configs.HOPPER_CANDIDATES if lesson05.stores_by_row_blocks(c))
    cases.append((f"05 {row_blocks}, fused epilogue, Co=200", row_blocks, 200, "fused"))
    return cases


def programs_of(name, config):
    """Programs a case runs on. Split-K splits only the tiles past the last full wave: on 64
    programs every tile of the 8 is split; the "last wave split" case runs 3 programs over them,
    2 full waves of whole tiles, then the 2 tiles left in slices."""
    if config.split_k == 1:
        return PROGRAMS
    return 3 if name.endswith("last wave split") else 64


@gluon.jit
def probe_default(out_ptr):
    offsets = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    gl.store(out_ptr + offsets, offsets)


@gluon.jit
def probe_worker(out_ptr):
    offsets = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    gl.store(out_ptr + 128 + offsets, -offsets)


@gluon.jit
def ws_probe_kernel(out_ptr):
    gl.warp_specialize([(probe_default, (out_ptr,)), (probe_worker, (out_ptr,))], [1], [24])


CASE_NAMES_04 = ["04 single-buffer", "04 single-buffer, Ci=3, stride 2"]
# Lessons 06-08: name -> (what runs, (N, H, W, Ci, Co, R, S, stride, padding, dilation), wgrad's forced
# (block_m, block_n, block_k, split_k, programs), or None for the launcher's choice)
CASES_BACKWARD = {
    "07 wgrad 3x3, 4 programs: 8 tiles whole, 1 in 2 slices":
        ("wgrad", (2, 16, 16, 64, 128, 3, 3, 1, 1, 1), (128, 64, 128, 2, 4)),
    "07 wgrad 1x1, x tiled, 64-row tiles, 3 programs: 2 tiles in 2 slices":
        ("wgrad", (2, 16, 16, 128, 128, 1, 1, 1, 0, 1), (64, 128, 128, 2, 3)),
    "07 wgrad of a stem, folded (Ci=3, 7x7 stride 2)": ("wgrad", (2, 20, 18, 3, 64, 7, 7, 2, 3, 1), None),
    "06 dgrad 3x3 stride 1": ("dgrad", (2, 16, 16, 64, 64, 3, 3, 1, 1, 1), None),
    "06 dgrad 3x3 stride 2, odd sizes, Co=48": ("dgrad", (2, 15, 17, 32, 48, 3, 3, 2, 1, 1), None),
    "06 dgrad 1x1 stride 2 (phases no tap reaches)": ("dgrad", (2, 14, 14, 64, 256, 1, 1, 2, 0, 1), None),
    "08 conv with BatchNorm's channel sums": ("channel sums", (2, 16, 16, 64, 128, 3, 3, 1, 1, 1), None),
}
PROBE = "Triton warp_specialize probe (no shared memory of its own)"


@functools.lru_cache(maxsize=None)
def _lesson(stem):
    return common.load_lesson(stem)


def all_case_names():
    return CASE_NAMES_04 + [name for name, *_ in lesson05_cases()] + list(CASES_BACKWARD) + [PROBE]


# %% One case, run in a child process (under a sanitizer, or plain to compile and warm the cache)

def run_case(name):
    import torch
    if name == PROBE:
        return run_probe()
    if name in CASES_BACKWARD:
        return run_case_backward(name)
    if name.startswith("04"):
        lesson04 = _lesson("04-implicit-gemm-single-buffer")
        shape = dict(SHAPE, Co=128) if name == CASE_NAMES_04[0] else \
            dict(N=2, H=15, W=17, Ci=3, Co=40, R=3, S=3, stride=2, padding=1)
        x_cpu, w_cpu = common.random_conv_inputs(*[shape[k] for k in "N H W Ci Co R S".split()],
                                                 torch.float16, device_name="cpu")
        out = lesson04.conv2d_tma_im2col(x_cpu.cuda(), w_cpu.cuda(), shape["stride"], shape["padding"])
        bias_cpu = None
    else:
        _, config, Co, epilogue = next(case for case in lesson05_cases() if case[0] == name)
        shape = dict(SHAPE, Co=Co)
        x_cpu, w_cpu = common.random_conv_inputs(*[shape[k] for k in "N H W Ci Co R S".split()],
                                                 torch.bfloat16, device_name="cpu")
        bias_cpu = torch.randn(Co) if epilogue else None
        fused = epilogue == "fused"
        scale_cpu = torch.rand(Co) + 0.5 if fused else None
        residual_cpu = torch.randn(shape["N"], shape["H"], shape["W"], Co).bfloat16() if fused else None
        geometry = common.conv_geometry(x_cpu.shape, w_cpu.shape, shape["stride"], shape["padding"])
        arch = "sm_90" if common.is_hopper() else "sm_100"
        plan = launch.ConvPlan(geometry, torch.bfloat16, config, arch,
                                     num_sms=programs_of(name, config) // config.programs_per_sm)
        x, w = x_cpu.cuda(), w_cpu.cuda()
        bias = bias_cpu.cuda() if epilogue else None
        extra = dict(scale=scale_cpu.cuda(), residual=residual_cpu.cuda(), activation="relu") if fused else {}
        out = plan.run(x, w, bias, **extra)
        out = plan.run(x, w, bias, **extra)     # the second call takes the direct-launch path
    expected = common.reference_conv2d_nhwc(x_cpu.float(), w_cpu.float(), None, shape["stride"],
                                            shape["padding"], out_dtype=torch.float32)
    if not name.startswith("04") and fused:
        expected = (expected * scale_cpu + bias_cpu + residual_cpu.float()).relu()
    elif bias_cpu is not None:
        expected = expected + bias_cpu
    expected = expected.to(out.dtype)
    print_output_buffer(out)
    common.assert_close_to_reference(out.cpu(), expected, dtype=out.dtype, K=shape["Ci"] * 9)
    print(f"case ok: {name}")


def print_output_buffer(out):
    # the whole allocation behind `out` (a view of it too), for judging initcheck's reports
    print(f"output buffer at {out.untyped_storage().data_ptr():#x}, {out.untyped_storage().nbytes()} bytes")


def run_case_backward(name):
    """One of the backward lessons' cases (06 dgrad, 07 wgrad, 08 the channel sums), checked against torch on
    the CPU (the lessons' tolerances)."""
    import torch
    lesson06 = _lesson("06-conv-dgrad")
    kind, (N, H, W, Ci, Co, R, S, stride, padding, dilation), forced = CASES_BACKWARD[name]
    x, w, dy, g = lesson06.backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, device_name="cpu")
    if kind == "dgrad":
        out = lesson06.conv2d_dgrad_launch(dy.cuda(), w.cuda(), x.shape, stride, padding, dilation)
        expected, K = lesson06.reference_gradients(x, w, dy, g)[0], g.Co_group * R * S
    elif kind == "wgrad":
        lesson07 = _lesson("07-conv-wgrad")
        config = forced and lesson07.WgradConfig(*forced[:3], split_k=forced[3], programs=forced[4])
        out = lesson07.conv2d_wgrad_launch(x.cuda(), dy.cuda(), w.shape, stride, padding, dilation, config=config)
        expected, K = lesson06.reference_gradients(x, w, dy, g)[1], g.M
    else:       # the channel sums
        out, sums = _lesson("08-training-fusions").conv2d_with_channel_stats(x.cuda(), w.cuda(), stride, padding, dilation)
        stored = out.cpu().reshape(-1, Co).double()
        # the sums of the values stored, up to fp32's rounding in the adds (lesson 08, check_channel_sums)
        for got, want, scale in zip(sums.cpu().double(), (stored.sum(0), (stored * stored).sum(0)),
                                    (stored.abs().sum(0), (stored * stored).sum(0))):
            assert ((got - want).abs() <= 1e-5 * scale + 1e-4).all(), (got, want)
        expected, K = common.reference_conv2d_nhwc(x, w, None, stride, padding, dilation, torch.float32), g.K
    print_output_buffer(out)
    common.assert_close_to_reference(out.cpu(), expected.to(out.dtype), dtype=out.dtype, K=K)
    print(f"case ok: {name}")


def run_probe():
    """A kernel that only warp-specializes: a default partition and a 1-warp worker, each writing
    its own part of a global buffer. Any shared-memory access in it is Triton's own."""
    import torch
    out = torch.zeros(160, dtype=torch.int32, device="cuda")
    ws_probe_kernel[(2,)](out, num_warps=4)
    expected = torch.cat([torch.arange(128), -torch.arange(32)]).to(torch.int32)
    assert torch.equal(out.cpu(), expected), out
    print(f"case ok: {PROBE}")


# %% The driver: each (tool, case) in its own sanitized process

def find_sanitizer():
    for candidate in (shutil.which("compute-sanitizer"),
                      os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer"),
                      *sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"), reverse=True)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("compute-sanitizer not found: install the CUDA toolkit or put it on PATH")


def case_env(cache_dir):
    return dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), PYTORCH_NO_CUDA_MEMORY_CACHING="1",
                PYTHONUNBUFFERED="1")


def sass_of_case(cache_dir):
    """{kernel name: {pc: (instruction, source line)}} from the cubins a case compiled."""
    nvdisasm = shutil.which("nvdisasm") or os.path.join(os.path.dirname(find_sanitizer()), "nvdisasm")
    listings = {}
    for cubin in glob.glob(os.path.join(cache_dir, "**", "*.cubin"), recursive=True):
        text = subprocess.run([nvdisasm, "-g", "-c", cubin], capture_output=True, text=True).stdout
        kernel, line, instructions = Path(cubin).stem, None, {}
        for row in text.splitlines():
            found = re.search(r'//## File ".*", line (\d+)', row)
            if found:
                line = int(found.group(1))
            found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", row)
            if found:
                instructions[int(found.group(1), 16)] = (found.group(2), line)
        listings[kernel] = instructions
    return listings


RACE = re.compile(r"Race reported between (Read|Write) access at (\w+)\+0x([0-9a-f]+)")
AND = re.compile(r"and (Read|Write) access at (\w+)\+0x([0-9a-f]+)[^\[]*\[(\d+) hazards?\]")


def dispatch_access(instruction, def_line):
    """Is this SASS one of warp_specialize's dispatch accesses? They are attributed to the kernel's
    `def` line (no statement of ours), and they are the byte load with which each worker warp reads
    its partition number (LDS.U8) or the stores of all those numbers at once (STS, STS.64)."""
    return (instruction is not None and instruction[1] == def_line
            and re.match(r"(@!?U?P\d+ )?(LDS\.U8|STS(\.64)?) ", instruction[0] + " ") is not None)


def racecheck_pairs(log):
    """[(access, kernel, pc, access, kernel, pc, hazards)] from racecheck's analysis lines
    ("Race reported between Read access at K+0x1f30 ... and Write access at K+0x610 ... [10 hazards]",
    the "and ..." parts on the same line or on the lines after it)."""
    pairs, last = [], None
    for line in log.splitlines():
        found = RACE.search(line)
        if found:
            last = (found.group(1), found.group(2), int(found.group(3), 16))
        for other in AND.finditer(line):
            if last:
                pairs.append((*last, other.group(1), other.group(2), int(other.group(3), 16),
                              int(other.group(4))))
    return pairs


def kernel_def_lines():
    """{kernel name: line of its `def`}: the line Triton gives the code it generates for the
    kernel as a whole, such as the warp_specialize dispatch."""
    import inspect
    from conv_tutorial.kernels import fprop
    kernels = [fprop.conv2d_fprop_kernel,      # (the operator's plans run the package's forward kernel)
               _lesson("07-conv-wgrad").conv2d_wgrad_kernel,
               _lesson("04-implicit-gemm-single-buffer").conv2d_tma_im2col_kernel, ws_probe_kernel]
    lines = {}
    for kernel in kernels:
        source, first = inspect.getsourcelines(kernel.fn)
        lines[kernel.fn.__name__] = first + next(i for i, row in enumerate(source) if row.lstrip().startswith("def "))
    return lines


ERROR_HEADER = re.compile(r"^=+ (?=\S)(?!COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY)(.*)$")
OUTPUT_BUFFER = re.compile(r"output buffer at 0x([0-9a-f]+), (\d+) bytes")
UNINITIALIZED_COPY = re.compile(r"Uninitialized access to 0x([0-9a-f]+) on access by cudaMemcpy source")


def explain_error(tool, header, following, output_range):
    """Why a memcheck/initcheck report is not a bug of the lessons' kernels, or None.

    - memcheck, CUDA_ERROR_INVALID_VALUE from cuFuncSetAttribute: when a kernel needs more than
      48 KB of shared memory, Triton's loader first asks for CU_SHARED_MEMORY_MODE_ALLOW_OVERSIZED
      and, when the driver refuses, falls back to MAX_DYNAMIC_SHARED_SIZE_BYTES
      (triton/backends/nvidia/driver.c, loadBinary). The refusal is expected and handled.
    - initcheck, "uninitialized" bytes read by the copy of the conv's output to the host: the
      kernel writes its output with TMA stores (cp.async.bulk.tensor ... global.shared), which
      initcheck does not track as initializing writes. Every element of that output has just been
      compared with the reference, so it was written."""
    if tool == "memcheck" and "CUDA_ERROR_INVALID_VALUE" in header and "cuFuncSetAttribute" in header:
        return "Triton's oversized-shared-memory probe (handled)"
    copied = UNINITIALIZED_COPY.search(following)
    if tool == "initcheck" and copied and output_range:
        address = int(copied.group(1), 16)
        if output_range[0] <= address < output_range[1]:
            return "output written by TMA stores, which initcheck does not track"
    return None


def judge(tool, case, log, cache_dir):
    """(summary line, unexplained count, details)."""
    if "case ok" not in log:
        return f"{tool:<9} | {case:<52} | did not finish", 1, log[-3000:]
    if tool != "racecheck":
        errors = re.search(r"ERROR SUMMARY: (\d+) error", log)
        total = int(errors.group(1)) if errors else 0
        found = OUTPUT_BUFFER.search(log)
        output_range = (int(found.group(1), 16), int(found.group(1), 16) + int(found.group(2))) if found else None
        lines = log.splitlines()
        reasons = {}
        for i, line in enumerate(lines):
            header = ERROR_HEADER.match(line)
            if header:
                reason = explain_error(tool, header.group(1), "\n".join(lines[i + 1:i + 3]), output_range)
                reasons[reason] = reasons.get(reason, 0) + 1
        explained = sum(count for reason, count in reasons.items() if reason)
        unexplained = total - explained
        why = "; ".join(f"{count} x {reason}" for reason, count in reasons.items() if reason)
        line = (f"{tool:<9} | {case:<52} | {total} errors: {explained} explained, {unexplained} unexplained"
                + (f" ({why})" if why else ""))
        return line, unexplained, ""
    summary = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", log)
    if not summary:
        return f"{tool:<9} | {case:<52} | no racecheck summary", 1, log[-3000:]
    pairs = racecheck_pairs(log)
    sass, def_lines = sass_of_case(cache_dir), kernel_def_lines()
    explained, unexplained, details = 0, 0, []
    for a, kernel, pc, b, kernel2, pc2, hazards in pairs:
        first = sass.get(kernel, {}).get(pc)
        second = sass.get(kernel2, {}).get(pc2)
        ok = (dispatch_access(first, def_lines.get(kernel)) and dispatch_access(second, def_lines.get(kernel2)))
        explained += hazards if ok else 0
        unexplained += 0 if ok else hazards
        details.append(f"    {a} {kernel}+{pc:#x} ({first[0] if first else '?'}) / {b} +{pc2:#x} "
                       f"({second[0] if second else '?'}): {hazards} hazards, "
                       + ("warp_specialize dispatch state (explained)" if ok else "UNEXPLAINED"))
    total = int(summary.group(1))
    if total and not pairs:        # hazards without an analysis line: cannot be judged
        unexplained = total
    line = (f"{tool:<9} | {case:<52} | {total} hazard reports: {explained} hazards explained "
            f"(warp_specialize dispatch state), {unexplained} unexplained")
    return line, unexplained, "\n".join(details)


def run_one(sanitizer, tool, case, cache_dir, logdir):
    command = [sanitizer, "--tool", tool, "--print-limit", "1000000", sys.executable, __file__,
               "--case", case]
    if tool == "racecheck":
        command[3:3] = ["--racecheck-report", "analysis"]
    else:                          # one line per error is enough to judge it; backtraces are huge
        command[3:3] = ["--show-backtrace", "no"]
    try:
        proc = subprocess.run(command, env=case_env(cache_dir), capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as timeout:
        log = f"{timeout.stdout or ''}{timeout.stderr or ''}\ntimed out after {RUN_TIMEOUT_S} s"
    slug = re.sub(r"[^A-Za-z0-9]+", "_", case).strip("_")
    (logdir / f"{tool}-{slug}.log").write_text(log)
    return judge(tool, case, log, cache_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", help="run one case once, without a sanitizer")
    parser.add_argument("--only", action="append", metavar="CASE",
                        help="run only this case (repeatable; default: every case)")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--jobs", type=int, default=8, help="sanitized processes at a time")
    parser.add_argument("--logdir", default=None, help="where each run's full log goes")
    args = parser.parse_args()
    if args.case:
        return run_case(args.case)

    if not (common.has_tma_mma_gpu() and common.is_hopper()):
        raise SystemExit(f"the sanitizer runs need a Hopper GPU: {common.GLUON_SKIP_REASON}")
    sanitizer = find_sanitizer()
    cases = args.only or all_case_names()
    unknown = sorted(set(cases) - set(all_case_names()))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; the cases are: {all_case_names()}")
    tools = args.tools.split(",")
    logdir = Path(args.logdir or common.output_dir(announce=False) / "sanitizer")
    logdir.mkdir(parents=True, exist_ok=True)
    caches = {case: Path(tempfile.mkdtemp(prefix="sanitize-cache-")) for case in cases}
    print(f"{sanitizer}; {common.gpu_name()}; logs in {logdir}")
    # Compile every case once, unsanitized (and check its result), so the sanitized runs reuse
    # the cached kernels and the SASS that racecheck's offsets refer to is on disk.
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        warm = {case: pool.submit(subprocess.run, [sys.executable, __file__, "--case", case],
                                  env=case_env(caches[case]), capture_output=True, text=True)
                for case in cases}
        for case, future in warm.items():
            proc = future.result()
            if proc.returncode:
                raise SystemExit(f"case {case!r} failed without a sanitizer:\n{proc.stderr[-3000:]}")
        jobs = {pool.submit(run_one, sanitizer, tool, case, caches[case], logdir): (tool, case)
                for tool in tools for case in cases}
        results = {}
        for future in concurrent.futures.as_completed(jobs):     # progress, as runs finish
            results[jobs[future]] = future.result()
            print("  done:", results[jobs[future]][0], flush=True)
    print("\nSummary, one line per tool and case:")
    unexplained = 0
    for tool in tools:
        for case in cases:
            line, count, details = results[(tool, case)]
            print(line)
            if details:
                print(details)
            unexplained += count
    print(f"{len(jobs)} sanitized runs ({len(tools)} tools x {len(cases)} cases): "
          f"{unexplained} unexplained reports")
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main() or 0)
