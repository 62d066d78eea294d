"""The whole test suite on one GPU machine: many pytest processes, one deadline, one summary.

    python tools/gpu_tests.py                         # every test, 14 processes, 540 s
    python tools/gpu_tests.py --part 1/2              # the first half of the chunks (a second call: --part 2/2)
    python tools/gpu_tests.py --workers 8 --deadline 300 tests/operator   # a pytest selection
    python tools/gpu_tests.py --workers 26 --gpus 2   # a host of two GPUs: processes alternate between them

Why not one pytest: most of a GPU run is Triton compiling kernels on the CPU (an H100 host ran the
suite's ~1,500 tests in about 8,000 process-seconds), so it takes many processes. Why not fixed
shards (conftest.py's CONV_TUTORIAL_SHARD=i/n): a shard that draws the slow tests (200 random fp8
layers in one test) runs past the limit while the others idle, and its unrun tests go unreported.
Here the tests are collected once and cut into chunks within a file; the chunks that hold the
slow tests (ids with "random" in them: the tests of 100-200 random layers alone, the
random layers one per test in half-size chunks) go first; `--workers` processes take
chunks from one queue until the deadline. Each test's outcome is recorded as it happens (this
file is also a pytest plugin), so a chunk stopped at the deadline still reports what it finished,
and the tests it did not reach are listed as unreported, never counted as passed. With `--rerun-failed`,
failures run again in fewer processes: on this suite, 20 processes once ran an 80 GB H100 out of
memory, and 180 allocation failures passed when run again in 8 (results/notebook.md, 2026-11-25).

Writes <out>/summary.txt (counts, device and versions, failures with their first error line,
unreported ids) and each chunk's log and record (<out>/chunks/). Exit status 0 only if every collected test
reported and none failed.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = re.compile(r"_on_\d+_random")  # one test of 100-200 random layers (minutes): a chunk of its own, first
SLOW = re.compile(r"random")            # one random layer each (a compile, 5-10 s): half-size chunks, next


def chunks_of(node_ids, size):
    """The node ids cut into chunks within one file and kind: each heavy test alone, then the slow
    ones in chunks of size / 2, then the rest in chunks of `size`, in collection order."""
    groups = {}
    for node_id in node_ids:
        kind = 0 if HEAVY.search(node_id) else 1 if SLOW.search(node_id) else 2
        groups.setdefault((kind, node_id.split("::")[0]), []).append(node_id)
    chunks = []
    for (kind, _), ids in sorted(groups.items(), key=lambda item: item[0][0]):    # stable: files in order
        step = (1, max(1, size // 2), size)[kind]
        chunks += [ids[i:i + step] for i in range(0, len(ids), step)]
    return chunks


_RECORD = None      # the chunk's record: $GPU_TESTS_RECORD as the session began (a test may change the variable)


def pytest_configure(config):
    global _RECORD
    _RECORD = os.environ.get("GPU_TESTS_RECORD")


def pytest_runtest_logreport(report):
    """Loaded into each chunk's pytest as a plugin (`-p gpu_tests`): appends every test's outcome,
    and a failure's first error line, to the chunk's record the moment it is known, so a chunk
    stopped at the deadline has recorded all it finished."""
    record_outcome(report, _RECORD)


def record_outcome(report, record):
    """Appends a report's outcome to the file `record` (nothing if None): a call's outcome, or a
    setup's or teardown's that did not pass."""
    if not record or not (report.when == "call" or report.outcome != "passed"):
        return
    outcome = {"passed": "PASSED", "skipped": "SKIPPED"}.get(report.outcome,
                                                            "FAILED" if report.when == "call" else "ERROR")
    error = next((line[1:].strip() for line in report.longreprtext.splitlines() if line.startswith("E ")), "")
    with open(record, "a") as handle:
        handle.write(f"{report.nodeid}\t{outcome}\t{error if outcome in ('FAILED', 'ERROR') else ''}\n")


def recorded(path):
    """{node id: (outcome, first error line)} from a record; a later line for a test wins (a teardown error)."""
    found = {}
    for line in Path(path).read_text(errors="replace").splitlines() if Path(path).exists() else []:
        node_id, outcome, error = (line.split("\t") + ["", ""])[:3]
        found[node_id] = (outcome, error)
    return found


def collect(selection):
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *selection], cwd=ROOT,
                          capture_output=True, text=True)
    ids = [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"collected no tests:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return ids


def run_chunks(chunks, workers, deadline, out, tag, gpus=1):
    """Runs the chunks in `workers` processes until `deadline` (time.monotonic()), the k-th process on
    GPU k % `gpus` (CUDA_VISIBLE_DEVICES); returns {node id: (outcome, first error line)} of the
    tests that reported."""
    queue, results = deque(enumerate(chunks)), {}
    (out / "chunks").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tools"), os.environ.get("PYTHONPATH")])))

    def worker(gpu):
        while queue and deadline - time.monotonic() > 30:      # no chunk starts in the last 30 s
            index, ids = queue.popleft()
            log, record = out / "chunks" / f"{tag}{index:03d}.log", out / "chunks" / f"{tag}{index:03d}.tsv"
            record.unlink(missing_ok=True)
            command = [sys.executable, "-m", "pytest", "-q", "-p", "gpu_tests", "-p", "no:cacheprovider", "-o",
                       "faulthandler_timeout=300", *ids]
            with open(log, "w") as handle:
                process = subprocess.Popen(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                           env=dict(env, GPU_TESTS_RECORD=str(record),
                                                    **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpus > 1 else {})))
                try:
                    process.wait(timeout=max(1.0, deadline - time.monotonic() - 20))
                except subprocess.TimeoutExpired:      # Ctrl-C first: pytest ends its session and says so
                    process.send_signal(signal.SIGINT)
                    try:
                        process.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()
                    handle.write("\n[gpu_tests] stopped at the deadline\n")
            results.update(recorded(record))

    with ThreadPoolExecutor(workers) as pool:
        for k in range(workers):
            pool.submit(worker, k % gpus)
    return results


def versions():
    probe = ("import torch, triton; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', "
             "'| torch', torch.__version__, '| Triton', triton.__version__)")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("selection", nargs="*", help="what pytest should collect (default: everything)")
    parser.add_argument("--workers", type=int, default=14, help="pytest processes at once (default 14)")
    parser.add_argument("--deadline", type=float, default=540, help="seconds for the whole run (default 540)")
    parser.add_argument("--gpus", type=int, default=1,
                        help="GPUs to spread the processes over (default 1: the processes see what CUDA_VISIBLE_DEVICES allows)")
    parser.add_argument("--chunk", type=int, default=24, help="tests per chunk (default 24)")
    parser.add_argument("--part", default="1/1", help="i/n: the i-th of n interleaved parts of the chunks")
    parser.add_argument("--rerun-failed", type=int, default=0, metavar="WORKERS",
                        help="run the failures again in this many processes, if time is left")
    parser.add_argument("--out", default=str(ROOT / "out" / "gpu-tests"))
    args = parser.parse_args()
    match = re.fullmatch(r"(\d+)/(\d+)", args.part)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        parser.error(f"--part must be i/n with 1 <= i <= n, got {args.part!r}")
    if args.gpus < 1:
        parser.error(f"--gpus must be at least 1, got {args.gpus}")
    start, out = time.monotonic(), Path(args.out)
    deadline = start + args.deadline
    ids = collect(args.selection)
    part, parts = int(match[1]), int(match[2])
    chunks = chunks_of(ids, args.chunk)[part - 1::parts]
    ids = [node_id for chunk in chunks for node_id in chunk]
    results = run_chunks(chunks, args.workers, deadline, out, "main-", args.gpus)
    failed = [i for i in ids if results.get(i, ("",))[0] in ("FAILED", "ERROR")]
    rerun = {}
    if failed and args.rerun_failed and deadline - time.monotonic() > 60:
        size = -(-len(failed) // args.rerun_failed)
        rerun = run_chunks([failed[i:i + size] for i in range(0, len(failed), size)], args.rerun_failed,
                           deadline, out, "rerun-", args.gpus)
    counts = Counter(results.get(i, ("UNREPORTED",))[0] for i in ids)
    lines = [f"GPU tests: {versions()}", f"command: {' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}",
             f"{len(ids)} tests in {len(chunks)} chunks (part {args.part}), {args.workers} processes "
             f"on {args.gpus} GPU{'s' * (args.gpus > 1)}, "
             f"{time.monotonic() - start:.0f} s of {args.deadline:.0f}",
             "counts: " + ", ".join(f"{n} {outcome.lower()}" for outcome, n in counts.most_common())]
    if rerun:
        again = Counter(rerun.get(i, ("UNREPORTED",))[0] for i in failed)
        lines.append(f"the {len(failed)} failures run again in {args.rerun_failed} processes: "
                     + ", ".join(f"{n} {outcome.lower()}" for outcome, n in again.most_common()))
    lines += [f"FAILED {i}: {results[i][1]}" + (f" (run again: {rerun[i][0]})" if i in rerun else "") for i in failed]
    lines += [f"UNREPORTED {i}" for i in ids if i not in results]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]) + f"\n(summary: {out / 'summary.txt'})")
    still_failing = [i for i in failed if rerun.get(i, ("",))[0] not in ("PASSED", "SKIPPED")]
    sys.exit(0 if not still_failing and counts["UNREPORTED"] == 0 else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
