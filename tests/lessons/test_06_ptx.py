"""Lesson 06's builds beyond the lesson's PTX table (section 6), ahead of time on a CPU: the window store
with 8 (mod 16) channels, its read-back from shared memory, and w read in place (an N-major B) at the
kinds of config the operator's runtime may pick for a phase's conv (ping-pong, tails, split-K)."""
import common

import pytest

STEM = "06-conv-dgrad"


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("Ci", [24, 40])
def test_window_store_keeps_16_byte_vectors_with_8_mod_16_channels(arch, Ci):
    # WindowStore.offsets tells the compiler Co and the strides are multiples of 8 elements: 16-byte stores where
    # Triton alone would assume only multiples of 16 of an integer argument (dX's 24 or 40 channels)
    built = common.aot_compile_or_skip(STEM, "aot_dgrad_phase", arch, Ci=Ci)
    per_thread = 128 * 64 * 2 // (128 * 16)        # a 128 x 64 bf16 tile over the epilogue's 128 threads
    assert common.ptx_instructions(built["ptx"], ["st.global", "st.global.v4"]) == {
        "st.global": per_thread, "st.global.v4": per_thread}


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_window_store_reads_the_staged_tile_back_in_16_byte_vectors(arch):
    # the tile goes through the TMA store's staging buffer (ld.shared.v4), then st.global.v4, predicated (masked);
    # lesson 05's dense build stores it with one TMA store and no st.global
    windowed = common.aot_compile_or_skip(STEM, "aot_dgrad_phase", arch)["ptx"]
    dense = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch)["ptx"]
    assert "ld.shared.v4.b32" in windowed
    assert "st.global.v4.b32 " in common.first_ptx_instruction(windowed, "st.global")
    assert "bar.sync \t0, 128;" in windowed
    assert common.ptx_instructions(dense, [common.PTX_TMA_STORE, "st.global"]) == {common.PTX_TMA_STORE: 1,
                                                                                  "st.global": 0}


@pytest.mark.parametrize("arch, config", [
    ("sm_90", (128, 128, 64, 4, 4, 1, 1, 64)),      # a column tail (lesson 05's section 6): its box 128 columns on
    ("sm_100", (128, 128, 64, 4, 4, 1, 1, 64)),
    ("sm_90", (128, 128, 64, 4, 4, 1, 2, 32, 1, 0)),   # ping-pong, a column tail
    ("sm_90", (128, 64, 64, 4, 4, 2, 1, 0, 1, 0)),     # two programs per SM
    ("sm_90", (128, 128, 64, 4, 4, 1, 1, 0, 1, 64)),   # a row tail
    ("sm_90", (128, 128, 64, 6, 8, 1, 1, 0, 2, 0)),    # split-K
    ("sm_100", (128, 128, 64, 4, 4, 1, 1, 32, 2, 0)),  # a column tail and split-K
])
def test_w_in_place_is_an_n_major_b_at_every_kind_of_config(arch, config):
    # a stride-1 dgrad, 64 -> 192 channels, w read in place: the MMAs read B as it lies, A as lesson 05 does
    built = common.aot_compile_or_skip(STEM, "aot_dgrad_phase", arch, Ci=192, Co=64, stride=1, phase=[0, 0],
                                       config=list(config))
    assert common.transposed_operands(built["ptx"], arch) == (0, 1) and built["stack"] == 0
