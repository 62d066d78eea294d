"""The fp8 pass on whole torchvision networks: how far each e4m3 model's logits are from the fp32 model's.

    python benchmarks/fp8_nets.py [--nets resnet50 resnet101 resnet152 wide_resnet50_2] [--batch 64]

Each network is torchvision's with seeded random weights and trained-like BatchNorm statistics
(torchvision_nets.trained_like_batchnorm), eval mode, 224x224 random images. The fp32 model run
with TF32 off is the reference; beside it the fused bf16 model (fuse_conv_bn_act, channels_last)
and its e4m3 version (quantize_fp8, calibrated on four other batches). For each: the logits' max
|error| / max |reference| over the batch, and for fp8 the convs kept in bf16 (and why: the stem, the
pass's layer check) and the residual-chain boundaries. With random weights the logits are near
ties, so top-1 agreement says little; the relative error is the measure. Runs eagerly (no
torch.compile): the same kernels, fewer minutes. Writes fp8_nets.json.
"""
import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import conv_tutorial  # noqa: E402
import torchvision_nets  # noqa: E402

import torch  # noqa: E402


def relative_error(logits, reference):
    return ((logits.float() - reference).abs().max() / reference.abs().max()).item()


def measure(net, batch):
    fp32 = torchvision_nets.fp32_model(net)
    x32 = torchvision_nets.images(batch)
    reference = torchvision_nets.fp32_reference(fp32, x32)
    bf16 = dict(dtype=torch.bfloat16, memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = conv_tutorial.fuse_conv_bn_act(fp32, example_input=x32[:1]).to(**bf16)
    calibration = [torchvision_nets.images(batch, seed=10 + i).to(**bf16) for i in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp8_model = conv_tutorial.quantize_fp8(fused, calibration)
    x = x32.to(**bf16)
    with torch.no_grad():
        bf16_error = relative_error(fused(x), reference)
        fp8_error = relative_error(fp8_model(x), reference)
    row = {"net": net, "batch": batch, "bf16_logits_max_rel_err": bf16_error, "fp8_logits_max_rel_err": fp8_error,
           "fp8_convs": fp8_model.fp8_convs, "bf16_convs": fp8_model.bf16_convs,
           "kept_bf16": list(getattr(fp8_model, "kept_bf16", [])),
           "calibration_output_error": getattr(fp8_model, "output_error", None),
           "warnings": [str(w.message)[:300] for w in caught]}
    print(f"  {net:<18} batch {batch}: logits max rel. error, bf16 {bf16_error:.3f}, fp8 {fp8_error:.3f}; "
          f"{row['fp8_convs']} convs in e4m3, {row['bf16_convs']} in bf16 (kept by the layer check: "
          f"{len(row['kept_bf16'])})")
    del fp32, fused, fp8_model
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=["resnet50", "resnet101", "resnet152", "wide_resnet50_2"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--outdir", default=None)
    args = parser.parse_args()
    common.require_tma_mma_gpu("benchmarks/fp8_nets.py")
    outdir = common.output_dir(args.outdir)
    print(f"fp8 pass on whole networks, {common.gpu_name()}:")
    rows = [measure(net, args.batch) for net in args.nets]
    common.save_json(outdir, "fp8_nets", {**common.versions(), "rows": rows})


if __name__ == "__main__":
    main()
