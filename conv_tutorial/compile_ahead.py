"""A model's kernels compiled side by side before its first step (the forward's, dgrad's and wgrad's).

    conv_tutorial.set_backward("lesson06")                            # (before: the pass compiles what the step runs)
    conv_tutorial.compile_kernels_ahead(model, example_input, autocast_dtype=torch.bfloat16)
    step = torch.compile(model)                                      # train as usual

Why: each distinct kernel a model needs (a shape, a config, an epilogue) compiles at its first call,
and a training step's first calls come one after another: ResNet-50's first step compiled its 68
Gluon kernels serially, about 1.4 s each, 95 of its 159 s (RESULTS.md, "Training"). Here the model
runs once inside `launch.compiling_ahead`: every operator call hands its kernels' compiles to a pool
of worker processes and launches nothing (the forward's and dgrad's through their plans, wgrad's through its
own, depthwise convs too), so the compiles overlap; on exit Triton's in-memory cache holds them, and
the step's first calls launch without compiling. Of the small Triton kernels around the convs,
dgrad's zero fill, the stem's fold and the fp8 operator's fold of its scales are compiled in the
pool too; dgrad's weight flips compile and run as usual.

The pass computes garbage (the operators launch nothing) and keeps none of it: it differentiates the
sum of the outputs with `torch.autograd.grad`, so no parameter's `.grad` is touched; it puts every
buffer back (BatchNorm's running statistics, which a forward in train mode updates) and the random
number generators' states; `backward_fallbacks()` counts none of its calls (backward.py: a compile-only
pass is not the model's). What it cannot keep from seeing
the garbage: hooks on the model's tensors run (a gradient hook that all-reduces would wait for
ranks that do not run the pass), and code that branches on values takes whichever branch. Call it on
the module itself, before torch.compile or DistributedDataParallel wrap it (either wrapper is refused:
torch.compile's CUDA graphs could record the pass, which launches none of the operators' kernels, and
replay it in the steps after; DDP's hooks wait for an optimizer step), after `set_backward`, with
an input of the step's shape, dtype and device, in the mode (train or eval) and under the autocast
dtype the step will use: the kernels compiled are those of these shapes and dtypes. A kernel the
step needs that this pass did not compile (another shape, a checkpointed segment whose backward
`torch.autograd.grad` does not reach) compiles at its first call, as without it.

Under torch.compile the step's operator calls can also be learned from torch.compile's own tracing, with no
pass of the model: traced_compiles.py (`compile_while_tracing`, opt-in).
"""
import time
import warnings

import torch

from . import native, selection
from .launch import compiling_ahead


