"""Does the TMA descriptors' L2 promotion matter? Suite layers timed with 128-byte (Triton's),
256-byte and no promotion, next to cuDNN, in alternating rounds of one run.

    python scripts/l2_promotion_probe.py ["RN50 7x7 2048->512 1x1" ...]

A TMA tensor map carries an L2 promotion: on a miss, L2 fetches that many bytes from memory
around the requested ones. Triton 3.8 encodes every map with 128 bytes (its driver.c passes
CU_TENSOR_MAP_L2_PROMOTION_L2_128B; there is no option). Lesson 05's kernel reads a pixel's 64
channels (128 bytes) per k-step, the next 64 at the next k-step: with 256-byte promotion one miss
brings both, a prefetch that should help the layers that read their input from HBM (ResNet-50's
1x1 layers with a cold L2).

How the probe changes the promotion without changing Triton: every time the runtime has Triton
encode a tensor map, the probe encodes the same map itself through the CUDA driver
(cuTensorMapEncodeIm2col / cuTensorMapEncodeTiled, called with ctypes and the parameters Triton
passes), once with Triton's 128 bytes and once with the promotion under test. The first must be
byte-for-byte Triton's map (the probe stops if not: then its parameters are wrong); it also
locates the map inside Triton's object, where the second is copied. Each promotion gets its own
copy of the input and weights, so their maps (cached by address) stay apart. Every variant is
checked against torch before it is timed.

RESULTS.md ("The network suite", tried and not adopted) has what it measured.
"""
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import conv_runtime  # noqa: E402
import network_suite  # noqa: E402

import torch  # noqa: E402

PROMOTIONS = {"128B (Triton)": 2, "256B": 3, "none": 0}   # CUtensorMapL2promotion values
DEFAULT_LAYERS = ["RN50 7x7 2048->512 1x1", "RN50 14x14 1024->512 1x1", "RN50 14x14 1024->256 1x1",
                  "RN50 7x7 512->2048 1x1", "RN50 28x28 256->256 3x3 s2", "SD 64x64 640->640 3x3"]
ROUNDS = 5


class PromotionPatch:
    """Wraps Triton's make_tensordesc_arg: maps of registered base addresses get their promotion."""

    def __init__(self):
        import triton.backends.nvidia.driver as driver
        self.driver, self.original = driver, driver.make_tensordesc_arg
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.promotion_of = {}      # data_ptr -> CUtensorMapL2promotion
        self.maps_checked = 0
        driver.make_tensordesc_arg = self.make_tensordesc_arg

    def encode(self, desc, meta, promotion):
        """The 128-byte map Triton's fill_tma_descriptor_* would make, with `promotion`: the same
        arguments, innermost dimension first, strides in bytes."""
        shape, strides, rank = list(desc.shape), list(desc.strides), len(desc.shape)
        elem_size = meta["elem_size"]
        u64, u32, i32 = ctypes.c_uint64 * 5, ctypes.c_uint32 * 5, ctypes.c_int * 5
        dims, byte_strides = u64(*reversed(shape), *[0] * (5 - rank)), u64()
        for i in range(rank - 1):
            byte_strides[rank - i - 2] = elem_size * strides[i]
        common_head = (ctypes.c_int(self.driver.TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]),
                       ctypes.c_uint32(rank), ctypes.c_void_p(desc.base.data_ptr()), dims, byte_strides)
        common_tail = (ctypes.c_int(0), ctypes.c_int(meta["swizzle"]), ctypes.c_int(promotion),
                       ctypes.c_int(1 if desc.padding == "nan" else 0))
        encoded = (ctypes.c_uint8 * 128)()
        if meta.get("is_im2col", False):
            lower, upper = desc.pixel_box_lower_corner, desc.pixel_box_upper_corner
            element_strides = desc.element_strides or [1] * rank
            pixels, channels = meta["block_size"]
            result = self.cuda.cuTensorMapEncodeIm2col(
                encoded, *common_head, i32(*reversed(lower)), i32(*reversed(upper)),
                ctypes.c_uint32(channels), ctypes.c_uint32(pixels), u32(*reversed(element_strides)), *common_tail)
        else:
            result = self.cuda.cuTensorMapEncodeTiled(
                encoded, *common_head, u32(*reversed(meta["block_size"])), u32(1, 1, 1, 1, 1), *common_tail)
        if result != 0:
            raise RuntimeError(f"cuTensorMapEncode failed with CUresult {result}")
        return bytes(encoded)

    def make_tensordesc_arg(self, desc, meta, *rest):
        expanded = self.original(desc, meta, *rest)
        if meta is None:
            return expanded
        tensor_map = expanded[0]
        memory = ctypes.string_at(id(tensor_map), type(tensor_map).__basicsize__)
        offset = memory.find(self.encode(desc, meta, 2))
        if offset < 0:
            raise SystemExit("the probe's own encoding differs from Triton's map: its parameters are wrong")
        self.maps_checked += 1
        promotion = self.promotion_of.get(desc.base.data_ptr(), 2)
        if promotion != 2:
            ctypes.memmove(id(tensor_map) + offset, self.encode(desc, meta, promotion), 128)
        return expanded


def main():
    common.require_tma_mma_gpu("scripts/l2_promotion_probe.py")
    labels = sys.argv[1:] or DEFAULT_LAYERS
    suite = {layer[0]: layer for layer in network_suite.NETWORK_SUITE}
    unknown = [label for label in labels if label not in suite]
    if unknown:
        raise SystemExit(f"unknown layers {unknown}; known: {sorted(suite)}")
    patch = PromotionPatch()
    print(f"{torch.cuda.get_device_name()}, {common.versions()}")
    print(f"TFLOPS (median of {ROUNDS} alternating rounds; do_bench, L2 flushed) and ratio to cuDNN")
    for label in labels:
        _, N, H, W, Ci, Co, R, S, stride, padding = suite[label]
        x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16)
        geometry = common.conv_geometry(x.shape, w.shape, stride, padding)
        config = conv_runtime.known_or_heuristic_config(geometry, x.dtype)
        expected = common.reference_conv2d_nhwc(x, w, None, stride, padding)
        calls = {"cuDNN": common.cudnn_conv2d(x, w, None, stride, padding)}
        for name, promotion in PROMOTIONS.items():
            x_copy, w_copy = x.clone(), w.clone()     # own addresses, so own tensor maps
            patch.promotion_of[x_copy.data_ptr()] = patch.promotion_of[w_copy.data_ptr()] = promotion
            call = (lambda a, b: lambda: conv_runtime.conv2d(a, b, None, stride, padding, config=config))(x_copy, w_copy)
            common.assert_close_to_reference(call(), expected, dtype=torch.bfloat16, K=geometry.K)
            calls[name] = call
        timed = common.bench_in_rounds(calls, geometry.flops, ROUNDS)
        print(f"\n{label} ({config}):")
        for name, result in timed.items():
            print(f"   {name:<14} {result['tflops']:6.1f} TFLOPS  {result['tflops'] / timed['cuDNN']['tflops']:5.3f}x "
                  f"cuDNN   rounds " + " ".join(f"{v:.0f}" for v in result["rounds"]))
    print(f"\n{patch.maps_checked} tensor maps re-encoded identical to Triton's")


if __name__ == "__main__":
    main()
