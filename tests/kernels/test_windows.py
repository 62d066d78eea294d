"""The host side of the backward's output windows (conv_tutorial.core.windows): what a window writes,
and the checks that refuse a window the forward kernel's store cannot serve."""
import pytest
import torch

from conv_tutorial.core.geometry import conv_geometry
from conv_tutorial.core.windows import OutputWindow, WindowPhases, check_output_window, window_storable


def test_output_window_write_crops_into_its_view():
    out = torch.arange(2 * 5 * 4 * 8, dtype=torch.float32).reshape(2, 5, 4, 8)
    larger = torch.full((2, 7, 6, 8), float("nan"))
    view = larger[:, 1::2, ::2][:, :3, :2]
    OutputWindow(view, crop_h=1, crop_w=2).write(out)
    assert torch.equal(larger[:, 1:7:2, 0:4:2], out[:, 1:4, 2:4])
    assert larger.isnan().sum() == larger.numel() - view.numel()


@pytest.mark.parametrize("change, error, message", [
    (dict(view="a tensor"), TypeError, "conv_tutorial.core.windows.OutputWindow of a tensor view"),
    (dict(view=torch.zeros(2, 3, 2, 8)[..., :7]), ValueError, r"needs \[2, rows, cols, 8\]"),
    (dict(view=torch.zeros(2, 3, 2, 8, dtype=torch.float16)), ValueError, "torch.float16 on cpu; the output is torch.float32 on cpu"),
    (dict(view=torch.zeros(2, 3, 4, 8)[:, :, ::2].transpose(1, 2).transpose(1, 2)[..., :8].as_strided(
        (2, 3, 2, 8), (48, 16, 9, 1))), ValueError, "16-byte aligned"),
    (dict(crop_h=3), ValueError, r"out_window crops \(3, 0\) and 3 x 2 pixels from an output of 5 x 4"),
    (dict(crop_w=-1), ValueError, "must lie inside it"),
    ("split_k", ValueError, r"takes a config without split-K \(split_k=1\), got split_k=2"),
])
def test_output_window_checks(change, error, message):
    geometry = conv_geometry((2, 5, 4, 16), (8, 1, 1, 16))          # output [2, 5, 4, 8]
    window = OutputWindow(torch.zeros(2, 7, 6, 8)[:, 1::2, ::2][:, :3, :2])
    split_k = 2 if change == "split_k" else 1
    with pytest.raises(error, match=message):
        check_output_window(window if split_k > 1 else window._replace(**change), geometry, torch.float32,
                                   torch.device("cpu"), split_k)


def test_output_window_takes_a_strided_cropped_view():
    geometry = conv_geometry((2, 5, 4, 16), (8, 1, 1, 16))          # output [2, 5, 4, 8]
    view = torch.zeros(2, 7, 6, 8)[:, 1::2, ::2][:, :3, :2]
    check_output_window(OutputWindow(view, 2, 2), geometry, torch.float32, torch.device("cpu"))


def test_output_window_refuses_channels_short_of_a_16_byte_vector():
    # 6 fp32 channels in pixels 8 apart: every pixel is 16-byte aligned, but its channels end mid-vector, and the
    # kernel stores whole 16-byte vectors of channels (WindowStore.offsets)
    geometry = conv_geometry((2, 3, 2, 16), (6, 1, 1, 16))          # output [2, 3, 2, 6]
    view = torch.zeros(2, 3, 2, 8)[..., :6]
    assert not window_storable(view) and window_storable(torch.zeros(2, 3, 2, 8))
    with pytest.raises(ValueError, match="whole number of 16-byte vectors"):
        check_output_window(OutputWindow(view), geometry, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("width, channels, tile_n, message", [
    (8, 8, None, None),                      # 4 phases of 8 columns for dX's 8 channels: accepted
    (16, 8, 8, None),                        # wider than the channels, in whole tiles: accepted
    (12, 8, 8, "whole tiles of 8 columns"),  # a tile would straddle two phases
    (4, 8, None, "a width of at least the channels"),
])
def test_output_window_with_phases(width, channels, tile_n, message):
    # the package's one launch (kernels/dgrad.py): a conv of dY [2, 5, 4, .] whose 4 * width columns are a stride-2 dgrad's phases, stored
    # into dX [2, 10, 8, channels]
    geometry = conv_geometry((2, 5, 4, 16), (4 * width, 1, 1, 16))
    phases = WindowPhases(width, channels, ((0, 1), (0, 2)), ((0, 1), (0, 2)))
    window = OutputWindow(torch.zeros(2, 10, 8, channels), phases=phases)
    check = lambda: check_output_window(window, geometry, torch.float32, torch.device("cpu"), 1, tile_n)
    if message is None:
        check()
    else:
        with pytest.raises(ValueError, match=message):
            check()
