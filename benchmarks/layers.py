"""The benchmarks' conv layers, each written once and named by its label.

The networks' lists (ResNet-50, the SD UNet's 3x3 convs, Inception v3: the network suite; ResNet-18)
and the short lists a single benchmark times, picked by label from them, so that one label names
one shape in every script and every recorded result. The headline shape and ResNet-50's four 3x3
shapes live in common.py, where lessons 02 and 05 read them (a lesson never imports a benchmark):
they are taken from there, not copied.
"""
import functools
from typing import NamedTuple, Union

import common


class Layer(NamedTuple):
    """One conv: NHWC input N x H x W x Ci, Co filters of R x S; stride and padding an int, or an
    (h, w) pair where the two differ. A tuple, so `for label, N, ... in layers` and `f(*layer)` work."""
    label: str
    N: int
    H: int
    W: int
    Ci: int
    Co: int
    R: int
    S: int
    stride: Union[int, tuple]
    padding: Union[int, tuple]


def by_label(labels, layers):
    """The layers of `layers` named `labels`, in the order of `labels`; KeyError([the missing labels])."""
    named = {layer.label: layer for layer in layers}
    missing = [label for label in labels if label not in named]
    if missing:
        raise KeyError(missing)
    return [named[label] for label in labels]


# %% The networks -------------------------------------------------------------------------------------

BATCH_RESNET, BATCH_UNET, BATCH_INCEPTION, BATCH_RESNET18 = 128, 8, 128, 256


