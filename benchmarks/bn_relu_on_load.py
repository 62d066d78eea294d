"""BatchNorm's apply and ReLU on the next conv's load, timed at the tile the runtime picks for each layer.

    python benchmarks/bn_relu_on_load.py --source DIR [--out FILE] [--layers LABEL ...] [--rep MS]
    python benchmarks/bn_relu_on_load.py --dry-run        (no GPU, no DIR: the layers and the plan)

In training, a ResNet's conv reads x = relu(y * scale[c] + shift[c]): BatchNorm's apply and the ReLU
over the previous conv's output y (scale = gamma / sqrt(var + eps), shift = beta - mean * scale).
Per layer below (ResNet-50 at batch 128, bf16: the convs of 64 and 128 input channels whose input
is BatchNorm + ReLU of a conv's output), three ways from y to the conv's output, each replayed in a
CUDA graph (common.bench_tflops with cuda_graph=True: kernels alone, no host time, L2 not flushed):
  (a) cudnn+pass   torch.compile's elementwise pass y -> x (one Inductor kernel: a read and a write of
                   the activation), then F.conv2d on channels_last x (cuDNN)
  (b) ours+pass    the same pass, then the package's conv (conv_tutorial.runtime.conv2d) at the config
                   the runtime picks without timing anything (selection.known_or_heuristic_config: a
                   tuning file's choice if the machine has one, else the heuristic's, as the operator
                   does by default)
  (c) fused        lesson 05's kernel with the input transform of commit 6f08b22 (lesson 06's old
                   section 11) at the same config: the Hopper consumer loads each A tile into
                   registers, maps it, and issues WGMMA with A from registers; x is never written
and the pass and the two convs alone. Every output is checked against torch's fp32 conv of x first.

Which tiles (c) supports, from 6f08b22's `check_input_transform` (refused with a reason, and then not
timed): Hopper only (tcgen05 on sm_100 reads A from shared or tensor memory, never from registers);
fp16 or bf16; no column or row tail (the tail's second MMA reads its A from shared memory, untransformed);
one consumer warpgroup, split_k 1, one program per SM, groups 1 (that version's limits: not built). The
runtime's picks for these layers (128x256, 256x64 and 256x128, 8 warps, no tail) are all inside them.

The fused kernel is not in today's tree (it left at the commit after 6f08b22). `--source DIR` holds the
files of 6f08b22 it needs, extracted from the repository's history (the device machine has none):

    mkdir -p DIR && git archive 6f08b22 common.py 04-implicit-gemm-single-buffer.py \\
        05-warp-specialized-conv.py 06-conv-backward.py | tar -x -C DIR

This script loads DIR/common.py as the module `common` while DIR's lessons 05 and 06 import (then
puts back the modules of those names it found), and calls 6f08b22's launcher,
`conv2d_bn_relu_input_launch`. Lesson 04 has not changed in git since 6f08b22: without
DIR/04-*.py, the repository's file stands in (and the script says so). Writes --out (JSON: device,
versions, one record per layer, microseconds).
"""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402  (first: the process set-up)
import torch  # noqa: E402
from layers import by_label, resnet50_layers  # noqa: E402

FUSED_COMMIT = "6f08b22"
LESSON04 = "04-implicit-gemm-single-buffer.py"
SOURCE_FILES = ("common.py", LESSON04, "05-warp-specialized-conv.py", "06-conv-backward.py")
EXTRACT = f"mkdir -p DIR && git archive {FUSED_COMMIT} {' '.join(SOURCE_FILES)} | tar -x -C DIR"
# ResNet-50's convs of 64 and 128 input channels whose input is BatchNorm + ReLU of a conv's output (a
# bottleneck's 3x3 and its last 1x1; the stride-2 3x3 too). Not its 56x56 64->64 1x1: in the first block
# its input is the max-pool's output, in the others a residual sum's ReLU, no BatchNorm of its own.
LAYERS = ["RN50 56x56 64->64 3x3", "RN50 56x56 64->256 1x1", "RN50 56x56 128->128 3x3 s2",
          "RN50 28x28 128->128 3x3", "RN50 28x28 128->512 1x1"]
WAYS = ("pass", "cudnn", "ours", "cudnn+pass", "ours+pass", "fused")


