"""Plans and the direct launch: what makes a call of the forward kernel (kernels/fprop.py) cheap on the host.

- Plans (`ConvPlan`): everything that depends only on the problem's shape (geometry, TMA im2col
  settings, shared layouts, grid, the kernel's constexprs) is computed once per (shape, dtype,
  config, device). (Building the shared layouts is the costly part.)
- Descriptor templates: the first call's descriptors are validated by Triton; later calls copy
  them and swap in the new tensors (`_with_base`), checking the one property that can differ
  (16-byte alignment). (Re-validating is tens of microseconds of Python.) The plan keeps the
  templates without their tensors (`_tensorless`): it must not keep a call's input and output
  alive.
- A direct launch (`DirectLaunch`): after the first launch of a plan, which goes through
  Triton's generic launcher (it binds and re-derives the specialization of ~25 arguments per call,
  tens of microseconds) and compiles, the compiled kernel is called through the CUDA launch that
  Triton's launcher ends in: arguments expanded once, pointers passed as addresses, each TMA
  descriptor's tensor map encoded once per (descriptor, address) instead of on every launch. What each
  path costs: benchmarks/host_time.py measures it (figures in RESULTS.md).
- Split-K's second kernel (lesson 05, section 7) is launched directly too.
- Compiling ahead (`compiling_ahead`): a model's distinct kernels compiled side by side in worker
  processes (Triton's `AsyncCompileMode`, compile_pool.py), before its first real call (RESULTS.md,
  "The first call of a fused model").
"""
import contextlib
import contextvars
import math
import os
import warnings

import torch
import triton
from triton.runtime import _async_compile
from triton.runtime._async_compile import FutureKernel

from .configs import KernelConfig, check_config
from .geometry import device_facts, nhwc_view
from . import compile_pool, native, packed
from .packed import Slot
from . import core
from .kernels import fprop


class DirectLaunch:
    """One compiled kernel, called straight through the CUDA launch that Triton's launcher ends
    in, with its TMA tensor maps remembered.

    Triton's launcher, on every launch: binds and type-checks the arguments, allocates scratch
    space if the kernel wants any, turns each descriptor into a CUtensorMap (Python reads the
    descriptor's fields, then the driver encodes 128 bytes), and asks the driver about each
    pointer argument. A plan knows all of that in advance except the tensors' addresses: its
    descriptors differ from call to call only in their base address, and a network's tensors come
    back at the same few addresses (PyTorch's caching allocator), so the encoded map is kept per
    (descriptor, address) and a repeat costs a dictionary lookup. The call passes the tensors
    themselves where the kernel takes descriptors (a new address is encoded from the plan's
    validated template), and plain integers (data_ptr()) for pointers, which the caller has
    checked. Kernels that need scratch space, and launches a profiler listens to, go through
    Triton's path instead."""

    MAX_TENSOR_MAPS = 256      # per plan and variant; then start over (a map is 128 bytes)

    def __init__(self, compiled, constexprs, templates=()):
        from triton.backends.nvidia.driver import make_tensordesc_arg
        compiled._init_handles()
        self.compiled, self.constexprs, self.encode = compiled, constexprs, make_tensordesc_arg
        driver = triton.runtime.driver.active
        self.current_device, self.current_stream = driver.get_current_device, driver.get_current_stream
        if self.current_device is torch.cuda.current_device:      # (the same, without its lazy-init check)
            self.current_device = torch._C._cuda_getDevice
        launcher = compiled.run
        metas = getattr(compiled.metadata, "tensordesc_meta", None) or []
        templates = [t for t in templates if t is not None]          # descriptors, in signature order
        signature = [str(kind) for kind in compiled.src.signature.values()]
        slots = [i for i, kind in enumerate(signature) if kind.startswith("tensordesc")]
        if len(metas) != len(templates) or len(templates) != len(slots):
            raise RuntimeError(f"{compiled.name}: {len(templates)} descriptors, {len(metas)} tensor-map "
                               f"layouts, {len(slots)} descriptor parameters")
        # argument position -> (its tensor-map layout, its validated template descriptor)
        self.descriptor_at = dict(zip(slots, zip(metas, templates)))
        self.descriptors_end = max(slots, default=-1) + 1
        self.tensor_maps = {}                  # (argument position, address) -> encoded
        self.lean = (launcher.global_scratch_size == 0 and launcher.profile_scratch_size == 0
                     and not getattr(launcher, "gsan_enabled", False))
        self.launch = driver.utils.launch
        self.launch_head = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                            compiled.packed_metadata)
        self.launch_tail = (launcher.arg_annotations, launcher.kernel_signature)

    @classmethod
    def first_launch(cls, kernel, grid, args, kwargs, templates=()):
        """Launch `kernel` through Triton's generic launcher (it binds, specializes and compiles),
        and return a DirectLaunch of the compiled kernel for the calls after it."""
        compiled = kernel[grid](*args, **kwargs)
        if isinstance(compiled, FutureKernel):      # inside compiling_ahead: the compile's future (launched once done)
            compiled = compiled.result()
        return cls(compiled, tuple(kwargs[p.name] for p in kernel.params if p.is_constexpr), templates)

    def _tensor_map(self, tensor, position):
        # `tensor`: a tensor, or its address (an int: a replay's, which the caller checked for 16-byte alignment)
        key = (position, tensor if type(tensor) is int else tensor.data_ptr())
        encoded = self.tensor_maps.get(key)
        if encoded is None:                    # a new address: encode from the validated template
            if len(self.tensor_maps) >= self.MAX_TENSOR_MAPS:
                self.tensor_maps.clear()
            encoded = self.tensor_maps[key] = self._encode(position, _Address(tensor) if type(tensor) is int else tensor)
        return encoded

    def _encode(self, position, base):
        # [tensor map, *shape, *strides] of descriptor argument `position` re-based on `base` (a tensor or an _Address)
        meta, template = self.descriptor_at[position]
        return self.encode(_with_base(template, base), meta, None)

    def encoded_at(self, position, address):
        """The tensor map of descriptor argument `position` at `address`, encoded from the template and
        not kept (packed.map_encoder checks its own encoding against it)."""
        return self._encode(position, _Address(address))[0]

    def tensor_map_at(self, position, address):
        """The tensor map of descriptor argument `position` pointing at `address` (16-byte aligned: the
        caller checked), as _tensor_map keeps it (packed.py's launches ask for a new address's)."""
        return self._tensor_map(_Address(address), position)[0]

    def takes_addresses(self):
        """Whether a call may pass descriptors' tensors as addresses (ints): the lean path, no
        profiler listening (Triton's path wants the tensors themselves)."""
        return self.lean and not _launch_hooks_set()

    def __call__(self, grid, *args):
        """Launch on the current stream. `grid`: 1 to 3 program counts, as Triton takes it; `args`:
        the kernel's run-time arguments in signature order (constexprs left out), a tensor (or None)
        where the kernel takes a descriptor."""
        if not self.lean or _launch_hooks_set():
            # scratch space to allocate, or a profiler listening: Triton's path, real descriptors
            args = list(args)
            for position, (_, template) in self.descriptor_at.items():
                args[position] = _with_base(template, args[position])
            self.compiled[grid](*args, *self.constexprs)
            return
        self.launch_lean(grid, args)

    def launch_lean(self, grid, args):
        """The lean path of __call__, for a caller that has checked `takes_addresses()`."""
        expanded = []
        descriptor_at = self.descriptor_at
        for position in range(self.descriptors_end):
            if position in descriptor_at:   # [tensor map, *shape, *strides], as Triton expands it
                expanded += self._tensor_map(args[position], position)
            else:
                expanded.append(args[position])
        expanded += args[self.descriptors_end:]
        expanded += self.constexprs
        stream = self.current_stream(self.current_device())
        self.launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                    *self.launch_head, None, None, None, None, None, *self.launch_tail, expanded)


