"""The operator's geometry and argument checks, and the GPU it runs on.

The rules a conv's arguments follow are taught by the lessons and live in their kit (common.py:
the geometry, the input and epilogue checks, the e4m3 dtypes and scales); this module names them
for the package, which takes them from nowhere else, and adds what only the operator asks: which
dtypes its kernel takes, and which GPU the current device is (looked up once per device).
"""
import functools

import torch

from .kernel import common, lesson05

ConvGeometry, conv_geometry, conv_output_size, pair = (
    common.ConvGeometry, common.conv_geometry, common.conv_output_size, common.pair)
check_conv_call, check_epilogue, output_dtype, ACTIVATIONS = (
    common.check_conv_call, common.check_epilogue, common.output_dtype, common.ACTIVATIONS)
FP8, FP8_MAX, check_fp8_dtypes, check_fp8_scales, fp8_epilogue = (
    common.FP8, common.FP8_MAX, common.check_fp8_dtypes, common.check_fp8_scales, common.fp8_epilogue)
quantize_tensor, quantize_conv_operands, dequantize_conv_operands = (
    common.quantize_fp8, common.quantize_conv_operands, common.dequantize_conv_operands)

KERNEL_DTYPES = lesson05.CONV_DTYPES + (FP8,)     # fp16, bf16, and e4m3 (lesson 05, section 9)


@functools.lru_cache(maxsize=None)
def _device_facts_of(device_index):
    arch, num_sms = common.tma_mma_arch_and_sms("conv2d_fprop")
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", lesson05.SHARED_MEMORY_PER_PROGRAM)
    return arch, num_sms, smem


def device_facts():
    """(arch, SM count, shared-memory limit per program) of the current GPU, looked up once per device;
    a clear error where it is no Hopper or data-centre Blackwell GPU."""
    if not common.HAS_CUDA:
        common.require_tma_mma_gpu("conv2d_fprop")
    return _device_facts_of(torch.cuda.current_device())


def current_arch():
    """"sm_90" or "sm_100" where this machine has the kernel's GPU, else None (once per device)."""
    return _arch_of_device(torch.cuda.current_device() if common.HAS_CUDA else None)


@functools.lru_cache(maxsize=None)
def _arch_of_device(device_index):
    if device_index is None or not common.is_tma_mma_capability(torch.cuda.get_device_capability(device_index)):
        return None
    return _device_facts_of(device_index)[0]