def fused_refusal(config, arch, dtype=torch.bfloat16, groups=1):
    """Why 6f08b22's fused conv does not run `config` (a KernelConfig) on `arch`, or None where it does:
    check_input_transform's rules at that commit."""
    if arch != "sm_90":
        return f"{arch}: tcgen05 reads A from shared or tensor memory, not registers (Hopper only)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{dtype}: fp16 or bf16 only"
    if config.block_n_tail or config.block_m_tail:
        return "a tail: its second MMA reads A from shared memory, untransformed"
    for name, allowed in (("consumers", 1), ("split_k", 1), ("programs_per_sm", 1)):
        if getattr(config, name) != allowed:
            return f"{name}={getattr(config, name)}: that version runs {name}={allowed} only"
    return None if groups == 1 else f"groups={groups}: groups=1 only"


def runtime_config(layer, on_this_gpu=True):
    """The config the runtime picks for the layer without timing: on this GPU the operator's own choice
    (known_or_heuristic_config: a tuning file's, else the heuristic's); else (--dry-run) the heuristic's
    for an H100's 132 SMs."""
    from conv_tutorial import selection
    g = common.conv_geometry((layer.N, layer.H, layer.W, layer.Ci), (layer.Co, layer.R, layer.S, layer.Ci),
                             layer.stride, layer.padding)
    if on_this_gpu:
        return g, selection.known_or_heuristic_config(g, torch.bfloat16)
    return g, selection.heuristic_config(g, "sm_90", 132)


def load_fused_launcher(source):
    """6f08b22's lesson 06 as a module (its lesson 05 and common.py with it), from the folder `source`."""
    source = Path(source).resolve()
    missing = [name for name in SOURCE_FILES if name != LESSON04 and not (source / name).is_file()]
    if missing:
        raise FileNotFoundError(f"--source {source} lacks {', '.join(missing)}; extract them with\n    {EXTRACT}")
    names = ["common"] + ["lesson_" + name[:-3].replace("-", "_") for name in SOURCE_FILES[1:]]
    today = {name: sys.modules.get(name) for name in names}     # put back after: today's lessons keep theirs
    try:
        spec = importlib.util.spec_from_file_location("common", source / "common.py")
        old_common = importlib.util.module_from_spec(spec)
        sys.modules["common"] = old_common          # what `import common` in 6f08b22's lessons finds
        spec.loader.exec_module(old_common)
        if not (source / LESSON04).is_file():       # unchanged in git since 6f08b22: today's file stands in
            print(f"[note] {source} has no {LESSON04}: the repository's stands in (identical to {FUSED_COMMIT}'s "
                  f"unless the working tree changed it)")
            spec = importlib.util.spec_from_file_location("lesson_04_at_" + FUSED_COMMIT, REPO / LESSON04)
            lesson04 = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(lesson04)
            old_common._LESSONS[LESSON04[:-3]] = lesson04
        return old_common.load_lesson("06-conv-backward")
    finally:
        for name, module in today.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def batch_norm_factors(Ci, device, seed=0):
    """scale in [0.5, 1.5), shift in [0.1, 1.1): positive shifts, so a padding pixel read as relu(shift)
    instead of 0 would show in the check."""
    generator = torch.Generator().manual_seed(seed)
    scale, shift = torch.rand(Ci, generator=generator) + 0.5, torch.rand(Ci, generator=generator) + 0.1
    return scale.to(device), shift.to(device)