class ForwardReplay:
    """A plan's later launches of one variant: the conv kernel's DirectLaunch and, with split-K,
    its second kernel's, with everything the plan fixes (grids, shapes, scalars, which tails have
    descriptors, the buffers' shapes) taken once. A call passes only what changes between calls:
    the input's and the weights' tensors or addresses (16-byte aligned: the caller checked), the
    epilogue's pointers as addresses, a window's and the statistics' arguments; it allocates the
    output and split-K's workspace on `device` (or takes the output's buffer, `out_2d`) and returns
    the output's buffer."""

    def __init__(self, plan, direct, template, reduce):
        self.direct, self.grid, self.shape = direct, template.grid, template.shape
        self.out_shape, self.out_dtype = tuple(template.out_2d.shape), template.out_2d.dtype
        self.partial = None if template.partial is None else (tuple(template.partial.shape), template.partial.dtype)
        self.w_tail, self.out_tail = template.w_tail_desc is not None, template.out_tail_desc is not None
        self.reduce, self.reduce_grid, self.reduce_scalars = reduce, plan.reduce_grid, plan.reduce_scalars
        self.dense = template.out_window is None and self.out_shape[1] == plan.geometry.Co

    @property
    def lean(self):
        return self.direct.lean and (self.reduce is None or self.reduce.lean)

    def __call__(self, device, x, w, pointers, out_2d=None, window_args=None, stats=None, checked=False):
        # checked: the caller has seen takes_addresses() (a Replay): the launches' lean path, without asking again
        if out_2d is None:
            out_2d = torch.empty(self.out_shape, dtype=self.out_dtype, device=device)
        out = out_2d.data_ptr()
        pointers = tuple(out if p is None else p for p in pointers)      # (bias, scale, residual): absent ones unread
        partial = None if self.partial is None else torch.empty(self.partial[0], dtype=self.partial[1], device=device)
        args = self._conv_args(x, w, out_2d, pointers, out if partial is None else partial.data_ptr(), window_args, stats)
        if checked:
            self.direct.launch_lean(self.grid, args)
        else:
            self.direct(self.grid, *args)
        if self.reduce is not None:             # split-K's second kernel sums the slices
            self.reduce(self.reduce_grid, *self._reduce_args(partial.data_ptr(), out, pointers))
        return out_2d

    def _conv_args(self, x, w, out, pointers, written, window_args, stats):
        # the conv kernel's run-time arguments: `out` the output (its tensor, address or Slot) where the kernel
        # takes its descriptors, `pointers` the epilogue's (bias, scale, residual), `written` where it stores (the
        # output, or split-K's workspace)
        return (x, w, w if self.w_tail else None, out, out if self.out_tail else None, (*pointers, written),
                self.shape, window_args, stats)

    def _reduce_args(self, partial, out, pointers):
        # split-K's second kernel's run-time arguments: the slices, the output, the epilogue's pointers
        return (partial, out, pointers, *self.reduce_scalars)

    def program_ops(self, x, w, pointers, out, window_args, stats, new_base, make_launch, device):
        """This launch (and split-K's second) as a replay's program ops (Replay._build), each launch made by
        `make_launch(direct, grid, args, device)`: `x`, `w`, `pointers`, `stats`, the window's address:
        Slots (or None); `out`: the output's base index (None: a window's call, whose stand-in output the
        program allocates, as __call__ does); `new_base()`: the index of a new base, for a buffer the
        program allocates."""
        ops, freed = [], []
        if out is None:
            out = new_base()
            ops.append(("alloc", out, self.out_shape, None, self.out_dtype, False, None))
            freed.append(out)
        out_slot = Slot(out)
        pointers = tuple(out_slot if p is None else p for p in pointers)
        partial_slot = None
        if self.partial is not None:
            partial_slot = Slot(new_base())
            ops.append(("alloc", partial_slot.base, self.partial[0], None, self.partial[1], False, None))
            freed.append(partial_slot.base)
        args = self._conv_args(x, w, out_slot, pointers, out_slot if partial_slot is None else partial_slot,
                               window_args, stats)
        ops.append(("launch", make_launch(self.direct, self.grid, args, device)))
        if self.reduce is not None:
            ops.append(("launch", make_launch(self.reduce, self.reduce_grid,
                                              self._reduce_args(partial_slot, out_slot, pointers), device)))
        # (the workspace and a window's stand-in freed once launched, as __call__ frees them: stream-ordered)
        ops += [("free", index) for index in freed]
        return ops


