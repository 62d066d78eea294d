"""compile_pool.ProcessCompiles, the executor of launch.compiling_ahead: compiles in worker processes that
give the caller the same kernels, from Triton's own cache, as compiling them on its threads would. On a CPU:
the kernels are built for sm_90 (no GPU needed) in a fresh process where Triton's interpreter is off."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import common

# A fresh process: a small kernel of the package's (dgrad's zero fill) compiled through the executor as
# Triton's AsyncCompileMode hands it a compile (a closure over src, target, options and env_vars), beside
# triton.compile's own build of the same source; then the cases a worker cannot take.
SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    import torch, triton
    import triton.language as tl
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from conv_tutorial import compile_pool
    from conv_tutorial.kernels import aot, dgrad
    import failing_kernel

    import threading
    threads = []                     # (the thread each closure ran on, in order)

    def closure(src, target, options, env_vars):
        def async_compile():         # (what JITFunction._do_compile submits, with the same names)
            threads.append(threading.current_thread().name)
            return triton.compile(src, target=target, options=options, _env_vars=env_vars)
        return async_compile

    @triton.jit
    def kernel_in_main(out_ptr, BLOCK: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32))

    env_vars = get_cache_invalidating_env_vars()
    dx = torch.zeros(2, 8, 8, 16, dtype=torch.bfloat16)
    def zeros_source(block_c):
        return aot.compile_source(dgrad.untapped_zeros_kernel, (dx, 8, 8, 16, 2, 2, 1, 1),
                                  dict(BLOCK_P=32, BLOCK_C=block_c), "sm_90")
    report = {}
    pool = compile_pool.ProcessCompiles(2)
    src, target, options = zeros_source(16)
    kernel = pool.submit(closure(src, target, options, env_vars)).result()
    report["worker_first"] = compile_pool.compiles_in_workers()
    cache = triton.knobs.cache.dir
    report["cache_entries"] = len([d for d in os.listdir(cache) if os.path.isdir(os.path.join(cache, d))])
    report["same_as_triton"] = kernel.hash == triton.compile(src, target=target, options=options).hash
    report["stores"] = "st.global" in kernel.asm["ptx"]
    hit = pool.submit(closure(src, target, options, env_vars))
    report["hit_done_at_submit"] = hit.done()
    again = hit.result()
    report["worker_after_hit"] = compile_pool.compiles_in_workers()
    report["hit_same"] = again.hash == kernel.hash
    report["threads"] = list(threads)

    main_src, main_target, main_options = aot.compile_source(kernel_in_main, (torch.zeros(16),), dict(BLOCK=16),
                                                             "sm_90")
    in_main = pool.submit(closure(main_src, main_target, main_options, env_vars)).result()
    report["main_compiled_here"] = ("st.global" in in_main.asm["ptx"], compile_pool.compiles_in_workers())
    report["timeline"] = [(e["kernel"], e["where"], e["submitted"] <= e["started"] <= e["finished"])
                          for e in compile_pool.compile_timeline()]

    bad = aot.compile_source(failing_kernel.odd_block, (torch.zeros(16),), dict(BLOCK=3), "sm_90")
    try:
        pool.submit(closure(*bad, env_vars)).result()
        report["failure"] = None
    except Exception as error:
        report["failure"] = type(error).__name__
    report["worker_after_failure"] = compile_pool.compiles_in_workers()

    for worker in pool._all:
        worker.process.kill()
        worker.process.wait()
    src32 = zeros_source(32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after_kill = pool.submit(closure(*src32, env_vars)).result()
    report["after_kill"] = (after_kill.hash == triton.compile(src32[0], target=src32[1], options=src32[2]).hash,
                            [str(w.message) for w in caught])
    src64 = zeros_source(64)
    pool.submit(closure(*src64, env_vars)).result()
    report["worker_after_kill"] = compile_pool.compiles_in_workers()
    workers = list(pool._all)
    pool.shutdown()
    report["stopped"] = bool(workers) and all(worker.process.poll() is not None for worker in workers)

    # (a worker that compiles with other options: its kernel lands at another key)
    compile_pool._WORKER_MAIN = (
        "import triton; compile = triton.compile; triton.compile = lambda src, target, options, _env_vars: "
        "compile(src, target=target, options=dict(options, num_warps=8), _env_vars=_env_vars); "
        "from conv_tutorial.compile_pool import serve; serve()")
    elsewhere = compile_pool.ProcessCompiles(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off_key = elsewhere.submit(closure(*zeros_source(2), env_vars)).result()
    report["off_key"] = ([str(w.message) for w in caught], off_key.metadata.num_warps,
                         compile_pool.compiles_in_workers())
    elsewhere.shutdown()

    compile_pool._WORKER_MAIN = "raise SystemExit(3)"      # (a worker that dies before its first answer)
    broken = compile_pool.ProcessCompiles(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = (broken.submit(closure(*zeros_source(block), env_vars)).result() for block in (8, 4))
    report["dead_at_start"] = (len(broken._all), [str(w.message) for w in caught],
                               all("st.global" in k.asm["ptx"] for k in (first, second)),
                               compile_pool.compiles_in_workers())
    broken.shutdown()
    print("POOL-JSON:" + json.dumps(report))
""")

