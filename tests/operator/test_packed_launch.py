"""Packed launches (conv_tutorial/packed.py, packed_launch.c): a replay's launch with its parameters
packed once. On a CPU: the C object built by Triton's build, the bytes it would pass for each
parameter type against Triton's launcher's conversions (read from Triton's own driver.c), the addresses
and tensor maps written per call, and the errors. On a GPU (tests/operator/test_replay.py): every
path's replays packed, with the bits of the Python launch path."""
import os
import re
import struct

import pytest
import triton

from conv_tutorial import packed
from conv_tutorial.packed import Slot


def _launch(params, encoders=(), grid=(1, 1, 1)):
    layout = packed.layout(params, encoders)
    return packed.module().PackedLaunch(None, 0, grid, (4, 1, 0), False, False, 0, layout.buffer, layout.params,
                                        layout.addresses, layout.maps)


def test_each_type_packs_as_tritons_launcher_converts_it():
    params = [("i1", True), ("i8", -2), ("i16", 300), ("i32", -7), ("i64", 2**40 + 5), ("u8", 255), ("u16", 65535),
              ("u32", 2**32 - 1), ("u64", 2**63), ("fp16", 0.5), ("bf16", 1.5), ("fp32", 0.25), ("fp64", -2.0),
              ("*bf16", 0x7f0000001000), ("*fp32", None)]
    got = _launch(params).parameters([])
    want = [b"\x01\0\0\0", b"\xfe", b"\x2c\x01", b"\xf9\xff\xff\xff", (2**40 + 5).to_bytes(8, "little"), b"\xff",
            b"\xff\xff", b"\xff" * 4, (2**63).to_bytes(8, "little"),
            b"\x00\x38",            # fp16 0.5: 0x3800
            b"\xc0\x3f",            # bf16 1.5: float32 0x3fc00000, its upper half
            b"\x00\x00\x80\x3e", struct.pack("<d", -2.0), (0x7f0000001000).to_bytes(8, "little"), bytes(8),
            bytes(8), bytes(8)]     # Triton's two scratch pointers, null
    assert list(got) == want


def test_parameters_sit_at_their_alignment():
    layout = packed.layout([("i8", 1), ("*fp32", 0), ("i16", 2), ("nvTmaDesc", Slot(0)), ("i32", 3)],
                           [lambda address: bytes(128)])
    for (offset, size) in layout.params:
        assert offset % (128 if size == 128 else size) == 0
    assert [size for _, size in layout.params] == [1, 8, 2, 128, 4, 8, 8]


def test_addresses_and_tensor_maps_come_from_the_bases():
    encoded = []

    def encode(address):
        encoded.append(address)
        return address.to_bytes(8, "little") * 16

    launch = _launch([("*bf16", Slot(1, 64)), ("i32", 9), ("nvTmaDesc", Slot(0, 16)), ("*fp32", Slot(0))], [encode])
    bases = [0x10000, 0x20000]
    p = launch.parameters(bases)
    assert p[0] == (0x20000 + 64).to_bytes(8, "little") and p[1] == b"\x09\0\0\0"
    assert p[2] == (0x10010).to_bytes(8, "little") * 16 and p[3] == (0x10000).to_bytes(8, "little")
    launch.parameters(bases)
    assert encoded == [0x10010]             # a map kept per address: the second call encodes nothing
    launch.parameters([0x30000, 0x20000])
    assert encoded == [0x10010, 0x30010]


def test_a_tensor_map_is_encoded_again_once_sixteen_newer_ones_replaced_it():
    encoded = []
    launch = _launch([("nvTmaDesc", Slot(0))], [lambda a: encoded.append(a) or bytes(128)])
    for i in range(17):
        launch.parameters([0x1000 * (i + 1)])
    launch.parameters([0x1000 * 17])        # still kept
    assert len(encoded) == 17
    launch.parameters([0x1000])             # the first, replaced by the seventeenth
    assert len(encoded) == 18


def test_flatten_follows_tuples_and_leaves_constexprs_out():
    signature = ["*bf16", ("i32", "constexpr", ("i64", "fp32")), "constexpr", "i1"]
    args = [Slot(0), (5, 1, (6, 0.5)), 128, False]
    assert packed.flatten(signature, args) == [("*bf16", Slot(0)), ("i32", 5), ("i64", 6), ("fp32", 0.5),
                                               ("i1", False)]
    with pytest.raises(ValueError, match="tuple argument of 3 entries"):
        packed.flatten(signature, [Slot(0), (5, 1), 128, False])
    with pytest.raises(ValueError, match="3 arguments for a signature of 4"):
        packed.flatten(signature, args[:3])


def test_the_extractor_table_is_tritons():
    # Triton's launcher says which conversion each parameter takes by an index into its extractor table
    # (driver.c); the packing's table must agree, index and size, type by type.
    source = open(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "driver.c")).read()
    enum = dict(re.findall(r"EXTRACTOR_(\w+)_INDEX = (\d+)", source))
    entries = re.findall(r"\[EXTRACTOR_(\w+)_INDEX\] =\s*\(Extractor\)\{[^}]*?\.size = sizeof\((\w+)\)[^}]*?"
                         r"\.name = (?:NULL|\{([^}]*)\})", source, re.S)
    c_sizes = {"int8_t": 1, "int16_t": 2, "int32_t": 4, "int64_t": 8, "uint8_t": 1, "uint16_t": 2, "uint32_t": 4,
               "uint64_t": 8, "CUdeviceptr": 8, "CUtensorMap": 128}
    seen = set()
    for name, c_type, names in entries:
        for kind in re.findall(r'"(\w+)"', names or ""):
            assert packed._EXTRACTORS[kind] == int(enum[name]), kind
            assert packed.parameter_size(kind) == c_sizes[c_type], kind
            seen.add(kind)
    assert int(enum["POINTER"]) == packed._EXTRACTORS["*"]
    assert seen == set(packed._EXTRACTORS) - {"*"}


