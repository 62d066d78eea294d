"""Kernels compiled while torch.compile traces the step: no eager pass (opt-in).

    conv_tutorial.set_backward("lesson06")
    conv_tutorial.compile_while_tracing()       # instead of compile_kernels_ahead(model, x, ...)
    step = torch.compile(model)                  # its tracing starts the compiles; train as usual

Why: `compile_kernels_ahead` learns which kernels a step needs by running the step once, eagerly,
before torch.compile traces it. With warm caches that pass is most of what the first steps spend
beyond torch.compile's own (RESULTS.md, "Where the first step's compile goes"). Yet torch.compile calls every operator of the step already: Dynamo calls the forward's
operators' fake implementations with fake tensors of the step's shapes, strides and dtypes, and
AOTAutograd the backward's as it traces the joint graph. Here, while `compile_while_tracing()` is on,
each such call on a CUDA device also runs the operator's implementation once on stand-ins (real tensors
of the fake ones' shapes, strides, storage offsets and dtypes, whose values nothing reads) in
launch.compiling_ahead's compile-only mode: its kernels go to a pool of worker processes and are not
launched (what the implementation does besides runs as in compile_kernels_ahead's pass: torch's own ops on
the stand-ins, a weight flip whose launch waits for its compile), and torch.compile goes on tracing while
they compile. Each kernel's first launch waits for its own compile (and raises its failure), as with
`compile_kernels_ahead(..., wait=False)`. The workers live until the switch is turned off (or the process
ends).

What differs from compile_kernels_ahead:
- Nothing of the model runs eagerly and nothing needs putting back (BatchNorm's running statistics,
  the random generators, the gradients): the stand-ins belong to the call alone.
- A call seen before (the same operator, tensor facts and other arguments) is not handed over again.
- With warm caches AOTAutograd's cache skips the backward's tracing: the backward's kernels then compile
  (or load from Triton's cache) at their first call, as without either.
- Sizes or strides that are symbolic (dynamic shapes) are skipped, and so are the backward's operators when
  torch's backward computes the gradients (`set_backward("torch")`: nothing to compile), every call while
  autotuning is on (the tuner compiles as it times) and calls while a CUDA graph is being captured: those
  kernels compile at their first call. So are those of a call the stand-ins' run fails on: it is counted
  (`hand_over_failures`), the first failure after the switch is turned on is said in a warning (never raised,
  whatever the warning filters), and torch.compile goes on tracing.
- The stand-ins take the traced tensors' storage offsets, so the pointer alignments Triton specializes
  on are the step's where its tensors start where the fake ones do.
- The memory: each call's stand-ins (its inputs, and the outputs its implementation allocates) live for
  the call alone, returned to torch's caching allocator after it.
"""
import contextlib
import functools
import threading
import warnings

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from . import compile_pool, launch, selection

_STATE = {"on": False, "pool": None, "workers": None, "failures": 0}
_SEEN = set()                # calls handed over (`_call_key`)
_DEVICES = ("cuda",)         # the devices whose calls are handed over (where the operators' kernels run)
_LOCK = threading.Lock()


def compile_while_tracing(enabled: bool = True, workers=None) -> None:
    """While on, each operator call that torch.compile traces on a CUDA device hands its kernels' compiles
    to a pool of `workers` processes (default: launch.compiling_ahead's count), at a lower priority than
    this process (launch.BACKGROUND_NICENESS). `enabled=False` turns it off and lets the pool finish what
    it was handed (nothing waits for it). Turning it on again forgets the calls seen before."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers must be None or a positive int, got {workers!r}")
    with _LOCK:
        pool, _STATE["pool"] = _STATE["pool"], None
        _SEEN.clear()
        _STATE.update(on=enabled, workers=workers, failures=0)
    if pool is not None:
        pool.shutdown(wait=False)


def compiling_while_tracing() -> bool:
    """Whether compile_while_tracing is on."""
    return _STATE["on"]


def hand_over_failures() -> int:
    """How many traced calls' kernels could not be compiled from stand-ins since the switch was turned on."""
    return _STATE["failures"]