class _Address(int):
    # An address where a descriptor's template wants a tensor: all a tensor map's encoding reads of it is data_ptr()
    def data_ptr(self):
        return int(self)


class Recording:
    """The launches one call made, each with its pointers as addresses, for a replay of the call
    (an operator's; backward.py builds them): `steps` are ("conv", ForwardReplay, x, w, pointers,
    window_args, stats, out) (`out` the output's address, None for a window) and ("launch",
    DirectLaunch, grid, args, pointer positions in args) and ("scratch", shape, dtype, (address,
    bytes)), a workspace the call allocated; `broken` where the call did anything a
    replay of these steps would not repeat (a first launch, a copy, torch's sums). A "derive" step,
    ("derive", fn, source, (address, bytes)): a new tensor fn(NHWC view of the source at address
    `source`), which later steps read (wgrad's folded x); a "finish" step, ("finish", fn, buffer,
    (address, bytes)): a result computed as fn(the workspace at `buffer`) by torch (wgrad's unfolded dW).
    A replay reruns both: each `fn` is torch's work on its argument alone."""

    def __init__(self):
        self.steps, self.broken = [], False
        self.keep = []      # the tensors whose addresses the steps hold, alive until the recording ends: no
                            # address can be freed and handed to another tensor of the same call meanwhile


_RECORDING = contextvars.ContextVar("conv_tutorial_recording", default=None)


@contextlib.contextmanager
def recording():
    """Record the launches made inside (a `Recording`). (A recording inside another breaks the outer one:
    the outer would not see the inner's steps.)"""
    record_breaks()
    token = _RECORDING.set(Recording())
    try:
        with native.suspended():    # (an operator called inside runs its Python path, which this recording sees)
            yield _RECORDING.get()
    finally:
        _RECORDING.reset(token)


def record_breaks():
    """Say that the call being recorded did work its steps do not hold: it gets no replay."""
    active = _RECORDING.get()
    if active is not None:
        active.broken = True



def _address(t):
    return t if t is None or type(t) is int else t.data_ptr()


def _record(replay, x, w, pointers, window_args, stats, out_2d):
    active = _RECORDING.get()
    if active is not None:
        active.keep += [t for t in (x, w, out_2d) if isinstance(t, torch.Tensor)]
        active.steps.append(("conv", replay, _address(x), _address(w), pointers, window_args, stats,
                             None if out_2d is None else out_2d.data_ptr()))


def record_step(step, keep=()):
    """Add a step (a tuple, as `Recording` describes) to the call being recorded, if any; `keep`: the
    tensors whose addresses it holds (kept alive until the recording ends)."""
    active = _RECORDING.get()
    if active is not None:
        active.steps.append(step)
        active.keep += keep


def record_scratch(tensor):
    """Record a workspace the call allocated (its launches' addresses may lie in it)."""
    if tensor is not None:
        record_step(("scratch", tuple(tensor.shape), tensor.dtype, (tensor.data_ptr(), tensor.nbytes)), (tensor,))


