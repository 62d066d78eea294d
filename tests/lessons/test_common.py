"""Tests of the shared helpers in common.py (geometry, validation, reference, loaders, PTX tools)."""
import itertools

import pytest
import torch

import common


@pytest.mark.parametrize("H, R, stride, padding, dilation", [
    (7, 3, 1, 0, 1), (7, 3, 2, 1, 1), (10, 5, 3, 2, 1), (9, 3, 1, 2, 2), (4, 1, 1, 0, 1), (5, 7, 1, 3, 1)])
def test_conv_output_size_matches_torch(H, R, stride, padding, dilation):
    x = torch.zeros(1, 1, H, H)
    w = torch.zeros(1, 1, R, R)
    expected = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding, dilation=dilation).shape[-1]
    assert common.conv_output_size(H, R, stride, padding, dilation) == expected


def test_conv_geometry_gemm_view():
    g = common.conv_geometry((2, 10, 12, 3), (8, 3, 5, 3), stride=(1, 2), padding=(1, 2), dilation=1)
    assert (g.out_h, g.out_w) == (10, 6)
    assert (g.M, g.N_GEMM, g.K) == (2 * 10 * 6, 8, 3 * 5 * 3)
    assert g.flops == 2 * g.M * g.N_GEMM * g.K
    assert "stride 1x2" in g.describe()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"stride": 0}, ValueError, "stride must be positive"),
    ({"stride": (1, 0)}, ValueError, "stride"),
    ({"padding": (-1, 0)}, ValueError, "padding must be non-negative"),
    ({"dilation": 0}, ValueError, "dilation"),
    ({"stride": 1.0}, TypeError, "stride must be an int"),
    ({"stride": (1, 2, 3)}, TypeError, "pair"),
    ({"stride": True}, TypeError, "stride"),
])
def test_conv_geometry_rejects_bad_hyperparameters(kwargs, error, message):
    with pytest.raises(error, match=message):
        common.conv_geometry((1, 8, 8, 4), (4, 3, 3, 4), **kwargs)


@pytest.mark.parametrize("x_shape, w_shape, message", [
    ((1, 8, 8), (4, 3, 3, 4), "rank 4"),
    ((1, 8, 8, 4), (4, 3, 3), "rank 4"),
    ((1, 8, 8, 4), (4, 3, 3, 5), "channel mismatch"),
    ((1, 2, 2, 4), (4, 3, 3, 4), "empty output"),
    ((0, 8, 8, 4), (4, 3, 3, 4), "N must be positive"),
])
def test_conv_geometry_rejects_bad_shapes(x_shape, w_shape, message):
    with pytest.raises(ValueError, match=message):
        common.conv_geometry(x_shape, w_shape)


def test_check_conv_inputs():
    x = torch.randn(1, 6, 6, 8, dtype=torch.float16)
    w = torch.randn(4, 3, 3, 8, dtype=torch.float16)
    dtypes = (torch.float16, torch.bfloat16)
    assert common.check_conv_inputs(x, w, dtypes=dtypes).out_h == 4
    with pytest.raises(TypeError, match="allowed: float16, bfloat16"):
        common.check_conv_inputs(x.float(), w.float(), dtypes=dtypes)
    with pytest.raises(ValueError, match="contiguous NHWC"):
        common.check_conv_inputs(x.transpose(1, 2), w, dtypes=dtypes)
    with pytest.raises(ValueError, match=r"bias must have shape \[Co\]"):
        common.check_conv_inputs(x, w, bias=torch.zeros(5), dtypes=dtypes)
    with pytest.raises(ValueError, match="CUDA GPU"):
        common.check_conv_inputs(x, w, dtypes=dtypes, need_cuda=True)