def resnet50_layers(batch=BATCH_RESNET):
    """Every distinct conv of ResNet-50 (torchvision's v1.5: the stride on the 3x3 conv), 224x224
    input, in the order the forward pass meets them: the stem, the 1x1s and the downsamples included."""
    layers = [Layer("RN50 stem 224 3->64 7x7 s2", batch, 224, 224, 3, 64, 7, 7, 2, 3)]
    size, channels = 56, 64                     # after the stem and the 3x3/2 max-pool
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            out = size // stride

            def conv(hw, ci, co, k, s):
                label = f"RN50 {hw}x{hw} {ci}->{co} {k}x{k}" + (f" s{s}" if s > 1 else "")
                return Layer(label, batch, hw, hw, ci, co, k, k, s, k // 2)
            layers += [conv(size, channels, width, 1, 1), conv(size, width, width, 3, stride),
                       conv(out, width, 4 * width, 1, 1)]
            if block == 0:
                layers.append(conv(size, channels, 4 * width, 1, stride))      # the downsample
            channels, size = 4 * width, out
    distinct = {}
    for layer in layers:
        distinct.setdefault(layer[1:], layer)
    return list(distinct.values())


def unet_3x3_layers(batch=BATCH_UNET):
    """The distinct 3x3 convs of the SD v1 UNet's resnet blocks and resamplers (64x64 latents)."""
    shapes = [  # (size, Ci, Co, stride)
        (64, 320, 320, 1), (64, 320, 320, 2), (64, 640, 320, 1), (64, 960, 320, 1), (64, 640, 640, 1),
        (32, 320, 640, 1), (32, 640, 640, 1), (32, 640, 640, 2), (32, 960, 640, 1), (32, 1280, 640, 1),
        (32, 1280, 1280, 1),
        (16, 640, 1280, 1), (16, 1280, 1280, 1), (16, 1280, 1280, 2), (16, 1920, 1280, 1),
        (16, 2560, 1280, 1),
        (8, 1280, 1280, 1), (8, 2560, 1280, 1),
    ]
    return [Layer(f"SD {hw}x{hw} {ci}->{co} 3x3" + (" s2" if s > 1 else ""), batch, hw, hw, ci, co, 3, 3, s, 1)
            for hw, ci, co, s in shapes]


def torchvision_dense_convs(model_name, prefix, batch, image_size, **model_options):
    """Every distinct dense (groups = 1) conv of a torchvision model, in the order its forward pass
    meets them: found by running the model on the meta device (shapes only, no memory, no
    arithmetic) with a hook on each nn.Conv2d. The label names the padding where it is not the
    filter's "same" padding (Inception's 3x3 valid convs: "p0")."""
    import torch
    import torchvision
    model = getattr(torchvision.models, model_name)(weights=None, **model_options).to("meta").eval()
    layers = {}

    def record(conv, inputs, output):
        if conv.groups != 1:
            return
        _, Ci, H, W = inputs[0].shape
        (R, S), stride, padding = conv.kernel_size, conv.stride, conv.padding
        key = (batch, H, W, Ci, conv.out_channels, R, S, stride, padding)
        filt = f"{R}x{S}" + (f" s{stride[0]}" if stride == (stride[0],) * 2 and stride[0] > 1 else
                             f" s{stride[0]}x{stride[1]}" if stride != (1, 1) else "")
        same = (R // 2, S // 2)
        label = f"{prefix} {H}x{W} {Ci}->{conv.out_channels} {filt}" + ("" if padding == same else
                                                                        f" p{padding[0]}" if padding[0] == padding[1]
                                                                        else f" p{padding[0]}x{padding[1]}")
        flat = lambda pair: pair[0] if pair[0] == pair[1] else pair  # noqa: E731
        layers.setdefault(key, Layer(label, batch, H, W, Ci, conv.out_channels, R, S, flat(stride), flat(padding)))

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(torch.empty(1, 3, image_size, image_size, device="meta"))
    for hook in hooks:
        hook.remove()
    labels = [layer.label for layer in layers.values()]
    assert len(set(labels)) == len(labels), "two distinct convs share a label"
    return list(layers.values())


def inception_v3_layers(batch=BATCH_INCEPTION):
    """The distinct convs of torchvision's Inception v3 (299x299 input), all dense: widths of 48, 80,
    96, 160 and 288 channels (not multiples of 64), 1x7 / 7x1 / 1x3 / 3x1 filters, 3x3 stride-2
    and unpadded ("valid") convs."""
    return torchvision_dense_convs("inception_v3", "IncV3", batch, 299, aux_logits=False, init_weights=False)


def resnet18_layers(batch=BATCH_RESNET18):
    """The distinct convs of torchvision's ResNet-18 (224x224 input)."""
    return torchvision_dense_convs("resnet18", "RN18", batch, 224)


@functools.lru_cache(maxsize=None)
def network_suite():
    """Every layer of the network suite: ResNet-50, the SD UNet's 3x3 convs, Inception v3."""
    return resnet50_layers() + unet_3x3_layers() + inception_v3_layers()


QUICK_LABELS = ("RN50 stem 224 3->64 7x7 s2", "RN50 14x14 256->256 3x3", "RN50 7x7 2048->512 1x1",
                "SD 8x8 1280->1280 3x3", "IncV3 73x73 80->192 3x3 p0", "IncV3 17x17 160->160 1x7")


def quick_suite():
    """The network suite's --quick layers, in the suite's order."""
    return [layer for layer in network_suite() if layer.label in QUICK_LABELS]


# %% Lesson 05's benchmark shapes (common.py's) and the ladder ---------------------------------------

HEADLINE = Layer(*common.HEADLINE_SHAPE)
RESNET50_3X3 = [Layer(*shape) for shape in common.RESNET50_3X3_SHAPES]
_NETWORKS = resnet50_layers() + unet_3x3_layers()          # the suite's lists that need no torchvision

# The ladder: lesson 05's shapes and four of the suite's (the UNet's under the ladder's own label).
LADDER = [HEADLINE, *RESNET50_3X3,
          *by_label(["RN50 56x56 128->128 3x3 s2", "RN50 56x56 256->64 1x1", "RN50 14x14 1024->256 1x1"], _NETWORKS),
          by_label(["SD 64x64 320->320 3x3"], _NETWORKS)[0]._replace(label="SD UNet 64x64 320->320 3x3")]


def chosen_on_command_line(labels):
    """The layers of the network suite and the ladder named `labels`, a script's arguments
    (bench_configs.py, clocks_under_load.py); exits naming the unknown labels and the known ones."""
    known = network_suite() + LADDER
    try:
        return by_label(labels, known)
    except KeyError as error:
        raise SystemExit(f"unknown layers {error.args[0]}; known: {sorted({layer.label for layer in known})}") from None


# %% The short lists of single benchmarks -----------------------------------------------------------

# host_time.py: two 3x3s of ResNet-50's and the UNet's largest and smallest 3x3.
HOST_TIME = by_label(["RN50 14x14 256->256 3x3", "RN50 7x7 512->512 3x3", "SD 64x64 320->320 3x3",
                      "SD 8x8 1280->1280 3x3"], _NETWORKS)

# ncu_layers.py: a 3x3 where ours leads, a 1x1 where it trails, a layer with fewer tiles than SMs;
# with --cold-l2 the two 1x1s furthest behind cuDNN.
NCU = by_label(["SD 64x64 320->320 3x3", "RN50 14x14 1024->256 1x1", "SD 16x16 1280->1280 3x3"], _NETWORKS)
NCU_COLD_L2 = by_label(["RN50 7x7 2048->512 1x1", "RN50 14x14 1024->512 1x1"], _NETWORKS)

# tuner_vs_heuristic.py: the layers on which an earlier tuner lost, and two of ResNet-50's.
TUNER_VS_HEURISTIC = [HEADLINE,
                      Layer("33x47 67->100 3x3", 64, 33, 47, 67, 100, 3, 3, 1, 1),
                      Layer("stem 224 3->64 4x4 s4", 32, 224, 224, 3, 64, 4, 4, 4, 0),
                      *by_label(["RN50 7x7 512->512 3x3", "RN50 56x56 256->64 1x1"], LADDER)]

# backward_layers.py --quick: three layers, a 3x3, a 3x3 at stride 2 (dgrad's phases) and a 1x1 (wgrad's x read tiled).
BACKWARD_QUICK = by_label(["RN50 14x14 256->256 3x3", "RN50 56x56 128->128 3x3 s2", "RN50 56x56 64->256 1x1"],
                          _NETWORKS)

# resnet50.py --first-call-latency: the layer whose first call is timed in fresh processes.
FIRST_CALL = by_label(["RN50 14x14 1024->256 1x1"], _NETWORKS)[0]