class SmallLaunches:
    """The launches of one small Triton kernel of pointers and scalars around the convs (the folded
    stem's copies, the fp8 operator's fold of its scales, dgrad's zero fill), made so that a replay
    repeats them: the first launch of each specialization through Triton's launcher (it compiles), the
    ones after it straight (a DirectLaunch), each recorded as a launch step. Inside compiling_ahead,
    compiled in its pool and not launched."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._direct = {}      # (scalars, constexprs, the tensors' dtypes, device) -> DirectLaunch

    def __call__(self, grid, args, kwargs, allocated=()):
        """Launch the kernel on `args` (tensors where it takes pointers, then its scalars) with constexprs
        `kwargs`. `allocated`: workspaces the caller allocated for this launch, recorded as the call's
        scratch (a replay allocates them again)."""
        places = tuple(i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor))
        tensors = tuple(args[i] for i in places)
        on_gpu = all(t.is_cuda for t in tensors)
        if compiling_ahead_active() and on_gpu:
            self.kernel.warmup(*args, grid=grid, **kwargs)
            return
        # (the key holds every scalar with its type: Triton specializes a kernel on their values, 1 and multiples
        # of 16, and on their types, where True, 1 and 1.0 are one key of a dict)
        key = (tuple((type(arg), arg) for arg in args if not isinstance(arg, torch.Tensor)),
               tuple((name, type(value), value) for name, value in sorted(kwargs.items())),
               tuple(t.dtype for t in tensors), tensors[0].device if tensors else None)
        aligned = all(t.data_ptr() % 16 == 0 for t in tensors)      # (what a DirectLaunch was compiled for)
        direct = self._direct.get(key)
        if direct is not None and aligned and direct.takes_addresses():
            values = tuple(arg.data_ptr() if isinstance(arg, torch.Tensor) else arg for arg in args)
            direct(grid, *values)
            for workspace in allocated:
                record_scratch(workspace)
            record_step(("launch", direct, grid, values, places), tensors)
            return
        record_breaks()
        if aligned and on_gpu and direct is None:
            self._direct[key] = DirectLaunch.first_launch(self.kernel, grid, args, kwargs)
        else:
            self.kernel[grid](*args, **kwargs)


class Replay:
    """An operator call replayed from its recording: the same launches on new tensors of the same
    shapes, strides, dtypes and device, with nothing else run (no checks, no plans, no keys).

    Built from a `Recording` of one call (`Replay.of`), where every address a launch took lies in
    one of the call's `sources` (its input tensors by name, and its `results`: tensors the call
    returned, which the replay allocates) or in what the replay remakes (a workspace, a derived
    tensor). A call whose recording is broken, or has an address elsewhere
    (a copy the call made, say), gets no replay: its calls keep the full path. A replay returns None
    (and launches nothing) where its launches cannot take addresses (a profiler listens) or an
    input is not 16-byte aligned (the full path explains)."""

    def __init__(self, steps, results, sources, launches):
        self.steps, self.results, self.sources = steps, results, sources
        self.lean = all(launch.lean for launch in launches)      # (no scratch space to allocate: launch.py's DirectLaunch)
        self.program = None     # the steps as a program (`_program`), built at the first replay
        self.packed = None      # whether its launches are packed (packed.py) or Python launches

    @classmethod
    def of(cls, recording, sources, results):
        """The replay of `recording`, or None. `sources`: {name: tensor or None} the call took;
        `results`: {name: (tensor, zeroed)} it returned (zeroed: allocated as zeros)."""
        if recording.broken or not recording.steps:
            return None
        spans = {}          # name -> (address, bytes)
        for name, t in list(sources.items()) + [(name, t) for name, (t, _) in results.items()]:
            if t is not None:
                if t.data_ptr() % 16:
                    return None
                spans[name] = (t.data_ptr(), t.numel() * t.element_size())
        # Inputs that share memory (a residual that is the input itself, say): an address in both would be
        # taken from the first, and every later call would read that input in the other's place. No replay.
        ordered = sorted(spans[name] for name, t in sources.items() if t is not None)
        if any(start + size > next_start for (start, size), (next_start, _) in zip(ordered, ordered[1:])):
            return None

        def where(address):          # (name, offset) of an address, or None
            if address is None:
                return None
            for name, (start, size) in spans.items():
                if start <= address < start + max(size, 1):
                    return (name, address - start)
            raise LookupError(address)

        steps, launches, produced = [], [], set()
        try:
            for step in recording.steps:
                if step[0] == "derive":     # a tensor the call made from an input: the replay makes its own
                    _, fn, source, span = step
                    source = where(source)
                    if source[1] or source[0] not in sources:
                        return None
                    name = f"derived{len(steps)}"
                    steps.append(("derive", fn, source[0], name))
                    spans[name] = span
                elif step[0] == "finish":   # a result torch computed from a workspace: the replay computes it
                    _, fn, buffer, (address, _) = step
                    buffer, out = where(buffer), where(address)
                    if buffer[1] or out[1] or buffer[0] in sources or buffer[0] in results or out[0] not in results:
                        return None
                    steps.append(("finish", fn, buffer[0], out[0]))
                    produced.add(out[0])
                elif step[0] == "scratch":  # a workspace the call allocated: the replay allocates its own
                    _, shape, dtype, span = step
                    name = f"scratch{len(steps)}"
                    steps.append(("scratch", shape, dtype, name))
                    spans[name] = span
                elif step[0] == "conv":
                    _, replay, x, w, pointers, window_args, stats, out = step
                    out = where(out)
                    if out is not None and (out[1] != 0 or out[0] not in results or not replay.dense):
                        return None
                    window = None if window_args is None else (where(window_args[0]), window_args[1:])
                    steps.append(("conv", replay, where(x), where(w), tuple(where(p) for p in pointers), window,
                                  where(stats), out and out[0]))
                    launches.append(replay)
                else:
                    _, direct, grid, args, positions = step
                    args = tuple(where(a) if i in positions else a for i, a in enumerate(args))
                    steps.append(("launch", direct, grid, args, positions))
                    launches.append(direct)
        except LookupError:
            return None
        results = tuple((name, tuple(t.shape), t.stride(), t.dtype, zeroed, name in produced)
                        for name, (t, zeroed) in results.items())
        return cls(tuple(steps), results, tuple(name for name, t in sources.items() if t is not None), launches)

    def __call__(self, device, tensors):
        """The results (a tuple, in the order given to `of`) of the call on `tensors` ({name: tensor}, as the sources
        were given), or None."""
        bases = []
        for name in self.sources:
            address = tensors[name].data_ptr()
            if address % 16:
                return None
            bases.append(address)
        if not self.lean or _launch_hooks_set():
            return None
        record_breaks()         # (a call being recorded that replays another would not see its launches)
        if self.program is None:
            self.program = False        # (a build that fails leaves the full path to serve, not a retry per call)
            try:
                self.program = self._program()
            except Exception as error:  # noqa: BLE001
                warnings.warn(f"conv_tutorial: a replay could not be built ({type(error).__name__}: {error}); its "
                              f"calls take the full path", RuntimeWarning)
        if not self.program:
            return None
        return self._run(device, tensors, bases)

    def _as_recorded(self, name, t):
        # result `name` as the recorded call returned it: a view of what its "finish" step computed (say, a
        # permuted [Co, R, S, Ci] as the NCHW-shaped dW), with the same shape and strides
        _, shape, strides, dtype, _, _ = next(entry for entry in self.results if entry[0] == name)
        if t.dtype != dtype or t.numel() != math.prod(shape) or t.storage_offset() or not t.is_contiguous():
            raise RuntimeError(f"a replay's finish step made {t.dtype} {tuple(t.shape)}, not the contiguous "
                               f"{dtype} {shape} the recorded call returned a view of")
        return t.as_strided(shape, strides)

    def _program(self):
        """The steps as a program over a list of base addresses (`_build`), its launches packed (packed.py)
        where every launch is a DirectLaunch and packed launches are available, else Python launches
        (`PythonLaunch`: the CPU tests' stand-ins, packed launches off or failing to pack)."""
        launches = [step[1] for step in self.steps if step[0] in ("conv", "launch")]
        if all(isinstance(getattr(launch, "direct", launch), DirectLaunch) for launch in launches) and packed.available():
            try:
                program = self._build(packed.pack, torch._C._cuda_getDevice())
                self.packed = True
                return program
            except Exception as error:      # noqa: BLE001  (a launch packed.py cannot pack: Python launches serve)
                warnings.warn(f"conv_tutorial: a replay keeps the Python launch path ({error})", RuntimeWarning)
        self.packed = False
        return self._build(PythonLaunch, None)

    def _build(self, make_launch, device):
        """(number of bases, ops): ("alloc", base, shape, strides, dtype, zeroed, result's position or None),
        ("launch", make_launch(direct, grid, args, device)), ("derive", fn, source name, base), ("finish", fn,
        buffer's base, result name, result's position), ("free", base), with every address a packed.Slot: a
        `bases` index plus a displacement (the sources' addresses first, in order)."""
        bases = {name: i for i, name in enumerate(self.sources)}
        program = []

        def base_of(name):
            if name not in bases:
                bases[name] = len(bases)
            return bases[name]

        def slot(place):
            return None if place is None else Slot(bases[place[0]], place[1])

        for position, (name, shape, strides, dtype, zeroed, produced) in enumerate(self.results):
            if not produced:
                program.append(("alloc", base_of(name), shape, strides, dtype, zeroed, position))
        for step in self.steps:
            kind = step[0]
            if kind == "conv":
                _, replay, x, w, pointers, window, stats, out = step
                program += replay.program_ops(slot(x), slot(w), tuple(slot(p) for p in pointers),
                                              None if out is None else bases[out],
                                              None if window is None else (slot(window[0]), *window[1]),
                                              slot(stats), lambda: base_of(object()), make_launch, device)
            elif kind == "launch":
                _, direct, grid, args, positions = step
                args = tuple(slot(a) if i in positions else a for i, a in enumerate(args))
                program.append(("launch", make_launch(direct, grid, args, device)))
            elif kind == "scratch":
                _, shape, dtype, name = step
                program.append(("alloc", base_of(name), shape, None, dtype, False, None))
            elif kind == "derive":
                _, fn, source, name = step
                program.append(("derive", fn, source, base_of(name)))
            elif kind == "finish":
                _, fn, buffer, name = step
                program.append(("finish", fn, bases[buffer], name,
                                next(i for i, entry in enumerate(self.results) if entry[0] == name)))
            else:
                raise ValueError(f"a replay step of unknown kind {kind!r}")
        return (len(bases), tuple(program))

    def _run(self, device, tensors, source_addresses):
        size, program = self.program
        bases = source_addresses + [0] * (size - len(source_addresses))
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()) if self.packed else None
        results, held = [None] * len(self.results), {}      # held: what the program allocated or derived, by base
        for op in program:
            kind = op[0]
            if kind == "launch":
                op[1].launch(stream, bases)
            elif kind == "alloc":
                _, index, shape, strides, dtype, zeroed, position = op
                t = (torch.empty(shape, dtype=dtype, device=device) if strides is None else
                     torch.empty_strided(shape, strides, dtype=dtype, device=device))
                if zeroed:
                    t.zero_()
                bases[index] = t.data_ptr()
                held[index] = t
                if position is not None:
                    results[position] = t
            elif kind == "derive":
                _, fn, source, index = op
                held[index] = t = fn(nhwc_view(tensors[source]))
                bases[index] = t.data_ptr()
            elif kind == "finish":
                _, fn, buffer, name, position = op
                results[position] = self._as_recorded(name, fn(held[buffer]))
            elif kind == "free":
                del held[op[1]]
            else:
                raise ValueError(f"a program op of unknown kind {kind!r}")
        return tuple(results)


