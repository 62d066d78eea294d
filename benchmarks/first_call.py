"""Where a fused model's first call spends its time, step by step, with cold and with warm caches.

    python benchmarks/first_call.py [--nets resnet50 mobilenet_v3_large] [--batch 128] [--variants ours]

For each network (torchvision's, random weights, trained-like BatchNorms, bf16, channels_last), in
fresh processes, one after the other (nothing else compiling beside them):
  ours:  fuse_conv_bn_act (the fx pass, from the fp32 model), keep_faster_convs (times each fused
         conv against cuDNN at this batch: Triton compiles each distinct kernel here), then
         torch.compile(mode="reduce-overhead") with Inductor freezing and its first forward;
  cudnn: the same torch.compile of the plain bf16 model and its first forward.
"cold": empty Triton and Inductor caches and no tuning file; "warm": a second process with the
caches the cold one left (keep_faster_convs' decisions among them, in the tuning file). Each
step's seconds; writes first_call.json.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def child(net, variant, batch):
    import torch
    import torch._inductor.config
    torch._inductor.config.freezing = True
    import torchvision_nets
    from conv_tutorial import fusion
    steps, fp32 = {}, torchvision_nets.fp32_model(net)
    x32 = torchvision_nets.images(batch)
    bf16 = dict(dtype=torch.bfloat16, memory_format=torch.channels_last)
    x = x32.to(**bf16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if variant == "ours":
            start = time.perf_counter()
            model = fusion.fuse_conv_bn_act(fp32, example_input=x32[:1]).to(**bf16)
            steps["fuse_conv_bn_act"] = time.perf_counter() - start
            start = time.perf_counter()
            model = fusion.keep_faster_convs(model, x)
            torch.cuda.synchronize()
            steps["keep_faster_convs"] = time.perf_counter() - start
            parts = {f"keep_faster_convs: {k}": v for k, v in model.keep_faster_convs_seconds.items()}
            print("PARTS " + json.dumps(parts) + f" torch_convs {model.torch_convs}")
        else:
            model = fp32.to(**bf16)
        start = time.perf_counter()
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
        with torch.no_grad():
            compiled(x)
        torch.cuda.synchronize()
        steps["torch.compile + first forward"] = time.perf_counter() - start
    print("STEPS " + json.dumps(steps))


def compare_timers(nets, batch):
    """keep_faster_convs' decisions and seconds with its timer (fusion._graph_replay_ms) and with
    triton.testing.do_bench_cudagraph(rep=20), on the same fused model, kernels compiled first."""
    import copy
    import torch
    import triton
    import torchvision_nets
    from conv_tutorial import fusion
    rows = []
    for net in nets:
        fp32, x32 = torchvision_nets.fp32_model(net), torchvision_nets.images(batch)
        bf16 = dict(dtype=torch.bfloat16, memory_format=torch.channels_last)
        x = x32.to(**bf16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fused = fusion.fuse_conv_bn_act(fp32, example_input=x32[:1]).to(**bf16)
            with torch.no_grad():
                fused(x)                                  # every kernel compiled before timing
            timers = {"graph replay (ours)": fusion._graph_replay_ms,
                      "do_bench_cudagraph(rep=20)": lambda fn: triton.testing.do_bench_cudagraph(fn, rep=20)}
            given_back = {}
            for name, timer in timers.items():
                model = copy.deepcopy(fused)
                start = time.perf_counter()
                fusion.keep_faster_convs(model, x, timer=timer, remember=False)
                seconds = time.perf_counter() - start
                given_back[name] = {n for n, m in model.named_modules() if isinstance(m, fusion.TorchConvEpilogue)}
                rows.append({"net": net, "batch": batch, "timer": name, "seconds": seconds,
                             "torch_convs": model.torch_convs})
                print(f"  {net:<20} {name:<28} {seconds:5.1f} s, {model.torch_convs} convs given back to torch", flush=True)
        ours, theirs = given_back.values()
        print(f"  {net}: the two timers disagree on {len(ours ^ theirs)} layers: {sorted(ours ^ theirs)}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=["resnet50", "mobilenet_v3_large"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=["cudnn", "ours"], choices=["cudnn", "ours"])
    parser.add_argument("--outdir", default=None)
    parser.add_argument("--compare-timers", action="store_true",
                        help="compare keep_faster_convs' timer with do_bench_cudagraph (decisions, seconds)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]))
    import common
    common.require_tma_mma_gpu("benchmarks/first_call.py")
    if args.compare_timers:
        rows = compare_timers(args.nets, args.batch)
        return common.save_json(common.output_dir(args.outdir), "first_call_timers", {**common.versions(), "rows": rows})
    rows = []
    for net in args.nets:
        for variant in args.variants:
            with tempfile.TemporaryDirectory() as caches:
                env = dict(os.environ, TRITON_CACHE_DIR=f"{caches}/triton", TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor",
                           CONV_TUTORIAL_TUNING_CACHE=f"{caches}/tuning.json")
                for state in ("cold", "warm"):
                    start = time.perf_counter()
                    proc = subprocess.run([sys.executable, __file__, "--child", net, variant, str(args.batch)],
                                          env=env, capture_output=True, text=True, timeout=900)
                    total = time.perf_counter() - start
                    line = next((l for l in proc.stdout.splitlines() if l.startswith("STEPS ")), None)
                    if line is None:
                        raise RuntimeError(f"{net} {variant} {state} failed:\n{proc.stderr[-3000:]}")
                    steps = json.loads(line[6:])
                    parts = next((l for l in proc.stdout.splitlines() if l.startswith("PARTS ")), "")
                    row = {"net": net, "batch": args.batch, "variant": variant, "caches": state,
                           "steps_s": steps, "first_call_s": sum(steps.values()), "process_s": total}
                    if parts:
                        row["keep_faster_convs_parts_s"] = json.loads(parts[6:].rsplit(" torch_convs ", 1)[0])
                        row["torch_convs"] = int(parts.rsplit(" ", 1)[1])
                    rows.append(row)
                    print(f"  {net:<20} {variant:<6} {state}: " + ", ".join(f"{k} {v:.1f} s" for k, v in steps.items())
                          + f"; together {sum(steps.values()):.1f} s (process {total:.0f} s) {parts[6:]}", flush=True)
    common.save_json(common.output_dir(args.outdir), "first_call", {**common.versions(), "rows": rows})


if __name__ == "__main__":
    main()
