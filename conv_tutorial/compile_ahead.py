"""A model's kernels compiled side by side before its first step (the forward's, dgrad's and wgrad's).

    conv_tutorial.compile_kernels_ahead(model, example_input, autocast_dtype=torch.bfloat16)
    step = torch.compile(model)                                      # train as usual

Why: each distinct kernel a model needs (a shape, a config, an epilogue) compiles at its first call,
and a training step's first calls come one after another: ResNet-50's first step compiled its 68
Gluon kernels serially, about 1.4 s each, 95 of its 159 s (RESULTS.md, "Training"). Here the model
runs once inside `launch.compiling_ahead`: every operator call hands its kernels' compiles to a pool
of threads and launches nothing (the forward's and dgrad's through their plans, wgrad's through its
own, depthwise convs too), so the compiles overlap; on exit Triton's in-memory cache holds them, and
the step's first calls launch without compiling. Small Triton kernels around the convs (dgrad's
zero fill, the stem's fold) compile and run as usual.

The pass computes garbage (nothing is launched) and keeps none of it: it differentiates the sum of
the outputs with `torch.autograd.grad`, so no parameter's `.grad` is touched, and puts every buffer
back (BatchNorm's running statistics, which a forward in train mode updates). Call it on the module
itself, before torch.compile or DistributedDataParallel wrap it, with an input of the step's shape,
dtype and device, in the mode (train or eval) and under the autocast dtype the step will use: the
kernels compiled are those of these shapes and dtypes. A kernel the step needs that this pass did
not compile (another shape, say) compiles at its first call, as without it.
"""
import time
import warnings

import torch

from . import selection
from .launch import compiling_ahead


def compile_kernels_ahead(model: torch.nn.Module, *example_inputs, backward: bool = True,
                          autocast_dtype=None, workers=None) -> float:
    """Compile the kernels one step of `model` on `example_inputs` needs (its forward, and with
    `backward` its gradients: dgrad and wgrad), side by side in a pool of `workers` threads (default:
    one per CPU, at most 32), and return the seconds it took. `autocast_dtype`: the dtype the step
    runs under torch.autocast (None: no autocast). The model's parameters, their gradients and its
    buffers are left as they were. On a CPU, or with autotuning on (the tuner compiles its
    candidates as it times them), nothing is compiled ahead and 0.0 is returned."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("model is wrapped in DistributedDataParallel, whose gradient hooks expect every backward "
                         "to reach the optimizer; pass the module it wraps (model.module), before wrapping it")
    if not example_inputs or not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise TypeError(f"example_inputs must be one or more tensors, got "
                        f"{[type(x).__name__ for x in example_inputs] or 'none'}")
    if autocast_dtype is not None and autocast_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast_dtype must be None, torch.float16 or torch.bfloat16, got {autocast_dtype!r}")
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers must be None or a positive int, got {workers!r}")
    device = example_inputs[0].device
    if device.type != "cuda":
        return 0.0        # the operator runs torch's conv off the GPU: nothing to compile
    if selection.autotune_enabled():
        warnings.warn("compile_kernels_ahead: autotuning is on, and the tuner compiles its candidates as it "
                      "times them; nothing was compiled ahead")
        return 0.0
    start = time.perf_counter()
    _step_once(model, example_inputs, backward, autocast_dtype, workers)
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _step_once(model, example_inputs, backward, autocast_dtype, workers):
    """One step's forward and, with `backward`, its gradients, inside launch.compiling_ahead, keeping
    nothing: no `.grad` written, every buffer put back as it was."""
    device_type = example_inputs[0].device.type
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    parameters = [p for p in model.parameters() if p.requires_grad]
    try:
        with compiling_ahead(workers), torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16,
                                                      enabled=autocast_dtype is not None):
            with torch.set_grad_enabled(backward):
                outputs = model(*example_inputs)
                total = sum(o.float().sum() for o in _tensors(outputs))
            if backward and parameters and isinstance(total, torch.Tensor) and total.requires_grad:
                # On this thread: autograd runs a GPU's backward on a thread of its own, where
                # compiling_ahead's context variables (and Triton's compile mode) are not set.
                with torch.autograd.set_multithreading_enabled(False):
                    torch.autograd.grad(total, parameters, allow_unused=True)
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _tensors(outputs):
    """The tensors in a model's output (a tensor, or a tuple, list or dict of them, nested)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (tuple, list)):
        return [t for o in outputs for t in _tensors(o)]
    return []