class PythonLaunch:
    """A program's launch (Replay._build) through DirectLaunch.launch_lean, the Python launch path, called
    as packed.py's PackedLaunch is: `launch(stream, bases)`, each packed.Slot in `args` (at the top level
    or in a tuple there) at bases[slot.base] + slot.displacement. (launch_lean launches on the current
    stream; `stream` is not read.)"""

    def __init__(self, direct, grid, args, device=None):
        self.direct, self.grid, self.args = direct, grid, list(args)
        # where the Slots are: (position, None) for an argument, (position, index) for a tuple's entry
        self.slots = []
        for i, a in enumerate(args):
            if isinstance(a, Slot):
                self.slots.append((i, None, a))
            elif isinstance(a, tuple):
                for j, v in enumerate(a):
                    if isinstance(v, Slot):
                        self.slots.append((i, j, v))
                    elif isinstance(v, tuple) and any(isinstance(e, Slot) for e in v):
                        raise TypeError(f"argument {i}: a Slot two tuples deep (PythonLaunch resolves an argument "
                                        f"and its tuple's entries)")

    def launch(self, stream, bases):
        args = list(self.args)
        nested = {}
        for i, j, slot in self.slots:
            address = bases[slot.base] + slot.displacement
            if j is None:
                args[i] = address
            else:
                nested.setdefault(i, list(args[i]))[j] = address
        for i, entries in nested.items():
            args[i] = tuple(entries)
        self.direct.launch_lean(self.grid, args)


