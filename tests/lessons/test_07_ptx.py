"""Lesson 07's wgrad kernel built ahead of time (on any machine) beyond the lesson's PTX table: x read
by a tiled load where a 1x1 conv lets it, the launcher's own tiles within a program's shared memory,
the stem's few channels, and lesson 05's forward kernel reading its operands untransposed."""
import common

import pytest

lesson07 = common.load_lesson("07-conv-wgrad")
from conv_tutorial.kernels.fprop import SHARED_MEMORY_PER_PROGRAM  # noqa: E402
from conv_tutorial.kernels.wgrad import default_wgrad_config  # noqa: E402

ARCHS = list(lesson07.TAUGHT_PTX)


@pytest.mark.parametrize("arch", ARCHS)
def test_1x1_wgrad_loads_x_tiled(arch):
    """A 1x1 stride-1 build has no im2col load: x's load is a tiled one (section 1), the rest alike."""
    loads = [common.PTX_IM2COL_LOAD, common.PTX_TILED_LOAD]
    im2col = common.ptx_instructions(common.aot_compile_or_skip("07-conv-wgrad", "aot_conv2d_wgrad", arch)["ptx"],
                                     loads)
    tiled = common.ptx_instructions(common.aot_compile_or_skip("07-conv-wgrad", "aot_conv2d_wgrad", arch, R=1, S=1,
                                                               padding=0)["ptx"], loads)
    assert im2col[common.PTX_IM2COL_LOAD] > 0 and tiled[common.PTX_IM2COL_LOAD] == 0
    assert tiled[common.PTX_TILED_LOAD] == im2col[common.PTX_TILED_LOAD] + im2col[common.PTX_IM2COL_LOAD]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("Ci, Co, R, ring", [(128, 256, 3, (128, 128, 64, 4)), (256, 512, 1, (64, 128, 128, 4))])
def test_default_wgrad_configs_fit_shared_memory(arch, Ci, Co, R, ring):
    """default_wgrad_config's 128 x 128 x 64 tiles and its 64 x 128 x 128 tiles (x read tiled) build, and
    the build asks for no more shared memory than a program may have."""
    params = dict(N=8, H=14, W=14, Ci=Ci, Co=Co, R=R, S=R, padding=R // 2, default_config=True)
    g = common.conv_geometry((8, 14, 14, Ci), (Co, R, R, Ci), 1, R // 2)
    assert tuple(default_wgrad_config(g, Ci, 132)[:4]) == ring
    built = common.aot_compile_or_skip("07-conv-wgrad", "aot_conv2d_wgrad", arch, **params)
    assert 0 < built["shared"] <= SHARED_MEMORY_PER_PROGRAM


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_kernel_reads_its_operands_untransposed(arch):
    compiled = common.aot_compile_or_skip("05-warp-specialized-conv", "aot_conv2d_fprop", arch)
    assert common.transposed_operands(compiled["ptx"], arch) == (0, 0)


def test_kernel_compiles_for_small_channels_and_strides():
    # Ci = 3 (padded to 8, a 16-channel box), Co = 48 (64-row tiles), a 7x7 stride-2 stem, 4 k-steps (of 128 pixels:
    # a small tile's) in 3 slices
    compiled = common.aot_compile_or_skip("07-conv-wgrad", "aot_conv2d_wgrad", "sm_90", H=32, W=32, Ci=3, Co=48,
                                          R=7, S=7, stride=2, padding=3, split_k=3)
    assert "m64n16k16" in common.first_ptx_instruction(compiled["ptx"], "wgmma.mma_async")
