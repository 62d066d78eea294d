"""The operators' repeat calls in C++: a replay run with no Python in the call (native.cpp).

A replay (hostpath.py, launch.Replay) takes the Python out of a repeat call's checks and plans, but
the call still enters Python: the dispatcher converts its arguments for the Python kernel, which
makes a key, walks the replay's program and allocates through torch's Python bindings, ~20 us of
a forward's ~25 (RESULTS.md, "Host time"). native.cpp registers a C++ kernel for each operator
(at the CUDA key, and at AutogradCUDA over the autograd kernel) that keys the call from the
dispatcher's stack and runs the program the Python path built for that key: its allocations by
ATen and its packed launches (packed.py) by packed_launch.c's C entry. The Python path hands each
program over (`offer`) on the first repeat call the C++ kernel could not serve; every other call
(a gradient to record, a tensor subclass, a new key, anything but allocations and launches) goes
to the Python kernel, as before.

The extension is built with torch's headers at the first repeat call on a GPU, in a child process
that a background thread waits for (`start`; torch.utils.cpp_extension, which needs a C++ compiler
and ninja), and cached per torch version; where it cannot be built, the Python path serves, with a
warning. CONV_TUTORIAL_NATIVE=0 (or `set_enabled(False)`) keeps every call on the Python path.
"""
import os
import sys
import threading
import warnings

_HERE = os.path.dirname(__file__)
_ENABLED = [os.environ.get("CONV_TUTORIAL_NATIVE", "1") != "0"]
_OPERATORS = []             # (namespace, name, implementation, autograd kernel or None), as registered
_STATE = {"module": None, "thread": None, "failed": False, "packed": False}   # packed: the C entry attached
_LOCK = threading.Lock()
_SUSPENDED = [0]            # recordings and compile-ahead passes under way: no program runs meanwhile
ACTIVE = [False]            # the kernels are installed: hostpath.call offers programs


def register(library, name, implementation, autograd=None):
    """Serve operator `name` of `library` natively once the extension is built (at once, if it is):
    `implementation` is its Python kernel at the CUDA key (CompositeExplicitAutograd's), `autograd`
    its autograd kernel, if any."""
    with _LOCK:
        _OPERATORS.append((library.ns, name, implementation, autograd))
        if ACTIVE[0]:
            _STATE["module"].install(library.ns, name, "CUDA", implementation, autograd)


def _module():
    """The extension, built into its folder of torch's build root if it is not there yet, and imported."""
    from torch.utils import cpp_extension
    import torch
    try:        # (pip's ninja: its binary sits beside the interpreter, which need not be on PATH)
        import ninja
        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    name = "conv_tutorial_native_" + "".join(c if c.isalnum() else "_" for c in torch.__version__)
    # (under torch's build root, a folder per Python version, as torch's default folder has)
    build_directory = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root(),
                                   f"py{sys.version_info.major}{sys.version_info.minor}", name)
    os.makedirs(build_directory, exist_ok=True)
    return _built_under_lock(build_directory, lambda: cpp_extension.load(
        name=name, sources=[os.path.join(_HERE, "native.cpp")], extra_cflags=["-O2"],
        build_directory=build_directory, verbose=False))


def _built_under_lock(build_directory, load):
    """`load()` (torch.utils.cpp_extension.load into `build_directory`) while this process holds an
    flock on the folder's conv_tutorial.lock. torch's own lock (torch 2.11's FileBaton) is a file that
    its builder deletes when done: a process that dies while building leaves it behind, and every
    later load waits for it forever. That happens when the process exits while this daemon thread
    builds, or on a Ctrl-C or a kill. An flock ends with its process, so a torch lock file found while
    holding ours is such a leftover (every build of this extension takes ours first), and is removed.
    Where flock is missing (not Linux or macOS) or refused (some network file systems), `load()` alone,
    with torch's lock as before."""
    try:
        import fcntl
    except ImportError:
        return load()
    with open(os.path.join(build_directory, "conv_tutorial.lock"), "a") as ours:
        try:
            fcntl.flock(ours, fcntl.LOCK_EX)         # (waits while another process builds)
        except OSError:
            return load()
        try:
            try:
                os.remove(os.path.join(build_directory, "lock"))       # (torch's, left by a build that died)
            except FileNotFoundError:
                pass
            return load()
        finally:
            fcntl.flock(ours, fcntl.LOCK_UN)