class ConvPlan:
    """Everything about one (shape, dtype, config, device) that does not depend on the tensors."""

    def __init__(self, geometry, dtype, config, arch, num_sms, out_dtype=None):
        self.geometry, self.dtype, self.arch, self.num_sms = geometry, dtype, arch, num_sms
        self.out_dtype = out_dtype or dtype      # e4m3 operands: a bf16 or an e4m3 output
        self.config = KernelConfig(*config)
        check_config(self.config, arch)
        self.templates = {}       # (windowed, w_taps) -> the first such call's ConvLaunch without its tensors
        self.replays = {}         # variant (`variant`) -> ForwardReplay: the conv kernel's DirectLaunch, split-K's
                                  # second kernel's, and what their later launches take from the plan
        self.reduce_grid = self.reduce_scalars = None   # split-K's second kernel: fixed by the plan

    def launch_for(self, x_nhwc, w, bias, scale=None, residual=None, out_window=None, channel_stats=None):
        """The forward kernel's ConvLaunch (kernels/fprop.py) for these tensors; after the first call, built from templates (one
        for calls that store a whole output, one for those with an `out_window`: its out_2d is a stand-in;
        and one per FlippedFilter's taps, lesson 06's dgrad weights read in place)."""
        key = _template_key(w, out_window)
        template = self.templates.get(key)
        if template is None:
            launch = fprop.prepare_launch(x_nhwc, w, bias, self.geometry, self.config,
                                           self.arch, self.num_sms, scale, residual, self.out_dtype, out_window,
                                           channel_stats)
            self.templates[key] = _tensorless(launch)
            return launch
        # Same shapes, strides, boxes and layouts: only the base pointers change. Copy the
        # validated descriptors and swap the tensors in.
        x_nhwc, w, _ = core.pad_channels_for_tma(x_nhwc, w)
        out_2d = _new_like(template.out_2d, x_nhwc.device)
        w = _weight_tensor(w)
        w_2d = w.view(w.shape[0], -1)
        tensors = dict(in_desc=x_nhwc, w_desc=w_2d, w_tail_desc=w_2d, out_desc=out_2d, out_tail_desc=out_2d)
        descriptors = {name: None if getattr(template, name) is None else _with_base(getattr(template, name), tensor)
                       for name, tensor in tensors.items()}
        partial = _new_like(template.partial, x_nhwc.device)
        pointers = tuple(t if t is not None else out_2d for t in (bias, scale, residual, partial))
        return template._replace(**descriptors, pointers=pointers, out_2d=out_2d, partial=partial,
                                 out_window=None if out_window is None else out_window.kernel_args(),
                                 channel_stats=channel_stats)

    def variant(self, bias, scale, residual, activation, window_args, channel_stats, template_key):
        """What a launch of this plan specializes on beyond the plan: the epilogue, and whether each
        of its pointers is 16-byte aligned (Triton specializes pointer alignment) and of which dtype;
        with a window, which of its integers are 1, multiples of 16 or past 32 bits (Triton
        specializes those too: a constexpr, an alignment, an i64 parameter); the statistics'
        pointer; lesson 06's weights read in place, their taps."""
        variant = (activation,) + tuple(None if t is None else (t.dtype, t.data_ptr() % 16 == 0)
                                        for t in (bias, scale, residual))
        if window_args is not None:     # (and a dgrad's phases, if any, as they are: small integers)
            variant += (window_args[0].dtype, window_args[8]) + tuple((v == 1, v % 16 == 0, -2**31 <= v < 2**31)
                                                                      for v in window_args[1:8])
        if channel_stats is not None:
            variant += ("channel_stats", channel_stats.data_ptr() % 16 == 0)
        if template_key[1] is not None:
            variant += template_key[1:]
        return variant

    def run(self, x_nhwc, w, bias=None, scale=None, residual=None, activation="none", out_window=None,
            channel_stats=None):
        """The conv's NHWC output, or, given an `out_window` (core.OutputWindow, checked by the
        caller; not with split-K), its view, where the kernel stored the output's pixels. Given
        `channel_stats` (checked by the caller; not with split-K; fp32 [2, Co]), the kernel also adds each
        output channel's sum and sum of squares into it, every program into the same tensor."""
        window_args = None if out_window is None else out_window.kernel_args()
        key = _template_key(w, out_window)
        variant = self.variant(bias, scale, residual, activation, window_args, channel_stats, key)
        replay = self.replays.get(variant)
        if replay is None:
            return self._first_run(variant, key, x_nhwc, w, bias, scale, residual, activation, out_window,
                                   channel_stats)
        # Later launches: the tensors themselves where the kernel takes descriptors (their tensor maps are
        # remembered by address), addresses for the pointers, the run-time scalars from the plan.
        x_nhwc, w, _ = core.pad_channels_for_tma(x_nhwc, w)
        w = _weight_tensor(w)
        _check_tma_aligned(x_nhwc)
        _check_tma_aligned(w)
        if window_args is not None:
            window_args = (window_args[0].data_ptr(), *window_args[1:])
        pointers = tuple(None if t is None else t.data_ptr() for t in (bias, scale, residual))
        stats = None if channel_stats is None else channel_stats.data_ptr()
        out_2d = replay(x_nhwc.device, x_nhwc, w, pointers, window_args=window_args, stats=stats)
        _record(replay, x_nhwc, w, pointers, window_args, stats, None if out_window is not None else out_2d)
        return out_window.view if out_window is not None else fprop.output_nhwc(self.geometry, out_2d)

    def _first_run(self, variant, key, x_nhwc, w, bias, scale, residual, activation, out_window, channel_stats):
        """A variant's first launch: the generic path (binds, specializes, compiles), then a
        DirectLaunch of each compiled kernel and the ForwardReplay of them, for the calls after it."""
        record_breaks()          # (a recording's replay would not compile, nor launch this way)
        launch = self.launch_for(x_nhwc, w, bias, scale, residual, out_window, channel_stats)
        epilogue = fprop.Epilogue(bias is not None, scale is not None, residual is not None, activation)
        kwargs = fprop.kernel_constexprs(self.config, self.arch, epilogue)
        if _COMPILE_ONLY.get():
            out = self._compile_only(launch, kwargs, bias, scale, residual, activation)
            return out if out_window is None else out_window.view
        direct = DirectLaunch.first_launch(fprop.conv2d_fprop_kernel, launch.grid, launch.kernel_args(), kwargs,
                                           _descriptors(self.templates[key]))
        reduce = None
        if launch.partial is not None:          # split-K: the second kernel sums the slices
            grid, args, reduce_kwargs = fprop.split_k_epilogue_launch(launch, bias, scale, residual, activation)
            reduce = DirectLaunch.first_launch(fprop.split_k_epilogue_kernel, grid, args, reduce_kwargs)
            self.reduce_grid, self.reduce_scalars = grid, args[3:]
        self.replays[variant] = ForwardReplay(self, direct, self.templates[key], reduce)
        return out_window.view if out_window is not None else fprop.output_nhwc(self.geometry, launch.out_2d)

    def _compile_only(self, launch, kwargs, bias, scale, residual, activation):
        """Inside `compiling_ahead`: hand this variant's kernels to the compile pool and launch
        nothing; the output comes back unwritten. (The specialization, and so Triton's cache key,
        is the one a real first launch with these tensors computes.)"""
        fprop.conv2d_fprop_kernel.warmup(*launch.kernel_args(), grid=launch.grid, **kwargs)
        if launch.partial is not None:
            grid, args, reduce_kwargs = fprop.split_k_epilogue_launch(launch, bias, scale, residual, activation)
            fprop.split_k_epilogue_kernel.warmup(*args, grid=grid, **reduce_kwargs)
        return fprop.output_nhwc(self.geometry, launch.out_2d) if launch.out_window is None else None


