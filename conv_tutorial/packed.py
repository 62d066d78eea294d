"""Launches with their parameters packed once: a replay's launches (launch.Replay) in one C call each.

A replay's launch differs from the same launch before it only in its addresses. Through Triton's
launcher (launch.DirectLaunch.launch_lean), each one still builds the expanded argument list in
Python, and Triton's C launcher parses ~20 arguments and converts every kernel argument by its
type: ~30 us of host time a launch inside a training step (RESULTS.md, "Inside a training step").
Here each launch's parameters are packed into bytes once, in the order and at the sizes Triton's
launcher passes them (its signature, flattened as its annotations flatten it, then its two scratch
pointers), and a small C object (packed_launch.c) writes only the addresses and tensor maps into a
copy and calls cuLaunchKernelEx. The C object is built at its first use by Triton's own build (the
system compiler Triton's launcher needs, Triton's cuda.h, Triton's cache); where it cannot be
built, replays keep the Python launch path (a warning says why).

`pack(direct, grid, args, device)`: a DirectLaunch's launch as a PackedLaunch, where `args` are the
kernel's run-time arguments as DirectLaunch takes them with a `Slot` wherever an address changes
from call to call (a pointer, or the tensor a descriptor points at). A call: `launch(stream, bases)`,
each Slot's address being `bases[slot.base] + slot.displacement`.
"""
import functools
import os
import struct
import warnings
from typing import NamedTuple

from . import native

_MODULE = "conv_tutorial_packed_launch"
_MAP_BYTES = _MAP_ALIGN = 128
_SCRATCH_POINTERS = 2        # Triton's launcher passes a global and a profile scratch pointer after the arguments


class Slot(NamedTuple):
    """An address a launch takes from its call: bases[base] + displacement."""
    base: int
    displacement: int = 0


# Each parameter type as Triton's launcher converts it (triton/backends/nvidia/driver.c's extractors):
# its struct format (little-endian) or "bf16" (a float32's upper half), and its size.
_FORMATS = {"i1": "<i", "i8": "<b", "i16": "<h", "i32": "<i", "i64": "<q",
            "u1": "<I", "u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q",
            "fp16": "<e", "bf16": "bf16", "fp32": "<f", "f32": "<f", "fp64": "<d"}


# The index of each type's extractor in Triton's launcher (driver.c, ExtractorTypeIndex): its signature
# metadata, one byte per parameter, says which it converts each parameter with.
_EXTRACTORS = {"*": 1, "i8": 2, "i16": 3, "i1": 4, "i32": 4, "i64": 5, "u8": 6, "u16": 7, "u1": 8, "u32": 8,
               "u64": 9, "fp16": 10, "bf16": 11, "fp32": 12, "f32": 12, "fp64": 13, "nvTmaDesc": 14}


def parameter_size(kind):
    """The bytes a parameter of type `kind` takes where Triton's launcher passes it."""
    if kind == "nvTmaDesc":
        return _MAP_BYTES
    if kind.startswith("*"):
        return 8
    fmt = _FORMATS.get(kind)
    if fmt is None:
        raise TypeError(f"no packing for a parameter of type {kind!r}")
    return 2 if fmt == "bf16" else struct.calcsize(fmt)


def parameter_bytes(kind, value):
    """The bytes Triton's launcher passes for `value` as a parameter of type `kind` (a constant: not a
    Slot). Out-of-range integers raise (Triton's launcher would wrap them)."""
    if kind.startswith("*"):
        value = 0 if value is None else value
        if not isinstance(value, int):
            raise TypeError(f"a pointer parameter takes an address (int) or None, not {type(value).__name__}")
        return struct.pack("<Q", value)
    fmt = _FORMATS.get(kind)
    if fmt is None:
        raise TypeError(f"no packing for a parameter of type {kind!r}")
    try:
        if fmt == "bf16":
            return struct.pack("<I", struct.unpack("<I", struct.pack("<f", value))[0] >> 16)[:2]
        return struct.pack(fmt, value)
    except (struct.error, OverflowError) as error:
        raise ValueError(f"{value!r} does not fit a parameter of type {kind!r} ({error})") from None