_LAUNCHES = {}      # what launch.py tells (`use_launches`): the packed launches' C entry, the profiler check


def use_launches(packed_api, hooks_set):
    """launch.py's part: `packed_api()`, packed_launch.c's capsule or None (packed launches not available),
    and `hooks_set()`, whether a profiler listens to Triton's launches (no program runs then)."""
    with _LOCK:
        _LAUNCHES.update(packed_api=packed_api, hooks_set=hooks_set)
        if _STATE["module"] is not None:        # (attached before launch.py was imported: `ensure()` first)
            _STATE["module"].set_hooks_check(hooks_set)


def _attach(module, packed_launches=True):
    # the module's settings from Python's: the packed launches' C entry, the profiler check, the suspensions.
    # A process may build and attach before launch.py has said how launches are made (`ensure()` before any
    # operator ran): no program exists then, and `use_launches` hands both over when it comes.
    with _LOCK:
        if "hooks_set" in _LAUNCHES:
            module.set_hooks_check(_LAUNCHES["hooks_set"])
        module.set_enabled(_ENABLED[0])
        if _STATE["module"] is not module:      # (attached once: the suspensions under way counted once)
            module.suspend(_SUSPENDED[0])
            _STATE["module"] = module
    if packed_launches:
        _attach_packed_launches()


def _attach_packed_launches():
    # packed_launch.c's C entry, once it is built (packed launches turned on later: at the first offer then)
    if not _STATE["packed"] and "packed_api" in _LAUNCHES:
        packed_api = _LAUNCHES["packed_api"]
        capsule = packed_api()
        if capsule is not None:
            _STATE["module"].set_packed_api(capsule)
            _STATE["packed"] = True


def _build():
    # (in a background thread: the build and the load; the kernels are installed by a caller's thread, `start`)
    try:
        _build_in_a_child_process()
        _attach(_module())      # (built by the child: a cache hit, tens of milliseconds)
    except Exception as error:  # noqa: BLE001  (no compiler, no ninja, another torch: the Python path serves)
        _STATE["failed"] = True
        warnings.warn(f"conv_tutorial: the native repeat path could not be built ({type(error).__name__}: "
                      f"{error}); repeat calls take the Python path", RuntimeWarning)


_LIBRARY_LINE = "conv_tutorial native library: "


BUILD_SECONDS = 1800      # the child's build, at most (a compile of torch's headers takes ~20-60 s)


def _build_in_a_child_process():
    """Build the extension (`_module()`) in another Python process, wait for it, and return the path of
    the library it built; None where no child could be started (`_module()` then builds here). A
    child that fails, or runs past BUILD_SECONDS, raises RuntimeError with the end of its error output.
    Built here, the build's Python (torch's build code and what it runs around the compiler) would run
    on this process's interpreter beside the operators' calls: while a build ran in a thread, calls
    measured several times slower (RESULTS.md, "Host time"). After it, `_module()` here finds the
    build in its folder and only imports it."""
    import subprocess
    from .compile_pool import python_command
    if not sys.executable:
        return None
    code = f"from conv_tutorial import native; print({_LIBRARY_LINE!r} + native._module().__file__)"
    try:
        child = subprocess.run(python_command(code), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, check=False, timeout=BUILD_SECONDS)
    except OSError:
        return None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the build did not finish in {BUILD_SECONDS} s") from None
    paths = [line[len(_LIBRARY_LINE):] for line in child.stdout.splitlines() if line.startswith(_LIBRARY_LINE)]
    if child.returncode != 0 or not paths or not os.path.isfile(paths[-1]):
        raise RuntimeError(f"the build's process exited with {child.returncode}: {child.stderr[-2000:]}")
    return paths[-1]


def start():
    """Build the native kernels in a background thread, once, and install them once built (hostpath.call
    asks at each replay on a GPU until they are; compile_ahead.compile_kernels_ahead before its pass).
    Installing changes the dispatcher's tables, so it happens here, in a thread that calls the operators,
    not in the build's thread. A process whose threads call the operators at the same time should
    install them before it starts those threads (`ensure()`), or keep them off (CONV_TUTORIAL_NATIVE=0):
    a call under way in another thread could read a table being rewritten."""
    if ACTIVE[0] or not _ENABLED[0] or _STATE["failed"]:
        return
    with _LOCK:
        if _STATE["thread"] is None:
            _STATE["thread"] = threading.Thread(target=_build, name="conv_tutorial_native_build", daemon=True)
            _STATE["thread"].start()
        elif _STATE["module"] is not None and not _STATE["thread"].is_alive() and not ACTIVE[0]:
            try:
                for ns, name, implementation, autograd in _OPERATORS:
                    _STATE["module"].install(ns, name, "CUDA", implementation, autograd)
            except Exception as error:  # noqa: BLE001
                _STATE["failed"] = True
                warnings.warn(f"conv_tutorial: the native kernels could not be installed ({type(error).__name__}: "
                              f"{error}); repeat calls take the Python path", RuntimeWarning)
                return
            ACTIVE[0] = True