_COMPILE_ONLY = contextvars.ContextVar("conv_tutorial_compile_only", default=False)

# How much lower the background's compile workers run than the caller (compile_pool.ProcessCompiles'
# niceness): low enough that the caller's thread keeps a CPU, not so low (19) that busy data-loader
# workers at the caller's priority would starve the compiles the first step is about to need.
BACKGROUND_NICENESS = 10


@contextlib.contextmanager
def compiling_ahead(workers=None, wait=True):
    """While active, the first call of each (plan, epilogue variant) does not run: it submits the
    kernel's compile (and split-K's second kernel's) to a pool of `workers` (default: the CPUs this
    process may use, shared among the processes torchrun started on this node, at most 32) and
    returns its output unwritten. Each compile runs in a worker process where it can
    (compile_pool.ProcessCompiles: the caller keeps the GIL), else on the pool's thread; a kernel
    already in Triton's cache loads at once, on the caller's thread. On exit
    every compile has finished, and Triton's in-memory cache holds them: the calls after it launch
    without compiling. A model run once inside it has its distinct kernels compiled side by side
    instead of one after another (its outputs are garbage: run it for the compiles alone).
    Depthwise convs (depthwise.py) and wgrad's kernels (wgrad.py), the column folds' copies
    (runtime.FoldedConv: the folded stem's, wgrad's), the fp8 operator's fold of its scales (runtime.fold_fp8_scales) and
    dgrad's zero fill (backward.py) are compiled in the pool too and not run; dgrad's weight flips
    (kernels/dgrad.py) compile and run as usual, their launch waiting for its compile. A whole
    training step: compile_ahead.compile_kernels_ahead. Autotuning must be off inside (the tuner
    times real launches). Triton reports a failed compile when the block exits.

    `wait=False`: the block exits once every compile is submitted (and every kernel already in the cache
    loaded), and the pool goes on compiling, its workers at a lower priority (BACKGROUND_NICENESS) than
    the caller, which goes on with its own work.
    Triton's cache holds each kernel's compile in progress (its FutureKernel): the kernel's first
    launch waits for that compile alone, and raises its failure, where a compile that failed is
    not reported at the block's exit (one whose kernel is never launched is not reported at all). The
    process's exit waits for the compiles still queued, as for any pool's work."""
    if not isinstance(wait, bool):
        raise TypeError(f"wait must be a bool, got {wait!r}")
    workers = workers or _compile_pool_size()
    pool = compile_pool.ProcessCompiles(workers, niceness=0 if wait else BACKGROUND_NICENESS)
    if wait:
        with pool, triton.AsyncCompileMode(pool) as mode, native.suspended():
            token = _COMPILE_ONLY.set(True)
            try:
                yield
            except BaseException:
                mode.ignore_errors = True    # (the block's own error, not a compile's failing after it, is the one to see)
                raise
            finally:
                _COMPILE_ONLY.reset(token)
    else:
        try:
            with compiling_into(pool):
                yield
        finally:
            pool.shutdown(wait=False)                # (its threads finish the compiles submitted)