def flatten(signature, args):
    """(type, value) of each kernel parameter, as Triton's launcher takes them from `args`: tuples
    flattened, constexprs (however specialized) left out. `signature`: the expanded signature
    (triton.backends.driver.expand_signature), one entry per argument."""
    params = []

    def visit(kind, value):
        if isinstance(kind, tuple):
            if not isinstance(value, tuple) or len(value) != len(kind):
                raise ValueError(f"a tuple argument of {len(kind)} entries given {value!r}")
            for k, v in zip(kind, value):
                visit(k, v)
        elif kind != "constexpr":
            params.append((kind, value))

    if len(signature) != len(args):
        raise ValueError(f"{len(args)} arguments for a signature of {len(signature)}")
    for kind, value in zip(signature, args):
        visit(kind, value)
    return params


class Layout(NamedTuple):
    buffer: bytes
    params: tuple       # (offset, size) of each parameter
    addresses: tuple    # (offset, base, displacement) of each Slot at a pointer
    maps: tuple         # (offset, base, displacement, encode) of each Slot at a tensor map


def layout(params, encoders):
    """The packed buffer of `params` ((type, value), flattened; a tensor map's value a Slot) and Triton's
    scratch pointers after them (null: a packed launch allocates no scratch); `encoders`: for each
    tensor map in order, address -> its map."""
    buffer, offsets, addresses, maps = bytearray(), [], [], []
    encoders = iter(encoders)
    for kind, value in list(params) + [("*i8", None)] * _SCRATCH_POINTERS:
        if kind == "nvTmaDesc" and not isinstance(value, Slot):
            raise TypeError("a tensor map's parameter takes a Slot")
        size = parameter_size(kind)
        align = _MAP_ALIGN if kind == "nvTmaDesc" else size
        offset = -len(buffer) % align + len(buffer)
        buffer += bytes(offset - len(buffer))
        if isinstance(value, Slot):
            if kind == "nvTmaDesc":
                maps.append((offset, value.base, value.displacement, next(encoders)))
            elif kind.startswith("*"):
                addresses.append((offset, value.base, value.displacement))
            else:
                raise TypeError(f"a Slot (an address) given for a parameter of type {kind!r}")
            buffer += bytes(size)
        else:
            buffer += parameter_bytes(kind, value)
        offsets.append((offset, size))
    return Layout(bytes(buffer), tuple(offsets), tuple(addresses), tuple(maps))


def pack(direct, grid, args, device):
    """The PackedLaunch of `direct` (a lean launch.DirectLaunch) on `grid` with `args` (its run-time
    arguments, as DirectLaunch takes them, with Slots where addresses change; a descriptor's place
    takes a Slot: the address of the tensor it points at), for the GPU numbered `device`."""
    from triton.backends.driver import expand_signature
    compiled = direct.compiled
    metas = getattr(compiled.metadata, "tensordesc_meta", None)
    signature = expand_signature(compiled.src.signature.values(), metas, "nvTmaDesc")
    expanded, encoders = [], []
    for position in range(direct.descriptors_end):
        if position in direct.descriptor_at:      # [tensor map, *shape, *strides], as Triton expands a descriptor
            _, template = direct.descriptor_at[position]
            if not isinstance(args[position], Slot):
                raise TypeError(f"argument {position} (a descriptor) takes a Slot")
            expanded += [args[position], *template.shape, *template.strides]
            encoders.append(map_encoder(direct, position))
        else:
            expanded.append(args[position])
    expanded += list(args[direct.descriptors_end:]) + list(direct.constexprs)
    params = flatten(signature, expanded)
    expected = bytes(direct.launch_tail[1])      # Triton's launcher's own list: one extractor per parameter
    if bytes(_EXTRACTORS.get(kind[0] if kind[0] == "*" else kind, 0) for kind, _ in params) != expected:
        raise ValueError(f"{compiled.name}: the parameters packed ({[kind for kind, _ in params]}) are not "
                         f"those Triton's launcher passes ({list(expected)})")
    packed = layout(params, encoders)
    function, cooperative, pdl, (num_warps, num_ctas, shared) = direct.launch_head
    grid = tuple(grid) + (1,) * (3 - len(grid))
    return module().PackedLaunch(direct, function, grid, (num_warps, num_ctas, shared), bool(cooperative), bool(pdl),
                                 device, packed.buffer, packed.params, packed.addresses, packed.maps)