def test_reference_conv_matches_the_definition():
    # The formula of lesson 01, summed with Python loops: the reference must agree with it.
    torch.manual_seed(0)
    x = torch.randn(2, 5, 6, 3, dtype=torch.float64)
    w = torch.randn(4, 3, 2, 3, dtype=torch.float64)
    bias = torch.randn(4, dtype=torch.float64)
    stride, padding, dilation = (2, 1), (1, 2), (1, 2)
    g = common.conv_geometry(x.shape, w.shape, stride, padding, dilation)
    expected = torch.zeros(2, g.out_h, g.out_w, 4, dtype=torch.float64)
    for n, oy, ox, co in itertools.product(range(2), range(g.out_h), range(g.out_w), range(4)):
        total = bias[co].item()
        for r, s in itertools.product(range(3), range(2)):
            iy, ix = oy * 2 - 1 + r * 1, ox * 1 - 2 + s * 2
            if 0 <= iy < 5 and 0 <= ix < 6:
                total += float((x[n, iy, ix] * w[co, r, s]).sum())
        expected[n, oy, ox, co] = total
    got = common.reference_conv2d_nhwc(x, w, bias, stride, padding, dilation, out_dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_pair():
    assert common.pair(3, "stride", 1) == (3, 3)
    assert common.pair([1, 2], "stride", 1) == (1, 2)


def test_load_lesson_is_cached_and_side_effect_free():
    first = common.load_lesson("01-conv-basics")
    assert common.load_lesson("01-conv-basics") is first
    assert hasattr(first, "conv2d_nchw_direct")
    with pytest.raises(FileNotFoundError):
        common.load_lesson("99-no-such-lesson")


def test_ptx_instruction_counter():
    ptx = "\n".join(["  wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 ...;",
                     "  @%p1 cp.async.bulk.tensor.4d.shared::cta.global.im2col.mbarrier ...;",
                     "  // wgmma.mma_async in a comment does not count",
                     "  mov.u32 %r1, 0;"])
    counts = common.ptx_instructions(ptx, ["wgmma.mma_async", "cp.async.bulk.tensor", "tcgen05.mma"])
    assert counts == {"wgmma.mma_async": 1, "cp.async.bulk.tensor": 1, "tcgen05.mma": 0}


def test_environment_detection_is_consistent():
    assert common.interpreter_mode() == (not common.HAS_CUDA)
    assert common.device() == ("cuda" if common.HAS_CUDA else "cpu")
    if not common.HAS_CUDA:
        assert not common.is_hopper() and not common.is_blackwell()
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            common.require_tma_mma_gpu("this test")


def test_a_pytorch_layout_weight_gets_the_permute_that_fixes_it():
    # [Co, Ci, R, S] = [8, 16, 3, 3] where [Co, R, S, Ci] is expected: the error names the permute
    with pytest.raises(ValueError, match=r"permute\(0, 2, 3, 1\).*\[8, 3, 3, 16\]"):
        common.conv_geometry((2, 10, 10, 16), (8, 16, 3, 3))
    # shapes that cannot be [Co, Ci, R, S] of this input get the plain mismatch error, no hint
    with pytest.raises(ValueError, match="channel mismatch") as error:
        common.conv_geometry((2, 10, 10, 16), (8, 3, 3, 4))
    assert "permute" not in str(error.value)




def test_canonical_strides_gives_size_one_dimensions_a_contiguous_tensors_strides():
    # an NCHW [N, C, 1, 1] tensor (a squeeze-excitation conv's input) seen as NHWC: contiguous for
    # PyTorch, strides (C, 1, 1, 1); TMA would refuse the 2-byte strides of H and W
    x = torch.randn(4, 72, 1, 1).permute(0, 2, 3, 1)
    assert x.is_contiguous() and x.stride() == (72, 1, 1, 1)
    view = common.canonical_strides(x)
    assert view.stride() == (72, 72, 72, 1) and view.data_ptr() == x.data_ptr() and torch.equal(view, x)
    same = torch.randn(2, 3, 4, 8)
    assert common.canonical_strides(same) is same                              # already canonical: itself
    strided = same[:, :, ::2]
    assert common.canonical_strides(strided) is strided                        # not contiguous: left to the caller's check


def test_launches_build_descriptors_for_a_1x1_input_with_odd_strides():
    # the regression: lesson 05's and the backward's descriptors on such a tensor raised Triton's
    # "strides must be 16-byte aligned" (a RegNetY training step hit it in squeeze-excitation convs); the
    # wgrad descriptors are the package's (conv_tutorial.kernels.wgrad), which lesson 07 teaches
    from conv_tutorial.kernels.wgrad import prepare_wgrad
    lesson05 = common.load_lesson("05-warp-specialized-conv")
    x = torch.randn(4, 72, 1, 1).bfloat16().permute(0, 2, 3, 1)
    w = torch.randn(24, 1, 1, 72).bfloat16()
    g = common.conv_geometry(x.shape, w.shape, 1, 0, 1)
    lesson05.prepare_launch(x, w, None, g, lesson05.FIXED_CONFIG, "sm_90", 132)
    dy = torch.randn(4, 24, 1, 1).bfloat16().permute(0, 2, 3, 1)
    prepare_wgrad(x, dy, g, None, "sm_90", 132)


def test_reference_conv_of_one_channel_matches_a_fresh_copy():
    # torch 2.14's CPU conv2d returned garbage (up to 1e36) for this NHWC input of one channel seen
    # as NCHW, strides (54, 1, 6, 1); the reference hands it canonical strides (common.canonical_strides)
    torch.manual_seed(0)
    x, w = torch.randn(1, 9, 6, 1), torch.randn(3, 7, 8, 1)

    def fresh(t):        # the same values in new, NCHW-contiguous float64 memory
        return torch.tensor(t.permute(0, 3, 1, 2).tolist(), dtype=torch.float64)
    expected = torch.nn.functional.conv2d(fresh(x), fresh(w), None, (1, 3), 2).permute(0, 2, 3, 1)
    got = common.reference_conv2d_nhwc(x, w, None, (1, 3), 2, out_dtype=torch.float32)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