def layer_times(layer, old06, bn_relu, rep_ms, arch):
    """One layer's record: config, whether (c) ran and why not, microseconds per way."""
    from conv_tutorial import runtime
    g, config = runtime_config(layer)
    y, w = common.random_conv_inputs(layer.N, layer.H, layer.W, layer.Ci, layer.Co, layer.R, layer.S, torch.bfloat16)
    scale, shift = batch_norm_factors(layer.Ci, y.device)
    x = bn_relu(y, scale, shift)
    cudnn = common.cudnn_conv2d(x, w, None, layer.stride, layer.padding)
    calls = {
        "pass": lambda: bn_relu(y, scale, shift),
        "cudnn": cudnn,
        "ours": lambda: runtime.conv2d(x, w, None, layer.stride, layer.padding, config=config),
        "cudnn+pass": lambda: common.cudnn_conv2d(bn_relu(y, scale, shift), w, None, layer.stride, layer.padding)(),
        "ours+pass": lambda: runtime.conv2d(bn_relu(y, scale, shift), w, None, layer.stride, layer.padding,
                                            config=config),
    }
    from conv_tutorial import selection
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    record = {"layer": layer.label, "geometry": g.describe(), "config": str(config), "config_tuple": list(config),
              "heuristic_config": str(selection.heuristic_config(g, arch, sms)),   # differs: a tuning file's pick
              "fused_refused": fused_refusal(config, arch)}
    if record["fused_refused"] is None:
        fused_config = old06.lesson05.KernelConfig(*config)
        calls["fused"] = lambda: old06.conv2d_bn_relu_input_launch(y, w, scale, shift, layer.stride, layer.padding,
                                                                   config=fused_config)
    # every way against torch's fp32 conv of x (bf16 out: section 8's tolerance)
    expected = common.reference_conv2d_nhwc(x, w, None, layer.stride, layer.padding, out_dtype=torch.float32)
    for name in ("cudnn", "ours", "fused"):
        if name in calls:
            out = calls[name]()
            out = out.permute(0, 2, 3, 1) if name == "cudnn" else out
            try:
                common.assert_close_to_reference(out, expected.to(torch.bfloat16), dtype=torch.bfloat16, K=g.K)
            except AssertionError as error:
                record[f"{name}_error"] = str(error).splitlines()[0]
                calls.pop(name)
                calls.pop(f"{name}+pass", None)
    for name, call in calls.items():
        record[f"{name}_us"] = common.bench_tflops(call, g.flops, rep_ms=rep_ms, cuda_graph=True)["ms"] * 1e3
    if "fused_us" in record:
        record["fused_vs_ours_pass"] = record["ours+pass_us"] / record["fused_us"]     # > 1: the fusion pays
        record["fused_vs_cudnn_pass"] = record["cudnn+pass_us"] / record["fused_us"]
    print(f"   {layer.label:<28} {str(config):<28}" + "".join(
        f"  {name} {record[name + '_us']:6.1f}" for name in WAYS if name + "_us" in record)
        + (f"   (ours+pass)/fused {record['fused_vs_ours_pass']:.2f}x" if "fused_us" in record
           else f"   fused: {record['fused_refused'] or record.get('fused_error')}"), flush=True)
    return record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", help=f"folder with {FUSED_COMMIT}'s {', '.join(SOURCE_FILES)} ({EXTRACT})")
    parser.add_argument("--out", default="bn_relu_on_load.json", help="the JSON to write")
    parser.add_argument("--layers", nargs="+", default=LAYERS, metavar="LABEL", help="labels of benchmarks/layers.py")
    parser.add_argument("--rep", type=int, default=100, help="milliseconds of replays per timing")
    parser.add_argument("--dry-run", action="store_true", help="print the layers and the plan; no GPU, no --source")
    args = parser.parse_args(argv)
    if not args.dry_run and not args.source:
        parser.error(f"--source DIR is needed (or --dry-run); make DIR with: {EXTRACT}")
    args.layer_list = by_label(args.layers, resnet50_layers())
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        print(f"{len(args.layer_list)} layers, bf16; the config the runtime picks (an H100's heuristic) and "
              f"whether {FUSED_COMMIT}'s fused conv runs it:")
        for layer in args.layer_list:
            config = runtime_config(layer, on_this_gpu=False)[1]
            print(f"   {layer.label:<28} {str(config):<28} fused: {fused_refusal(config, 'sm_90') or 'yes'}")
        return None
    arch = common.tma_mma_arch_and_sms("benchmarks/bn_relu_on_load.py")[0]
    old06 = load_fused_launcher(args.source)

    @torch.compile(dynamic=False)
    def bn_relu(y, scale, shift):        # BatchNorm's apply and the ReLU: one Inductor kernel
        return torch.relu(y.float() * scale + shift).to(y.dtype)
    print(f"microseconds per call, CUDA graphs, bf16, {common.gpu_name()}:")
    rows = [layer_times(layer, old06, bn_relu, args.rep, arch) for layer in args.layer_list]
    timed = [row for row in rows if "fused_us" in row]
    summary = {"layers_timed": len(timed),
               "fused_us": sum(row["fused_us"] for row in timed),
               "ours+pass_us": sum(row["ours+pass_us"] for row in timed),
               "cudnn+pass_us": sum(row["cudnn+pass_us"] for row in timed)}
    if timed:
        print(f"   all {len(timed)}: fused {summary['fused_us']:.1f} us, ours+pass {summary['ours+pass_us']:.1f}, "
              f"cudnn+pass {summary['cudnn+pass_us']:.1f}")
    data = {**common.versions(), "fused_commit": FUSED_COMMIT, "dtype": "bfloat16", "rep_ms": args.rep,
            "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    common.quiet_teardown()
    main()
