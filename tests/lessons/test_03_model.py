"""Lesson 03's reference model of a TMA im2col load: its refusals, and the hardware against it.

- Settings the descriptor rejects (checked by common.validate_im2col_settings before any kernel
  runs) and start coordinates the model does not cover (outside the window, off its stride
  lattice: limits of the model, not refusals of the hardware) raise ValueErrors naming the setting.
- The conv mapping (tile starts, tap offsets, channel blocks) rebuilds lesson 02's im2col matrix
  on a grid of shapes.
- On a Hopper or Blackwell GPU, hundreds of random settings (shapes, corners, element strides,
  start coordinates, offsets, channel offsets, fp32, fp16 and bf16, zero and NaN fill) run through
  the TMA unit and the model; every element must match exactly."""
import random

import pytest
import torch

import common

LESSON = "03-tma-im2col-modes"


def lesson():
    return common.load_lesson(LESSON)


@pytest.mark.parametrize("change, message", [
    (dict(x_shape=(4, 4, 32)), "rank 4"),
    (dict(block_pixels=2048), "block_pixels must be a power of two <= 1024"),
    (dict(block_pixels=24), "block_pixels"),
    (dict(block_channels=512), "block_channels"),
    (dict(x_shape=(1, 4, 4, 3)), "misaligned channel stride"),
    (dict(lower=[-200, 0]), r"\[-128, 127\]"),
    (dict(element_strides=[1, 9, 1, 1]), "element_strides"),
    (dict(element_strides=[1, 1, 1, 2]), "element_strides"),
    (dict(coord=[0, 1, 0, 0], element_strides=[1, 2, 1, 1]), "stride lattice"),
    (dict(coord=[0, 7, 0, 0]), "outside the access window"),
])
def test_reference_model_rejects_bad_settings(change, message):
    settings = dict(x_shape=(1, 4, 4, 32), block_pixels=16, block_channels=32, lower=[0, 0],
                    upper=[0, 0], element_strides=[1, 1, 1, 1], coord=[0, 0, 0, 0])
    settings.update(change)
    x_nhwc = torch.zeros(settings["x_shape"])
    with pytest.raises(ValueError, match=message):
        lesson().im2col_reference(x_nhwc, settings["block_pixels"], settings["block_channels"],
                                  settings["lower"], settings["upper"], settings["element_strides"],
                                  settings["coord"], [0, 0])


def test_reference_model_rejects_bad_padding_and_types():
    x_nhwc = torch.zeros(1, 4, 4, 32)
    with pytest.raises(ValueError, match="padding must be 'zero' or 'nan'"):
        lesson().im2col_reference(x_nhwc, 16, 32, [0, 0], [0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0],
                                  padding="one")
    with pytest.raises(TypeError, match="x_nhwc must be a torch.Tensor"):
        lesson().im2col_reference(x_nhwc.tolist(), 16, 32, [0, 0], [0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0])


def test_negative_offsets_read_only_padding():
    # Measured on an H100 (the lesson's prose): offsets are unsigned, -1 reads 65535 pixels away.
    x_nhwc = lesson().pixel_index_tensor(1)
    tile, sources = lesson().im2col_reference(x_nhwc, 16, 32, [-1, -1], [-1, -1], [1, 1, 1, 1],
                                              [0, 0, 0, 0], [1, -1])
    assert sources == [lesson().PADDING] * 16 and not tile.any()


def test_channels_past_C_get_the_padding_value():
    # Channels 16..47 of a 32-channel tensor: the second half is past C, filled like padding.
    x_nhwc = lesson().pixel_index_tensor(1)
    for padding, is_fill in (("zero", lambda t: t.eq(0).all()), ("nan", lambda t: t.isnan().all())):
        tile, _ = lesson().im2col_reference(x_nhwc, 16, 32, [0, 0], [0, 0], [1, 1, 1, 1],
                                            [0, 0, 0, 16], [0, 0], padding=padding)
        assert torch.equal(tile[:, :16], x_nhwc.reshape(16, 32)[:, 16:]) and is_fill(tile[:, 16:])


def test_conv_settings_reject_out_of_range_padding():
    geometry = common.conv_geometry((1, 300, 300, 8), (8, 3, 3, 8), 1, 130)
    with pytest.raises(ValueError, match="pixel-box corners"):
        common.conv_im2col_settings(geometry)


