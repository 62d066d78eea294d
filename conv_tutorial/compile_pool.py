"""Kernel compiles in worker processes, for launch.compiling_ahead.

Why processes: a compile's front end (Python walking the kernel's source into MLIR) holds the GIL.
In a pool of threads, the compiles take turns on the caller's interpreter with whatever the caller
runs beside them: with `compile_kernels_ahead(wait=False)`, torch.compile tracing the first step.
ResNet-50's first steps took longer with the compiles in the background on threads than after them
(RESULTS.md, "Training"). A worker process gives each compile an interpreter of its own.

How: Triton's AsyncCompileMode hands each compile to its executor as a closure over the kernel's
ASTSource, the GPU target, the options and the environment variables that key Triton's cache.
`ProcessCompiles.submit` runs the closure on one of its threads, which first sends those four (the
kernel named by module and name) to an idle worker. The worker compiles into Triton's file cache,
at the same key in the same folder. The closure then finds the kernel there and only loads it. Where the
worker cannot help, the closure compiles on the thread, as a pool of threads would. That is a kernel
defined where a worker cannot import it, one whose parts do not pickle, or a worker that failed. So the
result is the same kernel, and a compile that fails raises Triton's own error. A kernel already in the
cache needs no compile: `submit` loads it at once on the caller's thread, where it does not take turns
for the GIL with what the caller runs next.

Workers are `python -c` processes reading requests on their standard input. They are not
multiprocessing's, which would import the caller's main script. They start at the first compile that
needs one, at most one per thread. They exit when the executor shuts down, or with the caller's process.

Priority: compiles in the background share the CPUs with the caller's own work, and a worker (with its
ptxas) is one more task for the scheduler to give each core's turns to. `niceness` lowers the workers'
priority (os.nice) so that the caller's thread is not the one that waits for a core: measured as the
seconds ResNet-50's first step's thread spent off a CPU while it was traced beside the pool (RESULTS.md,
"Where the first step's compile goes").
"""
import collections
import hashlib
import importlib
import inspect
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import triton
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

# What Triton's asynchronous compile closure (JITFunction._do_compile's `async_compile`) closes over: a test
# checks that Triton's closure still has these names.
CLOSURE_NAMES = ("src", "target", "options", "env_vars")

_HEADER = struct.Struct("<Q")      # a request's length; 0 asks the worker to exit
_WORKER_MAIN = "from conv_tutorial.compile_pool import serve; serve()"

_compiles_in_workers = 0           # compiles the workers finished, in this process (the tests read it)
_count_lock = threading.Lock()
_TIMELINE = collections.deque(maxlen=4096)     # one dict per submitted compile (compile_timeline)


def compiles_in_workers() -> int:
    """How many compiles worker processes have finished for this process so far."""
    return _compiles_in_workers


def compile_timeline() -> list:
    """The compiles submitted to any ProcessCompiles of this process, oldest first (the last 4096): a dict
    each, {"kernel": its name, "where": "cache" (in Triton's cache: loaded at submit, on the caller's thread),
    "worker" (compiled by a worker process) or "here" (on the pool's thread: a worker could not), "submitted",
    "started", "finished": time.perf_counter() seconds, "finished" None while it runs}. What a benchmark
    reads to see whether a first step waited for the pool."""
    with _count_lock:
        return [dict(entry) for entry in _TIMELINE]


def _timed(job, where, submitted):
    entry = {"kernel": getattr(getattr(job[0], "fn", None), "__name__", "?") if job else "?", "where": where,
             "submitted": submitted, "started": time.perf_counter(), "finished": None}
    with _count_lock:
        _TIMELINE.append(entry)
    return entry


