"""The GPU a call runs on, as one table of facts: compute capability -> architecture (the PTX
target, the MMA flavour), streaming multiprocessors, shared memory per program, and peak rates.
Side-effect free: it asks torch about the device and changes nothing."""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
# The GPU targets of the Gluon kernels, by the name Triton and the PTX use: their compute capability.
ARCH_CAPABILITY = {"sm_90": (9, 0), "sm_100": (10, 0)}
MMA_FLAVOUR = {"sm_90": "wgmma", "sm_100": "tcgen05"}
SHARED_MEMORY_PER_PROGRAM = 232448    # bytes: the opt-in maximum of a program on an H100 or B200
SHARED_MEMORY_PER_SM = 233472         # bytes: 228 KB per SM on an H100 or B200, programs' reserves included
SHARED_MEMORY_RESERVED_PER_PROGRAM = 1024   # bytes the driver keeps per resident program (the 1 KB above the opt-in)
MBARRIER_BYTES = 8                    # one mbarrier: a 64-bit object in shared memory


def arch_of(cap) -> str:
    """"sm_90" for Hopper (9, 0), "sm_100" for data-centre Blackwell (10, x); ValueError otherwise."""
    if not is_tma_mma_capability(cap):
        raise ValueError(f"compute capability {cap} is neither Hopper (9, 0) nor data-centre Blackwell (10, x)")
    return "sm_90" if tuple(cap) == (9, 0) else "sm_100"


def interpreter_mode() -> bool:
    """True when plain Triton kernels run on the CPU through the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def capability() -> tuple[int, int] | None:
    """The CUDA compute capability of the current GPU, or None without one."""
    return torch.cuda.get_device_capability() if HAS_CUDA else None


def is_hopper() -> bool:
    """Exactly sm_90 (H100, H200): WGMMA and TMA. Not a `>= 9` test: sm_120 is not Hopper."""
    return capability() == (9, 0)


def is_blackwell() -> bool:
    """Data-centre Blackwell (sm_100, sm_103): tcgen05 and tensor memory. Consumer sm_120 has neither."""
    cap = capability()
    return cap is not None and cap[0] == 10


def is_tma_mma_capability(cap) -> bool:
    """Does a GPU of compute capability `cap` run the Gluon kernels: Hopper (9, 0) or
    data-centre Blackwell (10, x)?"""
    return cap is not None and (tuple(cap) == (9, 0) or cap[0] == 10)


def has_tma_mma_gpu() -> bool:
    """A GPU the Gluon kernels run on: Hopper or data-centre Blackwell."""
    return is_tma_mma_capability(capability())


def gpu_name() -> str:
    return torch.cuda.get_device_name() if HAS_CUDA else "no GPU"


GLUON_SKIP_REASON = (
    "needs an NVIDIA Hopper (sm_90) or data-centre Blackwell (sm_100) GPU; this machine has "
    + ("a GPU of capability %s" % (capability(),) if HAS_CUDA else "no CUDA GPU"))


def require_tma_mma_gpu(what: str) -> tuple[int, int]:
    """Raise a clear error unless a Hopper or Blackwell GPU is present; return its capability."""
    cap = capability()
    if cap is None:
        raise RuntimeError(f"{what} needs an NVIDIA GPU of capability 9.0 (Hopper) or 10.x "
                           f"(Blackwell); no CUDA GPU is present")
    if not has_tma_mma_gpu():
        raise RuntimeError(f"{what} needs an NVIDIA GPU of capability 9.0 (Hopper) or 10.x "
                           f"(data-centre Blackwell); this GPU ({gpu_name()}) has capability "
                           f"{cap[0]}.{cap[1]}")
    return cap


def tma_mma_arch_and_sms(what: str) -> tuple[str, int]:
    """("sm_90" or "sm_100", SM count) of the current GPU, or a clear error naming `what`."""
    capability = require_tma_mma_gpu(what)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return arch_of(capability), props.multi_processor_count


# Dense bf16/fp16 MMA FLOPs per SM per clock, by compute capability (Hopper's WGMMA).
FLOPS_PER_SM_PER_CYCLE = {(9, 0): 4096}
HOPPER_SMS = 132      # H100 SXM and H200


def hopper_peak_tflops(sm_clock_ghz, sms=HOPPER_SMS):
    """A Hopper part's dense bf16 peak at an SM clock: SMs x FLOPs per SM per clock x clock."""
    return sms * FLOPS_PER_SM_PER_CYCLE[(9, 0)] * sm_clock_ghz * 1e9 / 1e12


# datasheet peaks: dense bf16 TFLOPS and HBM TB/s (SXM parts); Hopper's at its 1.83 GHz boost clock
DEVICE_PEAKS = {"H100": (round(hopper_peak_tflops(1.83), 1), 3.35), "H200": (round(hopper_peak_tflops(1.83), 1), 4.8),
                "B200": (2250.0, 8.0)}


def device_peaks(device_name):
    return next((peaks for name, peaks in DEVICE_PEAKS.items() if name in device_name), None)


# The dense bf16 peak the H100 can hold at its 700 W board limit on a compute-bound conv: the SM
# clock falls to ~1440 MHz there (benchmarks/clocks_under_load.py measures it; an H100 SXM, other
# boards differ).
POWER_LIMITED_PEAK_TFLOPS = {"H100": round(hopper_peak_tflops(1.44))}


def dense_peak(device_name):
    return (device_peaks(device_name) or (None,))[0]

