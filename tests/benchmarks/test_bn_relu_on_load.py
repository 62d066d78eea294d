"""benchmarks/bn_relu_on_load.py on a CPU: its layers, its arguments, the dry run's plan, and its rule for
the tiles the fused conv of commit 6f08b22 runs, checked against that commit's own check."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bn_relu_on_load as bench  # noqa: E402

from conv_tutorial.configs import KernelConfig  # noqa: E402


def test_the_layers_are_resnet50s_64_and_128_channel_convs_after_a_batchnorm():
    layers = bench.parse_args(["--dry-run"]).layer_list
    assert [layer.label for layer in layers] == bench.LAYERS
    assert [(l.H, l.Ci, l.Co, l.R, l.stride, l.padding) for l in layers] == [
        (56, 64, 64, 3, 1, 1), (56, 64, 256, 1, 1, 0), (56, 128, 128, 3, 2, 1), (28, 128, 128, 3, 1, 1),
        (28, 128, 512, 1, 1, 0)]
    assert all(layer.N == 128 for layer in layers)


def test_arguments():
    with pytest.raises(SystemExit):          # a timing run needs the old sources
        bench.parse_args([])
    args = bench.parse_args(["--source", "/nowhere", "--out", "x.json", "--layers", bench.LAYERS[1], "--rep", "20"])
    assert ([layer.label for layer in args.layer_list], args.out, args.rep) == ([bench.LAYERS[1]], "x.json", 20)
    with pytest.raises(KeyError):
        bench.parse_args(["--dry-run", "--layers", "RN50 no such layer"])
    with pytest.raises(FileNotFoundError, match="git archive 6f08b22"):
        bench.load_fused_launcher("/nowhere")


def test_dry_run_prints_the_runtimes_configs(capsys):
    assert bench.main(["--dry-run"]) is None
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("   RN50")]
    assert len(lines) == len(bench.LAYERS) and all(line.endswith("fused: yes") for line in lines)
    assert "256x64x64 4 stages 8 warps" in lines[0]        # the 64-channel 3x3: a 64-wide tile, not 128 or 256


@pytest.mark.parametrize("config, refused", [
    (KernelConfig(256, 64, 64, 4, 8), None),
    (KernelConfig(128, 128, 64, 5, 4, block_n_tail=32), "a tail"),
    (KernelConfig(128, 128, 64, 4, 4, block_m_tail=64), "a tail"),
    (KernelConfig(128, 128, 64, 4, 4, consumers=2), "consumers=2"),
    (KernelConfig(128, 128, 64, 4, 4, split_k=2), "split_k=2"),
    (KernelConfig(128, 64, 64, 4, 4, programs_per_sm=2), "programs_per_sm=2"),
])
def test_fused_refusal(config, refused):
    reason = bench.fused_refusal(config, "sm_90")
    assert reason is None if refused is None else refused in reason
    assert "Hopper only" in bench.fused_refusal(config, "sm_100")


def test_the_rule_is_6f08b22s_check(tmp_path):
    # the fused launcher loads from the commit's files (as --source gives them), and its own check accepts and
    # refuses what fused_refusal says, on CPU tensors; today's modules of the same names are back afterwards
    archive = subprocess.run(["git", "-C", str(bench.REPO), "archive", bench.FUSED_COMMIT, *bench.SOURCE_FILES],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"no git history to take commit {bench.FUSED_COMMIT} from: {archive.stderr.decode()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    before = sys.modules.get("common")
    old06 = bench.load_fused_launcher(tmp_path)
    assert sys.modules.get("common") is before is common
    assert callable(old06.conv2d_bn_relu_input_launch)
    x, w = common.random_conv_inputs(1, 8, 8, 16, 32, 3, 3, torch.bfloat16, device_name="cpu")
    g = common.conv_geometry(x.shape, w.shape, 1, 1)
    configs = [KernelConfig(256, 64, 64, 4, 8), KernelConfig(128, 256, 64, 3, 8),
               KernelConfig(128, 128, 64, 5, 4, block_n_tail=32), KernelConfig(128, 128, 64, 4, 4, block_m_tail=64),
               KernelConfig(128, 128, 64, 4, 4, consumers=2), KernelConfig(128, 128, 64, 4, 4, split_k=2),
               KernelConfig(128, 64, 64, 4, 4, programs_per_sm=2)]
    for arch in ("sm_90", "sm_100"):
        for config in configs:
            try:
                old06.check_input_transform(torch.ones(16), torch.zeros(16), x, w, g,
                                            old06.lesson05.KernelConfig(*config), arch)
                accepted = True
            except ValueError:
                accepted = False
            assert accepted == (bench.fused_refusal(config, arch) is None), (arch, config)
