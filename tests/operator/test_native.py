"""The native repeat path (conv_tutorial/native.py, native.cpp), on a CPU: the extension built with
torch's headers, its kernels installed for a test operator at the CPU key and at AutogradCPU, over
Python kernels that record their calls and hand over a program whose launch is a stand-in (it copies
the input into the output through the addresses it is given, as a kernel would). What a hit runs,
what goes to Python, and when a program is forgotten. On a GPU (test_replay.py): every path of the
operators through the native kernels, with the bits of the Python path."""
import ctypes
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import conv_tutorial.launch  # noqa: F401  (tells native.py how launches are made)
from conv_tutorial import native

NS, NAME = "conv_tutorial_native_test", "f"
QUALIFIED = f"{NS}::{NAME}"


class CopyLaunch:
    """A program's launch: copies the input (bases[0]) into the output (bases[2]), as many bytes as the input has."""

    def __init__(self, nbytes):
        self.nbytes, self.seen = nbytes, []

    def launch(self, stream, bases):
        self.seen.append((stream, list(bases)))
        ctypes.memmove(bases[2], bases[0], self.nbytes)


class Program:
    """What native.offer reads of a launch.Replay: its sources, its program (number of bases, steps), and
    whether its launches are packed (here: stand-ins, which the C++ kernel calls through Python)."""

    def __init__(self, shape, launch):
        self.sources, self.packed = ("input", "weight"), False
        self.program = (5, (("alloc", 2, shape, None, torch.float32, False, 0),
                            ("alloc", 3, (2, 3), (1, 2), torch.float32, True, 1),     # strided, zeroed
                            ("alloc", 4, (16,), None, torch.float32, False, None),    # a workspace
                            ("launch", launch),
                            ("free", 4)))


class Operator:
    def __init__(self, module):
        self.python_calls, self.autograd_calls, self.offers, self.launches = [], [], [], {}
        self.setting_changes_during_call = False
        lib = torch.library.Library(NS, "DEF")
        lib.define(f"{NAME}(Tensor input, Tensor weight, Tensor? bias, int[] stride, str activation=\"none\", "
                   f"ScalarType? out_dtype=None) -> (Tensor, Tensor)")
        lib.impl(NAME, self.implementation, "CompositeExplicitAutograd")
        lib.impl(NAME, self.autograd, "Autograd")
        lib.define("g(Tensor input) -> (Tensor, int)")
        self.lib = lib
        native._attach(module, packed_launches=False)
        module.install(NS, NAME, "CPU", self.implementation, self.autograd)
        self.op = getattr(getattr(torch.ops, NS), NAME).default

    def implementation(self, input, weight, bias, stride, activation="none", out_dtype=None):
        self.python_calls.append((type(stride), stride, activation, out_dtype, bias is None))
        if activation == "raise":
            raise ValueError("activation 'raise' is refused (a test of errors through the native kernel)")
        shape = tuple(input.shape)
        launch = self.launches.setdefault(shape, CopyLaunch(input.nbytes))
        if self.setting_changes_during_call:     # (another thread's set_backward, say, while this call runs)
            native.invalidate()
        self.offers.append(native.offer(f"{NS}::g", Program(shape, launch)))     # another operator's: refused
        self.offers.append(native.offer(QUALIFIED, Program(shape, launch)))
        return input.clone(), torch.zeros(3, 2).t()

    def autograd(self, *args):
        self.autograd_calls.append(len(args))
        with torch._C._AutoDispatchBelowAutograd():
            return self.op(*args)


@pytest.fixture(scope="module")
def operator():
    module = native._module()       # (a C++ compiler and ninja: CI builds it, ~20-60 s)
    return Operator(module)


def _args(shape=(2, 3, 4, 4)):
    x = torch.randn(shape)
    return x, torch.randn(5, 3, 1, 1)


def test_a_repeat_call_runs_the_program_handed_over(operator):
    x, w = _args()
    operator.op(x, w, None, [1, 1])                      # a miss: Python, which hands its program over
    assert operator.offers[-2:] == [False, True]
    hits_before = native.counts()[QUALIFIED][0]
    python_calls = len(operator.python_calls)
    x2, w2 = _args()
    out, stats = operator.op(x2, w2, None, [1, 1])
    assert len(operator.python_calls) == python_calls and native.counts()[QUALIFIED][0] == hits_before + 1
    torch.testing.assert_close(out, x2, rtol=0, atol=0)      # the launch's copy, into the output allocated
    assert stats.shape == (2, 3) and stats.stride() == (1, 2) and not stats.any()   # zeroed, strided as recorded
    stream, bases = operator.launches[tuple(x.shape)].seen[-1]
    assert stream == 0 and bases[:4] == [x2.data_ptr(), w2.data_ptr(), out.data_ptr(), stats.data_ptr()]
    assert bases[4] != 0                                     # the workspace, allocated for the launch