def compiles_when_traced(implementation, when=None):
    """Decorate an operator's fake implementation: after it, while compile_while_tracing is on (and `when()`,
    if given, is true), the call's kernels are compiled from stand-ins through `implementation` (the
    operator's own, at its CompositeExplicitAutograd key)."""
    def decorate(fake):
        @functools.wraps(fake)
        def traced(*args, **kwargs):
            out = fake(*args, **kwargs)
            if _STATE["on"] and (when is None or when()):
                hand_over(implementation, args, kwargs)
            return out
        return traced
    return decorate


def hand_over(implementation, args, kwargs):
    """Run `implementation(*args, **kwargs)` on stand-ins of its fake CUDA tensors in compile-only mode,
    once per distinct call (module docstring). Any other call (no fake CUDA tensor, a symbolic size, one
    seen before, one inside a compile-ahead pass, autotuning on, a CUDA graph being captured) is left alone.
    Raises nothing: a failure is counted, and the first one said."""
    try:
        tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        if (not tensors or not all(isinstance(t, FakeTensor) and t.device.type in _DEVICES for t in tensors)
                or launch.compiling_ahead_active() or selection.autotune_enabled()):
            return
        device = tensors[0].device
        if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        key = _call_key(implementation, args, kwargs)
        with _LOCK:
            if key is None or key in _SEEN:
                return
            _SEEN.add(key)
        with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
            real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, stand_in_for, (args, kwargs))
            with _on_device(device), torch.autocast("cuda", enabled=False), launch.compiling_into(_pool()):
                implementation(*real_args, **real_kwargs)
    except Exception as error:      # (the step compiles this call's kernels at their first launch instead)
        with _LOCK:
            _STATE["failures"] += 1
            first = _STATE["failures"] == 1
        if first:
            with warnings.catch_warnings():
                warnings.simplefilter("always")      # (said, never raised into torch.compile's tracing)
                warnings.warn(f"conv_tutorial.compile_while_tracing: a traced call of {implementation.__name__} "
                              f"could not compile its kernels ahead ({type(error).__name__}: {error}); they compile "
                              f"at its first launch (conv_tutorial.traced_compiles.hand_over_failures() counts such "
                              f"calls)", RuntimeWarning, stacklevel=2)


def _on_device(device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _call_key(implementation, args, kwargs):
    """A hashable key of the call: each tensor's shape, strides, storage offset, dtype and device, and the
    other arguments; None where a size or stride is symbolic."""
    def fact(v):
        if isinstance(v, torch.Tensor):
            numbers = (*v.shape, *v.stride(), v.storage_offset())
            if not all(type(n) is int for n in numbers):
                raise _Symbolic
            return ("tensor", tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, str(v.device))
        if isinstance(v, (list, tuple)):
            return tuple(fact(x) for x in v)
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _Symbolic
        return v
    try:
        return (implementation.__module__, implementation.__qualname__, tuple(fact(v) for v in args),
                tuple(sorted((name, fact(v)) for name, v in kwargs.items())))
    except _Symbolic:
        return None


class _Symbolic(Exception):
    pass


def stand_in_for(t: torch.Tensor) -> torch.Tensor:
    """A real tensor of t's shape, strides, storage offset, dtype and device (t may be fake), its values
    uninitialized."""
    shape, strides, offset = tuple(t.shape), t.stride(), t.storage_offset()
    extent = offset + (1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0)
    return torch.empty(max(extent, 1), dtype=t.dtype, device=t.device).as_strided(shape, strides, offset)


def _pool():
    with _LOCK:
        if not _STATE["on"]:         # (turned off by another thread meanwhile: no pool left running)
            raise RuntimeError("compile_while_tracing was turned off")
        if _STATE["pool"] is None:
            _STATE["pool"] = compile_pool.ProcessCompiles(_STATE["workers"] or launch._compile_pool_size(),
                                                          niceness=launch.BACKGROUND_NICENESS)
        return _STATE["pool"]