def compile_kernels_ahead(model: torch.nn.Module, *example_inputs, backward: bool = True,
                          autocast_dtype=None, workers=None, wait: bool = True) -> float:
    """Compile the kernels one step of `model` on `example_inputs` needs (its forward, and with
    `backward` its gradients: dgrad and wgrad), side by side in a pool of `workers` processes
    (default: launch.compiling_ahead's), and return the seconds it took. `autocast_dtype`: the dtype
    the step runs under torch.autocast (None: no autocast). The model's parameters, their gradients
    and its buffers are left as they were. On a CPU, or with autotuning on (the tuner compiles its
    candidates as it times them), nothing is compiled ahead and 0.0 is returned. `wait=False`:
    return once every compile is submitted (the seconds of the pass alone; kernels already in Triton's
    cache are loaded by then); the compiles go on in the pool while the caller goes on (torch.compile
    tracing the step, say), and each kernel's first launch waits for its own compile and raises its
    failure (launch.compiling_ahead)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("model is wrapped in DistributedDataParallel, whose gradient hooks expect every backward "
                         "to reach the optimizer; pass the module it wraps (model.module), before wrapping it")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        # (its CUDA graphs, with mode="reduce-overhead", could record this pass, which launches none of the
        # operators' kernels, and replay it in the steps after)
        raise ValueError("model is wrapped by torch.compile; pass the module it compiles (model._orig_mod), and "
                         "compile it after this pass")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("compile_kernels_ahead: a CUDA graph is being captured on this stream, and it would "
                           "record a pass that launches none of the operators' kernels; call it before capturing")
    if not example_inputs or not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise TypeError(f"example_inputs must be one or more tensors, got "
                        f"{[type(x).__name__ for x in example_inputs] or 'none'}")
    if autocast_dtype is not None and autocast_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast_dtype must be None, torch.float16 or torch.bfloat16, got {autocast_dtype!r}")
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers must be None or a positive int, got {workers!r}")
    if not isinstance(wait, bool):
        raise TypeError(f"wait must be a bool, got {wait!r}")
    lazy = [name for name, t in (*model.named_parameters(), *model.named_buffers())
            if isinstance(t, torch.nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise ValueError(f"the model has uninitialized (lazy) parameters or buffers ({', '.join(lazy[:3])}): run "
                         f"one forward to initialize them before compiling its kernels ahead")
    device = example_inputs[0].device
    on_gpu = {t.device for t in model.parameters() if t.device.type == "cuda"}
    if device.type != "cuda":
        if on_gpu:
            raise ValueError(f"example_inputs are on {device} and the model's parameters on "
                             f"{', '.join(map(str, sorted(on_gpu, key=str)))}: pass an input on the device the step "
                             f"runs on")
        return 0.0        # the operator runs torch's conv off the GPU: nothing to compile
    if selection.autotune_enabled():
        warnings.warn("compile_kernels_ahead: autotuning is on, and the tuner compiles its candidates as it "
                      "times them; nothing was compiled ahead")
        return 0.0
    start = time.perf_counter()
    native.start()      # (the repeat calls' C++ kernels build in the background meanwhile: native.py)
    _step_once(model, example_inputs, backward, autocast_dtype, workers, wait)
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _step_once(model, example_inputs, backward, autocast_dtype, workers, wait=True):
    """One step's forward and, with `backward`, its gradients, inside launch.compiling_ahead, keeping
    nothing: no `.grad` written; every buffer (the same tensor, its values and shape) and the random
    number generators put back as they were (the backward's fallbacks are not counted inside
    compiling_ahead)."""
    device = example_inputs[0].device
    buffers = [(module, name, b, b.detach().clone()) for module in model.modules()
               for name, b in module._buffers.items() if b is not None]
    inputs = [p for p in model.parameters() if p.requires_grad] + [x for x in example_inputs if x.requires_grad]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.autograd.set_detect_anomaly(False), compiling_ahead(workers, wait), \
                torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            with torch.set_grad_enabled(backward):
                outputs = _tensors(model(*example_inputs))
                total = sum(o.float().sum() for o in outputs if o.requires_grad)
            if backward and inputs:
                if not isinstance(total, torch.Tensor):
                    warnings.warn("compile_kernels_ahead: the model's output holds no tensor that needs a gradient "
                                  "(tensors, and tuples, lists and dicts of them, are looked at): only the "
                                  "forward's kernels were compiled ahead")
                else:
                    # On this thread: autograd runs a GPU's backward on a thread of its own, where
                    # compiling_ahead's context variables (and Triton's compile mode) are not set.
                    with torch.autograd.set_multithreading_enabled(False):
                        torch.autograd.grad(total, inputs, allow_unused=True)
    finally:
        with torch.no_grad():
            for module, name, original, saved in buffers:
                module._buffers[name] = original            # (a forward may have put another tensor there)
                if original.shape != saved.shape:
                    original.resize_(saved.shape)
                original.copy_(saved)


def _tensors(outputs):
    """The tensors in a model's output (a tensor, or a tuple, list or dict of them, nested)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (tuple, list)):
        return [t for o in outputs for t in _tensors(o)]
    return []