def fill_arguments(template, meta):
    """Triton's tensor-map encoding function for descriptor `template` (its tensordesc metadata `meta`) and
    the arguments after the address that triton.backends.nvidia.driver.make_tensordesc_arg passes it."""
    import triton
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST, TMA_TF32
    utils = triton.runtime.driver.active.utils
    shape = list(template.shape)
    if meta["fp4_padded"]:
        shape[-1] *= 2
    elem_type = TMA_TF32 if template.round_f32_to_tf32 else meta["elem_type"]
    arguments = (meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[elem_type], meta["block_size"], shape,
                 template.strides, 1 if template.padding == "nan" else 0)
    if meta.get("is_im2col", False):
        element_strides = template.element_strides
        return utils.fill_tma_descriptor_im2col, arguments + (
            template.pixel_box_lower_corner, template.pixel_box_upper_corner,
            [1] * len(template.shape) if element_strides is None else element_strides)
    return utils.fill_tma_descriptor_tiled, arguments


_TEST_ADDRESS = 1 << 40      # (an encoding reads no memory: any 16-byte-aligned address serves)


def map_encoder(direct, position):
    """address -> the tensor map of `direct`'s descriptor argument `position` (a launch.DirectLaunch)
    pointing at that address, for a packed launch's addresses not seen before: Triton's encoding
    function called straight with the validated template's arguments (`fill_arguments`), not through
    DirectLaunch.tensor_map_at's Python (a copy of the descriptor, make_tensordesc_arg reading its
    fields; ~20 us a new address inside a training step, RESULTS.md). Used where it gives
    tensor_map_at's 128 bytes at a test address; else (another Triton's fields) tensor_map_at."""
    fallback = functools.partial(direct.tensor_map_at, position)
    try:
        fill, arguments = fill_arguments(direct.descriptor_at[position][1], direct.descriptor_at[position][0])
        same = (module().map_bytes(fill(_TEST_ADDRESS, *arguments)) ==
                module().map_bytes(direct.encoded_at(position, _TEST_ADDRESS)))
    except Exception:  # noqa: BLE001  (fields this Triton does not have: its own path serves)
        return fallback
    if not same:
        return fallback

    def encode(address):
        return fill(address, *arguments)
    return encode


@functools.lru_cache(maxsize=None)
def module():
    """The built C module (packed_launch.c), cached by Triton; raises where it cannot be built."""
    import triton
    from triton.runtime.build import compile_module_from_src
    here = os.path.dirname(__file__)
    with open(os.path.join(here, "packed_launch.c")) as f:
        source = f.read()
    include = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
    return compile_module_from_src(source, _MODULE, include_dirs=[include])


_ENABLED = [os.environ.get("CONV_TUTORIAL_PACKED_LAUNCH", "1") != "0"]


def set_enabled(enabled: bool) -> bool:
    """Turn packed launches on or off for replays built after this (benchmarks/host_time.py compares
    the two; also CONV_TUTORIAL_PACKED_LAUNCH=0); returns the previous setting."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    previous, _ENABLED[0] = _ENABLED[0], enabled
    native.invalidate()     # (programs handed to the native kernels keep the launches they were built with)
    return previous


def available() -> bool:
    """Whether replays pack their launches: turned on, the C module built and the CUDA driver found (the
    first call builds it; a failure warns once, and replays keep the Python launch path)."""
    if not _ENABLED[0]:
        return False
    return _built()


@functools.lru_cache(maxsize=None)
def _built():
    try:
        module().load_driver()
        return True
    except Exception as error:  # (no compiler, no Python headers, no driver: the Python path still serves)
        warnings.warn(f"conv_tutorial: packed launches could not be built ({type(error).__name__}: {error}); "
                      f"repeat calls take the Python launch path", RuntimeWarning, stacklevel=3)
        return False
