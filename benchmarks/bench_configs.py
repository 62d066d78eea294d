"""Time chosen kernel configs on chosen network-suite layers, next to cuDNN, in alternating rounds.

    python benchmarks/bench_configs.py "RN50 7x7 2048->512 1x1" --config 128,128,64,6,8 --config ...

Layers are named by their labels in layers.py: the network suite's and the ladder's (lesson 05's
`--bench` shapes, e.g. "headline 64x64 384->384 3x3").
For a quick look at one change on a few layers before running the whole suite: each layer is
checked against torch for every config, then timed as the suite times it (do_bench, L2 flushed,
median of alternating rounds). Configs are KernelConfig fields, comma-separated."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from conv_tutorial import runtime  # noqa: E402
from layers import chosen_on_command_line  # noqa: E402
import network_suite  # noqa: E402

import torch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layers", nargs="+", help="labels of the network suite or the ladder (benchmarks/layers.py)")
    parser.add_argument("--config", action="append", required=True, help="KernelConfig fields, e.g. 128,128,64,6,8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    KernelConfig = runtime.KernelConfig
    configs = [KernelConfig(*map(int, text.split(","))) for text in args.config]
    chosen = chosen_on_command_line(args.layers)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {common.versions()}")
    for label, N, H, W, Ci, Co, R, S, stride, padding in chosen:
        x, w = common.random_conv_inputs(N, H, W, Ci, Co, R, S, torch.bfloat16)
        geometry = common.conv_geometry(x.shape, w.shape, stride, padding)
        expected = common.reference_conv2d_nhwc(x, w, None, stride, padding)
        calls = {"cuDNN": common.cudnn_conv2d(x, w, None, stride, padding)}
        for config in configs:
            call = (lambda c: lambda: runtime.conv2d(x, w, None, stride, padding, config=c))(config)
            common.assert_close_to_reference(call(), expected, dtype=torch.bfloat16, K=geometry.K)
            calls[str(config)] = call
        timed = network_suite.bench_in_rounds(calls, geometry.flops, args.rounds)
        print(f"\n{label}: {geometry.describe()}")
        for name, result in timed.items():
            print(f"   {name:<46} {result['tflops']:6.1f} TFLOPS  {result['tflops'] / timed['cuDNN']['tflops']:5.2f}x "
                  f"cuDNN   rounds " + " ".join(f"{v:.0f}" for v in result["rounds"]))


if __name__ == "__main__":
    main()