class ProcessCompiles(Executor):
    """An executor for triton.AsyncCompileMode: `workers` threads, each sending its compile to a worker
    process of its own where one can take it (module docstring). `shutdown(wait=False)` returns at
    once; the compiles submitted finish and the workers exit after them."""

    def __init__(self, workers: int, niceness: int = 0):
        """niceness: how much lower than this process's the workers' scheduling priority is (os.nice's
        increment, 0 to 19; the result is capped at 19, the lowest, so a caller already at 10 or more gets
        less of a gap; 0 where the platform has no os.nice)."""
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if not isinstance(niceness, int) or isinstance(niceness, bool) or not 0 <= niceness <= 19:
            raise ValueError(f"niceness must be an int from 0 to 19, got {niceness!r}")
        self._niceness = niceness if hasattr(os, "nice") else 0
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="conv_tutorial_compile")
        self._idle = []            # workers waiting for a request
        self._all = []
        self._lock = threading.Lock()
        self._warned = False
        self._no_workers = False     # a worker died before its first answer: every compile on the threads
        self._shut = False

    def submit(self, fn, /, *args, **kwargs):
        if self._shut:
            raise RuntimeError("cannot submit a compile after shutdown")
        submitted = time.perf_counter()
        job = None if args or kwargs else _job(fn)
        state = None if job is None else _cache_state(*job)
        if state == "hit":
            # A kernel in Triton's cache loads here, on the caller's thread. On a thread of the pool it would take
            # turns for the GIL with whatever the caller runs beside it, and with warm caches that made
            # ResNet-50's first steps longer than loading the kernels first (RESULTS.md, "Training", "The warm
            # first steps: the background's loads").
            future, entry = Future(), _timed(job, "cache", submitted)
            try:
                future.set_result(fn())
            except Exception as error:      # (Triton's own error, raised where the kernel is asked for)
                future.set_exception(error)
            entry["finished"] = time.perf_counter()
            return future
        return self._threads.submit(self._compile, fn, args, kwargs, job, state, submitted)

    def shutdown(self, wait=True, *, cancel_futures=False):
        self._shut = True
        if wait:
            self._threads.shutdown(wait=True, cancel_futures=cancel_futures)
            self._stop_workers()
        else:
            self._threads.shutdown(wait=False, cancel_futures=cancel_futures)
            # (not a daemon: the process's exit waits for the compiles submitted, as it does for the threads)
            threading.Thread(target=self._stop_after_compiles, name="conv_tutorial_compile_stop").start()

    def _stop_after_compiles(self):
        self._threads.shutdown(wait=True)
        self._stop_workers()

    def _compile(self, fn, args, kwargs, job, state, submitted):
        # (job and its cache state as submit found them: a miss goes to a worker; "unknown", or no job, stays here)
        entry = _timed(job, "here", submitted)
        try:
            request = _pickled(job) if state == "miss" else None
            answer = None if request is None else self._in_worker(request)
            if answer is True and _in_triton_cache(*job):
                global _compiles_in_workers
                with _count_lock:
                    _compiles_in_workers += 1
                    entry["where"] = "worker"
            elif answer is True:     # (compiled at another key: the closure below compiles it again, here)
                self._say_once("a worker's kernel is not at this process's key in Triton's cache")
            kernel = fn(*args, **kwargs)     # (the kernel from Triton's cache where the worker compiled it)
        finally:
            entry["finished"] = time.perf_counter()
        if answer is False:      # (this process compiled what the worker could not)
            self._say_once("a worker could not compile a kernel that this process compiles")
        return kernel

    def _in_worker(self, request):
        """True: a worker compiled `request`; False: it answered that it could not; None: no worker took it."""
        with self._lock:
            if self._no_workers:
                return None
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker.start(self._niceness)
            if worker is None:
                with self._lock:
                    self._no_workers = True
                self._say_once("no worker process could be started")
                return None
            with self._lock:
                self._all.append(worker)
        answer = worker.compile(request)
        if worker.alive:
            with self._lock:
                self._idle.append(worker)
            return answer
        if not worker.answered:     # (it died before its first answer: so would the next one; no more workers)
            with self._lock:
                self._no_workers = True
        self._say_once(lambda: f"a worker process exited ({worker.returncode()})")
        return None

    def _say_once(self, what):
        """One warning per pool; `what` a message, or a function making it (called only if it is said)."""
        with self._lock:
            warned, self._warned = self._warned, True
        if not warned:
            what = what() if callable(what) else what
            warnings.warn(f"conv_tutorial: {what}; its kernel compiles in this process instead", RuntimeWarning,
                          stacklevel=2)

    def _stop_workers(self):
        with self._lock:
            workers, self._all, self._idle = self._all, [], []
        for worker in workers:
            worker.stop()


def _job(fn):
    """(src, target, options, env_vars) that Triton's compile closure `fn` compiles, or None where `fn` is not
    Triton's closure."""
    try:
        names = inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return None
    if not all(name in names for name in CLOSURE_NAMES) or not isinstance(names["src"], ASTSource):
        return None
    src, target, options, env_vars = (names[name] for name in CLOSURE_NAMES)
    options = getattr(options, "__dict__", options)
    return (src, target, options, env_vars) if isinstance(options, dict) else None


def _pickled(job):
    """A worker's request for `job`, or None where it does not pickle (a kernel a worker cannot import by
    name, say)."""
    buffer = io.BytesIO()
    try:
        _KernelsByName(buffer).dump((*job, triton.knobs.cache.dir))
    except Exception:
        return None
    return buffer.getvalue()


