"""Refit the operator's heuristic (conv_tutorial/selection.py) from a network-suite log, and check it leave-one-out.

`python benchmarks/network_suite.py` autotunes every layer and prints each candidate's TFLOPS.
From those timings this script fits what `selection.heuristic_config` uses on Hopper:

- HOPPER_CONFIG_TFLOPS: per config (split_k=1), the median over the layers of its TFLOPS divided
  by its useful share on that layer (`configs.useful_share`);
- SPLIT_K_WORKSPACE_BYTES_PER_S: the median bandwidth at which the split-K configs' extra time
  (over the same tile unsplit, less the fixed `selection.SPLIT_K_SECONDS`) moves their
  workspace (`configs.split_k_workspace_bytes`).

Then, for each layer, it fits both without that layer, lets the heuristic pick, and reports the
picked config's TFLOPS over the layer's fastest: a heuristic that only remembered the suite
would score 1.0 on every layer here and badly on new ones; this check sees only new ones.

    python benchmarks/fit_heuristic.py results/h100-2026-11-24-triton39/network-suite-part*.log
"""
import argparse
import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from conv_tutorial import configs, runtime, selection  # noqa: E402
from layers import network_suite  # noqa: E402

NUM_SMS = 132        # the H100 SXM the suite ran on


def parse_config(text):
    """A KernelConfig from its str(), e.g. "128x(128+32)x64 5 stages 4 warps, ping-pong, split-K 2"
    or "(128+64)x128x64 4 stages 4 warps"."""
    size = r"(?:\((\d+)\+(\d+)\)|(\d+))"
    match = re.match(size + "x" + size + r"x(\d+) (\d+) stages (\d+) warps(.*)", text.strip())
    block_m, block_n = int(match[1] or match[3]), int(match[4] or match[6])
    rest = match[10]
    split_k = re.search(r"split-K (\d+)", rest)
    return runtime.KernelConfig(
        block_m, block_n, int(match[7]), int(match[8]), int(match[9]),
        programs_per_sm=2 if "2/SM" in rest else 1, consumers=2 if "ping-pong" in rest else 1,
        block_n_tail=int(match[5] or 0), split_k=int(split_k[1]) if split_k else 1,
        block_m_tail=int(match[2] or 0))


def read_timings(log_text):
    """[(label, geometry the kernel runs, {config: TFLOPS})] for every suite layer in the log."""
    blocks = re.split(r"\n(?=(?:RN50|SD|IncV3) [^\n]*autotuning:)", log_text)
    layers = []
    for label, N, H, W, Ci, Co, R, S, stride, padding in network_suite():
        block = next((b for b in blocks if b.startswith(label + ":")), None)
        if block is None:           # a log of part of the suite
            continue
        timings = {}
        for line in block.splitlines()[1:]:
            match = re.match(r"\s+(.*? warps.*?)\s+([\d.]+) TFLOPS", line)
            if match:
                timings[parse_config(match[1])] = float(match[2])
        geometry = common.conv_geometry((N, H, W, Ci), (Co, R, S, Ci), stride, padding)
        fold = runtime.folded_geometry(geometry)
        layers.append((label, fold.geometry if fold else geometry, timings))
    return layers


def fit(layers):
    samples = {}
    for _, geometry, timings in layers:
        for config, tflops in timings.items():
            if config.split_k == 1:
                samples.setdefault(tuple(config), []).append(tflops / configs.useful_share(config, geometry, NUM_SMS))
    table = {config: round(statistics.median(values)) for config, values in samples.items()}
    bandwidths = []
    for _, geometry, timings in layers:
        for config, tflops in timings.items():
            unsplit = tuple(config._replace(split_k=1))
            if config.split_k > 1 and unsplit in table:
                compute = geometry.flops / (table[unsplit] * 1e12 * configs.useful_share(config, geometry, NUM_SMS))
                extra = geometry.flops / (tflops * 1e12) - compute - selection.SPLIT_K_SECONDS
                workspace = configs.split_k_workspace_bytes(config, geometry, NUM_SMS)
                bandwidths.append(workspace / extra if extra > 0 else math.inf)
    return table, statistics.median(bandwidths)


def heuristic_pick(table, bandwidth, geometry):
    selection.HOPPER_CONFIG_TFLOPS, selection.SPLIT_K_WORKSPACE_BYTES_PER_S = table, bandwidth
    return selection.heuristic_config(geometry, "sm_90", NUM_SMS)


def config_source(config):
    """The KernelConfig as conv_tutorial/selection.py writes it: its fields that differ from the defaults."""
    config = runtime.KernelConfig(*config)
    defaults = runtime.KernelConfig._field_defaults
    fields = [f"{name}={value}" for name, value in config._asdict().items()
              if name not in defaults or defaults[name] != value]
    return f"KernelConfig({', '.join(fields)})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", type=Path, nargs="+",
                        help="output of --bench --suite networks (autotuned), or of network_suite.py in parts")
    layers = read_timings("\n".join(log.read_text() for log in parser.parse_args().logs))
    shipped = dict(selection.HOPPER_CONFIG_TFLOPS), selection.SPLIT_K_WORKSPACE_BYTES_PER_S
    table, bandwidth = fit(layers)
    print("HOPPER_CONFIG_TFLOPS = {   # split_k left at 1: split-K's cost is modelled apart")
    for config, tflops in sorted(table.items(), key=lambda item: -item[1]):
        print(f"    {config_source(config)}: {tflops},")
    print(f"}}\nSPLIT_K_WORKSPACE_BYTES_PER_S = {bandwidth:.3g}\n")
    print("leave-one-out: the heuristic's pick, fitted without the layer, against its fastest config;")
    print("and the pick of the table conv_tutorial/selection.py holds now (not left out: it may have seen the layer)")
    scores, before = [], []
    for i, (label, geometry, timings) in enumerate(layers):
        pick = heuristic_pick(*fit(layers[:i] + layers[i + 1:]), geometry)
        scores.append(timings[pick] / max(timings.values()))
        old_pick = heuristic_pick(*shipped, geometry)
        old = timings.get(old_pick)     # None: the old table picks a config the autotuner did not time
        if old is not None:
            before.append(old / max(timings.values()))
        print(f"  {label:<30} {str(pick):<48} {scores[-1]:.3f}   now: "
              + (f"{before[-1]:.3f}" if old is not None else f"{old_pick} (not timed)"))
    print(f"geometric mean {statistics.geometric_mean(scores):.3f}, worst {min(scores):.3f}")
    if before:
        print(f"the table held now: geometric mean {statistics.geometric_mean(before):.3f}, worst "
              f"{min(before):.3f} over the {len(before)} layers whose pick was timed")


if __name__ == "__main__":
    main()