def ensure() -> bool:
    """Build and install the native kernels now (waiting for a build under way); whether they serve."""
    start()
    if _STATE["thread"] is not None:
        _STATE["thread"].join()
    start()
    return ACTIVE[0] and _ENABLED[0]


def set_enabled(enabled: bool) -> bool:
    """Turn the native repeat path on or off (off: every call goes to the Python kernels, as with
    CONV_TUTORIAL_NATIVE=0); returns the previous setting."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    with _LOCK:
        previous, _ENABLED[0] = _ENABLED[0], enabled
        if _STATE["module"] is not None:
            _STATE["module"].set_enabled(enabled)
    return previous


def invalidate():
    """Forget every program handed over: a setting that chooses a call's path changed (autotuning, the
    backward's backend, packed launches), or the replays were cleared."""
    if _STATE["module"] is not None:
        _STATE["module"].clear()


def offer(qualified_name, replay):
    """Hand the program of `replay` (a launch.Replay that just served a call of operator `qualified_name`)
    to the C++ kernel serving that call, if one is, under the call's key. Programs with steps that run
    torch's Python (a derived tensor, a finish: wgrad's folded stem, a wgrad whose column fold pads
    its channels) stay in Python."""
    steps = getattr(replay, "native_steps", None)      # (worked out once per replay)
    if steps is None:
        if not replay.program:
            return False
        size, program = replay.program
        steps = []
        for op in program:
            kind = op[0]
            if kind == "alloc":
                _, base, shape, strides, dtype, zeroed, position = op
                steps.append(("alloc", base, tuple(shape), None if strides is None else tuple(strides), dtype,
                              zeroed, position))
            elif kind in ("launch", "free"):
                steps.append(op)
            else:
                steps = False
                break
        replay.native_steps = steps = steps and (size, list(replay.sources), steps)
        if steps and replay.packed:
            _attach_packed_launches()
    if not steps:
        return False
    size, sources, steps = steps
    return _STATE["module"].offer(qualified_name, size, sources, steps)


def offer_or_stop(qualified_name, replay):
    """`offer`, for hostpath.call, whose result is already computed: a failure to hand a program over (a
    fault of this module's) turns the native path off with a warning, and fails no call."""
    try:
        return offer(qualified_name, replay)
    except Exception as error:  # noqa: BLE001
        set_enabled(False)
        warnings.warn(f"conv_tutorial: a replay could not be handed to the native kernels ({type(error).__name__}: "
                      f"{error}); repeat calls take the Python path from now on", RuntimeWarning)
        return False


class suspended:
    """While active (a recording, a compile-ahead pass), no call runs a native program: the Python path
    sees every launch."""

    def __enter__(self):
        with _LOCK:
            _SUSPENDED[0] += 1
            if _STATE["module"] is not None:
                _STATE["module"].suspend(1)

    def __exit__(self, *exc):
        with _LOCK:
            _SUSPENDED[0] -= 1
            if _STATE["module"] is not None:
                _STATE["module"].suspend(-1)


def counts():
    """{operator: (calls served natively, calls sent to Python, programs kept)} (the tests and the
    benchmarks read it); {} before the kernels are installed."""
    return {} if _STATE["module"] is None else dict(_STATE["module"].counts())


def declines():
    """{operator: {reason: calls}}: why the calls that `counts` sends to Python went there ("no program": a
    key's first calls, or one whose path Python keeps; "gradient to record", "suspended", "misaligned
    address", "launch hooks set", "stale program", "other dispatch key", "other device", "unkeyed
    argument", "disabled"), counted per kernel: a call that the autograd kernel sends to Python and whose
    call below autograd misses too counts twice; {} before the kernels are installed."""
    if _STATE["module"] is None:
        return {}
    return {op: dict(reasons) for op, reasons in _STATE["module"].declines().items()}
