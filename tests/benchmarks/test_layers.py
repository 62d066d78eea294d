"""benchmarks/layers.py: one label names one shape in every list, and the lists hold the layers the
benchmarks and lessons describe (no GPU needed)."""
import sys
from pathlib import Path

import common
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import layers  # noqa: E402

SHORT_LISTS = ("LADDER", "HOST_TIME", "NCU", "NCU_COLD_L2", "TUNER_VS_HEURISTIC", "BACKWARD_QUICK")


def every_list():
    return {"network_suite": layers.network_suite(), "resnet18": layers.resnet18_layers(),
            "first call": [layers.FIRST_CALL], **{name: getattr(layers, name) for name in SHORT_LISTS}}


def test_a_label_names_one_shape_everywhere():
    shapes = {}
    for name, named in every_list().items():
        assert all(isinstance(layer, layers.Layer) for layer in named), name
        assert len({layer.label for layer in named}) == len(named), f"{name}: a label twice"
        for layer in named:
            assert shapes.setdefault(layer.label, layer) == layer, f"{layer.label}: two shapes"


def test_the_networks_have_their_distinct_convs():
    # ResNet-50: the stem, 3 convs per bottleneck (16 blocks) and 4 downsamples, 23 distinct; the UNet's 18 3x3s;
    # Inception v3's 43; every label a distinct shape
    counts = [len(layers.resnet50_layers()), len(layers.unet_3x3_layers()), len(layers.inception_v3_layers())]
    assert counts == [23, 18, 43] and len(layers.network_suite()) == sum(counts)
    assert len({layer[1:] for layer in layers.network_suite()}) == sum(counts)
    assert [layer.label for layer in layers.quick_suite()] == list(layers.QUICK_LABELS)


def test_lesson_shapes_come_from_common_and_are_resnet50s_own():
    assert layers.HEADLINE == common.HEADLINE_SHAPE and layers.LADDER[0] is layers.HEADLINE
    assert layers.RESNET50_3X3 == common.RESNET50_3X3_SHAPES
    assert layers.RESNET50_3X3 == layers.by_label([s[0] for s in common.RESNET50_3X3_SHAPES], layers.resnet50_layers())
    # the ladder names the UNet's 64x64 3x3 its own way: the same shape
    assert layers.LADDER[-1][1:] == layers.by_label(["SD 64x64 320->320 3x3"], layers.unet_3x3_layers())[0][1:]


def test_by_label_names_what_it_cannot_find():
    with pytest.raises(KeyError, match="RN50 1x1x1"):
        layers.by_label(["RN50 stem 224 3->64 7x7 s2", "RN50 1x1x1"], layers.resnet50_layers())


def test_backward_quick_is_three_of_resnet50s_layers():
    # backward_layers.py --quick: a stride-1 3x3, a stride-2 3x3 and a 1x1 layer of ResNet-50 at batch 128, as the
    # full run (every distinct conv of ResNet-50) names them; no lesson keeps a copy of the list
    assert [layer.label for layer in layers.BACKWARD_QUICK] == [
        "RN50 14x14 256->256 3x3", "RN50 56x56 128->128 3x3 s2", "RN50 56x56 64->256 1x1"]
    assert layers.BACKWARD_QUICK == layers.by_label([layer.label for layer in layers.BACKWARD_QUICK],
                                                    layers.resnet50_layers())


def test_scripts_take_the_suites_and_the_ladders_labels():
    chosen = layers.chosen_on_command_line(["headline 64x64 384->384 3x3", "IncV3 17x17 160->160 1x7"])
    assert [layer.label for layer in chosen] == ["headline 64x64 384->384 3x3", "IncV3 17x17 160->160 1x7"]
    with pytest.raises(SystemExit, match=r"unknown layers \['RN50 1x1x1'\]; known: .*SD UNet 64x64 320->320 3x3"):
        layers.chosen_on_command_line(["RN50 1x1x1"])