def test_python_takes_what_a_program_may_not_serve(operator):
    x, w = _args((1, 3, 6, 6))
    operator.op(x, w, None, [1, 1])
    operator.op(x, w, None, [1, 1])                          # served natively from here
    n = len(operator.python_calls)

    def python_serves(*args, why="no program"):
        calls = len(operator.python_calls)
        before = native.declines()[QUALIFIED].get(why, 0)
        operator.op(*args)
        assert len(operator.python_calls) == calls + 1
        # ... and says why, once for each of its kernels (AutogradCPU's, then CPU's below the Python autograd kernel)
        assert native.declines()[QUALIFIED].get(why, 0) == before + 2

    # A gradient to record: the autograd kernel in Python (whose own call below autograd may then be served)
    autograd_calls = len(operator.autograd_calls)
    gradients = native.declines()[QUALIFIED].get("gradient to record", 0)
    operator.op(x.clone().requires_grad_(), w, None, [1, 1])
    assert len(operator.autograd_calls) == autograd_calls + 1
    assert native.declines()[QUALIFIED]["gradient to record"] == gradients + 1
    with torch.no_grad():                                    # ... and none without grad mode
        operator.op(x.clone().requires_grad_(), w, None, [1, 1])
    assert len(operator.autograd_calls) == autograd_calls + 1 and len(operator.python_calls) == n
    python_serves(x, w, None, [2, 2])                        # another key: its first call
    python_serves(x, w, torch.zeros(5), [1, 1])
    python_serves(torch.randn(1 * 3 * 36 + 1)[1:].view(1, 3, 6, 6), w, None, [1, 1],  # 4 bytes off 16
                  why="misaligned address")
    with native.suspended():                                 # a recording, a compile-ahead pass
        python_serves(x, w, None, [1, 1], why="suspended")

    seen = []

    class Listening(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    other_keys = native.declines()[QUALIFIED].get("other dispatch key", 0)
    with Listening():                                        # a mode sees the call (not a program run past it)
        operator.op(x, w, None, [1, 1])
    assert operator.op in seen and native.declines()[QUALIFIED]["other dispatch key"] == other_keys + 1
    previous = native.set_enabled(False)
    try:
        python_serves(x, w, None, [1, 1], why="disabled")
    finally:
        native.set_enabled(previous)
    native.invalidate()                                      # a setting changed: programs forgotten
    python_serves(x, w, None, [1, 1])                        # ... and handed over again
    calls = len(operator.python_calls)
    operator.op(x, w, None, [1, 1])
    assert len(operator.python_calls) == calls and n > 0


def test_python_gets_the_arguments_as_torch_gives_them(operator):
    x, w = _args((1, 3, 2, 2))
    operator.op(x, w, None, [1, 2], "relu", torch.bfloat16)
    assert operator.python_calls[-1] == (list, [1, 2], "relu", torch.bfloat16, True)


def test_an_error_in_python_reaches_the_caller_and_the_next_call_is_served(operator):
    x, w = _args((1, 3, 3, 3))
    with pytest.raises(ValueError, match="activation 'raise' is refused"):
        operator.op(x, w, None, [1, 1], "raise")
    assert native.offer(QUALIFIED, Program(tuple(x.shape), CopyLaunch(x.nbytes))) is False    # nothing left pending
    operator.op(x, w, None, [1, 1])
    calls = len(operator.python_calls)
    out, _ = operator.op(x, w, None, [1, 1])
    assert len(operator.python_calls) == calls
    torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_no_offer_outside_a_call_and_no_operator_that_returns_other_than_tensors(operator):
    x, w = _args((1, 3, 5, 5))
    assert native.offer(QUALIFIED, Program(tuple(x.shape), CopyLaunch(x.nbytes))) is False
    with pytest.raises(ValueError, match="not only tensors"):
        native._STATE["module"].install(NS, "g", "CPU", lambda x: (x, 1), None)


def test_set_enabled_checks_its_argument():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        native.set_enabled("yes")


def test_a_program_with_a_python_step_stays_in_python(operator):
    """A replay whose program runs torch's Python (wgrad's derived input for the folded stem) is not handed
    over; the verdict is kept on the replay, so later calls do not work it out again."""
    x, w = _args((1, 3, 7, 7))
    deriving = Program(tuple(x.shape), CopyLaunch(x.nbytes))
    deriving.program = (deriving.program[0] + 1, (("derive", torch.clone, "input", deriving.program[0]),)
                        + deriving.program[1])
    assert native.offer(QUALIFIED, deriving) is False and deriving.native_steps is False


def test_a_process_with_the_kernels_installed_exits_cleanly(operator):
    """The dispatcher frees its kernels at exit, after Python has finalized: a kernel that let go of its Python
    kernel then would crash the process (it did: a segmentation fault after every test had passed)."""
    import os
    import subprocess
    import sys
    code = ("import torch, conv_tutorial.launch\n"
            "from conv_tutorial import native\n"
            "lib = torch.library.Library('conv_tutorial_native_exit', 'DEF')\n"
            "lib.define('f(Tensor x) -> Tensor')\n"
            "lib.impl('f', lambda x: x.clone(), 'CompositeExplicitAutograd')\n"
            "native._attach(native._module(), packed_launches=False)\n"
            "native._STATE['module'].install('conv_tutorial_native_exit', 'f', 'CPU', lambda x: x.clone(), None)\n"
            "torch.ops.conv_tutorial_native_exit.f(torch.ones(2))\n"
            "print('called')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "called" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_a_program_made_before_a_setting_changed_does_not_serve(operator):
    """A program is stamped with the settings of the call that missed, not of the moment it is handed over: a
    setting changed in between (by another thread) leaves it stale."""
    x, w = _args((1, 3, 4, 5))
    operator.setting_changes_during_call = True
    try:
        operator.op(x, w, None, [1, 1])
    finally:
        operator.setting_changes_during_call = False
    calls = len(operator.python_calls)
    operator.op(x, w, None, [1, 1])
    assert len(operator.python_calls) == calls + 1


def test_a_build_lock_left_by_a_dead_process_does_not_stop_the_next_build(tmp_path):
    """torch's build lock is a file its builder deletes when done; a process that died building (its exit
    ended the background thread, a Ctrl-C) leaves it, and torch's next load would wait for it forever:
    the native kernels would never serve again, silently. Under the package's flock, which a dead process
    no longer holds, the leftover is removed before the load."""
    (tmp_path / "lock").write_text("")
    seen = []
    assert native._built_under_lock(str(tmp_path), lambda: seen.append((tmp_path / "lock").exists()) or "built") \
        == "built"
    assert seen == [False]


def test_a_build_under_way_in_another_process_is_waited_for(tmp_path):
    """While another holder of the flock builds (here: this test, through a second open file), the load waits;
    it runs once the flock is released."""
    import fcntl
    import threading
    import time
    holder = open(tmp_path / "conv_tutorial.lock", "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    loaded = threading.Event()
    thread = threading.Thread(target=native._built_under_lock, args=(str(tmp_path), loaded.set))
    thread.start()
    time.sleep(0.3)
    assert not loaded.is_set()
    fcntl.flock(holder, fcntl.LOCK_UN)
    holder.close()
    thread.join(timeout=10)
    assert loaded.is_set()


def test_the_build_runs_in_a_child_process_and_this_process_loads_it(operator):
    """The background build compiles in another Python process (none of its Python shares this process's
    interpreter); this process's load then finds that library in the build folder."""
    library = native._build_in_a_child_process()
    assert library is not None and os.path.isfile(library)
    assert os.path.realpath(library) == os.path.realpath(native._module().__file__)


def test_a_child_build_that_fails_says_why(monkeypatch):
    """A build whose process fails raises its own error output (the caller warns, and the Python path serves),
    instead of building again in this process."""
    import sys
    from conv_tutorial import compile_pool
    monkeypatch.setattr(compile_pool, "python_command",
                        lambda code: [sys.executable, "-c", "import sys; sys.stderr.write('no compiler'); sys.exit(2)"])
    with pytest.raises(RuntimeError, match="exited with 2: no compiler"):
        native._build_in_a_child_process()


def test_a_refused_flock_leaves_torchs_own_lock(tmp_path, monkeypatch):
    """Where the file system refuses flock (some network file systems), the build runs under torch's lock alone,
    and a lock file there is not touched (it may be a live build's)."""
    import fcntl

    def refused(*args):
        raise OSError("flock refused")
    monkeypatch.setattr(fcntl, "flock", refused)
    (tmp_path / "lock").write_text("")
    assert native._built_under_lock(str(tmp_path), lambda: "built") == "built"
    assert (tmp_path / "lock").exists()


def test_ensure_in_a_process_that_imported_only_this_module_serves(operator):
    """`native.ensure()` before any operator ran (a benchmark waits for the build before timing): the attach reads
    what launch.py tells at its import, which nothing had imported yet (it raised KeyError, and every repeat call
    took the Python path, with a warning). launch.py's import after it hands its profiler check to the module."""
    import subprocess
    import sys
    code = ("from conv_tutorial import native\n"
            "served = native.ensure()\n"
            "seen = []\n"
            "class Watched:\n"          # the attached module, its set_hooks_check calls seen
            "    def __init__(self, module): self.module = module\n"
            "    def __getattr__(self, name): return getattr(self.module, name)\n"
            "    def set_hooks_check(self, check): seen.append(check); self.module.set_hooks_check(check)\n"
            "native._STATE['module'] = Watched(native._STATE['module'])\n"
            "import conv_tutorial.launch\n"
            "handed = len(seen) == 1 and seen[0] is native._LAUNCHES['hooks_set'] and seen[0]() is False\n"
            "print('served', served, native._STATE['failed'], 'handed', handed)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, CONV_TUTORIAL_NATIVE="1",
               PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0 and "served True False handed True" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert "native repeat path could not be built" not in proc.stderr, proc.stderr[-2000:]