def _in_triton_cache(src, target, options, env_vars) -> bool:
    """Whether no worker should compile this: the kernel is in Triton's cache, or `_cache_state` cannot
    tell (a worker's compile could be wasted)."""
    return _cache_state(src, target, options, env_vars) != "miss"


def _cache_state(src, target, options, env_vars) -> str:
    """"hit" where triton.compile(src, target, options) would load the kernel from Triton's cache, "miss"
    where it would compile it: its key and file name as triton.compiler.compile makes them (Triton 3.9).
    "unknown" under settings that make every compile run (always_compile, a stages inspection hook) and
    where Triton's internals are not those (another Triton)."""
    knobs = triton.knobs
    if knobs.compilation.always_compile or knobs.runtime.add_stages_inspection_hook is not None:
        return "unknown"
    try:
        from triton.compiler.compiler import make_backend
        from triton.runtime.cache import get_cache_key, get_cache_manager
        backend = make_backend(target)
        parsed = backend.parse_options(dict(options, **src.parse_options()))
        key = get_cache_key(src, backend, parsed, env_vars=env_vars)
        metadata = f"{src.name[:150]}.json"
        group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(metadata) or {}
        return "hit" if group.get(metadata) is not None else "miss"
    except Exception:        # (another Triton's internals: no worker then, the closure decides)
        return "unknown"


class _KernelsByName(pickle.Pickler):
    """Pickles a JITFunction as its module and name, where importing that module gives it back."""

    def reducer_override(self, obj):
        if not isinstance(obj, JITFunction):
            return NotImplemented
        module, name = obj.fn.__module__, obj.fn.__qualname__
        if module == "__main__" or getattr(sys.modules.get(module), name, None) is not obj:
            raise pickle.PicklingError(f"{module}.{name} cannot be imported by name")
        return _kernel_named, (module, name)


def _kernel_named(module, name):
    return getattr(importlib.import_module(module), name)


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, process):
        self.process = process
        self.alive = True
        self.answered = 0          # requests answered

    @classmethod
    def start(cls, niceness=0):
        if not sys.executable:
            return None
        # (a sandbox that refuses setpriority leaves the worker at the caller's priority, still a worker)
        code = (f"import os\ntry:\n    os.nice({niceness})\nexcept OSError:\n    pass\n{_WORKER_MAIN}" if niceness
                else _WORKER_MAIN)
        try:
            # (no GPU: a compile for a given target needs none, and a worker holds no CUDA context)
            process = subprocess.Popen(python_command(code), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        except OSError:
            return None
        return cls(process)

    def compile(self, request: bytes) -> bool:
        """Send a request and wait for its answer: whether the worker compiled it."""
        try:
            self.process.stdin.write(_HEADER.pack(len(request)) + request)
            self.process.stdin.flush()
            answer = self.process.stdout.read(1)
        except (BrokenPipeError, OSError, ValueError):
            answer = b""
        if answer == b"":
            self.alive = False
        else:
            self.answered += 1
        return answer == b"1"

    def returncode(self):
        # (called once its pipe closed: the pipe closes as the process exits, a moment before it has ended)
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def stop(self):
        try:
            self.process.stdin.write(_HEADER.pack(0))
            self.process.stdin.close()
            self.process.wait(timeout=10)
        except (BrokenPipeError, OSError, ValueError, subprocess.TimeoutExpired):
            self.process.kill()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def python_command(code: str) -> list:
    """The command of a Python process that runs `code` with this process's interpreter and module path
    (so that it imports the same conv_tutorial, Triton and torch), not its main script."""
    paths = [os.path.abspath(path or os.curdir) for path in sys.path]
    return [sys.executable, "-c", f"import json, sys; sys.path[:0] = json.loads(sys.argv[1]); {code}",
            json.dumps(paths)]


def serve():
    """A worker's loop: read a request, compile it into Triton's cache, answer b"1" (compiled) or b"0"
    (failed: the caller compiles it again and sees Triton's error). Anything written to standard output
    while compiling goes to standard error instead, so that only answers reach the caller."""
    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    while True:
        header = requests.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        (length,) = _HEADER.unpack(header)
        if length == 0:
            return
        request = requests.read(length)
        try:
            src, target, options, env_vars, cache_dir = pickle.loads(request)
            if cache_dir and triton.knobs.cache.dir != cache_dir:
                triton.knobs.cache.dir = cache_dir
            triton.compile(src, target=target, options=options, _env_vars=env_vars)
            answer = b"1"
        except Exception:
            answer = b"0"
        answers.write(answer)
