"""Ahead-of-time builds of the package's kernels for a GPU target, on any machine (no GPU needed):
the PTX, shared memory and registers of a launch, as a GPU would compile it. The tests use it to
check the builds on a CPU, and to bind the forward kernel to the one lesson 05 teaches."""
import torch
import triton

from ..core.device import ARCH_CAPABILITY
from ..core.geometry import conv_geometry
from . import fprop


def compile_for_target(kernel, args, kwargs, arch: str):
    """Compile `kernel` (Gluon or Triton) for `arch` ("sm_90" or "sm_100") without a GPU.

    `args`/`kwargs` are what a launch would get (CPU tensors and host TensorDescriptor objects are
    fine; launch options like num_warps go in kwargs). Returns the CompiledKernel, whose
    `.asm["ptx"]` holds the PTX and `.metadata.shared` the shared memory a launch needs.
    (Run it where TRITON_INTERPRET is unset or 0: under the interpreter `triton.jit` builds no
    compilable kernel.)"""
    src, target, options = compile_source(kernel, args, kwargs, arch)
    return triton.compile(src, target=target, options=options)


def compile_source(kernel, args, kwargs, arch: str):
    """(src, target, options): what `triton.compile` takes to build `kernel`'s launch on `args`/`kwargs`
    for `arch`, as compile_for_target builds it. These are Triton-internal APIs: keep every use behind
    this one function."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import create_function_from_signature
    if arch not in ARCH_CAPABILITY:
        raise ValueError(f"arch must be one of {sorted(ARCH_CAPABILITY)}, got {arch!r}")
    major, minor = ARCH_CAPABILITY[arch]
    target = GPUTarget("cuda", 10 * major + minor, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    source_cls = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    return source_cls(kernel, signature, constexprs, attrs), target, options.__dict__


def fprop_build(arch, N=2, H=16, W=16, Ci=64, Co=128, R=3, S=3, stride=1, padding=1, config=fprop.FIXED_CONFIG,
                epilogue=fprop.Epilogue(), dtype="bfloat16", out_window=None, channel_stats=None):
    """(kernel, args, kwargs) of the forward kernel's launch on zeroed CPU tensors of this conv, for
    `compile_for_target`: `epilogue` an Epilogue or its fields as a list; dtype "float8_e4m3fn" builds
    the e4m3 kernel (bf16 out); out_window and channel_stats, the backward's destinations, as prepare_launch
    takes them. Without them, the build lesson 05's `aot_conv2d_fprop` makes of its own kernel."""
    epilogue, dtype = fprop.Epilogue(*epilogue), getattr(torch, dtype)
    x_nhwc, w = torch.zeros(N, H, W, Ci).to(dtype), torch.zeros(Co, R, S, Ci).to(dtype)
    geometry = conv_geometry(x_nhwc.shape, w.shape, stride, padding)
    per_channel, residual = torch.zeros(Co), torch.zeros(*geometry.output_shape_nhwc, dtype=torch.bfloat16)
    bias, scale, residual = (t if on else None for t, on in zip((per_channel, per_channel, residual), epilogue[:3]))
    launch = fprop.prepare_launch(x_nhwc, w, bias, geometry, fprop.KernelConfig(*config), arch, 132, scale, residual,
                                  torch.bfloat16, out_window, channel_stats)
    return fprop.conv2d_fprop_kernel, launch.kernel_args(), fprop.kernel_constexprs(config, arch, epilogue)


def wgrad_build(arch, N=2, H=16, W=16, Ci=64, Co=128, R=3, S=3, stride=1, padding=1, split_k=2,
                default_config=False):
    """(kernel, args, kwargs) of the wgrad kernel's launch on zeroed CPU tensors of this conv, for
    `compile_for_target`: wgrad_config's tile in `split_k` slices, or (default_config) the launcher's
    choice for an H100's 132 SMs. The build lesson 07's `aot_conv2d_wgrad` makes of its own kernel."""
    from . import wgrad
    x = torch.zeros(N, H, W, Ci, dtype=torch.bfloat16)
    geometry = conv_geometry(x.shape, (Co, R, S, Ci), stride, padding)
    dy = torch.zeros(geometry.output_shape_nhwc, dtype=torch.bfloat16)
    config = None if default_config else wgrad.wgrad_config(Co, Ci)._replace(split_k=split_k)
    launch = wgrad.prepare_wgrad(x, dy, geometry, config, arch, 132)
    dw = torch.empty(Co, R * S * Ci, dtype=x.dtype)
    return wgrad.conv2d_wgrad_kernel, launch.kernel_args(dw), wgrad.wgrad_kernel_options(launch.config, arch)