FAILING_KERNEL = textwrap.dedent("""
    import triton
    import triton.language as tl

    @triton.jit
    def odd_block(out_ptr, BLOCK: tl.constexpr):       # (tl.arange needs a power of two: its compile fails)
        tl.store(out_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32))
""")


def test_tritons_compile_closure_has_the_names_the_pool_reads():
    """The pool reads src, target, options and env_vars off the closure Triton's JITFunction submits; if a
    Triton release renames them, every compile silently goes back to the threads: this says so instead."""
    from conv_tutorial import compile_pool
    from triton.runtime.jit import JITFunction
    nested = [const for const in JITFunction._do_compile.__code__.co_consts
              if getattr(const, "co_name", None) == "async_compile"]
    assert len(nested) == 1
    assert set(compile_pool.CLOSURE_NAMES) <= set(nested[0].co_freevars), nested[0].co_freevars


def test_workers_compile_into_tritons_cache_and_the_caller_loads_the_same_kernel(tmp_path):
    """In a process with a fresh Triton cache: the first compile goes to a worker, and the caller gets the
    kernel triton.compile builds from the same source (the same hash: the worker wrote it at the caller's
    key); the same compile again is a cache hit, no worker asked, loaded on the caller's thread before submit
    returns. A kernel defined in the main script (no
    worker can import it) compiles on the caller's thread; one whose compile fails raises Triton's error
    there. A worker killed under the pool: one warning, the kernel still compiled, and the next compile
    starts a new worker. At shutdown every worker has exited. A worker whose kernel lands at another key
    than the caller's is said (one warning) and not counted, and the caller compiles its own. A worker
    that dies before its first answer (it could not start: so would the next) leaves every later compile
    on the threads: one warning, one worker started, the kernels compiled. compile_timeline lists each compile
    where it ran (a worker, the cache at submit, the pool's thread), its times in order."""
    (tmp_path / "failing_kernel.py").write_text(FAILING_KERNEL)
    (tmp_path / "pool_script.py").write_text(SCRIPT)         # (Triton reads a kernel's source from its file)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(common.REPO_ROOT), str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(tmp_path / "pool_script.py")], capture_output=True, text=True, env=env,
                          timeout=600)
    if "Cannot find ptxas" in proc.stderr:
        pytest.skip("this Triton install has no assembler for sm_90 (ptxas), so no kernel compiles here")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("POOL-JSON:")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    report = json.loads(lines[-1][len("POOL-JSON:"):])
    assert report["worker_first"] == 1 and report["cache_entries"] == 1     # (one key: the worker's and the caller's)
    assert report["same_as_triton"] and report["stores"]
    assert report["worker_after_hit"] == 1 and report["hit_same"]
    # (the miss loaded on a thread of the pool once its worker had compiled it; the hit on the caller's, at submit)
    assert report["threads"][0].startswith("conv_tutorial_compile") and report["threads"][1] == "MainThread"
    assert report["hit_done_at_submit"]
    assert report["main_compiled_here"] == [True, 1]
    # (compile_timeline: each compile where it ran, in order, its times in order)
    assert report["timeline"] == [["untapped_zeros_kernel", "worker", True], ["untapped_zeros_kernel", "cache", True],
                                  ["kernel_in_main", "here", True]], report["timeline"]
    assert report["failure"] == "CompilationError" and report["worker_after_failure"] == 1
    same, warned = report["after_kill"]
    assert same and len(warned) == 1 and "worker process exited" in warned[0], warned
    assert report["worker_after_kill"] == 2
    assert report["stopped"]
    warned, num_warps, in_workers = report["off_key"]
    assert len(warned) == 1 and "not at this process's key" in warned[0] and in_workers == 2, report["off_key"]
    assert num_warps == 4      # (the caller's own build, not the worker's)
    started, warned, compiled, in_workers = report["dead_at_start"]
    assert started == 1 and len(warned) == 1 and "exited (3)" in warned[0] and compiled and in_workers == 2, \
        report["dead_at_start"]