def random_im2col_case(rng):
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    element_size = torch.empty(0, dtype=dtype).element_size()
    lanes = 16 // element_size                     # channels per 16 bytes
    N, H, W = rng.randint(1, 3), rng.randint(1, 9), rng.randint(1, 9)
    C = lanes * rng.randint(1, 6)
    block_channels = lanes * rng.choice([1, 2, 4])
    block_pixels = rng.choice([16, 32, 64, 128])
    element_strides = [1, rng.randint(1, 3), rng.randint(1, 3), 1]
    while True:
        lower = [rng.randint(-3, 0), rng.randint(-3, 0)]
        upper = [rng.randint(-2, 2), rng.randint(-2, 2)]
        if H - 1 + upper[0] >= lower[0] and W - 1 + upper[1] >= lower[1]:
            break
    lattice_h = list(range(lower[0], H + upper[0], element_strides[1]))
    lattice_w = list(range(lower[1], W + upper[1], element_strides[2]))
    coord = [rng.randint(0, N - 1), rng.choice(lattice_h), rng.choice(lattice_w),
             lanes * rng.randint(0, C // lanes - 1)]
    # Mostly the offsets a convolution uses (>= 0); sometimes a negative one, which the hardware
    # reads as a huge unsigned offset.
    offsets = [rng.randint(0, 3), rng.randint(0, 3)]
    if rng.random() < 0.1:
        offsets[rng.randint(0, 1)] = -rng.randint(1, 2)
    padding = "nan" if rng.random() < 0.15 else "zero"
    return dict(dtype=dtype, shape=(N, H, W, C), block_pixels=block_pixels,
                block_channels=block_channels, pixel_box_lower_corner=lower,
                pixel_box_upper_corner=upper, element_strides=element_strides, coord=coord,
                offsets=offsets, padding=padding)


def run_differential(count=256, seed=0, verbose=True):
    rng = random.Random(seed)
    mismatches = []
    for index in range(count):
        case = random_im2col_case(rng)
        dtype, shape = case.pop("dtype"), case.pop("shape")
        x_nhwc = (torch.randn(shape) * 8).round().to(dtype).cuda()
        hardware = lesson().tma_im2col_load(x_nhwc, **case).cpu()
        model, _ = lesson().im2col_reference(x_nhwc, **case)
        same = torch.equal(torch.nan_to_num(hardware, nan=12345.0), torch.nan_to_num(model, nan=12345.0))
        if not same:
            mismatches.append((index, str(dtype), shape, case))
    if verbose:
        print(f"\ndifferential test: {count} random TMA im2col loads, {len(mismatches)} mismatches "
              f"between hardware and model")
        for mismatch in mismatches[:10]:
            print("   mismatch:", mismatch)
    return mismatches


def test_random_cases_are_valid_model_inputs():
    # On any machine: every drawn case is one the model accepts (so the GPU test compares, never raises).
    rng = random.Random(0)
    for _ in range(256):
        case = random_im2col_case(rng)
        dtype, shape = case.pop("dtype"), case.pop("shape")
        tile, sources = lesson().im2col_reference(torch.zeros(shape, dtype=dtype), **case)
        assert tile.shape == (case["block_pixels"], case["block_channels"]) and len(sources) == case["block_pixels"]


@pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
def test_hardware_matches_model_on_random_settings():
    mismatches = run_differential(count=256, verbose=False)
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"



CONV_MAPPING_CASES = [  # every combination below that has an output
    (N, H, W, Ci, R, S, stride, padding, dilation) for N, H, W, Ci in [(1, 6, 6, 8), (2, 7, 5, 12), (3, 4, 9, 4)]
    for R, S, stride, padding, dilation in [
        (3, 3, 1, 1, 1), (3, 3, 2, 0, 1), (3, 2, 3, 2, 1), (3, 3, 1, 2, 2), (1, 1, (2, 1), 0, 1),
        (2, 3, (1, 2), (0, 1), (2, 1))]
    if common.has_output((N, H, W, Ci), (1, R, S, Ci), stride, padding, dilation)]


@pytest.mark.parametrize("N, H, W, Ci, R, S, stride, padding, dilation", CONV_MAPPING_CASES)
def test_conv_mapping_rebuilds_lesson02_im2col(N, H, W, Ci, R, S, stride, padding, dilation):
    lesson().run_conv_mapping(N, H, W, Ci, R, S, stride, padding, dilation, verbose=False)


if __name__ == "__main__":
    run_differential()