def test_packing_refuses_what_it_cannot_pass():
    with pytest.raises(TypeError, match="a Slot .an address. given for a parameter of type 'i32'"):
        packed.layout([("i32", Slot(0))], [])
    with pytest.raises(TypeError, match="no packing for a parameter of type 'f8e4'"):
        packed.layout([("f8e4", 1)], [])
    with pytest.raises(TypeError, match="a tensor map's parameter takes a Slot"):
        packed.layout([("nvTmaDesc", 0)], [])
    with pytest.raises(ValueError, match="2147483648 does not fit a parameter of type 'i32'"):
        packed.layout([("i32", 2**31)], [])          # (Triton's launcher would wrap it)
    launch = _launch([("*i8", Slot(3))])
    with pytest.raises(IndexError, match="base 3 of 1"):
        launch.parameters([0])
    bad = _launch([("nvTmaDesc", Slot(0))], [lambda a: bytes(64)])
    with pytest.raises(ValueError, match="a tensor map of 64 bytes, not 128"):
        bad.parameters([0x1000])
    with pytest.raises(TypeError, match=re.escape("launch(stream: int, bases: list[int])")):
        launch.launch(0, (0,))


def test_a_grid_outside_the_drivers_limits_is_refused_and_an_empty_one_launches_nothing():
    with pytest.raises(ValueError, match="outside the driver's limits"):
        _launch([("i32", 1)], grid=(1, 65536, 1))
    with pytest.raises(ValueError, match="outside the driver's limits"):
        _launch([("i32", 1)], grid=(-1, 1, 1))
    assert _launch([("i32", 1)], grid=(0, 1, 1)).launch(0, []) is None     # (as Triton's launcher: no launch)


def test_a_packed_launch_is_initialised_once():
    launch = _launch([("i32", 1)])
    layout = packed.layout([("i32", 1)], [])
    with pytest.raises(TypeError, match="initialised once"):
        launch.__init__(None, 0, (1, 1, 1), (4, 1, 0), False, False, 0, layout.buffer, layout.params, (), ())


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="checks the error on a machine without a CUDA driver")
def test_a_launch_without_a_driver_says_so():
    with pytest.raises(RuntimeError, match="libcuda.so.1 could not be opened"):
        _launch([("*i8", Slot(0))]).launch(0, [0x1000])


def test_set_enabled_takes_a_bool_and_turns_replays_packing_off():
    with pytest.raises(TypeError, match="enabled must be a bool, got 1"):
        packed.set_enabled(1)
    before = packed.set_enabled(False)
    try:
        assert packed.available() is False
    finally:
        packed.set_enabled(before)


class _RecordingUtils:
    # Triton's driver utilities as make_tensordesc_arg calls them: each fill records its arguments
    def __init__(self):
        self.calls = []

    def fill_tma_descriptor_tiled(self, *args):
        self.calls.append(("tiled", args))
        return ("map", len(self.calls))

    def fill_tma_descriptor_im2col(self, *args):
        self.calls.append(("im2col", args))
        return ("map", len(self.calls))


@pytest.mark.parametrize("kind", ["tiled", "im2col"])
@pytest.mark.parametrize("nan_padding", [False, True])
def test_a_new_address_is_encoded_with_the_arguments_make_tensordesc_arg_passes(monkeypatch, kind, nan_padding):
    """packed.map_encoder calls Triton's encoding function straight (packed.fill_arguments): for a tiled and an
    im2col descriptor, the same function with the same arguments as Triton's make_tensordesc_arg gives it
    for the descriptor at that address (a driver that records the calls stands in for the GPU's)."""
    import torch
    from types import SimpleNamespace
    from triton.backends.nvidia.driver import make_tensordesc_arg
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor, TensorDescriptorIm2Col

    utils = _RecordingUtils()
    monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace(utils=utils), raising=False)
    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: self._active))
    padding = "nan" if nan_padding else "zero"
    if kind == "tiled":
        t = torch.empty(200, 96, dtype=torch.bfloat16)
        layout = gl.NVMMASharedLayout.get_default_for([64, 32], gl.bfloat16)
        desc = TensorDescriptor.from_tensor(t, [64, 32], layout, padding=padding)
        meta = {"swizzle": 2, "elem_size": 2, "elem_type": 10, "block_size": [64, 32], "fp4_padded": False}
    else:
        t = torch.empty(2, 9, 11, 64, dtype=torch.bfloat16)
        layout = gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16)
        desc = TensorDescriptorIm2Col.from_tensor(t, [128, 64], layout, padding=padding, element_strides=[1, 2, 2, 1],
                                                  pixel_box_lower_corner=[-1, -1], pixel_box_upper_corner=[-1, -1])
        meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [128, 64], "fp4_padded": False,
                "is_im2col": True}
    make_tensordesc_arg(desc, meta, None)
    fill, arguments = packed.fill_arguments(desc, meta)
    fill(t.data_ptr(), *arguments)
    (want_kind, want), (got_kind, got) = utils.calls
    assert got_kind == want_kind == kind and fill.__name__ == f"fill_tma_descriptor_{kind}"
    assert [list(a) if isinstance(a, (list, tuple)) else a for a in got] == \
           [list(a) if isinstance(a, (list, tuple)) else a for a in want]


def test_map_bytes_reads_a_128_byte_map_and_refuses_another_size():
    assert packed.module().map_bytes(bytes(range(128))) == bytes(range(128))
    with pytest.raises(ValueError, match="not 128"):
        packed.module().map_bytes(bytes(64))