def test_a_worker_whose_pipe_closes_before_it_exits_is_said_with_its_exit_status():
    """A worker's pipe can close a moment before its process ends: on a loaded machine the pool once said
    "a worker process exited (None)". The status it reports waits for the process to end."""
    from conv_tutorial import compile_pool
    code = "import os, sys, time; os.close(1); time.sleep(0.5); sys.exit(3)"
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    worker = compile_pool._Worker(process)
    assert worker.compile(b"a request") is False and not worker.alive and worker.answered == 0
    assert worker.returncode() == 3


def test_no_compile_is_taken_after_shutdown():
    """As any Executor: submit after shutdown raises, a cached kernel's load (which submit runs itself) too."""
    from conv_tutorial import compile_pool
    pool = compile_pool.ProcessCompiles(1)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)


@pytest.mark.parametrize("niceness", [-1, 20, True, 1.5, "10"])
def test_a_niceness_outside_0_to_19_is_refused_by_name(niceness):
    from conv_tutorial import compile_pool
    with pytest.raises(ValueError, match=r"niceness must be an int from 0 to 19, got " + repr(niceness).replace(".", r"\.")):
        compile_pool.ProcessCompiles(1, niceness=niceness)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="the platform has no os.getpriority")
def test_a_worker_runs_at_the_niceness_asked_below_the_caller():
    """A worker started with niceness 3 runs 3 below this process's priority (read off the worker's
    process once it has answered a request, so after its os.nice ran); one started with 0, at this one's."""
    from conv_tutorial import compile_pool
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for niceness in (0, 3):
        worker = compile_pool._Worker.start(niceness)
        try:
            assert worker.compile(b"not a pickle") is False and worker.alive     # (answered b"0": it could not)
            assert os.getpriority(os.PRIO_PROCESS, worker.process.pid) == min(19, own + niceness)
        finally:
            worker.stop()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="the platform has no os.getpriority")
def test_the_pool_starts_its_workers_at_its_niceness():
    """The pool's own path to a worker (a request with no worker idle starts one) passes its niceness on."""
    from conv_tutorial import compile_pool
    own = os.getpriority(os.PRIO_PROCESS, 0)
    pool = compile_pool.ProcessCompiles(1, niceness=3)
    try:
        assert pool._in_worker(b"not a pickle") is False and len(pool._all) == 1     # (answered: it could not)
        assert os.getpriority(os.PRIO_PROCESS, pool._all[0].process.pid) == min(19, own + 3)
    finally:
        pool.shutdown()


@pytest.mark.parametrize("wait", [True, False])
def test_compiling_ahead_lowers_the_workers_priority_only_in_the_background(monkeypatch, wait):
    """Waited for, the compiles are all the caller runs: the workers keep its priority. In the background
    they run beside the caller's own work (torch.compile tracing the first step), BACKGROUND_NICENESS below."""
    from conv_tutorial import compile_pool, launch
    made = []

    class Recorded(compile_pool.ProcessCompiles):
        def __init__(self, workers, niceness=0):
            made.append(niceness)
            super().__init__(workers, niceness)

    monkeypatch.setattr(compile_pool, "ProcessCompiles", Recorded)
    with launch.compiling_ahead(workers=1, wait=wait):
        pass
    assert made == [0 if wait else launch.BACKGROUND_NICENESS] and 0 < launch.BACKGROUND_NICENESS <= 19