@contextlib.contextmanager
def compiling_into(pool):
    """compiling_ahead's compile-only mode, its compiles handed to `pool` (an executor, as
    compile_pool.ProcessCompiles), for the block alone: on exit nothing waits, and the pool goes on with
    what it was handed (traced_compiles.py keeps one pool across many such blocks)."""
    triton.AsyncCompileMode(pool).__enter__()
    token = _COMPILE_ONLY.set(True)
    try:
        with native.suspended():
            yield
    finally:
        _COMPILE_ONLY.reset(token)
        _async_compile.active_mode.set(None)    # (not the mode's __exit__, which waits for every compile)


def _compile_pool_size():
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(32, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))))


def compiling_ahead_active() -> bool:
    return _COMPILE_ONLY.get()


def _launch_hooks_set():
    """Whether a profiler (proton, or a user) listens to Triton's launches. Triton 3.8 keeps the
    hooks in a HookChain, which is never None; older versions, a callable or None."""
    hook = triton.knobs.runtime.launch_enter_hook
    return bool(hook.calls) if hasattr(hook, "calls") else hook is not None


native.use_launches(lambda: packed.module()._C_API if packed.available() else None,
                    lambda: _launch_hooks_set())     # (looked up per call: a test may replace it)


def _template_key(w, out_window):
    # which of a plan's templates a call takes: windowed or not, and a FlippedFilter's filter shape and taps (None
    # for a tensor: its shape is the plan's). Two dgrads' phases can share a conv and its taps with filters of other
    # sizes (R 3 and 4 at stride 2, say), whose descriptors differ in their row length.
    return (out_window is not None,
            (tuple(w.w.shape), w.kernel_args()) if isinstance(w, core.FlippedFilter) else None)


def _weight_tensor(w):
    # the tensor a weights descriptor points at: w, or a FlippedFilter's filter (contiguous: the checks passed)
    return w.w if isinstance(w, core.FlippedFilter) else w


def _check_tma_aligned(tensor):
    if tensor.data_ptr() % 16:
        raise ValueError(f"TMA needs 16-byte aligned tensors; this one starts at address "
                         f"{tensor.data_ptr():#x} (a view into another tensor?); pass .clone()")


def _tensorless(launch, descriptors=fprop.DESCRIPTORS, buffers=("out_2d", "partial"),
                cleared=("pointers", "out_window", "channel_stats")):
    """A plan's template of a launch (the forward kernel's ConvLaunch by default; wgrad.py passes the
    wgrad kernel's WgradLaunch and its field names): its descriptors without their tensors, its output and
    workspace `buffers` as shapes (meta tensors), its `cleared` fields None. A template holding
    the first call's tensors would keep them alive as long as the plan: an activation per layer
    of a network, and during autotuning one per candidate."""
    fields = {name: None if getattr(launch, name) is None else _with_base(getattr(launch, name), None)
              for name in descriptors}
    as_meta = lambda t: None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    fields.update({name: as_meta(getattr(launch, name)) for name in buffers})
    fields.update({name: None for name in cleared})
    return launch._replace(**fields)


def _descriptors(launch, names=fprop.DESCRIPTORS):
    """A launch's descriptors, in the kernel's order (None where it has none)."""
    return tuple(getattr(launch, name) for name in names)


def _new_like(template_tensor, device):
    """A new tensor of a template's shape and dtype on `device` (None for None)."""
    if template_tensor is None:
        return None
    return torch.empty(template_tensor.shape, dtype=template_tensor.dtype, device=device)


def _with_base(template, tensor):
    """A copy of a validated descriptor that points at `tensor` (same shape, strides and dtype),
    or at nothing (None: a template)."""
    if tensor is not None:
        _check_tma_aligned(tensor)
    descriptor = object.__new__(type(template))    # copy.copy, without its ~3 us of generality
    descriptor.__dict__.update(template.__dict__)
    descriptor.base = tensor
    return descriptor



_PLANS = {}          # (geometry, dtype, config, device) -> ConvPlan


def plan_for(geometry, dtype, config, out_dtype=None):
    arch, num_sms, _ = device_facts()
    key = (geometry, dtype, config, torch.cuda.current_device(), out_dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = ConvPlan(geometry, dtype, config, arch, num_sms, out_dtype)
    return plan

