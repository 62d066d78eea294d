"""The operators' host path: what a repeat call costs on the host, and what it skips.

A model calls each conv with the same shapes step after step. The first calls of a shape take
the full path: every check (a clear error for bad input), the fallbacks, the plans (launch.py),
the first launches that compile. Such a call is recorded (launch.Recording), and where every
address its launches took lies in its inputs or its results, the recording becomes a replay
(launch.Replay): later calls of the same key (`replay_key`: shapes, strides, dtypes, devices, the
other arguments, the settings that choose a path) allocate the results and make the same launches
on the new addresses, nothing else. A call whose path does other work (a copy, torch's sums, a
fallback to torch) records no replay and keeps its full path.

A replay that serves a call is handed to the operator's C++ kernel (native.py), which runs it for
the key's later calls with no Python at all, where the extension is built.

The autograd kernel (`register_autograd`) is torch.library.register_autograd's, made cheaper for
plain tensors. What each path costs: benchmarks/host_time.py, figures in RESULTS.md ("Host time").
"""
import torch

from . import native, selection
from .launch import Replay, compiling_ahead_active, record_breaks, recording

_REPLAYS = {}        # a forward call's key (`replay_key`) -> its Replay (launch.py); an int: failed attempts to build one
REPLAY_ATTEMPTS = 3  # calls of a key recorded before its calls keep the full path for good
MAX_KEYS = 4096


def _facts(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)      # (a tensor's device: its index too)


def replay_key(tensors, *arguments):
    """What a call of an operator shows at a glance, for its replay: each tensor's shape, strides,
    dtype and device, the other `arguments` (the backward's: its backend too), whether autotuning is
    on, and the current GPU. A replay is valid for every call of its key."""
    return (*map(_facts, tensors), *arguments, selection.autotune_enabled(), torch._C._cuda_getDevice())


def clear():
    """Forget every replay, here and in the native kernels (a new key's first calls record again)."""
    _REPLAYS.clear()
    native.invalidate()


def keep_replay(key, recording, sources, results):
    """After a call of `key` made on its full path under `recording`: keep its replay, if it has one;
    after REPLAY_ATTEMPTS calls without one, stop recording the key's calls."""
    replay = Replay.of(recording, sources, results)
    if len(_REPLAYS) >= MAX_KEYS:      # (shapes that keep changing: start over)
        clear()
    if replay is not None:
        _REPLAYS[key] = replay
    else:
        _REPLAYS[key] = _REPLAYS.get(key, 0) + 1


def records(key):
    """Whether a full-path call of `key` should be recorded (launch.recording) for a replay."""
    return type(_REPLAYS.get(key, 0)) is int and _REPLAYS.get(key, 0) < REPLAY_ATTEMPTS


def call(op, key, device, tensors, full_path, results, zeroed=()):
    """What a call of operator `op` ("namespace::name") returns: the replay of `key` on `tensors` (its
    sources, by their argument names), or `full_path()` (recorded while the key may still get a
    replay). `results`: the names of what full_path returns (one name: a tensor; more: a tuple);
    `zeroed`: those a replay allocates as zeros. A replay that serves the call is offered to the C++
    kernel serving it, if any (native.py)."""
    if compiling_ahead_active():
        return full_path()  # (compiles and launches nothing: no replay to record, no attempt spent)
    replay = _REPLAYS.get(key)
    if replay is not None and type(replay) is not int:
        out = replay(device, tensors)
        if out is not None:
            if native.ACTIVE[0]:
                native.offer_or_stop(op, replay)
            elif str(device).startswith("cuda"):
                native.start()      # (built in the background once, installed at a call after that)
            return out[0] if len(results) == 1 else out
    if not records(key):
        record_breaks()     # (a call recorded around this one would not see its launches)
        return full_path()
    with recording() as steps:
        out = full_path()
    outs = (out,) if len(results) == 1 else out
    keep_replay(key, steps, tensors, {name: (t, name in zeroed) for name, t in zip(results, outs)})
    return out


def _plain(tensors):
    # Tensors an implementation may take as they are: no dispatch mode listening, no tensor subclass
    # of its own dispatch (FakeTensor, FunctionalTensor, DTensor: torch.compile's tracing, and others)
    return not torch._C._len_torch_dispatch_stack() and all(type(t) in _PLAIN for t in tensors if t is not None)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def register_autograd(library, name, implementation, backward, setup_context, tensor_positions, serve_natively=True):
    """The autograd kernel of operator `name` (of `library`): as torch.library.register_autograd's,
    an autograd.Function where a gradient is needed, else the call itself, with less host time:
    plain tensors (`_plain`) go straight to `implementation` (one Python call, not a redispatch
    through the dispatcher to it), and the check that a gradient is needed is one C call. Other
    tensors (torch.compile's tracing, a dispatch mode) are redispatched below autograd, as torch
    does. `tensor_positions`: which arguments are (optional) tensors. `serve_natively`: the operator's
    repeat calls may run in C++ (native.py); False for one whose replays are another operator's."""
    op = getattr(getattr(torch.ops, library.ns), name).default
    defaults = tuple(a.default_value for a in op._schema.arguments)

    def run(args):
        if _plain([args[i] for i in tensor_positions if i < len(args)]):
            return implementation(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    def forward(ctx, *args):
        output = run(args)
        setup_context(ctx, args + defaults[len(args):], output)     # (the dispatcher drops defaulted arguments)
        return output

    def backward_(ctx, *grads):
        return backward(ctx, *grads)

    function = type(f"{name}_autograd", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_)})

    def kernel(*args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return function.apply(*args)
        return run(args)

    library.impl(name, kernel, "Autograd")
    if serve_natively:
        native.register(library, name, implementation, kernel)
